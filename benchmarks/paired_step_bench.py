"""fastdump's cost per dumped decode step, measured step by step against undumped steps of the same run.

The step ratios of decode_bench and hf_decode_bench compare whole runs, and on a shared 2-core VM
the host's noise moves a whole run by several percent (issue 11's micro loop: 1.06x to 1.17x for
one build). Here fastdump is attached with ``every=2``: every other pass is dumped, so dumped and
undumped steps alternate within one run, microseconds apart, and their ratio cancels that noise.
A ``none`` run (no dump) is interleaved with it to show that undumped steps cost what no dump does.

  dumped / undumped   median over repetitions of (median dumped step / median undumped step):
                      fastdump's own cost per dumped step (wrapper, pass, staging), with the
                      writer running beside the model as always
  undumped / none     what attaching costs a step that is not dumped (wrappers, the skipped pass)
  dumped / none       the whole-run comparison, for reference (noisy)

With ``every=2`` the writer has half the work it has at ``every=1``, and whatever it takes from
the model lands in both kinds of step alike: ``dumped / undumped`` is the forward thread's own
cost; ``undumped / none`` shows the writer's share (benchmarks/RESULTS.md, 0e).

    python benchmarks/paired_step_bench.py --model micro     # decode_bench's micro preset
    python benchmarks/paired_step_bench.py --model hf        # hf_decode_bench's transformers Llama
    python benchmarks/paired_step_bench.py --model micro --compare-reader   # tensor reader vs attributes

``--vs-noop`` answers issue 11's per-tensor target (fastdump's forward-thread CPU per dumped
tensor <= 2x a no-op forward wrapper's, in the decode loop) from one run: fastdump stays attached
(``every=2``) and, between steps and outside the timed region, the module forwards are swapped so
that the steps of one run are of four kinds, in a random order per group of four: dumped, undumped
(fastdump's wrappers), bare (no wrapper at all) and noop (each leaf in a Python wrapper that only
calls it, decode_bench's noop-wrapper). Each step's thread CPU time (``time.thread_time``) and wall
time are recorded. Each group holds one step of each kind, run back to back, so differences within
a group cancel the host's drift: per dumped tensor = median over groups of (dumped - bare) /
tensors per step; per no-op call = median of (noop - bare) / leaf calls per step; the summary
pools the groups of every repetition. ``--steps`` counts steps of all four kinds.

``--compare-reader`` adds a third run per repetition, the same ``every=2`` dump with the tensor
reader switched off (``fastdump.staging.tensor_reader.set_enabled(False)``: tensors read through
their Python attributes), so the reader's saving is measured side by side with the rest.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fastdump  # noqa: E402
from benchmarks.decode_bench import leaf_modules  # noqa: E402  (what its noop-wrapper wraps)


def micro_loop(batch: int):
    """decode_bench's micro preset: its model and a decode step on one new token."""
    from benchmarks.models import PRESETS, allocate_kv_caches, build_models

    preset = PRESETS["micro"]
    model, _ = build_models(preset.model, with_draft=False)
    ids = torch.randint(0, preset.model.vocab_size, (batch, 1), generator=torch.Generator().manual_seed(1))

    def start(steps: int):
        allocate_kv_caches([model], batch, steps + 16)
        return lambda: model(ids)

    return model, start


def hf_loop(batch: int):
    """hf_decode_bench's transformers Llama (6x256), one new token per step with a DynamicCache."""
    from transformers import DynamicCache

    from benchmarks.hf_decode_bench import build_model

    model = build_model(6, 256, 4)
    gen = torch.Generator().manual_seed(1)
    prompt, ids = torch.randint(0, 1024, (batch, 8), generator=gen), torch.randint(0, 1024, (batch, 1), generator=gen)

    def start(steps: int):
        cache = DynamicCache()
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
        return lambda: model(input_ids=ids, past_key_values=cache, use_cache=True)

    return model, start


