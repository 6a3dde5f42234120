"""Hostile tests of ``fastdump verify`` and the reader against crafted and corrupt dumps.

A real dump is made once with ``fastdump.attach`` on a tiny CPU model (5 passes, 3 segments of
passes 0-1, 2-3 and 4); every test damages its own copy with h5py or by hand and asserts what
``verify`` reports (text and exit code of ``fastdump.cli.dump.main(["verify", ...])``) and what the
reader does: a clear ``DumpError``/``KeyError``/``ValueError``, or correct data. Never a traceback
out of verify, an unrelated exception type, or silently wrong data.

Cases already covered by test_integrity_disk.py / test_reader_cli.py (first_row far outside, name
slot outside the table, a missing block, external/virtual/chunked blocks, symlinked rank and role
directories, FIFOs, /dev/zero JSON, JSON lists, truncated segments, unfinished statuses) are not
repeated here.
"""

import contextlib
import json
import os
import shutil

import h5py
import numpy as np
import pytest
import torch

import fastdump
from fastdump import fsutil, reader
from fastdump import format as fmt
from fastdump.cli import dump as cli_dump

import conftest
from conftest import restamp_tables

NAMES = ["0", "1", "2", "Sequential"]  # what the model below dumps per pass, in dump order
PASSES = 5
# The dumps below are laid out by segment_passes alone: the writer's idle rotation (a second with no
# record, the default) cut a segment short whenever a loaded machine paused the model that long (the
# copied segment held passes 0..2, not 0..6).


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def model_input(p):
    return torch.arange(8, dtype=torch.float32).reshape(2, 4) + p


def expected_pass(model, p):
    x = model_input(p)
    a = model[0](x)
    b = model[1](a)
    c = model[2](b)
    return {"0": a, "1": b, "2": c, "Sequential": c}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine") / "dump"
    model = make_model()
    d = fastdump.attach(model, str(root), segment_passes=2, segment_idle_seconds=0)
    try:
        with torch.inference_mode():
            for p in range(PASSES):
                model(model_input(p))
    finally:
        stats = d.close()
    assert stats["status"] == "closed" and stats["passes"] == PASSES and stats["tensors"] == PASSES * 4
    with torch.inference_mode():
        expected = {p: expected_pass(model, p) for p in range(PASSES)}
    return root, expected


@pytest.fixture
def dump(pristine, tmp_path):
    root = tmp_path / "dump"
    shutil.copytree(pristine[0], root, symlinks=True)
    return root


@pytest.fixture
def expected(pristine):
    return pristine[1]


# ----------------------------------------------------------------------------------- helpers


def rank_dir(root):
    (name,) = os.listdir(root / "target")
    return root / "target" / name


def seg(root, number):
    return rank_dir(root) / fmt.segment_name(number)


def rank_json(root):
    """rank.json, its segment list under "segments" (segments.jsonl's from format 5)."""
    return conftest.read_rank_json(rank_dir(root))


def write_rank_json(root, info):
    conftest.write_rank_json(rank_dir(root), info)


def edit_rank_json(root, change):
    info = rank_json(root)
    change(info)
    write_rank_json(root, info)


def verify(root, *extra):
    """(exit code of the CLI, problems, warnings): both the CLI entry and verify_dump."""
    code = cli_dump.main(["verify", str(root), *extra])
    report = cli_dump.verify_dump(str(root), read_data="--data" in extra)
    assert (code == 0) == (not report.problems)
    return code, report.problems, report.warnings


def has(problems, *needles):
    return any(all(n in p for n in needles) for p in problems)


def rewrite(path, table, change, restamp=True):
    """Rewrite the table (``index`` or ``passes``) of a segment through ``change(array)``; with
    ``restamp`` its tables checksum follows (a faulty writer), without it the change is damage."""
    with h5py.File(path, "r+") as f:
        data = f[table][()]
        data = change(data)
        if data is not None:
            del f[table]
            f.create_dataset(table, data=data)
    if restamp:
        restamp_tables(path)


def set_names(path, names):
    with h5py.File(path, "r+") as f:
        del f["names"]
        f.create_dataset("names", data=json.dumps(names), dtype=h5py.string_dtype())
    restamp_tables(path)


def set_attrs(path, **attrs):
    with h5py.File(path, "r+") as f:
        for key, value in attrs.items():
            f.attrs[key] = value


def set_pass_meta(path, pass_id, change):
    """Change pass ``pass_id``'s pass_meta entry through ``change(entry)``, its tables CRC restamped."""
    with h5py.File(path, "r+") as f:
        entries = [json.loads(text) for text in f[fmt.PASS_META][()]]
        for row, entry in zip(f[fmt.PASSES][()], entries):
            if int(row["pass"]) == pass_id:
                change(entry)
        del f[fmt.PASS_META]
        f.create_dataset(fmt.PASS_META, data=[json.dumps(entry) for entry in entries], dtype=h5py.string_dtype())
    restamp_tables(path)


def relabel_passes(path, mapping):
    """Give a segment's passes new ids everywhere inside the file (index, passes, root attrs)."""
    with h5py.File(path, "r+") as f:
        index, passes = f["index"][()], f["passes"][()]
        index["pass"] = [mapping[int(p)] for p in index["pass"]]
        passes["pass"] = [mapping[int(p)] for p in passes["pass"]]
        f["index"][...] = index
        f["passes"][...] = passes
        f.attrs["first_pass"] = int(passes["pass"].min())
        f.attrs["last_pass"] = int(passes["pass"].max())
    restamp_tables(path)


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def open_quietly(root):
    """The reader warns about every unreadable segment; tests look at ``problems`` instead."""
    return fastdump.open(root)


# ----------------------------------------------------------------------------- the real dump


def test_the_real_dump_verifies_and_reads_back_exactly(dump, expected):
    code, problems, warnings = verify(dump, "--data")
    assert code == 0 and problems == [] and warnings == []
    with fastdump.open(dump) as ds:
        assert ds.passes("target", 0) == list(range(PASSES))
        assert [os.path.basename(s) for s in ds.segments("target", 0)] == [fmt.segment_name(n) for n in range(3)]
        for p in range(PASSES):
            got = ds.load("target", 0, p, check=True)
            assert list(got) == NAMES
            assert all(same(got[n], expected[p][n]) for n in NAMES)
            assert ds.meta("target", 0, p)["tensors"] == 4


# --------------------------------------------------------------------- index rows vs blocks


def _dup_row(index):
    """The same tensor listed twice (pass 0, '0', rows 0..2 of block 0)."""
    return np.concatenate([index, index[:1]])


def _fix_pass0_counts(path, extra_rows, extra_bytes):
    def change(passes):
        passes["tensors"][0] += extra_rows
        passes["bytes"][0] += extra_bytes
        return passes
    rewrite(path, "passes", change)


def _partial_overlap(index):
    index["first_row"][4] = 1  # pass 1's '0': rows 1..3 of block 0, overlapping pass 0's 0..2
    return index


def _gap(index):
    index["first_row"][4] = 3  # rows 3..5: row 2 belongs to no tensor
    return index


def _past_end(index):
    index["rows"][4] = 7  # pass 1's '0': rows 2..9 of a 4-row block
    return index


@pytest.mark.parametrize("damage, verify_text, reader_text", [
    ("dup-row", ["do not tile", "2 tensors named '0'"], "overlap the previous tensor"),
    ("partial-overlap", ["do not tile"], "overlap the previous tensor"),
    ("gap", ["do not tile"], "leave a gap"),
    ("past-end", ["do not tile"], "4 rows, but its index rows cover 9"),
])
def test_index_rows_that_do_not_tile_their_block(dump, expected, damage, verify_text, reader_text):
    path = seg(dump, 0)
    if damage == "dup-row":
        rewrite(path, "index", _dup_row)
        _fix_pass0_counts(path, 1, 24)  # the passes table agrees with the doubled index
    else:
        rewrite(path, "index", {"partial-overlap": _partial_overlap, "gap": _gap, "past-end": _past_end}[damage])
    code, problems, _ = verify(dump)
    assert code == 1
    for text in verify_text:
        assert has(problems, "seg-000000.h5", text), problems
    ds = open_quietly(dump)
    # a table that does not tile warns as the segment is indexed; past-end fails only the block read
    with pytest.warns(UserWarning) if damage != "past-end" else contextlib.nullcontext():
        with pytest.raises(reader.DumpError, match=reader_text):
            ds.load("target", 0, 1)
    assert all(same(ds.load("target", 0, 2)[n], expected[2][n]) for n in NAMES)  # other segments read


def test_block_with_rows_after_its_last_index_row(dump, expected):
    """Block 0 (name '0', passes 0 and 1: rows 0..3) gets a fifth row no index row accounts for: a
    gap at the block's end, which the checks of rows between tensors do not see. Its attributes,
    CRCs and every index row still agree."""
    with h5py.File(seg(dump, 0), "r+") as f:
        old = f["blocks"]["0"]
        data, attrs = old[()], dict(old.attrs)
        del f["blocks"]["0"]
        new = f["blocks"].create_dataset("0", data=np.concatenate([data, np.full((1, 3), 7.0, np.float32)]))
        new.attrs.update(attrs)
    code, problems, _ = verify(dump, "--data")
    assert code == 1
    assert problems == [f"{seg(dump, 0)} block 0: index rows do not tile the block's 5 rows exactly"], problems
    ds = open_quietly(dump)
    with pytest.raises(reader.DumpError, match="block 0: 5 rows, but its index rows cover 4"):
        ds.load("target", 0, 1)
    assert all(same(ds.load("target", 0, 2)[n], expected[2][n]) for n in NAMES)  # other segments read


