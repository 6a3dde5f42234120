"""The writer's C++ fast path (csrc/writer_rows.h): tensors whose pass and layout the channel writer
already knows are copied, CRC'd and indexed inside Consumer.next_batch; everything else goes to
Python. Whichever path a tensor takes, the dump must be the same bytes, rows and checksums."""

import itertools
import os
import threading

import numpy as np
import torch

from fastdump import _C, dtypes, protocol
from fastdump import reader
from fastdump.writer.loop import WriterLoop

_names = itertools.count()


class RingWriter:
    """A real ring with a WriterLoop in a thread, fed the way a Dumper feeds it."""

    def __init__(self, tmp_path, channels=(0,), capacity=8 << 20, **config):
        name = f"/fastdump-{os.getpid()}-fast{next(_names)}"
        self.producer = _C.Producer(name, capacity, 0)
        self.consumer = _C.Consumer(name)
        self.producer.unlink()
        self.loop = WriterLoop(self.consumer)
        self.thread = threading.Thread(target=self.loop.run, daemon=True)
        self.thread.start()
        self.ids: dict = {}
        self.dirs = {}
        for channel in channels:
            self.dirs[channel] = tmp_path / "target" / f"TP0_PP0_Rank{channel}_pid4242"  # rank = channel
            self.control(protocol.open_channel(
                channel, dir=str(self.dirs[channel]), role="target",
                rank={"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "rank": channel},
                pid=4242, session="s", host="h", device={"name": "cpu"},
                config={"segment_passes": 0, "segment_mb": 0, "segment_seconds": 0, **config}), wait=True)
        self.sinks = {channel: self.loop.sinks[channel] for channel in channels}

    def control(self, msg, wait=False):
        seq = self.producer.put_control(msg.get("channel", 0), protocol.encode(msg), True)
        assert seq
        if wait:
            assert self.producer.wait_acked(seq, 30.0)

    def tensor(self, channel, pass_id, name, t):
        key = (channel, name)
        if key not in self.ids:
            self.ids[key] = len(self.ids)
            self.control(protocol.name(channel, self.ids[key], name))
        t = t.contiguous()
        status = self.producer.stage_host(channel, self.ids[key], pass_id, dtypes.code_of(t.dtype), t.element_size(),
                                          t.shape, t.stride(), t.data_ptr(), True)
        assert status == _C.STAGED

    def close(self, stats=None):
        taken = {channel: sink.taken for channel, sink in self.sinks.items()}
        for channel in self.sinks:
            self.control(protocol.close(channel, stats or {}), wait=True)
            taken[channel] = self.sinks[channel].taken
        self.control(protocol.shutdown())
        self.thread.join(30)
        assert not self.thread.is_alive()
        return taken


def test_most_tensors_take_the_fast_path_and_the_dump_is_what_was_sent(tmp_path):
    gen = torch.Generator().manual_seed(0)
    w = RingWriter(tmp_path)
    sent = {}
    for p in range(12):
        w.control(protocol.begin(0, p))
        rows = 2 if p < 6 else 3  # the row count changes: same layout, the fast path keeps taking it
        tensors = {
            "a": torch.randn(rows, 64, generator=gen),
            "b": torch.randint(-100, 100, (4, 3, 5), generator=gen, dtype=torch.int16),
            "c": torch.tensor(float(p)),  # 0-d: a layout of its own
            "d": torch.randn(0, 7, generator=gen),  # no rows at all
            # the row shape changes at pass 8: a new layout (Python once), then fast again
            "e": torch.randn(2, 16 if p < 8 else 17, generator=gen).to(torch.bfloat16),
        }
        for name, t in tensors.items():
            w.tensor(0, p, name, t)
        sent[p] = tensors
        w.control(protocol.end(0, p, {}, 0, {}))
    taken = w.close({"passes": 12, "tensors": 60})
    # Python takes each layout's first tensor (6 layouts); every other tensor is taken in C++.
    assert taken[0] == 60 - 6
    ds = reader.open(tmp_path)
    assert ds.passes("target", 0) == list(range(12))
    for p, tensors in sent.items():
        got = ds.load("target", 0, p, check=True)  # checksums written by both paths verify
        assert set(got) == set(tensors)
        for name, t in tensors.items():
            assert got[name].dtype == t.dtype and got[name].shape == t.shape
            assert torch.equal(got[name], t), (p, name)


def test_interleaved_channels_and_passes_keep_their_rows_apart(tmp_path):
    """Two channels, their passes interleaved tensor by tensor, and a pass that resumes after
    another began: each record goes to its own channel's rows, in order."""
    gen = torch.Generator().manual_seed(1)
    w = RingWriter(tmp_path, channels=(0, 1))
    sent = {0: {}, 1: {}}
    for p in range(6):
        for channel in (0, 1):
            w.control(protocol.begin(channel, p))
        for i in range(4):
            for channel in (0, 1):
                t = torch.randn(3, 8, generator=gen) + 100 * channel
                w.tensor(channel, p, f"x{i}", t)
                sent[channel].setdefault(p, {})[f"x{i}"] = t
        for channel in (0, 1):
            w.control(protocol.end(channel, p, {}, 0, {}))
    taken = w.close()
    assert all(count > 0 for count in taken.values())
    ds = reader.open(tmp_path)
    for channel in (0, 1):
        for p, tensors in sent[channel].items():
            got = ds.load("target", channel, p, check=True)
            assert list(got) == list(tensors)
            for name, t in tensors.items():
                assert torch.equal(got[name], t), (channel, p, name)


def test_a_failed_channel_takes_nothing_more(tmp_path):
    w = RingWriter(tmp_path)
    w.control(protocol.begin(0, 0))
    w.tensor(0, 0, "x", torch.ones(2, 2))
    w.control(protocol.end(0, 0, {}, 0, {}), wait=True)
    sink = w.sinks[0]
    writer = w.loop.channels[0]
    writer.fail("disk gone (test)")
    assert not sink.accepting and sink.tensors == 0 and sink.nbytes == 0
    before = sink.taken
    w.control(protocol.begin(0, 1))
    w.tensor(0, 1, "x", torch.ones(2, 2))
    w.control(protocol.end(0, 1, {}, 0, {}), wait=True)
    assert sink.taken == before
    w.close()


def test_a_name_whose_dtype_changes_keeps_each_passs_dtype(tmp_path):
    """One name, one row shape, the same bytes per row, three dtypes over the passes: each is a
    layout of its own (a record of one must never land in another's block, where its bytes would
    read back as the other dtype with every checksum matching)."""
    w = RingWriter(tmp_path)
    sent = {}
    for p in range(6):
        w.control(protocol.begin(0, p))
        dtype = (torch.float32, torch.int32, torch.float32, torch.int32, torch.uint8, torch.uint8)[p]
        t = (torch.arange(8, dtype=torch.int32) * (p + 1) + 1000).to(dtype).reshape(2, 4)
        if dtype is torch.uint8:
            t = torch.arange(32, dtype=torch.uint8).reshape(2, 16)  # 16 bytes a row, as the others
        w.tensor(0, p, "x", t)
        sent[p] = t
        w.control(protocol.end(0, p, {}, 0, {}))
    taken = w.close({"passes": 6, "tensors": 6})
    ds = reader.open(tmp_path)
    for p, t in sent.items():
        got = ds.load("target", 0, p, check=True)["x"]
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), (p, got, t)
    assert taken[0] == 3  # each dtype's second pass, in C++


