"""The forward wrappers a Dumper puts on modules: the capture wrapper of a selected module
(the C++ ``ForwardWrapper``, or its Python twin under torch.compile), a watched module's
hooked wrapper, and the root's (a pass around each forward, or a forward outside this
Dumper's passes); putting them on and taking them off.

``WrappersMixin``'s methods are the Dumper's (fastdump/capture/dumper.py): one ``self``, the
attributes Dumper.__init__ sets; see docs/INTERNALS.md.
"""

from __future__ import annotations

import functools
import inspect
import logging
import types
import weakref

from .. import _C
from .lazy import STAND_INS as _LAZY_STAND_INS
from .compiled import (_GRAPH_TOKENS, _GRAPH_TOKEN_COUNT, _call, _fake_mode_active, _is_compiling, _is_exporting,
                       _no_graph_breaks, _outside_graph)
from .forward_slot import _install_copier, _is_ours, _mark_ours, _put_back, _remove_copier, _wrapped_by
from .structure import _MISSING
from .tensors import _TensorType

log = logging.getLogger("fastdump")


class WrappersMixin:
    """The Dumper's forward wrappers: made, put on, taken off."""

    def _wrap(self, module, wrapper) -> None:
        _mark_ours(wrapper, module.__dict__.get("forward", _MISSING))
        module.__dict__["forward"] = wrapper
        _install_copier(module)
        self._wrapped.append((module, wrapper))

    def _unwrap(self) -> None:
        for token in self._tokens:
            _GRAPH_TOKENS.pop(token, None)
        self._tokens.clear()
        hook = getattr(self, "_registration_hook", None)
        if hook is not None:
            hook.remove()
            self._registration_hook = None
        for module, wrapper in reversed(self._wrapped):
            if module.__dict__.get("forward") is wrapper:
                _put_back(module, wrapper)
            else:
                # Someone wrapped over us: become a pass-through. A Dumper whose wrapper sits over
                # ours restores what ours wraps when it closes (_skip_stale).
                wrapper.__fastdump_off__ = True
            if not _is_ours(module.__dict__.get("forward")):
                _remove_copier(module)
        self._wrapped.clear()

    def _capture_wrapper(self, name: str, forward, owner=None):
        """The wrapper of a selected module: the C++ ForwardWrapper (csrc/forward_wrapper.cpp),
        or the Python one where that cannot do the job."""
        if _NativeWrapper is not None and _native_wrappers and not self._python_wrappers and \
                name not in self._indexed_parents:
            return _wraps(forward)(_NativeWrapper(self._state, name, forward, self.inputs, owner))
        return self._python_capture_wrapper(name, forward, owner)

    def _python_capture_wrapper(self, name: str, forward, owner=None):
        """The same wrapper in Python: what _capture_wrapper falls back to; tests run both."""
        dumper = self
        inputs = self.inputs
        original, forward = forward, _following(owner, forward)
        token = self._graph_token(name)

        @_wraps(original)  # keeps the signature: transformers' generate() inspects it
        def forward_and_capture(*args, **kwargs):
            if not dumper._capturing:
                return forward(*args, **kwargs)
            if _is_compiling():  # torch.compile is tracing us: stage the real values at graph breaks
                if _no_graph_breaks(token):  # fullgraph=True: none allowed; served undumped, counted
                    return forward(*args, **kwargs)
                if inputs:  # numbered as it starts, as eagerly (one graph break before, as ever)
                    _outside_graph(dumper._enter_call, name, args, kwargs, True)
                    out = forward(*args, **kwargs)
                    _outside_graph(dumper._exit_call, name, out)
                else:  # numbered as it returns: no second graph break per module (docs/INTERNALS.md)
                    out = forward(*args, **kwargs)
                    _outside_graph(dumper._capture, name, out)
                return out
            pass_id = dumper.pass_id
            k = dumper._claim(name)  # numbered as it starts (see _claim)
            if inputs:  # before forward: it may change its inputs in place
                dumper._capture_inputs(name, args, kwargs, k)
            out = forward(*args, **kwargs)
            if dumper._capturing:
                if dumper.pass_id != pass_id:
                    k = None  # its pass ended inside the call: numbered in the new one
                if k == 0 and type(out) is _TensorType:  # the common case, inlined: first call, one tensor
                    try:  # free in 3.11 unless raised: nothing fastdump does may raise into the model
                        dumper._stage(name, out)
                    except Exception as exc:
                        dumper._capture_failed(name, out, exc)
                else:
                    dumper._capture(name, out, None, k)
            return out

        # A code object of its own: Dynamo keeps its compiled frames per code object, and where it
        # compiles the wrappers as frames (the model's own frame skipped, as Dynamo does for a graph
        # break in its loop over the layers) every module's wrapper was a recompile of one code
        # object, until Dynamo's recompile limit (8) sent the rest to eager, every pass.
        forward_and_capture.__code__ = forward_and_capture.__code__.replace()
        forward_and_capture.__fastdump_name__ = name  # (the C wrapper's _fastdump_name)
        return forward_and_capture

    def _hooked_wrapper(self, name: str, forward, convert, before, owner=None):
        """A watched module's wrapper (watch): the capture wrapper's rules plus the hooks. It stays
        Python, and off the hot path of plain leaves."""
        dumper = self
        inputs = self.inputs
        original, forward = forward, _following(owner, forward)
        token = self._graph_token(name)

        @_wraps(original)
        def forward_and_capture(*args, **kwargs):
            if not dumper._capturing:
                return forward(*args, **kwargs)
            # torch.compile tracing us: the hooks and the staging run eagerly, at graph breaks
            outside = _outside_graph if _is_compiling() else _call
            if outside is not _call and _no_graph_breaks(token):  # fullgraph=True: served undumped, counted
                return forward(*args, **kwargs)
            if before is not None or inputs or outside is _call:  # numbered as it starts (see _claim)
                outside(dumper._enter_call, name, args, kwargs, inputs, before)
                out = forward(*args, **kwargs)
                outside(dumper._exit_call, name, out, convert)
                return out
            out = forward(*args, **kwargs)  # compiled, nothing before forward: numbered as it returns
            if dumper._capturing:
                outside(dumper._capture, name, out, convert)
            return out

        forward_and_capture.__code__ = forward_and_capture.__code__.replace()  # (as _python_capture_wrapper)
        return forward_and_capture

    def _graph_token(self, name: str) -> int:
        """A number naming (this Dumper, ``name``) for _no_graph_breaks, which Dynamo calls with
        constants only; forgotten at close."""
        token = next(_GRAPH_TOKEN_COUNT)
        _GRAPH_TOKENS[token] = (weakref.ref(self), name)
        self._tokens.append(token)
        return token

    def _traced_without_graph_breaks(self, name: str) -> None:
        """Dynamo traced ``name``'s wrapper into a graph that may not break (``torch.compile(...,
        fullgraph=True)``, ``torch._dynamo.error_on_graph_break``): staging needs a graph break, so
        that compiled code runs undumped. The modules so traced are counted (``compiled_not_dumped``,
        which fails ``fastdump verify``) and logged: before, such a compile raised into the model."""
        if name in self._strict_graph_names:  # (Dynamo may trace a frame more than once)
            return
        self._strict_graph_names.add(name)
        self._totals["compiled_not_dumped"] = len(self._strict_graph_names)
        self._use_python_wrappers()  # Dynamo reads the leaves' forward after this: not the C ones
        if "fullgraph" not in self._said:
            self._said.add("fullgraph")
            log.warning("fastdump: %s: %s is compiled without graph breaks (torch.compile fullgraph=True): "
                        "the modules in that graph are served undumped (stats compiled_not_dumped; verify "
                        "fails). Compile without fullgraph=True to dump them.", self.dir, name)

    def _use_python_wrappers(self) -> None:
        """torch.compile is tracing the model: from now on its modules get the Python wrapper.

        Dynamo cannot trace C, so at a C++ ForwardWrapper it graph-breaks and runs that module's
        forward (torch.nn code, which it does not compile on its own) eagerly: a compiled model
        would compile nothing it dumps. Dynamo inlines the Python wrapper instead, compiling each
        module's code and breaking only around the staging calls (_outside_graph). Wrappers another
        wrapper now sits over are left alone."""
        if self._python_wrappers:
            return
        self._python_wrappers = True
        for i, (module, wrapper) in enumerate(self._wrapped):
            if type(wrapper) is _NativeWrapper and module.__dict__.get("forward") is wrapper:
                python = self._python_capture_wrapper(wrapper._fastdump_name, wrapper._fastdump_forward,
                                                      wrapper._fastdump_owner)
                _mark_ours(python, _wrapped_by(wrapper))
                module.__dict__["forward"] = python
                self._wrapped[i] = (module, python)

    def _root_wrapper(self, name, forward, owner=None):
        dumper = self
        original, forward = forward, _following(owner, forward)
        # The root's own output (when selected) is captured by a C++ ForwardWrapper inside the pass,
        # as any selected module's: a tuple of logits and hidden states is staged without the
        # Python path's frames (~45 us a pass in the micro decode loop, benchmarks/RESULTS.md 0i).
        # Under torch.compile the Python path below runs, which Dynamo can trace.
        native = None
        if name is not None and _NativeWrapper is not None and _native_wrappers and not self._python_wrappers \
                and name not in self._indexed_parents:
            native = _NativeWrapper(self._state, name, original, self.inputs, owner)
        # The pass's begin and end around it in C too, in the common case (CaptureState.root_pass:
        # ~40-110 us a pass in Python in the micro decode loop, mostly cache misses; RESULTS.md 0l).
        root_pass = self._state.root_pass if native is not None and _native_root_pass else None
        token = self._graph_token(name if name is not None else self._root_name)

        @_wraps(original)
        def forward_in_pass(*args, **kwargs):
            if getattr(forward_in_pass, "__fastdump_off__", False):
                return forward(*args, **kwargs)
            if _is_exporting():  # torch.export traces a graph from fake tensors: nothing to dump, no pass
                return forward(*args, **kwargs)
            outside = _outside_graph if _is_compiling() else _call  # once per pass: cheap
            if outside is not _call and _no_graph_breaks(token):  # fullgraph=True: no pass; counted
                return forward(*args, **kwargs)
            if outside is _call and _fake_mode_active():  # a shape or memory estimate: no values, no pass
                return forward(*args, **kwargs)  # (a pass of skips would shift every later pass id)
            if root_pass is not None and outside is _call and not dumper._python_wrappers:
                out = root_pass(native, args, kwargs)  # this function's pass, as below (C)
                if dumper._dropped_lazy:
                    dumper._close_dropped_lazy()
                if type(out) in _LAZY_STAND_INS:  # (a generator: its work runs after the pass ended)
                    return dumper._lazy_result(out, after_pass=True)
                return out
            if outside is not _call and not dumper._python_wrappers:
                outside(dumper._use_python_wrappers)  # before Dynamo meets the C++ wrappers
            outside(dumper._root_begin)
            try:
                if native is not None and outside is _call and not dumper._python_wrappers:
                    out = native(*args, **kwargs)  # inputs and output captured in C++, as for a leaf
                elif name is not None and dumper._capturing and (dumper.inputs or outside is _call):
                    outside(dumper._enter_call, name, args, kwargs, dumper.inputs)  # numbered as it starts
                    out = forward(*args, **kwargs)
                    outside(dumper._exit_call, name, out)
                else:
                    out = forward(*args, **kwargs)
                    if name is not None and dumper._capturing:  # compiled, no inputs: numbered as it returns
                        outside(dumper._capture, name, out)
            except BaseException as exc:
                outside(dumper._forward_raised, exc)
                raise
            finally:
                outside(dumper._end)
                if dumper._dropped_lazy:
                    outside(dumper._close_dropped_lazy)
            if type(out) in _LAZY_STAND_INS:  # (a generator: its work runs after the pass ended)
                return dumper._lazy_result(out, after_pass=True)
            return out

        return forward_in_pass

    def _outside_pass_wrapper(self, inner, forward, owner=None):
        """The root's wrapper with ``root_passes=False`` (``inner``: its capture wrapper when the root
        is selected, else None). Run while no pass of this Dumper is open, on a thread where another
        Dumper's pass is (an EAGLE draft run inside the target's forward without a pass of its own),
        it suspends that pass until it returns: the modules both wrap (the shared embedding and LM
        head) would otherwise put this model's calls into the other model's pass as ``embed#1``,
        indistinguishable from that model calling them twice, and verify said OK. The suspended pass
        records it (``suspended_for``, pass null: this model's calls went to no pass)."""
        dumper = self
        original, forward = forward, _following(owner, forward)
        if inner is None:
            inner = forward

        @_wraps(original)
        def forward_outside_passes(*args, **kwargs):
            if getattr(forward_outside_passes, "__fastdump_off__", False):
                return inner(*args, **kwargs)  # closed
            if dumper._depth > 0:  # in a pass of its own (which suspended the others)
                out = inner(*args, **kwargs)
                # (its steps are that pass's; dropped unconsumed in a later pass, its stand-in keeps
                # the cleanup out of that one: _close_dropped)
                return dumper._lazy_result(out, after_pass=False) if type(out) in _LAZY_STAND_INS else out
            outside = _outside_graph if _is_compiling() else _call
            held = len(dumper._forwards_outside_passes)
            try:  # (Ctrl-C between the suspend and the forward: still resumed)
                outside(dumper._suspend_for_forward)  # (the common case: no other pass open here, nothing)
                out = inner(*args, **kwargs)
            finally:
                if len(dumper._forwards_outside_passes) > held:
                    outside(dumper._resume_after_forward)
            if type(out) in _LAZY_STAND_INS:  # (a generator: its work runs when consumed, after this returned)
                return dumper._lazy_result(out, after_pass=False)
            return out

        return forward_outside_passes


