"""Export a fastdump dump in SGLang's tensor-dump layout, so tools written for SGLang dumps read it.

    <out>/[<role>/]TP{tp}_PP{pp}_Rank{rank}_pid{pid}/Pass{NNNNN}.pt   torch.save({name: CPU tensor})

Role subdirectories appear when the dump has several roles (an EAGLE run gives ``draft/`` and
``target/``, as SGLang writes since PR #21694); a single-role dump is laid out flat like a plain SGLang
run. Names stay fastdump's: a tuple output is ``name.0``, ``name.1`` ... where SGLang saves a list.
Each rank directory also gets ``fastdump_passes.json``: the pass metadata (forward mode, batch size...).
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["export_sglang", "add_arguments", "cmd_export"]


def export_sglang(root, out, *, role_subdirs: bool | None = None) -> int:
    """Write every pass of every role/rank of the dump at ``root`` under ``out``; returns the file count.

    ``role_subdirs`` None: only when the dump has more than one role."""
    import torch

    import fastdump

    ds = fastdump.open(root)
    roles = list(ds.roles)
    split = len(roles) > 1 if role_subdirs is None else role_subdirs
    if len(roles) > 1 and not split:  # roles of one process share rank directory names
        raise ValueError(f"{root} has roles {roles}: they need role subdirectories")
    written = 0
    for role in roles:
        for rank in ds.ranks(role):
            dest = Path(out, role, rank) if split else Path(out, rank)
            dest.mkdir(parents=True, exist_ok=True)
            metas = {}
            for pass_id in ds.passes(role, rank):
                # clone: a loaded tensor may view a larger block, and torch.save writes whole storages
                tensors = {name: t.clone() for name, t in ds.load(role, rank, pass_id).items()}
                torch.save(tensors, dest / f"Pass{pass_id:05d}.pt")
                metas[str(pass_id)] = ds.meta(role, rank, pass_id)
                written += 1
            (dest / "fastdump_passes.json").write_text(json.dumps(metas, indent=1, default=str))
    return written


def add_arguments(subparsers):
    p = subparsers.add_parser("export", help="convert a dump for other tools (SGLang's Pass*.pt layout)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--format", choices=["sglang"], default="sglang", help="output layout (default: sglang)")
    p.add_argument("--role-subdirs", choices=["auto", "always", "never"], default="auto",
                   help="<out>/<role>/ subdirectories: auto = only when the dump has several roles")
    p.add_argument("root", metavar="ROOT", help="fastdump dump root")
    p.add_argument("out", metavar="OUT", help="output directory")
    p.set_defaults(func=cmd_export)
    return p


def cmd_export(args) -> int:
    split = {"auto": None, "always": True, "never": False}[args.role_subdirs]
    n = export_sglang(args.root, args.out, role_subdirs=split)
    print(f"wrote {n} pass file(s) under {args.out}")
    return 0 if n else 1
