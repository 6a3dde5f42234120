"""Compare two dumps: ``fastdump.diff(baseline, target, ...) -> DiffResult`` and ``fastdump diff``.

How the two sides line up:
  * roles by name; ranks by rank NUMBERS (tp/pp/dp rank from rank.json, else from the directory
    name), never by directory name (those carry a pid and differ between any two runs);
  * when both sides have the same TP and PP sizes, rank (dp, pp, tp) pairs with rank (dp, pp, tp);
    otherwise each side's ranks are merged into whole tensors (TP unshard, PP stages in order);
  * passes by pass id, shifted by an offset, or (``align``) the n-th pass with the n-th pass,
    optionally only passes whose metadata field has a given value (``meta:forward_mode=decode``);
  * tensors by name; within a pass they are visited in the target's dump order (execution order),
    which is what "first divergence" means: the earliest pass first, then the earliest PP stage,
    then the first tensor dumped (TP and DP ranks run a tensor at once: then the lowest rank).
  * a rank number with several sessions on one side, or a malformed rank.json, is refused (exit 2);
    a rank on one side only, or a pass one TP rank lacks, is a difference (exit 1).

(This module is ``compare``, not ``diff``, so that it never shadows the function ``fastdump.diff``.)

Tensors are read one name at a time (all shards of that name; a small pass is read whole, one
pass pair at a time, never a whole dump) and compared in float64 chunks by ``fastdump.stats.compare``.
The rows are made in execution order and kept by ``fastdump.rowlog.RowLog`` (past 20,000, in a
temporary file), so a diff's memory does not grow with the number of tensors compared.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import json
import math
import os
import re
import sys
import time
import warnings

from . import format as fmt
from .options import BadRange, parse_ranges
from .format import printable
from .report import PassRuns, _missing_text, _span, _where, layer_of  # noqa: F401 - layer_of is public here too
from .report import cosine_text, not_a_report_file, percent
from .rowlog import RowLog

DEFAULT_ATOL = 1e-5
DEFAULT_RTOL = 1e-5
# Default thresholds of the metrics that are not elementwise.
DEFAULT_METRIC_THRESHOLD = {"rel_diff": 1e-3, "cosine": 1e-3}
METRICS = ("allclose", "rel_diff", "cosine")
LAYOUT_META_KEY = "tp_layout"  # pass metadata {name: dim | "replicated" | "sum"}, if the capture side records it


def unfinished_why(status: str, error) -> str:
    """Why a rank with ``status`` (not "closed") and rank.json's ``error`` may lack data: diff refuses
    or notes it, export refuses it, verify fails it (``fmt.UNFINISHED_STATUS_WHY``: the same words)."""
    return f"writing failed: {error}" if status == "error" else \
        fmt.UNFINISHED_STATUS_WHY.get(status, "not a finished dump")


def _is_positive(count) -> bool:
    return isinstance(count, int) and not isinstance(count, bool) and count > 0


def not_dumped_at_close(stats) -> str | None:
    """What the Dumper counted at close as never dumped (rank.json ``stats``; verify fails each), which
    no pass's metadata shows, or None: export refuses the rank, diff notes it (``_not_dumped_text``)."""
    stats = stats if isinstance(stats, dict) else {}
    lost, compiled = stats.get("lost_at_close"), stats.get("compiled_not_dumped")
    edits = stats.get("modules_not_followed")
    parts = []
    if _is_positive(lost):
        parts.append(f"{lost} staged tensor(s) were lost at close (a CUDA-graph capture still running held "
                     f"their batch)")
    if _is_positive(compiled):
        parts.append(f"{compiled} dumped module(s) were compiled into graphs that may not break (torch.compile "
                     f"fullgraph=True): their outputs are in no pass")
    if isinstance(edits, list) and edits:
        shown = "; ".join(map(str, edits[:3])) + ("; ..." if len(edits) > 3 else "")
        parts.append(f"{len(edits)} module edit(s) after attach could not be followed (their outputs are "
                     f"missing, or under a name that no longer leads to them): {shown}")
    return " and ".join(parts) or None


class DiffError(Exception):
    """The dumps cannot be compared at all (usage or read error): ``fastdump diff`` exits 2."""


# --------------------------------------------------------------------------------------- options


def parse_tol(text: str):
    """'REGEX=ATOL,RTOL' -> (compiled regex, atol, rtol)."""
    pattern, sep, values = text.rpartition("=")
    parts = values.split(",")
    if not sep or not pattern or len(parts) != 2:
        raise ValueError(f"--tol {text!r}: expected REGEX=ATOL,RTOL")
    try:
        atol, rtol = float(parts[0]), float(parts[1])
    except ValueError:
        raise ValueError(f"--tol {text!r}: ATOL and RTOL must be numbers") from None
    if not (atol >= 0 and rtol >= 0):
        raise ValueError(f"--tol {text!r}: tolerances must be >= 0")
    return _regex(pattern, "--tol"), atol, rtol


def parse_unshard(text: str):
    """'REGEX=DIM|replicated|sum' -> (compiled regex, int dim or 'replicated' or 'sum')."""
    pattern, sep, rule = text.rpartition("=")
    if not sep or not pattern:
        raise ValueError(f"--unshard {text!r}: expected REGEX=DIM|replicated|sum")
    return _regex(pattern, "--unshard"), _layout_rule(rule, f"--unshard {text!r}")


_MAX_DIMS = 64  # torch's limit on a tensor's dimensions


def _layout_rule(rule, where: str):
    if isinstance(rule, bool):
        raise ValueError(f"{where}: rule must be a dimension, 'replicated' or 'sum'")
    if isinstance(rule, int) or (isinstance(rule, str) and re.fullmatch(r"-?[0-9]+", rule)):
        dim = int(rule)
        if not -_MAX_DIMS <= dim < _MAX_DIMS:  # (torch.cat's own error: "Overflow when unpacking long long")
            raise ValueError(f"{where}: dimension {dim} is out of range (a tensor has at most {_MAX_DIMS})")
        return dim
    if rule in ("replicated", "sum"):
        return rule
    raise ValueError(f"{where}: rule must be a dimension, 'replicated' or 'sum', not {rule!r}")


def parse_metric(text: str):
    """'allclose' | 'rel_diff[=X]' | 'cosine[=X]' -> (name, threshold or None)."""
    name, sep, value = text.partition("=")
    if name not in METRICS:
        raise ValueError(f"--metric {text!r}: one of {', '.join(METRICS)}")
    if name == "allclose":
        if sep:
            raise ValueError("--metric allclose takes no threshold (use --atol/--rtol/--tol)")
        return name, None
    try:
        threshold = float(value) if sep else DEFAULT_METRIC_THRESHOLD[name]
    except ValueError:
        raise ValueError(f"--metric {text!r}: threshold must be a number") from None
    if not threshold >= 0:  # NaN would pass everything ('x > nan' is False), a negative nothing
        raise ValueError(f"--metric {text!r}: threshold must be >= 0")
    return name, threshold


def parse_passes(spec: str):
    """'0-3,7,10-' -> predicate on pass ids."""
    try:
        ranges = parse_ranges(spec, open_end=True)
    except BadRange as exc:
        if exc.reversed:  # selects nothing: "no passes in common" would blame the dumps
            raise ValueError(f"--passes {spec!r}: {exc.part!r} ends before it starts") from None
        ranges = []
    if not ranges:
        raise ValueError(f"--passes {spec!r}: expected comma-separated N, N-M or N-")
    # A set of the single ids and the ranges merged, sorted: a script that lists 20k pass ids made
    # each test walk the whole list (quadratic: minutes on a long dump).
    singles = {a for a, b in ranges if a == b}
    spans = sorted((a, math.inf if b is None else b) for a, b in ranges if a != b)
    merged: list = []
    for a, b in spans:
        if merged and a <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    starts = [a for a, _ in merged]

    def wanted(pass_id) -> bool:
        if pass_id in singles:
            return True
        k = bisect.bisect_right(starts, pass_id) - 1
        return k >= 0 and pass_id <= merged[k][1]

    return wanted


def parse_align(text):
    """None / 'id' -> pass ids; 'offset:K' -> baseline pass p with target pass p+K; 'order' -> n-th
    with n-th; 'meta:KEY=VALUE' -> n-th such pass with n-th such pass."""
    if text in (None, "", "id"):
        return None
    if text == "order":
        return ("order",)
    match = re.fullmatch(r"offset:(-?\d+)", text)
    if match:
        return ("offset", int(match.group(1)))
    match = re.fullmatch(r"meta:([^=]+)=(.*)", text)
    if not match:
        raise ValueError(f"--align {text!r}: expected id, offset:K, order or meta:KEY=VALUE")
    key, value = match.group(1), match.group(2)
    try:
        value = json.loads(value)  # 8 -> 8, true -> True; anything else stays a string
    except ValueError:
        pass
    return ("meta", key, value)


def _regex(pattern: str, where: str):
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"{where}: bad regular expression {pattern!r}: {exc}") from None


def _as_list(value):
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


