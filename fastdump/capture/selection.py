"""Which modules a Dumper wraps: every leaf module by default, narrowed by layers=, include=,
exclude= and module_types= (the same options as SGLang's dumper where it has them)."""

from __future__ import annotations

import inspect
import re
import sys

from .. import format as _fmt

# layers=: the decoder layers at `layers.N` or `model.layers.N` (SGLang's), from the start of the
# qualified name; any other name (`xlayers.1`, `encoder.layers.1`) is not a layer and is kept.
_LAYER_RE = re.compile(r"^(?:model\.)?layers\.(\d+)(?:\.|$)")

SCRIPT_REASON = ("torch.jit ScriptModule (scripted or traced): its forward runs as TorchScript, "
                 "which fastdump cannot wrap; neither it nor its submodules are dumped")


def original(module):
    """The module ``torch.compile`` wrapped, for a compiled one (an ``OptimizedModule``); else itself."""
    if type(module).__name__ != "OptimizedModule":
        return module
    modules = module.__dict__.get("_modules")  # (a ScriptModule's is no dict: checked after the type)
    inner = modules.get("_orig_mod") if isinstance(modules, dict) else None
    return inner if inner is not None else module


def is_script_module(module) -> bool:
    """A ``torch.jit.script``'ed or traced module. Its submodules run inside TorchScript, which never
    calls a Python forward, and its own forward is part of the compiled module (``torch.jit.save``,
    a scripted parent): fastdump wraps neither. (No torch.jit imported: no ScriptModule exists.)"""
    jit = sys.modules.get("torch.jit")
    script_module = getattr(jit, "ScriptModule", None)
    return script_module is not None and isinstance(module, script_module)


def script_modules(model) -> dict:
    """{qualified name: reason} of the outermost ScriptModules inside ``model`` (not the root): left
    unwrapped, with everything in them (see is_script_module)."""
    found = {}
    for name, module in named_modules(model):
        if name and is_script_module(module) and not _inside(name, found):
            found[name] = SCRIPT_REASON
    return found


CALL_NAME_REASON = ("its name holds '#<digits>', which reads as a repeated call's (name#k) in a dump; "
                    "neither it nor its submodules are dumped (watch() it under another name)")
SHADOWED_REASON = ("its class's forward is a property (a data descriptor), which the instance forward fastdump "
                   "sets cannot override: the wrapper would never run; it is not dumped (its submodules are)")


def forward_shadowed(module) -> bool:
    """Whether ``module``'s class defines ``forward`` as a data descriptor (a property): attribute
    lookup then never reaches an instance ``forward``, so fastdump's wrapper would sit there unused
    and the module would silently not be dumped."""
    attr = inspect.getattr_static(type(module), "forward", None)
    return hasattr(type(attr), "__set__") or hasattr(type(attr), "__delete__")


def unwrappable_modules(model, root_name: str) -> dict:
    """{qualified name: reason} of what fastdump cannot wrap in ``model``: the outermost TorchScript
    submodules (script_modules) and every module whose forward is shadowed (forward_shadowed; the
    root under ``root_name``), and every module whose name reads as another's repeated call
    (``a#1`` beside ``a`` called twice: two tensors under one name, which would read as mixed)."""
    found = script_modules(model)
    for name, module in named_modules(model):
        if name in found or _inside(name, found):
            continue
        if name and _fmt.reads_as_call(name):
            found[name] = CALL_NAME_REASON  # with its submodules, whose names read so too
        elif forward_shadowed(module):
            found[name or root_name] = SHADOWED_REASON
    return found


def _inside(name: str, prefixes) -> bool:
    return any(name.startswith(prefix + ".") for prefix in prefixes)


def named_modules(model, remove_duplicate: bool = True):
    """``model.named_modules()`` under the names the uncompiled model gives them: the ``_orig_mod``
    level that ``torch.compile`` adds (``torch.compile(model)``, or a compiled submodule) is left out
    of every name and the compiled wrapper itself is not listed, so a compiled run's dump and an eager
    one's have the same names (``fastdump diff``) and ``layers=`` still finds ``model.layers.N``.
    ``remove_duplicate=False``: a module held by several parents is listed under each of its names."""
    wrappers = set()  # (full names of the compiled wrappers seen; parents come before children)
    for name, module in model.named_modules(remove_duplicate=remove_duplicate):
        if original(module) is not module:
            wrappers.add(name)
            continue
        parts = name.split(".") if name else []
        kept = [part for i, part in enumerate(parts)
                if not (part == "_orig_mod" and ".".join(parts[:i]) in wrappers)]
        yield ".".join(kept), module


