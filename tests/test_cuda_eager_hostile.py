"""Hostile tests of the eager CUDA staging path on the mock CUDA runtime (tests/cuda_mock): failures
injected mid-run, odd sources (foreign arrays released right after the dump, shapes whose size
overflows) and what rank.json and ``fastdump verify`` say afterwards; contents read back bit for bit."""

from __future__ import annotations

import gc

import torch

import fastdump
from test_cuda import _attach, glue, m, mock, same_bits, to_device  # noqa: F401


def test_cai_array_released_right_after_the_dump_is_kept_until_read(m, glue, tmp_path):
    """A `__cuda_array_interface__` array (CuPy) dropped as soon as dump() returns: its pool may hand
    the block to a kernel on another stream (the one it was allocated on) before the snapshot on the
    interface's `stream` ran. fastdump keeps the array until the snapshot has read it, as it keeps
    DLPack capsules; what is on disk is what the array held."""
    t = torch.arange(1 << 12, dtype=torch.float32)
    ptr = to_device(m, t)
    reuse, busy = m._mock.stream_create(), m._mock.stream_create()

    class Array:
        def __init__(self):
            self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (t.numel(),), "strides": None,
                                             "typestr": "<f4", "version": 3, "stream": busy}

        def __del__(self):  # the producer's pool: the next kernel on the allocation stream reuses it
            m._mock.enqueue_fill(reuse, ptr, t.numel() * 4, 0xEE)

    d = _attach(tmp_path, writer="thread", device="cuda:0")
    try:
        m._mock.enqueue_sleep(busy, 0.2)  # the interface's stream is busy: the snapshot runs late
        d.begin_pass()
        d.dump("x", Array())
        gc.collect()
        d.end_pass()
        d.close()
    finally:
        m._mock.sync(reuse)
        m._mock.sync(busy)
        m._mock.stream_destroy(reuse)
        m._mock.stream_destroy(busy)
    got = fastdump.open(tmp_path).load("target", 0, 0)
    assert same_bits(torch.as_tensor(got["x"]), t)


class _Interface:
    """A bare `__cuda_array_interface__` object (no stream: the data is ready)."""

    def __init__(self, ptr, shape, strides_bytes, typestr="<f4"):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": shape, "strides": strides_bytes,
                                         "typestr": typestr, "version": 3, "stream": None}


def test_broadcast_views_whose_size_overflows_are_skipped_at_once(m, glue, tmp_path):
    """Broadcast (stride-0) views that say 2^64 bytes or more: a torch tensor (2^61 float64, which
    torch allows) wrapped to 0 bytes and was staged as an empty record under its huge shape (the
    writer refused it: 'bad record'); an interface array of 2^62 float32 was planned record by record
    until the plan ran out of memory (over a minute on the model's thread, then bad_alloc). Both are
    now skipped at once with the reason; everything else is dumped bit for bit, and `verify` passes."""
    import time

    from fastdump.cli.dump import verify_dump
    from test_cuda import device_buffer, fake_cuda

    ok = torch.arange(6, dtype=torch.int32)
    d = _attach(tmp_path, writer="thread", device="cuda:0", policy="drop")
    p = device_buffer(m, 64)
    t0 = time.monotonic()
    d.begin_pass()
    d.dump("ok", fake_cuda(m, ok))
    d.dump("torch_huge", fake_cuda(m, torch.tensor(1.5, dtype=torch.float64).expand(2 ** 61)))
    d.dump("array_huge", _Interface(p, (2 ** 62,), (0,)))
    d.dump("array_wraps_to_0", _Interface(p, (2 ** 32, 2 ** 32), (0, 0)))
    d.dump("empty", _Interface(p, (2 ** 20, 0, 3), (0, 0, 0)))  # no bytes: fine
    d.dump("broadcast_4tib", _Interface(p, (2 ** 40,), (0,)))  # fits 64 bits, not the ring: `drop` skips it
    d.end_pass()
    assert time.monotonic() - t0 < 10
    stats = d.close()
    assert stats["tensors"] == 2 and stats["skipped"] == 4, stats
    reasons = d._skipped
    for name in ("torch_huge", "array_huge", "array_wraps_to_0"):
        assert "2^63 bytes" in reasons[name], (name, reasons)
    assert "do not fit in the ring" in reasons["broadcast_4tib"]
    got = fastdump.open(tmp_path).load("target", 0, 0)
    assert set(got) == {"ok", "empty"}
    assert same_bits(torch.as_tensor(got["ok"]), ok)
    assert tuple(got["empty"].shape) == (2 ** 20, 0, 3)
    report = verify_dump(str(tmp_path), read_data=True)
    assert report.problems == [], report.problems