def test_pass_meta_with_an_entry_missing(dump, expected):
    """Segment 0 holds passes 0 and 1 but one pass_meta entry (the tables' CRC made to agree, as a
    faulty writer would): which pass's metadata, skips and incomplete reason it is is unknown."""
    path = seg(dump, 0)
    with h5py.File(path, "r+") as f:
        texts = f[fmt.PASS_META][()]
        del f[fmt.PASS_META]
        f.create_dataset(fmt.PASS_META, data=texts[:1], dtype=h5py.string_dtype())
    restamp_tables(path)
    code, problems, _ = verify(dump)
    assert code == 1 and problems == [f"{path}: 1 pass_meta entries for 2 passes"], problems
    with open_quietly(dump) as ds:
        with pytest.warns(UserWarning, match="1 pass_meta entries for 2 passes; pass metadata ignored"):
            got = ds.load("target", 0, 1)
        assert all(same(got[n], expected[1][n]) for n in NAMES)  # the data itself is whole
        assert ds.meta("target", 0, 1) == {"complete": True, "dropped": 0, "skipped": [], "tensors": 4, "bytes": 80}


def test_a_block_removed_with_its_index_rows(dump, expected):
    """Block 1 of segment 0 (name '1' of passes 0 and 1) and its index rows removed, the passes
    table and tables CRC made to agree: the segment is consistent in itself but for the gap in
    its block numbers, and rank.json's list still counts the lost tensors."""
    path = seg(dump, 0)
    with h5py.File(path, "r+") as f:
        del f["blocks"]["1"]
    rewrite(path, "index", lambda index: index[index["block"] != 1])

    def fewer(passes):
        passes["tensors"] -= 1
        passes["bytes"] -= 24
        return passes

    rewrite(path, "passes", fewer)
    code, problems, _ = verify(dump)
    assert code == 1
    here = rank_dir(dump)
    assert problems == [f"{path}: blocks are not numbered 0..n-1",
                        f"{path}: attribute tensors=8 but the tables say 6",
                        f"{path}: attribute bytes=160 but the tables say 112",
                        f"{here}: seg-000000.h5: segments.jsonl says tensors=8, file has 6",
                        f"{here}: seg-000000.h5: segments.jsonl says bytes=160, file has 112",
                        f"{here}: the Dumper staged 20 tensors; 18 are on disk (0 recorded as skipped)",
                        *(f"{here}: pass {p}: 3 tensors on disk, but its producer sent 4 (its end record's count): "
                          "tensors were lost" for p in (0, 1))], problems


def test_an_index_row_of_a_pass_the_passes_table_lacks(dump, expected):
    """Pass 1's row of '0' relabelled pass 9, the passes table and CRC made to agree with what
    pass 1 keeps: the row's tensor belongs to no pass this segment has."""
    path = seg(dump, 0)

    def relabel(index):
        index["pass"][(index["pass"] == 1) & (index["block"] == 0)] = 9
        return index

    def fewer(passes):
        passes["tensors"][1] -= 1
        passes["bytes"][1] -= 24
        return passes

    rewrite(path, "index", relabel)
    rewrite(path, "passes", fewer)
    code, problems, _ = verify(dump)
    assert code == 1
    assert problems == [f"{path}: tensors of passes missing from the passes table: [9]",
                        f"{path}: attribute bytes=160 but the tables say 136",
                        f"{rank_dir(dump)}: seg-000000.h5: segments.jsonl says bytes=160, file has 136",
                        f"{rank_dir(dump)}: pass 1: 3 tensors on disk, but its producer sent 4 (its end record's "
                        "count): tensors were lost"], problems
    ds = open_quietly(dump)
    with pytest.warns(UserWarning, match="index row 4: pass 9 is not in the passes table"):
        with pytest.raises(reader.DumpError, match="seg-000000.h5"):
            ds.load("target", 0, 1)


def test_pass_with_zero_tensors_in_the_passes_table_but_rows_in_the_index(dump, expected):
    def change(passes):
        passes["tensors"][0] = 0
        return passes

    rewrite(seg(dump, 0), "passes", change)
    code, problems, _ = verify(dump)
    assert code == 1 and has(problems, "seg-000000.h5", "pass 0: 4 tensors", "table says 0"), problems
    ds = open_quietly(dump)
    with pytest.warns(UserWarning, match="unreadable segment"):
        with pytest.raises(reader.DumpError, match="pass 0: 4 index rows, the passes table says 0"):
            ds.load("target", 0, 0)
    with pytest.raises(reader.DumpError, match="seg-000000.h5"):
        ds.meta("target", 0, 1)  # the pass may be in the damaged file: not a plain KeyError
    assert same(ds.load("target", 0, 3)["0"], expected[3]["0"])


def test_pass_whose_byte_count_in_the_passes_table_disagrees_with_its_rows(dump, expected):
    """The passes table says pass 0 holds 8 bytes more than its four index rows cover (a faulty
    writer: the tables checksum agrees). Only the byte count is wrong, so verify must see it."""
    with h5py.File(seg(dump, 0), "r") as f:
        stored = int(f["passes"][()]["bytes"][0])

    def change(passes):
        passes["bytes"][0] += 8
        return passes

    rewrite(seg(dump, 0), "passes", change)
    code, problems, _ = verify(dump)
    with h5py.File(seg(dump, 0), "r") as f:
        total = int(f.attrs["bytes"])
    assert code == 1 and problems == [
        f"{seg(dump, 0)}: pass 0: 4 tensors / {stored} bytes in the index, table says 4 / {stored + 8}",
        f"{seg(dump, 0)}: attribute bytes={total} but the tables say {total + 8}",
        f"{rank_dir(dump)}: seg-000000.h5: segments.jsonl says bytes={total}, file has {total + 8}"], problems


def test_rows_of_one_pass_relabelled_into_another(dump, expected):
    """Pass 1's four rows say pass 0; the passes table is made to agree (pass 0: 8 rows, pass 1: 0).
    Pass 0 then holds every name twice: mixed data."""
    def index_change(index):
        index["pass"][4:] = 0
        return index

    def passes_change(passes):
        passes["tensors"] = [8, 0]
        passes["bytes"] = [160, 0]
        return passes

    rewrite(seg(dump, 0), "index", index_change)
    rewrite(seg(dump, 0), "passes", passes_change)
    code, problems, _ = verify(dump)
    assert code == 1 and has(problems, "pass 0: 2 tensors named '0'"), problems
    with fastdump.open(dump) as ds:
        got = ds.load("target", 0, 0)  # nothing is dropped: the second of each name is renamed
        assert list(got) == NAMES + [n + "#dup1" for n in NAMES]
        assert same(got["0"], expected[0]["0"]) and same(got["0#dup1"], expected[1]["0"])
        assert ds.load("target", 0, 1) == {} and ds.meta("target", 0, 1)["tensors"] == 0


def test_duplicate_pass_id_in_the_passes_table(dump):
    def change(passes):
        passes["pass"][1] = 0
        return passes

    rewrite(seg(dump, 0), "passes", change)
    code, problems, _ = verify(dump)
    assert code == 1 and has(problems, "seg-000000.h5", "a pass id appears twice"), problems
    ds = open_quietly(dump)
    with pytest.warns(UserWarning, match="appears twice"):
        with pytest.raises(reader.DumpError, match="seg-000000.h5"):
            ds.load("target", 0, 0)


def test_a_block_no_index_row_refers_to(dump, expected):
    with h5py.File(seg(dump, 0), "r+") as f:
        f["blocks"].create_dataset("4", data=np.ones((2, 3), np.float32))
        f["blocks"]["4"].attrs["dtype"] = "float32"
        f["blocks"]["4"].attrs["encoding"] = "native"
    code, problems, _ = verify(dump)
    assert code == 1 and has(problems, "seg-000000.h5 block 4", "not referenced by the index"), problems
    with fastdump.open(dump) as ds:  # the reader reads only what the index lists
        assert all(same(ds.load("target", 0, 0)[n], expected[0][n]) for n in NAMES)


def test_two_names_sharing_a_block_are_reported(dump):
    """Rows of block 0 relabelled as name '1' and rows of block 1 as name '0' (pass 1): each
    row keeps its CRC, so checksums still match, but the data of '0' and '1' are swapped."""
    def change(index):
        index["name"][4], index["name"][5] = 1, 0
        return index

    rewrite(seg(dump, 0), "index", change)
    code, problems, _ = verify(dump, "--data")
    assert code == 1 and has(problems, "seg-000000.h5 block 0", "name different tensors"), problems


def test_reader_refuses_two_names_sharing_a_block(dump, expected):
    def change(index):
        index["name"][4], index["name"][5] = 1, 0
        return index

    rewrite(seg(dump, 0), "index", change)
    ds = open_quietly(dump)
    try:
        got = ds.load("target", 0, 1, check=True)
    except reader.DumpError:
        return
    assert same(got["0"], expected[1]["0"]), "load returned the data of module '1' under the name '0'"


def _swap_pass_labels(index):
    """Rows 0 (pass 0, '0', block 0 rows 0..2) and 4 (pass 1, '0', block 0 rows 2..4) trade
    their pass ids: every count, the tiling and every CRC still agree."""
    index["pass"][0], index["pass"][4] = 1, 0
    return index


def test_verify_fails_rows_whose_pass_ids_were_swapped(dump):
    rewrite(seg(dump, 0), "index", _swap_pass_labels, restamp=False)
    code, problems, _ = verify(dump)  # no --data needed: the tables' own checksum catches it
    assert code == 1 and has(problems, "seg-000000.h5", "tables have CRC32C", "changed after it was written"), problems


def test_reader_refuses_rows_whose_pass_ids_were_swapped(dump, expected):
    rewrite(seg(dump, 0), "index", _swap_pass_labels, restamp=False)
    ds = open_quietly(dump)
    with pytest.raises(reader.DumpError, match="seg-000000.h5.*changed after it was written"):
        ds.load("target", 0, 0, check=True)
    assert same(ds.load("target", 0, 3)["0"], expected[3]["0"])  # the other segment still reads


