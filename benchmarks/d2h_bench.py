"""D2H drain bandwidth: fastdump's CUDA staging vs the pinned-copy peak measured on the same machine.

    python benchmarks/d2h_bench.py [--sizes-mb 1,4,16,64] [--total-gb 8] [--json out.json]
    python benchmarks/d2h_bench.py --dry-run        # CPU only: the plumbing, no GPU rows

Peak: one large cudaMemcpyAsync (via torch) device -> pinned host (cudaHostAlloc), and the same into
a /dev/shm mapping pinned with cudaHostRegister (the kind of memory fastdump's ring is), timed with
CUDA events; the best of those is "peak".
fastdump: a _C.Producer ring, a writer *process* that consumes and discards every record, and one
_C.CudaStager; tensors of each size are staged back to back (policy block) until --total-gb went
through, then flush(). Bandwidth = bytes / wall time from the first stage() to the end of flush().
Also reported: the stager's own drain bandwidth (D2H bytes / time with copies in flight), the same
run with cudaMemcpyBatchAsync switched off (FASTDUMP_CUDA_BATCH=0), and the CPU cost of one
stage() call for a small (8 KiB) tensor, raw and through fastdump.staging.cuda.stage_tensor.
docs/DESIGN.md target: fastdump >= 80% of the pinned peak.
"""

from __future__ import annotations

import argparse
import functools
import mmap
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import format_table, median, write_json

READER = r"""
import sys
from fastdump import _C
c = _C.Consumer(sys.argv[1])
c.set_producer_fd(0)   # our stdin: EOF when the benchmark dies
records = nbytes = 0
while True:
    r = c.next(1.0)
    if r is None:
        if c.drained:
            break
        continue
    kind = r[0]
    records += 1
    nbytes += len(r[6])
    c.release()
    if kind == _C.KIND_CONTROL:
        break
print(records, nbytes, flush=True)
"""


class Ring:
    """A producer ring with a discarding writer process."""

    def __init__(self, ring_bytes: int, chunk_bytes: int):
        from fastdump import _C

        self._C = _C
        name = f"/fastdump-d2h-{os.getpid()}-{time.monotonic_ns()}"
        while True:  # a small /dev/shm (containers, VMs): halve down to 256 MiB
            try:
                self.producer = _C.Producer(name, ring_bytes, chunk_bytes)
                break
            except (RuntimeError, OSError) as exc:
                if ring_bytes <= 256 << 20:
                    raise
                print(f"d2h_bench: {exc}; trying a {ring_bytes >> 21} MiB ring", file=sys.stderr)
                ring_bytes //= 2
        self.ring_bytes = ring_bytes
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent) + os.pathsep +
                   os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen([sys.executable, "-c", READER, name], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.producer.set_writer_fd(self.proc.stdout.fileno())
        deadline = time.monotonic() + 60
        while not self.producer.writer_attached():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.producer.unlink()
                raise RuntimeError("reader process did not start")
            time.sleep(0.005)
        self.producer.unlink()

    def close(self) -> tuple:
        self.producer.put_control(0, b'{"op": "stop"}')
        out, _ = self.proc.communicate(timeout=120)
        parts = out.split()
        return (int(parts[0]), int(parts[1])) if len(parts) == 2 else (0, 0)


# ------------------------------------------------------------------------------------------------
# Peak


def _event_time(stream, fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        e0 = torch.cuda.Event(enable_timing=True)
        e1 = torch.cuda.Event(enable_timing=True)
        e0.record(stream)
        fn()
        e1.record(stream)
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / 1e3)
    return median(times)


def pinned_peak(nbytes: int, reps: int, piece: int) -> dict:
    """GB/s of D2H copies into cudaHostAlloc'd memory: one large copy, and `piece`-sized copies."""
    dev = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream()
    out = {}
    with torch.cuda.stream(stream):
        host.copy_(dev, non_blocking=True)
        stream.synchronize()
        one = functools.partial(host.copy_, dev, non_blocking=True)
        out["pinned_one_copy_GBps"] = nbytes / _event_time(stream, one, reps) / 1e9
        pieces = [functools.partial(host[off:off + piece].copy_, dev[off:off + piece], non_blocking=True)
                  for off in range(0, nbytes, piece)]
        out["pinned_pieces_GBps"] = nbytes / _event_time(stream, lambda: [f() for f in pieces], reps) / 1e9
    assert torch.equal(host[:4096].cpu(), dev[:4096].cpu())
    return out


def registered_shm_peak(nbytes: int, reps: int) -> dict:
    """GB/s into a /dev/shm mapping pinned with cudaHostRegister (what fastdump's ring is)."""
    cudart = torch.cuda.cudart()
    with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="fastdump-d2h-peak-") as f:
        f.truncate(nbytes)
        mm = mmap.mmap(f.fileno(), nbytes)
        host = torch.frombuffer(mm, dtype=torch.uint8)
        host.fill_(0)  # fault the pages in
        ptr = host.data_ptr()
        t0 = time.perf_counter()
        err = cudart.cudaHostRegister(ptr, nbytes, 1)  # cudaHostRegisterPortable
        reg_s = time.perf_counter() - t0
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister failed: {err}")
        try:
            dev = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
            stream = torch.cuda.Stream()
            copy = functools.partial(host.copy_, dev, non_blocking=True)
            with torch.cuda.stream(stream):
                copy()
                stream.synchronize()
                gbps = nbytes / _event_time(stream, copy, reps) / 1e9
            del copy, dev
        finally:
            cudart.cudaHostUnregister(ptr)
            del host  # the mapping can close only once no tensor views it
            try:
                mm.close()
            except BufferError:
                pass
    return {"registered_shm_GBps": gbps, "register_s_per_GiB": reg_s / (nbytes / (1 << 30))}


