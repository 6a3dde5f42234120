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
