"""The C++ ring on its own: what goes in comes out, byte for byte, in order."""

import ctypes
import itertools
import mmap
import time
import os
import threading

import numpy as np
import pytest
import torch

from fastdump import _C

_names = itertools.count()


def ring(capacity=1 << 20, chunk=0):
    name = f"/fastdump-{os.getpid()}-test{next(_names)}"
    producer = _C.Producer(name, capacity, chunk)
    consumer = _C.Consumer(name)
    producer.unlink()
    return producer, consumer


def stage(producer, t, name_id=0, pass_id=0, block=True):
    return producer.stage_host(0, name_id, pass_id, 0, t.element_size(), t.shape, t.stride(), t.data_ptr(), block)


def take(consumer, timeout=1.0):
    """Next tensor, reassembled from its chunks."""
    parts, shape = [], None
    while True:
        rec = consumer.next(timeout)
        assert rec is not None, "expected a record"
        kind, channel, name_id, pass_id, dtype, shape, payload, seq, offset, total = rec
        assert offset == sum(len(p) for p in parts)
        parts.append(bytes(payload))
        consumer.release()
        if offset + len(payload) == total:
            return shape, b"".join(parts), (name_id, pass_id)


@pytest.mark.parametrize("make", [
    lambda: torch.randn(3, 5),
    lambda: torch.randn(4, 6).t(),                       # transposed
    lambda: torch.randn(5, 7, 3)[:, ::2, 1:],            # sliced, non-contiguous inner
    lambda: torch.randn(2, 3)[:, None, :].expand(2, 4, 3),  # zero stride
    lambda: torch.arange(24).reshape(2, 3, 4).permute(2, 0, 1),
    lambda: torch.tensor(3.5),                           # 0-d
    lambda: torch.empty(0, 4),                           # empty
    lambda: torch.randn(1, 1, 1, 1, 1, 1, 1, 2),         # high rank
    lambda: torch.randn(10, 3).flip(0),                  # negative stride
])
def test_strided_tensors_arrive_in_c_order(make):
    producer, consumer = ring()
    t = make()
    assert stage(producer, t) == _C.STAGED
    shape, data, _ = take(consumer)
    assert tuple(shape) == tuple(t.shape)
    assert data == t.contiguous().numpy().tobytes()


def test_large_tensor_is_split_and_reassembled_in_order():
    producer, consumer = ring(capacity=1 << 20, chunk=64 << 10)
    t = torch.randn(300, 1000)[:, ::3]  # 400 KB, strided, several chunks
    got = {}

    def read():
        got["v"] = take(consumer, timeout=5)

    reader = threading.Thread(target=read)
    reader.start()
    assert stage(producer, t) == _C.STAGED
    reader.join()
    assert got["v"][1] == t.contiguous().numpy().tobytes()


def test_a_tensor_larger_than_the_ring_goes_in_chunk_by_chunk_byte_for_byte():
    """`block` stages a tensor the ring cannot hold at once as the writer frees space, each chunk
    from its own place in the tensor (strided too): the reader gets every byte in order."""
    producer, consumer = ring(64 << 10)  # chunks of 16 KiB
    t = torch.arange(3 * (100 << 8), dtype=torch.int32).reshape(-1, 3)[:, ::3]  # 100 KiB, strided
    got = {}
    reader = threading.Thread(target=lambda: got.setdefault("v", take(consumer, timeout=5)))
    reader.start()
    assert stage(producer, t) == _C.STAGED
    reader.join()
    shape, data, _ = got["v"]
    assert tuple(shape) == tuple(t.shape) and data == t.contiguous().numpy().tobytes()


def test_wraparound_keeps_every_record_intact():
    producer, consumer = ring(capacity=64 << 10)
    sent = [torch.randn(int(n)) for n in np.random.default_rng(0).integers(1, 3000, size=500)]
    received = []

    def read():
        for _ in sent:
            received.append(take(consumer, timeout=5)[1])

    reader = threading.Thread(target=read)
    reader.start()
    for i, t in enumerate(sent):
        assert stage(producer, t, name_id=i) == _C.STAGED
    reader.join()
    assert received == [t.numpy().tobytes() for t in sent]


