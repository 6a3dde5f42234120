"""Each pass's end record carries how many tensors its producer sent (format 6), and `fastdump
verify` fails a pass that holds other than that many: tensors written into a pass afterwards with
valid index rows and CRCs (crafted, or leaked from elsewhere), or taken out of it, made every other
check pass, since rank.json's counts are whole-rank totals only. And a pass end that arrives twice
(a late end sent again after Ctrl-C) is taken once."""

from __future__ import annotations

import json
import os
import shutil

import h5py
import numpy as np
import pytest
import torch

import fastdump
from fastdump import _C, reader
from fastdump import format as fmt
from fastdump.cli import dump as cli_dump

import conftest
from conftest import restamp_tables

PASSES = 3
NAMES = ["0", "1", "2", "Sequential"]


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """One pass per segment: a pass's tensors are its segment's blocks."""
    root = tmp_path_factory.mktemp("pristine") / "dump"
    model = make_model()
    d = fastdump.attach(model, str(root), segment_passes=1, segment_idle_seconds=0)
    try:
        with torch.inference_mode():
            for p in range(PASSES):
                model(torch.arange(8, dtype=torch.float32).reshape(2, 4) + p)
    finally:
        stats = d.close()
    assert stats["status"] == "closed" and stats["tensors"] == PASSES * len(NAMES)
    return root


@pytest.fixture
def dump(pristine, tmp_path):
    root = tmp_path / "dump"
    shutil.copytree(pristine, root, symlinks=True)
    return root


def rank_dir(root):
    (name,) = os.listdir(root / "target")
    return root / "target" / name


def seg(root, number):
    return rank_dir(root) / fmt.segment_name(number)


def verify(root):
    """(exit code of the CLI, problems): both the CLI entry and verify_dump."""
    code = cli_dump.main(["verify", str(root)])
    report = cli_dump.verify_dump(str(root))
    assert (code == 0) == (not report.problems)
    return code, report.problems


def _replace(f, name, data, **kwargs):
    del f[name]
    f.create_dataset(name, data=data, **kwargs)


def _retotal(root, number, tensors, nbytes):
    """The segment list's line for segment ``number`` and rank.json's totals moved by ``tensors`` /
    ``nbytes``, as a writer that wrote them would have: the dump stays consistent."""
    info = conftest.read_rank_json(rank_dir(root))
    entry = info["segments"][number]
    entry["tensors"] += tensors
    entry["bytes"] += nbytes
    info["tensors"] += tensors
    info["bytes"] += nbytes
    conftest.write_rank_json(rank_dir(root), info)


def add_tensor(root, number, pass_id, name, array):
    """Write ``array`` (float32) into pass ``pass_id`` of segment ``number`` as a writer would: its
    own block with dtype, encoding and block CRC, its name, an index row with its CRC32C, the pass's
    and the file's counts, the tables' CRC, the segment list and rank.json."""
    path = seg(root, number)
    with h5py.File(path, "r+") as f:
        names = json.loads(f[fmt.NAMES][()])
        names.append(name)
        _replace(f, fmt.NAMES, json.dumps(names), dtype=h5py.string_dtype())
        block_number = len(f[fmt.BLOCKS])
        block = f[fmt.BLOCKS].create_dataset(str(block_number), data=array)
        block.attrs[fmt.ATTR_DTYPE] = "float32"
        block.attrs["encoding"] = "native"
        block.attrs[fmt.ATTR_BLOCK_CRC] = np.int64(fmt.block_crc32c(block_number, "float32", "native", False,
                                                                    array.shape[1:]))
        index = f[fmt.INDEX][()]
        row = np.zeros(1, dtype=index.dtype)
        row["pass"], row["name"], row["block"], row["first_row"], row["rows"] = (
            pass_id, len(names) - 1, block_number, 0, array.shape[0])
        row["crc32c"] = _C.crc32c(np.ascontiguousarray(array).view(np.uint8).reshape(-1))
        _replace(f, fmt.INDEX, np.concatenate([index, row]))
        passes = f[fmt.PASSES][()]
        passes["tensors"][passes["pass"] == pass_id] += 1
        passes["bytes"][passes["pass"] == pass_id] += array.nbytes
        _replace(f, fmt.PASSES, passes)
        f.attrs["tensors"] = np.int64(int(f.attrs["tensors"]) + 1)
        f.attrs["bytes"] = np.int64(int(f.attrs["bytes"]) + array.nbytes)
    restamp_tables(path)
    _retotal(root, number, 1, array.nbytes)


