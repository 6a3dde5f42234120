"""Per-channel aggregation: decoded ring events -> segment files, segments.jsonl and rank.json.

One ``ChannelWriter`` per channel (one ``<root>/<role>/<rank dir>``), driven by the writer loop. It
buffers whole passes in memory, grouping rows per (name, dtype, row shape) so that a segment holds a
few large datasets instead of one dataset per tensor per pass (h5py costs ~100-250 us per dataset,
~10 us per row written in one block: docs/DESIGN.md, "Facts"). A name with several layouts inside one segment (a
row shape that changes, prefill vs decode shapes, a dtype change) simply gets one block per layout;
a layout seen in a single pass is per-pass storage. Readers see none of this.

Runs in the writer process: numpy + h5py only, never torch.

Errors: an exception while writing a segment or rank.json (OSError for a full disk, a missing
directory...) marks the channel failed (``self.error``, rank.json status "error" when the disk
still allows it) and is re-raised so the loop can log it; from then on every method is a no-op.
``fail()`` does the same from outside and never raises.
"""

from __future__ import annotations

import collections
import errno
import logging
import math
import os
import socket
import time

import numpy as np

from .. import _C, dtypes, fsutil, protocol, segment_list
from .. import format as fmt
from .segment_file import Block, OpenSegment, error_text, write_segment

log = logging.getLogger("fastdump.writer")

MiB = 1 << 20
MAX_DIMS = 32  # HDF5's limit on a dataset's dimensions (H5S_MAX_RANK); capture skips larger ones too

# CRC32C of a tensor's bytes as stored (index column "crc32c"), computed from the same bytes the
# writer copies or writes: C++, SSE4.2 where available, ~0.2 us + ~11 GB/s (csrc/crc32c.cpp).
_crc32c = _C.crc32c

# Tensors this large skip the in-memory buffer: they are written into the segment's file as they
# arrive (OpenSegment.write_direct), one dataset each, from the ring, where they start on a page so
# that O_DIRECT can take them (csrc/ring.h, kPageAlignedBytes). Per-dataset cost (~200 us) is noise
# at this size.
DIRECT_BYTES = _C.PAGE_ALIGNED_BYTES

# A pass that never ends (its "end" record lost, a hung producer) must not hold memory forever:
# past this multiple of the segment limits, the segment is written anyway with that pass marked
# incomplete, and its later tensors go to the next segment (the reader merges them).
_FORCE_FLUSH_FACTOR = 4

# Space held back for rank.json (fmt.RESERVE_FILE): when the disk fills, this file is deleted so
# that rank.json can still say "error" (a full disk must never look like a healthy dump). Removed at
# a normal close.
RESERVE_BYTES = 256 << 10  # rank.json no longer grows with the segments (segments.jsonl): a few KiB

# rank.json's skipped_reasons holds this many distinct reasons; later ones are counted under
# OTHER_SKIP_REASONS. A reason may carry an exception's text, which can differ every pass (a
# request id): unbounded, the map grew by one key a pass, in rank.json too (rewritten every poll).
# Each pass's own skipped list keeps every reason whole.
MAX_SKIP_REASONS = 64
OTHER_SKIP_REASONS = "(other reasons: see each pass's skipped list)"
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
# Late pass ends remembered to tell a copy from a first (the Dumper keeps at most 4096 to send late).
_LATE_ENDS_KEPT = 8192


class _PassState:
    """A pass of the open segment. Its tensors and bytes are counted from the index when the
    segment is written (most of its rows never pass through Python: RowSink)."""

    __slots__ = ("pass_id", "meta", "ended", "dropped", "skipped", "incomplete", "mixed", "structure", "sent")

    def __init__(self, pass_id: int):
        self.pass_id = pass_id
        self.meta: dict = {}
        self.ended = False
        self.dropped = 0
        self.skipped: list = []
        self.incomplete = None  # why the capture side says the pass is not whole (it ended all the same)
        self.mixed = False  # forwards of several threads merged into it
        self.structure = None  # output structures the names do not tell (format.PASS_STRUCTURE)
        self.sent = None  # the tensors its producer sent, as its end record counts them (format.PASS_SENT)


class _Stream:
    """A large tensor split over several ring records, written into the open segment's file as its
    chunks arrive (ChannelWriter.on_chunk): its bytes are never whole in the writer's memory. It
    becomes a numbered block, indexed, only once every chunk is in, in order."""

    __slots__ = ("block", "temp_name", "file_offset", "filled", "crc")

    def __init__(self, block, temp_name, file_offset):
        self.block = block  # its number given at completion
        self.temp_name = temp_name  # of its dataset until then
        self.file_offset = file_offset  # of its dataset (None: it holds no bytes)
        self.filled = 0  # bytes written so far, from the start
        self.crc = 0  # CRC32C of those bytes


