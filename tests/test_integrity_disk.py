"""Issue 9, what is on disk and how it is read: sessions, a full disk, checksums, crafted dumps.

Every crafted or damaged dump here is made by the test (h5py), never committed.
"""

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest
import torch

import fastdump
from fastdump import _C, dtypes, fsutil, reader
from fastdump.cli import dump as cli_dump
from fastdump import format as fmt
from fastdump.writer.channel_writer import ChannelWriter

from conftest import as_format_4, mount_small_tmpfs, read_rank_json, restamp_tables, write_rank_dir

RANKS = {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "rank": 0}


def write_dir(path, passes, status="closed", stats=None, segment_passes=2):
    """A rank directory written by the real ChannelWriter: {pass: {name: tensor}}."""
    return write_rank_dir(path, passes, rank=RANKS, status=status, stats=stats, segment_passes=segment_passes)


def tensors_of(p):
    return {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3) + p, "b": torch.full((4,), p, dtype=torch.int64),
            "big": torch.full((300, 1024), float(p))}  # 1.2 MB: written straight from the ring's data


RANK_DIR = "TP0_PP0_Rank0_pid100_20260101T000000.000000Z-00000001"


@pytest.fixture
def dump(tmp_path):
    root = tmp_path / "dump"
    write_dir(root / "target" / RANK_DIR, {p: tensors_of(p) for p in range(4)})
    return root


def rank_dir(root):
    return root / "target" / RANK_DIR


def segment(root, number=0):
    return rank_dir(root) / fmt.segment_name(number)


def verify(root, *extra):
    return cli_dump.verify_dump(str(root), read_data="--data" in extra)


def cli(*argv):
    return subprocess.run([sys.executable, "-m", "fastdump", *map(str, argv)], capture_output=True, text=True,
                          timeout=120)


# ------------------------------------------------------------------------------------ CRC32C


def test_crc32c_known_values_and_both_implementations_agree():
    assert _C.crc32c(b"123456789") == 0xE3069283  # the CRC32C check value (RFC 3720)
    assert _C.crc32c(b"") == 0
    data = np.random.default_rng(0).integers(0, 256, 100_003, dtype=np.uint8)
    for start in (0, 1, 3, 7):  # unaligned heads
        part = data[start:]
        assert _C.crc32c(part) == _C.crc32c(part, portable=True)
        assert _C.crc32c(part[5000:], _C.crc32c(part[:5000])) == _C.crc32c(part)  # continues
    assert _C.CRC32C_IMPL in ("sse4.2", "table")
    with pytest.raises(ValueError):
        _C.crc32c(np.zeros((4, 4), np.uint8)[:, ::2])  # not contiguous


def test_every_index_row_carries_the_crc_of_its_tensor(dump):
    with h5py.File(segment(dump), "r") as f:
        assert f.attrs["format_version"] == fmt.FORMAT_VERSION == 6
        index = f["index"][()]
        assert f.attrs[fmt.ATTR_TABLES_CRC] == fmt.tables_crc32c(
            f["names"][()], index, f["passes"][()], f["pass_meta"][()])
        assert index.dtype == fmt.INDEX_DTYPE
        for row in index:
            rows = f["blocks"][str(row["block"])][row["first_row"]:row["first_row"] + row["rows"]]
            assert _C.crc32c(np.ascontiguousarray(rows)) == row["crc32c"]
    ds = fastdump.open(dump)
    got = ds.load("target", 0, 1, check=True)
    for name, want in tensors_of(1).items():
        assert torch.equal(got[name], want)
    assert torch.equal(ds.series("target", 0, "a", check=True)[3], tensors_of(3)["a"])


@pytest.mark.parametrize("name", ["a", "big"])
def test_flipped_or_zeroed_data_is_detected(dump, name):
    path = segment(dump)
    with h5py.File(path, "r") as f:
        index, names = f["index"][()], json.loads(f["names"][()])
        row = index[(index["pass"] == 1) & (index["name"] == names.index(name))][0]
        offset = f["blocks"][str(row["block"])].id.get_offset()
        row_bytes = f["blocks"][str(row["block"])].dtype.itemsize * int(np.prod(f["blocks"][str(row["block"])].shape[1:]))
    raw = bytearray(path.read_bytes())
    position = offset + int(row["first_row"]) * row_bytes + 5
    raw[position] ^= 0x01  # one bit
    path.write_bytes(bytes(raw))
    ds = fastdump.open(dump)
    ds.load("target", 0, 1)  # unchecked reads stay as fast as before
    with pytest.raises(reader.DumpError, match=r"seg-000000.h5: index row \d+ \(pass 1, '" + name + r"'\): checksum"):
        ds.load("target", 0, 1, check=True)
    assert ds.load("target", 0, 0, check=True)  # the other pass is intact
    report = verify(dump, "--data")
    assert any("checksum mismatch" in p for p in report.problems), report.problems
    assert not any("checksum" in p for p in verify(dump).problems)  # without --data: not read
    done = cli("verify", dump, "--data")
    assert done.returncode == 1 and "checksum mismatch" in done.stdout


def test_format_1_dumps_still_read(dump):
    """A format-1 segment (no crc32c column, rank directory without a session) reads as before."""
    old = dump / "target" / "TP0_PP0_Rank0_pid7"
    rank_dir(dump).rename(old)
    as_format_4(old)  # (its rank.json an old one too: a format-6 one says its writer wrote format 6 only)
    path = old / fmt.segment_name(0)
    with h5py.File(path, "r+") as f:
        index = f["index"][()]
        del f["index"]
        f.create_dataset("index", data=index[list(fmt.INDEX_DTYPE_V1.names)].astype(fmt.INDEX_DTYPE_V1))
        f.attrs["format_version"] = 1
    ds = fastdump.open(dump)
    assert ds.ranks("target") == ["TP0_PP0_Rank0_pid7"]
    got = ds.load("target", 0, 1)
    assert all(torch.equal(got[n], t) for n, t in tensors_of(1).items())
    with pytest.warns(UserWarning, match="no checksums"):
        got = ds.load("target", 0, 1, check=True)
    assert all(torch.equal(got[n], t) for n, t in tensors_of(1).items())
    report = verify(dump, "--data")
    assert report.problems == [] and any("no checksums" in w for w in report.warnings)


# ------------------------------------------------------------------------------ index rows


def rewrite_index(path, change):
    """Change index rows as a faulty writer would: the tables checksum is stamped to match, so the
    row checks must catch it themselves (tables changed on disk: test_verify_hostile)."""
    with h5py.File(path, "r+") as f:
        index = f["index"][()]
        change(index)
        f["index"][...] = index
    restamp_tables(path)


def set_field(row, field, value):
    def change(index):
        index[field][row] = value
    return change


@pytest.mark.parametrize("damage, message, verify_text", [
    (set_field(0, "first_row", 10_000), "index row", ""),  # past its block
    (set_field(0, "rows", 0), "leave a gap|index row", ""),  # empty tensor
    (set_field(1, "name", 99), "name slot 99", "index refers to a name outside the name table"),  # no such name
    (set_field(1, "name", 3), "name slot 3 outside the name table \\(3 names\\)",  # one past the last (a, b, big)
     "index refers to a name outside the name table"),
    (set_field(0, "pass", 3), "pass 3 is not in the passes table|index rows", ""),  # mislabelled
    (set_field(0, "rows", -1), "index row 0: negative row range", ""),  # (else read as a row range ending early)
], ids=["outside", "empty", "name", "name-one-past", "pass", "negative-rows"])
def test_bad_index_rows_are_an_error_naming_file_and_row(dump, damage, message, verify_text, capsys):
    path = segment(dump)
    rewrite_index(path, damage)
    with pytest.warns(UserWarning, match="unreadable segment"):
        ds = fastdump.open(dump)
        with pytest.raises(reader.DumpError, match="seg-000000.h5"):
            ds.load("target", 0, 0)
    assert any("seg-000000.h5" in p and __import__("re").search(message, p) for p in ds.problems), ds.problems
    assert ds.load("target", 0, 2)  # other segments still read
    problems = verify(dump).problems  # (other checks fail on a bad name slot too: verify names its own cause)
    assert problems and any(verify_text in p for p in problems), problems
    code = cli_dump.main(["show", str(dump), "--pass", "0"])
    assert code == 1 and "seg-000000.h5" in capsys.readouterr().err


