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
        (KeyboardInterrupt); the next call (a retry, or the exit hook's) finishes what it left: the
        channel's close (see _close_was_cut for what is recorded meanwhile) or the engine's stop.
        Returns ``stats()``; a second call does nothing more. TypeError for a ``timeout`` that
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
                    # An earlier close() was interrupted (Ctrl-C) before it finished: this one finishes
                    # it. (It returned at once, status "running" or "error", the channel never closed,
                    # the model half unwrapped, and the exit hook skipped it too: verify failed.)
                    closing, self._close_resumes, self._closing_thread, mine = None, False, me, True
                    self._close_done.clear()
                elif self._closed and closing not in (None, me) and self._pid == os.getpid():
                    pass  # another thread's close() is running: waited for below
                elif self._closed and self._engine_unstopped is None:
                    return self.stats()
                elif self._closed:  # its engine's stop was cut (Ctrl-C): finished now (below)
                    closing, mine, unstopped = None, False, self._engine_unstopped  # (cleared once released)
                else:
                    closing = None
                    self._closed, self._closing_thread, mine = True, me, True
            if not mine and closing is None:
                # The writer ran on until the interpreter's exit (or the next attach): this retry
                # could not stop it, and a writer thread left running aborted the interpreter at exit.
                if unstopped is self._engine:
                    self._engine = None
                self._finish_release(unstopped, timeout)
                self._let_go_of_the_ring()
                self._let_go_of_the_dir()
                return self.stats()
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
            if mine and (self._close_resumes or not self._close_began):  # (no pass begins meanwhile: closed)
                self._close_resumes = True  # the next close() (a retry, the exit hook's) finishes it
                _open_dumpers.add(self)
            elif mine and self._engine is not None and self._pid == os.getpid():
                self._engine_unstopped = self._engine  # (its channel's close is over: the retry lets go of it)
                self._engine.release_cut(self._engine_holder)  # (else only a retry would, see _close_channel)
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

        if self._close_cut is not None:  # a close interrupted earlier, finished now: its record is taken back
            if self.status == "error" and self.error == self._close_cut:  # (if it alone made it an error)
                self.status, self.error = "running", None
        try:
            self._close_began = True
            # (Once its close record is in the ring, only its ack is waited for.)
            if self._close_seq or self._end_and_flush(timeout, left):
                if not self._close_seq:
                    # Not sent and waited for in one call: a Ctrl-C in the wait for the ack must know
                    # the record is in the ring. (One landing as put_control returns loses its seq: the
                    # retry sends a second close, which the writer ignores behind the first.)
                    self._close_seq = self._engine.control(protocol.close(self._channel.id, self._totals),
                                                           timeout=left())
                ok = bool(self._close_seq) and self._engine.wait_acked(self._close_seq, left())
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
        except BaseException as exc:  # Ctrl-C, or a signal handler's exception (SIGTERM's sys.exit)
            self._close_was_cut(exc)
            raise
        if self.status == "closed" and self._close_cut is not None:
            self._take_back_cut_record()
        try:
            self._release_engine(left())
        finally:  # (a Ctrl-C in the engine's stop: a retried close(), the next attach or exit finishes it)
            if self._engine is not None:  # (cut before its release began)
                self._engine_unstopped = self._engine
            if self._engine_unstopped is not None:
                # Cut before its token was let go (or in the stop): let go now, the stop left to the
                # next attach or the exit too. Held, the engine went to the next attach, and no later
                # close() stopped its writer (only a retry of this one did).
                self._engine_unstopped.release_cut(self._engine_holder)
            self._let_go_of_the_ring()
            self._let_go_of_the_dir()
        return self.stats()

    def _end_and_flush(self, timeout: float, left) -> bool:
        """The channel's close up to its ``close`` record: end the open pass, close the CUDA-graph
        recorders, flush the CUDA stager, send the pass ends a full ring refused. True when the
        ``close`` is to be sent (the writer lives and dumping had not stopped). Run again by a close()
        that finishes an interrupted one: the steps that must not run twice are marked done
        (``_close_steps``), and one cut inside such a step cannot be finished (``_close_step``)."""
        if self._depth > 0:
            self._mark_incomplete("still open at close(): closed inside the model's forward"
                                  if self._root_opener is not None else
                                  "still open at close(): end_pass() was not called")
            self._cut_outer_passes()
            self._depth = 1
            self._end()
        if self._graphs is not None and "graphs" not in self._close_steps:
            # Replays' passes and counts, before the final flush; stops its drains. (It adds its
            # counts as it goes: never run twice.)
            self._close_step = "the CUDA-graph recorders' close" if self._graphs.recording else None
            self._graphs.close(self._totals, left())
            self._close_steps.add("graphs")
            self._close_step = None
        if not (self._engine.alive and self.status == "running"):
            return False
        self._engine.flush_cuda(left())
        self._fold_lane_counts()
        if "cuda" not in self._close_steps:
            # Records a capture holds are padding now (never written). They were staged, so they
            # are lost, not dropped by policy: rank.json says so and `fastdump verify` fails.
            # (Cut short, the stager's close goes on in its own thread: never run twice.)
            self._close_step = "the CUDA stager's close" if self._engine.cuda_staging else None
            held = self._engine.close_cuda_if_last(left())
            self._close_steps.add("cuda")
            self._close_step = None
            stuck = self._engine.cuda_close_stuck
            if held > 0:
                self._totals["lost_at_close"] += held
                log.error("fastdump: %d staged CUDA tensors lost at close: %s", held, stuck or
                          "a CUDA-graph capture still running on another stream held their batch")
            if stuck:  # the writer waits for good at the first unfinished record: nothing after it lands
                self._disable(f"close timed out after {timeout:g} s: {stuck}; "
                              f"{self._unconfirmed_passes()} passes not confirmed on disk", writer_stuck=True)
                return True
        stopped = self._engine.cuda_staging_stopped()
        if stopped:
            # The drain failed after this Dumper's last CUDA tensor (a later one would have
            # seen DISABLED), or in the final flush: what it had not copied became padding.
            # rank.json says why; `verify` counts what is missing.
            log.error("fastdump: %s: %s", self.dir, stopped)
            self._channel.control(protocol.note(self._channel.id, "running",
                                                cuda_staging={"stopped": stopped}), block=True)
        if self._late_ends:  # the writer got going again: their passes' ends, before the close
            self._send_late_ends(time.monotonic() + left())
        return True

    def _close_was_cut(self, exc: BaseException) -> None:
        """close() was interrupted (Ctrl-C; a signal handler's exception, such as a SIGTERM handler's
        sys.exit) in the channel's close. Recorded as what is true now, and finished by the next
        close() (a retry, the exit hook's) where it can be: all of it was recorded as "close
        interrupted" before, and verify failed dumps whose writer got every pass and the close.

        - Its ``close`` record is in the ring: the writer closes the channel with this Dumper's
          counts whatever happens here (rank.json says how that went), so nothing is recorded on
          disk; the next close() waits for the ack.
        - Not yet: what the writer has is not closed, and this process may never get to close it
          (a second Ctrl-C, a kill): producer_error.json says so (verify fails) until the next
          close() has finished the close, which takes it back.
        - Cut inside the CUDA-graph recorders' or the CUDA stager's close, which cannot be run
          again: recorded for good."""
        what = f"close interrupted ({type(exc).__name__})"
        if self.status != "running":
            return  # (already given up on, and said why)
        if self._close_step is not None:
            self._disable(f"{what} in {self._close_step}; {self._unconfirmed_passes()} passes not "
                          "confirmed on disk", writer_stuck=True)
            return
        self._close_resumes = True
        if self._close_seq:
            self.status, self.error = "error", (f"{what} before the writer confirmed it; its close is in "
                                                "the ring: close() again to wait for it")
            log.warning("fastdump: %s: %s", self.dir, self.error)
        else:
            self._disable(f"{what} before its close reached the writer; {self._unconfirmed_passes()} passes "
                          "not confirmed on disk", writer_stuck=True)
            self._close_steps.add("recorded")
        self._close_cut = self.error

    def _take_back_cut_record(self) -> None:
        """A retried close() finished a close that was cut: the producer_error.json that said so is
        no longer true (the writer closed the channel with this Dumper's counts)."""
        self._close_cut = None
        if "recorded" not in self._close_steps or not self._own_dir:
            return
        try:
            os.unlink(self._anchor.join(_fmt.PRODUCER_ERROR_FILE))
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.error("fastdump: cannot remove %s/%s (the close it reports was finished): %s", self.dir,
                      _fmt.PRODUCER_ERROR_FILE, exc)
        log.warning("fastdump: %s: the interrupted close was finished", self.dir)

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
            engine = self._engine_unstopped = self._engine  # (no signal between: a retry finds it)
            self._engine = None
            self._finish_release(engine, timeout)

    def _finish_release(self, engine, timeout: float) -> None:
        """Let go of ``engine`` (stopping it when this was its last Dumper). Cut short (Ctrl-C), the
        next close() calls this again, which finishes the stop (Engine.release is safe to repeat)."""
        engine.release(timeout, self._engine_holder)
        self._engine_unstopped = None
