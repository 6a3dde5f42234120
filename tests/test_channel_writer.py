"""ChannelWriter (writer side) driven with synthetic ring events, read back with fastdump.reader."""

import json
import os
import re
import subprocess
import sys
import time
import warnings

import h5py
import numpy as np
import pytest
import torch

from fastdump import _C, dtypes, fsutil, reader
from fastdump import format as fmt
from fastdump.writer import segment_file
from fastdump.writer.channel_writer import ChannelWriter
from conftest import read_rank_json, require_o_direct, write_rank_dir, write_rank_json

RANK_DIR = "TP0_PP0_Rank0_pid4242"


def open_msg(root, role="target", rank_dir=RANK_DIR, **config):
    return {
        "op": "open", "channel": 0, "dir": str(root / role / rank_dir), "role": role,
        "rank": {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "dp_rank": 0, "dp_size": 1,
                 "ep_rank": 0, "ep_size": 1, "rank": 0},
        "pid": 4242, "host": "testhost", "device": {"name": "cpu"},
        "config": {"segment_passes": 0, "segment_mb": 0, "segment_seconds": 0, "policy": "block", **config},
    }


class Feeder:
    """Sends torch tensors to a ChannelWriter the way the ring loop does (interned names, raw bytes)."""

    def __init__(self, writer):
        self.writer = writer
        self.ids = {}

    def tensor(self, pass_id, name, t):
        if name not in self.ids:
            self.ids[name] = len(self.ids)
            self.writer.on_name(self.ids[name], name)
        t = t.contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().copy()
        self.writer.on_tensor(self.ids[name], pass_id, dtypes.code_of(t.dtype), tuple(t.shape), data)

    def full_pass(self, pass_id, tensors, meta=None, end_meta=None, dropped=0, skipped=()):
        self.writer.on_begin(pass_id, meta or {})
        for name, t in tensors.items():
            self.tensor(pass_id, name, t)
        self.writer.on_end(pass_id, end_meta or {}, dropped, list(skipped), sent=len(tensors))


def bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same(got, want, what=""):
    assert got.dtype == want.dtype, what
    assert got.shape == want.shape, what
    assert torch.equal(bits(got), bits(want)), what