def timed_steps(start, steps: int, dumper=None) -> tuple:
    """Step times, split into (dumped, undumped) by the Dumper's own pass count when one is attached."""
    dumped, undumped = [], []
    passes = (lambda: dumper.stats()["passes"]) if dumper is not None else (lambda: 0)
    with torch.no_grad():
        step = start(steps + 10)
        for _ in range(10):
            step()
        for _ in range(steps):
            before = passes()  # outside the timed region
            t0 = time.perf_counter()
            step()
            elapsed = time.perf_counter() - t0
            (dumped if passes() > before else undumped).append(elapsed)
    return dumped, undumped


CACHE_STEPS = 400  # --vs-noop: steps per KV cache


def noop_wrapper(forward):
    """decode_bench's reference wrapper: calls the forward, nothing else."""

    @functools.wraps(forward)
    def forward_unchanged(*args, **kwargs):
        return forward(*args, **kwargs)

    return forward_unchanged


def interleaved_steps(model, start, groups: int, dumper, seed: int) -> dict:
    """Thread CPU and wall time of ``groups`` groups of four steps, one of each kind (dumped,
    undumped, bare, noop) in a random order (see --vs-noop in the docstring).

    fastdump's wrappers stay in the modules' ``__dict__`` between its steps; for a bare step they
    are taken out, for a noop step every leaf gets the no-op wrapper over its class's forward.
    With ``every=2`` the two fastdump steps of a group are one dumped and one undumped."""
    hooked = [m for m in model.modules() if "forward" in m.__dict__]  # fastdump's wrappers
    theirs = [m.__dict__["forward"] for m in hooked]
    leaves = [m for _, m in leaf_modules(model)]
    noops = [noop_wrapper(type(m).forward.__get__(m)) for m in leaves]
    calls = [0]

    def counting(forward):
        def counted(*args, **kwargs):
            calls[0] += 1
            return forward(*args, **kwargs)
        return counted

    def use(kind: str) -> None:
        for m in hooked + leaves:
            m.__dict__.pop("forward", None)
        if kind == "fastdump":
            for m, f in zip(hooked, theirs):
                m.__dict__["forward"] = f
        elif kind == "noop":
            for m, f in zip(leaves, noops):
                m.__dict__["forward"] = f
        elif kind == "count":
            for m in leaves:
                m.__dict__["forward"] = counting(type(m).forward.__get__(m))

    rng = random.Random(seed)
    rows, done = [], 0
    with torch.no_grad():
        step = start(CACHE_STEPS + 16)
        use("count")  # how many leaf calls a step makes: the no-op wrapper's call count
        step()
        wrapped_calls = calls[0]
        use("fastdump")
        for _ in range(6):
            step()
        for _ in range(groups):
            if done + 4 > CACHE_STEPS:
                step, done = start(CACHE_STEPS + 16), 0  # a fresh KV cache: the micro model holds 512 positions
            kinds = ["fastdump", "fastdump", "bare", "noop"]
            rng.shuffle(kinds)
            row = {}
            for kind in kinds:
                use(kind)
                before = dumper.stats()["passes"]
                c0, t0 = time.thread_time(), time.perf_counter()
                step()
                t1, c1 = time.perf_counter(), time.thread_time()
                if kind == "fastdump":
                    kind = "dumped" if dumper.stats()["passes"] > before else "undumped"
                row[kind] = (c1 - c0, t1 - t0)
            done += 4
            if len(row) == 4:  # one of each (a group whose two fastdump steps were alike is left out)
                rows.append(row)
        use("fastdump")
    return {"groups": rows, "wrapped_calls": wrapped_calls}


def per_call(rows: list, kind: str, clock: int, count: float) -> float:
    """Median over groups of (kind's step - the bare step of the same group) / count: the two steps
    ran microseconds apart, so the host's drift cancels."""
    return statistics.median((r[kind][clock] - r["bare"][clock]) / count for r in rows)


