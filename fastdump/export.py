"""Export a fastdump dump in SGLang's layouts, so SGLang's own tools read it.

``--format sglang``: the tensor-dump hook's layout (``--debug-tensor-dump-output-folder``)

    <out>/[<role>/]TP{tp}_PP{pp}_Rank{rank}_pid{pid}/Pass{NNNNN}.pt   torch.save({name: CPU tensor or list})

(SGLang's directory name: fastdump's session suffix is dropped, unless several sessions of one process
are in the dump; then each keeps its whole name, so that none is merged into another.)

``--format sglang-dumper``: the layout of SGLang's ``dumper`` (``sglang.srt.debug_utils.dumper``),
which ``dump_loader.read_meta`` and SGLang's comparator read: one directory per role, one file per
tensor, all ranks together,

    <out>/[<role>/]name={name}___step={pass}___rank={rank}___dump_index={n}.pt   torch.save({"value", "meta"})

Role subdirectories appear when the dump has several roles (an EAGLE run gives ``draft/`` and
``target/``, as SGLang writes since PR #21694); a single-role dump is laid out flat like a plain SGLang
run. Names are SGLang's (see :func:`sglang_names`) when the dump was made through fastdump's SGLang
drop-in, which records the model's module names; otherwise they stay fastdump's. The dumper layout
has a file per call, as SGLang's dumper has one per ``dump()``: a module called several times in a
pass is several files of one name and step, in call order (:func:`sglang_calls`); the Pass layout
keeps the last call, as SGLang's hook does.

A dump is evidence: SGLang's tools cannot tell a partial pass from a whole one. Export refuses a dump
with a rank not closed (status running, error, incomplete), a pass marked incomplete or with
dropped tensors (or tensors accepted and then lost, in its skipped list), or a pass one TP rank
lacks while others of its group hold it (:class:`PartialDumpError`), unless ``partial=True``
(``--partial``): then each such pass is exported as written, with a warning, and
``fastdump_passes.json`` / the ``fastdump_pass`` meta record it. Tensors the capture side recorded
as skipped (e.g. quantized dtypes) are left out with a warning.
"""

from __future__ import annotations

import collections
import json
import os
import re
import sys
from pathlib import Path

from . import format as fmt
from . import fsutil
from .compare import not_dumped_at_close, unfinished_why
from .options import RANK_FIELDS
from .format import printable as _printable

__all__ = ["export_sglang", "export_sglang_dumper", "sglang_names", "PartialDumpError", "add_arguments",
           "cmd_export"]

# In a stored name: the call index a second call of a module in one pass gets (``name#1``).
_CALL_RE = fmt.CALL_SUFFIX_RE
# What the tuple/list elements of an output add to its module's name: ``.0``, ``.1.0`` ...
_ELEMENTS_RE = re.compile(r"(?:\.\d+)+")


def sglang_names(tensors: dict, modules, structure: dict | None = None) -> dict:
    """``{name: tensor}`` of one pass (storage order, every tensor of the pass) under the names
    SGLang's hook gives them.

    ``modules``: the model's module names (``sglang_names.json``); None keeps fastdump's names.
    SGLang's rules: an output tuple/list with one non-None tensor is stored under the module's name,
    with several as one list (``None`` left out), with none as ``[]``; a module called twice keeps
    its last call (the dict entry is overwritten in place). Other names
    (``model.forward_batch_info.*``, inputs, dict outputs) keep their fastdump name, less any ``#k``
    call index. ``structure``: the pass's record of output structures (``DumpSet.structure``): what
    was a dict (its digit keys read as tuple elements) and which tuples held no tensor; without it
    (a dump made before it was recorded) names alone decide."""
    if modules is None:
        return dict(tensors)
    out: dict = {}
    for (name, _call), value in sglang_calls(tensors, modules, structure):
        out[name] = value  # a later call overwrites in place: the first call's position, as SGLang's dict
    return out


