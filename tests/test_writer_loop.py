"""The writer loop against a scripted consumer: chunk reassembly, torn tensors, failures."""

import json

import numpy as np
import pytest
import torch

import fastdump
from fastdump import _C, dtypes
from fastdump.writer.loop import WriterLoop


class ScriptedConsumer:
    """Hands out a fixed list of records, like Consumer.next_batch, then reports the producer gone."""

    capacity = 1 << 20
    holding = False  # it never takes a record itself (no fast path: every tensor goes to Python)

    def __init__(self, records):
        self.records = list(records)
        self.acked, self.state, self.drained = [], None, False
        self.failed_channels = []
        self.channel_errors = {}

    def next_batch(self, timeout_s, max_bytes=0, view_bytes=0, sinks=None):
        if not self.records:
            self.drained = True
            return []
        batch = []
        while self.records and len(batch) < 3:  # like the real one: a control ends its batch
            batch.append(self.records.pop(0))
            if batch[-1][0] == _C.KIND_CONTROL:
                break
        return batch

    def release(self):
        pass

    def ack(self, seq):
        self.acked.append(seq)

    def set_state(self, state, error):
        self.state = (state, error)

    def fail_channel(self, channel, error=""):
        if channel >= _C.FAILED_CHANNEL_IDS:
            return False
        self.failed_channels.append(channel)
        self.channel_errors[channel] = error
        return True


def control(seq, **msg):
    return (_C.KIND_CONTROL, 0, 0, -1, 0, (), json.dumps(msg).encode(), seq, 0, 0)


def tensor(name_id, pass_id, t, offset=None, part=None):
    data = t.contiguous().numpy().tobytes()
    total = len(data)
    if part is not None:
        data = data[offset:offset + part]
    code = dtypes.code_of(t.dtype)
    return (_C.KIND_TENSOR, 0, name_id, pass_id, code, tuple(t.shape), data, 0, offset or 0, total)


def test_chunks_are_reassembled_and_a_torn_tensor_is_recorded_as_skipped(tmp_path):
    whole = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    torn = torch.ones(8)
    records = [
        control(1, op="open", channel=0, dir=str(tmp_path / "target" / "TP0_PP0_Rank0_pid1"), role="target", rank={}, pid=1, host="h",
                device={}, config={"segment_passes": 8, "segment_mb": 64, "segment_seconds": 60}),
        control(2, op="name", channel=0, id=0, name="whole"),
        control(3, op="name", channel=0, id=1, name="torn"),
        control(4, op="begin", channel=0, **{"pass": 0, "meta": {}}),
        tensor(0, 0, whole, offset=0, part=16),
        tensor(1, 0, torn, offset=0, part=8),     # its second half never arrives
        tensor(0, 0, whole, offset=16, part=32),
        control(5, op="end", channel=0, **{"pass": 0, "meta": {}, "dropped": 0, "skipped": []}),
        control(6, op="shutdown"),
    ]
    consumer = ScriptedConsumer(records)
    assert WriterLoop(consumer).run() == 0
    assert consumer.acked == [1, 2, 3, 4, 5, 6]
    ds = fastdump.open(tmp_path)
    dumped = ds.load("target", "TP0_PP0_Rank0_pid1", 0)
    assert list(dumped) == ["whole"] and torch.equal(dumped["whole"], whole)
    assert ds.meta("target", "TP0_PP0_Rank0_pid1", 0)["skipped"] == [
        {"name": "torn", "reason": "incomplete tensor (staging failed mid-copy)"}]