@pytest.mark.parametrize("table", ["names", "passes", "pass_meta"])
def test_any_table_changed_on_disk_fails_verify_and_the_reader(dump, table):
    """One byte of each table changed with no other sign: only the tables checksum can tell."""
    with h5py.File(seg(dump, 0), "r+") as f:
        if table == "names":
            text = f["names"][()].decode().replace('"1"', '"7"')
            del f["names"]
            f.create_dataset("names", data=text, dtype=h5py.string_dtype())
        elif table == "passes":
            passes = f["passes"][()]
            passes["dropped"][0] += 1
            f["passes"][...] = passes
        else:
            meta = [m.decode() for m in f["pass_meta"][()]]
            meta[0] = meta[0].replace("{}", '{"step": 9}', 1)
            assert meta[0] != f["pass_meta"][0].decode()
            del f["pass_meta"]
            f.create_dataset("pass_meta", data=np.array(meta, dtype=object), dtype=h5py.string_dtype())
    code, problems, _ = verify(dump)
    assert code == 1 and has(problems, "seg-000000.h5", "changed after it was written"), problems
    with pytest.raises(reader.DumpError, match="changed after it was written"):
        open_quietly(dump).load("target", 0, 0)


def test_a_segment_of_format_3_without_its_tables_checksum_is_refused(dump):
    with h5py.File(seg(dump, 0), "r+") as f:
        del f.attrs[fmt.ATTR_TABLES_CRC]
    code, problems, _ = verify(dump)
    assert code == 1 and has(problems, "seg-000000.h5", "no 'tables_crc32c'"), problems
    with pytest.raises(reader.DumpError, match="tables_crc32c"):
        open_quietly(dump).load("target", 0, 0)


# ------------------------------------------------------------------------------- name table


def test_name_table_with_non_string_entries(dump, expected):
    set_names(seg(dump, 0), [0, 1, 2, "Sequential"])
    ds = open_quietly(dump)
    with pytest.warns(UserWarning, match="not a list of strings"):
        with pytest.raises(reader.DumpError, match="seg-000000.h5"):
            ds.load("target", 0, 0)
    assert same(ds.load("target", 0, 2)["0"], expected[2]["0"])
    code, problems, _ = verify(dump)
    assert code == 1 and has(problems, "seg-000000.h5", "name table"), problems


def test_verify_fails_a_name_table_naming_two_slots_alike(dump):
    set_names(seg(dump, 0), ["0", "0", "2", "Sequential"])
    code, problems, _ = verify(dump)
    assert code == 1 and has(problems, "seg-000000.h5", "'0'"), problems


def test_reader_is_consistent_about_a_name_listed_twice(dump, expected):
    set_names(seg(dump, 0), ["0", "0", "2", "Sequential"])
    with fastdump.open(dump) as ds:
        try:
            loaded = ds.load("target", 0, 0)
            one = ds.tensor("target", 0, "0", 0)
            series = ds.series("target", 0, "0")
        except reader.DumpError:
            return  # refusing the segment is fine too
        assert list(loaded) == ["0", "0#dup1", "2", "Sequential"]
        assert same(one, loaded["0"]) and same(series[0], loaded["0"])


def test_unicode_nul_slash_and_very_long_names_read_back(dump, expected, capsys):
    names = ["модуль.0/α\x00β", "x" * 100_000, "\u202eevil\x1b[2J", "😀.\ud800"]
    for number in range(3):
        set_names(seg(dump, number), names)
    code, problems, _ = verify(dump, "--data")
    assert code == 0, problems
    with fastdump.open(dump) as ds:
        assert ds.names("target", 0) == names
        for p in range(PASSES):
            got = ds.load("target", 0, p, check=True)
            assert list(got) == names
            assert all(same(got[new], expected[p][old]) for new, old in zip(names, NAMES))
        assert same(ds.tensor("target", 0, names[1], 3), expected[3]["1"])
        assert sorted(ds.series("target", 0, names[3])) == list(range(PASSES))
    capsys.readouterr()
    assert cli_dump.main(["show", str(dump), "--pass", "1"]) == 0
    out = capsys.readouterr()
    assert "\x1b" not in out.out and "\x00" not in out.out and "\\x1b" in out.out


# ------------------------------------------------------------------------------ block dtypes


def _replace_block0(path, data, **attrs):
    with h5py.File(path, "r+") as f:
        old = dict(f["blocks"]["0"].attrs)
        del f["blocks"]["0"]
        f["blocks"].create_dataset("0", data=data)
        for key, value in {**old, **attrs}.items():
            f["blocks"]["0"].attrs[key] = value


@pytest.mark.parametrize("kind, verify_text, reader_text", [
    ("int32-storage", "stored as int32, expected float32", "stored as int32, expected float32"),
    ("bfloat16-attr", "stored as float32, expected uint16", "stored as float32, expected uint16"),
    ("numeric-dtype-attr", "unknown dtype attribute", "unknown dtype attribute '7'"),
    ("scalar-2d", "scalar block must be 1-D", "does not fit scalar rows"),
])
def test_block_whose_dtype_or_shape_disagrees_with_its_attributes(dump, kind, verify_text, reader_text):
    path = seg(dump, 0)
    with h5py.File(path, "r") as f:
        data = f["blocks"]["0"][()]
    if kind == "int32-storage":
        _replace_block0(path, data.astype(np.int32))
    elif kind == "bfloat16-attr":
        _replace_block0(path, data, dtype="bfloat16", encoding="raw-bits")
    elif kind == "numeric-dtype-attr":
        _replace_block0(path, data, dtype=7)
    else:
        _replace_block0(path, data, scalar=1)
    code, problems, _ = verify(dump, "--data")
    assert code == 1 and has(problems, "seg-000000.h5 block 0", verify_text), problems
    with fastdump.open(dump) as ds:
        with pytest.raises(reader.DumpError, match=reader_text):
            ds.load("target", 0, 0)
        with pytest.raises(reader.DumpError, match="seg-000000.h5 block 0"):
            ds.series("target", 0, "0")
        assert list(ds.load("target", 0, 0, select=lambda n: n != "0")) == NAMES[1:]  # block 0 not read


def test_wrong_encoding_attribute_fails_verify_and_the_reader(dump, expected):
    """A block's attributes say how its bytes read back: one changed after writing is damage, and
    the reader refuses the block rather than guess which attribute is right (format 4's block CRC)."""
    with h5py.File(seg(dump, 0), "r+") as f:
        f["blocks"]["0"].attrs["encoding"] = "raw-bits"
    code, problems, _ = verify(dump)
    assert code == 1 and has(problems, "block 0", "encoding 'raw-bits', expected 'native'"), problems
    assert has(problems, "block 0", "changed after it was written"), problems
    with fastdump.open(dump) as ds:
        with pytest.raises(reader.DumpError, match="block 0"):
            ds.load("target", 0, 0, check=True)
        others = ds.load("target", 0, 0, select=lambda name: name != "0")  # other blocks read as before
        assert others and all(same(t, expected[0][name]) for name, t in others.items())


# ---------------------------------------------------------------------------------- checksums


def test_a_stored_crc_that_does_not_match(dump, expected):
    def change(index):
        index["crc32c"][5] ^= 1  # pass 1, '1'
        return index

    rewrite(seg(dump, 0), "index", change)
    code, problems, _ = verify(dump)
    assert code == 0, problems  # without --data the bytes are not read (documented)
    code, problems, _ = verify(dump, "--data")
    assert code == 1 and problems == [
        f"{seg(dump, 0)} block 1: index row 5 (pass 1): checksum mismatch: the data changed after it was written"]
    with fastdump.open(dump) as ds:
        with pytest.raises(reader.DumpError, match=r"index row 5 \(pass 1, '1'\): checksum"):
            ds.load("target", 0, 1, check=True)
        with pytest.raises(reader.DumpError, match="checksum"):
            ds.tensor("target", 0, "1", 1, check=True)
        with pytest.raises(reader.DumpError, match="checksum"):
            ds.series("target", 0, "1", check=True)
        assert same(ds.load("target", 0, 0, check=True)["1"], expected[0]["1"])  # pass 0's row is fine


def test_data_flipped_in_place_is_caught_by_verify_data(dump):
    with h5py.File(seg(dump, 1), "r+") as f:
        block = f["blocks"]["2"]
        data = block[()]
        data.view(np.uint32)[3, 1] ^= 1 << 30  # pass 3, '2'
        block[...] = data
    assert verify(dump)[0] == 0
    code, problems, _ = verify(dump, "--data")
    assert code == 1 and has(problems, "seg-000001.h5 block 2", "index row 6 (pass 3)", "checksum mismatch")
    with fastdump.open(dump) as ds:
        with pytest.raises(reader.DumpError, match="checksum"):
            ds.load("target", 0, 3, check=True)


# ------------------------------------------------------------------------ pass ids, segments


def test_passes_out_of_order_across_segments(dump, expected):
    relabel_passes(seg(dump, 0), {0: 2, 1: 3})
    relabel_passes(seg(dump, 1), {2: 0, 3: 1})

    def change(info):
        info["segments"][0].update(first_pass=2, last_pass=3)
        info["segments"][1].update(first_pass=0, last_pass=1)

    edit_rank_json(dump, change)
    code, problems, _ = verify(dump)
    assert code == 1 and has(problems, "seg-000001.h5 passes 0..1 overlap seg-000000.h5 passes 2..3"), problems
    with fastdump.open(dump) as ds:  # the reader returns what each file says
        assert ds.passes("target", 0) == list(range(PASSES))
        assert same(ds.load("target", 0, 0)["0"], expected[2]["0"])


def test_cuda_graph_replays_between_eager_passes_do_not_overlap_across_segments(dump, expected):
    """Replay passes (numbered from GRAPH_PASS_BASE) arrive between eager passes, so a segment's
    min..max spans both kinds: seg 0 holds eager 0 and replay B, seg 1 eager 2 and replay B+1.
    That is a legitimate dump: ranges are disjoint for each kind, and verify must not call it an
    overlap. Two segments whose replays do overlap still fail."""
    from fastdump import protocol

    base = protocol.GRAPH_PASS_BASE
    relabel_passes(seg(dump, 0), {0: 0, 1: base})
    relabel_passes(seg(dump, 1), {2: 2, 3: base + 1})

    def change(info):
        info["segments"][0].update(first_pass=0, last_pass=base)
        info["segments"][1].update(first_pass=2, last_pass=base + 1)

    edit_rank_json(dump, change)
    code, problems, _ = verify(dump)
    assert code == 0, problems
    with fastdump.open(dump) as ds:
        assert ds.passes("target", 0) == [0, 2, 4, base, base + 1]
        assert same(ds.load("target", 0, base + 1)["0"], expected[3]["0"])
    relabel_passes(seg(dump, 1), {2: 2, base + 1: base})  # now both segments hold replay B
    edit_rank_json(dump, lambda info: info["segments"][1].update(last_pass=base))
    code, problems, _ = verify(dump)
    assert code == 1 and has(problems, f"seg-000001.h5 passes {base}..{base} overlap seg-000000.h5"), problems


