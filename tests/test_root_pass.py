"""The root forward's pass begun and ended in C (``CaptureState.root_pass``, csrc/forward_wrapper.cpp).

It takes a pass only when it is plain (no metadata, skips, budget, stall, graph capture, nesting or
thread mixing) and its begin or end record goes into the ring at once (a pass the selection leaves
out needs none); anything else runs Dumper._root_begin / _end as before. These tests check both sides of that line: what the
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

        def spy(self, *args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(self, *args, **kwargs)

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
    monkeypatch.setattr("fastdump.capture.wrappers._native_root_pass", native_pass)
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


@pytest.mark.parametrize("case", ["meta", "max_bytes", "raises", "nested", "manual", "drop"])
def test_a_pass_that_is_not_plain_goes_through_python_and_is_right(tmp_path, counted, case):
    model = Net()
    options = {"max_bytes": {"max_bytes": 1 << 20}, "drop": {"policy": "drop"}}.get(case, {})
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
    selected = [0, 1, 2, 3]
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
    python_passes = {"meta": 4, "max_bytes": 4, "raises": 1, "nested": 1, "manual": 1, "drop": 0}[case]
    assert counted["_begin"] >= python_passes or counted["_end"] >= python_passes, dict(counted)
    if case == "drop":  # plain passes under `drop`: the C path
        assert dict(counted) == {}
    assert not verify_dump(str(tmp_path)).problems


SELECTIONS = {"every": dict(every=3), "skip_passes": dict(skip_passes=2), "pass_range": dict(pass_range=(2, 5)),
              "all three": dict(every=2, skip_passes=1, pass_range=(0, 6))}


def python_selects(i, every=1, skip_passes=0, pass_range=None):
    return i >= skip_passes and (i - skip_passes) % every == 0 and (pass_range is None or pass_range[0] <= i < pass_range[1])


@pytest.mark.parametrize("selection", list(SELECTIONS))
def test_the_selection_is_made_in_c_as_python_makes_it(tmp_path, monkeypatch, counted, selection):
    """every/skip_passes/pass_range: the C path picks the same forwards as Dumper._selected, dumps
    the same values, and leaves the others out without any Python pass method. A dump() outside a
    pass is a pass of its own that neither counts."""
    options = SELECTIONS[selection]
    xs = [torch.full((2, 8), float(i)) - 3.5 for i in range(8)]
    found = {}
    for native in (True, False):
        monkeypatch.setattr("fastdump.capture.wrappers._native_root_pass", native)
        counted.clear()
        model = Net()
        d = fastdump.attach(model, tmp_path / str(native), **options)
        with torch.no_grad():
            for i, x in enumerate(xs):
                if i == 3:
                    d.dump("extra", torch.full((2,), 7.0))  # pass 3, standalone
                model(x)
        stats = d.close()
        roots = counted["_root_begin"]
        assert roots == (0 if native else 8), dict(counted)
        ds = fastdump.open(tmp_path / str(native))
        found[native] = {p: ds.load("target", 0, p) for p in ds.passes("target", 0)}
        assert stats["passes"] == len(found[native]) and not verify_dump(str(tmp_path / str(native))).problems
    kept = [i for i in range(8) if python_selects(i, **options)]
    ids = {i: i if i < 3 else i + 1 for i in kept}  # forwards after the dump() are a pass id later
    assert list(found[True]) == sorted([*ids.values(), 3]) == list(found[False])
    assert list(found[True][3]) == ["extra"]
    for i, p in ids.items():
        want = expected(Net(), xs[i])
        for native in (True, False):
            assert list(found[native][p]) == list(want)
            assert all(bits(found[native][p][k]).equal(bits(want[k])) for k in want), (native, i)


def test_a_pass_left_out_while_a_cuda_graph_is_captured_goes_to_python_and_is_dumped(tmp_path, monkeypatch, counted):
    """A graph captured in a pass the selection leaves out must still be recorded (GraphRecording):
    the C path asks capture_running and, when it says yes, hands the pass to Python."""
    from fastdump.staging import graphs

    monkeypatch.setattr(graphs.GraphRecording, "capture_running", staticmethod(lambda: True))
    model = Net()
    d = fastdump.attach(model, tmp_path, every=2)
    with torch.no_grad():
        for i in range(4):
            model(torch.full((2, 8), float(i)))
    d.close()
    assert counted["_root_begin"] == 2  # the passes left out; the kept ones took the C path
    assert fastdump.open(tmp_path).passes("target", 0) == [0, 1, 2, 3]


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

    monkeypatch.setattr("fastdump.capture.wrappers._native_root_pass", native_pass)
    model = Net()
    d = fastdump.attach(model, tmp_path)
    def all_acked():
        deadline = time.monotonic() + 20
        while d._unconfirmed and d._producer.acked_seq < d._unconfirmed[-1] and time.monotonic() < deadline:
            time.sleep(0.02)  # the writer acknowledges what it handled, in its own time
        assert not d._unconfirmed or d._producer.acked_seq >= d._unconfirmed[-1], "the writer acknowledged nothing"

    with torch.no_grad():
        for _ in range(100):
            model(torch.ones(1, 8))
        all_acked()
        # How many are still listed depends on how fast the writer acknowledged during the 100 (the
        # trims at 65 waiting forget only what it had handled by then): all of them are handled now.
        handled = list(d._unconfirmed)
        more = max(1, 65 - len(handled))
        for _ in range(more):  # the pass that makes 65 waiting forgets the handled ones
            model(torch.ones(1, 8))
        assert d._unconfirmed and all(seq > (handled[-1] if handled else 0) for seq in d._unconfirmed)
        assert len(d._unconfirmed) <= more
    assert d.close()["passes"] == 100 + more


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


class _OddInPassOne(nn.Module):
    """Returns ``x * 2``, or in its second call an object that holds no tensor (a recorded skip)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return object() if self.calls == 2 else x * 2


@pytest.mark.parametrize("native_pass", [True, False])
def test_a_skip_in_a_pass_the_c_path_opened_reaches_the_disk(tmp_path, monkeypatch, native_pass):
    """A pass begun in C whose forward records a skip is not plain at its end: its skipped list must
    go with the end (Python's), on disk in that pass's meta. (A mutant whose C end ignored skips
    sent a plain end: the skip was lost and the pass read as whole.)"""
    monkeypatch.setattr("fastdump.capture.wrappers._native_root_pass", native_pass)
    model = nn.Sequential(_OddInPassOne())
    with fastdump.attach(model, tmp_path) as d, torch.no_grad():
        for i in range(3):
            model(torch.full((2,), float(i)))
    assert d.stats()["skipped"] == 2  # the leaf's output and the root's (the same object)
    ds = fastdump.open(tmp_path)
    skipped = [sorted(s["name"] for s in ds.meta("target", 0, p)["skipped"]) for p in (0, 1, 2)]
    assert skipped == [[], ["0", "Sequential"], []], skipped
    assert ds.rank_info("target", 0)["skipped"] == 2
