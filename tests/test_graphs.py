"""CUDA-graph record mode (fastdump/staging/graphs.py, csrc/cuda_graph_record.cu) against the mock CUDA
runtime: the flow of SGLang's / vLLM's graph runners (warm-up passes, capture on a side stream in
global or thread-local mode, one graph per batch size, replays interleaved with eager passes, a
target and a draft Dumper), checked byte for byte per replay."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import fastdump
from fastdump.staging.graphs import free_device_memory
from test_cuda import (GLOBAL, RELAXED, THREAD_LOCAL, FakeCudaTensor, Ring, device_buffer, glue, m,  # noqa: F401
                       mock, needs_cuda_build, same_bits, _attach)

GRAPH_BASE = 1 << 40


class Stream:
    """The 'current stream' seam of fastdump.staging.cuda, switched by the test like torch.cuda.stream()."""

    def __init__(self, raw):
        self.raw = raw

    def __call__(self, device):
        return self.raw, _FakeTorchStream(self.raw)


class _FakeTorchStream:
    def __init__(self, raw):
        self.cuda_stream = raw


class Model:
    """Two 'layers' on mock device memory: h1 = x + 1, h2 = h1 + 1 (bytewise), then h1 is
    overwritten in place (0xEE) by a later kernel, as a fused residual/norm would. The hooks dump
    h1 and h2 right after their kernels, on the current stream."""

    def __init__(self, m, batch, width=64, dtype=torch.int32):
        self.m = m
        self.shape = (batch, width)
        self.cpu = torch.zeros(self.shape, dtype=dtype)
        self.nbytes = self.cpu.numel() * self.cpu.element_size()
        self.x = device_buffer(m, self.nbytes)   # static input buffer (the graph runner's)
        self.h1 = device_buffer(m, self.nbytes)
        self.h2 = device_buffer(m, self.nbytes)

    def forward(self, dumper, stream, tag="layers"):
        m = self.m
        dumper.begin_pass()
        assert m._mock.enqueue_copy(stream, self.h1, self.x, self.nbytes) == 0
        assert m._mock.enqueue_increment(stream, self.h1, self.nbytes) == 0
        dumper.dump(f"{tag}.0", FakeCudaTensor(self.cpu, self.h1))
        assert m._mock.enqueue_copy(stream, self.h2, self.h1, self.nbytes) == 0
        assert m._mock.enqueue_increment(stream, self.h2, self.nbytes) == 0
        dumper.dump(f"{tag}.1", FakeCudaTensor(self.cpu, self.h2))
        assert m._mock.enqueue_fill(stream, self.h1, self.nbytes, 0xEE) == 0
        dumper.end_pass()

    def expected(self, x: torch.Tensor) -> tuple:
        b = x.contiguous().view(torch.uint8)
        return (b + 1).view(x.dtype).reshape(self.shape), (b + 2).view(x.dtype).reshape(self.shape)

    def set_input(self, stream, x: torch.Tensor) -> None:
        """Copy a new input into the static buffer in stream order (as the runner's copy_ does)."""
        src = device_buffer(self.m, self.nbytes)
        assert self.m._mock.upload(src, x.contiguous().data_ptr(), self.nbytes) == 0
        assert self.m._mock.enqueue_copy(stream, self.x, src, self.nbytes) == 0


def capture(m, model, dumper, current, capture_stream, mode=GLOBAL, **meta):
    """torch.cuda.graph(g, stream=capture_stream): begin capture, run the forward, end capture."""
    current.raw = capture_stream
    assert m._mock.begin_capture(capture_stream, mode) == 0
    if meta:
        dumper.set_pass_meta(**meta)
    model.forward(dumper, capture_stream)
    err, graph = m._mock.end_capture(capture_stream)
    assert err == 0, m._mock.error_name(err)
    exe = m._mock.graph_instantiate(graph)
    assert exe
    return graph, exe


def release(m, graphs, streams=(), dumpers=()):
    """Test teardown: destroy the (graph, exec) pairs, then the streams, then the Dumpers' recording
    memory (which replays write into, so only once no graph of theirs can run)."""
    for graph, exe in graphs:
        m._mock.graph_exec_destroy(exe)
        m._mock.graph_destroy(graph)
    for stream in streams:
        m._mock.stream_destroy(stream)
    for dumper in dumpers:
        free_device_memory(dumper)


def rand_input(model, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2 ** 31, 2 ** 31 - 1, model.shape, generator=g, dtype=torch.int32)


def replay(m, model, exe, stream, x):
    """One replay of ``exe`` on ``stream`` with ``x`` as its input: what that replay computes."""
    model.set_input(stream, x)
    assert m._mock.graph_launch(exe, stream) == 0
    return model.expected(x)


def graph_passes(ds, role):
    return [p for p in ds.passes(role, 0) if p >= GRAPH_BASE]


@pytest.mark.parametrize("mode", [GLOBAL, THREAD_LOCAL])
def test_graph_replays_become_passes_bit_exact(m, glue, tmp_path, monkeypatch, mode):
    """Warm-up, two graphs (batch 4 and 8) captured on a side stream, replays with new inputs
    interleaved with eager passes and not synchronized: each replay is one pass, in replay order,
    holding that replay's values, with meta naming the graph."""
    from fastdump.staging import cuda

    m._mock.set("max_delay_us", 200)  # streams run apart, late
    current = Stream(glue)
    monkeypatch.setattr(cuda, "_current_stream", current)
    d = _attach(tmp_path, writer="thread", device="cuda:0")
    side = m._mock.stream_create_flags(0)  # torch's capture stream: a blocking side stream
    replay_stream = m._mock.stream_create()
    models = {4: Model(m, 4), 8: Model(m, 8)}
    execs = {}
    try:
        # Warm-up (eager) then one capture per batch size, as the graph runners do.
        for bs, model in models.items():
            current.raw = glue
            model.set_input(glue, rand_input(model, bs))
            model.forward(d, glue)
        m._mock.sync(glue)  # torch.cuda.graph synchronizes before capturing; the runner's warm-ups are done
        for bs, model in models.items():
            execs[bs] = capture(m, model, d, current, side, mode, graph=f"decode_bs{bs}")
        current.raw = glue
        expected = []   # (batch, replay index, h1, h2) in replay order
        eager_expected = []
        counts = {4: 0, 8: 0}
        for k, bs in enumerate([4, 8, 8, 4, 4, 8, 4]):
            model = models[bs]
            h1, h2 = replay(m, model, execs[bs][1], replay_stream, rand_input(model, 100 + k))
            expected.append((bs, counts[bs], h1, h2))
            counts[bs] += 1
            if k % 3 == 1:  # an eager pass between replays (prefill)
                e = models[4]
                xe = rand_input(e, 1000 + k)
                m._mock.sync(replay_stream)
                e.set_input(glue, xe)
                e.forward(d, glue, tag="eager")
                eager_expected.append(e.expected(xe))
                m._mock.sync(glue)
        m._mock.sync(replay_stream)
        stats = d.close()
    finally:
        m._mock.sync(side)
        release(m, execs.values(), [side, replay_stream], [d])
    ds = fastdump.open(tmp_path)
    passes = graph_passes(ds, "target")
    assert passes == [GRAPH_BASE + i for i in range(len(expected))]
    for p, (bs, index, h1, h2) in zip(passes, expected):
        got = ds.load("target", 0, p)
        assert set(got) == {"layers.0", "layers.1"}
        assert same_bits(torch.as_tensor(got["layers.0"]), h1), (p, bs)
        assert same_bits(torch.as_tensor(got["layers.1"]), h2), (p, bs)
        meta = ds.meta("target", 0, p)
        assert meta["graph"] == f"decode_bs{bs}" and meta["graph_batch"] == bs
        assert meta["graph_replay"] == index and meta["complete"]
        assert meta["cuda_graph"] == (0 if bs == 4 else 1)
    # The eager passes (warm-ups, prefill) are ordinary passes; the capture passes hold nothing.
    eager = [p for p in ds.passes("target", 0) if p < GRAPH_BASE]
    assert len(eager) == 2 + 2 + len(eager_expected)
    for p in eager[2:4]:
        meta = ds.meta("target", 0, p)
        assert meta["tensors"] == 0 and "recorded into graph" in meta["incomplete"]
    for p, (h1, h2) in zip(eager[4:], eager_expected):
        got = ds.load("target", 0, p)
        assert same_bits(torch.as_tensor(got["eager.0"]), h1) and same_bits(torch.as_tensor(got["eager.1"]), h2)
    assert stats["graph_replays"] == len(expected) and stats["dropped_passes"] == 0
    assert stats["status"] == "closed"
    r = subprocess.run([sys.executable, "-m", "fastdump", "verify", "--data", str(tmp_path)], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def _one_tensor_graph(m, rec, side, cpu):
    """A graph recording one tensor (``cpu``'s values, in mock device memory) through ``rec``,
    captured on ``side`` -> (graph, its executable)."""
    from fastdump import dtypes

    src = device_buffer(m, cpu.nbytes)
    assert m._mock.upload(src, cpu.data_ptr(), cpu.nbytes) == 0
    assert m._mock.begin_capture(side, GLOBAL) == 0
    gid = rec.begin_graph(side)
    assert rec.record(0, dtypes.code_of(cpu.dtype), 4, [cpu.numel()], [1], src, 0, side) == m.STAGED
    assert rec.end_graph() == gid
    err, graph = m._mock.end_capture(side)
    assert err == 0, m._mock.error_name(err)
    return graph, m._mock.graph_instantiate(graph)


def _graph_of_one_model(m, glue, tmp_path, monkeypatch, capture_meta=None, **attach):
    """The set-up of the replay drop and failed-channel tests below: the current stream a seam the
    test switches, a thread-writer Dumper on cuda:0 (with ``attach``'s options), Model(m, 4)
    captured on a blocking side stream (``capture_meta``: the capture pass's meta), and ``glue`` the
    current stream again for the replays -> (dumper, model, (graph, exe), side stream, recorder)."""
    from fastdump.staging import cuda

    current = Stream(glue)
    monkeypatch.setattr(cuda, "_current_stream", current)
    d = _attach(tmp_path, writer="thread", device="cuda:0", **attach)
    side = m._mock.stream_create_flags(0)
    model = Model(m, 4)
    graph, exe = capture(m, model, d, current, side, **(capture_meta or {}))
    current.raw = glue
    return d, model, (graph, exe), side, d._graphs.recorder(0)


def _assert_pass_holds(ds, p, model, x):
    """Pass ``p`` of the target holds what ``model`` computes from ``x``, bit for bit."""
    h1, h2 = model.expected(x)
    got = ds.load("target", 0, p)
    assert same_bits(torch.as_tensor(got["layers.0"]), h1) and same_bits(torch.as_tensor(got["layers.1"]), h2)


def _rank_json(root, role="target"):
    import json

    (path,) = (root / role).glob("*/rank.json")
    return json.loads(path.read_text())


def _wait_for(predicate, timeout=60.0):
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_graph_replays_outrunning_the_drain_are_dropped_and_counted(m, glue, tmp_path, monkeypatch):
    """With the drain stopped, replays fill the device replay ring; later ones are dropped inside
    the graph and counted (never written torn); the ones that fit are written intact. The drops
    are counted through the Channel as they happen: Dumper.stats() and rank.json say so while the
    Dumper runs (the drain's graph_drops note), and agree after close; under policy `block` (the
    default) `verify` fails on them: the dump is not whole (under `drop` it would warn)."""
    # 128 KiB: 64 KiB of slots, a 64 KiB replay ring = 28 entries of 2.25 KiB (a 256-byte replay
    # header and two 1 KiB tensors).
    d, model, (graph, exe), side, rec = _graph_of_one_model(m, glue, tmp_path, monkeypatch, graph_ring_mb=0.125)
    rec.set_paused(True)
    inputs = [rand_input(model, 7 + k) for k in range(40)]
    try:
        for x in inputs:
            replay(m, model, exe, glue, x)
        m._mock.sync(glue)
        assert rec.stats()["dropped_replays"] == 12
        # Counted while running, before any eager pass or close: the Channel reads the recorder.
        assert d.stats()["dropped_passes"] == 12
        _wait_for(lambda: _rank_json(tmp_path)["dropped_passes"] == 12)  # the drain's note, the writer's poll
        assert _rank_json(tmp_path)["status"] == "running"
        rec.set_paused(False)
        # A replay after the drain caught up fits again.
        assert rec.flush(30)
        replay(m, model, exe, glue, inputs[0])
        m._mock.sync(glue)
        stats = d.close()
    finally:
        release(m, [(graph, exe)], [side], [d])
    assert stats["dropped_passes"] == 12 and stats["graph_replays"] == 29
    info = _rank_json(tmp_path)
    assert info["dropped_passes"] == stats["dropped_passes"] and info["status"] == "closed"
    ds = fastdump.open(tmp_path)
    passes = graph_passes(ds, "target")
    assert len(passes) == 29
    for i, p in enumerate(passes):
        _assert_pass_holds(ds, p, model, inputs[i] if i < 28 else inputs[0])
        assert ds.meta("target", 0, p)["graph_replay"] == (i if i < 28 else 40)  # 28..39 dropped
    r = subprocess.run([sys.executable, "-m", "fastdump", "verify", "--data", str(tmp_path)], capture_output=True,
                       text=True)
    assert r.returncode == 1 and "policy 'block': 0 tensor(s) and 12 whole pass(es) were dropped" in r.stdout, \
        r.stdout + r.stderr


def test_replays_of_a_failed_channel_are_not_staged_and_are_counted(m, glue, tmp_path, monkeypatch):
    """The writer stopped writing a Dumper's channel (its root's disk full): the graph drain went on
    staging every replay into the host ring, which the writer threw away, and then broke with
    "CUDA staging stopped", naming nothing. A failed channel's replays go no further now: counted
    as dropped, the recorder broken with the reason, the Dumper stopped with the writer's error,
    and verify fails; the replays before the failure are written whole."""
    from test_faults import _recording_consumers

    consumers = _recording_consumers(monkeypatch, m)  # the engine's _C is the mock build here
    d, model, (graph, exe), side, rec = _graph_of_one_model(m, glue, tmp_path, monkeypatch)
    inputs = [rand_input(model, 50 + k) for k in range(6)]
    try:
        for x in inputs[:2]:
            replay(m, model, exe, glue, x)
        m._mock.sync(glue)
        assert rec.flush(30)
        staged = rec.stats()["span_records"]
        assert staged == 2
        consumers[-1].fail_channel(d._channel.id, "root: No space left on device (test)")
        for x in inputs[2:]:
            replay(m, model, exe, glue, x)
        m._mock.sync(glue)
        _wait_for(lambda: rec.stats()["broken"])
        after = rec.stats()
        assert after["span_records"] == staged  # nothing of a failed channel was staged
        assert "the writer stopped writing this Dumper's channel" in after["last_error"]
        d.begin_pass()  # the Dumper learns of it (and says the writer's error) at the latest here
        d.end_pass()
        stats = d.close()
    finally:
        release(m, [(graph, exe)], [side], [d])
    assert stats["status"] == "error" and "No space left on device (test)" in stats["error"], stats
    assert stats["graph_replays"] == 2 and stats["dropped_passes"] >= 4, stats
    ds = fastdump.open(tmp_path)
    passes = graph_passes(ds, "target")
    assert len(passes) == 2
    for x, p in zip(inputs, passes):
        _assert_pass_holds(ds, p, model, x)
    r = subprocess.run([sys.executable, "-m", "fastdump", "verify", "--data", str(tmp_path)], capture_output=True,
                       text=True)
    assert r.returncode == 1, r.stdout + r.stderr


def test_graph_replays_beyond_the_replay_log_are_dropped_and_counted(m, glue, tmp_path, monkeypatch):
    """The replay log bounds the replays waiting for the drain as the ring does: with the drain
    stopped and room in the ring, a replay that would take a log position the drain has not given
    back yet is dropped and counted. Taking it reused the oldest waiting entry's log slot: that
    replay was never written and the drain waited for its stamp for good."""
    from fastdump.staging import graphs

    monkeypatch.setattr(graphs, "LOG_ENTRIES", 4)
    d, model, (graph, exe), side, rec = _graph_of_one_model(  # ring: 28 entries; the meta's batch, not the leading dim
        m, glue, tmp_path, monkeypatch, capture_meta={"batch_size": 3}, graph_ring_mb=0.125)
    rec.set_paused(True)
    inputs = [rand_input(model, 500 + k) for k in range(6)]
    try:
        for x in inputs:
            replay(m, model, exe, glue, x)
        m._mock.sync(glue)
        assert rec.stats()["dropped_replays"] == 2
        rec.set_paused(False)
        assert rec.flush(30)
        stats = d.close()
    finally:
        release(m, [(graph, exe)], [side], [d])
    assert stats["dropped_passes"] == 2 and stats["graph_replays"] == 4
    ds = fastdump.open(tmp_path)
    passes = graph_passes(ds, "target")
    assert len(passes) == 4
    for i, p in enumerate(passes):
        _assert_pass_holds(ds, p, model, inputs[i])
        assert ds.meta("target", 0, p)["graph_replay"] == i  # 4 and 5 dropped
        assert ds.meta("target", 0, p)["graph_batch"] == 3


def test_graph_two_roles_target_and_draft(m, glue, tmp_path, monkeypatch):
    """EAGLE: a target and a draft Dumper, each with its own graph, replayed alternately on one
    stream; each role's passes hold its own replays."""
    from fastdump.staging import cuda

    current = Stream(glue)
    monkeypatch.setattr(cuda, "_current_stream", current)
    target = _attach(tmp_path, writer="thread", device="cuda:0", role="target")
    draft = _attach(tmp_path, writer="thread", device="cuda:0", role="draft")
    side = m._mock.stream_create_flags(0)
    tm, dm = Model(m, 2, width=128), Model(m, 2, width=32, dtype=torch.int16)
    tg = capture(m, tm, target, current, side)
    dg = capture(m, dm, draft, current, side)
    current.raw = glue
    expected = {"target": [], "draft": []}
    try:
        for k in range(5):
            for role, model, (graph, exe) in (("draft", dm, dg), ("target", tm, tg)):
                x = rand_input(model, 50 + k).to(model.cpu.dtype) if model.cpu.dtype == torch.int32 else \
                    torch.randint(-2 ** 15, 2 ** 15 - 1, model.shape, dtype=torch.int16,
                                  generator=torch.Generator().manual_seed(k))
                expected[role].append(replay(m, model, exe, glue, x))
        m._mock.sync(glue)
        draft.close()
        target.close()
    finally:
        release(m, [tg, dg], [side], [target, draft])
    ds = fastdump.open(tmp_path)
    for role in ("target", "draft"):
        passes = graph_passes(ds, role)
        assert len(passes) == 5
        for p, (h1, h2) in zip(passes, expected[role]):
            got = ds.load(role, 0, p)
            assert same_bits(torch.as_tensor(got["layers.0"]), h1)
            assert same_bits(torch.as_tensor(got["layers.1"]), h2)


# Pass 1 captures the graph; each selection leaves it out (max_bytes=1: pass 0 reaches the budget).
@pytest.mark.parametrize("selection,eager", [({"every": 3}, [0]), ({"skip_passes": 2}, [2]),
                                             ({"pass_range": (0, 1)}, [0]), ({"max_bytes": 1}, [0])])
def test_graph_captured_in_a_pass_the_selection_leaves_out_is_recorded(m, glue, tmp_path, monkeypatch, selection,
                                                                      eager):
    """Selection (every, skip_passes, pass_range, max_bytes) is of eager passes. A graph captured in
    a pass it leaves out (a runner captures at start-up, in what a user skipping warm-ups counts as
    pass 1) is still recorded: each replay is a pass of its own, bit for bit, as documented. Before,
    the capture's tensors were never hooked, and no replay was ever dumped, silently."""
    from fastdump.staging import cuda

    current = Stream(glue)
    monkeypatch.setattr(cuda, "_current_stream", current)
    monkeypatch.setattr(cuda, "_capture_running", lambda: m._mock.capture_info(current.raw)[1] != 0)
    d = _attach(tmp_path, writer="thread", device="cuda:0", **selection)
    side = m._mock.stream_create_flags(0)
    model = Model(m, 4)
    inputs = {0: rand_input(model, 0), 2: rand_input(model, 99)}
    model.set_input(glue, inputs[0])
    model.forward(d, glue)  # pass 0
    m._mock.sync(glue)
    graph, exe = capture(m, model, d, current, side, graph="decode_bs4")  # pass 1
    current.raw = glue
    expected = []
    try:
        for k in range(3):
            expected.append(replay(m, model, exe, glue, rand_input(model, 10 + k)))
        model.set_input(glue, inputs[2])
        model.forward(d, glue)  # pass 2
        m._mock.sync(glue)
        stats = d.close()
    finally:
        m._mock.sync(side)
        release(m, [(graph, exe)], [side], [d])
    ds = fastdump.open(tmp_path)
    assert [p for p in ds.passes("target", 0) if p < GRAPH_BASE] == sorted(eager + [1])  # 1 holds nothing
    for p in eager:
        got = ds.load("target", 0, p)
        h1, h2 = model.expected(inputs[p])
        assert same_bits(torch.as_tensor(got["layers.0"]), h1) and same_bits(torch.as_tensor(got["layers.1"]), h2)
    assert "recorded into graph" in ds.meta("target", 0, 1)["incomplete"]
    passes = graph_passes(ds, "target")
    assert len(passes) == 3 and stats["graph_replays"] == 3
    for p, (h1, h2) in zip(passes, expected):
        got = ds.load("target", 0, p)
        assert same_bits(torch.as_tensor(got["layers.0"]), h1) and same_bits(torch.as_tensor(got["layers.1"]), h2)
        assert ds.meta("target", 0, p)["graph"] == "decode_bs4"


def test_graph_skip_mode_keeps_the_old_behaviour(m, glue, tmp_path, monkeypatch):
    """cuda_graphs="skip": tensors hooked during a capture are skipped with a reason; replays are
    not dumped; the capture stays valid."""
    from fastdump.staging import cuda

    current = Stream(glue)
    monkeypatch.setattr(cuda, "_current_stream", current)
    d = _attach(tmp_path, writer="thread", device="cuda:0", cuda_graphs="skip")
    side = m._mock.stream_create_flags(0)
    model = Model(m, 4)
    graph, exe = capture(m, model, d, current, side)
    try:
        assert m._mock.graph_launch(exe, glue) == 0
        m._mock.sync(glue)
        d.close()
    finally:
        release(m, [(graph, exe)], [side], [d])
    ds = fastdump.open(tmp_path)
    assert ds.passes("target", 0) == [0]
    reasons = {s["name"]: s["reason"] for s in ds.meta("target", 0, 0)["skipped"]}
    assert set(reasons) == {"layers.0", "layers.1"} and all("capture" in r for r in reasons.values())


def test_graph_recorder_made_during_a_global_capture_keeps_it_valid(m, glue, tmp_path, monkeypatch):
    """No device= hint at attach: the recorder is made at the first captured tensor, inside a
    global-mode capture; its allocations run in relaxed mode and must not invalidate it."""
    from fastdump.staging import cuda

    current = Stream(glue)
    monkeypatch.setattr(cuda, "_current_stream", current)
    d = _attach(tmp_path, writer="thread")
    side = m._mock.stream_create_flags(0)
    model = Model(m, 4)
    graph, exe = capture(m, model, d, current, side)  # asserts the capture ended valid
    x = rand_input(model, 3)
    try:
        model.set_input(glue, x)
        assert m._mock.graph_launch(exe, glue) == 0
        m._mock.sync(glue)
        d.close()
    finally:
        release(m, [(graph, exe)], [side], [d])
    ds = fastdump.open(tmp_path)
    (p,) = graph_passes(ds, "target")
    h1, h2 = model.expected(x)
    got = ds.load("target", 0, p)
    assert same_bits(torch.as_tensor(got["layers.0"]), h1) and same_bits(torch.as_tensor(got["layers.1"]), h2)


def test_graph_option_validation(tmp_path):
    with pytest.raises(ValueError, match="cuda_graphs"):
        _attach(tmp_path, cuda_graphs="replay")
    with pytest.raises(ValueError, match="graph_ring_mb"):
        _attach(tmp_path, graph_ring_mb=0)
    from fastdump.config import settings_from_env

    got = settings_from_env({"FASTDUMP_DIR": str(tmp_path), "FASTDUMP_CUDA_GRAPHS": "skip",
                             "FASTDUMP_GRAPH_RING_MB": "64"})
    assert got["cuda_graphs"] == "skip" and got["graph_ring_mb"] == 64.0
    from fastdump.config import ConfigError

    with pytest.raises(ConfigError, match="FASTDUMP_CUDA_GRAPHS"):
        settings_from_env({"FASTDUMP_DIR": str(tmp_path), "FASTDUMP_CUDA_GRAPHS": "on"})


def test_graph_no_recording_memory_skips_with_reason_and_keeps_the_capture(m, glue, tmp_path, monkeypatch):
    """The serving engine took the GPU's memory before attach: no recorder; tensors hooked during
    the capture are skipped with the reason, the capture stays valid, and no CUDA error is left
    behind for the framework's next call (cudaGetLastError). The graph's replays run undumped:
    counted as a graph not dumped, and verify fails (it said OK, the skips looked like the whole
    story while every replay was lost)."""
    from fastdump.cli.dump import verify_dump
    from fastdump.staging import cuda

    current = Stream(glue)
    monkeypatch.setattr(cuda, "_current_stream", current)
    model = Model(m, 4)
    # Memory taken: the attach's two allocations (staging ring, recording memory) fail.
    m._mock.fail("cudaMalloc", 2, 2)  # cudaErrorMemoryAllocation
    d = _attach(tmp_path, writer="thread", device="cuda:0")
    device_buffer(m, 256)  # raises on a leftover error of the failed allocations
    side = m._mock.stream_create_flags(0)
    graph, exe = capture(m, model, d, current, side)
    try:
        assert m._mock.graph_launch(exe, glue) == 0
        m._mock.sync(glue)
        stats = d.close()
    finally:
        release(m, [(graph, exe)], [side])
    ds = fastdump.open(tmp_path)
    assert graph_passes(ds, "target") == [] and stats.get("graph_replays", 0) == 0
    reasons = [s["reason"] for s in ds.meta("target", 0, 0)["skipped"]]
    assert len(reasons) == 2 and all("CUDA-graph recording memory" in r for r in reasons), reasons
    assert stats["graphs_not_dumped"] == 1
    assert "not dumped (no recorder: cannot allocate the CUDA-graph recording memory" in ds.meta("target", 0, 0)["incomplete"]
    problems = verify_dump(str(tmp_path)).problems
    assert len(problems) == 1 and problems[0].endswith(
        "1 CUDA graph(s) captured while dumping cannot be dumped: their replays ran unseen (see the capture "
        "pass's incomplete reason)"), problems


def test_graph_close_honours_its_timeout_with_a_stalled_writer(m):
    """Review finding 5: a writer that is alive but consumes nothing. The drain staged the replays
    the host ring holds and waits for space for the next (up to 10 s per replay). close(timeout)
    returns within about its timeout (before: flush's timeout, then the drain's 10 s wait for every
    stamped replay, i.e. minutes), and every replay is accounted for: written, or counted as
    unwritten (a dropped pass), none lost."""
    import threading
    import time

    ring = Ring(m, capacity=1 << 20)  # nobody reads it: the stalled writer
    stager = m.CudaStager(ring.producer, 4 << 20)
    stager.register_host()
    rec = m.GraphRecorder(stager, 0, 0, 1 << 20, 8 << 20, 64)
    side, launch = m._mock.stream_create_flags(0), m._mock.stream_create()
    cpu = torch.arange(32 << 10, dtype=torch.int32)  # 128 KiB a replay: about 7 fit in the host ring
    graph, exe = _one_tensor_graph(m, rec, side, cpu)
    n_replays, timeout = 20, 1.0
    closer = None
    try:
        for _ in range(n_replays):
            assert m._mock.graph_launch(exe, launch) == 0
        m._mock.sync(launch)
        _wait_for(lambda: stager.stats()["host_ring_full_waits"] > 0, 30)  # the drain waits for the writer
        staged_before_close = rec.stats()["replays"]
        assert 0 < staged_before_close < n_replays
        took = []

        def close():
            t0 = time.monotonic()
            rec.close(timeout)
            took.append(time.monotonic() - t0)

        closer = threading.Thread(target=close)
        closer.start()
        closer.join(timeout + 4)
        assert not closer.is_alive(), "close() outlasted its timeout by seconds (the writer is stalled)"
        assert timeout - 0.1 <= took[0] < timeout + 3
        s = rec.stats()
        assert s["replays"] + s["dropped_replays"] == n_replays, s
        assert s["unwritten_replays"] == s["dropped_replays"] == n_replays - s["replays"] > 0, s
        assert s["span_records"] <= s["replays"] + 1  # at most the one whose wait close() ended was tried
        got, _ = ring.read()  # the written replays, whole (read() asserts nothing is torn)
        assert len(got) == s["replays"]
    finally:
        if closer is not None and closer.is_alive():  # the old behaviour: let the writer consume so it ends
            while closer.is_alive():
                ring.read(timeout=0.05)
            closer.join()
        m._mock.graph_exec_destroy(exe)
        m._mock.graph_destroy(graph)
        rec.close(10.0, True)
        stager.close()
        m._mock.stream_destroy(side)
        m._mock.stream_destroy(launch)


@pytest.mark.slow
def test_graph_stress_driver():
    """The C++ driver (tests/cuda_mock/graph_stress.cpp): three graphs captured on three threads in
    global and thread-local mode, unsynchronized replays, drains paused and restarted; every pass
    checked byte for byte, passes + dropped = replays (run_stress.sh also runs it under TSan)."""
    from test_cuda import mock_driver

    out = mock_driver("graph_stress", ["csrc/cuda_staging.cu", "csrc/cuda_graph_record.cu"], "-O2")
    r = subprocess.run([str(out), "300", "3"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 errors" in r.stdout


# =================================================================================================
# On a real GPU (pytest -m cuda; benchmarks/gpu_check.sh): torch.cuda.graph / CUDAGraph.replay()


def _gpu_model(width=256, layers=3):
    torch.manual_seed(0)
    layers_ = [torch.nn.Linear(width, width) for _ in range(layers)]
    return torch.nn.Sequential(*[m for lin in layers_ for m in (lin, torch.nn.GELU())]).cuda().to(torch.bfloat16)


def _gpu_capture(model, static_in, stream, mode="global"):
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up, as graph runners do
            model(static_in)
    stream.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream, capture_error_mode=mode):
        out = model(static_in)
    return g, out


@pytest.mark.cuda
@needs_cuda_build
@pytest.mark.parametrize("mode", ["global", "thread_local"])
def test_gpu_graph_record_bit_exact_per_replay(tmp_path, mode):
    """Two graphs (batch 4 and 16) on a side stream, replays with fresh inputs interleaved with an
    eager pass: every replay is a pass equal, bit for bit, to what the graph computed."""
    model = _gpu_model()
    d = fastdump.attach(model, tmp_path, tp_rank=0, tp_size=1, writer="thread", strict=True, device="cuda:0")
    stream = torch.cuda.Stream()
    graphs, want = {}, []
    with torch.inference_mode():
        for bs in (4, 16):
            static_in = torch.randn(bs, 256, device="cuda", dtype=torch.bfloat16)
            g, out = _gpu_capture(model, static_in, stream, mode)
            graphs[bs] = (g, static_in, out)
        for k, bs in enumerate([4, 16, 16, 4, 16]):
            g, static_in, out = graphs[bs]
            with torch.cuda.stream(stream):
                static_in.copy_(torch.randn(bs, 256, device="cuda", dtype=torch.bfloat16))
                g.replay()
                want.append((bs, out.clone()))
            if k == 2:
                stream.synchronize()
                model(torch.randn(2, 256, device="cuda", dtype=torch.bfloat16))  # an eager pass
        torch.cuda.synchronize()
        stats = d.close()
    ds = fastdump.open(tmp_path)
    passes = graph_passes(ds, "target")
    assert len(passes) == len(want) and stats["dropped_passes"] == 0
    for p, (bs, out) in zip(passes, want):
        got = ds.load("target", 0, p)
        assert same_bits(torch.as_tensor(got["Sequential"]), out.cpu()), p
        assert ds.meta("target", 0, p)["graph_batch"] == bs
    assert len(ds.names("target", 0)) == 7  # six leaves and the root


@pytest.mark.cuda
@needs_cuda_build
def test_gpu_graph_record_two_roles_replays_outrun_drain(tmp_path):
    """Target and draft Dumpers with their own graphs; the draft's drain paused while its graph is
    replayed more often than its replay ring holds: drops counted, the rest intact."""
    target, draft = _gpu_model(), _gpu_model(width=128, layers=1)
    dt = fastdump.attach(target, tmp_path, role="target", tp_rank=0, tp_size=1, writer="thread", strict=True,
                         device="cuda:0")
    dd = fastdump.attach(draft, tmp_path, role="draft", tp_rank=0, tp_size=1, writer="thread", strict=True,
                         device="cuda:0", graph_ring_mb=0.25)
    stream = torch.cuda.Stream()
    with torch.inference_mode():
        tin = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
        din = torch.randn(8, 128, device="cuda", dtype=torch.bfloat16)
        tg, tout = _gpu_capture(target, tin, stream)
        dg, dout = _gpu_capture(draft, din, stream)
        dd._graphs.recorder(0).set_paused(True)
        want_t, want_d = [], []
        for _ in range(200):
            with torch.cuda.stream(stream):
                din.normal_()
                dg.replay()
                want_d.append(dout.clone())
                tin.normal_()
                tg.replay()
                want_t.append(tout.clone())
        torch.cuda.synchronize()
        dropped = dd._graphs.recorder(0).stats()["dropped_replays"]
        assert dropped > 0
        dd._graphs.recorder(0).set_paused(False)
        st, sd = dt.close(), dd.close()
    assert st["dropped_passes"] == 0 and sd["dropped_passes"] == dropped
    ds = fastdump.open(tmp_path)
    tp, dp = graph_passes(ds, "target"), graph_passes(ds, "draft")
    assert len(tp) == 200 and len(dp) == 200 - dropped
    for p, w in zip(tp, want_t):
        assert same_bits(torch.as_tensor(ds.load("target", 0, p)["Sequential"]), w.cpu())
    for p in dp:
        replay = ds.meta("draft", 0, p)["graph_replay"]
        assert same_bits(torch.as_tensor(ds.load("draft", 0, p)["Sequential"]), want_d[replay].cpu())


class _GpuView(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, h):
        return self.fn(h)


class _GpuOddOutputs(torch.nn.Module):
    """Module outputs a graph records with the gather kernel or an odd-sized copy: a stride-3 view at
    a 2-byte offset, a transpose, a zero-size slice, an offset block, rows of 99 bf16 (198 bytes)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(256, 99)
        self.strided = _GpuView(lambda h: h[:, 1::3])
        self.transposed = _GpuView(lambda h: h.t())
        self.empty = _GpuView(lambda h: h[:0])
        self.block = _GpuView(lambda h: h[1:, 3:50])
        self.last = None

    def forward(self, x):
        h = self.lin(x)
        self.last = h  # (the graph's static tensor: what each replay computed)
        self.strided(h), self.transposed(h), self.empty(h), self.block(h)
        return h * 2


@pytest.mark.cuda
@needs_cuda_build
def test_gpu_graph_record_odd_layouts_bit_exact(tmp_path):
    """Record mode's snapshots inside the graph (snapshot_whole: the gather kernel in 1- to 16-byte
    units, cudaMemcpyAsync of odd sizes) and the copy kernel's 16-byte units over the 256-byte
    slots: every replay's views, at odd offsets and strides, and an empty one, bit for bit."""
    torch.manual_seed(0)
    model = _GpuOddOutputs().cuda().to(torch.bfloat16)
    d = fastdump.attach(model, tmp_path, tp_rank=0, tp_size=1, writer="thread", strict=True, device="cuda:0")
    stream = torch.cuda.Stream()
    want = []
    with torch.inference_mode():
        static_in = torch.randn(7, 256, device="cuda", dtype=torch.bfloat16)
        g, out = _gpu_capture(model, static_in, stream)
        h = model.last
        for _ in range(3):
            with torch.cuda.stream(stream):
                static_in.normal_()
                g.replay()
                want.append((h.clone(), out.clone()))
        torch.cuda.synchronize()
        stats = d.close()
    assert stats["dropped_passes"] == 0
    ds = fastdump.open(tmp_path)
    passes = graph_passes(ds, "target")
    assert len(passes) == len(want)
    for p, (hv, o) in zip(passes, want):
        got = {k: torch.as_tensor(v) for k, v in ds.load("target", 0, p).items()}
        hv = hv.cpu()
        assert same_bits(got["lin"], hv), p
        assert same_bits(got["strided"], hv[:, 1::3].contiguous()), p
        assert same_bits(got["transposed"], hv.t().contiguous()), p
        assert tuple(got["empty"].shape) == (0, 99), p
        assert same_bits(got["block"], hv[1:, 3:50].contiguous()), p
        assert same_bits(got["_GpuOddOutputs"], o.cpu()), p


@pytest.mark.cuda
@needs_cuda_build
def test_gpu_capture_in_global_mode_while_the_drain_copies(tmp_path):
    """A graph captured in global mode (torch's default) while the stager's drain still has an
    eager pass's copies to issue and poll (cudaStreamWaitEvent, cudaMemcpyBatchAsync, cudaEventQuery
    on another thread): the drain's relaxed capture mode must keep those calls legal and the
    capture valid. The mock models the rules; only the runtime can say they are these. Both the
    eager pass and the replays are dumped bit for bit, and staging is not broken."""
    model = _gpu_model()
    dt = fastdump.attach(model, tmp_path, role="target", tp_rank=0, tp_size=1, writer="thread", strict=True,
                         device="cuda:0")
    de = fastdump.attach(None, tmp_path, role="draft", tp_rank=0, tp_size=1, writer="thread", strict=True,
                         device="cuda:0")
    stager = dt._engine.cuda_stager(dt.device_ring_mb)
    stream = torch.cuda.Stream()
    with torch.inference_mode():
        static_in = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up on the capture stream
                model(static_in)
        torch.cuda.synchronize()
        eager = [torch.randn(1 << 16, device="cuda") * (i + 1) for i in range(40)]
        torch.cuda.synchronize()
        # The default stream spins ~0.25 s: the eager snapshots, and so the drain's copies and its
        # event polls, wait behind it while the capture below runs (no synchronize before it:
        # CUDAGraph.capture_begin, not torch.cuda.graph, which synchronizes first).
        torch.cuda._sleep(int(5e8))
        de.begin_pass()
        for i, t in enumerate(eager):
            de.dump(f"e{i}", t)
        de.end_pass()  # the batch is sealed: the drain waits on it and issues its copies now
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            g.capture_begin(capture_error_mode="global")
            out = model(static_in)
            g.capture_end()
        overlapped = stager.completed(0) < stager.submitted(0)  # the copies were still in flight
        want = []
        for _ in range(3):
            with torch.cuda.stream(stream):
                static_in.normal_()
                g.replay()
                want.append(out.clone())
        torch.cuda.synchronize()
        st = stager.stats()
        sd, se = dt.close(), de.close()
    assert overlapped, "the capture did not overlap the drain's work: the check is void"
    assert not st["broken"] and st["last_error"] == "", st
    assert sd["dropped_passes"] == 0 and se["dropped_passes"] == 0
    ds = fastdump.open(tmp_path)
    got = ds.load("draft", 0, ds.passes("draft", 0)[0])
    for i, t in enumerate(eager):
        assert same_bits(torch.as_tensor(got[f"e{i}"]), t.cpu()), i
    tp = graph_passes(ds, "target")
    assert len(tp) == len(want)
    for p, w in zip(tp, want):
        assert same_bits(torch.as_tensor(ds.load("target", 0, p)["Sequential"]), w.cpu()), p


@pytest.mark.cuda
@needs_cuda_build
def test_gpu_recapture_never_breaks_another_threads_raw_capture(tmp_path):
    """On a GPU (the mock models it: test_reclaiming_slots_never_breaks_another_threads_raw_capture):
    a torch graph reset and captured again (its slots reclaimed as the capture begins) while another
    thread holds a raw CuPy capture in thread-local mode: the slots come back through the graph's
    done event (an event record node), never a cudaDeviceSynchronize, which would invalidate the
    CuPy capture; the recaptured graph's replay is dumped bit-exact. Also checks that
    cudaEventSynchronize works on an event recorded by a graph's event record node."""
    import threading

    cupy = pytest.importorskip("cupy")
    model = _gpu_model()
    d = fastdump.attach(model, tmp_path, tp_rank=0, tp_size=1, writer="thread", strict=True, device="cuda:0")
    stream = torch.cuda.Stream()
    began, done, result = threading.Event(), threading.Event(), {}

    def other_thread():
        try:
            cupy.cuda.Device(0).use()
            s = cupy.cuda.Stream(non_blocking=True)
            x = cupy.ones(1024, dtype=cupy.float32)
            with s:
                x *= 2  # (compiled and loaded now: no module load inside the capture)
            s.synchronize()
            s.begin_capture(mode=cupy.cuda.runtime.streamCaptureModeThreadLocal)
            with s:
                x *= 2
            began.set()
            done.wait(60)
            result["graph"] = s.end_capture()
        except Exception as exc:  # (reported below)
            result["error"] = repr(exc)
        finally:
            began.set()

    with torch.inference_mode():
        static_in = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
        g, out = _gpu_capture(model, static_in, stream)
        with torch.cuda.stream(stream):
            g.replay()  # still running, maybe, when the graph is reset
        g.reset()
        t = threading.Thread(target=other_thread)
        t.start()
        assert began.wait(60) and "error" not in result, result
        g2 = torch.cuda.CUDAGraph()  # (not torch.cuda.graph: its __enter__ synchronizes the device itself)
        with torch.cuda.stream(stream):
            g2.capture_begin(capture_error_mode="thread_local")
            out2 = model(static_in)
            g2.capture_end()
        done.set()
        t.join(60)
        rec = d._graphs.recorder(0).stats()
        with torch.cuda.stream(stream):
            static_in.copy_(torch.randn(4, 256, device="cuda", dtype=torch.bfloat16))
            g2.replay()
            want = out2.clone()
        stream.synchronize()
        stats = d.close()
    assert "error" not in result and result.get("graph") is not None, result
    assert rec["reclaimed_graphs"] == 1, rec
    passes = graph_passes(fastdump.open(tmp_path), "target")
    assert stats["dropped_passes"] == 0 and len(passes) == 2
    got = fastdump.open(tmp_path).load("target", 0, passes[-1])
    assert same_bits(torch.as_tensor(got["Sequential"]), want.cpu())


def test_graph_recording_memory_is_freed_when_no_graph_can_use_it(m, glue, tmp_path, monkeypatch):
    """Without a committed graph the recorder's device memory goes at close; with one, it stays
    (replays write into it) until free_device_memory() after the graph is destroyed."""
    from fastdump.staging import cuda

    current = Stream(glue)
    monkeypatch.setattr(cuda, "_current_stream", current)
    model = Model(m, 4)
    live = lambda: m._mock.counters()["live_allocs"]  # noqa: E731
    base = live()
    d = _attach(tmp_path / "a", writer="thread", device="cuda:0")
    assert live() >= base + 2  # the staging ring and the recording memory, at attach
    d.close()
    assert live() == base  # engine gone (staging ring), recorder freed: it never held a graph
    d = _attach(tmp_path / "b", writer="thread", device="cuda:0")
    side = m._mock.stream_create_flags(0)
    graph, exe = capture(m, model, d, current, side)
    d.close()
    assert live() == base + 1  # the graph still exists: its recording memory stays
    release(m, [(graph, exe)], [side], [d])
    assert live() == base


def test_graph_replays_drained_while_the_next_graph_is_captured(m, glue, tmp_path, monkeypatch):
    """A runner captures its next batch size (global mode) while another thread replays the first
    graph and the drain turns those replays into passes: the capture stays valid, every replay of
    both graphs is dumped bit-exact."""
    import threading

    from fastdump.staging import cuda

    m._mock.set("max_delay_us", 100)
    current = Stream(glue)
    monkeypatch.setattr(cuda, "_current_stream", current)
    d = _attach(tmp_path, writer="thread", device="cuda:0")
    side, side2, other = m._mock.stream_create_flags(0), m._mock.stream_create_flags(0), m._mock.stream_create()
    a, b = Model(m, 4), Model(m, 8)
    inputs = [rand_input(a, 300 + k) for k in range(30)]
    srcs = []
    for x in inputs:  # uploaded before the capture: no allocation while it runs
        src = device_buffer(m, a.nbytes)
        assert m._mock.upload(src, x.contiguous().data_ptr(), a.nbytes) == 0
        srcs.append(src)
    ga = capture(m, a, d, current, side)
    started = threading.Event()

    def replay():
        for src in srcs:
            assert m._mock.enqueue_copy(other, a.x, src, a.nbytes) == 0
            assert m._mock.graph_launch(ga[1], other) == 0
            started.set()
        m._mock.sync(other)

    th = threading.Thread(target=replay)
    th.start()
    started.wait(30)
    gb = capture(m, b, d, current, side2)  # asserts it ended valid
    th.join()
    xb = rand_input(b, 9)
    b.set_input(glue, xb)
    assert m._mock.graph_launch(gb[1], glue) == 0
    m._mock.sync(glue)
    try:
        stats = d.close()
    finally:
        release(m, [ga, gb], [side, side2, other], [d])
    assert stats["graph_replays"] == 31 and stats["dropped_passes"] == 0
    ds = fastdump.open(tmp_path)
    passes = graph_passes(ds, "target")
    for p in passes:
        meta = ds.meta("target", 0, p)
        model, x = (a, inputs[meta["graph_replay"]]) if meta["cuda_graph"] == 0 else (b, xb)
        h1, h2 = model.expected(x)
        got = ds.load("target", 0, p)
        assert same_bits(torch.as_tensor(got["layers.0"]), h1) and same_bits(torch.as_tensor(got["layers.1"]), h2)
    assert [ds.meta("target", 0, p)["graph_replay"] for p in passes if ds.meta("target", 0, p)["cuda_graph"] == 0] \
        == list(range(30))


def test_graph_tensor_that_does_not_fit_is_skipped_in_every_replay(m, glue, tmp_path, monkeypatch):
    """Slots full: the second output is not recorded; the capture pass and every replay pass say
    so (skipped, with the reason), the first output is still dumped bit-exact."""
    from fastdump.staging import cuda

    current = Stream(glue)
    monkeypatch.setattr(cuda, "_current_stream", current)
    d = _attach(tmp_path, writer="thread", device="cuda:0", graph_ring_mb=0.125)  # 64 KiB of slots
    side = m._mock.stream_create_flags(0)
    model = Model(m, 64, width=160)  # 40 KiB per output: the second does not fit
    graph, exe = capture(m, model, d, current, side)
    xs = [rand_input(model, 70 + k) for k in range(3)]
    try:
        for x in xs:  # one replay at a time: the 64 KiB replay ring holds one 40 KiB entry
            model.set_input(glue, x)
            assert m._mock.graph_launch(exe, glue) == 0
            m._mock.sync(glue)
            assert d._graphs.recorder(0).flush(30)
        stats = d.close()
    finally:
        release(m, [(graph, exe)], [side], [d])
    assert stats["graph_replays"] == 3 and stats["dropped_passes"] == 0
    ds = fastdump.open(tmp_path)
    capture_pass = [p for p in ds.passes("target", 0) if p < GRAPH_BASE][-1]
    assert [s["name"] for s in ds.meta("target", 0, capture_pass)["skipped"]] == ["layers.1"]
    for p, x in zip(graph_passes(ds, "target"), xs):
        got = ds.load("target", 0, p)
        assert set(got) == {"layers.0"} and same_bits(torch.as_tensor(got["layers.0"]), model.expected(x)[0])
        (skip,) = ds.meta("target", 0, p)["skipped"]
        assert skip["name"] == "layers.1" and "graph_ring_mb" in skip["reason"]


# =================================================================================================
# One record per replay (the writer splits it), and the wire messages it travels with


class Chain:
    """``n`` 'layers' on mock device memory, each output h_i = x + (i + 1) bytewise, seen as a
    tensor of its own dtype and shape (same byte count): many tensors of mixed dtypes per graph."""

    LOOKS = [(torch.int32, 1), (torch.int16, 2), (torch.uint8, 4), (torch.float32, 1), (torch.bfloat16, 2)]

    def __init__(self, m, batch, n, width=16):
        self.m, self.n = m, n
        self.shape = (batch, width)  # of the int32 input
        self.nbytes = batch * width * 4
        self.x = device_buffer(m, self.nbytes)
        self.h = [device_buffer(m, self.nbytes) for _ in range(n)]
        self.views = []
        for i in range(n):
            dtype, widen = self.LOOKS[i % len(self.LOOKS)]
            self.views.append(torch.zeros((batch, width * widen), dtype=dtype))

    def forward(self, dumper, stream):
        m = self.m
        dumper.begin_pass()
        for i, h in enumerate(self.h):
            assert m._mock.enqueue_copy(stream, h, self.x, self.nbytes) == 0
            for _ in range(i + 1):
                assert m._mock.enqueue_increment(stream, h, self.nbytes) == 0
            dumper.dump(f"chain.{i}", FakeCudaTensor(self.views[i], h))
        for h in self.h:  # later kernels overwrite every output in place
            assert m._mock.enqueue_fill(stream, h, self.nbytes, 0xEE) == 0
        dumper.end_pass()

    def expected(self, x: torch.Tensor) -> list:
        b = x.contiguous().view(torch.uint8)
        return [(b + (i + 1)).view(v.dtype).reshape(v.shape) for i, v in enumerate(self.views)]

    def set_input(self, stream, x: torch.Tensor) -> None:
        src = device_buffer(self.m, self.nbytes)
        assert self.m._mock.upload(src, x.contiguous().data_ptr(), self.nbytes) == 0
        assert self.m._mock.enqueue_copy(stream, self.x, src, self.nbytes) == 0


class _RingTap:
    """A Consumer seen through: every record the writer takes off the ring, payload copied."""

    def __init__(self, inner, seen):
        self._inner, self._seen = inner, seen

    def next_batch(self, *args, **kwargs):
        from fastdump import protocol

        batch = self._inner.next_batch(*args, **kwargs)
        for item in batch:
            r = protocol.Record._make(item)
            self._seen.append(r._replace(payload=bytes(r.payload)))
        return batch

    def __getattr__(self, name):
        return getattr(self._inner, name)


@pytest.fixture
def ring_tap(monkeypatch):
    from fastdump.writer import loop

    seen = []
    init = loop.WriterLoop.__init__
    monkeypatch.setattr(loop.WriterLoop, "__init__",
                        lambda self, consumer, *a, **k: init(self, _RingTap(consumer, seen), *a, **k))
    return seen


def _same_shape_of_message(got: dict, want: dict) -> None:
    """Same keys, and the same JSON types per key (recursively for dicts)."""
    assert set(got) == set(want), (sorted(got), sorted(want))
    for key, value in want.items():
        assert type(got[key]) is type(value), (key, got[key], value)
        if isinstance(value, dict):
            _same_shape_of_message(got[key], value)


@pytest.mark.parametrize("mode", [GLOBAL, THREAD_LOCAL])
def test_graph_replay_is_one_span_record_split_by_the_writer(m, glue, tmp_path, monkeypatch, ring_tap, mode):
    """Two graphs (batch 2 and 6) of 12 tensors of mixed dtypes sharing one engine: per replay the
    drain stages ONE record (O(1) host work, whatever the tensor count), which the writer splits
    into the pass's tensors, bit-exact. The ring holds exactly: the graph layouts (``graph``
    messages, built by protocol.graph), one span record per replay whose GPU-written header matches
    the record, and the drain's ``graph_drops`` note (protocol.graph_drops's keys and types); no
    begin/end of replay passes is built in C++ any more."""
    from fastdump import protocol
    from fastdump.staging import cuda

    current = Stream(glue)
    monkeypatch.setattr(cuda, "_current_stream", current)
    # 0.5 MiB: a 256 KiB replay ring; the batch-6 span is 256 + 12 * 384 bytes.
    d = _attach(tmp_path, writer="thread", device="cuda:0", graph_ring_mb=0.5)
    side = m._mock.stream_create_flags(0)
    chains = {2: Chain(m, 2, 12), 6: Chain(m, 6, 12)}
    for bs, chain in chains.items():
        current.raw = glue
        chain.set_input(glue, rand_input(chain, bs))
        chain.forward(d, glue)
    m._mock.sync(glue)
    execs = {bs: capture(m, chain, d, current, side, mode, batch_size=bs) for bs, chain in chains.items()}
    current.raw = glue
    rec = d._graphs.recorder(0)
    stager = d._engine.cuda_stager(d.device_ring_mb)
    staged_before = stager.stats()["tensors"]
    expected, counts = [], {2: 0, 6: 0}
    try:
        order = [2, 6, 6, 2, 6, 2, 2, 6]
        for k, bs in enumerate(order):
            x = rand_input(chains[bs], 300 + k)
            expected.append((bs, counts[bs], replay(m, chains[bs], execs[bs][1], glue, x)))
            counts[bs] += 1
        m._mock.sync(glue)
        assert rec.flush(60)
        s = rec.stats()
        assert s["span_records"] == len(order) and s["replays"] == len(order) and s["tensors"] == 12 * len(order)
        assert stager.stats()["tensors"] - staged_before == len(order)  # one staging call per replay
        # Replays that outrun the paused drain: dropped on the device, counted, noted to the writer.
        rec.set_paused(True)
        big = chains[6]
        span = rec.layout(1)["span_bytes"]
        fits = (256 << 10) // span
        for k in range(fits + 5):
            big.set_input(glue, rand_input(big, 900 + k))
            assert m._mock.graph_launch(execs[6][1], glue) == 0
        m._mock.sync(glue)
        dropped = rec.stats()["dropped_replays"]
        assert dropped >= 5
        _wait_for(lambda: any(r.kind == m.KIND_CONTROL and b'"graph_drops"' in r.payload for r in ring_tap))
        rec.set_paused(False)
        ch = d._channel.id  # (close() lets go of the channel)
        stats = d.close()
    finally:
        m._mock.sync(side)
        release(m, execs.values(), [side], [d])
    assert stats["dropped_passes"] == dropped and stats["graph_replays"] == len(order) + fits + 5 - dropped

    mine = [r for r in ring_tap if r.channel == ch]
    controls = [protocol.decode(r.payload) for r in mine if r.kind == m.KIND_CONTROL]
    graphs = [c for c in controls if c["op"] == "graph"]
    assert [g["graph"] for g in graphs] == [0, 1]
    for g, bs in zip(graphs, (2, 6)):
        layout = rec.layout(g["graph"])
        want = protocol.graph(ch, 0, g["graph"], layout["span_name_id"], layout["span_bytes"], layout["tensors"],
                              {"batch_size": bs, "cuda_graph": g["graph"], "graph_batch": bs}, {})
        assert g == want
        assert [t[1] for t in g["tensors"]] == [dtypes_code(v.dtype) for v in chains[bs].views]
    notes = [c for c in controls if c["op"] == "graph_drops"]
    assert notes and notes[-1]["dropped_passes"] == dropped
    for note in notes:
        _same_shape_of_message(note, protocol.graph_drops(ch, 0, 1))
    # The drain builds no begin/end: every replay pass is one span record, nothing else.
    assert not [c for c in controls if c.get("pass", 0) >= GRAPH_BASE]
    spans = [r for r in mine if r.kind == m.KIND_TENSOR and r.pass_id >= GRAPH_BASE]
    assert len(spans) == stats["graph_replays"]
    names = {g["span_name_id"]: g for g in graphs}
    replays_seen = {0: [], 1: []}
    for r in spans:
        g = names[r.name_id]
        assert r.dtype == protocol.REPLAY_SPAN_DTYPE and r.shape == (g["span_bytes"],)
        assert (r.offset, r.total) == (0, g["span_bytes"]) and len(r.payload) == g["span_bytes"]
        h = protocol.replay_header(r.payload)
        assert h == (protocol.REPLAY_MAGIC, r.pass_id, h.replay, r.name_id, g["span_bytes"], g["graph"])
        replays_seen[g["graph"]].append(h.replay)
    assert replays_seen[0] == list(range(counts[2]))
    assert replays_seen[1][:counts[6]] == list(range(counts[6]))
    assert replays_seen[1][counts[6]:] == list(range(counts[6], counts[6] + fits)) + \
        list(range(counts[6] + fits + 5, counts[6] + fits + 5 + (stats["graph_replays"] - len(order) - fits)))

    # On disk: each replay's pass, bit-exact, with the meta the writer built with protocol.begin/end.
    ds = fastdump.open(tmp_path)
    passes = graph_passes(ds, "target")
    assert len(passes) == stats["graph_replays"]
    for p, (bs, index, want) in zip(passes, expected):
        got = ds.load("target", 0, p)
        assert sorted(got) == sorted(f"chain.{i}" for i in range(12))
        for i, w in enumerate(want):
            assert same_bits(torch.as_tensor(got[f"chain.{i}"]), w), (p, i)
        meta = ds.meta("target", 0, p)
        assert (meta["cuda_graph"], meta["graph_batch"], meta["graph_replay"]) == ((0 if bs == 2 else 1), bs, index)
        assert all(type(meta[k]) is int for k in ("cuda_graph", "graph_batch", "graph_replay"))
        assert meta["complete"] and meta["tensors"] == 12
    r = subprocess.run([sys.executable, "-m", "fastdump", "verify", "--data", str(tmp_path)], capture_output=True,
                       text=True)
    # The replays the paused drain dropped make the dump not whole (policy block); nothing else fails.
    assert r.returncode == 1 and f"{stats['dropped_passes']} whole pass(es) were dropped" in r.stdout, r.stdout
    assert "policy 'block'" in r.stdout and "1 problem(s)" in r.stdout, r.stdout


def dtypes_code(dtype):
    from fastdump import dtypes

    return dtypes.code_of(dtype)


def test_graph_replay_span_larger_than_a_record_is_chunked_and_reassembled(m, glue, tmp_path, monkeypatch,
                                                                             ring_tap):
    """A replay span above the ring's record size (1 MiB ring: 256 KiB records) travels as several
    chunks of one record; the writer reassembles it, then splits it: bit-exact per replay."""
    from fastdump.staging import cuda

    current = Stream(glue)
    monkeypatch.setattr(cuda, "_current_stream", current)
    # graph_ring_mb=6: a 3 MiB replay ring holds all four replays (512 KiB + header each), so none
    # is dropped however slowly the drain goes: it is paused while they run (with 4, a 2 MiB ring
    # held three and the fourth was dropped whenever the replays outran the drain; drops have a test
    # of their own)
    d = _attach(tmp_path, writer="thread", device="cuda:0", ring_mb=1, graph_ring_mb=6)
    side = m._mock.stream_create_flags(0)
    model = Model(m, 512, width=128)  # two 256 KiB tensors per replay
    graph, exe = capture(m, model, d, current, side)
    current.raw = glue
    expected = []
    for rec in d._graphs._recorders.values():
        rec.set_paused(True)
    try:
        for k in range(4):
            expected.append(replay(m, model, exe, glue, rand_input(model, 40 + k)))
        m._mock.sync(glue)
        for rec in d._graphs._recorders.values():
            rec.set_paused(False)
        stats = d.close()
    finally:
        release(m, [(graph, exe)], [side], [d])
    assert stats["graph_replays"] == 4 and stats["dropped_passes"] == 0
    chunks = [r for r in ring_tap if r.kind == m.KIND_TENSOR and r.pass_id == GRAPH_BASE]
    assert len(chunks) >= 3 and sum(len(r.payload) for r in chunks) == chunks[0].total
    ds = fastdump.open(tmp_path)
    passes = graph_passes(ds, "target")
    assert len(passes) == 4
    for p, (h1, h2) in zip(passes, expected):
        got = ds.load("target", 0, p)
        assert same_bits(torch.as_tensor(got["layers.0"]), h1) and same_bits(torch.as_tensor(got["layers.1"]), h2)


def test_replay_wire_constants_match_the_extension(m):
    """protocol.py's replay-span constants and header layout are the C++ ones (the GPU writes the
    header, the writer reads it): checked against the mock build and, when built with CUDA, the
    real extension."""
    from fastdump import _C as real
    from fastdump import protocol

    builds = [m] + ([real] if hasattr(real, "REPLAY_MAGIC") else [])
    for C in builds:
        assert C.GRAPH_PASS_BASE == protocol.GRAPH_PASS_BASE
        assert C.REPLAY_SPAN_DTYPE == protocol.REPLAY_SPAN_DTYPE
        assert C.GRAPH_SPAN_NAME_BASE == protocol.GRAPH_SPAN_NAME_BASE
        assert C.GRAPHS_PER_RECORDER == protocol.GRAPHS_PER_RECORDER
        assert C.REPLAY_HEADER_BYTES == protocol.REPLAY_HEADER_BYTES
        assert C.REPLAY_MAGIC == protocol.REPLAY_MAGIC
        assert list(C.REPLAY_HEADER_FIELDS) == [(f, 8 * i) for i, f in enumerate(protocol.ReplayHeader._fields)]
    text, mark = protocol.drop_note_template(3, 1)
    assert protocol.decode(text.replace(mark, "17")) == protocol.graph_drops(3, 1, 17)


class _Forward:
    """Model.forward without its pass: the tests below begin and end the pass themselves."""

    @staticmethod
    def run(m, model, dumper, stream):
        assert m._mock.enqueue_copy(stream, model.h1, model.x, model.nbytes) == 0
        assert m._mock.enqueue_increment(stream, model.h1, model.nbytes) == 0
        dumper.dump("layers.0", FakeCudaTensor(model.cpu, model.h1))
        assert m._mock.enqueue_copy(stream, model.h2, model.h1, model.nbytes) == 0
        assert m._mock.enqueue_increment(stream, model.h2, model.nbytes) == 0
        dumper.dump("layers.1", FakeCudaTensor(model.cpu, model.h2))


def test_a_graph_whose_pass_ends_after_its_capture_is_not_committed_and_fails_verify(m, glue, tmp_path,
                                                                                   monkeypatch):
    """begin_pass(); capture; end_pass() after the capture ended: the commit kernels went onto a
    stream no longer capturing, ran once at once and published slots no replay wrote (the mock's
    0xA5 poison) as a complete replay pass, while the graph's real replays were not dumped nor
    counted, and verify said OK. Now the graph is given up: no replay pass, the loss counted
    (graphs_not_dumped) and verify fails."""
    from fastdump.cli.dump import verify_dump
    from fastdump.staging import cuda

    current = Stream(glue)
    monkeypatch.setattr(cuda, "_current_stream", current)
    d = _attach(tmp_path, writer="thread", device="cuda:0")
    side = m._mock.stream_create_flags(0)
    model = Model(m, 4)
    d.begin_pass()
    current.raw = side
    assert m._mock.begin_capture(side, GLOBAL) == 0
    _Forward.run(m, model, d, side)
    err, graph = m._mock.end_capture(side)
    assert err == 0, m._mock.error_name(err)
    current.raw = glue
    d.end_pass()  # the capture is over
    exe = m._mock.graph_instantiate(graph)
    try:
        for k in range(3):
            replay(m, model, exe, glue, rand_input(model, k))
        m._mock.sync(glue)
        stats = d.close()
    finally:
        release(m, [(graph, exe)], [side], [d])
    assert stats["graphs_not_dumped"] == 1
    ds = fastdump.open(tmp_path)
    assert graph_passes(ds, "target") == []  # no replay pass of values no replay wrote
    assert "the capture ended before the pass did" in ds.meta("target", 0, 0)["incomplete"]
    problems = verify_dump(str(tmp_path)).problems
    assert any("1 CUDA graph(s) captured while dumping cannot be dumped" in p for p in problems), problems


def test_a_new_capture_in_a_pass_whose_capture_ended_starts_a_graph_of_its_own(m, glue, tmp_path, monkeypatch):
    """A capture raised (its pass never ended), then the runner captured again on the same stream:
    the new capture's tensors were recorded into the stale graph, whose commit never reached a live
    capture; the new graph's replays were lost uncounted. The stale graph is now given up (counted)
    and the new capture records a graph of its own, committed when the pass ends inside it."""
    from fastdump.staging import cuda

    current = Stream(glue)
    monkeypatch.setattr(cuda, "_current_stream", current)
    d = _attach(tmp_path, writer="thread", device="cuda:0")
    side = m._mock.stream_create_flags(0)
    model = Model(m, 4)
    d.begin_pass()  # the pass of the capture that fails
    current.raw = side
    assert m._mock.begin_capture(side, GLOBAL) == 0
    _Forward.run(m, model, d, side)
    err, failed = m._mock.end_capture(side)  # it raised: torch's __exit__ ends the capture
    m._mock.graph_destroy(failed)
    assert m._mock.begin_capture(side, GLOBAL) == 0  # the retry, in the same (never ended) pass
    _Forward.run(m, model, d, side)
    d.end_pass()  # inside the new capture: its graph commits
    err, graph = m._mock.end_capture(side)
    assert err == 0, m._mock.error_name(err)
    current.raw = glue
    exe = m._mock.graph_instantiate(graph)
    expected = {}
    try:
        for k in range(3):
            expected[k] = replay(m, model, exe, glue, rand_input(model, 10 + k))
        m._mock.sync(glue)
        stats = d.close()
    finally:
        release(m, [(graph, exe)], [side], [d])
    assert stats["graphs_not_dumped"] == 1  # the failed capture's
    ds = fastdump.open(tmp_path)
    passes = graph_passes(ds, "target")
    assert len(passes) == 3
    for p in passes:
        meta, got = ds.meta("target", 0, p), ds.load("target", 0, p)
        want = expected[meta["graph_replay"]]
        # (the second calls of the pass: numbered #1, the failed capture's were the first)
        assert sorted(got) == ["layers.0#1", "layers.1#1"]
        assert torch.equal(torch.as_tensor(got["layers.0#1"]), want[0])
        assert torch.equal(torch.as_tensor(got["layers.1#1"]), want[1])


@pytest.mark.parametrize("pass_ends", ["after_invalidation", "at_invalidation"])
def test_an_invalidated_capture_retried_is_not_a_graph_lost(m, glue, tmp_path, monkeypatch, pass_ends):
    """A capture invalidated mid-pass (the forward made an unsafe call in global mode) yields no
    graph: cudaStreamEndCapture fails and nothing recorded into it can ever run. It was given up as
    a graph whose replays "ran unseen" (graphs_not_dumped), so verify failed a dump in which the
    runner's retried capture had every replay dumped. Now it is an incomplete capture pass saying
    why, its slots go to the retry's graph, and verify passes."""
    from fastdump.cli.dump import verify_dump
    from fastdump.staging import cuda

    current = Stream(glue)
    monkeypatch.setattr(cuda, "_current_stream", current)
    d = _attach(tmp_path, writer="thread", device="cuda:0")
    side = m._mock.stream_create_flags(0)
    model = Model(m, 4)
    current.raw = side
    assert m._mock.begin_capture(side, GLOBAL) == 0
    d.begin_pass()
    assert m._mock.enqueue_copy(side, model.h1, model.x, model.nbytes) == 0
    d.dump("layers.0", FakeCudaTensor(model.cpu, model.h1))
    with pytest.raises(RuntimeError, match="cudaErrorStreamCaptureUnsupported"):
        m._mock.malloc(16)  # unsafe during a global capture: invalidates it
    assert m._mock.capture_info(side)[1] == 2  # cudaStreamCaptureStatusInvalidated
    if pass_ends == "after_invalidation":  # tensors after it, then the pass ends inside the capture
        d.dump("layers.1", FakeCudaTensor(model.cpu, model.h2))
        d.dump("layers.2", FakeCudaTensor(model.cpu, model.h2))
    d.end_pass()
    err, failed = m._mock.end_capture(side)
    assert m._mock.error_name(err) == "cudaErrorStreamCaptureInvalidated" and failed == 0
    rec = d._graphs.recorder(0)
    assert rec.stats()["slot_used"] == 0  # the failed capture's slots are free again
    graph, exe = capture(m, model, d, current, side, graph="retry")  # the runner retries
    current.raw = glue
    try:
        expected = [replay(m, model, exe, glue, rand_input(model, 40 + k)) for k in range(3)]
        m._mock.sync(glue)
        stats = d.close()
    finally:
        release(m, [(graph, exe)], [side], [d])
    assert stats["graphs_not_dumped"] == 0 and stats["graph_replays"] == 3 and stats["dropped_passes"] == 0
    ds = fastdump.open(tmp_path)
    assert "the capture was invalidated" in ds.meta("target", 0, 0)["incomplete"]
    if pass_ends == "after_invalidation":
        assert {e["name"]: e["reason"] for e in ds.meta("target", 0, 0)["skipped"]} == {
            "layers.1": "CUDA graph capture: not recorded: the capture was invalidated (it makes no graph)",
            "layers.2": "CUDA graph capture: not recorded (the CUDA graph capture was invalidated: it makes no graph)"}
    passes = graph_passes(ds, "target")
    assert len(passes) == 3
    for p, (h1, h2) in zip(passes, expected):
        got = ds.load("target", 0, p)
        assert same_bits(torch.as_tensor(got["layers.0"]), h1) and same_bits(torch.as_tensor(got["layers.1"]), h2)
        assert ds.meta("target", 0, p)["graph"] == "retry"
    assert verify_dump(str(tmp_path)).problems == []


def test_a_given_up_graph_keeps_the_recording_memory_at_close(m, glue, tmp_path, monkeypatch):
    """A graph given up (its pass ended after its capture) still holds its snapshot copies, which
    write the recorder's slots at every replay. close() freed the recording memory all the same
    ("no graph was committed"): the graph's next replay wrote into freed device memory, which the
    next Dumper's recorder gets back from cudaMalloc. Now the memory stays until
    free_device_memory(); the old graph replayed between the next Dumper's replays changes none of
    their values."""
    from fastdump.staging import cuda

    current = Stream(glue)
    monkeypatch.setattr(cuda, "_current_stream", current)
    live = lambda: m._mock.counters()["live_allocs"]  # noqa: E731
    side = m._mock.stream_create_flags(0)
    model, model_b = Model(m, 4), Model(m, 4)
    base = live()
    a = _attach(tmp_path / "a", writer="thread", device="cuda:0")
    a.begin_pass()
    current.raw = side
    assert m._mock.begin_capture(side, GLOBAL) == 0
    _Forward.run(m, model, a, side)
    err, old_graph = m._mock.end_capture(side)
    assert err == 0, m._mock.error_name(err)
    current.raw = glue
    a.end_pass()  # after the capture: given up
    old_exe = m._mock.graph_instantiate(old_graph)
    assert a.close()["graphs_not_dumped"] == 1
    assert live() == base + 1  # the given-up graph writes into it: kept
    b = _attach(tmp_path / "b", writer="thread", device="cuda:0")
    graph, exe = capture(m, model_b, b, current, side)
    current.raw = glue
    try:
        expected = []
        for k in range(4):
            replay(m, model, old_exe, glue, rand_input(model, 60 + k))  # the old graph, after its Dumper closed
            expected.append(replay(m, model_b, exe, glue, rand_input(model_b, 70 + k)))
        m._mock.sync(glue)
        stats = b.close()
    finally:
        release(m, [(old_graph, old_exe), (graph, exe)], [side], [a, b])
    assert stats["graph_replays"] == 4 and stats["dropped_passes"] == 0
    ds = fastdump.open(tmp_path / "b")
    passes = graph_passes(ds, "target")
    assert len(passes) == 4
    for p, (h1, h2) in zip(passes, expected):
        got = ds.load("target", 0, p)
        assert same_bits(torch.as_tensor(got["layers.0"]), h1) and same_bits(torch.as_tensor(got["layers.1"]), h2)


class _TorchGraph:
    """Stands in for torch.cuda.CUDAGraph on the mock runtime (the methods fastdump wraps)."""

    def __init__(self, m, stream):
        self.m, self.stream, self.graph, self.exe = m, stream, None, None

    def capture_begin(self, pool=None, capture_error_mode="global"):
        assert self.m._mock.begin_capture(self.stream, GLOBAL) == 0

    def capture_end(self):
        err, self.graph = self.m._mock.end_capture(self.stream)
        if err:  # (torch raises too: no graph)
            raise RuntimeError(self.m._mock.error_name(err))
        self.exe = self.m._mock.graph_instantiate(self.graph)

    def reset(self):
        release(self.m, [(self.graph, self.exe)])
        self.graph = self.exe = None


@pytest.mark.parametrize("gone", ["reset", "deleted"])
def test_free_device_memory_refuses_while_a_torch_graph_still_writes_into_it(m, glue, tmp_path, monkeypatch, gone):
    """free_device_memory() called while a graph captured with the Dumper still exists (a serving
    engine that closes its Dumper and frees, keeping its graphs): the memory went back to cudaMalloc,
    the next Dumper's recorder got it, and the old graph's replays claimed, copied and published in
    the new recorder's ring under its graph ids: the new Dumper's replay passes held the old graph's
    values with wrong replay indices, and verify said OK. torch graphs are tracked now: the memory
    is kept (False, logged) while the graph exists, and freed once it is reset or deleted."""
    import gc

    from fastdump.cli.dump import verify_dump
    from fastdump.staging import cuda

    current = Stream(glue)
    monkeypatch.setattr(cuda, "_current_stream", current)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _TorchGraph)
    monkeypatch.setattr(cuda, "_capture_hook", None)
    for name in ("capture_begin", "capture_end", "reset"):  # the wrappers go with the test
        monkeypatch.setattr(_TorchGraph, name, _TorchGraph.__dict__[name])
    assert cuda.watch_graph_captures()
    live = lambda: m._mock.counters()["live_allocs"]  # noqa: E731
    side = m._mock.stream_create_flags(0)
    model, model_b = Model(m, 4), Model(m, 4)
    base = live()
    a = _attach(tmp_path / "a", writer="thread", device="cuda:0", graph_ring_mb=1)
    g = torch.cuda.CUDAGraph(m, side)  # torch.cuda.graph(g, stream=side): capture_begin, forward, capture_end
    current.raw = side
    g.capture_begin()
    model.forward(a, side)
    g.capture_end()
    current.raw = glue
    a.close()
    assert free_device_memory(a) is False and live() == base + 1  # g exists: kept
    b = _attach(tmp_path / "b", writer="thread", device="cuda:0", graph_ring_mb=1)
    graph, exe = capture(m, model_b, b, current, side)
    current.raw = glue
    try:
        expected = []
        for k in range(3):
            replay(m, model, g.exe, glue, rand_input(model, 20 + k))
            m._mock.sync(glue)
            expected.append(replay(m, model_b, exe, glue, rand_input(model_b, 30 + k)))
            m._mock.sync(glue)
        b.close()
    finally:
        release(m, [(graph, exe)], [], [b])
        if gone == "reset":
            g.reset()
        else:
            release(m, [(g.graph, g.exe)])
            del g
            gc.collect()
        m._mock.stream_destroy(side)
    before = live()
    assert free_device_memory(a) is True and live() == before - 1
    ds = fastdump.open(tmp_path / "b")
    passes = graph_passes(ds, "target")
    assert [ds.meta("target", 0, p)["graph_replay"] for p in passes] == [0, 1, 2]
    for p, (h1, h2) in zip(passes, expected):
        got = ds.load("target", 0, p)
        assert same_bits(torch.as_tensor(got["layers.0"]), h1) and same_bits(torch.as_tensor(got["layers.1"]), h2)
    assert verify_dump(str(tmp_path / "b")).problems == []


class _Layer(torch.nn.Module):
    """dst = src + 1 (bytewise) on the current (mock) stream; returns dst as a fake CUDA tensor."""

    def __init__(self, m, current, model, src, dst):
        super().__init__()
        self.m, self.current, self.model, self.src, self.dst = m, current, model, src, dst

    def forward(self, x):
        assert self.m._mock.enqueue_copy(self.current.raw, self.dst, self.src, self.model.nbytes) == 0
        assert self.m._mock.enqueue_increment(self.current.raw, self.dst, self.model.nbytes) == 0
        return FakeCudaTensor(self.model.cpu, self.dst)


class _Net(torch.nn.Module):
    def __init__(self, m, current, model):
        super().__init__()
        self.l0 = _Layer(m, current, model, model.x, model.h1)
        self.l1 = _Layer(m, current, model, model.h1, model.h2)
        self.fail = False

    def forward(self, x):
        a = self.l0(x)
        if self.fail:
            raise RuntimeError("boom")
        return self.l1(a)


def test_replays_of_a_graph_whose_capture_forward_raised_are_incomplete(m, glue, tmp_path, monkeypatch):
    """The model's forward raised inside `with torch.cuda.graph(g)`: the root forward ended its
    pass (inside the capture: the graph committed) and torch's __exit__ ended the capture, so g
    holds the layers before the exception only. Its capture pass said "a forward raised", but every
    replay pass read as a whole forward (complete, layer l1 neither there nor skipped). Now each
    replay pass is incomplete with the capture pass's reason, its recorded values intact."""
    from fastdump.staging import cuda

    current = Stream(glue)
    monkeypatch.setattr(cuda, "_current_stream", current)
    model = Model(m, 4)
    net = _Net(m, current, model)
    d = fastdump.attach(net, tmp_path, tp_rank=0, tp_size=1, writer="thread", strict=True, device="cuda:0")
    side = m._mock.stream_create_flags(0)
    current.raw = side
    assert m._mock.begin_capture(side, GLOBAL) == 0
    net.fail = True
    with pytest.raises(RuntimeError, match="boom"):
        net(FakeCudaTensor(model.cpu, model.x))
    err, graph = m._mock.end_capture(side)  # torch.cuda.graph's __exit__
    assert err == 0, m._mock.error_name(err)
    exe = m._mock.graph_instantiate(graph)
    current.raw = glue
    try:
        expected = [replay(m, model, exe, glue, rand_input(model, 80 + k)) for k in range(2)]
        m._mock.sync(glue)
        stats = d.close()
    finally:
        release(m, [(graph, exe)], [side], [d])
    assert stats["graph_replays"] == 2
    ds = fastdump.open(tmp_path)
    passes = graph_passes(ds, "target")
    assert len(passes) == 2
    for p, (h1, _) in zip(passes, expected):
        meta = ds.meta("target", 0, p)
        assert not meta["complete"]
        assert meta["incomplete"] == "captured in an incomplete pass: a forward raised RuntimeError: boom"
        got = ds.load("target", 0, p)
        assert list(got) == ["l0"] and same_bits(torch.as_tensor(got["l0"]), h1)


def test_one_graph_replayed_from_two_threads_on_two_streams(m, glue, tmp_path, monkeypatch):
    """The same graph launched from two threads on two streams at once. CUDA orders each launch of
    an executable graph after its previous ones, so replays never overlap and share the graph's
    slots and decision word safely; the mock ran them concurrently (each replay's in-place 0xEE
    kernel tore the other's values), which no GPU does: it orders them now. Every replay is one
    whole pass, bit-exact, its replay index unique."""
    import threading

    from fastdump.staging import cuda

    m._mock.set("max_delay_us", 100)
    current = Stream(glue)
    monkeypatch.setattr(cuda, "_current_stream", current)
    d = _attach(tmp_path, writer="thread", device="cuda:0")
    side = m._mock.stream_create_flags(0)
    streams = [m._mock.stream_create(), m._mock.stream_create()]
    model = Model(m, 4, width=4096)
    graph, exe = capture(m, model, d, current, side)
    current.raw = glue
    x = rand_input(model, 1)  # one input for every replay: their order cannot change a value
    model.set_input(glue, x)
    m._mock.sync(glue)
    h1, h2 = model.expected(x)
    errors = []

    def launch(stream):
        for _ in range(20):
            errors.append(m._mock.graph_launch(exe, stream))

    try:
        threads = [threading.Thread(target=launch, args=(s,)) for s in streams]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for s in streams:
            m._mock.sync(s)
        stats = d.close()
    finally:
        release(m, [(graph, exe)], [side, *streams], [d])
    assert errors == [0] * 40
    assert stats["graph_replays"] == 40 and stats["dropped_passes"] == 0
    ds = fastdump.open(tmp_path)
    passes = graph_passes(ds, "target")
    assert sorted(ds.meta("target", 0, p)["graph_replay"] for p in passes) == list(range(40))
    for p in passes:
        got = ds.load("target", 0, p)
        assert same_bits(torch.as_tensor(got["layers.0"]), h1) and same_bits(torch.as_tensor(got["layers.1"]), h2)


@pytest.mark.cuda
@needs_cuda_build
def test_gpu_free_device_memory_waits_for_the_torch_graphs(tmp_path):
    """The CUDAGraph wrappers on real torch: after close, free_device_memory keeps the recording
    memory while a graph captured with the Dumper exists (its replays still run, undumped, and
    change nothing the next Dumper dumps), and frees it once the graph is reset; then a second
    graph, deleted instead, the same way."""
    import gc

    model = _gpu_model()
    stream = torch.cuda.Stream()
    for how in ("reset", "deleted"):
        root = tmp_path / how
        d = fastdump.attach(model, root, tp_rank=0, tp_size=1, writer="thread", strict=True, device="cuda:0")
        with torch.inference_mode():
            static_in = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
            g, out = _gpu_capture(model, static_in, stream)
            torch.cuda.synchronize()
            d.close()
            assert free_device_memory(d) is False
            d2 = fastdump.attach(model, root / "next", tp_rank=0, tp_size=1, writer="thread", strict=True,
                                 device="cuda:0")
            x = torch.randn(2, 256, device="cuda", dtype=torch.bfloat16)
            with torch.cuda.stream(stream):
                g.replay()  # the closed Dumper's graph: dumps nothing
            stream.synchronize()
            want = model(x)
            torch.cuda.synchronize()
            d2.close()
            assert same_bits(torch.as_tensor(fastdump.open(root / "next").load("target", 0, 0)["Sequential"]),
                             want.cpu())
            if how == "reset":
                g.reset()
            else:
                del g, out
                gc.collect()
            assert free_device_memory(d) is True


@pytest.mark.cuda
@needs_cuda_build
def test_gpu_slots_of_given_up_and_never_launched_graphs_come_back(tmp_path):
    """On a GPU (the mock: test_failed_captures_give_their_slots_back and
    test_slots_of_graphs_never_launched_come_back): a graph whose pass ends after the
    `torch.cuda.graph` block (given up; its done event recorded at capture_end), launched once and
    reset, then a committed graph never launched, reset: the slots of both come back at the next
    capture (cudaEventSynchronize on an event recorded by an event record node, before and after a
    launch), and the last graph's replay is dumped bit-exact."""
    stream = torch.cuda.Stream()
    d = _attach(tmp_path, writer="thread", device="cuda:0")
    with torch.inference_mode():
        x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
        with torch.cuda.stream(stream):  # warm-up, in an eager pass
            d.begin_pass()
            d.dump("y", x * 2)
            d.end_pass()
        stream.synchronize()
        g1 = torch.cuda.CUDAGraph()
        d.begin_pass()
        with torch.cuda.graph(g1, stream=stream):
            d.dump("y", x * 2)
        d.end_pass()  # after its capture: given up
        g1.replay()
        g1.reset()
        g2 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g2, stream=stream):
            d.begin_pass()
            d.dump("y", x * 3)
            d.end_pass()
        g2.reset()  # never launched
        g3 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g3, stream=stream):
            d.begin_pass()
            y3 = x * 4
            d.dump("y", y3)
            d.end_pass()
        rec = d._graphs.recorder(0).stats()
        x.copy_(torch.randn(4, 256, device="cuda", dtype=torch.bfloat16))
        g3.replay()
        want = (x * 4).cpu()
        torch.cuda.synchronize()
        stats = d.close()
    g3.reset()
    assert free_device_memory(d) is True
    assert rec["reclaimed_graphs"] == 2, rec
    assert stats["graphs_not_dumped"] == 1 and stats["graph_replays"] == 1, stats
    passes = graph_passes(fastdump.open(tmp_path), "target")
    assert len(passes) == 1
    assert same_bits(torch.as_tensor(fastdump.open(tmp_path).load("target", 0, passes[0])["y"]), want)