class Options:
    """Everything ``diff`` accepts, checked once (ValueError on bad values)."""

    def __init__(self, role=None, rank=None, passes=None, name=None, atol=DEFAULT_ATOL, rtol=DEFAULT_RTOL,
                 tol=None, metric=None, align=None, unshard=None, allow_running=False, progress=False,
                 strict=False):
        self.roles = list(dict.fromkeys(_as_list(role)))  # a role given twice was compared twice, counted twice
        self.rank = None if rank is None else int(rank)
        self.passes_spec = passes
        self.pass_filter = parse_passes(str(passes)) if passes is not None else None
        self.name_spec = name
        self.name_filter = _regex(name, "--name").search if name else None
        self.atol, self.rtol = float(atol), float(rtol)
        if not (self.atol >= 0 and self.rtol >= 0):
            raise ValueError("atol and rtol must be >= 0")
        if isinstance(tol, dict):
            tol = [f"{k}={a},{r}" for k, (a, r) in tol.items()]
        self.tol_specs = _as_list(tol)
        self.tols = [parse_tol(text) for text in self.tol_specs]
        self.metric_specs = _as_list(metric) or ["allclose"]
        self.metrics = [parse_metric(text) for text in self.metric_specs]
        self.align_spec = align
        self.align = parse_align(align)
        if isinstance(unshard, dict):
            unshard = [f"{k}={v}" for k, v in unshard.items()]
        self.unshard_specs = _as_list(unshard)
        self.unshard = [parse_unshard(text) for text in self.unshard_specs]
        self.allow_running = bool(allow_running)
        self.progress = progress
        self.strict = bool(strict)  # a name or a pass on one side only fails the diff (exit 1)

    def tolerance(self, name: str):
        for pattern, atol, rtol in self.tols:  # the first matching rule wins
            if pattern.search(name):
                return atol, rtol
        return self.atol, self.rtol

    def explicit_layout(self, name: str):
        for pattern, rule in self.unshard:
            if pattern.search(name):
                return rule
        return None

    def criteria(self) -> str:
        """What a tensor must satisfy to pass, in words ('atol 1e-05, rtol 1e-05'; 'rel_diff <= 0.001'):
        the metrics given, not the tolerances alone. With --metric rel_diff only, a bf16 run against
        an fp32 one read "all within tolerance (atol 1e-05, rtol 1e-05)", which its tensors are not."""
        said = []
        for metric, threshold in self.metrics:
            if metric == "allclose":
                rules = f" and {len(self.tols)} --tol rule(s)" if self.tols else ""
                said.append(f"atol {self.atol:g}, rtol {self.rtol:g}{rules}")
            else:
                said.append(f"{'rel_diff' if metric == 'rel_diff' else 'cosine distance'} <= {threshold:g}")
        return "; ".join(dict.fromkeys(said))  # (a metric given twice is said once)

    def as_dict(self) -> dict:
        return {"role": self.roles or None, "rank": self.rank, "passes": self.passes_spec, "name": self.name_spec,
                "atol": self.atol, "rtol": self.rtol, "tol": self.tol_specs, "metric": self.metric_specs,
                "align": self.align_spec, "unshard": self.unshard_specs, "strict": self.strict}


# ----------------------------------------------------------------------------------------- ranks


def _rank_numbers(info: dict, path: str) -> dict:
    """rank.json's "rank" object, checked (format.check_rank_numbers; absent: {}, nothing known).
    Damage is a DiffError naming the file, never a traceback, nor a size that makes diff allocate
    until it is killed."""
    numbers = info.get("rank")
    if numbers is None:
        return {}
    try:
        return fmt.check_rank_numbers(numbers)
    except ValueError as exc:
        raise DiffError(f"{path}: {exc}") from None


class RankRef:
    """One rank directory of one side, identified by its rank numbers."""

    def __init__(self, ds, role: str, name: str, side: str):
        self.ds, self.role, self.name, self.side = ds, role, name, side
        self.path = ds.rank_path(role, name)
        info = ds.rank_info(role, name)
        rank_file = os.path.join(self.path, fmt.RANK_FILE)
        self.status = info.get("status", "unknown")
        if not isinstance(self.status, str):
            raise DiffError(f"{side} {rank_file}: status is {self.status!r:.80}, not a string")
        numbers = _rank_numbers(info, f"{side} {rank_file}")
        mislabelled = fmt.rank_dir_mismatch(name, numbers)
        if mislabelled:  # which of the two is the rank cannot be told: paired by either, it could be the wrong one
            raise DiffError(f"{side} {self.path}: {mislabelled}")
        match = fmt.RANK_DIR_RE.match(name)
        from_dir = [int(g) for g in match.groups()[:3]] if match else [None, None, None]

        def number(key, fallback):
            value = numbers.get(key)
            return fallback if value is None else value

        self.tp_rank = number("tp_rank", from_dir[0] if from_dir[0] is not None else 0)
        self.pp_rank = number("pp_rank", from_dir[1] if from_dir[1] is not None else 0)
        self.rank = number("rank", from_dir[2] if from_dir[2] is not None else self.tp_rank)
        self.dp_rank = number("dp_rank", 0)
        self.tp_size = number("tp_size", None)
        self.pp_size = number("pp_size", None)
        self._passes = None

    @property
    def passes(self) -> set:
        """Pass ids of this rank directory (read once)."""
        if self._passes is None:
            self._passes = set(_read(self, None, self.ds.passes))
        return self._passes

    def where(self, pass_id=None) -> str:
        """'<side> dump <root>, role R, rank N (<dir>)[, pass P]': what a read error names."""
        root = os.path.dirname(os.path.dirname(self.path))
        return (f"{self.side} dump {root}, role {self.role!r}, rank {self.rank} ({self.name})"
                + ("" if pass_id is None else f", pass {pass_id}"))

    def __repr__(self):
        return f"{self.role}/{self.name}"


class _ReadError(DiffError):
    """The reader failed on one rank's passes or one of its passes (reader.DumpError: damaged, or a
    pass in two segments; an OSError). Within the pass loop a problem (exit 2), the other passes
    are still compared; anywhere else it stops the diff (exit 2)."""


def _read(ref: RankRef, pass_id, method, *args):
    """``method(role, rank dir, *args)`` of the reader; its errors become a _ReadError naming
    side, dump, role, rank and pass."""
    try:
        return method(ref.role, ref.name, *args)
    except (ValueError, KeyError, OSError) as exc:  # reader.DumpError is a ValueError
        reason = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc  # str(KeyError) adds quotes
        raise _ReadError(f"{ref.where(pass_id)}: cannot read ({type(exc).__name__}: {reason})") from None


def _side_ranks(ds, role: str, side: str) -> list:
    refs = [RankRef(ds, role, name, side) for name in ds.ranks(role)]
    by_numbers: dict = {}
    for ref in refs:
        by_numbers.setdefault((ref.dp_rank, ref.pp_rank, ref.tp_rank), []).append(ref)
    for (dp, pp, tp), same in by_numbers.items():
        if len(same) > 1:
            # Attach/close twice into one root leaves one directory per session: comparing one of
            # them (the last, as a dict would) would hide the others.
            raise DiffError(
                f"{side} role {role!r}: rank {same[0].rank} (dp {dp} pp {pp} tp {tp}) has {len(same)} sessions "
                f"(rank directories): {[ref.path for ref in same]}; diff compares one session per rank. To "
                f"compare one, copy its directory alone into a root of its own (mkdir -p NEW/{role} && "
                f"cp -r DIR NEW/{role}/) and give NEW as the {side} dump")
    # Sizes missing from rank.json: count the ranks of the same stage / the stages.
    for ref in refs:
        if ref.tp_size is None:
            ref.tp_size = sum(1 for r in refs if r.dp_rank == ref.dp_rank and r.pp_rank == ref.pp_rank)
        if ref.pp_size is None:
            ref.pp_size = len({r.pp_rank for r in refs if r.dp_rank == ref.dp_rank})
    return refs


def _stages(refs: list, only_in: str, missing: list) -> list:
    """Ranks of one DP replica as [[tp ranks of pp stage 0], [stage 1], ...]: its whole stages. A
    stage, or a TP rank of one, that the sizes in rank.json say ran but that has no directory here
    is listed missing (``only_in``: the other side; the diff fails) and its stage left out:
    unsharding half a tensor would blame the shapes, and a stage absent was not compared at all."""
    by_stage: dict = {}
    for ref in refs:
        by_stage.setdefault(ref.pp_rank, []).append(ref)
    role, dp, where = refs[0].role, refs[0].dp_rank, os.path.dirname(refs[0].path)
    pp_sizes = sorted({r.pp_size for r in refs})
    if len(pp_sizes) > 1:
        raise DiffError(f"role {role!r} dp {dp}: the rank directories disagree on pp_size {pp_sizes} ({where})")

    def absent(rank: str, why: str) -> None:
        missing.append({"kind": "rank", "only_in": only_in, "role": role, "rank": rank, "dp_rank": dp,
                        "path": f"no rank directory in {where}: {why}"})

    stages = []
    for pp in range(max(pp_sizes[0], max(by_stage) + 1)):
        group = sorted(by_stage.get(pp, []), key=lambda r: r.tp_rank)  # one per tp rank: _side_ranks checked
        if not group:
            absent(f"pp{pp}", f"pp stage {pp} of {pp_sizes[0]}, not compared")
            continue
        sizes = sorted({r.tp_size for r in group})
        if len(sizes) > 1:
            raise DiffError(f"role {role!r} pp {pp}: the rank directories disagree on tp_size {sizes} ({where})")
        present = [r.tp_rank for r in group]
        if present != list(range(sizes[0])):  # (tp_size at most fmt.MAX_PARALLEL_SIZE: RankRef checked)
            for tp in sorted(set(range(sizes[0])) - set(present)):
                absent(f"pp{pp} tp{tp}", f"tp rank {tp} of {sizes[0]}: pp stage {pp} cannot be reassembled, "
                                         "not compared")
            continue
        stages.append(group)
    return stages


