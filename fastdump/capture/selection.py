"""Which modules a Dumper wraps: every leaf module by default, narrowed by layers=, include=,
exclude= and module_types= (the same options as SGLang's dumper where it has them)."""

from __future__ import annotations

import re

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)(?:\.|$)")  # layers= means model.layers.N only, as in SGLang


def original(module):
    """The module ``torch.compile`` wrapped, for a compiled one (an ``OptimizedModule``); else itself."""
    inner = module.__dict__.get("_modules", {}).get("_orig_mod")
    return inner if inner is not None and type(module).__name__ == "OptimizedModule" else module


def named_modules(model):
    """``model.named_modules()`` under the names the uncompiled model gives them: the ``_orig_mod``
    level that ``torch.compile`` adds (``torch.compile(model)``, or a compiled submodule) is left out
    of every name and the compiled wrapper itself is not listed, so a compiled run's dump and an eager
    one's have the same names (``fastdump diff``) and ``layers=`` still finds ``model.layers.N``."""
    wrappers = set()  # (full names of the compiled wrappers seen; parents come before children)
    for name, module in model.named_modules():
        if original(module) is not module:
            wrappers.add(name)
            continue
        parts = name.split(".") if name else []
        kept = [part for i, part in enumerate(parts)
                if not (part == "_orig_mod" and ".".join(parts[:i]) in wrappers)]
        yield ".".join(kept), module


def select_modules(model, *, layers=None, include=None, exclude=None, module_types=None,
                   leaves_only=True) -> list:
    """(qualified name, module) of the modules to capture, in registration order."""
    layer_set = None if layers is None else {int(i) for i in layers}
    inc = re.compile(include) if isinstance(include, str) else include
    exc = re.compile(exclude) if isinstance(exclude, str) else exclude
    types = tuple(module_types) if module_types else None
    chosen = []
    for name, module in named_modules(model):
        if name == "":
            continue  # the root is handled by the pass wrapper
        if leaves_only and next(iter(module.children()), None) is not None:
            continue
        if layer_set is not None:
            m = _LAYER_RE.search(name)
            if m and int(m.group(1)) not in layer_set:
                continue
        if inc is not None and not inc.search(name):
            continue
        if exc is not None and exc.search(name):
            continue
        if types is not None and not any(
            (isinstance(t, str) and type(module).__name__ == t) or (isinstance(t, type) and isinstance(module, t))
            for t in types
        ):
            continue
        chosen.append((name, module))
    return chosen


def root_selected(root_name: str, selection: dict) -> bool:
    """Whether the root module itself is dumped under this selection (its forward delimits passes
    either way)."""
    include, exclude, types = selection.get("include"), selection.get("exclude"), selection.get("module_types")
    if types:
        return False
    if include is not None and not re.search(include, root_name):
        return False
    if exclude is not None and re.search(exclude, root_name):
        return False
    return True