def test_free_device_memory_before_close_keeps_the_recorder(m, glue, tmp_path, monkeypatch):
    """free_device_memory() on a Dumper still open (its graph already destroyed) stopped and freed
    the recorder, so close() no longer counted its replays: stats() said 1 pass and 0 tensors
    while 3 replay passes were on disk. It now refuses (False) until close(), which counts them."""
    from fastdump.staging import cuda

    current = Stream(glue)
    monkeypatch.setattr(cuda, "_current_stream", current)
    d = _attach(tmp_path, writer="thread", device="cuda:0")
    side = m._mock.stream_create_flags(0)
    model = Model(m, 4)
    graph, exe = capture(m, model, d, current, side)
    current.raw = glue
    expected = [replay(m, model, exe, glue, rand_input(model, 90 + k)) for k in range(3)]
    m._mock.sync(glue)
    release(m, [(graph, exe)], [side])
    assert free_device_memory(d) is False
    stats = d.close()
    assert stats["graph_replays"] == 3 and stats["passes"] == 4 and stats["tensors"] == 6
    assert free_device_memory(d) is True
    ds = fastdump.open(tmp_path)
    passes = graph_passes(ds, "target")
    assert len(passes) == 3
    for p, (h1, h2) in zip(passes, expected):
        got = ds.load("target", 0, p)
        assert same_bits(torch.as_tensor(got["layers.0"]), h1) and same_bits(torch.as_tensor(got["layers.1"]), h2)


