"""Writer throughput: how fast tensors get from ``Dumper.dump`` to complete HDF5 files on disk.

No model: ``fastdump.attach(None, root, ...)`` and manual passes (``begin_pass`` / ``dump`` /
``end_pass``). Each figure is timed from the first ``dump`` to ``close()`` returning, so it
includes the writer draining everything (segments are fsynced by the writer).

  small  N tensors of 8 KiB (fp32), ``--per-pass`` distinct names per pass, as a decode pass
         would produce; reported in tensors/s. Target: >= 50,000 tensors/s.
  large  tensors of ``--large-mb`` MiB each, ``--large-total-mb`` in all; reported in GB/s and
         as a fraction of a raw sequential write of the same bytes to the same disk
         (open/write/fsync, measured in the same run). Target: >= 70% of raw.

Modes (round-robin per repetition): fastdump-process, fastdump-thread, naive-h5 (the same
baseline as decode_bench, driven by hand; it gets at most ``--naive-tensors`` small tensors
because it manages only a few thousand datasets per second) and raw (the file write alone).

    python benchmarks/writer_bench.py --tiny
    python benchmarks/writer_bench.py --json results/writer.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.baselines import NaiveH5Dumper
from benchmarks.common import (
    default_dump_root,
    fmt_rate,
    fmt_seconds,
    format_table,
    import_fastdump,
    load_average,
    machine_info,
    median,
    parse_modes,
    print_header,
    remove_tree,
    round_robin,
    write_json,
)

SMALL_TENSOR_BYTES = 8 * 1024
SMALL_TARGET_TENSORS_PER_S = 50_000
LARGE_TARGET_FRACTION_OF_RAW = 0.70
MODES = ["fastdump-process", "fastdump-thread", "naive-h5", "raw"]
FASTDUMP_WRITER = {"fastdump-process": "process", "fastdump-thread": "thread"}


def open_writer(mode: str, fastdump, root: Path, ring_mb: int):
    """A dumper with the manual-pass API (begin_pass / dump / end_pass / close / stats)."""
    if mode in FASTDUMP_WRITER:
        return fastdump.attach(None, str(root), role="writer-bench", writer=FASTDUMP_WRITER[mode],
                               policy="block", ring_mb=ring_mb)
    if mode == "naive-h5":
        return NaiveH5Dumper(None, root, role="writer-bench")
    raise ValueError(mode)


def push_tensors(dumper, tensors: list[torch.Tensor], names: list[str], passes: int) -> dict:
    """Dump ``tensors`` under ``names`` once per pass, ``passes`` times; close; time it all."""
    start = staged = time.perf_counter()
    try:
        for _ in range(passes):
            dumper.begin_pass()
            for name, tensor in zip(names, tensors):
                dumper.dump(name, tensor)
            dumper.end_pass()
        staged = time.perf_counter()
    finally:
        dumper.close()  # also on failure: never leave a writer running
    done = time.perf_counter()
    stats = dict(dumper.stats())
    return {
        "tensors": passes * len(tensors),
        "bytes": passes * sum(t.nbytes for t in tensors),
        "seconds": done - start,
        "producer_seconds": staged - start,  # time the dumping thread was busy
        "close_seconds": done - staged,
        "dropped": stats.get("dropped", 0),
        "status": stats.get("status"),
        "error": stats.get("error"),
        "writer_tensors": stats.get("tensors"),
    }


def raw_sequential_write(directory: Path, tensor: torch.Tensor, count: int) -> dict:
    """The disk's own speed for the same bytes: write ``tensor``'s bytes ``count`` times, fsync."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "raw.bin"
    payload = memoryview(tensor.contiguous().view(torch.uint8).numpy())
    os.sync()  # start from a clean page cache, as the fastdump runs do: writeback of earlier runs is noise
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as file:
        for _ in range(count):
            file.write(payload)
        os.fsync(file.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return {"bytes": count * payload.nbytes, "seconds": seconds}


def make_small_workload(per_pass: int):
    # Distinct tensors and names, like the modules of one decode pass.
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(SMALL_TENSOR_BYTES // 4, generator=generator) for _ in range(per_pass)]
    names = [f"model.layers.{i // 8}.module{i % 8}" for i in range(per_pass)]
    return tensors, names


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a few seconds on 2 CPU cores")
    parser.add_argument("--small-tensors", type=int, default=100_000, help="number of 8 KiB tensors")
    parser.add_argument("--per-pass", type=int, default=100, help="8 KiB tensors (names) per pass")
    parser.add_argument("--naive-tensors", type=int, default=4_000, help="cap for the naive-h5 small run")
    parser.add_argument("--large-mb", type=int, default=64, help="MiB per large tensor")
    parser.add_argument("--large-total-mb", type=int, default=1024, help="MiB of large tensors in all")
    parser.add_argument("--ring-mb", type=int, default=256)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ", ".join(MODES))
    parser.add_argument("--out", help="dump root (default: a fresh temp dir under /tmp; must be the disk to test)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.tiny:
        args.small_tensors, args.per_pass, args.naive_tensors = 3_000, 100, 500
        args.large_mb, args.large_total_mb, args.ring_mb, args.reps = 4, 16, 64, 1
    args.mode_list = parse_modes(args.modes, MODES, parser.error)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    info = machine_info()
    print_header(f"writer_bench small={args.small_tensors}x8KiB large={args.large_total_mb // args.large_mb}x"
                 f"{args.large_mb}MiB reps={args.reps}", info)
    fastdump, unavailable_reason = import_fastdump()
    out_root = Path(args.out) if args.out else default_dump_root("writer")

    small_tensors, small_names = make_small_workload(args.per_pass)
    large_tensor = torch.arange(args.large_mb * 1024 * 1024 // 4, dtype=torch.float32)
    large_count = max(1, args.large_total_mb // args.large_mb)

    results = {mode: {"status": "ok", "small": [], "large": []} for mode in args.mode_list}
    for mode in results:
        if mode in FASTDUMP_WRITER and fastdump is None:
            results[mode].update(status="unavailable", reason=unavailable_reason)

    for rep in range(args.reps):
        for mode in round_robin(args.mode_list, rep):
            entry = results[mode]
            if entry["status"] != "ok":
                continue
            root = out_root / mode / f"rep{rep}"
            try:
                if mode == "raw":
                    entry["large"].append(raw_sequential_write(root, large_tensor, large_count))
                    continue
                small_total = min(args.small_tensors, args.naive_tensors) if mode == "naive-h5" else args.small_tensors
                passes = max(1, small_total // args.per_pass)
                entry["small"].append(push_tensors(open_writer(mode, fastdump, root / "small", args.ring_mb),
                                                   small_tensors, small_names, passes))
                remove_tree(root / "small")
                os.sync()  # the small run's dirty pages must not slow the large one down
                entry["large"].append(push_tensors(open_writer(mode, fastdump, root / "large", args.ring_mb),
                                                   [large_tensor], ["big"], large_count))
            except Exception as exc:
                entry.update(status="error", reason=f"{type(exc).__name__}: {exc}")
                traceback.print_exc()
            finally:
                remove_tree(root)

    summary = summarize(results)
    print_report(summary)
    if not args.out:
        remove_tree(out_root)
    payload = {
        "benchmark": "writer",
        "machine": dict(info, load_average_end=load_average()),
        "config": {k: v for k, v in vars(args).items() if k != "mode_list"} | {"modes": args.mode_list,
                                                                                 "command": " ".join(sys.argv)},
        "targets": {"small_tensors_per_s": SMALL_TARGET_TENSORS_PER_S,
                    "large_fraction_of_raw": LARGE_TARGET_FRACTION_OF_RAW},
        "modes": summary,
    }
    write_json(args.json, payload)
    return payload


def summarize(results: dict) -> dict:
    raw = results.get("raw", {})
    raw_rate = median(r["bytes"] / r["seconds"] for r in raw.get("large", [])) if raw.get("large") else None
    summary = {}
    for mode, entry in results.items():
        if entry["status"] != "ok":
            summary[mode] = {"status": entry["status"], "reason": entry.get("reason")}
            continue
        out = {"status": "ok", "runs": {"small": entry["small"], "large": entry["large"]}}
        if entry["small"]:
            rate = median(r["tensors"] / r["seconds"] for r in entry["small"])
            out["small"] = {
                "tensors_per_s": rate,
                "producer_tensors_per_s": median(r["tensors"] / r["producer_seconds"] for r in entry["small"]),
                "tensors": entry["small"][-1]["tensors"],
                "dropped": sum(r["dropped"] or 0 for r in entry["small"]),
                "meets_target": rate >= SMALL_TARGET_TENSORS_PER_S,
            }
        if entry["large"]:
            rate = median(r["bytes"] / r["seconds"] for r in entry["large"])
            fraction = rate / raw_rate if raw_rate else None
            out["large"] = {
                "bytes_per_s": rate,
                "fraction_of_raw": fraction,
                "meets_target": None if mode == "raw" or fraction is None else fraction >= LARGE_TARGET_FRACTION_OF_RAW,
                "close_s": median(r.get("close_seconds", 0.0) for r in entry["large"]),
            }
        errors = [r["error"] for r in entry["small"] + entry["large"] if r.get("error")]
        if errors:
            out["error"] = errors[-1]
        summary[mode] = out
    if raw_rate:
        # The disk caps the small-tensor rate too: this many 8 KiB tensors/s is the raw speed.
        summary.setdefault("raw", {})["small_tensor_ceiling_per_s"] = raw_rate / SMALL_TENSOR_BYTES
    return summary


def print_report(summary: dict) -> None:
    headers = ["mode", "8 KiB tensors/s", "(producer side)", "target 50k", "large GB/s", "vs raw", "target 70%",
               "large close"]
    rows, notes = [], []

    def verdict(value):
        return "-" if value is None else ("PASS" if value else "FAIL")

    for mode, entry in summary.items():
        if entry.get("status") != "ok":
            rows.append([mode, entry.get("status"), "", "", "", "", "", ""])
            notes.append(f"  {mode}: {entry.get('reason')}")
            continue
        small, large = entry.get("small", {}), entry.get("large", {})
        rows.append([
            mode,
            fmt_rate(small.get("tensors_per_s")),
            fmt_rate(small.get("producer_tensors_per_s")),
            verdict(small.get("meets_target")) if small else "-",
            f"{large['bytes_per_s'] / 1e9:.3f}" if large else "-",
            f"{large['fraction_of_raw'] * 100:.0f}%" if large.get("fraction_of_raw") else "-",
            verdict(large.get("meets_target")) if large else "-",
            fmt_seconds(large.get("close_s")) if large and mode != "raw" else "-",
        ])
        if entry.get("error"):
            notes.append(f"  {mode}: writer error: {entry['error']}")
    print(format_table(headers, rows))
    ceiling = summary.get("raw", {}).get("small_tensor_ceiling_per_s")
    if ceiling:
        print(f"disk ceiling for 8 KiB tensors at the raw write speed: {fmt_rate(ceiling)} tensors/s")
    if notes:
        print("notes:")
        print("\n".join(notes))


if __name__ == "__main__":
    main()