def test_drain_failure_tearing_a_staged_tensor_fails_verify(m, glue, tmp_path, monkeypatch):
    """A tensor of two records, STAGED (counted by the Dumper), whose first record reached the host
    ring before the D2H copy of its second failed: the drain turns the rest into padding and the
    writer stores the tensor as skipped (an incomplete tensor). It was accepted and lost: rank.json
    says why and `fastdump verify` fails (the skip used to explain the missing tensor: no problem)."""
    import json

    from fastdump import format as fmt
    from fastdump.cli.dump import verify_dump
    from test_cuda import fake_cuda

    monkeypatch.setenv("FASTDUMP_CUDA_BATCH", "0")  # the drain's D2H copies are cudaMemcpyAsync calls
    big = torch.arange(1 << 19, dtype=torch.float32).reshape(512, 1024).t()  # 2 MiB, gathered: no memcpy
    small = torch.arange(10, dtype=torch.int16).reshape(2, 5).t()  # gathered too
    fb, fs = fake_cuda(m, big), fake_cuda(m, small)
    d = _attach(tmp_path, writer="thread", device="cuda:0", device_ring_mb=4, ring_mb=4)
    # One copy batch per record (at most a device ring / 8); the third D2H copy (big's second record) fails.
    m._mock.fail("cudaMemcpyAsync", 1, 999, skip=2)
    m._mock.enqueue_sleep(glue, 0.3)  # the snapshots run late: both tensors are STAGED before any copy ran
    d.begin_pass()
    d.dump("small", fs)
    d.dump("big", fb)
    d.end_pass()
    stats = d.close()
    assert stats["tensors"] == 2 and stats["skipped"] == 0
    info = json.loads(next(tmp_path.rglob("rank.json")).read_text())
    assert info["skipped_reasons"] == {fmt.TORN_TENSOR_REASON: 1}, info
    got = fastdump.open(tmp_path).load("target", 0, 0)
    assert set(got) == {"small"} and same_bits(torch.as_tensor(got["small"]), small)
    report = verify_dump(str(tmp_path), read_data=True)
    assert any("1 staged tensor(s) were lost after they were accepted: torn" in p for p in report.problems), \
        report.problems


def test_drain_failure_after_the_last_tensor_is_recorded(m, glue, tmp_path, monkeypatch):
    """The drain fails after the Dumper's last CUDA tensor was STAGED: no later tensor sees DISABLED,
    so the Dumper closed as if nothing happened (rank.json: status closed, no reason) while the
    pass's tensors became padding. rank.json now says why CUDA staging stopped, and `verify` fails on
    the missing tensors; the earlier pass is whole."""
    import json

    from fastdump.cli.dump import verify_dump
    from test_cuda import fake_cuda

    monkeypatch.setenv("FASTDUMP_CUDA_BATCH", "0")  # the drain's D2H copies are cudaMemcpyAsync calls
    first = torch.arange(64, dtype=torch.float32).reshape(8, 8).t()  # gathered: no cudaMemcpyAsync
    last = [torch.arange(12, dtype=torch.int32).reshape(3, 4).t() + i for i in range(3)]
    f0, fl = fake_cuda(m, first), [fake_cuda(m, t) for t in last]
    d = _attach(tmp_path, writer="thread", device="cuda:0")
    d.begin_pass()
    d.dump("x", f0)
    d.end_pass()
    assert d._engine.flush_cuda(10)
    m._mock.fail("cudaMemcpyAsync", 1, 999)  # the next D2H copy fails
    m._mock.enqueue_sleep(glue, 0.3)  # the snapshots run late: every tensor is STAGED first
    d.begin_pass()
    for i, f in enumerate(fl):
        d.dump(f"y{i}", f)
    d.end_pass()
    stats = d.close()
    assert stats["tensors"] == 4
    info = json.loads(next(tmp_path.rglob("rank.json")).read_text())
    assert "D2H copy" in info["cuda_staging"]["stopped"], info.get("cuda_staging")
    ds = fastdump.open(tmp_path)
    assert same_bits(torch.as_tensor(ds.load("target", 0, 0)["x"]), first)
    report = verify_dump(str(tmp_path), read_data=True)
    assert any("the Dumper staged 4 tensors; 1 are on disk" in p for p in report.problems), report.problems


