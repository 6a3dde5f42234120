"""Hostile tests of the read side: the public reader API (``fastdump.open`` -> DumpSet /
MultiDumpSet), ``fastdump ls / show / export`` and multi-root reading, on dumps being written,
killed writers, odd directory contents, odd names and ids, odd dtypes and concurrent readers.

The rule: a read returns exactly what was dumped or raises a clear error (DumpError / ValueError /
KeyError naming the path), never another tensor's data, never hangs, never crashes; a CLI command
on bad input exits non-zero with a message and no traceback.
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import fastdump
from fastdump import format as fmt
from fastdump import reader
from fastdump.reader import Problem
from fastdump.cli.dump import list_dump
from fastdump.cli.main import main as cli_main_entry

from conftest import read_rank_json, write_rank_dir, write_rank_json

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
R0 = "TP0_PP0_Rank0_pid100_20260101T000000.000000Z-00000001"
R0B = "TP0_PP0_Rank0_pid100_20260101T000001.000000Z-00000002"  # a second session of rank 0
R1 = "TP1_PP0_Rank1_pid101_20260101T000000.000000Z-00000003"
RANK0 = {"tp_rank": 0, "tp_size": 2, "pp_rank": 0, "pp_size": 1, "rank": 0}
RANK1 = {"tp_rank": 1, "tp_size": 2, "pp_rank": 0, "pp_size": 1, "rank": 1}


def tensors_of(p, tag=0.0):
    return {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4) + p + tag,
            "b": torch.full((2,), p, dtype=torch.int64)}


def write(root, rank_dir, passes=4, rank=RANK0, tag=0.0, **kw):
    return write_rank_dir(root / "target" / rank_dir, {p: tensors_of(p, tag) for p in range(passes)}, rank=rank,
                          **kw)


@pytest.fixture
def dump(tmp_path):
    root = tmp_path / "dump"
    write(root, R0, segment_passes=2)
    write(root, R1, rank=RANK1, tag=100.0, segment_passes=2)
    return root


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def cli(*argv, capsys=None):
    """``fastdump ARGV`` in this process: (exit code, stdout, stderr). An exception escaping main
    is what a user would see as a traceback: it fails the test."""
    code = cli_main_entry([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def cli_proc(*argv, prefix=(), timeout=120):
    return subprocess.run([*prefix, sys.executable, "-m", "fastdump", *map(str, argv)], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


def no_escapes(text):
    return not any(c in text for c in "\x1b\x07\x9b\x00\r")


def wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


# ------------------------------------------------------------------------- a dump being written


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_reading_between_segments_of_a_live_dump(tmp_path, writer):
    root = tmp_path / "live"
    model = torch.nn.Linear(4, 4)
    d = fastdump.attach(model, root, writer=writer, segment_passes=1, segment_idle_seconds=0)
    try:
        outs = []
        ds = fastdump.open(root)
        with torch.inference_mode():
            for p in range(6):
                outs.append(model(torch.full((1, 4), float(p))))
                rank = d.dir.name
                # the segment of pass p - 1 is on disk once pass p began (segment_passes=1)
                assert wait_for(lambda: len(list(d.dir.glob("seg-*.h5"))) >= p)
                # a writer's temporary file is never read, whatever it holds
                (d.dir / f".seg-{900 + p:06d}.h5.tmp").write_bytes(b"half a segment")
                ds.refresh()
                visible = ds.passes("target", rank)
                assert visible == list(range(len(visible))) and len(visible) >= p
                for q in visible:
                    assert same(ds.load("target", rank, q, check=True)["Linear"], outs[q])
                summary = ds.summary("target", rank)
                assert summary["unreadable_segments"] == 0 and summary["passes"] == len(visible)
                assert ds.rank_info("target", rank)["status"] == "running"
        ds.close()
    finally:
        d.close()
    with fastdump.open(root) as ds:
        assert ds.passes("target", 0) == list(range(6))
        assert all(same(ds.load("target", 0, p, check=True)["Linear"], outs[p]) for p in range(6))
        assert ds.rank_info("target", 0)["status"] == "closed"


def test_summary_of_a_cached_rank_does_not_call_new_segments_unreadable(dump):
    """A long-lived DumpSet sees a segment written after its index was cached: until refresh() it is
    simply not there yet, not an 'unreadable segment'."""
    ds = fastdump.open(dump)
    assert ds.passes("target", 0) == [0, 1, 2, 3]
    rank_dir = dump / "target" / R0
    write_rank_dir(dump / "scratch", {4: tensors_of(4)}, rank=RANK0)
    shutil.copy(dump / "scratch" / "seg-000000.h5", rank_dir / "seg-000002.h5")  # the writer's next segment
    summary = ds.summary("target", 0)
    assert summary["unreadable_segments"] == 0, summary
    assert summary["segments"] == 2 and summary["passes"] == 4
    ds.refresh()
    assert ds.passes("target", 0) == [0, 1, 2, 3, 4] and ds.summary("target", 0)["unreadable_segments"] == 0
    assert same(ds.load("target", 0, 4)["a"], tensors_of(4)["a"])


def test_ls_during_a_live_dump_lists_pending_passes_and_exits_0(tmp_path, capsys):
    root = tmp_path / "live"
    model = torch.nn.Linear(4, 4)
    d = fastdump.attach(model, root, writer="thread", segment_passes=1000, segment_idle_seconds=0)
    try:
        with torch.inference_mode():
            for p in range(3):
                model(torch.ones(1, 4))
        d.begin_pass()  # an open pass: nothing of it is on disk
        code, out, err = cli("ls", root, capsys=capsys)
        assert code == 0 and "running" in out and "Traceback" not in err
        with fastdump.open(root) as ds:
            with pytest.raises(KeyError):
                ds.load("target", 0, 3)
        d.end_pass()
    finally:
        d.close()


# ------------------------------------------------------------------------------ a killed writer


def test_a_sigkilled_writer_leaves_a_readable_running_dump(tmp_path, capsys):
    root = tmp_path / "killed"
    model = torch.nn.Linear(4, 4)
    d = fastdump.attach(model, root, segment_passes=1, segment_idle_seconds=0)  # the writer process
    try:
        outs = []
        with torch.inference_mode():
            for p in range(4):
                outs.append(model(torch.full((1, 4), float(p))))
        assert wait_for(lambda: len(list(d.dir.glob("seg-*.h5"))) >= 3)
        os.kill(d._engine._proc.pid, signal.SIGKILL)
        d._engine._proc.wait()
        (d.dir / ".seg-000099.h5.tmp").write_bytes(os.urandom(4096))  # what a kill mid-segment leaves
        with fastdump.open(root) as ds:
            assert ds.rank_info("target", 0)["status"] == "running"
            passes = ds.passes("target", 0)
            assert len(passes) >= 3 and passes == list(range(len(passes)))
            for p in passes:
                assert same(ds.load("target", 0, p, check=True)["Linear"], outs[p])
            assert not ds.problems
        code, out, err = cli("ls", root, capsys=capsys)
        assert code == 0 and "running" in out and "Traceback" not in err
        code, out, err = cli("show", root, "--pass", "0", capsys=capsys)
        assert code == 0 and "Linear" in out
    finally:
        d.close(timeout=10)
    assert fastdump.open(root).rank_info("target", 0)["status"] == "error"


def test_a_dump_left_running_by_a_dead_process_reads_and_ls_says_so(tmp_path, capsys):
    root = tmp_path / "dump"
    write(root, R0, status="running")
    info_path = root / "target" / R0 / "rank.json"
    info = json.loads(info_path.read_text())
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    info.update(pid=dead.pid, host=__import__("socket").gethostname())
    info_path.write_text(json.dumps(info))
    with fastdump.open(root) as ds:
        assert same(ds.load("target", 0, 3)["a"], tensors_of(3)["a"])
    code, out, _ = cli("ls", root, capsys=capsys)
    assert code == 0 and "its process is gone" in out


def test_a_running_rank_whose_pid_another_process_holds_now_reads_as_gone(tmp_path, capsys):
    """A writer killed with its serving process left status "running"; its pid was later given to
    another process (pids wrap; a restarted container's pid 1). ls said the rank was still being
    written and its open segment's passes pending (readable later), verify named no lost process:
    the pid alone was asked. rank.json's pid_identity (boot id + start time) tells the two apart."""
    from fastdump import fsutil
    from fastdump.cli import dump as cli_dump

    earlier = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert wait_for(lambda: fsutil.process_identity(earlier.pid) is not None)
        identity = fsutil.process_identity(earlier.pid)
    finally:
        earlier.kill()
        earlier.wait()
    mine = fsutil.process_identity(os.getpid())
    assert identity and mine and identity != mine
    root = tmp_path / "dump"
    write(root, R0, status="running")
    info_path = root / "target" / R0 / "rank.json"
    info = json.loads(info_path.read_text())
    info.update(pid=os.getpid(), host=__import__("socket").gethostname(), pid_identity=identity, pending_passes=3)
    info_path.write_text(json.dumps(info))  # (this live pid, another process's identity: the pid reused)
    assert reader.pid_gone(info)
    code, out, _ = cli("ls", root, capsys=capsys)
    assert code == 0 and "its process is gone" in out and "3 pass(es) of the open segment lost with its process" in out
    assert "in the open segment]" not in out
    report = cli_dump.verify_dump(str(root))
    assert any("status running (its process is gone)" in p for p in report.problems), report.problems
    info["pid_identity"] = mine  # the process that wrote it, still alive: not gone
    info_path.write_text(json.dumps(info))
    assert not reader.pid_gone(info)
    code, out, _ = cli("ls", root, capsys=capsys)
    assert "its process is gone" not in out and "+3 pass(es) in the open segment" in out


def test_the_writer_records_which_process_its_pid_is(tmp_path):
    """rank.json's pid_identity is the serving process's, as fsutil reads it, for both writers."""
    from fastdump import fsutil

    for writer in ("thread", "process"):
        d = fastdump.attach(torch.nn.Linear(2, 2), tmp_path / writer, writer=writer)
        info = json.loads((d.dir / "rank.json").read_text())
        assert d.close()["status"] == "closed"
        assert info["pid"] == os.getpid() and info["pid_identity"] == fsutil.process_identity(os.getpid())
        assert not reader.pid_gone(info)


# ------------------------------------------------------------------- odd directory contents


def test_empty_role_and_rank_directories_and_stray_entries(dump, tmp_path, capsys):
    outside = tmp_path / "outside"
    write(outside, R0, tag=666.0)
    (dump / "README").write_text("not a role")
    (dump / "emptyrole").mkdir()
    (dump / "target" / "TP5_PP0_Rank5_pid1_20260101T000000.000000Z-00000009").mkdir()  # no files at all
    os.symlink(outside / "target", dump / "linked")
    os.symlink(outside / "target" / R0, dump / "target" / "TP7_PP0_Rank7_pid7")
    os.mkfifo(dump / "fifo")
    os.mkfifo(dump / "target" / "fifo")
    (dump / "seg-000000.h5").mkdir()
    (dump / "target" / "seg-000000.h5").mkdir()
    (dump / "target" / R0 / "seg-000009.h5").mkdir()  # a directory named like a segment
    (dump / "target" / R0 / "notes.txt").write_text("hello")
    (dump / "target" / R0 / "seg-000010.h5.bak").write_bytes(b"junk")
    with fastdump.open(dump) as ds:
        assert ds.roles == ["target"]
        assert ds.ranks("target") == [R0, R1]
        with pytest.warns(UserWarning, match="seg-000009.h5.*not a regular file"):
            assert ds.passes("target", 0) == [0, 1, 2, 3]
        assert same(ds.load("target", 0, 2)["a"], tensors_of(2)["a"])
        with pytest.raises(KeyError, match="emptyrole"):
            ds.passes("emptyrole", 0)
        with pytest.raises(KeyError, match="linked"):
            ds.passes("linked", 0)
        with pytest.raises(KeyError):
            ds.passes("target", 7)
        with pytest.raises(reader.DumpError, match="no pass 9 .*seg-000009.h5"):
            ds.load("target", 0, 9)  # may be in the segment it could not read: not a plain KeyError
    code, out, err = cli("ls", dump, capsys=capsys)
    assert code == 0 and R0 in out and "TP5" not in out and "666" not in out
    code, out, err = cli("show", dump, "--rank", "1", "--pass", "1", capsys=capsys)
    assert code == 0 and "a " in out
    # A session's directory without any file: that session recorded nothing, not even why.
    code, out, err = cli("verify", dump, capsys=capsys)
    empty = dump / "target" / "TP5_PP0_Rank5_pid1_20260101T000000.000000Z-00000009"
    assert code == 1 and f"{empty}: a session directory with no rank.json" in out + err, out + err


def test_a_rank_directory_with_rank_json_and_no_segment(tmp_path, capsys):
    root = tmp_path / "dump"
    from fastdump.writer.channel_writer import ChannelWriter

    writer = ChannelWriter({"op": "open", "channel": 0, "dir": str(root / "target" / R0), "role": "target",
                            "rank": RANK0, "pid": 100, "host": "h", "device": {}, "config": {}})
    writer.close({})
    with fastdump.open(root) as ds:
        assert ds.ranks("target") == [R0] and ds.passes("target", 0) == [] and ds.names("target", 0) == []
        assert ds.series("target", 0, "a") == {}
        with pytest.raises(KeyError, match="no pass 0"):
            ds.load("target", 0, 0)
        assert ds.summary("target", 0)["passes"] == 0
    code, out, _ = cli("ls", root, capsys=capsys)
    assert code == 0 and R0 in out
    code, _, err = cli("show", root, "--pass", "0", capsys=capsys)
    assert code == 1 and "no pass 0" in err and "Traceback" not in err
    code, out, err = cli("export", root, tmp_path / "out", capsys=capsys)
    assert code != 0 and "Traceback" not in err


def _setpriv():
    """A command prefix that takes the DAC override capabilities away (root ignores chmod 000)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root and setpriv is missing: chmod 000 cannot stop this process")
    probe = subprocess.run(["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "true"],
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"setpriv cannot drop capabilities here: {probe.stderr!r}")
    return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]


@pytest.mark.parametrize("what", ["rank-dir", "segment", "role-dir"])
def test_unreadable_entries_chmod_000(dump, tmp_path, what):
    prefix = _setpriv()
    target = {"rank-dir": dump / "target" / R1, "segment": dump / "target" / R1 / "seg-000001.h5",
              "role-dir": dump / "draftrole"}[what]
    if what == "role-dir":
        write_rank_dir(target / R0, {0: tensors_of(0)}, rank=RANK0, role="draftrole")
    os.chmod(target, 0)
    try:
        done = cli_proc("ls", dump, prefix=prefix)
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
        assert R0 in done.stdout
        assert "Permission denied" in done.stderr and str(target) in done.stderr
        done = cli_proc("show", dump, "--role", "target", "--rank", "0", "--pass", "3", prefix=prefix)
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr  # another rank reads
        done = cli_proc("show", dump, "--role", "target", "--rank", "1", "--pass", "3", prefix=prefix)
        if what != "role-dir":
            assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
        done = cli_proc("export", "--role-subdirs", "always", dump, tmp_path / "out", prefix=prefix)
        assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
        assert str(target) in done.stderr
        done = cli_proc("verify", dump, prefix=prefix)  # what it cannot read is a problem, not a traceback
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
        if what != "segment":  # (a segment's own open error names it already)
            assert f"{target}: cannot list: Permission denied" in done.stdout + done.stderr
    finally:
        os.chmod(target, 0o755)


def test_unreadable_rank_directory_in_process(dump, monkeypatch):
    """Same as above without needing capabilities: listing a rank directory fails with EACCES."""
    real = os.listdir
    bad = str(dump / "target" / R1)

    def listdir(path="."):
        if os.fspath(path) == bad:
            raise PermissionError(13, "Permission denied", bad)
        return real(path)

    monkeypatch.setattr(os, "listdir", listdir)
    with fastdump.open(dump) as ds:
        assert ds.roles == ["target"]
        assert same(ds.load("target", 0, 1)["a"], tensors_of(1)["a"])
        assert any(bad in p for p in ds.problems)
        # (each problem carries its path and kind: export refuses on the kind, not on the text)
        assert [(p.path, p.kind) for p in ds.problems] == [(bad, Problem.UNLISTABLE)]


# ----------------------------------------------------------------------- almost-matching names


@pytest.mark.parametrize("lookalike", [
    R0 + "\n",  # '$' matches before a final newline
    R0 + " ",
    R0.lower(),
    R0[:-1] + "G",  # not hex
    "TP\u0660_PP0_Rank\u0660_pid100",  # Arabic-Indic digits are \d for re
    "TP0_PP0_Rank0_pid100_backup",
    "TP00_PP0_Rank00_pid100",
    "\u00b2",  # a superscript digit: str.isdigit() but not int()
    "2\u00b2",
])
def test_rank_directories_that_almost_match_the_pattern(dump, lookalike, capsys):
    """A look-alike directory (holding another run's data, and a rank.json saying rank 0) is read
    under its own name, and a rank *number* never silently picks it or the real one's data up
    wrongly: either the real rank 0 or a refusal to choose."""
    write(dump, lookalike, tag=1000.0)
    with fastdump.open(dump) as ds:
        assert lookalike in ds.ranks("target")
        assert same(ds.load("target", lookalike, 2)["a"], tensors_of(2, 1000.0)["a"])
        assert same(ds.load("target", R0, 2)["a"], tensors_of(2)["a"])
        try:
            got = ds.load("target", 0, 2)
        except ValueError as exc:
            assert "sessions" in str(exc)
        else:
            assert same(got["a"], tensors_of(2)["a"])
        assert same(ds.load("target", 1, 2)["a"], tensors_of(2, 100.0)["a"])
    code, out, err = cli("ls", dump, capsys=capsys)
    assert code == 0 and no_escapes(out + err)


# ------------------------------------------------------------------------- sessions and ranks


def test_sessions_accepts_what_rank_accepts(dump):
    write(dump, R0B, tag=50.0)
    with fastdump.open(dump) as ds:
        assert ds.sessions("target", 0) == [R0, R0B]
        assert ds.sessions("target", np.int64(0)) == [R0, R0B]
        assert ds.sessions("target", R0B) == [R0B]  # a directory name, as every other method takes
        with pytest.raises((KeyError, ValueError, TypeError)):
            ds.sessions("target", True)  # a bool is not rank 1
        with pytest.raises(ValueError, match="2 sessions"):
            ds.passes("target", 0)
        with pytest.raises(ValueError, match="2 sessions"):
            ds.rank_info("target", 0)
        session = fmt.parse_rank_dir(R0B)[4]
        assert same(ds.tensor("target", 0, "a", 1, session=session), tensors_of(1, 50.0)["a"])
        assert same(ds.series("target", 0, "a", session=session)[3], tensors_of(3, 50.0)["a"])
        with pytest.raises(KeyError):
            ds.load("target", R0, 1, session=session)  # the directory is not that session


def test_multi_root_sessions_and_numpy_ranks(tmp_path):
    a, b = tmp_path / "host0", tmp_path / "host1"
    write(a, R0)
    write(a, R0B, tag=50.0)
    write(b, R1, rank=RANK1, tag=100.0)
    with fastdump.open([a, b]) as ds:
        assert ds.ranks("target") == [R0, R0B, R1]
        assert same(ds.load("target", np.int64(1), 2)["a"], tensors_of(2, 100.0)["a"])
        assert ds.sessions("target", 0) == [R0, R0B]
        with pytest.raises(ValueError, match="2 sessions"):
            ds.load("target", np.int64(0), 2)
        with pytest.raises(KeyError):
            ds.load("target", True, 2)


def test_multi_root_with_a_damaged_rank_json_is_a_clear_error_or_reads(tmp_path):
    a, b = tmp_path / "host0", tmp_path / "host1"
    write(a, R0)
    write(b, R1, rank=RANK1, tag=100.0)
    path = b / "target" / R1 / "rank.json"
    info = json.loads(path.read_text())
    info["rank"] = [1]
    path.write_text(json.dumps(info))
    with fastdump.open([a, b]) as ds:
        assert same(ds.load("target", 1, 2)["a"], tensors_of(2, 100.0)["a"])


def test_multi_root_refuses_one_root_twice_and_the_same_rank_twice(tmp_path):
    a, b = tmp_path / "host0", tmp_path / "host1"
    write(a, R0)
    shutil.copytree(a, b)
    with pytest.raises(ValueError, match="duplicate rank"):
        fastdump.open([a, b])
    with pytest.raises(ValueError, match="twice"):
        fastdump.open([a, str(a) + "/"])
    os.symlink(a, tmp_path / "alias")
    with pytest.raises(ValueError, match="duplicate"):
        fastdump.open([a, tmp_path / "alias"])
    with pytest.raises(ValueError):
        fastdump.open([])
    with pytest.raises(FileNotFoundError):
        fastdump.open([a, tmp_path / "missing"])



def test_multi_root_refuses_one_directory_name_in_two_roots_even_without_a_rank_number(tmp_path):
    """A rank directory whose name and rank.json give no rank number (a hand-named directory, a
    rank.json without "rank") in two roots: the number check cannot see it, and the second root's
    directory hid the first one's (mutant M01: only the name check refuses it)."""
    roots = [tmp_path / "host0", tmp_path / "host1"]
    for k, root in enumerate(roots):
        path = write(root, "rank-a", tag=100.0 * k)
        info = read_rank_json(path)
        del info["rank"]
        write_rank_json(path, info)
    with pytest.raises(ValueError, match="duplicate rank directory target/rank-a in .*host0 and .*host1"):
        fastdump.open(roots)


def test_multi_root_refuses_one_rank_under_two_directory_names(tmp_path):
    """Rank 0 in two roots under names that differ only in the pid (format 1: no session) is one
    rank twice: refused at open, as the same directory name is (a mutant without the rank-number
    check opened both). Another DP replica's rank 0, or another session of rank 0, is another rank."""
    a, b = tmp_path / "host0", tmp_path / "host1"
    write(a, "TP0_PP0_Rank0_pid100")
    write(b, "TP0_PP0_Rank0_pid200", tag=100.0)
    with pytest.raises(ValueError, match="duplicate rank: role 'target' rank 0 [(]dp 0[)]"):
        fastdump.open([a, b])
    replica = tmp_path / "replica1"
    write(replica, "TP0_PP0_Rank0_pid200", tag=100.0, rank=dict(RANK0, dp_rank=1, dp_size=2))
    with fastdump.open([a, replica]) as ds:
        assert len(ds.ranks("target")) == 2
    first, second = tmp_path / "session1", tmp_path / "session2"
    write(first, R0)
    write(second, R0B.replace("pid100", "pid200"), tag=50.0)
    with fastdump.open([first, second]) as ds:
        assert len(ds.sessions("target", 0)) == 2


def test_a_role_name_never_leads_out_of_the_root(dump, tmp_path):
    other = tmp_path / "other"
    write(other, R0, tag=666.0)
    with fastdump.open(dump) as ds:
        for role in ("../other/target", "../other/target/", "target/../../other/target", ".", "..", "", "/",
                     str(other / "target"), "target\0"):
            with pytest.raises(KeyError):
                ds.load(role, 0, 0)


# ------------------------------------------------------------------------- pass ids and names


def test_pass_ids_that_are_not_integers_are_refused(dump):
    with fastdump.open(dump) as ds:
        assert same(ds.load("target", 0, np.int64(1))["a"], tensors_of(1)["a"])
        for bad in (True, False, 1.0, np.float64(2.0), "1", None, [1]):
            with pytest.raises((KeyError, TypeError)):
                ds.load("target", 0, bad)
            with pytest.raises((KeyError, TypeError)):
                ds.tensor("target", 0, "a", bad)
            with pytest.raises((KeyError, TypeError)):
                ds.meta("target", 0, bad)
            with pytest.raises((KeyError, TypeError)):
                ds.pass_names("target", 0, bad)


@pytest.mark.parametrize("pass_id", [-1, -(1 << 63), 4, (1 << 63) - 1, 1 << 63, 1 << 200, -(1 << 200),
                                     np.uint64((1 << 64) - 1), np.int64(-1)])
def test_absent_negative_and_huge_pass_ids_are_a_key_error(dump, pass_id, capsys):
    with fastdump.open(dump) as ds:
        for call in (lambda: ds.load("target", 0, pass_id), lambda: ds.tensor("target", 0, "a", pass_id),
                     lambda: ds.meta("target", 0, pass_id), lambda: ds.pass_names("target", 0, pass_id)):
            with pytest.raises(KeyError, match="no pass"):
                call()
    code, _, err = cli("show", dump, "--rank", "0", "--pass", int(pass_id), capsys=capsys)
    assert code == 1 and "no pass" in err and "Traceback" not in err


def test_names_given_by_the_user(dump):
    with fastdump.open(dump) as ds:
        for name in ("nope", "", "a\0", "A", " a", "a ", "a#dup1", "b.0", "blocks/0", "0"):
            with pytest.raises(KeyError):
                ds.tensor("target", 0, name, 1)
            assert ds.series("target", 0, name) == {}
        for name in (None, 0, b"a"):
            with pytest.raises((KeyError, TypeError)):
                ds.tensor("target", 0, name, 1)
        assert same(ds.tensor("target", 0, "b", 1), tensors_of(1)["b"])
        assert ds.load("target", 0, 1, select=lambda n: False) == {}


def test_a_real_name_looking_like_a_dup_suffix_keeps_its_own_data(tmp_path):
    """``load`` renames a second tensor of one name in one pass ``name#dup1`` (a faulty writer);
    a tensor really named ``a#dup1`` must not be overwritten by it nor handed out under its name."""
    root = tmp_path / "dump"
    rd = root / "target" / R0
    write_rank_dir(rd, {0: {"a": torch.zeros(2), "c": torch.full((2,), 7.0), "a#dup1": torch.ones(2)}}, rank=RANK0)
    import h5py

    from conftest import restamp_tables

    seg = rd / "seg-000000.h5"
    with h5py.File(seg, "r+") as f:  # a faulty writer: 'c' stored under the name of 'a'
        index = f["index"][()]
        names = json.loads(f["names"][()])
        index["name"][index["name"] == names.index("c")] = names.index("a")
        f["index"][...] = index
    restamp_tables(seg)
    with fastdump.open(root) as ds:
        try:
            got = ds.load("target", 0, 0)
        except reader.DumpError:
            return
        assert same(got["a#dup1"], torch.ones(2)), got
        assert same(ds.tensor("target", 0, "a#dup1", 0), torch.ones(2))


# ------------------------------------------------------------ unicode and control characters


EVIL_NAMES = ["x\x1b[2J\x1b[H", "t\x1b]0;pwned\x07", "csi\x9b31m", "rtl\u202egnp.exe", "nl\nnext", "cr\rover",
              "nul\0byte", "tab\tbed", "zero\u200bwidth", "\u00e9\u4e2d\U0001f600", "bell\x07"]


def test_show_escapes_control_characters_in_tensor_names_and_meta(tmp_path, capsys):
    root = tmp_path / "dump"
    tensors = {name: torch.full((2,), float(i)) for i, name in enumerate(EVIL_NAMES)}
    write_rank_dir(root / "target" / R0, {0: tensors}, rank=RANK0,
                   pass_meta=lambda p: {"mode\x1b[31m": "decode\x1b]0;x\x07"})
    with fastdump.open(root) as ds:
        got = ds.load("target", 0, 0)
        assert list(got) == EVIL_NAMES
        assert all(same(got[name], tensors[name]) for name in EVIL_NAMES)
        assert same(ds.tensor("target", 0, "nul\0byte", 0), tensors["nul\0byte"])
    code, out, err = cli("show", root, "--pass", "0", capsys=capsys)
    assert code == 0 and no_escapes(out + err), repr(out)
    assert "\\x1b" in out and "\u00e9\u4e2d" in out
    assert "\u202e" not in out and "\u200b" not in out
    assert len(out.splitlines()) == 2 + len(EVIL_NAMES)  # one line per tensor: no raw newline from a name
    code, out, err = cli("show", root, "--pass", "0", "--name", "^nl", capsys=capsys)
    assert code == 0 and len(out.splitlines()) == 3


def test_ls_escapes_control_characters_in_role_and_rank_names(tmp_path, capsys):
    root = tmp_path / "dump"
    role = "role\x1b[2J"
    write_rank_dir(root / role / (R0 + "\x1b]0;t\x07"), {0: tensors_of(0)}, rank=RANK0, role=role)
    code, out, err = cli("ls", root, capsys=capsys)
    assert code == 0 and no_escapes(out + err) and "\\x1b" in out
    code, out, err = cli("show", root, "--role", "nosuch\x1b[2J", "--pass", "0", capsys=capsys)
    assert code == 1 and no_escapes(out + err)


def test_export_messages_escape_control_characters(tmp_path, capsys):
    root = tmp_path / "dump"
    rank = "evil\x1b[2J\x1b]0;t\x07"
    write_rank_dir(root / "target" / rank, {0: tensors_of(0)}, rank=RANK0)
    code, out, err = cli("export", root, tmp_path / "out", capsys=capsys)
    assert no_escapes(out + err), repr(err)


def test_show_with_a_bad_regular_expression_exits_1_with_a_message(dump, capsys):
    code, out, err = cli("show", dump, "--rank", "0", "--pass", "0", "--name", "[", capsys=capsys)
    assert code == 1 and "regular expression" in err and "Traceback" not in err


# --------------------------------------------------------------------------------- export


ODD = {
    "bf16": torch.tensor([1.5, -0.0, float("inf"), float("nan")], dtype=torch.bfloat16),
    "bf16_nan_payloads": torch.tensor([0x7FC1, -1, 0x7F81], dtype=torch.int16).view(torch.bfloat16),
    "f8e4m3": torch.tensor(range(256), dtype=torch.uint8).view(torch.float8_e4m3fn),
    "f8e5m2": torch.tensor(range(256), dtype=torch.uint8).view(torch.float8_e5m2),
    "f8e4m3fnuz": torch.tensor(range(256), dtype=torch.uint8).view(torch.float8_e4m3fnuz),
    "f8e8m0": torch.tensor([0, 1, 127, 255], dtype=torch.uint8).view(torch.float8_e8m0fnu),
    "f4x2": torch.tensor([0x00, 0x12, 0xFF], dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
    "c64": torch.tensor([1 + 2j, float("nan") - 1j], dtype=torch.complex64),
    "c128": torch.tensor([[1e300 + 1e-300j]], dtype=torch.complex128),
    "c32": torch.tensor([0x3C00_7E01, 0], dtype=torch.int32).view(torch.complex32),
    "bool": torch.tensor([[True, False], [False, True]]),
    "scalar": torch.tensor(3.25),
    "scalar_bf16": torch.tensor(-2.5, dtype=torch.bfloat16),
    "scalar_bool": torch.tensor(True),
    "empty_rows": torch.empty(0, 3, dtype=torch.float16),
    "empty_cols": torch.empty(2, 0, dtype=torch.int8),
    "empty_1d_f8": torch.empty(0, dtype=torch.float8_e5m2),
    "u64": torch.tensor([-1, -(1 << 63)], dtype=torch.int64).view(torch.uint64),
    "i64_min": torch.tensor([-(1 << 63)], dtype=torch.int64),
    "f16_subnormal": torch.tensor([1, -32767, 0x7C01], dtype=torch.int16).view(torch.float16),
}


@pytest.fixture
def odd_dump(tmp_path):
    root = tmp_path / "odd"
    passes = {p: {name: t.clone() for name, t in ODD.items()} for p in range(2)}
    write_rank_dir(root / "target" / R0, passes, rank=RANK0, segment_passes=1)
    return root


def test_odd_dtypes_read_back_bit_exact(odd_dump):
    with fastdump.open(odd_dump) as ds:
        for p in (0, 1):
            got = ds.load("target", 0, p, check=True)
            assert list(got) == list(ODD)
            for name, want in ODD.items():
                assert same(got[name], want), name
                assert got[name].is_contiguous()
        series = ds.series("target", 0, "scalar_bf16", check=True)
        assert list(series) == [0, 1] and all(same(t, ODD["scalar_bf16"]) for t in series.values())


def test_show_of_odd_dtypes_counts_a_signaling_nan_without_a_warning(odd_dump, capsys):
    """f16_subnormal and bf16_nan_payloads hold signaling NaNs (0x7C01, 0x7F81): widening them to
    float64 made numpy warn "invalid value encountered in cast", which show printed as a "warning:"
    line, as if the dump had a problem. They are NaNs, counted as such."""
    code, out, err = cli("show", odd_dump, "--pass", "0", capsys=capsys)
    assert code == 0 and err == "", err
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:]}
    assert rows["f16_subnormal"][-2:] == ["1", "0"]  # NAN, INF
    assert rows["bf16_nan_payloads"][-6:] == ["-"] * 4 + ["3", "0"]  # no finite value; 3 NaNs


def test_export_sglang_odd_dtypes_round_trip_bit_exact(odd_dump, tmp_path, capsys):
    out = tmp_path / "out"
    code, _, err = cli("export", "--names", "fastdump", odd_dump, out, capsys=capsys)
    assert code == 0, err
    for p in (0, 1):
        got = torch.load(out / "TP0_PP0_Rank0_pid100" / f"Pass{p:05d}.pt", weights_only=True)
        assert list(got) == list(ODD)
        for name, want in ODD.items():
            assert same(got[name], want), name
            assert got[name].untyped_storage().nbytes() == want.numel() * want.element_size(), name


def test_export_sglang_dumper_odd_dtypes_round_trip_bit_exact(odd_dump, tmp_path, capsys):
    out = tmp_path / "out"
    code, _, err = cli("export", "--format", "sglang-dumper", "--names", "fastdump", odd_dump, out, capsys=capsys)
    assert code == 0, err
    files = sorted(out.glob("*.pt"))
    assert len(files) == 2 * len(ODD)
    for path in files:
        record = torch.load(path, weights_only=True)
        meta = record["meta"]
        assert path.name == f"name={meta['name']}___step={meta['step']}___rank=0___dump_index={meta['dump_index']}.pt"
        assert same(record["value"], ODD[meta["name"]]), meta["name"]


SUB_BYTE = {f"{kind}{bits}": torch.tensor([0, 1, (1 << bits) - 1, 5 % (1 << bits)], dtype=torch.uint8)
            for kind in ("uint", "int") for bits in range(1, 8)}


@pytest.mark.parametrize("layout", ["sglang", "sglang-dumper"])
def test_export_writes_sub_byte_integer_types_as_their_byte_with_one_warning_each(tmp_path, capsys, layout):
    """torch.save (and clone) refuse uint1..uint7 and int1..int7: export stopped with a traceback at
    the first such tensor. Stored one element a byte, each is exported as uint8 or int8, bit for bit,
    with one warning per rank and type."""
    root = tmp_path / "subbyte"
    tensors = {name: bits.view(getattr(torch, name)) for name, bits in SUB_BYTE.items()}
    write_rank_dir(root / "target" / R0, {p: tensors for p in range(2)}, rank=RANK0, segment_passes=1)
    out = tmp_path / "out"
    code, _, err = cli("export", "--format", layout, "--names", "fastdump", root, out, capsys=capsys)
    assert code == 0 and "Traceback" not in err, err
    for name in SUB_BYTE:
        said = [line for line in err.splitlines() if f"cannot write {name}:" in line]
        assert len(said) == 1 and said[0].startswith("fastdump export: warning: target/"), (name, err)
    if layout == "sglang":
        files = [torch.load(out / "TP0_PP0_Rank0_pid100" / f"Pass{p:05d}.pt", weights_only=True) for p in range(2)]
    else:
        files = [{r["meta"]["name"]: r["value"] for r in map(lambda f: torch.load(f, weights_only=True),
                                                            out.glob(f"*step={p}___*.pt"))} for p in range(2)]
    for got in files:
        assert sorted(got) == sorted(SUB_BYTE)
        for name, bits in SUB_BYTE.items():
            want = bits.view(torch.int8) if name.startswith("int") else bits
            assert got[name].dtype == want.dtype and torch.equal(got[name], want), name


@pytest.mark.parametrize("argv", [
    ["export", "{missing}", "{out}"],
    ["export", "--format", "sglang", "--role-subdirs", "never", "{two_roles}", "{out}"],
    ["export", "--format", "sglang-dumper", "{bad_name}", "{out}"],
    ["export", "--format", "sglang-dumper", "{sessions}", "{out}"],
    ["export", "{file}", "{out}"],
    ["export", "{dump}", "{file}"],  # the output is a file
])
def test_export_on_bad_input_exits_non_zero_without_traceback(dump, tmp_path, argv, capsys):
    two_roles = tmp_path / "two_roles"
    write(two_roles, R0)
    write_rank_dir(two_roles / "draft" / R0, {0: tensors_of(0)}, rank=RANK0, role="draft")
    bad_name = tmp_path / "bad_name"
    write_rank_dir(bad_name / "target" / R0, {0: {"a___b=c": torch.ones(1)}}, rank=RANK0)
    sessions = tmp_path / "sessions"
    write(sessions, R0)
    write(sessions, R0B)
    (tmp_path / "file").write_text("x")
    values = dict(missing=tmp_path / "missing", out=tmp_path / "out", two_roles=two_roles, bad_name=bad_name,
                  sessions=sessions, file=tmp_path / "file", dump=dump)
    code, out, err = cli(*[a.format(**values) for a in argv], capsys=capsys)
    assert code != 0 and err.strip() and "Traceback" not in err


def test_export_of_a_dump_with_an_unreadable_segment_fails(dump, tmp_path, capsys):
    seg = dump / "target" / R1 / "seg-000001.h5"
    seg.write_bytes(seg.read_bytes()[:200])
    with pytest.warns(UserWarning, match="unreadable segment"):
        code, out, err = cli("export", "--names", "fastdump", dump, tmp_path / "out", capsys=capsys)
    assert code != 0 and "seg-000001.h5" in err and "Traceback" not in err
    with pytest.warns(UserWarning, match="unreadable segment"), fastdump.open(dump) as ds:
        ds.passes("target", 1)
        assert [(p.path, p.kind) for p in ds.problems] == [(str(seg), Problem.UNREADABLE_SEGMENT)]


def test_export_reads_several_roots_as_one_dump(tmp_path):
    from fastdump import export

    a, b = tmp_path / "host0", tmp_path / "host1"
    write(a, R0)
    write(b, R1, rank=RANK1, tag=100.0)
    out = tmp_path / "out"
    assert export.export_sglang([a, b], out, names="fastdump") == 8
    got = torch.load(out / "TP1_PP0_Rank1_pid101" / "Pass00002.pt", weights_only=True)
    assert same(got["a"], tensors_of(2, 100.0)["a"])


# ------------------------------------------------------------------------------- concurrency


@pytest.fixture
def many_segments(tmp_path):
    root = tmp_path / "many"
    write_rank_dir(root / "target" / R0, {p: tensors_of(p) for p in range(40)}, rank=RANK0, segment_passes=1)
    write_rank_dir(root / "target" / R1, {p: tensors_of(p, 100.0) for p in range(40)}, rank=RANK1,
                   segment_passes=1)
    return root


def test_one_dumpset_read_from_several_threads(many_segments):
    """More segments than the reader keeps open (16): threads evict each other's files."""
    errors = []

    def work(ds, seed):
        rng = random.Random(seed)
        for _ in range(150):
            p, rank = rng.randrange(40), rng.randrange(2)
            tag = 100.0 * rank
            try:
                kind = rng.randrange(3)
                if kind == 0:
                    ok = same(ds.load("target", rank, p, check=True)["a"], tensors_of(p, tag)["a"])
                elif kind == 1:
                    ok = same(ds.tensor("target", rank, "b", p, check=True), tensors_of(p, tag)["b"])
                else:
                    ok = ds.meta("target", rank, p)["tensors"] == 2
                if not ok:
                    errors.append(f"wrong data: rank {rank} pass {p}")
            except Exception as exc:  # noqa: BLE001 - every failure is the finding
                errors.append(f"{type(exc).__name__}: {exc}"[:300])

    for multi in (False, True):
        ds = fastdump.open([many_segments] if multi else many_segments)
        threads = [threading.Thread(target=work, args=(ds, seed)) for seed in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a reader thread hangs"
        assert not errors, errors[:5]
        assert not ds.problems, ds.problems
        ds.close()


def test_reading_after_fork_even_while_another_thread_reads(many_segments):
    """A child forked from a process holding an open DumpSet (and a thread in the middle of a read)
    reads it exactly and does not hang. Run in a subprocess: a hang there cannot hang pytest."""
    script = f"""
import os, sys, threading, time, torch
sys.path.insert(0, {os.path.join(REPO, 'tests')!r})
import fastdump
from test_reader_hostile import tensors_of, same
ds = fastdump.open({str(many_segments)!r})
ds.load("target", 0, 0)
stop = []
def spin():
    i = 0
    while not stop:
        ds.load("target", 0, i % 40); ds.tensor("target", 1, "a", (i * 7) % 40); i += 1
t = threading.Thread(target=spin); t.start()
children = []
for k in range(8):
    time.sleep(0.01)
    pid = os.fork()
    if pid == 0:
        ok = all(same(ds.load("target", r, p, check=True)["a"], tensors_of(p, 100.0 * r)["a"])
                 for r in (0, 1) for p in range(0, 40, 3))
        os._exit(0 if ok else 3)
    children.append(pid)
stop.append(1); t.join()
codes = []
for pid in children:
    deadline = time.monotonic() + 30
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            codes.append(os.waitstatus_to_exitcode(status)); break
        if time.monotonic() > deadline:
            os.kill(pid, 9); os.waitpid(pid, 0); codes.append("hung"); break
        time.sleep(0.02)
print(codes)
sys.exit(0 if codes == [0] * len(children) else 1)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]


def test_a_pass_whole_in_one_segment_and_found_again_in_another_is_not_read(tmp_path):
    """A pass continues in a later segment only when the writer flushed it unfinished. A segment of
    another session copied into a rank directory repeats whole passes: which copy is real cannot be
    told, so the reader refuses those passes (it merged them, handing back 'a' and 'a#dup1', and
    diff compared only the first), reads the others, and verify fails."""
    mine, other = tmp_path / "dump" / "target" / R0, tmp_path / "other" / "target" / R0
    write_rank_dir(mine, {p: {"a": torch.full((3,), float(p))} for p in range(4)})
    write_rank_dir(other, {p: {"a": torch.full((3,), 100.0 + p)} for p in range(2)})
    shutil.copy(other / fmt.segment_name(0), mine / fmt.segment_name(2))
    with pytest.warns(UserWarning, match="appears again"):
        ds = fastdump.open(tmp_path / "dump")
        with pytest.raises(reader.DumpError, match="pass 0 is whole in seg-000000.h5 and appears again in seg-000002"):
            ds.load("target", 0, 0)
    assert [(p.kind, p.path) for p in ds.problems] == [(Problem.REPEATED_PASS, str(mine))] * 2  # passes 0 and 1
    with pytest.raises(reader.DumpError):
        ds.meta("target", 0, 1)
    assert {p: t.tolist() for p, t in ds.series("target", 0, "a").items()} == {2: [2.0] * 3, 3: [3.0] * 3}
    assert ds.load("target", 0, 3)["a"].tolist() == [3.0] * 3
    done = subprocess.run([sys.executable, "-m", "fastdump", "verify", str(tmp_path / "dump")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stdout + done.stderr


def test_ls_says_the_open_segments_passes_were_lost_once_its_process_is_gone(tmp_path, capsys):
    """A running rank whose process is gone has no open segment any more: its pending passes were
    never written. ls showed them as "in the open segment", as if they would still come."""
    root = tmp_path / "gone"
    script = (f"import os, signal, torch, fastdump\n"
              f"m = torch.nn.Linear(4, 4)\n"
              f"d = fastdump.attach(m, {str(root)!r}, writer='thread', segment_passes=1000, segment_idle_seconds=0)\n"
              f"import json, glob, time\n"
              f"with torch.inference_mode():\n"
              f"    [m(torch.ones(1, 4)) for _ in range(5)]\n"
              f"deadline = time.monotonic() + 30\n"
              f"while time.monotonic() < deadline:\n"
              f"    f = glob.glob({str(root)!r} + '/target/*/rank.json')\n"
              f"    if f and json.load(open(f[0])).get('pending_passes') == 5: break\n"
              f"    time.sleep(0.05)\n"
              f"os.kill(os.getpid(), signal.SIGKILL)\n")
    subprocess.run([sys.executable, "-c", script], timeout=120)
    code, out, err = cli("ls", root, capsys=capsys)
    assert "5 pass(es) of the open segment lost with its process" in out and "in the open segment]" not in out
    from fastdump.cli import dump as cli_dump

    listed = cli_dump.list_dump(str(root))["ranks"][0]
    assert listed["pending_passes"] == 0 and listed["lost_pending_passes"] == 5 and listed["producer_gone"]


def test_a_multi_root_refresh_sees_roles_and_sessions_made_since(tmp_path):
    """MultiDumpSet.refresh() refreshed each root but kept the rank directories it found at open:
    a role or a session written since stayed invisible (a multi-host dump read as it is written)."""
    model = torch.nn.Linear(4, 4)
    with fastdump.attach(model, tmp_path / "a", writer="thread"):
        model(torch.ones(1, 4))
    multi = fastdump.open([tmp_path / "a"])
    assert multi.roles == ["target"]
    x = torch.full((1, 4), 3.0)
    with fastdump.attach(model, tmp_path / "a", role="draft", writer="thread"):
        out = model(x)
    multi.refresh()
    assert multi.roles == ["draft", "target"]
    assert torch.equal(multi.load("draft", 0, 0)["Linear"], out)
    with fastdump.attach(model, tmp_path / "a", writer="thread"):  # a second session of target rank 0
        model(x)
    multi.refresh()
    sessions = multi.sessions("target", 0)
    assert len(sessions) == 2
    with pytest.raises(ValueError, match="2 sessions"):
        multi.load("target", 0, 0)
    session = fmt.parse_rank_dir(sessions[1])[4]
    assert multi.rank_path("target", 0, session=session).endswith(sessions[1])  # (it took no session=)
    multi.close()


def test_ls_counts_no_pass_the_reader_refuses_and_flags_it(tmp_path, capsys):
    """A segment copied in under another number repeats passes already whole in the first: the
    reader refuses them (which copy is the pass cannot be told), but ls counted them, with a plain
    `closed` status. They are flagged now and not counted. An empty root says it has no rank."""
    root = tmp_path / "copied"
    model = torch.nn.Linear(4, 4)
    with fastdump.attach(model, root, writer="thread", segment_passes=2):
        with torch.inference_mode():
            for _ in range(5):
                model(torch.ones(1, 4))
    (rank,) = (root / "target").iterdir()
    shutil.copy(rank / "seg-000000.h5", rank / "seg-000009.h5")
    with pytest.warns(UserWarning):
        with fastdump.open(root) as ds:
            summary = ds.summary("target", 0)
    assert summary["repeated_passes"] == [0, 1] and summary["passes"] == 3
    code, out, err = cli("ls", root, capsys=capsys)  # (the reader's warnings go to stderr)
    assert "2 pass(es) in two segments: not read" in out and "seg-000009.h5" in err
    (tmp_path / "empty").mkdir()
    with pytest.raises(KeyError, match="no rank directories"):
        fastdump.open(tmp_path / "empty").passes()


# ----------------------------------------------------------------------- long runs, many sessions


def _counting(monkeypatch, module, attr, wanted):
    """Count the calls of ``module.attr`` whose first argument ``wanted(arg)`` accepts."""
    real, calls = getattr(module, attr), []

    def counted(path, *args, **kwargs):
        if wanted(os.fspath(path)):
            calls.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(module, attr, counted)
    return calls


def test_a_rank_with_many_segments_reads_rank_json_once(tmp_path, monkeypatch):
    """Opening a rank's segments read rank.json once per segment (the session check evaluated
    ``self.info`` for each): a server's dump of S segments has a rank.json listing S segments, so
    indexing it parsed S² entries (2000 segments: ~30 s of JSON alone)."""
    root = tmp_path / "dump"
    write(root, R0, passes=40, segment_passes=1)  # 40 segments
    reads = _counting(monkeypatch, reader.fsutil, "load_json", lambda p: p.endswith(fmt.RANK_FILE))
    with fastdump.open(root) as ds:
        assert ds.passes("target", 0) == list(range(40))
        assert same(ds.load("target", 0, 39)["a"], tensors_of(39)["a"])
    assert len(reads) <= 2, len(reads)


def test_loading_one_pass_reads_only_the_segments_that_can_hold_it(tmp_path, monkeypatch):
    """Loading one pass indexed every segment of the rank (~3 ms each: 14 s for one load at 4000
    segments). rank.json gives each segment's pass range: the pass's own segment is read, and the
    files either side (a part there would show rank.json wrong)."""
    root = tmp_path / "dump"
    write(root, R0, passes=40, segment_passes=1)  # 40 segments
    built = _counting(monkeypatch, reader, "SegmentIndex", lambda p: True)
    with fastdump.open(root) as ds:
        got = ds.load("target", 0, 20)
        assert list(got) == ["a", "b"] and all(same(got[n], tensors_of(20)[n]) for n in got)
        assert ds.meta("target", 0, 20)["tensors"] == 2 and ds.pass_names("target", 0, 20) == ["a", "b"]
        assert same(ds.tensor("target", 0, "b", 39), tensors_of(39)["b"])
        assert sorted(os.path.basename(p) for p in built) == [fmt.segment_name(n) for n in (19, 20, 21, 38, 39)]
        with pytest.raises(KeyError, match="no pass 40"):
            ds.load("target", 0, 40)  # (not in any range: the full index says so)
    assert len(built) == 40


def test_loading_one_pass_of_a_dump_with_graph_replays_reads_few_segments(tmp_path, monkeypatch):
    """A segment holding eager passes and CUDA-graph replays (ids from GRAPH_PASS_BASE) has a pass
    range spanning both kinds in rank.json: nearly every segment's range held any eager pass, and
    loading one read them all. Each kind's passes run in file order, which bounds each file's."""
    from fastdump.protocol import GRAPH_PASS_BASE as B

    root = tmp_path / "dump"
    order = [p for k in range(30) for p in (k, B + k)]  # segment k: eager pass k and replay B + k
    write_rank_dir(root / "target" / R0, {p: tensors_of(p % B) for p in order}, rank=RANK0, segment_passes=2)
    built = _counting(monkeypatch, reader, "SegmentIndex", lambda p: True)
    with fastdump.open(root) as ds:
        for p in (15, B + 15, 29, B):
            got = ds.load("target", 0, p)
            assert list(got) == ["a", "b"] and all(same(got[n], tensors_of(p % B)[n]) for n in got)
        assert ds.meta("target", 0, B + 20)["tensors"] == 2
        assert len(built) <= 12, sorted(os.path.basename(p) for p in built)
        assert ds.passes("target", 0) == list(range(30)) + [B + k for k in range(30)]


def test_many_sessions_under_one_root_list_each_rank_directory_once(tmp_path, monkeypatch):
    """Each reader call (rank_info, summary, load...) listed every rank directory of the role,
    twice: `fastdump ls` of a root with R sessions (a server's attach/close loop) made ~4·R² listdir
    calls (301 sessions: 364k calls, ~25 s). Each DumpSet lists a rank directory twice now: once
    to find it, once for its segments."""
    root = tmp_path / "dump"
    names = [f"TP0_PP0_Rank0_pid100_20260101T{k // 60:02d}{k % 60:02d}00.000000Z-{k:08x}" for k in range(30)]
    for name in names:
        write(root, name, passes=1)
    listed = _counting(monkeypatch, os, "listdir", lambda p: os.path.dirname(p) == str(root / "target"))
    assert [entry["rank"] for entry in list_dump(root)["ranks"]] == names
    with fastdump.open(root) as ds:
        for name in names:
            assert same(ds.load("target", name, 0)["b"], tensors_of(0)["b"])
            assert ds.meta("target", name, 0)["complete"]
    assert len(listed) <= 2 * 2 * len(names), len(listed)  # (two DumpSets)


def test_refresh_reads_only_the_segments_written_since(tmp_path, monkeypatch):
    """refresh() forgot every segment's index: a reader following a live dump re-read all of its
    segments at each refresh (114 segments: ~2.5 s a refresh; a long run's: hours). A segment file
    never changes once written, so only new ones are read; one replaced under its name is read again."""
    from fastdump.writer.channel_writer import ChannelWriter
    from fastdump import dtypes

    path = tmp_path / "dump" / "target" / R0
    writer = ChannelWriter({"op": "open", "channel": 0, "dir": str(path), "role": "target", "rank": RANK0,
                            "pid": 100, "host": "h", "device": {}, "config": {"segment_passes": 1}})
    writer.on_name(0, "a")

    def passes(ids):
        for p in ids:
            writer.on_begin(p, {})
            t = tensors_of(p)["a"]
            writer.on_tensor(0, p, dtypes.code_of(t.dtype), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().copy())
            writer.on_end(p, {}, 0, [])

    passes(range(20))
    built = _counting(monkeypatch, reader, "SegmentIndex", lambda p: True)
    ds = fastdump.open(tmp_path / "dump")
    assert ds.passes("target", 0) == list(range(20)) and len(built) == 20
    passes(range(20, 25))
    ds.refresh()
    assert ds.passes("target", 0) == list(range(25)) and len(built) == 25  # the 5 new ones only
    assert same(ds.load("target", 0, 24)["a"], tensors_of(24)["a"])
    writer.close({})
    shutil.copy(path / "seg-000001.h5", path / "copy.tmp")
    os.replace(path / "copy.tmp", path / "seg-000003.h5")  # pass 1 again, under pass 3's segment
    ds.refresh()
    with pytest.warns(UserWarning, match="pass 1 is whole"):
        assert 3 not in ds.passes("target", 0)
    assert len(built) == 26
    # Rewritten in place (same inode, same size): read again too, or pass 4 would be read from
    # what is now pass 2's data. (Closed first: the reader's open handle would cache the old file.)
    ds.close()
    inode = os.stat(path / "seg-000004.h5").st_ino
    with open(path / "seg-000004.h5", "r+b") as f:
        f.write((path / "seg-000002.h5").read_bytes())
        f.truncate()
    assert os.stat(path / "seg-000004.h5").st_ino == inode
    ds.refresh()
    with pytest.warns(UserWarning, match="pass 2 is whole"):
        assert 4 not in ds.passes("target", 0)
    assert len(built) == 27
    with pytest.raises(reader.DumpError, match="pass 2 is whole"):
        ds.load("target", 0, 2)
    ds.close()


def test_a_segment_that_cannot_be_looked_at_is_not_called_a_fifo(tmp_path, monkeypatch):
    """A rank directory readable but not searchable (chmod 444, or an unreadable mount): every
    segment was reported as 'not a regular file (symbolic links, FIFOs and devices are not read)'."""
    seg = tmp_path / "seg-000000.h5"
    seg.write_bytes(b"")
    real_lstat = os.lstat

    def denied(path, *args, **kwargs):
        if os.fspath(path) == str(seg):
            raise PermissionError(13, "Permission denied", str(seg))
        return real_lstat(path, *args, **kwargs)

    monkeypatch.setattr(os, "lstat", denied)
    with pytest.raises(reader.DumpError) as e:
        reader.open_segment(str(seg))
    assert str(e.value) == f"{seg}: cannot read (Permission denied)"
    monkeypatch.setattr(os, "lstat", real_lstat)
    seg.unlink()
    os.mkfifo(seg)
    with pytest.raises(reader.DumpError, match="not a regular file"):
        reader.open_segment(str(seg))


def _tp2_dump(root):
    """A real TP=2 run: two Dumpers of one column-parallel Linear, each rank's shard its own rows."""
    torch.manual_seed(0)
    weight, x = torch.randn(8, 4), torch.randn(3, 4)
    models = [torch.nn.Linear(4, 4, bias=False) for _ in range(2)]
    with torch.no_grad():
        for k, model in enumerate(models):
            model.weight.copy_(weight[4 * k:4 * k + 4])
    dumpers = [fastdump.attach(m, root, tp_rank=k, tp_size=2, writer="thread") for k, m in enumerate(models)]
    with torch.inference_mode():
        for step in range(2):
            for model in models:
                model(x + step)
    for dumper in dumpers:
        dumper.close()
    return [x @ weight[4 * k:4 * k + 4].T for k in range(2)]


def test_rank_directories_renamed_to_each_others_rank_are_refused(tmp_path, capsys):
    """Two TP ranks' directories renamed to each other's rank numbers (sessions kept, so the session
    checks pass): load(role, 0, ...) read rank 1's tensors and verify said OK. Now verify fails
    naming both, reading by number, diff and export refuse, and the name still reads as it is."""
    root = tmp_path / "tp2"
    expected = _tp2_dump(root)
    role_dir = root / "target"
    (r0,), (r1,) = [[n for n in os.listdir(role_dir) if n.startswith(p)] for p in ("TP0_", "TP1_")]
    session0, session1 = r0[len("TP0_PP0_Rank0_"):], r1[len("TP1_PP0_Rank1_"):]
    os.rename(role_dir / r0, role_dir / ("TP1_PP0_Rank1_" + session0))
    os.rename(role_dir / r1, role_dir / ("TP0_PP0_Rank0_" + session1))

    assert cli_main_entry(["verify", str(root)]) == 1
    out = capsys.readouterr().out
    assert out.count("the directory's name says tp_rank 0, rank 0 but its rank.json says tp_rank 1, rank 1") == 1
    assert out.count("the directory's name says tp_rank 1, rank 1 but its rank.json says tp_rank 0, rank 0") == 1
    with fastdump.open(root) as ds:
        for number in (0, 1):
            with pytest.raises(reader.DumpError, match="renamed to another rank"):
                ds.load("target", number, 0)
        # by directory name: what that directory holds (rank 1's tensors, under rank 0's name)
        got = ds.load("target", "TP0_PP0_Rank0_" + session1, 0)
        assert torch.equal(next(iter(got.values())), expected[1])
    with fastdump.open([root]) as ds:  # a list of roots (MultiDumpSet) alike
        with pytest.raises(reader.DumpError, match="renamed to another rank"):
            ds.load("target", 0, 0)
    with pytest.raises(fastdump.compare.DiffError, match="renamed to another rank"):
        fastdump.diff(root, root)
    assert cli_main_entry(["export", str(root), str(tmp_path / "out")]) == 2  # (a dump it cannot read: 2, as diff)
    assert "renamed to another rank" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_producers_error_fills_an_error_status_that_names_none():
    """rank.json status "error" without its error (a hand-edited or older file) takes the serving
    process's recorded error, so the reason is never blank; a writer's own error is kept (the
    earlier cause). A mutant keeping the blank survived."""
    record = {"error": "close timed out"}
    assert fmt.merge_producer_error({"status": "error"}, record)["error"] == "close timed out"
    assert fmt.merge_producer_error({"status": "error", "error": ""}, record)["error"] == "close timed out"
    kept = fmt.merge_producer_error({"status": "error", "error": "disk full"}, record)
    assert kept["error"] == "disk full" and kept["producer_error"] == record
    assert fmt.merge_producer_error({"status": "closed"}, record)["status"] == "error"


def test_ls_says_which_rank_directories_are_another_ranks_and_which_rank_numbers_are_damaged(tmp_path, capsys):
    """ls listed two TP ranks' directories renamed to each other's numbers without a word (verify
    fails them as mixed). Now each is a WRONG_RANK problem, a warning and a mark in its STATUS, as
    an unreadable segment is; rank numbers of the wrong type are a BAD_FILE of that rank.json."""
    root = tmp_path / "tp2"
    _tp2_dump(root)
    role_dir = root / "target"
    (r0,), (r1,) = [[n for n in os.listdir(role_dir) if n.startswith(p)] for p in ("TP0_", "TP1_")]
    renamed = "TP1_PP0_Rank1_" + r0[len("TP0_PP0_Rank0_"):]
    os.rename(role_dir / r0, role_dir / renamed)
    os.rename(role_dir / r1, role_dir / ("TP0_PP0_Rank0_" + r1[len("TP1_PP0_Rank1_"):]))
    assert cli_main_entry(["ls", str(root)]) == 0  # (ls lists a damaged dump: verify judges it)
    out, err = capsys.readouterr()
    assert err.count("but its rank.json says tp_rank 1, rank 1: renamed to another rank") == 1, err
    assert err.count("but its rank.json says tp_rank 0, rank 0: renamed to another rank") == 1, err
    assert out.count("[its rank.json is another rank's: see the warning]") == 2, out
    listing = list_dump(str(root))
    assert sorted(r["wrong_rank"] for r in listing["ranks"]) == [True, True]
    with fastdump.open(root) as ds:
        ds.rank_info("target", renamed)
        assert [(p.kind, os.path.basename(p.path)) for p in ds.problems] == [(Problem.WRONG_RANK, renamed)]

    info_path = role_dir / renamed / "rank.json"
    info = json.loads(info_path.read_text())
    info["rank"] = dict(info["rank"], tp_rank="1")  # a number of the wrong type: nothing to compare
    info_path.write_text(json.dumps(info))
    assert cli_main_entry(["ls", str(root)]) == 0
    out, err = capsys.readouterr()
    assert f"{info_path}: rank.tp_rank is \"1\", expected an integer >= 0" in err, err
    with fastdump.open(root) as ds:
        ds.rank_info("target", renamed)
        assert [(p.kind, p.path) for p in ds.problems] == [(Problem.BAD_FILE, str(info_path))]


@pytest.mark.parametrize("key, value, shown", [("dropped", float("nan"), "NaN"), ("skipped", -5, "-5"),
                                               ("dropped_passes", 2.0, "2.0"), ("dropped", "3", '"3"')])
def test_ls_warns_of_a_count_it_cannot_show_instead_of_showing_0(tmp_path, capsys, key, value, shown):
    """rank.json "dropped": NaN was listed by ls as DROPPED 0 without a word (verify fails it: a
    damaged count must not pass for none). ls now warns with verify's words and exits 0."""
    root = tmp_path / "d"
    with fastdump.attach(None, root, writer="thread") as dumper:
        dumper.begin_pass(), dumper.dump("x", torch.ones(2)), dumper.end_pass()
    (rank,) = os.listdir(root / "target")
    info_path = root / "target" / rank / "rank.json"
    info = json.loads(info_path.read_text())
    info[key] = value
    info_path.write_text(json.dumps(info))
    assert cli_main_entry(["ls", str(root)]) == 0
    err = capsys.readouterr().err
    assert f"{root / 'target' / rank}: rank.json {key} is {shown}, not a count (an integer >= 0)" in err, err
    assert no_escapes(err)
    problems = list_dump(str(root))["problems"]
    assert [p.kind for p in problems] == [Problem.BAD_FILE], problems
    assert cli_main_entry(["verify", str(root)]) == 1


@pytest.mark.parametrize("link_to", ["itself", "the role moved away"])
def test_ls_warns_of_an_attached_role_replaced_by_a_symbolic_link(tmp_path, capsys, link_to):
    """The root records role "target"; its directory moved to t2 and "target" made a symbolic link
    (to itself: a loop, or to t2). ls listed t2 and said nothing of "target" (verify fails the
    link). The reader never follows it, and now lists it as a LOST_ROLE problem."""
    root = tmp_path / "d"
    with fastdump.attach(None, root, writer="thread") as dumper:
        dumper.begin_pass(), dumper.dump("x", torch.ones(2)), dumper.end_pass()
    os.rename(root / "target", root / "t2")
    os.symlink(root / ("target" if link_to == "itself" else "t2"), root / "target")
    assert cli_main_entry(["ls", str(root)]) == 0
    out, err = capsys.readouterr()
    assert f"{root / 'target'}: role 'target' was attached here (fastdump.roles/target) but this is a symbolic " \
           "link, not followed" in err, err
    assert "t2 " in out
    with fastdump.open(root) as ds:
        assert ds.roles == ["t2"]
        assert [(p.kind, p.path) for p in ds.problems] == [(Problem.LOST_ROLE, str(root / "target"))]
    assert cli_main_entry(["verify", str(root)]) == 1
    assert capsys.readouterr().out.count("symbolic link") == 1  # (verify's own check, said once)


def test_a_segment_replaced_after_its_index_was_read_is_refused_not_read_with_that_index(tmp_path):
    """A DumpSet keeps a segment's checked index after closing its file (its LRU of 16 open files,
    ``close()``). Reopened, the file was taken to be the one indexed: a segment replaced meanwhile
    was read at the old index's blocks and rows, another dump's data handed back under this one's
    names and passes (unchecked by default). The file opened again must be the one indexed."""
    root, other = tmp_path / "dump", tmp_path / "other"
    write(root, R0, segment_passes=2)
    write(other, R0, tag=1000.0, segment_passes=2)  # same names and layouts, other values
    ds = fastdump.open(root)
    assert same(ds.load("target", 0, 0)["a"], tensors_of(0)["a"])
    ds.close()
    segment = root / "target" / R0 / "seg-000000.h5"
    replacement = tmp_path / "replacement.h5"
    shutil.copyfile(other / "target" / R0 / "seg-000000.h5", replacement)
    os.replace(replacement, segment)
    with pytest.raises(reader.DumpError, match=f"{segment}: the file changed after its index was read"):
        ds.load("target", 0, 0)
    ds.refresh()  # (what reading a changed dump takes: the new file's own index)
    assert same(ds.load("target", 0, 0)["a"], tensors_of(0, 1000.0)["a"])


def test_rows_read_at_their_offset_are_the_rows_hdf5_reads(dump):
    """A checked block's rows are read with preadv at its offset; a compact block (no offset) or a
    file without a descriptor goes through HDF5. Both give the same rows, and a file cut short
    after its checks is a DumpError naming the block, not short data."""
    ds = fastdump.open(dump)
    ds.passes("target", 0)
    segment = ds._rank_obj("target", R0).segments[0]
    h5file = ds._file(segment.path)
    for number in range(len(h5file[fmt.BLOCKS])):
        layout, offset = segment.block(h5file, number)
        total = segment._block_rows[number]
        at_offset = segment.read_rows(h5file, number, 1, total - 1)
        through_hdf5 = reader.read_block_rows(None, h5file[fmt.BLOCKS].id, number, None, layout.row_shape,
                                              layout.storage, 1, total - 1, "x")
        assert at_offset.dtype == through_hdf5.dtype and at_offset.shape == through_hdf5.shape == \
            (total - 1, *h5file[f"{fmt.BLOCKS}/{number}"].shape[1:])
        assert at_offset.tobytes() == through_hdf5.tobytes() == h5file[f"{fmt.BLOCKS}/{number}"][1:].tobytes()
    with pytest.MonkeyPatch.context() as patch:  # (a platform without preadv: through HDF5)
        patch.delattr(os, "preadv")
        assert same(ds.load("target", 0, 1, check=True)["a"], tensors_of(1)["a"])
    layout, offset = segment.block(h5file, 0)
    with pytest.raises(reader.DumpError, match="block 0: the file ends at byte"):
        reader.read_block_rows(reader.vfd(h5file), None, 0, segment.file_size, layout.row_shape, layout.storage,
                               0, 1, f"{segment.path} block 0")
    with pytest.raises(reader.DumpError, match="rows 1..99 outside its rows"):
        segment.read_rows(h5file, 0, 1, 98)