def test_negative_and_huge_pass_ids_read_back_without_error(dump, expected):
    huge = (1 << 62) + 3
    relabel_passes(seg(dump, 0), {0: -7, 1: -6})
    relabel_passes(seg(dump, 2), {4: huge})
    code, problems, _ = verify(dump, "--data")  # rank.json still says 0..1 and 4
    assert code == 1
    assert has(problems, "seg-000000.h5: segments.jsonl says first_pass=0, file has -7"), problems
    assert has(problems, f"seg-000002.h5: segments.jsonl says first_pass=4, file has {huge}"), problems
    with fastdump.open(dump) as ds:
        assert ds.passes("target", 0) == [-7, -6, 2, 3, huge]
        assert same(ds.load("target", 0, -6, check=True)["2"], expected[1]["2"])
        assert same(ds.load("target", 0, huge, check=True)["Sequential"], expected[4]["Sequential"])
        with pytest.raises(KeyError):
            ds.load("target", 0, 0)
        assert ds.meta("target", 0, huge)["tensors"] == 4


def test_a_continued_pass_with_a_name_in_both_segments(dump, expected):
    """The writer may flush a pass still open (complete = 0) and continue it in the next segment.
    Here seg 0's pass 1 is marked so and seg 1's pass 2 is relabelled 1: pass 1 then holds each
    name twice, as a capture bug that named two tensors alike would leave across a 4x-limit flush."""
    def incomplete(passes):
        passes["complete"][1] = 0
        return passes

    rewrite(seg(dump, 0), "passes", incomplete)
    set_attrs(seg(dump, 0), complete=0)
    relabel_passes(seg(dump, 1), {2: 1, 3: 3})

    def change(info):
        info["segments"][0]["complete"] = False
        info["segments"][1].update(first_pass=1)
        info["stats"]["passes"] = 4  # the Dumper's own count of this crafted history

    edit_rank_json(dump, change)
    with fastdump.open(dump) as ds:
        got = ds.load("target", 0, 1)
        assert list(got) == NAMES + [n + "#dup1" for n in NAMES]  # the reader keeps both, renamed
    code, problems, _ = verify(dump)
    assert code == 1 and has(problems, "pass 1", "'0'"), problems


def test_a_pass_continued_and_ended_in_the_next_segment_verifies_without_a_warning(dump, expected):
    """A pass the writer flushed unfinished (complete = 0, no reason: it had not ended yet) and ended
    in the next segment is whole: verify neither fails nor warns of it as a pass whose end never
    came (only a pass whose last part on disk is not complete is one)."""
    def incomplete(passes):
        passes["complete"][1] = 0
        passes["dropped"][1] = 2  # (each part counts the drops of its own tensors)
        return passes

    def dropped(passes):
        passes["dropped"][0] = 3
        return passes

    rewrite(seg(dump, 0), "passes", incomplete)
    relabel_passes(seg(dump, 1), {2: 1, 3: 3})
    rewrite(seg(dump, 1), "passes", dropped)
    set_names(seg(dump, 1), [f"rest.{name}" for name in NAMES])  # its second part: other names
    # (format 6: the count of the tensors sent is on the part the pass's end reached, for both parts)
    set_pass_meta(seg(dump, 0), 1, lambda entry: entry.pop(fmt.PASS_SENT))
    set_pass_meta(seg(dump, 1), 1, lambda entry: entry.update({fmt.PASS_SENT: 2 * len(NAMES)}))

    def change(info):
        info["segments"][0]["complete"] = False
        info["segments"][1].update(first_pass=1)
        info["stats"]["passes"] = 4  # the Dumper's own count of this crafted history

    edit_rank_json(dump, change)
    code, problems, warnings = verify(dump)
    assert (code, problems, warnings) == (0, [], []), (problems, warnings)
    with fastdump.open(dump) as ds:
        assert list(ds.load("target", 0, 1, check=True)) == NAMES + [f"rest.{name}" for name in NAMES]
        meta = ds.meta("target", 0, 1)
        assert (meta["complete"], meta["dropped"], meta["tensors"]) == (True, 5, 2 * len(NAMES)), meta


def test_a_whole_pass_found_again_in_the_next_segment_is_not_read_as_one(dump, expected):
    """Seg 1's pass 2 relabelled 1 and rank.json made to agree: pass 1 is whole (complete) in seg 0
    and again in seg 1. Which copy is the pass is unknown: the reader refuses it rather than
    merging both into one pass with every name twice; verify fails the overlap."""
    relabel_passes(seg(dump, 1), {2: 1, 3: 3})
    edit_rank_json(dump, lambda info: info["segments"][1].update(first_pass=1))
    ds = open_quietly(dump)
    with pytest.raises(reader.DumpError, match="pass 1"):
        ds.load("target", 0, 1)
    assert all(same(ds.load("target", 0, 3)[n], expected[3][n]) for n in NAMES)
    code, problems, _ = verify(dump)
    assert code == 1 and has(problems, "seg-000001.h5 passes 1..3 overlap seg-000000.h5 passes 0..1"), problems


def test_a_segment_renamed_leaving_a_gap(dump, expected):
    os.rename(seg(dump, 1), seg(dump, 3))
    code, problems, _ = verify(dump)
    assert code == 1
    assert has(problems, "seg-000001.h5 is listed in segments.jsonl but missing"), problems
    assert has(problems, "seg-000003.h5 is not listed in segments.jsonl"), problems
    with fastdump.open(dump) as ds:  # the data itself is all there
        assert ds.passes("target", 0) == list(range(PASSES))
        assert same(ds.load("target", 0, 3, check=True)["1"], expected[3]["1"])


def test_a_renamed_segment_whose_number_attribute_disagrees(dump):
    """The last segment renamed seg-000004.h5 (a gap: 2 and 3 missing) and rank.json made to agree:
    only the file's own ``segment`` attribute (2) tells."""
    os.rename(seg(dump, 2), seg(dump, 4))
    edit_rank_json(dump, lambda info: info["segments"][2].update(file="seg-000004.h5"))
    code, problems, _ = verify(dump)
    assert code == 1 and has(problems, "seg-000004.h5", "segment"), problems


def test_a_segment_from_another_session_copied_in(dump, pristine, tmp_path):
    """A second real dump's segment dropped into this rank directory, renumbered past the end."""
    other = tmp_path / "other"
    model = make_model()
    d = fastdump.attach(model, str(other), segment_passes=10, segment_idle_seconds=0)
    with torch.inference_mode():
        for p in range(7):
            model(model_input(100 + p))
    d.close()
    shutil.copy(rank_dir(other) / "seg-000000.h5", seg(dump, 3))  # passes 0..6: overlap
    code, problems, _ = verify(dump)
    assert code == 1 and has(problems, "seg-000003.h5 is not listed in segments.jsonl")
    assert has(problems, "seg-000003.h5 passes 0..6 overlap"), problems


# ------------------------------------------------------------------------------- rank.json


@pytest.mark.parametrize("change, text", [
    (lambda i: i.update(passes=7), "rank.json total passes=7 but its segments add up to 5"),
    (lambda i: i.update(tensors=12), "rank.json total tensors=12 but its segments add up to 20"),
    (lambda i: i["stats"].update(passes=7), "the Dumper dumped 7 passes; 5 are on disk"),
    (lambda i: i["stats"].update(tensors=25), "the Dumper staged 25 tensors; 20 are on disk"),
    (lambda i: i["stats"].update(passes=6), "the Dumper dumped 6 passes; 5 are on disk"),  # one lost is loss too
    (lambda i: i["stats"].update(tensors=21), "the Dumper staged 21 tensors; 20 are on disk (0 recorded as skipped)"),
    (lambda i: i["segments"][0].update(tensors=10), "seg-000000.h5: segments.jsonl says tensors=10, file has 8"),
    (lambda i: i["segments"][2].update(last_pass=6, passes=3), "seg-000002.h5: segments.jsonl says last_pass=6"),
    (lambda i: i.update(segments=i["segments"][:2], passes=4, tensors=16, bytes=320),
     "seg-000002.h5 is not listed in segments.jsonl"),
    (lambda i: i["segments"].append(dict(i["segments"][2], file="seg-000003.h5", first_pass=5, last_pass=5)),
     "seg-000003.h5 is listed in segments.jsonl but missing"),
    (lambda i: i.update(passes="5"), "rank.json total passes=5 but its segments add up to 5"),
    # a list the writer got wrong, its checksum right: verify said OK
    (lambda i: i["segments"].append(i["segments"][1]), "seg-000001.h5 is listed twice in segments.jsonl"),
    (lambda i: i["segments"].insert(0, i["segments"].pop(1)),
     "segments.jsonl lists seg-000000.h5 after a later segment (it lists them in write order)"),
], ids=["passes-more", "tensors-fewer", "stats-passes", "stats-tensors", "stats-one-pass", "stats-one-tensor",
        "segment-tensors", "segment-range",
        "segment-unlisted", "segment-lost", "passes-string", "segment-twice", "segments-out-of-order"])
def test_rank_json_claims_that_disagree_with_the_segments(dump, expected, change, text):
    edit_rank_json(dump, change)
    code, problems, _ = verify(dump)
    assert code == 1 and has(problems, text), problems
    with fastdump.open(dump) as ds:
        assert same(ds.load("target", 0, 4, check=True)["2"], expected[4]["2"])


def _torn_before_lost_tensors(info):
    """A rank.json from before ``lost_tensors``: the torn tensors only under skipped_reasons."""
    info.pop("lost_tensors", None)
    info.update(skipped=2, skipped_reasons={fmt.TORN_TENSOR_REASON: 2})