def test_a_tensor_of_1_mib_or_more_is_left_to_python_to_write_from_the_ring(tmp_path, o_direct_bytes):
    """The fast path copies small tensors into row pages; one of 1 MiB or more (_C.PAGE_ALIGNED_BYTES)
    starts on a page in the ring and is written from there with O_DIRECT, never copied, even when
    its layout is one the sink knows."""
    from conftest import require_o_direct

    require_o_direct(tmp_path)
    w = RingWriter(tmp_path)
    small, big = torch.randn(1, 1024), torch.randn(_C.PAGE_ALIGNED_BYTES // 4096, 1024)  # 4 KiB and 1 MiB rows
    w.control(protocol.begin(0, 0))
    w.tensor(0, 0, "x", small)  # the layout (x, float32, (1024,)) learnt from Python
    w.tensor(0, 0, "y", small)
    w.control(protocol.end(0, 0, {}, 0, {}))
    w.control(protocol.begin(0, 1))
    w.tensor(0, 1, "x", big)  # same layout, 1 MiB
    w.tensor(0, 1, "y", small)  # taken by the sink
    w.control(protocol.end(0, 1, {}, 0, {}))
    taken = w.close({"passes": 2, "tensors": 4})
    assert taken[0] == 1
    assert sum(o_direct_bytes) >= big.numel() * 4
    ds = reader.open(tmp_path)
    assert torch.equal(ds.load("target", 0, 1, check=True)["x"], big)


def test_a_record_whose_bytes_disagree_with_its_known_layout_is_never_put_in_its_block(tmp_path):
    """The layout fixes the bytes of a row; a record of that name, dtype and row shape carrying
    another number of bytes (a staging bug: the element size given wrong) is not appended to the
    block, where every later row would be read shifted: Python gets it and records it."""
    from fastdump.cli.dump import verify_dump

    w = RingWriter(tmp_path)
    t = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    w.control(protocol.begin(0, 0))
    w.tensor(0, 0, "x", t)
    w.control(protocol.end(0, 0, {}, 0, {}, sent=1))
    w.control(protocol.begin(0, 1))
    code = dtypes.code_of(torch.float32)
    status = w.producer.stage_host(0, w.ids[(0, "x")], 1, code, 2, t.shape, t.stride(), t.data_ptr(), True)
    assert status == _C.STAGED  # 16 bytes where the layout says 32
    w.tensor(0, 1, "z", t)
    w.control(protocol.end(0, 1, {}, 0, {}, sent=2))  # both staged: the bad record is the writer's own skip
    w.close({"passes": 2, "tensors": 3})
    ds = reader.open(tmp_path)
    assert torch.equal(ds.load("target", 0, 0, check=True)["x"], t)
    second = ds.load("target", 0, 1, check=True)
    assert "x" not in second and torch.equal(second["z"], t)
    assert ds.meta("target", 0, 1)["skipped"] == [{"name": "x", "reason": f"bad record: dtype code {code}, shape [2, 4], "
                                                                   "16 bytes"}]
    assert not verify_dump(str(tmp_path), read_data=True).problems