def test_empty_tensor_numpy_cannot_represent_is_skipped_not_stored(m, glue, tmp_path):
    """torch makes an empty CUDA tensor of shape (2^40, 0, 2^40); numpy cannot (its other dimensions
    span more than 2^63 bytes). It was staged (0 bytes: nothing to copy) and stored, and its block
    made the whole segment unreadable: the pass failed to load, `verify` said 0 passes on disk. Now
    the writer skips it with the reason; the rest of the pass and the next pass are whole."""
    from fastdump.cli.dump import verify_dump
    from test_cuda import fake_cuda

    ok = torch.arange(4.0)
    d = _attach(tmp_path, writer="thread", device="cuda:0")
    for p in range(2):
        d.begin_pass()
        d.dump("ok", fake_cuda(m, ok + p))
        if p == 0:
            d.dump("wide", fake_cuda(m, torch.empty(2 ** 40, 0, 2 ** 40)))
            d.dump("empty", fake_cuda(m, torch.empty(2 ** 20, 0, 3)))  # numpy can: stored
        d.end_pass()
    d.close()
    ds = fastdump.open(tmp_path)
    got = ds.load("target", 0, 0)
    assert set(got) == {"ok", "empty"} and tuple(got["empty"].shape) == (2 ** 20, 0, 3)
    assert same_bits(torch.as_tensor(got["ok"]), ok)
    assert same_bits(torch.as_tensor(ds.load("target", 0, 1)["ok"]), ok + 1)
    report = verify_dump(str(tmp_path), read_data=True)
    assert report.problems == [], report.problems
    reasons = ds.rank_info("target", 0).get("skipped_reasons", {})
    assert any("numpy" in r for r in reasons), reasons


def test_no_device_ring_drops_foreign_arrays_like_tensors(m, glue, tmp_path):
    """The GPU's device ring cannot be had (a serving engine took the memory): a torch tensor is
    dropped and counted (verify fails under `block`), but a CuPy-style array was *skipped* ('cannot
    stage'), which verify accepts. Both are drops now, with the reason in rank.json once."""
    import json

    from fastdump.cli.dump import verify_dump

    t = torch.arange(100, dtype=torch.float32)
    ptr = to_device(m, t)
    m._mock.set("device_free", 64 << 20)  # less than the 256 MiB ring
    d = _attach(tmp_path, writer="thread")  # no device hint: the ring is tried at the first array
    d.begin_pass()
    d.dump("arr", _Interface(ptr, (100,), None))
    d.end_pass()
    stats = d.close()
    assert stats["dropped"] == 1 and stats["skipped"] == 0 and stats["tensors"] == 0, stats
    info = json.loads(next(tmp_path.rglob("rank.json")).read_text())
    assert info["dropped"] == 1 and info["cuda_staging"]["device_ring"] == "unavailable"
    report = verify_dump(str(tmp_path))
    assert any("1 tensor(s) and 0 whole pass(es) were dropped" in p for p in report.problems), report.problems