@pytest.mark.parametrize("change, text", [
    (lambda i: i.update(error="disk on fire"), "status closed, but an error was recorded: disk on fire"),
    (_torn_before_lost_tensors, "2 staged tensor(s) were lost after they were accepted: torn (part of their copies "
     "failed, a CUDA drain error) or not stored by the writer (each pass's skipped list says which and why); "
     "they are not on disk"),
    (lambda i: i["stats"].update(graphs_not_dumped=1), "1 CUDA graph(s) captured while dumping cannot be dumped: "
     "their replays ran unseen (see the capture pass's incomplete reason)"),
    (lambda i: i.update(late_pass_ends_left_out=1), "1 pass end(s) never reached the writer in time (ring full): "
     "those passes are stored incomplete, without their drop counts, metadata and skips"),
    (lambda i: (i.update(dropped=3), i["config"].pop("policy")), "policy 'block': 3 tensor(s) and 0 whole pass(es) "
     "were dropped (counted, not dumped): the writer fell behind for longer than block_timeout_s, or CUDA-graph "
     "replays outran the drain"),
    (lambda i: i["stats"].update(lost_at_close=2, tensors=22), "2 staged tensor(s) were lost at close: a CUDA-graph "
     "capture still running on another stream held their batch"),
    (lambda i: (i.update(late_pass_ends_left_out=1), i["config"].pop("policy")),  # (block, the default)
     "1 pass end(s) never reached the writer in time (ring full): those passes are stored incomplete, without "
     "their drop counts, metadata and skips"),
], ids=["error-recorded", "torn-before-lost-tensors", "graphs-not-dumped", "late-ends", "drop-default-policy",
        "lost-at-close", "late-ends-default-policy"])
def test_rank_json_records_of_a_loss_fail_verify_alone(dump, expected, change, text):
    """Each record of a loss in an otherwise whole dump's rank.json is exactly one problem."""
    edit_rank_json(dump, change)
    # (a config edited in rank.json, policy left to its default, is the session's: so is the root's record of it)
    _edit_manifest(dump, lambda manifest: manifest.update(config=rank_json(dump)["config"]))
    code, problems, _ = verify(dump)
    assert code == 1 and problems == [f"{rank_dir(dump)}: {text}"], problems
    with fastdump.open(dump) as ds:
        assert same(ds.load("target", 0, 4, check=True)["2"], expected[4]["2"])


@pytest.mark.parametrize("content", ["", "{broken", "null", "42", '{"status": "closed", "segments": [1, "x"]}'],
                         ids=["empty", "not-json", "null", "number", "segment-entries-not-objects"])
def test_rank_json_damaged(dump, expected, content, capsys):
    (rank_dir(dump) / "rank.json").write_text(content)
    code, problems, _ = verify(dump)
    assert code == 1 and has(problems, "rank.json"), problems
    with fastdump.open(dump) as ds:
        info = ds.rank_info("target", 0)
        assert isinstance(info, dict)
        assert same(ds.load("target", 0, 1, check=True)["1"], expected[1]["1"])
    capsys.readouterr()
    assert cli_dump.main(["ls", str(dump)]) == 0


@pytest.mark.parametrize("bad_file", [["seg-000000.h5"], {"a": 1}])
def test_rank_json_segment_file_of_the_wrong_type(dump, bad_file):
    edit_rank_json(dump, lambda info: info["segments"][0].update(file=bad_file))
    code, problems, _ = verify(dump)
    assert code == 1 and has(problems, "segments.jsonl segments entry without a file name"), problems


@pytest.mark.parametrize("entry", ["verify", "reader", "ls"])
def test_deeply_nested_rank_json(dump, entry, capsys):
    (rank_dir(dump) / "rank.json").write_text("[" * 100_000 + "]" * 100_000)
    if entry == "verify":
        code, problems, _ = verify(dump)
        assert code == 1 and has(problems, "rank.json"), problems
    elif entry == "reader":
        with fastdump.open(dump) as ds:
            assert ds.rank_info("target", 0) == {}
            assert any("rank.json" in p for p in ds.problems)
    else:
        assert cli_dump.main(["ls", str(dump)]) == 0


def test_a_producer_error_makes_a_closed_ranks_torn_list_tail_what_an_interrupted_writer_leaves(dump):
    """producer_error.json: the serving process stopped dumping, its writer dead or stuck. Its
    rank.json may still say closed, but the writer may have been cut off mid-append: a torn tail of
    segments.jsonl is then a warning, and the failure is the producer error (exactly one problem)."""
    path = rank_dir(dump)
    (path / fmt.PRODUCER_ERROR_FILE).write_text(json.dumps({"error": "writer stuck for 60 s"}))
    with open(path / fmt.SEGMENT_LIST_FILE, "ab") as f:
        f.write(b'{"file": "seg-000009.h5", "first_')
    code, problems, warnings = verify(dump)
    assert code == 1 and problems == [
        f"{path}: the serving process stopped dumping (producer_error.json): writer stuck for 60 s"], problems
    assert f"{path}: segments.jsonl holds 33 bytes after the lines rank.json commits (status error: what an " \
           "interrupted writer leaves; not read)" in warnings, warnings


@pytest.mark.parametrize("file", ["producer_error", "manifest"])
def test_deeply_nested_other_json(dump, file):
    path = rank_dir(dump) / "producer_error.json" if file == "producer_error" else dump / "fastdump.json"
    path.write_text("{\"a\":" * 50_000 + "1" + "}" * 50_000)
    if file == "producer_error":
        code, problems, _ = verify(dump)
        assert code == 1 and has(problems, "producer_error.json"), problems
    else:
        with fastdump.open(dump) as ds:
            assert ds.manifest == {}


@pytest.mark.parametrize("damage,text", [
    ("dir", "not a regular file"), ("fifo", "not a regular file"), ("garbage", "not valid JSON"),
    ("list", "not a JSON object"), ("nested", "not valid JSON"),
])
def test_a_damaged_fastdump_json_fails_verify(dump, damage, text):
    """fastdump.json, the run's record, as a directory, a FIFO or damaged: `ls` warned, verify said OK."""
    path = dump / "fastdump.json"
    path.unlink()
    if damage == "dir":
        path.mkdir()
    elif damage == "fifo":
        os.mkfifo(path)
    else:
        path.write_text({"garbage": "{not json", "list": "[1, 2]", "nested": "[" * 100_000}[damage])
    code, problems, _ = verify(dump)
    assert code == 1 and has(problems, "fastdump.json", text), problems
    path.rmdir() if damage == "dir" else path.unlink()
    assert verify(dump)[0] == 0  # absent: a root whose first Dumper wrote none


@pytest.mark.parametrize("kind", ["fifo", "file"])
def test_a_session_name_that_is_not_a_directory_fails_verify(dump, kind):
    """A second session's directory replaced by a FIFO or a file (a copy gone wrong): verify skipped
    the entry without a word and said OK for the session that is still there."""
    name = rank_dir(dump).name
    name = name[:-1] + ("1" if name.endswith("0") else "0")  # another session id of that rank
    assert fmt.parse_rank_dir(name)
    path = dump / "target" / name
    os.mkfifo(path) if kind == "fifo" else path.write_bytes(b"not a directory")
    code, problems, _ = verify(dump)
    assert code == 1 and has(problems, name, "not a directory"), problems
    path.unlink()
    assert verify(dump)[0] == 0


@pytest.mark.parametrize("name", ["draft", "manifest-role"])
@pytest.mark.parametrize("kind", ["fifo", "file"])
def test_a_role_name_that_is_not_a_directory_fails_verify(dump, kind, name):
    """A root entry named as a role (target, draft, or fastdump.json's role) that is not a
    directory: verify skipped it as "no role" and said OK, though that role's dump is not there."""
    if name == "manifest-role":
        manifest = json.loads((dump / fmt.MANIFEST_FILE).read_text())
        manifest["config"]["role"] = name = "verifier"
        del manifest["session"]  # (a record from before it named its session: its config is held against none)
        (dump / fmt.MANIFEST_FILE).write_text(json.dumps(manifest))
    path = dump / name
    os.mkfifo(path) if kind == "fifo" else path.write_bytes(b"not a directory")
    code, problems, _ = verify(dump)
    assert code == 1 and has(problems, str(path), "named as a role but not a directory"), problems
    assert len(problems) == 1, problems
    path.unlink()
    assert verify(dump)[:2] == (0, [])


def _two_roles(root):
    """A root written by two Dumpers: role target (fastdump.json's, written first) and role reward,
    one pass each (other inputs). Returns what each role's pass 0 computed."""
    model, out = make_model(), {}
    for role, p in (("target", 0), ("reward", 1)):
        with fastdump.attach(model, str(root), role=role, writer="thread") as d, torch.inference_mode():
            model(model_input(p))
        assert d.stats()["status"] == "closed"
        with torch.inference_mode():
            out[role] = expected_pass(model, p)
    return out