class Unit:
    """What is compared as one: a baseline rank group against a target rank group."""

    def __init__(self, role, label, baseline_stages, target_stages, pp_rank=0, peers=None, dp_rank=None,
                 target_replica=None):
        self.role, self.label = role, label
        # A merged unit stands for every target rank of its DP replica, a stage left out (absent
        # ranks) included: --rank K of any of them selects it, and keeps the replica's absent ranks.
        self.target_replica = target_replica
        self.dp_rank = dp_rank  # its DP replica, where the role has several (rank numbers repeat per replica)
        self.baseline, self.target = baseline_stages, target_stages
        self.pp_rank = pp_rank  # the PP stage a one-rank unit runs; a merged unit holds every stage
        # (baseline ranks, target ranks) whose passes say which passes a side ran: a one-rank unit's
        # DP replica (every TP rank and PP stage runs every pass), so that a pass its rank lacks but
        # its replica ran is compared, and fails.
        self.peers = peers or (_ranks_of(baseline_stages), _ranks_of(target_stages))

    @property
    def target_ranks(self):
        return [ref.rank for ref in self.target_replica or _ranks_of(self.target)]


def _ranks_of(stages: list) -> list:
    return [ref for stage in stages for ref in stage]


def _pair_units(role: str, base_refs: list, target_refs: list, missing: list) -> list:
    def layout(refs):
        return {(r.tp_size, r.pp_size) for r in refs}

    units = []
    several_dp = len({r.dp_rank for r in base_refs + target_refs}) > 1
    if layout(base_refs) == layout(target_refs) and len(layout(base_refs)) == 1:
        base_by_key = {(r.dp_rank, r.pp_rank, r.tp_rank): r for r in base_refs}
        target_by_key = {(r.dp_rank, r.pp_rank, r.tp_rank): r for r in target_refs}
        for key in sorted(set(base_by_key) | set(target_by_key)):
            b, t = base_by_key.get(key), target_by_key.get(key)
            if b is None or t is None:
                only = "baseline" if t is None else "target"
                ref = b or t
                missing.append({"kind": "rank", "only_in": only, "role": role, "rank": ref.rank,
                                "dp_rank": ref.dp_rank, "path": ref.path})
                continue
            replicas = tuple([r for r in refs if r.dp_rank == key[0]] for refs in (base_refs, target_refs))
            units.append(Unit(role, t.rank, [[b]], [[t]], pp_rank=t.pp_rank, peers=replicas,
                              dp_rank=key[0] if several_dp else None))
        return units
    # Different parallel layouts: rebuild whole tensors on each side, per DP replica.
    for dp in sorted({r.dp_rank for r in base_refs} | {r.dp_rank for r in target_refs}):
        b = [r for r in base_refs if r.dp_rank == dp]
        t = [r for r in target_refs if r.dp_rank == dp]
        if not b or not t:
            for ref in b or t:
                missing.append({"kind": "rank", "only_in": "baseline" if b else "target", "role": role,
                                "rank": ref.rank, "dp_rank": ref.dp_rank, "path": ref.path})
            continue
        label = f"dp{dp}:merged"
        b_stages, t_stages = _stages(b, "target", missing), _stages(t, "baseline", missing)
        if b_stages and t_stages:
            units.append(Unit(role, label, b_stages, t_stages, target_replica=t))
    return units


def _replica_ranks(role: str, target_refs: list) -> dict:
    """{(role, dp rank): the target's rank numbers in that DP replica}: which ranks --rank K asks
    about when a replica is merged (its absent ranks are labelled 'pp1 tp1', never K)."""
    found: dict = {}
    for ref in target_refs:
        found.setdefault((role, ref.dp_rank), set()).add(ref.rank)
    return found


# ---------------------------------------------------------------------------------------- passes


def _pass_holders(refs: list) -> dict:
    """{pass id: the first rank holding it}, in pass order, over the ranks of a side: a pass the
    lead rank lacks is still compared (the ranks without it fail its rows)."""
    holders: dict = {}
    for ref in refs:
        for pass_id in ref.passes:
            holders.setdefault(pass_id, ref)
    return dict(sorted(holders.items()))


def _pass_pairs(unit: Unit, options: Options, missing: list) -> list:
    """[(sort key, baseline pass, target pass)] for one unit, before --passes selects among them."""
    b_holders, t_holders = (_pass_holders(peers) for peers in unit.peers)
    b_passes, t_passes = list(b_holders), list(t_holders)
    align = options.align
    if align is None or align[0] == "offset":
        shift = 0 if align is None else align[1]  # baseline pass p pairs with target pass p + shift
        b_set, t_set = set(b_passes), set(t_passes)
        pairs = [(t, t - shift, t) for t in t_passes if t - shift in b_set]
        # A pass outside --passes was not asked about: its absence on one side says nothing (it
        # was listed missing, and failed a --strict diff). A baseline pass p stands for target p + shift.
        wanted = options.pass_filter or (lambda pass_id: True)
        extras = {"baseline": [p for p in b_passes if p + shift not in t_set and wanted(p + shift)],
                  "target": [t for t in t_passes if t - shift not in b_set and wanted(t)]}
    else:
        if align[0] == "meta":
            b_passes, t_passes = _meta_passes(b_holders, align), _meta_passes(t_holders, align)
        n = min(len(b_passes), len(t_passes))
        extras = {"baseline": b_passes[n:], "target": t_passes[n:]}
        if options.pass_filter is not None:
            # --passes selects target pass ids. A baseline pass past the target's last has none: it
            # stands for the ids the target would give its next passes (last + 1, last + 2, ...), so
            # an open '--passes 0-' still lists it and '--passes 0-3' does not.
            after = t_passes[-1] + 1 if t_passes else 0
            extras = {"baseline": [b for k, b in enumerate(extras["baseline"]) if options.pass_filter(after + k)],
                      "target": [t for t in extras["target"] if options.pass_filter(t)]}
        pairs = [(i, b_passes[i], t_passes[i]) for i in range(n)]
    for side, passes in extras.items():
        if not passes:
            continue
        other, other_holders = ("target", t_holders) if side == "baseline" else ("baseline", b_holders)
        if not other_holders:
            # The other side's rank (its whole DP replica) holds no pass at all: none of its data is
            # there to compare, as with a rank on one side only (exit 1). Listed as passes on one
            # side only, an EAGLE draft that never dumped a pass read "no divergence".
            missing.append({"kind": "rank_without_passes", "only_in": side, "side": other, "role": unit.role,
                            "rank": unit.label, **_dp_field(unit), "passes": passes,
                            "path": ", ".join(ref.path for ref in unit.peers[side == "baseline"])})
            continue
        missing.append({"kind": "passes", "only_in": side, "role": unit.role, "rank": unit.label,
                        **_dp_field(unit), "passes": passes})
    return pairs


def _dp_field(unit) -> dict:
    """{"dp_rank": k} where the role has several DP replicas (their rank numbers repeat: two
    replicas' items read alike, and one name's pass ids were merged into 0,0,1,1,...)."""
    return {} if unit.dp_rank is None else {"dp_rank": unit.dp_rank}


def _meta_passes(holders: dict, align) -> list:
    """The passes (of ``{pass id: rank holding it}``) whose metadata KEY equals VALUE."""
    _, key, value = align
    return [p for p, ref in holders.items() if _read(ref, p, ref.ds.meta, p).get(key) == value]


# ------------------------------------------------------------------------------------- unsharding


def _incomplete_pass_notes(unit, side: str, stages: list, pass_id: int) -> list:
    """A note for each shard of a side whose pass is compared although the capture side said it
    is not whole (every TP and PP shard: one incomplete shard makes the reassembled pass so)."""
    refs = _ranks_of(stages)
    notes = []
    for ref in refs:
        try:
            meta = ref.ds.meta(ref.role, ref.name, pass_id)
        except (KeyError, ValueError, OSError):  # ValueError: reader.DumpError, a segment it cannot read
            continue  # this shard's tensors of the pass are reported missing or ERROR when read
        if meta.get("complete") is False:
            notes.append(f"{unit.role} rank {unit.label}: {side} pass {pass_id} is marked incomplete"
                         + (f" in {ref.name}" if len(refs) > 1 else "")
                         + (f" ({meta['incomplete']})" if meta.get("incomplete") else ""))
    return notes


# How the reader names the second copy of a name in one pass ('a#dup1'): load() returns both.
_READER_COPY_RE = re.compile(r"(.+)#dup\d+")


def _ambiguous_name(names: list):
    """A name one rank's pass holds twice, as listed ('a', 'a') or as load() renames it ('a',
    'a#dup1'); None when there is none. Such a pass is in two segments (a segment of another
    session copied in): which copy is the pass cannot be told, so neither is compared."""
    listed, seen = set(names), set()
    for name in names:
        copy_of = _READER_COPY_RE.fullmatch(name)
        if name in seen or (copy_of and copy_of.group(1) in listed):
            return name
        seen.add(name)
    return None


