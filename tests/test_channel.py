"""staging/channel.py: the Dumper's one staging object (dispatch decided once, drops counted once)."""

import json

import torch

import fastdump
from fastdump.staging.channel import UNSUPPORTED_DEVICE, Channel


def test_the_dumper_stages_through_one_channel_and_the_hot_path_is_the_cpp_call(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    d = fastdump.attach(model, tmp_path)
    try:
        assert isinstance(d._channel, Channel)
        # The common case stays one C++ call: the Dumper holds the ChannelStager's own method.
        assert d._stage_fast.__self__ is d._channel.lane
        assert d._stage_fast.__name__ == "stage_tensor"
        with torch.inference_mode():
            x = torch.arange(8, dtype=torch.float32).reshape(2, 4)
            want = model(x)
            model(x)
    finally:
        stats = d.close()
    assert stats["status"] == "closed" and stats["tensors"] == 4 and stats["dropped"] == 0
    ds = fastdump.open(tmp_path)
    assert torch.equal(ds.load("target", 0, 1)["0"], want)


def test_unsupported_device_is_reported_by_the_channel_not_staged(tmp_path):
    d = fastdump.attach(None, tmp_path)
    try:
        d.begin_pass()
        assert d._channel.stage(0, d.pass_id, torch.empty(3, device="meta"), 0, 4) == UNSUPPORTED_DEVICE
        d.dump("m", torch.empty(3, device="meta"))
        d.dump("ok", torch.ones(3))
        d.end_pass()
    finally:
        stats = d.close()
    assert stats["tensors"] == 1 and stats["skipped"] == 1 and stats["dropped"] == 0
    info = fastdump.open(tmp_path).rank_info("target", 0)
    assert any("meta" in reason for reason in info["skipped_reasons"]), info["skipped_reasons"]


def test_drops_are_counted_once_by_the_channel(tmp_path):
    """Under `drop`, a name message that finds the ring full drops its tensor: counted once in the
    channel, in the pass's end message, in stats() and in rank.json."""
    d = fastdump.attach(None, tmp_path, policy="drop")
    channel = d._channel
    send = channel.control

    def name_ring_full(msg, **kw):
        if msg.get("op") == "name" and msg.get("name") == "lost":
            return 0  # as a full ring answers under `drop`
        return send(msg, **kw)

    channel.control = name_ring_full
    try:
        d.begin_pass()
        d.dump("kept", torch.full((5,), 3.0))
        d.dump("lost", torch.ones(5))
        assert channel.pass_dropped == 1 and channel.dropped == 1
        d.end_pass()
        d.begin_pass()  # a new pass starts with no drops of its own
        assert channel.pass_dropped == 0
        d.dump("kept", torch.full((5,), 4.0))
        d.end_pass()
        assert d.stats()["dropped"] == 1
        assert d.stats()["dropped"] == 1  # folding twice does not count twice
    finally:
        channel.control = send
        stats = d.close()
    assert stats["status"] == "closed" and stats["dropped"] == 1 and stats["tensors"] == 2
    info = json.loads((d.dir / "rank.json").read_text())
    assert info["dropped"] == 1
    ds = fastdump.open(tmp_path)
    assert torch.equal(ds.load("target", 0, 0)["kept"], torch.full((5,), 3.0))
    assert "lost" not in ds.load("target", 0, 0)
