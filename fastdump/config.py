"""The profiling flag: ``FASTDUMP_*`` environment variables -> ``fastdump.attach`` keyword arguments.

``maybe_attach(model)`` is meant to stay in serving code permanently: with ``FASTDUMP_DIR`` unset it
costs one dict lookup and never touches the model. With it set, every variable is parsed and checked
first, so a typo fails at start-up with one message instead of after the model was half-instrumented.

Precedence: keyword arguments given in code > ``FASTDUMP_*`` variables > ``attach``'s defaults.
"""

from __future__ import annotations

import difflib
import inspect
import os
import re
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping

__all__ = ["ConfigError", "ENV_VARS", "env_table", "settings_from_env", "maybe_attach"]


class ConfigError(ValueError):
    """An invalid ``FASTDUMP_*`` value; the message names the variable and the value."""


# --- parsers: each takes the raw string and returns the value or raises ValueError(reason) ---

def _int(minimum: int) -> Callable[[str], int]:
    def parse(s: str) -> int:
        try:
            v = int(s.strip())
        except ValueError:
            v = minimum - 1
        if v < minimum:
            raise ValueError(f"must be an integer >= {minimum}")
        return v
    parse.__doc__ = f"integer >= {minimum}"
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


def _layers(s: str) -> tuple[int, ...]:
    """comma list of indices and inclusive ranges, e.g. 0,1,5-7"""
    out: set[int] = set()
    for part in s.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if not lo.strip().isdigit() or (sep and not hi.strip().isdigit()):
            raise ValueError(f"bad item {part!r}: expected N or N-M with N, M >= 0, e.g. 0,1,5-7")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a:
            raise ValueError(f"bad range {part!r}: end before start")
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


def _pass_range(s: str) -> tuple[int, int]:
    """start:stop pass ids, stop exclusive; start may be empty (0)"""
    lo, sep, hi = s.strip().partition(":")
    if not sep or not hi.strip().isdigit() or (lo.strip() and not lo.strip().isdigit()):
        raise ValueError("must be START:STOP with integers, e.g. 10:20 (stop exclusive)")
    a, b = int(lo or 0), int(hi)
    if b <= a:
        raise ValueError("stop must be greater than start")
    return a, b


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
    return s


@dataclass(frozen=True)
class EnvVar:
    name: str
    kwarg: str
    parse: Callable[[str], Any]
    doc: str


ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar("FASTDUMP_DIR", "root", _root, "dump root directory; unset or empty = dumping off"),
    EnvVar("FASTDUMP_ROLE", "role", _role, "role used when the code does not name one (default target)"),
    EnvVar("FASTDUMP_LAYERS", "layers", _layers, "keep only these decoder layers (model.layers.N); other modules unaffected"),
    EnvVar("FASTDUMP_INCLUDE", "include", _regex, "dump only modules whose qualified name matches"),
    EnvVar("FASTDUMP_EXCLUDE", "exclude", _regex, "never dump modules whose qualified name matches"),
    EnvVar("FASTDUMP_MODULE_TYPES", "module_types", _names, "dump only modules of these classes"),
    EnvVar("FASTDUMP_INPUTS", "inputs", _bool, "also dump module inputs (name.input.0 ...)"),
    EnvVar("FASTDUMP_SKIP", "skip_passes", _int(0), "skip the first N passes (warm-up)"),
    EnvVar("FASTDUMP_EVERY", "every", _int(1), "dump one pass in N"),
    EnvVar("FASTDUMP_PASSES", "pass_range", _pass_range, "dump only pass ids in [start, stop)"),
    EnvVar("FASTDUMP_MAX_BYTES", "max_bytes", _int(0), "stop dumping after this many bytes (recorded in rank.json)"),
    EnvVar("FASTDUMP_MAX_MB", "max_bytes", _mb_to_bytes, "same budget in MiB (do not set both)"),
    EnvVar("FASTDUMP_POLICY", "policy", _choice("block", "drop"), "full ring: wait (block) or drop and count (drop)"),
    EnvVar("FASTDUMP_BLOCK_TIMEOUT_S", "block_timeout_s", _positive_float,
           "policy=block: the longest a forward waits for ring space; then drop (counted) until the writer catches up"),
    EnvVar("FASTDUMP_WRITER", "writer", _choice("process", "thread"), "HDF5 writer in its own process or a thread"),
    EnvVar("FASTDUMP_WRITER_PRIORITY", "writer_priority", _choice("idle", "normal"),
           "writer process on idle CPU only (idle, SCHED_IDLE) or at the model's priority (normal)"),
    EnvVar("FASTDUMP_RING_MB", "ring_mb", _positive_float, "shared-memory host ring size, MiB"),
    EnvVar("FASTDUMP_DEVICE_RING_MB", "device_ring_mb", _positive_float, "GPU staging ring size, MiB"),
    EnvVar("FASTDUMP_CUDA_GRAPHS", "cuda_graphs", _choice("record", "skip"),
           "CUDA graphs: record module outputs into captured graphs, one pass per replay (record), "
           "or skip tensors hooked during a capture (skip)"),
    EnvVar("FASTDUMP_GRAPH_RING_MB", "graph_ring_mb", _positive_float,
           "per GPU and Dumper: CUDA-graph recording memory, MiB (half static slots, half replay ring)"),
    EnvVar("FASTDUMP_SEGMENT_PASSES", "segment_passes", _int(1), "start a new .h5 segment after N passes"),
    EnvVar("FASTDUMP_SEGMENT_MB", "segment_mb", _positive_float, "start a new .h5 segment after N MiB"),
    EnvVar("FASTDUMP_SEGMENT_SECONDS", "segment_seconds", _positive_float, "start a new .h5 segment after N seconds"),
    EnvVar("FASTDUMP_SEGMENT_IDLE_SECONDS", "segment_idle_seconds", _nonnegative_float,
           "writer idle this long after a pass ended: write the open segment (0 = never)"),
    EnvVar("FASTDUMP_STRICT", "strict", _bool, "fail at attach if dumping cannot start (default: log, serve on)"),
    EnvVar("FASTDUMP_TP_RANK", "tp_rank", _int(0), "tensor-parallel rank (default: from torch.distributed / launcher)"),
    EnvVar("FASTDUMP_TP_SIZE", "tp_size", _int(1), "tensor-parallel size"),
    EnvVar("FASTDUMP_PP_RANK", "pp_rank", _int(0), "pipeline-parallel rank"),
    EnvVar("FASTDUMP_PP_SIZE", "pp_size", _int(1), "pipeline-parallel size"),
)
_BY_NAME = {v.name: v for v in ENV_VARS}