def sglang_calls(tensors: dict, modules, structure: dict | None = None) -> list:
    """[((SGLang name, call index), tensor or list)] of one pass, in the order the calls returned:
    :func:`sglang_names` before a later call of a module overwrites an earlier one (each call of a
    module is an entry of its own, as each ``dump()`` of SGLang's dumper is a file of its own)."""
    if modules is None:  # fastdump's names, as stored (``name#1`` included)
        return [((name, 0), t) for name, t in tensors.items()]
    modules = set(modules)
    structure = structure or {}
    empty = _empty_outputs(structure, modules, len(tensors))  # [(position, module, call)] in position order
    out: dict = {}  # (SGLang name, call) -> tensor, or [tensor, ...] of a tuple output in element order
    for position, (name, tensor) in enumerate(tensors.items()):
        while empty and empty[0][0] <= position:
            out[empty.pop(0)[1:]] = []
        module, call, rest = _split(name, modules)
        if module is None or (rest and not (_ELEMENTS_RE.fullmatch(rest)
                                            and _in_sequences(structure.get(fmt.call_name(module, call)), rest))):
            out[_CALL_RE.sub("", name), call] = tensor  # not a module output's element: the name as is
            continue
        if not rest:
            out[module, call] = tensor
            continue
        out.setdefault((module, call), []).append(tensor)
    for _, module, call in empty:
        out[module, call] = []
    return [(key, value[0] if isinstance(value, list) and len(value) == 1 else value) for key, value in out.items()]


def _in_sequences(entry, rest: str) -> bool:
    """Whether part ``rest`` (``.1.0``) of an output lies in tuples/lists only, by the output's
    structure record ``entry`` (no record: names alone say so). A dict's digit key reads alike."""
    if not entry:
        return True
    kinds, path = entry["kinds"], ""
    for key in rest[1:].split("."):
        if not kinds.get(path, "tuple").startswith(("tuple", "list")):
            return False
        path += "." + key
    return True


def _empty_outputs(structure: dict, modules: set, stored: int) -> list:
    """[(position among the pass's ``stored`` tensors, module, call)] of the module outputs that were a
    tuple/list holding no tensor (SGLang stores ``[]`` for one), in the order they returned."""
    found = []
    for order, (call_name, entry) in enumerate(structure.items()):
        if call_name == fmt.STRUCTURE_LOST or "after" not in entry:
            continue
        module, call, rest = _split(call_name, modules)
        if module is not None and not rest and entry["kinds"].get("", "").startswith(("tuple:", "list:")):
            found.append((max(0, stored - entry["after"]), order, module, call))
    return [(position, module, call) for position, _, module, call in sorted(found)]


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


def _module_names(ds, role, rank, names):
    """(module names, top module name, aliases) the SGLang drop-in recorded for a rank; (None,
    "model", {}) without them, said on stderr when SGLang names were asked for or the file is
    unusable. aliases: {stored name: [SGLang names]} of leaves held under several names."""
    path = os.path.join(ds.rank_path(role, rank), fmt.NAMES_FILE)  # (a MultiDumpSet's root is no path)
    try:
        data = fsutil.load_json(path)  # no link followed out of the dump, no FIFO waited on
        modules, top = (data.get("modules"), data.get("top", "model")) if isinstance(data, dict) else (None, None)
        if not (isinstance(modules, list) and all(isinstance(m, str) for m in modules) and isinstance(top, str)):
            raise ValueError('not {"modules": [name, ...], "top": name}')
        aliases = data.get("aliases", {})  # (absent: written before aliases were recorded)
        if not (isinstance(aliases, dict) and all(isinstance(v, list) and all(isinstance(n, str) for n in v)
                                                  for v in aliases.values())):
            raise ValueError('"aliases" is not {name: [name, ...]}')
        return modules, top, aliases
    except FileNotFoundError:
        if names == "sglang":
            _say(f"{role}/{rank} has no module list (not dumped through the SGLang drop-in): names kept as stored")
    except (OSError, ValueError) as exc:
        _say(f"warning: {role}/{rank}/{fmt.NAMES_FILE} not read ({exc}): names kept as stored")
    return None, "model", {}


def _under_aliases(tensors: dict, aliases: dict) -> dict:
    """A shared leaf's entry (SGLang names) under every name SGLang's hook gives it, in its place:
    SGLang hooks each path to the module, so each call is stored under all of them and the last
    one stays. Each name gets its own copy (SGLang's ``.cpu()`` copies once per hook)."""
    if not aliases:
        return tensors
    out = {}
    for name, value in tensors.items():
        for i, alias in enumerate(aliases.get(name, [name])):
            out[alias] = value if i == 0 else ([t.clone() for t in value] if isinstance(value, list) else value.clone())
    return out


