"""The shape of the values a pass holds: containers and dataclasses walked as capture walks
them, the structure record of outputs whose stored names do not tell it, and a pass's
metadata as JSON.

A helper of the Dumper's modules (fastdump/capture/dumper.py); see docs/INTERNALS.md.
"""

from __future__ import annotations

import dataclasses
import enum

from .tensors import _Tensor, _torch


_MISSING = object()
_MAX_NESTING = 32  # containers inside containers in one output; deeper is skipped with the reason


def _is_dataclass_instance(value) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _structure_of(value):
    """({part path: container kind}, whether it holds a tensor) of an output: path "" is the output,
    ".k" its part k (the suffix its stored names get), kind "tuple", "list", "dict" or
    "dataclass", with ":empty" when that container holds no tensor or array at any depth. kinds
    None: nothing the stored names do not already say (no container holding no tensor, no dict
    with a key like "0"). Cycles and depth are cut as _emit cuts them."""
    kinds: dict = {}
    digit_keys = [False]  # a dict whose key reads like an element index ("0")

    def walk(item, path: str, outer: tuple) -> bool:
        if isinstance(item, _Tensor) or hasattr(item, "__cuda_array_interface__") or hasattr(item, "__dlpack__"):
            return True
        if isinstance(item, (tuple, list)):
            kind, parts = ("tuple" if isinstance(item, tuple) else "list"), enumerate(item)
        elif isinstance(item, dict):
            kind, parts = "dict", item.items()
            digit_keys[0] = digit_keys[0] or any(str(key).isdecimal() for key in item)
        elif _is_dataclass_instance(item):
            kind, parts = "dataclass", ((f.name, _MISSING) for f in dataclasses.fields(item))
        else:
            return False
        if id(item) in outer or len(outer) >= _MAX_NESTING:
            return False
        kinds[path] = kind
        outer = outer + (id(item),)
        held = False
        for key, part in parts:
            try:
                held = walk(getattr(item, key) if part is _MISSING else part, f"{path}.{key}", outer) or held
            except Exception:  # (a field that cannot be read: _emit records it)
                pass
        if not held:
            kinds[path] = kind + ":empty"
        return held

    held = walk(value, "", ())
    # Only what names cannot tell is recorded: a container holding no tensor, a dict whose keys read
    # as element indices. Any other output (an HF ModelOutput, a dict of named tensors) records
    # nothing, so its pass keeps the C pass end.
    untold = any(kind.endswith(":empty") for kind in kinds.values()) or digit_keys[0]
    return (kinds if untold else None), held


def _placed(structure: dict, staged_at: dict, staged: int) -> dict:
    """The pass's structure record with each output that stored nothing placed: ``after``, the
    tensors the pass stored after it returned (``staged``: tensors staged by now), which reads the
    same whatever the Dumper staged before the pass."""
    return {name: (dict(entry, after=staged - staged_at[name]) if name in staged_at else entry)
            for name, entry in structure.items()}


_MAX_META_INT_BITS = 2000  # ~600 digits: under the lowest limit Python lets json.dumps print (640)


def _jsonable(value, outer: tuple = ()):
    """Pass metadata as JSON: tensors and numpy values become lists (complex ones as [real, imag]
    pairs), enum members their name, other objects their str(); a container inside itself or
    deeper than _MAX_NESTING is cut there (never a RecursionError into the model). Every value it
    returns is one json.dumps takes: a pass's end must never raise into the model."""
    if isinstance(value, (dict, list, tuple)):
        if id(value) in outer:
            return "<cut: refers to itself>"
        if len(outer) >= _MAX_NESTING:
            return f"<cut: nested more than {_MAX_NESTING} deep>"
        outer = outer + (id(value),)
        if isinstance(value, dict):
            out = {}
            for k, v in value.items():
                key = k if isinstance(k, str) else str(k)
                if key in out:  # keys that read alike (1 and "1"): the later one under its repr, not lost
                    key, n = repr(k), 1
                    while key in out:
                        key, n = f"{k!r}#{n}", n + 1
                out[key] = _jsonable(v, outer)
            return out
        return [_jsonable(v, outer) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > _MAX_META_INT_BITS:
        return f"<int of {value.bit_length()} bits>"  # json.dumps refuses ints of over 4300 digits (or fewer)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, complex):
        return [value.real, value.imag]
    if isinstance(value, _Tensor):
        if value.numel() > 4096:
            return f"<tensor {tuple(value.shape)}>"
        value = value.detach().cpu()
        return (_torch.view_as_real(value) if value.is_complex() else value).tolist()  # bools, ints, floats
    if isinstance(value, enum.Enum):  # e.g. an engine's ForwardMode.DECODE: its name, not "ForwardMode.DECODE"
        return value.name
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):  # arrays and scalars
        return _jsonable(value.tolist(), outer) if getattr(value, "size", 1) <= 4096 else \
            f"<array {tuple(value.shape)}>"
    return str(value)
