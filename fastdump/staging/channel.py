"""A Dumper's one way into the ring: ``Engine.open_channel(...)`` returns a :class:`Channel`.

The channel holds what staging needs and the Dumper does not: its channel id, the block policy's
state (block / block timeout, and the fall back to `drop` while the writer is stalled), the stagers
(the C++ ``ChannelStager`` for plain CPU tensors, the CUDA stager or its host fallback, chosen once),
and the drop counts. The Dumper keeps passes, names and selection.

Hot path: ``channel.stage_fast`` IS the C++ ``ChannelStager.stage_tensor`` (a plain CPU tensor with
a known name: one C++ call, no Python frame in between; every Python attribute read there cost the
model's thread ~0.1-0.2 us per tensor). Once the channel has a CUDA stager (``prepare_cuda`` at
attach, or the first CUDA tensor) the same call stages CUDA tensors through the stager's lean path
(docs/CUDA.md, "The eager path"). ``stage`` is the general path behind it.
"""

from __future__ import annotations

import logging

from .. import _C
from .. import protocol

log = logging.getLogger("fastdump")

STAGED = _C.STAGED
DROPPED = _C.DROPPED
CAPTURING = _C.CAPTURING
# stage(): a tensor on a device fastdump cannot read (not a _C status: never leaves Python).
UNSUPPORTED_DEVICE = -1


def host_layout(t) -> tuple:
    """(shape, strides, address, storage address, storage bytes) of a CPU tensor as its TensorImpl
    holds them: the arguments of ``ChannelStager.stage``, which checks the extent against the
    storage before it copies. A subclass's Python overrides (properties, ``__torch_function__``)
    and torch function modes are not asked: a wrong address or extent would make the copy read
    outside the tensor and crash the served model. ValueError (the tensor's recorded skip) for a
    subclass without storage of its own."""
    import torch

    base_class = torch.Tensor
    with torch._C.DisableTorchFunction():
        shape, strides = base_class.size(t), base_class.stride(t)
        try:
            ptr = base_class.data_ptr(t)
            storage = base_class.untyped_storage(t)
            return shape, strides, ptr, storage.data_ptr(), storage.nbytes()
        except RuntimeError:  # a wrapper subclass: no storage of its own
            raise ValueError(_C.NO_DATA) from None


assert UNSUPPORTED_DEVICE not in {getattr(_C, n) for n in dir(_C) if n.isupper() and isinstance(getattr(_C, n), int)}


