"""fastdump's own cost per dumped tensor, without a model around it: a low-noise A/B instrument.

In the decode loop (paired_step_bench --vs-noop) one build's figure moves by +-0.3 us from run to
run on a shared VM, more than most code-level changes make. Here a model of ``--leaves`` modules
that compute nothing (each returns its own fixed tensor of ``--numel`` fp32 elements, 5.5 KiB by
default: the micro model's average output) is run forward in groups, in a random order per group:
  - two forwards with fastdump attached (``every=2``: one dumped pass, one undumped);
  - one forward with every leaf in a no-op Python wrapper (decode_bench's noop-wrapper);
  - one bare forward (no wrapper).
Per dumped tensor = median over groups of (dumped - undumped) thread CPU / tensors per dumped pass
(leaves + the root): the wrapper's output handling, the staging, the pass's share. Per no-op call
= median of (noop - bare) / leaves. ``--pollute-kib`` makes each leaf also fill a buffer of that
size first, as a kernel would, so fastdump's code and data run with colder caches.

What this does not show: the decode loop's own coldness (the model's Python and kernels between
two leaf calls evict far more than a buffer fill does). In the micro decode loop the same per-tensor
work costs about 3x what it costs here (benchmarks/RESULTS.md, 0j). Use this to compare two builds
(run from two checkouts alternately); use paired_step_bench for the figure the target is about.

    python benchmarks/leaf_bench.py
    python benchmarks/leaf_bench.py --pollute-kib 256
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fastdump  # noqa: E402
from benchmarks.common import load_average, write_json  # noqa: E402
from benchmarks.paired_step_bench import noop_wrapper  # noqa: E402  (decode_bench's reference)


class FixedLeaf(nn.Module):
    """Returns its own tensor: the output is new to nobody, so only fastdump's work is timed."""

    def __init__(self, numel: int, pollute: torch.Tensor | None):
        super().__init__()
        self.out = torch.randn(numel)
        self.pollute = pollute

    def forward(self, x):
        if self.pollute is not None:
            self.pollute.fill_(1.0)
        return self.out


class Leaves(nn.Module):
    def __init__(self, leaves: int, numel: int, pollute_kib: int):
        super().__init__()
        pollute = torch.zeros(pollute_kib * 256) if pollute_kib else None  # one buffer for all
        self.leaves = nn.ModuleList(FixedLeaf(numel, pollute) for _ in range(leaves))

    def forward(self, x):
        for leaf in self.leaves:
            x = leaf(x)
        return x


def measure(leaves: int, numel: int, pollute_kib: int, groups: int, seed: int) -> dict:
    torch.set_num_threads(1)
    dumped_model = Leaves(leaves, numel, pollute_kib)
    noop_model = Leaves(leaves, numel, pollute_kib)
    bare_model = Leaves(leaves, numel, pollute_kib)
    for leaf in noop_model.leaves:
        leaf.forward = noop_wrapper(leaf.forward)
    root = tempfile.mkdtemp(prefix="fastdump-leaf-bench-")
    x = torch.zeros(1)
    clock = time.thread_time_ns
    rng = random.Random(seed)
    per_tensor, per_noop = [], []
    try:
        dumper = fastdump.attach(dumped_model, root, role="target", every=2)
        tensors = leaves + 1  # every leaf and the root

        def timed(model):
            t0 = clock()
            model(x)
            return clock() - t0

        def fastdump_pair():
            before = dumper.stats()["passes"]
            first = timed(dumped_model)
            first_dumped = dumper.stats()["passes"] > before
            second = timed(dumped_model)
            return (first - second) if first_dumped else (second - first)

        with torch.no_grad():
            for _ in range(20):  # warm-up: wrappers, name ids, the ring's first pages
                dumped_model(x), noop_model(x), bare_model(x)
            for _ in range(groups):
                kinds = ["fastdump", "noop", "bare"]
                rng.shuffle(kinds)
                times = {}
                for kind in kinds:
                    times[kind] = fastdump_pair() if kind == "fastdump" else timed(
                        noop_model if kind == "noop" else bare_model)
                per_tensor.append(times["fastdump"] / tensors / 1e3)
                per_noop.append((times["noop"] - times["bare"]) / leaves / 1e3)
        stats = dumper.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    quartiles = statistics.quantiles(per_tensor, n=4)
    return {
        "leaves": leaves, "numel": numel, "pollute_kib": pollute_kib, "groups": groups,
        "tensors_per_dumped_pass": tensors,
        "per_tensor_us": statistics.median(per_tensor),
        "per_tensor_quartiles_us": [quartiles[0], quartiles[2]],
        "noop_per_call_us": statistics.median(per_noop),
        "passes": stats["passes"], "dropped": stats["dropped"], "tensors": stats["tensors"],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--leaves", type=int, default=100)
    parser.add_argument("--numel", type=int, default=1408, help="fp32 elements per leaf output")
    parser.add_argument("--pollute-kib", type=int, default=0, help="buffer each leaf fills first (0: none)")
    parser.add_argument("--groups", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    load_before = load_average()
    result = measure(args.leaves, args.numel, args.pollute_kib, args.groups, args.seed)
    result["load_average"] = [load_before, load_average()]
    print(f"leaf_bench: {args.leaves} leaves x {args.numel * 4} B, pollute {args.pollute_kib} KiB, "
          f"{args.groups} groups, load {load_before[0] if load_before else '?'}")
    q = result["per_tensor_quartiles_us"]
    print(f"per dumped tensor: {result['per_tensor_us']:.3f} us thread CPU (quartiles {q[0]:.2f}-{q[1]:.2f}); "
          f"per no-op wrapper call: {result['noop_per_call_us']:.3f} us")
    write_json(args.json, result)
    # Every dumped pass whole: otherwise the figure is not what it says.
    expected = result["tensors_per_dumped_pass"] * result["passes"]
    if result["dropped"] or result["tensors"] != expected:
        print(f"error: {result['dropped']} dropped, {result['tensors']} tensors staged of {expected}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