def _names_in_order(stages: list, pass_id: int, cache: "_PassCache") -> dict:
    """{name: stage index} of a pass, in dump order: stage 0's names first; within a stage its
    first TP rank's order, then any name only a later TP rank holds (each name is then read from
    every rank of its stage, and a rank without it fails that row). Raises _ReadError when a
    rank's pass cannot be read, or holds a name twice."""
    found: dict = {}
    for index, stage in enumerate(stages):
        for ref in stage:
            if pass_id not in ref.passes:
                continue  # its rows say the pass is missing on this rank
            names = cache.names(ref, pass_id)
            twice = _ambiguous_name(names)
            if twice is not None:
                raise _ReadError(f"{ref.where(pass_id)}: tensor {twice!r} is in the pass twice (the pass is "
                                 f"in two segments?); which copy to compare is ambiguous, so the pass is not "
                                 f"compared")
            for name in names:
                # A name several PP stages dump is the root module's, which every stage runs: its
                # output is the model's from the last stage that has it (stage 0's is that stage's
                # hidden states), its inputs the model's from the first.
                if name not in found:
                    found[name] = index
                elif found[name] != index and not _INPUT_NAME.search(name):
                    del found[name]  # (it moves to where the last stage's names are)
                    found[name] = index
    return found


_INPUT_NAME = re.compile(r"\.input\.")  # name[#k].input.<i|key>[.part]: what a call was given


class _PassCache:
    """Tensors of the passes being compared, read a whole pass at a time when it is small.

    Small passes (decode steps) are read with one ``load`` per rank and pass: per-tensor lookups
    would cost more than the reads. A pass over ``PASS_CACHE_BYTES`` is read tensor by tensor, so
    memory stays bounded by one tensor per rank, whatever the dump's size.
    """

    PASS_CACHE_BYTES = 64 << 20

    def __init__(self):
        self._passes: dict = {}  # (rank path, pass id) -> {name: tensor} or None (read per tensor)
        self._names: dict = {}  # (rank path, pass id) -> [name, ...]
        self._name_sets: dict = {}  # (rank path, pass id) -> {name, ...}

    def clear(self) -> None:
        self._passes.clear()
        self._names.clear()
        self._name_sets.clear()

    def names(self, ref: RankRef, pass_id: int) -> list:
        """Tensor names of one rank's pass, in dump order (read once per pass pair)."""
        key = (ref.path, pass_id)
        if key not in self._names:
            self._names[key] = _read(ref, pass_id, ref.ds.pass_names, pass_id)
        return self._names[key]

    def holds(self, ref: RankRef, name: str, pass_id: int) -> bool:
        """Whether one rank's pass holds ``name`` (a set: asked per name, a list made a pass of
        20k tensors take 20k x 20k string comparisons)."""
        key = (ref.path, pass_id)
        if key not in self._name_sets:
            self._name_sets[key] = set(self.names(ref, pass_id))
        return name in self._name_sets[key]

    def tensor(self, ref: RankRef, name: str, pass_id: int):
        key = (ref.path, pass_id)
        if key not in self._passes:
            small = ref.ds.meta(ref.role, ref.name, pass_id).get("bytes", 0) <= self.PASS_CACHE_BYTES
            loaded = None
            if small:
                try:
                    loaded = ref.ds.load(ref.role, ref.name, pass_id, check=True)
                except Exception:  # a damaged block: read tensor by tensor, so only that tensor fails
                    loaded = None
            self._passes[key] = loaded
        loaded = self._passes[key]
        if loaded is not None:
            if name not in loaded:
                raise KeyError(name)
            return loaded[name]
        # check=True: a changed bit is damage (exit 2, segment named), not a model divergence.
        return ref.ds.tensor(ref.role, ref.name, name, pass_id, check=True)


def _read_shards(stage: list, name: str, pass_id: int, cache: _PassCache) -> list:
    shards = []
    for ref in stage:
        # Missing data on one rank of a group fails the row (exit 1), as a differing value would.
        if pass_id not in ref.passes:
            raise _RowError("fail", f"pass {pass_id} missing on {ref.side} rank {ref.rank}", ref.path)
        if not cache.holds(ref, name, pass_id):
            raise _RowError("fail", f"missing on {ref.side} rank {ref.rank} pass {pass_id}", ref.path)
        try:
            shards.append(cache.tensor(ref, name, pass_id))
        except Exception as exc:  # a damaged block: report where, keep comparing the rest
            raise _RowError("read", f"cannot read pass {pass_id} ({type(exc).__name__}: {exc})", ref.path) from None
    return shards


class _RowError(Exception):
    def __init__(self, kind: str, reason: str, path=None):
        super().__init__(reason)
        self.kind, self.reason, self.path = kind, reason, path


def _shape(tensor) -> list:
    return list(tensor.shape)


def _combine(shards: list, rule, atol: float, rtol: float, side: str, options: Options):
    """One tensor from the shards of one side under ``rule`` (dim, 'replicated' or 'sum')."""
    import torch

    from . import stats

    if len(shards) == 1:
        return shards[0]
    if rule == "pairwise":  # (see _assemble) one tensor per TP rank, stacked
        return torch.stack(shards)
    if rule == "replicated":
        for k, shard in enumerate(shards[1:], start=1):
            if shard.shape != shards[0].shape:
                raise _RowError("fail", f"{side}: replicated tensor has shape {_shape(shard)} on tp rank {k}, "
                                        f"{_shape(shards[0])} on tp rank 0")
            # The copies are held to the criterion the user chose (--metric), not allclose alone: under
            # rel_diff, all-reduce noise between TP ranks failed the diff, and under rel_diff with a
            # loose atol a copy far off passed it.
            check = stats.compare(shards[0], shard, atol, rtol)
            failed = _verdict(check, options)
            if failed:
                # (types with no arithmetic are compared bit for bit, whatever the metric)
                how = "their bits differ" if check["bitwise"] else \
                    f"exceeds {', '.join(failed)}; {_measured(check, failed)}"
                raise _RowError("fail", f"{side}: tp ranks 0 and {k} disagree on a tensor treated as replicated "
                                        f"({how}); partial sums? give --unshard 'NAME=sum'")
        return shards[0]
    if rule == "sum":
        if any(s.shape != shards[0].shape for s in shards):
            raise _RowError("fail", f"{side}: partial sums of different shapes {[_shape(s) for s in shards]}")
        if not all(stats.has_arithmetic(s.dtype) for s in shards):  # float4, bits*: no values to add
            raise _RowError("fail", f"{side}: {shards[0].dtype} shards cannot be summed (no arithmetic); give "
                                    f"--unshard 'NAME=DIM' or 'NAME=replicated'")
        # complex128 for complex shards: .to(float64) drops the imaginary part, on both sides alike
        wide = torch.complex128 if any(s.is_complex() for s in shards) else torch.float64
        total = shards[0].to(wide)
        for shard in shards[1:]:
            total = total + shard.to(wide)
        return total
    try:
        return torch.cat(shards, dim=rule)
    except (RuntimeError, IndexError) as exc:
        raise _RowError("fail", f"{side}: cannot concatenate shards {[_shape(s) for s in shards]} along dim "
                                f"{rule}: {exc}") from None


def _measured(check: dict, failed: list) -> str:
    """The numbers behind the failed metrics of ``check`` ('max abs 0.5', 'rel_diff 0.02')."""
    said = {"allclose": f"max abs {check['max_abs']:.3g}", "rel_diff": f"rel_diff {check['rel_diff']:.3g}",
            "cosine": f"cosine distance {check['cosine_distance']:.3g}"}
    return ", ".join(said[metric.partition(">")[0]] for metric in failed)


def _infer_rule(base_shards: list, target_shards: list):
    """The concatenation dim (or 'replicated') that makes both sides the same shape; None when no
    single dimension does (then an explicit rule is needed)."""
    shapes = {tuple(s.shape) for s in base_shards + target_shards}
    if len(shapes) == 1:
        return "replicated"
    ndims = {len(shape) for shape in shapes}
    if len(ndims) != 1:
        return None
    (ndim,) = ndims
    candidates = []
    for dim in range(ndim):
        def full(shards):
            if any(s.shape[:dim] + s.shape[dim + 1:] != shards[0].shape[:dim] + shards[0].shape[dim + 1:]
                   for s in shards):
                return None
            return tuple(shards[0].shape[:dim]) + (sum(s.shape[dim] for s in shards),) + \
                tuple(shards[0].shape[dim + 1:])

        b, t = full(base_shards), full(target_shards)
        if b is not None and b == t:
            candidates.append(dim)
    return candidates[0] if len(candidates) == 1 else None


def _assemble(base_shards: list, target_shards: list, rule, atol: float, rtol: float, options: Options):
    """(baseline tensor, target tensor, rule used) from each side's TP shards."""
    if len(base_shards) == 1 and len(target_shards) == 1:
        return base_shards[0], target_shards[0], None
    if rule is None and len(base_shards) == len(target_shards) and \
            len({tuple(s.shape) for s in base_shards + target_shards}) == 1:
        # The same TP size on both sides (their PP sizes differ): rank k against rank k, whatever
        # the shards are. Taken as replicated, column shards of one run failed against the same
        # shards of the other ("tp ranks 0 and 1 disagree").
        rule = "pairwise"
    if rule is None:
        rule = _infer_rule(base_shards, target_shards)
        if rule is None:
            raise _RowError("fail", f"shapes differ and no unshard explains them: baseline shards "
                                    f"{[_shape(s) for s in base_shards]}, target shards "
                                    f"{[_shape(s) for s in target_shards]} (give --unshard 'REGEX=DIM|replicated|sum')")
    return (_combine(base_shards, rule, atol, rtol, "baseline", options),
            _combine(target_shards, rule, atol, rtol, "target", options), rule)