# ------------------------------------------------------------------------------------------------
# fastdump


def fastdump_drain(size: int, total: int, ring_bytes: int, device_ring_bytes: int, chunk_bytes: int,
                   batch: bool) -> dict:
    from fastdump import _C, dtypes

    os.environ["FASTDUMP_CUDA_BATCH"] = "1" if batch else "0"
    ring = Ring(ring_bytes, chunk_bytes)
    try:
        stager = _C.CudaStager(ring.producer, device_ring_bytes)
        reg_s = stager.register_host()
        code = dtypes.CODE_BY_NAME["bfloat16"]
        numel = size // 2
        sources = [torch.randn(numel, device="cuda").to(torch.bfloat16) for _ in range(4)]
        device = torch.cuda.current_device()
        stream = torch.cuda.current_stream().cuda_stream
        for i, t in enumerate(sources):  # warm up (module load, device ring, event pool)
            stager.stage(0, i, 0, code, 2, [numel], [1], t.data_ptr(), device, stream, True)
        stager.flush(60)
        base = stager.stats()
        torch.cuda.synchronize()
        n = max(1, total // size)
        t0 = time.perf_counter()
        for i in range(n):
            t = sources[i % len(sources)]
            status = stager.stage(0, i % len(sources), 1, code, 2, [numel], [1], t.data_ptr(), device, stream, True)
            if status != _C.STAGED:
                raise RuntimeError(f"stage() returned {status}")
        ok = stager.flush(300)
        wall = time.perf_counter() - t0
        st = stager.stats()
        stager.close()
    finally:
        os.environ.pop("FASTDUMP_CUDA_BATCH", None)
        records, nbytes = ring.close()
    d2h = st["d2h_bytes"] - base["d2h_bytes"]
    drain_s = st["drain_seconds"] - base["drain_seconds"]
    return {
        "size": size, "tensors": n, "bytes": n * size, "wall_s": wall, "flushed": ok,
        "GBps": n * size / wall / 1e9,
        "drain_GBps": d2h / drain_s / 1e9 if drain_s > 0 else None,
        "d2h_copies": st["d2h_copies"] - base["d2h_copies"], "d2h_batches": st["d2h_batches"] - base["d2h_batches"],
        "device_ring_waits": st["device_ring_full_waits"] - base["device_ring_full_waits"],
        "host_ring_waits": st["host_ring_full_waits"] - base["host_ring_full_waits"],
        "batch_api": st["batch_api"], "register_s": reg_s, "writer_records": records, "writer_bytes": nbytes,
        "ring_bytes": ring.ring_bytes,
        "last_error": st["last_error"],
        "batch_api_fallback": st.get("batch_api_fallback", ""),
    }


def stage_call_cost(ring_bytes: int, device_ring_bytes: int, n: int) -> dict:
    """CPU microseconds per stage() of an 8 KiB tensor: raw binding call and through stage_tensor."""
    from fastdump import _C, dtypes
    from fastdump.staging import cuda

    ring = Ring(ring_bytes, 0)
    try:
        stager = _C.CudaStager(ring.producer, device_ring_bytes)
        stager.register_host()
        t = torch.randn(4096, device="cuda").to(torch.bfloat16)
        code = dtypes.code_of(t.dtype)
        device, stream = t.get_device(), torch.cuda.current_stream().cuda_stream
        for i in range(100):
            stager.stage(0, 0, 0, code, 2, [4096], [1], t.data_ptr(), device, stream, True)
            cuda.stage_tensor(stager, 0, 0, 0, code, t, True)
        stager.flush(60)
        t0 = time.perf_counter()
        for i in range(n):
            stager.stage(0, 0, 1, code, 2, [4096], [1], t.data_ptr(), device, stream, True)
        raw = (time.perf_counter() - t0) / n
        stager.flush(60)
        t0 = time.perf_counter()
        for i in range(n):
            cuda.stage_tensor(stager, 0, 0, 2, code, t, True)
        glue = (time.perf_counter() - t0) / n
        stager.flush(60)
        st = stager.stats()
        stager.close()
    finally:
        ring.close()
    return {"stage_us": raw * 1e6, "stage_tensor_us": glue * 1e6, "d2h_batches": st["d2h_batches"],
            "d2h_copies": st["d2h_copies"]}


def host_path_dry_run(size: int, total: int, ring_bytes: int, chunk_bytes: int) -> dict:
    """The same loop through the CPU path (producer.stage_host): checks the plumbing without a GPU."""
    from fastdump import _C, dtypes

    ring = Ring(ring_bytes, chunk_bytes)
    try:
        src = torch.randn(size // 4)
        code = dtypes.code_of(src.dtype)
        n = max(1, total // size)
        t0 = time.perf_counter()
        for i in range(n):
            if ring.producer.stage_host(0, 0, i, code, 4, [src.numel()], [1], src.data_ptr(), True) != _C.STAGED:
                raise RuntimeError("stage_host failed")
        wall = time.perf_counter() - t0
    finally:
        records, nbytes = ring.close()
    return {"size": size, "tensors": n, "bytes": n * size, "wall_s": wall, "GBps": n * size / wall / 1e9,
            "writer_records": records, "writer_bytes": nbytes}


# ------------------------------------------------------------------------------------------------


def size_label(size: int) -> str:
    """'8 KiB', '256 KiB', '1 MiB', '1.5 MiB': decode-size tensors are far below 1 MiB."""
    if size < 1 << 20:
        return f"{size / 1024:g} KiB"
    return f"{size / (1 << 20):g} MiB"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mb", default="1,4,16,64", help="tensor sizes, MiB")
    p.add_argument("--total-gb", type=float, default=8.0, help="bytes staged per size, GiB")
    p.add_argument("--ring-mb", type=int, default=1024, help="host ring (shared memory), MiB")
    p.add_argument("--device-ring-mb", type=int, default=512, help="device staging ring, MiB")
    p.add_argument("--chunk-mb", type=int, default=32, help="host record size (large tensors are split), MiB")
    p.add_argument("--peak-mb", type=int, default=1024, help="size of the peak-bandwidth copies, MiB")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-memcpy-variant", action="store_true", help="skip the FASTDUMP_CUDA_BATCH=0 run")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--dry-run", action="store_true", help="no GPU: run the host path only")
    args = p.parse_args(argv)
    sizes = [int(float(s) * (1 << 20)) for s in args.sizes_mb.split(",") if s]
    total = int(args.total_gb * (1 << 30))
    # "status" stays "partial" until the end; the JSON is rewritten after every row, so a run
    # killed part-way (gpu_check.sh's stage timeout) still leaves the rows it finished.
    result = {"args": vars(args), "rows": [], "status": "partial"}

    if args.dry_run or not torch.cuda.is_available():
        why = "dry run" if args.dry_run else "no CUDA device visible to torch"
        print(f"d2h_bench: {why}: host path only (the GPU rows are skipped)")
        rows = []
        for size in sizes:
            r = host_path_dry_run(size, min(total, 64 << 20), min(args.ring_mb, 256) << 20,
                                  min(args.chunk_mb, 16) << 20)
            assert r["writer_bytes"] >= r["bytes"], r
            result["rows"].append(r)
            write_json(args.json, result)
            rows.append([size_label(size), "host memcpy (CPU path)", f"{r['GBps']:.2f}", "-", "-"])
        print(format_table(["size", "path", "GB/s", "vs peak", "notes"], rows))
        result["status"] = "dry-run"
        write_json(args.json, result)
        return result

    from fastdump import _C

    if not _C.cuda_compiled():
        raise SystemExit("fastdump._C was built without CUDA (CUDA_HOME=... pip install -e .)")
    print(f"d2h_bench on {torch.cuda.get_device_name()}: {_C.cuda_info().get('devices', [{}])[0]}")
    peak = pinned_peak(args.peak_mb << 20, args.reps, piece=max(sizes))
    try:
        peak.update(registered_shm_peak(args.peak_mb << 20, args.reps))
    except Exception as exc:
        peak["registered_shm_error"] = str(exc)
    peak_gbps = max(v for k, v in peak.items() if k.endswith("GBps"))
    result["peak"] = dict(peak, peak_GBps=peak_gbps)
    write_json(args.json, result)
    print("peak: " + ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in peak.items()))

    rows = []
    variants = [True] if args.no_memcpy_variant else [True, False]
    for size in sizes:
        for batch in variants:
            try:
                r = fastdump_drain(size, total, args.ring_mb << 20, args.device_ring_mb << 20, args.chunk_mb << 20,
                                   batch)
            except Exception as exc:
                r = {"size": size, "batch_requested": batch, "error": f"{type(exc).__name__}: {exc}"}
                rows.append([size_label(size), "batch" if batch else "memcpy", "-", "-", "-", r["error"]])
                result["rows"].append(r)
                write_json(args.json, result)
                continue
            r["batch_requested"] = batch
            r["ratio_to_peak"] = r["GBps"] / peak_gbps
            result["rows"].append(r)
            result["min_ratio_to_peak"] = min((x["ratio_to_peak"] for x in result["rows"]
                                               if x.get("batch_requested") and "ratio_to_peak" in x), default=None)
            write_json(args.json, result)
            rows.append([size_label(size), "batch" if r["batch_api"] else "memcpy", f"{r['GBps']:.2f}",
                         f"{r['drain_GBps']:.2f}" if r["drain_GBps"] else "-", f"{r['ratio_to_peak']:.0%}",
                         f"{r['d2h_copies']} copies/{r['d2h_batches']} batches, waits dev {r['device_ring_waits']}"
                         f" host {r['host_ring_waits']}" + (f"; {r['last_error']}" if r["last_error"] else "")
                         + (f"; batch API refused: {r['batch_api_fallback']}" if r["batch_api_fallback"] else "")])
    try:
        result["stage_cost"] = stage_call_cost(256 << 20, 256 << 20, 20000)
    except Exception as exc:
        result["stage_cost"] = {"error": str(exc)}
    print(format_table(["size", "D2H path", "fastdump GB/s (wall)", "drain GB/s (in flight)", "vs peak", "notes"],
                       rows))
    sc = result["stage_cost"]
    if "error" not in sc:
        print(f"stage() CPU cost, 8 KiB tensor: {sc['stage_us']:.1f} µs raw, {sc['stage_tensor_us']:.1f} µs via "
              f"fastdump.staging.cuda.stage_tensor ({sc['d2h_copies']} copies in {sc['d2h_batches']} batches)")
    ok = [r["ratio_to_peak"] for r in result["rows"] if r.get("batch_requested") and "ratio_to_peak" in r]
    result["min_ratio_to_peak"] = min(ok) if ok else None
    print(f"pinned peak {peak_gbps:.2f} GB/s; fastdump worst size {min(ok):.0%} of peak (target >= 80%)"
          if ok else "no fastdump result")
    result["status"] = "ok" if ok else "failed"
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
