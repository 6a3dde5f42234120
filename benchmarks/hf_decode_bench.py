"""Decode overhead on a real transformers model: issue 11's small-model loop, outside fastdump's own
toy models.

A ``transformers`` ``LlamaForCausalLM`` (default: 6 layers, hidden 256, 4 heads, vocab 1024), batch
4, one new token per step with a ``DynamicCache``, ``torch.set_num_threads(1)``, every leaf module
dumped with default ``fastdump.attach`` options. Modes run interleaved in every repetition, in an
order rotated from one repetition to the next (the machine's noise hits all of them alike):

  none          no dump
  noop-wrapper  every leaf's forward replaced by a Python wrapper that only calls it (the floor a
                per-module wrapper costs; issue 11's target: fastdump's CPU per tensor <= 2x this)
  fastdump      fastdump.attach(model, root)

Printed per mode: median step time, step ratio to ``none`` (median of the per-repetition ratios),
and forward-thread CPU (time.thread_time) added per dumped tensor over ``none``. The last pass of
the fastdump mode is read back and compared bit for bit with the outputs recorded by forward hooks
in a separate reference pass.

    python benchmarks/hf_decode_bench.py                    # 7 reps x 200 steps
    python benchmarks/hf_decode_bench.py --steps 20 --reps 1 --json out.json   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fastdump  # noqa: E402
from benchmarks.decode_bench import NoopWrapperSession, leaf_modules  # noqa: E402

MODES = ("none", "noop-wrapper", "fastdump")


def build_model(layers: int, hidden: int, heads: int):
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)  # past_key_values' deprecation notice
    cfg = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=heads, intermediate_size=int(hidden * 2.6875), vocab_size=1024,
                      max_position_embeddings=8192)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def decode(model, steps: int, batch: int):
    """Prefill 8 tokens, 10 warm-up steps, then ``steps`` timed decode steps: (wall s, thread CPU s) per step."""
    from transformers import DynamicCache

    cache = DynamicCache()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 1024, (batch, 8), generator=gen), past_key_values=cache, use_cache=True)
        ids = torch.randint(0, 1024, (batch, 1), generator=gen)
        for _ in range(10):
            model(input_ids=ids, past_key_values=cache, use_cache=True)
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(steps):
            model(input_ids=ids, past_key_values=cache, use_cache=True)
        t1, c1 = time.perf_counter(), time.thread_time()
    return (t1 - t0) / steps, (c1 - c0) / steps


def run_mode(model, mode: str, steps: int, batch: int, out: Path) -> dict:
    root = Path(tempfile.mkdtemp(prefix=f"hfbench-{mode}-", dir=out))
    dumper, noop = None, None
    if mode == "fastdump":
        dumper = fastdump.attach(model, str(root))
    elif mode == "noop-wrapper":
        noop = NoopWrapperSession()  # decode_bench's reference wrapper, on every leaf
        noop.attach({"target": model}, root)
    try:
        wall, cpu = decode(model, steps, batch)
    finally:
        if noop is not None:
            noop.close()
        stats = dumper.close() if dumper is not None else None
    result = {"step_s": wall, "thread_cpu_s": cpu}
    if stats is not None:
        result.update(tensors_per_step=stats["tensors"] / max(stats["passes"], 1), dropped=stats["dropped"],
                      passes=stats["passes"], root=str(root))
    else:
        shutil.rmtree(root, ignore_errors=True)
    return result


def check_bit_exact(model, root: str, batch: int) -> int:
    """Dump one more forward and compare it with what forward hooks saw: the number of tensors checked."""
    seen = {}
    hooks = [m.register_forward_hook(lambda mod, _in, out, name=name: seen.__setitem__(name, out))
             for name, m in leaf_modules(model)]
    dumper = fastdump.attach(model, root, role="check")
    try:
        with torch.no_grad():
            model(input_ids=torch.arange(batch * 4).reshape(batch, 4) % 1024)
    finally:
        dumper.close()
        for h in hooks:
            h.remove()
    got = fastdump.open(root).load("check", 0, 0)
    checked = 0
    for name, out in seen.items():
        flat = {name: out} if isinstance(out, torch.Tensor) else \
            {f"{name}.{i}": t for i, t in enumerate(out) if isinstance(t, torch.Tensor)}
        for key, want in flat.items():
            if not torch.equal(got[key], want):
                raise AssertionError(f"{key}: dumped tensor differs from the module's output")
            checked += 1
    return checked


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="dump directory (default: a temporary one, removed)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = build_model(args.layers, args.hidden, args.heads)
    out = Path(args.out or tempfile.mkdtemp(prefix="hfbench-"))
    out.mkdir(parents=True, exist_ok=True)
    runs = {m: [] for m in MODES}
    load = [os.getloadavg()[0]]
    for rep in range(args.reps):
        for mode in MODES[rep % len(MODES):] + MODES[:rep % len(MODES)]:  # rotated: no mode always first
            r = run_mode(model, mode, args.steps, args.batch, out)
            if "root" in r:
                shutil.rmtree(r.pop("root"), ignore_errors=True)
            runs[mode].append(r)
    load.append(os.getloadavg()[0])
    checked = check_bit_exact(model, str(out / "check"), args.batch)
    tensors = statistics.median(r["tensors_per_step"] for r in runs["fastdump"])
    summary = {}
    for mode in MODES:
        ratios = [r["step_s"] / n["step_s"] for r, n in zip(runs[mode], runs["none"])]
        extra_cpu = [(r["thread_cpu_s"] - n["thread_cpu_s"]) / tensors for r, n in zip(runs[mode], runs["none"])]
        summary[mode] = {"step_s": statistics.median(r["step_s"] for r in runs[mode]),
                         "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                         "cpu_per_tensor_s": statistics.median(extra_cpu),
                         "dropped": sum(r.get("dropped", 0) for r in runs[mode])}
    noop, fd = summary["noop-wrapper"]["cpu_per_tensor_s"], summary["fastdump"]["cpu_per_tensor_s"]
    print(f"transformers Llama {args.layers}x{args.hidden}, {args.heads} heads, batch {args.batch}, "
          f"{tensors:.0f} dumped tensors/step, {args.reps} reps x {args.steps} steps, "
          f"torch threads {args.threads}, load {load[0]:.2f} -> {load[1]:.2f}")
    print(f"{'mode':<14}{'step':>10}{'vs none':>10}{'range':>16}{'CPU/tensor':>12}{'dropped':>9}")
    for mode, s in summary.items():
        cpu = "-" if mode == "none" else f"{s['cpu_per_tensor_s'] * 1e6:.2f} us"
        print(f"{mode:<14}{s['step_s'] * 1e3:>8.3f}ms{s['ratio']:>9.3f}x"
              f"{s['ratio_min']:>8.3f}-{s['ratio_max']:.3f}{cpu:>12}{s['dropped']:>9}")
    vs_noop = fd / noop if noop > 0 else float("nan")
    print(f"fastdump CPU per tensor / no-op wrapper's: {vs_noop:.2f} (issue 11 target <= 2); "
          f"bit-exact check: {checked} tensors equal")
    result = {"config": vars(args), "tensors_per_step": tensors, "load": load, "modes": summary,
              "cpu_vs_noop": vs_noop, "bit_exact_tensors": checked}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.out is None:
        shutil.rmtree(out, ignore_errors=True)
    return result


if __name__ == "__main__":
    main()