def select_modules(model, *, layers=None, include=None, exclude=None, module_types=None,
                   leaves_only=True, scripted: dict | None = None) -> list:
    """(qualified name, module) of the modules to capture, in registration order. ``scripted``:
    script_modules(model) when the caller has it already (the Dumper does, from its attach)."""
    if scripted is None:
        scripted = script_modules(model)
    kept = _selection(layers, include, exclude, module_types, leaves_only)
    return [(name, module) for name, module in named_modules(model)
            if name and not (name in scripted or _inside(name, scripted)) and kept(name, module)]


def select_subtree(module, prefix: str, *, layers=None, include=None, exclude=None, module_types=None,
                   leaves_only=True) -> list:
    """select_modules for ``module`` about to be put into a model under the name ``prefix`` (a
    submodule registered after attach): (full name, module) of it and its submodules, by the same
    rules on their full names."""
    scripted = script_modules(module)
    kept = _selection(layers, include, exclude, module_types, leaves_only)
    found = []
    for name, sub in named_modules(module):
        full = f"{prefix}.{name}" if name else prefix
        if not (name in scripted or _inside(name, scripted)) and kept(full, sub):
            found.append((full, sub))
    return found


SHARED_LEFT_OUT_REASON = ("a module held under several names is wrapped once, under its first name, and the "
                          "selection (layers=, include=, exclude=) leaves that name out while it keeps {kept}; "
                          "its calls cannot be told apart by the path they come from, so it is not dumped")


def shared_left_out(model, *, layers=None, include=None, exclude=None, module_types=None,
                    leaves_only=True) -> dict:
    """{first name: reason} of the modules held under several names (a rotary embedding cached for
    every layer) whose first name the selection leaves out while it keeps another: the wrapper,
    installed under the first name, is not installed, so a module the selection asks for would be
    silently missing (the Dumper records them in not_wrapped). SGLang's drop-in dumps them under
    each name instead (integrations/sglang.py, ``_shared_leaves``)."""
    kept = _selection(layers, include, exclude, module_types, leaves_only)
    first, others = {}, {}
    for name, module in named_modules(model, remove_duplicate=False):
        if not name:
            continue
        if id(module) not in first:
            first[id(module)] = (name, module)
        elif name != first[id(module)][0]:
            others.setdefault(id(module), []).append(name)
    found = {}
    for key, names in others.items():
        name, module = first[key]
        wanted = [alias for alias in names if kept(alias, module)]
        if wanted and not kept(name, module):
            found[name] = SHARED_LEFT_OUT_REASON.format(kept=", ".join(wanted[:4]) + (" ..." if len(wanted) > 4 else ""))
    return found


def _selection(layers, include, exclude, module_types, leaves_only):
    """The selection's test of one (name, module): a predicate."""
    layer_set = None if layers is None else {int(i) for i in layers}
    inc = re.compile(include) if isinstance(include, str) else include
    exc = re.compile(exclude) if isinstance(exclude, str) else exclude
    types = tuple(module_types) if module_types else None

    def kept(name: str, module) -> bool:
        if forward_shadowed(module):
            return False  # a wrapper would never run (the Dumper records them, see unwrappable_modules)
        if leaves_only and not _is_leaf(module):
            return False
        if layer_set is not None:
            m = _LAYER_RE.search(name)
            if m and int(m.group(1)) not in layer_set:
                return False
        if inc is not None and not inc.search(name):
            return False
        if exc is not None and exc.search(name):
            return False
        return types is None or _of_types(module, types)

    return kept


def _is_leaf(module) -> bool:
    """A module without children, or whose only child is the ``parametrizations`` container that
    ``torch.nn.utils.parametrize`` adds (weight_norm, spectral_norm, orthogonal): a parametrized
    Linear is still the leaf that computes the activation (its parametrizations, which compute the
    weight when it is read, are leaves of their own). Its output used to be missing from the dump."""
    children = dict(module.named_children())
    if not children:
        return True
    parametrize = sys.modules.get("torch.nn.utils.parametrize")  # (imported by whoever parametrized it)
    return list(children) == ["parametrizations"] and parametrize is not None and parametrize.is_parametrized(module)


def _of_types(module, types) -> bool:
    """``module`` is of one of ``types`` (module_types=: classes, or class names)."""
    return any((isinstance(t, str) and type(module).__name__ == t) or (isinstance(t, type) and isinstance(module, t))
               for t in types)


def root_selected(root, root_name: str, selection: dict) -> bool:
    """Whether the root module itself is dumped under this selection (its forward delimits passes
    either way). ``module_types=`` keeps it when it is of a kept type, as any module; a compiled
    root is judged by the module it compiled, as its submodules are."""
    include, exclude, types = selection.get("include"), selection.get("exclude"), selection.get("module_types")
    if types and not _of_types(original(root), tuple(types)):
        return False
    if include is not None and not re.search(include, root_name):
        return False
    if exclude is not None and re.search(exclude, root_name):
        return False
    return True
