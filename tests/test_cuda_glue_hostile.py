"""Hostile tests of the CUDA path's Python/C++ glue after the CPU hot-path changes, on the mock
CUDA runtime: models whose leaves and root return (fake) CUDA tensors through the C forward
wrappers, drop/block, record mode with the C wrappers, byte budgets, writer death, close with
batches held, Dumpers sharing one stager; contents read back bit for bit and counts checked."""

from __future__ import annotations

import json
import time

import pytest
import torch
from torch import nn

import fastdump
from fastdump.cli.dump import verify_dump
from test_cuda import (GLOBAL, RELAXED, THREAD_LOCAL, FakeCudaTensor, device_buffer, fake_cuda, glue, m,  # noqa: F401
                       mock, same_bits)
from test_cuda_lean import _capture_on_another_thread
from test_graphs import GRAPH_BASE, Stream, rand_input, release


@pytest.fixture
def native(m, glue, monkeypatch):
    """The Dumper's C++ forward wrappers and capture state from the mock build, so that its
    CaptureState holds the channel's (mock) ChannelStager and the wrappers call stage_tensor in C,
    as on a GPU; FakeCudaTensor is the 'exact tensor' type they stage in C (torch.Tensor is on a GPU)."""
    from fastdump.capture import dumper, emit, tensors, wrappers

    for module in (dumper, emit, wrappers, tensors):  # (each capture module that reads _C)
        monkeypatch.setattr(module, "_C", m)
    monkeypatch.setattr(wrappers, "_NativeWrapper", m.ForwardWrapper)
    for module in (dumper, wrappers, tensors):  # (each capture module that reads _TensorType)
        monkeypatch.setattr(module, "_TensorType", FakeCudaTensor)
    return glue


class Leaf(nn.Module):
    """Returns a new (fake) CUDA tensor per call, its values depending on `step`: one tensor, or
    a tuple (tensor, None, tensor)."""

    def __init__(self, m, shape, dtype, k, tuple_out=False):
        super().__init__()
        self.m, self.shape, self.dtype, self.k, self.tuple_out = m, shape, dtype, k, tuple_out
        self.last = None  # the CPU values of the last call's output(s)

    def forward(self, step):
        n = 1
        for s in self.shape:
            n *= s
        cpu = (torch.arange(n, dtype=torch.int64).reshape(self.shape) * (self.k + 1) + step * 1000).to(self.dtype)
        if self.tuple_out:
            other = cpu.to(torch.float32) * 0.5 + step
            self.last = (cpu, other)
            return fake_cuda(self.m, cpu), None, fake_cuda(self.m, other)
        self.last = cpu
        return fake_cuda(self.m, cpu)


class Net(nn.Module):
    """Three leaves (one returning a tuple with a None) and a root returning a tuple: every output
    a fake CUDA tensor. `expected` holds each call's values by dumped name."""

    def __init__(self, m):
        super().__init__()
        self.m = m
        self.a = Leaf(m, (4, 8), torch.float32, 0)
        self.b = Leaf(m, (3, 5), torch.bfloat16, 1, tuple_out=True)
        self.c = Leaf(m, (16,), torch.int32, 2)
        self.expected = []

    def forward(self, step):
        self.a(step)
        self.b(step)
        self.c(step)
        root = (torch.full((2, 3), float(step), dtype=torch.float16), torch.arange(5, dtype=torch.int64) + step)
        self.expected.append({"a": self.a.last, "b.0": self.b.last[0], "b.2": self.b.last[1], "c": self.c.last,
                              "Net.0": root[0], "Net.1": root[1]})
        return fake_cuda(self.m, root[0]), fake_cuda(self.m, root[1])


def _attach_model(model, root, **kw):
    kw.setdefault("tp_rank", 0)
    kw.setdefault("tp_size", 1)
    kw.setdefault("strict", True)
    kw.setdefault("writer", "thread")
    kw.setdefault("device", "cuda:0")
    return fastdump.attach(model, root, **kw)