# Variables read elsewhere, not attach settings: known, so never reported as misspelt.
OTHER_VARS = {
    "FASTDUMP_EXIT_TIMEOUT_S": "interpreter exit: seconds (default 30) to close Dumpers and stop the writer; "
                               "then the writer is killed",
    "FASTDUMP_NO_DIRECT_IO": "writer: 1 = write through the page cache, never O_DIRECT",
    "FASTDUMP_CUDA": "build (setup.py): 1 = CUDA path required, 0 = CPU-only build",
    "FASTDUMP_CUDA_ARCHS": "build (setup.py): CUDA architectures to compile for",
}


def _parse_all(environ: Mapping[str, str]) -> dict[str, Any]:
    """Every FASTDUMP_* variable that is set, parsed to attach kwargs (FASTDUMP_DIR included if set)."""
    out: dict[str, Any] = {}
    for var in ENV_VARS:
        raw = environ.get(var.name)
        if raw is None or (var.name == "FASTDUMP_DIR" and raw == ""):
            continue
        try:
            value = var.parse(raw)
        except ValueError as e:
            raise ConfigError(f"{var.name}={raw!r}: {e}") from None
        if var.kwarg in out:  # FASTDUMP_MAX_BYTES and FASTDUMP_MAX_MB
            raise ConfigError(f"{var.name}={raw!r}: conflicts with FASTDUMP_MAX_BYTES; set only one of them")
        out[var.kwarg] = value
    # A misspelt variable would otherwise be ignored silently: the dump then differs from what was asked.
    for key in environ:
        if key.startswith("FASTDUMP_") and key not in _BY_NAME and key not in OTHER_VARS:
            near = difflib.get_close_matches(key, _BY_NAME, n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            warnings.warn(f"unknown environment variable {key}{hint}; ignored", stacklevel=3)
    return out


def settings_from_env(environ: Mapping[str, str] = os.environ) -> dict[str, Any] | None:
    """``attach`` kwargs from ``FASTDUMP_*`` (``root`` included), or None when FASTDUMP_DIR is unset/empty.

    Raises ConfigError naming the variable and its value for the first invalid one."""
    if not environ.get("FASTDUMP_DIR"):
        return None
    return _parse_all(environ)


def _attach_params() -> dict[str, inspect.Parameter]:
    """attach's keyword parameters, including the options it forwards to Dumper."""
    from . import attach
    from .capture import Dumper

    params = {**inspect.signature(Dumper.__init__).parameters, **inspect.signature(attach).parameters}
    return {k: p for k, p in params.items()
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and k not in ("self", "model", "root", "ranks")}


def _attach_defaults() -> dict[str, Any]:
    try:
        params = _attach_params()
    except Exception:  # core not importable (e.g. `fastdump info` on a broken build): show no defaults
        return {}
    return {k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty}


def env_table() -> list[dict[str, Any]]:
    """One dict per variable: name, kwarg, format, default (attach's own, so it never drifts), doc."""
    defaults = _attach_defaults()
    return [
        {"name": v.name, "kwarg": v.kwarg, "format": (v.parse.__doc__ or "").strip(),
         "default": None if v.name == "FASTDUMP_DIR" else defaults.get(v.kwarg), "doc": v.doc}
        for v in ENV_VARS
    ]


def maybe_attach(model, role: str | None = None, *, environ: Mapping[str, str] = os.environ, **overrides):
    """``fastdump.attach(model, ...)`` when FASTDUMP_DIR is set, else None (one dict lookup, model untouched).

    ``role`` and ``overrides`` come from code and win over the environment; FASTDUMP_ROLE applies only
    when ``role`` is None. Everything is validated before the model is touched."""
    if not environ.get("FASTDUMP_DIR"):
        return None
    settings = _parse_all(environ)
    from . import attach

    unknown = set(overrides) - set(_attach_params())
    if unknown:
        raise TypeError(f"maybe_attach: unknown attach argument(s) {', '.join(sorted(unknown))}")
    settings.update(overrides)
    root = settings.pop("root")
    settings["role"] = role if role is not None else settings.get("role", "target")
    return attach(model, root, **settings)