def vs_noop(args) -> dict:
    from fastdump.staging import tensor_reader

    reader = tensor_reader.install()
    torch.set_num_threads(args.threads)
    model, start = (micro_loop if args.model == "micro" else hf_loop)(args.batch)
    parent = Path(tempfile.mkdtemp(prefix="paired-bench-"))
    reps, pooled, load = [], [], [os.getloadavg()[0]]
    tensors = calls = None
    try:
        for rep in range(args.reps):
            root = tempfile.mkdtemp(dir=parent)
            dumper = fastdump.attach(model, root, every=2)
            try:
                run = interleaved_steps(model, start, args.steps // 4, dumper, seed=rep)
            finally:
                stats = dumper.close()
            shutil.rmtree(root, ignore_errors=True)
            if stats["dropped"] or stats["status"] != "closed":
                raise SystemExit(f"fastdump lost data: {stats}")
            tensors, calls = stats["tensors"] / max(stats["passes"], 1), run["wrapped_calls"]
            rows = run["groups"]
            pooled += rows
            r = {"groups": len(rows)}
            for i, clock in enumerate(("cpu", "wall")):
                r[f"{clock}_per_tensor_s"] = per_call(rows, "dumped", i, tensors)
                r[f"{clock}_noop_per_call_s"] = per_call(rows, "noop", i, calls)
                r[f"{clock}_undumped_per_call_s"] = per_call(rows, "undumped", i, calls)
            reps.append(r)
            print(f"rep {rep}: {len(rows)} groups; per dumped tensor {r['cpu_per_tensor_s'] * 1e6:.2f} us CPU / "
                  f"{r['wall_per_tensor_s'] * 1e6:.2f} us wall; no-op wrapper per call "
                  f"{r['cpu_noop_per_call_s'] * 1e6:.2f} / {r['wall_noop_per_call_s'] * 1e6:.2f} us", flush=True)
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    load.append(os.getloadavg()[0])
    result = {"model": args.model, "config": vars(args), "load": load, "tensor_reader": reader["reader"],
              "tensors_per_dumped_step": tensors, "wrapped_calls": calls, "groups": len(pooled), "reps": reps,
              "bare_step_cpu_s": statistics.median(r["bare"][0] for r in pooled)}
    for i, clock in enumerate(("cpu", "wall")):  # all groups of all repetitions pooled
        result[f"{clock}_per_tensor_s"] = per_call(pooled, "dumped", i, tensors)
        result[f"{clock}_noop_per_call_s"] = per_call(pooled, "noop", i, calls)
        result[f"{clock}_undumped_per_call_s"] = per_call(pooled, "undumped", i, calls)
        noop = result[f"{clock}_noop_per_call_s"]
        result[f"{clock}_vs_noop"] = result[f"{clock}_per_tensor_s"] / noop if noop > 0 else None
    print(f"{args.model}: {tensors:.0f} tensors per dumped step, {calls} leaf calls per step, {args.reps} reps x "
          f"{args.steps} interleaved steps, bare step {result['bare_step_cpu_s'] * 1e3:.3f} ms CPU, torch threads "
          f"{args.threads}, tensor reader {reader['reader']}, load {load[0]:.2f} -> {load[1]:.2f}")
    print(f"per dumped tensor: {result['cpu_per_tensor_s'] * 1e6:.2f} us thread CPU, "
          f"{result['wall_per_tensor_s'] * 1e6:.2f} us wall; per no-op wrapper call: "
          f"{result['cpu_noop_per_call_s'] * 1e6:.2f} us CPU, {result['wall_noop_per_call_s'] * 1e6:.2f} us wall; "
          f"per undumped fastdump call: {result['cpu_undumped_per_call_s'] * 1e6:.2f} us CPU "
          f"(medians of same-group differences, {len(pooled)} groups)")
    ratio = result["cpu_vs_noop"]
    print("fastdump per dumped tensor / no-op wrapper per call (thread CPU): "
          + (f"{ratio:.2f}x" if ratio is not None else "not defined (the no-op wrapper measured <= 0)")
          + " (issue 11 target: <= 2x)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("micro", "hf"), default="micro")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=400, help="timed steps per run (half of them dumped)")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--compare-reader", action="store_true",
                    help="also dump with the tensor reader off (attribute reads), interleaved")
    ap.add_argument("--vs-noop", action="store_true",
                    help="per dumped tensor against a no-op wrapper per call, thread CPU and wall, steps interleaved")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.vs_noop:
        return vs_noop(args)
    from fastdump.staging import tensor_reader

    reader = tensor_reader.install()
    if args.compare_reader and reader["reader"] != "torch":
        raise SystemExit(f"--compare-reader needs the tensor reader: {reader['why']}")
    torch.set_num_threads(args.threads)
    model, start = (micro_loop if args.model == "micro" else hf_loop)(args.batch)
    parent = Path(tempfile.mkdtemp(prefix="paired-bench-"))
    none, dumped, undumped, tensors = [], [], [], []
    attrs_dumped, attrs_undumped = [], []
    modes = ("none", "every2", "every2-attributes") if args.compare_reader else ("none", "every2")
    load = [os.getloadavg()[0]]
    try:
        for rep in range(args.reps):
            for mode in modes[rep % len(modes):] + modes[:rep % len(modes)]:  # rotated: no fixed order
                if mode == "none":
                    none.append(statistics.median(timed_steps(start, args.steps)[1]))
                    continue
                root = tempfile.mkdtemp(dir=parent)
                attributes = mode == "every2-attributes"
                if attributes:
                    tensor_reader.set_enabled(False)
                dumper = fastdump.attach(model, root, every=2)
                try:
                    on, off = timed_steps(start, args.steps, dumper)
                finally:
                    stats = dumper.close()
                    if attributes:
                        tensor_reader.set_enabled(True)
                shutil.rmtree(root, ignore_errors=True)
                if stats["dropped"] or stats["status"] != "closed" or abs(len(on) - len(off)) > 1:
                    raise SystemExit(f"fastdump lost data or did not dump every other step: {stats}")
                if attributes:
                    attrs_dumped.append(statistics.median(on))
                    attrs_undumped.append(statistics.median(off))
                    continue
                dumped.append(statistics.median(on))
                undumped.append(statistics.median(off))
                tensors.append(stats["tensors"] / max(stats["passes"], 1))
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    load.append(os.getloadavg()[0])
    paired = [d / u for d, u in zip(dumped, undumped)]
    per_tensor = [(d - u) / t for d, u, t in zip(dumped, undumped, tensors)]
    result = {
        "model": args.model, "config": vars(args), "load": load, "tensor_reader": reader["reader"],
        "tensors_per_dumped_step": statistics.median(tensors),
        "step_none_s": statistics.median(none), "step_dumped_s": statistics.median(dumped),
        "step_undumped_s": statistics.median(undumped),
        "dumped_vs_undumped": statistics.median(paired), "dumped_vs_undumped_range": [min(paired), max(paired)],
        "undumped_vs_none": statistics.median([u / n for u, n in zip(undumped, none)]),
        "dumped_vs_none": statistics.median([d / n for d, n in zip(dumped, none)]),
        "added_per_tensor_s": statistics.median(per_tensor),
    }
    print(f"{args.model}: {result['tensors_per_dumped_step']:.0f} tensors per dumped step, {args.reps} reps x "
          f"{args.steps} steps, torch threads {args.threads}, tensor reader {reader['reader']}, "
          f"load {load[0]:.2f} -> {load[1]:.2f}")
    print(f"step: none {result['step_none_s'] * 1e3:.3f} ms, undumped {result['step_undumped_s'] * 1e3:.3f} ms, "
          f"dumped {result['step_dumped_s'] * 1e3:.3f} ms")
    print(f"dumped / undumped {result['dumped_vs_undumped']:.3f}x (range {min(paired):.3f}-{max(paired):.3f}), "
          f"+{result['added_per_tensor_s'] * 1e6:.2f} us per dumped tensor; undumped / none "
          f"{result['undumped_vs_none']:.3f}x; dumped / none {result['dumped_vs_none']:.3f}x")
    if args.compare_reader:
        attrs = [d / u for d, u in zip(attrs_dumped, attrs_undumped)]
        result["attributes_dumped_vs_undumped"] = statistics.median(attrs)
        result["attributes_added_per_tensor_s"] = statistics.median(
            [(d - u) / t for d, u, t in zip(attrs_dumped, attrs_undumped, tensors)])
        print(f"reader off (attribute reads): dumped / undumped {result['attributes_dumped_vs_undumped']:.3f}x "
              f"(range {min(attrs):.3f}-{max(attrs):.3f}), +{result['attributes_added_per_tensor_s'] * 1e6:.2f} us "
              f"per dumped tensor")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
