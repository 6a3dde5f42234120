"""Passes reach disk soon after the model goes idle (segment_idle_seconds), and `fastdump ls` shows
the ended passes the writer still holds in its open segment."""

import json
import time

import pytest
import torch
from torch import nn

import fastdump
from fastdump import cli
from fastdump.config import ConfigError, settings_from_env
from fastdump.writer.channel_writer import ChannelWriter
from test_channel_writer import Feeder, open_msg


def wait_for(predicate, timeout=30.0):
    """Poll until predicate() is truthy (generous timeout: the machine may be loaded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    return predicate()


def rank_json(writer):
    return json.loads((writer.dir_path / "rank.json").read_text())


def make_writer(tmp_path, **config):
    writer = ChannelWriter(open_msg(tmp_path, **config))
    writer.dir_path = tmp_path / "target" / "TP0_PP0_Rank0_pid4242"
    return writer


def segments(writer):
    return sorted(p.name for p in writer.dir_path.glob("seg-*.h5"))


def test_idle_writes_ended_passes_after_the_delay(tmp_path):
    writer = make_writer(tmp_path, segment_idle_seconds=1.0)
    feed = Feeder(writer)
    feed.full_pass(0, {"x": torch.arange(4.0)})
    feed.full_pass(1, {"x": torch.arange(4.0) + 1})
    ended = writer._pending.last_end
    writer.idle(ended + 0.5)
    assert segments(writer) == []  # not idle long enough
    writer.idle(ended + 1.0)
    assert len(segments(writer)) == 1
    ds = fastdump.open(tmp_path)
    assert ds.passes("target", "TP0_PP0_Rank0_pid4242") == [0, 1]
    assert torch.equal(ds.load("target", "TP0_PP0_Rank0_pid4242", 1)["x"], torch.arange(4.0) + 1)
    writer.close()


def test_a_wall_clock_set_back_does_not_hold_passes_off_the_disk(tmp_path, monkeypatch):
    """Idle and age rotation measured the wall clock: set back an hour (NTP, an operator) after a
    pass ended, `now - last_end` stayed negative, and the ended passes stayed in the writer's
    memory, not on disk, for that hour (segment_seconds likewise). They use time.monotonic()."""
    from fastdump.writer import channel_writer

    writer = make_writer(tmp_path, segment_idle_seconds=0.2, segment_seconds=0.2, segment_passes=100)
    feed = Feeder(writer)
    feed.full_pass(0, {"x": torch.arange(4.0)})
    real = time.time
    monkeypatch.setattr(channel_writer.time, "time", lambda: real() - 3600)  # the clock is set back
    time.sleep(0.3)
    writer.idle()
    assert len(segments(writer)) == 1  # on disk a segment_idle_seconds after the pass ended
    writer.on_begin(1, {})
    feed.tensor(1, "x", torch.ones(4))
    time.sleep(0.9)  # (a pass still open: written at 4 segment_seconds, split)
    writer.poll()
    assert len(segments(writer)) == 2
    monkeypatch.setattr(channel_writer.time, "time", real)
    writer.on_end(1, {}, 0, [])
    writer.close()
    ds = fastdump.open(tmp_path)
    assert torch.equal(ds.load("target", "TP0_PP0_Rank0_pid4242", 1)["x"], torch.ones(4))


def test_idle_never_splits_an_open_pass(tmp_path):
    writer = make_writer(tmp_path, segment_idle_seconds=1.0)
    feed = Feeder(writer)
    feed.full_pass(0, {"x": torch.ones(2)})
    writer.on_begin(1, {})
    feed.tensor(1, "x", torch.zeros(2))  # pass 1 still running
    writer.idle(writer._pending.last_end + 100)
    assert segments(writer) == []
    writer.close()
    ds = fastdump.open(tmp_path)
    assert ds.passes("target", "TP0_PP0_Rank0_pid4242") == [0, 1]


def test_idle_rotation_disabled_by_zero(tmp_path):
    writer = make_writer(tmp_path, segment_idle_seconds=0)
    Feeder(writer).full_pass(0, {"x": torch.ones(2)})
    writer.idle(writer._pending.last_end + 100)
    assert segments(writer) == []
    writer.close()


def test_poll_publishes_pending_passes(tmp_path):
    writer = make_writer(tmp_path, segment_idle_seconds=0)
    feed = Feeder(writer)
    assert rank_json(writer)["pending_passes"] == 0
    feed.full_pass(0, {"x": torch.ones(2)})
    feed.full_pass(1, {"x": torch.ones(2)})
    writer.on_begin(2, {})  # a running pass is not counted
    writer.poll()
    assert rank_json(writer)["pending_passes"] == 2
    writer.close()
    assert rank_json(writer)["pending_passes"] == 0 and rank_json(writer)["passes"] == 3


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    @torch.no_grad()
    def forward(self, x):
        return self.b(self.a(x))


@pytest.mark.parametrize("writer_kind", ["thread", "process"])
def test_passes_visible_while_serving(tmp_path, writer_kind, capsys):
    """Five passes, then the model idles: without closing, the passes are on disk within a few
    seconds (the old behaviour: only after 64 passes or 30 s)."""
    model = Tiny()
    d = fastdump.attach(model, tmp_path, writer=writer_kind, segment_idle_seconds=0.5,
                        segment_seconds=300)  # age rotation far beyond the wait below
    try:
        outs = [model(torch.full((1, 4), float(i))) for i in range(5)]
        ds = fastdump.open(tmp_path)

        def visible():
            ds.refresh()
            ranks = ds.ranks("target")
            return ranks and len(ds.passes("target", ranks[0])) == 5

        assert wait_for(visible), "passes not on disk while the dumper is open"
        rank = ds.ranks("target")[0]
        for i, out in enumerate(outs):
            assert torch.equal(ds.load("target", rank, i)["b"], out)
    finally:
        d.close()
    assert fastdump.open(tmp_path).passes("target", rank) == [0, 1, 2, 3, 4]


def test_ls_shows_open_segment_passes(tmp_path, capsys):
    model = Tiny()
    d = fastdump.attach(model, tmp_path, writer="thread", segment_idle_seconds=0)  # never rotated by idleness
    try:
        for i in range(3):
            model(torch.ones(1, 4))
        rank_file = d.dir / "rank.json"
        assert wait_for(lambda: json.loads(rank_file.read_text()).get("pending_passes") == 3)
        capsys.readouterr()
        assert cli.main(["ls", str(tmp_path)]) == 0
        out = capsys.readouterr().out
        assert "+3 pass(es) in the open segment" in out
    finally:
        d.close()
    capsys.readouterr()
    cli.main(["ls", str(tmp_path)])
    assert "open segment" not in capsys.readouterr().out


def test_segment_idle_seconds_is_validated(tmp_path):
    with pytest.raises(ValueError, match="segment_idle_seconds"):
        fastdump.attach(Tiny(), tmp_path, writer="thread", segment_idle_seconds=-1)
    with pytest.raises(ConfigError, match="FASTDUMP_SEGMENT_IDLE_SECONDS"):
        settings_from_env({"FASTDUMP_DIR": str(tmp_path), "FASTDUMP_SEGMENT_IDLE_SECONDS": "-1"})
    assert settings_from_env({"FASTDUMP_DIR": str(tmp_path),
                              "FASTDUMP_SEGMENT_IDLE_SECONDS": "0"})["segment_idle_seconds"] == 0


def test_a_pass_end_received_twice_does_not_let_idle_split_the_next_open_pass(tmp_path):
    """A pass's end handled twice counts it ended once: with pass 1 open, idle writes nothing (it
    would split pass 1 across segments); once pass 1 ends, both passes land whole. (A mutant that
    counted every end as closing an open pass wrote the open pass 1 unfinished.)"""
    writer = make_writer(tmp_path, segment_idle_seconds=0.2)
    feed = Feeder(writer)
    feed.full_pass(0, {"x": torch.arange(4.0)})
    writer.on_end(0, {}, 0, [])  # the same end again
    writer.on_begin(1, {})
    feed.tensor(1, "x", torch.arange(4.0) + 1)
    writer.idle(writer._pending.last_end + 10.0)
    assert segments(writer) == []  # pass 1 is open
    writer.on_end(1, {}, 0, [])
    writer.idle(writer._pending.last_end + 10.0)
    assert len(segments(writer)) == 1
    ds = fastdump.open(tmp_path)
    rank = "TP0_PP0_Rank0_pid4242"
    assert ds.passes("target", rank) == [0, 1]
    assert torch.equal(ds.load("target", rank, 1)["x"], torch.arange(4.0) + 1)
    assert all(ds.meta("target", rank, p)["complete"] for p in (0, 1))
    writer.close()
