"""Every ``fastdump.attach`` option, defined once: its default, its check, its ``FASTDUMP_*`` variable.

``Options`` is what a Dumper runs with; ``EngineOptions`` (``Options.engine``) is the part that the
one staging engine of a process shares between its Dumpers: the first attach decides, a later attach
that asks for something else gets a warning naming the setting (``EngineOptions.differences``).

Each field's metadata holds the environment variable(s) that set it (``env``: ``EnvVar`` entries with
their string parser) and whether it is recorded in ``fastdump.json``'s ``config`` (``manifest``).
``fastdump.config`` (the profiling flag), ``fastdump info`` and the integrations read from here; a
new option is one field below.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import os
import re
import sys
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

from . import format as _fmt


# --- parsers: each takes the raw string and returns the value or raises ValueError(reason) ---

def _int(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    def parse(s: str) -> int:
        try:
            v = int(s.strip())
        except ValueError:
            v = minimum - 1
        if v < minimum or (maximum is not None and v > maximum):
            raise ValueError(f"must be an integer >= {minimum}" + (f" and <= {maximum}" if maximum is not None else ""))
        return v
    parse.__doc__ = f"integer >= {minimum}" + (f", <= {maximum}" if maximum is not None else "")
    return parse


def _positive_float(s: str) -> float:
    """number > 0"""
    try:
        v = float(s.strip())
    except ValueError:
        v = 0.0
    if not 0 < v < float("inf"):
        raise ValueError("must be a finite number > 0")
    return v


def _nonnegative_float(s: str) -> float:
    """number >= 0"""
    try:
        v = float(s.strip())
    except ValueError:
        v = -1.0
    if not 0 <= v < float("inf"):
        raise ValueError("must be a finite number >= 0")
    return v


def _mb_to_bytes(s: str) -> int:
    """MiB (number > 0)"""
    return max(1, int(_positive_float(s) * (1 << 20)))


_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


def _bool(s: str) -> bool:
    """0/1/true/false/yes/no/on/off"""
    v = s.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError("must be one of 0, 1, true, false, yes, no, on, off")


class BadRange(ValueError):
    """An item of a ``parse_ranges`` list that is not N, N-M (or N-), or that ends before it starts."""

    def __init__(self, part: str, reversed_: bool):
        super().__init__(part)
        self.part, self.reversed = part, reversed_


def parse_ranges(text: str, open_end: bool = False) -> list:
    """'0, 2-3,7-' -> [(0, 0), (2, 3), (7, None)]: comma-separated N and inclusive N-M (and N-, up
    to no end, where ``open_end``), in the order given, empty items skipped. Raises ``BadRange``;
    the caller words it (``layers=``, ``fastdump diff --passes``)."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        match = re.fullmatch(r"([0-9]+)\s*(?:(-)\s*([0-9]*))?", part)
        if not match or (match.group(2) and not match.group(3) and not open_end):
            raise BadRange(part, False)
        first = int(match.group(1))
        last = first if not match.group(2) else int(match.group(3)) if match.group(3) else None
        if last is not None and last < first:
            raise BadRange(part, True)
        out.append((first, last))
    return out


def _layers(s: str) -> tuple[int, ...]:
    """comma list of indices and inclusive ranges, e.g. 0,1,5-7"""
    out: set[int] = set()
    try:
        ranges = parse_ranges(s)
    except BadRange as exc:
        if exc.reversed:
            raise ValueError(f"bad range {exc.part!r}: end before start") from None
        raise ValueError(f"bad item {exc.part!r}: expected N or N-M with N, M >= 0, e.g. 0,1,5-7") from None
    for a, b in ranges:
        part = f"{a}-{b}" if a != b else str(a)
        if b > MAX_LAYER:  # (a typo's 0-10000000000 would be a set of 10^10 ints: minutes, then out of memory)
            raise ValueError(f"bad item {part!r}: layer indices go up to {MAX_LAYER}")
        out.update(range(a, b + 1))
    if not out:
        raise ValueError("no layer index given")
    return tuple(sorted(out))


def _regex(s: str) -> str:
    """Python regex, re.search on qualified module names"""
    try:
        re.compile(s)
    except re.error as e:
        raise ValueError(f"not a valid regular expression ({e})") from None
    return s


