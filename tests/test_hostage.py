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


def check_on_disk(root, outs, dumper_stats, policy="drop"):
    """Every pass on disk holds exactly what the model computed, or records the tensor dropped.
    verify: nothing wrong under `drop`; under `block` the drops alone (that policy's dump is then
    not whole)."""
    problems = verify_dump(str(root)).problems
    if policy == "block":
        assert len(problems) == 1 and "policy 'block'" in problems[0] and "were dropped" in problems[0], problems
    else:
        assert not problems, problems
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
    check_on_disk(tmp_path, outs, stats, policy="block")


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


def small_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 8))


def small_input(i):
    return torch.full((2, 8), float(i) / 3)


@pytest.mark.parametrize("timeout", [None, "5", float("nan"), True])
def test_a_close_timeout_that_is_no_number_is_refused_before_anything_is_closed(tmp_path, timeout):
    """close(None) and close("5") raised TypeError after the wrappers came off, with the Dumper
    marked closed and its channel still open: a second close() did nothing and the status stayed
    "running" for good. close(nan) waited for nothing: every buffered pass lost. Refused now with
    the Dumper untouched: it goes on dumping, and a close() with a number closes it whole."""
    model = small_model(1)
    d = fastdump.attach(model, tmp_path)
    with torch.no_grad():
        model(small_input(0))
        with pytest.raises(TypeError, match=r"close: timeout must be a number of seconds, not "):
            d.close(timeout)
        assert d.status == "running" and "forward" in model[0].__dict__
        model(small_input(1))
    stats = d.close(30)
    assert stats["status"] == "closed" and stats["passes"] == 2
    ds = fastdump.open(tmp_path)
    assert ds.summary("target", 0)["passes"] == 2
    with torch.no_grad():
        assert torch.equal(ds.load("target", 0, 1)["0"], model[0](small_input(1)))
    assert verify_dump(str(tmp_path)).problems == []


@pytest.mark.parametrize("segment_passes", [8, 256])
def test_close_timeout_counts_the_passes_missing_on_disk(tmp_path, segment_passes):
    """N in "N passes not confirmed on disk" is what is missing on disk, not the pass ends the
    writer has not acked: it acks a pass end once buffered, long before its segment is written."""
    model = small_model(0)
    d = fastdump.attach(model, tmp_path, segment_passes=segment_passes, segment_idle_seconds=0)
    pid = writer_pid()
    try:
        with torch.inference_mode():
            for i in range(20):
                model(small_input(i))
        written = 20 // segment_passes * segment_passes  # 16 or 0: the rest wait in the open segment
        rank_json = d.dir / "rank.json"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # every pass end handled (acked), the full segments written
            info = json.loads(rank_json.read_text())
            if info["passes"] == written and info["pending_passes"] == 20 - written:
                break
            time.sleep(0.05)
        assert (info["passes"], info["pending_passes"]) == (written, 20 - written), info
        os.kill(pid, signal.SIGSTOP)
        with torch.inference_mode():
            for i in range(20, 23):  # pass ends the writer never sees
                model(small_input(i))
        stats = d.close(timeout=2)
    finally:
        cont(pid)
        kill(pid)
    assert stats["status"] == "error" and stats["passes"] == 23
    assert stats["error"].startswith("close timed out after 2 s; ") and stats["error"].endswith(
        " passes not confirmed on disk")
    unconfirmed = int(stats["error"].split("; ")[1].split()[0])
    ds = fastdump.open(tmp_path)
    on_disk = ds.passes("target", 0)
    assert on_disk == list(range(written))
    for p in on_disk:  # what is on disk is whole
        assert torch.equal(ds.load("target", 0, p)["Sequential"], model(small_input(p)))
    assert unconfirmed == stats["passes"] - len(on_disk) == 23 - written  # before: 3, the unacked ones
    assert json.loads((d.dir / "producer_error.json").read_text())["error"] == stats["error"]