def remove_last_tensor(root, number):
    """Take the last block of segment ``number`` (one pass: the block is one tensor) out with its
    index row, every count after it (rank.json's stats.tensors, the Dumper's, included), and the
    tables' CRC: a pass missing one of its tensors, consistently."""
    path = seg(root, number)
    with h5py.File(path, "r+") as f:
        last = len(f[fmt.BLOCKS]) - 1
        nbytes = f[fmt.BLOCKS][str(last)].nbytes
        del f[fmt.BLOCKS][str(last)]
        index = f[fmt.INDEX][()]
        (pass_id,) = set(index["pass"][index["block"] == last].tolist())
        _replace(f, fmt.INDEX, index[index["block"] != last])
        passes = f[fmt.PASSES][()]
        passes["tensors"][passes["pass"] == pass_id] -= 1
        passes["bytes"][passes["pass"] == pass_id] -= nbytes
        _replace(f, fmt.PASSES, passes)
        f.attrs["tensors"] = np.int64(int(f.attrs["tensors"]) - 1)
        f.attrs["bytes"] = np.int64(int(f.attrs["bytes"]) - nbytes)
    restamp_tables(path)
    _retotal(root, number, -1, -nbytes)
    info = conftest.read_rank_json(rank_dir(root))
    info["stats"]["tensors"] -= 1
    conftest.write_rank_json(rank_dir(root), info)
    return pass_id


def test_the_pristine_dump_verifies(dump):
    assert verify(dump) == (0, [])


def test_a_pass_holding_a_tensor_its_producer_never_sent_fails_verify(dump):
    """One tensor more in pass 1, written in consistently (name, block, block CRC, index row and
    CRC, pass and file counts, tables CRC, segment list, rank.json): before format 6 every check
    passed (more on disk than the Dumper staged is no loss) and verify said OK."""
    add_tensor(dump, 1, 1, "leaked", np.arange(6, dtype=np.float32).reshape(2, 3))
    with fastdump.open(dump) as ds:  # (consistent: the reader takes it as pass 1's)
        assert sorted(ds.load("target", 0, 1, check=True)) == sorted(NAMES + ["leaked"])
    code, problems = verify(dump)
    assert code == 1
    assert problems == [f"{rank_dir(dump)}: pass 1: 5 tensors on disk, but its producer sent 4 (its end record's "
                        "count): tensors it never sent were written into it"], problems


def test_a_pass_missing_one_of_its_tensors_consistently_fails_verify(dump):
    pass_id = remove_last_tensor(dump, 2)
    assert pass_id == 2
    code, problems = verify(dump)
    assert code == 1
    assert problems == [f"{rank_dir(dump)}: pass 2: 3 tensors on disk, but its producer sent 4 (its end record's "
                        "count): tensors were lost"], problems


def sent_counts(root):
    """{pass id: its pass_meta entry's count of the tensors sent (None: none)} over the segments."""
    counts = {}
    for name in sorted(os.listdir(rank_dir(root))):
        if fmt.segment_number(name) is not None:
            with h5py.File(rank_dir(root) / name, "r") as f:
                for row, text in zip(f[fmt.PASSES][()], f[fmt.PASS_META][()]):
                    counts[int(row["pass"])] = json.loads(text).get(fmt.PASS_SENT)
    return counts


def strip_counts(root, passes=None, version=None):
    """Take the count out of ``passes``' pass_meta entries (all: None), tables CRC restamped; with
    ``version``, every segment and rank.json say that format version."""
    for name in sorted(os.listdir(rank_dir(root))):
        if fmt.segment_number(name) is None:
            continue
        with h5py.File(rank_dir(root) / name, "r+") as f:
            meta = [json.loads(text) for text in f[fmt.PASS_META][()]]
            for row, entry in zip(f[fmt.PASSES][()], meta):
                if passes is None or int(row["pass"]) in passes:
                    entry.pop(fmt.PASS_SENT, None)
            _replace(f, fmt.PASS_META, [json.dumps(entry) for entry in meta], dtype=h5py.string_dtype())
            if version is not None:
                f.attrs["format_version"] = np.int64(version)
        restamp_tables(rank_dir(root) / name)
    if version is not None:
        info = conftest.read_rank_json(rank_dir(root))
        info["format_version"] = version
        conftest.write_rank_json(rank_dir(root), info)


