"""The rank directory changed under a running writer: renamed, replaced by a symbolic link, deleted,
made read-only. The writer and the Dumper hold the directory open (fsutil.DirAnchor): nothing is
ever written out of the dump, every pass is on disk and verify passes, or verify fails."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

import fastdump
from fastdump import format as fmt
from fastdump import fsutil
from fastdump.cli.dump import verify_dump

from conftest import mount_small_tmpfs, open_fds_where

PASSES_BEFORE, PASSES_AFTER = 3, 3


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))


def _inputs(i):
    return torch.full((2, 8), float(i))


def _segments_listed(rank_dir) -> int:
    try:  # (absent until the writer's first segment)
        return fsutil.load_json(str(rank_dir / "rank.json")).get("segments_listed", 0)
    except FileNotFoundError:
        return 0


def _run(root, change, **options):
    """Attach, run PASSES_BEFORE passes and wait until their segments are on disk, ``change(rank
    dir)``, run PASSES_AFTER more, close. Returns (close stats, the model's outputs per pass)."""
    model = _model()
    d = fastdump.attach(model, root, role="target", segment_passes=1, **options)
    outs = []
    with torch.inference_mode():
        for i in range(PASSES_BEFORE):
            outs.append(model(_inputs(i)))
        deadline = time.monotonic() + 30
        while (_segments_listed(d.dir) < PASSES_BEFORE
               and time.monotonic() < deadline):
            time.sleep(0.02)
        change(d.dir)
        for i in range(PASSES_BEFORE, PASSES_BEFORE + PASSES_AFTER):
            outs.append(model(_inputs(i)))
    return d.close(timeout=30), outs


def _files_under(path):
    return sorted(os.path.relpath(os.path.join(where, name), path)
                  for where, _, names in os.walk(path) for name in names)


def _assert_all_passes_bit_exact(root, outs):
    ds = fastdump.open(root)
    assert ds.passes("target", 0) == list(range(len(outs)))
    for p, want in enumerate(outs):
        assert torch.equal(ds.load("target", 0, p)["Sequential"], want)


def test_a_rank_directory_replaced_by_a_link_gets_nothing_and_the_moved_one_everything(tmp_path):
    root, outside = tmp_path / "dump", tmp_path / "outside"
    outside.mkdir()

    def swap(rank_dir):
        os.rename(rank_dir, str(rank_dir) + ".moved")
        os.symlink(outside, rank_dir)

    stats, outs = _run(root, swap)
    # Before: the next segment, rank.json and producer_error.json went through the link.
    assert _files_under(outside) == []
    assert stats["status"] == "closed" and stats["error"] is None
    problems = verify_dump(str(root)).problems
    assert len(problems) == 1 and "symbolic link: not followed" in problems[0], problems
    (link,) = [p for p in (root / "target").iterdir() if p.is_symlink()]  # (a session id may end in "d")
    link.unlink()
    assert verify_dump(str(root)).problems == []
    _assert_all_passes_bit_exact(root, outs)


def test_without_proc_a_rank_directory_replaced_by_a_link_stops_the_writing_and_fails_verify(tmp_path, monkeypatch):
    """Where /proc/self/fd cannot be used (a chroot, a container without /proc) the anchor falls
    back to the directory's path, which the link led out of the dump: the next segments, rank.json
    and the close went there without a word. The path's identity is checked at each use now."""
    monkeypatch.setattr(fsutil.DirAnchor, "_PROC_FD", str(tmp_path / "no-proc"))
    root, outside = tmp_path / "dump", tmp_path / "outside"
    outside.mkdir()

    def swap(rank_dir):
        os.rename(rank_dir, str(rank_dir) + ".moved")
        os.symlink(outside, rank_dir)

    stats, outs = _run(root, swap, writer="thread")  # (a thread: the writer shares the patched anchor)
    assert _files_under(outside) == []
    assert stats["status"] == "error" and "no longer the directory created there" in stats["error"]
    problems = verify_dump(str(root)).problems
    assert any("symbolic link: not followed" in p for p in problems), problems
    (link,) = [p for p in (root / "target").iterdir() if p.is_symlink()]
    link.unlink()
    problems = verify_dump(str(root)).problems  # the moved directory lacks the passes after the swap
    assert problems and not any("symbolic link" in p for p in problems), problems
    ds = fastdump.open(root)
    for p in ds.passes("target", 0):  # what is there is what the model computed
        assert torch.equal(ds.load("target", 0, p)["Sequential"], outs[p])


def test_a_renamed_rank_directory_is_written_to_the_end(tmp_path):
    root = tmp_path / "dump"
    stats, outs = _run(root, lambda rank_dir: os.rename(rank_dir, str(rank_dir) + ".moved"))
    # Before: the writer failed (ENOENT) and the moved directory said "running": verify failed.
    assert stats["status"] == "closed" and stats["error"] is None
    assert json.loads(next(root.glob("target/*.moved/rank.json")).read_text())["status"] == "closed"
    assert verify_dump(str(root)).problems == []
    _assert_all_passes_bit_exact(root, outs)


def test_a_role_directory_replaced_by_a_link_gets_nothing(tmp_path):
    root, outside = tmp_path / "dump", tmp_path / "outside"
    outside.mkdir()

    def swap(rank_dir):
        role = rank_dir.parent
        os.rename(role, str(role) + ".moved")
        (outside / rank_dir.name).mkdir()  # the same path again, out of the dump
        os.symlink(outside, role)

    stats, outs = _run(root, swap)
    assert _files_under(outside) == []
    assert stats["status"] == "closed"
    (root / "target").unlink()
    os.rename(root / "target.moved", root / "target")
    assert verify_dump(str(root)).problems == []
    _assert_all_passes_bit_exact(root, outs)


def test_a_deleted_rank_directory_stops_dumping_and_fails_verify(tmp_path):
    root = tmp_path / "dump"
    stats, _ = _run(root, shutil.rmtree)
    assert stats["status"] == "error" and "No such file or directory" in stats["error"]
    assert "/proc/self/fd" not in stats["error"]  # messages name the directory, not its descriptor
    files = _files_under(root)  # nothing made again at the old path: the root's records alone
    assert files[:2] == ["fastdump.json", "fastdump.roles/target"] and len(files) == 3, files
    assert files[2].startswith(f"{fmt.SESSIONS_DIR}/target/TP0_PP0_Rank0_pid"), files
    assert subprocess.run([sys.executable, "-m", "fastdump", "verify", str(root)],
                          capture_output=True).returncode == 1



def test_a_deleted_rank_directory_stops_dumping_at_a_pass_begin_not_only_at_close(tmp_path):
    """Once the writer has failed the channel (its directory gone), the Dumper stops at the next
    pass that begins (_begin reads Channel.failed), on both the C and the Python root pass: it does
    not stage pass after pass into a channel whose records the writer ignores, with stats() saying
    "running", until close(). (A mutant without that check ran 39 more passes as "running".)"""
    root = tmp_path / "dump"
    model = _model()
    d = fastdump.attach(model, root, role="target", segment_passes=1)
    try:
        with torch.inference_mode():
            for i in range(PASSES_BEFORE):
                model(_inputs(i))
            deadline = time.monotonic() + 30
            while _segments_listed(d.dir) < PASSES_BEFORE and time.monotonic() < deadline:
                time.sleep(0.02)
            shutil.rmtree(d.dir)
            deadline = time.monotonic() + 30  # (the writer fails the channel at its next segment)
            while d.status == "running" and time.monotonic() < deadline:
                model(_inputs(0))
                time.sleep(0.02)
        assert d.status == "error" and "No such file or directory" in d.error, (d.status, d.error)
        passes = d.stats()["passes"]
        with torch.inference_mode():
            model(_inputs(1))
        assert d.stats()["passes"] == passes  # (stopped: no pass staged since)
    finally:
        stats = d.close(timeout=30)
    assert stats["status"] == "error"


@pytest.fixture
def small_fs(tmp_path):
    yield from mount_small_tmpfs(tmp_path, "4m")


def test_a_read_only_file_system_stops_dumping_and_fails_verify(small_fs):
    root = small_fs / "dump"

    def read_only(rank_dir):
        subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)

    try:
        stats, outs = _run(root, read_only)
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_fs)], check=True)
    assert stats["status"] == "error" and "Read-only file system" in stats["error"]
    problems = verify_dump(str(root)).problems
    assert len(problems) == 1 and "status running" in problems[0], problems
    ds = fastdump.open(root)  # what is on disk is whole
    assert ds.passes("target", 0) == list(range(PASSES_BEFORE))
    for p in range(PASSES_BEFORE):
        assert torch.equal(ds.load("target", 0, p)["Sequential"], outs[p])


