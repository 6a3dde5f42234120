"""One staging engine per process: the shared-memory ring, the writer, and their liveness.

Every Dumper in a process (the EAGLE target and draft, several ranks' threads) stages into the same
engine; each opens its own channel, which the writer maps to one ``<root>/<role>/<rank dir>``.
The engine starts with the first attach and shuts down when the last Dumper closes.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from .. import _C
from .. import fsutil, protocol
from ..options import EngineOptions, _nonnegative_float
from . import tensor_reader
from .channel import Channel

log = logging.getLogger("fastdump")

# close_cuda_if_last waits at least this long for the stager's close: a close() whose timeout the
# final flush already spent still gets the moment a healthy stager needs to stop its drain.
CUDA_CLOSE_FLOOR_S = 0.25


def _returns_within(call, timeout: float) -> bool:
    """Run ``call()`` in a daemon thread; True once it returned (its exception re-raised here),
    False when it is still running after ``timeout`` s (it is left running: a C++ wait that cannot
    be cut short, which then holds only that thread)."""
    done, error = threading.Event(), []

    def run():
        try:
            call()
        except BaseException as exc:
            error.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name="fastdump-cuda-close", daemon=True).start()
    if not done.wait(timeout):
        return False
    if error:
        raise error[0]
    return True

SHM_PREFIX = "fastdump-"
SHM_DIR = Path("/dev/shm")
_counter = itertools.count()
# Blocking waits return to Python this often, so Ctrl-C (KeyboardInterrupt) gets through.
WAIT_SLICE_S = 0.1
# How stale a pass's check that the writer lives may be: the poll of its pipe is a syscall, which
# costs the forward thread ~5 us per pass between the model's kernels (benchmarks/RESULTS.md 0i).
LIVENESS_POLL_S = 0.02
EXIT_TIMEOUT_VAR = "FASTDUMP_EXIT_TIMEOUT_S"
DEFAULT_EXIT_TIMEOUT_S = 30.0
# A writer thread still busy when its stop's time is up is told to give up at its next batch
# boundary (writer.loop.StopSignal.abandon); this long is waited for that.
THREAD_ABANDON_S = 1.0


def exit_timeout() -> float:
    """Seconds the interpreter's exit may spend closing Dumpers and stopping the writer."""
    raw = os.environ.get(EXIT_TIMEOUT_VAR)
    if raw in (None, ""):
        return DEFAULT_EXIT_TIMEOUT_S
    try:
        return _nonnegative_float(raw)  # the parser fastdump.config checks this variable with
    except ValueError:
        log.error("fastdump: %s=%r is not a number of seconds >= 0; using %g", EXIT_TIMEOUT_VAR, raw,
                  DEFAULT_EXIT_TIMEOUT_S)
        return DEFAULT_EXIT_TIMEOUT_S


# A region's name lives from its creation until the writer has mapped it (then it is unlinked), at
# most the engine's start timeout (60 s). A younger one may be an attach in progress in another pid
# namespace sharing /dev/shm (containers of one pod), whose pid looks dead from here: unlinking it
# made that attach fail (its writer found no region).
STALE_REGION_AGE_S = 180.0