def _check_passes(root, passes, role="target"):
    """passes: {pass id: {name: cpu tensor}}; each pass on disk holds exactly those, bit for bit."""
    ds = fastdump.open(root)
    assert [p for p in ds.passes(role, 0) if p in passes] == sorted(passes)
    n = 0
    for p, want in passes.items():
        got = ds.load(role, 0, p)
        assert set(got) == set(want), (p, sorted(got), sorted(want))
        for name, t in want.items():
            assert same_bits(torch.as_tensor(got[name]), t), (p, name)
        n += len(want)
    return n


def _stager_stats():
    from fastdump.staging import cuda

    return cuda.status()["stagers"][-1]


def test_c_wrappers_stage_cuda_leaves_and_root_output_bit_exact(m, native, tmp_path):
    """As on a GPU: the C ForwardWrappers (leaves, and the root's own output inside the root
    wrapper's pass) hand CUDA tensors to ChannelStager.stage_tensor in C; every tensor of every
    pass goes the lean path, bit-exact on disk, and stats() counts what is on disk."""
    net = Net(m)
    d = _attach_model(net, tmp_path)
    assert type(net.a.forward) is m.ForwardWrapper and d._state.lane is d._channel.lane
    for step in range(4):
        net(step)
    mid = d.stats()
    stats = d.close()
    assert mid["tensors"] == stats["tensors"] == 4 * 6 and stats["passes"] == 4
    assert stats["status"] == "closed" and stats["dropped"] == stats["skipped"] == 0
    assert _check_passes(tmp_path, dict(enumerate(net.expected))) == stats["tensors"]
    st = _stager_stats()
    assert st["lean_tensors"] == st["published"] == 4 * 6 and st["cancelled"] == 0


class _Layer(nn.Module):
    """dst = src + 1 (bytewise) on the current stream; returns dst as a fake CUDA tensor."""

    def __init__(self, m, src, dst, nbytes, cpu, current):
        super().__init__()
        self.m, self.src, self.dst, self.nbytes, self.cpu, self.current = m, src, dst, nbytes, cpu, current

    def forward(self, x):
        assert self.m._mock.enqueue_copy(self.current.raw, self.dst, self.src, self.nbytes) == 0
        assert self.m._mock.enqueue_increment(self.current.raw, self.dst, self.nbytes) == 0
        return FakeCudaTensor(self.cpu, self.dst)


class GraphNet(nn.Module):
    """test_graphs.Model as modules: l0 (h1 = x + 1), l1 (h2 = h1 + 1), then h1 overwritten in
    place; the root returns (h2,). Static buffers, as a graph runner's."""

    def __init__(self, m, current, batch, width=64):
        super().__init__()
        self.m, self.current = m, current
        self.shape = (batch, width)
        self.cpu = torch.zeros(self.shape, dtype=torch.int32)
        self.nbytes = self.cpu.numel() * 4
        self.x, self.h1, self.h2 = (device_buffer(m, self.nbytes) for _ in range(3))
        self.l0 = _Layer(m, self.x, self.h1, self.nbytes, self.cpu, current)
        self.l1 = _Layer(m, self.h1, self.h2, self.nbytes, self.cpu, current)

    def forward(self, x):
        self.l1(self.l0(x))
        assert self.m._mock.enqueue_fill(self.current.raw, self.h1, self.nbytes, 0xEE) == 0
        return (FakeCudaTensor(self.cpu, self.h2),)

    def expected(self, x):
        b = x.contiguous().view(torch.uint8)
        h1, h2 = (b + 1).view(x.dtype).reshape(self.shape), (b + 2).view(x.dtype).reshape(self.shape)
        return {"l0": h1, "l1": h2, "GraphNet.0": h2}

    def set_input(self, stream, x):
        src = device_buffer(self.m, self.nbytes)
        assert self.m._mock.upload(src, x.contiguous().data_ptr(), self.nbytes) == 0
        assert self.m._mock.enqueue_copy(stream, self.x, src, self.nbytes) == 0


