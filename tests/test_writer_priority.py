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
def one_busy_cpu():
    """This process, the writer it starts and BUSY_LOOPS spinning processes share one CPU: the
    CPU is kept busy whatever the machine's size, and an idle-priority process on it gets almost
    nothing (about 1-2 ms a second, measured beside 3 loops on 2 CPUs)."""
    allowed = os.sched_getaffinity(0)
    cpu = min(allowed)
    os.sched_setaffinity(0, {cpu})  # inherited by the loops and by the writer process
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(BUSY_LOOPS)]
    try:
        yield cpu
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
        os.sched_setaffinity(0, allowed)


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
