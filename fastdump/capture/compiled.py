"""What torch.compile, torch.export and fake tensors see of the wrappers: the staging calls
kept outside Dynamo's graphs (``_outside_graph``), and graphs that may not break
(``fullgraph=True``), whose modules are served undumped and counted.

A helper of the Dumper's modules (fastdump/capture/dumper.py); see docs/INTERNALS.md.
"""

from __future__ import annotations

from .tensors import _torch


def _call(fn, *args):
    return fn(*args)


_CALL_CODE = _call.__code__


if _torch is not None and hasattr(_torch, "_disable_dynamo"):
    _is_compiling = _torch.compiler.is_compiling
    _is_exporting = getattr(_torch.compiler, "is_exporting", lambda: False)
    try:  # a FakeTensorMode is active (its forward computes shapes, not values)
        _FAKE_MODE = _torch._C._TorchDispatchModeKey.FAKE

        def _fake_mode_active() -> bool:
            return _torch._C._get_dispatch_mode(_FAKE_MODE) is not None
    except AttributeError:  # pragma: no cover - a torch without the key
        def _fake_mode_active() -> bool:
            return False
    # torch.compile must not trace into the staging code (symbolic shapes, raw pointers): a call
    # through this is a graph break, and the staging runs eagerly on the real tensors. Lazy: it
    # imports torch._dynamo only when first used, which is while Dynamo is tracing anyway.
    _outside_graph = _torch._disable_dynamo(_call)
    try:  # the C++ forward wrappers' test for "Dynamo would trace a frame started now"
        _DYNAMO = (_torch._C._dynamo.eval_frame.get_eval_frame_callback, _outside_graph)
    except AttributeError:  # pragma: no cover - a torch without it: every fallback call goes around Dynamo
        _DYNAMO = (lambda: True, _outside_graph)
else:  # pragma: no cover - without torch nothing is compiled
    def _is_compiling() -> bool:
        return False

    _is_exporting = _fake_mode_active = _is_compiling

    _outside_graph = _call
    _DYNAMO = None


_GRAPH_TOKENS: dict = {}  # Dumper._graph_token: token -> (weakref to the Dumper, name)
_GRAPH_TOKEN_COUNT = __import__("itertools").count()


def _no_graph_breaks(token: int) -> bool:
    """Called by a wrapper Dynamo is tracing: True when the graph may not break (fullgraph=True),
    so the wrapper must not stage (each staging call is a graph break). Dynamo runs it once, while
    tracing, and compiles its answer in as a constant (``_dynamo_marked_constant``, what
    ``torch._dynamo.assume_constant_result`` sets, without importing torch._dynamo here)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        tx = InstructionTranslator.current_tx()
        strict = bool(tx is not None and (tx.one_graph or getattr(tx, "error_on_graph_break", False)))
    except Exception:  # a torch without these: as before (a fullgraph compile fails at our graph break)
        return False
    if strict:
        dumper, name = _GRAPH_TOKENS.get(token, (lambda: None, None))
        dumper = dumper()
        if dumper is not None and not dumper._closed:
            dumper._traced_without_graph_breaks(name)
    return strict


_no_graph_breaks._dynamo_marked_constant = True
