"""How much of fastdump's per-tensor cost on the model's thread is the writer working beside it?

The `micro` decode loop (decode_bench's preset: 6 layers, hidden 256, batch 4, one token per step,
torch on one thread, every leaf dumped) in three modes, interleaved, order rotated per repetition:

  none      no dump
  running   fastdump.attach(model, root): the writer process drains the ring as the model runs
  stopped   the same, but the writer process is stopped (SIGSTOP) for the timed steps, with a ring
            large enough to hold them (ring_mb=1024), then resumed: the forward thread's own cost
            (wrapper, staging copy) without the writer's work on the other core

Printed: median step, step ratio to `none`, forward-thread CPU (time.thread_time) added per
dumped tensor, and for `running` the writer process's own CPU per dumped tensor (utime + stime
from /proc/<pid>/stat, from the first timed step until the ring is empty again). Every dump is
checked for drops (none allowed).

    python benchmarks/writer_interference_bench.py --reps 5 --steps 300
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fastdump  # noqa: E402
from benchmarks.models import PRESETS, allocate_kv_caches, build_models  # noqa: E402
from fastdump.staging.engine import Engine  # noqa: E402

MODES = ("none", "running", "stopped")


def process_cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(model, ids, mode: str, steps: int, root_parent: str):
    allocate_kv_caches([model], ids.shape[0], steps + 20)
    root = tempfile.mkdtemp(prefix=f"interference-{mode}-", dir=root_parent)
    dumper = None
    if mode != "none":
        dumper = fastdump.attach(model, root, ring_mb=1024 if mode == "stopped" else 256)
    try:
        with torch.no_grad():
            for _ in range(10):
                model(ids)
            engine = Engine._current if dumper is not None else None
            writer = engine._proc.pid if mode == "stopped" else None
            if writer:
                os.kill(writer, signal.SIGSTOP)
                time.sleep(0.05)
            w0 = process_cpu_s(engine._proc.pid) if mode == "running" else None
            try:
                t0, c0 = time.perf_counter(), time.thread_time()
                for _ in range(steps):
                    model(ids)
                t1, c1 = time.perf_counter(), time.thread_time()
            finally:
                if writer:
                    os.kill(writer, signal.SIGCONT)
            writer_cpu = None
            if w0 is not None:
                while engine.producer.used_bytes() > 0:  # the writer has taken every record
                    time.sleep(0.002)
                writer_cpu = process_cpu_s(engine._proc.pid) - w0
        stats = dumper.close() if dumper is not None else None
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if stats is not None and stats["dropped"]:
        raise SystemExit(f"{mode}: {stats['dropped']} tensors dropped; the comparison is void")
    if writer_cpu is not None:
        stats = dict(stats, writer_cpu_s=writer_cpu)
    return (t1 - t0) / steps, (c1 - c0) / steps, stats


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="micro", choices=sorted(k for k, p in PRESETS.items() if p.device == "cpu"))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--root", default=None, help="where the dumps go (default: the temporary directory)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    preset = PRESETS[args.preset]
    if args.steps + 20 > preset.model.max_seq_len:
        ap.error(f"--steps at most {preset.model.max_seq_len - 20} for this preset's KV cache")
    model, _ = build_models(preset.model, with_draft=False)
    ids = torch.randint(0, preset.model.vocab_size, (preset.batch_size, 1),
                        generator=torch.Generator().manual_seed(0))
    results = {m: [] for m in MODES}
    tensors = None
    writer_cpu = []  # the writer's CPU per dumped tensor, `running`
    load = os.getloadavg()[0]
    for rep in range(args.reps):
        for mode in MODES[rep % 3:] + MODES[:rep % 3]:
            wall, cpu, stats = run(model, ids, mode, args.steps, args.root or tempfile.gettempdir())
            results[mode].append((wall, cpu))
            if stats:
                tensors = stats["tensors"] / stats["passes"]
            if stats and "writer_cpu_s" in stats:
                writer_cpu.append(stats["writer_cpu_s"] / (tensors * args.steps))
    print(f"preset {args.preset}: {tensors:.0f} dumped tensors/step, {args.reps} reps x {args.steps} steps, "
          f"load {load:.2f} -> {os.getloadavg()[0]:.2f}")
    summary = {}
    for mode in MODES:
        ratio = statistics.median(a[0] / b[0] for a, b in zip(results[mode], results["none"]))
        cpu = statistics.median((a[1] - b[1]) / tensors for a, b in zip(results[mode], results["none"]))
        step = statistics.median(a[0] for a in results[mode])
        summary[mode] = {"step_s": step, "ratio": ratio, "cpu_per_tensor_s": cpu}
        extra = ""
        if mode == "running" and writer_cpu:
            summary[mode]["writer_cpu_per_tensor_s"] = statistics.median(writer_cpu)
            extra = f"  writer CPU/tensor {statistics.median(writer_cpu) * 1e6:5.2f} us"
        print(f"{mode:8} step {step * 1e3:6.3f} ms  vs none {ratio:.3f}x  forward-thread CPU/tensor "
              f"{cpu * 1e6:5.2f} us{extra}")
    return summary


if __name__ == "__main__":
    main()
