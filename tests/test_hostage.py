"""The serving process is never held hostage by a stopped or dead writer (issue 9, items 11-12).

Each test stops the writer process with SIGSTOP (what a debugger, a swapped-out container or a
frozen disk looks like from the model's side) and checks that forwards, close() and interpreter
exit stay bounded, that what was dropped is counted, and that what was staged before is on disk
bit for bit. Stopped writers are always continued or killed in ``finally``.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import fastdump
from fastdump import config
from fastdump.cli.dump import verify_dump
from fastdump.staging.engine import Engine

# Outputs of 384 or 640 KiB (rows x 256 float32): two or three chunks of a 1 MiB ring (a chunk is
# a quarter of it). With a 384 KiB tensor in an otherwise empty ring, a 640 KiB one finds room for
# its first chunks but not its last: the case that stalled `drop` before (it staged the first
# chunk, then waited for the writer for the others).
def rows(i):
    return 384 if i % 4 == 0 else 640


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 256))


def inputs(i):
    return torch.full((rows(i), 256), float(i) / 7)


def writer_pid():
    return Engine._current._proc.pid


def cont(pid):
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def gone(pid, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def drained(timeout=30.0):
    eng = Engine._current
    deadline = time.monotonic() + timeout
    while eng.producer.used_bytes() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert eng.producer.used_bytes() == 0, "the writer did not drain the ring"


def run_forwards(model, first, n, limit):
    """Run n forwards in a thread; return their outputs, or fail if they take more than `limit` s."""
    outs = {}

    def work():
        with torch.inference_mode():
            for i in range(first, first + n):
                outs[i] = model(inputs(i))

    t = threading.Thread(target=work, daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(limit)
    elapsed = time.monotonic() - t0
    assert not t.is_alive(), f"{len(outs)} of {n} forwards finished in {limit} s: the writer holds forward hostage"
    return outs, elapsed


def check_on_disk(root, outs, dumper_stats):
    """Every pass on disk holds exactly what the model computed, or records the tensor dropped."""
    assert not verify_dump(str(root)).problems
    ds = fastdump.open(root)
    on_disk_dropped = 0
    for p in ds.passes("target", 0):
        got = ds.load("target", 0, p)
        meta = ds.meta("target", 0, p)
        on_disk_dropped += meta["dropped"]
        if "0" in got:
            assert torch.equal(got["0"], outs[p]), f"pass {p} differs from what the model computed"
        else:
            assert meta["dropped"] == 1, f"pass {p} lost its tensor without counting it"
    assert on_disk_dropped == dumper_stats["dropped"]
    return ds


def test_drop_never_stalls_on_tensors_larger_than_a_chunk(tmp_path):
    model = make_model()
    d = fastdump.attach(model, tmp_path, policy="drop", ring_mb=1, include=r"^0$")
    pid = writer_pid()
    try:
        assert rows(0) * 256 * 4 > Engine._current.producer.chunk_bytes  # really chunked
        os.kill(pid, signal.SIGSTOP)  # the ring is empty: what fits and what does not is known
        outs, _ = run_forwards(model, 0, 12, limit=20)  # before the fix: stuck in the second forward
        # Whole tensors only: those of passes 0 and 4 (384 KiB each) fit, no other one does.
        assert d.stats()["dropped"] == 10
        cont(pid)
        drained()
        more, _ = run_forwards(model, 12, 4, limit=60)
        outs.update(more)
    finally:
        cont(pid)
        stats = d.close()
    assert stats["status"] == "closed"  # (a busy writer may make `drop` drop more after SIGCONT)
    ds = check_on_disk(tmp_path, outs, stats)
    assert set(ds.passes("target", 0)) == set(range(16))
    for p in (0, 4):  # staged while the writer was stopped: on disk after all
        assert "0" in ds.load("target", 0, p)


def test_block_timeout_drops_instead_of_freezing_forward(tmp_path):
    model = make_model()
    d = fastdump.attach(model, tmp_path, policy="block", block_timeout_s=1.0, ring_mb=1, include=r"^0$")
    pid = writer_pid()
    try:
        outs, _ = run_forwards(model, 0, 3, limit=60)
        drained()
        waited = Engine._current.producer.stats()["block_seconds"]
        os.kill(pid, signal.SIGSTOP)
        stopped, elapsed = run_forwards(model, 3, 12, limit=30)
        waited = Engine._current.producer.stats()["block_seconds"] - waited
        assert 0.9 < waited < 1.9, f"waited {waited:.2f} s in all: one timeout, not one per tensor or pass"
        outs.update(stopped)
        stats = d.stats()
        # Blocking tensors may fill the ring to the brim: then whole passes are dropped at their start.
        assert stats["dropped"] + stats["dropped_passes"] >= 9
        # One timeout, then drop-like staging until the writer frees space: not 1 s per tensor.
        assert elapsed < 8, f"12 forwards took {elapsed:.1f} s"
        cont(pid)
        drained()
        before = d.stats()["tensors"]
        more, _ = run_forwards(model, 15, 5, limit=60)  # the writer caught up: blocking again
        outs.update(more)
        assert d.stats()["tensors"] == before + 5
    finally:
        cont(pid)
        stats = d.close()
    assert stats["status"] == "closed"
    check_on_disk(tmp_path, outs, stats)


def test_close_timeout_is_kept_with_a_stopped_writer(tmp_path):
    model = make_model()
    d = fastdump.attach(model, tmp_path, ring_mb=1, include=r"^0$")
    pid = writer_pid()
    try:
        run_forwards(model, 0, 2, limit=60)
        drained()
        os.kill(pid, signal.SIGSTOP)
        run_forwards(model, 2, 1, limit=30)
        t0 = time.monotonic()
        stats = d.close(timeout=2)
        elapsed = time.monotonic() - t0
    finally:
        cont(pid)
        kill(pid)
    assert elapsed < 8, f"close(timeout=2) took {elapsed:.1f} s"
    assert stats["status"] == "error"
    assert "close timed out after 2 s" in stats["error"] and "not confirmed on disk" in stats["error"]
    assert int(stats["error"].split("; ")[1].split()[0]) >= 1  # the pass staged after the stop
    # The writer was stopped: the serving process records the reason in its own file, not in
    # rank.json (one file, one writer); readers merge it, verify names it.
    assert json.loads((d.dir / "rank.json").read_text())["status"] != "error"
    record = json.loads((d.dir / "producer_error.json").read_text())
    assert record["status"] == "error" and record["error"] == stats["error"]
    info = fastdump.open(tmp_path).rank_info("target", 0)
    assert info["status"] == "error" and info["error"] == stats["error"]
    problems = verify_dump(str(tmp_path)).problems  # a dump that may have lost passes never verifies
    assert any("producer_error.json" in text and "close timed out" in text for text in problems), problems
    assert Engine._current is None  # the writer was killed, not left behind


STUCK = textwrap.dedent("""
    import os, signal, sys, time, torch, fastdump
    from fastdump.staging.engine import Engine
    mode = sys.argv[2]
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    d = fastdump.attach(model, sys.argv[1])
    model(torch.ones(2, 8))
    os.kill(Engine._current._proc.pid, signal.SIGSTOP)
    model(torch.ones(2, 8))
    print(Engine._current._proc.pid, flush=True)
    if mode == "close":
        d.close(timeout=1)
    elif mode == "interrupt":
        print("closing", flush=True)
        t0 = time.monotonic()
        try:
            d.close(timeout=120)
        except KeyboardInterrupt:
            print("interrupted", round(time.monotonic() - t0, 1), d.stats()["status"], flush=True)
            sys.exit(3)
        print("not interrupted", flush=True)
    # mode "exit": leave the Dumper open, the interpreter's exit closes it
