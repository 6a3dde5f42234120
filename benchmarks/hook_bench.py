"""Cost per captured tensor on the forward thread.

A model of many tiny leaf modules (``--modules`` small Linear layers in a Sequential, outputs of
``--batch`` x ``--width`` fp32, i.e. 1 KiB by default) is run forward repeatedly with
  none          no hooks
  noop-hook     a forward hook that does nothing on every leaf (the floor for any hook dumper)
  fastdump      fastdump.attach(model, ...) (process writer, policy block, ring large enough
                that the writer never makes the forward wait)
  sglang-style  SGLang's synchronous dumper (benchmarks/baselines.py), torch.save per pass
  sglang-style-clone  (opt-in) the same with a real copy per tensor (.cpu() is a no-op on CPU)
and the added time per module over ``none`` is reported (median forward time, round-robin over
modes per repetition).

    python benchmarks/hook_bench.py --tiny
    python benchmarks/hook_bench.py --json results/hook.json
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch import nn

from benchmarks.baselines import SGLangStyleDumper, leaf_modules
from benchmarks.common import (
    default_dump_root,
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

MODES = ["none", "noop-hook", "fastdump", "sglang-style"]
EXTRA_MODES = ["sglang-style-clone"]  # opt-in: a real copy per tensor on CPU too (see baselines.py)


class ManyTinyLeaves(nn.Module):
    """Root with a top-level child named ``model`` (what SGLang's dumper expects) holding the leaves."""

    def __init__(self, num_modules: int, width: int):
        super().__init__()
        self.model = nn.Sequential(*(nn.Linear(width, width) for _ in range(num_modules)))

    def forward(self, x):
        return self.model(x)


class NoopHooks:
    def __init__(self, model: nn.Module):
        self._handles = [m.register_forward_hook(lambda _m, _i, _o: None) for _, m in leaf_modules(model)]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()

    def stats(self) -> dict:
        return {}


def attach_mode(mode: str, model: nn.Module, root: Path, fastdump, ring_mb: int):
    if mode == "none":
        return None
    if mode == "noop-hook":
        return NoopHooks(model)
    if mode == "fastdump":
        return fastdump.attach(model, str(root), role="hook-bench", writer="process", policy="block",
                               ring_mb=ring_mb)
    if mode in ("sglang-style", "sglang-style-clone"):
        return SGLangStyleDumper(model, root, role="hook-bench", copy_on_cpu=mode == "sglang-style-clone")
    raise ValueError(mode)


def time_forwards(model: nn.Module, x: torch.Tensor, iters: int, warmup: int) -> list[float]:
    times = []
    with torch.inference_mode():
        for i in range(warmup + iters):
            start = time.perf_counter()
            model(x)
            elapsed = time.perf_counter() - start
            if i >= warmup:
                times.append(elapsed)
    return times


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a few seconds on 2 CPU cores")
    parser.add_argument("--modules", type=int, default=200, help="leaf modules in the model")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--iters", type=int, default=300, help="timed forwards per mode and repetition")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--ring-mb", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: tiny matmuls gain nothing from more, and it leaves a core to the writer)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, from " + ", ".join(MODES + EXTRA_MODES))
    parser.add_argument("--out", help="dump root (default: a fresh temp dir under /tmp)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.tiny:
        args.modules, args.iters, args.warmup, args.reps, args.ring_mb = 50, 30, 3, 2, 64
    args.mode_list = parse_modes(args.modes, MODES + EXTRA_MODES, parser.error, always_first="none")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    info = machine_info()
    print_header(f"hook_bench modules={args.modules} output={args.batch}x{args.width} fp32 "
                 f"iters={args.iters} reps={args.reps}", info)
    torch.manual_seed(0)
    model = ManyTinyLeaves(args.modules, args.width).eval()
    x = torch.randn(args.batch, args.width)
    num_leaves = len(leaf_modules(model))
    fastdump, unavailable_reason = import_fastdump()
    out_root = Path(args.out) if args.out else default_dump_root("hook")

    results = {mode: {"status": "ok", "times": [], "close_s": [], "stats": None} for mode in args.mode_list}
    if "fastdump" in results and fastdump is None:
        results["fastdump"].update(status="unavailable", reason=unavailable_reason)

    for rep in range(args.reps):
        for mode in round_robin(args.mode_list, rep):
            entry = results[mode]
            if entry["status"] != "ok":
                continue
            root = out_root / mode / f"rep{rep}"
            try:
                dumper = attach_mode(mode, model, root, fastdump, args.ring_mb)
                try:
                    entry["times"] += time_forwards(model, x, args.iters, args.warmup)
                finally:
                    if dumper is not None:
                        start = time.perf_counter()
                        dumper.close()
                        entry["close_s"].append(time.perf_counter() - start)
                        entry["stats"] = dict(dumper.stats())
            except Exception as exc:
                entry.update(status="error", reason=f"{type(exc).__name__}: {exc}")
                traceback.print_exc()
            finally:
                remove_tree(root)

    summary = summarize(results, num_leaves)
    print_report(summary, num_leaves)
    if not args.out:
        remove_tree(out_root)
    payload = {
        "benchmark": "hook",
        "machine": dict(info, load_average_end=load_average()),
        "config": {k: v for k, v in vars(args).items() if k != "mode_list"} | {
            "modes": args.mode_list, "leaf_modules": num_leaves, "output_bytes": args.batch * args.width * 4,
            "command": " ".join(sys.argv)},
        "modes": summary,
    }
    write_json(args.json, payload)
    return payload


def summarize(results: dict, num_leaves: int) -> dict:
    base = median(results["none"]["times"]) if results.get("none", {}).get("times") else None
    summary = {}
    for mode, entry in results.items():
        if entry["status"] != "ok":
            summary[mode] = {"status": entry["status"], "reason": entry.get("reason")}
            continue
        forward = median(entry["times"])
        stats = entry["stats"] or {}
        summary[mode] = {
            "status": "ok",
            "median_forward_s": forward,
            "added_us_per_module": (forward - base) / num_leaves * 1e6 if base is not None else None,
            "ratio_to_none": forward / base if base else None,
            "captured_tensors_per_s": num_leaves / forward if mode not in ("none", "noop-hook") else None,
            "median_close_s": median(entry["close_s"]) if entry["close_s"] else None,
            "dropped": stats.get("dropped"),
            "writer_status": stats.get("status"),
            "writer_error": stats.get("error"),
            "forwards": len(entry["times"]),
        }
    return summary


def print_report(summary: dict, num_leaves: int) -> None:
    headers = ["mode", "forward (median)", "vs none", f"added µs/module ({num_leaves} leaves)", "close", "dropped"]
    rows, notes = [], []
    for mode, entry in summary.items():
        if entry["status"] != "ok":
            rows.append([mode, entry["status"], "", "", "", ""])
            notes.append(f"  {mode}: {entry['reason']}")
            continue
        added = entry["added_us_per_module"]
        rows.append([
            mode,
            fmt_seconds(entry["median_forward_s"]),
            f"{entry['ratio_to_none']:.2f}x" if entry["ratio_to_none"] else "-",
            "-" if mode == "none" or added is None else f"{added:+.1f}",
            fmt_seconds(entry["median_close_s"]),
            "-" if entry["dropped"] is None else entry["dropped"],
        ])
        if entry.get("writer_error"):
            notes.append(f"  {mode}: writer error: {entry['writer_error']}")
    print(format_table(headers, rows))
    print("reference (docs/DESIGN.md, torch 2.13): no-op hook +1.8 µs/module; clone in hook +8 µs")
    if notes:
        print("notes:")
        print("\n".join(notes))


if __name__ == "__main__":
    main()