def remove_stale_regions(shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink shared-memory ring regions whose producer process is gone (left by a crash before unlink)."""
    removed = []
    try:
        entries = list(shm_dir.glob(SHM_PREFIX + "*"))
    except OSError:
        return removed
    for path in entries:
        try:
            pid = int(path.name[len(SHM_PREFIX):].split("-")[0])
        except ValueError:
            continue
        if pid <= 0 or pid == os.getpid() or fsutil.pid_alive(pid):  # (0: not a process; kill(0) is our group)
            continue
        try:
            if time.time() - path.stat().st_mtime < STALE_REGION_AGE_S:
                continue
        except OSError:
            continue
        try:
            path.unlink()
            removed.append(path.name)
        except OSError:
            pass
    return removed



def _exact_tensor_type():
    """The one tensor type whose Python attributes ChannelStager.stage_tensor reads without the
    tensor reader (a subclass's may lie: it takes the general path). A seam: the mock-runtime tests
    stage their fake CUDA tensor type in C as a GPU's torch.Tensor."""
    return sys.modules["torch"].Tensor  # (strided given: torch is imported)


def _process_state(pid: int):
    """(state letter, CPU ticks used) of a process, from Linux ``/proc/PID/stat``; None if unreadable."""
    fields = fsutil.proc_stat_fields(pid)
    try:
        return fields[0].decode(), int(fields[11]) + int(fields[12])  # state, utime + stime
    except (TypeError, IndexError, ValueError, UnicodeDecodeError):
        return None


def _why_silent(pid: int) -> str | None:
    """What a writer process that did not answer is doing, from the kernel's view of it, or None
    where that cannot be told. A writer at ``writer_priority="idle"`` (SCHED_IDLE) on a machine whose
    every CPU other processes keep busy is runnable and hardly runs: behind, not stopped, so attach
    goes on (Engine._open_taken). Costs 0.1 s, only when an ack is late."""
    first = _process_state(pid)
    if first is None:
        return None
    if first[0] in ("T", "t"):
        return "it is stopped or stuck: stopped (SIGSTOP or a debugger)"
    if first[0] == "D":
        return "it is stopped or stuck: waiting on its disk (a frozen or very slow disk?)"
    if first[0] != "R":
        return None
    time.sleep(0.1)
    second = _process_state(pid)
    if second is None or second[0] != "R":
        return None
    return _BUSY if second[1] > first[1] else _STARVED


# A writer in one of these states is alive and behind, not stuck: it takes an open in ring order.
_BUSY = "it is running but busy (a backlog to write, or a slow disk)"
_STARVED = ("it is runnable but got no CPU: other work keeps every CPU busy, and a writer at "
            "writer_priority='idle' runs only on idle CPU (writer_priority='normal' gives it its share)")


class Engine:
    """The ring plus its writer (a child process by default, or a thread)."""

    _current: "Engine | None" = None
    _lock = threading.Lock()

    def __init__(self, options: EngineOptions, chunk_mb: float = 0, start_timeout: float = 60.0):
        """``chunk_mb``: tensors above this are split over several records (0: a quarter of the
        ring, the most a record may take; larger chunks spare the writer a reassembly copy).
        ``options.writer_priority``: ``idle`` runs the writer process under SCHED_IDLE, so it only takes
        CPU time the model leaves unused (see fastdump/writer/__main__.py); ``normal`` does not.
        A writer thread always shares the serving process's priority."""
        self.options = options  # checked by EngineOptions; see acquire for who decides them
        ring_mb, writer, self.writer_priority = options.ring_mb, options.writer, options.writer_priority
        remove_stale_regions()
        self.pid = os.getpid()
        self.mode = writer
        # Who holds this engine (acquire's ``holder``, one token per Dumper): a set, not a count, so
        # that a release interrupted before or after it let go (Ctrl-C) can simply be called again.
        self._holders: set = set()
        self.closed = False
        self._stop_cut = False  # shutdown() was cut short (Ctrl-C): a later call finishes it
        self.cuda_close_stuck = None  # why close_cuda_if_last gave up on the CUDA stager, if it did
        # A blocking wait for ring space timed out (block_timeout_s): Dumpers stage as under `drop`
        # until the writer gives ring space back again (see Channel.begin).
        self.stalled = False
        self._stall_released = 0
        self._channels = itertools.count()
        self._cuda_stager = None
        self._cuda_lock = threading.Lock()
        # Random bits too: a region left by a killed process of the same pid (a restarted container's
        # pid 1 on a /dev/shm that outlived it, which remove_stale_regions must leave: it may be
        # another live container's) made shm_open fail with EEXIST at every attach.
        name = f"/{SHM_PREFIX}{self.pid}-{next(_counter)}-{os.urandom(4).hex()}"
        self.producer = _C.Producer(name, int(ring_mb * (1 << 20)), int(chunk_mb * (1 << 20)))
        self._max_control_bytes = self.producer.max_control_bytes
        self._proc = None
        self._thread = None
        try:
            if writer == "process":
                self._start_process(name)
            else:
                self._start_thread(name)
            self._wait_attached(start_timeout)
        except BaseException:
            self.producer.disable()
            self._stop_writer(timeout=5)
            raise
        finally:
            # Named only until the writer has mapped it: then no crash can leak it.
            self.producer.unlink()

    # -- writer lifecycle ------------------------------------------------------------------------
    def _start_process(self, name: str) -> None:
        cmd = [sys.executable, "-m", "fastdump.writer", "--shm", name, "--priority", self.writer_priority]
        # stdin: our write end; its EOF tells the writer we died (even under kill -9).
        # stdout: the writer's write end; its EOF tells us the writer died.
        # Its own process group keeps Ctrl-C in the serving terminal from killing the writer
        # mid-drain. Not its own session: Linux schedules each session as a group (autogroup), and
        # a writer in a group of its own would compete with the whole model as an equal, whatever
        # its own priority (measured: ~660 preemptions of torch's threads in a 4 s decode loop).
        env = dict(os.environ)
        # The writer imports this very fastdump, also when the serving process found it through
        # sys.path rather than an installed package or PYTHONPATH.
        pkg_parent = str(Path(__file__).resolve().parents[2])  # fastdump/staging/engine.py
        env["PYTHONPATH"] = pkg_parent + os.pathsep + env.get("PYTHONPATH", "")
        group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      close_fds=True, env=env, **group)
        self.producer.set_writer_fd(self._proc.stdout.fileno())

    def _start_thread(self, name: str) -> None:
        from ..writer.loop import StopSignal, run_consumer  # imports h5py: registers its atexit hook

        _exit_hook_before_h5pys()
        consumer = _C.Consumer(name)
        self._thread_stop = StopSignal()
        self._thread = threading.Thread(target=run_consumer, args=(consumer, False, self._thread_stop),
                                        name="fastdump-writer", daemon=True)
        self._thread.start()

    def _wait_attached(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.producer.writer_attached():
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"fastdump writer process exited at start (code {self._proc.returncode})")
            if time.monotonic() > deadline:
                raise RuntimeError("fastdump writer did not start in time")
            time.sleep(0.002)

    def _stop_writer(self, timeout: float) -> None:
        if self._proc is not None:
            try:
                self._proc.stdin.close()
            except OSError:
                pass
            try:
                self._proc.wait(timeout=max(timeout, 0))  # waits in Python: Ctrl-C gets through
            except subprocess.TimeoutExpired:
                log.error("fastdump: writer did not exit in %.1f s; killing it", timeout)
                self._kill_writer()
            self._proc.stdout.close()
        if self._thread is not None:
            self._stop_thread(timeout)

    def _stop_thread(self, timeout: float) -> None:
        """A writer thread: the producer is done (as the stdin EOF of a writer process). The loop
        drains what is in the ring and returns; one still busy after ``timeout`` is told to give
        up at its next batch boundary. A thread left running would abort the interpreter at exit
        (it is a daemon inside C++ code: "terminate called without an active exception")."""
        self._thread_stop.requested = True
        self._thread.join(max(timeout, 0))
        if self._thread.is_alive():
            self._thread_stop.abandon = True
            self._thread.join(THREAD_ABANDON_S)
            if self._thread.is_alive():
                log.error("fastdump: the writer thread did not end in %.1f s (stuck in a disk write?)",
                          timeout + THREAD_ABANDON_S)

    def _kill_writer(self) -> None:
        """SIGKILL the writer's process group (it leads its own; SIGKILL also ends a stopped one)."""
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            self._proc.kill()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.error("fastdump: writer process %d survived SIGKILL", self._proc.pid)

    # -- channels ----------------------------------------------------------------------------------
    def open_channel(self, facts: dict, *, fast_codes: dict, strided, block: bool, block_timeout_s: float,
                     device_ring_mb, min_wait_s: float = 1.0) -> "Channel":
        """A new channel, announced to the writer (``protocol.open_channel``'s fields) and acked:
        the Dumper's one object for staging (fastdump/staging/channel.py).

        Waits for the writer (ring space, then its ack) ``block_timeout_s`` in all, the longest a
        forward waits for it, but at least ``min_wait_s`` (the writer creates the directory and
        makes its first rank.json durable: a tiny block_timeout_s must not make a healthy writer
        fail an attach for good). A writer that is stopped or stuck (SIGSTOP, a debugger, a frozen
        disk) or dead raises RuntimeError saying so, never holds attach hostage; one that is merely
        behind (runnable: busy, or starved at idle priority) does not fail it (_open_taken). Ctrl-C interrupts
        the wait (KeyboardInterrupt). Whenever no channel is returned, the open is withdrawn: an
        error note and a ``close`` follow it into the ring without waiting, so a writer that gets
        to the open later records the channel as failed and closes it (ignored if it never came)."""
        channel = next(self._channels)
        wait_s = max(block_timeout_s, min_wait_s)
        deadline = time.monotonic() + wait_s
        try:
            seq = self.control(protocol.open_channel(channel, **facts), block_timeout=wait_s)
            if not (seq != 0 and self._open_taken(seq, deadline, min_wait_s, facts.get("dir", ""))):
                if not self.alive:
                    raise RuntimeError(self.error())
                who = f"writer process {self._proc.pid}" if self._proc is not None else "writer thread"
                why = _why_silent(self._proc.pid) if self._proc is not None else None
                raise RuntimeError(f"the {who} did not answer within {wait_s:g} s (block_timeout_s, "
                                   f"at least {min_wait_s:g} s): "
                                   + (why or "it is stopped or stuck (SIGSTOP, a debugger, a frozen disk?)"))
        except BaseException as exc:
            try:  # withdraw the open; a writer that never got it ignores both
                if self.control(protocol.note(channel, "error", error=f"attach gave up: {type(exc).__name__}: "
                                              f"{exc}"), block=False):
                    self.control(protocol.close(channel, {}), block=False)
            except Exception as withdraw_exc:  # the exception being raised is the one that matters
                log.debug("fastdump: withdrawing channel %d: %s", channel, withdraw_exc)
            raise
        return Channel(self, channel, fast_codes, strided, block=block, block_timeout_s=block_timeout_s,
                       device_ring_mb=device_ring_mb, where=facts.get("dir", ""))

    def _open_taken(self, seq: int, deadline: float, patience_s: float, where: str) -> bool:
        """The open ``seq`` is in the ring: True once the writer acked it, or once, after
        ``patience_s`` (and again at ``deadline``), the kernel shows the writer process runnable:
        busy with a backlog, or starved of CPU at writer_priority="idle". Such a writer is behind,
        not stuck, and takes the open before any record of its channel; a failure to open the
        directory then stops the Dumper at its next pass (Channel.failed). An idle writer on a
        machine other processes keep busy gets 1-2 ms of CPU a second: a later attach (the EAGLE
        draft's) waited 0.3-5 s for its ack and gave up at the default 5 s (2 of 6, measured)."""
        for until in sorted({min(deadline, time.monotonic() + patience_s), deadline}):
            if self.wait_acked(seq, max(0.0, until - time.monotonic())):
                return True
            why = _why_silent(self._proc.pid) if self._proc is not None and self.alive else None
            if why in (_BUSY, _STARVED):
                log.warning("fastdump: the writer process %d has not acked the open of %s yet: %s; attach goes "
                            "on, and the writer takes the open before any of its records", self._proc.pid,
                            where, why)
                return True
        return False

    def channel_stager(self, channel: int, fast_codes: dict, strided) -> "_C.ChannelStager":
        """A channel's CPU hot path into this engine's ring (see Dumper._stage)."""
        tensor_reader.install()  # once per process: how stage_tensor reads tensors
        tensor_type = _exact_tensor_type() if strided is not None else None
        lane = _C.ChannelStager(self.producer, channel, fast_codes, strided, tensor_type)
        lane.set_pass_templates(*protocol.plain_pass_templates(channel))  # a pass's begin/end in one C call
        return lane

    def control(self, msg: dict, wait: bool = False, timeout: float = 600.0, block: bool = True,
                block_timeout: float | None = None):
        """Send a control message in ring order: its seq (0: not sent); with ``wait``, True once the
        writer handled it (False: not sent, writer gone, or ``timeout`` passed).

        ``block=False`` (the ``drop`` policy) gives up at once when the ring is full; a blocking
        send waits up to ``block_timeout`` (default ``timeout``) for space. Every wait returns to
        Python every WAIT_SLICE_S, so Ctrl-C interrupts it.
        """
        deadline = time.monotonic() + (timeout if block_timeout is None else block_timeout)
        payload = protocol.encode(msg)
        channel = msg.get("channel", 0)
        if len(payload) > self._max_control_bytes:  # no wait can make room for it: never spin on it
            payload = protocol.fit(msg, payload, self._max_control_bytes)
            if payload is None:
                log.error("fastdump: a %r message of more than %d bytes cannot go through the ring; not sent",
                          msg.get("op"), self._max_control_bytes)
                return False if wait else 0
        seq = self.producer.put_control(channel, payload, False)
        while seq == 0 and block and not self.producer.disabled:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            seq = self.producer.put_control(channel, payload, True, min(left, WAIT_SLICE_S))
        if not wait:
            return seq
        return seq != 0 and self.wait_acked(seq, timeout)

    def wait_acked(self, seq: int, timeout: float) -> bool:
        """True once the writer handled control record ``seq``; False on timeout or a dead writer."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if self.producer.wait_acked(seq, max(0.0, min(left, WAIT_SLICE_S))):
                return True
            if left <= 0 or not self.producer.writer_alive():
                return False

    def mark_stalled(self) -> None:
        """A blocking wait for ring space ran out: stage as under `drop` until the writer moves."""
        self.stalled = True
        self._stall_released = self.producer.released_bytes

    def space_returned(self) -> bool:
        """The writer has given ring space back since the stall began (it is consuming again)."""
        return self.producer.released_bytes != self._stall_released

    @property
    def alive(self) -> bool:
        return self.producer.writer_alive()

    @property
    def alive_lately(self) -> bool:
        """``alive`` as each pass checks it: the writer's own state is read every time, its pipe
        polled at most every LIVENESS_POLL_S (a writer killed with SIGKILL is noticed that much
        later; what was staged meanwhile is in a dump the closing Dumper records as failed)."""
        return self.producer.writer_seen_alive(LIVENESS_POLL_S)

    def error(self) -> str:
        text = self.producer.writer_error()
        if text:
            return text
        exited = self._proc is not None and self._proc.poll() is not None
        if self.closed and self.pid == os.getpid() and (self._proc is None or (exited and self._proc.returncode == 0)):
            # (shutdown() stopped it: a Dumper still using the engine was closing on another thread at exit)
            return "the staging engine was shut down (interpreter exit, or its last Dumper closed): its writer has stopped"
        if exited:
            return f"writer process exited with code {self._proc.returncode}"
        stager_error = self._cuda_stager_error()
        if stager_error:
            return stager_error
        return "writer stopped"

    def cuda_staging_stopped(self) -> str:
        """Why CUDA staging stopped for good ('' while it runs, or when there is no CUDA stager)."""
        return self._cuda_stager_error()

    def _cuda_stager_error(self) -> str:
        """The CUDA stager's own error when it stopped staging (DISABLED with a live writer)."""
        if self._cuda_stager is None:
            return ""
        try:
            stats = self._cuda_stager.stats()
        except Exception as exc:
            return f"CUDA staging stopped: {exc}"
        if stats.get("broken"):
            return f"CUDA staging stopped: {stats.get('last_error') or 'unknown error'}"
        return ""

    def cuda_stager(self, device_ring_mb: float):
        """The process's CUDA stager, made (and the host ring pinned) with the first CUDA tensor."""
        if self._cuda_stager is None:
            with self._cuda_lock:
                if self._cuda_stager is None:
                    from . import cuda

                    self._cuda_stager = cuda.get_stager(self.producer, device_ring_mb)
        return self._cuda_stager

    def flush_cuda(self, timeout: float) -> bool:
        """Wait until every CUDA snapshot staged so far is in the host ring (True when none are).
        Waits in WAIT_SLICE_S slices, so Ctrl-C gets through."""
        if self._cuda_stager is None:
            return True
        from . import cuda

        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            ok = self._cuda_stager.flush(max(0.0, min(left, WAIT_SLICE_S)))
            if ok or left <= 0:
                cuda.release_read()  # sources held for snapshots that have now completed
                return ok

    @property
    def cuda_staging(self) -> bool:
        """The process's CUDA stager was made (close_cuda_if_last has work that must not run twice)."""
        return self._cuda_stager is not None

    def close_cuda_if_last(self, timeout: float) -> int:
        """The engine's last Dumper is closing: close the CUDA stager now, before that Dumper sends
        its ``close`` and waits for the writer's ack. A lean batch held open by a CUDA-graph capture
        (another thread's, on a blocking stream, while the batch is on the legacy stream) can never
        be sealed; the stager's close turns its records into padding. Left to shutdown(), which
        runs after the ack, the writer waited at those records and the close its whole timeout.
        Returns the records so cancelled (0 when other Dumpers still use the engine)."""
        stager = self._cuda_stager
        if stager is None or self.refs > 1:
            return 0
        before = stager.stats().get("cancelled", 0)
        # The stager's close joins its drain thread, which finishes every copy in flight first: on
        # a stream that never completes (a hung kernel ahead of the snapshot) it never returned, and
        # Dumper.close(timeout=...) with it. Run in a thread and given up on past the timeout.
        if not _returns_within(lambda: stager.close(timeout), max(timeout, CUDA_CLOSE_FLOOR_S)):
            st = stager.stats()
            # Records staged and neither published nor cancelled: in flight on the stuck stream;
            # the writer waits at the first of them for good, so they and what follows are lost.
            unfinished = max(0, st.get("records", 0) - st.get("published", 0) - st.get("cancelled", 0))
            self.cuda_close_stuck = (f"the CUDA stager did not stop by close's deadline: {unfinished} staged "
                                     "records still copying on a stream that never completed")
            return st.get("cancelled", 0) - before + unfinished
        return stager.stats().get("cancelled", 0) - before

    @property
    def refs(self) -> int:
        """How many Dumpers hold this engine."""
        return len(self._holders)

    def shutdown(self, timeout: float = 600.0) -> None:
        """Drain and stop the writer within ``timeout`` seconds in all, then kill it. A shutdown
        cut short (Ctrl-C) is finished by the next call: its holder's retried close(), the next
        attach (``acquire``) or the exit hook; each step is safe to take again (a second
        ``shutdown`` message behind a handled one is never read; the writer has exited)."""
        if self.closed and not self._stop_cut:
            return  # stopped, or a forked child's copy (forget_in_forked_child)
        self._stop_cut = False
        try:
            self.closed = True
            deadline = time.monotonic() + timeout

            def left() -> float:
                return max(0.0, deadline - time.monotonic())

            if self._cuda_stager is not None:
                try:
                    self._cuda_stager.flush(left())
                    self._cuda_stager.close()
                except Exception as exc:  # never let teardown crash the host program
                    log.error("fastdump: CUDA stager shutdown failed: %s", exc)
            if self.producer.writer_alive():
                self.control(protocol.shutdown(), wait=True, timeout=left())
            self._stop_writer(timeout=left())
        except BaseException:  # cut short (Ctrl-C): finished by the next call, at the latest at exit
            self._stop_at_exit()
            raise
        if self in _UNFINISHED_STOPS:
            _UNFINISHED_STOPS.remove(self)

    def forget_in_forked_child(self) -> None:
        """In a child made by os.fork(): never touch the parent's writer, and let go of its pipes,
        so that the parent's death (even kill -9) still reads as EOF in the writer."""
        self.closed = True  # shutdown() is a no-op here
        if self._proc is not None:
            for pipe in (self._proc.stdin, self._proc.stdout):
                try:
                    pipe.close()  # the child's copy of the descriptor only
                except OSError:
                    pass
        if Engine._current is self:
            Engine._current = None

    # -- process-wide singleton ------------------------------------------------------------------
    @classmethod
    def acquire(cls, options: EngineOptions, holder: object, stop_timeout: float = 10.0) -> "Engine":
        """The process's engine, started with ``options`` if none runs, held by ``holder`` (any
        object; ``release`` takes the same one). An engine whose shutdown a Ctrl-C cut short is
        stopped first, within ``stop_timeout`` (then killed). The first attach decides the
        engine-wide settings; a later one that asks for others gets a warning naming each, and the
        running engine's. An engine whose writer has died (killed, crashed) is not handed out again:
        its Dumpers have stopped (and say why); a new attach gets a new engine and writer, and the
        old one shuts down when its last Dumper lets go of it."""
        _finish_cut_stops(stop_timeout)
        with cls._lock:
            eng = cls._current
            if eng is None or eng.closed or eng.pid != os.getpid() or not eng.alive:
                if eng is not None and not eng.closed and eng.pid == os.getpid():
                    log.warning("fastdump: the staging engine's writer has stopped (%s); starting a new one "
                                "for this attach", eng.error())
                eng = cls(options)
                cls._current = eng
                _shut_down_at_multiprocessing_exit()
            else:
                differences = eng.options.differences(options)
                if differences:
                    log.warning("fastdump: the staging engine already runs with %s; the first attach decides "
                                "these settings for the whole process", ", ".join(differences))
            eng._holders.add(holder)
            return eng

    def release(self, timeout: float, holder: object) -> None:
        """``holder`` lets go; the last one's release shuts the engine down. Safe to call again
        after a Ctrl-C cut it short (anywhere: before the holder was let go, or in the shutdown,
        which the second call finishes): a retried close() stops the writer then and there."""
        last = False
        try:
            with Engine._lock:
                self._holders.discard(holder)
                last = not self._holders
                if last and Engine._current is self:
                    Engine._current = None
            if last:
                self.shutdown(timeout)
        except BaseException:
            if last:  # (a Ctrl-C as shutdown() was called, before its own guard)
                self._stop_at_exit()
            raise

    def release_cut(self, holder: object) -> None:
        """``holder``'s close() was cut (Ctrl-C) before its ``release`` let go: it lets go now, without
        waiting, and if it was the last, the engine's stop is left to whatever finishes a cut stop
        first (the retried close(), the next attach, the exit hook). Still held by a token nobody
        would release, the engine was handed to the next attach, and no later close() stopped its
        writer: it ran until the interpreter's exit."""
        with Engine._lock:
            self._holders.discard(holder)
            last = not self._holders
            if last and Engine._current is self:
                Engine._current = None
        if last and not (self.closed and not self._stop_cut):  # (not stopped already)
            self._stop_at_exit()

    def _stop_at_exit(self) -> None:
        """This engine's shutdown was cut short (Ctrl-C in the last Dumper's close): its holder's
        retried close(), the next attach or, at the latest, the exit hook finishes it. Before, only
        the exit hook did: a writer process outlived its use for the rest of the run, a retried
        close() could not stop it, and a writer thread left alone ran on into the interpreter's exit
        and aborted it ("terminate called without an active exception")."""
        self._stop_cut = True
        if self.pid == os.getpid() and self not in _UNFINISHED_STOPS:
            _UNFINISHED_STOPS.append(self)


fsutil.renew_locks_at_fork(Engine, "_lock")  # (a parent thread starting a writer at the fork held it)

_EXIT_HOOKS: list = []  # called with the deadline before the engine shuts down (capture's close_all)
_UNFINISHED_STOPS: list = []  # engines whose shutdown was interrupted: their writers are stopped at exit


def _finish_cut_stops(timeout: float) -> None:
    """Finish the shutdowns a Ctrl-C cut short (their engines have no holder left), each within
    ``timeout``: an attach does this before it starts or takes an engine, so a writer nobody uses
    never outlives the next attach."""
    for eng in [e for e in _UNFINISHED_STOPS if e.pid == os.getpid()]:
        eng.shutdown(timeout)


def on_exit(hook) -> None:
    """Run ``hook(deadline)`` at interpreter exit, before the engine stops: the layer above (capture)
    closes its dumpers here without staging importing it back."""
    if hook not in _EXIT_HOOKS:
        _EXIT_HOOKS.append(hook)


# What a user or a signal handler raises to end the program (Ctrl-C; a SIGTERM handler's
# sys.exit): the exit hook holds one back until the rest is done. (A SystemExit there ended the
# hook as a Ctrl-C once did: the other Dumpers' dumps were left incomplete, and a writer thread
# died unwritten, aborting the interpreter.)
EXIT_INTERRUPTS = (KeyboardInterrupt, SystemExit)


def _shutdown_at_exit() -> None:
    """Bounded by FASTDUMP_EXIT_TIMEOUT_S in all: a stuck writer is killed, never waited for.

    A Ctrl-C landing here interrupts the step it lands in (a Dumper's close records it), not the
    rest, and is raised once the engine is down: it ended the hook, so the other Dumpers were never
    closed (verify failed their whole dumps) and the engine never stopped; a writer thread then died
    with every pass it had not written, aborting the interpreter ("terminate called without an
    active exception")."""
    interrupted = None
    try:
        deadline = time.monotonic() + exit_timeout()
    except EXIT_INTERRUPTS as exc:
        interrupted, deadline = exc, time.monotonic() + DEFAULT_EXIT_TIMEOUT_S
    for hook in list(_EXIT_HOOKS):
        try:
            hook(deadline)
        except EXIT_INTERRUPTS as exc:
            interrupted = interrupted or exc
    eng = Engine._current
    try:
        if eng is not None and eng.pid == os.getpid():
            eng.shutdown(max(0.0, deadline - time.monotonic()))
    except EXIT_INTERRUPTS as exc:  # (in its wait for the writer)
        interrupted = interrupted or exc
        if eng._thread is not None:  # left running, it aborts the interpreter; a writer process ends
            eng._stop_thread(max(0.0, deadline - time.monotonic()))  # on its stdin's EOF, after what it has
    for eng in [e for e in _UNFINISHED_STOPS if e.pid == os.getpid()]:
        try:
            eng.shutdown(max(0.0, deadline - time.monotonic()))  # (finished where it was cut)
        except EXIT_INTERRUPTS as exc:
            interrupted = interrupted or exc
    if interrupted is not None:
        raise interrupted


atexit.register(_shutdown_at_exit)
_MULTIPROCESSING_EXIT_PID = None  # the process that registered _shutdown_at_exit with multiprocessing


def _shut_down_at_multiprocessing_exit() -> None:
    """In a process multiprocessing started (a ``Process``'s target, a ``Pool`` worker): run
    _shutdown_at_exit when that process ends. One started by fork (or forkserver) leaves through
    ``os._exit`` once its target returned: atexit hooks never run there, only multiprocessing's
    finalizers. Its Dumpers were never closed: a writer process kept what it had, marked incomplete
    (``verify`` failed), and a writer thread died with every pass it had not yet written."""
    global _MULTIPROCESSING_EXIT_PID
    mp = sys.modules.get("multiprocessing")  # (a child multiprocessing started has imported it)
    if _MULTIPROCESSING_EXIT_PID == os.getpid() or mp is None or mp.parent_process() is None:
        return
    from multiprocessing import util

    # Its registry is emptied in each child multiprocessing starts, and it runs a finalizer only in
    # the process that registered it; priority: before it joins or terminates the child's children.
    util.Finalize(None, _shutdown_at_exit, exitpriority=100)
    _MULTIPROCESSING_EXIT_PID = os.getpid()


# atexit hooks run newest first. h5py's own hook unregisters its type converters; when it ran
# before ours, a writer thread's final segment writes at exit failed ("TypeError: Operation not
# defined for data type class") and every buffered pass was lost. h5py imported before this module
# registered its hook first: ours already runs before it.
_EXIT_HOOK_BEFORE_H5PYS = "h5py" in sys.modules


def _exit_hook_before_h5pys() -> None:
    """A writer thread writes HDF5 in this process: make our exit hook run before h5py's (imported
    by now), by registering it again, newest. Only a writer thread needs h5py here at exit."""
    global _EXIT_HOOK_BEFORE_H5PYS
    if _EXIT_HOOK_BEFORE_H5PYS:
        return
    import h5py  # noqa: F401  (its atexit hook is registered by now)

    atexit.unregister(_shutdown_at_exit)
    atexit.register(_shutdown_at_exit)
    _EXIT_HOOK_BEFORE_H5PYS = True
