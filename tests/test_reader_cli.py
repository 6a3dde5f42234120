"""fastdump ls / verify / show, and the reader's directory-level API, on synthetic dumps."""

import argparse
import json
import os
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch

import fastdump
from fastdump import fsutil, reader
from fastdump.cli import dump as cli_dump

from conftest import read_rank_json, write_rank_dir, write_rank_json

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = "TP0_PP0_Rank0_pid100"
TARGET1 = "TP1_PP0_Rank1_pid101"
DRAFT = "TP0_PP0_Rank0_pid100"


def write_rank(root, role, rank_dir, passes, segment_passes=2, status="closed", tp_size=2):
    rank_number = int(rank_dir.split("_Rank")[1].split("_")[0])
    write_rank_dir(root / role / rank_dir, passes, role=role, status=status, segment_passes=segment_passes,
                   rank={"tp_rank": rank_number, "tp_size": tp_size, "pp_rank": 0, "pp_size": 1, "rank": rank_number},
                   pass_meta=lambda pass_id: {"forward_mode": "decode" if pass_id else "prefill"})


def target_pass(p):
    return {
        "model.embed_tokens": torch.arange(8, dtype=torch.float32).reshape(2, 4) + p,
        "model.layers.0.mlp": torch.tensor([[1.0, float("nan"), float("inf")], [-2.0, 3.0, -float("inf")]]),
        "model.norm": torch.full((2, 4), 0.5, dtype=torch.bfloat16),
        "ids": torch.tensor([p, p + 1]),
        "packed": torch.zeros(3, dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
    }


@pytest.fixture
def dump(tmp_path):
    root = tmp_path / "dump"
    write_rank(root, "target", TARGET, {p: target_pass(p) for p in range(5)})
    write_rank(root, "target", TARGET1, {p: target_pass(p) for p in range(5)})
    write_rank(root, "draft", DRAFT, {p: {"draft.out": torch.ones(1, 2) * p} for p in range(3)}, tp_size=1)
    fsutil.atomic_write_json(str(root / "fastdump.json"), {"format_version": 1, "fastdump_version": "0.1.0"})
    return root


def run_cli(func, *argv, parser_args=None):
    parser = argparse.ArgumentParser()
    cli_dump.add_arguments(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    assert args.func is func
    return args.func(args)


def seg_path(root, role="target", rank=TARGET, number=0):
    return root / role / rank / f"seg-{number:06d}.h5"


# ---------------------------------------------------------------------------------------- reader


def test_reader_directory_api(dump):
    with reader.open(dump) as ds:
        assert ds.roles == ["draft", "target"]
        assert ds.ranks("target") == [TARGET, TARGET1]
        assert ds.manifest["fastdump_version"] == "0.1.0"
        assert ds.passes("target", 1) == ds.passes("target", TARGET1) == [0, 1, 2, 3, 4]
        assert ds.passes("draft", 0) == [0, 1, 2]
        assert ds.rank_info("target", 1)["rank"]["tp_rank"] == 1
        assert len(ds.segments("target", 0)) == 3
        assert ds.names("target", 0) == list(target_pass(0))
        got = ds.load("target", 0, 3)
        for name, want in target_pass(3).items():
            assert got[name].dtype == want.dtype and got[name].shape == want.shape
            assert torch.equal(got[name].reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
        series = ds.series("target", 0, "ids")
        assert {p: t.tolist() for p, t in series.items()} == {p: [p, p + 1] for p in range(5)}
        assert ds.meta("draft", 0, 0)["forward_mode"] == "prefill"
        with pytest.raises(ValueError):
            ds.passes(None, 0)  # two roles: must choose


def test_reading_many_segments_keeps_open_hdf5_ids_bounded(tmp_path):
    """Loading passes of more segments than the reader keeps open must not leave one HDF5 id per
    block read behind: each file close scans every open id, so a leak made a whole-dump read (diff,
    export, a loop over passes) of N segments O(N²) (2000 one-pass segments: 36 s, 4000: 159 s)."""
    segments = 3 * reader._MAX_OPEN_FILES
    passes = {p: {f"m{k}": torch.arange(4, dtype=torch.float32) * k + p for k in range(4)} for p in range(segments)}
    write_rank(tmp_path / "dump", "target", TARGET, passes, segment_passes=1, tp_size=1)

    def open_ids():
        return h5py.h5f.get_obj_count(h5py.h5f.OBJ_ALL, h5py.h5f.OBJ_ALL)

    with reader.open(tmp_path / "dump") as ds:
        counts = []
        for p in ds.passes("target", 0):
            got = ds.load("target", 0, p)
            assert list(got) == list(passes[p]) and all(torch.equal(got[n], passes[p][n]) for n in got)
            counts.append(open_ids())
    # once the open-file cache is full, what is open stays as it is: 16 files and their blocks
    assert max(counts[reader._MAX_OPEN_FILES:]) <= counts[reader._MAX_OPEN_FILES], counts


def test_loading_a_tensor_needs_its_size_once(tmp_path):
    """load, tensor and series hand back the array read from the file, not a copy of it: a 500 MB
    tensor must not need 1 GB to load."""
    import tracemalloc

    big = {p: {"big": torch.arange(1 << 22, dtype=torch.float32) + p, "small": torch.ones(3) * p} for p in range(2)}
    write_rank(tmp_path / "dump", "target", TARGET, big, segment_passes=2, tp_size=1)
    size = big[0]["big"].nbytes
    with reader.open(tmp_path / "dump") as ds:
        ds.load("target", 0, 0, select=lambda name: name == "small")  # index read outside the measure
        for read, want in ((lambda: ds.load("target", 0, 1, check=True)["big"], big[1]["big"]),
                           (lambda: ds.tensor("target", 0, "big", 0), big[0]["big"])):
            tracemalloc.start()
            got = read()
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            assert torch.equal(got, want) and peak < 1.5 * size, (peak, size)
            del got
        tracemalloc.start()
        series = ds.series("target", 0, "big")
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert all(torch.equal(series[p], big[p]["big"]) for p in range(2)) and peak < 2.5 * size, (peak, size)
        series[0].add_(1)  # the parts share one read buffer, each its own rows
        assert torch.equal(series[1], big[1]["big"])


def test_reader_skips_an_unreadable_segment_with_a_warning(dump):
    path = seg_path(dump, number=1)
    path.write_bytes(path.read_bytes()[:100])
    with reader.open(dump) as ds, pytest.warns(UserWarning, match="unreadable segment"):
        assert ds.passes("target", 0) == [0, 1, 4]
        assert ds.problems and "seg-000001.h5" in ds.problems[0]


def crc32c_by_hand(data: bytes) -> int:
    """CRC32C (Castagnoli, reflected polynomial 0x82F63B78), bit by bit: no fastdump code."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def test_reader_by_hand_with_h5py_alone(dump):
    """docs/FORMAT.md's recipe: enough to read a pass without fastdump: the segment list (format 5:
    segments.jsonl's committed lines), then the pass from the segment that holds it."""
    rank_dir = seg_path(dump).parent
    with open(rank_dir / "rank.json") as f:
        info = json.load(f)
    with open(rank_dir / "segments.jsonl", "ab") as f:
        f.write(b'{"file": "seg-000009.h5", "first_pa')  # a killed writer's torn line: not listed
    with open(rank_dir / "segments.jsonl", "rb") as f:
        committed = f.read(info["segments_bytes"])
    assert crc32c_by_hand(committed) == info["segments_crc32c"]
    segments = [json.loads(line) for line in committed.splitlines()]
    assert len(segments) == info["segments_listed"] == 3
    holding = [s["file"] for s in segments if s["first_pass"] <= 3 <= s["last_pass"]]
    assert holding == ["seg-000001.h5"]
    with h5py.File(rank_dir / holding[0], "r") as f:
        names = json.loads(f["names"][()])
        index = f["index"][()]
        out = {}
        for row in index[index["pass"] == 3]:
            block = f["blocks"][str(row["block"])]
            rows = block[row["first_row"]:row["first_row"] + row["rows"]]
            if block.attrs.get("scalar", 0):
                rows = rows.reshape(())
            out[names[row["name"]]] = (block.attrs["dtype"], block.attrs["encoding"], rows)
    assert list(out) == list(target_pass(3))
    dtype, encoding, raw = out["model.norm"]
    assert (dtype, encoding) == ("bfloat16", "raw-bits") and raw.dtype == np.uint16
    assert np.all(raw == 0x3F00)  # bfloat16 0.5
    np.testing.assert_array_equal(out["ids"][2], [3, 4])


# ---------------------------------------------------------------------------------------- ls


def test_ls_human_and_json(dump, capsys):
    assert run_cli(cli_dump.cmd_ls, "ls", str(dump)) == 0
    text = capsys.readouterr().out
    assert "fastdump 0.1.0" in text
    lines = [line.split() for line in text.splitlines()[2:]]
    assert [line[:6] for line in lines] == [
        ["draft", DRAFT, "3", "0..2", "2", "3"],
        ["target", TARGET, "5", "0..4", "3", "25"],
        ["target", TARGET1, "5", "0..4", "3", "25"],
    ]
    assert all(line[-1] == "closed" for line in lines)

    assert run_cli(cli_dump.cmd_ls, "ls", str(dump), "--json") == 0
    listing = json.loads(capsys.readouterr().out)
    target = [r for r in listing["ranks"] if r["role"] == "target" and r["rank"] == TARGET][0]
    pass_bytes = sum(t.numel() * t.element_size() for t in target_pass(0).values())
    assert target["passes"] == 5 and target["first_pass"] == 0 and target["last_pass"] == 4
    assert target["segments"] == 3 and target["tensors"] == 25 and target["bytes"] == 5 * pass_bytes
    assert target["status"] == "closed" and target["dropped"] == 0 and target["incomplete_passes"] == []


def test_ls_and_show_say_each_problem_once_without_python_warnings(dump):
    """The reader warns of each problem (Python warnings, for programs); ls and show print their own
    ``warning:`` line per problem, and not the Python warning again with its source line."""
    path = seg_path(dump, number=1)
    path.write_bytes(path.read_bytes()[:100])
    for argv in (["ls", dump], ["show", dump, "--role", "target", "--rank", TARGET, "--pass", "0"]):
        done = subprocess.run([sys.executable, "-m", "fastdump", *map(str, argv)], capture_output=True, text=True,
                              cwd=REPO, timeout=120)
        assert done.returncode == 0, done.stderr
        assert "UserWarning" not in done.stderr and "warnings.warn" not in done.stderr, done.stderr
        said = [line for line in done.stderr.splitlines() if "seg-000001.h5" in line]
        assert len(said) == 1 and said[0].startswith("warning: ") and "unreadable segment" in said[0], done.stderr


def test_cli_module_runs_as_a_program(dump):
    out = subprocess.run([sys.executable, "-m", "fastdump.cli.dump", "ls", str(dump), "--json"],
                         capture_output=True, text=True, check=True, cwd=REPO).stdout
    assert len(json.loads(out)["ranks"]) == 3
    done = subprocess.run([sys.executable, "-m", "fastdump.cli.dump", "verify", str(dump)],
                          capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0 and done.stdout.strip().endswith("OK")


# ---------------------------------------------------------------------------------------- verify


def verify(root, capsys, *extra):
    code = run_cli(cli_dump.cmd_verify, "verify", str(root), *extra)
    return code, capsys.readouterr().out


def test_verify_clean_dump(dump, capsys):
    code, out = verify(dump, capsys, "--data")
    assert code == 0, out
    assert out.strip() == "OK"
    code, out = verify(dump, capsys, "--json")
    assert code == 0 and json.loads(out) == {"ok": True, "problems": [], "warnings": []}


def test_verify_fails_on_truncated_segment(dump, capsys):
    path = seg_path(dump, number=1)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    code, out = verify(dump, capsys)
    assert code == 1
    assert "seg-000001.h5: cannot open" in out


def test_verify_fails_on_corrupted_metadata(dump, capsys):
    path = seg_path(dump, number=0)
    data = bytearray(path.read_bytes())
    data[0:8] = b"\0" * 8  # the HDF5 signature
    path.write_bytes(bytes(data))
    code, out = verify(dump, capsys)
    assert code == 1 and "seg-000000.h5" in out


def test_verify_fails_on_index_not_matching_its_block(dump, capsys):
    with h5py.File(seg_path(dump, number=0), "r+") as f:
        index = f["index"][()]
        index["rows"][0] += 1
        f["index"][...] = index
    code, out = verify(dump, capsys)
    assert code == 1
    assert "do not tile" in out


def test_verify_fails_on_wrong_dtype_attribute(dump, capsys):
    with h5py.File(seg_path(dump, number=0), "r+") as f:
        f["blocks"]["0"].attrs["dtype"] = "float64"  # stored as float32
    code, out = verify(dump, capsys)
    assert code == 1 and "expected float64" in out


def test_verify_fails_on_segment_missing_vs_rank_json(dump, capsys):
    seg_path(dump, number=1).unlink()
    code, out = verify(dump, capsys)
    assert code == 1
    assert "seg-000001.h5 is listed in segments.jsonl but missing" in out


def test_verify_fails_on_overlapping_passes(dump, capsys):
    rank_dir = dump / "target" / TARGET
    shutil.copy(seg_path(dump, number=1), rank_dir / "seg-000003.h5")
    info = read_rank_json(rank_dir)
    info["segments"].append(dict(info["segments"][1], file="seg-000003.h5"))
    info["passes"] += 2
    info["tensors"] += 10
    info["bytes"] += info["segments"][1]["bytes"]
    write_rank_json(rank_dir, info)
    code, out = verify(dump, capsys)
    assert code == 1 and "overlap" in out


def test_verify_fails_on_error_status(dump, capsys):
    path = dump / "draft" / DRAFT / "rank.json"
    info = json.loads(path.read_text())
    info.update(status="error", error="OSError: No space left on device")
    path.write_text(json.dumps(info))
    code, out = verify(dump, capsys)
    assert code == 1 and "No space left on device" in out


def test_producer_error_file_is_merged_by_reader_and_ls_and_fails_verify(dump, capsys):
    """The serving process's own record (it could not tell the writer) shows in the reader and
    `ls` as the rank's error and fails verify; rank.json itself is not touched."""
    rank_dir = dump / "draft" / DRAFT
    before = (rank_dir / "rank.json").read_bytes()
    (rank_dir / "producer_error.json").write_text(json.dumps({"status": "error", "error": "close timed out"}))
    with reader.open(dump) as ds:
        info = ds.rank_info("draft", DRAFT)
        assert info["status"] == "error" and info["error"] == "close timed out"
        assert info["producer_error"]["error"] == "close timed out"
        assert ds.rank_info("target", TARGET)["status"] == "closed"  # other ranks unaffected
        assert len(ds.passes("draft", DRAFT)) == 3  # the data stays readable
    assert run_cli(cli_dump.cmd_ls, "ls", str(dump), "--json") == 0
    ranks = {r["rank"]: r for r in json.loads(capsys.readouterr().out)["ranks"] if r["role"] == "draft"}
    assert ranks[DRAFT]["status"] == "error" and ranks[DRAFT]["error"] == "close timed out"
    code, out = verify(dump, capsys)
    assert code == 1 and "producer_error.json" in out and "close timed out" in out
    assert (rank_dir / "rank.json").read_bytes() == before


def test_damaged_producer_error_file_still_fails_verify(dump, capsys):
    rank_dir = dump / "target" / TARGET
    (rank_dir / "producer_error.json").write_text("{not json")
    code, out = verify(dump, capsys)
    assert code == 1 and "producer_error.json" in out
    with reader.open(dump) as ds:
        assert ds.rank_info("target", TARGET)["status"] == "error"


def test_verify_temp_files_warn_when_interrupted_and_fail_when_closed(tmp_path, capsys):
    root = tmp_path / "dump"
    write_rank(root, "target", TARGET, {p: target_pass(p) for p in range(3)}, status="incomplete")
    rank_dir = root / "target" / TARGET
    (rank_dir / ".seg-000002.h5.tmp").write_bytes(b"what a kill -9 leaves")
    code, out = verify(root, capsys)
    # The leftover itself is only a warning; the unfinished status is the (one) problem.
    assert code == 1 and out.count("PROBLEM") == 1 and "status incomplete" in out, out
    assert "warning:" in out and ".seg-000002.h5.tmp" in out

    info = json.loads((rank_dir / "rank.json").read_text())
    info["status"] = "closed"
    (rank_dir / "rank.json").write_text(json.dumps(info))
    code, out = verify(root, capsys)
    assert code == 1 and "leftover temporary file" in out


def test_verify_unlisted_segment(tmp_path, capsys):
    root = tmp_path / "dump"
    write_rank(root, "target", TARGET, {p: target_pass(p) for p in range(4)}, status="running")
    rank_dir = root / "target" / TARGET
    info = read_rank_json(rank_dir)
    info["segments"] = info["segments"][:1]  # killed between the rename and the segment list's update
    write_rank_json(rank_dir, info)
    code, out = verify(root, capsys)
    # Listed as a warning; the dump fails only because status running means unfinished.
    assert code == 1 and "warning:" in out and "seg-000001.h5 is not listed" in out
    assert out.count("PROBLEM") == 1 and "status running" in out, out
    info["status"] = "closed"
    write_rank_json(rank_dir, info)
    code, out = verify(root, capsys)
    assert code == 1 and "seg-000001.h5 is not listed" in out


def test_show_and_diff_given_a_rank_or_role_directory_name_the_root_to_give(dump, capsys):
    """show and diff gave the expected layout alone when given a rank or role directory for the
    dump root, an easy slip: each names the root to give instead (ls and verify: the test above)."""
    from fastdump import cli

    layout = "no rank directories (expected <root>/<role>/<rank>/rank.json)"
    for given, kind in ((dump / "target" / TARGET, "rank"), (dump / "target", "role")):
        hint = f"{given} is a {kind} directory; its dump root is {dump}"
        assert run_cli(cli_dump.cmd_show, "show", str(given), "--pass", "0") == 1
        assert capsys.readouterr().err == f"fastdump show: no rank directories in {given} (expected <root>/<role>/<rank>/rank.json); {hint}\n"
        assert cli.main(["diff", str(dump), str(given)]) == 2
        assert capsys.readouterr().err == f"fastdump diff: target {given}: {layout}; {hint}\n"


def test_verify_empty_directory_fails(tmp_path, capsys):
    code, out = verify(tmp_path, capsys)
    assert code == 1 and "no rank directories" in out


# ---------------------------------------------------------------------------------------- show


def test_show_prints_stats(dump, capsys):
    assert run_cli(cli_dump.cmd_show, "show", str(dump), "--role", "target", "--rank", "0", "--pass", "2") == 0
    out = capsys.readouterr().out
    first, *table = out.splitlines()
    assert first.startswith("pass 2: ") and json.loads(first[len("pass 2: "):])["forward_mode"] == "decode"
    rows = {line.split()[0]: line.split() for line in table[1:]}
    assert list(rows) == list(target_pass(2))
    # name dtype shape min max mean std nan inf
    assert rows["model.embed_tokens"][1:] == ["float32", "[2,", "4]", "2", "9", "5.5", "2.29129", "0", "0"]
    # NaN/Inf are counted, statistics use the finite values
    assert rows["model.layers.0.mlp"][4:] == ["-2", "3", "0.666667", "2.0548", "1", "2"]
    assert rows["model.norm"][1:] == ["bfloat16", "[2,", "4]", "0.5", "0.5", "0.5", "0", "0", "0"]
    assert rows["ids"][1:4] == ["int64", "[2]", "2"]
    assert rows["packed"][1:] == ["float4_e2m1fn_x2", "[3]", "-", "-", "-", "-", "-", "-"]


def test_show_name_filter_and_errors(dump, capsys):
    argv = ["show", str(dump), "--role", "target", "--rank", TARGET1, "--pass", "0", "--name", r"^model\.(norm|embed)"]
    assert run_cli(cli_dump.cmd_show, *argv) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()[2:]]
    assert names == ["model.embed_tokens", "model.norm"]
    assert run_cli(cli_dump.cmd_show, "show", str(dump), "--role", "target", "--rank", "0", "--pass", "42") == 1
    assert "no pass 42" in capsys.readouterr().err
    assert run_cli(cli_dump.cmd_show, "show", str(dump), "--rank", "0", "--pass", "0") == 1  # two roles


def test_show_reads_a_large_pass_one_tensor_at_a_time(tmp_path, monkeypatch, capsys):
    """show loaded a whole pass before printing a line: a 20 GB prefill pass needed 20 GB (a 384 MiB
    pass took 672 MB of resident memory, 296 MB now). Past SHOW_LOAD_BYTES it holds one tensor at
    a time, and prints what the whole load printed (a repeated name's copies included)."""
    import weakref

    write_rank_dir(tmp_path / "target" / TARGET, {0: {f"t{k}": torch.full((3,), float(k)) for k in range(5)}})
    from fastdump import dtypes
    from fastdump.writer.channel_writer import ChannelWriter

    writer = ChannelWriter({"op": "open", "channel": 0, "dir": str(tmp_path / "dup" / "target" / TARGET),
                            "role": "target", "rank": {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1,
                                                       "rank": 0}, "pid": 100, "host": "h", "device": {}, "config": {}})
    writer.on_name(0, "a")
    writer.on_name(1, "z")
    writer.on_begin(0, {})
    for index, t in ((0, torch.tensor([1.0, -1.0])), (1, torch.ones(1)), (0, torch.arange(4.))):  # 'a' twice
        writer.on_tensor(index, 0, dtypes.code_of(t.dtype), tuple(t.shape), t.view(torch.uint8).numpy().copy())
    writer.on_end(0, {}, 0, [])
    writer.close({})

    def show(root):
        args = argparse.Namespace(root=str(root), role=None, rank=None, session=None, pass_id=0, name=None)
        assert cli_dump.cmd_show(args) == 0
        return capsys.readouterr().out

    whole = show(tmp_path), show(tmp_path / "dup")
    alive, peak = set(), [0]
    real_tensor = reader.DumpSet.tensor

    def counted(self, *a, **k):
        t = real_tensor(self, *a, **k)
        alive.add(id(t))
        weakref.finalize(t, alive.discard, id(t))
        peak[0] = max(peak[0], len(alive))
        return t

    monkeypatch.setattr(reader.DumpSet, "tensor", counted)
    monkeypatch.setattr(cli_dump, "SHOW_LOAD_BYTES", 0)
    assert show(tmp_path) == whole[0] and peak[0] == 1
    # (the copies of a repeated name are printed together)
    assert show(tmp_path / "dup").splitlines()[1:] == [whole[1].splitlines()[k] for k in (1, 2, 4, 3)]
    assert whole[1].splitlines()[4].startswith("a#dup1  float32  [4]    0    3    1.5   1.11803")


def test_show_of_a_pass_still_in_the_open_segment_says_so(tmp_path, capsys):
    """A running rank keeps its ended passes in its open segment: show said only 'no pass 0', as
    if the model had never run it."""
    import socket

    rank_dir = tmp_path / "target" / TARGET
    write_rank_dir(rank_dir, {0: {"x": torch.ones(2)}})
    info = read_rank_json(rank_dir)
    info.update(status="running", pending_passes=3, host=socket.gethostname(), pid=os.getpid())
    write_rank_json(rank_dir, info)
    args = argparse.Namespace(root=str(tmp_path), role=None, rank=None, session=None, pass_id=1, name=None)
    assert cli_dump.cmd_show(args) == 1
    assert capsys.readouterr().err == (
        f"fastdump show: no pass 1 in target/{TARGET}: its only pass is 0 (the rank is still being written: 3 ended pass(es) are in its open segment, not "
        "yet in a file; they are readable once the segment is full or the Dumper is closed)\n")
    info.update(pid=2 ** 22 + 12345)  # no such process: those passes are lost
    write_rank_json(rank_dir, info)
    assert cli_dump.cmd_show(args) == 1
    assert capsys.readouterr().err == (f"fastdump show: no pass 1 in target/{TARGET}: its only pass is 0 (3 ended pass(es) were in the open segment of a "
                                       "writer whose process is gone: lost)\n")
    args.pass_id = 0  # a written pass still shows
    assert cli_dump.cmd_show(args) == 0 and "x     float32  [2]" in capsys.readouterr().out
    # A pid too large for the kernel (os.kill: OverflowError, not OSError) was a traceback.
    info.update(pid=10 ** 30)
    write_rank_json(rank_dir, info)
    args.pass_id = 1
    assert cli_dump.cmd_show(args) == 1
    assert capsys.readouterr().err.endswith("writer whose process is gone: lost)\n")
    assert cli_dump.main(["verify", str(tmp_path)]) == 1
    assert "status running (its process is gone)" in capsys.readouterr().out


# ------------------------------------------------------------- a new user's likely mistakes


def test_a_wrong_root_path_names_the_dump_root_meant(dump, tmp_path, capsys):
    """`fastdump ls dumps` for `dumps/demo` (or a role or rank directory) said "no rank directories"
    and exited 0, and fastdump.open's KeyError said no more: each now names the root meant, and ls
    exits 1 for a directory that is no dump."""
    rank_dir = dump / "target" / TARGET
    cases = {
        tmp_path: f"dump roots below {tmp_path}: {dump}",
        dump / "target": f"{dump / 'target'} is a role directory; its dump root is {dump}",
        rank_dir: f"{rank_dir} is a rank directory; its dump root is {dump}",
    }
    for path, hint in cases.items():
        assert run_cli(cli_dump.cmd_ls, "ls", str(path)) == 1
        assert capsys.readouterr().out == f"{path}\nno rank directories; {hint}\n"
        assert run_cli(cli_dump.cmd_ls, "ls", str(path), "--json") == 1
        assert json.loads(capsys.readouterr().out)["not_a_dump"] == hint
        code, out = verify(path, capsys)
        assert code == 1 and f"no rank directories (expected <root>/<role>/<rank>/rank.json); {hint}\n" in out
        with pytest.raises(KeyError) as info, reader.open(path) as ds:
            ds.passes()
        assert info.value.args[0] == (f"no rank directories in {path} (expected <root>/<role>/<rank>/rank.json); "
                                      f"{hint}")
    old = tmp_path / "runs" / "old"  # a root without fastdump.json (format 1), a file beside its roles
    shutil.copytree(dump / "draft", old / "draft")
    (old / "notes.txt").write_text("")
    assert reader.wrong_root_hint(tmp_path / "runs") == f"dump roots below {tmp_path / 'runs'}: {old}"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_cli(cli_dump.cmd_ls, "ls", str(empty)) == 1  # no fastdump.json, no rank: no dump
    assert capsys.readouterr().out == f"{empty}\nno rank directories\n"
    started = tmp_path / "started"  # attach made fastdump.json; no rank directory yet: a dump, empty
    started.mkdir()
    fsutil.atomic_write_json(str(started / "fastdump.json"), {"format_version": 1})
    assert run_cli(cli_dump.cmd_ls, "ls", str(started)) == 0
    assert capsys.readouterr().out == f"{started}\n{STARTED}\n"
    assert run_cli(cli_dump.cmd_ls, "ls", str(started), "--json") == 0
    assert "not_a_dump" not in json.loads(capsys.readouterr().out)


STARTED = ("no rank directories: fastdump.json says a Dumper attached here, but no session has written its "
           "rank.json (a run still starting, or its rank directories were removed: fastdump verify fails then)")


def test_ls_json_of_a_missing_root_prints_the_object_of_a_path_that_is_no_dump(tmp_path, capsys):
    """`fastdump ls --json` of a missing root printed nothing on stdout (a script's JSON parser failed
    on ""), where a role directory or an empty one gets an object with `not_a_dump`: so does it."""
    missing = tmp_path / "nope"
    assert run_cli(cli_dump.cmd_ls, "ls", str(missing), "--json") == 1
    out, err = capsys.readouterr()
    assert json.loads(out) == {"root": str(missing), "manifest": {}, "ranks": [], "problems": [],
                               "not_a_dump": f"no dump directory at {missing}: no such file or directory"}
    assert err == f"fastdump ls: no dump directory at {missing}: no such file or directory\n"
    assert run_cli(cli_dump.cmd_ls, "ls", str(missing)) == 1  # without --json: the message alone
    assert capsys.readouterr() == ("", f"fastdump ls: no dump directory at {missing}: no such file or directory\n")


def test_a_role_asked_of_a_role_or_rank_directory_names_the_dump_root_meant(dump):
    """fastdump.open(role or rank directory).load("target", 0, 0), README's first read, said only
    "no role 'target' in ... (roles: [])": it names the root meant, as ls and a role-less read do."""
    for path, kind in ((dump / "target", "role"), (dump / "target" / TARGET, "rank")):
        for read in (lambda ds: ds.load("target", 0, 0), lambda ds: ds.passes("target", 0)):
            with pytest.raises(KeyError) as info, reader.open(path) as ds:
                read(ds)
            assert info.value.args[0] == (f"no role 'target': no rank directories in {path} (expected "
                                          f"<root>/<role>/<rank>/rank.json); {path} is a {kind} directory; "
                                          f"its dump root is {dump}")
    with pytest.raises(KeyError) as info, reader.open(dump) as ds:  # a dump without that role: its roles
        ds.load("reward", 0, 0)
    assert info.value.args[0] == f"no role 'reward' in {dump} (roles: ['draft', 'target'])"


def test_ls_of_a_dump_root_whose_rank_directories_were_all_removed(tmp_path, capsys):
    """ls of a root with fastdump.json and no rank directory said only "no rank directories", exit 0,
    whether the run was starting or its data had been removed. It now says what fastdump.json
    means and, where the root records a role attached whose dump is gone, warns naming it. Exit 0
    still: ROOT is a dump (ls exits 1 for no dump only); verify fails it."""
    root = tmp_path / "dump"
    model = torch.nn.Linear(4, 3)
    with fastdump.attach(model, root, writer="thread"), torch.inference_mode():
        out = model(torch.ones(2, 4))
    assert run_cli(cli_dump.cmd_ls, "ls", str(root)) == 0
    assert "closed" in capsys.readouterr().out
    with fastdump.open(root) as ds:
        assert torch.equal(ds.load("target", 0, 0)["Linear"], out)
    shutil.rmtree(root / "target")
    lost = f"{root / 'target'}: role 'target' was attached here (fastdump.roles/target) but its directory is gone"
    assert run_cli(cli_dump.cmd_ls, "ls", str(root)) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines()[1:] == [STARTED]
    assert captured.err == f"warning: {lost}: that role's dump is not here\n"
    assert run_cli(cli_dump.cmd_ls, "ls", str(root), "--json") == 0
    listing = json.loads(capsys.readouterr().out)
    assert listing["ranks"] == [] and listing["problems"] == [f"{lost}: that role's dump is not here"]
    code, text = verify(root, capsys)
    assert code == 1 and f"{lost}: that role's dump is not here" in text
    (root / "target").mkdir()  # emptied rather than removed: the same loss
    assert run_cli(cli_dump.cmd_ls, "ls", str(root)) == 0
    assert "its directory holds no rank directory: its sessions were removed" in capsys.readouterr().err


def test_a_pass_id_out_of_range_names_the_rank_and_its_passes(dump, capsys):
    """It said KeyError 'no pass 99' alone: which rank, and which passes are there?"""
    with reader.open(dump) as ds:
        with pytest.raises(KeyError) as info:
            ds.load("target", TARGET, 99)
        assert info.value.args[0] == f"no pass 99 in target/{TARGET}: its passes are 0..4"
        with pytest.raises(KeyError) as info:
            ds.load("draft", DRAFT, 3)
        assert info.value.args[0] == f"no pass 3 in draft/{DRAFT}: its passes are 0..2"
    assert run_cli(cli_dump.cmd_show, "show", str(dump), "--role", "draft", "--pass", "7") == 1
    assert capsys.readouterr().err == f"fastdump show: no pass 7 in draft/{DRAFT}: its passes are 0..2\n"


def test_help_texts_say_what_root_is_and_read_as_text():
    """`fastdump --help` showed the module docstring's RST (``fastdump``), and ls/verify/show
    listed their ROOT argument with no word of what it is."""
    from fastdump.cli.main import build_parser

    parser = build_parser()
    top = parser.format_help()
    assert "``" not in top and "ROOT is the directory given to attach" in top
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("ls", "verify", "show"):
        text = " ".join(subparsers.choices[name].format_help().split())
        assert "root dump root: the directory given to fastdump.attach" in text, name


def test_loading_a_pass_still_in_the_open_segment_says_so_in_python_too(tmp_path):
    """Only `fastdump show` said that a running rank holds its ended passes in its open segment;
    fastdump.open(...).load said 'no pass 1', as if the model had never run it."""
    import socket

    rank_dir = tmp_path / "target" / TARGET
    write_rank_dir(rank_dir, {0: {"x": torch.ones(2)}})
    info = read_rank_json(rank_dir)
    info.update(status="running", pending_passes=3, host=socket.gethostname(), pid=os.getpid())
    write_rank_json(rank_dir, info)
    with reader.open(tmp_path) as ds, pytest.raises(KeyError) as caught:
        ds.load("target", 0, 1)
    assert caught.value.args[0] == (
        f"no pass 1 in target/{TARGET}: its only pass is 0 (the rank is still being written: 3 ended pass(es) are "
        "in its open segment, not yet in a file; they are readable once the segment is full or the Dumper is closed)")


def test_output_piped_into_a_reader_that_stops_ends_quietly(dump):
    """`fastdump show ... | head` printed a BrokenPipeError traceback once head had its lines."""
    for argv in (["show", str(dump), "--role", "draft", "--pass", "0"], ["ls", str(dump)]):
        proc = subprocess.Popen([sys.executable, "-m", "fastdump", *argv], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        proc.stdout.close()  # the reader is gone before the first line is written (imports take longer)
        err = proc.stderr.read()
        proc.stderr.close()
        assert proc.wait(timeout=60) == 141 and err == b"", (argv, err)


def test_a_missing_pass_id_or_a_misspelt_tensor_name_says_what_to_do(dump):
    """load("target", 0) said "no pass None: a pass id is an integer"; tensor() of a misspelt name
    said "no tensor 'model.nrom' in pass 0" without the name meant."""
    with reader.open(dump) as ds:
        with pytest.raises(KeyError) as caught:
            ds.load("draft", DRAFT)
        assert caught.value.args[0] == "a pass id must be given: load(role, rank, pass_id); passes(role, rank) lists them"
        with pytest.raises(KeyError) as caught:
            ds.tensor("target", TARGET, "model.nrom", 0)
        assert caught.value.args[0] == "no tensor 'model.nrom' in pass 0 (did you mean 'model.norm'?)"
        with pytest.raises(KeyError) as caught:
            ds.tensor("target", TARGET, "zzz", 0)
        assert caught.value.args[0] == "no tensor 'zzz' in pass 0 (5 names)"


def test_show_of_a_rank_with_two_sessions_says_which_options_choose(tmp_path, capsys):
    """The reader's advice named Python's `session=` alone; `fastdump show` takes --rank DIR or --session."""
    first, second = (f"{TARGET}_20260101T00000{i}.000000Z-0000000{i}" for i in (1, 2))
    for name in (first, second):
        write_rank_dir(tmp_path / "target" / name, {0: {"x": torch.ones(2)}})
    assert run_cli(cli_dump.cmd_show, "show", str(tmp_path), "--rank", "0", "--pass", "0") == 1
    assert capsys.readouterr().err == (
        f"fastdump show: rank 0 of role 'target' has 2 sessions: {[first, second]}; pass the directory name as "
        "rank, or session= (fastdump show: --rank DIR or --session S)\n")
    assert run_cli(cli_dump.cmd_show, "show", str(tmp_path), "--pass", "0") == 1
    assert capsys.readouterr().err == (
        f"fastdump show: rank must be given: role 'target' has rank directories {[first, second]}; pass one as "
        "rank (fastdump show: --rank DIR)\n")
