"""The writer process's priority: it starts at the serving process's, and goes to SCHED_IDLE
(writer_priority="idle", the default) only once the first attach's open is acked, so a machine
other processes keep busy does not starve its start-up (fastdump/writer/__main__.py)."""

import contextlib
import os
import subprocess
import sys
import time

import pytest
import torch

import fastdump
from fastdump.staging.engine import Engine
from fastdump.writer import segment_file
from conftest import same_bits

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE") or not hasattr(os, "sched_setaffinity"),
                                reason="SCHED_IDLE and CPU affinity are Linux-only")

START_TIMEOUT_S = 15.0  # the engine's start timeout in these tests (60 s by default)
BUSY_LOOPS = 2


@contextlib.contextmanager
def one_cpu():
    """This process, and what it starts meanwhile (a writer process, busy loops), on one CPU. The
    writer is let go of it after: an idle writer still has to close on a machine other tests keep
    busy, where one CPU seldom has idle time to give it."""
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, allowed)
        engine = Engine._current
        if engine is not None and engine._proc is not None and engine._proc.poll() is None:
            os.sched_setaffinity(engine._proc.pid, allowed)


@contextlib.contextmanager
def busy_loops(count: int = BUSY_LOOPS):
    """Processes that keep the CPU busy: on one CPU (one_cpu), whatever the machine's size, an
    idle-priority process beside them gets almost nothing (1-2 ms a second, measured)."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


@contextlib.contextmanager
def one_busy_cpu():
    with one_cpu(), busy_loops():
        yield


def policy_of(tid: int):
    try:
        return os.sched_getscheduler(tid)
    except OSError:  # (a thread that ended meanwhile)
        return None


def wait_for_policy(pid: int, policy: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while policy_of(pid) != policy and time.monotonic() < deadline:
        time.sleep(0.01)
    return policy_of(pid)


def test_an_idle_writer_starts_and_acks_its_first_open_beside_busy_loops(tmp_path, monkeypatch):
    """It lowered itself before its imports: attach waited the whole start timeout (54 s beside 3
    busy loops on 2 CPUs) and returned a Dumper that does not dump."""
    monkeypatch.setattr(Engine.__init__, "__defaults__", (0, START_TIMEOUT_S))
    x = torch.arange(12.0)
    with one_busy_cpu():
        started = time.monotonic()
        d = fastdump.attach(None, tmp_path)  # writer_priority="idle", the default
        took = time.monotonic() - started
        try:
            assert d.stats()["error"] is None, (took, d.stats()["error"])
            writer = d._engine._proc.pid
            # Once the open is acked it goes to SCHED_IDLE, and its I/O threads stay at the
            # priority it started with (made before it lowered itself).
            assert wait_for_policy(writer, os.SCHED_IDLE) == os.SCHED_IDLE
            others = [policy_of(int(tid)) for tid in os.listdir(f"/proc/{writer}/task") if int(tid) != writer]
            assert others.count(os.SCHED_OTHER) == segment_file.IO_THREADS, others
        except BaseException:
            d.close(timeout=1)
            raise
    d.dump("x", x)  # (the loops are gone: the idle writer gets the CPU it needs to close)
    assert d.close(timeout=30)["status"] == "closed"
    assert same_bits(fastdump.open(tmp_path).load("target", 0, 0)["x"], x)


def test_a_later_attach_goes_on_while_an_idle_writer_is_behind(tmp_path):
    """The EAGLE draft attached while the target's idle-priority writer, on a CPU other processes
    keep busy, has the target's tensors to write before the draft's open: attach waited
    block_timeout_s for the open's ack and gave up (a Dumper that never dumps). Now it goes on once
    the kernel shows the writer runnable (starved or busy), and the writer takes the open in ring
    order: both dumps are whole once the CPU is free again."""
    big = [torch.full((1 << 18,), float(i)) for i in range(16)]  # 16 MiB to write ahead of the open
    small = torch.arange(5.0)
    with one_cpu():
        target = fastdump.attach(None, tmp_path, role="target", ring_mb=256)
        try:
            assert target.stats()["error"] is None
            assert wait_for_policy(target._engine._proc.pid, os.SCHED_IDLE) == os.SCHED_IDLE
            with busy_loops():
                with target.manual_pass():
                    for i, tensor in enumerate(big):
                        target.dump(f"t{i}", tensor)
                started = time.monotonic()
                draft = fastdump.attach(None, tmp_path, role="draft", block_timeout_s=5)
                took = time.monotonic() - started
                assert draft.stats()["error"] is None, draft.stats()["error"]
                assert took < 4, f"attach took {took:.1f} s"  # (patience 1 s, then a 0.1 s look at the writer)
                with draft.manual_pass():
                    draft.dump("x", small)
        except BaseException:
            target.close(timeout=1)
            raise
    assert draft.close(timeout=60)["status"] == "closed"
    assert target.close(timeout=60)["status"] == "closed"
    ds = fastdump.open(tmp_path)
    assert same_bits(ds.load("draft", 0, 0)["x"], small)
    loaded = ds.load("target", 0, 0)
    assert sorted(loaded) == sorted(f"t{i}" for i in range(16))
    assert all(same_bits(loaded[f"t{i}"], tensor) for i, tensor in enumerate(big))


def test_a_later_attach_whose_open_the_writer_then_fails_stops_with_the_writers_error(tmp_path):
    """The open attach did not wait for fails when the writer gets to it (its rank.json cannot be
    made): the Dumper stops at its next pass or its close with the writer's error, and verify fails
    that directory; the target's dump stays whole."""
    big = [torch.full((1 << 18,), float(i)) for i in range(16)]
    with one_cpu():
        target = fastdump.attach(None, tmp_path, role="target")
        try:
            assert wait_for_policy(target._engine._proc.pid, os.SCHED_IDLE) == os.SCHED_IDLE
            with busy_loops():
                with target.manual_pass():
                    for i, tensor in enumerate(big):
                        target.dump(f"t{i}", tensor)
                draft = fastdump.attach(None, tmp_path, role="draft", block_timeout_s=5)
                assert draft.stats()["error"] is None, draft.stats()["error"]
                assert not (draft.dir / "rank.json").exists()  # the writer has not taken the open yet
                (draft.dir / "rank.json").mkdir()  # where its atomic rename must land: EISDIR
        except BaseException:
            target.close(timeout=1)
            raise
    for _ in range(3):
        with draft.manual_pass():
            draft.dump("x", torch.arange(3.0))
    stats = draft.close(timeout=60)
    assert stats["status"] == "error" and "cannot open" in stats["error"] and "rank.json" in stats["error"], stats
    assert target.close(timeout=60)["status"] == "closed"
    from fastdump.cli.dump import verify_dump
    problems = verify_dump(str(tmp_path)).problems
    assert problems and all("draft" in text for text in problems), problems
    loaded = fastdump.open(tmp_path).load("target", 0, 0)
    assert all(same_bits(loaded[f"t{i}"], tensor) for i, tensor in enumerate(big))
