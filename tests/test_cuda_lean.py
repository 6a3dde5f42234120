"""The lean CUDA eager path (CudaStager::stage_lean behind ChannelStager.stage_tensor) against the mock
CUDA runtime: what the forward thread does per tensor (runtime calls, heap allocations, mutex
acquisitions, counted per thread by the mock build), one event per N snapshots, batches handed to the
drain, capture detection at pass and stream changes, the fallbacks to the checked path, and the
content of every staged tensor, bit for bit. docs/CUDA.md, "The eager path"."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

import fastdump
from fastdump import dtypes
from fastdump.capture.dumper import _FAST_CODES
from test_cuda import (GLOBAL, FakeCudaTensor, FakeStream, Ring, _attach, _dump_pass, _load, fake_cuda, glue,  # noqa: F401
                       m, mock, same_bits, to_device)

NOT_FAST = -1


class Current:
    """The current stream of each device as the lane asks for it (torch._C._cuda_getCurrentRawStream's
    role): ``raw`` on device 0, the legacy stream (0) elsewhere, as in torch, where a stream belongs
    to one device (the mock refuses a kernel or an event on another device's stream)."""

    def __init__(self, raw):
        self.raw = raw
        self.asked = 0

    def raw_stream(self, device):
        self.asked += 1
        return self.raw if device == 0 else 0

    def stream_object(self, device):
        return FakeStream(self.raw_stream(device))


class Lane:
    """A mock ring, a mock CudaStager and a ChannelStager whose CUDA tensors go to the lean path."""

    def __init__(self, m, stream, *, events_every=16, capacity=8 << 20, chunk=0, device_ring=4 << 20, channel=0):
        self.m = m
        self.ring = Ring(m, capacity, chunk)
        self.stager = m.CudaStager(self.ring.producer, device_ring)
        self.stager.register_host()
        self.stager.events_every = events_every
        self.current = Current(stream)
        self.lane = m.ChannelStager(self.ring.producer, channel, _FAST_CODES, torch.strided)
        self.lane.set_cuda(self.stager, self.current.raw_stream, self.current.stream_object)
        self.stager.prepare(0)
        self.stager.prepare(1)

    def run_pass(self, pass_id, tensors, block=True):
        self.lane.begin(pass_id, block, -1.0)
        statuses = [self.lane.stage_tensor(i, t) for i, t in enumerate(tensors)]
        self.lane.take_counts()  # the pass end: the lane's last batch goes to the drain
        return statuses

    def close(self):
        self.stager.close()


def fakes(m, n, seed=0, device=0):
    """n small tensors of assorted dtypes and shapes in mock device memory (contiguous)."""
    g = torch.Generator().manual_seed(seed)
    out, cpu = [], []
    kinds = [torch.float32, torch.bfloat16, torch.int64, torch.float16, torch.int8]
    for i in range(n):
        dt = kinds[i % len(kinds)]
        shape = (1 + i % 4, 16 + (i * 7) % 50)
        t = torch.randint(-100, 100, shape, generator=g).to(dt)
        cpu.append(t)
        out.append(fake_cuda(m, t, device))
    return out, cpu


def check_ring(ring, expected):
    """expected: {(name_id, pass_id): cpu tensor}; every one in the ring, bit for bit, nothing else."""
    got, _ = ring.read(timeout=1.0)
    assert set(got) == {(0, n, p) for (n, p) in expected}, (sorted(got), sorted(expected))
    for (n, p), t in expected.items():
        dtype, shape, data = got[(0, n, p)]
        assert dtype == dtypes.code_of(t.dtype) and shape == tuple(t.shape), (n, p)
        assert data == t.contiguous().view(torch.uint8).numpy().tobytes(), (n, p)


def test_lean_steady_state_costs_on_the_forward_thread(m):
    """Per pass of T tensors, N snapshots per event, once warm: T snapshot copies, at most
    ceil(T/N)+1 event records (each after a capture check), one capture check per pass, the current
    device read per tensor (and at the pass's end), no other runtime call, no heap
    allocation per tensor, at most 3 mutex acquisitions per tensor (lane, device ring, host ring) plus 2 per
    batch; every tensor bit-exact in the ring; every tensor went through the lean path."""
    stream = m._mock.stream_create()
    T, N, P = 60, 16, 4
    lane = Lane(m, stream, events_every=N)
    try:
        ts, cpu = fakes(m, T)
        expected = {}
        for p in range(2):  # warm: names, lanes, vectors, event pool
            assert lane.run_pass(p, ts) == [m.STAGED] * T
            expected.update({(i, p): c for i, c in enumerate(cpu)})
        m._mock.reset_thread_counts()
        t0 = time.thread_time_ns()
        for p in range(2, 2 + P):
            assert lane.run_pass(p, ts) == [m.STAGED] * T
            expected.update({(i, p): c for i, c in enumerate(cpu)})
        ns = (time.thread_time_ns() - t0) / (P * T)
        counts = m._mock.thread_counts()
        calls = dict(counts["calls"])
        print(f"\nmock, forward thread: {ns:.0f} ns CPU per tensor (stage_tensor incl. Python attribute reads); "
              f"counts over {P * T} tensors: {counts}")
        assert calls.pop("cudaMemcpyAsync") == P * T
        assert calls.pop("cudaEventRecord") <= P * (math.ceil(T / N) + 1)
        # one capture check per pass, and one per batch before its event (never an event in a capture)
        assert calls.pop("cudaStreamIsCapturing", 0) <= P * (math.ceil(T / N) + 2)
        # the current device, at each tensor (a thread-local read: a thread may switch devices
        # mid-pass), and at the pass end's seal
        assert calls.pop("cudaGetDevice", 0) <= P * T + 2 * P
        assert calls == {}, calls  # nothing else on the forward thread
        total_calls = sum(counts["calls"].values())
        assert total_calls / (P * T) <= 2 + (2 * math.ceil(T / N) + 5) / T
        # Pools (events, queues) may still grow once under a drain backlog: never per tensor.
        assert counts["allocs"] * 50 <= P * T, counts
        batches = P * (math.ceil(T / N) + 1)
        assert counts["locks"] <= 3 * P * T + 2 * batches, counts
        assert lane.stager.flush(10)
        st = lane.stager.stats()
        assert st["lean_tensors"] == st["tensors"] == (2 + P) * T
        assert st["snapshot_events"] <= (2 + P) * (math.ceil(T / N) + 1)
        assert st["drain_wakeups"] == st["snapshot_events"]
        assert st["lean_checks"] <= 2 + P  # one per pass
        check_ring(lane.ring, expected)
    finally:
        lane.close()
        m._mock.stream_destroy(stream)


def test_general_path_costs_more_calls(m):
    """The contrast the lean path is for: the checked stage() makes four runtime calls per tensor on
    the calling thread (device, capture state, snapshot, event)."""
    stream = m._mock.stream_create()
    ring = Ring(m)
    stager = m.CudaStager(ring.producer, 4 << 20)
    stager.register_host()
    stager.prepare(0)
    try:
        t = torch.arange(256, dtype=torch.float32)
        p = to_device(m, t)
        m._mock.reset_thread_counts()
        for i in range(10):
            assert stager.stage(0, i, 0, dtypes.code_of(t.dtype), 4, [256], [1], p, 0, stream, True) == m.STAGED
        calls = m._mock.thread_counts()["calls"]
        assert calls["cudaMemcpyAsync"] == 10 and calls["cudaEventRecord"] == 10
        assert calls["cudaStreamIsCapturing"] == 10 and calls["cudaGetDevice"] >= 10
        assert stager.flush(10)
    finally:
        stager.close()
        m._mock.stream_destroy(stream)


@pytest.mark.parametrize("n_every", [1, 7, 1000])
def test_lean_pass_end_hands_the_batch_to_the_drain(m, n_every):
    """One event per N snapshots, and the pass end seals the rest: every record is published without
    flush(), and the drain copied them in about one batch per event, not one per tensor."""
    stream = m._mock.stream_create()
    m._mock.set("max_delay_us", 100)  # the producer stream runs late: the event really orders the copies
    T = 40
    lane = Lane(m, stream, events_every=n_every)
    try:
        ts, cpu = fakes(m, T, seed=n_every)
        assert lane.run_pass(0, ts) == [m.STAGED] * T
        deadline = time.monotonic() + 10
        while lane.stager.stats()["published"] < T and time.monotonic() < deadline:
            time.sleep(0.005)
        st = lane.stager.stats()
        assert st["published"] == T  # no flush(): the pass end sealed the last batch
        assert st["snapshot_events"] == math.ceil(T / n_every)
        assert st["d2h_batches"] <= st["snapshot_events"] + 2 * (n_every == 1000)
        check_ring(lane.ring, {(i, 0): c for i, c in enumerate(cpu)})
    finally:
        lane.close()
        m._mock.stream_destroy(stream)


def test_lean_open_batch_is_sealed_by_the_drain_timer(m, monkeypatch):
    """A pass that stays open (no pass end, fewer than N tensors): the drain seals the batch after
    the hold time (FASTDUMP_CUDA_HOLD_MS), so its records are published without any further call on
    the forward thread, within a bounded time (50 ms here; the wait below allows 200 times that)."""
    monkeypatch.setenv("FASTDUMP_CUDA_HOLD_MS", "50")
    stream = m._mock.stream_create()
    lane = Lane(m, stream, events_every=1000)
    try:
        ts, cpu = fakes(m, 5, seed=3)
        lane.lane.begin(0, True, -1.0)
        assert [lane.lane.stage_tensor(i, t) for i, t in enumerate(ts)] == [m.STAGED] * 5
        deadline = time.monotonic() + 10
        while lane.stager.stats()["published"] < 5 and time.monotonic() < deadline:
            time.sleep(0.005)
        st = lane.stager.stats()
        assert st["published"] == 5 and st["timer_seals"] >= 1
        check_ring(lane.ring, {(i, 0): c for i, c in enumerate(cpu)})
    finally:
        lane.close()
        m._mock.stream_destroy(stream)


def test_lean_capture_on_a_side_stream_mid_pass_is_seen(m):
    """torch.cuda.graph switches to its capture stream: a tensor hooked there, mid-pass, is refused
    (NOT_FAST, so the Dumper's general path gets CAPTURING for the graph recorder) and nothing of
    the lean path joins the capture; back on the eager stream the lean path stages again."""
    eager, side = m._mock.stream_create(), m._mock.stream_create_flags(0)
    lane = Lane(m, eager, events_every=4)
    try:
        ts, cpu = fakes(m, 6, seed=5)
        lane.lane.begin(0, True, -1.0)
        assert [lane.lane.stage_tensor(i, ts[i]) for i in range(3)] == [m.STAGED] * 3
        assert m._mock.begin_capture(side, GLOBAL) == 0
        lane.current.raw = side
        assert lane.lane.stage_tensor(3, ts[3]) == NOT_FAST
        assert lane.stager.stage(0, 3, 0, dtypes.code_of(cpu[3].dtype), cpu[3].element_size(), list(cpu[3].shape),
                                 list(cpu[3].stride()), ts[3].data_ptr(), 0, side, True) == m.CAPTURING
        assert lane.lane.stage_tensor(4, ts[4]) == NOT_FAST  # still capturing: asked again, not cached
        err, graph = m._mock.end_capture(side)
        assert err == 0, m._mock.error_name(err)  # the capture stayed valid
        lane.current.raw = eager
        assert lane.lane.stage_tensor(5, ts[5]) == m.STAGED
        lane.lane.take_counts()
        assert lane.stager.flush(10)
        st = lane.stager.stats()
        # counted once per tensor, by stage() (the Dumper's general path, here the direct call)
        assert st["capturing_skipped"] == 1 and st["lean_tensors"] == 4
        check_ring(lane.ring, {(i, 0): cpu[i] for i in (0, 1, 2, 5)})
        m._mock.graph_destroy(graph)
    finally:
        lane.close()
        m._mock.stream_destroy(eager)
        m._mock.stream_destroy(side)


def test_lean_capture_begun_between_passes_on_the_same_stream_is_seen(m):
    """SGLang/vLLM capture each graph in its own forward (a pass of its own), possibly on the stream
    the warm-up passes ran on: the check made at each pass's first tensor sees the capture."""
    s = m._mock.stream_create()
    lane = Lane(m, s, events_every=4)
    try:
        ts, cpu = fakes(m, 2, seed=6)
        assert lane.run_pass(0, ts) == [m.STAGED] * 2
        assert m._mock.begin_capture(s, GLOBAL) == 0
        assert lane.run_pass(1, ts) == [NOT_FAST] * 2
        err, graph = m._mock.end_capture(s)
        assert err == 0, m._mock.error_name(err)
        assert lane.run_pass(2, ts) == [m.STAGED] * 2
        assert lane.stager.flush(10)
        check_ring(lane.ring, {(i, p): cpu[i] for i in range(2) for p in (0, 2)})
        m._mock.graph_destroy(graph)
    finally:
        lane.close()
        m._mock.stream_destroy(s)


def test_lean_new_pass_id_checks_again_even_without_a_pass_end(m):
    """The lane's capture check is per pass: a new pass id makes it check again even when the
    previous pass never reached the lane's pass end (take_counts / put_plain_end / end_pass: its batch
    sealed by the drain's hold timer or a flush, which leave the check in place), so a
    capture begun outside torch between the two passes (no capture epoch) is seen, and no snapshot
    is enqueued into the user's graph."""
    s = m._mock.stream_create()
    lane = Lane(m, s, events_every=100)
    graph = None
    try:
        ts, cpu = fakes(m, 2, seed=11)
        lane.lane.begin(0, True, -1.0)
        assert lane.lane.stage_tensor(0, ts[0]) == m.STAGED
        assert lane.stager.flush(10)  # sealed as the drain's hold timer would: the lane's check stays
        lane.lane.begin(1, True, -1.0)  # (no pass end on the lane in between)
        assert m._mock.begin_capture(s, GLOBAL) == 0
        assert lane.lane.stage_tensor(1, ts[1]) == NOT_FAST
        err, graph = m._mock.end_capture(s)
        assert err == 0, m._mock.error_name(err)
        lane.lane.take_counts()
        assert lane.stager.flush(10)
        check_ring(lane.ring, {(0, 0): cpu[0]})
    finally:
        if graph:
            m._mock.graph_destroy(graph)
        lane.close()
        m._mock.stream_destroy(s)


def test_lean_check_each_tensor_sees_a_capture_begun_mid_pass_on_the_same_stream(m, monkeypatch):
    """FASTDUMP_CUDA_CHECK_EACH_TENSOR=1: for code that begins a capture mid-pass on the stream it was
    already running on (the one case the per-pass rule misses), every tensor asks."""
    monkeypatch.setenv("FASTDUMP_CUDA_CHECK_EACH_TENSOR", "1")
    s = m._mock.stream_create()
    lane = Lane(m, s, events_every=100)
    try:
        ts, cpu = fakes(m, 3, seed=7)
        lane.lane.begin(0, True, -1.0)
        assert lane.lane.stage_tensor(0, ts[0]) == m.STAGED
        assert m._mock.begin_capture(s, GLOBAL) == 0
        assert lane.lane.stage_tensor(1, ts[1]) == NOT_FAST
        err, graph = m._mock.end_capture(s)
        assert err == 0, m._mock.error_name(err)
        assert lane.lane.stage_tensor(2, ts[2]) == m.STAGED
        lane.lane.take_counts()
        assert lane.stager.flush(10)
        check_ring(lane.ring, {(0, 0): cpu[0], (2, 0): cpu[2]})
        m._mock.graph_destroy(graph)
    finally:
        lane.close()
        m._mock.stream_destroy(s)


@pytest.mark.parametrize("timer_first", [False, True], ids=["tensor-first", "drain-timer-first"])
def test_lean_capture_begun_mid_pass_through_torch_is_seen_and_the_batch_before_it_kept(m, timer_first):
    """The per-pass check's gap, closed for torch's captures: CUDAGraph.capture_begin tells the
    extension first (note_capture_begin), so a capture begun mid-pass on the stream the pass already
    checked is seen at the next tensor (CAPTURING, for the graph recorder), the snapshots queued
    before it stay valid and are written once the capture has ended, and staging goes on.

    drain-timer-first, the timer-seal race: the drain's hold timer sealed the open batch before the
    lane's next tensor saw the capture epoch change. The seal found the stream capturing, could not
    tell the batch came before the capture (only the next tensor marked that), gave the batch up and
    stopped CUDA staging for the process ("not begun through torch"). The epoch the lane checked at
    tells it: the batch is held until the capture ends, then sealed and written."""
    s = m._mock.stream_create()
    lane = Lane(m, s, events_every=100)
    try:
        ts, cpu = fakes(m, 4, seed=11)
        lane.lane.begin(0, True, -1.0)
        assert lane.lane.stage_tensor(0, ts[0]) == m.STAGED
        assert lane.lane.stage_tensor(1, ts[1]) == m.STAGED
        m.note_capture_begin()  # what the hook on torch.cuda.CUDAGraph.capture_begin does first
        assert m._mock.begin_capture(s, GLOBAL) == 0
        if timer_first:
            time.sleep(0.1)  # the drain's timer (2 ms hold) finds the batch open, its stream capturing
            st = lane.stager.stats()
            assert not st["broken"] and st["published"] == 0, st
        assert lane.lane.stage_tensor(2, ts[2]) == NOT_FAST  # CAPTURING: the general path records it
        err, graph = m._mock.end_capture(s)
        assert err == 0, m._mock.error_name(err)
        assert lane.lane.stage_tensor(3, ts[3]) == m.STAGED
        lane.lane.take_counts()
        assert lane.stager.flush(10)
        check_ring(lane.ring, {(0, 0): cpu[0], (1, 0): cpu[1], (3, 0): cpu[3]})
        st = lane.stager.stats()
        assert not st["broken"] and st["cancelled"] == 0 and "mid-pass" not in (st.get("error") or ""), st
        m._mock.graph_destroy(graph)
    finally:
        lane.close()
        m._mock.stream_destroy(s)


class CaptureRace:
    """The set-up of the capture-race tests below: a lane on a stream of its own with one event per
    100 snapshots (so only a seal from outside the lane ends its batch), ``n`` fake tensors, tensors
    0 and 1 staged in pass 0. As a context manager it ends a capture the test left open (a failed
    check: the device's memory can be freed only without one), destroys the graph the capture made,
    and closes the lane and the stream."""

    def __init__(self, m, n, seed):
        self.m = m
        self.ts, self.cpu = fakes(m, n, seed=seed)
        self.s = m._mock.stream_create()
        self.lane = Lane(m, self.s, events_every=100)
        self.capturing, self.graph = False, None

    def __enter__(self):
        try:
            self.lane.lane.begin(0, True, -1.0)
            assert self.lane.lane.stage_tensor(0, self.ts[0]) == self.m.STAGED
            assert self.lane.lane.stage_tensor(1, self.ts[1]) == self.m.STAGED
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def end_capture(self):
        err, self.graph = self.m._mock.end_capture(self.s)
        self.capturing = False
        assert err == 0, self.m._mock.error_name(err)

    def flush_and_check(self, expected):
        """The lane's last batch handed over and flushed: staging never broke nor gave a batch up,
        and the ring holds ``expected`` ({(name_id, pass_id): cpu tensor}) and nothing else."""
        self.lane.lane.take_counts()
        assert self.lane.stager.flush(10)
        st = self.lane.stager.stats()
        assert not st["broken"] and st["last_error"] == "" and st["cancelled"] == 0, st
        check_ring(self.lane.ring, expected)

    def __exit__(self, *exc):
        if self.capturing:
            self.m._mock.end_capture(self.s)
        if self.graph:
            self.m._mock.graph_destroy(self.graph)
        self.lane.close()
        self.m._mock.stream_destroy(self.s)


def test_lean_batch_sealed_by_another_thread_after_a_torch_capture_began_is_held_not_given_up(m):
    """The timer-seal race: torch began a capture on the lane's stream (the capture epoch moved)
    after the batch's snapshots were enqueued, and a seal from another thread (the drain's hold
    timer, a flush) finds the stream capturing before the lane's next tensor saw the epoch move.
    Every snapshot of the batch preceded the capture: the batch is held until the capture ended,
    then sealed and written; staging goes on. (Given up, it stopped CUDA staging for the process.)"""
    with CaptureRace(m, 3, seed=17) as race:
        lane = race.lane
        m.note_capture_begin()  # what the hook on torch.cuda.CUDAGraph.capture_begin does first
        assert m._mock.begin_capture(race.s, GLOBAL) == 0
        race.capturing = True
        th = threading.Thread(target=lambda: lane.stager.flush(0.2))  # seals every lane: this one is held
        th.start()
        th.join()
        st = lane.stager.stats()
        assert not st["broken"] and st["last_error"] == "" and st["cancelled"] == 0, st
        race.end_capture()
        lane.lane.begin(1, True, -1.0)
        assert lane.lane.stage_tensor(2, race.ts[2]) == m.STAGED
        race.flush_and_check({(0, 0): race.cpu[0], (1, 0): race.cpu[1], (2, 1): race.cpu[2]})


def test_lean_drain_timer_never_seals_while_torch_is_beginning_a_capture(m):
    """While the capture gate is held (torch's cudaStreamBeginCapture under way in the
    capture_begin hook), the drain's hold timer leaves the lane's batch alone: had it sealed then,
    its capture check could come before torch's begin and its event record after it, a node of the
    user's graph. The batch is sealed once the capture ended; nothing is lost, staging goes on."""
    with CaptureRace(m, 3, seed=19) as race:
        m.note_capture_begin()
        m.capture_gate(True)  # the hook holds it around torch's begin
        try:
            m._mock.delay("cudaEventRecord", 1, 0.3)  # a seal's record, were one made now
            deadline = time.monotonic() + 0.5  # (the timer fires every 1 ms once the batch is 2 ms old)
            while m._mock.delayed() == 0 and time.monotonic() < deadline:
                time.sleep(0.001)
            assert m._mock.begin_capture(race.s, GLOBAL) == 0
            race.capturing = True
        finally:
            m.capture_gate(False)
            m._mock.delay("cudaEventRecord", 0, 0)
        time.sleep(0.35)  # a record delayed above would land in the capture now
        race.end_capture()
        race.lane.lane.begin(1, True, -1.0)
        assert race.lane.lane.stage_tensor(2, race.ts[2]) == m.STAGED
        race.flush_and_check({(0, 0): race.cpu[0], (1, 0): race.cpu[1], (2, 1): race.cpu[2]})


def test_lean_drain_timer_seal_never_lands_in_a_capture_begun_meanwhile(m):
    """The drain's hold timer seals a lane's batch from its own thread: it asks whether the stream
    captures, then records the batch's event there. A capture torch began on that stream between the
    two (an engine that begins a graph per piece, mid-pass, on the stream its eager parts ran on
    opens that window thousands of times at startup) got our event as a node of the user's graph:
    the side stream's wait on it joined the capture, the batch copy on it was refused (staging
    stopped for the process), the capture ended unjoined (the engine's capture failed), and every
    replay would record an event of our pool. CUDAGraph.capture_begin now holds the capture gate around torch's begin, and the
    drain seals only while it holds the gate: its check and its record land on one side of the
    capture's beginning. (The mock delays the drain's cudaEventRecord past its check.)"""
    with CaptureRace(m, 4, seed=13) as race:
        m._mock.delay("cudaEventRecord", 1, 0.3)  # the next record: the drain's timer seal
        deadline = time.monotonic() + 10
        while m._mock.delayed() == 0:  # the drain checked (not capturing) and is recording now
            assert time.monotonic() < deadline, "the drain's timer never sealed the batch"
            time.sleep(0.001)
        # What the hook on torch.cuda.CUDAGraph.capture_begin does around torch's begin.
        m.note_capture_begin()
        m.capture_gate(True)
        try:
            assert m._mock.begin_capture(race.s, GLOBAL) == 0
            race.capturing = True
        finally:
            m.capture_gate(False)
        assert race.lane.lane.stage_tensor(2, race.ts[2]) == NOT_FAST  # CAPTURING: the general path records it
        time.sleep(0.05)  # the drain issues the sealed batch's copies meanwhile
        race.end_capture()
        assert race.lane.lane.stage_tensor(3, race.ts[3]) == m.STAGED
        race.flush_and_check({(0, 0): race.cpu[0], (1, 0): race.cpu[1], (3, 0): race.cpu[3]})


def test_torch_capture_begin_tells_the_extension_first(monkeypatch):
    """watch_graph_captures wraps torch.cuda.CUDAGraph.capture_begin: the extension hears of the
    capture before torch begins it, and the original runs with the caller's arguments."""
    from fastdump import _C as real
    from fastdump.staging import cuda

    calls = []

    class FakeGraph:
        def capture_begin(self, pool=None, capture_error_mode="global"):
            calls.append(("torch", pool, capture_error_mode))

        def capture_end(self):
            calls.append(("torch end",))

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(cuda, "_capture_hook", None)
    # (the module's record of open captures: this fake one must not stay open for later tests,
    # where it kept the slots of reset graphs from being reclaimed)
    monkeypatch.setattr(cuda, "_open_captures", {})
    monkeypatch.setattr(real, "note_capture_begin", lambda: calls.append(("fastdump",)), raising=False)
    monkeypatch.setattr(real, "capture_gate", lambda enter: calls.append(("gate", enter)), raising=False)
    assert cuda.watch_graph_captures() and cuda.watch_graph_captures()  # once
    graph = FakeGraph()
    graph.capture_begin(pool=7, capture_error_mode="relaxed")
    # the capture gate is held around torch's begin only (see test_lean_drain_timer_seal_never_lands_...)
    assert calls == [("fastdump",), ("gate", True), ("torch", 7, "relaxed"), ("gate", False)]
    assert cuda._open_captures == {id(graph): ("relaxed", threading.get_ident())}
    graph.capture_end()
    assert calls[-1] == ("torch end",) and not cuda._open_captures and cuda.capturing_graph() is None
    assert FakeGraph.capture_begin.__fastdump_original__.__name__ == "capture_begin"


def test_lean_fallbacks_stage_through_the_checked_path(m):
    """What the lean path leaves to stage(): a tensor on another GPU than the current one, a stream
    change mid-pass, a tensor of several host records, a strided view (gather kernel), an empty
    tensor: all staged, bit-exact, in one pass, interleaved with lean ones."""
    s1, s2 = m._mock.stream_create(), m._mock.stream_create()
    lane = Lane(m, s1, events_every=3, chunk=4096)
    try:
        small = torch.arange(100, dtype=torch.int32)
        big = torch.arange(5000, dtype=torch.int32)                      # 20000 bytes: 5 records of 4096
        view = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)[::2, 1::3]
        empty = torch.zeros(0, 5)
        other = torch.arange(77, dtype=torch.int16)
        items = [(small, 0), (big, 0), (view, 0), (empty, 0), (other, 1), (small * 3, 0)]
        ts = [fake_cuda(m, t, dev) for t, dev in items]
        lane.lane.begin(0, True, -1.0)
        statuses = []
        for i, t in enumerate(ts):
            if i == 5:
                lane.current.raw = s2  # the stream changed mid-pass
            statuses.append(lane.lane.stage_tensor(i, t))
        lane.lane.take_counts()
        assert statuses == [m.STAGED] * len(ts)
        assert lane.stager.flush(10)
        check_ring(lane.ring, {(i, 0): t for i, (t, _) in enumerate(items)})
        st = lane.stager.stats()
        assert st["tensors"] == len(ts) and st["snapshot_kernels"] >= 1
    finally:
        lane.close()
        m._mock.stream_destroy(s1)
        m._mock.stream_destroy(s2)


