"""The read side's speed and memory: ``fastdump verify / ls / show / diff / export`` on two kinds of
dumps, timed as commands a user runs, each checkout side by side.

Dumps (made once, with the fastdump this script imports):
  - ``micro``: the micro preset's target (benchmarks/models.py) decoding ``--passes`` passes
    (200: 19,000 tensors of ~5.5 KB, 103 MiB), twice (A and B; the same seeds: a rerun that
    reproduced its baseline);
  - ``wide``: a model of ``--leaves`` modules (12,000) each returning 64 fp32 values, ``--wide-passes``
    passes (2): a block per name, what a big model or MoE dump looks like to the reader, twice.

Each command runs under ``/usr/bin/time -v`` (wall, user CPU, max RSS) as ``python -m fastdump ...``
with ``PYTHONPATH`` set to each checkout given by ``--tree LABEL=PATH`` (from a directory holding no
``fastdump``, so the path given is the one imported), the checkouts alternated within each round
and the first one rotated from round to round. The table gives medians over ``--rounds``. On a
shared machine wall time moves with the load: compare user CPU and RSS first.

    python benchmarks/read_bench.py --tree old=/path/to/main --tree new=.
    python benchmarks/read_bench.py --passes 20 --leaves 500 --rounds 1   # a quick look
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import load_average  # noqa: E402
from benchmarks.models import PRESETS, allocate_kv_caches, build_models  # noqa: E402


@torch.no_grad()
def make_micro(root: Path, passes: int) -> None:
    import fastdump

    config = PRESETS["micro"].model
    target, _ = build_models(config, with_draft=False, seed=0)
    allocate_kv_caches([target], 4, passes + 16)
    dumper = fastdump.attach(target, root, role="target")
    ids = torch.randint(0, config.vocab_size, (4, 1), generator=torch.Generator().manual_seed(1))
    for _ in range(passes):
        logits, _ = target(ids)
        ids = logits.argmax(-1)[:, -1:]
    assert dumper.close()["status"] == "closed"


class _Leaf(nn.Module):
    def __init__(self, numel: int):
        super().__init__()
        self.out = torch.randn(numel)

    def forward(self, x):
        return self.out


class _Wide(nn.Module):
    def __init__(self, leaves: int, numel: int):
        super().__init__()
        self.leaves = nn.ModuleList(_Leaf(numel) for _ in range(leaves))

    def forward(self, x):
        for leaf in self.leaves:
            x = leaf(x)
        return x


def make_wide(root: Path, leaves: int, passes: int) -> None:
    import fastdump

    torch.manual_seed(0)
    model = _Wide(leaves, 64)
    dumper = fastdump.attach(model, root, role="target")
    for _ in range(passes):
        model(torch.zeros(1))
    assert dumper.close()["status"] == "closed"


def commands(kind: str, a: Path, b: Path, out: Path, show_pass: int) -> list:
    """(label, argv after ``python -m fastdump``) timed on one kind of dump."""
    diff = [("diff", ["diff", str(a), str(b)])] if kind == "micro" else \
        [("diff --html", ["diff", "--html", str(out / "report.html"), str(a), str(b)])]
    return [("verify", ["verify", str(a)]), ("verify --data", ["verify", "--data", str(a)]),
            ("ls", ["ls", str(a)]), ("show", ["show", str(a), "--pass", str(show_pass)]),
            *diff, ("export", ["export", str(a), str(out / "export")])]


_TIME_FIELDS = {"wall": r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)",
                "user": r"User time \(seconds\): (\S+)", "rss_mb": r"Maximum resident set size \(kbytes\): (\d+)"}


def _seconds(text: str) -> float:
    parts = [float(p) for p in text.split(":")]
    return sum(p * 60 ** k for k, p in enumerate(reversed(parts)))


def timed(tree: str, argv: list, cwd: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": tree}
    proc = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-m", "fastdump", *argv], cwd=cwd, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    found = {key: re.search(pattern, proc.stderr) for key, pattern in _TIME_FIELDS.items()}
    if not all(found.values()) or proc.returncode not in (0, 1):  # (1: diff found a difference)
        raise SystemExit(f"fastdump {' '.join(argv)} with PYTHONPATH={tree} failed (exit {proc.returncode}): "
                         f"{proc.stderr[-2000:]}")
    return {"wall": _seconds(found["wall"].group(1)), "user": float(found["user"].group(1)),
            "rss_mb": int(found["rss_mb"].group(1)) / 1024, "rc": proc.returncode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", default=[], metavar="LABEL=PATH",
                        help="a checkout to time (repeatable; default: this one)")
    parser.add_argument("--passes", type=int, default=200, help="micro dump: decode passes")
    parser.add_argument("--leaves", type=int, default=12000, help="wide dump: names per pass")
    parser.add_argument("--wide-passes", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kinds", default="micro,wide")
    parser.add_argument("--dir", help="where the dumps go (kept; default: a temporary directory, removed)")
    args = parser.parse_args()
    trees = [t.split("=", 1) for t in args.tree] or [["this", str(Path(__file__).resolve().parents[1])]]
    trees = [(label, str(Path(path).resolve())) for label, path in trees]
    work = Path(args.dir).resolve() if args.dir else Path(tempfile.mkdtemp(prefix="fastdump-read-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        kinds = args.kinds.split(",")
        for kind in kinds:
            for side in ("A", "B"):
                root = work / f"{kind}-{side}"
                if not root.exists():
                    make_micro(root, args.passes) if kind == "micro" else make_wide(root, args.leaves, args.wide_passes)
        print(f"load average at start: {load_average()}")
        results: dict = {}  # (kind, command, tree label) -> [measurements]
        for round_number in range(args.rounds):
            order = trees[round_number % len(trees):] + trees[:round_number % len(trees)]
            for kind in kinds:
                show_pass = args.passes // 2 if kind == "micro" else args.wide_passes - 1
                out = work / "out"
                for label, argv in commands(kind, work / f"{kind}-A", work / f"{kind}-B", out, show_pass):
                    for tree_label, tree in order:
                        shutil.rmtree(out, ignore_errors=True)
                        out.mkdir()
                        results.setdefault((kind, label, tree_label), []).append(timed(tree, argv, work))
        print(f"load average at end: {load_average()}")
        print(f"\n{'dump':6} {'command':14} {'tree':6} {'wall s':>8} {'user s':>8} {'RSS MB':>8} {'exit':>5}")
        for (kind, label, tree_label), runs in results.items():
            med = {key: statistics.median(r[key] for r in runs) for key in ("wall", "user", "rss_mb")}
            codes = ",".join(sorted({str(r["rc"]) for r in runs}))
            print(f"{kind:6} {label:14} {tree_label:6} {med['wall']:8.2f} {med['user']:8.2f} {med['rss_mb']:8.0f} "
                  f"{codes:>5}")
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
