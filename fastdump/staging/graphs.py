"""CUDA-graph record mode (``attach(..., cuda_graphs="record")``, the default).

While a CUDA graph is captured with a Dumper attached, each captured module output's snapshot is
recorded into the graph itself (``_C.GraphRecorder``, csrc/cuda_graph_record.cu); every replay of the
graph then becomes one pass holding that replay's values, numbered from ``protocol.GRAPH_PASS_BASE`` in
replay order, with pass meta naming the graph (``cuda_graph``: its number, never reused by the
Dumper on that GPU, ``graph_batch``: its captured
batch size where known, ``graph_replay``: the graph's replay index). Python runs only while the
graph is captured (it sends the graph's layout to the writer then: ``protocol.graph``); a replay
costs no Python and one C++ staging call on the recorder's drain thread (the whole replay as one
record, which the writer splits). Dropped replays are counted by the Channel, which reads each
recorder's count. Design and limits: docs/CUDA.md, "CUDA graphs".
"""

from __future__ import annotations

import logging
import threading
import weakref

from .. import protocol

log = logging.getLogger("fastdump")

_cuda_module = None  # fastdump.staging.cuda, imported at the first use (it is never imported eagerly)


def _import_cuda():
    global _cuda_module
    from . import cuda

    if reclaim_dead_graphs not in cuda.before_capture:  # (see reclaim_dead_graphs)
        cuda.before_capture.append(reclaim_dead_graphs)
    if capture_ending not in cuda.before_capture_end:  # (see capture_ending)
        cuda.before_capture_end.append(capture_ending)
    _cuda_module = cuda
    return cuda


LOG_ENTRIES = 1024  # replays that may wait for the drain at once (per Dumper and GPU)


def _C():
    return (_cuda_module or _import_cuda())._C  # the mock build in tests (the same seam as the staging glue)


class CapturedPass:
    """The pass of one graph capture: its recorder, graph id and the facts its replays carry."""

    __slots__ = ("recorder", "graph", "device", "batch", "recorded", "missing", "owner", "serial", "refused")

    def __init__(self, recorder, graph: int, device: int, owner=None, refused: str | None = None):
        self.recorder, self.graph, self.device = recorder, graph, device
        self.refused = refused  # why the recorder has no graph id for it: its replays cannot be dumped
        self.owner = owner     # the torch CUDAGraph being captured (cuda.capturing_graph), or None
        self.serial = recorder.open_serial if recorder is not None else 0  # names its slots (GraphRecorder.reclaim)
        self.batch = None      # leading dimension of the first recorded tensor
        self.recorded = 0
        self.missing: dict = {}  # name -> why the replays lack it