def test_a_held_descriptor_closed_and_reused_by_the_program_writes_nothing_elsewhere(tmp_path):
    """A program's os.closerange closed the descriptors holding the rank directory, and opened
    another directory, which took their numbers: /proc/self/fd/N then led there, and rank.json and
    producer_error.json were written into that directory; close() then closed the program's own
    descriptors. Now nothing is written elsewhere, the program's descriptors stay open, and verify
    fails."""
    other = tmp_path / "other"
    other.mkdir()
    model = _model()
    d = fastdump.attach(model, tmp_path / "dump", writer="thread", segment_passes=1)
    with torch.inference_mode():
        model(_inputs(0))
    rank_dir = os.path.realpath(d.dir)
    held = open_fds_where(lambda target: target == rank_dir)
    assert len(held) == 2  # the Dumper's and its writer thread's
    opened = os.open(other, os.O_RDONLY | os.O_DIRECTORY)
    for fd in held:  # (dup2: the number closed and taken at once, as the next open would take it)
        os.dup2(opened, fd)
    os.close(opened)
    taken = held
    try:
        with torch.inference_mode():
            for i in range(1, 4):
                model(_inputs(i))
        d.close(timeout=30)
        assert os.listdir(other) == []
        for fd in taken:  # still the program's
            assert os.path.realpath(f"/proc/self/fd/{fd}") == str(other)
    finally:
        for fd in taken:
            os.close(fd)
    assert verify_dump(str(tmp_path / "dump")).problems != []