def test_a_missing_block_fails_the_reads_that_need_it(dump):
    with h5py.File(segment(dump), "r+") as f:
        index, names = f["index"][()], json.loads(f["names"][()])
        big0 = int(index[(index["pass"] == 0) & (index["name"] == names.index("big"))]["block"][0])
        del f["blocks"][str(big0)]  # the index still points at it
    ds = fastdump.open(dump)
    with pytest.raises(reader.DumpError, match=f"seg-000000.h5 'blocks': missing '{big0}'"):
        ds.load("target", 0, 0)
    got = ds.load("target", 0, 1, check=True)  # the rest of the segment still reads
    assert all(torch.equal(got[n], t) for n, t in tensors_of(1).items())
    with pytest.raises(reader.DumpError):
        ds.series("target", 0, "big")
    assert any("missing block" in p for p in verify(dump).problems), verify(dump).problems


def test_overlapping_rows_never_return_doubled_data(dump):
    """Two rows of one block pointing at the same data (pass 1's 'a' aliased onto pass 0's)."""
    path = segment(dump)

    def alias(index):
        names_a = index[index["block"] == index[0]["block"]]
        assert len(names_a) == 2
        second = np.flatnonzero(index["block"] == index[0]["block"])[1]
        index["first_row"][second] = 0

    rewrite_index(path, alias)
    with pytest.warns(UserWarning):
        ds = fastdump.open(dump)
        with pytest.raises(reader.DumpError, match="overlap"):
            ds.load("target", 0, 1)


def test_bad_pass_meta_is_reported_and_show_goes_on(dump, capsys):
    with h5py.File(segment(dump), "r+") as f:
        meta = f["pass_meta"][()]
        meta[0] = b'["not", "an object"]'
        meta[1] = b"{broken"
        del f["pass_meta"]
        f.create_dataset("pass_meta", data=meta, dtype=h5py.string_dtype())
    restamp_tables(segment(dump))  # as a faulty writer would have written it
    assert cli_dump.main(["show", str(dump), "--pass", "0"]) == 0
    captured = capsys.readouterr()
    assert "pass_meta of pass 0" in captured.err and "seg-000000.h5" in captured.err
    assert "a" in captured.out and "Traceback" not in captured.err


# ------------------------------------------------------------------- crafted: outside the root


def secret_file(tmp_path):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.arange(24, dtype=np.float32).tobytes())
    return secret


def replace_block(path, make):
    """Replace block 0 of a segment with what ``make(blocks_group, name)`` creates."""
    with h5py.File(path, "r+") as f:
        blocks = f["blocks"]
        old = blocks["0"]
        shape, dtype, attrs = old.shape, old.dtype, dict(old.attrs)
        del blocks["0"]
        make(blocks, "0", shape, dtype)
        if isinstance(blocks.get("0", getlink=True), h5py.HardLink):
            for key, value in attrs.items():
                blocks["0"].attrs[key] = value


@pytest.mark.parametrize("kind", ["external-storage", "external-link", "soft-link", "virtual", "chunked"])
def test_blocks_that_read_outside_the_file_are_refused(dump, tmp_path, kind):
    secret = secret_file(tmp_path)

    def make(blocks, name, shape, dtype):
        if kind == "external-storage":
            blocks.create_dataset(name, shape=shape, dtype=dtype, external=[(str(secret), 0, h5py.h5f.UNLIMITED)])
        elif kind == "external-link":
            with h5py.File(tmp_path / "other.h5", "w") as other:
                other.create_dataset("x", data=np.zeros(shape, dtype))
            blocks[name] = h5py.ExternalLink(str(tmp_path / "other.h5"), "/x")
        elif kind == "soft-link":
            blocks[name] = h5py.SoftLink("/index")
        elif kind == "virtual":
            layout = h5py.VirtualLayout(shape=shape, dtype=dtype)
            layout[...] = h5py.VirtualSource(str(tmp_path / "other.h5"), "x", shape=shape)
            with h5py.File(tmp_path / "other.h5", "w") as other:
                other.create_dataset("x", data=np.ones(shape, dtype))
            blocks.create_virtual_dataset(name, layout)
        else:
            blocks.create_dataset(name, shape=shape, dtype=dtype, chunks=True, compression="gzip")

    replace_block(segment(dump), make)
    ds = fastdump.open(dump)
    why = {"external-storage": "dataset stored in external files", "external-link": "'0' is a ExternalLink",
           "soft-link": "'0' is a SoftLink", "virtual": "virtual dataset", "chunked": "chunked dataset"}[kind]
    with pytest.raises(reader.DumpError, match=f"seg-000000.h5.*: {why}"):
        ds.load("target", 0, 0)
    with pytest.raises(reader.DumpError):
        ds.series("target", 0, "a")
    report = verify(dump, "--data")
    assert any("refused" in p and "seg-000000.h5" in p for p in report.problems), report.problems
    out = tmp_path / "export"
    done = cli("export", dump, out)
    assert done.returncode == 2 and "seg-000000.h5" in done.stderr and "Traceback" not in done.stderr  # (read error: 2)
    assert not _contains_secret(out, secret)


def _contains_secret(out, secret):
    needle = secret.read_bytes()[:16]
    return any(needle in p.read_bytes() for p in out.rglob("*.pt"))