class _PendingSegment:
    """Everything received since the last segment file was written. Its index rows and byte count
    are in the channel's RowSink (C++), which the writer loop's fast path appends to."""

    def __init__(self):
        self.blocks: list = []
        self.block_by_layout: dict = {}  # (name_id, dtype code, row shape or None for 0-d) -> Block
        self.name_slot: dict = {}  # channel name id -> position in this segment's name table
        self.names: list = []
        self.passes: dict = {}  # pass id -> _PassState, in order of first appearance
        self.open_passes = 0
        # time.monotonic(), never the wall clock: a clock set back (NTP, an operator) held the open
        # segment in memory, not on disk, for as long as it was set back
        self.started = None  # of the first event
        self.last_end = None  # of the last pass end (idle rotation)


def _pass_meta(pass_state: _PassState) -> dict:
    """A pass's PASS_META entry; ``incomplete``/``mixed`` only when the capture side reported them."""
    entry = {"meta": pass_state.meta, "skipped": pass_state.skipped}
    if pass_state.sent is not None:
        entry[fmt.PASS_SENT] = pass_state.sent
    if pass_state.structure:
        entry[fmt.PASS_STRUCTURE] = pass_state.structure
    if pass_state.incomplete is not None:
        entry["incomplete"] = pass_state.incomplete
        if pass_state.mixed:
            entry["mixed"] = True
    return entry


def _identity_of(pid):
    """fsutil.process_identity of the serving process ``pid`` (as the open message gives it), or None."""
    if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0:
        return fsutil.process_identity(pid)
    return None


def _limit(config: dict, key: str, scale: float = 1.0):
    """A positive rotation limit from the config, or None (no limit) when unset/zero/invalid."""
    try:
        value = float(config.get(key) or 0)
    except (TypeError, ValueError):
        return None
    return value * scale if value > 0 else None


def _too_wide(shape: tuple, itemsize: int) -> bool:
    """Whether numpy refuses an array of this shape: its non-zero dimensions times the item size
    exceed the largest signed 64-bit size (zero dimensions do not make it fit)."""
    n = itemsize
    for d in shape:
        if d:
            n *= d
    return n > (1 << 63) - 1