def _watch_torch_graphs(monkeypatch):
    """torch.cuda.CUDAGraph is _TorchGraph, with fastdump's capture_begin/capture_end/reset wrappers."""
    from fastdump.staging import cuda

    monkeypatch.setattr(torch.cuda, "CUDAGraph", _TorchGraph)
    monkeypatch.setattr(cuda, "_capture_hook", None)
    for name in ("capture_begin", "capture_end", "reset"):  # the wrappers go with the test
        monkeypatch.setattr(_TorchGraph, name, _TorchGraph.__dict__[name])
    assert cuda.watch_graph_captures()


def _torch_capture(m, model, dumper, current, stream):
    """torch.cuda.graph(g, stream=stream) with the forward inside; returns g."""
    g = torch.cuda.CUDAGraph(m, stream)
    current.raw = stream
    g.capture_begin()
    model.forward(dumper, stream)
    g.capture_end()
    return g


@pytest.mark.parametrize("gone", ["reset", "deleted"])
def test_recaptured_graphs_reuse_the_slots_of_graphs_that_no_longer_exist(m, glue, tmp_path, monkeypatch, gone):
    """An engine that recaptures its graphs (CUDAGraph.reset() or a new CUDAGraph, then capture
    again, as SGLang and vLLM do): a graph's slots were never given back, so the second capture of
    a graph whose span takes half the slots had no room and its replays lacked a tensor (skipped
    with a reason), and every later recapture lost more. The slots of a graph reset or collected
    now go to the next capture (after the device is synchronized): four rounds in slots that hold
    barely two spans, every replay pass whole and bit-exact, replays of a round left in flight at
    its reset."""
    import gc

    from fastdump.cli.dump import verify_dump
    from fastdump.staging import cuda

    current = Stream(glue)
    monkeypatch.setattr(cuda, "_current_stream", current)
    _watch_torch_graphs(monkeypatch)
    m._mock.set("max_delay_us", 100)
    side = m._mock.stream_create_flags(0)
    model = Model(m, 4, width=8192)  # 2 tensors of 128 KiB: a span of 256.25 KiB; the slots: 512 KiB
    d = _attach(tmp_path, writer="thread", device="cuda:0", graph_ring_mb=1)
    expected, g = [], None
    try:
        for rnd in range(4):
            g = _torch_capture(m, model, d, current, side)
            current.raw = glue
            assert d._graphs.recorder(0).flush(30)  # (the last round's last replay: drained)
            for k in range(2):  # the second not waited for: still running when the graph goes
                expected.append((k, replay(m, model, g.exe, glue, rand_input(model, 10 * rnd + k))))
                if k == 0:  # (the replay ring holds one span at a time: no replay is dropped for room)
                    m._mock.sync(glue)
                    assert d._graphs.recorder(0).flush(30)
            if gone == "reset":
                g.reset()
            else:
                release(m, [(g.graph, g.exe)])
                g = None
                gc.collect()
        rec = d._graphs.recorder(0).stats()
        m._mock.sync(glue)
        stats = d.close()
    finally:
        m._mock.sync(glue)
        m._mock.stream_destroy(side)
        free_device_memory(d)
    assert rec["reclaimed_graphs"] == 3 and rec["slot_used"] == 256 + 2 * (128 << 10), rec
    assert stats["graph_replays"] == 8 and stats["dropped_passes"] == 0 and stats["skipped"] == 0, stats
    ds = fastdump.open(tmp_path)
    passes = graph_passes(ds, "target")
    assert len(passes) == 8
    for p, (k, (h1, h2)) in zip(passes, expected):
        got = ds.load("target", 0, p)
        assert set(got) == {"layers.0", "layers.1"}, ds.meta("target", 0, p)
        assert same_bits(torch.as_tensor(got["layers.0"]), h1) and same_bits(torch.as_tensor(got["layers.1"]), h2)
        assert ds.meta("target", 0, p)["graph_replay"] == k
    assert verify_dump(str(tmp_path)).problems == []


