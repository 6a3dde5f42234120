"""The demo: dump a small Llama-like target and its EAGLE-style draft in one process, then list it.

    python examples/demo.py [ROOT]        (default ./dumps/demo)

Runs speculative decoding (prefill, rounds of draft passes, a target verify pass, draft extend),
with both roles attached to fastdump, checks one pass against the logits the model returned, then
prints `fastdump ls` and `fastdump verify`.
"""

import argparse
import shutil
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import fastdump  # noqa: E402
from benchmarks.decode_bench import speculative_decode  # noqa: E402
from benchmarks.models import PRESETS, allocate_kv_caches, build_models  # noqa: E402
from fastdump.cli import main as fastdump_cli  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", nargs="?", default="dumps/demo")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--k", type=int, default=3)
    args = parser.parse_args(argv)
    root = Path(args.root)
    shutil.rmtree(root, ignore_errors=True)

    preset = PRESETS["tiny"]
    target, draft = build_models(preset.model, device="cpu", dtype=torch.float32)
    allocate_kv_caches([target, draft], batch_size=1)
    prompt = torch.randint(0, preset.model.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))

    dumpers = {role: fastdump.attach(model, root, role=role) for role, model in (("target", target), ("draft", draft))}
    with torch.inference_mode():
        run = speculative_decode(target, draft, prompt, rounds=args.rounds, k=args.k,
                                 on_pass=lambda role, **meta: dumpers[role].set_pass_meta(**meta))
    for dumper in dumpers.values():
        dumper.close()
    print(f"generated {run.generated_tokens} tokens; accepted drafts per round: {run.accepted}")

    # What was dumped is what the model computed: the target's prefill logits, bit for bit.
    dump = fastdump.open(root)
    prefill = dump.load("target", 0, 0)
    same = torch.equal(prefill["lm_head"], run.logits[0])
    print(f"target pass 0 ({dump.meta('target', 0, 0)['forward_mode']}): {len(prefill)} tensors; "
          f"lm_head equals the model's logits: {same}")

    print(f"\n$ fastdump ls {root}")
    fastdump_cli(["ls", str(root)])
    print(f"\n$ fastdump verify {root}")
    rc = fastdump_cli(["verify", str(root)])
    return 0 if same and rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
