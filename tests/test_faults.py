"""Faults: the serving process killed, the writer killed, a full disk, leftover shared memory."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import fastdump
from fastdump.cli.dump import verify_dump
from fastdump.staging.engine import SHM_DIR, SHM_PREFIX, STALE_REGION_AGE_S, remove_stale_regions

from conftest import mount_small_tmpfs

SERVE = textwrap.dedent("""
    import os, sys, torch, fastdump
    root, progress, rows = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
    d = fastdump.attach(model, root, role="target", segment_passes=8)
    with torch.inference_mode():
        i = 0
        while True:
            model(torch.full((rows, 64), float(i)))
            with open(progress + ".tmp", "w") as f:
                f.write(str(i + 1))   # passes finished so far (atomic: the kill may land anywhere)
            os.replace(progress + ".tmp", progress)
            i += 1
""")


def expected_outputs(n, rows):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
    with torch.inference_mode():
        return [model(torch.full((rows, 64), float(i))) for i in range(n)]


def wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("rows", [4, 4096])  # 1 KiB outputs are buffered, 1 MiB ones written directly
def test_kill_9_of_the_serving_process_keeps_every_finished_pass(tmp_path, rows):
    root, progress = tmp_path / "dump", tmp_path / "progress"
    script = tmp_path / "serve.py"
    script.write_text(SERVE)
    proc = subprocess.Popen([sys.executable, str(script), str(root), str(progress), str(rows)])
    try:
        assert wait_for(lambda: progress.exists() and progress.read_text() and int(progress.read_text()) >= 30)
    finally:
        proc.kill()
        proc.wait()
    finished = int(progress.read_text())
    rank_json = next(root.glob("target/*/rank.json"))
    # The writer drains what was published, closes its segment and marks the rank incomplete.
    assert wait_for(lambda: fastdump.open(root).rank_info("target", 0).get("status") == "incomplete"), \
        rank_json.read_text()
    # A dump whose process died without close() may lack what was in flight: verify says so.
    done = subprocess.run([sys.executable, "-m", "fastdump", "verify", str(root)], capture_output=True, text=True)
    assert done.returncode == 1 and "status incomplete" in done.stdout, done.stdout
    assert done.stdout.count("PROBLEM") == 1, done.stdout  # and nothing else is wrong with it
    ds = fastdump.open(root)
    passes = ds.passes("target", 0)
    assert passes[:finished] == list(range(finished))
    want = expected_outputs(len(passes), rows)
    for p in range(finished):
        assert torch.equal(ds.load("target", 0, p)["Sequential"], want[p])
    assert not list(SHM_DIR.glob(f"{SHM_PREFIX}{proc.pid}-*")), "shared memory outlived both processes"


def test_writer_killed_serving_goes_on_and_the_error_is_recorded(tmp_path, caplog):
    model = torch.nn.Linear(8, 8)
    d = fastdump.attach(model, tmp_path)
    with torch.inference_mode():
        for i in range(3):
            model(torch.full((1, 8), float(i)))
        os.kill(d._engine._proc.pid, signal.SIGKILL)
        d._engine._proc.wait()
        outs = [model(torch.full((1, 8), float(i))) for i in range(3, 200)]
    assert outs[-1].shape == (1, 8)
    stats = d.close()
    assert stats["status"] == "error" and "writer" in stats["error"]
    info = fastdump.open(tmp_path).rank_info("target", 0)
    assert info["status"] == "error" and info["error"]
    assert "dumping to" in caplog.text and "stopped" in caplog.text
    # The writer is dead: the reason is in the serving process's own file; rank.json is the dead
    # writer's alone (its last state), and verify fails on the dump.
    record = json.loads((d.dir / "producer_error.json").read_text())
    assert record["error"] == stats["error"] and info["error"] == stats["error"]
    assert json.loads((d.dir / "rank.json").read_text())["status"] == "running"
    problems = verify_dump(str(tmp_path)).problems
    assert any("producer_error.json" in text for text in problems), problems


def test_attach_after_the_writer_died_starts_a_new_writer(tmp_path, caplog):
    # The draft's Dumper still holds the engine whose writer was killed; a new attach (the target
    # re-attached, say) must not get that dead engine, whose Dumpers can only record an error.
    draft, target = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    old = fastdump.attach(draft, tmp_path / "a", role="draft")
    with torch.inference_mode():
        draft(torch.ones(1, 8))
        os.kill(old._engine._proc.pid, signal.SIGKILL)
        old._engine._proc.wait()
        new = fastdump.attach(target, tmp_path / "b")
        assert new._engine is not old._engine and new.status == "running"
        x = torch.arange(8.0).reshape(1, 8)
        want = target(x)
        draft(x)  # the old Dumper goes on failing on its own, serving untouched
    assert "writer has stopped" in caplog.text
    assert new.close()["status"] == "closed"
    assert old.close()["status"] == "error"
    assert not verify_dump(str(tmp_path / "b")).problems
    assert torch.equal(fastdump.open(tmp_path / "b").load("target", 0, 0)["Linear"], want)
    assert verify_dump(str(tmp_path / "a")).problems


def test_writer_alive_gets_the_reason_as_a_note_and_no_producer_file(tmp_path, monkeypatch):
    """CUDA staging failing (or any stop with a live writer): the note reaches the writer, which
    writes rank.json; the serving process writes no file of its own."""
    model = torch.nn.Linear(8, 8)
    d = fastdump.attach(model, tmp_path)
    with torch.inference_mode():
        model(torch.ones(1, 8))
        d._disable("test: staging stopped")
        model(torch.ones(1, 8))
    stats = d.close()
    assert stats["status"] == "error" and stats["error"] == "test: staging stopped"
    assert not (d.dir / "producer_error.json").exists()
    info = json.loads((d.dir / "rank.json").read_text())
    assert info["status"] == "error" and info["error"] == "test: staging stopped"


@pytest.fixture
def small_disk(tmp_path):
    yield from mount_small_tmpfs(tmp_path, "512k")


@pytest.mark.parametrize("rows", [64, 1024])  # 64 KiB tensors are buffered, 1 MiB ones written directly
def test_full_disk_stops_dumping_not_serving(small_disk, caplog, rows):
    model = torch.nn.Linear(256, 256)
    d = fastdump.attach(model, small_disk, segment_passes=2)
    with torch.inference_mode():
        outs = [model(torch.randn(rows, 256)) for _ in range(40)]  # >= 2.5 MB in all, on 512 KiB
    assert len(outs) == 40
    stats = d.close()
    assert stats["status"] == "error"
    assert "No space left" in stats["error"] or "No space left" in caplog.text
    # What is visible is complete: every segment opens and holds whole passes.
    ds = fastdump.open(small_disk)
    for p in ds.passes("target", 0):
        assert ds.load("target", 0, p)["Linear"].shape == (rows, 256)
    assert not list(small_disk.glob("target/*/.*tmp")), "a failed segment's temporary file was left"
    assert subprocess.run([sys.executable, "-m", "fastdump", "verify", str(small_disk)]).returncode == 1


def test_a_file_size_limit_below_the_ring_is_named_and_serving_goes_on(tmp_path):
    """Under ``ulimit -f`` below the ring's size, attach blamed /dev/shm's size ("docker's default is
    64 MiB") for "File too large", and the reservation that hits the limit is one Linux answers
    with SIGXFSZ, whose default action kills the serving process. The limit is checked first now: the
    attach records an error naming it, nothing is signalled, and the model serves undumped."""
    script = textwrap.dedent("""
        import resource, sys, torch, fastdump
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))  # SIGXFSZ left default
        model = torch.nn.Linear(4, 4)
        dumper = fastdump.attach(model, sys.argv[1])
        out = model(torch.ones(2, 4))
        print(dumper.status, "|", dumper.error, "|", out.shape[0])
    """)
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path / "dump")], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    status, error, rows = run.stdout.strip().splitlines()[-1].split(" | ")
    assert status == "error" and rows == "2"
    assert "file size limit, ulimit -f" in error and "docker" not in error


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_a_full_disk_under_one_root_stops_only_the_dumper_writing_there(small_disk, tmp_path, writer):
    """Two Dumpers of one process (EAGLE's draft and target) on two roots, on two file systems: the
    draft's disk fills. Every channel of the writer was failed then, and the target's healthy root
    stopped after 2 of 20 passes with the draft's "No space left" error. The failure is the
    draft's channel's alone now: the target's dump is whole and passes verify."""
    healthy = tmp_path / "healthy"
    torch.manual_seed(0)
    draft, target = torch.nn.Linear(256, 256), torch.nn.Linear(256, 256)
    dd = fastdump.attach(draft, small_disk, role="draft", segment_passes=2, writer=writer)
    dt = fastdump.attach(target, healthy, role="target", segment_passes=2, writer=writer)
    with torch.inference_mode():
        outs = []
        for i in range(20):
            draft(torch.randn(256, 256))  # 256 KiB a pass: the 512 KiB disk is full within a few
            outs.append(target(torch.full((4, 256), float(i))))
        deadline = time.monotonic() + 30
        while dd.status == "running" and time.monotonic() < deadline:  # the writer fails it when it gets there
            draft(torch.randn(256, 256))
            time.sleep(0.05)
    assert dd.status == "error" and "No space left" in dd.error  # noticed at a pass start, not only at close
    draft_stats, target_stats = dd.close(), dt.close()
    assert draft_stats["status"] == "error" and "No space left" in draft_stats["error"]
    assert target_stats["status"] == "closed", target_stats["error"]
    with fastdump.open(healthy) as ds:
        assert ds.passes("target", 0) == list(range(20))
        for p, want in enumerate(outs):
            assert torch.equal(torch.as_tensor(ds.load("target", 0, p)["Linear"]), want)
    assert verify_dump(str(healthy)).problems == []
    assert subprocess.run([sys.executable, "-m", "fastdump", "verify", str(small_disk)]).returncode == 1


def _recording_consumers(monkeypatch, extension=None) -> list:
    """The writer threads' ring consumers, as engines start them (to fail a channel as the writer
    does); `extension` is the `_C` the engine uses (the mock CUDA build in tests/test_graphs.py)."""
    extension = fastdump._C if extension is None else extension
    made, real = [], extension.Consumer

    def recording(name):
        made.append(real(name))
        return made[-1]

    monkeypatch.setattr(extension, "Consumer", recording)
    return made


class _FailsItsChannel(torch.nn.Module):
    """A layer that, in the pass whose input is 1, has the writer fail its Dumper's channel (its
    root's disk full) while it runs: the rest of the pass comes after the failure."""

    def __init__(self, consumers):
        super().__init__()
        self.consumers, self.dumper = consumers, None

    def forward(self, x):
        if float(x.flatten()[0]) == 1.0:
            self.consumers[-1].fail_channel(self.dumper._channel.id, "disk gone under this root (test)")
        return x + 1


def test_a_failed_channel_stops_its_dumper_at_once_not_at_the_next_pass(tmp_path, monkeypatch):
    """The writer failed a channel (its root's disk full) in the middle of a pass: its Dumper went on
    copying every tensor of that pass into the ring, which the writer then threw away, and learnt
    of the failure only as the next pass began. Staging refuses a failed channel's tensors now: the
    first tensor after the failure stops the Dumper, with the writer's error."""
    consumers = _recording_consumers(monkeypatch)
    first = _FailsItsChannel(consumers)
    model = torch.nn.Sequential(first, torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    dumper = fastdump.attach(model, tmp_path / "dump", writer="thread")
    first.dumper = dumper
    try:
        with torch.inference_mode():
            model(torch.zeros(2, 8))  # pass 0: whole (5 tensors)
            staged = dumper.stats()["tensors"]
            model(torch.ones(2, 8))  # pass 1: the channel fails as its first layer runs
            assert dumper.stats()["tensors"] == staged  # nothing of pass 1 after the failure (it was 5)
            assert dumper.status == "error" and "disk gone under this root (test)" in dumper.error
            model(torch.zeros(2, 8))  # serving goes on
    finally:
        stats = dumper.close()
    assert stats["status"] == "error" and stats["tensors"] == staged


def test_each_of_five_failed_channels_gets_the_writers_error(tmp_path, monkeypatch):
    """Five Dumpers of one process on five roots whose disks fail: the ring header kept the text
    of the first four failed channels only, and the fifth Dumper (with no rank.json the writer
    could write) said "the writer stopped writing ... (its log says why)". The header holds 64
    texts at a time now, each taken out by its Dumper as it reads it (the place freed for the
    next one, tests/test_ring.py): each Dumper gets its own error."""
    consumers = _recording_consumers(monkeypatch)
    dumpers, models = [], []
    for i in range(5):
        model = torch.nn.Linear(8, 8)
        dumpers.append(fastdump.attach(model, tmp_path / f"root{i}", role=f"role{i}", writer="thread"))
        models.append(model)
    with torch.inference_mode():
        for m in models:
            m(torch.ones(2, 8))
        for i, d in enumerate(dumpers):  # as the writer fails them, one after another
            consumers[-1].fail_channel(d._channel.id, f"root{i}: No space left on device (test)")
        deadline = time.monotonic() + 30
        while any(d.status == "running" for d in dumpers) and time.monotonic() < deadline:
            for m in models:
                m(torch.ones(2, 8))
            time.sleep(0.01)
    closed = [d.close() for d in dumpers]
    for i, stats in enumerate(closed):
        assert stats["status"] == "error" and f"root{i}: No space left on device (test)" in stats["error"], stats


FILE_SIZE_LIMIT_SERVE = textwrap.dedent("""
    import resource, signal, sys, torch, fastdump
    root, writer, rows = sys.argv[1], sys.argv[2], int(sys.argv[3])
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # as a host that restores default dispositions runs
    resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, resource.RLIM_INFINITY))  # above the 2 MiB ring
    model = torch.nn.Linear(256, 256)
    dumper = fastdump.attach(model, root, writer=writer, ring_mb=2, segment_passes=10)
    with torch.inference_mode():
        outs = [model(torch.randn(rows, 256)) for _ in range(30)]  # a segment of 10 passes is over 4 MiB
    stats = dumper.close()
    print(stats["status"], "|", stats["error"], "|", len(outs))
""")


@pytest.mark.parametrize("writer", ["thread", "process"])
@pytest.mark.parametrize("rows", [512, 1024])  # 512 KiB tensors are buffered, 1 MiB ones written directly
def test_a_segment_over_the_file_size_limit_fails_the_dump_not_the_serving_process(tmp_path, writer, rows):
    """Under ``ulimit -f`` above the ring but below a segment, the segment write past the limit
    made the kernel send SIGXFSZ; with a writer THREAD that went to the serving process, whose
    default action killed it (exit 153). The writer's threads block it now (EFBIG instead): the
    model serves on, the dump fails loudly and its error names the limit."""
    root = tmp_path / "dump"
    run = subprocess.run([sys.executable, "-c", FILE_SIZE_LIMIT_SERVE, str(root), writer, str(rows)],
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    status, error, passes = run.stdout.strip().splitlines()[-1].split(" | ")
    assert passes == "30" and status == "error"
    assert "File too large" in error and "file size limit, ulimit -f, of 4194304 bytes" in error
    verify = subprocess.run([sys.executable, "-m", "fastdump", "verify", str(root)], capture_output=True, text=True)
    assert verify.returncode == 1 and "ulimit -f" in verify.stdout


def test_an_hdf5_write_over_the_file_size_limit_in_a_writer_thread_is_an_error_naming_it(tmp_path):
    """HDF5's own writes (metadata, its file extension at close) cross the limit too: in a thread
    that refused SIGXFSZ they raise, the process lives, and the error names the limit."""
    script = textwrap.dedent("""
        import resource, signal, sys, threading, h5py, numpy as np
        from fastdump.writer.segment_file import error_text, refuse_file_size_signal
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
        errors = []
        def write():
            refuse_file_size_signal()
            try:
                with h5py.File(sys.argv[1], "w") as f:
                    f.create_dataset("x", data=np.ones(4 << 20, np.uint8))
            except Exception as exc:
                errors.append(error_text(exc))
        thread = threading.Thread(target=write)
        thread.start()
        thread.join()
        print(errors)
    """)
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path / "x.h5")], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "ulimit -f, of 1048576 bytes" in run.stdout


def test_leftover_shared_memory_of_a_dead_process_is_removed_at_start(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    leftover = SHM_DIR / f"{SHM_PREFIX}{int(dead.stdout)}-0"
    leftover.write_bytes(b"\0" * 4096)
    old = time.time() - STALE_REGION_AGE_S - 1
    os.utime(leftover, (old, old))
    assert leftover.name in remove_stale_regions()
    assert not leftover.exists()
    live = SHM_DIR / f"{SHM_PREFIX}{os.getpid()}-999"
    live.write_bytes(b"")
    try:
        assert live.name not in remove_stale_regions()
    finally:
        live.unlink()


def test_a_young_region_of_a_pid_not_seen_here_is_left_alone():
    """Containers of one pod share /dev/shm but not their pids: another container's attach in
    progress has a region whose pid is dead from here. Unlinking it (as any dead pid's) made that
    attach fail: its writer, starting, found no region to map."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    young = SHM_DIR / f"{SHM_PREFIX}{int(dead.stdout)}-0-0badcafe"
    young.write_bytes(b"\0" * 4096)
    try:
        assert young.name not in remove_stale_regions() and young.exists()
    finally:
        young.unlink()


def test_a_region_named_for_a_pid_too_large_for_the_kernel_does_not_stop_attach(tmp_path):
    """``os.kill`` raises OverflowError (not OSError) for such a pid: every attach on the host
    failed while one stray file of that name lay in /dev/shm. No such process exists: swept when old."""
    crafted = tmp_path / f"{SHM_PREFIX}{10 ** 30}-0"
    crafted.write_bytes(b"")
    assert remove_stale_regions(tmp_path) == [] and crafted.exists()  # young: left alone
    old = time.time() - STALE_REGION_AGE_S - 1
    os.utime(crafted, (old, old))
    assert remove_stale_regions(tmp_path) == [crafted.name] and not crafted.exists()


def test_a_leftover_region_of_this_pid_does_not_stop_dumping(tmp_path, monkeypatch):
    """A container restarted as pid 1 on a /dev/shm that outlived it finds its own pid's leftover
    region (never swept: the pid is alive, its own); every attach failed with shm_open EEXIST."""
    import itertools

    from fastdump.staging import engine

    assert engine.Engine._current is None  # (this attach starts a ring of its own)
    monkeypatch.setattr(engine, "_counter", itertools.count())  # the name the killed process took first
    leftover = SHM_DIR / f"{SHM_PREFIX}{os.getpid()}-0"
    leftover.write_bytes(b"\0" * 4096)
    try:
        model = torch.nn.Linear(4, 4)
        d = fastdump.attach(model, tmp_path, writer="thread")
        assert d.status == "running", d.error
        with torch.inference_mode():
            out = model(torch.ones(2, 4))
        d.close()
        assert torch.equal(fastdump.open(tmp_path).load("target", 0, 0)["Linear"], out)
        assert leftover.exists()  # (not this process's to remove: maybe a live one's, same pid)
    finally:
        leftover.unlink()


def test_writer_starts_when_fastdump_was_found_through_sys_path_only(tmp_path):
    """A script that puts the checkout on sys.path (no install, no PYTHONPATH, another working
    directory): the writer process must import the same fastdump and the dump must be whole."""
    repo = Path(fastdump.__file__).resolve().parent.parent
    script = tmp_path / "loop.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(repo)!r})
        import torch, fastdump
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        d = fastdump.attach(model, {str(tmp_path / "dump")!r}, strict=True)
        x = torch.ones(2, 4)
        with torch.no_grad():
            y = model(x)
        st = d.close()
        assert st["passes"] == 1 and st["tensors"] == 3, st
        ds = fastdump.open({str(tmp_path / "dump")!r})
        got = ds.load("target", 0, 0)["Sequential"]
        assert torch.equal(got, y), (got, y)
        print("ok")
    """))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, str(script)], cwd=str(tmp_path), env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-2000:]