def _pattern(option: str, value):
    """include=/exclude=: a regular expression (str or compiled), or a list of them, which match
    when any does; kept as one str (or the compiled pattern as given). Checked at attach."""
    if value is None or isinstance(value, re.Pattern):
        return value
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple, set, frozenset)) or not items or \
            not all(isinstance(i, (str, re.Pattern)) for i in items):
        raise ValueError(f"{option} must be a regular expression (str or re.Pattern) or a non-empty list of "
                         f"them, not {value!r}")
    if len(items) == 1 and isinstance(next(iter(items)), re.Pattern):
        return _pattern(option, next(iter(items)))  # kept as given, its flags with it
    if any(isinstance(i, re.Pattern) and i.flags & ~re.UNICODE for i in items) and len(items) > 1:
        raise ValueError(f"{option}: a compiled pattern with flags cannot be joined with others (put the flags "
                         f"inline, e.g. '(?i)mlp'): {value!r}")
    texts = [getattr(i, "pattern", i) for i in items]
    if any(isinstance(t, bytes) for t in texts):
        raise ValueError(f"{option} must match str module names, not bytes: {value!r}")
    joined = texts[0] if len(texts) == 1 else "|".join(f"(?:{t})" for t in texts)
    try:
        re.compile(joined)
    except (re.error, TypeError) as exc:
        raise ValueError(f"{option}={value!r} is not a valid regular expression ({exc})") from None
    return joined


def _pass_range(s: str) -> tuple[int, int]:
    """start:stop pass ids, stop exclusive; start may be empty (0)"""
    lo, sep, hi = s.strip().partition(":")
    if not sep or not hi.strip().isdigit() or (lo.strip() and not lo.strip().isdigit()):
        raise ValueError("must be START:STOP with integers, e.g. 10:20 (stop exclusive)")
    a, b = int(lo or 0), int(hi)
    if b <= a:
        raise ValueError(_empty_range(a, b, f"{a}:{a + 1}"))
    return a, b


def _empty_range(start: int, stop: int, fix: str) -> str:
    """Why pass range [start, stop) is refused, with the setting meant: stop is exclusive, so 5:5
    holds no pass and dumped nothing without a word (the user meant pass 5)."""
    what = "holds no pass" if start == stop else "is backwards"
    return (f"stop must be greater than start: [{start}, {stop}) {what} (stop is exclusive); "
            f"for pass {start} alone give {fix}")


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(s: str) -> str:
        v = s.strip().lower()
        if v not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return v
    parse.__doc__ = "|".join(choices)
    return parse


def _names(s: str) -> tuple[str, ...]:
    """comma list of module class names, e.g. Linear,RMSNorm"""
    names = tuple(p.strip() for p in s.split(",") if p.strip())
    if not names or not all(n.isidentifier() for n in names):
        raise ValueError("must be a comma list of class names, e.g. Linear,RMSNorm")
    return names


def _role(s: str) -> str:
    """directory-safe name"""
    v = s.strip()
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", v):
        raise ValueError("must be a directory-safe name: letters, digits, '_', '.', '-'")
    return v


def _root(s: str) -> str:
    """directory path"""
    if s != s.strip():  # FASTDUMP_DIR=$(cat file) keeps the newline: the dump went to 'dump\n', not 'dump'
        raise ValueError("starts or ends with whitespace (a newline from $(...)?); no dump root is named so")
    # An env file (docker --env-file, systemd Environment=) or quotes leave these as typed: the dump
    # went to ./~/dump or ./$HOME/dump, where no one looks.
    if s.startswith("~") or re.search(r"\$(\{|[A-Za-z_])", s):
        raise ValueError("holds '~' or '$VAR' that no shell expanded; give the path itself")
    return s


CUDA_GRAPH_MODES = ("record", "skip")  # cuda_graphs=: see fastdump/staging/graphs.py
MAX_LAYER = (1 << 20) - 1  # layers=: far above any model's layer count
# The keys DumpSet.meta adds to every pass's metadata: set_pass_meta, begin_pass and pass_meta= refuse them.
RESERVED_META = _fmt.RESERVED_META_KEYS