def _shift_late(passes, top: str):
    """SGLang saves a pass file when the top-level ``model`` returns, so ``model``'s own output and
    everything after it (``logits_processor``) land in the next pass's file. Yields (pass id, dict)
    like that; the late part of a pass whose next pass is not in the dump is left out (SGLang never
    writes the last pass's either: nothing saves it after the final forward)."""
    carry, carry_from = {}, None
    for pass_id, tensors in passes:
        names = list(tensors)
        cut = _top_output_at(names, top)
        early = {n: tensors[n] for n in names[:cut]}
        late = {n: tensors[n] for n in names[cut:]}
        merged = dict(carry) if carry_from == pass_id - 1 else {}
        merged.update(early)
        yield pass_id, merged
        carry, carry_from = late, pass_id


def _top_output_at(names: list, top: str) -> int:
    """Where ``top``'s own output starts in a pass's ``names`` (a tensor or list under ``top``, or
    on a pipeline stage before the last its PPProxyTensors); ``len(names)`` when it is not there."""
    return next((i for i, n in enumerate(names) if n == top or n.startswith(top + ".pp_proxy_tensors.")),
                len(names))


def _batch_info_last(tensors: dict, top: str) -> dict:
    """SGLang's order in a pass file: the top module's hook adds its ForwardBatch
    (``<top>.forward_batch_info.*``) when the module returns, after every layer and just before
    ``<top>``'s own output; fastdump takes it before the forward runs, so it is stored first."""
    info = f"{top}.forward_batch_info."
    batch = [n for n in tensors if n.startswith(info)]
    if not batch:
        return tensors
    rest = [n for n in tensors if not n.startswith(info)]
    cut = _top_output_at(rest, top)
    return {n: tensors[n] for n in rest[:cut] + batch + rest[cut:]}


# torch.save cannot write the sub-byte integer types ("dtype torch.uint1 is not recognized"), nor
# clone them: their elements are stored one a byte, so the 8-bit integer of the same signedness
# holds each one's bits unchanged.
_SAVED_AS = {f"{kind}{bits}": ("uint8" if kind == "uint" else "int8") for kind in ("uint", "int") for bits in range(1, 8)}


def _savable(t, role, rank, said: set):
    """``t`` as torch.save writes it: a copy of its own (a loaded tensor may view a larger block,
    and torch.save writes whole storages), a sub-byte integer type as its 8-bit one (said once per
    rank and type on stderr)."""
    import torch

    from .dtypes import torch_name

    dtype = torch_name(t.dtype)
    stored = _SAVED_AS.get(dtype)
    if stored is None:
        return t.clone()
    if (role, rank, dtype) not in said:
        said.add((role, rank, dtype))
        _say(f"warning: {role}/{rank}: torch.save cannot write {dtype}: its tensors are exported as {stored}, "
             "one element a byte, bit for bit")
    return t.view(getattr(torch, stored)).clone()


def _passes(ds, role, rank, pass_ids, modules, names, shift, top, hook_order=False, aliases=None,
            every_call=False):
    """(pass id, {SGLang name: tensor}) of a rank, in pass order; ``hook_order``: each pass's names
    in the order SGLang's tensor-dump hook writes them (else capture order). ``every_call``: (pass
    id, [(name, tensor), ...]) instead, each call of a module an entry of its own in capture order
    (SGLang's dumper: a file per dump() call), a shared leaf's calls under its first kept name."""
    said = set()

    def converted():
        for pass_id in pass_ids:
            tensors = {name: _savable(t, role, rank, said) for name, t in ds.load(role, rank, pass_id).items()}
            if names == "sglang" and modules is not None:
                structure = ds.structure(role, rank, pass_id)
                if fmt.STRUCTURE_LOST in structure:
                    _say(f"warning: {role}/{rank} pass {pass_id}: its outputs' structure was not recorded "
                         f"({structure[fmt.STRUCTURE_LOST]}): names alone decide (a dict with digit keys reads "
                         "as a list, a tuple of Nones is left out)")
                if every_call:
                    yield pass_id, [((aliases or {}).get(name, [name])[0], value)
                                    for (name, _), value in sglang_calls(tensors, modules, structure)]
                    continue
                tensors = _under_aliases(sglang_names(tensors, modules, structure), aliases or {})
                tensors = _batch_info_last(tensors, top) if hook_order else tensors
            yield pass_id, (list(tensors.items()) if every_call else tensors)

    return _shift_late(converted(), top) if shift else converted()


