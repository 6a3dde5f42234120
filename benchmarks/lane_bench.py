"""Forward-thread cost per CUDA tensor of fastdump's eager staging: the lean path against the checked one.

    python benchmarks/lane_bench.py [--tensors 400] [--passes 30] [--json out.json]   # on a GPU
    python benchmarks/lane_bench.py --mock [--json out.json]   # no GPU: against the mock CUDA runtime

The loop is a decode step's hooks without the model: per pass, ``--tensors`` decode-size tensors
(``--numel`` bf16 elements, 8 KiB by default) are staged back to back, as the Dumper does.
Rows, per staged tensor on the forward thread (wall and thread CPU time):
  lean     ChannelStager.stage_tensor with the channel's CUDA lane: the Dumper's hot path (one C++ call:
           attribute reads, per-pass checks, the snapshot, one event per N snapshots).
  checked  fastdump.staging.cuda.stage_on_device: the general path (Python, a 12-argument binding,
           device and capture checks and an event per tensor).
Also: events and drain batches per pass (the stager's counters); with --mock, runtime calls, heap
allocations and mutex acquisitions per tensor on the forward thread, as the mock counts them; and the
three Python-level calls the lean path still makes per CUDA tensor (``tensor.get_device()``, the
current raw stream, ``tensor.record_stream(stream)``; csrc/cuda_bindings.cpp, StagerTensorLane), each
timed alone in a tight loop over the same tensors: their share of the lean row says whether moving
them into C++ (the torch-aware reader) is worth it.

--mock: tests/cuda_mock builds fastdump._C against the mock runtime (needs g++; ~1 min, cached in
build/). Its times are the MOCK's: its cudaMemcpyAsync hands work to a thread (a lock and a wake-up),
far from what a driver costs, and its tensors are plain Python objects. They show the host-side shape
of the cost and the call counts, never a GPU figure.
"""

from __future__ import annotations

import argparse
import math
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import format_table, write_json

ROOT = Path(__file__).resolve().parent.parent


class _MockStorage:
    __slots__ = ("_ptr", "_nbytes")

    def __init__(self, ptr, nbytes):
        self._ptr, self._nbytes = ptr, nbytes

    def data_ptr(self):
        return self._ptr

    def nbytes(self):
        return self._nbytes


class MockTensor:
    """What stage_tensor reads from a torch CUDA tensor, as plain attributes (the mock has no torch
    CUDA tensors; a torch subclass would add __torch_function__ to every read)."""

    __slots__ = ("dtype", "shape", "_stride", "_ptr", "recorded")
    is_cpu, is_cuda, layout = False, True, torch.strided

    def __init__(self, dtype, shape, ptr):
        self.dtype, self.shape, self._ptr = dtype, tuple(shape), ptr
        self._stride = tuple(int(math.prod(shape[i + 1:])) for i in range(len(shape)))
        self.recorded = 0

    def is_neg(self):
        return False

    def stride(self):
        return self._stride

    def data_ptr(self):
        return self._ptr

    def untyped_storage(self):  # the attribute reads check the tensor's extent against its storage
        return _MockStorage(self._ptr, math.prod(self.shape) * self.element_size())

    def get_device(self):
        return 0

    def element_size(self):
        return torch.empty(0, dtype=self.dtype).element_size()

    def record_stream(self, stream):
        self.recorded += 1


class _Stream:
    def __init__(self, raw):
        self.cuda_stream = raw


def _drain_ring(mod, consumer, stop):
    """The writer's part: consume and discard every record."""
    while not stop.is_set():
        r = consumer.next(0.05)
        if r is not None:
            consumer.release()