def test_every_pass_stores_its_producers_count(dump):
    assert fmt.FORMAT_VERSION == fmt.PASS_SENT_VERSION == 6
    assert sent_counts(dump) == {p: len(NAMES) for p in range(PASSES)}


def test_a_format_6_pass_whose_count_was_taken_out_fails_verify(dump):
    """Without this, taking the count out with the tensor put in would pass as an older dump."""
    strip_counts(dump, passes={1})
    add_tensor(dump, 1, 1, "leaked", np.zeros((1, 2), dtype=np.float32))
    code, problems = verify(dump)
    assert code == 1
    assert problems == [f"{seg(dump, 1)}: pass 1 ended without a count of the tensors its producer sent: a format-6 "
                        "writer stores one with every pass that ended; taken out"], problems


def test_a_format_5_dump_verifies_as_before(dump):
    """Older dumps carry no count: they verify as they did (a tensor written in consistently is
    not seen there, as before)."""
    strip_counts(dump, version=5)
    assert verify(dump) == (0, [])
    with fastdump.open(dump) as ds:
        assert all(ds.meta("target", 0, p)["tensors"] == len(NAMES) for p in range(PASSES))
    add_tensor(dump, 1, 1, "leaked", np.zeros((1, 2), dtype=np.float32))
    assert verify(dump) == (0, [])


@pytest.mark.parametrize("bad", [-1, 2.0, True, "4", [4]])
def test_a_count_that_is_not_a_count_fails_verify(dump, bad):
    path = seg(dump, 0)
    with h5py.File(path, "r+") as f:
        entry = json.loads(f[fmt.PASS_META][0])
        entry[fmt.PASS_SENT] = bad
        _replace(f, fmt.PASS_META, [json.dumps(entry)], dtype=h5py.string_dtype())
    restamp_tables(path)
    code, problems = verify(dump)
    assert code == 1 and problems == [f"{path}: pass 0: its count of the tensors sent is {json.dumps(bad)}, not a "
                                      "count (an integer >= 0)"], problems


def test_the_count_is_what_was_put_into_the_ring_not_what_was_skipped(tmp_path):
    """The C root pass's end (its lane's own count), the Python end (a pass with meta), the general
    path (a complex tensor with its lazy conjugate bit: a copy staged by Channel.stage), skips (a
    sparse tensor: never sent) and dump()'s standalone passes: each pass's count is its tensors that
    went into the ring, and the dump verifies."""
    model = make_model()
    x = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    z = torch.complex(torch.ones(3), torch.arange(3.0))
    with fastdump.attach(model, str(tmp_path / "dump"), segment_idle_seconds=0) as d:
        with torch.inference_mode():
            model(x)  # pass 0: plain, its end put by the C root pass
            d.set_pass_meta(step=1)
            model(x)  # pass 1: with meta, its end sent by Python
            d.begin_pass()  # pass 2: the general path, and a skip
            d.dump("conj", z.conj())
            d.dump("sparse", torch.eye(3).to_sparse())
            d.dump("plain", x)
            d.end_pass()
            d.dump("alone", x)  # pass 3: a standalone dump()
    root = tmp_path / "dump"
    with fastdump.open(root) as ds:
        assert ds.pass_names("target", 0, 2) == ["conj", "plain"]
        assert [s["name"] for s in ds.meta("target", 0, 2)["skipped"]] == ["sparse"]
        assert ds.meta("target", 0, 1)["step"] == 1
    assert sent_counts(root) == {0: 4, 1: 4, 2: 2, 3: 1}
    assert verify(root) == (0, [])