def attach_in_thread(model, root, limit, **settings):
    """attach() in a thread; (Dumper, seconds it took), or fail if it takes more than `limit` s."""
    result = {}

    def work():
        t0 = time.monotonic()
        result["dumper"] = fastdump.attach(model, root, **settings)
        result["elapsed"] = time.monotonic() - t0

    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(limit)
    assert not t.is_alive(), f"attach did not return in {limit} s: the stopped writer holds it hostage"
    return result["dumper"], result["elapsed"]


def test_attach_with_a_stopped_writer_gives_up_within_block_timeout(tmp_path):
    """The EAGLE draft attached while the target's writer is stopped: attach gives up after
    block_timeout_s with a disabled Dumper saying why; the draft serves, the target dumps on."""
    target, draft = small_model(0), small_model(1)
    with torch.inference_mode():
        draft_reference = [draft(small_input(i)) for i in range(3)]
    dt = fastdump.attach(target, tmp_path, role="target")
    pid = writer_pid()
    outs = {}
    try:
        with torch.inference_mode():
            outs[0] = target(small_input(0))
        drained()
        os.kill(pid, signal.SIGSTOP)
        dd, elapsed = attach_in_thread(draft, tmp_path, limit=20, role="draft", block_timeout_s=1.0)
        assert 0.9 < elapsed < 4, f"attach took {elapsed:.1f} s with block_timeout_s=1"
        stats = dd.stats()
        assert stats["status"] == "error"
        assert f"writer process {pid} did not answer within 1 s (block_timeout_s" in stats["error"]
        assert "stopped or stuck: stopped (SIGSTOP" in stats["error"] and str(dd.dir) in stats["error"]
        with torch.inference_mode():  # the draft serves, unwrapped, computing as without fastdump
            assert all(torch.equal(draft(small_input(i)), draft_reference[i]) for i in range(3))
        assert "forward" not in draft[0].__dict__ and "forward" not in draft.__dict__
        with torch.inference_mode():
            outs[1] = target(small_input(1))  # staged while stopped (the ring has room)
        cont(pid)
        drained()
        with torch.inference_mode():
            for i in range(2, 5):
                outs[i] = target(small_input(i))
        assert dd.close(timeout=1)["status"] == "error"
        target_stats = dt.close(timeout=30)
    finally:
        cont(pid)
    assert target_stats["status"] == "closed" and target_stats["passes"] == 5
    assert Engine._current is None  # the draft let go of the engine: the target's close stopped the writer
    assert gone(pid)
    ds = fastdump.open(tmp_path)
    assert ds.passes("target", 0) == list(range(5))
    for p, out in outs.items():
        assert torch.equal(ds.load("target", 0, p)["Sequential"], out)
    # The draft's directory says why it holds nothing: the serving process recorded it at once;
    # the writer, continued, got the withdrawn open and recorded it too.
    assert json.loads((dd.dir / "producer_error.json").read_text())["error"] == stats["error"]
    draft_rank = json.loads((dd.dir / "rank.json").read_text())
    assert draft_rank["status"] == "error" and "did not answer within 1 s" in draft_rank["error"]
    assert draft_rank["passes"] == 0 and not list(dd.dir.glob("seg-*"))
    problems = verify_dump(str(tmp_path)).problems
    assert problems and all("draft" in text for text in problems), problems
    assert any("producer_error.json" in text and "did not answer" in text for text in problems), problems