def run(mod, tensors, raw_stream, stream_object, passes, events_every, mock, on_row=lambda label, row: None):
    from fastdump import dtypes
    from fastdump.capture.dumper import _FAST_CODES
    from fastdump.staging import cuda

    stop = threading.Event()
    if mock:  # the mock module lives in this process only: an in-process consumer thread
        name = f"/fdlane-{id(tensors)}-{time.monotonic_ns()}"
        prod = mod.Producer(name, 256 << 20, 0)
        cons = mod.Consumer(name)
        prod.unlink()
        th = threading.Thread(target=_drain_ring, args=(mod, cons, stop), daemon=True)
        th.start()
        ring = None
    else:  # a discarding writer process, as fastdump's writer is one
        from benchmarks.d2h_bench import Ring as ProcessRing

        ring = ProcessRing(256 << 20, 0)
        prod, th = ring.producer, None
    stager = mod.CudaStager(prod, 256 << 20)
    stager.register_host()
    stager.prepare(0)
    stager.events_every = events_every
    lane = mod.ChannelStager(prod, 0, _FAST_CODES, torch.strided)
    lane.set_cuda(stager, raw_stream, stream_object)
    code = dtypes.code_of(tensors[0].dtype)
    result = {}
    try:
        def lean(p):
            lane.begin(p, True, -1.0)
            for i, t in enumerate(tensors):
                lane.stage_tensor(i, t)
            lane.take_counts()

        def checked(p):
            for i, t in enumerate(tensors):
                cuda.stage_on_device(stager, 0, i, p, code, t, True)

        pass_id = 0
        for label, fn in (("lean", lean), ("checked", checked)):
            for _ in range(3):  # warm
                fn(pass_id)
                pass_id += 1
            stager.flush(60)
            before = stager.stats()
            if mock:
                mod._mock.reset_thread_counts()
            w0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(passes):
                fn(pass_id)
                pass_id += 1
            wall, cpu = time.perf_counter() - w0, time.thread_time() - c0
            counts = mod._mock.thread_counts() if mock else None
            stager.flush(60)
            after = stager.stats()
            n = passes * len(tensors)
            row = {"us_per_tensor_wall": wall / n * 1e6, "us_per_tensor_cpu": cpu / n * 1e6,
                   "events_per_pass": (after["snapshot_events"] - before["snapshot_events"]) / passes
                   if label == "lean" else float(len(tensors)),
                   "d2h_batches_per_pass": (after["d2h_batches"] - before["d2h_batches"]) / passes,
                   "lean_tensors": after["lean_tensors"] - before["lean_tensors"]}
            if counts is not None:
                row["runtime_calls_per_tensor"] = sum(counts["calls"].values()) / n
                row["calls"] = {k: v / n for k, v in counts["calls"].items()}
                row["allocs_per_tensor"] = counts["allocs"] / n
                row["locks_per_tensor"] = counts["locks"] / n
            result[label] = row
            on_row(label, row)
        result["stats"] = stager.stats()
    finally:
        stager.close()
        stop.set()
        if th is not None:
            th.join(5)
        if ring is not None:
            ring.close()
    return result