@pytest.mark.parametrize("failure", ["pass_outlives_capture", "invalidated"])
def test_failed_captures_give_their_slots_back(m, glue, tmp_path, monkeypatch, failure):
    """A capture that makes no dumpable graph, again and again: the pass ends after the capture
    (the forward raised past the pass's end inside `torch.cuda.graph`, a manual end_pass after the
    block), or the capture was invalidated and torch's capture_end raised. Each such graph kept its
    slots for good (given up before its commit, it had no done event to wait for), so the second
    failed capture already found no room and the runner's final, good capture had its tensors
    skipped. Now torch's capture_end gives a still-open graph a done event (its slots come back
    once it is reset, after its last launch), and an invalidated capture gives them back at once
    (not counted as a graph not dumped). The good capture's replays are whole and bit-exact."""
    import gc

    from fastdump.cli.dump import verify_dump
    from fastdump.staging import cuda

    current = Stream(glue)
    monkeypatch.setattr(cuda, "_current_stream", current)
    _watch_torch_graphs(monkeypatch)
    m._mock.set("max_delay_us", 100)
    side = m._mock.stream_create_flags(0)
    model = Model(m, 4, width=8192)  # 2 tensors of 128 KiB: a span of 256.25 KiB; the slots: 512 KiB
    d = _attach(tmp_path, writer="thread", device="cuda:0", graph_ring_mb=1)
    span = 256 + 2 * (128 << 10)
    g = None
    try:
        for rnd in range(4):
            g = torch.cuda.CUDAGraph(m, side)
            current.raw = side
            d.begin_pass()
            g.capture_begin()
            _Forward.run(m, model, d, side)
            if failure == "invalidated":
                with pytest.raises(RuntimeError, match="cudaErrorStreamCaptureUnsupported"):
                    m._mock.malloc(16)  # unsafe during a global capture: invalidates it
                with pytest.raises(RuntimeError, match="cudaErrorStreamCaptureInvalidated"):
                    g.capture_end()
                assert d._graphs.recorder(0).stats()["slot_used"] == 0  # given back at once
            else:
                g.capture_end()
            current.raw = glue
            d.end_pass()  # after the capture: that graph cannot be committed
            if failure == "pass_outlives_capture":
                assert d._graphs.recorder(0).stats()["slot_used"] == span
                replay(m, model, g.exe, glue, rand_input(model, rnd))  # still running at its reset
                g.reset()
            g = None
            gc.collect()
        g = _torch_capture(m, model, d, current, side)  # the runner's capture that works
        current.raw = glue
        expected = []
        for k in range(2):  # (the replay ring holds one span at a time: no replay is dropped for room)
            expected.append(replay(m, model, g.exe, glue, rand_input(model, 50 + k)))
            m._mock.sync(glue)
            assert d._graphs.recorder(0).flush(30)
        rec = d._graphs.recorder(0).stats()
        stats = d.close()
    finally:
        m._mock.sync(glue)
        if not d._closed:
            d.close()
        if g is not None:
            g.reset()
        m._mock.stream_destroy(side)
        free_device_memory(d)
    assert rec["slot_used"] == span, rec
    assert rec["reclaimed_graphs"] == (4 if failure == "pass_outlives_capture" else 0), rec
    assert stats["skipped"] == 0 and stats["graph_replays"] == 2 and stats["dropped_passes"] == 0, stats
    _replays_dumped_as(tmp_path, expected)
    ds = fastdump.open(tmp_path)
    problems = verify_dump(str(tmp_path)).problems
    if failure == "invalidated":  # no graph came of them: nothing was lost
        assert stats["graphs_not_dumped"] == 0, stats
        assert "the capture was invalidated" in ds.meta("target", 0, 0)["incomplete"]
        assert problems == []
    else:  # four graphs ran unseen (one replay each): counted, and verify says so
        assert stats["graphs_not_dumped"] == 4, stats
        assert "the capture ended before the pass did" in ds.meta("target", 0, 0)["incomplete"]
        assert any("4 CUDA graph(s) captured while dumping cannot be dumped" in p for p in problems), problems