_NativeWrapper = getattr(_C, "ForwardWrapper", None)  # csrc/forward_wrapper.cpp
_native_wrappers = True  # False: every selected module gets the Python wrapper (tests of both)
_native_root_pass = True  # False: a root forward's pass begins and ends in Python (tests of both)


# The root wrapper's code (see Dumper._root_begin): the frame that opened a pass is one of it.
_ROOT_CODE = next(c for c in WrappersMixin._root_wrapper.__code__.co_consts
                  if isinstance(c, types.CodeType) and c.co_name == "forward_in_pass")


def _wraps(forward):
    """functools.wraps without our own markers: it copies ``__dict__``, and a wrapper made over a
    stale fastdump wrapper must not inherit its ``__fastdump_off__`` or ``__fastdump_previous__``."""
    def decorate(wrapper):
        functools.wraps(forward)(wrapper)
        wrapper.__dict__.pop("__fastdump_off__", None)
        wrapper.__dict__.pop("__fastdump_previous__", None)
        wrapper.__dict__.pop("__fastdump_name__", None)
        return wrapper

    return decorate


def _owner_of(module):
    """``module`` when its forward is its class's (no instance forward set): the wrappers then follow
    the class's forward as attribute lookup does, so a class patched after attach (a library's
    kernels applied to a built model) runs patched with dumping on, as it does without. Else None."""
    if "forward" in module.__dict__:
        return None
    bound = module.forward
    if (type(bound) is not types.MethodType or bound.__self__ is not module
            or bound.__func__ is not getattr(type(module), "forward", None)):
        return None
    return module


def _following(owner, forward):
    """``forward``, or for an owner (_owner_of) a callable that calls the owner's class forward as
    attribute lookup finds it at each call (the Python wrappers' twin of ForwardWrapper's owner)."""
    if owner is None:
        return forward

    # What `cls.forward` last gave as a plain function, and whether the class attribute behind it
    # is a staticmethod (which `cls.forward` unwraps to the same plain function): found in the MRO
    # only when the class or its forward changes, not at every call.
    seen = [None, None, False]  # [cls, function, static]

    def class_forward(*args, **kwargs):
        cls = type(owner)  # (at call time: some libraries swap a module's __class__, FSDP2 does)
        f = cls.forward
        if type(f) is types.FunctionType:
            if seen[0] is not cls or seen[1] is not f:
                seen[:] = [cls, f, isinstance(inspect.getattr_static(cls, "forward", None), staticmethod)]
            return f(*args, **kwargs) if seen[2] else f(owner, *args, **kwargs)
        get = getattr(type(f), "__get__", None)
        return (f if get is None else get(f, owner, cls))(*args, **kwargs)

    return class_forward