def python_calls(tensors, raw_stream, stream_object, reps: int = 5) -> dict:
    """us per tensor of each Python-level call the lean lane makes, alone in a tight loop (best of reps)."""
    dev = tensors[0].get_device()
    stream = stream_object(dev)

    def best(fn) -> float:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times) / len(tensors) * 1e6

    def get_device():
        for t in tensors:
            t.get_device()

    def current_stream():
        for t in tensors:
            raw_stream(dev)

    def record_stream():
        for t in tensors:
            t.record_stream(stream)

    return {"get_device_us": best(get_device), "raw_stream_us": best(current_stream),
            "record_stream_us": best(record_stream)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensors", type=int, default=400, help="tensors per pass (an 8B decode step dumps ~350-490)")
    p.add_argument("--numel", type=int, default=4096, help="elements per tensor (bf16)")
    p.add_argument("--passes", type=int, default=30)
    p.add_argument("--events-every", type=int, default=64, help="lean snapshots per event (N)")
    p.add_argument("--mock", action="store_true", help="no GPU: the mock CUDA runtime (host-side shape only)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    result = {"args": vars(args)}

    def save_row(label, row):  # after each row: a run killed part-way still leaves what it measured
        result[label] = row
        result["status"] = "partial"
        write_json(args.json, result)

    if args.mock:
        sys.path.insert(0, str(ROOT / "tests" / "cuda_mock"))
        try:
            import build as mock_build

            mod = mock_build.load(mock_build.build())
        except Exception as exc:  # no compiler: nothing to measure here
            print(f"lane_bench: mock build unavailable ({exc}); skipped")
            result["status"] = "skipped"
            write_json(args.json, result)
            return result
        from fastdump.staging import cuda

        stream = mod._mock.stream_create()
        cuda._current_stream = lambda device: (stream, _Stream(stream))  # the checked path's seam
        nbytes = args.numel * 2
        tensors = []
        for i in range(args.tensors):
            ptr = mod._mock.malloc(nbytes)
            tensors.append(MockTensor(torch.bfloat16, (1, args.numel), ptr))
        try:
            result.update(run(mod, tensors, lambda d: stream, lambda d: _Stream(stream), args.passes,
                              args.events_every, mock=True, on_row=save_row))
            result["python_calls"] = python_calls(tensors, lambda d: stream, lambda d: _Stream(stream))
        finally:
            mod._mock.sync(stream)
            for t in tensors:
                mod._mock.free(t.data_ptr())
            mod._mock.stream_destroy(stream)
        where = "MOCK CUDA runtime (host-side shape only; not a GPU figure)"
    else:
        from fastdump import _C

        if not (torch.cuda.is_available() and _C.cuda_compiled()):
            print("lane_bench: needs a CUDA GPU and fastdump._C built with CUDA (or --mock)")
            result["status"] = "skipped"
            write_json(args.json, result)
            return result
        torch.cuda.init()
        tensors = [torch.randn(1, args.numel, device="cuda").to(torch.bfloat16) for _ in range(args.tensors)]
        torch.cuda.synchronize()
        result.update(run(_C, tensors, torch._C._cuda_getCurrentRawStream, torch.cuda.current_stream, args.passes,
                          args.events_every, mock=False, on_row=save_row))
        result["python_calls"] = python_calls(tensors, torch._C._cuda_getCurrentRawStream, torch.cuda.current_stream)
        torch.cuda.synchronize()
        where = torch.cuda.get_device_name()
    rows = []
    for label in ("lean", "checked"):
        r = result[label]
        rows.append([label, f"{r['us_per_tensor_wall']:.2f}", f"{r['us_per_tensor_cpu']:.2f}",
                     f"{r['events_per_pass']:.1f}", f"{r['d2h_batches_per_pass']:.1f}",
                     f"{r['runtime_calls_per_tensor']:.2f}" if "runtime_calls_per_tensor" in r else "-",
                     f"{r['allocs_per_tensor']:.3f}" if "allocs_per_tensor" in r else "-",
                     f"{r['locks_per_tensor']:.2f}" if "locks_per_tensor" in r else "-"])
    print(f"lane_bench on {where}: {args.tensors} tensors of {args.numel} bf16 per pass, N={args.events_every}")
    print(format_table(["path", "us/tensor wall", "us/tensor CPU", "events/pass", "D2H batches/pass",
                        "runtime calls/tensor", "allocs/tensor", "locks/tensor"], rows))
    pc = result["python_calls"]
    print(f"Python-level calls per CUDA tensor in the lean path, each alone in a tight loop: get_device() "
          f"{pc['get_device_us']:.3f} us, current raw stream {pc['raw_stream_us']:.3f} us, record_stream() "
          f"{pc['record_stream_us']:.3f} us (together {sum(pc.values()):.2f} of the lean row's "
          f"{result['lean']['us_per_tensor_cpu']:.2f} us CPU)")
    result["where"] = where
    result["status"] = "ok"
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