@pytest.mark.parametrize("captured_event", [0, 1])
def test_slots_of_graphs_never_launched_come_back(m, glue, tmp_path, monkeypatch, caplog, captured_event):
    """Graphs captured and reset without a single launch (a runner that recaptures at startup, a
    batch size never served). Their done events were only ever recorded by the capture's event
    record node; whether CUDA then answers a query with cudaErrorCapturedEvent ("last recorded in a
    capturing stream") is not documented (the mock's `external_record_captures` gives that answer).
    With it, reclaim() gave back nothing at all (every graph asked for in the same call kept its
    slots), the next capture found no room and its tensors were skipped, and close() warned it
    could not wait for the graphs' replays. No launch recorded the event since its capture, so none
    is in flight: those slots come back now, and close() waits quietly."""
    import logging

    from fastdump.staging import cuda

    current = Stream(glue)
    monkeypatch.setattr(cuda, "_current_stream", current)
    _watch_torch_graphs(monkeypatch)
    m._mock.set("external_record_captures", captured_event)
    side = m._mock.stream_create_flags(0)
    model = Model(m, 4, width=8192)  # 2 tensors of 128 KiB: a span of 256.25 KiB; the slots: 512 KiB
    d = _attach(tmp_path, writer="thread", device="cuda:0", graph_ring_mb=1)
    g = never = None
    try:
        for _ in range(3):
            g = _torch_capture(m, model, d, current, side)  # never launched
            current.raw = glue
            g.reset()
        g = _torch_capture(m, model, d, current, side)
        current.raw = glue
        never = _torch_capture(m, Model(m, 1, width=16), d, current, side)  # alive, never launched, at close
        current.raw = glue
        expected = []
        for k in range(2):  # (the replay ring holds one span at a time: no replay is dropped for room)
            expected.append(replay(m, model, g.exe, glue, rand_input(model, 90 + k)))
            m._mock.sync(glue)
            assert d._graphs.recorder(0).flush(30)
        rec = d._graphs.recorder(0).stats()
        with caplog.at_level(logging.WARNING, logger="fastdump"):
            stats = d.close()
    finally:
        m._mock.sync(glue)
        if not d._closed:
            d.close()
        for graph in (g, never):
            if graph is not None:
                graph.reset()
        m._mock.stream_destroy(side)
        free_device_memory(d)
    assert rec["reclaimed_graphs"] == 3, rec
    assert stats["skipped"] == 0 and stats["graph_replays"] == 2 and stats["dropped_passes"] == 0, stats
    _replays_dumped_as(tmp_path, expected)
    assert "cannot wait for the CUDA graphs' last replays" not in caplog.text