def test_the_lanes_count_belongs_to_its_pass():
    """ChannelStager counts the tensors stage_tensor stages and those add_sent is told of, for the
    pass they were staged in: a pass whose begin never reached the lane reads 0, not the last
    pass's count; a tensor it did not stage is not counted."""
    name = f"/fastdump-test-counts-{np.random.randint(1 << 30)}"
    producer = _C.Producer(name, 1 << 20, 0)
    try:
        lane = _C.ChannelStager(producer, 1, {torch.float32: (7, 4)}, torch.strided)
        lane.begin(5, True, 1.0)
        assert lane.stage_tensor(1, torch.ones(4)) == _C.STAGED
        assert lane.stage_tensor(1, torch.ones(4, dtype=torch.float64)) == _C.ChannelStager.NOT_FAST
        lane.add_sent(5)
        assert lane.sent_in(5) == 2 and lane.sent_in(4) == 0 and lane.sent_in(6) == 0
        lane.begin(6, True, 1.0)
        assert lane.sent_in(6) == 0 and lane.sent_in(5) == 2  # nothing of pass 6 yet
        assert lane.stage_tensor(1, torch.ones(2)) == _C.STAGED
        assert lane.sent_in(6) == 1 and lane.sent_in(5) == 0
    finally:
        producer.unlink()


def test_a_late_end_interrupted_after_its_send_is_sent_again():
    """Why the writer must take a late end once: Ctrl-C (KeyboardInterrupt, raised as control()
    returns) between a late end's send and its removal from the Dumper's list leaves it there,
    and the next pass's begin or close() sends it again."""
    import threading

    from fastdump.capture.passes import PassesMixin

    sent = []

    class Engine:
        interrupt = True

        def control(self, msg, **_):
            sent.append(msg["pass"])
            if self.interrupt:
                self.interrupt = False
                raise KeyboardInterrupt
            return len(sent)

    class Dumper(PassesMixin):
        _late_lock = threading.Lock()
        _engine = Engine()
        _late_ends = [{"op": "end", "channel": 0, "pass": 3, "late": True}]
        _totals = {"lost_pass_ends": 1, "late_pass_ends": 0}

    d = Dumper()
    with pytest.raises(KeyboardInterrupt):
        d._send_late_ends()
    d._send_late_ends()
    assert sent == [3, 3] and d._late_ends == [] and d._totals == {"lost_pass_ends": 0, "late_pass_ends": 1}


def test_a_segment_set_back_to_format_5_in_a_format_6_directory_fails_verify(dump):
    """The version attribute is covered by no checksum: a segment whose counts were taken out and
    version set back would verify as an older one, but its directory's rank.json says format 6."""
    path = seg(dump, 1)
    with h5py.File(path, "r+") as f:
        f.attrs["format_version"] = np.int64(5)
    strip_counts(dump, passes={1})
    code, problems = verify(dump)
    assert code == 1
    assert problems == [f"{path}: a format-5 segment in a rank directory whose rank.json says format 6, whose "
                        "writer writes no other: its passes' counts of the tensors sent taken out, the version "
                        "set back"], problems


def test_a_tensor_the_writer_received_and_could_not_store_is_no_count_problem(tmp_path):
    """Sent, received, not stored: the writer records why in the pass's skipped list, and the count
    allows for it (a record that describes no tensor; a torn one, which rank.json's lost_tensors
    fails on its own). A tensor missing without such a skip is lost."""
    from fastdump.writer.channel_writer import ChannelWriter

    rank = {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "rank": 0}
    root = tmp_path / "dump"
    w = ChannelWriter({"op": "open", "channel": 0, "dir": str(root / "target" / "TP0_PP0_Rank0_pid7"),
                       "role": "target", "rank": rank, "pid": 7, "host": "h", "device": {}, "config": {}})
    w.on_name(0, "x")
    w.on_name(1, "y")
    for p in range(2):
        w.on_begin(p, {})
        w.on_tensor(0, p, 0, (2,), np.zeros(8, dtype=np.uint8))  # float32 (code 0), stored
        w.on_tensor(1, p, 0, (3,), np.zeros(5, dtype=np.uint8))  # 5 bytes for 12: not a tensor
    w.on_end(0, {}, 0, [], sent=2)
    w.on_end(1, {}, 0, [], sent=3)  # one more than the writer ever saw
    w.close({})
    code, problems = verify(root)
    assert code == 1
    assert problems == [f"{root / 'target' / 'TP0_PP0_Rank0_pid7'}: pass 1: 1 tensors on disk, but its producer sent "
                        "3 (its end record's count), 1 of them not stored by the writer (its skipped list says why): "
                        "tensors were lost"], problems