@pytest.mark.parametrize("damage", ["file", "fifo", "removed", "emptied"])
def test_a_lost_role_of_another_name_fails_verify(tmp_path, damage):
    """A role named neither target, draft nor in fastdump.json (attach(role="reward") on a root whose
    fastdump.json a target Dumper wrote) left no trace at the root: its directory replaced by a
    file, deleted, or emptied of its sessions, verify said OK. The root now records each role
    attached (fastdump.roles/<role>), and verify names the role whose dump is not there."""
    root = tmp_path / "dump"
    expected = _two_roles(root)
    assert sorted(os.listdir(root / fmt.ROLES_DIR)) == ["reward", "target"]
    assert json.loads((root / fmt.MANIFEST_FILE).read_text())["config"]["role"] == "target"
    assert verify(root, "--data")[:2] == (0, [])
    with fastdump.open(root) as ds:
        assert ds.roles == ["reward", "target"]
        for role in ("target", "reward"):
            got = ds.load(role, 0, 0)  # (each session's passes start at 0)
            assert list(got) == NAMES and all(conftest.same_bits(got[n], expected[role][n]) for n in NAMES)
    reward = root / "reward"
    if damage == "emptied":
        for session in os.listdir(reward):
            shutil.rmtree(reward / session)
    else:
        shutil.rmtree(reward)
        if damage == "file":
            reward.write_bytes(b"")
        elif damage == "fifo":
            os.mkfifo(reward)
    code, problems, _ = verify(root)
    why = {"file": "this is not a directory", "fifo": "this is not a directory", "removed": "its directory is gone",
           "emptied": "its directory holds no rank directory"}[damage]
    assert code == 1 and problems == [f"{reward}: role 'reward' was attached here (fastdump.roles/reward) but {why}"
                                      + (": that role's dump is not here" if damage != "emptied"
                                         else ": its sessions were removed")], problems
    with fastdump.open(root) as ds:  # the reader reads what is there, and says what verify says is lost
        assert ds.roles == ["target"]
        assert ds.problems == problems and [p.kind for p in ds.problems] == [reader.Problem.LOST_ROLE]
    other = tmp_path / "other"
    _two_roles(other)
    with fastdump.open([other, root]) as multi:  # (several roots: each root's losses)
        assert multi.problems == problems
        assert all(conftest.same_bits(ds.load("target", 0, 0)[n], expected["target"][n]) for n in NAMES)


def test_a_root_written_before_the_role_record_reads_and_verifies(dump, expected):
    """Dumps written before fastdump.roles existed have none: nothing to check, nothing refused."""
    shutil.rmtree(dump / fmt.ROLES_DIR)
    assert verify(dump, "--data")[:2] == (0, [])
    assert reader.lost_roles(dump) == [] and reader.recorded_roles(dump) == []
    with fastdump.open(dump) as ds:
        got = ds.load("target", 0, 4)
        assert all(conftest.same_bits(got[n], expected[4][n]) for n in NAMES)
    shutil.rmtree(dump / "target")  # (and without the record, a removed role is not noticed: known)
    assert verify(dump)[1] == [f"{dump}: no rank directories (expected <root>/<role>/<rank>/rank.json)"]


def test_the_role_record_replaced_by_a_file_fails_verify_and_attach_says_why(dump, tmp_path):
    """fastdump.roles that is not a directory: the record of the roles attached is not there (verify
    fails); an attach to that root cannot record its role and says so (strict: raises)."""
    shutil.rmtree(dump / fmt.ROLES_DIR)
    (dump / fmt.ROLES_DIR).write_bytes(b"")
    code, problems, _ = verify(dump)
    assert code == 1 and problems == [f"{dump / fmt.ROLES_DIR}: not a directory: the root's record of the roles "
                                      "attached is not here"], problems
    with pytest.raises(FileExistsError, match="fastdump.roles is not a directory"):
        fastdump.attach(make_model(), str(dump), role="reward", writer="thread", strict=True)
    d = fastdump.attach(make_model(), str(dump), role="reward", writer="thread")
    assert d.close()["status"] == "error" and "fastdump.roles is not a directory" in d.stats()["error"]