def test_drop_policy_counts_and_never_blocks():
    producer, consumer = ring(capacity=64 << 10)
    t = torch.randn(2048)  # 8 KiB
    statuses = [stage(producer, t, block=False) for _ in range(20)]
    assert statuses.count(_C.DROPPED) > 0
    assert producer.stats()["dropped"] == statuses.count(_C.DROPPED)
    staged = statuses.count(_C.STAGED)
    for _ in range(staged):
        assert take(consumer)[1] == t.numpy().tobytes()
    assert consumer.next(0.01) is None


def test_views_in_a_batch_stay_valid_until_release():
    # The writer holds a whole batch of views into the ring: the producer must not reuse their
    # space, even with the ring full, until release() gives the batch back at once.
    producer, consumer = ring(capacity=64 << 10)
    sent = [torch.full((1024,), float(i)) for i in range(12)]  # 4 KiB each: the ring holds ~14
    for t in sent:
        assert stage(producer, t, block=False) == _C.STAGED
    batch = consumer.next_batch(1.0, view_bytes=1)
    assert len(batch) == 12 and consumer.holding
    assert all(type(rec[6]) is memoryview for rec in batch)
    # The ring is full of held records: a new tensor is dropped, never written over them.
    statuses = [stage(producer, torch.full((1024,), -1.0), block=False) for _ in range(4)]
    assert statuses.count(_C.DROPPED) >= 2
    for rec, t in zip(batch, sent):
        assert bytes(rec[6]) == t.numpy().tobytes()
    consumer.release()
    assert not consumer.holding
    assert stage(producer, torch.full((1024,), 99.0), block=False) == _C.STAGED


def test_large_payloads_start_on_a_page():
    # The writer's O_DIRECT path needs page-aligned sources: any large payload, after records of
    # any size and across wrap-arounds, starts on a page boundary; small ones are packed.
    producer, consumer = ring(capacity=8 << 20)
    gen = torch.Generator().manual_seed(0)
    for i in range(12):
        small = torch.randn(1 + 37 * i, generator=gen)
        big = torch.randn((_C.PAGE_ALIGNED_BYTES >> 2) + 13 * i, generator=gen)
        stage(producer, small)
        stage(producer, big)
        batch = consumer.next_batch(1.0, view_bytes=1)
        assert [len(rec[6]) for rec in batch] == [small.nbytes, big.nbytes]
        address = np.frombuffer(batch[1][6], dtype=np.uint8).ctypes.data
        assert address % _C.PAGE_BYTES == 0
        assert bytes(batch[0][6]) == small.numpy().tobytes() and bytes(batch[1][6]) == big.numpy().tobytes()
        consumer.release()


