"""Export a fastdump dump in SGLang's layouts, so SGLang's own tools read it.

``--format sglang``: the tensor-dump hook's layout (``--debug-tensor-dump-output-folder``)

    <out>/[<role>/]TP{tp}_PP{pp}_Rank{rank}_pid{pid}/Pass{NNNNN}.pt   torch.save({name: CPU tensor or list})

``--format sglang-dumper``: the layout of SGLang's ``dumper`` (``sglang.srt.debug_utils.dumper``),
which ``dump_loader.read_meta`` and SGLang's comparator read: one directory per role, one file per
tensor, all ranks together,

    <out>/[<role>/]name={name}___step={pass}___rank={rank}___dump_index={n}.pt   torch.save({"value", "meta"})

Role subdirectories appear when the dump has several roles (an EAGLE run gives ``draft/`` and
``target/``, as SGLang writes since PR #21694); a single-role dump is laid out flat like a plain SGLang
run. Names are SGLang's (see :func:`sglang_names`) when the dump was made through fastdump's SGLang
drop-in, which records the model's module names; otherwise they stay fastdump's.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from .report import printable as _printable

__all__ = ["export_sglang", "export_sglang_dumper", "sglang_names", "add_arguments", "cmd_export"]

# In a stored name: the call index a second call of a module in one pass gets (``name#1``).
_CALL_RE = re.compile(r"#(\d+)(?=\.|$)")
# What the tuple/list elements of an output add to its module's name: ``.0``, ``.1.0`` ...
_ELEMENTS_RE = re.compile(r"(?:\.\d+)+")


def sglang_names(tensors: dict, modules) -> dict:
    """``{name: tensor}`` of one pass (storage order) under the names SGLang's hook gives them.

    ``modules``: the model's module names (``sglang_names.json``); None keeps fastdump's names.
    SGLang's rules: an output tuple/list with one non-None tensor is stored under the module's name,
    with several as one list (``None`` left out); a module called twice keeps its last call (the
    dict entry is overwritten in place). Other names (``model.forward_batch_info.*``, inputs, dict
    outputs) keep their fastdump name, less any ``#k`` call index."""
    if modules is None:
        return dict(tensors)
    modules = set(modules)
    grouped: dict = {}  # (key, call) -> [tensor, ...] of a tuple output, in element order
    out: dict = {}
    for name, tensor in tensors.items():
        module, call, rest = _split(name, modules)
        if module is None or (rest and not _ELEMENTS_RE.fullmatch(rest)):
            out[_CALL_RE.sub("", name)] = tensor  # not a module output's element: the name, last call wins
            continue
        if not rest:
            out[module] = tensor
            continue
        elements = grouped.setdefault((module, call), [])
        if not elements:
            out[module] = elements  # keeps the position of its first element; a later call overwrites
        elements.append(tensor)
    return {key: (value[0] if isinstance(value, list) and len(value) == 1 else value) for key, value in out.items()}


def _split(name: str, modules: set):
    """(module, call index, rest) with ``name == module + [#call] + rest``; module None when no
    module name prefixes it."""
    plain = _CALL_RE.sub("", name)
    call_match = _CALL_RE.search(name)
    call = int(call_match.group(1)) if call_match else 0
    candidate = plain
    while candidate:
        if candidate in modules:
            return candidate, call, plain[len(candidate):]
        candidate = candidate.rpartition(".")[0]
    return None, call, plain


def _module_names(ds, role, rank):
    """The module names the SGLang drop-in recorded for a rank, or None."""
    from .format import NAMES_FILE

    try:
        data = json.loads(Path(ds.root, role, rank, NAMES_FILE).read_text())
        return data["modules"], data.get("top", "model")
    except (OSError, ValueError, KeyError, TypeError):
        return None, "model"


def _shift_late(passes, top: str):
    """SGLang saves a pass file when the top-level ``model`` returns, so ``model``'s own output and
    everything after it (``logits_processor``) land in the next pass's file. Yields (pass id, dict)
    like that; the late part of a pass whose next pass is not in the dump is left out (SGLang never
    writes the last pass's either: nothing saves it after the final forward)."""
    carry, carry_from = {}, None
    for pass_id, tensors in passes:
        names = list(tensors)
        # model's output: a tensor, or on a pipeline stage before the last its PPProxyTensors
        cut = next((i for i, n in enumerate(names) if n == top or n.startswith(top + ".pp_proxy_tensors.")),
                   len(names))
        early = {n: tensors[n] for n in names[:cut]}
        late = {n: tensors[n] for n in names[cut:]}
        merged = dict(carry) if carry_from == pass_id - 1 else {}
        merged.update(early)
        yield pass_id, merged
        carry, carry_from = late, pass_id


