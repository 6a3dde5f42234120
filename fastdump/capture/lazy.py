"""Root forwards whose work runs later: a forward that returns a generator, a coroutine or an async
generator runs its modules when the caller consumes that result, after the root wrapper returned.

For an EAGLE draft run inside the target's forward that is after the draft's wrapper resumed the
target's pass, so the modules both wrap (the shared embedding and LM head) would put the draft's
calls into the target's pass as ``embed#1``, ``lm_head#1``..., indistinguishable from the target
calling them twice, and verify said OK. The root wrapper hands back a stand-in instead that runs
each step of the result as a forward of its model outside its Dumper's passes
(``Dumper._step_outside_passes``): the other Dumpers' passes open on that thread are suspended
while it runs, as they are while the forward itself runs.

A stand-in dropped with its generator or coroutine suspended (not consumed to the end) closes it
through the same step: the ``finally`` blocks it runs then would otherwise run as the garbage
collector found the real object, wherever that was (inside the next pass of another Dumper on that
thread: a draft's cleanup call of the shared LM head read as the target's ``lm_head#1``, verify OK).
An async generator cannot be closed there (its ``aclose()`` is awaited): the event loop's finalizer
hook schedules it. That hook is taken by the real object at its first step; the stand-in hands it
itself instead (``_AsyncGenerator._first_step``), so the ``aclose()`` the loop runs steps as the
others do. Without an event loop (no finalizer hook: the generator driven by hand) it is finalized
where the collector finds it, unsuspended (docs/INTERNALS.md, README).

Only these three built-in kinds are recognised (by exact type, once per root forward): any other
lazy object (an iterator class of one's own, a closure) is returned as it is; docs/INTEGRATIONS.md
says so.
"""

from __future__ import annotations

import collections.abc
import inspect
import sys
import types


class _StandIn:
    """What the three stand-ins share: the real result ``inner``, whose steps run through ``dumper``;
    any other attribute is the real object's."""

    __slots__ = ("_inner", "_dumper")

    def __init__(self, inner, dumper):
        self._inner = inner
        self._dumper = dumper

    def __getattr__(self, name):  # gi_frame, cr_code, __name__, ...: the real object's
        return getattr(self._inner, name)

    def __repr__(self):
        return f"<fastdump stand-in for {self._inner!r}>"


class _Lazy(_StandIn):
    """A generator or coroutine: each of its steps runs outside other Dumpers' passes."""

    __slots__ = ()

    def _step(self, step, *args):
        return self._dumper._step_outside_passes(step, *args)

    def send(self, value):
        return self._step(self._inner.send, value)

    def throw(self, *exc):
        return self._step(self._inner.throw, *exc)

    def close(self):
        return self._step(self._inner.close)

    def __del__(self):
        # (the real object, finalized unconsumed, would run its finally blocks unsuspended: see above)
        try:
            suspended = _suspended(self._inner)
        except Exception:  # (at interpreter exit, modules torn down: the real object's finalizer closes it)
            return
        if suspended:  # (what its finally blocks raise is reported as the collector reports it)
            self._dumper._close_dropped(self._inner)  # (after the pass, when one of its Dumper is open)


def _suspended(inner) -> bool:
    """A generator or coroutine started and not finished (closing one not started runs nothing)."""
    if isinstance(inner, types.GeneratorType):
        return inspect.getgeneratorstate(inner) == inspect.GEN_SUSPENDED
    if isinstance(inner, types.CoroutineType):
        return inspect.getcoroutinestate(inner) == inspect.CORO_SUSPENDED
    return False  # (a coroutine's __await__ wrapper: its coroutine's own stand-in closes it)


class _Generator(_Lazy, collections.abc.Generator):
    __slots__ = ()

    def __next__(self):
        return self.send(None)


class _Coroutine(_Lazy, collections.abc.Coroutine):
    """A coroutine, or one step of an async generator (its ``__anext__()``, ``asend()``... awaitable)."""

    __slots__ = ()

    def __await__(self):
        return _Generator(self._inner.__await__(), self._dumper)


class _AsyncGenerator(_StandIn, collections.abc.AsyncGenerator):
    """An async generator: each step (an awaitable) runs as a _Coroutine's. Equal to (and hashed
    as) the real object, and weakly referenceable: the event loop's finalizer hook is handed this
    stand-in (see _first_step) and drops the real object from its weak set of live generators."""

    __slots__ = ("_hooked", "__weakref__")

    def __init__(self, inner, dumper):
        super().__init__(inner, dumper)
        self._hooked = False

    def __eq__(self, other):
        return self._inner == (other._inner if isinstance(other, _AsyncGenerator) else other)

    def __hash__(self):
        return hash(self._inner)

    def __anext__(self):
        return _Coroutine(self._first_step(self._inner.__anext__), self._dumper)

    def asend(self, value):
        return _Coroutine(self._first_step(self._inner.asend, value), self._dumper)

    def athrow(self, *exc):
        return _Coroutine(self._first_step(self._inner.athrow, *exc), self._dumper)

    def aclose(self):
        return _Coroutine(self._first_step(self._inner.aclose), self._dumper)

    def _first_step(self, method, *args):
        """The real object's first step takes the thread's async-generator hooks (the event loop's,
        ``sys.set_asyncgen_hooks``): its finalizer is what closes it when it is dropped unconsumed,
        by scheduling ``agen.aclose()``, whose ``finally`` blocks then ran unsuspended, inside
        whatever pass was open as the loop ran it (a target's pass open across an ``await``: the
        draft's cleanup call as ``lm_head#1``, verify OK). For that one call the loop's finalizer is
        handed this stand-in instead of the real object: its ``aclose()`` steps run as the others.
        The loop's own hooks are back in place when the call returns; nothing else of it changes."""
        if self._hooked:
            return method(*args)
        self._hooked = True
        firstiter, finalizer = sys.get_asyncgen_hooks()
        if finalizer is None:  # (no event loop: finalized where the collector finds it, as before)
            return method(*args)
        dumper = self._dumper

        def finalize(agen):
            finalizer(_DroppedAsyncGenerator(agen, dumper))

        sys.set_asyncgen_hooks(firstiter, finalize)
        try:
            return method(*args)
        finally:
            sys.set_asyncgen_hooks(firstiter, finalizer)


class _DroppedAsyncGenerator(_AsyncGenerator):
    """An async generator dropped unconsumed, as its event loop's finalizer hook gets it: the
    ``aclose()`` that hook schedules runs as a _Cleanup."""

    __slots__ = ()

    def aclose(self):
        return _Cleanup(self._inner.aclose(), self._dumper)


class _Cleanup(_Coroutine):
    """The ``aclose()`` of a dropped async generator, run when its loop gets to it: outside passes as
    any step; should a pass of its own Dumper be open then (one held open across ``await``s), its
    ``finally`` blocks' calls are in that pass, which is marked mixed saying so
    (``Dumper._step_dropped_cleanup``): they are not that pass's forward."""

    __slots__ = ()

    def _step(self, step, *args):
        return self._dumper._step_dropped_cleanup(step, *args)


# exact types: a subclass or a look-alike is not recognised (the check runs at every root forward)
STAND_INS = {types.GeneratorType: _Generator, types.CoroutineType: _Coroutine,
             types.AsyncGeneratorType: _AsyncGenerator}