@pytest.mark.parametrize("mode", [GLOBAL, THREAD_LOCAL])
def test_record_mode_through_the_c_wrappers(m, native, tmp_path, monkeypatch, mode):
    """Record mode with the C wrappers: eager passes, a capture whose forward is a pass of its
    own on a blocking side stream (the lean lane returns CAPTURING, the wrapper's Python fallback
    hands the tensors to the graph recorder), replays interleaved with eager passes: each replay a
    pass with that replay's values, the eager passes bit-exact, counts agree with the disk."""
    from fastdump.staging import cuda

    current = Stream(native)
    monkeypatch.setattr(cuda, "_current_stream", current)
    net = GraphNet(m, current, 4)
    d = _attach_model(net, tmp_path)
    side = m._mock.stream_create_flags(0)
    eager, replays, graph = {}, [], None
    try:
        for k in range(2):
            x = rand_input(net, k)
            net.set_input(native, x)
            net(None)
            eager[k] = net.expected(x)
        m._mock.sync(native)
        current.raw = side
        assert m._mock.begin_capture(side, mode) == 0
        net(None)  # pass 2: the capture
        err, graph = m._mock.end_capture(side)
        assert err == 0, m._mock.error_name(err)
        exe = m._mock.graph_instantiate(graph)
        current.raw = native
        for k in range(4):
            x = rand_input(net, 100 + k)
            net.set_input(native, x)
            assert m._mock.graph_launch(exe, native) == 0
            replays.append(net.expected(x))
            if k == 1:
                m._mock.sync(native)
                x = rand_input(net, 200)
                net.set_input(native, x)
                net(None)  # pass 3: eager between replays
                eager[3] = net.expected(x)
        m._mock.sync(native)
        stats = d.close()
    finally:
        m._mock.sync(side)
        release(m, [(graph, exe)] if graph is not None else [], [side], [d])
    ds = fastdump.open(tmp_path)
    assert ds.passes("target", 0) == [0, 1, 2, 3] + [GRAPH_BASE + i for i in range(4)]
    assert "recorded into graph 0" in ds.meta("target", 0, 2)["incomplete"]
    n = _check_passes(tmp_path, {**eager, **{GRAPH_BASE + i: r for i, r in enumerate(replays)}})
    for i in range(4):
        assert ds.meta("target", 0, GRAPH_BASE + i)["graph_replay"] == i
    assert stats["status"] == "closed" and stats["graph_replays"] == 4 and stats["tensors"] == n == 7 * 3
    assert stats["passes"] == 4 + 4 and stats["incomplete_passes"] == 1 and stats["dropped_passes"] == 0


def test_close_with_a_lean_batch_held_by_a_capture(m, native, tmp_path, monkeypatch):
    """A pass on the legacy stream ends while another thread captures a blocking stream: its lean
    batch is held (an event on the legacy stream would join that capture). close() with the
    capture still running must not wait for the writer behind those records for its whole
    timeout (and then stop the writer with passes unwritten): the held records become padding,
    counted as lost (they were staged: `verify` fails on them), the earlier pass is on disk."""
    from fastdump.staging import cuda

    monkeypatch.setenv("FASTDUMP_CUDA_HOLD_MS", "60000")
    monkeypatch.setattr(cuda, "_current_stream", Stream(0))  # torch's default: the legacy stream
    blocking = m._mock.stream_create_flags(0)
    cpu = [torch.arange(10, dtype=torch.float32) + i for i in range(4)]
    fakes = [fake_cuda(m, t) for t in cpu]
    d = _attach_model(None, tmp_path)
    d.begin_pass()
    d.dump("a", fakes[0])
    d.dump("b", fakes[1])
    d.end_pass()
    m._mock.sync(0)
    end = None
    try:
        d.begin_pass()
        d.dump("a", fakes[2])
        d.dump("b", fakes[3])
        end = _capture_on_another_thread(m, blocking, RELAXED)
        d.end_pass()  # the batch is held: the capture is still open
        t0 = time.monotonic()
        stats = d.close(timeout=20)
        took = time.monotonic() - t0
    finally:
        if end is not None:
            err, graph = end()
            assert err == 0, m._mock.error_name(err)  # the other thread's capture stayed valid
            m._mock.graph_destroy(graph)
        m._mock.stream_destroy(blocking)
    assert took < 10, took
    assert stats["status"] == "closed", stats
    assert _check_passes(tmp_path, {0: {"a": cpu[0], "b": cpu[1]}, 1: {}}) == 2
    assert stats["tensors"] == 4 and stats["lost_at_close"] == 2 and stats["dropped"] == 0
    assert _stager_stats()["cancelled"] == 2
    problems = verify_dump(str(tmp_path)).problems
    assert len(problems) == 2 and "2 staged tensor(s) were lost at close" in problems[0], problems
    # (and the pass they were sent in: its end record counted them, format 6)
    assert problems[1].endswith(": pass 1: 0 tensors on disk, but its producer sent 2 (its end record's count): "
                                "tensors were lost"), problems