def test_two_attaches_recording_one_role_at_once_leave_one_whole_marker(tmp_path):
    """Processes attaching to one root at once each write the role's marker through a temporary file
    and a rename: whoever renames last, the marker is whole, and no temporary file is left."""
    import threading

    from fastdump.capture.manifest import write_role_marker

    start = threading.Barrier(8)

    def attach_one():
        start.wait()
        write_role_marker(tmp_path, "reward")

    threads = [threading.Thread(target=attach_one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert os.listdir(tmp_path / fmt.ROLES_DIR) == ["reward"]
    assert json.loads((tmp_path / fmt.ROLES_DIR / "reward").read_text()) == {"role": "reward"}


def test_two_processes_attaching_two_roles_to_one_root_both_are_recorded(tmp_path):
    import subprocess
    import sys

    code = ("import sys, torch, fastdump\n"
            "m = torch.nn.Linear(4, 3)\n"
            "with fastdump.attach(m, sys.argv[1], role=sys.argv[2], writer='thread'), torch.inference_mode():\n"
            "    m(torch.ones(2, 4))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path), role], env=env) for role in ("a", "b")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert sorted(os.listdir(tmp_path / fmt.ROLES_DIR)) == ["a", "b"]
    assert verify(tmp_path)[:2] == (0, [])
    shutil.rmtree(tmp_path / "b")
    assert has(verify(tmp_path)[1], "role 'b'", "its directory is gone")


# Two processes attaching to one root at once, each with its role and config (argv: root, role, a
# directory to meet in). Each stops where it is about to write fastdump.json (fsutil.temp_path of that
# name), so that both have decided to write it before either has; "b" then waits until "a" has
# attached and read the record back. Prints the record as "a" read it.
_ATTACH_AT_ONCE = """
import os, sys, time, torch, fastdump
from fastdump import format as fmt, fsutil
root, role, meeting = sys.argv[1:4]
real_temp_path = fsutil.temp_path

def wait_for(*names):
    deadline = time.monotonic() + 60
    while not all(os.path.exists(os.path.join(meeting, name)) for name in names):
        assert time.monotonic() < deadline, names
        time.sleep(0.001)

def meet(point):
    open(os.path.join(meeting, point + "." + role), "w").close()
    wait_for(point + ".a", point + ".b")

def temp_path(path, *args, **kwargs):
    if os.path.basename(path) == fmt.MANIFEST_FILE:
        meet("writing")
        if role == "b":
            wait_for("read.a")
    return real_temp_path(path, *args, **kwargs)

fsutil.temp_path = temp_path
model = torch.nn.Linear(4, 3)
meet("start")
with fastdump.attach(model, root, role=role, writer="thread", segment_passes=1 if role == "a" else 7), \
        torch.inference_mode():
    seen = open(os.path.join(root, fmt.MANIFEST_FILE)).read()
    open(os.path.join(meeting, "read." + role), "w").close()
    model(torch.ones(2, 4))
print(seen, end="")
"""


def test_two_processes_attaching_at_once_never_replace_the_roots_record(tmp_path):
    """fastdump.json was written "if absent": a check, then a temporary file renamed into place. Two
    processes attaching at once both found it absent; the later rename replaced the record the first
    had written and read back, so the root's record of its config changed under a reader. Now it is
    made once (hard link of the temporary file: fails where one exists), and names the session whose
    config it holds, which verify holds against that session's rank.json."""
    import subprocess
    import sys

    root, meeting = tmp_path / "dump", tmp_path / "meeting"
    meeting.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    procs = [subprocess.Popen([sys.executable, "-c", _ATTACH_AT_ONCE, str(root), role, str(meeting)], env=env,
                              stdout=subprocess.PIPE, text=True) for role in ("a", "b")]
    seen = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    record = (root / fmt.MANIFEST_FILE).read_text()
    assert record == seen[0]  # what "a" read back right after its attach is the record still
    manifest = json.loads(record)
    (a_dir,) = os.listdir(root / "a")
    assert manifest["session"] == {"role": "a", "rank_dir": a_dir}
    assert manifest["config"] == json.loads((root / "a" / a_dir / "rank.json").read_text())["config"]
    assert manifest["config"]["segment_passes"] == 1
    assert [e for e in os.listdir(root) if fsutil.is_temp_name(e)] == []
    assert verify(root)[:2] == (0, [])


def test_create_json_once_leaves_what_is_there(tmp_path):
    path = str(tmp_path / "record.json")
    assert fsutil.create_json_once(path, {"first": 1}) is True
    assert fsutil.create_json_once(path, {"second": 2}) is False
    assert json.loads(open(path).read()) == {"first": 1}
    os.symlink(tmp_path / "nowhere", tmp_path / "link.json")  # (a dangling link is something: never followed)
    assert fsutil.create_json_once(str(tmp_path / "link.json"), {"x": 1}) is False
    assert not (tmp_path / "nowhere").exists()
    assert sorted(os.listdir(tmp_path)) == ["link.json", "record.json"]


def test_create_json_once_without_hard_links_creates_exclusively(tmp_path, monkeypatch):
    """A file system without hard links (EPERM): the file is created with O_EXCL, once."""
    import errno

    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    path = str(tmp_path / "record.json")
    assert fsutil.create_json_once(path, {"first": 1}) is True
    assert fsutil.create_json_once(path, {"second": 2}) is False
    assert json.loads(open(path).read()) == {"first": 1} and os.listdir(tmp_path) == ["record.json"]


def _edit_manifest(root, change):
    path = root / fmt.MANIFEST_FILE
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("change, text", [
    (lambda m: m["config"].update(segment_passes=7),
     "its config is not the config its session target/{rank_dir} ran with (rank.json): segment_passes: 7 here, 2 there"),
    (lambda m: m["config"].update(role="draft", policy="drop"),
     "its config is not the config its session target/{rank_dir} ran with (rank.json): policy: \"drop\" here, "
     "\"block\" there; role: \"draft\" here, \"target\" there"),
    (lambda m: m.update(session={"role": "target"}), 'its session is {"role": "target"}, not a role and rank directory name'),
    (lambda m: m.update(session={"role": "../x", "rank_dir": "TP0_PP0_Rank0_pid1"}),
     'its session is {"role": "../x", "rank_dir": "TP0_PP0_Rank0_pid1"}, not a role and rank directory name'),
], ids=["one-key", "two-keys", "no-rank-dir", "a-path"])
def test_a_root_record_whose_config_is_not_its_sessions_fails_verify(dump, change, text):
    """fastdump.json names the session whose config it holds: another config there (the record
    replaced by another process's, copied from another root, edited) is not what that session ran."""
    assert verify(dump)[:2] == (0, [])
    _edit_manifest(dump, change)
    code, problems, _ = verify(dump)
    assert code == 1 and problems == [f"{dump / fmt.MANIFEST_FILE}: " + text.replace("{rank_dir}", rank_dir(dump).name)]


def test_a_root_record_naming_a_session_not_here_is_a_warning_and_old_records_pass(dump):
    _edit_manifest(dump, lambda m: m["session"].update(rank_dir="TP0_PP0_Rank0_pid1"))
    code, problems, warnings = verify(dump)
    assert code == 0 and has(warnings, "its session target/TP0_PP0_Rank0_pid1 is not here")
    _edit_manifest(dump, lambda m: (m.pop("session"), m["config"].update(segment_passes=7)))
    assert verify(dump)[:2] == (0, [])  # (a root from before the record: nothing to hold it against)


def _two_sessions(root):
    """Two sessions of role target on one root (a server restarted), one pass each (other inputs).
    Returns their rank directory names in start order and what each one's pass 0 computed."""
    model, out = make_model(), []
    for p in (0, 1):
        with fastdump.attach(model, str(root), role="target", writer="thread") as d, torch.inference_mode():
            model(model_input(p))
        assert d.stats()["status"] == "closed"
        with torch.inference_mode():
            out.append((d.dir.name, expected_pass(model, p)))
    return out


@pytest.mark.parametrize("damage", ["removed", "file", "renamed", "renamed-then-removed"])
def test_a_session_removed_beside_another_of_its_role_fails_verify(tmp_path, damage):
    """One session's rank directory removed while another session of its role remains: the role
    record saw a role with a rank directory, and verify said OK with half the run. The root now
    records each session attached (fastdump.sessions/<role>/<rank directory>); a session renamed
    during the run (its rank.json names its session) is still there."""
    root = tmp_path / "dump"
    sessions = _two_sessions(root)
    names = [name for name, _ in sessions]
    assert sorted(os.listdir(root / fmt.SESSIONS_DIR / "target")) == sorted(names)
    assert verify(root, "--data")[:2] == (0, [])
    gone, kept = root / "target" / names[0], root / "target" / names[1]
    if damage == "removed":
        shutil.rmtree(gone)
    elif damage == "file":
        shutil.rmtree(gone)
        gone.write_bytes(b"")
    else:
        renamed = root / "target" / "moved-aside"
        gone.rename(renamed)
        if damage == "renamed-then-removed":
            shutil.rmtree(renamed)
    code, problems, _ = verify(root)
    if damage == "renamed":
        assert (code, problems) == (0, []), problems
        return
    marker = os.path.join(fmt.SESSIONS_DIR, "target", names[0])
    lost = f"{gone}: session attached here ({marker}) but its rank directory is gone: that session's dump is not here"
    assert code == 1 and lost in problems, problems
    assert reader.lost_records(root) == [(str(gone), lost.split(": ", 1)[1])]
    with fastdump.open(root) as ds:  # the reader reads what is there: the other session, exactly
        assert ds.problems == [lost] and ds.problems[0].kind == reader.Problem.LOST_SESSION
        ds.refresh()
        assert ds.problems == [lost]  # (said once)
        assert ds.ranks("target") == [names[1]]
        got = ds.load("target", names[1], 0)
        assert list(got) == NAMES and all(conftest.same_bits(got[n], sessions[1][1][n]) for n in NAMES)
    assert kept.is_dir()


def test_the_session_record_is_no_role_and_old_roots_have_none(tmp_path):
    """fastdump.sessions holds files named as rank directories: it is no role to the reader or to
    verify's walk, no role may be named so, and a root written before it verifies as before."""
    root = tmp_path / "dump"
    _two_sessions(root)
    with fastdump.open(root) as ds:
        assert ds.roles == ["target"]
    with pytest.raises(ValueError, match="fastdump uses at the dump root"):
        fastdump.attach(torch.nn.Linear(2, 2), str(root), role=fmt.SESSIONS_DIR)
    shutil.rmtree(root / fmt.SESSIONS_DIR)
    assert verify(root)[:2] == (0, []) and reader.lost_sessions(root) == []
    (root / fmt.SESSIONS_DIR).write_bytes(b"")
    assert verify(root)[1] == [f"{root / fmt.SESSIONS_DIR}: not a directory: the root's record of the sessions "
                               "attached is not here"]


@pytest.mark.parametrize("kind", ["fifo", "file"])
def test_other_files_in_the_root_are_allowed(dump, kind):
    """A root may hold other files (notes, a launcher's log): not roles, no problem."""
    for name in ("notes.txt", "drafts", "Target"):
        path = dump / name
        os.mkfifo(path) if kind == "fifo" else path.write_bytes(b"a file")
    assert verify(dump)[:2] == (0, [])


def test_symlinked_rank_json_is_not_followed(dump, tmp_path):
    outside = tmp_path / "outside.json"
    shutil.copy(rank_dir(dump) / "rank.json", outside)
    (rank_dir(dump) / "rank.json").unlink()
    os.symlink(outside, rank_dir(dump) / "rank.json")
    code, problems, _ = verify(dump)
    assert code == 1 and has(problems, "rank.json", "symbolic links are not followed"), problems
    with fastdump.open(dump) as ds:
        assert ds.rank_info("target", 0) == {}
        assert any("rank.json" in p for p in ds.problems)


# ------------------------------------------------------------------------------ segment files


def test_a_segment_replaced_by_a_symlink_to_a_copy(dump, expected, tmp_path):
    copy = tmp_path / "copy.h5"
    shutil.copy(seg(dump, 1), copy)
    seg(dump, 1).unlink()
    os.symlink(copy, seg(dump, 1))
    code, problems, _ = verify(dump)
    assert code == 1 and has(problems, "seg-000001.h5", "not a regular file"), problems
    ds = open_quietly(dump)
    with pytest.warns(UserWarning, match="not a regular file"):
        assert ds.passes("target", 0) == [0, 1, 4]
    with pytest.raises(reader.DumpError, match="no pass 2 in the readable segments"):
        ds.load("target", 0, 2)
    assert same(ds.load("target", 0, 4)["0"], expected[4]["0"])


@pytest.mark.parametrize("kind", ["zero-bytes", "directory", "plain-hdf5", "no-version", "no-tables",
                                  "format-array", "hdf5-garbage-tail", "future-version"])
def test_a_segment_that_is_not_a_fastdump_segment(dump, expected, kind):
    path = seg(dump, 1)
    path.unlink()
    if kind == "zero-bytes":
        path.write_bytes(b"")
        text = "cannot open"
    elif kind == "directory":
        path.mkdir()
        text = "not a regular file"
    elif kind == "hdf5-garbage-tail":
        shutil.copy(seg(dump, 0), path)
        with open(path, "r+b") as f:
            f.seek(2048)
            f.write(os.urandom(path.stat().st_size - 2048))
        text = "seg-000001.h5"
    else:
        with h5py.File(path, "w") as f:
            f.create_dataset("x", data=np.arange(10))
            if kind == "no-version":
                f.attrs["format"] = fmt.FORMAT_NAME
            elif kind == "no-tables":
                f.attrs["format"] = fmt.FORMAT_NAME
                f.attrs["format_version"] = 2
            elif kind == "format-array":
                f.attrs["format"] = np.array([b"fastdump-segment", b"x"])
            elif kind == "future-version":  # (a later format's tables may mean other things)
                f.attrs["format"] = fmt.FORMAT_NAME
                f.attrs["format_version"] = fmt.FORMAT_VERSION + 1
        text = {"plain-hdf5": "not a fastdump segment (format attribute None)",
                "no-version": "format version None", "no-tables": "missing 'names'",
                "format-array": "seg-000001.h5",
                "future-version": f"format version {fmt.FORMAT_VERSION + 1} is not one of "
                                  f"{list(fmt.READABLE_VERSIONS)}"}[kind]
    code, problems, _ = verify(dump, "--data")
    assert code == 1 and has(problems, "seg-000001.h5", text), problems
    ds = open_quietly(dump)
    with pytest.warns(UserWarning, match="seg-000001.h5"):
        assert ds.passes("target", 0) == [0, 1, 4]
    assert any("seg-000001.h5" in p for p in ds.problems)
    with pytest.raises(reader.DumpError, match="no pass 2 in the readable segments"):
        ds.load("target", 0, 2)
    with pytest.raises(reader.DumpError):
        ds.meta("target", 0, 3)
    assert same(ds.load("target", 0, 0, check=True)["Sequential"], expected[0]["Sequential"])


def test_temp_files_left_by_a_crash(dump, expected):
    shutil.copy(seg(dump, 2), rank_dir(dump) / ".seg-000003.h5.tmp")  # a complete one, never renamed
    (rank_dir(dump) / ".rank.json.123-0.tmp").write_text("{")
    code, problems, _ = verify(dump)
    assert code == 1
    assert has(problems, "leftover temporary file .seg-000003.h5.tmp"), problems
    assert has(problems, "leftover temporary file .rank.json.123-0.tmp"), problems
    with fastdump.open(dump) as ds:  # never read
        assert ds.passes("target", 0) == list(range(PASSES))
    only_tmp = dump / "target" / "TP1_PP0_Rank1_pid7"
    only_tmp.mkdir()
    (only_tmp / ".seg-000000.h5.tmp").write_bytes(b"\x89HDF")
    code, problems, _ = verify(dump)
    assert code == 1 and has(problems, "TP1_PP0_Rank1_pid7", "rank.json missing"), problems


def test_verify_reports_never_raise_through_the_cli(dump):
    """Several damages at once: verify lists each, and exits 1."""
    set_names(seg(dump, 2), ["only"])
    (rank_dir(dump) / "rank.json").write_text("{")
    seg(dump, 1).write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 100)
    code, problems, _ = verify(dump, "--data")
    assert code == 1
    assert has(problems, "seg-000002.h5", "name outside the name table")
    assert has(problems, "seg-000001.h5", "cannot open")
    assert has(problems, "rank.json", "not valid JSON")


@pytest.mark.parametrize("change, text", [
    (lambda i: i["stats"].update(passes=6.0), "rank.json stats.passes is 6.0, not a count"),
    (lambda i: i["stats"].update(tensors=24.0), "rank.json stats.tensors is 24.0, not a count"),
    (lambda i: i.update(dropped=2.0), "rank.json dropped is 2.0, not a count"),
    (lambda i: i.update(dropped=-5), "rank.json dropped is -5, not a count"),
    (lambda i: i.update(dropped=float("nan")), "rank.json dropped is NaN, not a count"),
    (lambda i: i["stats"].update(lost_pass_ends=True), "rank.json stats.lost_pass_ends is true, not a count"),
    (lambda i: i["rank"].update(tp_size=1.0), "rank.tp_size is 1.0, expected an integer 1..65536"),
    (lambda i: i["rank"].update(tp_rank="0"), 'rank.tp_rank is "0", expected an integer >= 0'),
], ids=["stats-passes-float", "stats-tensors-float", "dropped-float", "dropped-negative", "dropped-nan",
        "lost-ends-bool", "tp-size-float", "tp-rank-string"])
def test_rank_json_counts_and_ranks_of_the_wrong_type_are_problems(dump, change, text):
    """A count verify cannot read was taken as none: 6.0 passes sent against 5 on disk, or 2.0
    tensors dropped under `block`, passed; ranks diff and export refuse passed verify."""
    edit_rank_json(dump, change)
    code, problems, _ = verify(dump)
    assert code == 1 and has(problems, text), problems


def test_rank_json_with_a_key_twice_is_refused(dump):
    """JSON keeps the last of two keys: one reader could see `"rank": {...tp_size: 1}` and another
    program the first; such a file is refused as damaged."""
    text = (rank_dir(dump) / "rank.json").read_text()
    assert text.startswith("{")
    (rank_dir(dump) / "rank.json").write_text('{"rank": {"tp_size": 2, "tp_rank": 1}, ' + text[1:])
    code, problems, _ = verify(dump)
    assert code == 1 and has(problems, "key 'rank' appears twice"), problems
    with pytest.raises(ValueError, match="appears twice"):
        fsutil.load_json(str(rank_dir(dump) / "rank.json"))


@pytest.mark.parametrize("attribute", ["kept", "removed"])
def test_a_segment_copied_in_from_another_sessions_directory_fails_verify_and_is_not_read(dump, expected, tmp_path,
                                                                                         attribute):
    """Another run's seg-000001.h5 over this one's: rank.json's entry, the tables and every CRC
    still matched, so verify said OK and the reader returned the other run's passes 2 and 3 as
    this session's. Each segment now carries its session id; one whose attribute was removed (no
    CRC covers it: verify said OK again) is refused too, since every format-5 segment of a session
    carries it."""
    other = tmp_path / "other"
    model = make_model()
    with torch.no_grad():
        model[0].weight.add_(1.0)
    d = fastdump.attach(model, str(other), segment_passes=2, segment_idle_seconds=0)
    with torch.inference_mode():
        for p in range(PASSES):
            model(model_input(p))
    d.close()
    with h5py.File(seg(dump, 1), "r") as f:
        assert f.attrs[fmt.ATTR_SESSION] == fmt.parse_rank_dir(rank_dir(dump).name)[4]
    shutil.copy(seg(other, 1), seg(dump, 1))
    if attribute == "removed":
        with h5py.File(seg(dump, 1), "r+") as f:
            del f.attrs[fmt.ATTR_SESSION]
    code, problems, _ = verify(dump, "--data")
    text = "seg-000001.h5: written by session" if attribute == "kept" else "seg-000001.h5: carries no session attribute"
    assert code == 1 and has(problems, text), problems
    assert has(problems, "copied in from another run")
    with pytest.warns(UserWarning, match="copied in from another run"), fastdump.open(dump) as ds:
        assert ds.passes("target", 0) == [0, 1, 4]
        assert same(ds.load("target", 0, 4, check=True)["2"], expected[4]["2"])


def test_a_tp_rank_with_no_directory_is_a_warning_naming_it(tmp_path):
    """rank.json says tp_size 2 and only TP rank 1 is here: verify said OK without a word. Nothing
    fastdump accepted was lost (the rank never attached, or it is another node's root), so this is
    a warning, not a problem; it names the absent rank."""
    for tp_rank in (1,):
        with fastdump.attach(None, tmp_path, tp_rank=tp_rank, tp_size=2, writer="thread") as d:
            d.dump("x", torch.arange(3.0))
    report = cli_dump.verify_dump(str(tmp_path))
    assert not report.problems
    absent = [w for w in report.warnings if "no directory here" in w]
    assert len(absent) == 1 and "TP0_PP0 has no directory here" in absent[0], report.warnings
    with fastdump.attach(None, tmp_path, tp_rank=0, tp_size=2, writer="thread") as d:
        d.dump("x", torch.arange(3.0))
    report = cli_dump.verify_dump(str(tmp_path))
    assert not report.problems and not [w for w in report.warnings if "no directory here" in w], report.warnings


# ------------------------------------------------------------------- truncation and bit flips


def _reads_exact_or_refuses(root, expected) -> list:
    """The passes whose load(check=True) returned anything but the dumped tensors, bit for bit: a
    read may refuse (DumpError, KeyError), never hand back other bits."""
    wrong = []
    with fastdump.open(root) as ds:
        for p, tensors in expected.items():
            try:
                got = ds.load("target", 0, p, check=True)
            except (reader.DumpError, KeyError):
                continue
            if list(got) != list(tensors) or not all(same(got[name], tensors[name]) for name in tensors):
                wrong.append(p)
    return wrong


def test_a_segment_cut_at_any_length_fails_verify_and_never_reads_back_other_bits(dump, expected):
    """A copy or a disk that stopped short: every length from the HDF5 signature to the last byte
    (a stride through the file, and each end of it) fails verify naming the file, and no read
    returns other bits. (One cut, at half, was tested; a cut inside the last data page or after the
    tables read differently.)"""
    path = seg(dump, 1)
    whole = path.read_bytes()
    cuts = sorted({0, 1, 7, 8, 48, 96, 512, len(whole) - 4096, len(whole) - 64, len(whole) - 8, len(whole) - 1}
                  | set(range(0, len(whole), 1499)))
    for cut in cuts:
        path.write_bytes(whole[:cut])
        report = cli_dump.verify_dump(str(dump), read_data=True)
        assert any(p.startswith(str(path)) for p in report.problems), (cut, report.problems)
        with pytest.warns(UserWarning):  # (the reader says which segment it could not read)
            assert _reads_exact_or_refuses(dump, expected) == [], cut
    path.write_bytes(whole)
    assert verify(dump, "--data")[0] == 0


def test_a_bit_flipped_anywhere_in_a_segments_structure_fails_verify_or_changes_nothing_read(dump, expected):
    """One bit flipped in a segment's HDF5 metadata, tables or attributes (every 20th byte that is
    not zero padding, both ends of a byte): verify --data fails naming the file, or the flip
    changed nothing that reads back (a reserved or unused byte); never a read of other bits, never
    an exception out of verify."""
    path = seg(dump, 1)
    whole = path.read_bytes()
    offsets = [i for i in range(len(whole)) if whole[i]][::20]
    passed = 0
    for k, offset in enumerate(offsets):
        damaged = bytearray(whole)
        damaged[offset] ^= 0x01 if k % 2 else 0x80
        path.write_bytes(bytes(damaged))
        report = cli_dump.verify_dump(str(dump), read_data=True)
        if report.problems:
            assert all(p.startswith(str(path)) or str(rank_dir(dump)) in p for p in report.problems), report.problems
        else:
            passed += 1
        with warnings_ignored():
            assert _reads_exact_or_refuses(dump, expected) == [], (offset, report.problems)
    assert passed < len(offsets) // 4, f"{passed} of {len(offsets)} flips passed verify"
    path.write_bytes(whole)


@contextlib.contextmanager
def warnings_ignored():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# ------------------------------------------------------------- sessions copied in or twice


def test_a_rank_directory_copied_in_from_another_dump_fails_verify(dump, tmp_path):
    """Another run's whole rank directory put beside this one's: its segments carry its own session,
    rank.json and list agree, every check passed and verify said OK, though that session never
    attached to this root (fastdump.sessions records every one that did)."""
    other = tmp_path / "other"
    model = make_model()
    d = fastdump.attach(model, str(other), segment_passes=10, segment_idle_seconds=0)
    with torch.inference_mode():
        model(model_input(100))
    d.close()
    assert verify(other)[0] == 0
    (copied,) = os.listdir(other / "target")
    shutil.copytree(other / "target" / copied, dump / "target" / copied)
    code, problems, _ = verify(dump)
    assert code == 1 and problems == [
        f"{dump / 'target' / copied}: a session fastdump.sessions/target does not record as attached to this root "
        "(every Dumper records its session before writing): copied in from another dump"]


def test_one_session_copied_under_another_directory_name_fails_verify(dump):
    """A rank directory copied whole under a name without a session (format 1's, which the reader
    takes with rank.json's session): its segments are its session's, so nothing else failed, and
    every pass of it would be read twice (export wrote both copies)."""
    original = rank_dir(dump)
    copy = dump / "target" / "TP0_PP0_Rank0_pid1"
    shutil.copytree(original, copy)
    code, problems, _ = verify(dump)
    session = fmt.parse_rank_dir(original.name)[4]
    assert code == 1 and len(problems) == 1 and has(problems, str(copy), f"session {session} again", str(original))


def test_a_session_directory_renamed_to_another_sessions_name_fails_verify_and_is_not_read(dump):
    """A rank directory renamed to the name of another session (another session id, rank.json kept):
    its segments are the old session's, and read under the new name they would pass for that other
    session's passes. The name's session is the one its segments must carry (rank.json's is only
    for names without one), so every segment is foreign here, and the recorded session is lost."""
    original = rank_dir(dump)
    session = fmt.parse_rank_dir(original.name)[4]
    other_session = "20200101T000000.000000Z-00000000"
    renamed = dump / "target" / original.name.replace(session, other_session)
    os.rename(original, renamed)
    code, problems, _ = verify(dump)
    assert code == 1, problems
    assert has(problems, f"{renamed / 'seg-000000.h5'}: written by session '{session}', "
                         f"not this directory's '{other_session}': copied in from another run"), problems
    assert has(problems, str(original), "its rank directory is gone"), problems
    with warnings_ignored(), fastdump.open(dump) as ds:
        assert ds.passes("target", 0) == []
        assert all(p.kind == reader.Problem.UNREADABLE_SEGMENT for p in ds.problems
                   if p.path.startswith(str(renamed))), ds.problems