def _layout(ds, role_subdirs):
    roles = list(ds.roles)
    from .reader import DumpError, Problem, no_rank_dirs_message, wrong_root_hint

    if not roles and not getattr(ds, "roots", None) and wrong_root_hint(ds.root):
        # A role or rank directory, or a parent of dump roots: "wrote 0 pass file(s)" said nothing of
        # why, where ls, show, verify and diff name the dump root meant.
        raise DumpError(no_rank_dirs_message(ds.root))
    unlisted = [p for p in ds.problems if p.kind == Problem.UNLISTABLE]
    if unlisted:  # its ranks would be missing from the export without a word
        raise DumpError("not exported: " + "; ".join(unlisted))
    split = len(roles) > 1 if role_subdirs is None else role_subdirs
    if len(roles) > 1 and not split:  # roles of one process share rank directory names
        raise ValueError(f"{ds.root} has roles {roles}: they need role subdirectories")
    return roles, split


# ------------------------------------------------------------------------ is the dump whole?

_MAX_LISTED = 20  # problems listed in a refusal; the rest are counted


class PartialDumpError(ValueError):
    """The dump is not whole (a rank not closed, a pass incomplete or with dropped tensors) and
    ``partial`` was not given. ``problems``: one line per such rank and pass."""

    HEADER = "not exported: the dump is not whole"
    HINT = "to export it as written (each such pass recorded in fastdump_passes.json)"

    def __init__(self, problems: list):
        self.problems = list(problems)
        listed = self.problems[:_MAX_LISTED]
        if len(self.problems) > _MAX_LISTED:
            listed.append(f"... and {len(self.problems) - _MAX_LISTED} more")
        self.listed = listed
        super().__init__(f"{self.HEADER}: {'; '.join(listed)}; pass partial=True {self.HINT}")

    def lines(self) -> list:
        """The command line's message: one line per problem."""
        return [f"{self.HEADER}:", *(f"  {line}" for line in self.listed), f"pass --partial {self.HINT}"]


def _status_problem(info: dict):
    """Why a rank is not known to be whole (rank.json's status), or None."""
    if "status" not in info:
        return "rank.json has no status (missing or damaged): not known to be whole"
    status, error = info["status"], info.get("error")
    if status == "closed":
        if error:
            return f"status is 'closed' but an error was recorded ({error})"
        # Whole passes dropped (policy drop, the ring full as they began; CUDA-graph replays that
        # outran the drain) are gaps in the pass ids: no pass's metadata says so.
        dropped = info.get("dropped_passes")
        if isinstance(dropped, int) and not isinstance(dropped, bool) and dropped > 0:
            return f"{dropped} whole pass(es) were dropped (gaps in the pass ids)"
        return not_dumped_at_close(info.get("stats"))
    return f"status is {status!r} ({unfinished_why(status, error)})"  # in diff's words


def _pass_problem(meta: dict) -> str:
    """Why a pass is not whole ("" when it is), from its metadata (``DumpSet.meta``)."""
    parts = []
    if meta.get("complete") is False:
        parts.append("is marked incomplete" + (f" ({meta['incomplete']})" if meta.get("incomplete") else ""))
    if meta.get("dropped"):
        parts.append(f"lost {meta['dropped']} tensor(s) (dropped under policy drop)")
    # A tensor accepted and then lost (torn by a failed CUDA drain, or the writer could not store it)
    # is in the pass's skipped list, but it is a loss (verify fails it), not a value fastdump cannot
    # store: exported with a skip's warning, the pass looked whole to SGLang's tools.
    lost = _lost_entries(meta)
    if lost:
        reasons = list(dict.fromkeys(str(entry.get("reason")) for entry in lost))
        names = list(dict.fromkeys(str(entry.get("name", "?")) for entry in lost))
        parts.append(f"lost {len(lost)} tensor(s) after they were accepted ({'; '.join(reasons[:3])}"
                     f"{'; ...' if len(reasons) > 3 else ''}): {', '.join(names[:3])}"
                     + (", ..." if len(names) > 3 else ""))
    return " and ".join(parts)


def _lost_entries(meta: dict) -> list:
    """The entries of a pass's skipped list that record a loss (``format.is_loss``)."""
    return [entry for entry in meta.get("skipped") or []
            if isinstance(entry, dict) and fmt.is_loss(str(entry.get("reason", "")))]