def test_byte_budget_with_cuda_tensors_through_the_c_wrappers(m, native, tmp_path):
    """max_bytes with CUDA tensors staged in C: the lane's counts are folded at each pass end (the
    budget's check at the next begin needs them), so dumping stops after the pass that reached
    the budget; what is on disk is what stats() counts."""
    net = Net(m)
    per_pass = 4 * 8 * 4 + 3 * 5 * 2 + 3 * 5 * 4 + 16 * 4 + 2 * 3 * 2 + 5 * 8
    d = _attach_model(net, tmp_path, max_bytes=2 * per_pass + 1)
    for step in range(5):
        net(step)
    stats = d.close()
    assert stats["passes"] == 3 and stats["bytes"] == 3 * per_pass
    assert _check_passes(tmp_path, {p: net.expected[p] for p in range(3)}) == stats["tensors"] == 18
    assert fastdump.open(tmp_path).passes("target", 0) == [0, 1, 2]


def test_target_and_draft_share_the_cuda_stager_through_the_c_wrappers(m, native, tmp_path):
    """An EAGLE pair: two Dumpers, one engine and CUDA stager, one lane each, passes interleaved;
    the target closes while the draft's pass is open and the draft goes on: each role holds its
    own values, bit for bit, and the shared stager published every tensor."""
    target, draft = Net(m), Net(m)
    t = _attach_model(target, tmp_path, role="target")
    dr = _attach_model(draft, tmp_path, role="draft")
    for step in range(3):
        target(step)
        draft(10 + step)
    draft.a(50)  # outside a pass: nothing
    dr.begin_pass()
    draft.a(60)
    ts = t.close()
    draft.c(61)
    dr.end_pass()
    draft(70)
    ds_ = dr.close()
    assert ts["tensors"] == 18 and _check_passes(tmp_path, dict(enumerate(target.expected))) == 18
    want = dict(enumerate(draft.expected[:3]))
    want[3] = {"a": (torch.arange(32, dtype=torch.int64).reshape(4, 8) + 60000).to(torch.float32),
               "c": (torch.arange(16, dtype=torch.int64) * 3 + 61000).to(torch.int32)}
    want[4] = draft.expected[3]
    assert _check_passes(tmp_path, want, role="draft") == ds_["tensors"] == 18 + 2 + 6
    st = _stager_stats()
    assert st["published"] == st["lean_tensors"] == 18 + 26 and st["cancelled"] == 0