def random_tensor(name, shape, gen):
    """Every bit pattern the dtype can hold (NaN payloads, -0.0, subnormals, ...)."""
    dtype = getattr(torch, name)
    count = int(np.prod(shape))
    if name == "bool":
        return torch.randint(0, 2, shape, generator=gen).bool()
    raw = torch.randint(0, 256, (count * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def rank_json(root, role="target"):
    """rank.json, its segment list under "segments" (segments.jsonl's from format 5)."""
    return read_rank_json(root / role / RANK_DIR)


def seg_files(root, role="target"):
    return sorted(p.name for p in (root / role / RANK_DIR).iterdir() if p.name.startswith("seg-"))


# ---------------------------------------------------------------------------------------- dtypes


def test_every_dtype_round_trips_bit_exact(tmp_path):
    gen = torch.Generator().manual_seed(0)
    w = ChannelWriter(open_msg(tmp_path))
    f = Feeder(w)
    sent = {}
    for p in range(3):  # several passes: the aggregated block holds rows of every pass
        sent[p] = {}
        for name in dtypes.NAMES:
            sent[p][name] = random_tensor(name, (p + 1, 4, 3), gen)
            sent[p][name + ".scalar"] = random_tensor(name, (), gen)
        f.full_pass(p, sent[p])
    w.close({})
    ds = reader.open(tmp_path)
    for p in range(3):
        got = ds.load("target", 0, p)
        assert list(got) == list(sent[p])
        for name, t in sent[p].items():
            assert_same(got[name], t, (p, name))
    # Each block carries its torch dtype and encoding; raw-bit types are stored as unsigned ints.
    path = tmp_path / "target" / RANK_DIR / "seg-000000.h5"
    with h5py.File(path, "r") as h5:
        seen = set()
        for ds_ in h5["blocks"].values():
            name = ds_.attrs["dtype"]
            seen.add(name)
            assert ds_.attrs["encoding"] == dtypes.encoding(name)
            assert ds_.dtype == dtypes.storage_dtype(name)
        assert seen == set(dtypes.NAMES)


@pytest.mark.parametrize("name,patterns", [
    ("float32", [0x80000000, 0x00000001, 0x007FFFFF, 0x7FC00001, 0xFFBFFFFF, 0x7F800001, 0x7F800000, 0xFF800000]),
    ("float64", [0x8000000000000000, 0x0000000000000001, 0x7FF8000000000123, 0xFFF0000000000001,
                 0x7FF0000000000000]),
    ("float16", [0x8000, 0x0001, 0x03FF, 0x7E01, 0xFC01, 0x7C01, 0x7C00]),
    ("bfloat16", [0x8000, 0x0001, 0x007F, 0x7FC1, 0xFF81, 0x7F81, 0x7F80]),
])
def test_special_float_bits_survive(tmp_path, name, patterns):
    dtype = getattr(torch, name)
    container = {2: np.uint16, 4: np.uint32, 8: np.uint64}[dtype.itemsize]
    t = torch.from_numpy(np.array(patterns, dtype=container).view(np.uint8).copy()).view(dtype)
    c = torch.complex(t.float(), -t.float()) if name == "float32" else None
    w = ChannelWriter(open_msg(tmp_path))
    f = Feeder(w)
    tensors = {"x": t, "x0d": t[3].clone()}
    if c is not None:
        tensors["complex"] = c
    f.full_pass(0, tensors)
    w.close({})
    got = reader.open(tmp_path).load("target", 0, 0)
    for key, want in tensors.items():
        assert_same(got[key], want, key)


# ---------------------------------------------------------------------------------------- shapes


def test_awkward_shapes(tmp_path):
    shapes = {
        "scalar": (), "empty_rows": (0, 4), "empty_inner": (4, 0), "empty_1d": (0,), "vector": (7,),
        "high_rank": (2, 1, 3, 1, 2, 2), "one_row": (1, 5),
    }
    gen = torch.Generator().manual_seed(1)
    w = ChannelWriter(open_msg(tmp_path))
    f = Feeder(w)
    sent = []
    for p in range(2):
        tensors = {name: random_tensor("float32", shape, gen) for name, shape in shapes.items()}
        sent.append(tensors)
        f.full_pass(p, tensors)
    w.close({})
    ds = reader.open(tmp_path)
    for p in range(2):
        got = ds.load("target", 0, p)
        for name, want in sent[p].items():
            assert_same(got[name], want, (p, name))
    series = ds.series("target", 0, "scalar")
    assert list(series) == [0, 1] and all(t.shape == () for t in series.values())


def test_rows_of_one_name_are_one_dataset(tmp_path):
    w = ChannelWriter(open_msg(tmp_path))
    f = Feeder(w)
    rows = [1, 3, 2, 5]
    sent = {p: torch.randn(n, 16) for p, n in enumerate(rows)}
    for p, t in sent.items():
        f.full_pass(p, {"model.layers.0.mlp": t, "scalar": torch.tensor(float(p))})
    w.close({})
    with h5py.File(tmp_path / "target" / RANK_DIR / "seg-000000.h5", "r") as h5:
        assert len(h5["blocks"]) == 2  # one dataset per name, not per tensor
        index = h5["index"][()]
        mlp = index[index["name"] == json.loads(h5["names"][()]).index("model.layers.0.mlp")]
        block = h5["blocks"][str(mlp["block"][0])]
        assert block.shape == (sum(rows), 16)
        assert mlp["first_row"].tolist() == [0, 1, 4, 6] and mlp["rows"].tolist() == rows
        assert mlp["pass"].tolist() == [0, 1, 2, 3]
        np.testing.assert_array_equal(block[()], torch.cat(list(sent.values())).numpy())
    for p, t in sent.items():
        assert_same(reader.open(tmp_path).tensor("target", 0, "model.layers.0.mlp", p), t)


def test_gathered_write_survives_short_writes_and_many_buffers(tmp_path, monkeypatch):
    # A block of more rows than one pwritev may take (IOV_MAX), written by a pwritev that stops
    # after at most 1000 bytes, mid-buffer: every byte still lands in its place.
    monkeypatch.setenv("FASTDUMP_NO_DIRECT_IO", "1")  # buffered: short writes of any length are legal
    real_pwritev = os.pwritev
    calls = []

    def short_pwritev(fd, buffers, offset):
        calls.append(len(buffers))
        budget, cut = 1000, []
        for b in buffers:
            b = memoryview(b)[:budget]
            cut.append(b)
            budget -= b.nbytes
            if budget == 0:
                break
        return real_pwritev(fd, cut, offset)

    monkeypatch.setattr(segment_file.os, "pwritev", short_pwritev)
    rows = 2 * segment_file._IOV_MAX + 7
    sent = {p: torch.arange(p * 37, p * 37 + 37, dtype=torch.int16).reshape(1, 37) for p in range(rows)}
    w = ChannelWriter(open_msg(tmp_path))
    f = Feeder(w)
    for p, t in sent.items():
        f.full_pass(p, {"x": t})
    w.close({})
    assert max(calls) <= segment_file._IOV_MAX and len(calls) > rows * 74 // 1000
    ds = reader.open(tmp_path)
    for p in (0, 1, segment_file._IOV_MAX, rows - 1):
        assert_same(ds.tensor("target", 0, "x", p), sent[p])
    with h5py.File(tmp_path / "target" / RANK_DIR / "seg-000000.h5", "r") as h5:
        (block,) = h5["blocks"].values()
        np.testing.assert_array_equal(block[()], torch.cat(list(sent.values())).numpy())


def test_trailing_shape_and_dtype_changes_inside_a_segment(tmp_path):
    w = ChannelWriter(open_msg(tmp_path))
    f = Feeder(w)
    sent = {
        0: torch.randn(2, 8),  # prefill-like
        1: torch.randn(1, 8),
        2: torch.randn(1, 3, 8),  # trailing shape changes
        3: torch.randn(1, 8).to(torch.bfloat16),  # dtype changes
        4: torch.tensor(5.0),  # 0-d among 1-row tensors
        5: torch.randn(3),  # 1-d: same trailing shape () as the 0-d one, but not 0-d
        6: torch.randn(4, 8),
    }
    for p, t in sent.items():
        f.full_pass(p, {"h": t})
    w.close({})
    ds = reader.open(tmp_path)
    for p, t in sent.items():
        assert_same(ds.load("target", 0, p)["h"], t, p)
    series = ds.series("target", 0, "h")
    assert list(series) == list(sent)
    for p, t in sent.items():
        assert_same(series[p], t, p)
    with h5py.File(tmp_path / "target" / RANK_DIR / "seg-000000.h5", "r") as h5:
        assert len(h5["blocks"]) == 5  # (·,8) f32, (·,3,8) f32, (·,8) bf16, 0-d f32, (·) f32


# ---------------------------------------------------------------------------------------- rotation


def test_rotation_by_passes(tmp_path):
    w = ChannelWriter(open_msg(tmp_path, segment_passes=3))
    f = Feeder(w)
    sent = {p: torch.full((2, 2), float(p)) for p in range(8)}
    for p, t in sent.items():
        f.full_pass(p, {"x": t})
        # a segment is written on the pass boundary that completes it, not later
        assert len(seg_files(tmp_path)) == (p + 1) // 3
    w.close({})
    assert seg_files(tmp_path) == ["seg-000000.h5", "seg-000001.h5", "seg-000002.h5"]
    info = rank_json(tmp_path)
    spans = [(s["first_pass"], s["last_pass"], s["passes"]) for s in info["segments"]]
    assert spans == [(0, 2, 3), (3, 5, 3), (6, 7, 2)]
    assert info["passes"] == 8 and info["tensors"] == 8 and info["bytes"] == 8 * 16
    ds = reader.open(tmp_path)
    assert ds.passes("target", 0) == list(range(8))
    for p, t in sent.items():
        assert_same(ds.load("target", 0, p)["x"], t)


def test_many_segments_read_in_any_order(tmp_path):
    w = ChannelWriter(open_msg(tmp_path, segment_passes=1))
    f = Feeder(w)
    sent = {p: torch.full((p % 3 + 1, 2), float(p)) for p in range(40)}  # more files than the reader keeps open
    for p, t in sent.items():
        f.full_pass(p, {"x": t, "y": t.double()})
    w.close({})
    with reader.open(tmp_path) as ds:
        for p in reversed(range(40)):
            got = ds.load("target", 0, p)
            assert_same(got["x"], sent[p])
            assert_same(got["y"], sent[p].double())
        series = ds.series("target", 0, "y")
        assert list(series) == list(range(40))
        for p, t in series.items():
            assert_same(t, sent[p].double())


def test_rotation_by_bytes(tmp_path):
    w = ChannelWriter(open_msg(tmp_path, segment_mb=1))
    f = Feeder(w)
    for p in range(5):
        f.full_pass(p, {"a": torch.zeros(300, 256), "b": torch.zeros(10)})  # ~300 KiB per pass
    w.close({})
    segments = rank_json(tmp_path)["segments"]
    assert [s["passes"] for s in segments] == [4, 1]  # 4 passes cross 1 MiB
    assert segments[0]["bytes"] >= 1 << 20


def test_rotation_by_seconds_in_poll_and_at_pass_end(tmp_path):
    w = ChannelWriter(open_msg(tmp_path, segment_seconds=30))
    f = Feeder(w)
    f.full_pass(0, {"x": torch.ones(1)})
    w.poll(time.monotonic())
    assert seg_files(tmp_path) == []  # not old enough
    w.poll(time.monotonic() + 31)
    assert seg_files(tmp_path) == ["seg-000000.h5"]  # idle data is not held forever

    # A pass still open when the age is reached is not split: the segment waits for its end.
    w.on_begin(1, {})
    f.tensor(1, "x", torch.ones(1))
    w.poll(time.monotonic() + 100)
    assert seg_files(tmp_path) == ["seg-000000.h5"]
    w.on_end(1, {}, 0, [])
    assert seg_files(tmp_path) == ["seg-000000.h5"]  # the new segment's clock started with pass 1
    w.close({})
    assert len(seg_files(tmp_path)) == 2


def test_pass_that_never_ends_is_flushed_when_far_over_the_limits(tmp_path):
    w = ChannelWriter(open_msg(tmp_path, segment_mb=1))
    f = Feeder(w)
    w.on_begin(0, {"mode": "prefill"})
    chunks = [torch.full((256, 256), float(i)) for i in range(24)]  # 256 KiB each, 6 MiB in all
    for i, t in enumerate(chunks[:12]):
        f.tensor(0, f"t{i}", t)
    w.poll(time.monotonic())
    assert seg_files(tmp_path) == []  # 3 MiB: over the limit, but a pass is not split lightly
    for i, t in enumerate(chunks[12:18], start=12):
        f.tensor(0, f"t{i}", t)
    w.poll(time.monotonic())
    assert seg_files(tmp_path) == ["seg-000000.h5"]  # 4.5 MiB > 4x the limit: memory is bounded
    for i, t in enumerate(chunks[18:], start=18):
        f.tensor(0, f"t{i}", t)
    w.on_end(0, {"tokens": 7}, 0, [], sent=24)  # (its count on the last part: verify adds up both)
    w.close({})
    segments = rank_json(tmp_path)["segments"]
    assert [(s["first_pass"], s["last_pass"], s["complete"]) for s in segments] == [(0, 0, False), (0, 0, True)]
    ds = reader.open(tmp_path)
    assert ds.passes("target", 0) == [0]
    got = ds.load("target", 0, 0)  # the two parts are merged, in dump order
    assert list(got) == [f"t{i}" for i in range(24)]
    for i, t in enumerate(chunks):
        assert_same(got[f"t{i}"], t)
    meta = ds.meta("target", 0, 0)
    assert meta["complete"] is True and meta["mode"] == "prefill" and meta["tokens"] == 7 and meta["tensors"] == 24
    from fastdump.cli.dump import verify_dump
    assert verify_dump(str(tmp_path)).problems == []


def split_pass_dump(root):
    """Pass 0 flushed unfinished twice (parts in seg-000000..2), pass 1 whole in seg-000003."""
    w = ChannelWriter(open_msg(root, segment_mb=1))
    f = Feeder(w)
    w.on_begin(0, {})
    chunks = [torch.full((256, 256), float(i)) for i in range(40)]  # 256 KiB each
    for i, t in enumerate(chunks):
        f.tensor(0, f"t{i}", t)
        if i in (17, 35):
            w.poll(time.monotonic())  # over 4x the limit: the part so far is written
    w.on_end(0, {}, 0, [])
    f.full_pass(1, {"x": torch.ones(2)})
    w.close({})
    assert [(s["first_pass"], s["complete"]) for s in rank_json(root)["segments"]] == \
        [(0, False), (0, False), (0, True), (1, True)]
    return chunks


@pytest.mark.parametrize("damage", ["swapped", "missing", "truncated", "truncated first"])
def test_a_pass_whose_part_is_not_read_is_refused_not_returned_short_or_reordered(tmp_path, damage):
    """A pass the writer split over segments is merged in file-number order. Two of its parts'
    files swapped by hand were merged in the wrong order (verify failed, load did not); one part
    missing or unreadable left a pass with tensors missing, `complete` and no error."""
    chunks = split_pass_dump(tmp_path)
    rank = tmp_path / "target" / RANK_DIR
    name = {"swapped": "seg-000000.h5", "missing": "seg-000001.h5", "truncated": "seg-000001.h5",
            "truncated first": "seg-000000.h5"}[damage]
    if damage == "swapped":
        os.rename(rank / "seg-000000.h5", rank / "x")
        os.rename(rank / "seg-000001.h5", rank / "seg-000000.h5")
        os.rename(rank / "x", rank / "seg-000001.h5")
    elif damage == "missing":
        os.remove(rank / name)
    else:
        os.truncate(rank / name, 5000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(reader.DumpError, match=f"pass 0: part of it may be in .*{name}.*: not read"):
            reader.open(tmp_path).load("target", 0, 0)  # the lookup of one pass, as the full index below
        ds = reader.open(tmp_path)
        assert ds.passes("target", 0) == [0, 1]
        with pytest.raises(reader.DumpError, match=f"pass 0: part of it may be in .*{name}.*: not read"):
            ds.load("target", 0, 0)
        with pytest.raises(reader.DumpError, match="pass 0: part of it may be in"):
            ds.meta("target", 0, 0)
        assert list(ds.series("target", 0, "t39")) == []
        assert_same(ds.load("target", 0, 1)["x"], torch.ones(2))
        if damage == "swapped":
            with pytest.raises(reader.DumpError, match=r"seg-000000.h5 \(written as segment 1: renamed\)"):
                ds.load("target", 0, 0)
    intact = tmp_path / "intact"
    split_pass_dump(intact)
    got = reader.open(intact).load("target", 0, 0)
    assert list(got) == [f"t{i}" for i in range(40)]
    for i, t in enumerate(chunks):
        assert_same(got[f"t{i}"], t)


@pytest.mark.parametrize("lost", ["seg-000000.h5", "seg-000002.h5"])
@pytest.mark.parametrize("damage", ["truncated", "removed"])
def test_a_pass_next_to_an_unreadable_unlisted_segment_is_refused(tmp_path, lost, damage):
    """A writer killed between renaming segments and updating rank.json leaves them unlisted (a
    full disk leaves rank.json without its list): an unreadable or removed one has no known pass
    range. Pass 0's first part in such a file (seg 0) loaded as its later parts alone, with no
    error; so did pass 0 with its last part in one (seg 2: the part read ends unfinished). Pass 1
    begins seg 3: after a lost seg 2 it may have begun there too; after a readable one it reads."""
    split_pass_dump(tmp_path)
    rank = tmp_path / "target" / RANK_DIR
    info = rank_json(tmp_path)
    info["segments"] = info["segments"][3:]  # as if the writer never listed seg 0..2
    write_rank_json(rank, info)
    if damage == "truncated":
        os.truncate(rank / lost, 5000)
    else:
        os.remove(rank / lost)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for full_index in (False, True):  # the lookup of one pass; the rank's whole index
            ds = reader.open(tmp_path)
            if full_index:
                assert ds.passes("target", 0) == [0, 1]
            with pytest.raises(reader.DumpError, match=f"pass 0: part of it may be in {lost} "):
                ds.load("target", 0, 0)
            with pytest.raises(reader.DumpError, match="pass 0: part of it may be in"):
                ds.meta("target", 0, 0)
            if lost == "seg-000002.h5":
                with pytest.raises(reader.DumpError, match="pass 1: part of it may be in seg-000002.h5 "):
                    ds.load("target", 0, 1)
            else:
                assert_same(ds.load("target", 0, 1)["x"], torch.ones(2))
            assert list(ds.series("target", 0, "t39")) == []


@pytest.mark.parametrize("lie", ["first part", "middle part", "last part"])
def test_a_pass_found_without_the_full_index_is_whole_even_where_rank_json_lies(tmp_path, lie):
    """Loading one pass reads only the segments whose range in rank.json holds it (and the files
    either side). rank.json giving a part's file another range must not hand the pass back short:
    the file read next to the parts shows the lie, and the full index merges every part."""
    chunks = split_pass_dump(tmp_path)
    rank = tmp_path / "target" / RANK_DIR
    info = rank_json(tmp_path)
    k = {"first part": 0, "middle part": 1, "last part": 2}[lie]
    info["segments"][k].update(first_pass=7, last_pass=7)
    write_rank_json(rank, info)
    ds = reader.open(tmp_path)
    got = ds.load("target", 0, 0)
    assert list(got) == [f"t{i}" for i in range(40)]
    for i, t in enumerate(chunks):
        assert_same(got[f"t{i}"], t)
    assert reader.open(tmp_path).meta("target", 0, 0)["tensors"] == 40
    assert_same(reader.open(tmp_path).load("target", 0, 1)["x"], torch.ones(2))
    with pytest.raises(KeyError):
        reader.open(tmp_path).load("target", 0, 7)


@pytest.mark.parametrize("listing", ["unlisted", "listed with another range"])
def test_a_pass_whose_middle_file_is_gone_is_refused_by_the_lookup_of_one_pass(tmp_path, listing):
    """Pass 0's parts are in seg-000000 and seg-000002; seg-000001 (its middle part) is gone and
    rank.json sends the lookup of one pass to files 0 and 2 only (seg 1 unlisted, or listed as
    holding pass 7). The two visible files are next to each other in the listing but their numbers
    are not: merged, they would hand back pass 0 without t18..t35, `complete`, and no error."""
    split_pass_dump(tmp_path)
    rank = tmp_path / "target" / RANK_DIR
    info = rank_json(tmp_path)
    if listing == "unlisted":
        del info["segments"][1]
    else:
        info["segments"][1].update(first_pass=7, last_pass=7)
    write_rank_json(rank, info)
    os.remove(rank / "seg-000001.h5")
    want = "pass 0: part of it may be in seg-000001.h5 (unreadable, missing or renamed): not read"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(reader.DumpError, match=re.escape(want)):
            reader.open(tmp_path).load("target", 0, 0)
        with pytest.raises(reader.DumpError, match=re.escape(want)):
            reader.open(tmp_path).meta("target", 0, 0)
        with pytest.raises(reader.DumpError, match=re.escape(want)):
            reader.open(tmp_path).tensor("target", 0, "t0", 0)
        assert_same(reader.open(tmp_path).load("target", 0, 1)["x"], torch.ones(2))


def test_a_lost_later_segment_whose_range_spans_an_earlier_replay_does_not_hide_it(tmp_path):
    """Eager passes and CUDA-graph replays share segments: seg 0 holds 0, 1, B, B+1, seg 1 holds
    2, 3, B+2, B+3, so seg 1's listed range 2..B+3 spans replay B+1 though it cannot hold it
    (replays run in file order, and B+1 ended in seg 0). seg 1 lost, B+1 is still whole: it loads,
    while passes seg 1 held are refused."""
    from fastdump import protocol

    base = protocol.GRAPH_PASS_BASE
    order = [0, 1, base, base + 1, 2, 3, base + 2, base + 3]
    rank = write_rank_dir(tmp_path / "target" / RANK_DIR, {p: {"x": torch.full((2,), float(k))}
                                                            for k, p in enumerate(order)}, segment_passes=4)
    assert [(s["first_pass"], s["last_pass"]) for s in rank_json(tmp_path)["segments"]] == [(0, base + 1), (2, base + 3)]
    os.remove(rank / "seg-000001.h5")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for full_index in (False, True):
            ds = reader.open(tmp_path)
            if full_index:
                assert ds.passes("target", 0) == [0, 1, base, base + 1]
            for k, p in enumerate(order[:4]):
                assert_same(ds.load("target", 0, p)["x"], torch.full((2,), float(k)))
            with pytest.raises(reader.DumpError, match="seg-000001.h5"):
                ds.load("target", 0, base + 2)


def test_a_pass_in_a_listed_segment_that_is_gone_is_lost_not_absent(tmp_path):
    """seg 1, listed as holding passes 2..3, is gone. The reader said KeyError "no pass 3", listed
    no problem, and ls/passes showed the rank as if it had only passes 0 and 1."""
    rank = write_rank_dir(tmp_path / "target" / RANK_DIR, {p: {"x": torch.full((2,), float(p))} for p in range(4)})
    os.remove(rank / "seg-000001.h5")
    want = f"{rank / 'seg-000001.h5'}: listed as holding passes 2..3, but missing"
    with pytest.warns(UserWarning, match=re.escape(want)):
        ds = reader.open(tmp_path)
        assert ds.passes("target", 0) == [0, 1]
    assert ds.problems == [want] and ds.summary("target", 0)["unreadable_segments"] == 1
    for p in (2, 3):
        with pytest.raises(reader.DumpError, match=re.escape(f"no pass {p} in the readable segments of {rank}; "
                                                             f"unreadable: {want}")):
            ds.load("target", 0, p)
    assert_same(ds.load("target", 0, 1)["x"], torch.full((2,), 1.0))


def test_only_the_first_pass_after_an_unreadable_unlisted_segment_is_refused(tmp_path):
    """seg 0 (passes 0, 1) is unlisted and truncated: it may hold the start of seg 1's first pass
    (2), never a part of pass 3, which began after pass 2 in seg 1. Pass 3 reads, bit-exact."""
    rank = write_rank_dir(tmp_path / "target" / RANK_DIR, {p: {"x": torch.full((2,), float(p))} for p in range(4)})
    info = rank_json(tmp_path)
    info["segments"] = info["segments"][1:]
    write_rank_json(rank, info)
    os.truncate(rank / "seg-000000.h5", 5000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for full_index in (False, True):
            ds = reader.open(tmp_path)
            if full_index:
                assert ds.passes("target", 0) == [2, 3]
            with pytest.raises(reader.DumpError, match="pass 2: part of it may be in seg-000000.h5 "):
                ds.load("target", 0, 2)
            assert_same(ds.load("target", 0, 3)["x"], torch.full((2,), 3.0))


def test_a_late_pass_end_completes_its_pass_only_where_the_segments_stay_in_order(tmp_path):
    """A pass end the full ring refused comes again after later records (protocol.end, late=True).
    It completes a pass still buffered, or continues the pass the last segment ended unfinished;
    elsewhere it would put a pass in two segments out of order, so it is left out and counted."""
    from fastdump.cli.dump import verify_dump
    w = ChannelWriter(open_msg(tmp_path, segment_passes=2, segment_mb=1))
    f = Feeder(w)
    # Pass 0's end comes after pass 1: the segment still holds pass 0.
    w.on_begin(0, {})
    f.tensor(0, "x", torch.full((2,), 0.0))
    f.full_pass(1, {"x": torch.full((2,), 1.0)})
    w.on_end(0, {"step": 0}, 3, [{"name": "q", "reason": "quantized tensor"}], late=True, sent=1)
    # Pass 2 is flushed unfinished, as the last pass of its segment (4.5 MiB > 4x segment_mb).
    w.on_begin(2, {})
    big = [torch.full((256, 256), float(i)) for i in range(18)]
    for i, t in enumerate(big):
        f.tensor(2, f"t{i}", t)
    w.poll(time.monotonic())
    assert [s["last_pass"] for s in rank_json(tmp_path)["segments"]] == [1, 2]
    w.on_begin(3, {})
    f.tensor(3, "x", torch.full((2,), 3.0))
    w.on_end(2, {"step": 2}, 4, [], late=True, sent=18)  # continues pass 2 in the next segment
    w.on_end(3, {}, 0, [], sent=1)
    # Pass 4 is flushed unfinished with later passes behind it (8 passes, 4x segment_passes).
    w.on_begin(4, {})
    f.tensor(4, "x", torch.full((2,), 4.0))
    for p in range(5, 12):
        f.full_pass(p, {"x": torch.full((2,), float(p))})
    assert rank_json(tmp_path)["segments"][-1]["last_pass"] == 11
    w.on_end(4, {"step": 4}, 5, [], late=True, sent=1)  # would overlap the segment with passes 5..11
    f.full_pass(12, {"x": torch.full((2,), 12.0)})
    w.close({"dropped": 12})
    ds = reader.open(tmp_path)
    assert ds.passes("target", 0) == list(range(13))
    meta = {p: ds.meta("target", 0, p) for p in range(13)}
    assert meta[0]["complete"] and meta[0]["step"] == 0 and meta[0]["dropped"] == 3
    assert [s["name"] for s in meta[0]["skipped"]] == ["q"]
    assert meta[2]["complete"] and meta[2]["step"] == 2 and meta[2]["dropped"] == 4 and meta[2]["tensors"] == 18
    assert list(ds.load("target", 0, 2)) == [f"t{i}" for i in range(18)]
    assert not meta[4]["complete"] and "step" not in meta[4] and meta[4]["dropped"] == 0
    assert all(meta[p]["complete"] for p in range(13) if p != 4)
    assert rank_json(tmp_path)["late_pass_ends_left_out"] == 1
    problems = verify_dump(str(tmp_path)).problems
    assert len(problems) == 2, problems  # the drops (policy block), and the end left out; no overlap
    assert any("1 pass end(s) never reached the writer in time" in str(p) for p in problems), problems


def test_a_late_pass_end_sent_again_after_its_pass_was_written_is_taken_once(tmp_path):
    """A late end is sent again when Ctrl-C lands between its send and its removal from the
    Dumper's list (Dumper._send_late_ends: the KeyboardInterrupt is raised as control() returns).
    The copy reached the writer after the segment holding the pass, completed by the first, was
    written: it was counted as an end left out (rank.json late_pass_ends_left_out), and `verify`
    failed a whole dump under `block`, saying an end never reached the writer. It is a copy."""
    from fastdump.cli.dump import verify_dump
    w = ChannelWriter(open_msg(tmp_path, segment_passes=2))
    f = Feeder(w)
    w.on_begin(0, {})
    f.tensor(0, "x", torch.full((2,), 0.0))
    f.full_pass(1, {"x": torch.full((2,), 1.0)})
    w.on_end(0, {"step": 0}, 0, [], late=True, sent=1)  # completes pass 0: both ended, the segment is written
    assert [s["last_pass"] for s in rank_json(tmp_path)["segments"]] == [1]
    w.on_end(0, {"step": 0}, 0, [], late=True, sent=1)  # the same end again
    f.full_pass(2, {"x": torch.full((2,), 2.0)})
    w.close({})
    assert "late_pass_ends_left_out" not in rank_json(tmp_path)
    ds = reader.open(tmp_path)
    assert ds.passes("target", 0) == [0, 1, 2] and all(ds.meta("target", 0, p)["complete"] for p in range(3))
    assert verify_dump(str(tmp_path)).problems == []


def test_a_pass_that_ends_twice_on_disk_fails_verify_and_is_not_read(tmp_path):
    """A second (not late) end of a pass already written: no Dumper path sends one (an end that
    Ctrl-C cut short is not sent again, Dumper._end_interrupted; late copies are ignored, above),
    but were one to come, the writer would store the pass again, ended, in a later segment: verify
    fails it and the reader refuses to merge it, so no pass is read as two."""
    from fastdump.cli.dump import verify_dump
    w = ChannelWriter(open_msg(tmp_path, segment_passes=1))
    f = Feeder(w)
    f.full_pass(0, {"x": torch.full((2,), 0.0)})
    f.full_pass(1, {"x": torch.full((2,), 1.0)})
    w.on_end(0, {}, 0, [], sent=1)
    w.close({})
    assert [(s["first_pass"], s["last_pass"]) for s in rank_json(tmp_path)["segments"]] == [(0, 0), (1, 1), (0, 0)]
    problems = verify_dump(str(tmp_path)).problems
    assert problems == [f"{tmp_path / 'target' / RANK_DIR}: seg-000002.h5 passes 0..0 overlap seg-000001.h5 "
                        "passes 1..1"], problems
    ds = reader.open(tmp_path)
    with pytest.raises(reader.DumpError):
        ds.load("target", 0, 0)


# ---------------------------------------------------------------------------------------- names & metadata


def test_names_with_any_character(tmp_path):
    names = ["model.layers.0.self_attn/q_proj", "a#1", "ünïcødé.层", "", "/", "..", "a/b/../c", "nul\x00byte",
             "line\nbreak", "x" * 2000, "blocks/0", "index", "\udcff lone surrogate"]
    w = ChannelWriter(open_msg(tmp_path))
    f = Feeder(w)
    sent = {name: torch.full((2,), float(i)) for i, name in enumerate(names)}
    f.full_pass(0, sent)
    w.close({})
    ds = reader.open(tmp_path)
    got = ds.load("target", 0, 0)
    assert list(got) == names
    for name, t in sent.items():
        assert_same(got[name], t, name)
    assert ds.names("target", 0) == names
    assert_same(ds.tensor("target", 0, "nul\x00byte", 0), sent["nul\x00byte"])


def test_pass_metadata_dropped_and_skipped(tmp_path):
    w = ChannelWriter(open_msg(tmp_path))
    f = Feeder(w)
    f.full_pass(0, {"x": torch.ones(2)}, meta={"forward_mode": "prefill", "input_ids": [1, 2, 3], "batch_size": 1},
                end_meta={"tokens": 3}, dropped=2,
                skipped=[{"name": "q", "reason": "quantized tensor"}, {"name": "r", "reason": "quantized tensor"}])
    w.on_begin(1, {"forward_mode": "decode"})
    w.on_end(1, {}, 0, [])  # a pass with no tensors keeps its metadata
    f.tensor(2, "x", torch.ones(2))  # tensors without a begin: tolerated
    w.on_end(2, {"forward_mode": "decode"}, 0, [])
    w.on_note({"status": "running", "error": None})
    w.close({"dropped": 5, "dropped_passes": 1, "tensors_staged": 3})  # the keys of Dumper.stats()
    ds = reader.open(tmp_path)
    assert ds.passes("target", 0) == [0, 1, 2]
    meta0 = ds.meta("target", 0, 0)
    assert meta0["forward_mode"] == "prefill" and meta0["input_ids"] == [1, 2, 3] and meta0["tokens"] == 3
    assert meta0["dropped"] == 2 and meta0["complete"] is True and meta0["tensors"] == 1
    assert [s["name"] for s in meta0["skipped"]] == ["q", "r"]
    assert ds.meta("target", 0, 1)["forward_mode"] == "decode" and ds.load("target", 0, 1) == {}
    assert_same(ds.load("target", 0, 2)["x"], torch.ones(2))
    info = ds.rank_info("target", 0)
    assert info["status"] == "closed" and info["error"] is None
    assert info["dropped"] == 5 and info["skipped"] == 2 and info["skipped_reasons"] == {"quantized tensor": 2}
    assert info["dropped_passes"] == 1
    assert info["passes"] == 3 and info["tensors"] == 2 and info["bytes"] == 16
    assert info["role"] == "target" and info["rank"]["tp_size"] == 1 and info["pid"] == 4242
    assert info["host"] == "testhost" and info["device"] == {"name": "cpu"} and info["config"]["policy"] == "block"
    assert info["stats"]["tensors_staged"] == 3
    assert [s["file"] for s in rank_json(tmp_path)["segments"]] == ["seg-000000.h5"]


def test_skipped_reasons_stay_bounded_when_every_pass_has_a_new_one(tmp_path):
    """skipped_reasons took one key per distinct reason: reasons carrying an exception's text (a
    request id) made rank.json grow by one key a pass for as long as the server ran."""
    from fastdump.writer.channel_writer import MAX_SKIP_REASONS, OTHER_SKIP_REASONS

    w = ChannelWriter(open_msg(tmp_path, segment_passes=50))
    f = Feeder(w)
    for p in range(200):
        f.full_pass(p, {"x": torch.ones(1)}, skipped=[{"name": "h", "reason": f"convert raised: request {p}"}])
    w.close({})
    info = rank_json(tmp_path)
    reasons = info["skipped_reasons"]
    assert info["skipped"] == 200 and sum(reasons.values()) == 200
    assert len(reasons) == MAX_SKIP_REASONS + 1 and reasons[OTHER_SKIP_REASONS] == 200 - MAX_SKIP_REASONS
    assert reader.open(tmp_path).meta("target", 0, 199)["skipped"] == [{"name": "h", "reason": "convert raised: request 199"}]


def test_rank_json_costs_no_more_to_write_as_segments_accumulate(tmp_path, monkeypatch):
    """rank.json listed every segment and was rewritten whole (fsynced) after each one: bytes
    written grew as N^2 over a run (4000 one-pass segments: 20 s of writing; 8000: minutes). From
    format 5 each segment appends one line to segments.jsonl and rank.json keeps only the totals
    and the committed count, so each of its writes is as large after 80 segments as after 1."""
    real, written = fsutil.atomic_write_bytes, []

    def recording(path, data, **kwargs):
        if path.endswith(fmt.RANK_FILE):
            written.append(len(data))
        return real(path, data, **kwargs)

    monkeypatch.setattr(fsutil, "atomic_write_bytes", recording)
    w = ChannelWriter(open_msg(tmp_path, segment_passes=1))
    f = Feeder(w)
    for p in range(80):
        f.full_pass(p, {"x": torch.full((1,), float(p))})
        w.poll()
    w.close({})
    directory = tmp_path / "target" / RANK_DIR
    text = (directory / "rank.json").read_text()
    info = json.loads(text)
    assert text == json.dumps(info, indent=2, ensure_ascii=False) + "\n"  # the layout it always had
    assert "segments" not in info and info["format_version"] == 6
    lines = (directory / fmt.SEGMENT_LIST_FILE).read_bytes()
    assert info[fmt.LIST_COUNT] == 80 and info[fmt.LIST_BYTES] == len(lines) and info[fmt.LIST_CRC] == _C.crc32c(lines)
    listed = rank_json(tmp_path)["segments"]
    assert [s["file"] for s in listed] == [f"seg-{p:06d}.h5" for p in range(80)]
    assert [(s["first_pass"], s["last_pass"], s["passes"], s["tensors"], s["bytes"], s["complete"]) for s in listed] \
        == [(p, p, 1, 1, 4, True) for p in range(80)]
    # (before: each write ~170 bytes longer than the last, 13 KiB more at the 80th)
    assert max(written) - written[1] < 64, written
    ds = reader.open(tmp_path)
    assert_same(ds.load("target", 0, 79)["x"], torch.full((1,), 79.0))


def test_unfinished_pass_at_close_is_marked_incomplete(tmp_path):
    w = ChannelWriter(open_msg(tmp_path))
    f = Feeder(w)
    f.full_pass(0, {"x": torch.ones(3)})
    w.on_begin(1, {"forward_mode": "decode"})
    f.tensor(1, "x", torch.full((3,), 2.0))
    w.close({}, status="incomplete")  # the producer died mid-pass
    ds = reader.open(tmp_path)
    assert ds.meta("target", 0, 0)["complete"] is True
    meta1 = ds.meta("target", 0, 1)
    assert meta1["complete"] is False and meta1["forward_mode"] == "decode"
    assert_same(ds.load("target", 0, 1)["x"], torch.full((3,), 2.0))
    assert ds.rank_info("target", 0)["status"] == "incomplete"


def test_rank_json_written_at_open_and_after_each_segment(tmp_path):
    w = ChannelWriter(open_msg(tmp_path, segment_passes=1))
    info = rank_json(tmp_path)
    assert info["status"] == "running" and info["segments"] == [] and info["passes"] == 0
    Feeder(w).full_pass(0, {"x": torch.ones(1)})
    info = rank_json(tmp_path)
    assert info["status"] == "running" and [s["file"] for s in info["segments"]] == ["seg-000000.h5"]
    w.on_note({"status": "running", "dropped": 7})
    assert rank_json(tmp_path)["dropped"] == 7
    w.close({})
    assert rank_json(tmp_path)["status"] == "closed"


def test_bad_record_is_skipped_not_stored(tmp_path):
    w = ChannelWriter(open_msg(tmp_path))
    w.on_name(0, "short")
    w.on_name(1, "ok")
    w.on_tensor(0, 0, dtypes.CODE_BY_NAME["float32"], (4,), np.zeros(12, np.uint8))  # 12 bytes for 16
    w.on_tensor(1, 0, 999, (1,), np.zeros(1, np.uint8))  # unknown dtype code
    w.on_tensor(1, 0, dtypes.CODE_BY_NAME["int64"], (1,), np.zeros(8, np.uint8))
    w.on_end(0, {}, 0, [])
    w.close({})
    ds = reader.open(tmp_path)
    assert list(ds.load("target", 0, 0)) == ["ok"]
    assert [s["name"] for s in ds.meta("target", 0, 0)["skipped"]] == ["short", "ok"]


def test_repeated_name_in_a_pass_is_kept(tmp_path):
    w = ChannelWriter(open_msg(tmp_path))
    f = Feeder(w)
    w.on_begin(0, {})
    f.tensor(0, "x", torch.ones(1))
    f.tensor(0, "x", torch.zeros(1))  # the capture layer prevents this; if it happens, lose nothing
    w.on_end(0, {}, 0, [])
    w.close({})
    got = reader.open(tmp_path).load("target", 0, 0)
    assert list(got) == ["x", "x#dup1"]
    assert_same(got["x#dup1"], torch.zeros(1))


def test_segment_numbers_continue_after_existing_files(tmp_path):
    w = ChannelWriter(open_msg(tmp_path))
    Feeder(w).full_pass(0, {"x": torch.ones(1)})
    w.close({})
    (tmp_path / "target" / RANK_DIR / ".seg-000003.h5.tmp").write_bytes(b"junk")
    w = ChannelWriter(open_msg(tmp_path))
    Feeder(w).full_pass(1, {"x": torch.ones(1)})
    w.close({})
    assert seg_files(tmp_path) == ["seg-000000.h5", "seg-000004.h5"]


def test_a_writer_reopening_a_directory_starts_its_segment_list_anew(tmp_path):
    """The second writer's segments.jsonl holds its own line only: the first one's longer list
    left under it would read as bytes after the committed lines (a torn append: verify fails a
    closed rank on it)."""
    from fastdump import segment_list

    w = ChannelWriter(open_msg(tmp_path, segment_passes=1))
    for p in range(3):
        Feeder(w).full_pass(p, {"x": torch.ones(1)})
    w.close({})
    w = ChannelWriter(open_msg(tmp_path))
    Feeder(w).full_pass(3, {"x": torch.ones(1)})
    w.close({})
    rank = tmp_path / "target" / RANK_DIR
    entries, problem, tail = segment_list.read(str(rank), json.loads((rank / fmt.RANK_FILE).read_text()))
    assert problem is None and tail == 0
    assert [(e["file"], e["first_pass"], e["last_pass"]) for e in entries] == [("seg-000003.h5", 3, 3)]
    assert (rank / fmt.SEGMENT_LIST_FILE).read_bytes().count(b"\n") == 1


# ---------------------------------------------------------------------------------------- atomicity & errors


def test_a_segments_root_attributes_keep_their_types(tmp_path):
    """docs/FORMAT.md: ``created`` is a float Unix time, the counts are integers, ``complete`` 0/1,
    ``role`` a string: a float stored as an integer lost the time's fraction without a word."""
    t0 = time.time()
    w = ChannelWriter(open_msg(tmp_path))
    Feeder(w).full_pass(0, {"x": torch.ones(4)})
    w.close({})
    t1 = time.time()
    with h5py.File(tmp_path / "target" / RANK_DIR / fmt.segment_name(0), "r") as h5:
        attrs = dict(h5.attrs)
    assert attrs["created"].dtype == np.float64 and t0 <= attrs["created"] <= t1
    assert {k: (attrs[k].dtype, int(attrs[k])) for k in ("first_pass", "last_pass", "passes", "tensors", "complete")} \
        == {"first_pass": (np.int64, 0), "last_pass": (np.int64, 0), "passes": (np.int64, 1),
            "tensors": (np.int64, 1), "complete": (np.int64, 1)}
    assert attrs["role"] == "target" and attrs["segment"] == 0


def test_segment_is_invisible_until_complete(tmp_path, monkeypatch):
    seen = []
    real_publish = segment_file.fsutil.publish

    def checking_publish(tmp, final):
        directory = os.path.dirname(final)
        seen.append(sorted(os.listdir(directory)))
        assert not os.path.exists(final)
        with h5py.File(tmp, "r") as h5:  # the temporary file is already a complete, closed HDF5 file
            assert h5.attrs["format"] == fmt.FORMAT_NAME
        real_publish(tmp, final)

    monkeypatch.setattr(segment_file.fsutil, "publish", checking_publish)
    w = ChannelWriter(open_msg(tmp_path))
    Feeder(w).full_pass(0, {"x": torch.ones(4)})
    w.close({})
    # reserve: see test_integrity_disk
    assert seen == [[".rank.json.reserve", ".seg-000000.h5.tmp", "rank.json", "segments.jsonl"]]
    assert sorted(os.listdir(tmp_path / "target" / RANK_DIR)) == ["rank.json", "seg-000000.h5", "segments.jsonl"]


def test_write_error_midway_leaves_no_segment_and_records_error(tmp_path, monkeypatch):
    w = ChannelWriter(open_msg(tmp_path, segment_passes=1))
    f = Feeder(w)
    f.full_pass(0, {"a": torch.ones(4), "b": torch.ones(4)})  # one good segment first
    real_write_block = segment_file.OpenSegment.write_block
    calls = []

    def failing_write_block(segment, block):
        calls.append(block.number)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real_write_block(segment, block)

    monkeypatch.setattr(segment_file.OpenSegment, "write_block", failing_write_block)
    w.on_begin(1, {})
    f.tensor(1, "a", torch.ones(4))
    f.tensor(1, "b", torch.ones(4))
    with pytest.raises(OSError, match="No space left"):
        w.on_end(1, {}, 0, [])
    directory = tmp_path / "target" / RANK_DIR
    # no temp file left, no bad segment
    assert sorted(os.listdir(directory)) == ["rank.json", "seg-000000.h5", "segments.jsonl"]
    info = rank_json(tmp_path)
    assert info["status"] == "error" and "No space left" in info["error"]
    assert w.failed
    # From now on nothing is written and nothing raises; the loop may still call us.
    f.full_pass(2, {"a": torch.ones(4)})
    w.poll(time.monotonic() + 1e6)
    w.fail("second failure")
    w.close({})
    assert sorted(os.listdir(directory)) == ["rank.json", "seg-000000.h5", "segments.jsonl"]
    info = rank_json(tmp_path)
    assert info["status"] == "error" and "No space left" in info["error"]
    ds = reader.open(tmp_path)
    assert ds.passes("target", 0) == [0]


def test_a_block_write_failing_on_an_io_thread_fails_the_segment(tmp_path, monkeypatch):
    """Block rows are written by the I/O threads; a write that fails there (EIO, a full disk) must
    fail the segment as one in the writer's own thread does: published, it would read back the
    file's zeros under CRCs that only verify --data checks."""
    import errno

    w = ChannelWriter(open_msg(tmp_path, segment_passes=1))
    f = Feeder(w)
    f.full_pass(0, {"a": torch.ones(4)})

    def failing_pwritev_all(fd, buffers, offset):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(segment_file, "_pwritev_all", failing_pwritev_all)
    with pytest.raises(OSError, match="Input/output error"):
        f.full_pass(1, {"a": torch.full((4,), 2.0)})
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path / "target" / RANK_DIR)) == ["rank.json", "seg-000000.h5", "segments.jsonl"]
    info = rank_json(tmp_path)
    assert info["status"] == "error" and "Input/output error" in info["error"] and info["segments_listed"] == 1
    assert reader.open(tmp_path).passes("target", 0) == [0]


def test_an_o_direct_write_failing_with_eio_fails_the_segment_not_retried_through_the_page_cache(tmp_path,
                                                                                                   monkeypatch):
    """Only EINVAL (a device that wants a larger alignment) sends a block's O_DIRECT write through
    the page cache instead; an I/O error of the device is the segment's failure, as any other
    write's: retried buffered, the pages could reach the same failing disk later, unseen."""
    import errno
    import fcntl

    require_o_direct(tmp_path)
    real = segment_file._pwritev_all

    def failing_direct_writes(fd, buffers, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buffers, offset)

    w = ChannelWriter(open_msg(tmp_path, segment_passes=1))
    monkeypatch.setattr(segment_file, "_pwritev_all", failing_direct_writes)
    with pytest.raises(OSError, match="Input/output error"):
        Feeder(w).full_pass(0, {"a": torch.ones(4096)})  # 16 KiB: whole pages, written with O_DIRECT
    monkeypatch.undo()
    assert rank_json(tmp_path)["status"] == "error"
    assert not [n for n in os.listdir(tmp_path / "target" / RANK_DIR) if n.startswith("seg-")]


def test_an_hdf5_file_that_fails_after_creating_its_temporary_file_leaves_nothing_behind(tmp_path, monkeypatch):
    """HDF5 may create the segment's temporary file and then fail (a disk that fills as it writes
    the superblock): OpenSegment removes that file, so no .seg-*.tmp is left in the rank directory."""
    real_file = segment_file.h5py.File

    def create_then_fail(path, *args, **kwargs):
        real_file(path, "w").close()
        raise OSError("Unable to create file (No space left on device)")

    monkeypatch.setattr(segment_file.h5py, "File", create_then_fail)
    with pytest.raises(OSError, match="No space left"):
        segment_file.OpenSegment(str(tmp_path), 3)
    assert os.listdir(tmp_path) == []


def test_h5py_open_failure_is_reported(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("Unable to create file (disk quota exceeded)")

    w = ChannelWriter(open_msg(tmp_path))
    Feeder(w).full_pass(0, {"x": torch.ones(1)})
    monkeypatch.setattr(segment_file.h5py, "File", refuse)
    with pytest.raises(OSError):
        w.close({})
    info = rank_json(tmp_path)
    assert info["status"] == "error" and "quota" in info["error"]
    assert seg_files(tmp_path) == []


def test_fail_never_raises_even_without_a_directory(tmp_path):
    w = ChannelWriter(open_msg(tmp_path))
    directory = tmp_path / "target" / RANK_DIR
    for entry in directory.iterdir():
        entry.unlink()
    directory.rmdir()
    w.fail("writer lost its directory")  # rank.json cannot be written: still no exception
    assert w.error == "writer lost its directory"


def test_unwritable_directory_raises_at_open(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    msg = open_msg(tmp_path)
    msg["dir"] = str(blocker / "target" / RANK_DIR)
    with pytest.raises(OSError):
        ChannelWriter(msg)


def test_writer_does_not_import_torch():
    code = ("import sys, fastdump.writer.channel_writer, fastdump.writer.segment_file; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))


# ---------------------------------------------------------------------------------------- reader details


def test_loading_a_pass_reads_only_its_rows(tmp_path, monkeypatch):
    w = ChannelWriter(open_msg(tmp_path))
    f = Feeder(w)
    for p in range(10):
        f.full_pass(p, {"x": torch.full((p + 1, 4), float(p))})
    w.close({})
    ds = reader.open(tmp_path)
    ds.passes("target", 0)  # index loaded
    reads, preadv_bytes = [], []  # rows asked for; bytes read from the file for them
    real_read_rows, real_preadv, real_getitem = reader.read_block_rows, os.preadv, h5py.Dataset.__getitem__

    def recording_read_rows(fd, blocks_id, number, offset, row_shape, storage, first, count, where):
        reads.append(slice(first, first + count))
        return real_read_rows(fd, blocks_id, number, offset, row_shape, storage, first, count, where)

    def recording_preadv(fd, buffers, at):
        done = real_preadv(fd, buffers, at)
        preadv_bytes.append(done)
        return done

    def recording_getitem(self, key):  # (a block read through HDF5 instead: counted as a read too)
        if self.name.startswith("/blocks/"):
            reads.append(key)
        return real_getitem(self, key)

    monkeypatch.setattr(reader, "read_block_rows", recording_read_rows)
    monkeypatch.setattr(os, "preadv", recording_preadv)
    monkeypatch.setattr(h5py.Dataset, "__getitem__", recording_getitem)
    got = ds.load("target", 0, 6)["x"]
    assert_same(got, torch.full((7, 4), 6.0))
    first_row = sum(range(1, 7))
    assert reads == [slice(first_row, first_row + 7)]
    assert sum(preadv_bytes) == 7 * 4 * 4  # its 7 rows of 4 float32s, no more


def test_reader_ignores_temp_files_and_tolerates_rank_selection(tmp_path):
    for rank_dir in ("TP0_PP0_Rank0_pid1", "TP1_PP0_Rank1_pid2", "TP0_PP0_Rank10_pid3"):
        msg = open_msg(tmp_path, rank_dir=rank_dir)
        tp, pp, rank = fmt.parse_rank_dir(rank_dir)[:3]  # (rank.json says what the name says, as a run's does)
        msg["rank"].update(tp_rank=tp, pp_rank=pp, rank=rank, tp_size=11)
        w = ChannelWriter(msg)
        Feeder(w).full_pass(0, {"x": torch.ones(1)})
        w.close({})
    (tmp_path / "target" / "TP0_PP0_Rank0_pid1" / ".seg-000001.h5.tmp").write_bytes(b"partial")
    ds = reader.open(tmp_path)
    assert ds.roles == ["target"]
    assert ds.ranks() == ["TP0_PP0_Rank0_pid1", "TP1_PP0_Rank1_pid2", "TP0_PP0_Rank10_pid3"]
    assert ds.segments(None, 0) == [str(tmp_path / "target" / "TP0_PP0_Rank0_pid1" / "seg-000000.h5")]
    assert ds.passes(None, 10) == [0]
    assert ds.passes("target", "TP1_PP0_Rank1_pid2") == [0]
    with pytest.raises(KeyError):
        ds.passes("target", 5)
    with pytest.raises(ValueError):
        ds.passes("target")  # three ranks: must say which
    with pytest.raises(KeyError):
        ds.load("target", 0, 99)


# ---------------------------------------------------------------------------------------- page buffers, O_DIRECT

from fastdump.writer import pages  # noqa: E402


def _address(view):
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


def test_page_buffer_keeps_the_stream_and_splits_it_for_o_direct():
    gen = np.random.default_rng(0)
    pool = pages.PagePool()
    buf = pages.PageBuffer(pool)
    # every length and alignment the streaming copy handles (head, 64-byte body, tail; under 256 bytes: memcpy)
    sent = [gen.integers(0, 256, n, dtype=np.uint8) for n in (0, 1, 4095, 4097, 20000, 300_000, 7, 255, 256, 13, 2 << 20)]
    for chunk in sent:
        buf.append(chunk)
        buf.append(memoryview(chunk.tobytes()))  # bytes and read-only views too
    want = b"".join(c.tobytes() * 2 for c in sent)
    assert buf.nbytes == len(want)
    assert b"".join(bytes(v) for v in buf.views()) == want
    body, tail = buf.split_aligned()
    assert all(v.nbytes % pages.ALIGN == 0 and _address(v) % pages.ALIGN == 0 for v in body)
    assert b"".join(bytes(v) for v in body) + (bytes(tail) if tail is not None else b"") == want
    assert (tail.nbytes if tail is not None else 0) == len(want) % pages.ALIGN
    assert all(p.nbytes <= pages.MAX_PAGE for p in buf.pages) and len(buf.pages) < 20
    allocated = pool.allocated
    buf.free()
    again = pages.PageBuffer(pool)
    for chunk in sent:
        again.append(chunk)
        again.append(chunk)
    assert pool.allocated == allocated  # the second round reuses the pages: no new memory, no faults


def _write_odd_rows(tmp_path, direct):
    """Rows of sizes that leave every kind of tail; returns (sent, O_DIRECT bytes per segment)."""
    gen = torch.Generator().manual_seed(3)
    w = ChannelWriter(open_msg(tmp_path, segment_passes=3))
    f = Feeder(w)
    sent = {}
    for p in range(7):
        sent[p] = {"odd": torch.randint(0, 1 << 30, (p + 1, 1031), generator=gen, dtype=torch.int32),
                   "page": torch.randn(4, 1024, generator=gen), "tiny": torch.tensor([p], dtype=torch.int8),
                   "big": torch.randn(70_000, generator=gen)}
        f.full_pass(p, sent[p])
    w.close({})
    ds = reader.open(tmp_path)
    for p, tensors in sent.items():
        got = ds.load("target", 0, p)
        for name, t in tensors.items():
            assert_same(got[name], t, f"{name} pass {p}")
    assert subprocess.run([sys.executable, "-m", "fastdump.cli", "verify", str(tmp_path)],
                          capture_output=True).returncode == 0
    return sent, direct


def test_buffered_rows_reach_the_disk_with_o_direct(tmp_path, monkeypatch, o_direct_bytes):
    require_o_direct(tmp_path)
    monkeypatch.delenv("FASTDUMP_NO_DIRECT_IO", raising=False)
    _, direct = _write_odd_rows(tmp_path, o_direct_bytes)
    assert len(direct) == 3 and all(n > 0 for n in direct)


def test_without_o_direct_every_write_is_buffered(tmp_path, monkeypatch, o_direct_bytes):
    monkeypatch.setenv("FASTDUMP_NO_DIRECT_IO", "1")
    _, direct = _write_odd_rows(tmp_path, o_direct_bytes)
    assert direct == [0, 0, 0]


@pytest.mark.parametrize("value", ["0", "false", "off"])
def test_no_direct_io_set_to_a_false_value_keeps_o_direct(tmp_path, monkeypatch, o_direct_bytes, value):
    """FASTDUMP_NO_DIRECT_IO=0 was read as set: every segment went through the page cache."""
    require_o_direct(tmp_path)
    monkeypatch.setenv("FASTDUMP_NO_DIRECT_IO", value)
    _, direct = _write_odd_rows(tmp_path, o_direct_bytes)
    assert len(direct) == 3 and all(n > 0 for n in direct)


def test_a_device_that_refuses_the_alignment_falls_back_to_buffered(tmp_path, monkeypatch, o_direct_bytes):
    require_o_direct(tmp_path)
    import errno
    import fcntl

    real_pwritev = os.pwritev

    def einval_for_direct(fd, buffers, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwritev(fd, buffers, offset)

    monkeypatch.setattr(segment_file.os, "pwritev", einval_for_direct)
    _, direct = _write_odd_rows(tmp_path, o_direct_bytes)
    assert direct == [0, 0, 0]


def _replay_span(layout: dict, pass_id: int, replay: int, tensors: list, magic=None) -> np.ndarray:
    """A replay span record as the GPU leaves it: header, then each tensor at its offset."""
    from fastdump import protocol

    span = np.zeros(layout["span_bytes"], dtype=np.uint8)
    header = protocol.ReplayHeader(protocol.REPLAY_MAGIC if magic is None else magic, pass_id, replay,
                                   layout["span_name_id"], layout["span_bytes"], layout["graph"])
    span[:48] = np.frombuffer(np.array(header, dtype="<u8").tobytes(), np.uint8)
    for (_, _, _, offset, nbytes), t in zip(layout["tensors"], tensors):
        span[offset:offset + nbytes] = bits(t).numpy()
    return span


def test_replay_span_is_split_into_its_pass_and_a_bad_one_is_never_written(tmp_path):
    """The writer side of CUDA-graph record mode: a ``graph`` message, then one span record per
    replay, split into the pass's tensors with the meta protocol.replay_pass builds. A span whose
    header does not match its record (wrong magic, pass or size) or whose layout never came is an
    incomplete pass with no tensors, never a pass of wrong data; drains' drop notes reach rank.json
    while running, and the Dumper's total (which includes them) at close."""
    from fastdump import protocol

    w = ChannelWriter(open_msg(tmp_path))
    w.on_name(0, "a")
    w.on_name(1, "b")
    a, b = torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.tensor([7, -8], dtype=torch.int16)
    span_name = protocol.GRAPH_SPAN_NAME_BASE + 1
    layout = protocol.graph(0, 0, 1, span_name, 256 + 256 + 256,
                            [[0, dtypes.code_of(a.dtype), [2, 3], 256, 24], [1, dtypes.code_of(b.dtype), [2], 512, 4]],
                            {"graph": "decode_bs2", "cuda_graph": 1, "graph_batch": 2}, {"c": "too large"})
    w.on_graph(layout)
    base = protocol.GRAPH_PASS_BASE
    good = _replay_span(layout, base, 0, [a, b])
    w.on_tensor(span_name, base, protocol.REPLAY_SPAN_DTYPE, (len(good),), good)
    bad_magic = _replay_span(layout, base + 1, 1, [a, b], magic=1)
    w.on_tensor(span_name, base + 1, protocol.REPLAY_SPAN_DTYPE, (len(bad_magic),), bad_magic)
    wrong_pass = _replay_span(layout, base + 7, 2, [a, b])
    w.on_tensor(span_name, base + 2, protocol.REPLAY_SPAN_DTYPE, (len(wrong_pass),), wrong_pass)
    unknown = _replay_span(dict(layout, span_name_id=span_name + 1), base + 3, 3, [a, b])
    w.on_tensor(span_name + 1, base + 3, protocol.REPLAY_SPAN_DTYPE, (len(unknown),), unknown)
    w.on_tensor(span_name, base + 4, protocol.REPLAY_SPAN_DTYPE, (len(good) - 256,), good[256:])
    w.on_graph_drops(0, 3)
    w.on_graph_drops(0, 2)  # counts only grow (a late note never lowers it)
    w.poll()
    assert json.loads((tmp_path / "target" / RANK_DIR / "rank.json").read_text())["dropped_passes"] == 3
    w.close({"dropped_passes": 4})  # the Dumper's total: the drains' drops plus an eager pass
    ds = reader.open(tmp_path)
    assert ds.passes("target", 0) == [base + i for i in range(5)]
    got = ds.load("target", 0, base)
    assert_same(got["a"], a)
    assert_same(got["b"], b)
    meta = ds.meta("target", 0, base)
    assert meta["complete"] and meta["graph_replay"] == 0 and meta["graph"] == "decode_bs2" and meta["tensors"] == 2
    assert meta["skipped"] == [{"name": "c", "reason": "too large"}]
    for i, why in ((1, "does not match"), (2, "does not match"), (3, "no layout"), (4, "bytes, the graph's is")):
        meta = ds.meta("target", 0, base + i)
        assert not meta["complete"] and why in meta["incomplete"] and meta["tensors"] == 0, (i, meta)
        assert ds.load("target", 0, base + i) == {}
    assert ds.rank_info("target", 0)["dropped_passes"] == 4


def test_each_segment_is_durable_before_the_list_and_rank_json_name_it(tmp_path, monkeypatch):
    """The order that makes a crash lose nothing rank.json lists: a segment's temporary file is
    fsynced, renamed and its directory fsynced; then its segments.jsonl line is made durable; then
    rank.json (its temporary file fsynced, renamed, the directory fsynced). A file renamed before
    its data is on disk can come back empty after a power cut while rank.json commits it."""
    events = []

    def path_of(fd):
        return os.readlink(f"/proc/self/fd/{fd}")

    real_fsync, real_fdatasync, real_replace = os.fsync, getattr(os, "fdatasync", None), os.replace

    def fsync(fd):
        events.append(("sync", path_of(fd)))
        return real_fsync(fd)

    def fdatasync(fd):
        events.append(("sync", path_of(fd)))
        return real_fdatasync(fd)

    def real_path(path):  # the writer names files through its held directory: /proc/self/fd/N/name
        head, name = os.path.split(os.fspath(path))
        return os.path.join(os.readlink(head), name) if head.startswith("/proc/self/fd/") else os.fspath(path)

    def replace(src, dst, **kwargs):
        events.append(("replace", real_path(src), real_path(dst)))
        return real_replace(src, dst, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    if real_fdatasync is not None:
        monkeypatch.setattr(os, "fdatasync", fdatasync)
    monkeypatch.setattr(os, "replace", replace)
    w = ChannelWriter(open_msg(tmp_path, segment_passes=1))
    f = Feeder(w)
    for p in range(3):
        f.full_pass(p, {"x": torch.full((2,), float(p))})
    w.close({})
    monkeypatch.undo()
    directory = str(tmp_path / "target" / RANK_DIR)
    rank_file, listing = os.path.join(directory, fmt.RANK_FILE), os.path.join(directory, fmt.SEGMENT_LIST_FILE)

    def after(start, want):
        """Position of the first event from ``start`` on for which ``want`` holds."""
        for k in range(start, len(events)):
            if want(events[k]):
                return k
        raise AssertionError(f"no such event after {start}: {events[start:]}")

    k = 0
    for number in range(3):
        final = os.path.join(directory, fmt.segment_name(number))
        renamed = after(k, lambda e: e[0] == "replace" and e[2] == final)
        temp = events[renamed][1]
        assert ("sync", temp) in events[k:renamed], f"segment {number} renamed before its data was fsynced"
        k = after(renamed, lambda e: e == ("sync", directory))  # the rename itself made durable
        k = after(k, lambda e: e == ("sync", listing))  # its line in segments.jsonl
        published = after(k, lambda e: e[0] == "replace" and e[2] == rank_file)
        assert ("sync", events[published][1]) in events[k:published], "rank.json renamed before its data was fsynced"
        k = after(published, lambda e: e == ("sync", directory))
    info = rank_json(tmp_path)
    assert info["status"] == "closed" and [s["file"] for s in info["segments"]] == [fmt.segment_name(n) for n in range(3)]


def test_a_pass_flushed_open_continues_after_other_passes_and_verifies(tmp_path):
    """Pass 3 begins first and stays open while passes 0..2 end: at 4x the segment limit the
    writer flushes it unfinished (segment 0: passes 0..3) and its tensor 'b' lands in segment 1.
    Pass 0 also has a 'b': what pass 3 carried into segment 1 is its own names, not its segment's
    first pass's, so this whole dump verifies and pass 3 reads back whole."""
    w = ChannelWriter(open_msg(tmp_path, segment_passes=1))
    f = Feeder(w)
    t = {name: torch.full((2,), float(k)) for k, name in enumerate(["3a", "3b", "a", "b"])}
    w.on_begin(3, {})
    f.tensor(3, "a", t["3a"])
    for p in range(3):
        f.full_pass(p, {"a": t["a"] + p, "b": t["b"] + p})
    assert [s["file"] for s in rank_json(tmp_path)["segments"]] == ["seg-000000.h5"]  # flushed with 3 open
    f.tensor(3, "b", t["3b"])
    w.on_end(3, {}, sent=2)  # (its two parts, one in each segment, add up to its count)
    w.close({"passes": 4, "tensors": 8})
    from fastdump.cli.dump import verify_dump

    report = verify_dump(str(tmp_path))
    assert report.problems == [] and report.warnings == [], (report.problems, report.warnings)
    ds = reader.open(tmp_path)
    got = ds.load("target", 0, 3, check=True)
    assert list(got) == ["a", "b"] and torch.equal(got["a"], t["3a"]) and torch.equal(got["b"], t["3b"])
    assert ds.meta("target", 0, 3)["complete"]


def test_a_name_stored_twice_in_a_mixed_pass_reads_the_same_through_tensor_and_load(tmp_path):
    """A pass whose capture side reported mixed forwards holds 'x' twice (two layouts): load keeps
    both (the second renamed x#dup1), and tensor('x') is load's 'x', the first, never the other."""
    w = ChannelWriter(open_msg(tmp_path))
    f = Feeder(w)
    first, second = torch.arange(4, dtype=torch.float32).reshape(2, 2), torch.full((3, 5), 7.0)
    w.on_begin(0, {})
    f.tensor(0, "x", first)
    f.tensor(0, "x", second)
    w.on_end(0, {}, incomplete="two forwards at once", mixed=True)
    w.close({})
    ds = reader.open(tmp_path)
    got = ds.load("target", 0, 0, check=True)
    assert list(got) == ["x", "x#dup1"]
    assert_same(got["x"], first)
    assert_same(got["x#dup1"], second)
    assert_same(ds.tensor("target", 0, "x", 0, check=True), first)


def test_a_scalar_blocks_row_spanning_two_rows_is_refused(tmp_path):
    """0-d tensors are stored one row each; an index row spanning two (the next pass's row made
    empty to keep the block tiled, tables CRC restamped, as a faulty writer would) is refused by
    the reader and verify, never read back as pass 0's value."""
    from conftest import restamp_tables
    from fastdump.cli.dump import verify_dump

    w = ChannelWriter(open_msg(tmp_path))
    f = Feeder(w)
    for p in range(2):
        f.full_pass(p, {"s": torch.tensor(float(p + 1))})
    w.close({})
    path = str(tmp_path / "target" / RANK_DIR / "seg-000000.h5")
    with h5py.File(path, "r+") as h5:
        index = h5["index"][()]
        index["rows"][:] = (2, 0)
        index["first_row"][:] = (0, 2)
        h5["index"][...] = index
    restamp_tables(path)
    assert f"{path} block 0: scalar block must be 1-D with one row per tensor" in verify_dump(str(tmp_path)).problems
    ds = reader.open(tmp_path)
    with pytest.raises(reader.DumpError, match="a scalar block's index rows must span one row each"):
        ds.load("target", 0, 0)


def _verify_problems(root):
    from fastdump.cli.dump import verify_dump

    return [p.replace(str(root / "target" / RANK_DIR), "RD") for p in verify_dump(str(root)).problems]


def test_drops_the_pass_ends_report_are_counted_in_rank_json_without_the_dumpers_stats(tmp_path):
    """A Dumper that never sent its close stats (killed, say): the drops its pass ends reported
    are still rank.json's, and fail verify under policy block."""
    w = ChannelWriter(open_msg(tmp_path))
    Feeder(w).full_pass(0, {"x": torch.ones(2)}, dropped=3)
    w.close({})
    assert rank_json(tmp_path)["dropped"] == 3
    assert _verify_problems(tmp_path) == [
        "RD: policy 'block': 3 tensor(s) and 0 whole pass(es) were dropped (counted, not dumped): the writer fell "
        "behind for longer than block_timeout_s, or CUDA-graph replays outran the drain"]


def test_a_tensor_the_writer_could_not_store_is_counted_lost_and_fails_verify(tmp_path):
    """A skip whose reason records a loss (accepted, then not stored) is rank.json's lost_tensors;
    other skips (values fastdump cannot store) are not."""
    w = ChannelWriter(open_msg(tmp_path))
    Feeder(w).full_pass(0, {"x": torch.ones(2)}, skipped=[
        {"name": "y", "reason": fmt.WRITER_LOST_REASON + " (MemoryError)"},
        {"name": "z", "reason": "convert raised: not a tensor"}])
    w.close({})
    info = rank_json(tmp_path)
    assert info["skipped"] == 2 and info["lost_tensors"] == 1
    assert _verify_problems(tmp_path) == [
        "RD: 1 staged tensor(s) were lost after they were accepted: torn (part of their copies failed, a CUDA drain "
        "error) or not stored by the writer (each pass's skipped list says which and why); they are not on disk"]


def test_a_continued_pass_whose_listed_second_part_is_gone_is_never_returned_half(tmp_path):
    """Pass 3 flushed open in segment 0 and ended in segment 1 (as above); segment 1 then deleted.
    rank.json still lists it: loading pass 3 must fail, not return segment 0's half as the pass."""
    w = ChannelWriter(open_msg(tmp_path, segment_passes=1))
    f = Feeder(w)
    w.on_begin(3, {})
    f.tensor(3, "a", torch.ones(2))
    for p in range(3):
        f.full_pass(p, {"a": torch.zeros(2)})
    f.tensor(3, "b", torch.ones(3))
    w.on_end(3, {})
    w.close({})
    os.unlink(tmp_path / "target" / RANK_DIR / "seg-000001.h5")
    ds = reader.open(tmp_path)
    with pytest.raises(reader.DumpError) as caught:
        ds.load("target", 0, 3)
    assert "seg-000001.h5" in str(caught.value), str(caught.value)
    assert_same(ds.load("target", 0, 1, check=True)["a"], torch.zeros(2))  # whole passes still read


def test_an_empty_tensor_before_rows_of_its_layout_reads_back_empty(tmp_path):
    """'x' has no rows in pass 0 and two in pass 1 (one block, rows 0..2): pass 0's 'x' is read
    as its zero rows, never as pass 1's first row."""
    w = ChannelWriter(open_msg(tmp_path))
    f = Feeder(w)
    empty, full = torch.zeros(0, 4), torch.arange(8, dtype=torch.float32).reshape(2, 4)
    f.full_pass(0, {"x": empty})
    f.full_pass(1, {"x": full})
    w.close({})
    ds = reader.open(tmp_path)
    assert_same(ds.load("target", 0, 0)["x"], empty)
    assert_same(ds.tensor("target", 0, "x", 0), empty)
    assert_same(ds.load("target", 0, 1)["x"], full)


def test_typed_and_2d_buffers_are_written_byte_for_byte_through_short_writes(tmp_path, monkeypatch):
    """pages.byte_view makes any C-contiguous buffer a flat byte view: a float32 or a 2-d view
    kept its items, so resuming a short write cut it by items, not bytes, and lost data."""
    real_pwritev = os.pwritev

    def short_pwritev(fd, buffers, offset):  # at most 5 bytes a call: every cut is mid-item
        return real_pwritev(fd, [memoryview(buffers[0]).cast("B")[:5]], offset)

    monkeypatch.setattr(segment_file.os, "pwritev", short_pwritev)
    floats = np.arange(7, dtype=np.float32)
    grid = np.arange(12, dtype=np.uint8).reshape(3, 4)
    for view in (floats, grid, memoryview(floats), memoryview(grid)):
        assert pages.byte_view(view).format == "B" and pages.byte_view(view).ndim == 1
        assert pages.byte_view(view).nbytes == len(pages.byte_view(view)) == np.asarray(view).nbytes
    path = tmp_path / "out"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        segment_file._pwritev_all(fd, [floats, grid, memoryview(floats)], 3)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"\0" * 3 + floats.tobytes() + grid.tobytes() + floats.tobytes()


def test_a_failed_segment_write_gives_its_blocks_pages_back(tmp_path, monkeypatch):
    """write_segment frees its blocks' pages when it fails too: the channel fails, nothing will write
    them, and a writer that kept them would hold a failed segment's rows for the rest of its life."""
    import errno

    def failing_pwritev_all(fd, buffers, offset):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(segment_file, "_pwritev_all", failing_pwritev_all)
    block = segment_file.Block(0, 0, dtypes.code_of(torch.float32), (4096,), scalar=False)
    block.data.append(np.ones(4096, dtype=np.float32))
    block.rows = 1
    with pytest.raises(OSError, match="Input/output error"):
        segment_file.write_segment(str(tmp_path), 0, names=["x"], blocks=[block], index=np.zeros(0, fmt.INDEX_DTYPE),
                                   passes=np.zeros(0, fmt.PASS_DTYPE), pass_meta=[], attrs={})
    assert (block.data.nbytes, block.data.rows, len(block.data.pages)) == (0, 0, 0)
    assert os.listdir(tmp_path) == []  # nor is any file left


def test_tensors_written_straight_to_the_file_count_toward_segment_mb_and_the_segments_bytes(tmp_path):
    """A tensor of 1 MiB or more goes to the open segment's file at once (write_direct), its index
    row added apart from the row pages: its bytes count toward segment_mb as buffered rows do, and
    into the segment's 'bytes' (segments.jsonl, its root attribute). Uncounted, a dump of large
    tensors never rotated by size and listed its segments as holding 0 bytes."""
    w = ChannelWriter(open_msg(tmp_path, segment_mb=1))
    f = Feeder(w)
    big = [torch.full((1 << 18,), float(p)) for p in range(3)]  # 1 MiB each: one segment per pass
    for p, t in enumerate(big):
        f.full_pass(p, {"x": t})
    w.close({})
    rank = tmp_path / "target" / RANK_DIR
    listed = [json.loads(line) for line in (rank / fmt.SEGMENT_LIST_FILE).read_text().splitlines()]
    assert [(s["first_pass"], s["last_pass"], s["bytes"]) for s in listed] == [(p, p, 1 << 20) for p in range(3)]
    with h5py.File(rank / fmt.segment_name(0), "r") as h5:
        assert int(h5.attrs["bytes"]) == 1 << 20
    ds = reader.open(tmp_path)
    assert all(torch.equal(ds.load("target", 0, p, check=True)["x"], big[p]) for p in range(3))
