"""The writer's main loop: take records off the ring in order, hand them to channel writers.

Runs in the writer process (``python -m fastdump.writer``) or in a thread. It owns the ring's
consumer side. ``next_batch`` takes most tensors itself: a tensor whose pass and layout its
channel writer already knows is copied into that channel's page buffers, CRC'd and indexed in C++
(the channel's ``RowSink``, csrc/writer_rows.h) without a Python object per tensor. The others
(a pass's or a name's first tensor, chunks, large tensors, CUDA-graph spans) come out as views
into the ring; the ChannelWriter copies each one once into its page buffers (or writes a large one
to the file). The batch's ring space is released before any control record is handled (so the
producer never waits on HDF5). Control records are acknowledged after they are handled, which is
how ``Dumper.close()`` knows its data is on disk.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from .. import _C, protocol
from .. import format as fmt
from . import segment_file
from .channel_writer import ChannelWriter

log = logging.getLogger("fastdump.writer")

POLL_SECONDS = 0.25  # idle wake-up: rotate segments by time or idleness, notice a dead producer
BATCH_BYTES = 16 << 20  # ring space one batch may hold while the writer consumes it


class _Assembly:
    """A tensor split over several ring records, filled in as its chunks arrive."""

    __slots__ = ("data", "filled")
    streamed = False

    def __init__(self, total: int):
        self.data = np.empty(total, dtype=np.uint8)
        self.filled = 0


class _Streamed:
    """A tensor split over several ring records whose chunks its channel writer writes into the
    segment as they come (ChannelWriter.on_chunk): a 4 GiB activation no longer takes 4 GiB of the
    writer's memory. ``data`` is None once it was dropped and its loss recorded."""

    __slots__ = ("data", "filled")
    streamed = True

    def __init__(self):
        self.data = True
        self.filled = 0


class StopSignal:
    """How the serving process stops its writer THREAD (a writer process learns it from its stdin's
    EOF, the ring's ``drained``): the producer never dies in-process, and a writer that failed is not
    sent the ``shutdown`` message (Engine.shutdown), so without this its loop idled forever (close()
    waited its whole timeout, and at exit the daemon thread, still inside next_batch, aborted the
    interpreter: "terminate called without an active exception").

    ``requested``: the producer is done; drain what is in the ring, finish, return.
    ``abandon``: return at the next batch boundary, failing the channels still open (their
    temporary files removed), as a killed writer process would have left them."""

    __slots__ = ("requested", "abandon")

    def __init__(self):
        self.requested = False
        self.abandon = False


