"""Forwards that run outside this Dumper's passes: a root forward's lazy result (a
generator, coroutine or async generator: fastdump/capture/lazy.py), one dropped
unconsumed, and the passes of other Dumpers open on the thread (an EAGLE draft run
inside the target's forward), suspended while such a forward runs.

``OutsidePassesMixin``'s methods are the Dumper's (fastdump/capture/dumper.py): one ``self``, the
attributes Dumper.__init__ sets; see docs/INTERNALS.md.
"""

from __future__ import annotations

import logging
import os

from .lazy import STAND_INS as _LAZY_STAND_INS
from .process import _open_dumpers
from .text import _short

log = logging.getLogger("fastdump")


_MAX_SUSPENDED_FOR = 256  # entries of a pass's suspended_for kept (the rest counted)


class OutsidePassesMixin:
    """The Dumper's forwards outside its passes: lazy results, suspended passes of others."""

    def _lazy_result(self, out, after_pass: bool):
        """The root forward returned a generator, coroutine or async generator (fastdump/capture/lazy.py):
        a stand-in whose every step runs as this model's forward outside its passes. ``after_pass``: a
        root_passes=True wrapper, whose pass has ended with none of that work in it; said once."""
        if after_pass:
            self._say_once("lazy", "fastdump: %s: the root forward returned a %s: its modules run when it is "
                                   "consumed, after the pass ended, and are not dumped; attach with "
                                   "root_passes=False and open the passes with begin_pass()/end_pass() around "
                                   "its consumption", self.dir, type(out).__name__)
        return _LAZY_STAND_INS[type(out)](out, self)

    def _step_outside_passes(self, step, *args):
        """One step of a root forward's lazy result (_lazy_result), run as the forward itself runs in
        _outside_pass_wrapper: inside a pass of this Dumper it is that pass's; outside, the passes of
        other Dumpers open on this thread are suspended while it runs."""
        if self._depth > 0 or self._closed:
            return step(*args)
        held = len(self._forwards_outside_passes)
        try:
            self._suspend_for_forward()
            return step(*args)
        finally:
            if len(self._forwards_outside_passes) > held:
                self._resume_after_forward()

    def _close_dropped(self, inner) -> None:
        """A lazy result dropped unconsumed (lazy._Lazy.__del__): close it now, outside passes as its
        steps ran. While a pass of this Dumper is open (the stand-in was freed inside it, on any
        thread), the ``finally`` blocks it runs then would put their module calls into that pass, as
        if its forward had made them (``lm_head`` of a cleanup step, verify OK): it is closed once
        that pass has ended instead, outside it (_close_dropped_lazy)."""
        state = self._state
        if self._closed:
            # This Dumper is gone, but its model may be attached again: a pass of that Dumper got the
            # cleanup's calls as its own (verify OK). Closed as that Dumper's own dropped result.
            heir = next((d for d in list(_open_dumpers) if d is not self and not d._closed
                         and d._pid == os.getpid() and d._model_holds(self._model_ref)), None)
            if heir is not None:
                return heir._close_dropped(inner)
        elif self._depth > 0 or state.capturing or state.suspended:
            self._dropped_lazy.append(inner)
            return
        self._step_outside_passes(inner.close)

    def _close_dropped_lazy(self) -> None:
        """Close the lazy results dropped during the pass that just ended (_close_dropped), unless a
        pass is open again (nested, another thread's): then at its end. What their ``finally``
        blocks raise is logged, as the garbage collector would have reported it."""
        state = self._state
        while self._dropped_lazy and (self._closed or not (self._depth > 0 or state.capturing or state.suspended)):
            inner = self._dropped_lazy.pop(0)
            try:
                self._step_outside_passes(inner.close)
            except Exception as exc:
                log.error("fastdump: %s: closing a dropped %s raised %s: %s", self.dir, type(inner).__name__,
                          type(exc).__name__, _short(exc))

    def _step_dropped_cleanup(self, step, *args):
        """One step of the ``aclose()`` an event loop runs for an async generator of this Dumper's
        dropped unconsumed (lazy._Cleanup): as any step, unless a pass of this Dumper is open (across
        an ``await``): it cannot be put off as a generator's close is (_close_dropped), the loop runs
        it now; the pass is marked mixed, naming why (verify fails), as its calls read as its forward's."""
        state = self._state
        if not self._closed and (self._depth > 0 or state.capturing or state.suspended):
            self._mixed = True  # (verify fails on it: calls that are not this pass's forward, told apart by none)
            self._mark_incomplete("the cleanup of an async generator dropped unconsumed ran inside this pass "
                                  "(its event loop closed it here): its module calls are in it")
        return self._step_outside_passes(step, *args)

    def _suspend_for_forward(self) -> bool:
        """The root's forward starts outside any pass of this Dumper (_outside_pass_wrapper): suspend
        the passes of other Dumpers open on this thread. Whether it suspended any."""
        outer = self._state.suspend_others()
        if not outer:
            return False
        if not self._forwards_outside_passes and any(other._model_holds(self._model_ref) for other in outer):
            # This model is part of that pass's model (a Dumper on one of its submodules, dumping on
            # demand): its forward is that model's own computation, which that pass keeps.
            self._state.resume_held()
            return False
        self._forwards_outside_passes.append(outer)  # first: from here on the wrapper resumes them
        for other in outer:
            other._note_suspended_for(self.role, None)
        return True

    def _model_holds(self, model_ref) -> bool:
        """Whether ``model_ref()`` is this Dumper's model or one of its submodules (cached per model:
        asked only where passes nest, a walk of the model's modules the first time)."""
        held = self._holds_models.get(model_ref)
        if held is None:
            mine, other = self._model_ref(), model_ref()
            held = mine is not None and other is not None and any(m is other for m in mine.modules())
            if len(self._holds_models) < 64:  # (a few models per process)
                self._holds_models[model_ref] = held
        return held

    def _resume_after_forward(self) -> None:
        """That forward returned (or raised): what it suspended captures again, unless a pass of
        this Dumper begun inside it is still open (its end resumes them)."""
        self._forwards_outside_passes.pop()
        if self._depth == 0 and not self._forwards_outside_passes:
            self._state.resume_held()

    def _note_suspended_for(self, role: str, pass_id) -> None:
        """This Dumper's open pass was suspended while a pass of ``role`` (``pass_id``; None: a
        forward of that role's model outside any pass of its own) ran inside it on its thread: in
        its meta, ``suspended_for``, so a reader sees the gap and can put the roles' passes in order."""
        entries = self._meta.setdefault("suspended_for", [])
        if len(entries) < _MAX_SUSPENDED_FOR:
            entries.append({"role": role, "pass": pass_id})
        else:  # (a manual pass around thousands of draft steps: the count, not the list)
            self._meta["suspended_for_left_out"] = self._meta.get("suspended_for_left_out", 0) + 1
