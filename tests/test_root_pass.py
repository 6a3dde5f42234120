"""The root forward's pass begun and ended in C (``CaptureState.root_pass``, csrc/forward_wrapper.cpp).

It takes a pass only when it is plain (no metadata, skips, budget, pass selection, stall, graph
capture, nesting or thread mixing) and its begin or end record goes into the ring at once; anything
else runs Dumper._root_begin / _end as before. These tests check both sides of that line: what the
C path dumps is what the Python path dumps, bit for bit, with the same pass table, and each case
that is not plain is seen and handed to Python."""

import collections
import threading

import pytest
import torch
from torch import nn

import fastdump
from fastdump.capture import dumper as dumper_mod
from fastdump.cli.dump import verify_dump


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.act, self.down = nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)
        self.fail_with = None
        self.recurse = False

    def forward(self, x):
        if self.recurse:  # the root called inside its own forward: a nested begin, in the same pass
            self.recurse = False
            self(x)
        h = self.act(self.up(x))
        if self.fail_with is not None:
            raise self.fail_with
        return self.down(h)


def expected(model, x) -> dict:
    with torch.no_grad():
        up = model.up(x)
        act = model.act(up)
        down = model.down(act)
    return {"up": up, "act": act, "down": down, "Net": down}


def bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


@pytest.fixture
def counted(monkeypatch):
    """Calls of the Python pass methods, by name (the C path calls none of them)."""
    calls = collections.Counter()
    for name in ("_root_begin", "_end", "_begin", "_forward_raised"):
        real = getattr(dumper_mod.Dumper, name)

        def spy(self, *args, _real=real, _name=name):
            calls[_name] += 1
            return _real(self, *args)

        monkeypatch.setattr(dumper_mod.Dumper, name, spy)
    return calls


def run(tmp_path, passes=5, **options):
    model = Net()
    xs = [torch.full((2, 8), float(i)) - 2.5 for i in range(passes)]
    d = fastdump.attach(model, tmp_path, **options)
    with torch.no_grad():
        outs = [model(x) for x in xs]
    stats = d.close()
    return model, xs, outs, stats


@pytest.mark.parametrize("native_pass", [True, False])
def test_plain_passes_are_the_same_on_disk_whichever_path_took_them(tmp_path, monkeypatch, counted, native_pass):
    monkeypatch.setattr(dumper_mod, "_native_root_pass", native_pass)
    model, xs, outs, stats = run(tmp_path, passes=6)
    # The C path ran every pass without a Python pass method; the Python path, each once a pass.
    assert dict(counted) == ({} if native_pass else {"_root_begin": 6, "_begin": 6, "_end": 6})
    assert stats["status"] == "closed" and stats["passes"] == 6 and stats["tensors"] == 6 * 4
    ds = fastdump.open(tmp_path)
    assert ds.passes("target", 0) == list(range(6))
    for p, x in enumerate(xs):
        got = ds.load("target", 0, p)
        want = expected(model, x)
        assert list(got) == list(want)
        assert all(bits(got[k]).equal(bits(want[k])) for k in want), p
        meta = ds.meta("target", 0, p)
        assert meta["complete"] is True and meta["dropped"] == 0 and meta["skipped"] == []
    assert not verify_dump(str(tmp_path)).problems


@pytest.mark.parametrize("case", ["meta", "every", "skip_passes", "pass_range", "max_bytes", "raises",
                                  "nested", "manual", "drop"])
def test_a_pass_that_is_not_plain_goes_through_python_and_is_right(tmp_path, counted, case):
    model = Net()
    options = {"every": {"every": 2}, "skip_passes": {"skip_passes": 1}, "pass_range": {"pass_range": (1, 3)},
               "max_bytes": {"max_bytes": 1 << 20}, "drop": {"policy": "drop"}}.get(case, {})
    d = fastdump.attach(model, tmp_path, **options)
    xs = [torch.full((2, 8), float(i)) for i in range(4)]
    with torch.no_grad():
        for i, x in enumerate(xs):
            if case == "meta":
                d.set_pass_meta(step=i)
            if case == "raises" and i == 1:
                model.fail_with = ValueError("boom")
                with pytest.raises(ValueError, match="boom"):
                    model(x)
                model.fail_with = None
            elif case == "nested" and i == 1:
                model.recurse = True
                model(x)  # the root inside its own pass: one pass, the outer call's names numbered #1
            elif case == "manual" and i == 1:
                d.begin_pass()
                model(x)
                model(x)
                d.end_pass()
            else:
                model(x)
    stats = d.close()
    ds = fastdump.open(tmp_path)
    selected = {"every": [0, 2], "skip_passes": [1, 2, 3], "pass_range": [1, 2]}.get(case, [0, 1, 2, 3])
    assert ds.passes("target", 0) == selected
    for p in selected:
        got = ds.load("target", 0, p)
        want = expected(model, xs[p])
        meta = ds.meta("target", 0, p)
        if case == "raises" and p == 1:
            assert meta["complete"] is False and "ValueError" in meta["incomplete"]
            assert list(got) == ["up", "act"] and bits(got["act"]).equal(bits(want["act"]))
            continue
        if case in ("nested", "manual") and p == 1:
            assert set(got) == {"up", "act", "down", "Net", "up#1", "act#1", "down#1", "Net#1"}
            assert all(bits(got[k]).equal(bits(want[k.split("#")[0]])) for k in got)
            assert meta["complete"] is True
            continue
        assert list(got) == list(want) and all(bits(got[k]).equal(bits(want[k])) for k in want), p
        assert meta["complete"] is True
        if case == "meta":
            assert meta["step"] == p
    assert stats["passes"] == len(selected)
    # Each such pass (and only such a pass, at its begin or its end) took a Python method.
    python_passes = {"meta": 4, "every": 4, "skip_passes": 4, "pass_range": 4, "max_bytes": 4, "raises": 1,
                     "nested": 1, "manual": 1, "drop": 0}[case]
    assert counted["_begin"] >= python_passes or counted["_end"] >= python_passes, dict(counted)
    if case == "drop":  # plain passes under `drop`: the C path
        assert dict(counted) == {}
    assert not verify_dump(str(tmp_path)).problems