def _replays_dumped_as(root, want):
    """The target's graph passes at ``root`` are one per replay in ``want``, in order, each holding
    that replay's (layers.0, layers.1) bit for bit."""
    ds = fastdump.open(root)
    passes = graph_passes(ds, "target")
    assert len(passes) == len(want)
    for p, (h1, h2) in zip(passes, want):
        got = ds.load("target", 0, p)
        assert same_bits(torch.as_tensor(got["layers.0"]), h1) and same_bits(torch.as_tensor(got["layers.1"]), h2)


def test_slots_of_a_reset_graph_wait_for_its_replay_still_queued(m, glue, tmp_path, monkeypatch):
    """The old graph's replay is still queued (behind other work) when the graph is reset and the
    next one captured: given back at once, its slots would be the new graph's while that replay
    still writes and reads them. The device is synchronized first: the new capture begins only
    after the old replay ran; the old replay's pass holds its values, the new graph's replays
    theirs, in the old graph's slots."""
    import threading
    import time

    from fastdump.staging import cuda

    current = Stream(glue)
    monkeypatch.setattr(cuda, "_current_stream", current)
    _watch_torch_graphs(monkeypatch)
    side, late = m._mock.stream_create_flags(0), m._mock.stream_create()
    model = Model(m, 4, width=8192)
    d = _attach(tmp_path, writer="thread", device="cuda:0", graph_ring_mb=1)
    timer = None
    try:
        g = _torch_capture(m, model, d, current, side)
        current.raw = glue
        gate = m._mock.enqueue_gate(late)
        old = replay(m, model, g.exe, late, rand_input(model, 1))  # queued behind the gate
        g.reset()
        opened = []
        timer = threading.Timer(0.3, lambda: (opened.append(time.monotonic()), m._mock.open_gate(gate)))
        timer.start()
        g2 = torch.cuda.CUDAGraph(m, side)
        current.raw = side
        g2.capture_begin()
        began = time.monotonic()
        assert opened and began >= opened[0], "the capture began while the reset graph's replay was queued"
        model.forward(d, side)
        g2.capture_end()
        current.raw = glue
        assert d._graphs.recorder(0).flush(30)
        new = []
        for k in range(2):  # (the replay ring holds one span at a time: no replay is dropped for room)
            new.append(replay(m, model, g2.exe, glue, rand_input(model, 2 + k)))
            m._mock.sync(glue)
            assert d._graphs.recorder(0).flush(30)
        rec = d._graphs.recorder(0).stats()
        stats = d.close()
        g2.reset()
    finally:
        if timer is not None:
            timer.join()
        m._mock.sync(late)
        for s in (side, late):
            m._mock.stream_destroy(s)
        free_device_memory(d)
    assert rec["reclaimed_graphs"] == 1 and stats["graph_replays"] == 3 and stats["skipped"] == 0, (rec, stats)
    _replays_dumped_as(tmp_path, [old] + new)