def test_lean_full_rings_never_deadlock_with_open_batches(m):
    """Batches open on the forward thread hold host records the writer waits for: a tensor that must
    wait for ring space (block) seals them first, so a small host ring and device ring drain while
    a concurrent writer consumes; every tensor arrives intact. Under `drop` the same rings drop and
    count instead of waiting."""
    s = m._mock.stream_create()
    m._mock.set("max_delay_us", 50)
    lane = Lane(m, s, events_every=1000, capacity=256 << 10, device_ring=1 << 20)
    got, stop = {}, threading.Event()

    def consume():
        while not stop.is_set():
            r = lane.ring.consumer.next(0.05)
            if r is None:
                continue
            kind, channel, name_id, pass_id, dtype, shape, payload, *_ = r
            if kind == m.KIND_TENSOR:
                got[(name_id, pass_id)] = bytes(payload)
            lane.ring.consumer.release()

    th = threading.Thread(target=consume, daemon=True)
    th.start()
    try:
        t = torch.arange(4096, dtype=torch.float32)  # 16 KiB: the 256 KiB ring holds ~15
        ts = [fake_cuda(m, t + i) for i in range(8)]
        for p in range(10):
            assert lane.run_pass(p, ts) == [m.STAGED] * len(ts)
        assert lane.stager.flush(20)
        deadline = time.monotonic() + 20
        while len(got) < 80 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(got) == 80
        for (i, p), data in got.items():
            assert data == (t + i).numpy().tobytes(), (i, p)
        stop.set()
        th.join(5)
        # `drop`, nobody consuming: the ring fills, the rest is dropped and counted, no wait.
        for p in range(10, 14):
            statuses = lane.run_pass(p, ts, block=False)
            assert set(statuses) <= {m.STAGED, m.DROPPED}
        assert m.DROPPED in statuses and lane.stager.stats()["dropped"] > 0
    finally:
        stop.set()
        lane.close()
        m._mock.stream_destroy(s)