class ChannelWriter:
    """Turns one channel's events into ``seg-*.h5`` files and ``rank.json`` in ``open_msg["dir"]``.

    ``__init__`` creates the directory and the first rank.json (status "running") and raises
    OSError when it cannot. ``on_tensor`` copies ``data`` (1-D uint8, C-order bytes; possibly a view
    into the ring, valid only during the call) or writes it to the file before returning.
    Segments are written from ``on_end``/``poll`` (rotation) and ``close``.
    """

    def __init__(self, open_msg: dict):
        self.channel = open_msg.get("channel")
        self.dir = os.path.abspath(open_msg["dir"])
        self.config = dict(open_msg.get("config") or {})
        self.max_passes = _limit(self.config, "segment_passes")
        self.max_bytes = _limit(self.config, "segment_mb", MiB)
        self.max_seconds = _limit(self.config, "segment_seconds")
        self.idle_seconds = _limit(self.config, "segment_idle_seconds")

        self.error = None
        self._closed = False
        self._names: dict = {}
        self._pending = _PendingSegment()
        self._open = None  # OpenSegment holding this segment's large tensors, if any yet
        self._current = None  # the _PassState that received the last tensor (fast path)
        self._streams: dict = {}  # (name id, pass id) -> _Stream: large tensors whose chunks are coming
        self._stream_count = 0  # streams begun: their datasets' temporary names
        # The open segment's index rows and bytes; the loop's fast path takes a record into it when
        # its pass (set_pass) and layout (add_layout) are known here (csrc/writer_rows.h).
        self.sink = _C.RowSink()

        # Totals over everything written so far (rank.json).
        self._passes_written = 0
        self._tensors_written = 0
        self._bytes_written = 0
        self._dropped_in_passes = 0
        self._unfinished_last = None  # the last segment's last pass, when it was flushed unfinished
        self._late_ends_left_out = 0  # late pass ends that came too late to be written (_takes_late_end)
        # The passes whose late end came already (taken or left out), the last _LATE_ENDS_KEPT of
        # them: a copy of one is ignored (_takes_late_end)
        self._late_ends_seen: set = set()
        self._late_ends_order: collections.deque = collections.deque()
        self._dropped_total = 0  # the Dumper's count of dropped tensors ("dropped" in its close stats)
        self._dropped_passes = 0  # whole passes the Dumper dropped (their "begin" never reached us)
        self._graph_dropped: dict = {}  # device -> CUDA-graph replays dropped (the drains' notes, while running)
        self._graph_layouts: dict = {}  # replay span name id -> its "graph" message
        self._skipped_total = 0
        self._skipped_reasons: dict = {}
        self._lost_total = 0  # of those skips, tensors accepted and then lost (fmt.is_loss)
        self._stats: dict = {}
        self._status = "running"
        self._note_error = None  # an error the producer side reported (writer itself still fine)
        self._published_pending = 0  # pending_passes as last written to rank.json
        self._counts_changed = False  # a drop count rank.json does not show yet (graph_drops)

        self._info = {
            "format_version": fmt.FORMAT_VERSION,
            "role": open_msg.get("role"),
            "rank": dict(open_msg.get("rank") or {}),
            "pid": open_msg.get("pid"),
            # (the writer runs beside the serving process, on its host: which process that pid is,
            # so a reader can tell it from a later one given the same pid: fsutil.pid_alive)
            "pid_identity": _identity_of(open_msg.get("pid")),
            "session": open_msg.get("session"),
            "host": open_msg.get("host") or socket.gethostname(),
            "device": dict(open_msg.get("device") or {}),
            "config": self.config,
            "started": time.time(),
        }
        os.makedirs(self.dir, exist_ok=True)
        # Every file of the channel is made through this open directory, never through self.dir's
        # path, which a rename, a deletion or a symbolic link put in its place during the run would
        # lead elsewhere (out of the dump). Closed by close() and fail().
        self._anchor = fsutil.DirAnchor(self.dir)
        try:
            self._next_segment = self._first_free_segment_number()
            self._list = segment_list.Appender(self._anchor)  # before rank.json, whose write makes it durable
            self._write_rank_json()
            _reserve_space(self._in_dir(fmt.RESERVE_FILE), RESERVE_BYTES)
        except BaseException:
            self._anchor.close()
            raise

    # ----------------------------------------------------------------- events from the loop

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def names(self) -> dict:
        """name id -> tensor name, as announced so far."""
        return self._names

    def on_name(self, name_id: int, name: str) -> None:
        self._names[name_id] = name

    def on_begin(self, pass_id: int, meta: dict) -> None:
        if self.error is not None or self._closed:
            return
        pass_state = self._pass(pass_id)
        if meta:
            pass_state.meta.update(meta)
        if not pass_state.ended:
            self._set_current(pass_state)  # its tensors may take the fast path from the first

    def on_tensor(self, name_id: int, pass_id: int, dtype_code: int, shape: tuple, data: np.ndarray) -> None:
        # The tensors the loop's C++ fast path declined (a pass's or layout's first, chunks, large
        # ones, CUDA-graph spans): what they teach (pass, layout) lets the fast path take the next.
        if self.error is not None or self._closed:
            return
        pass_state = self._current
        if pass_state is None or pass_state.pass_id != pass_id:
            pass_state = self._pass(pass_id)
            self._set_current(pass_state)
        if type(shape) is not tuple:
            shape = tuple(shape)
        nbytes = len(data)  # 1-D uint8: bytes, numpy array or a view into the ring
        if (not 0 <= dtype_code < len(dtypes.ITEMSIZE) or len(shape) > MAX_DIMS
                or nbytes != math.prod(shape) * dtypes.ITEMSIZE[dtype_code]):
            if dtype_code == protocol.REPLAY_SPAN_DTYPE:  # off the hot path: a CUDA-graph replay
                self.on_replay(name_id, pass_id, data)
                return
            self._skip(pass_state, name_id, f"{fmt.BAD_RECORD_REASON}: dtype code {dtype_code}, shape {list(shape)}, "
                                            f"{nbytes} bytes")
            return
        if not nbytes and _too_wide(shape, dtypes.ITEMSIZE[dtype_code]):
            # torch makes an empty (2^40, 0, 2^40) tensor; numpy cannot: stored, its block made the
            # whole segment unreadable (every pass in it).
            self._skip(pass_state, name_id, f"{fmt.TOO_WIDE_REASON} {list(shape)}: its other dimensions span more "
                                            "than 2^63 bytes, which numpy (and so the reader) cannot represent")
            return
        if shape and nbytes >= DIRECT_BYTES:
            self._write_direct(pass_state, name_id, pass_id, dtype_code, shape, data)
            return
        if shape:
            layout = (name_id, dtype_code, shape[1:])
            rows = shape[0]
        else:
            layout = (name_id, dtype_code, None)
            rows = 1
        block = self._pending.block_by_layout.get(layout)
        if block is None:
            block = self._new_block(layout, shape)
        # Our copy (``data`` may be a view into the ring), its CRC32C and index row, as the fast path does.
        self.sink.append(block.number, pass_id, data, rows)

    def streams(self, dtype_code: int, shape: tuple, total: int) -> bool:
        """Whether a tensor split over several records is written chunk by chunk as they arrive
        (``on_chunk``) rather than put together in memory first: a valid tensor of DIRECT_BYTES
        or more (a CUDA-graph span or a bad record is put together, and judged, whole)."""
        return (self.error is None and not self._closed and 0 <= dtype_code < len(dtypes.ITEMSIZE)
                and 0 < len(shape) <= MAX_DIMS and total >= DIRECT_BYTES
                and total == math.prod(shape) * dtypes.ITEMSIZE[dtype_code])

    def on_chunk(self, name_id: int, pass_id: int, dtype_code: int, shape: tuple, data, offset: int,
                 total: int) -> bool:
        """One chunk of a tensor ``streams`` took, written at its place in its dataset (created with
        the first chunk). The tensor is indexed, with the CRC32C of all its bytes, with its last
        chunk. False: the chunk does not continue the tensor where it stands (a chunk lost before
        it): the tensor is dropped (``drop_stream``) and the caller records it as torn."""
        if self.error is not None or self._closed:
            return True
        key = (name_id, pass_id)
        stream = self._streams.get(key)
        if stream is None and offset == 0:
            stream = self._start_stream(name_id, pass_id, dtype_code, tuple(shape))
        if stream is None or offset != stream.filled:
            self.drop_stream(name_id, pass_id)
            return False
        try:
            if stream.file_offset is not None:
                self._open.write_at(stream.file_offset + offset, data)
        except Exception as exc:
            self.fail(error_text(exc))
            raise
        stream.crc = _crc32c(data, stream.crc)
        stream.filled += len(data)
        if stream.filled >= total:
            del self._streams[key]
            pending, block = self._pending, stream.block
            block.number, block.name_slot = len(pending.blocks), self._name_slot(name_id)
            try:
                self._open.number_block(block, stream.temp_name)
            except Exception as exc:
                self.fail(error_text(exc))
                raise
            pending.blocks.append(block)
            self.sink.add_index(pass_id, block.name_slot, block.number, 0, block.rows, stream.crc, total)
        return True

    def _start_stream(self, name_id: int, pass_id: int, code: int, shape: tuple) -> _Stream:
        pass_state = self._current
        if pass_state is None or pass_state.pass_id != pass_id:
            self._set_current(self._pass(pass_id))
        block = Block(-1, -1, code, shape[1:], scalar=False)  # numbered when whole (other blocks come meanwhile)
        block.rows = shape[0]
        self._stream_count += 1
        temp_name = f"streaming-{self._stream_count}"
        try:
            if self._open is None:
                self._open = OpenSegment(self._anchor.join(""), self._next_segment)
            file_offset = self._open.create_unnumbered(block, temp_name)
        except Exception as exc:
            self.fail(error_text(exc))
            raise
        stream = self._streams[(name_id, pass_id)] = _Stream(block, temp_name, file_offset)
        return stream

    def drop_stream(self, name_id: int, pass_id: int) -> None:
        """A streamed tensor that will not complete (torn): its dataset leaves the segment, and no
        index row ever names it. The caller records why."""
        stream = self._streams.pop((name_id, pass_id), None)
        if stream is None or self.error is not None or self._closed:
            return
        try:
            self._open.drop_unnumbered(stream.temp_name)
        except Exception as exc:
            self.fail(error_text(exc))
            raise

    def _tear_streams(self) -> None:
        """The segment is written while tensors are still coming (close, a producer gone): each is
        dropped and recorded as skipped, never written in part."""
        for (name_id, pass_id) in list(self._streams):
            self.drop_stream(name_id, pass_id)
            self._skip(self._pass(pass_id), name_id, fmt.TORN_TENSOR_REASON)

    def on_end(self, pass_id: int, meta: dict, dropped: int = 0, skipped: list = (), incomplete: str = None,
               mixed: bool = False, late: bool = False, structure: dict | None = None, sent: int | None = None) -> None:
        if self.error is not None or self._closed:
            return
        if late and not self._takes_late_end(pass_id):
            return
        pass_state = self._pass(pass_id)
        if isinstance(sent, int) and not isinstance(sent, bool) and sent >= 0:
            pass_state.sent = sent  # (stored with the pass: verify holds its rows to it)
        if incomplete:
            pass_state.incomplete = str(incomplete)
            pass_state.mixed = bool(mixed)
        if meta:
            pass_state.meta.update(meta)
        if structure and isinstance(structure, dict):
            pass_state.structure = structure
        if dropped:
            pass_state.dropped += int(dropped)
            self._dropped_in_passes += int(dropped)
        for entry in skipped or ():
            self._record_skip(pass_state, dict(entry))
        if not pass_state.ended:
            pass_state.ended = True
            self._pending.open_passes -= 1
        self._set_current(None)
        now = time.monotonic()
        self._pending.last_end = now
        self._rotate_if_due(now)

    def _takes_late_end(self, pass_id: int) -> bool:
        """A pass end the ring refused at first, sent again after later records (protocol.end's
        ``late``). It completes the pass while this segment still holds it unfinished, or continues
        the pass the last segment ended unfinished (as a long pass does). Any other place would put
        the pass in two segments out of order; it is then left out, its pass `complete = 0` and
        its drops counted in rank.json's totals only (logged; rank.json counts such ends)."""
        if pass_id in self._late_ends_seen:
            # A copy: the Dumper sends a late end again when Ctrl-C lands between its send and its
            # removal from its list. Taken after the segment its first completed was written, it was
            # counted as left out, and verify failed the whole dump for an end that never came.
            return False
        self._late_ends_seen.add(pass_id)
        self._late_ends_order.append(pass_id)
        if len(self._late_ends_order) > _LATE_ENDS_KEPT:
            self._late_ends_seen.discard(self._late_ends_order.popleft())
        state = self._pending.passes.get(pass_id)
        if state is not None:
            return not state.ended  # (ended: a copy of an end already taken)
        if pass_id == self._unfinished_last:
            return True
        self._late_ends_left_out += 1
        log.warning("fastdump writer: %s: the late end of pass %d came after its segment was written "
                    "with later passes; its pass stays incomplete", self.dir, pass_id)
        return False

    def on_graph(self, msg: dict) -> None:
        """A CUDA graph was captured: the layout its replay spans are split by."""
        self._graph_layouts[int(msg["span_name_id"])] = msg

    def on_graph_drops(self, device: int, dropped_passes: int) -> None:
        """A recorder's running count of dropped replays; rank.json shows it at the next poll."""
        if isinstance(dropped_passes, int) and dropped_passes > self._graph_dropped.get(device, 0):
            self._graph_dropped[device] = dropped_passes
            self._counts_changed = True

    def on_replay(self, span_name_id: int, pass_id: int, data) -> None:
        """One CUDA-graph replay's span record: its pass (begin, its tensors, end), made with the
        protocol's constructors. A span that does not match its graph's layout or header (which
        only a bug could cause) becomes an incomplete pass without tensors, each recorded as lost:
        `verify` fails on it."""
        layout = self._graph_layouts.get(span_name_id)
        why, header = None, None
        if layout is None:
            why = f"no layout for CUDA-graph span {span_name_id:#x} (its graph message was lost)"
        elif len(data) != layout["span_bytes"] or len(data) < protocol.REPLAY_HEADER_BYTES:
            why = f"replay span of {len(data)} bytes, the graph's is {layout['span_bytes']}"
        else:
            header = protocol.replay_header(data)
            # (graph: a replay of an earlier graph under the same, since reused, id is never split
            # with this one's layout)
            if header != (protocol.REPLAY_MAGIC, pass_id, header.replay, span_name_id, len(data), layout["graph"]):
                why = f"replay header {tuple(header)} does not match its record (pass {pass_id})"
        if why is not None:
            self.on_begin(pass_id, {})
            # Its tensors were sent, in the span, and are not stored: each a loss (verify fails on
            # it), which the pass's count allows for. Without a layout neither is known: the pass
            # has no count, which verify fails in a format-6 segment.
            lost = [{"name": self._names.get(t[0], f"<unnamed {t[0]}>"),
                     "reason": f"{fmt.WRITER_LOST_REASON}: CUDA-graph replay not written: {why}"}
                    for t in (layout["tensors"] if layout is not None else ())]
            self.on_end(pass_id, {}, 0, lost, incomplete="CUDA-graph replay not written: " + why,
                        sent=len(layout["tensors"]) if layout is not None else None)
            return
        begin, end = protocol.replay_pass(self.channel, layout, header)
        self.on_begin(begin["pass"], begin["meta"])
        view = memoryview(data) if not isinstance(data, np.ndarray) else data
        for name_id, dtype_code, shape, offset, nbytes in layout["tensors"]:
            self.on_tensor(name_id, pass_id, dtype_code, tuple(shape), view[offset:offset + nbytes])
        self.on_end(end["pass"], end["meta"], end["dropped"], end["skipped"], incomplete=end.get("incomplete"),
                    structure=end.get(fmt.PASS_STRUCTURE), sent=end["sent"])

    def on_note(self, msg: dict) -> None:
        if self._closed:
            return
        self._take_counts(msg)
        if msg.get("status"):
            self._status = str(msg["status"])
        if msg.get("error"):
            self._note_error = str(msg["error"])
        if msg.get("budget_reached"):
            self._info["budget_reached"] = True  # max_bytes hit: later passes were not dumped
        if isinstance(msg.get("cuda_staging"), dict):  # e.g. why CUDA tensors were dropped; why staging stopped
            self._info["cuda_staging"] = {**(self._info.get("cuda_staging") or {}), **msg["cuda_staging"]}
        if self.error is None:
            self._guarded(self._write_rank_json)

    def poll(self, now: float = None) -> None:
        """Rotate by age, and publish a changed ``pending_passes`` in rank.json; the loop calls this
        every POLL_SECONDS. ``now`` is ``time.monotonic()`` (as the loop passes)."""
        if self.error is not None or self._closed:
            return
        self._rotate_if_due(time.monotonic() if now is None else now)
        if self.error is None and (self._counts_changed or self.pending_passes() != self._published_pending):
            self._write_progress()  # (a rotation may have failed: error checked again)

    def idle(self, now: float = None) -> None:
        """The loop found the ring empty: write the open segment once every pass in it has ended
        and ``segment_idle_seconds`` passed since the last one did, so a reader sees those passes
        soon after the model stops; never while a pass is open (it would be split)."""
        pending = self._pending
        if self.idle_seconds is None or self.error is not None or self._closed or not pending.passes \
                or pending.open_passes or pending.last_end is None or self._streams:
            return
        if (time.monotonic() if now is None else now) - pending.last_end >= self.idle_seconds:
            self._guarded(self._flush)

    def pending_passes(self) -> int:
        """Ended passes held in the open segment (not yet in a segment file)."""
        pending = self._pending
        return len(pending.passes) - pending.open_passes

    def close(self, stats: dict = None, status: str = "closed") -> None:
        """Write what is buffered (an unfinished pass is marked incomplete) and finalize rank.json."""
        if self._closed:
            return
        if stats:
            self._stats.update(stats)
            self._take_counts(stats)
        try:
            if self.error is None:
                self._guarded(self._flush)
                if self._status != "error":  # a note's "error" (the serving process stopped dumping) stays
                    self._status = status
                self._info["closed"] = time.time()
                self._guarded(self._write_rank_json)
                fsutil.remove_quietly(self._in_dir(fmt.RESERVE_FILE))  # "closed" is on disk: the reserve's job is done
        finally:
            self._closed = True
            self.sink.accepting = False
            self._anchor.close()

    def _take_counts(self, msg: dict) -> None:
        """The Dumper's own counts (its stats: ``dropped`` tensors, ``dropped_passes``), so that
        rank.json and ``fastdump ls`` agree with ``Dumper.stats()``."""
        for key, attr in (("dropped", "_dropped_total"), ("dropped_passes", "_dropped_passes")):
            value = msg.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                setattr(self, attr, value)

    def fail(self, error: str) -> None:
        """Stop writing for good; record ``error`` in rank.json if the disk allows. Never raises."""
        if self.error is None:
            self.error = self._anchor.readable(str(error)) or "unknown error"
        self._status = "error"
        self.sink.accepting = False  # every later record goes to Python, which ignores it
        for block in self._pending.blocks:
            block.data.free()  # the buffered rows' pages go back to the pool
        self._pending = _PendingSegment()
        self._streams.clear()
        self._set_current(None)
        self.sink.reset()
        if self._open is not None:
            self._open.abort()  # never leave its temporary file behind
            self._open = None
        try:
            self._write_rank_json()
            fsutil.remove_quietly(self._in_dir(fmt.RESERVE_FILE))  # the channel is done either way
        except Exception:
            pass
        self._anchor.close()

    def _in_dir(self, name: str) -> str:
        """``name`` in the channel's directory, reached through its open descriptor (DirAnchor)."""
        return self._anchor.join(name)

    def readable(self, text: str) -> str:
        """An error message naming the directory by its path, not its descriptor's."""
        return self._anchor.readable(text)

    # ----------------------------------------------------------------- internals

    def _set_current(self, pass_state) -> None:
        """The pass receiving tensors now (None: none); the fast path takes only its tensors."""
        self._current = pass_state
        if pass_state is None:
            self.sink.clear_pass()
        else:
            self.sink.set_pass(pass_state.pass_id)

    def _pass(self, pass_id: int) -> _PassState:
        pending = self._pending
        pass_state = pending.passes.get(pass_id)
        if pass_state is None:
            pass_state = pending.passes[pass_id] = _PassState(pass_id)
            pending.open_passes += 1
            if pending.started is None:
                pending.started = time.monotonic()
        return pass_state

    def _name_slot(self, name_id: int) -> int:
        pending = self._pending
        slot = pending.name_slot.get(name_id)
        if slot is None:
            slot = pending.name_slot[name_id] = len(pending.names)
            pending.names.append(self._names.get(name_id, f"<unnamed {name_id}>"))
        return slot

    def _new_block(self, layout: tuple, shape: tuple) -> Block:
        pending = self._pending
        name_id, code, row_shape = layout
        block = Block(len(pending.blocks), self._name_slot(name_id), code, shape[1:], scalar=row_shape is None)
        self.sink.add_layout(name_id, code, row_shape, block.number, block.name_slot, block.row_bytes, block.data)
        pending.blocks.append(block)
        pending.block_by_layout[layout] = block
        return block

    def _write_direct(self, pass_state: _PassState, name_id: int, pass_id: int, code: int, shape: tuple, data) -> None:
        """A large tensor: its own block, written into the open segment file now (see DIRECT_BYTES)."""
        pending = self._pending
        block = Block(len(pending.blocks), self._name_slot(name_id), code, shape[1:], scalar=False)
        block.rows = shape[0]
        try:
            if self._open is None:
                self._open = OpenSegment(self._anchor.join(""), self._next_segment)
            self._open.write_direct(block, data)
        except Exception as exc:
            self.fail(error_text(exc))
            raise
        pending.blocks.append(block)  # not in block_by_layout: later rows of the name go elsewhere
        self.sink.add_index(pass_id, block.name_slot, block.number, 0, block.rows, _crc32c(data), len(data))

    def skip_tensor(self, name_id: int, pass_id: int, reason: str) -> None:
        """A tensor the loop could not hand over (on_tensor raised): recorded, the rest goes on."""
        if self.error is not None or self._closed:
            return
        self._skip(self._pass(pass_id), name_id, reason)

    def _skip(self, pass_state: _PassState, name_id: int, reason: str) -> None:
        name = self._names.get(name_id, f"<unnamed {name_id}>")
        self._record_skip(pass_state, {"name": name, "reason": reason})

    def _record_skip(self, pass_state: _PassState, entry: dict) -> None:
        pass_state.skipped.append(entry)
        self._skipped_total += 1
        reason, reasons = str(entry.get("reason", "")), self._skipped_reasons
        if fmt.is_loss(reason):  # counted apart: the reasons below are capped, this never is
            self._lost_total += 1
        if reason not in reasons and len(reasons) >= MAX_SKIP_REASONS:
            reason = OTHER_SKIP_REASONS
        reasons[reason] = reasons.get(reason, 0) + 1

    def _rotate_if_due(self, now: float) -> None:
        pending = self._pending
        if not pending.passes or self._streams:  # (a tensor's chunks are coming into this segment's file)
            return
        factor = 1 if pending.open_passes == 0 else _FORCE_FLUSH_FACTOR
        due = (
            (self.max_passes is not None and len(pending.passes) >= self.max_passes * factor)
            or (self.max_bytes is not None and self.sink.nbytes >= self.max_bytes * factor)
            or (self.max_seconds is not None and now - pending.started >= self.max_seconds * factor)
        )
        if due:
            self._guarded(self._flush)

    def _guarded(self, action) -> None:
        """Run a disk action; on failure record the error (status "error") and re-raise."""
        try:
            action()
        except Exception as exc:
            self.fail(error_text(exc))
            raise

    def _flush(self) -> None:
        """Write the pending passes as the next segment (unfinished passes marked incomplete)."""
        self._tear_streams()
        pending = self._pending
        if not pending.passes:
            return
        self._pending = _PendingSegment()
        self._set_current(None)
        open_segment, self._open = self._open, None
        index = np.frombuffer(self.sink.index_bytes(), dtype=fmt.INDEX_DTYPE)
        nbytes = self.sink.nbytes
        self.sink.reset()
        passes = list(pending.passes.values())

        pass_table = np.array([(p.pass_id, p.ended and p.incomplete is None, p.dropped, 0, 0) for p in passes],
                              dtype=fmt.PASS_DTYPE)
        _count_pass_rows(pass_table, index, pending.blocks)
        pass_meta = [_pass_meta(p) for p in passes]
        pass_ids = pass_table["pass"]
        tensors = len(index)
        complete = all(p.ended for p in passes)  # every pass ended: none continues in the next segment
        last = pending.passes[int(pass_ids.max())]
        self._unfinished_last = None if last.ended else last.pass_id  # the next segment may continue it
        summary = {
            "first_pass": int(pass_ids.min()),
            "last_pass": int(pass_ids.max()),
            "passes": len(passes),
            "tensors": tensors,
            "bytes": nbytes,
        }
        number = self._next_segment
        write_segment(
            self._anchor.join(""),
            number,
            names=pending.names,
            blocks=pending.blocks,
            index=index,
            passes=pass_table,
            pass_meta=pass_meta,
            attrs={**summary, "complete": complete, "role": str(self._info["role"]), "created": time.time(),
                   **({fmt.ATTR_SESSION: self._info["session"]} if isinstance(self._info["session"], str) else {})},
            open_segment=open_segment,
        )
        self._next_segment = number + 1
        self._list.append({"file": fmt.segment_name(number), **summary, "complete": complete})
        self._passes_written += len(passes)
        self._tensors_written += tensors
        self._bytes_written += nbytes
        self._write_rank_json()

    def _first_free_segment_number(self) -> int:
        """Never reuse a number already on disk (a restarted writer in an existing directory)."""
        highest = -1
        for entry in os.listdir(self._anchor.join("")):
            name = entry[1:-len(fsutil.TMP_SUFFIX)] if fsutil.is_temp_name(entry) else entry
            number = fmt.segment_number(name)
            if number is not None:
                highest = max(highest, number)
        return highest + 1

    def rank_json(self) -> dict:
        """The current content of rank.json."""
        late = {"late_pass_ends_left_out": self._late_ends_left_out} if self._late_ends_left_out else {}
        return {
            **late,
            **self._info,
            "status": self._status,
            "error": self.error or self._note_error,
            "dropped": max(self._dropped_total, self._dropped_in_passes),
            # The Dumper's count (sent at close) includes its graphs' drops; while it runs, the
            # drains' notes are what is known of those.
            "dropped_passes": max(self._dropped_passes, sum(self._graph_dropped.values())),
            "skipped": self._skipped_total,
            "skipped_reasons": dict(self._skipped_reasons),
            "lost_tensors": self._lost_total,
            "passes": self._passes_written,
            "pending_passes": self.pending_passes(),  # ended, still in the open segment
            "tensors": self._tensors_written,
            "bytes": self._bytes_written,
            **self._list.committed(),  # the lines of segments.jsonl that are durable
            "stats": dict(self._stats),
            "updated": time.time(),
        }

    def _write_rank_json(self) -> None:
        self._published_pending = self.pending_passes()
        self._counts_changed = False
        path = self._in_dir(fmt.RANK_FILE)
        reserve = self._in_dir(fmt.RESERVE_FILE)
        try:
            fsutil.atomic_write_json(path, self.rank_json())
        except OSError as exc:
            if exc.errno not in _DISK_FULL or not os.path.exists(reserve):
                raise
            # Disk full: give up the reserved space so that this rank.json (its error) lands
            # (it is a few KiB however many segments there are: they are in segments.jsonl).
            # A routine write (after a segment) that needs the reserve is the failure itself: the
            # reserve is spent once, so this rank.json says so, and the caller stops writing (the
            # next segment would take the freed space and its failure find none for rank.json,
            # leaving it "running").
            spent_here = self.error is None
            if spent_here:
                self.error = f"disk full: {exc.strerror or exc} writing {fmt.RANK_FILE}"
                self._status = "error"
            fsutil.remove_quietly(reserve)
            fsutil.atomic_write_json(path, self.rank_json())
            if spent_here:
                raise

    def _write_progress(self) -> None:
        """rank.json with a new pending_passes or drop count: at most once a poll, not made durable.
        Best effort: a progress figure that cannot be written (disk full) waits for the next
        segment's rank.json, which reports any real failure."""
        self._published_pending = self.pending_passes()
        self._counts_changed = False
        try:
            fsutil.atomic_write_json(self._in_dir(fmt.RANK_FILE), self.rank_json(), durable=False)
        except OSError:
            pass  # the next segment's rank.json (durable, checked) says what is wrong