def test_the_same_exception_object_reaches_the_caller_and_the_pass_says_why(tmp_path):
    model = Net()
    d = fastdump.attach(model, tmp_path)
    error = KeyError("mine")
    model.fail_with = error
    with pytest.raises(KeyError) as caught, torch.no_grad():
        model(torch.ones(2, 8))
    assert caught.value is error and caught.value.__context__ is None
    model.fail_with = None
    with torch.no_grad():
        model(torch.ones(2, 8))
    d.close()
    ds = fastdump.open(tmp_path)
    assert "KeyError" in ds.meta("target", 0, 0)["incomplete"] and ds.meta("target", 0, 1)["complete"]


def test_an_end_interrupted_after_the_forward_raised_is_closed_at_the_next_pass(tmp_path, monkeypatch):
    """Ctrl-C inside the Python _end the C path calls after a forward raised: the pass stays open
    (its count never went down). The C path recorded the opener's frame as the Python path does,
    so the next root forward sees the pass dangling, closes it marked incomplete and opens its own."""
    model = Net()
    d = fastdump.attach(model, tmp_path)
    real_end, hits = dumper_mod.Dumper._end, []

    def interrupted_end(self):
        if not hits:
            hits.append(1)
            raise KeyboardInterrupt  # before the end's first instruction
        return real_end(self)

    monkeypatch.setattr(dumper_mod.Dumper, "_end", interrupted_end)
    model.fail_with = ValueError("boom")
    with pytest.raises(KeyboardInterrupt) as caught, torch.no_grad():
        model(torch.ones(2, 8))
    assert isinstance(caught.value.__context__, ValueError)  # as a `finally:` raising in Python
    assert d.in_pass
    model.fail_with = None
    x = torch.full((2, 8), 3.0)
    with torch.no_grad():
        model(x)
    assert not d.in_pass
    d.close()
    ds = fastdump.open(tmp_path)
    assert ds.passes("target", 0) == [0, 1]
    assert "ValueError" in ds.meta("target", 0, 0)["incomplete"]  # (the first reason is the one kept)
    assert ds.meta("target", 0, 1)["complete"] is True
    got, want = ds.load("target", 0, 1), expected(model, x)
    assert list(got) == list(want) and all(bits(got[k]).equal(bits(want[k])) for k in want)


def test_a_leaf_called_from_another_thread_during_a_c_pass_marks_it_mixed(tmp_path):
    model = Net()
    d = fastdump.attach(model, tmp_path)
    started, done = threading.Event(), threading.Event()
    real = model.act.forward  # (the wrapper fastdump put there)

    def act_then_wait(x):
        out = real(x)
        if not started.is_set():
            started.set()
            done.wait(10)
        return out

    model.act.forward = act_then_wait
    worker = threading.Thread(target=lambda: (started.wait(10), model.up(torch.ones(1, 8)), done.set()))
    worker.start()
    with torch.no_grad():
        model(torch.ones(2, 8))
        model(torch.ones(2, 8))
    worker.join(10)
    stats = d.close()
    assert stats["mixed_passes"] == 1
    ds = fastdump.open(tmp_path)
    assert ds.meta("target", 0, 0)["mixed"] and ds.meta("target", 0, 1)["complete"]
    assert verify_dump(str(tmp_path)).problems  # mixing fails verify


@pytest.mark.parametrize("native_pass", [True, False])
def test_pass_ends_the_writer_handled_are_forgotten(tmp_path, monkeypatch, native_pass):
    import time

    monkeypatch.setattr(dumper_mod, "_native_root_pass", native_pass)
    model = Net()
    d = fastdump.attach(model, tmp_path)
    with torch.no_grad():
        for _ in range(100):
            model(torch.ones(1, 8))
        deadline = time.monotonic() + 20
        while d._producer.acked_seq < d._unconfirmed[-1] and time.monotonic() < deadline:
            time.sleep(0.02)  # the writer acknowledges what it handled, in its own time
        for _ in range(65):
            model(torch.ones(1, 8))
    # the 65th pass since found more than 64 waiting and forgot the 100 handled (_trim_unconfirmed)
    assert len(d._unconfirmed) < 65
    assert d.close()["passes"] == 165


def test_a_dead_writer_is_noticed_by_the_c_path_and_serving_goes_on(tmp_path, caplog):
    import os
    import signal
    import time

    model = Net()
    d = fastdump.attach(model, tmp_path)
    with torch.no_grad():
        model(torch.ones(1, 8))
        os.kill(d._engine._proc.pid, signal.SIGKILL)
        d._engine._proc.wait()
        time.sleep(0.05)  # past the liveness check's 20 ms
        x = torch.ones(1, 8)
        out = model(x)
    assert bits(out).equal(bits(expected(model, x)["Net"]))
    assert d.status == "error" and not d.in_pass
    assert d.close()["status"] == "error"