def test_a_page_aligned_payload_whose_gap_would_carry_it_past_the_end_wraps_to_the_start():
    """A payload of 1 MiB or more starts on a page: the gap before it counts when deciding whether
    the record fits before the end of the ring. Here it fits without the gap, 128 bytes short with
    it: it must wrap to the start (its record written past the end would overrun the mapping)."""
    producer, consumer = ring(8 << 20)  # chunks of 2 MiB
    address = lambda payload: np.frombuffer(payload, dtype=np.uint8).ctypes.data
    starts = []
    # fillers of 1 MiB - 128 B and one of 1 MiB - 384 B (no page gaps): the head at 8 MiB - 1 MiB - 256 B
    for n in [(1 << 20) - 128] * 6 + [(1 << 20) - 384]:
        assert stage(producer, torch.zeros(n // 4, dtype=torch.int32), block=False) == _C.STAGED
        rec = consumer.next(1.0)
        starts.append(address(rec[6]))
        consumer.release()
    big = torch.arange(((1 << 20) + 100) // 4, dtype=torch.int32)  # one record of 1 MiB + 100 B
    assert stage(producer, big, block=False) == _C.STAGED
    rec = consumer.next(1.0)
    assert bytes(rec[6]) == big.numpy().tobytes()
    assert address(rec[6]) % _C.PAGE_BYTES == 0
    assert starts[0] - 128 <= address(rec[6]) < starts[0] + _C.PAGE_BYTES  # wrapped: at the ring's start
    consumer.release()


def test_a_control_record_ends_a_batch_of_views():
    producer, consumer = ring()
    for i in range(3):
        stage(producer, torch.full((8,), float(i)))
    producer.put_control(0, b'{"op": "end"}')
    stage(producer, torch.full((8,), 7.0))
    first = consumer.next_batch(1.0, view_bytes=1)
    assert [rec[0] for rec in first] == [_C.KIND_TENSOR] * 3 + [_C.KIND_CONTROL]
    assert bytes(first[-1][6]) == b'{"op": "end"}'  # controls are copies, never views
    consumer.release()
    (last,) = consumer.next_batch(1.0, view_bytes=1)
    assert bytes(last[6]) == torch.full((8,), 7.0).numpy().tobytes()
    consumer.release()


def test_control_records_are_acknowledged_in_order():
    producer, consumer = ring()
    seq = producer.put_control(3, b'{"op": "x"}')
    rec = consumer.next(1)
    assert rec[0] == _C.KIND_CONTROL and rec[1] == 3 and bytes(rec[6]) == b'{"op": "x"}'
    consumer.release()
    assert not producer.wait_acked(seq, 0.05)
    consumer.ack(seq)
    assert producer.wait_acked(seq, 1)


def test_dead_producer_published_records_are_drained_then_reported():
    # The producer's liveness pipe: closing the write end is what a kill -9 does.
    r, w = os.pipe()
    producer, consumer = ring()
    consumer.set_producer_fd(r)
    stage(producer, torch.ones(4))
    os.close(w)
    assert take(consumer)[1] == torch.ones(4).numpy().tobytes()
    assert consumer.next(0.5) is None and consumer.drained


def test_a_poll_that_does_not_wait_still_sees_a_dead_producer():
    """next(0) (a look without waiting) checks the producer's pipe too: a consumer that only polls
    never sleeps, and would otherwise never learn that the producer is gone."""
    r, w = os.pipe()
    producer, consumer = ring()
    consumer.set_producer_fd(r)
    assert consumer.next(0) is None and not consumer.drained  # alive, nothing yet
    stage(producer, torch.ones(4))
    os.close(w)
    rec = consumer.next(0)
    assert bytes(rec[6]) == torch.ones(4).numpy().tobytes()
    consumer.release()
    assert consumer.next(0) is None and consumer.drained


def test_a_producer_dying_mid_copy_leaves_one_abandoned_record_after_what_it_published():
    """A real death inside a tensor's copy: the source's second page is unreadable, so the serving
    process faults (SIGSEGV) after the record was reserved. The writer drains every tensor
    published before it, then steps over the reserved record, counting it abandoned."""
    producer, consumer = ring()
    r, w = os.pipe()
    consumer.set_producer_fd(r)
    page = mmap.PAGESIZE
    buf = mmap.mmap(-1, 2 * page)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    first = torch.arange(100, dtype=torch.float32)
    pid = os.fork()
    if pid == 0:  # the serving process
        try:
            os.close(r)
            stage(producer, first, name_id=1)
            libc = ctypes.CDLL(None)
            libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            libc.mprotect(addr + page, page, 0)  # PROT_NONE
            n = 2 * page // 4
            producer.stage_host(0, 2, 0, 0, 4, (n,), (1,), addr, True)  # faults mid-copy
        finally:
            os._exit(3)  # (not reached when the copy faults)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == 11, status
    assert take(consumer)[1:] == (first.numpy().tobytes(), (1, 0))
    assert consumer.next(1.0) is None and consumer.drained
    assert consumer.abandoned == 1


def test_dead_writer_disables_a_blocked_producer():
    r, w = os.pipe()
    producer, consumer = ring(capacity=64 << 10)
    producer.set_writer_fd(r)
    t = torch.randn(4096)  # 16 KiB: the ring fills after a few
    os.close(w)  # the writer is gone
    statuses = [stage(producer, t) for _ in range(10)]
    assert statuses[-1] == _C.DISABLED
    assert producer.disabled


def test_the_pass_check_polls_the_writer_pipe_at_most_every_max_age():
    """writer_seen_alive, each pass's check: the writer's state in the ring header every time, its
    pipe (a syscall) only once the last poll that found it alive is older than max_age_s."""
    r, w = os.pipe()
    producer, consumer = ring()
    producer.set_writer_fd(r)
    assert producer.writer_alive()  # polled just now: alive
    os.close(w)  # what SIGKILL does to the writer's end
    assert producer.writer_seen_alive(3600.0)  # that poll still counts
    assert not producer.disabled
    assert not producer.writer_seen_alive(0.0)  # polled again: gone
    assert producer.disabled and not producer.writer_seen_alive(3600.0)
    os.close(r)


def test_a_writer_error_longer_than_its_place_in_the_header_is_cut_to_fit():
    """The writer's failure text has 1024 bytes in the ring header: a longer one (a traceback) is
    cut to 1023 and its NUL, never written over the header fields after it (the failed channels)."""
    producer, consumer = ring()
    consumer.set_state(_C.WRITER_FAILED, "E" * 5000)
    assert producer.writer_error() == "E" * 1023


def test_the_pass_check_sees_a_failed_writer_at_once():
    r, w = os.pipe()
    producer, consumer = ring()
    producer.set_writer_fd(r)
    assert producer.writer_alive()
    consumer.set_state(_C.WRITER_FAILED, "disk full")  # its pipe stays open: only the state says so
    assert not producer.writer_seen_alive(3600.0)
    assert producer.disabled
    os.close(w)
    os.close(r)


def test_drop_stages_a_chunked_tensor_whole_or_not_at_all():
    """No consumer (a stopped writer): under `drop` a tensor of several chunks is never half in the
    ring, and staging never waits (before: later chunks waited for the writer forever)."""
    producer, consumer = ring(1 << 20)  # chunks of 256 KiB
    # 640 KiB: 3 chunks. With one in the ring, the next one's first chunk fits but the rest do not.
    tensors = [torch.full((160 << 10,), i, dtype=torch.int32) for i in range(4)]
    statuses = []
    worker = threading.Thread(target=lambda: statuses.extend(stage(producer, t, name_id=i, block=False)
                                                             for i, t in enumerate(tensors)), daemon=True)
    worker.start()
    worker.join(10)
    if worker.is_alive():
        consumer.next(0.1)  # let the stuck call finish (and the test end)
        while worker.is_alive():
            consumer.release()
            consumer.next(0.1)
        pytest.fail("drop waited for the consumer mid-tensor")
    assert statuses == [_C.STAGED] + [_C.DROPPED] * 3
    assert producer.stats()["dropped"] == 3
    shape, data, (name_id, _) = take(consumer)
    assert name_id == 0 and data == tensors[0].numpy().tobytes()
    assert consumer.next(0.05) is None  # nothing torn left behind


def test_block_waits_at_most_its_timeout():
    producer, consumer = ring(1 << 20)
    t = torch.zeros(96 << 10, dtype=torch.int32)  # 384 KiB: two fit in the ring
    assert stage(producer, t) == _C.STAGED and stage(producer, t) == _C.STAGED
    t0 = time.monotonic()
    status = producer.stage_host(0, 0, 0, 0, 4, t.shape, t.stride(), t.data_ptr(), True, 0.3)
    assert status == _C.TIMED_OUT and time.monotonic() - t0 < 5
    assert producer.stats()["dropped"] == 1


def test_a_tensor_that_fills_the_ring_up_to_the_control_reserve_exactly_is_staged():
    """The space check counts free bytes inclusively: a record that leaves exactly the control
    reserve (capacity / 16) free is staged, one byte more is not (a strict check dropped it)."""
    producer, consumer = ring(64 << 10)  # control reserve 4 KiB; chunks of 16 KiB
    # A 1-d record is a 128-byte header plus its payload, 64-aligned: four of 15 KiB leave 4 KiB.
    quarter = [torch.arange((15 << 10) // 4 - 32, dtype=torch.int32) + i for i in range(4)]
    assert [stage(producer, t, block=False) for t in quarter] == [_C.STAGED] * 4
    assert stage(producer, torch.zeros(1, dtype=torch.int32), block=False) == _C.DROPPED
    assert [take(consumer)[1] for _ in quarter] == [t.numpy().tobytes() for t in quarter]


def test_a_tensor_the_wrap_keeps_out_is_dropped_for_space_not_called_too_large_for_the_ring():
    """Under `drop`, a chunked tensor that fits the ring whole (up to its control reserve exactly)
    but not from where the ring's head stands (a chunk would cross the end) is DROPPED, the status
    of a ring that is busy; RING_TOO_SMALL tells the user to raise ring_mb, which is not the fix."""
    producer, consumer = ring(64 << 10)  # chunks of 16 KiB, control reserve 4 KiB
    # three whole chunks and a last one: 3 * (128 + 16384) + (128 + 11776) = 60 KiB, + 4 KiB reserve
    big = torch.arange((3 * 16384 + 11776) // 4, dtype=torch.int32)
    fresh_producer, fresh_consumer = ring(64 << 10)
    assert stage(fresh_producer, big, block=False) == _C.STAGED  # from the start of an empty ring it fits
    assert take(fresh_consumer)[1] == big.numpy().tobytes()
    for i in range(2):  # move the head on (the ring stays empty): its third chunk would cross the end
        assert stage(producer, torch.full((3500,), i, dtype=torch.int32), block=False) == _C.STAGED
        take(consumer)
    assert stage(producer, big, block=False) == _C.DROPPED
    assert stage(producer, torch.cat([big, big[:1]]), block=False) == _C.RING_TOO_SMALL  # one element more


def test_control_records_up_to_max_control_bytes_are_taken_larger_ones_refused_at_once():
    producer, consumer = ring(64 << 10)
    limit = producer.max_control_bytes  # a record takes at most half the ring
    assert limit == (32 << 10) - 128
    t0 = time.monotonic()
    assert producer.put_control(0, b"x" * (limit + 1), True, 5.0) == 0  # never waited for: no room can come
    assert time.monotonic() - t0 < 2
    assert producer.put_control(0, b"y" * limit, True, 5.0) != 0
    rec = consumer.next(1.0)
    assert rec[0] == _C.KIND_CONTROL and bytes(rec[6]) == b"y" * limit


def test_producer_stats_count_records_tensors_and_bytes_once_each():
    producer, consumer = ring(1 << 20)  # chunks of 256 KiB
    small, chunked = torch.ones(100), torch.ones(100_000)  # 400 B in one record; 400,000 B in two
    assert stage(producer, small) == _C.STAGED and stage(producer, chunked) == _C.STAGED
    producer.put_control(0, b'{"op": "x"}')
    stats = producer.stats()
    assert (stats["records"], stats["tensors"], stats["bytes"]) == (4, 2, 400 + 400_000 + len(b'{"op": "x"}'))


@pytest.mark.parametrize("shape", [(0, -1), (-1,), (-1, 0), (2, -3)])
def test_a_negative_dimension_is_refused_even_beside_a_zero_one(shape):
    """A shape with a dimension of 0 holds no elements whatever its other sizes, but a negative one
    is no shape at all (HDF5 cannot store it): TOO_LARGE, and nothing reaches the ring."""
    producer, consumer = ring()
    buf = torch.zeros(8)
    status = producer.stage_host(0, 0, 0, 0, 4, shape, (1,) * len(shape), buf.data_ptr(), True)
    assert status == _C.TOO_LARGE
    assert consumer.next(0.05) is None


def test_a_broadcast_view_claiming_more_than_2_to_the_63_bytes_is_too_large_not_staged_chunk_by_chunk():
    """A stride-0 view may claim any size: one of 1.5 * 2**63 bytes (no 64-bit overflow) is refused
    as TOO_LARGE at once, under either policy, never planned nor copied chunk by chunk."""
    producer, consumer = ring()
    buf = torch.zeros(1)
    for block in (False, True):
        status = producer.stage_host(0, 0, 0, 0, 4, (3 << 60,), (0,), buf.data_ptr(), block, 0.2)
        assert status == _C.TOO_LARGE
    assert consumer.next(0.05) is None


def test_a_tensor_larger_than_the_ring_is_torn_only_once_a_chunk_went_in():
    """`block`, chunk by chunk (the tensor never fits whole): a wait that runs out before the first
    chunk leaves nothing in the ring, TIMED_OUT (dropped whole, counted); after one, TORN."""
    producer, consumer = ring(64 << 10)  # chunks of 16 KiB
    big = torch.arange(100 << 8, dtype=torch.int32)  # 100 KiB: more than the ring
    while stage(producer, torch.ones(3000), block=False) == _C.STAGED:  # the ring full, no writer
        pass
    status = producer.stage_host(0, 7, 0, 0, 4, big.shape, big.stride(), big.data_ptr(), True, 0.2)
    assert status == _C.TIMED_OUT
    while (rec := consumer.next(0.05)) is not None:  # nothing of it reached the ring
        assert rec[2] != 7
        consumer.release()
    status = producer.stage_host(0, 7, 0, 0, 4, big.shape, big.stride(), big.data_ptr(), True, 0.2)
    assert status == _C.TORN  # the empty ring took some chunks, then no one freed space


def test_drop_refuses_a_tensor_larger_than_the_ring():
    producer, consumer = ring(1 << 20)
    big = torch.zeros(1 << 20, dtype=torch.uint8)  # the whole ring
    assert stage(producer, big, block=False) == _C.RING_TOO_SMALL
    assert consumer.next(0.05) is None


def bounds(t):
    """ChannelStager.stage's storage arguments: where t's storage starts and its bytes."""
    return t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()


def test_channel_stager_stages_like_stage_host():
    """The per-Dumper entry point (pass settings set once per pass) stages the same bytes."""
    producer, consumer = ring()
    lane = _C.ChannelStager(producer, 3)
    lane.begin(7, True, 5.0)
    for t in (torch.randn(3, 5), torch.randn(4, 6).t(), torch.tensor(2.5)):
        assert lane.stage(11, 0, t.element_size(), t.shape, t.stride(), t.data_ptr(), *bounds(t)) == _C.STAGED
        kind, channel, name_id, pass_id, _dtype, shape, payload, *_ = consumer.next(1.0)
        assert (kind, channel, name_id, pass_id, tuple(shape)) == (_C.KIND_TENSOR, 3, 11, 7, tuple(t.shape))
        assert bytes(payload) == t.contiguous().numpy().tobytes()
        consumer.release()
    t = torch.randn(2, 2)
    assert lane.stage(1, 0, 4, list(t.shape), list(t.stride()), t.data_ptr(), *bounds(t)) == _C.STAGED  # lists too
    with pytest.raises(ValueError, match="length"):
        lane.stage(1, 0, 4, (2, 2), (2,), t.data_ptr(), *bounds(t))
    for shape, strides, offset in (((3, 2), (2, 1), 0), ((2, 2), (2, 1), 1), ((2, 2), (-2, 1), 0)):
        with pytest.raises(ValueError, match="storage"):  # any element outside the storage: never read
            lane.stage(1, 0, 4, shape, strides, t.data_ptr() + 4 * offset, *bounds(t))
    with pytest.raises(ValueError, match="no data"):
        lane.stage(1, 0, 4, (2, 2), (2, 1), 0, *bounds(t))
    empty = torch.empty(0)
    assert lane.stage(1, 0, 4, empty.shape, empty.stride(), empty.data_ptr(), 0, 0) == _C.STAGED  # nothing to read
    lane.begin(8, False, 0.0)
    full = torch.randn(200 << 10)  # 800 KiB of a 1 MiB ring, never consumed: `drop` drops the next
    assert lane.stage(1, 0, 4, full.shape, full.stride(), full.data_ptr(), *bounds(full)) == _C.STAGED
    assert lane.stage(1, 0, 4, full.shape, full.stride(), full.data_ptr(), *bounds(full)) == _C.DROPPED


def test_channel_stager_stage_tensor_takes_only_plain_cpu_tensors():
    """stage_tensor (the Dumper's hot path, reading the tensor in C++) stages plain CPU tensors of
    the dtypes it was given, counts them, and sends everything else back (NOT_FAST) untouched."""
    producer, consumer = ring()
    lane = _C.ChannelStager(producer, 0, {torch.float32: (7, 4)}, torch.strided)
    lane.begin(0, True, 5.0)
    t = torch.randn(6, 5)[:, 1:]
    assert lane.stage_tensor(2, t) == _C.STAGED
    kind, _ch, name_id, _pass, dtype, shape, payload, *_ = consumer.next(1.0)
    assert (name_id, dtype, tuple(shape)) == (2, 7, (6, 4)) and bytes(payload) == t.contiguous().numpy().tobytes()
    consumer.release()
    assert lane.take_counts() == (1, t.numel() * 4) and lane.take_counts() == (0, 0)
    z = torch.randn(3, dtype=torch.complex64)
    for other in (torch.randn(3, dtype=torch.float64),       # a dtype not given
                  torch.randn(4, 4).to_sparse(),             # another layout
                  z.conj().imag,                              # the lazy negation bit
                  torch.empty(3, device="meta")):             # not on the CPU
        assert lane.stage_tensor(2, other) == _C.ChannelStager.NOT_FAST, other
    assert consumer.next(0.05) is None and lane.take_counts() == (0, 0)


def test_every_staging_status_has_one_value_defined_in_the_extension():
    """One StageStatus enum in csrc/ring.h, exported under each name: the Python glue once defined
    RING_UNAVAILABLE = 7 itself, the value of TORN, so a torn CUDA tensor would have been counted as
    a device-ring failure."""
    from fastdump.staging import cuda

    names = ("STAGED", "DROPPED", "DISABLED", "TOO_LARGE", "CAPTURING", "TIMED_OUT", "TORN", "RING_TOO_SMALL",
             "RING_UNAVAILABLE")
    values = {name: getattr(_C, name) for name in names}
    assert len(set(values.values())) == len(names), values
    assert cuda.CAPTURING == _C.CAPTURING and cuda.RING_UNAVAILABLE == _C.RING_UNAVAILABLE
    assert cuda.RING_UNAVAILABLE != _C.TORN


def test_failed_channels_errors_are_taken_out_and_their_places_reused():
    """The ring header kept the error text of the first four failed channels for good: a fifth
    got none. It holds 64 at a time now, and each is taken out by its Dumper (once), its place
    then free for the next failed channel's text."""
    producer, consumer = ring()
    for channel in range(70):
        assert consumer.fail_channel(channel, f"disk {channel} full")
    texts = [producer.take_channel_error(channel) for channel in range(70)]
    assert texts == [f"disk {c} full" for c in range(64)] + [""] * 6  # no place left for the last six
    assert producer.take_channel_error(0) == ""  # taken once
    for channel in range(100, 300):  # each taken before the next fails: never out of places
        assert consumer.fail_channel(channel, f"disk {channel} full")
        assert producer.channel_failed(channel)
        assert producer.take_channel_error(channel) == f"disk {channel} full"
    long = "x" * 1000
    consumer.fail_channel(400, long)
    assert producer.take_channel_error(400) == long[:443]  # cut to its place, never past it


def test_a_failed_channels_tensors_are_refused_before_any_copy():
    """A channel the writer failed (its root's disk full) had every tensor copied into the ring
    until its Dumper's next pass start, and the writer threw them away: both staging entries of
    its lane refuse them now (DISABLED), and another channel's lane stages on."""
    from fastdump.capture.tensors import _FAST_CODES

    producer, consumer = ring()
    lanes = {channel: _C.ChannelStager(producer, channel, _FAST_CODES, torch.strided) for channel in (3, 4)}
    for lane in lanes.values():
        lane.begin(0, False, 0.0)
    t = torch.ones(4)
    code, itemsize = _FAST_CODES[torch.float32]
    storage = t.untyped_storage()
    assert lanes[3].stage_tensor(0, t) == _C.STAGED
    consumer.fail_channel(3, "disk gone (test)")
    used = producer.used_bytes()
    assert lanes[3].stage_tensor(0, t) == _C.DISABLED
    assert lanes[3].stage(0, code, itemsize, t.shape, t.stride(), t.data_ptr(), storage.data_ptr(),
                          storage.nbytes()) == _C.DISABLED
    assert producer.used_bytes() == used
    assert lanes[4].stage_tensor(0, t) == _C.STAGED and producer.used_bytes() > used