@pytest.mark.parametrize("raised", [KeyboardInterrupt, TimeoutError])
def test_ctrl_c_during_a_stuck_attach_propagates_and_leaves_nothing_half_open(tmp_path, raised):
    """Ctrl-C, or any exception a signal handler raises (a deadline's SIGALRM raising TimeoutError):
    the caller gets it. Before, an Exception from a handler was taken for a failure to start dumping,
    swallowed, and attach returned a disabled Dumper."""
    target, draft = small_model(0), small_model(1)
    dt = fastdump.attach(target, tmp_path, role="target")
    engine, pid = Engine._current, writer_pid()

    def ctrl_c(*_):
        raise raised

    old = signal.signal(signal.SIGALRM, ctrl_c)
    try:
        with torch.inference_mode():
            target(small_input(0))
        drained()
        os.kill(pid, signal.SIGSTOP)
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        t0 = time.monotonic()
        with pytest.raises(raised):
            fastdump.attach(draft, tmp_path, role="draft", block_timeout_s=60)
        elapsed = time.monotonic() - t0
        signal.setitimer(signal.ITIMER_REAL, 0)
        assert elapsed < 5, f"Ctrl-C took {elapsed:.1f} s to get through attach"
        assert engine.refs == 1 and Engine._current is engine  # the target's reference alone
        assert "forward" not in draft.__dict__ and "forward" not in draft[0].__dict__
        (draft_dir,) = (tmp_path / "draft").iterdir()
        record = json.loads((draft_dir / "producer_error.json").read_text())
        assert record["status"] == "error" and record["error"] == f"attach interrupted ({raised.__name__})"
        cont(pid)
        with torch.inference_mode():
            target(small_input(1))
        stats = dt.close(timeout=30)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        cont(pid)
    assert stats["status"] == "closed" and stats["passes"] == 2
    assert Engine._current is None and gone(pid)  # nothing held the engine once the target closed
    assert fastdump.open(tmp_path).passes("target", 0) == [0, 1]
    draft_rank = json.loads((draft_dir / "rank.json").read_text())  # the writer got the withdrawn open
    assert draft_rank["status"] == "error" and raised.__name__ in draft_rank["error"]
    problems = verify_dump(str(tmp_path)).problems
    assert problems and all("draft" in text for text in problems), problems