def _skip_note(metas: list):
    """What the capture side recorded as not dumped in a rank's passes (quantized dtypes, objects it
    cannot read), or None. Known and named, so exported (with this note), not refused."""
    lost = [_lost_entries(meta) for meta in metas]  # (a pass problem: _pass_problem)
    skipped = [entry for meta, gone in zip(metas, lost) for entry in meta.get("skipped") or [] if entry not in gone]
    if not skipped:
        return None
    passes = sum(1 for meta, gone in zip(metas, lost) if len(meta.get("skipped") or []) > len(gone))
    reasons = list(dict.fromkeys(str(entry.get("reason", "no reason given")) for entry in skipped))
    names = list(dict.fromkeys(str(entry.get("name", "?")) for entry in skipped))
    return (f"{len(skipped)} tensor(s) in {passes} pass(es) were not dumped ({'; '.join(reasons[:3])}"
            f"{'; ...' if len(reasons) > 3 else ''}): {', '.join(names[:3])}{', ...' if len(names) > 3 else ''} "
            "left out of the export")


def _unwrapped_note(info: dict):
    """The modules the capture side left unwrapped (rank.json ``config.not_wrapped``: a name holding
    ``#<digits>``, TorchScript...), which SGLang's hook dumps and the export cannot; or None."""
    config = info.get("config")
    unwrapped = config.get("not_wrapped") if isinstance(config, dict) else None
    if not isinstance(unwrapped, dict) or not unwrapped:
        return None
    names = [str(name) for name in unwrapped]
    reasons = list(dict.fromkeys(str(reason) for reason in unwrapped.values()))
    return (f"{len(names)} module(s) were not wrapped, so not dumped, and are missing from the export "
            f"({'; '.join(reasons[:3])}{'; ...' if len(reasons) > 3 else ''}): "
            f"{', '.join(names[:3])}{', ...' if len(names) > 3 else ''}")


def _survey(ds, roles, partial: bool) -> dict:
    """{(role, rank): {pass id: metadata}} of every rank, once the dump is known to be whole: a
    PartialDumpError otherwise, unless ``partial`` (then a warning per rank and pass not whole).
    Recorded skips are a warning either way."""
    from .reader import Problem

    # A role or session the root records as attached whose directory is gone (verify fails it): the
    # rest was exported without a word, an EAGLE dump without its draft laid out as a plain run.
    metas, notes = {}, []
    problems = [str(p) for p in ds.problems if p.kind in (Problem.LOST_ROLE, Problem.LOST_SESSION)]
    for role in roles:
        for rank in ds.ranks(role):
            where = f"{role}/{rank}"
            info = ds.rank_info(role, rank)
            try:  # (numbers that are no rank numbers: refused as such below, by _parallel_info)
                mislabelled = fmt.rank_dir_mismatch(rank, fmt.check_rank_numbers(info.get("rank", {})))
            except ValueError:
                mislabelled = None
            if mislabelled:  # exported under its name, it would be another rank's files: no --partial for it
                from .reader import DumpError
                raise DumpError(f"{where}: {mislabelled}")
            status = _status_problem(info)
            if status:
                problems.append(f"{where}: {status}")
            unwrapped = _unwrapped_note(info)
            if unwrapped:
                notes.append(f"{where}: {unwrapped}")
            metas[role, rank] = {p: ds.meta(role, rank, p) for p in _passes_of(ds, role, rank)}
            for pass_id, meta in metas[role, rank].items():
                why = _pass_problem(meta)
                if why:
                    problems.append(f"{where}: pass {pass_id} {why}")
            note = _skip_note(list(metas[role, rank].values()))
            if note:
                notes.append(f"{where}: {note}")
    problems += _passes_missing_in_tp_groups(ds, roles, metas)
    if problems and not partial:
        raise PartialDumpError(problems)
    for line in problems:
        _say(f"warning: {line}; exported as written (--partial)")
    for line in notes:
        _say(f"warning: {line}")
    return metas