def test_dumper_stages_cuda_tensors_through_the_cpp_entry(m, glue, tmp_path, monkeypatch):
    """Dumper.dump with a CUDA tensor of a known name: one C++ call (ChannelStager.stage_tensor), no
    Python staging function; the current stream is recorded on each tensor for the caching
    allocator; the dump is bit-exact and counted."""
    from fastdump.staging import cuda

    calls = []
    real = cuda.stage_on_device
    monkeypatch.setattr(cuda, "stage_on_device", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    cases = {"a": torch.arange(3 * 5 * 7, dtype=torch.float32).reshape(3, 5, 7),
             "b": torch.arange(600, dtype=torch.float32).to(torch.bfloat16).reshape(20, 30)[2:, ::3],
             "c": torch.arange(10, dtype=torch.int16)}
    fakes_ = {k: fake_cuda(m, v) for k, v in cases.items()}
    d = _attach(tmp_path, writer="thread", device="cuda:0")
    assert d._channel.lane.has_cuda  # registered at attach (prepare_cuda)
    for p in range(3):
        _dump_pass(d, list(fakes_.items()))
    stats = d.close()
    assert calls == [] or len(calls) == len(cases)  # at most the first pass (new names) took Python
    for p in range(3):
        got = _load(tmp_path, pass_id=p)
        for k, v in cases.items():
            assert same_bits(torch.as_tensor(got[k]) if not isinstance(got[k], torch.Tensor) else got[k], v), (p, k)
    for f in fakes_.values():
        assert [s.cuda_stream for s in f.recorded] == [glue] * 3
    st = cuda.status()["stagers"][-1]
    assert st["lean_tensors"] >= 2 * len(cases)
    assert stats["tensors"] == 3 * len(cases)


@pytest.mark.parametrize("plain_end", [True, False])
def test_the_dumpers_pass_end_hands_the_lanes_last_batch_to_the_drain(m, glue, tmp_path, monkeypatch, plain_end):
    """A pass's end seals its CUDA lane's open batch (fewer snapshots than events_every): its records
    are published at once, not after the drain's hold timer (set to a minute here), whether the
    end record is the plain one (put in C++) or carries metadata (the general path)."""
    monkeypatch.setenv("FASTDUMP_CUDA_HOLD_MS", "60000")
    from fastdump.staging import cuda

    cases = {"a": torch.arange(12, dtype=torch.float32), "b": torch.arange(6, dtype=torch.int16)}
    fakes_ = {k: fake_cuda(m, v) for k, v in cases.items()}
    d = _attach(tmp_path, writer="thread", device="cuda:0")
    try:
        for p in range(2):
            d.begin_pass()
            if not plain_end:
                d.set_pass_meta(step=p)
            for name, t in fakes_.items():
                d.dump(name, t)
            d.end_pass()
            st = cuda.status()["stagers"][-1]
            want = (p + 1) * len(cases)
            deadline = time.monotonic() + 10
            while st["published"] < want and time.monotonic() < deadline:
                time.sleep(0.01)
                st = cuda.status()["stagers"][-1]
            assert st["published"] == want and st["timer_seals"] == 0, st
    finally:
        d.close()
    for p in range(2):
        got = _load(tmp_path, pass_id=p)
        for k, v in cases.items():
            assert same_bits(torch.as_tensor(got[k]) if not isinstance(got[k], torch.Tensor) else got[k], v), (p, k)


def test_a_cuda_tensor_whose_storage_was_freed_is_skipped_not_copied(m, glue, tmp_path):
    """A CUDA tensor with elements and a null data pointer (its storage freed under it): a copy would
    fault on the device or, through the synchronous fallback, on the host. It is skipped with the
    reason on every pass, first (general path) and later (the C++ entry), and nothing else is lost."""
    from fastdump import _C
    from fastdump.staging import cuda

    good = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    freed = FakeCudaTensor(torch.zeros(3, 4), 0)
    d = _attach(tmp_path, writer="thread", device="cuda:0")
    for p in range(3):
        _dump_pass(d, [("good", fake_cuda(m, good)), ("freed", freed), ("after", fake_cuda(m, good + 1))])
    stats = d.close()
    assert stats["tensors"] == 6 and stats["skipped"] == 3
    for p in range(3):
        got = _load(tmp_path, pass_id=p)
        assert list(got) == ["good", "after"], p
        assert same_bits(got["good"], good) and same_bits(got["after"], good + 1)
        skipped = fastdump.open(tmp_path).meta("target", 0, p)["skipped"]
        assert skipped == [{"name": "freed", "reason": f"cannot capture FakeCudaTensor: ValueError: {_C.NO_DATA}"}]
    assert freed.recorded == []  # never handed to the allocator as in use: nothing was enqueued
    with pytest.raises(ValueError, match="holds no data"):  # the Python CUDA path refuses it too
        cuda.stage_on_device(None, 0, 0, 0, 0, freed, True)


def test_lean_capture_begun_mid_pass_on_a_checked_stream_stops_staging_loudly(m):
    """Without FASTDUMP_CUDA_CHECK_EACH_TENSOR, a capture begun mid-pass on the stream the pass was
    already staging on is not seen per tensor; the batch's capture check before its event sees it:
    nothing of that batch is written as if it were data, and staging stops with the reason."""
    s = m._mock.stream_create()
    lane = Lane(m, s, events_every=100)
    try:
        ts, cpu = fakes(m, 3, seed=8)
        lane.lane.begin(0, True, -1.0)
        assert lane.lane.stage_tensor(0, ts[0]) == m.STAGED
        assert m._mock.begin_capture(s, GLOBAL) == 0
        assert lane.lane.stage_tensor(1, ts[1]) == m.STAGED  # not checked per tensor: captured
        lane.lane.take_counts()  # the pass end: the batch's check finds the capture
        err, graph = m._mock.end_capture(s)
        assert err == 0, m._mock.error_name(err)
        st = lane.stager.stats()
        assert st["broken"] and "mid-pass" in st["last_error"]
        assert lane.lane.stage_tensor(2, ts[2]) == m.DISABLED
        got, _ = lane.ring.read(timeout=0.5)
        assert got == {}  # both records became padding: nothing written as data
        # The graph holds a snapshot into device 0's ring and writes it at each replay: close()
        # must leave that ring allocated (before, it was freed, and torch's allocator could hand
        # the memory to a tensor the replays then overwrote). Device 1's ring is freed.
        control = Lane(m, s)
        live = m._mock.counters()["live_allocs"]
        control.close()
        freed_normally = live - m._mock.counters()["live_allocs"]
        live = m._mock.counters()["live_allocs"]
        lane.close()
        assert live - m._mock.counters()["live_allocs"] == freed_normally - 1 >= 1
        m._mock.graph_destroy(graph)
    finally:
        lane.close()
        m._mock.stream_destroy(s)


def test_lean_a_thread_that_switched_devices_mid_pass_stages_on_the_tensors_device(m):
    """The lean path's cached check belongs to the lane (pass, device, stream), not to a thread's
    current device: a hook that runs under `with torch.cuda.device(1)` mid-pass, on a GPU-0 tensor,
    had its snapshot issued with device 1 current: a kernel on device 0's stream (a strided view's
    gather), which CUDA refuses, or a copy on device 1's legacy stream, unordered with the kernels
    that made the tensor. The device is now read at every tensor; such a tensor takes the checked
    path, which switches to its device and back."""
    s = m._mock.stream_create()  # device 0
    lane = Lane(m, s, events_every=2)
    try:
        base = torch.arange(32 * 32, dtype=torch.float32).reshape(32, 32)
        items = [base[0], base[:, 1::3], base[5] * 2, base[::2, ::4]]  # contiguous and strided views
        ts = [fake_cuda(m, t) for t in items]
        lane.lane.begin(0, True, -1.0)
        assert lane.lane.stage_tensor(0, ts[0]) == m.STAGED  # the pass's check, cached
        assert m._mock.set_device(1) == 0
        try:
            statuses = [lane.lane.stage_tensor(i, ts[i]) for i in range(1, 4)]
            assert m._mock.get_device() == 1  # the thread's device, as it was
        finally:
            m._mock.set_device(0)
        assert statuses == [m.STAGED] * 3
        lane.lane.take_counts()
        assert lane.stager.flush(10)
        st = lane.stager.stats()
        assert not st["broken"] and st["last_error"] == "", st
        assert st["lean_tensors"] == 1 and st["tensors"] == 4
        check_ring(lane.ring, {(i, 0): t for i, t in enumerate(items)})
    finally:
        lane.close()
        m._mock.stream_destroy(s)


def _capture_on_another_thread(m, stream, mode=GLOBAL):
    """Begin a capture of `stream` on a thread of its own (CuPy's or a raw cudaStreamBeginCapture);
    returns end(), which ends it there and gives back (error, graph)."""
    began, ending, result = threading.Event(), threading.Event(), {}

    def run():
        result["begin"] = m._mock.begin_capture(stream, mode)
        began.set()
        ending.wait(30)
        result["end"] = m._mock.end_capture(stream)

    th = threading.Thread(target=run)
    th.start()
    assert began.wait(10) and result["begin"] == 0

    def end():
        ending.set()
        th.join(10)
        return result["end"]

    return end


def test_lean_batch_on_the_legacy_stream_waits_out_a_blocking_stream_capture(m):
    """Review finding 6: a lean batch open on the legacy stream (torch's default) while another thread
    captures a blocking stream: the batch's capture check gets cudaErrorStreamCaptureImplicit, which
    says only that the legacy stream is unusable until that capture ends (the legacy stream never
    captures; the capture is not invalidated). The batch is kept (no event recorded into the capture),
    sealed once the capture has ended, and staging goes on; nothing is lost, nothing stops."""
    blocking = m._mock.stream_create_flags(0)
    lane = Lane(m, 0, events_every=100)
    try:
        ts, cpu = fakes(m, 3, seed=12)
        lane.lane.begin(0, True, -1.0)
        assert [lane.lane.stage_tensor(i, ts[i]) for i in range(2)] == [m.STAGED] * 2
        end_capture = _capture_on_another_thread(m, blocking)
        lane.lane.take_counts()  # the pass end seals: Implicit
        time.sleep(0.05)  # the drain's hold timer tries again meanwhile (every ~1 ms)
        st = lane.stager.stats()
        assert not st["broken"] and st["last_error"] == "", st
        assert st["published"] == 0 and st["cancelled"] == 0
        err, graph = end_capture()
        assert err == 0, m._mock.error_name(err)  # the other thread's capture stayed valid
        assert lane.stager.flush(10)
        assert lane.run_pass(1, [ts[2]]) == [m.STAGED]
        assert lane.stager.flush(10)
        st = lane.stager.stats()
        assert not st["broken"] and st["published"] == 3 and st["lean_tensors"] == 3
        check_ring(lane.ring, {(0, 0): cpu[0], (1, 0): cpu[1], (0, 1): cpu[2]})
        m._mock.graph_destroy(graph)
    finally:
        lane.close()
        m._mock.stream_destroy(blocking)


def test_lean_batch_held_by_a_capture_at_close_becomes_padding(m):
    """A batch still held open by a capture when the stager closes can never be sealed: its records
    become padding (counted as cancelled), so the writer never waits for them."""
    blocking = m._mock.stream_create_flags(0)
    lane = Lane(m, 0, events_every=100)
    end_capture = None
    try:
        ts, _ = fakes(m, 2, seed=13)
        lane.lane.begin(0, True, -1.0)
        assert [lane.lane.stage_tensor(i, ts[i]) for i in range(2)] == [m.STAGED] * 2
        end_capture = _capture_on_another_thread(m, blocking)
        lane.lane.take_counts()
        t0 = time.monotonic()
        lane.stager.close(1.0)
        assert time.monotonic() - t0 < 5
        st = lane.stager.stats()
        assert st["cancelled"] == 2 and st["published"] == 0
        got, _ = lane.ring.read(timeout=0.5)  # the reader passes the padding: nothing waits, nothing written
        assert got == {} and lane.ring.producer.used_bytes() == 0
    finally:
        if end_capture is not None:
            err, graph = end_capture()
            assert err == 0, m._mock.error_name(err)
            m._mock.graph_destroy(graph)
        lane.close()
        m._mock.stream_destroy(blocking)


# =================================================================================================
# On a GPU (benchmarks/gpu_check.sh runs these)

from test_cuda import needs_cuda_build  # noqa: E402


@pytest.mark.cuda
@needs_cuda_build
def test_gpu_lean_path_is_taken_and_bit_exact(tmp_path):
    """Real torch CUDA tensors through the Dumper: after the first pass (new names) every tensor goes
    through ChannelStager.stage_tensor's lean path; each pass's values bit-exact, including a tensor
    overwritten in place right after its hook and one made on a side stream."""
    from fastdump.staging import cuda

    torch.manual_seed(0)
    d = _attach(tmp_path, writer="thread", device="cuda:0")
    expected = []
    side = torch.cuda.Stream()
    for p in range(4):
        xs = [torch.randn(4, 1000 + i, device="cuda").to(dt)
              for i, dt in enumerate([torch.float32, torch.bfloat16, torch.float16, torch.float32])]
        with torch.cuda.stream(side):
            s = torch.arange(300, device="cuda", dtype=torch.int32) * (p + 1)
        torch.cuda.current_stream().wait_stream(side)
        d.begin_pass()
        for i, x in enumerate(xs):
            d.dump(f"x{i}", x)
        d.dump("side", s)
        snap = [x.cpu() for x in xs] + [s.cpu()]
        for x in xs:
            x.fill_(7)  # the next kernel overwrites the tensors in place
        d.end_pass()
        expected.append(snap)
    d.close()
    for p, snap in enumerate(expected):
        got = _load(tmp_path, pass_id=p)
        for i, t in enumerate(snap[:-1]):
            assert same_bits(torch.as_tensor(got[f"x{i}"]), t), (p, i)
        assert same_bits(torch.as_tensor(got["side"]), snap[-1]), p
    st = cuda.status()["stagers"][-1]
    assert st["lean_tensors"] >= 3 * 5, st


_RING_LOCK_SCENARIO = r"""
import sys, threading, time
sys.path[:0] = [sys.argv[2], sys.argv[2] + "/cuda_mock"]
import build, torch
import test_cuda
from fastdump import dtypes
from test_cuda_lean import Lane
from test_cuda import fake_cuda
m = build.load(build.build())
m.device_buffers = []
test_cuda.MOCK_MODULE[0] = m
s = m._mock.stream_create()
lane = Lane(m, s, events_every=1000, capacity=256 << 10)
got, stop = {}, threading.Event()

def consume():  # a thread writer: it needs the GIL
    while not stop.is_set():
        r = lane.ring.consumer.next(0.05)
        if r is None:
            continue
        kind, channel, name_id, pass_id, dtype, shape, payload, seq, off, total = r
        if kind == m.KIND_TENSOR:  # large tensors come in chunk records
            buf = got.setdefault((channel, name_id), bytearray(total))
            buf[off:off + len(payload)] = bytes(payload)
        lane.ring.consumer.release()

consumer = threading.Thread(target=consume, daemon=True)
consumer.start()
t = torch.arange(4096, dtype=torch.float32)  # 16 KiB
ts = [fake_cuda(m, t + i) for i in range(6)]
lane.lane.begin(0, True, -1.0)
assert [lane.lane.stage_tensor(i, ts[i]) for i in range(5)] == [m.STAGED] * 5  # open batch: 80 KiB
big = torch.arange(50000, dtype=torch.int32)  # 200 KiB: fits the ring only once the batch is written
host = {}
waiter = threading.Thread(target=lambda: host.update(st=lane.ring.producer.stage_host(
    1, 0, 0, dtypes.code_of(big.dtype), 4, [big.numel()], [1], big.data_ptr(), True)), daemon=True)
waiter.start()
time.sleep(0.3)  # the waiter holds the ring's allocation lock while it waits for the writer
assert lane.lane.stage_tensor(5, ts[5]) == m.STAGED
waiter.join(20)
assert host["st"] == m.STAGED
lane.lane.take_counts()
assert lane.stager.flush(20)
deadline = time.monotonic() + 20
while len(got) < 7 and time.monotonic() < deadline:
    time.sleep(0.01)
assert bytes(got[(1, 0)]) == big.numpy().tobytes()
for i in range(6):
    assert bytes(got[(0, i)]) == (t + i).numpy().tobytes(), i
stop.set()
consumer.join(10)
lane.close()
m._mock.sync(s)
m._mock.stream_destroy(s)
print("SCENARIO OK", flush=True)
"""


def test_lean_never_waits_for_the_ring_lock_with_an_open_batch(mock):
    """Regression (a rare hang of the stress driver): another thread waits for host-ring space while
    holding the ring's allocation lock, and the (thread) writer waits for a record of this lane's
    open batch. The lean path must not block on that lock while it holds its lane (the batch could
    then never be sealed), nor while it holds the GIL the writer needs: it falls back, seals, waits
    with the GIL released, and everything arrives. The drain's timer is held off
    (FASTDUMP_CUDA_HOLD_MS). Run in a subprocess: the bug hangs the whole interpreter."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    env = dict(os.environ, FASTDUMP_CUDA_HOLD_MS="60000",
               PYTHONPATH=os.pathsep.join([str(here.parent), os.environ.get("PYTHONPATH", "")]))
    try:
        r = subprocess.run([sys.executable, "-c", _RING_LOCK_SCENARIO, "x", str(here)], env=env,
                           capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("deadlock: the lean path waited for the ring lock holding its lane or the GIL")
    assert r.returncode == 0 and "SCENARIO OK" in r.stdout, r.stdout + r.stderr


def test_two_threads_staging_through_one_lane_onto_one_stream(m):
    """Two user threads dump into the same channel (one lane) on the same stream at once, with a
    small N and the drain's hold timer sealing batches too: the lane's per-pass check, open batch
    and event-per-N count are one state under the lane's lock, every event is recorded after the
    batch's last snapshot on that stream, so every tensor arrives bit for bit, each once."""
    stream = m._mock.stream_create()
    m._mock.set("max_delay_us", 50)
    lane = Lane(m, stream, events_every=3)
    T = 60
    try:
        ts, cpu = fakes(m, 2 * T, seed=5)
        lane.lane.begin(0, True, -1.0)
        statuses = {}

        def stage(first):
            statuses[first] = [lane.lane.stage_tensor(i, ts[i]) for i in range(first, first + T)]

        threads = [threading.Thread(target=stage, args=(k * T,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        lane.lane.take_counts()
        assert statuses[0] == [m.STAGED] * T and statuses[T] == [m.STAGED] * T
        assert lane.stager.flush(30)
        st = lane.stager.stats()
        assert st["published"] == 2 * T and st["lean_tensors"] == 2 * T, st
        check_ring(lane.ring, {(i, 0): c for i, c in enumerate(cpu)})
    finally:
        lane.close()
        m._mock.stream_destroy(stream)
