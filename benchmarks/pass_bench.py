"""What a dumped pass costs the forward thread around the model, measured in the decode loop.

The root wrapper opens the pass, captures the root's own output and closes the pass; the model's
forward runs inside it. This benchmark times, per dumped step of decode_bench's ``micro`` model
(every pass dumped, torch on one thread), the step's thread CPU minus the thread CPU spent inside
the model's own forward: what the root wrapper adds (begin, root output, end).

It runs the two ways a pass can begin and end, alternately, ``--rounds`` times each: in C
(``CaptureState.root_pass``, every plain pass) and in Python (``Dumper._root_begin`` / ``_end``,
what a pass with metadata, skips or a budget takes), and prints their ratio. For the Python way it
also times the pass's begin alone (``Dumper._root_begin``, wall clock: perf_counter, not a syscall).

Old and new code are compared by running this script from two checkouts alternately, several rounds
(the VM's drift between runs is larger than the differences): benchmarks/RESULTS.md, 0i and 0l.

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
from fastdump.capture import wrappers as wrappers_mod  # noqa: E402
from benchmarks.paired_step_bench import micro_loop  # noqa: E402


def measure(steps: int, batch: int = 4, native_pass: bool = True) -> dict:
    torch.set_num_threads(1)
    wrappers_mod._native_root_pass = native_pass  # read when attach wraps the root
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
            "begin_per_pass_s": statistics.median(begins) if begins else None}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=2, help="runs of each way, alternately")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    runs = {"c": [], "python": []}
    for _ in range(args.rounds):
        for way in runs:
            runs[way].append(measure(args.steps, native_pass=way == "c"))
    result = {"steps": args.steps, "rounds": args.rounds, "tensors_per_pass": runs["c"][0]["tensors_per_pass"],
              "runs": runs}
    for way, measured in runs.items():
        result[f"{way}_per_pass_s"] = statistics.median(r["root_wrapper_per_pass_s"] for r in measured)
    result["begin_per_pass_s"] = statistics.median(r["begin_per_pass_s"] for r in runs["python"])
    result["c_vs_python"] = result["c_per_pass_s"] / result["python_per_pass_s"]
    for way, measured in runs.items():
        print(f"micro, {result['tensors_per_pass']:.0f} tensors per pass, {args.steps} dumped steps, pass in "
              f"{way:6s}: root wrapper per pass " + ", ".join(f"{r['root_wrapper_per_pass_s'] * 1e6:.1f}"
                                                            for r in measured) + " us (thread CPU)")
    print(f"begin alone in Python: {result['begin_per_pass_s'] * 1e6:.1f} us (wall); "
          f"C / Python per pass: {result['c_vs_python']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