@dataclass(frozen=True)
class EnvVar:
    """One ``FASTDUMP_*`` variable: the option (``kwarg``) it sets and how its string is parsed."""
    name: str
    kwarg: str
    parse: Callable[[str], Any]
    doc: str


def _opt(default, *env: tuple, manifest: bool = True):
    """A field with its default; ``env``: (variable, parser, doc) triples that set it."""
    return field(default=default, metadata={"env": env, "manifest": manifest})


# --- value checks shared by both dataclasses -------------------------------------------------------

def _check_int(what: str, value, minimum: int) -> None:
    """An integer (not a bool, not 1.5) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, not {value!r}")


def _check_number(what: str, value, above: float, at_most: float | None = None) -> None:
    """A finite real number (not a bool, not NaN) greater than ``above`` (and at most ``at_most``)."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
            or not value > above):
        raise ValueError(f"{what} must be a finite number > {above:g}, not {value!r}")
    if at_most is not None and value > at_most:
        raise ValueError(f"{what} must be at most {at_most:.15g} (MiB), not {value!r}")


# A ring larger than this (4 TiB) is a typo: 1e26 failed at attach with pybind11's "incompatible
# constructor arguments" (a byte count beyond 64 bits), recorded as the dump's error.
MAX_RING_MB = float(1 << 22)