def _holds(stages: list, pass_id: int) -> bool:
    return any(pass_id in ref.passes for ref in _ranks_of(stages))


def _recorded_layout(stages: list, pass_id: int) -> dict:
    if len(stages) == 1 and len(stages[0]) == 1:
        return {}
    holder = next((ref for ref in _ranks_of(stages) if pass_id in ref.passes), None)  # the lead may lack it
    if holder is None:
        return {}
    layout = _read(holder, pass_id, holder.ds.meta, pass_id).get(LAYOUT_META_KEY)
    return layout if isinstance(layout, dict) else {}


# ------------------------------------------------------------------------------------- comparison


def _verdict(result: dict, options: Options) -> list:
    """Names of the metrics this comparison fails (empty: it passes)."""
    failed = []
    for metric, threshold in options.metrics:
        if metric == "allclose" or result["bitwise"]:
            bad = result["mismatches"] > 0
        else:  # 'not <=': an undefined (NaN) distance fails
            distance = result["rel_diff"] if metric == "rel_diff" else result["cosine_distance"]
            bad = not distance <= threshold or result["nonfinite_mismatches"] > 0
        if bad:
            failed.append(metric if threshold is None else f"{metric}>{threshold:g}")
    return failed


def _compare_name(unit, pass_pair, name, b_stage, t_stage, options, layouts, cache):
    from . import stats  # imports torch: only when comparing, so that other commands start fast

    _, b_pass, t_pass = pass_pair
    atol, rtol = options.tolerance(name)
    base_shards = _read_shards(unit.baseline[b_stage], name, b_pass, cache)
    target_shards = _read_shards(unit.target[t_stage], name, t_pass, cache)
    rule = options.explicit_layout(name)
    if rule is None:
        for layout in layouts:
            if name in layout:
                rule = _layout_rule(layout[name], f"recorded {LAYOUT_META_KEY} of {name!r}")
                break
    base, target, used_rule = _assemble(base_shards, target_shards, rule, atol, rtol, options)
    row = {"shape": _shape(target), "baseline_dtype": str(base_shards[0].dtype).rpartition(".")[2],
           "dtype": str(target_shards[0].dtype).rpartition(".")[2], "atol": atol, "rtol": rtol,
           "unshard": used_rule}
    if base.shape != target.shape:
        raise _RowError("fail", f"shape {_shape(target)} vs baseline {_shape(base)}")
    result = stats.compare(base, target, atol, rtol)
    failed = _verdict(result, options)
    row.update({key: result[key] for key in ("max_abs", "max_rel", "rel_diff", "cosine", "cosine_distance",
                                             "mismatch", "mismatches", "numel", "bitwise")})
    row["baseline_stats"], row["target_stats"] = result["baseline"], result["target"]
    row["status"] = "fail" if failed else "ok"
    if failed:
        row["reason"] = "exceeds " + ", ".join(failed)
        if result["nonfinite_mismatches"] and "complex" in row["dtype"] + row["baseline_dtype"]:
            # (a complex element's finite part still counts in rel_diff and cosine)
            row["reason"] += (f"; {result['nonfinite_mismatches']} element(s) with a NaN or infinite part, left "
                              f"out of max_abs and max_rel")
        elif result["nonfinite_mismatches"]:  # max_abs, rel_diff, cosine leave them out: they may read 0 and 1
            row["reason"] += (f"; {result['nonfinite_mismatches']} element(s) NaN or infinite on one side only "
                              f"(or infinite of opposite signs), left out of max_abs, rel_diff and cosine")
        if used_rule == "replicated" and rule is None:
            row["reason"] += " (shards were taken as replicated; if they are partial sums give --unshard 'NAME=sum')"
        # A merged row names no rank: say whose shard differs, as a TP=2 against TP=2 diff would.
        ranks = None
        if isinstance(used_rule, int) and not isinstance(used_rule, bool):
            ranks = {side: _failing_shards(side, shards, whole, used_rule, atol, rtol, options)
                     for side, shards, whole in (("baseline", base_shards, target), ("target", target_shards, base))
                     if len(shards) > 1}
        elif used_rule == "pairwise":  # TP rank k against TP rank k
            ranks = {"target": [k for k, pair in enumerate(zip(base_shards, target_shards))
                                if _verdict(stats.compare(*pair, atol, rtol), options)]}
        if ranks is not None:
            row["failing_tp_ranks"] = ranks
            said = [f"{side} tp rank{'s' if len(ks) > 1 else ''} {', '.join(map(str, ks))}"
                    for side, ks in ranks.items() if ks]
            if said:
                row["reason"] += f" (in the shard of {'; '.join(said)})"
    return row


def _failing_shards(side: str, shards: list, whole, dim: int, atol: float, rtol: float, options) -> list:
    """The TP ranks of ``side`` whose shard (along ``dim``) fails against its slice of the other
    side's tensor ``whole``, under the row's rule."""
    from . import stats

    failing, start = [], 0
    for k, shard in enumerate(shards):
        part = whole.narrow(dim, start, shard.shape[dim])
        start += shard.shape[dim]
        pair = (shard, part) if side == "baseline" else (part, shard)  # compare(baseline, target)
        if _verdict(stats.compare(*pair, atol, rtol), options):
            failing.append(k)
    return failing


class _Progress:
    """A one-line progress bar on stderr, only when stderr is a terminal."""

    def __init__(self, enabled):
        self.enabled = bool(enabled) and sys.stderr.isatty()
        self.last = 0.0

    def update(self, done: int, total: int, compared: int, failed: int) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self.last < 0.1 and done < total):
            return
        self.last = now
        width = 30
        filled = width * done // max(total, 1)
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} passes, "
                         f"{compared} tensors, {failed} failing")
        sys.stderr.flush()

    def close(self):
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


# ---------------------------------------------------------------------------------------- result


class DiffResult:
    """Outcome of a comparison. ``ok`` is True when every compared tensor is within tolerance."""

    def __init__(self, baseline_roots, target_roots, options: Options, rows, missing, problems, notes=()):
        self.baseline, self.target = baseline_roots, target_roots
        self.notes = list(notes)  # facts that do not change the verdict but qualify it (incomplete dumps)
        self.options = options
        if not isinstance(rows, RowLog):
            log = RowLog(memory_rows=len(rows))
            for row in rows:
                log.append(row)
            rows = log
        self._rows = rows  # in execution order; past rowlog.MEMORY_ROWS in a temporary file
        self.missing = missing
        self.problems = problems
        self.compared, self.failed = rows.compared, rows.failed
        self.first_divergence = rows.first_divergence
        # A role, rank or stage on one side only is data missing from the comparison: the dumps
        # differ (exit 1). A name on one side only, or a pass, is listed, and fails only a strict diff.
        self.missing_ranks = [item for item in missing if item["kind"] in _MISSING_KIND]
        self.not_compared = [item for item in missing if item["kind"] in ("name", "passes")]

    def __repr__(self) -> str:
        first = self.first_divergence
        where = "" if first is None else f", first_divergence={first['name']!r} (pass {first['pass']})"
        return f"DiffResult(ok={self.ok}, compared={self.compared}, failed={self.failed}{where})"

    @property
    def rows(self):
        """Every row in execution order: a list, or past rowlog.MEMORY_ROWS an iterable read back
        from a temporary file (``len`` and ``[i]`` work on both)."""
        return self._rows if self._rows.spilled else self._rows.as_list()

    def iter_failures(self):
        """The failing rows in execution order, one at a time (any number of them)."""
        return (row for row in self._rows if row["status"] != "ok")

    @property
    def read_errors(self) -> list:
        return [row for row in self.iter_failures() if row["status"] == "error"] if self._rows.errors else []

    @property
    def exit_code(self) -> int:
        if self.problems or self._rows.errors:
            return 2
        return 1 if self.failed or self.missing_ranks or (self.options.strict and self.not_compared) else 0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def failures(self) -> list:
        return list(self.iter_failures())

    def _head(self) -> dict:
        return {"baseline": self.baseline, "target": self.target, "options": self.options.as_dict(),
                "ok": self.ok, "exit_code": self.exit_code, "first_divergence": self.first_divergence,
                "compared": self.compared, "failed": self.failed, "missing": self.missing,
                "problems": self.problems, "notes": self.notes}

    def as_dict(self) -> dict:
        return dict(self._head(), rows=self._rows.as_list())

    def to_json(self, indent=None) -> str:
        """Strict JSON: infinities and NaN (a max_rel over a zero baseline) become strings."""
        return json.dumps(_json_safe(self.as_dict()), indent=indent, default=str, allow_nan=False)

    def write_json(self, out) -> None:
        """``to_json()`` and a newline, written to the text stream ``out`` a row at a time: the
        text of a large diff is never held whole in memory."""
        head = json.dumps(_json_safe(dict(self._head(), rows=[])), default=str, allow_nan=False)
        out.write(head[:-len("]}")])  # (rows is the last key)
        for k, row in enumerate(self._rows):
            out.write((", " if k else "") + json.dumps(_json_safe(row), default=str, allow_nan=False))
        out.write("]}\n")

    def to_html(self, path) -> str:
        from .report import write_html

        return write_html(self, path)

    def headline(self) -> str:
        """The verdict in one line (the text report's first, the HTML report's summary)."""
        first = self.first_divergence
        unread = self._rows.errors  # rows whose tensor could not be read (ERROR lines): damage, not divergence
        if first is not None:
            incomplete = " and ".join(([f"{unread} tensor(s) could not be read"] if unread else [])
                                      + ([f"{len(self.problems)} read problem(s)"] if self.problems else []))
            return (f"first divergence: {_where(first)} {first['name']}  {_row_numbers(first)}"
                    + (f"; {incomplete} (ERROR lines below)" if incomplete else ""))
        if self.problems:
            return (f"no divergence in the {self.compared} tensor(s) compared, but {len(self.problems)} read "
                    f"problem(s) (ERROR lines below) leave the comparison incomplete")
        if unread:
            return (f"no divergence in the {self.compared} tensor(s) compared, but {unread} tensor(s) could not be "
                    f"read (ERROR lines below): the comparison is incomplete")
        if self.missing_ranks:
            kinds = collections.Counter(item["kind"] for item in self.missing_ranks)
            both = kinds.pop("rank_passes", 0)  # (lost on both sides: not "on one side only")
            what = "; ".join(([", ".join(f"{n} {_MISSING_KIND[kind]}" for kind, n in sorted(kinds.items()))
                               + " on one side only"] if kinds else [])
                             + ([f"{both} {_MISSING_KIND['rank_passes']}, on both sides"] if both else []))
            return (f"{'ranks' if set(kinds) == {'rank'} and not both else 'data'} missing: {what} (listed "
                    f"below); the {self.compared} tensor(s) compared are within tolerance")
        tolerance = f"({self.options.criteria()})"
        if self.missing:  # names or passes on one side only: listed, not failed, but never "all fine"
            names = len({(m["role"], m["name"]) for m in self.missing if m["kind"] == "name"})
            # (each TP rank lists the passes it lacks: a pass counts once, not once per rank)
            passes = len({(m["role"], m.get("dp_rank"), m["only_in"], p) for m in self.missing
                          if m["kind"] == "passes" for p in m["passes"]})
            what = " and ".join(f"{n} {kind}" for n, kind in ((names, "name(s)"), (passes, "pass(es)")) if n)
            strict = "; --strict: the diff fails" if self.options.strict else ""
            return (f"no divergence in the {self.compared} tensor(s) compared {tolerance}; not compared: {what} "
                    f"on one side only (listed below{strict})")
        return f"no divergence: {self.compared} tensor(s) compared, all within tolerance {tolerance}"

    def lines(self) -> list:
        """Human-readable report: the first divergence first, then one line per failing tensor."""
        return list(self.iter_lines())

    def iter_lines(self):
        """``lines()`` one at a time (a diff may fail millions of tensors)."""
        yield printable(self.headline())
        for row in self.iter_failures():  # ERROR: unreadable or damaged data, not a divergence of the model
            label = "ERROR" if row["status"] == "error" else "FAIL"
            yield printable(f"{label} {_where(row)} {row['name']}  {_row_numbers(row)}")  # no terminal escapes
        for item in self.missing:
            yield printable("missing: " + _missing_text(item))
        for problem in self.problems:
            yield printable(f"ERROR: {problem}")
        for note in self.notes:
            yield printable(f"note: {note}")
        yield (f"compared {self.compared}, failed {self.failed}, missing {len(self.missing)}"
               + (f", problems {len(self.problems) + self._rows.errors}" if self.exit_code == 2 else ""))


