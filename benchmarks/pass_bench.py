"""What a dumped pass costs the forward thread around the model, measured in the decode loop.

The root wrapper opens the pass, captures the root's own output and closes the pass; the model's
forward runs inside it. This benchmark times, per dumped step of decode_bench's ``micro`` model
(every pass dumped, torch on one thread), the step's thread CPU minus the thread CPU spent inside
the model's own forward: what the root wrapper adds (begin, root output, end). It also times the
pass's begin alone (``Dumper._root_begin``, wall clock: perf_counter, not a syscall).

Old and new code are compared by running this script from two checkouts alternately, several rounds
(the VM's drift between runs is larger than the differences): benchmarks/RESULTS.md, 0i.

    python benchmarks/pass_bench.py --steps 400
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fastdump  # noqa: E402
from benchmarks.paired_step_bench import micro_loop  # noqa: E402


def measure(steps: int, batch: int = 4) -> dict:
    torch.set_num_threads(1)
    model, start = micro_loop(batch)
    clock = time.thread_time
    inside = [0.0]
    forward = model.forward

    def timed_forward(*args, **kwargs):  # set before attach: the root wrapper wraps this
        t0 = clock()
        out = forward(*args, **kwargs)
        inside[0] = clock() - t0
        return out

    model.forward = timed_forward
    root = tempfile.mkdtemp(prefix="pass-bench-")
    dumper = fastdump.attach(model, root)
    begins, overheads = [], []
    root_begin = dumper._root_begin

    def timed_begin():
        t0 = time.perf_counter()
        root_begin()
        begins.append(time.perf_counter() - t0)

    dumper._root_begin = timed_begin
    try:
        with torch.no_grad():
            step = start(steps + 16)
            for _ in range(5):
                step()
            begins.clear()
            for _ in range(steps):
                t0 = clock()
                step()
                overheads.append(clock() - t0 - inside[0])
    finally:
        stats = dumper.close()
        del model.forward
        shutil.rmtree(root, ignore_errors=True)
    if stats["status"] != "closed" or stats["dropped"] or stats["passes"] != steps + 5:
        raise SystemExit(f"fastdump lost data or passes: {stats}")
    q = statistics.quantiles(overheads)
    return {"steps": steps, "tensors_per_pass": stats["tensors"] / stats["passes"],
            "root_wrapper_per_pass_s": statistics.median(overheads), "quartiles_s": [q[0], q[2]],
            "begin_per_pass_s": statistics.median(begins)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    result = measure(args.steps)
    print(f"micro, {result['tensors_per_pass']:.0f} tensors per pass, {args.steps} dumped steps: root wrapper "
          f"{result['root_wrapper_per_pass_s'] * 1e6:.1f} us per pass (quartiles "
          f"{result['quartiles_s'][0] * 1e6:.1f}-{result['quartiles_s'][1] * 1e6:.1f}), of which begin "
          f"{result['begin_per_pass_s'] * 1e6:.1f} us (thread CPU; begin: wall)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