def _check_choice(what: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{what} must be {' or '.join(repr(c) for c in choices)}, not {value!r}")


def _flag(what: str, value) -> bool:
    """A switch: True or False (1 or 0, numpy's bools); ``inputs="false"`` was taken as True."""
    if isinstance(value, bool) or (isinstance(value, numbers.Integral) and value in (0, 1)) \
            or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")):
        return bool(value)
    raise ValueError(f"{what} must be True or False, not {value!r}")


def _layer_list(value) -> tuple:
    """layers=: layer indices (a list, tuple, set, range or iterator), kept as a sorted tuple. Read
    once, here: an iterator read by this check was empty by the time the modules were selected, so
    no layer was dumped; an int or a str (``layers=5``, ``"0,1"``) is refused with the option's name."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ValueError(f"layers must be a list of layer indices (e.g. [0, 1, 5]), not {value!r}")
    out = set()
    for layer in value:
        _check_int("each of layers", layer, 0)
        if layer > MAX_LAYER:  # (range(10**12) would be checked for hours)
            raise ValueError(f"each of layers must be at most {MAX_LAYER}, not {layer!r}")
        out.add(int(layer))
    return tuple(sorted(out))


def _module_types(value) -> tuple:
    """module_types=: a class or class name, or a non-empty list of them, kept as a tuple. A str
    was read as its letters and a generator used up by fastdump.json, each keeping no module; a
    class alone failed while wrapping, after the writer had started."""
    items = (value,) if isinstance(value, (str, type)) else value
    if isinstance(items, Iterable) and not isinstance(items, (bytes, Mapping)):
        items = tuple(items)
        if items and all(isinstance(t, type) or (isinstance(t, str) and t.isidentifier()) for t in items):
            return items
    raise ValueError(f"module_types must be a class or class name (as type(module).__name__ gives it: "
                     f"'Linear', not 'nn.Linear'), or a non-empty list of them, not {value!r}")


def _pass_meta(value):
    """pass_meta=: the first pass's metadata, a dict whose keys are none of RESERVED_META (as
    set_pass_meta checks: a reader could not tell them from its own)."""
    if not isinstance(value, Mapping):
        raise ValueError(f"pass_meta must be a dict, not {value!r}")
    check_meta_keys("pass_meta", value)
    return dict(value)


def check_meta_keys(caller: str, meta) -> None:
    """ValueError naming ``caller`` when ``meta`` holds a key of RESERVED_META (pass_meta=,
    set_pass_meta, begin_pass)."""
    taken = [key for key in RESERVED_META if key in meta]
    if taken:
        raise ValueError(f"{caller}: {', '.join(map(repr, taken))}: a key fastdump's readers add to every "
                         f"pass's meta ({', '.join(RESERVED_META)}); use another name")


def _check_device(value) -> None:
    """device=: None, a CUDA index (int >= 0), or a device ('cuda:1', torch.device); 'cuda:x' failed
    while starting (dumping off, no error at attach) and 'banana' was ignored."""
    if value is None:
        return
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return _check_int("device", value, 0)
    text = str(value) if isinstance(value, str) or type(value).__name__ == "device" else None
    torch = sys.modules.get("torch")
    try:
        if text is None:
            raise ValueError
        if torch is not None:
            torch.device(text)  # (a Dumper of a model has torch imported: the check a model's .to() makes)
        if text.startswith("cuda") and not re.fullmatch(r"cuda(:\d+)?", text):
            raise ValueError
    except (ValueError, RuntimeError, TypeError):
        raise ValueError(f"device must be a CUDA device index or a device such as 'cuda:1', not {value!r}") from None


@dataclass(frozen=True)
class EngineOptions:
    """Settings of the one staging engine per process (ring, writer, device ring): the first attach
    decides them; see ``differences``."""
    writer: str = _opt("process", ("FASTDUMP_WRITER", _choice("process", "thread"),
                                   "HDF5 writer in its own process or a thread"))
    writer_priority: str = _opt("idle", ("FASTDUMP_WRITER_PRIORITY", _choice("idle", "normal"),
                                         "writer process on idle CPU only (idle, SCHED_IDLE) or at the model's "
                                         "priority (normal)"))
    ring_mb: float = _opt(256, ("FASTDUMP_RING_MB", _positive_float, "shared-memory host ring size, MiB"))
    device_ring_mb: float = _opt(256, ("FASTDUMP_DEVICE_RING_MB", _positive_float, "GPU staging ring size, MiB"))

    def __post_init__(self):
        _check_choice("writer", self.writer, ("process", "thread"))
        _check_choice("writer_priority", self.writer_priority, ("idle", "normal"))
        _check_number("ring_mb", self.ring_mb, above=0.25, at_most=MAX_RING_MB)
        _check_number("device_ring_mb", self.device_ring_mb, above=0, at_most=MAX_RING_MB)

    def differences(self, asked: "EngineOptions") -> list[str]:
        """``name=running (asked: value)`` for each setting ``asked`` wants otherwise; the running
        engine keeps its own. writer_priority only matters for a writer process."""
        out = []
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(asked, f.name)
            if f.name == "writer_priority" and self.writer != "process":
                continue
            if mine != theirs:
                out.append(f"{f.name}={mine!r} (asked: {theirs!r})")
        return out


_ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(EngineOptions))


@dataclass(frozen=True)
class Options:
    """Everything ``fastdump.attach(model, root, **options)`` accepts besides the model, in the
    order ``fastdump.json`` records them."""
    root: Any = _opt(None, ("FASTDUMP_DIR", _root, "dump root directory; unset or empty = dumping off"),
                     manifest=False)
    role: str = _opt("target", ("FASTDUMP_ROLE", _role, "role used when the code does not name one (default target)"))
    layers: Any = _opt(None, ("FASTDUMP_LAYERS", _layers,
                              "keep only these decoder layers (layers.N or model.layers.N); other modules unaffected"))
    include: Any = _opt(None, ("FASTDUMP_INCLUDE", _regex, "dump only modules whose qualified name matches"))
    exclude: Any = _opt(None, ("FASTDUMP_EXCLUDE", _regex, "never dump modules whose qualified name matches"))
    module_types: Any = _opt(None, ("FASTDUMP_MODULE_TYPES", _names, "dump only modules of these classes"))
    inputs: bool = _opt(False, ("FASTDUMP_INPUTS", _bool, "also dump module inputs (name.input.0 ...)"))
    skip_passes: int = _opt(0, ("FASTDUMP_SKIP", _int(0), "skip the first N passes (warm-up)"))
    every: int = _opt(1, ("FASTDUMP_EVERY", _int(1), "dump one pass in N"))
    pass_range: Any = _opt(None, ("FASTDUMP_PASSES", _pass_range, "dump only pass ids in [start, stop)"))
    max_bytes: Any = _opt(None, ("FASTDUMP_MAX_BYTES", _int(0), "stop dumping after this many bytes (recorded in rank.json)"),
                          ("FASTDUMP_MAX_MB", _mb_to_bytes, "same budget in MiB (do not set both)"))
    policy: str = _opt("block", ("FASTDUMP_POLICY", _choice("block", "drop"),
                                 "full ring: wait (block) or drop and count (drop)"))
    block_timeout_s: float = _opt(5.0, ("FASTDUMP_BLOCK_TIMEOUT_S", _positive_float,
                                        "policy=block: the longest a forward waits for ring space; then drop "
                                        "(counted) until the writer catches up"))
    writer: str = field(default=EngineOptions.__dataclass_fields__["writer"].default, metadata={"manifest": True})
    writer_priority: str = field(default=EngineOptions.__dataclass_fields__["writer_priority"].default, metadata={"manifest": True})
    ring_mb: float = field(default=EngineOptions.__dataclass_fields__["ring_mb"].default, metadata={"manifest": True})
    device_ring_mb: float = field(default=EngineOptions.__dataclass_fields__["device_ring_mb"].default, metadata={"manifest": True})
    cuda_graphs: str = _opt("record", ("FASTDUMP_CUDA_GRAPHS", _choice(*CUDA_GRAPH_MODES),
                                       "CUDA graphs: record module outputs into captured graphs, one pass per replay "
                                       "(record), or skip tensors hooked during a capture (skip)"))
    graph_ring_mb: float = _opt(256, ("FASTDUMP_GRAPH_RING_MB", _positive_float,
                                      "per GPU and Dumper: CUDA-graph recording memory, MiB (half static slots, "
                                      "half replay ring)"))
    # 256, not 64: a segment costs the writer ~10 ms of CPU (a dataset per name and layout, its
    # writes, rank.json); on a small model (~100 tensors per pass) 64 passes made that ~1.5 us per
    # tensor, a third of the writer's CPU (benchmarks/RESULTS.md, 0e). segment_mb and
    # segment_seconds still bound a segment of large passes, segment_idle_seconds its latency.
    segment_passes: int = _opt(256, ("FASTDUMP_SEGMENT_PASSES", _int(1), "start a new .h5 segment after N passes"))
    segment_mb: float = _opt(256, ("FASTDUMP_SEGMENT_MB", _positive_float, "start a new .h5 segment after N MiB"))
    segment_seconds: float = _opt(30.0, ("FASTDUMP_SEGMENT_SECONDS", _positive_float,
                                         "start a new .h5 segment after N seconds"))
    segment_idle_seconds: float = _opt(1.0, ("FASTDUMP_SEGMENT_IDLE_SECONDS", _nonnegative_float,
                                             "writer idle this long after a pass ended: write the open segment "
                                             "(0 = never)"))
    root_passes: bool = _opt(True, manifest=False)
    root_name: Any = _opt(None, manifest=False)
    strict: bool = _opt(False, ("FASTDUMP_STRICT", _bool,
                                "fail at attach if dumping cannot start (default: log, serve on)"), manifest=False)
    pass_meta: Any = _opt(None, manifest=False)
    device: Any = _opt(None, manifest=False)
    tp_rank: Any = _opt(None, ("FASTDUMP_TP_RANK", _int(0, _fmt.MAX_PARALLEL_SIZE - 1),
                               "tensor-parallel rank (default: from torch.distributed / launcher)"), manifest=False)
    tp_size: Any = _opt(None, ("FASTDUMP_TP_SIZE", _int(1, _fmt.MAX_PARALLEL_SIZE), "tensor-parallel size"), manifest=False)
    pp_rank: Any = _opt(None, ("FASTDUMP_PP_RANK", _int(0, _fmt.MAX_PARALLEL_SIZE - 1), "pipeline-parallel rank"), manifest=False)
    pp_size: Any = _opt(None, ("FASTDUMP_PP_SIZE", _int(1, _fmt.MAX_PARALLEL_SIZE), "pipeline-parallel size"), manifest=False)
    dp_rank: Any = _opt(None, manifest=False)
    dp_size: Any = _opt(None, manifest=False)
    ep_rank: Any = _opt(None, manifest=False)
    ep_size: Any = _opt(None, manifest=False)

    def __post_init__(self):
        """Bad settings fail at attach, before the model runs, with one clear message."""
        root, role = self.root, self.role
        if not isinstance(root, (str, os.PathLike)) or not os.fspath(root).strip() \
                or "\0" in str(os.fspath(root)):  # (no file name holds NUL: mkdir would fail after attach)
            raise ValueError(f"root must be a non-empty directory path, not {root!r}")
        if not isinstance(role, str) or not role or "/" in role or role in (".", "..") or "\0" in role:
            raise ValueError(f"role must be a plain directory name, not {role!r}")
        if role in _fmt.ROOT_NAMES:  # (fastdump's own names at the root: the role's directory cannot be made there)
            raise ValueError(f"role {role!r} is a name fastdump uses at the dump root ({', '.join(_fmt.ROOT_NAMES)}): "
                             "give another role")
        if len(os.fsencode(role)) > 255:  # NAME_MAX: mkdir failed after attach (ENAMETOOLONG), dumping off
            raise ValueError(f"role must be a directory name of at most 255 bytes, not {len(os.fsencode(role))}")
        root_name = self.root_name
        if root_name is not None and not (isinstance(root_name, str) and root_name and not _fmt.reads_as_call(root_name)):
            raise ValueError(f"root_name must be a non-empty string without a '#<digits>' part (a repeated "
                             f"call's), not {root_name!r}")
        _check_choice("policy", self.policy, ("block", "drop"))
        _check_number("block_timeout_s", self.block_timeout_s, above=0)
        self.engine  # the engine-wide settings are checked by EngineOptions
        _check_int("every", self.every, 1)
        _check_int("skip_passes", self.skip_passes, 0)
        _check_int("segment_passes", self.segment_passes, 1)
        if self.max_bytes is not None:
            _check_int("max_bytes", self.max_bytes, 0)
        pass_range = self.pass_range
        if pass_range is not None:
            if not isinstance(pass_range, (tuple, list)) or len(pass_range) != 2:
                raise ValueError(f"pass_range must be (start, stop) with start < stop, not {pass_range!r}")
            _check_int("pass_range start", pass_range[0], 0)
            _check_int("pass_range stop", pass_range[1], 0)
            if pass_range[0] >= pass_range[1]:  # (5, 5) dumped nothing, silently
                raise ValueError(f"pass_range {tuple(pass_range)!r}: "
                                 + _empty_range(pass_range[0], pass_range[1], f"({pass_range[0]}, {pass_range[0] + 1})"))
        if self.layers is not None:
            object.__setattr__(self, "layers", _layer_list(self.layers))
        if self.module_types is not None:
            object.__setattr__(self, "module_types", _module_types(self.module_types))
        for name in ("inputs", "strict", "root_passes"):
            object.__setattr__(self, name, _flag(name, getattr(self, name)))
        if self.pass_meta is not None:
            object.__setattr__(self, "pass_meta", _pass_meta(self.pass_meta))
        _check_device(self.device)
        for name in ("include", "exclude"):
            object.__setattr__(self, name, _pattern(name, getattr(self, name)))
        _check_choice("cuda_graphs", self.cuda_graphs, CUDA_GRAPH_MODES)
        _check_number("graph_ring_mb", self.graph_ring_mb, above=0, at_most=MAX_RING_MB)
        _check_number("segment_mb", self.segment_mb, above=0)
        _check_number("segment_seconds", self.segment_seconds, above=0)
        idle = self.segment_idle_seconds
        if not (isinstance(idle, numbers.Real) and not isinstance(idle, bool) and idle == 0):  # 0: never
            _check_number("segment_idle_seconds (or 0: never)", idle, above=0)

    @property
    def engine(self) -> EngineOptions:
        return EngineOptions(**{name: getattr(self, name) for name in _ENGINE_FIELDS})

    @property
    def rank_args(self) -> dict:
        """The rank options, as ``capture.resolve_ranks`` takes them."""
        return {name: getattr(self, name) for name in RANK_FIELDS}

    def manifest_config(self) -> dict:
        """The ``config`` object of ``fastdump.json`` and of the writer's channel: JSON values only."""
        out = {}
        for f in dataclasses.fields(self):
            if f.metadata.get("manifest", False):
                out[f.name] = _to_json(f.name, getattr(self, f.name))
        return out