def _one_tensor_on_a_full_disk(tmp_path, monkeypatch, channel):
    from fastdump.writer import channel_writer

    def broken(self, *args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(channel_writer.ChannelWriter, "on_tensor", broken)
    records = [
        control(1, op="open", channel=channel, dir=str(tmp_path / "target" / "TP0_PP0_Rank0_pid1"), role="target",
                rank={}, pid=1, host="h", device={},
                config={"segment_passes": 8, "segment_mb": 64, "segment_seconds": 60}),
        control(2, op="name", channel=channel, id=0, name="x"),
        (_C.KIND_TENSOR, channel, *tensor(0, 0, torch.ones(2))[2:]),
        control(3, op="shutdown"),
    ]
    consumer = ScriptedConsumer(records)
    loop = WriterLoop(consumer)
    assert loop.run() == 0
    rank = json.loads((tmp_path / "target" / "TP0_PP0_Rank0_pid1" / "rank.json").read_text())
    assert rank["status"] == "error" and "No space left" in rank["error"]
    return consumer, loop


def test_a_failing_channel_stops_dumping_there_and_tells_the_producer_which(tmp_path, monkeypatch):
    """One root's full disk fails its channel alone (the producer reads the channel's bit: its
    Dumper stops), not the writer: the other channels' Dumpers, on other roots, go on."""
    consumer, loop = _one_tensor_on_a_full_disk(tmp_path, monkeypatch, channel=3)
    assert consumer.failed_channels == [3]
    assert consumer.state == (_C.WRITER_EXITED, "") and loop.failed is None


def test_a_failing_channel_too_high_to_report_alone_stops_the_writer(tmp_path, monkeypatch):
    consumer, loop = _one_tensor_on_a_full_disk(tmp_path, monkeypatch, channel=_C.FAILED_CHANNEL_IDS)
    assert consumer.failed_channels == []
    assert consumer.state[0] == _C.WRITER_FAILED and "No space left" in consumer.state[1]
    assert "No space left" in loop.failed


def test_replay_spans_chunked_and_a_torn_one_is_forgotten(tmp_path):
    """CUDA-graph replay spans through the loop: chunks reassembled, then split into the pass. A
    span whose later chunks never come (the drain's record timed out; the replay was counted as
    dropped) is forgotten when that GPU's next span begins, and never written."""
    from fastdump import protocol

    a = torch.arange(40, dtype=torch.int32)
    name = protocol.GRAPH_SPAN_NAME_BASE + 2 * protocol.GRAPHS_PER_RECORDER  # GPU 2, graph 0
    other_gpu = protocol.GRAPH_SPAN_NAME_BASE + 5  # GPU 0, graph 5: another drain, left alone
    layout = protocol.graph(0, 2, 0, name, 512, [[0, dtypes.code_of(a.dtype), [40], 256, 160]],
                            {"cuda_graph": 0, "graph_batch": 40}, {})

    def span(pass_id, replay, values):
        head = np.array(protocol.ReplayHeader(protocol.REPLAY_MAGIC, pass_id, replay, name, 512, 0), dtype="<u8")
        body = np.zeros(512, np.uint8)
        body[:48] = np.frombuffer(head.tobytes(), np.uint8)
        body[256:416] = np.frombuffer(values.numpy().tobytes(), np.uint8)
        return body.tobytes()

    def chunk(name_id, pass_id, data, offset, size):
        return (_C.KIND_TENSOR, 0, name_id, pass_id, protocol.REPLAY_SPAN_DTYPE, (len(data),),
                data[offset:offset + size], 0, offset, len(data))

    base = protocol.GRAPH_PASS_BASE
    torn, whole = span(base, 0, a), span(base + 1, 1, a * 3)
    records = [
        control(1, op="open", channel=0, dir=str(tmp_path / "target" / "TP0_PP0_Rank0_pid1"), role="target", rank={},
                pid=1, host="h", device={}, config={"segment_passes": 8, "segment_mb": 64, "segment_seconds": 60}),
        control(2, op="name", channel=0, id=0, name="a"),
        control(3, **layout),
        chunk(other_gpu, base + 7, bytes(512), 0, 256),
        chunk(name, base, torn, 0, 256),          # its second half never arrives
        chunk(name, base + 1, whole, 0, 300),
        chunk(name, base + 1, whole, 300, 212),
    ]
    consumer = ScriptedConsumer(records)
    loop = WriterLoop(consumer)
    consumer.records.append(control(4, op="shutdown"))
    assert loop.run() == 0
    assert list(loop.partial) == [(0, other_gpu, base + 7)]
    ds = fastdump.open(tmp_path)
    assert ds.passes("target", "TP0_PP0_Rank0_pid1") == [base + 1]
    got = ds.load("target", "TP0_PP0_Rank0_pid1", base + 1)
    assert torch.equal(torch.as_tensor(got["a"]), a * 3)
    meta = ds.meta("target", "TP0_PP0_Rank0_pid1", base + 1)
    assert meta["graph_replay"] == 1 and meta["complete"]


def test_a_replay_span_whose_chunks_straddle_an_eager_pass_end_is_put_together(tmp_path):
    """A GPU's drain sends a replay span in chunks while the model thread ends an eager pass on the
    same channel: that end tears only its own pass's unfinished tensors. Taking the span's first
    chunks for torn, it recorded a skip in the eager pass and lost the replay."""
    from fastdump import protocol

    a = torch.arange(40, dtype=torch.int32)
    x = torch.full((3,), 7.0)
    name = protocol.GRAPH_SPAN_NAME_BASE  # GPU 0, graph 0
    layout = protocol.graph(0, 0, 0, name, 512, [[0, dtypes.code_of(a.dtype), [40], 256, 160]],
                            {"cuda_graph": 0, "graph_batch": 40}, {})
    base = protocol.GRAPH_PASS_BASE
    head = np.array(protocol.ReplayHeader(protocol.REPLAY_MAGIC, base, 0, name, 512, 0), dtype="<u8")
    span = np.zeros(512, np.uint8)
    span[:48] = np.frombuffer(head.tobytes(), np.uint8)
    span[256:416] = np.frombuffer(a.numpy().tobytes(), np.uint8)
    span = span.tobytes()

    def chunk(offset, size):
        return (_C.KIND_TENSOR, 0, name, base, protocol.REPLAY_SPAN_DTYPE, (512,), span[offset:offset + size], 0,
                offset, 512)

    rank = "TP0_PP0_Rank0_pid1"
    records = [
        control(1, op="open", channel=0, dir=str(tmp_path / "target" / rank), role="target", rank={}, pid=1,
                host="h", device={}, config={"segment_passes": 8, "segment_mb": 64, "segment_seconds": 60}),
        control(2, op="name", channel=0, id=0, name="a"),
        control(3, op="name", channel=0, id=1, name="x"),
        control(4, **layout),
        control(5, op="begin", channel=0, **{"pass": 0, "meta": {}}),
        tensor(1, 0, x),
        chunk(0, 300),
        control(6, op="end", channel=0, **{"pass": 0, "meta": {}, "dropped": 0, "skipped": []}),
        chunk(300, 212),
        control(7, op="shutdown"),
    ]
    loop = WriterLoop(ScriptedConsumer(records))
    assert loop.run() == 0 and loop.partial == {}
    ds = fastdump.open(tmp_path)
    assert ds.passes("target", rank) == [0, base]
    assert ds.meta("target", rank, 0)["skipped"] == [] and torch.equal(ds.load("target", rank, 0)["x"], x)
    assert torch.equal(torch.as_tensor(ds.load("target", rank, base)["a"]), a)
    assert ds.meta("target", rank, base)["complete"]


def test_a_one_byte_last_chunk_completes_its_tensor_and_a_torn_one_keeps_the_producers_reason(tmp_path):
    """A 9-byte tensor in chunks of 8 and 1 is whole only with its last byte (a mutant reading it
    whole one byte early stored a zero there and tore the last chunk); a torn tensor the producer
    already recorded as skipped keeps that one entry, with its reason."""
    odd = torch.arange(1, 10, dtype=torch.uint8)
    torn = torch.ones(8)
    rank = "TP0_PP0_Rank0_pid1"
    records = [
        control(1, op="open", channel=0, dir=str(tmp_path / "target" / rank), role="target", rank={}, pid=1, host="h",
                device={}, config={"segment_passes": 8, "segment_mb": 64, "segment_seconds": 60}),
        control(2, op="name", channel=0, id=0, name="odd"),
        control(3, op="name", channel=0, id=1, name="torn"),
        control(4, op="begin", channel=0, **{"pass": 0, "meta": {}}),
        tensor(0, 0, odd, offset=0, part=8),
        tensor(1, 0, torn, offset=0, part=8),  # its second half never arrives
        tensor(0, 0, odd, offset=8, part=1),
        control(5, op="end", channel=0, **{"pass": 0, "meta": {}, "dropped": 0,
                                           "skipped": [{"name": "torn", "reason": "the producer's reason"}]}),
        control(6, op="shutdown"),
    ]
    assert WriterLoop(ScriptedConsumer(records)).run() == 0
    ds = fastdump.open(tmp_path)
    dumped = ds.load("target", rank, 0)
    assert list(dumped) == ["odd"] and torch.equal(dumped["odd"], odd)
    assert ds.meta("target", rank, 0)["skipped"] == [{"name": "torn", "reason": "the producer's reason"}]


def test_a_pass_end_tears_only_its_own_channels_unfinished_tensors(tmp_path):
    """Two channels at the same pass id: channel 0's pass end comes while channel 1's tensor is half
    in. That tensor is channel 1's, completed by its next chunk; channel 0's pass records no skip.
    (A mutant that tore every channel's unfinished tensors of that pass id lost it and recorded
    a skip in channel 0's pass.)"""
    whole = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    mine = torch.ones(4)

    def opened(seq, channel, rank):
        return control(seq, op="open", channel=channel, dir=str(tmp_path / "target" / rank), role="target",
                       rank={}, pid=1, host="h", device={},
                       config={"segment_passes": 8, "segment_mb": 64, "segment_seconds": 60})

    def on(channel, record):
        return (record[0], channel, *record[2:])

    end = {"pass": 0, "meta": {}, "dropped": 0, "skipped": []}
    records = [
        opened(1, 0, "TP0_PP0_Rank0_pid1"), opened(2, 1, "TP0_PP0_Rank1_pid1"),
        control(3, op="name", channel=0, id=0, name="mine"),
        control(4, op="name", channel=1, id=0, name="whole"),
        control(5, op="begin", channel=0, **{"pass": 0, "meta": {}}),
        control(6, op="begin", channel=1, **{"pass": 0, "meta": {}}),
        tensor(0, 0, mine),
        on(1, tensor(0, 0, whole, offset=0, part=16)),
        control(7, op="end", channel=0, **end),
        on(1, tensor(0, 0, whole, offset=16, part=32)),
        control(8, op="end", channel=1, **end),
        control(9, op="shutdown"),
    ]
    assert WriterLoop(ScriptedConsumer(records)).run() == 0
    ds = fastdump.open(tmp_path)
    assert torch.equal(ds.load("target", "TP0_PP0_Rank0_pid1", 0)["mine"], mine)
    assert torch.equal(ds.load("target", "TP0_PP0_Rank1_pid1", 0)["whole"], whole)
    assert ds.meta("target", "TP0_PP0_Rank0_pid1", 0)["skipped"] == []
    assert ds.meta("target", "TP0_PP0_Rank1_pid1", 0)["skipped"] == []


def _open_and_name(tmp_path, *names):
    return [control(1, op="open", channel=0, dir=str(tmp_path / "target" / "TP0_PP0_Rank0_pid1"), role="target",
                    rank={}, pid=1, host="h", device={},
                    config={"segment_passes": 8, "segment_mb": 64, "segment_seconds": 60}),
            *[control(2 + i, op="name", channel=0, id=i, name=name) for i, name in enumerate(names)],
            control(9, op="begin", channel=0, **{"pass": 0, "meta": {}})]


def test_a_large_chunked_tensor_is_written_as_its_chunks_come_and_a_torn_one_leaves_no_block(tmp_path, monkeypatch):
    """A tensor staged in several records was put together whole in the writer's memory before
    its segment write (a 4 GiB activation: 4 GiB in the writer). Its chunks go into its dataset
    as they come now, never assembled: the tensor is stored bit for bit, with its CRC32C; a torn
    one (its last chunk never comes) is dropped, its dataset taken out of the segment (no block
    without index rows: verify passes), and recorded as skipped."""
    from fastdump.cli.dump import verify_dump
    from fastdump.writer import loop as loop_mod

    def no_assembly(total):
        raise AssertionError("a large tensor was put together in memory")

    monkeypatch.setattr(loop_mod, "_Assembly", no_assembly)
    big = torch.randn(1024, 512)  # 2 MiB, in 4 chunks
    torn = torch.randn(512, 512)  # 1 MiB, its last chunk never comes
    step = 512 << 10
    records = [*_open_and_name(tmp_path, "big", "torn"),
               *[tensor(0, 0, big, offset=k, part=step) for k in range(0, 2 * step, step)],
               tensor(1, 0, torn, offset=0, part=step),
               *[tensor(0, 0, big, offset=k, part=step) for k in range(2 * step, 4 * step, step)],
               control(10, op="end", channel=0, **{"pass": 0, "meta": {}, "dropped": 0, "skipped": []}),
               control(11, op="shutdown")]
    assert WriterLoop(ScriptedConsumer(records)).run() == 0
    with fastdump.open(tmp_path) as ds:
        dumped = ds.load("target", "TP0_PP0_Rank0_pid1", 0)
        assert list(dumped) == ["big"] and torch.equal(dumped["big"], big)
        assert ds.meta("target", "TP0_PP0_Rank0_pid1", 0)["skipped"] == [
            {"name": "torn", "reason": "incomplete tensor (staging failed mid-copy)"}]
    problems = verify_dump(str(tmp_path)).problems
    assert not [p for p in problems if "block" in str(p)], problems


@pytest.mark.parametrize("ended", [False, True])
def test_a_chunk_out_of_place_tears_its_streamed_tensor_and_close_tears_an_unfinished_one(tmp_path, ended):
    """A chunk that does not continue its tensor (one lost before it) must never leave a tensor
    with a hole called whole; nor may close() write the part of one whose last chunk never came.
    ``ended``: the pass's end comes first and tears what is unfinished; the tensor torn already is
    recorded once, not again at that end (a mutant that recorded it again survived)."""
    from fastdump.cli.dump import verify_dump

    gap, unfinished, kept = torch.randn(512, 512), torch.randn(512, 512), torch.randn(512, 512)
    step = 256 << 10
    records = [*_open_and_name(tmp_path, "gap", "unfinished", "kept"),
               tensor(0, 0, gap, offset=0, part=step),
               tensor(0, 0, gap, offset=2 * step, part=step),  # the second chunk never came
               tensor(0, 0, gap, offset=3 * step, part=step),
               tensor(2, 0, kept),
               tensor(1, 0, unfinished, offset=0, part=step),
               *([control(9, op="end", channel=0, **{"pass": 0, "meta": {}, "dropped": 0, "skipped": []})]
                 if ended else []),
               control(10, op="close", channel=0, stats={})]
    assert WriterLoop(ScriptedConsumer(records)).run() == 0
    with fastdump.open(tmp_path) as ds:
        dumped = ds.load("target", "TP0_PP0_Rank0_pid1", 0)
        assert list(dumped) == ["kept"] and torch.equal(dumped["kept"], kept)
        skipped = ds.meta("target", "TP0_PP0_Rank0_pid1", 0)["skipped"]
        assert sorted(entry["name"] for entry in skipped) == ["gap", "unfinished"]
        assert all(entry["reason"] == "incomplete tensor (staging failed mid-copy)" for entry in skipped)
    problems = verify_dump(str(tmp_path)).problems
    assert not [p for p in problems if "block" in str(p)], problems


def test_on_first_ack_runs_once_right_after_the_first_open_is_acked(tmp_path):
    """A writer process lowers its priority there (writer/__main__.py, settle): after the ack (an
    idle-priority thread may not run again for seconds on a busy machine: attach would wait for
    it), before the next record (tensors are the work to keep out of the model's way)."""
    rank = "TP0_PP0_Rank0_pid1"
    records = [
        control(1, op="open", channel=0, dir=str(tmp_path / "target" / rank), role="target", rank={}, pid=1,
                host="h", device={}, config={"segment_passes": 8, "segment_mb": 64, "segment_seconds": 60}),
        control(2, op="name", channel=0, id=0, name="x"),
        control(3, op="begin", channel=0, **{"pass": 0, "meta": {}}),
        tensor(0, 0, torch.arange(4.0)),
        control(4, op="end", channel=0, **{"pass": 0, "meta": {}, "dropped": 0, "skipped": []}),
        control(5, op="shutdown"),
    ]
    consumer = ScriptedConsumer(records)
    seen = []  # at each call: the seqs acked so far, the records not yet taken
    loop = WriterLoop(consumer, on_first_ack=lambda: seen.append((list(consumer.acked), len(consumer.records))))
    assert loop.run() == 0
    assert seen == [([1], len(records) - 1)]
    assert consumer.acked == [1, 2, 3, 4, 5]


def test_a_streamed_tensor_whose_last_chunk_ends_off_a_page_is_stored_whole_with_o_direct(tmp_path, o_direct_bytes):
    """Chunks come from the ring page-aligned, so the writer hands them to the disk with O_DIRECT;
    a chunk that ends off a page (a tensor's last one) goes in as its whole pages with O_DIRECT and
    its tail through the page cache. Both parts land, in place: the tensor reads back bit for bit."""
    import mmap

    from conftest import require_o_direct

    require_o_direct(tmp_path)
    big = torch.randn((3 * (512 << 10) + 300_000) // 4)  # three 512 KiB chunks and one of 300,000 bytes
    data = big.numpy().tobytes()
    step, total = 512 << 10, len(data)
    chunks = []
    for offset in range(0, total, step):
        part = data[offset:offset + step]
        page_aligned = mmap.mmap(-1, len(part))  # as a record's payload in the ring: starts on a page
        page_aligned[:] = part
        chunks.append((_C.KIND_TENSOR, 0, 0, 0, dtypes.code_of(big.dtype), tuple(big.shape),
                       memoryview(page_aligned), 0, offset, total))
    records = [*_open_and_name(tmp_path, "big"), *chunks,
               control(10, op="end", channel=0, **{"pass": 0, "meta": {}, "dropped": 0, "skipped": []}),
               control(11, op="shutdown")]
    assert WriterLoop(ScriptedConsumer(records)).run() == 0
    assert sum(o_direct_bytes) == 3 * step + (300_000 - 300_000 % 4096)  # every whole page, not the tail
    with fastdump.open(tmp_path) as ds:
        assert torch.equal(ds.load("target", "TP0_PP0_Rank0_pid1", 0)["big"], big)


def test_a_chunk_o_direct_cannot_take_goes_through_the_page_cache_and_o_direct_stays_on(tmp_path, o_direct_bytes):
    """O_DIRECT needs the source memory and the file offset on a page: a chunk off either (a copy in
    Python's memory; a chunk that starts mid-page in the file) is written through the page cache,
    and the next chunks that are on a page still go with O_DIRECT (trying one off a page failed
    with EINVAL, which turned O_DIRECT off for the rest of the segment)."""
    import mmap

    from conftest import require_o_direct

    require_o_direct(tmp_path)

    def chunked(name_id, t, step, aligned):
        data, out = t.numpy().tobytes(), []
        for offset in range(0, len(data), step):
            part = data[offset:offset + step]
            if aligned:
                page_aligned = mmap.mmap(-1, len(part))
                page_aligned[:] = part
                part = memoryview(page_aligned)
            out.append((_C.KIND_TENSOR, 0, name_id, 0, dtypes.code_of(t.dtype), tuple(t.shape), part, 0, offset,
                        len(data)))
        return out

    copied = torch.randn(3 << 17)  # 1.5 MiB from bytes: never on a page in memory
    odd = torch.randn(350_000)  # 1.4 MB in chunks of 700,000 bytes: the second starts mid-page in the file
    whole = torch.randn(1 << 19)  # 2 MiB in 512 KiB chunks, all on a page
    records = [*_open_and_name(tmp_path, "copied", "odd", "whole"),
               *chunked(0, copied, 512 << 10, aligned=False), *chunked(1, odd, 700_000, aligned=True),
               *chunked(2, whole, 512 << 10, aligned=True),
               control(10, op="end", channel=0, **{"pass": 0, "meta": {}, "dropped": 0, "skipped": []}),
               control(11, op="shutdown")]
    assert WriterLoop(ScriptedConsumer(records)).run() == 0
    assert sum(o_direct_bytes) == (700_000 - 700_000 % 4096) + (2 << 20)
    with fastdump.open(tmp_path) as ds:
        dumped = ds.load("target", "TP0_PP0_Rank0_pid1", 0, check=True)
        assert all(torch.equal(dumped[n], t) for n, t in (("copied", copied), ("odd", odd), ("whole", whole)))