STUCK = textwrap.dedent("""
    import faulthandler, os, signal, sys, time, torch, fastdump
    from fastdump.staging.engine import Engine
    mode = sys.argv[2]
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # run_stuck asks where it sits before a kill
    # Ctrl-C raises KeyboardInterrupt here whatever the test runner's own SIGINT handling: a runner
    # started with SIGINT ignored (a CI job run as a background job of a non-interactive shell)
    # passes that on to the processes it starts, and Python then installs no handler of its own: the
    # test's SIGINT did nothing and close() waited its 120 s (TimeoutExpired, nothing printed).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    d = fastdump.attach(model, sys.argv[1])  # (an idle writer starts at our priority: never starved in attach)
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


# Starts the script (its arguments after this one) with SIGINT ignored, as a process a CI runner
# started in the background of a non-interactive shell is: what it starts inherits that.
SIGINT_IGNORED = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                  "os.execv(sys.executable, [sys.executable] + sys.argv[1:])")


def run_stuck(tmp_path, mode, interrupt=False, sigint_ignored_by_runner=False):
    script = tmp_path / "stuck.py"
    script.write_text(STUCK)
    env = dict(os.environ, FASTDUMP_EXIT_TIMEOUT_S="2",
               PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    launch = [sys.executable] + (["-c", SIGINT_IGNORED] if sigint_ignored_by_runner else [])
    proc = subprocess.Popen(launch + [str(script), str(tmp_path / "dump"), mode], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid = None
    try:
        pid = int(proc.stdout.readline())
        if interrupt:
            assert proc.stdout.readline().strip() == "closing"
            time.sleep(1.0)
            proc.send_signal(signal.SIGINT)
        hung = None
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            hung = stacks_of_hung(proc, pid)
        if hung is not None:
            pytest.fail(f"the script did not end within 60 s: {hung}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if pid is not None:
            cont(pid)
    assert "terminate called" not in err and "Fatal Python error" not in err, err
    assert pid is not None and gone(pid), "the stopped writer was left behind"
    return proc.returncode, out, err


def stacks_of_hung(proc, writer_pid) -> str:
    """What a script run_stuck gave up on was doing: its threads' stacks (faulthandler, on SIGUSR1),
    what it printed, and whether it had exited with its writer still holding its pipes. (A timeout
    said nothing more than TimeoutExpired: two CI failures could not tell where it hung.)"""
    exited = proc.poll()
    if exited is None:
        proc.send_signal(signal.SIGUSR1)
    try:
        out, err = proc.communicate(timeout=5)
    except subprocess.TimeoutExpired as exc:  # (still hung, or its pipes held open by its writer)
        out, err = (b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
                    for b in (exc.output, exc.stderr))
    try:
        with open(f"/proc/{writer_pid}/stat") as f:
            writer = "state " + f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        writer = "gone"
    return (f"{'running' if exited is None else f'exited with {exited}'}; its writer {writer_pid}: {writer}\n"
            f"--- stdout:\n{out[-3000:]}\n--- stderr (the stacks at the end):\n{err[-12000:]}")


@pytest.mark.parametrize("mode", ["exit", "close"])
def test_interpreter_exits_cleanly_when_close_is_stuck(tmp_path, mode):
    t0 = time.monotonic()
    rc, out, err = run_stuck(tmp_path, mode)
    assert rc == 0, err
    assert time.monotonic() - t0 < 40  # FASTDUMP_EXIT_TIMEOUT_S=2, not 600 s
    rank = next((tmp_path / "dump" / "target").iterdir())
    assert json.loads((rank / "producer_error.json").read_text())["status"] == "error"
    assert fastdump.open(tmp_path / "dump").rank_info("target", 0)["status"] == "error"


@pytest.mark.parametrize("runner", ["default", "sigint ignored"])
def test_ctrl_c_interrupts_a_stuck_close(tmp_path, runner):
    """(runner "sigint ignored": the test itself run by a CI job that ignores SIGINT, as a background
    job of a non-interactive shell does: the script starts with it ignored. It never saw the Ctrl-C
    and the test timed out, TimeoutExpired with nothing printed: the signature of its CI failures.)"""
    rc, out, err = run_stuck(tmp_path, "interrupt", interrupt=True,
                             sigint_ignored_by_runner=runner == "sigint ignored")
    assert rc == 3, (out, err)
    words = out.split()
    assert words[-3] == "interrupted" and float(words[-2]) < 10 and words[-1] == "error"


PKG = os.path.dirname(fastdump.__file__)


def attach_with_a_stopped_writer(root):
    """A Dumper that ran two passes, its writer stopped (SIGSTOP) between them: nothing reaches disk."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    d = fastdump.attach(model, root, writer_priority="normal")
    with torch.no_grad():
        model(torch.ones(2, 8))
        os.kill(writer_pid(), signal.SIGSTOP)
        model(torch.ones(2, 8))
    return d, writer_pid()


# close()'s own steps, the engine's (its waits for the writer, its stop) and the record's writes
CLOSE_STEP_FILES = ("closing.py", "engine.py", "fsutil.py")


def close_steps_with_a_stopped_writer(root) -> list:
    """The functions (file:name) of CLOSE_STEP_FILES, in order of first call, that close() runs with
    its writer stopped, through its timeout, the error, and the engine's stop."""
    d, writer = attach_with_a_stopped_writer(root)
    steps = []

    def note(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(PKG):
            step = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"
            if step.startswith(CLOSE_STEP_FILES) and step not in steps:
                steps.append(step)

    sys.setprofile(note)
    try:
        d.close(timeout=0.3)
    finally:
        sys.setprofile(None)
        cont(writer)
    assert gone(writer)
    return steps


def test_ctrl_c_in_each_step_of_a_close_whose_writer_is_stopped_gets_out_and_the_exit_stops_it(
        tmp_path, monkeypatch):
    """test_ctrl_c_interrupts_a_stuck_close sends its SIGINT after 1 s: it lands in the wait for the
    close's ack, and where else it lands depends on the machine's load. Here the Ctrl-C is raised in
    each step of close() in turn (deterministic: the first call of each function), with the writer
    stopped: close() must raise it at once, never wait on the writer; the exit hook must then stop the
    writer within its deadline; and the record must say the passes are not on disk (verify fails)."""
    monkeypatch.setenv("FASTDUMP_EXIT_TIMEOUT_S", "0.5")
    from fastdump.staging import engine as engine_module

    steps = close_steps_with_a_stopped_writer(tmp_path / "probe")
    assert "closing.py:_close_channel" in steps and "engine.py:_stop_writer" in steps, steps
    for n, step in enumerate(steps):
        d, writer = attach_with_a_stopped_writer(tmp_path / f"at{n}")

        def ctrl_c_in_step(frame, event, arg, step=step):
            if event == "call" and f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}" == step \
                    and frame.f_code.co_filename.startswith(PKG):
                sys.setprofile(None)
                raise KeyboardInterrupt(step)

        try:
            t0 = time.monotonic()
            sys.setprofile(ctrl_c_in_step)
            try:
                with pytest.raises(KeyboardInterrupt, match=step):
                    d.close(timeout=0.3)  # (its timeout passes before the steps after the wait)
            finally:
                sys.setprofile(None)
            assert time.monotonic() - t0 < 5, step
            t0 = time.monotonic()
            engine_module._shutdown_at_exit()  # what the interpreter's exit runs
            assert time.monotonic() - t0 < 8, step
            assert gone(writer, timeout=2), step
        finally:
            cont(writer)
            kill(writer)
        assert Engine._current is None or Engine._current.closed, step
        assert not engine_module._UNFINISHED_STOPS, step
        assert d.stats()["status"] == "error", (step, d.stats())
        assert verify_dump(str(tmp_path / f"at{n}")).problems, step


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), True, "5"])
def test_block_timeout_is_validated(tmp_path, bad):
    with pytest.raises(ValueError, match="block_timeout_s"):
        fastdump.attach(make_model(), tmp_path, block_timeout_s=bad)