def _passes_missing_in_tp_groups(ds, roles, metas) -> list:
    """One line per rank lacking passes that other ranks of its TP group (one role, DP replica and
    PP stage) hold. TP ranks run every forward together: a pass one of them lacks was lost (a
    segment gone before it was listed, say), even where its rank.json records no drop, and SGLang's
    comparator would read that pass as whole from the ranks that have it. A group in which a TP
    rank appears twice (several runs or sessions in one dump) is left alone: which ranks ran
    together cannot be told."""
    groups: dict = {}  # (role, dp_rank, pp_rank, tp_size) -> {tp_rank: rank directory}
    for role in roles:
        for rank in ds.ranks(role):
            try:
                numbers = fmt.check_rank_numbers(ds.rank_info(role, rank).get("rank"))
            except ValueError:
                continue  # (the dumper layout refuses it, naming the field; the Pass layout does not need it)
            key = (role, numbers.get("dp_rank", 0), numbers.get("pp_rank", 0), numbers.get("tp_size", 1))
            groups.setdefault(key, []).append((numbers.get("tp_rank", 0), rank))
    lines = []
    for (role, dp_rank, pp_rank, _), members in groups.items():
        if len(members) < 2 or len({tp for tp, _ in members}) < len(members):
            continue
        held = set().union(*(metas[role, rank] for _, rank in members))
        for _, rank in sorted(members):
            lacking = sorted(held - set(metas[role, rank]))
            if lacking:
                shown = ", ".join(map(str, lacking[:8])) + (f" ... ({len(lacking)} in all)" if len(lacking) > 8 else "")
                lines.append(f"{role}/{rank}: pass(es) {shown} missing, which other TP ranks of its group "
                             f"(dp rank {dp_rank}, pp rank {pp_rank}) hold: lost, whatever rank.json says")
    return lines


# ------------------------------------------------------------------------ the two layouts

def _sglang_dir_names(ds, role) -> dict:
    """{rank directory: its name in the export}: SGLang's ``TP{tp}_PP{pp}_Rank{rank}_pid{pid}``,
    fastdump's session suffix dropped. Sessions of one process (attach/close twice, a restarted server
    reusing the pid) would share that name: each of them keeps its whole name, none merged."""
    wanted = {}
    for rank in ds.ranks(role):
        parsed = fmt.parse_rank_dir(rank)
        wanted[rank] = (fmt.rank_dir_name({"tp_rank": parsed[0], "pp_rank": parsed[1], "rank": parsed[2]}, parsed[3])
                        if parsed else rank)
    sharing = collections.defaultdict(list)
    for rank, name in wanted.items():
        sharing[name].append(rank)
    for name, ranks in sharing.items():
        if len(ranks) > 1:
            _say(f"{role}/{name} has {len(ranks)} sessions in this dump: each is exported under its whole "
                 f"directory name ({', '.join(ranks)})")
            wanted.update({rank: rank for rank in ranks})
    return wanted


def export_sglang(root, out, *, role_subdirs: bool | None = None, names: str = "sglang",
                  pass_shift: bool = False, partial: bool = False) -> int:
    """Write every pass of every role/rank of the dump at ``root`` as SGLang's ``PassNNNNN.pt`` files
    under ``out``; returns the file count.

    ``role_subdirs`` None: only when the dump has more than one role. ``names``: "sglang" or
    "fastdump" (as stored). ``pass_shift``: move ``model``/``logits_processor`` outputs to the next
    pass file, as SGLang's hook does. ``partial``: export a dump that is not whole (see
    :class:`PartialDumpError`, raised otherwise) as written."""
    import torch

    from .multiroot import open as open_dump

    ds = open_dump(root)
    roles, split = _layout(ds, role_subdirs)
    metas = _survey(ds, roles, partial)
    _fresh_out(out)
    written = 0
    for role in roles:
        out_names = _sglang_dir_names(ds, role)
        for rank in ds.ranks(role):
            dest = Path(out, role, out_names[rank]) if split else Path(out, out_names[rank])
            dest.mkdir(parents=True, exist_ok=True)
            modules, top, aliases = _module_names(ds, role, rank, names)
            pass_metas = metas[role, rank]
            for pass_id, tensors in _passes(ds, role, rank, list(pass_metas), modules, names, pass_shift, top,
                                            hook_order=True, aliases=aliases):
                if tensors:
                    torch.save(tensors, dest / f"Pass{pass_id:05d}.pt")
                    written += 1
            (dest / "fastdump_passes.json").write_text(
                json.dumps({str(p): meta for p, meta in pass_metas.items()}, indent=1, default=str))
    return written


# Characters a name cannot hold in the dumper layout: read_meta splits the file stem on "___" and "=".
_BAD_IN_FILENAME = ("___", "=", "/", "\0")
_MAX_FILENAME_BYTES = 255  # (NAME_MAX of Linux file systems)