def check_option_names(caller: str, names) -> None:
    """TypeError naming each keyword ``caller`` does not take, with the closest option: a misspelt
    ``attach(model, root, evry=2)`` said "Options.__init__() got an unexpected keyword argument"."""
    import difflib

    unknown = sorted(set(names) - (OPTION_NAMES - {"root"}))
    if unknown:
        hints = []
        for name in unknown:
            near = difflib.get_close_matches(name, sorted(OPTION_NAMES - {"root"}), n=1)
            hints.append(f"{name!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
        raise TypeError(f"{caller}: unknown option(s) {', '.join(hints)}; the options are listed in README.md "
                        "(Use) and fastdump/options.py")


# The rank options: rank.json's "rank" object without the world rank, which capture/ranks.py derives.
RANK_FIELDS = tuple(key for key in _fmt.RANK_KEYS if key != "rank")


def _field_of(cls, name):
    return cls.__dataclass_fields__[name]


def _to_json(name: str, value):
    if name == "layers":
        return sorted(value) if value is not None else None
    if name in ("include", "exclude"):
        return getattr(value, "pattern", value)
    if name == "module_types":
        return [getattr(t, "__name__", str(t)) for t in value or ()]
    if name == "pass_range":
        return [int(p) for p in value] if value is not None else None
    if name in ("skip_passes", "every"):
        return int(value)
    if name == "inputs":
        return bool(value)
    return value


def _env_vars() -> tuple[EnvVar, ...]:
    """Every variable in field order; the engine-wide fields' variables are declared on EngineOptions."""
    out = []
    for f in dataclasses.fields(Options):
        source = _field_of(EngineOptions, f.name) if f.name in _ENGINE_FIELDS else f
        out.extend(EnvVar(name, f.name, parse, doc) for name, parse, doc in source.metadata.get("env", ()))
    return tuple(out)


ENV_VARS: tuple[EnvVar, ...] = _env_vars()
OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(Options))
DEFAULTS = {f.name: f.default for f in dataclasses.fields(Options)}