def _passes(ds, role, rank, modules, names, shift, top):
    """(pass id, {SGLang name: tensor}) of a rank, in pass order."""
    def converted():
        for pass_id in _passes_of(ds, role, rank):
            # clone: a loaded tensor may view a larger block, and torch.save writes whole storages
            tensors = {name: t.clone() for name, t in ds.load(role, rank, pass_id).items()}
            yield pass_id, (sglang_names(tensors, modules) if names == "sglang" else tensors)

    return _shift_late(converted(), top) if shift else converted()


def _layout(ds, role_subdirs):
    roles = list(ds.roles)
    from .reader import DumpError, Problem

    unlisted = [p for p in ds.problems if p.kind == Problem.UNLISTABLE]
    if unlisted:  # its ranks would be missing from the export without a word
        raise DumpError("not exported: " + "; ".join(unlisted))
    split = len(roles) > 1 if role_subdirs is None else role_subdirs
    if len(roles) > 1 and not split:  # roles of one process share rank directory names
        raise ValueError(f"{ds.root} has roles {roles}: they need role subdirectories")
    return roles, split


def export_sglang(root, out, *, role_subdirs: bool | None = None, names: str = "sglang",
                  pass_shift: bool = False) -> int:
    """Write every pass of every role/rank of the dump at ``root`` as SGLang's ``PassNNNNN.pt`` files
    under ``out``; returns the file count.

    ``role_subdirs`` None: only when the dump has more than one role. ``names``: "sglang" or
    "fastdump" (as stored). ``pass_shift``: move ``model``/``logits_processor`` outputs to the next
    pass file, as SGLang's hook does."""
    import torch

    from .multiroot import open as open_dump

    ds = open_dump(root)
    roles, split = _layout(ds, role_subdirs)
    written = 0
    for role in roles:
        for rank in ds.ranks(role):
            dest = Path(out, role, rank) if split else Path(out, rank)
            dest.mkdir(parents=True, exist_ok=True)
            modules, top = _module_names(ds, role, rank)
            _warn_unnamed(names, modules, role, rank)
            for pass_id, tensors in _passes(ds, role, rank, modules, names, pass_shift, top):
                if tensors:
                    torch.save(tensors, dest / f"Pass{pass_id:05d}.pt")
                    written += 1
            metas = {str(p): ds.meta(role, rank, p) for p in ds.passes(role, rank)}
            (dest / "fastdump_passes.json").write_text(json.dumps(metas, indent=1, default=str))
    return written


# Characters a name cannot hold in the dumper layout: read_meta splits the file stem on "___" and "=".
_BAD_IN_FILENAME = ("___", "=", "/", "\0")


def export_sglang_dumper(root, out, *, role_subdirs: bool | None = None, names: str = "sglang") -> int:
    """Write the dump at ``root`` in SGLang's dumper layout under ``out``; returns the file count.

    One file per tensor: ``name=…___step=<pass id>___rank=<world rank>___dump_index=<n>.pt`` holding
    ``{"value": tensor, "meta": {...}}`` with SGLang's meta fields (name, step, rank, dump_index,
    world_rank, world_size, sglang_parallel_info) plus ``fastdump_pass`` (the pass metadata).
    ``dump_index`` counts a rank's tensors from 1 in dump order, as SGLang's dumper does. A list output
    (several tensors) becomes ``name.0``, ``name.1`` ... (SGLang's dumper splits tuples the same way)."""
    import torch

    from .multiroot import open as open_dump

    ds = open_dump(root)
    roles, split = _layout(ds, role_subdirs)
    written = 0
    for role in roles:
        dest = Path(out, role) if split else Path(out)
        dest.mkdir(parents=True, exist_ok=True)
        seen_ranks: dict = {}
        for rank in ds.ranks(role):
            info = ds.rank_info(role, rank)
            ranks = info.get("rank") or {}
            world_rank = ranks.get("rank")
            if not isinstance(world_rank, int):
                raise ValueError(f"{role}/{rank}: rank.json has no rank number")
            if world_rank in seen_ranks:  # file names carry only the rank: they would collide
                raise ValueError(f"{role}: ranks {seen_ranks[world_rank]} and {rank} are both rank {world_rank} "
                                 f"(several runs in one dump?); export them separately")
            seen_ranks[world_rank] = rank
            world_size = int(ranks.get("tp_size", 1)) * int(ranks.get("pp_size", 1))
            parallel = {k: ranks[k] for k in ("tp_rank", "tp_size", "pp_rank", "pp_size", "dp_rank", "dp_size",
                                              "ep_rank", "ep_size") if k in ranks}
            modules, top = _module_names(ds, role, rank)
            _warn_unnamed(names, modules, role, rank)
            dump_index = 0
            for pass_id, tensors in _passes(ds, role, rank, modules, names, False, top):
                pass_meta = ds.meta(role, rank, pass_id)
                for name, value in _one_tensor_each(tensors):
                    bad = [c for c in _BAD_IN_FILENAME if c in name]
                    if bad:
                        raise ValueError(f"{role}/{rank} pass {pass_id}: tensor name {name!r} contains {bad[0]!r}, "
                                         f"which SGLang's dumper file names cannot hold")
                    dump_index += 1
                    fields = {"name": name, "step": pass_id, "rank": world_rank, "dump_index": dump_index}
                    meta = {**fields, "world_rank": world_rank, "world_size": world_size,
                            "sglang_parallel_info": parallel, "fastdump_pass": pass_meta}
                    filename = "___".join(f"{k}={v}" for k, v in fields.items()) + ".pt"
                    torch.save({"value": value, "meta": meta}, dest / filename)
                    written += 1
    return written


