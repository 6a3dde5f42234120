"""The profiling flag: ``FASTDUMP_*`` environment variables -> ``fastdump.attach`` keyword arguments.

``maybe_attach(model)`` is meant to stay in serving code permanently: with ``FASTDUMP_DIR`` unset it
costs one dict lookup and never touches the model. With it set, every variable is parsed and checked
first, so a typo fails at start-up with one message instead of after the model was half-instrumented.

Precedence: keyword arguments given in code > ``FASTDUMP_*`` variables > ``attach``'s defaults.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Mapping

from .options import DEFAULTS, ENV_VARS, OPTION_NAMES, EnvVar, Options  # noqa: F401 - EnvVar re-exported
from .options import _bool, _nonnegative_float  # noqa: F401
from .options import ConfigError, check_runtime_env, _RUNTIME_CHECKS  # noqa: F401 - defined with the options
from .options import check_option_names
from .options import OTHER_VARS, unknown_env, warn_unknown_env_once, _WARNED_UNKNOWN, _user_stacklevel  # noqa: F401 - defined with the variables

__all__ = ["ConfigError", "ENV_VARS", "env_table", "parse_env", "settings_from_env", "maybe_attach"]


_BY_NAME = {v.name: v for v in ENV_VARS}

def parse_env(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """Every FASTDUMP_* variable that is set, parsed to attach kwargs (FASTDUMP_DIR included if set).

    Raises ConfigError naming the variable and its value for the first invalid one; warns about
    FASTDUMP_* names it does not know."""
    out: dict[str, Any] = {}
    for var in ENV_VARS:
        raw = environ.get(var.name)
        if raw is None or (var.name == "FASTDUMP_DIR" and raw == ""):
            continue
        try:
            value = var.parse(raw)
            _check_alone(var.kwarg, value)
        except ValueError as e:
            raise ConfigError(f"{var.name}={raw!r}: {e}") from None
        if var.kwarg in out:  # FASTDUMP_MAX_BYTES and FASTDUMP_MAX_MB
            raise ConfigError(f"{var.name}={raw!r}: conflicts with FASTDUMP_MAX_BYTES; set only one of them")
        out[var.kwarg] = value
    for rank, size in (("tp_rank", "tp_size"), ("pp_rank", "pp_size")):  # (attach said 'tp_rank=2 is outside ...')
        if rank in out and size in out and out[rank] >= out[size]:
            r, z = (f"FASTDUMP_{k.upper()}" for k in (rank, size))
            raise ConfigError(f"{r}={environ[r]!r}: must be below {z}={environ[z]!r}")
    check_runtime_env(environ)
    # A misspelt variable would otherwise be ignored silently: the dump then differs from what was asked.
    for key, text in unknown_env(environ).items():
        _WARNED_UNKNOWN.add(key)
        warnings.warn(text, stacklevel=_user_stacklevel())
    return out


def _check_alone(kwarg: str, value) -> None:
    """The checks ``attach`` makes (Options), on this one setting: a value the parser took but
    attach refuses (FASTDUMP_RING_MB=0.1, a blank FASTDUMP_DIR) failed later with a message that
    named the option, not the variable."""
    Options(**{"root": "."} | {kwarg: value})


def settings_from_env(environ: Mapping[str, str] = os.environ) -> dict[str, Any] | None:
    """``attach`` kwargs from ``FASTDUMP_*`` (``root`` included), or None when FASTDUMP_DIR is unset/empty.

    Raises ConfigError naming the variable and its value for the first invalid one."""
    if not environ.get("FASTDUMP_DIR"):
        return None
    return parse_env(environ)


def env_table() -> list[dict[str, Any]]:
    """One dict per variable: name, kwarg, format, default (fastdump.options', so it never drifts), doc."""
    defaults = DEFAULTS
    return [
        {"name": v.name, "kwarg": v.kwarg, "format": (v.parse.__doc__ or "").strip(),
         "default": None if v.name == "FASTDUMP_DIR" else defaults.get(v.kwarg), "doc": v.doc}
        for v in ENV_VARS
    ]


def maybe_attach(model, role: str | None = None, *, environ: Mapping[str, str] = os.environ, **overrides):
    """``fastdump.attach(model, ...)`` when FASTDUMP_DIR is set, else None (one dict lookup, model untouched).

    ``role`` and ``overrides`` come from code and win over the environment; FASTDUMP_ROLE applies only
    when ``role`` is None. Everything is validated before the model is touched."""
    if overrides:  # (a misspelt keyword fails with the flag off too, not first in production)
        check_option_names("maybe_attach", overrides)
    if not environ.get("FASTDUMP_DIR"):
        return None
    settings = parse_env(environ)
    from . import attach

    settings.update(overrides)
    root = settings.pop("root")
    settings["role"] = role if role is not None else settings.get("role", "target")
    return attach(model, root, **settings)