# The missing items that fail the diff (exit 1): data of a role, rank or stage absent on one side.
_MISSING_KIND = {"role": "role(s)", "rank": "rank(s)", "stage_passes": "stage(s) without a pass",
                 "rank_without_passes": "rank(s) holding no pass",
                 "rank_passes": "rank(s) without passes their DP replica ran"}


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return value


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def _row_numbers(row) -> str:
    if row.get("max_abs") is None and not row.get("bitwise"):
        return f"[{row.get('reason')}]" + (f" ({row['path']})" if row.get("path") else "")
    text = (f"max_abs {_fmt(row['max_abs'])}  max_rel {_fmt(row['max_rel'])}  rel_diff {_fmt(row['rel_diff'])}  "
            f"cosine {cosine_text(row)}  mismatch {percent(row['mismatch'])}")
    if row["status"] != "ok":
        text += f"  [{row.get('reason')}]"
    return text


def _open(source, side: str):
    from . import multiroot

    if hasattr(source, "pass_names"):
        return source, False
    roots = [os.fspath(r) for r in source] if isinstance(source, (list, tuple)) else [os.fspath(source)]
    try:
        return multiroot.open(roots if len(roots) > 1 else roots[0]), True
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise DiffError(f"{side}: {exc}") from None


def diff(baseline, target, **options) -> DiffResult:
    """Compare ``target`` against ``baseline`` (each a dump root, a list of roots, or an open DumpSet).

    Options: role, rank, passes ("0-3,7"), name (regex), atol, rtol, tol (["REGEX=ATOL,RTOL"] or
    {regex: (atol, rtol)}), metric (["allclose", "rel_diff=1e-3", "cosine=1e-4"]), align ("id",
    "order", "meta:forward_mode=decode"), unshard (["REGEX=DIM|replicated|sum"] or {regex: rule}),
    allow_running, progress, strict (a name or a pass on one side only fails the diff). Raises
    ValueError for bad options and DiffError when the dumps cannot be compared at all; per-tensor
    problems are rows of the result.
    """
    _check_option_names(options)
    opts = Options(**options)
    base_ds, close_base = _open(baseline, "baseline")
    try:
        target_ds, close_target = _open(target, "target")
    except DiffError:
        if close_base:
            base_ds.close()
        raise
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # unreadable segments are reported as problems instead
            return _diff(base_ds, target_ds, opts)
    finally:
        if close_base:
            base_ds.close()
        if close_target:
            target_ds.close()