# --- variables read at run time, outside the options (fastdump.config lists them: OTHER_VARS) ---

class ConfigError(ValueError):
    """An invalid ``FASTDUMP_*`` value; the message names the variable and the value."""


def _exactly(*choices: str):
    def parse(s: str) -> str:
        if s not in choices:
            raise ValueError(f"must be exactly {' or '.join(choices)}")
        return s
    return parse


def _digits(s: str) -> int:
    """What C's atoll reads whole: '1e3' was read as 1, '0x10' as 0 (then ignored)."""
    if not (s.isascii() and s.isdigit() and int(s) >= 1):
        raise ValueError("must be an integer >= 1 (digits only)")
    return int(s)


def _decimal(s: str) -> float:
    """What C's atof reads whole, > 0: '0x10' and 'inf' are numbers to atof, not to a reader of the docs."""
    if not re.fullmatch(r"(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", s) or not 0 < float(s) < float("inf"):
        raise ValueError("must be a decimal number > 0")
    return float(s)


# Checks of OTHER_VARS read at run time (by the writer, the engine, the C++ CUDA stager). These are
# read where they are used, without fastdump.config; a value they would misread ('true' where the CUDA
# stager looks for '1', FASTDUMP_NO_DIRECT_IO=0 read as set) is a ConfigError at attach instead (check_runtime_env).
# (Build-time variables are setup.py's.)
_RUNTIME_CHECKS = {
    "FASTDUMP_EXIT_TIMEOUT_S": _nonnegative_float,
    "FASTDUMP_NO_DIRECT_IO": _bool,
    "FASTDUMP_TORCH_READER": _exactly("0", "1"),
    "FASTDUMP_CUDA_BATCH": _exactly("0", "1"),
    "FASTDUMP_CUDA_CHECK_EACH_TENSOR": _exactly("0", "1"),
    "FASTDUMP_CUDA_REGISTER_PIECE_MB": _digits,
    "FASTDUMP_CUDA_EVENTS_EVERY": _digits,
    "FASTDUMP_CUDA_HOLD_MS": _decimal,
}