def _one_tensor_each(tensors: dict):
    for name, value in tensors.items():
        if isinstance(value, list):
            for i, t in enumerate(value):
                yield f"{name}.{i}", t
        else:
            yield name, value


def _warn_unnamed(names, modules, role, rank):
    if names == "sglang" and modules is None:
        print(f"fastdump export: {_printable(role)}/{_printable(rank)} has no module list (not dumped through the "
              f"SGLang drop-in): names kept as stored", file=sys.stderr)


def _passes_of(ds, role, rank) -> list:
    """The rank's pass ids; a DumpError when a segment could not be read (its passes would be
    missing from the export without a word)."""
    from .reader import DumpError, Problem

    passes = ds.passes(role, rank)
    if ds.summary(role, rank)["unreadable_segments"]:
        unreadable = [p for p in ds.problems if p.kind == Problem.UNREADABLE_SEGMENT]
        raise DumpError(f"{role}/{rank}: unreadable segment(s), not exported: " + "; ".join(unreadable))
    return passes


def add_arguments(subparsers):
    p = subparsers.add_parser("export", help="convert a dump for SGLang's tools (Pass*.pt or dumper layout)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--format", choices=["sglang", "sglang-dumper"], default="sglang",
                   help="sglang: Pass*.pt per rank (tensor-dump hook); sglang-dumper: one file per tensor "
                        "(SGLang's dumper, read by its comparator)")
    p.add_argument("--role-subdirs", choices=["auto", "always", "never"], default="auto",
                   help="<out>/<role>/ subdirectories: auto = only when the dump has several roles")
    p.add_argument("--names", choices=["sglang", "fastdump"], default="sglang",
                   help="sglang: SGLang's tensor names (default); fastdump: as stored (name.0, name#1)")
    p.add_argument("--sglang-pass-shift", action="store_true",
                   help="--format sglang: put model/logits_processor outputs in the next pass file, as "
                        "SGLang's hook does (byte-level comparison with SGLang's own dumps)")
    p.add_argument("root", metavar="ROOT", help="fastdump dump root")
    p.add_argument("out", metavar="OUT", help="output directory")
    p.set_defaults(func=cmd_export)
    return p


def cmd_export(args) -> int:
    try:
        return _cmd_export(args)
    except (KeyError, ValueError, OSError) as exc:  # DumpError is a ValueError: no traceback, say why
        print(f"fastdump export: {_printable(exc.args[0] if isinstance(exc, KeyError) and exc.args else exc)}",
              file=sys.stderr)
        return 1


def _cmd_export(args) -> int:
    split = {"auto": None, "always": True, "never": False}[args.role_subdirs]
    if args.format == "sglang-dumper":
        if args.sglang_pass_shift:
            print("fastdump export: --sglang-pass-shift applies to --format sglang only", file=sys.stderr)
            return 2
        n = export_sglang_dumper(args.root, args.out, role_subdirs=split, names=args.names)
        print(f"wrote {n} tensor file(s) under {args.out}")
    else:
        n = export_sglang(args.root, args.out, role_subdirs=split, names=args.names,
                          pass_shift=args.sglang_pass_shift)
        print(f"wrote {n} pass file(s) under {args.out}")
    return 0 if n else 1