def test_a_cuda_graph_replay_pass_counts_the_graphs_tensors(tmp_path):
    """A replay's span holds every slot its graph fixed at capture: its pass's count is the graph's
    tensors. A span that does not match its layout is stored as an incomplete pass without them,
    each recorded as lost (they were sent, in the span): verify fails on the losses, and the count
    allows for them."""
    from fastdump import protocol
    from fastdump.writer.channel_writer import ChannelWriter

    rank = {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "rank": 0}
    root = tmp_path / "dump"
    w = ChannelWriter({"op": "open", "channel": 0, "dir": str(root / "target" / "TP0_PP0_Rank0_pid7"),
                       "role": "target", "rank": rank, "pid": 7, "host": "h", "device": {}, "config": {}})
    w.on_name(0, "a")
    w.on_name(1, "b")
    span_id, span_bytes = protocol.GRAPH_SPAN_NAME_BASE + 1, protocol.REPLAY_HEADER_BYTES + 64
    w.on_graph(protocol.graph(0, 0, 1, span_id, span_bytes, [[0, 0, [2], 256, 8], [1, 0, [4], 320, 16]],
                              {"cuda_graph": 1}, {}))
    for replay in range(2):
        pass_id = protocol.GRAPH_PASS_BASE + replay
        span = np.zeros(span_bytes, dtype=np.uint8)
        graph = 1 if replay == 0 else 2  # replay 1's header names another graph: not written
        span[:48] = np.frombuffer(np.array([protocol.REPLAY_MAGIC, pass_id, replay, span_id, span_bytes, graph],
                                           dtype="<u8").tobytes(), dtype=np.uint8)
        w.on_tensor(span_id, pass_id, protocol.REPLAY_SPAN_DTYPE, (span_bytes,), span)
    w.close({})
    assert sent_counts(root) == {protocol.GRAPH_PASS_BASE: 2, protocol.GRAPH_PASS_BASE + 1: 2}
    code, problems = verify(root)
    assert code == 1
    assert len(problems) == 1 and "2 staged tensor(s) were lost after they were accepted" in problems[0], problems
    with fastdump.open(root) as ds:
        skipped = ds.meta("target", 0, protocol.GRAPH_PASS_BASE + 1)["skipped"]
    assert [s["name"] for s in skipped] == ["a", "b"]
    assert all(s["reason"].startswith("writer could not store it: CUDA-graph replay not written: replay header")
               for s in skipped)


def test_a_count_off_in_a_pass_marked_incomplete_is_a_warning(dump):
    """A pass the capture side marked incomplete may have been ended while a tensor was still being
    staged into it (close() from another thread inside its forward, Ctrl-C between a tensor's
    staging and its count): its count can be off by those, so verify warns, as it does of the pass."""
    path = seg(dump, 1)
    with h5py.File(path, "r+") as f:
        entry = json.loads(f[fmt.PASS_META][0])
        entry["incomplete"] = "still open at close(): closed inside the model's forward"
        _replace(f, fmt.PASS_META, [json.dumps(entry)], dtype=h5py.string_dtype())
        passes = f[fmt.PASSES][()]
        passes["complete"] = 0
        _replace(f, fmt.PASSES, passes)
    restamp_tables(path)
    add_tensor(dump, 1, 1, "late", np.zeros((1, 2), dtype=np.float32))
    report = cli_dump.verify_dump(str(dump))
    assert report.problems == []
    warning = (f"{rank_dir(dump)}: pass 1: 5 tensors on disk, but its producer sent 4 (its end record's count): "
               "tensors it never sent were written into it (the pass is marked incomplete: a tensor staged as its "
               "end was sent, by another thread or around a Ctrl-C, is counted on one side only)")
    assert warning in report.warnings, report.warnings