def check_runtime_env(environ: Mapping[str, str] = os.environ) -> None:
    """ConfigError naming the first variable read at run time (the writer's, the engine's, the CUDA
    stager's: _RUNTIME_CHECKS) whose value its reader would misread. Called by config.parse_env and by
    every Dumper at attach, before anything is made: a direct ``fastdump.attach()`` took
    FASTDUMP_CUDA_HOLD_MS=abc, and the C++ stager read it as 0 without a word."""
    for name, check in _RUNTIME_CHECKS.items():
        raw = environ.get(name)
        if raw is not None and raw != "":  # (empty: unset, as each reader takes it)
            try:
                check(raw)
            except ValueError as e:
                raise ConfigError(f"{name}={raw!r}: {e}") from None


# FASTDUMP_* variables set that nothing reads are warned about at every attach (a misspelling is
# otherwise ignored without a word). Variables read elsewhere, not attach settings: known, so never reported as misspelt.
OTHER_VARS = {
    "FASTDUMP_EXIT_TIMEOUT_S": "interpreter exit: seconds (default 30) to close Dumpers and stop the writer; "
                               "then the writer is killed",
    "FASTDUMP_NO_DIRECT_IO": "writer: 1 = write through the page cache, never O_DIRECT",
    "FASTDUMP_CUDA": "build (setup.py): 1 = CUDA path required, 0 = CPU-only build",
    "FASTDUMP_CUDA_ARCHS": "build (setup.py): CUDA architectures to compile for",
    "FASTDUMP_TORCH_READER": "build (setup.py): 1 = fastdump._torch_reader required, 0 = not built; "
                             "run time: 0 = read tensors through their Python attributes",
    "FASTDUMP_CUPY": "build (setup.py): the CuPy wheel the cuda extra names (e.g. cupy-cuda12x)",
    # Read by the CUDA stager (csrc/cuda_staging.cu, docs/CUDA.md) when it starts.
    "FASTDUMP_CUDA_BATCH": "CUDA: 0 = no cudaMemcpyBatchAsync (one copy per record)",
    "FASTDUMP_CUDA_REGISTER_PIECE_MB": "CUDA: MiB per cudaHostRegister call pinning the ring (default 256)",
    "FASTDUMP_CUDA_HOLD_MS": "CUDA: ms an open batch waits before the drain seals it (default 2)",
    "FASTDUMP_CUDA_CHECK_EACH_TENSOR": "CUDA: 1 = ask the capture state for every tensor (captures begun mid-pass)",
    "FASTDUMP_CUDA_EVENTS_EVERY": "CUDA: snapshots per completion event (default 64)",
    # Read by the test double of the CUDA runtime (tests/cuda_mock/cuda_runtime.h, docs/CUDA.md).
    "FASTDUMP_MOCK_SEED": "tests: seed of the CUDA mock runtime's random stream delays (0 = random)",
}