def test_block_timeout_from_the_environment():
    assert config.settings_from_env({"FASTDUMP_DIR": "/d", "FASTDUMP_BLOCK_TIMEOUT_S": "2.5"}) == {
        "root": "/d", "block_timeout_s": 2.5}
    with pytest.raises(config.ConfigError, match="FASTDUMP_BLOCK_TIMEOUT_S"):
        config.settings_from_env({"FASTDUMP_DIR": "/d", "FASTDUMP_BLOCK_TIMEOUT_S": "0"})


def test_tensors_larger_than_the_ring_a_stalled_writer_cut_off_are_drops_and_fail_verify(tmp_path):
    """`block`, tensors larger than the ring (staged chunk by chunk as the writer frees space), the
    writer stopped: the first tensor times out with part of it in the ring (TORN), and the channel
    then stages as under `drop`, where such a tensor cannot go in at once (RING_TOO_SMALL). Both
    were recorded as skips (which say a tensor cannot be stored at all), so verify said OK with
    tensors lost to the stall. They are drops now, counted in their pass, and verify fails."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 1152), torch.nn.ReLU())
    x = torch.randn(512, 64)  # outputs of 512 x 1152 fp32: 2.25 MiB each, the ring 1 MiB
    # (2 s: a loaded machine's writer, warming up, took over 0.3 s for one chunk of pass 0)
    d = fastdump.attach(model, tmp_path, policy="block", block_timeout_s=2.0, ring_mb=1)
    pid = writer_pid()
    try:
        with torch.inference_mode():
            model(x)  # pass 0: the writer frees space as the chunks go in
            drained()
            os.kill(pid, signal.SIGSTOP)  # the ring is empty: the first chunk fits, the second waits
            model(x)  # pass 1: "0" torn after 2 s; "1" and "Sequential" cannot go in at once
            stats = d.stats()
            assert stats["dropped"] == 3 and stats["skipped"] == 0, stats
            cont(pid)
            drained()
            out = model(x)  # pass 2: blocking again, whole
    finally:
        cont(pid)
        stats = d.close()
    assert stats["status"] == "closed" and stats["dropped"] == 3 and stats["skipped"] == 0
    ds = fastdump.open(tmp_path)
    assert ds.meta("target", 0, 1)["dropped"] == 3 and ds.load("target", 0, 1) == {}
    assert torch.equal(ds.load("target", 0, 2)["Sequential"], out)
    problems = verify_dump(str(tmp_path)).problems
    assert any("policy 'block': 3 tensor(s)" in p for p in problems), problems


def test_close_timeout_is_kept_with_a_writer_thread_stuck_in_a_segment_write(tmp_path, monkeypatch):
    """A writer THREAD cannot be stopped like a process: one stuck in a segment write (a hung
    disk) must not hold close() past its timeout, and what it had not written fails verify, also
    once the write comes back."""
    from fastdump.writer import channel_writer

    release = threading.Event()
    flush = channel_writer.ChannelWriter._flush
    model = small_model(0)
    d = fastdump.attach(model, tmp_path, writer="thread", segment_passes=2, segment_idle_seconds=0)
    with torch.inference_mode():
        for i in range(2):
            model(small_input(i))
    rank_json = d.dir / "rank.json"
    deadline = time.monotonic() + 30
    while json.loads(rank_json.read_text())["passes"] < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    monkeypatch.setattr(channel_writer.ChannelWriter, "_flush", lambda self: (release.wait(), flush(self)))
    try:
        with torch.inference_mode():
            for i in range(2, 6):
                model(small_input(i))
        t0 = time.monotonic()
        stats = d.close(timeout=2)
        elapsed = time.monotonic() - t0
    finally:
        release.set()
    assert elapsed < 5, f"close(timeout=2) took {elapsed:.1f} s"
    assert stats["status"] == "error" and stats["passes"] == 6
    assert stats["error"] == "close timed out after 2 s; 4 passes not confirmed on disk"
    assert json.loads((d.dir / "producer_error.json").read_text())["error"] == stats["error"]
    problems = verify_dump(str(tmp_path)).problems
    assert any("producer_error.json" in p and "close timed out" in p for p in problems), problems
    deadline = time.monotonic() + 10  # the write comes back: the abandoned writer stops, marks the rank failed
    while json.loads(rank_json.read_text())["status"] != "error" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert json.loads(rank_json.read_text())["status"] == "error"
    ds = fastdump.open(tmp_path)
    on_disk = ds.passes("target", 0)  # the two written before, and the segment the stuck write finished
    assert on_disk == [0, 1, 2, 3]
    for p in on_disk:  # whole, bit for bit
        assert torch.equal(ds.load("target", 0, p)["Sequential"], model(small_input(p)))
    problems = verify_dump(str(tmp_path)).problems  # passes 4 and 5 never landed: still a failure
    assert any("writer status error" in p and "stopped waiting" in p for p in problems), problems


def test_one_stall_shared_by_two_dumpers_is_logged_once_and_its_end_once(tmp_path, caplog):
    """`block`, two Dumpers (target, draft) on one writer, the writer stopped: the first blocking
    wait that times out marks the writer stalled and logs it; the other Dumper's wait in a pass it
    began before the stall times out too, but it is the same stall (not logged again). Once the
    writer gives space back, the next pass logs the recovery once and blocks again: whole passes."""
    caplog.set_level("WARNING", logger="fastdump")
    d = fastdump.attach(None, tmp_path, policy="block", block_timeout_s=0.3, ring_mb=1)
    d2 = fastdump.attach(None, tmp_path, role="draft", policy="block", block_timeout_s=0.3, ring_mb=1)
    assert d2._engine is d._engine
    pid = writer_pid()
    sent = {"target": [], "draft": []}
    try:
        drained()
        waited = Engine._current.producer.stats()["block_seconds"]
        os.kill(pid, signal.SIGSTOP)
        d.begin_pass()
        d2.begin_pass()  # began before the stall: still blocking
        for i in range(20):  # 64 KiB each, 1.25 MiB > the ring: the wait times out, the rest dropped
            d.dump(f"t{i}", torch.full((16384,), float(i)))
        d2.dump("x", torch.full((16384,), -1.0))  # waits block_timeout_s once more, then dropped
        d.end_pass()
        d2.end_pass()
        for i in range(5):  # stalled: staged as under `drop`, no more waiting (dropped, counted)
            d.begin_pass()
            d.dump("z", torch.full((16384,), float(i)))
            d.end_pass()
        waited = Engine._current.producer.stats()["block_seconds"] - waited
        assert 0.5 < waited < 1.6, f"waited {waited:.2f} s: two timeouts (one per Dumper), then none (a third: 2.1 s)"
        cont(pid)
        drained()
        for dumper, role in ((d, "target"), (d2, "draft")):
            for p in range(2):
                t = torch.arange(1000, dtype=torch.float64) + 10 * p
                dumper.begin_pass()
                dumper.dump("y", t)
                dumper.end_pass()
                sent[role].append((dumper.pass_id, t))
    finally:
        cont(pid)
        s2 = d2.close()
        s1 = d.close()
    stalls = [r for r in caplog.records if "freed no ring space" in r.getMessage()]
    recoveries = [r for r in caplog.records if "caught up" in r.getMessage()]
    assert len(stalls) == 1, [r.getMessage() for r in stalls]
    assert len(recoveries) == 1, [r.getMessage() for r in recoveries]
    assert s1["dropped"] >= 1 and s2["dropped"] == 1
    assert s1["tensors"] + s1["dropped"] + s1["dropped_passes"] == 20 + 5 + 2
    ds = fastdump.open(tmp_path)
    for role, want in sent.items():
        for pass_id, t in want:
            assert torch.equal(ds.load(role, 0, pass_id)["y"], t)
    assert verify_dump(str(tmp_path)).problems  # drops under `block`: verify fails


def test_block_timeout_bounds_a_stall_not_the_streaming_of_a_tensor_larger_than_the_ring(tmp_path, monkeypatch):
    """`block`, a tensor 16 times the ring, a writer that frees a chunk every 0.1 s (a slow disk, a
    busy machine): each wait for space is short, but the whole tensor takes longer than
    block_timeout_s. It was torn at block_timeout_s after its first chunk (and logged as "the
    writer freed no ring space"): a 2 GiB tensor through the default ring on a loaded machine was
    lost that way with a writer that never stalled. It is dumped whole, bit for bit."""
    from fastdump.writer import loop

    assemble = loop.WriterLoop._assemble

    def slow_assemble(self, *args):
        time.sleep(0.1)  # per chunk: the ring's space comes back at the writer's pace
        return assemble(self, *args)

    monkeypatch.setattr(loop.WriterLoop, "_assemble", slow_assemble)
    big = torch.arange(float(1 << 20))  # 4 MiB: 16 chunks of the 1 MiB ring
    model = torch.nn.Sequential(torch.nn.Identity())
    t0 = time.monotonic()
    with fastdump.attach(model, tmp_path, writer="thread", policy="block", block_timeout_s=0.8, ring_mb=1,
                         include=r"^0$") as d, torch.inference_mode():
        model(big)
        stats = d.stats()
    assert time.monotonic() - t0 > 0.8  # (the streaming did take longer than the timeout)
    assert stats["dropped"] == 0 and stats["tensors"] == 1, stats
    assert torch.equal(fastdump.open(tmp_path).load("target", 0, 0)["0"], big)
    assert not verify_dump(str(tmp_path)).problems


def test_a_silent_writer_is_told_apart_stopped_busy_or_starved(monkeypatch):
    """What the writer that did not answer is doing: stopped (attach's error), busy, or runnable and
    starved of CPU (an idle-priority writer on a machine kept busy): the last two are behind, not
    stuck, and attach goes on (Engine._open_taken, tests/test_writer_priority.py)."""
    from fastdump.staging import engine
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        deadline = time.monotonic() + 10
        while engine._process_state(spinner.pid)[1] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)  # until it has used a tick of CPU
        assert engine._why_silent(spinner.pid) == "it is running but busy (a backlog to write, or a slow disk)"
        os.kill(spinner.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while engine._process_state(spinner.pid)[0] != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine._why_silent(spinner.pid) == "it is stopped or stuck: stopped (SIGSTOP or a debugger)"
    finally:
        spinner.kill()
        spinner.wait()
    assert engine._why_silent(spinner.pid) is None  # gone: nothing to tell
    # Runnable and no CPU used in between: what the kernel shows of a starved SCHED_IDLE process.
    monkeypatch.setattr(engine, "_process_state", lambda pid: ("R", 7))
    assert "runnable but got no CPU" in engine._why_silent(1) and "writer_priority='normal'" in engine._why_silent(1)
    monkeypatch.setattr(engine, "_process_state", lambda pid: ("S", 7))
    assert engine._why_silent(1) is None  # asleep: the generic words stand