def test_a_legacy_stream_tensor_during_another_threads_capture_is_a_skip_not_a_lost_graph(m, glue, tmp_path,
                                                                                           monkeypatch):
    """A model on torch's default (legacy) stream while another thread captures on a blocking
    stream with a raw cudaStreamBeginCapture: cudaStreamIsCapturing(legacy) answers
    cudaErrorStreamCaptureImplicit, so the tensor went to the graph recorder, whose begin_graph
    raised on the same error; the pass then gave up a "graph" that does not exist and counted it in
    graphs_not_dumped (verify failed, falsely). The legacy stream never captures: the tensor is
    skipped with the reason, nothing is enqueued on it (the other capture stays valid), no graph is
    counted lost, and the next pass, after that capture ended, is dumped bit-exact."""
    import threading

    from fastdump.cli.dump import verify_dump
    from fastdump.staging import cuda

    current = Stream(0)  # torch's default stream
    monkeypatch.setattr(cuda, "_current_stream", current)
    blocking = m._mock.stream_create_flags(0)
    model = Model(m, 4)
    d = _attach(tmp_path, writer="thread", device="cuda:0")
    began, done, result = threading.Event(), threading.Event(), {}

    def other_thread():
        try:
            result["begin"] = m._mock.begin_capture(blocking, GLOBAL)
        finally:
            began.set()
        done.wait(60)
        result["err"], result["graph"] = m._mock.end_capture(blocking)

    t = threading.Thread(target=other_thread)
    t.start()
    try:
        assert began.wait(60) and result["begin"] == 0
        d.begin_pass()
        d.dump("layers.0", FakeCudaTensor(model.cpu, model.h1))
        d.end_pass()
        done.set()
        t.join(60)
        assert result["err"] == 0, m._mock.error_name(result["err"])  # the other capture made its graph
        x = rand_input(model, 5)
        model.set_input(0, x)
        model.forward(d, 0)
        stats = d.close()
    finally:
        done.set()
        t.join(60)
        if result.get("graph"):
            m._mock.graph_destroy(result["graph"])
        m._mock.sync(0)
        m._mock.stream_destroy(blocking)
        free_device_memory(d)
    assert stats["graphs_not_dumped"] == 0 and stats["skipped"] == 1, stats
    ds = fastdump.open(tmp_path)
    first, second = ds.passes("target", 0)
    meta = ds.meta("target", 0, first)
    assert meta["tensors"] == 0 and "legacy default stream" in str(meta.get("skipped")), meta
    h1, h2 = model.expected(x)
    got = ds.load("target", 0, second)
    assert same_bits(torch.as_tensor(got["layers.0"]), h1) and same_bits(torch.as_tensor(got["layers.1"]), h2)
    assert verify_dump(str(tmp_path)).problems == []


@pytest.mark.parametrize("mode", [GLOBAL, THREAD_LOCAL, RELAXED])
def test_reclaiming_slots_never_breaks_another_threads_raw_capture(m, glue, tmp_path, monkeypatch, mode):
    """Another thread captures a graph of its own with a raw cudaStreamBeginCapture (CuPy, a
    library) while the serving thread resets a graph and captures the next: the slots were given
    back after a cudaDeviceSynchronize, which is illegal while any stream of the device captures, in
    any mode, and invalidated the other thread's capture (its cudaStreamEndCapture failed, the
    slots stayed taken). Each graph's last launch is waited for through its done event now: the
    other capture yields its graph, the slots go to the new graph, its replays are bit-exact."""
    import threading

    from fastdump.cli.dump import verify_dump
    from fastdump.staging import cuda

    current = Stream(glue)
    monkeypatch.setattr(cuda, "_current_stream", current)
    _watch_torch_graphs(monkeypatch)
    side, late, other = m._mock.stream_create_flags(0), m._mock.stream_create(), m._mock.stream_create()
    model = Model(m, 4, width=8192)  # the slots hold barely two spans: the recapture needs the old one's
    d = _attach(tmp_path, writer="thread", device="cuda:0", graph_ring_mb=1)
    began, done, result = threading.Event(), threading.Event(), {}

    buf = device_buffer(m, 256)

    def other_thread():
        try:
            result["begin"] = m._mock.begin_capture(other, mode)
            result["fill"] = m._mock.enqueue_fill(other, buf, 256, 7)
        finally:
            began.set()
        done.wait(60)
        result["err"], result["graph"] = m._mock.end_capture(other)

    t = threading.Thread(target=other_thread)
    g2 = None
    try:
        g = _torch_capture(m, model, d, current, side)
        current.raw = glue
        gate = m._mock.enqueue_gate(late)
        old = replay(m, model, g.exe, late, rand_input(model, 1))  # still queued when the graph goes
        g.reset()
        t.start()
        assert began.wait(60) and result == {"begin": 0, "fill": 0}, result
        threading.Timer(0.2, lambda: m._mock.open_gate(gate)).start()
        g2 = _torch_capture(m, model, d, current, side)  # (reclaims g's slots as it begins)
        done.set()
        t.join(60)
        current.raw = glue
        # The graph ring holds one replay of this width: the new replay waits for the old one to
        # be drained and its ring space given back, or it is (rightly) a dropped replay on a loaded machine.
        assert d._graphs.recorder(0).flush(30)
        new = [replay(m, model, g2.exe, glue, rand_input(model, 2))]
        m._mock.sync(glue)
        rec = d._graphs.recorder(0).stats()
        stats = d.close()
        g2.reset()
    finally:
        done.set()
        if t.is_alive():
            t.join(60)
        if result.get("graph"):
            m._mock.graph_destroy(result["graph"])
        m._mock.sync(late)
        for s in (side, late, other):
            m._mock.stream_destroy(s)
        free_device_memory(d)
    assert result["err"] == 0, m._mock.error_name(result["err"])
    assert rec["reclaimed_graphs"] == 1 and stats["skipped"] == 0, (rec, stats)
    _replays_dumped_as(tmp_path, [old] + new)
    assert verify_dump(str(tmp_path)).problems == []


def test_a_replay_claimed_while_close_runs_is_written(m, glue, tmp_path, monkeypatch):
    """A replay running when close() begins, past its claim (it has a log position) but not yet
    published: close() flushed the drain (idle: nothing published), closed the recorder and stopped
    the drain, and the replay published into a log nobody read: neither written nor counted, and
    verify said OK. close() now sees every claimed position and waits for it (the drain stages it),
    or counts it as dropped when it cannot."""
    from fastdump.cli.dump import verify_dump
    from fastdump.staging import cuda

    current = Stream(glue)
    monkeypatch.setattr(cuda, "_current_stream", current)
    side = m._mock.stream_create_flags(0)
    model = Model(m, 4)
    d = _attach(tmp_path, writer="thread", device="cuda:0")
    graph, exe = capture(m, model, d, current, side)
    current.raw = glue
    try:
        m._mock.set("graph_node_us", 300_000)  # each node of a replay takes 0.3 s: publish is 0.6 s after claim
        expected = replay(m, model, exe, glue, rand_input(model, 5))
        rec = d._graphs.recorder(0)
        _wait_for(lambda: rec.stats()["claimed_replays"] == 1)
        assert rec.stats()["replays"] == 0
        stats = d.close()
    finally:
        m._mock.sync(glue)
        m._mock.set("graph_node_us", 0)
        release(m, [(graph, exe)], [side], [d])
    assert stats["graph_replays"] == 1 and stats["dropped_passes"] == 0, stats
    ds = fastdump.open(tmp_path)
    (p,) = graph_passes(ds, "target")
    got = ds.load("target", 0, p)
    assert same_bits(torch.as_tensor(got["layers.0"]), expected[0])
    assert same_bits(torch.as_tensor(got["layers.1"]), expected[1])
    assert verify_dump(str(tmp_path)).problems == []


def test_replays_after_close_returned_change_no_count(m):
    """A replay that claims after close() closed the recorder is dropped and counted while close()
    runs (it happened while the Dumper closed); once close() returned the count is final (what
    rank.json says): replays launched before but run after it change nothing."""
    ring = Ring(m, capacity=1 << 20)
    stager = m.CudaStager(ring.producer, 4 << 20)
    rec = m.GraphRecorder(stager, 0, 0, 1 << 20, 1 << 20, 64)
    side, launch = m._mock.stream_create_flags(0), m._mock.stream_create()
    cpu = torch.arange(256, dtype=torch.int32)
    graph, exe = _one_tensor_graph(m, rec, side, cpu)
    try:
        assert m._mock.graph_launch(exe, launch) == 0
        m._mock.sync(launch)
        assert rec.flush(30)
        gate = m._mock.enqueue_gate(launch)
        for _ in range(3):
            assert m._mock.graph_launch(exe, launch) == 0
        rec.close(5.0, False)  # (the gate holds them: they claim after close())
        assert rec.stats()["replays"] == 1 and rec.dropped_replays == 0
        m._mock.open_gate(gate)
        m._mock.sync(launch)
        assert rec.stats()["dropped_replays"] == 0 and rec.stats()["replays"] == 1  # final at close()
        got, _ = ring.read()
        assert len(got) == 1
    finally:
        m._mock.sync(launch)
        m._mock.graph_exec_destroy(exe)
        m._mock.graph_destroy(graph)
        rec.close(10.0, True)
        stager.close()
        m._mock.stream_destroy(side)
        m._mock.stream_destroy(launch)


class _EmptyOut(torch.nn.Module):
    def forward(self, x):
        return (None, [])  # stores nothing: a tuple holding no tensor


class _DictLayer(_Layer):
    def forward(self, x):
        return {"0": super().forward(x)}  # a dict whose key reads as an element index


class _StructNet(torch.nn.Module):
    """Outputs whose structure the stored names cannot tell: l0 (a tensor), e ((None, []): nothing
    stored), l1 ({"0": tensor}, stored as l1.0 like a tuple's element)."""

    def __init__(self, m, current, model):
        super().__init__()
        self.l0 = _Layer(m, current, model, model.x, model.h1)
        self.e = _EmptyOut()
        self.l1 = _DictLayer(m, current, model, model.h1, model.h2)

    def forward(self, x):
        a = self.l0(x)
        self.e(a)
        return self.l1(a)["0"]


def test_replay_passes_carry_the_structure_recorded_at_capture(m, glue, tmp_path, monkeypatch):
    """The eager path records, per pass, the output structures the stored names cannot tell (a
    tuple holding no tensor, a dict with digit keys); replay passes carried none, so
    `export --names sglang` named a replay pass's tensors unlike the same forward run eagerly (the
    dict read as a tuple, the empty output left out). The capture pass's record now goes with the
    graph's layout to every replay pass, its positions counted among the recorded tensors."""
    from fastdump import export
    from fastdump.staging import cuda

    current = Stream(glue)
    monkeypatch.setattr(cuda, "_current_stream", current)
    model = Model(m, 4)
    net = _StructNet(m, current, model)
    d = fastdump.attach(net, tmp_path, tp_rank=0, tp_size=1, writer="thread", strict=True, device="cuda:0")
    side = m._mock.stream_create_flags(0)
    try:
        current.raw = glue
        model.set_input(glue, rand_input(model, 1))
        net(FakeCudaTensor(model.cpu, model.x))  # the eager pass
        m._mock.sync(glue)
        current.raw = side
        assert m._mock.begin_capture(side, GLOBAL) == 0
        net(FakeCudaTensor(model.cpu, model.x))
        err, graph = m._mock.end_capture(side)
        assert err == 0, m._mock.error_name(err)
        exe = m._mock.graph_instantiate(graph)
        current.raw = glue
        expected = replay(m, model, exe, glue, rand_input(model, 2))
        m._mock.sync(glue)
        d.close()
    finally:
        release(m, [(graph, exe)], [side], [d])
    ds = fastdump.open(tmp_path)
    eager = min(ds.passes("target", 0))
    (replayed,) = graph_passes(ds, "target")
    want = ds.structure("target", 0, eager)
    assert set(want) == {"e", "l1"} and want["e"]["after"] == 2, want  # (l1.0 and the root output after it)
    assert ds.structure("target", 0, replayed) == want
    modules = ["l0", "e", "l1"]
    named = {p: export.sglang_names(ds.load("target", 0, p), modules, ds.structure("target", 0, p))
             for p in (eager, replayed)}
    assert list(named[replayed]) == list(named[eager]) == ["l0", "e", "l1.0", "_StructNet"], named
    assert same_bits(torch.as_tensor(named[replayed]["l1.0"]), expected[1])


def test_a_recaptured_graph_in_the_slots_of_one_reset_between_live_graphs(m, glue, tmp_path, monkeypatch):
    """Graphs of three batch sizes, the middle one reset and captured again (a partial recapture):
    the new graph's span goes into the freed hole, the only room large enough, and never over the
    live graphs on either side: every graph's replays stay bit-exact, interleaved."""
    from fastdump.cli.dump import verify_dump
    from fastdump.staging import cuda

    current = Stream(glue)
    monkeypatch.setattr(cuda, "_current_stream", current)
    _watch_torch_graphs(monkeypatch)
    side = m._mock.stream_create_flags(0)
    # spans: 64.25 KiB, 256.25 KiB, 128.25 KiB of the 512 KiB of slots: 63.25 KiB left after them
    models = {"a": Model(m, 4, width=2048), "b": Model(m, 4, width=8192), "c": Model(m, 4, width=4096)}
    d = _attach(tmp_path, writer="thread", device="cuda:0", graph_ring_mb=1)
    graphs = {}
    try:
        for key, model in models.items():
            graphs[key] = _torch_capture(m, model, d, current, side)
        graphs["b"].reset()
        graphs["b"] = _torch_capture(m, models["b"], d, current, side)
        current.raw = glue
        rec = d._graphs.recorder(0)
        expected = []
        for k, key in enumerate("abcbca"):
            expected.append((key, replay(m, models[key], graphs[key].exe, glue, rand_input(models[key], 40 + k))))
            m._mock.sync(glue)
            assert rec.flush(30)
        stats = rec.stats()
        d.close()
        for g in graphs.values():
            g.reset()
    finally:
        m._mock.sync(glue)
        m._mock.stream_destroy(side)
        free_device_memory(d)
    assert stats["reclaimed_graphs"] == 1 and stats["dropped_replays"] == 0, stats
    ds = fastdump.open(tmp_path)
    passes = graph_passes(ds, "target")
    assert len(passes) == len(expected)
    for p, (key, (h1, h2)) in zip(passes, expected):
        got = ds.load("target", 0, p)
        assert set(got) == {"layers.0", "layers.1"}, (key, ds.meta("target", 0, p))
        assert same_bits(torch.as_tensor(got["layers.0"]), h1), key
        assert same_bits(torch.as_tensor(got["layers.1"]), h2), key
    assert verify_dump(str(tmp_path)).problems == []


def test_graph_ids_of_graphs_that_no_longer_exist_are_reused(m, glue, tmp_path, monkeypatch):
    """An engine that recaptures its graphs round after round (config change, LoRA swap, one
    torch.cuda.graph per batch size): graph ids were never reused, so after 4096 captures every
    later graph's tensors were skipped and its replays ran unseen, with verify saying OK. The id of
    a graph reset (its slots reclaimed) now goes to a later graph: 4100 capture/replay/reset rounds
    in one Dumper, every sampled replay whole and bit-exact, its meta naming the round's graph by a
    number never reused (cuda_graph == the round)."""
    from fastdump.cli.dump import verify_dump
    from fastdump.staging import cuda

    current = Stream(glue)
    monkeypatch.setattr(cuda, "_current_stream", current)
    _watch_torch_graphs(monkeypatch)
    side = m._mock.stream_create_flags(0)
    model = Model(m, 1, width=4)
    d = _attach(tmp_path, writer="thread", device="cuda:0", graph_ring_mb=1)
    sampled, expected = (0, 1, 2047, 4095, 4096, 4097, 4099), []
    try:
        for rnd in range(4100):
            g = _torch_capture(m, model, d, current, side)
            current.raw = glue
            if rnd in sampled:
                expected.append(replay(m, model, g.exe, glue, rand_input(model, rnd)))
                m._mock.sync(glue)
            g.reset()
        rec = d._graphs.recorder(0).stats()
        stats = d.close()
    finally:
        m._mock.sync(glue)
        m._mock.stream_destroy(side)
        free_device_memory(d)
    assert rec["graphs"] == 4100 and rec["live_graphs"] == 1 and rec["reclaimed_graphs"] == 4099, rec
    assert stats["graph_replays"] == len(sampled) and stats["skipped"] == 0 and stats["graphs_not_dumped"] == 0, stats
    ds = fastdump.open(tmp_path)
    passes = graph_passes(ds, "target")
    assert len(passes) == len(sampled)
    for p, rnd, (h1, h2) in zip(passes, sampled, expected):
        got = ds.load("target", 0, p)
        assert same_bits(torch.as_tensor(got["layers.0"]), h1) and same_bits(torch.as_tensor(got["layers.1"]), h2)
        meta = ds.meta("target", 0, p)
        assert (meta["cuda_graph"], meta["graph_replay"], meta["complete"]) == (rnd, 0, True), meta
    assert verify_dump(str(tmp_path)).problems == []