_ENV_BY_NAME = {v.name: v for v in ENV_VARS}

_WARNED_UNKNOWN: set = set()  # unknown names warned about in this process (warn_unknown_env_once)


def unknown_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """{name: warning text} for each FASTDUMP_* variable set that nothing reads (a misspelling),
    with the closest known name."""
    out = {}
    for key in environ:
        if key.startswith("FASTDUMP_") and key not in _ENV_BY_NAME and key not in OTHER_VARS:
            near = difflib.get_close_matches(key, list(_ENV_BY_NAME) + list(OTHER_VARS), n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            out[key] = f"unknown environment variable {key}{hint}; ignored"
    return out


def warn_unknown_env_once(environ: Mapping[str, str] = os.environ) -> None:
    """The misspelling warning at every attach, not only maybe_attach's: a direct ``attach()`` with
    FASTDUMP_NO_DIRECTIO=1 or FASTDUMP_EXIT_TIMEOUT=5 set ignored it without a word. Once per name
    and process (maybe_attach's parse_env has already said it)."""
    for key, text in unknown_env(environ).items():
        if key not in _WARNED_UNKNOWN:
            _WARNED_UNKNOWN.add(key)
            warnings.warn(text, stacklevel=_user_stacklevel())


def _user_stacklevel() -> int:
    """The stacklevel of the first frame outside the fastdump package, so that a warning names the
    user's line (maybe_attach's named fastdump/__init__.py)."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    return level
