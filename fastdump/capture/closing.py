"""The end of a Dumper: ``close()`` (end what is open, flush, close the channel, let go of the
engine, the ring and the rank directory, each bounded by one deadline), and dumping
stopped for good on a failure (``_disable``, ``_abandon_attach``), recorded where a
reader finds it.

``ClosingMixin``'s methods are the Dumper's (fastdump/capture/dumper.py): one ``self``, the
attributes Dumper.__init__ sets; see docs/INTERNALS.md.
"""

from __future__ import annotations

import logging
import numbers
import os
import threading
import time

from .. import protocol, format as _fmt, segment_list as _segment_list
from ..fsutil import atomic_write_json as write_json_atomic, load_json as _load_json
from .process import _closing_dumpers, _open_dumpers
from .text import _short

log = logging.getLogger("fastdump")


class ClosingMixin:
    """The Dumper's end: close(), and dumping stopped for good on a failure."""

    def close(self, timeout: float = 600.0) -> dict:
        """Flush everything staged, wait until it is on disk, detach from the model.

        Returns within about ``timeout`` seconds whatever the writer does: what was not confirmed
        on disk by then is recorded as an error in the stats and producer_error.json. Ctrl-C interrupts it
        (KeyboardInterrupt, after recording the error); one that lands before the channel's close began
        (the model's walk, the unwrapping) leaves the whole close to the next call (a retry, or the exit
        hook's). Returns ``stats()``; a second call does nothing more. TypeError for a ``timeout`` that
        is no number (None, NaN), before anything."""
        # Checked before anything is done: a timeout of None or "5" raised TypeError after the
        # wrappers came off, with the Dumper marked closed and its channel open (a second close()
        # did nothing, status "running" for good); NaN waited for nothing and lost every buffered pass.
        if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or timeout != timeout:
            raise TypeError(f"close: timeout must be a number of seconds, not {timeout!r}")
        me, mine = threading.get_ident(), False  # mine: this call closes (set with _closed, no signal between)
        try:
            with self._lock:  # (held by a registration wrapping a module put in: see _follow_registrations)
                closing = self._closing_thread
                if self._closed and self._close_resumes:
                    # An earlier close() was interrupted (Ctrl-C) before it closed anything: this one
                    # does it all. (It returned at once, status "running", the channel never closed,
                    # the model half unwrapped, and the exit hook skipped it too: verify failed.)
                    closing, self._close_resumes, self._closing_thread, mine = None, False, me, True
                    self._close_done.clear()
                elif self._closed and closing not in (None, me) and self._pid == os.getpid():
                    pass  # another thread's close() is running: waited for below
                elif self._closed:
                    return self.stats()
                else:
                    closing = None
                    self._closed, self._closing_thread, mine = True, me, True
            if closing is not None:
                # It returned at once, status "running", rank.json not final: a caller reading or
                # verifying the dump next found it unfinished. Now it returns once that close has.
                deadline = time.monotonic() + timeout
                self._close_done.wait(timeout)
                if self._close_resumes:  # interrupted before it closed anything: this call does it
                    return self.close(max(0.0, deadline - time.monotonic()))
                return self.stats()
            with self._lock:
                try:
                    self._totals["modules_not_followed"] = self._not_followed()
                except Exception as exc:  # (a model that cannot be walked now: said, not raised)
                    self._totals["modules_not_followed"] = [f"(the model's modules could not be checked at close: "
                                                            f"{type(exc).__name__}: {_short(exc)})"]
                if self._totals["modules_not_followed"]:
                    log.error("fastdump: %s: module edits after attach that fastdump could not follow "
                              "(`fastdump verify` fails): %s", self.dir,
                              "; ".join(self._totals["modules_not_followed"]))
            self._unwrap()
            _closing_dumpers.add(self)  # (the exit hook waits for it: see close_all)
            _open_dumpers.discard(self)
            return self._close_channel(timeout)
        except BaseException:
            if mine and not self._close_began:  # nothing closed yet; no pass begins meanwhile (closed)
                self._close_resumes = True  # the next close() (a retry, the exit hook's) does it all
                _open_dumpers.add(self)
            raise
        finally:
            if mine:
                _closing_dumpers.discard(self)
                self._close_done.set()

    def _close_channel(self, timeout: float) -> dict:
        """close() once the wrappers are off: end what is open, flush, close the channel, let go."""
        if self._dropped_lazy:  # (dropped in a pass close() cuts short: unwrapped now, nothing captured)
            self._close_dropped_lazy()
        if self._engine is None or self._pid != os.getpid():
            self._let_go_of_the_dir()
            return self.stats()  # never started, or a forked child's copy: the parent's engine is not ours
        deadline = time.monotonic() + timeout

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        try:
            self._close_began = True  # from here an interrupted close is recorded (below), not done again
            if self._depth > 0:
                self._mark_incomplete("still open at close(): closed inside the model's forward"
                                      if self._root_opener is not None else
                                      "still open at close(): end_pass() was not called")
                self._cut_outer_passes()
                self._depth = 1
                self._end()
            if self._graphs is not None:  # replays' passes and counts, before the final flush; stops its drains
                self._graphs.close(self._totals, left())
            if self._engine.alive and self.status == "running":
                self._engine.flush_cuda(left())
                self._fold_lane_counts()
                # Records a capture holds are padding now (never written). They were staged, so they
                # are lost, not dropped by policy: rank.json says so and `fastdump verify` fails.
                held = self._engine.close_cuda_if_last(left())
                stuck = self._engine.cuda_close_stuck
                if held > 0:
                    self._totals["lost_at_close"] += held
                    log.error("fastdump: %d staged CUDA tensors lost at close: %s", held, stuck or
                              "a CUDA-graph capture still running on another stream held their batch")
                if stuck:  # the writer waits for good at the first unfinished record: nothing after it lands
                    self._disable(f"close timed out after {timeout:g} s: {stuck}; "
                                  f"{self._unconfirmed_passes()} passes not confirmed on disk", writer_stuck=True)
                stopped = None if stuck else self._engine.cuda_staging_stopped()
                if stopped:
                    # The drain failed after this Dumper's last CUDA tensor (a later one would have
                    # seen DISABLED), or in the final flush: what it had not copied became padding.
                    # rank.json says why; `verify` counts what is missing.
                    log.error("fastdump: %s: %s", self.dir, stopped)
                    self._channel.control(protocol.note(self._channel.id, "running",
                                                        cuda_staging={"stopped": stopped}), block=True)
                if self._late_ends:  # the writer got going again: their passes' ends, before the close
                    self._send_late_ends(deadline)
                ok = self._channel.control(protocol.close(self._channel.id, self._totals), wait=True,
                                           timeout=left())
                if self.status != "running":
                    pass  # given up on above (the CUDA stager never finished): said why already
                elif ok and self._channel.failed:  # this root's final segment write failed (disk full)
                    self._disable(self._channel_failure())
                elif ok and self._engine.alive:  # the final segment write itself can fail (disk full)
                    self.status = "closed"
                elif self._engine.closed:
                    self._closed_under_us()
                elif self._engine.alive:
                    self._disable(f"close timed out after {timeout:g} s; {self._unconfirmed_passes()} "
                                  "passes not confirmed on disk", writer_stuck=True)
                else:
                    self._disable(self._engine.error())
            elif self.status == "running" and self._engine.closed:
                self._closed_under_us()
            elif self.status == "running":
                self._disable(self._engine.error())
        except KeyboardInterrupt:
            self._disable(f"close interrupted (KeyboardInterrupt); {self._unconfirmed_passes()} passes "
                          "not confirmed on disk", writer_stuck=True)
            raise
        try:
            self._release_engine(left())
        finally:  # (a Ctrl-C in the engine's stop: the exit hook stops its writer; the ring and dir go now)
            self._let_go_of_the_ring()
            self._let_go_of_the_dir()
        return self.stats()

    def _closed_under_us(self) -> None:
        """The engine was shut down while this close() ran (the exit hook, past its deadline for
        this close on another thread): the writer closed this channel itself with what it had
        (rank.json "closed", an unfinished pass incomplete), without this close's message. Whole
        when every pass this Dumper ended is in the segment files; else those passes are lost and
        the error says why (not "writer process exited with code 0", which read as a crash)."""
        missing = self._totals["passes"] - self._passes_on_disk()
        if missing <= 0 and not self._late_ends:
            self.status = "closed"
            log.warning("fastdump: %s: the staging engine shut down (interpreter exit) while close() ran on "
                        "another thread; every pass is on disk, this close's counts are not in rank.json",
                        self.dir)
            return
        self._disable(f"the staging engine shut down (interpreter exit) while close() ran on another thread: "
                      f"{max(missing, len(self._late_ends))} passes not confirmed on disk", writer_stuck=True)

    def _let_go_of_the_dir(self) -> None:
        """Close the held rank directory: nothing is written there by this process any more."""
        if self._anchor is not None:
            self._anchor.close()

    def _let_go_of_the_ring(self, fold: bool = True) -> None:
        """Drop this Dumper's references to the ring (its 256 MiB mapping is freed with the last
        one). A Dumper sits in reference cycles (its wrappers, its capture state), so without this
        a closed Dumper kept its ring mapped and resident until the garbage collector happened to
        run: each attach/close cycle of a serving process added the ring's size to its RSS."""
        if fold:
            self._fold_lane_counts()  # the last counts, while the channel is still here
        self._engine = self._producer = self._channel = self._stage_fast = None
        self._state.lane = None

    def _unconfirmed_passes(self) -> int:
        """Passes this Dumper ended that are not known to be on disk (a close that timed out or was
        interrupted says how many). The writer acks a pass end once it has buffered it, long before
        its segment is written (256 passes, segment_seconds, idle or close): acks say nothing of the
        disk. What is: the segment list (segments.jsonl, committed by rank.json), which the writer
        extends after each segment file (see _passes_on_disk). Read here, at close only, never per pass."""
        acked = self._producer.acked_seq if self._producer is not None else 0
        not_handled = sum(1 for seq in self._unconfirmed if seq > acked)  # not even buffered
        return max(not_handled, self._totals["passes"] - self._passes_on_disk())

    def _passes_on_disk(self) -> int:
        """Ended passes in the segment files the segment list names (0 when it cannot be read). A pass a
        segment holds unfinished (``complete`` false: it was split) counts once, with its end."""
        try:
            info = _load_json(self._anchor.join(_fmt.RANK_FILE))
            segments, problem, _ = _segment_list.read(self._anchor.join(""), info)  # (its own writer's: this format)
            if problem:
                raise ValueError(problem)
            on_disk, open_pass = 0, None  # the previous segment's unfinished last pass
            for segment in segments:
                on_disk += int(segment["passes"])
                if open_pass is not None and int(segment["first_pass"]) == open_pass:
                    on_disk -= 1  # the same pass again, continued
                open_pass = None if segment.get("complete", True) else int(segment["last_pass"])
            return on_disk - (open_pass is not None)  # the last one's end is not on disk
        except Exception as exc:  # missing, unreadable, malformed: nothing is known to be on disk
            log.debug("fastdump: %s: cannot read %s: %s", self.dir, _fmt.RANK_FILE, exc)
            return 0

    def _disable(self, error: str, writer_stuck: bool = False) -> None:
        """Dumping stops for good; serving goes on. Said once, and recorded without waiting: a live
        writer gets it as a note (it writes rank.json; only it does); when the writer is dead,
        ``writer_stuck`` (close timed out or was interrupted), or the note finds no ring space,
        it goes to producer_error.json, which readers merge and ``verify`` fails on."""
        if self.status == "error":
            return
        self.status, self.error = "error", error
        self._capturing = False
        log.error("fastdump: dumping to %s stopped: %s", self.dir, error)
        if not writer_stuck and self._engine is not None and self._channel is not None and self._engine.alive \
                and not self._channel.failed:  # (a channel the writer stopped takes no note)
            if self._channel.control(protocol.note(self._channel.id, "error", error=error), block=False):
                return  # in the ring: the writer merges it into rank.json
        if not self._own_dir:  # (not made, or another Dumper's: its dump is not this one's to mark)
            log.error("fastdump: %s is not this Dumper's directory: the error is not recorded there", self.dir)
            return
        try:
            # Through the held directory: a path replaced by a link during the run would lead out of the dump
            write_json_atomic(self._anchor.join(_fmt.PRODUCER_ERROR_FILE),
                              {"status": "error", "error": error, "pid": os.getpid(), "time": time.time()})
        except OSError as exc:
            log.error("fastdump: cannot record the error in %s/%s: %s", self.dir, _fmt.PRODUCER_ERROR_FILE,
                      self._anchor.readable(str(exc)) if self._anchor is not None else exc)

    def _channel_failure(self) -> str:
        """Why the writer stopped writing this Dumper's directory alone: its error as the writer
        left it in the ring header, else its rank.json's (a deleted directory or a read-only file
        system leaves no rank.json to read it from)."""
        error = None
        try:
            error = self._channel.failure()
        except Exception:
            pass
        if not error:
            try:
                error = _load_json(self._anchor.join(_fmt.RANK_FILE)).get("error")
            except (OSError, ValueError, AttributeError):
                pass  # (never opened, unreadable: the writer's log says why)
        return str(error) if error else f"the writer stopped writing {self.dir} (its log says why)"

    def _abandon_attach(self, error: str | None, writer_stuck: bool = False) -> None:
        """Attach failed or was interrupted: record ``error`` (None: the caller raises it, strict=),
        close this Dumper's channel if it was opened (without waiting), and let go of the engine now
        (its shutdown, if this was its last Dumper, bounded by block_timeout_s), so that no
        half-started Dumper keeps the writer or its ring: a stuck writer is then killed by the
        last close, the engine's shutdown or exit. ``close()`` of such a Dumper only reports."""
        if error is not None:
            self._disable(error, writer_stuck=writer_stuck)
        try:
            if self._channel is not None and self._engine is not None and self._engine.alive:
                self._channel.control(protocol.close(self._channel.id, self._totals), block=False)
        except Exception as exc:
            log.debug("fastdump: %s: closing the channel of a failed attach: %s", self.dir, exc)
        self._release_engine(self.options.block_timeout_s)
        self._let_go_of_the_ring(fold=False)
        self._let_go_of_the_dir()

    def _release_engine(self, timeout: float = 600.0) -> None:
        if self._engine is not None:
            engine, self._engine = self._engine, None
            engine.release(timeout)