def test_a_graph_id_is_reused_only_after_the_drain_wrote_the_old_graphs_replays(m, glue, tmp_path, monkeypatch):
    """A replay of a reset graph still waits for the drain (paused) when the next graph is captured:
    were the old id reused now, the new graph's layout would reach the writer before the old
    replay's span, which would be split with the new graph's layout (another graph's values under
    its name) or looked up as the new graph by the drain. The new graph takes another id; the old
    id goes to the graph after, once the drain wrote the old replay. Each replay's pass holds its
    own graph's values and names it; replay indices start at 0 for the graph reusing an id."""
    from fastdump.cli.dump import verify_dump
    from fastdump.staging import cuda

    current = Stream(glue)
    monkeypatch.setattr(cuda, "_current_stream", current)
    _watch_torch_graphs(monkeypatch)
    side = m._mock.stream_create_flags(0)
    models = [Model(m, 2, width=16 * (k + 1)) for k in range(3)]  # three layouts (span sizes differ)
    d = _attach(tmp_path, writer="thread", device="cuda:0", graph_ring_mb=1)
    rec = d._graphs.recorder(0)
    expected = []
    try:
        g0 = _torch_capture(m, models[0], d, current, side)
        current.raw = glue
        rec.set_paused(True)
        expected.append(replay(m, models[0], g0.exe, glue, rand_input(models[0], 1)))
        m._mock.sync(glue)
        g0.reset()
        g1 = _torch_capture(m, models[1], d, current, side)  # id 0 is freed, its replay not drained yet
        current.raw = glue
        ids = [rec.layout(1)["graph_number"]]
        rec.set_paused(False)
        assert rec.flush(30)
        g2 = _torch_capture(m, models[2], d, current, side)  # id 0 again
        current.raw = glue
        ids.append(rec.layout(0)["graph_number"])
        for k in range(2):
            expected.append(replay(m, models[1], g1.exe, glue, rand_input(models[1], 10 + k)))
            m._mock.sync(glue)
            expected.append(replay(m, models[2], g2.exe, glue, rand_input(models[2], 20 + k)))
            m._mock.sync(glue)
        assert rec.flush(30)
        stats = d.close()
        g1.reset()
        g2.reset()
    finally:
        m._mock.sync(glue)
        m._mock.stream_destroy(side)
        free_device_memory(d)
    assert ids == [1, 2]
    assert stats["graph_replays"] == 5 and stats["dropped_passes"] == 0 and stats["skipped"] == 0, stats
    ds = fastdump.open(tmp_path)
    passes = graph_passes(ds, "target")
    assert len(passes) == 5
    names = [(0, 0), (1, 0), (2, 0), (1, 1), (2, 1)]  # (cuda_graph, graph_replay)
    for p, (number, k), (h1, h2) in zip(passes, names, expected):
        got = ds.load("target", 0, p)
        meta = ds.meta("target", 0, p)
        assert (meta["cuda_graph"], meta["graph_replay"], meta["complete"]) == (number, k, True), meta
        assert same_bits(torch.as_tensor(got["layers.0"]), h1) and same_bits(torch.as_tensor(got["layers.1"]), h2)
    assert verify_dump(str(tmp_path)).problems == []


def test_more_live_graphs_than_graph_ids_are_counted_and_fail_verify(m, glue, tmp_path, monkeypatch):
    """4096 graphs that all still exist, then one more: the 4097th graph's tensors were skipped
    (each with a reason) but its replays ran unseen, nothing counted them and verify said OK. It is
    now a graph not dumped: counted in rank.json, the capture pass says why, verify fails."""
    from fastdump.cli.dump import verify_dump
    from fastdump.staging import cuda

    current = Stream(glue)
    monkeypatch.setattr(cuda, "_current_stream", current)
    _watch_torch_graphs(monkeypatch)
    side = m._mock.stream_create_flags(0)
    model = Model(m, 1, width=4)
    d = _attach(tmp_path, writer="thread", device="cuda:0", graph_ring_mb=8)  # slots for 4096 spans of 768 B
    live = []
    try:
        for _ in range(4097):
            live.append(_torch_capture(m, model, d, current, side))
        current.raw = glue
        last = replay(m, model, live[-1].exe, glue, rand_input(model, 1))  # unseen
        first = replay(m, model, live[0].exe, glue, rand_input(model, 2))
        m._mock.sync(glue)
        rec = d._graphs.recorder(0).stats()
        stats = d.close()
        for g in live:
            g.reset()
    finally:
        m._mock.sync(glue)
        m._mock.stream_destroy(side)
        free_device_memory(d)
    assert stats["graphs_not_dumped"] == 1 and stats["skipped"] == 2 and stats["graph_replays"] == 1, stats
    assert last is not None and rec["live_graphs"] == 4096, rec
    assert _rank_json(tmp_path)["stats"]["graphs_not_dumped"] == 1
    ds = fastdump.open(tmp_path)
    meta = ds.meta("target", 0, 4096)  # the last capture's pass
    why = "more than 4096 CUDA graphs of one Dumper exist on GPU 0 (reset or delete graphs no longer replayed)"
    assert meta["skipped"] == [{"name": n, "reason": f"CUDA graph capture: not recorded ({why})"}
                               for n in ("layers.0", "layers.1")], meta
    assert meta["incomplete"] == f"CUDA graph capture: the graph's replays are not dumped ({why})", meta
    (p,) = graph_passes(ds, "target")
    got = ds.load("target", 0, p)
    assert same_bits(torch.as_tensor(got["layers.0"]), first[0]) and ds.meta("target", 0, p)["cuda_graph"] == 0
    problems = verify_dump(str(tmp_path)).problems
    assert any("1 CUDA graph(s) captured while dumping cannot be dumped" in p for p in problems), problems


def test_tensors_hooked_off_the_capturing_stream_or_gpu_are_skipped_in_every_replay(m, glue, tmp_path,
                                                                                    monkeypatch):
    """During a capture, a tensor hooked while another stream is current (an alternate stream forked
    into the capture) and a tensor on another GPU are not recorded: the commit kernels on the
    capturing stream would not be ordered after their snapshots (a copy on a stream that is not
    capturing runs once, at capture time, and every replay would publish that stale copy as its
    value). Both are skipped, with the reason, in the capture pass and in every replay pass; the
    tensor on the capturing stream is dumped bit-exact."""
    from fastdump.staging import cuda

    current = Stream(glue)
    monkeypatch.setattr(cuda, "_current_stream", current)
    d = _attach(tmp_path, writer="thread", device="cuda:0")
    side = m._mock.stream_create_flags(0)
    other = m._mock.stream_create()  # not capturing
    model = Model(m, 4)
    cpu = torch.zeros(model.shape, dtype=torch.int32)
    stale = device_buffer(m, model.nbytes)
    on_gpu1 = device_buffer(m, model.nbytes, device=1)
    assert m._mock.upload(stale, torch.full(model.shape, 7, dtype=torch.int32).data_ptr(), model.nbytes) == 0

    fork, join = m._mock.event_create(), m._mock.event_create()

    def forward(dumper, stream, tag="layers"):
        dumper.begin_pass()
        assert m._mock.enqueue_copy(stream, model.h1, model.x, model.nbytes) == 0
        assert m._mock.enqueue_increment(stream, model.h1, model.nbytes) == 0
        dumper.dump("on_capture", FakeCudaTensor(cpu, model.h1))
        # `other` joins the capture (torch: with torch.cuda.stream(s): s.wait_stream(capture stream))
        assert m._mock.event_record(fork, stream) == 0 and m._mock.stream_wait_event(other, fork) == 0
        current.raw = other
        dumper.dump("on_other_stream", FakeCudaTensor(cpu, stale))
        assert m._mock.event_record(join, other) == 0 and m._mock.stream_wait_event(stream, join) == 0
        current.raw = stream
        dumper.dump("on_gpu1", FakeCudaTensor(cpu, on_gpu1, device=1))
        dumper.end_pass()

    model.forward = forward
    xs = [rand_input(model, 300 + k) for k in range(3)]
    try:
        graph, exe = capture(m, model, d, current, side)
        current.raw = glue
        for x in xs:
            model.set_input(glue, x)
            assert m._mock.graph_launch(exe, glue) == 0
            m._mock.sync(glue)
        assert d._graphs.recorder(0).flush(30)
        stats = d.close()
    finally:
        m._mock.sync(side)
        release(m, [(graph, exe)], [side, other], [d])
        m._mock.event_destroy(fork)
        m._mock.event_destroy(join)
    assert stats["graph_replays"] == 3 and stats["graphs_not_dumped"] == 0
    ds = fastdump.open(tmp_path)
    capture_pass = [p for p in ds.passes("target", 0) if p < GRAPH_BASE][-1]
    assert sorted(s["name"] for s in ds.meta("target", 0, capture_pass)["skipped"]) == ["on_gpu1", "on_other_stream"]
    passes = graph_passes(ds, "target")
    assert len(passes) == 3
    for p, x in zip(passes, xs):
        got = ds.load("target", 0, p)
        assert set(got) == {"on_capture"}
        assert same_bits(torch.as_tensor(got["on_capture"]), model.expected(x)[0])
        reasons = {s["name"]: s["reason"] for s in ds.meta("target", 0, p)["skipped"]}
        assert set(reasons) == {"on_other_stream", "on_gpu1"}
        assert "not the stream being captured" in reasons["on_other_stream"]
        assert "another GPU" in reasons["on_gpu1"]


def test_a_raw_capture_after_a_torch_capture_is_not_taken_for_that_torch_graph(m, glue, tmp_path, monkeypatch):
    """A graph captured outside torch (raw cudaStreamBeginCapture) on a thread whose torch capture
    has ended must not be taken for that torch graph: when the torch graph is reset, only its own
    slots come back; the raw graph, which fastdump cannot see destroyed, keeps its slots (its
    replays write them) and is still dumped whole."""
    from fastdump.staging import cuda

    current = Stream(glue)
    monkeypatch.setattr(cuda, "_current_stream", current)
    _watch_torch_graphs(monkeypatch)
    side = m._mock.stream_create_flags(0)
    model, raw_model = Model(m, 4), Model(m, 4)
    d = _attach(tmp_path, writer="thread", device="cuda:0", graph_ring_mb=1)
    raw = g2 = None
    try:
        g = _torch_capture(m, model, d, current, side)
        raw = capture(m, raw_model, d, current, side)  # this thread, after the torch capture ended
        current.raw = glue
        g.reset()
        g2 = _torch_capture(m, model, d, current, side)  # its capture_begin gives dead graphs' slots back
        current.raw = glue
        rec = d._graphs.recorder(0).stats()
        assert rec["reclaimed_graphs"] == 1, rec
        expected = [replay(m, raw_model, raw[1], glue, rand_input(raw_model, 90 + k)) for k in range(2)]
        m._mock.sync(glue)
        stats = d.close()
    finally:
        release(m, [p for p in [raw] if p], [side], [])
        if g2 is not None:
            g2.reset()
        free_device_memory(d)
    assert stats["graph_replays"] == 2 and stats["dropped_passes"] == 0
    ds = fastdump.open(tmp_path)
    passes = graph_passes(ds, "target")
    assert len(passes) == 2
    for p, (h1, h2) in zip(passes, expected):
        got = ds.load("target", 0, p)
        assert same_bits(torch.as_tensor(got["layers.0"]), h1) and same_bits(torch.as_tensor(got["layers.1"]), h2)


def test_a_torch_graph_with_one_recorded_tensor_keeps_the_recording_memory(m, glue, tmp_path, monkeypatch):
    """A graph that recorded a single tensor writes its slot at every replay like any other: while
    the torch graph exists, free_device_memory() keeps the memory (False); once it is reset, the
    memory is freed (True)."""
    from fastdump.staging import cuda

    current = Stream(glue)
    monkeypatch.setattr(cuda, "_current_stream", current)
    _watch_torch_graphs(monkeypatch)
    side = m._mock.stream_create_flags(0)
    model = Model(m, 4)
    cpu = torch.zeros(model.shape, dtype=torch.int32)
    d = _attach(tmp_path, writer="thread", device="cuda:0", graph_ring_mb=1)
    g = torch.cuda.CUDAGraph(m, side)
    try:
        current.raw = side
        g.capture_begin()
        d.begin_pass()
        assert m._mock.enqueue_copy(side, model.h1, model.x, model.nbytes) == 0
        d.dump("only", FakeCudaTensor(cpu, model.h1))
        d.end_pass()
        g.capture_end()
        current.raw = glue
        assert d._graphs.recorder(0).stats()["captured_tensors"] == 1
        d.close()
        assert free_device_memory(d) is False  # g still writes into it
        g.reset()
        assert free_device_memory(d) is True
    finally:
        if g.graph is not None:
            g.reset()
        m._mock.stream_destroy(side)
        free_device_memory(d)


def test_a_stale_graph_is_counted_when_the_next_capture_on_its_stream_is_invalidated(m, glue, tmp_path, monkeypatch):
    """A pass's capture ended (the graph exists and may be replayed: it was instantiated) without the
    pass ending, and the next capture on that stream was invalidated. The stale graph is still a
    graph whose replays run unseen: given up and counted (graphs_not_dumped), not taken for the
    invalidated capture (which makes no graph and is no loss)."""
    from fastdump.staging import cuda

    current = Stream(glue)
    monkeypatch.setattr(cuda, "_current_stream", current)
    d = _attach(tmp_path, writer="thread", device="cuda:0")
    side = m._mock.stream_create_flags(0)
    model = Model(m, 4)
    d.begin_pass()
    current.raw = side
    assert m._mock.begin_capture(side, GLOBAL) == 0
    assert m._mock.enqueue_copy(side, model.h1, model.x, model.nbytes) == 0
    d.dump("layers.0", FakeCudaTensor(model.cpu, model.h1))
    err, stale = m._mock.end_capture(side)  # the pass goes on after its capture
    assert err == 0, m._mock.error_name(err)
    exe = m._mock.graph_instantiate(stale)
    assert m._mock.begin_capture(side, GLOBAL) == 0  # the next capture on that stream ...
    with pytest.raises(RuntimeError, match="cudaErrorStreamCaptureUnsupported"):
        m._mock.malloc(16)  # ... is invalidated
    try:
        d.dump("layers.1", FakeCudaTensor(model.cpu, model.h2))
        d.end_pass()
        err, failed = m._mock.end_capture(side)
        assert m._mock.error_name(err) == "cudaErrorStreamCaptureInvalidated" and failed == 0
        current.raw = glue
        stats = d.close()
    finally:
        release(m, [(stale, exe)], [side], [d])
    assert stats["graphs_not_dumped"] == 1


def test_no_slots_are_given_back_while_a_recorder_has_a_capture_open(m, glue, tmp_path, monkeypatch):
    """reclaim_dead_graphs (run as any torch capture begins) leaves a Dumper whose own capture is
    open alone: the open graph's span is still a free extent, and a dead graph's extent given back
    just before it merged with it, so the open graph's commit found no extent at its offset and its
    slots were never held: the next graph would take them while the first still replays."""
    from fastdump.staging import cuda, graphs

    current = Stream(glue)
    monkeypatch.setattr(cuda, "_current_stream", current)
    _watch_torch_graphs(monkeypatch)
    side, raw_side = m._mock.stream_create_flags(0), m._mock.stream_create_flags(0)
    model, raw_model = Model(m, 4), Model(m, 4)
    d = _attach(tmp_path, writer="thread", device="cuda:0", graph_ring_mb=1)
    raw = None
    try:
        g = _torch_capture(m, model, d, current, side)  # slots [0, span)
        current.raw = glue
        g.reset()  # dead: its slots may come back at the next capture's begin
        rec = d._graphs.recorder(0)
        span = rec.stats()["slot_used"]
        assert span > 0
        current.raw = raw_side
        assert m._mock.begin_capture(raw_side, GLOBAL) == 0  # a raw capture: its graph grows from `span`
        d.begin_pass()
        assert m._mock.enqueue_copy(raw_side, raw_model.h1, raw_model.x, raw_model.nbytes) == 0
        d.dump("layers.0", FakeCudaTensor(raw_model.cpu, raw_model.h1))
        graphs.reclaim_dead_graphs()  # what a torch capture begun meanwhile (another stream) runs first
        d.end_pass()
        err, raw_graph = m._mock.end_capture(raw_side)
        assert err == 0, m._mock.error_name(err)
        raw = (raw_graph, m._mock.graph_instantiate(raw_graph))
        current.raw = glue
        st = rec.stats()
        # its own span (header room + the tensor) held; g's slots come back at a later begin
        assert st["slot_used"] == span + 256 + raw_model.nbytes and st["reclaimed_graphs"] == 0, st
        d.close()
    finally:
        release(m, [p for p in [raw] if p], [side, raw_side], [])
        free_device_memory(d)