class Channel:
    """One channel of the engine's ring, as its Dumper sees it."""

    def __init__(self, engine, channel_id: int, fast_codes: dict, strided, *, block: bool,
                 block_timeout_s: float, device_ring_mb, where: str = ""):
        self.engine = engine
        self.id = channel_id
        self.where = where  # for log lines: the rank directory
        self.lane = engine.channel_stager(channel_id, fast_codes, strided)
        self.stage_fast = self.lane.stage_tensor  # see the module docstring
        self.policy_block = bool(block)
        self.block = self.policy_block  # False while the writer is stalled (see begin / note_stall)
        self.block_timeout_s = float(block_timeout_s)
        self.device_ring_mb = device_ring_mb
        self._cuda = None  # the staging.cuda module, imported with the first CUDA tensor or array
        self._stage_cuda = None  # the stager's stage function, chosen once (device ring or host fallback)
        self._ring_noted = False
        # Drops, counted here only: tensors, whole passes, and this pass's tensors (for its end message).
        self.dropped = 0
        self._dropped_pass_starts = 0  # eager passes whose begin found the ring full (`drop`)
        self._graph_recorders: list = []  # CUDA-graph recorders: their dropped replays are passes too
        self.pass_dropped = 0
        self._failure = None  # the writer's error for this channel, once taken out of the ring header

    @property
    def failed(self) -> bool:
        """The writer stopped writing this channel alone (its root's disk full or unwritable; the
        reason is in its rank.json): this Dumper stops, the engine's other channels go on."""
        return self.engine.producer.channel_failed(self.id)

    def failure(self) -> str:
        """The writer's error for this failed channel ('' when it had no place in the ring header
        to say it): taken out of the header once, its place freed for the next channel that fails
        (a fifth failed channel got none while four places were kept for good), and kept here."""
        if self._failure is None:
            self._failure = self.engine.producer.take_channel_error(self.id)
        return self._failure

    # -- control messages ---------------------------------------------------------------------------
    def control(self, msg: dict, *, block: bool | None = None, wait: bool = False, timeout: float = 600.0):
        """Send ``msg`` in ring order under this channel's block policy (``block`` overrides it);
        its seq, 0 when not sent. ``wait``: True once the writer handled it (see Engine.control)."""
        if wait:
            return self.engine.control(msg, wait=True, timeout=timeout)
        return self.engine.control(msg, block=self.block if block is None else block,
                                   block_timeout=self.block_timeout_s)

    def begin(self, pass_id: int) -> bool:
        """Open pass ``pass_id`` in the ring; False when `drop` found the ring full (the whole pass
        is dropped, counted). Under `block`, blocking resumes once the writer gave space back."""
        engine = self.engine
        self.pass_dropped = 0
        if not self.block and self.policy_block and engine.space_returned():
            if engine.stalled:
                log.warning("fastdump: the writer caught up; %s blocks for ring space again", self.where)
            engine.stalled = False
        self.block = self.policy_block and not engine.stalled
        if self.lane.open_pass(pass_id, self.block, self.block_timeout_s):
            return True  # the common case: the begin record went in at once (one C call)
        if not self.control(protocol.begin(self.id, pass_id)):
            self._dropped_pass_starts += 1
            self.note_stall("a pass start", pass_id)
            return False
        self.lane.begin(pass_id, self.block, self.block_timeout_s)
        return True

    def end(self, pass_id: int, meta: dict, skipped: dict, incomplete: str | None, mixed: bool,
            dropped: int, sent: int, structure: dict | None = None) -> int:
        """Close pass ``pass_id`` in the ring (see protocol.end): its seq, 0 when not sent.
        ``dropped``, ``sent``: the pass's drops (``pass_dropped``) and tensors put into the ring
        (``lane.sent_in``: stage_tensor's, and the general paths' ``lane.add_sent``) as read when it
        ended: another thread's next pass may have moved them since."""
        if not meta and not skipped and incomplete is None and not mixed and not structure:
            seq = self.lane.put_plain_end(pass_id, dropped, sent)  # the common case, one C call (it
            if seq:                                                 # ends the CUDA lane's pass too)
                return seq
        else:
            self.lane.end_pass()  # the CUDA lane's last batch goes to the drain now, not at its hold timer
        return self.control(protocol.end(self.id, pass_id, meta, dropped, skipped, sent=sent,
                                         incomplete=incomplete, mixed=mixed, structure=structure))

    def note_stall(self, what: str, pass_id: int) -> None:
        """A send into the ring failed; under a blocking wait that means block_timeout_s ran out:
        stage as under `drop` from now on (logged once per stall) until the writer catches up."""
        if not self.block or not self.engine.alive:
            return
        self.block = False  # the rest of this pass is staged as under `drop`
        self.lane.begin(pass_id, False, self.block_timeout_s)
        if not self.engine.stalled:
            self.engine.mark_stalled()
            log.error("fastdump: the writer freed no ring space for block_timeout_s=%g s (at %s, pass %d): "
                      "dropping (counted) until it consumes again", self.block_timeout_s, what, pass_id)

    # -- staging ----------------------------------------------------------------------------------------
    def stage(self, name_id: int, pass_id: int, t, code: int, itemsize: int) -> int:
        """The general path: a strided tensor of dtype ``code`` with resolved conj/neg bits, on the
        CPU (the C++ lane) or CUDA (device ring, or the synchronous host fallback). A _C status,
        or UNSUPPORTED_DEVICE."""
        if t.is_cpu:
            return self.lane.stage(name_id, code, itemsize, *host_layout(t))
        if not t.is_cuda:
            return UNSUPPORTED_DEVICE
        if self.failed:  # (as the C++ lane does for the CPU: nothing more for the writer to throw away)
            return _C.DISABLED
        stage_cuda = self._stage_cuda or self._cuda_stage_function()
        status = stage_cuda(self.id, name_id, pass_id, code, t, self.block, self.block_timeout_s)
        if status == self._cuda.RING_UNAVAILABLE:  # that GPU's device ring could not be had
            self.engine.producer.count_dropped(1)
            self.note_ring_failure(self._cuda.ring_failure(self.engine.cuda_stager(self.device_ring_mb)))
            return DROPPED
        return status

    def stage_array(self, name_id: int, pass_id: int, array):
        """A CuPy/Numba/DLPack array: (status, nbytes). Raises for an array it cannot read."""
        cuda = self._cuda_module()
        if self.failed:  # (as in stage)
            return _C.DISABLED, 0
        status, nbytes = cuda.stage_array(self.engine, self.device_ring_mb, self.id, name_id, pass_id, array,
                                          self.block, timeout_s=self.block_timeout_s)
        if status == cuda.RING_UNAVAILABLE:  # that GPU's device ring could not be had: as for a torch tensor
            self.engine.producer.count_dropped(1)
            self.note_ring_failure(cuda.ring_failure(self.engine.cuda_stager(self.device_ring_mb)))
            return DROPPED, nbytes
        return status, nbytes

    def prepare_cuda(self, index) -> None:
        """Allocate GPU ``index``'s device ring now (at attach, before a serving engine sizes its KV
        cache to the free memory); when it cannot be had, that GPU's tensors are dropped (recorded)."""
        cuda = self._cuda_module()
        if cuda.usable():
            reason = cuda.prepare(self.engine.cuda_stager(self.device_ring_mb), index)
            if reason:
                self.note_ring_failure(reason)
            else:
                self._cuda_stage_function()  # chosen now: stage_fast takes CUDA tensors from the start

    def note_ring_failure(self, reason: str) -> None:
        if not self._ring_noted:  # once: rank.json says why CUDA tensors are dropped
            self._ring_noted = True
            self.control(protocol.note(self.id, "running", cuda_staging={
                "device_ring": "unavailable", "reason": reason,
                "effect": "CUDA tensors on that GPU are dropped and counted"}), block=True)

    # -- counts -------------------------------------------------------------------------------------------
    @property
    def dropped_passes(self) -> int:
        """Whole passes dropped: eager passes (`drop`, ring full as they began) and CUDA-graph
        replays (dropped on the device or by the drain; each recorder counts them as they happen,
        read here, so stats() is current while replays run)."""
        n = self._dropped_pass_starts
        for rec in self._graph_recorders:
            n += rec.dropped_replays
        return n

    def count_graph_drops(self, recorder) -> None:
        """Count ``recorder``'s dropped replays (a _C.GraphRecorder of this channel) as dropped passes."""
        self._graph_recorders.append(recorder)

    def count_drop(self, in_ring: bool = True) -> None:
        """One tensor dropped in this pass. ``in_ring=False``: the ring never saw it (no name id,
        no device ring), so the producer's own drop count gets it too."""
        if not in_ring:
            self.engine.producer.count_dropped(1)
        self.pass_dropped += 1
        self.dropped += 1

    def take_counts(self):
        """(tensors, bytes) the C++ lane staged since the last call."""
        return self.lane.take_counts()

    # -- internals ---------------------------------------------------------------------------------------
    def _cuda_module(self):
        if self._cuda is None:
            from . import cuda  # imported once, with the first CUDA tensor: never by a CPU-only run

            self._cuda = cuda
        return self._cuda

    def _cuda_stage_function(self):
        """The stager's stage function, decided once: the device ring, or the host fallback."""
        cuda = self._cuda_module()
        stager = self.engine.cuda_stager(self.device_ring_mb)
        if isinstance(stager, cuda.HostFallbackStager):
            self._stage_cuda = stager.stage_tensor
        else:
            def stage_cuda(*args, _stage=cuda.stage_on_device, _stager=stager):
                return _stage(_stager, *args)
            self._stage_cuda = stage_cuda
            if hasattr(self.lane, "set_cuda") and not self.lane.has_cuda:
                # The C++ hot path takes this channel's CUDA tensors from now on (the lean path).
                self.lane.set_cuda(stager, *cuda.lane_stream_functions())
        return self._stage_cuda