class WriterLoop:
    def __init__(self, consumer, pin_near_device: bool = False, stop: StopSignal | None = None,
                 on_first_ack=None):
        self.consumer = consumer
        self.pin_near_device = pin_near_device  # only a writer process may move its own CPUs
        self.stop = stop  # a writer thread's (see StopSignal); None in a writer process
        # Called once, right after the first control record (the first attach's open) is acked: a
        # writer process lowers its priority there (writer/__main__.py), not before its handshake.
        self.on_first_ack = on_first_ack
        self.channels: dict[int, ChannelWriter] = {}
        self.sinks: dict = {}  # channel -> its writer's RowSink: next_batch's fast path
        self.partial: dict[tuple, _Assembly] = {}
        self.failed: str | None = None

    def run(self) -> int:
        consumer = self.consumer
        consumer.set_state(_C.WRITER_RUNNING, "")
        next_poll = time.monotonic() + POLL_SECONDS
        tensor_kind = _C.KIND_TENSOR
        # A small ring must not be held whole while a batch is consumed (the producer would drop
        # or wait for nothing).
        batch_bytes = min(BATCH_BYTES, max(consumer.capacity // 4, 1))
        stop = self.stop
        while True:
            if stop is not None and stop.abandon:
                self._abandon()
                return 0
            # The tensors next_batch did not take itself arrive as views into the ring, held until
            # release(): the channel writer copies each once into its pages, or writes it to the
            # file. A batch ends at a control record or at a tensor the fast path declined, so the
            # batch is released before that control's work, and rows stay in arrival order.
            batch = consumer.next_batch(POLL_SECONDS, max_bytes=batch_bytes, view_bytes=1, sinks=self.sinks)
            now = time.monotonic()
            if now >= next_poll:
                self._poll(now)
                next_poll = now + POLL_SECONDS
            if not batch and consumer.holding:  # every record of the batch took the fast path
                consumer.release()
                continue
            if not batch:
                # The serving process died, or (writer thread) stopped us: keep what arrived.
                if consumer.drained or (stop is not None and stop.requested):
                    self._finish("incomplete")
                    return 0
                self._idle()  # only when nothing arrived: never on the busy path
                continue
            channels = self.channels
            # protocol.Record, unpacked by position: the fields in its order, at no cost per record
            for kind, channel, name_id, pass_id, dtype, shape, payload, seq, offset, total in batch:
                if kind == tensor_kind:  # the hot path, inlined: tens of thousands per second
                    if offset == 0 and len(payload) == total:
                        data = payload
                    else:
                        data = self._assemble(channel, name_id, pass_id, dtype, shape, payload, offset, total)
                    writer = channels.get(channel)
                    if writer is not None and data is not None:
                        try:
                            writer.on_tensor(name_id, pass_id, dtype, shape, data)
                        except Exception as exc:
                            self._tensor_failed(writer, name_id, pass_id, exc)
                    continue
                consumer.release()  # every view before this control is consumed
                msg = protocol.decode(payload)
                if msg["op"] == "shutdown":
                    self._finish("closed")
                    consumer.ack(seq)
                    return 0
                self._control(msg)
                consumer.ack(seq)
                if self.on_first_ack is not None:
                    settle, self.on_first_ack = self.on_first_ack, None
                    settle()
            consumer.release()

    def _assemble(self, channel, name_id, pass_id, dtype, shape, payload, offset, total):  # copies: payload may be a view
        """One chunk of a split tensor; the whole tensor once its last chunk is in, else None.
        A large one its channel writer streams is written chunk by chunk instead (None always)."""
        key = (channel, name_id, pass_id)
        part = self.partial.get(key)
        if part is None:
            if name_id >= protocol.GRAPH_SPAN_NAME_BASE:
                self._drop_torn_spans(channel, name_id)
            writer = self.channels.get(channel)
            if offset == 0 and writer is not None and writer.streams(dtype, shape, total):
                part = self.partial[key] = _Streamed()
        if part is not None and part.streamed:
            return self._stream(key, part, dtype, shape, payload, offset, total)
        if part is None:
            try:
                part = _Assembly(total)
            except MemoryError as exc:  # (a broadcast view of terabytes): lost, said once, the writer goes on
                part = _Assembly(0)
                part.data = None  # takes the rest of its chunks and keeps nothing
                writer = self.channels.get(channel)
                if writer is not None:
                    self._tensor_failed(writer, name_id, pass_id, exc)
            self.partial[key] = part
        if part.data is not None:
            part.data[offset:offset + len(payload)] = np.frombuffer(payload, dtype=np.uint8)
        part.filled += len(payload)
        if part.filled < total:
            return None
        del self.partial[key]
        return part.data

    def _stream(self, key, part, dtype, shape, payload, offset, total) -> None:
        """A chunk of a streamed tensor to its channel writer; a chunk out of place tears it."""
        channel, name_id, pass_id = key
        writer = self.channels.get(channel)
        if part.data is not None and writer is not None:
            try:
                if not writer.on_chunk(name_id, pass_id, dtype, shape, payload, offset, total):
                    part.data = None  # dropped; recorded here, not again at its pass's end
                    writer.skip_tensor(name_id, pass_id, fmt.TORN_TENSOR_REASON)
            except Exception as exc:
                part.data = None
                self._tensor_failed(writer, name_id, pass_id, exc)
        part.filled += len(payload)
        if part.filled >= total:
            del self.partial[key]
        return None

    def _drop_torn_spans(self, channel: int, name_id: int) -> None:
        """A CUDA-graph replay span begins: an unfinished span from the same GPU's drain can never
        complete (the drain stages one span at a time; its record timed out part-way and the replay
        was counted as dropped). Forget it: it has no pass and no end message to do so."""
        device = (name_id - protocol.GRAPH_SPAN_NAME_BASE) // protocol.GRAPHS_PER_RECORDER
        for key in [k for k in self.partial if k[0] == channel and k[1] >= protocol.GRAPH_SPAN_NAME_BASE
                    and (k[1] - protocol.GRAPH_SPAN_NAME_BASE) // protocol.GRAPHS_PER_RECORDER == device]:
            del self.partial[key]

    def _control(self, msg: dict) -> None:
        op, channel = msg["op"], msg.get("channel", 0)
        if op == "open":
            if self.pin_near_device and (msg.get("device") or {}).get("pci_bus_id"):
                from ..devices import pin_writer_near

                pin_writer_near(msg["device"]["pci_bus_id"])
                self.pin_near_device = False  # the first GPU decides: one writer serves them all
            try:
                writer = self.channels[channel] = ChannelWriter(msg)
                self.sinks[channel] = writer.sink
            except Exception as exc:
                self.channels.pop(channel, None)
                self._fail_channel(channel, f"cannot open {msg.get('dir')}: {exc}")
            return
        if op == "end":
            self._drop_torn(channel, msg)
        method = {"name": "on_name", "begin": "on_begin", "end": "on_end", "note": "on_note",
                  "close": "close", "graph": "on_graph", "graph_drops": "on_graph_drops"}.get(op)
        if method is None:
            log.warning("fastdump writer: unknown control op %r", op)
            return
        args = {
            "name": lambda: (msg["id"], msg["name"]),
            "begin": lambda: (msg["pass"], msg.get("meta") or {}),
            "end": lambda: (msg["pass"], msg.get("meta") or {}, msg.get("dropped", 0), msg.get("skipped", []),
                            msg.get("incomplete"), msg.get("mixed", False), msg.get("late", False),
                            msg.get(fmt.PASS_STRUCTURE), msg.get("sent")),
            "note": lambda: (msg,),
            "close": lambda: (msg.get("stats") or {},),
            "graph": lambda: (msg,),
            "graph_drops": lambda: (msg["device"], msg["dropped_passes"]),
        }[op]()
        self._call(channel, method, *args)
        if op == "close":
            self.channels.pop(channel, None)
            self.sinks.pop(channel, None)

    def _drop_torn(self, channel: int, end_msg: dict) -> None:
        """Chunks of a tensor whose other chunks never came (a failed CUDA drain turns unfinished
        records into padding): at its pass's end it can never complete, so it is recorded as skipped."""
        torn = [key for key in self.partial if key[0] == channel and key[2] == end_msg["pass"]]
        names = getattr(self.channels.get(channel), "names", {})
        skipped = end_msg.setdefault("skipped", [])
        writer = self.channels.get(channel)
        for key in torn:
            part = self.partial.pop(key)
            if part.data is None:
                continue  # its loss is recorded already (_assemble, _stream)
            if part.streamed and writer is not None:
                self._call(channel, "drop_stream", key[1], key[2])  # its dataset leaves the segment
            name = names.get(key[1], f"name #{key[1]}")
            if not any(entry.get("name") == name for entry in skipped):  # the producer may have said why
                skipped.append({"name": name, "reason": fmt.TORN_TENSOR_REASON})

    def _call(self, channel: int, method: str, *args) -> None:
        writer = self.channels.get(channel)
        if writer is None:
            return  # channel failed to open, or writing already failed
        try:
            getattr(writer, method)(*args)
        except Exception as exc:
            self._fail_writer(writer, exc)

    def _tensor_failed(self, writer, name_id: int, pass_id: int, exc: Exception) -> None:
        """One tensor the channel could not take: a recorded skip, not a dead writer, unless the
        channel itself failed or the disk did (OSError), which stops writing as before."""
        if getattr(writer, "failed", False) or isinstance(exc, OSError):
            return self._fail_writer(writer, exc)
        reason = f"{fmt.WRITER_LOST_REASON}: {type(exc).__name__}: {exc}"
        log.error("fastdump writer: %s: tensor #%s of pass %s skipped: %s", writer_dir(writer), name_id, pass_id,
                  reason)
        try:
            writer.skip_tensor(name_id, pass_id, reason)
        except Exception as exc2:
            self._fail_writer(writer, exc2)

    def _fail_writer(self, writer, exc: Exception) -> None:
        readable = getattr(writer, "readable", str)  # its files' paths go through a descriptor (DirAnchor)
        error = f"{writer_dir(writer)}: {readable(segment_file.error_text(exc))}"
        try:
            writer.fail(error)  # rank.json says why (if its disk allows)
        except Exception:
            pass
        self._fail_channel(getattr(writer, "channel", None), error)

    def _fail_channel(self, channel, error: str) -> None:
        """Writing one channel failed (its root's disk full or unwritable): that channel stops, its
        Dumper learns it from the ring header (Producer.channel_failed) and stops, and the other
        channels, on other roots, go on. Their records are consumed and ignored from now on. A
        channel whose id is too high for the header's bits stops every channel, as before."""
        writer = self.channels.pop(channel, None)
        self.sinks.pop(channel, None)
        if not isinstance(channel, int) or not self.consumer.fail_channel(channel, error):
            if writer is not None:
                self.channels[channel] = writer  # (failed already; _fail fails every channel)
            return self._fail(error)
        log.error("fastdump writer: %s; dumping to that directory stops", error)

    def _fail(self, error: str) -> None:
        """The writer itself cannot go on: stop dumping everywhere, keep serving."""
        log.error("fastdump writer: %s; dumping stops", error)
        if self.failed is None:
            self.failed = error
            # The producer sees FAILED and stops staging; we keep draining what is in flight.
            self.consumer.set_state(_C.WRITER_FAILED, error)
        for writer in self.channels.values():
            try:
                writer.fail(error)
            except Exception:
                pass
        self.channels.clear()
        self.sinks.clear()

    def _poll(self, now: float) -> None:
        for channel in list(self.channels):
            self._call(channel, "poll", now)  # (time.monotonic(): rotation never reads the wall clock)

    def _idle(self) -> None:
        now = time.monotonic()
        for channel in list(self.channels):
            self._call(channel, "idle", now)

    def _abandon(self) -> None:
        """A writer thread given up on by its serving process (StopSignal.abandon)."""
        if self.channels:
            self._fail("writer stopped before it finished: the serving process stopped waiting for it")
        elif self.failed is None:
            self.consumer.set_state(_C.WRITER_EXITED, "")

    def _finish(self, status: str) -> None:
        for channel, writer in list(self.channels.items()):
            try:
                writer.close({}, status=status)
            except Exception as exc:
                self._fail_writer(writer, exc)
        self.channels.clear()
        self.sinks.clear()
        if self.failed is None:
            self.consumer.set_state(_C.WRITER_EXITED, "")


def writer_dir(writer) -> str:
    return str(getattr(writer, "dir", "?"))


def run_consumer(consumer, pin_near_device: bool = False, stop: StopSignal | None = None,
                 on_first_ack=None) -> int:
    """The writer's loop until it ends; ``stop``: a writer thread's StopSignal (None in a process);
    ``on_first_ack``: see WriterLoop.
    The I/O threads of segment writes end with the last loop of the process: a closed writer
    thread leaves no thread behind in the serving process."""
    segment_file.refuse_file_size_signal()  # a writer thread shares the serving process's dispositions
    segment_file.hold_io_threads()
    try:
        return WriterLoop(consumer, pin_near_device, stop, on_first_ack).run()
    except BaseException as exc:  # a crash of the loop itself: say so where the producer looks
        log.exception("fastdump writer crashed")
        consumer.set_state(_C.WRITER_FAILED, f"writer crashed: {type(exc).__name__}: {exc}")
        return 1
    finally:
        segment_file.release_io_threads()