def test_symlinks_out_of_the_root_are_not_followed(dump, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    write_dir(elsewhere / "target" / "TP1_PP0_Rank1_pid5", {0: tensors_of(9)})
    os.symlink(elsewhere / "target" / "TP1_PP0_Rank1_pid5", dump / "target" / "TP1_PP0_Rank1_pid5")
    os.symlink(elsewhere / "target", dump / "linkedrole")
    os.symlink(segment(dump, 0), rank_dir(dump) / "seg-000099.h5")
    ds = fastdump.open(dump)
    assert ds.roles == ["target"] and ds.ranks("target") == [rank_dir(dump).name]
    with pytest.warns(UserWarning, match="not a regular file"):
        assert 99 not in ds.passes("target", 0)
    problems = verify(dump).problems
    assert any("TP1_PP0_Rank1_pid5: symbolic link" in p for p in problems)
    assert any("linkedrole: symbolic link" in p for p in problems)
    assert any("seg-000099.h5" in p and "not a regular file" in p for p in problems)


# --------------------------------------------------------------------------- size claims


def test_a_small_file_claiming_a_huge_block_is_refused_before_allocating(dump):
    def make(blocks, name, shape, dtype):
        # 3 TiB of float32 rows in a file of a few MB: HDF5 stores the claim (contiguous storage
        # is allocated late, i.e. never here), not the data.
        blocks.create_dataset(name, shape=(1 << 38, *shape[1:]), dtype=dtype)

    replace_block(segment(dump), make)
    ds = fastdump.open(dump)
    with pytest.raises(reader.DumpError, match="claims .* bytes, more than the file"):
        ds.load("target", 0, 0)
    started = time.monotonic()
    report = verify(dump, "--data")
    assert time.monotonic() - started < 60
    assert any("claims" in p for p in report.problems), report.problems


# ---------------------------------------------------------------------- special files, JSON


def test_fifo_rank_json_and_segment_do_not_hang(dump, tmp_path):
    (rank_dir(dump) / "rank.json").unlink()
    os.mkfifo(rank_dir(dump) / "rank.json")
    os.mkfifo(rank_dir(dump) / "seg-000050.h5")
    for argv in (["ls", dump], ["verify", dump], ["show", dump, "--pass", "0"]):
        done = cli(*argv)  # a hang would hit the 120 s timeout
        assert "Traceback" not in done.stderr, done.stderr
    done = cli("verify", dump)
    assert done.returncode == 1 and "not a regular file" in done.stdout


def test_json_from_dev_zero_is_bounded(dump):
    os.symlink("/dev/zero", dump / "fastdump.json")
    started = time.monotonic()
    done = cli("ls", dump)
    assert done.returncode == 0 and time.monotonic() - started < 60
    assert "fastdump.json" in done.stderr
    with pytest.raises(ValueError):
        fsutil.load_json(str(dump / "fastdump.json"))
    big = dump / "big.json"
    big.write_bytes(b"[" + b"0," * (fsutil.MAX_JSON_BYTES // 2) + b"0]")
    with pytest.raises(ValueError, match="more than"):
        fsutil.load_json(str(big))


@pytest.mark.parametrize("content", ['["a", "list"]', '"a string"', '{"status": 5, "dropped": "x", "rank": [1], '
                                    '"segments": "no", "error": {"a": 1}}'])
def test_ls_and_verify_report_odd_rank_json_and_go_on(dump, content):
    (rank_dir(dump) / "rank.json").write_text(content)
    (dump / "fastdump.json").write_text('["not", "an object"]')
    done = cli("ls", dump)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert rank_dir(dump).name in done.stdout
    assert "fastdump.json" in done.stderr
    done = cli("verify", dump)
    assert done.returncode == 1 and "Traceback" not in done.stderr


def test_control_characters_are_escaped(dump):
    info = json.loads((rank_dir(dump) / "rank.json").read_text())
    info.update(status="closed\x1b[31m", error="bad\x1b]0;title\x07")
    (rank_dir(dump) / "rank.json").write_text(json.dumps(info))
    evil = dump / "target" / "TP9_PP0_Rank9_pid1\x1b[2J"
    write_dir(evil, {0: tensors_of(0)})
    for argv in (["ls", dump], ["verify", dump]):
        done = cli(*argv)
        assert "\x1b" not in done.stdout + done.stderr and "\x07" not in done.stdout + done.stderr
        assert "\\x1b" in done.stdout


# ------------------------------------------------------------------------------ sessions


def test_session_ids_sort_by_time_and_differ(monkeypatch):
    ids = [fmt.new_session_id() for _ in range(50)]
    assert len(set(ids)) == 50
    name = fmt.rank_dir_name(RANKS, 1, ids[0])
    assert fmt.parse_rank_dir(name) == (0, 0, 0, 1, ids[0])
    assert fmt.parse_rank_dir("TP0_PP0_Rank0_pid1") == (0, 0, 0, 1, None)  # format 1
    monkeypatch.setattr(time, "time", lambda: 1.5e9)
    early = fmt.new_session_id()
    monkeypatch.setattr(time, "time", lambda: 1.5e9 + 0.000001)
    assert fmt.new_session_id() > early  # sorts by start time whatever the random bits


def model_and_input(seed):
    torch.manual_seed(seed)
    return torch.nn.Linear(8, 8), torch.randn(2, 8)


def test_sessions_sharing_a_pid_are_never_merged(tmp_path):
    """attach/run/close three times in one process: three directories, each its own run."""
    root = tmp_path / "dump"
    expected = []
    for run in range(3):
        model, x = model_and_input(run)
        d = fastdump.attach(model, root, writer="thread")
        with torch.inference_mode():
            expected.append(model(x))
        d.close()
    ds = fastdump.open(root)
    dirs = ds.ranks("target")
    assert len(dirs) == 3 and all(str(os.getpid()) in d for d in dirs)
    with pytest.raises(ValueError, match="3 sessions"):
        ds.load("target", 0, 0)
    for run, name in enumerate(dirs):  # start order
        got = ds.load("target", name, 0)
        assert list(got) == ["Linear"] and torch.equal(got["Linear"], expected[run])
        session = fmt.parse_rank_dir(name)[4]
        assert torch.equal(ds.load("target", 0, 0, session=session)["Linear"], expected[run])
        assert ds.rank_info("target", name)["session"] == session
    assert cli("verify", root).returncode == 0
    listing = cli("ls", root).stdout
    assert all(name in listing for name in dirs)
    done = cli("show", root, "--pass", "0", "--rank", "0")
    assert done.returncode == 1 and "sessions" in done.stderr
    done = cli("show", root, "--pass", "0", "--rank", "0", "--session", fmt.parse_rank_dir(dirs[1])[4])
    assert done.returncode == 0, done.stderr


def test_two_live_dumpers_same_root_and_role_get_their_own_directories(tmp_path, caplog):
    root = tmp_path / "dump"
    target, x = model_and_input(0)
    draft, y = model_and_input(1)
    with caplog.at_level(logging.WARNING, logger="fastdump"):
        d1 = fastdump.attach(target, root, writer="thread")
        d2 = fastdump.attach(draft, root, writer="thread")  # forgot role="draft"
    assert "another Dumper of this process" in caplog.text
    assert d1.dir != d2.dir
    with torch.inference_mode():
        outs = [(target(x), draft(y)) for _ in range(3)]
    d1.close()
    d2.close()
    ds = fastdump.open(root)
    assert sorted(ds.ranks("target")) == sorted([d1.dir.name, d2.dir.name])
    for p, (t_out, d_out) in enumerate(outs):
        assert torch.equal(ds.load("target", d1.dir.name, p)["Linear"], t_out)
        assert torch.equal(ds.load("target", d2.dir.name, p)["Linear"], d_out)
    assert cli("verify", root).returncode == 0


def test_a_session_directory_that_exists_is_never_shared(tmp_path, monkeypatch, caplog):
    """Two Dumpers of one pid (containers: pid 1 each, on a shared volume) drawing the same session
    id both wrote <root>/target/<one dir>: the second's segments and rank.json replaced the first's,
    one model's passes were lost and verify said OK. A directory that exists is another's: a fresh
    id is drawn; when none is free, attach fails without writing into the other's directory."""
    root = tmp_path / "dump"
    fixed = "20260101T000000.000000Z-0000abcd"
    ids = iter([fixed, fixed])  # both draw the same id once; the second draws again
    real = fmt.new_session_id
    monkeypatch.setattr(fmt, "new_session_id", lambda: next(ids, None) or real())
    target, x = model_and_input(0)
    draft, y = model_and_input(1)
    d1 = fastdump.attach(target, root, writer="thread")
    d2 = fastdump.attach(draft, root, writer="thread")
    assert d1.session == fixed and d2.session != fixed and d1.dir != d2.dir and d2.status == "running"
    with torch.inference_mode():
        outs = [(target(x), draft(y)) for _ in range(3)]
    d1.close()
    d2.close()
    ds = fastdump.open(root)
    for p, (t_out, d_out) in enumerate(outs):
        assert torch.equal(ds.load("target", d1.dir.name, p)["Linear"], t_out)
        assert torch.equal(ds.load("target", d2.dir.name, p)["Linear"], d_out)
    assert cli("verify", root).returncode == 0

    monkeypatch.setattr(fmt, "new_session_id", lambda: fixed)  # every id taken: attach gives up
    before = sorted(os.listdir(d1.dir))
    with caplog.at_level(logging.ERROR, logger="fastdump"):
        d3 = fastdump.attach(draft, root, writer="thread")
    assert d3.status == "error" and "existed already" in d3.error
    with torch.inference_mode():
        assert torch.equal(draft(y), outs[0][1])  # serving goes on
    d3.close()
    assert sorted(os.listdir(d1.dir)) == before  # no producer_error.json in the other's directory
    assert torch.equal(fastdump.open(root).load("target", d1.dir.name, 0)["Linear"], outs[0][0])
    assert cli("verify", root).returncode == 0
    with pytest.raises(FileExistsError, match="existed already"):
        fastdump.attach(draft, root, writer="thread", strict=True)


def test_a_root_inside_a_dump_is_refused(tmp_path, caplog):
    """FASTDUMP_DIR set to a rank directory that `fastdump ls` printed: the second dump was written
    inside the first (its fastdump.json and target/ among the first's segments), and verify said OK."""
    root = tmp_path / "dump"
    model, x = model_and_input(0)
    d = fastdump.attach(model, root, writer="thread")
    with torch.inference_mode():
        out = model(x)
    d.close()
    before = {p: sorted(os.listdir(p)) for p in (root, d.dir.parent, d.dir)}
    for inner, what in ((d.dir, "is a rank directory"), (d.dir.parent, "is a role directory"),
                        (d.dir / "sub", "is inside a rank directory")):
        with caplog.at_level(logging.ERROR, logger="fastdump"):
            d2 = fastdump.attach(model, inner, writer="thread")
        assert d2.status == "error" and what in d2.error, d2.error
        with torch.inference_mode():
            assert torch.equal(model(x), out)  # serving goes on
        d2.close()
        with pytest.raises(ValueError, match=what):
            fastdump.attach(model, inner, writer="thread", strict=True)
    assert {p: sorted(os.listdir(p)) for p in before} == before
    assert torch.equal(fastdump.open(root).load("target", d.dir.name, 0)["Linear"], out)
    assert cli("verify", root).returncode == 0


def test_a_root_that_is_a_dangling_link_is_named_so(tmp_path):
    """FASTDUMP_DIR a symbolic link to a directory not mounted yet: the recorded error said only
    '[Errno 17] File exists'."""
    os.symlink(tmp_path / "not-mounted", tmp_path / "dump")
    model, _ = model_and_input(0)
    d = fastdump.attach(model, tmp_path / "dump", writer="thread")
    assert d.status == "error" and d.error.endswith(f"{tmp_path / 'dump'} is a symbolic link to nothing"), d.error
    d.close()
    with pytest.raises(FileExistsError, match="is a symbolic link to nothing"):
        fastdump.attach(model, tmp_path / "dump", writer="thread", strict=True)
    assert sorted(os.listdir(tmp_path)) == ["dump"]


# ------------------------------------------------------------------- status, counts, full disk


def test_verify_fails_unless_closed(dump):
    path = rank_dir(dump) / "rank.json"
    info = json.loads(path.read_text())
    assert verify(dump).problems == []
    for status, reason in (("running", "never finished"), ("incomplete", "without close"),
                           ("weird", "not a finished dump")):
        path.write_text(json.dumps({**info, "status": status}))
        assert any(reason in p for p in verify(dump).problems), status
    path.write_text(json.dumps({**info, "status": "running", "pid": 2 ** 22 + 12345, "host": __import__("socket").gethostname()}))
    assert any("process is gone" in p for p in verify(dump).problems)
    assert "process is gone" in cli("ls", dump).stdout
    path.write_text(json.dumps({**info, "error": "the Dumper failed"}))
    assert any("an error was recorded" in p for p in verify(dump).problems)


def test_a_block_without_its_crc_attribute_fails_verify_and_the_reader(tmp_path):
    """Format 4 on, every block carries block_crc32c: one without it is not taken as unchecked."""
    root = tmp_path / "dump"
    write_dir(root / "target" / RANK_DIR, {0: {"x": torch.arange(4, dtype=torch.bfloat16)}})
    with h5py.File(segment(root), "r+") as f:
        del f[fmt.BLOCKS]["0"].attrs[fmt.ATTR_BLOCK_CRC]
    problems = verify(root).problems
    assert len(problems) == 1 and problems[0].endswith("block 0: no 'block_crc32c' attribute (format 4 requires one)"), \
        problems
    with fastdump.open(root) as ds, pytest.raises(reader.DumpError, match="no 'block_crc32c' attribute"):
        ds.load("target", 0, 0)


def test_verify_fails_when_passes_the_dumper_sent_are_missing(tmp_path):
    root = tmp_path / "dump"
    write_dir(root / "target" / "TP0_PP0_Rank0_pid1", {p: tensors_of(p) for p in range(3)},
              stats={"passes": 5, "tensors": 15})
    problems = verify(root).problems
    assert any("dumped 5 passes; 3 are on disk" in p for p in problems), problems
    assert any("staged 15 tensors; 9 are on disk" in p for p in problems), problems


@pytest.mark.parametrize("policy", ["drop", "block"])
def test_dropped_passes_are_counted_in_rank_json_and_ls(tmp_path, policy):
    """A stalled writer: whole passes are dropped; the Dumper, rank.json and ls agree on every
    count, and ls shows the dropped passes. verify warns under `drop` (the user chose to drop) and
    fails under `block` (which loses nothing while the writer keeps up: this dump is not whole)."""
    root = tmp_path / "dump"
    model = torch.nn.Linear(4, 4)
    # (the open's ack waits max(block_timeout_s, 1 s): the writer handles it at our priority, and
    # goes to SCHED_IDLE only once it has acked it)
    d = fastdump.attach(model, root, policy=policy, ring_mb=1, block_timeout_s=0.05)
    writer = d._engine._proc
    os.kill(writer.pid, signal.SIGSTOP)  # the ring fills up to the last byte: passes cannot even begin
    forwards = 0
    try:
        with torch.inference_mode():
            while d.stats()["dropped_passes"] < 5 and forwards < 100_000:
                model(torch.randn(1, 4))  # tiny records, so that not even a "begin" fits
                forwards += 1
    finally:
        os.kill(writer.pid, signal.SIGCONT)
    stats = d.close()
    assert stats["status"] == "closed" and stats["dropped_passes"] >= 5
    info = fastdump.open(root).rank_info("target", 0)
    assert info["dropped"] == stats["dropped"] and info["dropped_passes"] == stats["dropped_passes"]
    listing = json.loads(cli("ls", root, "--json").stdout)["ranks"][0]
    assert listing["dropped"] == stats["dropped"] and listing["dropped_passes"] == stats["dropped_passes"]
    assert listing["passes"] == stats["passes"] == forwards - stats["dropped_passes"]
    assert f"{stats['dropped']} +{stats['dropped_passes']} passes" in cli("ls", root).stdout
    done = cli("verify", root)
    assert f"policy '{policy}': {stats['dropped']} tensor(s) and {stats['dropped_passes']} whole pass(es) were dropped" \
        in done.stdout, done.stdout
    assert done.returncode == (0 if policy == "drop" else 1), done.stdout


@pytest.fixture
def small_disk(tmp_path):
    yield from mount_small_tmpfs(tmp_path, "2m")


def fill(directory):
    """Take every free byte of the file system (what another process writing logs would do)."""
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)


def test_full_disk_is_recorded_even_when_rank_json_cannot_grow(small_disk):
    """The disk fills up completely while dumping: rank.json still says error, verify fails."""
    path = small_disk / "target" / "TP0_PP0_Rank0_pid1_20260101T000000.000000Z-00000002"
    writer = ChannelWriter({"op": "open", "channel": 0, "dir": str(path), "role": "target", "rank": RANKS,
                            "pid": 1, "host": "h", "device": {}, "config": {"segment_passes": 1}})
    assert (path / fmt.RESERVE_FILE).exists()
    fill(small_disk)
    writer.on_name(0, "x")
    with pytest.raises(OSError):
        for p in range(50):
            writer.on_begin(p, {})
            writer.on_tensor(0, p, dtypes.code_of(torch.float32), (64, 64), np.ones(64 * 64 * 4, np.uint8))
            writer.on_end(p, {}, 0, [])
    info = json.loads((path / "rank.json").read_text())
    assert info["status"] == "error" and "No space left" in info["error"]
    assert not (path / fmt.RESERVE_FILE).exists()
    done = cli("verify", small_disk)
    assert done.returncode == 1 and "No space left" in done.stdout
    assert "error" in cli("ls", small_disk).stdout


def test_closed_dump_leaves_no_reserve(dump):
    assert not (rank_dir(dump) / fmt.RESERVE_FILE).exists()


def test_a_reserve_left_beside_a_closed_rank_json_is_passed_over(dump):
    """A writer killed after writing "closed" and before removing the reserve leaves it: it is no
    part of the dump (format.RESERVE_FILE, beside the other on-disk names), and ls, verify and the
    reader pass over it."""
    (rank_dir(dump) / fmt.RESERVE_FILE).write_bytes(b"\0" * 4096)
    report = verify(dump, "--data")
    assert report.problems == [] and report.warnings == []
    with fastdump.open(dump) as ds:
        assert ds.problems == [] and ds.passes("target", 0) == [0, 1, 2, 3]
        for p in range(4):
            got = ds.load("target", 0, p)
            assert sorted(got) == ["a", "b", "big"] and all(torch.equal(got[n], t) for n, t in tensors_of(p).items())
    assert cli("ls", dump).returncode == 0


def test_an_attribute_larger_than_its_file_is_refused_before_reading(dump):
    """Attributes, like datasets, are size-checked before they are read. (A real crafted file
    with a huge attribute claim is not easy to make: HDF5 allocates an attribute when it creates
    one, and checksums its headers; so the check is exercised against a smaller file size.)"""
    with h5py.File(segment(dump), "r+") as f:
        f["blocks"]["0"].attrs.create("big", np.zeros(4096, np.uint8))
    with h5py.File(segment(dump), "r") as f:
        assert reader.read_attrs(f["blocks"]["0"], 1 << 20, "x")["dtype"] == "float32"
        with pytest.raises(reader.DumpError, match="attribute 'big' claims 4096 bytes, more than the file's 1000"):
            reader.read_attrs(f["blocks"]["0"], 1000, "x")


ODD_BLOCKS = {"bf16": torch.tensor([1.5, -2.25, 3.0e5], dtype=torch.bfloat16),
              "e4m3": torch.tensor([0.5, -1.75, 240.0]).to(torch.float8_e4m3fn),
              "zero_d": torch.tensor(2.5), "one": torch.tensor([2.5]),
              "cube": torch.arange(64, dtype=torch.float32).reshape(2, 4, 8)}


def block_of(f, name):
    """The block dataset holding ``name``'s rows."""
    names = json.loads(f[fmt.NAMES][()])
    index = f[fmt.INDEX][()]
    return f[fmt.BLOCKS][str(int(index["block"][index["name"] == names.index(name)][0]))]


@pytest.mark.parametrize("kind", ["bf16-as-uint16", "e4m3-as-e5m2", "0-d-as-(1,)", "(1,)-as-0-d", "rows-reshaped",
                                  "attributes-swapped"])
def test_a_block_relabelled_after_writing_is_refused(tmp_path, kind):
    """A block's attributes and row shape say how its bytes read back; the rows' CRC covers only
    the bytes. Relabelled (bfloat16 as uint16, one float8 as the other, 0-d rows as (1,) and back,
    (N, 4, 8) rows as (N, 8, 4), two blocks' attributes traded), the data read back as other
    values with every check passing: format 4's block CRC makes each such change fail loudly."""
    root = tmp_path / "dump"
    write_dir(root / "target" / RANK_DIR, {0: ODD_BLOCKS})
    with h5py.File(segment(root), "r+") as f:
        if kind == "bf16-as-uint16":
            block_of(f, "bf16").attrs["dtype"] = "uint16"
        elif kind == "e4m3-as-e5m2":
            block_of(f, "e4m3").attrs["dtype"] = "float8_e5m2"
        elif kind == "0-d-as-(1,)":
            del block_of(f, "zero_d").attrs[fmt.ATTR_SCALAR]
        elif kind == "(1,)-as-0-d":
            block_of(f, "one").attrs[fmt.ATTR_SCALAR] = 1
        elif kind == "rows-reshaped":
            block = block_of(f, "cube")
            rows, attrs = block[()].reshape(-1, 8, 4), dict(block.attrs)
            name = block.name
            del f[name]
            f[name] = rows
            f[name].attrs.update(attrs)
        else:
            a, b = block_of(f, "zero_d"), block_of(f, "one")
            a_attrs, b_attrs = dict(a.attrs), dict(b.attrs)
            for block, attrs in ((a, b_attrs), (b, a_attrs)):
                for key in list(block.attrs):
                    del block.attrs[key]
                block.attrs.update(attrs)
    problems = verify(root, "--data").problems
    assert any("block" in p and "changed after it was written" in p for p in problems), problems
    with fastdump.open(root) as ds:
        with pytest.raises(reader.DumpError, match="changed after it was written"):
            ds.load("target", 0, 0, check=True)


def test_a_0_d_block_of_rows_is_refused_even_with_its_block_crc_restamped(tmp_path):
    """A block of rows must have a row axis: one rewritten as a 0-d dataset (its block CRC stamped
    again, so that check passes) is a DumpError naming its shape, not an IndexError from the reader."""
    root = tmp_path / "dump"
    write_dir(root / "target" / RANK_DIR, {0: ODD_BLOCKS})
    with h5py.File(segment(root), "r+") as f:
        block = block_of(f, "one")
        name, attrs, number = block.name, dict(block.attrs), int(block.name.rsplit("/", 1)[1])
        value = block[()].reshape(())
        del f[name]
        f[name] = value
        attrs[fmt.ATTR_BLOCK_CRC] = fmt.block_crc32c(number, attrs[fmt.ATTR_DTYPE], attrs[fmt.ATTR_ENCODING],
                                                     False, ())
        f[name].attrs.update(attrs)
    with fastdump.open(root) as ds:
        with pytest.raises(reader.DumpError, match=rf"block {number}: shape \(\) does not fit rows"):
            ds.load("target", 0, 0)
        got = ds.tensor("target", 0, "bf16", 0)  # the other blocks read
        assert torch.equal(got.view(torch.int16), ODD_BLOCKS["bf16"].view(torch.int16))
    assert verify(root).problems


def test_blocks_written_whole_read_back_bit_exact(tmp_path):
    """The odd blocks above, untouched: read back exactly, and verify --data passes."""
    root = tmp_path / "dump"
    write_dir(root / "target" / RANK_DIR, {0: ODD_BLOCKS})
    report = verify(root, "--data")
    assert not report.problems, report.problems
    with fastdump.open(root) as ds:
        got = ds.load("target", 0, 0, check=True)
    assert list(got) == list(ODD_BLOCKS)
    for name, want in ODD_BLOCKS.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name


@pytest.mark.parametrize("kind", ["index-soft-link", "names-not-a-list", "future-version", "another-format"])
def test_crafted_tables_are_refused(dump, kind):
    with h5py.File(segment(dump), "r+") as f:
        if kind == "index-soft-link":
            f["index_copy"] = f["index"][()]
            del f["index"]
            f["index"] = h5py.SoftLink("/index_copy")
        elif kind == "names-not-a-list":
            del f["names"]
            f.create_dataset("names", data='{"a": 1}', dtype=h5py.string_dtype())
        elif kind == "another-format":  # (whole and consistent otherwise: only this attribute says so)
            f.attrs["format"] = "another-format"
        else:
            f.attrs["format_version"] = fmt.FORMAT_VERSION + 1
    with pytest.warns(UserWarning, match="unreadable segment"):
        ds = fastdump.open(dump)
        with pytest.raises(reader.DumpError, match="seg-000000.h5"):
            ds.load("target", 0, 0)
    if kind == "another-format":
        assert any(p.endswith("seg-000000.h5: unreadable segment (not a fastdump segment (format attribute "
                              "'another-format')); skipped") for p in ds.problems), ds.problems
    assert any("seg-000000.h5" in p for p in verify(dump).problems)


def test_multi_root_reading_never_mixes_sessions(tmp_path):
    a, b = tmp_path / "host0", tmp_path / "host1"
    first = "TP0_PP0_Rank0_pid1_20260101T000000.000000Z-00000001"
    second = "TP0_PP0_Rank0_pid1_20260101T000001.000000Z-00000002"
    write_dir(a / "target" / first, {0: tensors_of(0)})
    write_dir(a / "target" / second, {0: tensors_of(5)})
    rank1 = dict(RANKS, tp_rank=1, tp_size=2, rank=1)
    writer = ChannelWriter({"op": "open", "channel": 0, "dir": str(b / "target" / "TP1_PP0_Rank1_pid2"),
                            "role": "target", "rank": rank1, "pid": 2, "host": "h", "device": {}, "config": {}})
    writer.close({})
    with fastdump.open([a, b]) as ds:
        with pytest.raises(ValueError, match="2 sessions"):
            ds.load("target", 0, 0)
        got = ds.load("target", 0, 0, session=fmt.parse_rank_dir(second)[4])
        assert torch.equal(got["a"], tensors_of(5)["a"])
        assert torch.equal(ds.load("target", first, 0)["a"], tensors_of(0)["a"])


def test_a_routine_rank_json_write_that_needs_the_reserve_records_the_full_disk_and_stops(tmp_path, monkeypatch):
    """The disk fills between segments: the rank.json written after a segment is refused (ENOSPC).
    The reserve was spent on it and writing went on; the next segment took the freed space, its
    own failure found no reserve for rank.json, and the dump was left "running" with no error.
    Now the write that spends the reserve records the full disk (status "error") and stops."""
    import errno

    path = tmp_path / "target" / "TP0_PP0_Rank0_pid1_20260101T000000.000000Z-00000003"
    writer = ChannelWriter({"op": "open", "channel": 0, "dir": str(path), "role": "target", "rank": RANKS,
                            "pid": 1, "host": "h", "device": {}, "config": {"segment_passes": 1}})
    real, refused = fsutil.atomic_write_json, []

    def full_once(target, data, **kwargs):
        if target.endswith(fmt.RANK_FILE) and data.get("passes") == 1 and not refused:
            refused.append(target)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(target, data, **kwargs)

    monkeypatch.setattr(fsutil, "atomic_write_json", full_once)
    writer.on_name(0, "x")
    with pytest.raises(OSError):
        for p in range(5):
            writer.on_begin(p, {})
            writer.on_tensor(0, p, dtypes.code_of(torch.float32), (4,), np.ones(16, np.uint8))
            writer.on_end(p, {}, 0, [])
    assert refused and p == 0  # the first segment's rank.json: nothing more was written
    info = read_rank_json(path)
    assert info["status"] == "error" and "disk full" in info["error"] and "No space left" in info["error"]
    assert [s["file"] for s in info["segments"]] == ["seg-000000.h5"] and not (path / fmt.RESERVE_FILE).exists()
    assert verify(tmp_path).problems


# ------------------------------------------------------------------ the segment list (format 5)


def small_pass(p):
    return {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3) + p, "b": torch.full((4,), p, dtype=torch.int64)}


def list_dump(root, status):
    """Three one-pass segments, their list in segments.jsonl."""
    write_dir(root / "target" / RANK_DIR, {p: small_pass(p) for p in range(3)}, status=status, segment_passes=1)
    return rank_dir(root)


def commit_lines(path, count):
    """rank.json commits only the first ``count`` lines of segments.jsonl: what a writer killed
    after appending the next line(s) and before rewriting rank.json leaves."""
    info = json.loads((path / fmt.RANK_FILE).read_text())
    data = (path / fmt.SEGMENT_LIST_FILE).read_bytes()
    kept = b"".join(data.splitlines(keepends=True)[:count])
    info.update({fmt.LIST_COUNT: count, fmt.LIST_BYTES: len(kept), fmt.LIST_CRC: _C.crc32c(kept)})
    (path / fmt.RANK_FILE).write_text(json.dumps(info))


def read_all(root):
    with fastdump.open(root) as ds:
        loaded = {p: ds.load("target", 0, p, check=True) for p in ds.passes("target", 0)}
        return loaded, list(ds.problems)


def test_the_segment_list_is_appended_and_rank_json_commits_it(tmp_path):
    path = list_dump(tmp_path / "dump", "closed")
    info = json.loads((path / fmt.RANK_FILE).read_text())
    data = (path / fmt.SEGMENT_LIST_FILE).read_bytes()
    assert info["format_version"] == 6 and "segments" not in info
    assert (info[fmt.LIST_COUNT], info[fmt.LIST_BYTES], info[fmt.LIST_CRC]) == (3, len(data), _C.crc32c(data))
    assert [json.loads(line) for line in data.splitlines()] == [
        {"file": fmt.segment_name(p), "first_pass": p, "last_pass": p, "passes": 1, "tensors": 2, "bytes": 56,
         "complete": True} for p in range(3)]
    assert not verify(tmp_path / "dump").problems


@pytest.mark.parametrize("tail", ["torn", "whole"])
def test_a_line_after_the_committed_ones_is_never_read_as_listed(tmp_path, tail):
    """A writer killed mid-append leaves a torn last line; killed between the append and rank.json,
    a whole one rank.json does not commit. Neither is part of the list: the segment file is read
    as an unlisted one was before format 5 (a warning while the status is unfinished), and the
    torn text is never parsed as an entry."""
    root = tmp_path / "dump"
    path = list_dump(root, "running")
    if tail == "torn":
        with open(path / fmt.SEGMENT_LIST_FILE, "ab") as f:
            f.write(b'{"file": "seg-000003.h5", "first_pass": 3, "last_pa')
        unlisted = []
    else:
        commit_lines(path, 2)
        unlisted = ["seg-000002.h5 is not listed in segments.jsonl (status running)"]
    loaded, problems = read_all(root)
    assert list(loaded) == [0, 1, 2] and not problems
    for p in range(3):
        for name, t in small_pass(p).items():
            assert torch.equal(loaded[p][name], t)
    report = verify(root)
    assert len(report.problems) == 1 and "status running: the writer never finished" in report.problems[0], \
        report.problems
    assert any("after the lines rank.json commits (status running" in w for w in report.warnings), report.warnings
    for text in unlisted:
        assert any(text in w for w in report.warnings), report.warnings
    info = json.loads((path / fmt.RANK_FILE).read_text())
    info["status"] = "closed"  # a closed writer never leaves one: damage
    (path / fmt.RANK_FILE).write_text(json.dumps(info))
    assert any("after the lines rank.json commits" in p for p in verify(root).problems)


@pytest.mark.parametrize("damage", ["byte-changed", "truncated", "truncated-one-byte", "missing", "missing-no-bytes",
                                    "missing-no-lines", "count-wrong", "not-a-count", "a-true-count",
                                    "a-negative-count", "a-key-twice"])
def test_a_damaged_committed_list_fails_verify_and_is_reported_by_the_reader(tmp_path, damage):
    root = tmp_path / "dump"
    path = list_dump(root, "closed")
    list_file = path / fmt.SEGMENT_LIST_FILE
    data = list_file.read_bytes()
    if damage == "byte-changed":  # what rank.json commits is checked, not only parsed
        list_file.write_bytes(data.replace(b'"last_pass": 1', b'"last_pass": 2'))
        expected = "the list changed after it was written"
    elif damage.startswith("truncated"):  # (one byte short: said so, not read as a changed list)
        cut = 1 if damage == "truncated-one-byte" else 10
        list_file.write_bytes(data[:-cut])
        expected = f"segments.jsonl holds {len(data) - cut} bytes, rank.json commits 3 segment(s) in {len(data)}: truncated"
    elif damage == "missing":
        list_file.unlink()
        expected = "segments.jsonl missing: rank.json commits 3 segment(s) to it"
    elif damage == "missing-no-bytes":  # an absent list is empty only when rank.json commits no line either
        list_file.unlink()
        info = json.loads((path / fmt.RANK_FILE).read_text())
        info[fmt.LIST_BYTES] = 0
        (path / fmt.RANK_FILE).write_text(json.dumps(info))
        expected = "segments.jsonl missing: rank.json commits 3 segment(s) to it"
    elif damage == "missing-no-lines":  # nor when it commits bytes but no line
        list_file.unlink()
        info = json.loads((path / fmt.RANK_FILE).read_text())
        info[fmt.LIST_COUNT] = 0
        (path / fmt.RANK_FILE).write_text(json.dumps(info))
        expected = "segments.jsonl missing: rank.json commits 0 segment(s) to it"
    elif damage == "a-key-twice":  # committed as written: json would keep the last of the two values
        list_file.write_bytes(data.replace(b'"passes": 1,', b'"passes": 1, "passes": 1,', 1))
        commit_lines(path, 3)
        expected = "segments.jsonl line 1: not valid JSON (key 'passes' appears twice in one object)"
    else:
        info = json.loads((path / fmt.RANK_FILE).read_text())
        info[fmt.LIST_COUNT] = {"count-wrong": 2, "not-a-count": "3", "a-true-count": True,
                                "a-negative-count": -1}[damage]
        (path / fmt.RANK_FILE).write_text(json.dumps(info))
        expected = {"count-wrong": "commits 2 line(s)", "not-a-count": "segments_listed is '3', not an integer",
                    "a-true-count": "segments_listed is 'True', not an integer",  # (True is no 1)
                    "a-negative-count": "segments_listed is '-1', not an integer >= 0"}[damage]
    report = verify(root)
    assert any(expected in p for p in report.problems), report.problems
    loaded, problems = read_all(root)  # the segments themselves still read
    assert list(loaded) == [0, 1, 2] and any(expected in p and p.kind == reader.Problem.BAD_FILE for p in problems)


def test_a_failed_append_records_the_error_and_leaves_the_list_committed(tmp_path, monkeypatch):
    """The disk fills while a segment's line is appended: half of it lands. rank.json says error,
    commits the lines before it, and the half line is never read."""
    import errno

    from fastdump import segment_list

    path = tmp_path / "target" / RANK_DIR
    writer = ChannelWriter({"op": "open", "channel": 0, "dir": str(path), "role": "target", "rank": RANKS,
                            "pid": 1, "host": "h", "device": {}, "config": {"segment_passes": 1}})
    real, calls = os.pwrite, []

    def half_then_full(fd, data, offset):
        calls.append(offset)
        if len(calls) == 1:
            return real(fd, data, offset)
        if len(calls) == 2:
            return real(fd, data[:len(data) // 2], offset)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(segment_list.os, "pwrite", half_then_full)
    writer.on_name(0, "x")
    with pytest.raises(OSError, match="No space left"):
        for p in range(3):
            writer.on_begin(p, {})
            writer.on_tensor(0, p, dtypes.code_of(torch.float32), (2,), np.ones(8, np.uint8))
            writer.on_end(p, {}, 0, [])
    assert p == 1
    monkeypatch.undo()
    info = read_rank_json(path)
    assert info["status"] == "error" and "No space left" in info["error"]
    assert [s["file"] for s in info["segments"]] == ["seg-000000.h5"] and not (path / fmt.RESERVE_FILE).exists()
    report = verify(tmp_path)
    assert any("No space left" in p for p in report.problems)
    assert any("after the lines rank.json commits (status error" in w for w in report.warnings), report.warnings
    with fastdump.open(tmp_path) as ds:  # both segment files are whole: read
        assert ds.passes("target", 0) == [0, 1]


def test_format_4_dumps_read_verify_and_diff_as_before(tmp_path):
    """Format 4 kept the list in rank.json: such dumps read, verify and diff exactly as the same
    data written as format 5, and verify still checks their list."""
    from fastdump import compare

    roots = {}
    for version in (4, 5):
        for side, bump in (("base", 0.0), ("new", 1.0)):
            root = tmp_path / f"v{version}-{side}"
            passes = {p: small_pass(p) for p in range(5)}
            passes[3]["a"] = passes[3]["a"] + bump
            path = write_dir(root / "target" / RANK_DIR, passes, segment_passes=2)
            if version == 4:
                as_format_4(path)
                info = json.loads((path / fmt.RANK_FILE).read_text())
                assert info["format_version"] == 4 and len(info["segments"]) == 3
                assert not (path / fmt.SEGMENT_LIST_FILE).exists()
            roots[version, side] = root
    for side in ("base", "new"):
        old, new = read_all(roots[4, side]), read_all(roots[5, side])
        assert not old[1] and not new[1] and list(old[0]) == list(new[0]) == [0, 1, 2, 3, 4]
        for p, tensors in new[0].items():
            assert all(torch.equal(old[0][p][name], t) for name, t in tensors.items())
        old_report, new_report = verify(roots[4, side], "--data"), verify(roots[5, side], "--data")
        assert not old_report.problems and old_report.warnings == new_report.warnings
    results = [compare.diff(roots[version, "base"], roots[version, "new"]) for version in (4, 5)]
    assert [r.rows for r in results[:1]] == [r.rows for r in results[1:]] and not results[0].ok
    assert results[0].first_divergence["pass"] == 3 and results[0].problems == results[1].problems == []
    # Its list is still checked against the files.
    segment(roots[4, "base"], 1).unlink()
    assert any("seg-000001.h5 is listed in rank.json but missing" in p for p in verify(roots[4, "base"]).problems)


def test_two_writers_of_one_pid_never_share_a_temporary_file(tmp_path, monkeypatch):
    """Two containers whose servers are both pid 1 write the shared root's fastdump.json at once:
    both named their temporary file '.fastdump.json.1-0.tmp' (pid and a counter from 0), so one
    truncated and wrote into the file the other was about to rename into place."""
    import itertools

    target = str(tmp_path / "fastdump.json")
    names = []
    for _ in range(2):  # each process's counter starts at 0
        monkeypatch.setattr(fsutil, "_counter", itertools.count())
        names.append(fsutil.temp_path(target))
    assert names[0] != names[1] and all(fsutil.is_temp_name(os.path.basename(n)) for n in names)
    # And should a name be taken anyway, the write fails rather than share (or remove) that file.
    taken = names[0]
    with open(taken, "wb") as f:
        f.write(b"the other writer's")
    monkeypatch.setattr(fsutil, "temp_path", lambda path, unique=True: taken)
    with pytest.raises(FileExistsError):
        fsutil.atomic_write_json(target, {"a": 1})
    assert open(taken, "rb").read() == b"the other writer's" and not os.path.exists(target)


def test_an_atomic_write_that_fails_leaves_the_old_file_and_no_temporary_one(tmp_path, monkeypatch):
    """A rename that fails (EXDEV, EIO) must leave the old content and no .<name>.*.tmp behind: a
    temporary file left in a rank directory fails verify ("leftover temporary file")."""
    import errno

    from fastdump import fsutil

    path = tmp_path / "rank.json"
    path.write_bytes(b"old")

    def failing_replace(src, dst, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="Input/output error"):
        fsutil.atomic_write_bytes(str(path), b"new")
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["rank.json"] and path.read_bytes() == b"old"


def test_an_atomic_write_has_all_its_bytes_in_the_file_when_it_is_fsynced(tmp_path, monkeypatch):
    """fsync makes durable what the file holds: bytes still in Python's buffer at that moment
    (flush dropped) reach the file only at close, after the fsync, and a power cut after the
    rename leaves rank.json empty or short."""
    data = b"x" * 1000  # less than Python's buffer: without flush() none of it is in the file
    sizes = []
    real_fsync = os.fsync

    def fsync(fd):
        sizes.append(os.fstat(fd).st_size)
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    fsutil.atomic_write_bytes(str(tmp_path / "rank.json"), data)
    monkeypatch.undo()
    assert sizes[0] == len(data)  # the temporary file, before its rename (then the directory's)
    assert (tmp_path / "rank.json").read_bytes() == data


def test_a_directory_anchor_never_follows_a_link(tmp_path):
    """A writer holds its rank directory open; a link put in the directory's place before it is
    opened must not lead the writer out of the dump."""
    outside = tmp_path / "outside"
    outside.mkdir()
    link = tmp_path / "rank"
    os.symlink(outside, link)
    with pytest.raises(OSError) as info:
        fsutil.DirAnchor(str(link))
    assert info.value.errno in (errno.ELOOP, errno.ENOTDIR)
    anchor = fsutil.DirAnchor(str(outside))  # the directory itself: held, and reached through its descriptor
    try:
        assert os.path.samefile(anchor.join(""), outside)
    finally:
        anchor.close()


@pytest.mark.parametrize("when", ["at-open", "at-append"])
def test_the_segment_list_is_never_written_through_a_link(tmp_path, when):
    """segments.jsonl replaced by a link (before a writer reopens the directory, or between two
    segments) must not truncate or append to the file it points at."""
    from fastdump import segment_list

    victim = tmp_path / "victim"
    victim.write_bytes(b"someone else's\n")
    directory = tmp_path / "rank"
    directory.mkdir()
    listing = directory / fmt.SEGMENT_LIST_FILE
    anchor = fsutil.DirAnchor(str(directory))  # as the writer holds it
    if when == "at-open":
        os.symlink(victim, listing)
        with pytest.raises(OSError) as info:
            segment_list.Appender(anchor)
    else:
        appender = segment_list.Appender(anchor)
        appender.append({"file": fmt.segment_name(0), "first_pass": 0, "last_pass": 0})
        listing.unlink()
        os.symlink(victim, listing)
        with pytest.raises(OSError) as info:
            appender.append({"file": fmt.segment_name(1), "first_pass": 1, "last_pass": 1})
        assert appender.count == 1  # nothing committed for the refused line
    anchor.close()
    assert info.value.errno == errno.ELOOP
    assert victim.read_bytes() == b"someone else's\n"


def test_a_segment_list_appender_given_a_path_writes_in_that_directory(tmp_path):
    """Appender takes a path or a DirAnchor. A path is a str, which has a ``join`` method too: taken
    for an anchor's, it named the list 's<dir>e<dir>g<dir>...' (FileNotFoundError, or a stray file)."""
    from fastdump import segment_list

    directory = tmp_path / "rank"
    directory.mkdir()
    appender = segment_list.Appender(str(directory))
    entry = {"file": fmt.segment_name(0), "first_pass": 0, "last_pass": 3}
    appender.append(entry)
    line = (json.dumps(entry) + "\n").encode()
    assert os.listdir(directory) == [fmt.SEGMENT_LIST_FILE]
    assert (directory / fmt.SEGMENT_LIST_FILE).read_bytes() == line
    assert appender.committed() == {fmt.LIST_COUNT: 1, fmt.LIST_BYTES: len(line), fmt.LIST_CRC: _C.crc32c(line)}


def test_a_json_file_of_the_dump_that_is_a_link_is_not_read(tmp_path):
    """rank.json (or fastdump.json) replaced by a link to a file elsewhere: never read through it,
    whatever it points at."""
    outside = tmp_path / "outside.json"
    outside.write_text('{"status": "closed"}')
    link = tmp_path / "rank.json"
    os.symlink(outside, link)
    with pytest.raises(ValueError, match="symbolic links are not followed"):
        fsutil.load_json(str(link))
    assert fsutil.load_json(str(outside)) == {"status": "closed"}


def test_a_directory_anchor_closed_under_it_never_closes_the_descriptor_that_took_its_number(tmp_path):
    """A program closed the anchor's descriptor (os.closerange) and opened a file, which took its
    number: closing the anchor (or collecting it) must leave that file open."""
    directory = tmp_path / "rank"
    directory.mkdir()
    anchor = fsutil.DirAnchor(str(directory))
    number = anchor.fd
    opened = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT, 0o644)
    os.dup2(opened, number)  # (the number closed and taken at once, as the next open would take it)
    os.close(opened)
    other = number
    try:
        anchor.close()
        os.write(other, b"still open")
        assert (tmp_path / "other").read_bytes() == b"still open"
    finally:
        os.close(other)


def _peak_rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) >> 10


def test_a_tensor_far_larger_than_the_ring_never_takes_its_size_in_the_writers_memory(tmp_path):
    """A tensor staged in several ring records was put together whole in the writer's memory
    before its segment write: a 4 GiB activation took 4 GiB of the writer (here a 192 MiB one took
    the writer from ~80 to ~280 MiB, and the writer, slowed by the copy, timed out the next pass's
    tensor). Its chunks go into the segment's file as they come now: stored bit for bit, the
    writer's peak stays near its base."""
    model = torch.nn.Identity()
    d = fastdump.attach(model, tmp_path, ring_mb=16, segment_passes=1)  # chunks of 4 MiB
    writer_pid = d._engine._proc.pid
    x = torch.randn(48 << 20)  # 192 MiB
    with torch.inference_mode():
        model(x)
        model(-x)
    deadline = time.monotonic() + 120
    while len(list(d.dir.glob("seg-*.h5"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    peak = _peak_rss_mib(writer_pid)
    assert d.close()["status"] == "closed"
    with fastdump.open(tmp_path) as ds:
        assert ds.passes("target", 0) == [0, 1]
        assert torch.equal(torch.as_tensor(ds.load("target", 0, 0)["Identity"]), x)
        assert torch.equal(torch.as_tensor(ds.load("target", 0, 1)["Identity"]), -x)
    assert verify(tmp_path).problems == []
    assert peak < 100 + 192 // 2, f"writer peak RSS {peak} MiB for a 192 MiB tensor"