""")


def run_stuck(tmp_path, mode, interrupt=False):
    script = tmp_path / "stuck.py"
    script.write_text(STUCK)
    env = dict(os.environ, FASTDUMP_EXIT_TIMEOUT_S="2",
               PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "dump"), mode], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid = None
    try:
        pid = int(proc.stdout.readline())
        if interrupt:
            assert proc.stdout.readline().strip() == "closing"
            time.sleep(1.0)
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if pid is not None:
            cont(pid)
    assert "terminate called" not in err and "Fatal Python error" not in err, err
    assert pid is not None and gone(pid), "the stopped writer was left behind"
    return proc.returncode, out, err


@pytest.mark.parametrize("mode", ["exit", "close"])
def test_interpreter_exits_cleanly_when_close_is_stuck(tmp_path, mode):
    t0 = time.monotonic()
    rc, out, err = run_stuck(tmp_path, mode)
    assert rc == 0, err
    assert time.monotonic() - t0 < 40  # FASTDUMP_EXIT_TIMEOUT_S=2, not 600 s
    rank = next((tmp_path / "dump" / "target").iterdir())
    assert json.loads((rank / "producer_error.json").read_text())["status"] == "error"
    assert fastdump.open(tmp_path / "dump").rank_info("target", 0)["status"] == "error"


def test_ctrl_c_interrupts_a_stuck_close(tmp_path):
    rc, out, err = run_stuck(tmp_path, "interrupt", interrupt=True)
    assert rc == 3, (out, err)
    words = out.split()
    assert words[-3] == "interrupted" and float(words[-2]) < 10 and words[-1] == "error"


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), True, "5"])
def test_block_timeout_is_validated(tmp_path, bad):
    with pytest.raises(ValueError, match="block_timeout_s"):
        fastdump.attach(make_model(), tmp_path, block_timeout_s=bad)


def test_block_timeout_from_the_environment():
    assert config.settings_from_env({"FASTDUMP_DIR": "/d", "FASTDUMP_BLOCK_TIMEOUT_S": "2.5"}) == {
        "root": "/d", "block_timeout_s": 2.5}
    with pytest.raises(config.ConfigError, match="FASTDUMP_BLOCK_TIMEOUT_S"):
        config.settings_from_env({"FASTDUMP_DIR": "/d", "FASTDUMP_BLOCK_TIMEOUT_S": "0"})