def _fresh_out(out) -> None:
    """Make OUT, which must be new or an empty directory: refused (ValueError) before anything is
    written otherwise. File names carry no session, so another export's files left there would
    read as this run's (SGLang's tools glob them all), and a link inside OUT would be followed
    out of it. An empty OUT ("", an unset $OUT) would write into the current directory."""
    if not str(out):
        raise ValueError("OUT is empty (an unset variable?): give the directory to write into")
    path = Path(out)
    if path.exists() or path.is_symlink():
        if not path.is_dir():
            raise ValueError(f"{out}: exists and is not a directory")
        if any(path.iterdir()):
            raise ValueError(f"{out}: not empty; export into a new or empty directory (files of another export "
                             "there would be read as this one's)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # ("[Errno 2] No such file or directory: '/proc/x'" before: say it is OUT)
        raise OSError(f"OUT {out}: cannot be made ({exc.strerror or exc})") from None


def _check_dumper_names(ds, role, rank, world_rank: int, passes, aliases=()) -> None:
    """Every name of a rank (and every SGLang name recorded for a shared leaf) fits the dumper
    layout's file names, checked before anything is written (a refusal halfway left an export that
    looked whole)."""
    longest = len(f"name=___step={max(passes, default=0)}___rank={world_rank}___dump_index={10 ** 12}.pt")
    for name in [*ds.names(role, rank), *aliases]:
        bad = [c for c in _BAD_IN_FILENAME if c in name]
        if bad:
            raise ValueError(f"{role}/{rank}: tensor name {name!r} contains {bad[0]!r}, which SGLang's dumper file "
                             "names cannot hold")
        if len(name.encode("utf-8", "surrogatepass")) + longest + 8 > _MAX_FILENAME_BYTES:  # (+8: ".<i>" parts)
            raise ValueError(f"{role}/{rank}: tensor name {name[:40]!r}... is too long for a file name "
                             f"({_MAX_FILENAME_BYTES} bytes)")


def _parallel_info(where: str, info: dict):
    """(world rank, world size, sglang_parallel_info) from rank.json's ``rank`` object, checked
    (format.check_rank_numbers); a ValueError naming the field when it is not what fastdump writes."""
    if "rank" not in info:
        raise ValueError(f'{where}: rank.json has no "rank" object (rank numbers)')
    try:
        numbers = fmt.check_rank_numbers(info["rank"])
    except ValueError as exc:
        raise ValueError(f"{where}: rank.json {exc}") from None
    if "rank" not in numbers:
        raise ValueError(f"{where}: rank.json has no rank number (rank.rank)")
    world_size = numbers.get("tp_size", 1) * numbers.get("pp_size", 1)
    return numbers["rank"], world_size, {key: numbers[key] for key in RANK_FIELDS if key in numbers}


def _dumper_ranks(ds, role) -> dict:
    """{rank directory: (world rank, world size, parallel info)} of a role, checked before anything
    is written: file names carry only the world rank, so two directories of one rank would collide."""
    found, seen = {}, {}
    for rank in ds.ranks(role):
        found[rank] = _parallel_info(f"{role}/{rank}", ds.rank_info(role, rank))
        world_rank = found[rank][0]
        if world_rank in seen:
            raise ValueError(f"{role}: ranks {seen[world_rank]} and {rank} are both rank {world_rank} "
                             f"(several runs in one dump?); export them separately")
        seen[world_rank] = rank
    return found


def export_sglang_dumper(root, out, *, role_subdirs: bool | None = None, names: str = "sglang",
                         partial: bool = False) -> int:
    """Write the dump at ``root`` in SGLang's dumper layout under ``out``; returns the file count.

    One file per tensor: ``name=…___step=<pass id>___rank=<world rank>___dump_index=<n>.pt`` holding
    ``{"value": tensor, "meta": {...}}`` with SGLang's meta fields (name, step, rank, dump_index,
    world_rank, world_size, sglang_parallel_info) plus ``fastdump_pass`` (the pass metadata).
    ``dump_index`` counts a rank's tensors from 1 in dump order, as SGLang's dumper does. A list output
    (several tensors) becomes ``name.0``, ``name.1`` ... (SGLang's dumper splits tuples the same way).
    Every call of a module is written, in call order (its files share name and step; SGLang's
    ``read_meta`` numbers them by ``duplicate_index``); a leaf held under several names (a shared
    ``rotary_emb``) under its first kept name. ``partial``: as for :func:`export_sglang`."""
    import torch

    from .multiroot import open as open_dump

    ds = open_dump(root)
    roles, split = _layout(ds, role_subdirs)
    metas = _survey(ds, roles, partial)
    plans = {role: _dumper_ranks(ds, role) for role in roles}
    recorded = {(role, rank): _module_names(ds, role, rank, names) for role in roles for rank in plans[role]}
    for role in roles:
        for rank, (world_rank, _, _) in plans[role].items():
            aliases = recorded[role, rank][2] if names == "sglang" else {}
            _check_dumper_names(ds, role, rank, world_rank, list(metas[role, rank]),
                                [alias for listed in aliases.values() for alias in listed])
    _fresh_out(out)
    written = 0
    for role in roles:
        dest = Path(out, role) if split else Path(out)
        dest.mkdir(parents=True, exist_ok=True)
        for rank, (world_rank, world_size, parallel) in plans[role].items():
            modules, top, aliases = recorded[role, rank]
            dump_index = 0
            pass_metas = metas[role, rank]
            for pass_id, calls in _passes(ds, role, rank, list(pass_metas), modules, names, False, top,
                                          aliases=aliases, every_call=True):
                for name, value in _one_tensor_each(calls):
                    bad = [c for c in _BAD_IN_FILENAME if c in name]
                    if bad:  # (_check_dumper_names saw every stored name: a mapped one, to be sure)
                        raise ValueError(f"{role}/{rank} pass {pass_id}: tensor name {name!r} contains {bad[0]!r}, "
                                         f"which SGLang's dumper file names cannot hold")
                    dump_index += 1
                    fields = {"name": name, "step": pass_id, "rank": world_rank, "dump_index": dump_index}
                    meta = {**fields, "world_rank": world_rank, "world_size": world_size,
                            "sglang_parallel_info": parallel, "fastdump_pass": pass_metas[pass_id]}
                    filename = "___".join(f"{k}={v}" for k, v in fields.items()) + ".pt"
                    torch.save({"value": value, "meta": meta}, dest / filename)
                    written += 1
    return written


def _one_tensor_each(calls):
    """(name, tensor) of each [(name, tensor or list)]: a list's tensors as ``name.0``, ``name.1`` ..."""
    for name, value in calls:
        if isinstance(value, list):
            for i, t in enumerate(value):
                yield f"{name}.{i}", t
        else:
            yield name, value


def _say(text) -> None:
    print(f"fastdump export: {_printable(text)}", file=sys.stderr)


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
                              description=__doc__.split("\n\n")[0],
                              epilog="Exit status: 0 files written; 1 nothing written (a dump with no passes); "
                                     "2 error: ROOT could not be read (no dump there, an unreadable segment or "
                                     "directory, a malformed rank.json), OUT could not be written, a dump not "
                                     "whole refused (without --partial), a layout the dump cannot be written in.")
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
    p.add_argument("--partial", action="store_true",
                   help="export a dump that is not whole (a rank not closed: running, error, incomplete; "
                        "data lost: a role or session gone, tensors lost at close or after they were accepted; "
                        "a pass marked incomplete or with dropped tensors) as written, one warning per such "
                        "rank and pass; refused otherwise (exit 2)")
    p.add_argument("root", metavar="ROOT", help="fastdump dump root")
    p.add_argument("out", metavar="OUT", help="output directory")
    p.set_defaults(func=cmd_export)
    return p