def test_close_returns_within_its_timeout_when_a_stream_never_completes(m, native, tmp_path):
    """The copies of the last passes wait behind a kernel that never ends (a gate left shut): the
    stager's close joined its drain, which finishes every copy first, so close(timeout=2) never
    returned. Now it returns in time, counts the unfinished records as lost, and verify fails."""
    net = Net(m)
    d = _attach_model(net, tmp_path, strict=False)
    for step in range(2):
        net(step)
    assert d._engine.flush_cuda(10)
    gate = m._mock.enqueue_gate(native)  # every later copy on the current stream waits here
    try:
        for step in range(2, 4):
            net(step)
        t0 = time.monotonic()
        stats = d.close(timeout=2)
        elapsed = time.monotonic() - t0
    finally:
        m._mock.open_gate(gate)  # (the abandoned close then finishes in its thread)
    assert elapsed < 4, f"close(timeout=2) took {elapsed:.1f} s"
    assert stats["status"] == "error" and stats["passes"] == 4
    assert stats["lost_at_close"] == 2 * 6  # the two gated passes' records, one per tensor
    assert stats["error"].startswith("close timed out after 2 s: the CUDA stager did not stop by close's "
                                     "deadline: 12 staged records still copying on a stream that never completed")
    record = json.loads((d.dir / "producer_error.json").read_text())
    assert record["error"] == stats["error"]
    problems = verify_dump(str(tmp_path)).problems
    assert any("producer_error.json" in p and "never completed" in p for p in problems), problems
    _check_passes(tmp_path, {p: net.expected[p] for p in range(2)})  # what landed before the gate is whole


_EXIT_WITH_A_STREAM_THAT_NEVER_COMPLETES = """
import sys, time
sys.path[:0] = [{tests!r}, {mock!r}]
from _pytest.monkeypatch import MonkeyPatch
import build, test_cuda, test_cuda_glue_hostile as hostile
m = build.load(build.build())
for k, v in test_cuda._KNOBS.items():
    m._mock.set(k, v)
m._mock.reset()
m.device_buffers = []
test_cuda.MOCK_MODULE[0] = m
patch = MonkeyPatch()
glue = test_cuda.glue._get_wrapped_function()(m, patch)
native = hostile.native._get_wrapped_function()(m, next(glue), patch)
net = hostile.Net(m)
d = hostile._attach_model(net, {root!r}, strict=False)
for step in range(2):
    net(step)
assert d._engine.flush_cuda(10)
m._mock.enqueue_gate(native)  # never opened: every later copy on the stream waits for good
for step in range(2, 4):
    net(step)
if {close!r}:
    print("closed:", d.close(timeout=1)["status"], flush=True)
print("exiting", flush=True)
"""


@pytest.mark.parametrize("close_first", [True, False])
def test_the_process_exits_in_time_with_a_stream_that_never_completes(m, tmp_path, close_first):
    """close(timeout=1) gives up on the stager's close (its drain waits for copies on a stream that
    never completes) and leaves that close running in a daemon thread; or nothing closes and the
    exit hook does, within FASTDUMP_EXIT_TIMEOUT_S. Either way the interpreter's exit must neither
    hang on that thread nor crash (its drain, the pinned ring, the closed channel), and what was
    lost must fail verify; the passes before the gate are whole."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).parent
    code = _EXIT_WITH_A_STREAM_THAT_NEVER_COMPLETES.format(tests=str(here), mock=str(here / "cuda_mock"),
                                                           root=str(tmp_path), close=close_first)
    env = dict(os.environ, FASTDUMP_EXIT_TIMEOUT_S="2",
               PYTHONPATH=os.pathsep.join([str(here.parent), os.environ.get("PYTHONPATH", "")]))
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - t0
    assert run.returncode == 0, run.stderr[-3000:]
    assert "exiting" in run.stdout and ("closed: error" in run.stdout) == close_first, run.stdout
    assert elapsed < 60, f"{elapsed:.0f} s"  # (the mock build is cached: the import, attach, 2 s of close)
    problems = verify_dump(str(tmp_path)).problems
    assert any("producer_error.json" in p and "never completed" in p for p in problems), problems
    want = Net(m)
    for step in range(2):
        want(step)
    _check_passes(tmp_path, {p: want.expected[p] for p in range(2)})