def _check_option_names(options) -> None:
    """TypeError naming each keyword ``diff`` does not take, with the closest one: a misspelt
    ``diff(a, b, atl=1e-3)`` said "Options.__init__() got an unexpected keyword argument"."""
    import difflib
    import inspect

    known = sorted(inspect.signature(Options).parameters)
    unknown = sorted(set(options) - set(known))
    if unknown:
        hints = []
        for name in unknown:
            near = difflib.get_close_matches(name, known, n=1)
            hints.append(f"{name!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
        raise TypeError(f"diff: unknown option(s) {', '.join(hints)}; the options are {', '.join(known)}")


def _check_side(ds, side: str, roles: list, options: Options, notes: list) -> None:
    if not ds.roles:
        from .reader import wrong_root_hint

        hint = wrong_root_hint(ds.root) if len(getattr(ds, "roots", [ds.root])) == 1 else ""
        raise DiffError(f"{side} {ds.root}: no rank directories (expected <root>/<role>/<rank>/rank.json)"
                        + (f"; {hint}" if hint else ""))
    for role in roles:
        if role not in ds.roles:
            raise DiffError(f"{side} {ds.root}: no role {role!r} (roles: {ds.roles})")
    for role in roles:
        for name in ds.ranks(role):
            ref = RankRef(ds, role, name, side)
            info = ds.rank_info(role, name)
            error = info.get("error")
            rank_file = os.path.join(ref.path, fmt.RANK_FILE)
            if "status" not in info and not any(getattr(p, "path", None) == rank_file for p in ds.problems):
                # rank.json gone or without its status (verify fails it): its segments were
                # compared as a closed dump's, "no divergence", whatever they lack. (One the
                # reader cannot read is its problem: exit 2, named.)
                said = (f"{fmt.RANK_FILE} is missing" if not os.path.lexists(rank_file)
                        else f"{fmt.RANK_FILE} holds no status") + ": not known to be a finished dump"
                if not options.allow_running:
                    raise DiffError(f"{side} {ref.path}: {said}; pass --allow-running to compare what is there")
                notes.append(f"{side} {ref.path}: {said}")
            if ref.status in ("running", "error") and not options.allow_running:
                temp = [e for e in os.listdir(ref.path) if e.endswith(".tmp")]
                raise DiffError(f"{side} {ref.path}: status is {ref.status!r} ({unfinished_why(ref.status, error)}"
                                + (f"; open segment {temp[0]}" if temp else "")
                                + "); compare it once closed, or pass --allow-running to compare what is there")
            if ref.status not in ("closed", "unknown"):
                # 'incomplete' (the producer died; what it published was written) is still evidence
                # worth comparing, but never silently.
                notes.append(f"{side} {ref.path}: status is {ref.status!r}" + (f" ({error})" if error else ""))
            not_dumped = _not_dumped_text(ds.rank_info(role, name))
            if not_dumped:
                # What the capture side did not dump is listed as names or passes on one side only:
                # without this the listing reads as a model that did not run them.
                notes.append(f"{side} {ref.path}: the capture side {not_dumped}; names and passes this rank "
                             f"lacks may be data not dumped, not absent from the model")


def _not_dumped_text(info: dict) -> str:
    """'dropped 3 tensor(s) and 1 whole pass(es) (ring full) and skipped 2 tensor(s) (...)' from
    rank.json's counts; '' when none (a count that is not an integer >= 0 is verify's to report)."""
    def count(key):
        value = info.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0

    dropped = " and ".join(f"{n} {what}" for n, what in ((count("dropped"), "tensor(s)"),
                                                         (count("dropped_passes"), "whole pass(es)")) if n)
    # rank.json's skipped counts the losses too (a torn tensor is recorded as its pass's skip): said
    # as skipped, a tensor the dump lost read as one the capture side left out by design.
    lost = min(count("lost_tensors"), count("skipped"))
    said = ([f"dropped {dropped} (ring full)"] if dropped else []) + \
        ([f"skipped {count('skipped') - lost} tensor(s) (reasons in each pass's metadata: fastdump show)"]
         if count("skipped") > lost else []) + \
        ([f"lost {lost} tensor(s) after they were accepted (torn, or not stored by the writer: fastdump verify "
          f"fails the dump)"] if lost else [])
    at_close = not_dumped_at_close(info.get("stats"))  # (names absent from every pass: read as not run)
    return " and ".join(said + ([f"counted at close: {at_close}"] if at_close else []))


def _diff(base_ds, target_ds, options: Options) -> DiffResult:
    missing, problems, notes = [], [], []
    roles = options.roles or sorted(set(base_ds.roles) | set(target_ds.roles))
    if not options.roles:
        for role in roles:
            for side, ds in (("baseline", base_ds), ("target", target_ds)):
                if role not in ds.roles:
                    missing.append({"kind": "role", "only_in": "target" if side == "baseline" else "baseline",
                                    "role": role})
        roles = [role for role in roles if role in base_ds.roles and role in target_ds.roles]
    _check_side(base_ds, "baseline", roles, options, notes)
    _check_side(target_ds, "target", roles, options, notes)
    if not roles:
        raise DiffError(f"no role in common: baseline has {base_ds.roles}, target has {target_ds.roles}")

    units, replicas = [], {}
    for role in roles:
        target_refs = _side_ranks(target_ds, role, "target")
        units.extend(_pair_units(role, _side_ranks(base_ds, role, "baseline"), target_refs, missing))
        replicas.update(_replica_ranks(role, target_refs))
    if options.rank is not None:
        def asked(item) -> bool:
            # Other ranks were not asked about: their absence on one side says nothing here. A
            # merged replica's absent rank ('pp1 tp1') is asked about with any rank of the replica:
            # dropped, a lost TP rank read "no divergence" under --rank 0.
            if item["kind"] != "rank" or item["rank"] == options.rank:
                return True
            return isinstance(item["rank"], str) and options.rank in replicas.get((item["role"], item["dp_rank"]), ())

        missing = [item for item in missing if asked(item)]
        units = [unit for unit in units if options.rank in unit.target_ranks]
        if not units:
            raise DiffError(f"no rank {options.rank} present on both sides" + "".join(
                f"\n  {_missing_text(item)}" for item in missing if item["kind"] == "rank"))
    # At one pass id, the target role first: its forward feeds the others (an EAGLE draft runs on the
    # target's hidden states; the target's prefill runs before any draft pass). By name, 'draft' came
    # first, and a change moving both roles' pass 0 was named the draft's divergence.
    role_order = {role: index for index, role in enumerate(sorted(roles, key=lambda r: (r != "target", r)))}
    # In execution order (the pass, the role, the PP stage; then the units running it at once), so
    # that rows leave the loop in their final order and need not all be held to be sorted.
    paired = [(unit_index, unit, pair) for unit_index, unit in enumerate(units)
              for pair in _pass_pairs(unit, options, missing)]
    selected = paired if options.pass_filter is None else \
        [item for item in paired if options.pass_filter(item[2][2])]  # --passes: target pass ids
    work = sorted(selected, key=lambda item: (item[2][0], role_order[item[1].role], item[1].pp_rank, item[0]))

    progress = _Progress(options.progress)
    missing_names: dict = {}
    stage_gaps: dict = {}  # (role, unit label, side, pp stage) -> passes no rank of that stage holds
    lost_on_both: dict = {}  # (role, unit label, dp) -> passes both sides' rank lacks, which their replicas ran
    base_names_seen, target_names_seen = set(), set()
    rows = RowLog()
    group, group_key = [], None  # rows of one pass of one PP stage (all its TP/DP units), to be ordered

    def flush():
        keys = _merged_positions(group)
        group.sort(key=lambda row: (keys[row["name"]], row.pop("_key")[1]))
        for row in group:
            rows.append(row)
        group.clear()

    try:
        cache = _PassCache()
        for done, (unit_index, unit, pair) in enumerate(work, start=1):
            key, b_pass, t_pass = pair
            if (key, role_order[unit.role], unit.pp_rank) != group_key:
                flush()
                group_key = (key, role_order[unit.role], unit.pp_rank)
            cache.clear()  # one pass pair in memory at a time
            for side, stages, pass_id in (("baseline", unit.baseline, b_pass), ("target", unit.target, t_pass)):
                notes.extend(_incomplete_pass_notes(unit, side, stages, pass_id))
                if len(stages) > 1 and _holds(stages, pass_id):  # a whole stage without it: its names are unknown
                    for index, stage in enumerate(stages):
                        if not _holds([stage], pass_id):
                            stage_gaps.setdefault((unit.role, unit.label, side, stage[0].pp_rank), []).append(pass_id)
            try:
                base_names = _names_in_order(unit.baseline, b_pass, cache)
                target_names = _names_in_order(unit.target, t_pass, cache)
                layouts = [_recorded_layout(unit.target, t_pass), _recorded_layout(unit.baseline, b_pass)]
            except _ReadError as exc:  # a damaged or ambiguous pass: exit 2, the other passes still compared
                problems.append(str(exc))
                continue
            # A rank without a pass its TP group ran (paired ranks; a merged unit reads every rank):
            # the other side's names are compared, and each row fails naming that rank.
            if not _holds(unit.target, t_pass) and not _holds(unit.baseline, b_pass):
                # Both sides' rank lacks it (their replicas ran it): no name to make a row of. Left
                # out, its data lost on both sides read "no divergence".
                lost_on_both.setdefault((unit.role, unit.label, unit.dp_rank), []).append(t_pass)
                continue
            if not _holds(unit.target, t_pass):
                target_names = dict(base_names)
            elif not _holds(unit.baseline, b_pass):
                base_names = dict(target_names)
            base_names_seen.update(base_names)
            target_names_seen.update(target_names)
            wanted = options.name_filter
            for side, names, other in (("target", target_names, base_names), ("baseline", base_names, target_names)):
                for name in names:
                    if name not in other and (wanted is None or wanted(name)):
                        missing_names.setdefault((unit.role, unit.label, unit.dp_rank, name, side),
                                                 PassRuns()).add(t_pass)
            for order, (name, t_stage) in enumerate(target_names.items()):
                if name not in base_names or (wanted is not None and not wanted(name)):
                    continue
                row = {"role": unit.role, "rank": unit.label, "pass": t_pass, "baseline_pass": b_pass,
                       "name": name, "order": order}
                if unit.dp_rank is not None:
                    row["dp_rank"] = unit.dp_rank
                try:
                    row.update(_compare_name(unit, pair, name, base_names[name], t_stage, options, layouts, cache))
                except _RowError as exc:
                    row.update({"status": "error" if exc.kind == "read" else "fail",
                                "reason": exc.reason, "max_abs": None})
                    if exc.path:
                        row["path"] = exc.path
                except ValueError as exc:  # a bad recorded layout rule
                    row.update({"status": "error", "reason": str(exc), "max_abs": None})
                # Execution order: the pass, then its PP stages in turn, then the tensor's position;
                # TP and DP ranks run the same position at once, so the lowest rank is named first.
                row["_key"] = (order, unit_index)
                group.append(row)
            progress.update(done, len(work), len(rows) + len(group), rows.failed)
        flush()
    finally:
        progress.close()

    for (role, label, side, pp), passes in stage_gaps.items():
        missing.append({"kind": "stage_passes", "only_in": "baseline" if side == "target" else "target",
                        "role": role, "rank": label, "pp_rank": pp, "side": side, "passes": passes})
    for (role, label, dp), passes in lost_on_both.items():
        missing.append({"kind": "rank_passes", "role": role, "rank": label, **({} if dp is None else {"dp_rank": dp}),
                        "passes": passes})
    for (role, label, dp, name, side), passes in missing_names.items():
        missing.append({"kind": "name", "only_in": side, "role": role, "rank": label,
                        **({} if dp is None else {"dp_rank": dp}), "name": name, **passes.as_item()})
    problems.extend(base_ds.problems)
    problems.extend(target_ds.problems)
    result = DiffResult(_roots(base_ds), _roots(target_ds), options, rows, missing, problems, notes)
    if result.compared == 0:
        common = base_names_seen & target_names_seen
        def listed(kind):  # the one-sided items of that kind, a line each
            return "".join(f"\n  {_missing_text(item)}" for item in missing if item["kind"] == kind)

        if not units:
            reason = "no rank in common" + listed("rank")
        elif not work and paired:  # the dumps have passes in common: --passes selected none of them
            target_ids = sorted({pair[2] for _, _, pair in paired})
            reason = (f"--passes {options.passes_spec!r} selects none of the {len(target_ids)} target pass(es) "
                      f"paired with a baseline pass (target pass ids {_span(target_ids)})")
        elif not work and options.align is not None and options.align[0] == "meta":
            # (it said "no passes in common", and suggested the --align given)
            _, key, value = options.align
            counts = [f"{side} {len(_meta_passes(holders, options.align))} of {len(holders)} passes"
                      for side, holders in zip(("baseline", "target"), map(_pass_holders, units[0].peers))]
            reason = (f"--align {options.align_spec!r}: no pass with metadata {key} == {value!r} on both sides "
                      f"({', '.join(counts)}; role {units[0].role}, rank {units[0].label})" + listed("passes"))
        elif not work and any(not _pass_holders(peers) for unit in units for peers in unit.peers):
            # (it said "no passes in common" and suggested --align: there was nothing to align)
            empty = [k for k in (0, 1) if all(not _pass_holders(unit.peers[k]) for unit in units)]
            running = any(ref.status == "running" for unit in units for k in empty or (0, 1) for ref in unit.peers[k])
            where = " and the ".join(("baseline", "target")[k] for k in empty) or "ranks compared"
            reason = (f"no pass in a segment file on the {where}"
                      + (" (a running rank keeps its ended passes in its open segment until the segment is full or "
                         "the Dumper is closed)" if running else ": nothing was dumped"))
        elif not work:
            reason = "no passes in common (--align order or meta:KEY=VALUE pairs passes by order)" + listed("passes")
        elif not (base_names_seen or target_names_seen) and problems:
            reason = "no pass could be read"
        elif not common:
            reason = (f"no tensor name in common ({len(base_names_seen)} baseline names, "
                      f"{len(target_names_seen)} target names): these look like dumps of different models")
        elif options.name_filter is not None and not len(rows):
            reason = f"--name {options.name_spec!r} matches no tensor present on both sides"
        else:
            reason = "no tensor could be compared: " + "; ".join(
                f"{row['name']}: {row.get('reason')}" for row in itertools.islice(rows, 3))
        raise DiffError(reason + "".join(f"\n  {problem}" for problem in problems))
    return result


def _merged_positions(group: list) -> dict:
    """{name: sort key} of the rows of one pass of one PP stage (all its TP and DP units): the units'
    own orders merged into one, the first unit's as it is, a name only a later unit holds placed
    right after the name that unit ran before it. Each row's ``order`` is its position in its own
    rank's pass: a rank lacking a tensor (dropped) put its later layers one place early, level with
    another rank's earlier layer, and the lower rank won the tie: layer 5 was named the first
    divergence where layer 4 of another TP rank diverged."""
    by_unit: dict = {}
    for row in group:
        by_unit.setdefault(row["_key"][1], []).append(row)
    keys: dict = {}
    inserted: dict = {}  # key -> names placed right after it so far
    first, *later = sorted(by_unit) or [None]
    for row in by_unit.get(first, []):
        keys[row["name"]] = (row["order"],)
    for unit_index in later:
        previous = (-1,)  # (before every name the earlier units hold)
        for row in sorted(by_unit[unit_index], key=lambda r: r["order"]):
            name = row["name"]
            if name not in keys:
                inserted[previous] = inserted.get(previous, 0) + 1
                keys[name] = previous + (inserted[previous],)
            previous = keys[name]
    return keys


def _roots(ds) -> list:
    return list(getattr(ds, "roots", [ds.root]))


# ------------------------------------------------------------------------------------------- CLI


def add_arguments(subparsers) -> None:
    p = subparsers.add_parser(
        "diff", help="compare two dumps; find the first divergent module (exit 0 same, 1 differ, 2 error)",
        description="Compare TARGET against BASELINE tensor by tensor. A tensor passes when every element "
                    "satisfies |a-b| <= atol + rtol*|b| (a: target, b: baseline; NaN equals NaN). "
                    "Exit status: 0 every compared tensor within tolerance, 1 some are not, "
                    "2 usage or read errors.")
    p.add_argument("baseline", nargs="?", help="baseline dump root (or a glob of roots)")
    p.add_argument("target", nargs="?", help="target dump root (or a glob of roots)")
    p.add_argument("--baseline-root", action="append", default=[], metavar="ROOT",
                   help="baseline root; repeat (or use a glob) for one root per host of a multi-node run")
    p.add_argument("--target-root", action="append", default=[], metavar="ROOT", help="target root; repeatable")
    p.add_argument("--role", action="append", help="compare only this role (repeatable; default: all)")
    p.add_argument("--rank", type=int, help="compare only this global rank (of the target)")
    p.add_argument("--passes", metavar="SPEC", help="target pass ids to compare, e.g. 0-3,7,10-")
    p.add_argument("--name", metavar="REGEX", help="only tensor names matching this regular expression (re.search)")
    p.add_argument("--atol", type=float, default=DEFAULT_ATOL, help="absolute tolerance (default 1e-5)")
    p.add_argument("--rtol", type=float, default=DEFAULT_RTOL, help="relative tolerance (default 1e-5)")
    p.add_argument("--tol", action="append", metavar="REGEX=ATOL,RTOL",
                   help="per-name tolerances (repeatable; the first matching REGEX wins)")
    p.add_argument("--metric", action="append", metavar="NAME[=X]",
                   help="pass/fail criterion, repeatable (all must hold): allclose (default, the rule above), "
                        "rel_diff[=X] (1-2Σab/Σ(a²+b²) <= X, default 1e-3), cosine[=X] (1-cosine <= X, "
                        "default 1e-3)")
    p.add_argument("--align", metavar="MODE",
                   help="pair passes by: id (default), offset:K (baseline pass p with target pass p+K), order "
                        "(n-th with n-th), meta:KEY=VALUE (n-th pass whose metadata KEY equals VALUE on each "
                        "side, e.g. meta:forward_mode=decode)")
    p.add_argument("--unshard", action="append", metavar="REGEX=DIM|replicated|sum",
                   help="how TP shards of matching names combine (default: inferred from shapes)")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 when anything was not compared: a tensor name or a pass on one side only "
                        "(default: listed as missing, exit 0 when every compared tensor passes)")
    p.add_argument("--allow-running", action="store_true",
                   help="compare dumps whose writer is still running (or was killed), or whose rank.json has "
                        "no status, as far as written")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--html", metavar="REPORT", help="also write a self-contained HTML report with plots")
    p.set_defaults(func=cmd_diff)