def _count_pass_rows(pass_table: np.ndarray, index: np.ndarray, blocks: list) -> None:
    """Fill each pass's ``tensors`` and ``bytes`` from the segment's index rows."""
    if not len(index):
        return
    ids = pass_table["pass"]
    order = np.argsort(ids, kind="stable")
    where = order[np.minimum(np.searchsorted(ids, index["pass"], sorter=order), len(ids) - 1)]
    if not np.array_equal(ids[where], index["pass"]):
        raise RuntimeError("an index row names a pass the segment does not hold")  # only a bug
    row_bytes = np.array([block.row_bytes for block in blocks], dtype=np.int64)
    pass_table["tensors"] = np.bincount(where, minlength=len(ids))
    per_pass = np.zeros(len(ids), dtype=np.int64)
    np.add.at(per_pass, where, index["rows"] * row_bytes[index["block"]])
    pass_table["bytes"] = per_pass


def _reserve_space(path: str, nbytes: int) -> None:
    """Allocate ``nbytes`` at ``path`` (really allocated, not a sparse file); best effort."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError:
        return
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            if exc.errno in _DISK_FULL:
                raise
            os.pwrite(fd, bytes(nbytes), 0)  # file systems without fallocate
        except AttributeError:
            os.pwrite(fd, bytes(nbytes), 0)
    except OSError:
        fsutil.remove_quietly(path)  # not even that much room: nothing to hold back
    finally:
        os.close(fd)