class GraphRecording:
    """One Dumper's record mode: a ``_C.GraphRecorder`` per GPU, made at attach when the GPU is
    known (before a serving engine sizes its KV cache), else at the first capture on that GPU."""

    def __init__(self, dumper, graph_ring_mb: float):
        self._dumper = dumper
        total = int(float(graph_ring_mb) * (1 << 20))
        # Half for the static slots (every captured tensor of every graph), half for the replay ring.
        self._slot_bytes = max(total // 2, 1 << 16)
        self._ring_bytes = max(total - total // 2, 1 << 16)
        self._recorders: dict = {}   # device -> _C.GraphRecorder
        self._failures: dict = {}    # device -> why it has none
        # device -> [(owner token or None, capture serial)]: graphs that write its memory (their
        # slots), until reclaim_dead() gives the slots of those that can never run again back.
        self._writers: dict = {}
        self._writers_lock = threading.Lock()  # (reclaim_dead runs on the thread that begins a capture)
        self.open: CapturedPass | None = None
        self._said: set = set()
        _recordings.add(self)

    # -- recorders --------------------------------------------------------------------------------
    def prepare(self, device) -> str:
        """Make ``device``'s recorder now; returns '' or why it cannot be had."""
        if device is None:
            return ""
        return "" if self._recorder(int(device)) is not None else self._failures.get(int(device), "")

    def _recorder(self, device: int):
        rec = self._recorders.get(device)
        if rec is not None or device in self._failures:
            return rec
        d = self._dumper
        stager = d._engine.cuda_stager(d.device_ring_mb)
        C = _C()
        if not hasattr(C, "GraphRecorder") or not isinstance(stager, C.CudaStager):
            self._failures[device] = "CUDA staging is not available"
            return None
        note, mark = protocol.drop_note_template(d._channel.id, device)  # sent by the drain as drops happen
        try:
            rec = C.GraphRecorder(stager, d._channel.id, device, self._slot_bytes, self._ring_bytes, LOG_ENTRIES,
                                  note, mark)
        except Exception as exc:  # e.g. no device memory left: graphs are then captured without dumping
            self._failures[device] = f"cannot allocate the CUDA-graph recording memory on GPU {device}: {exc}"
            log.warning("fastdump: %s: %s", d.dir, self._failures[device])
            return None
        self._recorders[device] = rec
        d._channel.count_graph_drops(rec)
        return rec

    def recorder(self, device: int):
        """The recorder of ``device`` (tests and benchmarks), or None."""
        return self._recorders.get(int(device))

    # -- capture (the capturing thread) ----------------------------------------------------------
    @staticmethod
    def capture_running() -> bool:
        """A graph is being captured on the current stream: the pass beginning is its forward.
        Asked at every pass the selection leaves out: the module is looked up once (a `from .
        import` runs importlib's Python code at each call: ~10 us a pass, in cold caches)."""
        return (_cuda_module or _import_cuda())._capture_running()

    def record(self, name: str, name_id: int, code: int, t) -> None:
        """A CUDA tensor hooked while its stream captures: record its snapshot into the graph."""
        from . import cuda

        d = self._dumper
        device = t.get_device()
        raw, _ = cuda._current_stream(device)
        cap = self.open
        if cap is not None and cap.recorder is None:  # (no recorder: the graph is given up at its pass's end)
            return d._skip(name, f"CUDA graph capture: not recorded ({cap.refused})")
        if cap is not None and cap.recorder.capture_invalidated():
            # No graph will come of it (cudaStreamEndCapture fails): nothing to dump, nothing lost.
            self._invalidated(cap)
            return d._skip(name, "CUDA graph capture: not recorded: the capture was invalidated (it makes no graph)")
        if cap is not None and cap.recorder.capture_ended():
            # The capture this pass began in is over (a capture that raised, then a new one in a
            # pass that never ended): its graph can no longer be committed. Given up, loudly, and
            # this tensor starts a graph of its own in the capture running now.
            self._give_up(cap, "the capture it was recorded in ended before its pass did")
            cap = None
        if cap is None:
            # A graph that cannot be recorded still runs at every replay, which nobody dumps: its
            # pass (end_pass) counts it as a graph not dumped (verify fails). Skipping its tensors
            # alone recorded the capture and lost every replay while verify said OK.
            rec = self._recorder(device)
            if rec is None:  # (no recording memory: the serving engine took the GPU's memory first)
                cap = self.open = CapturedPass(None, -1, device, refused="no recorder: " + self._failures.get(device, "?"))
            else:
                try:
                    cap = self.open = CapturedPass(rec, rec.begin_graph(raw), device, cuda.capturing_graph())
                except ValueError as exc:  # no graph comes of this capture (invalidated): nothing lost
                    return d._skip(name, f"CUDA graph capture: not recorded ({exc})")
                except (OverflowError, RuntimeError) as exc:  # every graph id taken; a broken recorder
                    cap = self.open = CapturedPass(rec, -1, device, refused=str(exc))
        if cap.refused is not None:
            return d._skip(name, f"CUDA graph capture: not recorded ({cap.refused})")
        elif device != cap.device:
            cap.missing[name] = "on another GPU than the graph's first tensor"
            return d._skip(name, "CUDA graph capture: tensor on another GPU than the graph's first tensor")
        ptr = t.data_ptr()
        if not ptr and t.numel():
            cap.missing[name] = _C().NO_DATA
            return d._skip(name, "CUDA graph capture: not recorded: " + _C().NO_DATA)
        try:
            status = cap.recorder.record(name_id, code, t.element_size(), t.shape, t.stride(), ptr, device, raw)
        except RuntimeError as exc:
            cap.missing[name] = str(exc)
            return d._skip(name, f"CUDA graph capture: not recorded ({exc})")
        if status == _C().STAGED:
            if cap.batch is None and t.dim() > 0:
                cap.batch = int(t.shape[0])
            cap.recorded += 1
        else:
            why = ("more than %d dimensions" % _C().MAX_DIMS if status == _C().TOO_LARGE else
                   "the CUDA-graph slots or replay ring are full (graph_ring_mb)")
            cap.missing[name] = why
            d._skip(name, "CUDA graph capture: not recorded: " + why)

    def end_pass(self, meta: dict, incomplete: str | None = None, structure: dict | None = None) -> None:
        """The captured pass ends: commit the graph and send its layout to the writer (in ring
        order, before any replay's record). Its replays are passes; the capture-time pass itself
        holds no values (the capture computes nothing) and is marked incomplete, saying so.
        ``incomplete``: why the capture's pass was already not whole (its forward raised, ...):
        the graph holds only what was captured before, so every replay pass says so too.
        ``structure``: the capture pass's structure record (Dumper._end): every replay pass
        carries it, so it exports under the same names as the eager pass."""
        cap, self.open = self.open, None
        d = self._dumper
        if cap.refused is not None:
            self._give_up(cap, cap.refused)
            return
        if cap.recorder.capture_invalidated():  # the capture failed: no graph, no replay to miss
            self._invalidated(cap)
            return
        batch = meta.get("batch_size", meta.get("bs", cap.batch))
        if cap.recorded:  # its snapshots are in the graph (committed or not): its replays write the slots
            self._hold(cap)
        try:
            # A pass that ends after its capture did (end_pass() after the `with torch.cuda.graph`
            # block, close() ending a capture that raised) cannot commit: its kernels would run
            # once, now, and publish slots no replay wrote as a replay (end_graph refuses).
            gid = cap.recorder.end_graph()
        except (RuntimeError, ValueError) as exc:
            self._give_up(cap, str(exc))
            return
        if gid < 0:
            d._mark_incomplete("CUDA graph capture: nothing was recorded into the graph")
            return
        span = cap.recorder.layout(gid)
        number = span["graph_number"]  # (gid is reused once the graph is gone; the number never)
        graph_meta = dict(meta, cuda_graph=number, graph_batch=batch)
        msg = protocol.graph(d._channel.id, cap.device, number, span["span_name_id"], span["span_bytes"],
                             span["tensors"], graph_meta, cap.missing,
                             None if incomplete is None else f"captured in an incomplete pass: {incomplete}",
                             structure)
        if not d._channel.control(msg, block=True):  # the writer is gone or stuck past block_timeout_s
            log.error("fastdump: %s: the layout of CUDA graph %d did not reach the writer; its replays are "
                      "written as incomplete passes without tensors", d.dir, number)
            d._mark_incomplete(f"CUDA graph capture: the layout of graph {number} did not reach the writer")
            return
        d._mark_incomplete(f"CUDA graph capture: values recorded into graph {number} (batch {batch}); each "
                           f"replay is a pass of its own, numbered from {protocol.GRAPH_PASS_BASE}")

    def _give_up(self, cap, why: str) -> None:
        """A captured graph that will not be dumped: its replays run unseen, so the loss is counted
        (``graphs_not_dumped``: verify fails on it) and its capture pass marked incomplete. Its
        slots stay reserved (abort_graph): the graph may still be replayed."""
        if cap.recorder is not None:
            cap.recorder.abort_graph()
        if self.open is cap:
            self.open = None
            if cap.recorded:  # (end_pass noted it already)
                self._hold(cap)
        d = self._dumper
        d._totals["graphs_not_dumped"] += 1
        d._mark_incomplete(f"CUDA graph capture: the graph's replays are not dumped ({why})")
        if "give_up" not in self._said:
            self._said.add("give_up")
            log.error("fastdump: %s: a captured CUDA graph's replays are not dumped: %s", d.dir, why)

    def _invalidated(self, cap) -> None:
        """The capture of ``cap`` was invalidated: cudaStreamEndCapture returns no graph, so its
        recorded snapshots never run and no replay is missed. Not counted as a graph not dumped
        (a runner that retries a failed capture dumps every replay of the graph it then makes);
        the capture pass says why it holds nothing."""
        cap.recorder.abort_graph()  # (its slots go to the next graph)
        if self.open is cap:
            self.open = None
        self._dumper._mark_incomplete("CUDA graph capture: the capture was invalidated; it makes no graph, "
                                      "nothing was recorded")

    def capture_ending(self, cap) -> None:
        """The torch capture of ``cap`` is about to end (its ``capture_end``) while its pass is still
        open: the pass cannot commit the graph any more (it ends after the capture, and is given up
        then). An invalidated capture makes no graph: given back now, not counted as a graph not
        dumped. Otherwise the recorder records a done event into the graph now, while it still
        can, so that the graph's slots come back once the graph is reset or collected (without
        one they stayed taken for good, and each such capture took more of them)."""
        if cap.recorder is None or cap.refused is not None:
            return
        if cap.recorder.capture_invalidated():
            self._invalidated(cap)
        else:
            cap.recorder.capture_ending()

    # -- slots of graphs that can never run again -------------------------------------------------
    def _hold(self, cap) -> None:
        with self._writers_lock:
            self._writers.setdefault(cap.device, []).append((cap.owner, cap.serial))

    def reclaim_dead(self) -> int:
        """Give back the slots of the torch CUDAGraphs captured with this Dumper that can never be
        replayed again (reset, captured again, or collected: an engine that recaptures its graphs).
        Without it every recapture takes new slots until graph_ring_mb/2 is full and the next
        graphs' tensors are skipped. The recorder first waits for each such graph's last launch (a
        replay launched before the reset may still be writing them; an event per graph, never the
        device, which would break another thread's capture). Graphs captured outside torch are never
        known dead: their slots stay. Returns the captures whose slots were given back."""
        given = 0
        with self._writers_lock:
            dead = {dev: [serial for owner, serial in held if owner is not None and not owner.alive()]
                    for dev, held in self._writers.items()}
        for dev, serials in dead.items():
            rec = self._recorders.get(dev)
            if rec is None or not serials:
                continue
            done = set(rec.reclaim(serials))  # (waits for their last launches, without the GIL)
            if done:
                with self._writers_lock:
                    self._writers[dev] = [(o, s) for o, s in self._writers[dev] if s not in done]
                given += len(done)
        return given

    # -- end ---------------------------------------------------------------------------------------
    @property
    def recording(self) -> bool:
        """A capture is open or a GPU has a recorder: close() has work that must not run twice."""
        return self.open is not None or bool(self._recorders)

    def close(self, totals: dict, timeout: float) -> None:
        """Flush every replay the GPUs have run, stop the drains, add their passes to ``totals``
        (their drops are the Channel's: it reads the recorders' counts). The device memory stays:
        graphs captured with it may still be replayed (see CUDA.md)."""
        if self.open is not None:
            cap, self.open = self.open, None
            if cap.recorder is not None:
                cap.recorder.abort_graph()
            if cap.recorded:
                self._hold(cap)
        _recordings.discard(self)
        for rec in self._recorders.values():
            # Replays already launched are dumped: each graph's last launch is waited for (its done
            # event; a device-wide torch.cuda.synchronize would break another thread's capture).
            if not rec.wait_launched():
                log.warning("fastdump: %s: cannot wait for the CUDA graphs' last replays at close",
                            self._dumper.dir)
            rec.close(timeout)
            s = rec.stats()
            totals["passes"] += s["replays"]
            totals["tensors"] += s["tensors"]
            totals["bytes"] += s["bytes"]
            totals["graph_replays"] = totals.get("graph_replays", 0) + s["replays"]
            if s["broken"]:
                log.warning("fastdump: %s: CUDA-graph recording stopped: %s", self._dumper.dir, s["last_error"])

    def stats(self) -> dict:
        return {dev: rec.stats() for dev, rec in self._recorders.items()}

    def free_device_memory(self) -> bool:
        """Free each GPU's recording memory that no torch CUDAGraph still writes into; True when
        all of it was freed. A GPU with such a graph keeps its memory (logged): freed, its next
        replay would write into memory cudaMalloc hands out again, the next Dumper's recorder
        included, whose replay passes would then hold this graph's values and pass verify."""
        kept = 0
        for dev in list(self._recorders):
            with self._writers_lock:
                live = sum(1 for owner, _ in self._writers.get(dev, ()) if owner is not None and owner.alive())
            if live:
                kept += live
                continue
            self._recorders.pop(dev).close(60.0, True)
        if kept:
            log.error("fastdump: %s: CUDA-graph recording memory not freed: %d torch CUDA graph(s) captured "
                      "while the Dumper was attached still exist and write into it at every replay; free it "
                      "after they are reset or deleted", self._dumper.dir, kept)
        return not kept


_recordings: "weakref.WeakSet[GraphRecording]" = weakref.WeakSet()  # the Dumpers' not closed yet


def reclaim_dead_graphs() -> None:
    """Called by torch's ``CUDAGraph.capture_begin`` (wrapped in staging/cuda.py, which _import_cuda gives it) before a capture
    begins, when no other torch capture is open: every Dumper gives back the slots of its graphs
    that can never run again, so the capture about to begin finds them free."""
    for recording in list(_recordings):
        if recording.open is None:  # (a capture of its own is open: later)
            try:
                recording.reclaim_dead()
            except Exception as exc:  # never fail the user's capture over it
                log.warning("fastdump: reclaiming the slots of CUDA graphs that no longer exist failed: %s", exc)


def capture_ending(graph) -> None:
    """Called by torch's ``CUDAGraph.capture_end`` (wrapped in staging/cuda.py) before the capture
    of ``graph`` ends: a Dumper whose pass in that capture is still open prepares its graph for
    being given up (GraphRecording.capture_ending)."""
    for recording in list(_recordings):
        cap = recording.open
        if cap is not None and cap.owner is not None and cap.owner.is_capture_of(graph):
            try:
                recording.capture_ending(cap)
            except Exception as exc:  # never fail the user's capture over it
                log.warning("fastdump: preparing a CUDA graph whose pass outlives its capture failed: %s", exc)


def free_device_memory(dumper) -> bool:
    """Give back a closed Dumper's CUDA-graph recording memory (slots and replay ring). Call it only
    once every graph captured while the Dumper was attached has been destroyed: each replay of such
    a graph writes into that memory. (Without a committed graph it is freed at close already.)

    Graphs captured through ``torch.cuda.CUDAGraph`` are tracked: while one of them still exists
    (not reset, not garbage-collected) the memory is kept, an error is logged and False is
    returned (so for a Dumper not closed yet). Graphs captured outside torch (raw
    ``cudaStreamBeginCapture``) cannot be tracked: for those the caller's word is taken. True when
    everything was freed."""
    recording = getattr(dumper, "_graphs", None)
    if recording is None:
        return True
    if not dumper._closed:  # its drains still run, and close() still has to count their replays
        log.error("fastdump: %s: free_device_memory() before close(): the CUDA-graph recording memory is kept "
                  "(close the Dumper first)", dumper.dir)
        return False
    return recording.free_device_memory()