def cmd_export(args) -> int:
    from .reader import DumpError

    try:
        return _cmd_export(args)
    except PartialDumpError as exc:
        for line in exc.lines():
            _say(line)
        return 2
    except (DumpError, KeyError, OSError) as exc:  # the dump could not be read (or OUT written): say why
        # 2, as diff's read errors and every other refusal here: an unreadable segment exited 1,
        # as "nothing written" does, and a malformed rank.json 2
        _say(exc.args[0] if isinstance(exc, KeyError) and exc.args else exc)
        return 2
    except ValueError as exc:  # refused: a malformed rank.json, a layout the dump cannot be written in
        _say(exc)
        return 2


def _cmd_export(args) -> int:
    split = {"auto": None, "always": True, "never": False}[args.role_subdirs]
    if args.format == "sglang-dumper":
        if args.sglang_pass_shift:
            _say("--sglang-pass-shift applies to --format sglang only")
            return 2
        n = export_sglang_dumper(args.root, args.out, role_subdirs=split, names=args.names, partial=args.partial)
        print(f"wrote {n} tensor file(s) under {_printable(args.out)}")  # (OUT's escape sequences: not obeyed)
    else:
        n = export_sglang(args.root, args.out, role_subdirs=split, names=args.names,
                          pass_shift=args.sglang_pass_shift, partial=args.partial)
        print(f"wrote {n} pass file(s) under {_printable(args.out)}")
    return 0 if n else 1