def _roots_arg(positional, repeated, side):
    import glob

    given = ([positional] if positional else []) + list(repeated)
    roots = []
    for item in given:
        # A path that exists is taken as it is: 'run[bf16]' is a directory, not a glob matching 'runb'.
        matches = sorted(glob.glob(item)) if glob.has_magic(item) and not os.path.exists(item) else [item]
        if not matches:
            raise DiffError(f"{side}: {item!r} matches no directory")
        roots.extend(matches)
    if not roots:
        raise DiffError(f"no {side} dump given (BASELINE TARGET, or --{side}-root)")
    return roots


def _check_report_path(path: str) -> None:
    """--html REPORT must name a file that can be written: found out after the comparison, the
    diff's verdict was lost to an error naming a temporary file."""
    if not path:
        raise DiffError("--html: give a file name")
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise DiffError(f"--html {path!r}: is a directory")
    why = not_a_report_file(path)
    if why:
        raise DiffError(f"--html {path!r}: {why}")
    if not os.path.isdir(folder):
        raise DiffError(f"--html {path!r}: no directory {folder!r}")
    if not os.access(folder, os.W_OK):
        raise DiffError(f"--html {path!r}: directory {folder!r} is not writable")


def cmd_diff(args) -> int:
    positional = [p for p in (args.baseline, args.target) if p]
    try:
        if len(positional) == 2:
            base_roots = _roots_arg(args.baseline, args.baseline_root, "baseline")
            target_roots = _roots_arg(args.target, args.target_root, "target")
        elif len(positional) == 1 and bool(args.baseline_root) != bool(args.target_root):
            # One positional plus the other side's --*-root.
            if args.baseline_root:
                base_roots = _roots_arg(None, args.baseline_root, "baseline")
                target_roots = _roots_arg(positional[0], args.target_root, "target")
            else:
                base_roots = _roots_arg(positional[0], [], "baseline")
                target_roots = _roots_arg(None, args.target_root, "target")
        elif not positional:
            base_roots = _roots_arg(None, args.baseline_root, "baseline")
            target_roots = _roots_arg(None, args.target_root, "target")
        else:
            raise DiffError("give BASELINE TARGET, or --baseline-root/--target-root")
        if args.html is not None:
            _check_report_path(args.html)  # before comparing: a diff may take hours
        result = diff(base_roots, target_roots, role=args.role, rank=args.rank, passes=args.passes,
                      name=args.name, atol=args.atol, rtol=args.rtol, tol=args.tol, metric=args.metric,
                      align=args.align, unshard=args.unshard, allow_running=args.allow_running, progress=True,
                      strict=args.strict)
        if args.html:
            try:
                result.to_html(args.html)
            except OSError as exc:  # (past _check_report_path: /proc/x, a full disk)
                raise DiffError(f"--html {args.html!r}: cannot be written ({exc.strerror or exc})") from None
    except (DiffError, ValueError, OSError) as exc:
        # Line by line: a path given may hold escape sequences, but the message's own lines stay lines.
        print("\n".join(printable(line) for line in f"fastdump diff: {exc}".split("\n")), file=sys.stderr)
        return 2
    try:
        if args.json:
            result.write_json(sys.stdout)
        else:
            for line in result.iter_lines():
                print(line)
            if args.html:
                print(printable(f"report: {args.html}"))  # (a name's escape sequences: not obeyed)
            sys.stdout.flush()
    except BrokenPipeError:  # `fastdump diff A B | head`: the verdict is the exit status
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return result.exit_code
