"""The pass lifecycle of a Dumper: a pass's begin and end (root forwards, ``begin_pass()``
and ``end_pass()``, nesting, a pass another Dumper's pass is open in), which passes are
dumped, pass ends a full ring refused (sent late), and what makes a pass incomplete or
mixed (threads, dangling manual passes, interruptions).

``PassesMixin``'s methods are the Dumper's (fastdump/capture/dumper.py): one ``self``, the
attributes Dumper.__init__ sets; see docs/INTERNALS.md.
"""

from __future__ import annotations

import logging
import sys
import threading
import time

from .. import protocol
from .compiled import _CALL_CODE
from .process import _open_dumpers
from .structure import _jsonable, _placed
from .text import _short
from .wrappers import _ROOT_CODE

log = logging.getLogger("fastdump")


_MIXED_REASON = "forwards of several threads ran at once in this pass (mixed tensors)"
_MAX_LATE_ENDS = 4096  # refused pass ends kept to send again (each a small dict)


class PassesMixin:
    """The Dumper's passes: begin, end, nesting, selection, late ends, incomplete and mixed."""

    def _begin_manual(self, meta: dict, caller) -> None:
        """begin_pass() called from ``caller`` (the frame whose return leaves the pass dangling)."""
        opener = self._manual_opener
        if opener is not None and opener[0] is caller and opener[1] == caller.f_lasti:
            self._close_dangling("begin_pass() ran again before end_pass()")
        (self._meta if self._depth > 0 else self._next_meta).update(meta)  # nested: the open pass's
        opening = self._depth == 0
        self._begin()
        self._manual_depth += 1
        if opening:
            self._manual_opener = (caller, caller.f_lasti)

    def _begin(self, standalone: bool = False) -> None:
        # Threads: from the count to the opener's marks below there is no call, hence no point
        # where another thread can run (with the GIL): a second thread that enters the pass sees
        # the opener's thread and its mark of mixing sticks (a get_ident() or a reset after the
        # count let it see the previous pass's thread, or erased its mark).
        me = threading.get_ident()
        self._depth += 1
        opening = False  # the channel was asked to open the pass: its begin may be in the ring
        try:
            if self._depth > 1:
                if self._pass_thread != me and not self._mixed:
                    self._mixed = True  # before any call: no thread switch between the check and the mark
                    self._mark_mixed()
                return
            self._pass_thread = me
            self._incomplete, self._mixed = None, False
            self.pass_id += 1
            if standalone:
                self._standalone_passes += 1
            self._meta, self._next_meta = self._next_meta, {}
            # A pass of another Dumper open on this thread (this one runs inside its forward): its
            # wrappers pass through until this pass ends, so the modules both wrap (EAGLE's shared
            # embedding and LM head) are this pass's alone. (C: nothing to do when none is open.)
            # After the marks above: the call is a point where another thread may run and mark
            # this pass mixed, a mark the reset above would have erased.
            outer = self._state.suspend_others()
            if not outer and self._forwards_outside_passes:  # (begun inside such a forward: suspended by it,
                # those still suspended)
                outer = [d for d in self._forwards_outside_passes[-1] if self._state.holds(d._state)]
            if outer:  # where it ran, and in the outer pass what ran inside it: a reader can put the
                # roles' passes in order
                self._meta["nested_in"] = [{"role": d.role, "pass": d.pass_id} for d in outer]
                for other in outer:
                    other._note_suspended_for(self.role, self.pass_id)
            self._calls.clear()
            if self._open_calls:
                self._open_calls.clear()  # (calls that raised: never closed)
            if self._skipped:
                self._skipped = {}
            if self._structure:
                self._structure, self._structure_at = {}, {}
            # (A forked child's copies have no engine: _forget_parent_dumpers, at fork.)
            if self._closed or self._engine is None or self.status != "running":
                return
            # Selection applies to eager passes; a graph captured in a pass left out is recorded
            # all the same, since each of its replays is a pass of its own.
            if not self._selected(self.pass_id, standalone) and (
                    self._graphs is None or not self._graphs.capture_running()):
                return
            if not self._engine.alive_lately:  # a dead writer stops dumping, not serving
                return self._disable(self._engine.error())
            if self._channel.failed:  # this root's disk failed: this Dumper stops, not the others
                return self._disable(self._channel_failure())
            opening = True
            if not self._channel.begin(self.pass_id):
                return  # `drop` with a full ring: the whole pass is dropped (the channel counts it)
            self._capturing = True
            if self._late_ends:  # the ring took a record again: the refused ends may go now
                self._send_late_ends()
        except BaseException as exc:
            self._begin_interrupted(exc, opening)
            raise

    def _begin_interrupted(self, exc: BaseException, opening: bool) -> None:
        """Ctrl-C (KeyboardInterrupt, raised wherever a signal is delivered: a wait for ring space,
        a call's return) or any other exception stopped _begin after it counted the depth. The
        caller never gets to its _end, so undo the count here: a pass left open would swallow every
        later forward, dumping nothing more while verify said OK. A pass this call was opening is
        ended at once, marked incomplete (its begin may be in the ring already)."""
        if self._depth > 1:
            self._depth -= 1  # a nested begin: the open pass goes on
            return
        self._mark_incomplete(f"interrupted as it began: {type(exc).__name__}")
        if opening:
            self._capturing = True  # so that _end sends the pass's end, whether its begin went in or not
        self._end()

    def _end(self) -> None:
        if self._depth == 0:
            if self._resume_at_root_return and self._pass_thread == threading.get_ident():
                self._resume_at_root_return = False  # the root forward close() cut short returned
                self._state.resume_held()
            return
        self._depth -= 1
        if self._depth > 0:
            return
        if self._state.suspended:
            self._end_nested_first()
        # What this pass is, read before any call: at a call another thread may run and open the
        # next pass (new id, meta, skips, drop count), and this end must still be this pass's.
        state = self._state
        capturing = state.capturing or state.suspended  # (suspended: its end is still to be sent)
        state.capturing = False
        if not (self._forwards_outside_passes or self._resume_at_root_return):  # (else: when that forward returns)
            state.resume_held()  # the passes this one nested in capture again
        pass_id, meta, skipped, incomplete, mixed = (self.pass_id, self._meta, self._skipped, self._incomplete,
                                                     self._mixed)
        structure, structure_at = self._structure, self._structure_at
        self._manual_opener = self._root_opener = None  # (frames: let them go with the pass)
        self._manual_depth = 0
        if not capturing:
            return
        if mixed and incomplete is None:
            incomplete = _MIXED_REASON  # (marked mixed, the reason not set yet: a thread switch between)
        channel = self._channel
        dropped = channel.pass_dropped
        self._totals["passes"] += 1
        sent = False  # the pass's end is in the ring (or known lost)
        try:
            # What it put into the ring: the end record's count (verify holds its rows to it). A C
            # call, inside the try: Ctrl-C on its return is an interrupted end, counted (read above
            # the try, as a Python call, it left the pass stored incomplete with no count of it).
            tensors_sent = channel.lane.sent_in(pass_id)
            if self.max_bytes is not None:  # the budget needs the bytes now; stats() and close() fold anyway
                self._fold_lane_counts()
            if structure_at:
                structure = _placed(structure, structure_at, self._staged_so_far())
            try:
                meta = _jsonable(meta) if meta else {}  # (most passes carry none)
            except Exception as exc:  # a user's object whose str() raises: the pass is kept, its meta said so
                meta = {"fastdump_meta_error": f"{type(exc).__name__}: {_short(exc)}"}
            if self._graphs is not None and self._graphs.open is not None:
                # A graph was captured in this pass: its replays are passes (with this pass's structure record).
                self._graphs.end_pass(meta, incomplete, structure)
                if incomplete is None:  # (it marks this pass, the capture's, as holding no values)
                    incomplete = self._incomplete
            if incomplete is not None:
                self._totals["incomplete_passes"] += 1  # the writer records the pass as not complete
                if mixed:
                    self._totals["mixed_passes"] += 1  # `fastdump verify` fails on it
            seq = channel.end(pass_id, meta, skipped, incomplete, mixed, dropped, tensors_sent, structure)
            sent = True
            if seq:
                self._unconfirmed.append(seq)
                if len(self._unconfirmed) > 64:
                    self._trim_unconfirmed()
                return
            if not self._engine.alive:
                self._disable(self._engine.error())
            else:  # the ring is full (`drop`, or `block` past block_timeout_s): the end goes later
                self._totals["lost_pass_ends"] += 1
                if len(self._late_ends) < _MAX_LATE_ENDS:  # (beyond: lost; the writer marks the pass incomplete)
                    self._late_ends.append(protocol.end(channel.id, pass_id, meta, dropped, skipped,
                                                        sent=tensors_sent, incomplete=incomplete, mixed=mixed,
                                                        late=True, structure=structure))
                channel.note_stall("a pass end", pass_id)
        except BaseException as exc:
            if not sent:
                self._end_interrupted(exc, incomplete)
            raise

    def _end_nested_first(self) -> None:
        """This pass ends while a pass of another Dumper opened inside it is still open (a draft's
        begin_pass() in the target's forward without its end_pass()): what ran since that one
        opened went to it, not here (this pass's own output included), so this pass is incomplete;
        and that one is dangling: closed now, marked so, or every later pass of this Dumper would
        suspend it and take the other role's calls as its own. (Suspended by another model's forward
        outside any pass of its Dumper (_outside_pass_wrapper) instead: nothing of this pass went
        elsewhere, and that forward resumes nothing once this pass has ended.)"""
        holder = next((other for other in list(_open_dumpers)
                       if other is not self and other._state.holds(self._state)), None)
        if holder is not None and holder._depth == 0 and holder._forwards_outside_passes:
            return
        self._mark_incomplete("a pass of another Dumper opened inside this one was still open when it "
                              "ended: what ran after that one opened is not in this pass")
        if holder is not None:
            holder._close_dangling(f"it was still open when the pass of role {self.role!r} it was "
                                   "opened inside ended", manual=holder._manual_depth > 0)

    def _cut_outer_passes(self) -> None:
        """close() ends this Dumper's pass while it is nested in passes of other Dumpers, perhaps
        with the forward in it still running (closed inside it, or from another thread). Resumed
        now, they would take that forward's later calls of the modules both wrap (the shared
        embedding and LM head) as ``lm_head#1``, ..., which read as their own model's. A pass a root
        forward opened: they stay suspended until that forward returns (its wrapper's _end resumes
        them), as they do for a root forward outside passes (_outside_pass_wrapper). A begin_pass()
        pass: where its forward ends is not known, so they are resumed now and marked mixed
        (verify fails)."""
        if self._forwards_outside_passes:
            return
        outer = [other for other in list(_open_dumpers) if other is not self and self._state.holds(other._state)]
        if not outer:
            return
        if self._root_opener is not None and self._manual_depth == 0:
            self._resume_at_root_return = True
            return
        for other in outer:
            other._mixed = True  # (before the reason, as _check_thread does)
            other._mark_incomplete(f"a pass of role {self.role!r} nested in it was ended by close() before "
                                   "its end_pass(): what ran after (that role's calls of the modules both wrap "
                                   "too) went into this pass (mixed tensors)")

    def _send_late_ends(self, deadline: float | None = None) -> None:
        """Send the pass ends a full ring refused, oldest first, until one is refused again (it
        waits for the next pass that opens, or close). ``deadline``: wait for space until then
        (close); None: never wait.

        Each carries what only the end says: the pass's drop count, metadata and skips; without it
        the pass stays `complete = 0`, its drops counted in no pass. The writer completes a pass it
        still buffers, or continues the one it flushed unfinished last (docs/INTERNALS.md, "Lost
        pass ends"). One thread at a time, and a sent end is removed before the next is tried; but
        Ctrl-C landing between a send and its removal leaves it to be sent again (whether it went in
        cannot be told): the writer takes one end per pass and ignores such a copy
        (ChannelWriter._takes_late_end)."""
        if not self._late_lock.acquire(blocking=False):
            return  # another thread is sending them
        try:
            late, engine = self._late_ends, self._engine
            while late and engine is not None:
                if deadline is None:  # (at a pass's begin: never a wait)
                    sent = engine.control(late[0], block=False)
                else:
                    sent = engine.control(late[0], block_timeout=max(0.0, deadline - time.monotonic()))
                if not sent:
                    return
                del late[0]
                self._totals["lost_pass_ends"] -= 1
                self._totals["late_pass_ends"] += 1
        finally:
            self._late_lock.release()

    def _trim_unconfirmed(self) -> None:
        """Forget the pass ends the writer has handled (checked now and then, not at every pass)."""
        unconfirmed, acked = self._unconfirmed, self._producer.acked_seq
        while unconfirmed and unconfirmed[0] <= acked:
            unconfirmed.popleft()

    def _end_interrupted(self, exc: BaseException, incomplete) -> None:
        """Ctrl-C (or another exception) stopped _end before it knew the pass's end was in the ring
        (a wait for ring space returns to Python so that Ctrl-C gets through; a C call's return is
        a point where a signal's exception is raised, too). Sending it again could put a second end
        behind one already written: a lost pass end, as under `drop` with a full ring, which the
        writer records as not complete when its segment is written."""
        if incomplete is None:
            self._totals["incomplete_passes"] += 1
        self._totals["interrupted_pass_ends"] += 1

    def _selected(self, pass_id: int, standalone: bool = False) -> bool:
        """Whether pass ``pass_id`` is dumped. every/skip_passes/pass_range pick root forwards and
        manual passes, counted without the passes of dump() calls outside any pass: those are
        always dumped (the caller asked for that value), and they move no other pass in or out."""
        if not standalone:
            counted = pass_id - self._standalone_passes
            if counted < self.skip_passes or (counted - self.skip_passes) % self.every:
                return False
            if self.pass_range is not None and not self.pass_range[0] <= counted < self.pass_range[1]:
                return False
        if self.max_bytes is not None and self._totals["bytes"] >= self.max_bytes:
            if not self._budget_reached:
                self._budget_reached = True  # said once, not every pass
                log.warning("fastdump: %s reached its byte budget (%d bytes); dumping stops", self.dir, self.max_bytes)
                self._channel.control(protocol.note(self._channel.id, "running", budget_reached=True))
            return False
        return True

    def _mark_incomplete(self, reason: str) -> None:
        """The open pass is not a whole forward; the first reason is the one recorded."""
        if self._incomplete is None:
            self._incomplete = reason

    def _check_thread(self) -> None:
        """Inside the open pass: a calling thread other than the one that opened it marks it mixed."""
        if self._pass_thread != threading.get_ident() and not self._mixed:
            self._mixed = True  # (set before the call, as _begin does)
            self._mark_mixed()

    def _mark_mixed(self) -> None:
        """A second thread entered the open pass: its tensors and the first thread's are merged.
        The caller sets ``_mixed`` first, without a call in between (see _begin)."""
        self._mixed = True
        self._mark_incomplete(_MIXED_REASON)
        self._say_once("threads", "fastdump: %s: forwards from several threads at once on one Dumper: their "
                                  "passes are merged, marked incomplete (mixed) and fail `fastdump verify`; "
                                  "run one forward at a time per Dumper", self.dir)

    def _forward_raised(self, exc: BaseException) -> None:
        if self._depth > 0:
            self._mark_incomplete(f"a forward raised {type(exc).__name__}: {_short(exc)}")

    def _root_begin(self) -> None:
        """A root forward starts: close a dangling manual pass first (see begin_pass), or a pass
        an earlier root forward of this thread opened and never ended (a signal's exception,
        Ctrl-C, delivered on its way to _end: a Python call's first instruction is such a point)."""
        caller = sys._getframe(1)
        if caller.f_code is _CALL_CODE:
            caller = caller.f_back
        if caller is not None and caller.f_code is not _ROOT_CODE:
            caller = None  # (compiled: Dynamo's frames; no check)
        if self._depth > 0 and self._pass_thread == threading.get_ident():
            opener = self._manual_opener
            if opener is not None and not _on_stack(opener[0], caller or sys._getframe(1)):
                self._close_dangling("the function that called begin_pass() returned without end_pass()")
            elif (opener is None and self._root_opener is not None and caller is not None and not self._mixed
                  and not _on_stack(self._root_opener, caller)):  # (mixed: the count left is another thread's)
                self._close_dangling("the root forward that opened it returned without ending it "
                                     "(interrupted)", manual=False)
        if self._depth == 0:
            self._root_opener = caller  # before _begin: no moment where the pass is open unrecorded
        self._begin()

    def _close_dangling(self, why: str, manual: bool = True) -> None:
        self._mark_incomplete(f"dangling {'manual ' if manual else ''}pass: {why}; closed at the next pass")
        self._say_once("dangling", "fastdump: %s: %s; the open pass %d is closed, marked incomplete",
                       self.dir, why, self.pass_id)
        self._depth = 1
        self._end()


def _on_stack(frame, start) -> bool:
    """Whether ``frame`` is still running: ``start`` or one of its callers."""
    while start is not None:
        if start is frame:
            return True
        start = start.f_back
    return False
