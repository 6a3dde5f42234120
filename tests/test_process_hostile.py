"""Hostile process-level events: writers killed or stopped at random moments, serving processes
killed mid-pass, Ctrl-C inside a forward, fork, threads, several Dumpers on shared modules,
attach/close loops and close() from odd places.

Each test checks the project's rules: the model never crashes, hangs past the documented timeouts
or returns something else; a dump never holds wrong or mixed data; lost or mixed data makes
``fastdump verify`` fail while a clean run verifies; finished passes are not lost when the serving
process dies. "Random moments" come from a seeded RNG. Processes spawned here are always killed.
"""

import copy
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import fastdump
from fastdump.staging.engine import SHM_DIR, SHM_PREFIX, Engine

REPO = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))


# ------------------------------------------------------------------------------------------ helpers


class Net(nn.Module):
    """Three leaves and the root: names ``up``, ``act``, ``down``, ``Net``."""

    def __init__(self, dim=16, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.up = nn.Linear(dim, 2 * dim)
        self.act = nn.ReLU()
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


LEAVES = ("up", "act", "down")


def expected(ref: Net, x: torch.Tensor, root="Net") -> dict:
    """What a pass of ``ref`` (an undumped copy) on ``x`` must hold, by name."""
    with torch.no_grad():
        up = ref.up(x)
        act = ref.act(up)
        down = ref.down(act)
    return {"up": up, "act": act, "down": down, root: down}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return a.contiguous().reshape(-1).view(torch.uint8).equal(b.contiguous().reshape(-1).view(torch.uint8))


def verify_cli(root) -> subprocess.CompletedProcess:
    """``python -m fastdump verify --data ROOT``: the user's verdict on the dump."""
    return subprocess.run([sys.executable, "-m", "fastdump", "verify", "--data", str(root)],
                          capture_output=True, text=True, timeout=120, env=ENV)


def assert_verifies(root):
    done = verify_cli(root)
    assert done.returncode == 0, done.stdout + done.stderr


def assert_verify_fails(root, *words):
    done = verify_cli(root)
    assert done.returncode != 0, done.stdout
    for word in words:
        assert word in done.stdout, done.stdout
    return done.stdout


def rank_of(ds, role="target"):
    ranks = ds.ranks(role)
    assert len(ranks) == 1, ranks
    return ranks[0]


def check_passes_against(root, inputs: dict, ref: Net, *, role="target", root_name="Net", allow_drops=False):
    """Every pass on disk holds exactly what ``ref`` computes from that pass's input (by pass id),
    under the expected names and no other (no ``#k`` from a neighbour, nothing shifted), unless the
    pass says it is not whole (then what it holds is still right). Returns the DumpSet."""
    ds = fastdump.open(root)
    rank = rank_of(ds, role)
    for p in ds.passes(role, rank):
        got = ds.load(role, rank, p, check=True)
        meta = ds.meta(role, rank, p)
        want = expected(ref, inputs[p], root_name)
        assert set(got) <= set(want), f"pass {p}: names {sorted(got)} are not the model's ({sorted(want)})"
        for name, t in got.items():
            assert same_bits(t, want[name]), f"pass {p}: {name} differs from what the model computed"
        if meta["complete"] and not allow_drops:
            assert set(got) == set(want), f"pass {p} is marked whole but lacks {set(want) - set(got)}"
        elif meta["complete"]:
            assert len(got) + meta["dropped"] == len(want), f"pass {p} lost tensors without counting them"
    return ds


def writer_pid(d) -> int:
    return d._engine._proc.pid


def signal_quietly(pid, sig):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def wait_for(predicate, timeout=30.0, step=0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


def run_script(tmp_path, source, *args, timeout=120):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    proc = subprocess.Popen([sys.executable, str(script), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out, err


# ---------------------------------------------------------------- the writer killed at random moments


@pytest.mark.parametrize("seed", range(4))
def test_writer_sigkilled_at_a_random_moment_serving_goes_on_and_nothing_on_disk_is_wrong(tmp_path, seed):
    rng = random.Random(seed)
    model = Net()
    ref = copy.deepcopy(model)
    d = fastdump.attach(model, tmp_path, segment_passes=rng.choice([1, 3, 8]), ring_mb=2,
                        segment_idle_seconds=rng.choice([0.05, 1.0]))
    pid = writer_pid(d)
    kill_after = rng.randrange(2, 60)
    delay = rng.random() * 0.003  # lands anywhere: mid-pass, mid-segment write, between passes
    started = threading.Event()

    def killer():
        started.wait(60)
        time.sleep(delay)
        signal_quietly(pid, signal.SIGKILL)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    inputs = {}
    try:
        with torch.no_grad():
            for i in range(100):
                x = torch.randn(rng.choice([1, 3, 64]), 16)
                inputs[i] = x
                if i == kill_after:
                    started.set()
                out = model(x)
                assert same_bits(out, expected(ref, x)["Net"])  # the model's answer never changes
        t.join(30)
        t0 = time.monotonic()
        stats = d.close(timeout=5)
        assert time.monotonic() - t0 < 8
    finally:
        signal_quietly(pid, signal.SIGKILL)
    assert stats["status"] == "error" and stats["error"], stats
    assert stats["passes"] <= 100
    # What the dead writer managed to put on disk is right, and the dump does not verify.
    check_passes_against(tmp_path, inputs, ref)
    assert_verify_fails(tmp_path, "producer_error.json")
    assert not list(SHM_DIR.glob(f"{SHM_PREFIX}{os.getpid()}-*")), "the ring outlived its close"
    # The next attach gets a fresh writer and a whole dump.
    model2, ref2 = Net(seed=1), None
    ref2 = copy.deepcopy(model2)
    with fastdump.attach(model2, tmp_path / "again") as d2:
        xs = {i: torch.randn(2, 16) for i in range(5)}
        with torch.no_grad():
            for i in range(5):
                model2(xs[i])
    assert d2.stats()["status"] == "closed"
    check_passes_against(tmp_path / "again", xs, ref2)
    assert_verifies(tmp_path / "again")


# ---------------------------------------------------------- the writer stopped and continued at random


@pytest.mark.parametrize("policy", ["drop", "block"])
def test_writer_stopped_and_continued_at_random_moments_loses_only_what_it_counts(tmp_path, policy):
    rng = random.Random(f"stop-{policy}")
    model = Net(dim=128)
    ref = copy.deepcopy(model)
    # A 1 MiB ring: 256-row passes (3 tensors of 128-256 KiB) fill it in a few passes.
    d = fastdump.attach(model, tmp_path, policy=policy, block_timeout_s=0.3, ring_mb=1, segment_passes=4)
    pid = writer_pid(d)
    inputs = {}
    stopped = False
    t0 = time.monotonic()
    try:
        with torch.no_grad():
            for i in range(120):
                if rng.random() < 0.08:
                    signal_quietly(pid, signal.SIGCONT if stopped else signal.SIGSTOP)
                    stopped = not stopped
                x = torch.randn(rng.choice([1, 8, 256]), 128)
                inputs[i] = x
                t1 = time.monotonic()
                out = model(x)
                # Under block one pass waits at most block_timeout_s per stall, under drop not at all.
                assert time.monotonic() - t1 < (3.0 if policy == "block" else 1.0)
                assert same_bits(out, expected(ref, x)["Net"])
        signal_quietly(pid, signal.SIGCONT)
        stats = d.close(timeout=60)
    finally:
        signal_quietly(pid, signal.SIGCONT)
    elapsed = time.monotonic() - t0
    assert elapsed < 40, elapsed
    assert stats["status"] == "closed", stats
    assert stats["dropped"] + stats["dropped_passes"] > 0, "the test never filled the ring"
    ds = check_passes_against(tmp_path, inputs, ref, allow_drops=True)
    rank = rank_of(ds)
    passes = ds.passes("target", rank)
    # Every pass is on disk or counted as dropped whole; every dropped tensor is counted in its pass.
    assert len(passes) + stats["dropped_passes"] == 120, (len(passes), stats)
    assert sum(ds.meta("target", rank, p)["dropped"] for p in passes) == stats["dropped"]
    info = ds.rank_info("target", rank)
    assert info["dropped"] == stats["dropped"] and info["dropped_passes"] == stats["dropped_passes"]
    # Drops are counted by design: verify passes with warnings that say so, and reads every byte.
    done = verify_cli(tmp_path)
    assert done.returncode == 0, done.stdout
    assert "dropped" in done.stdout, done.stdout


# ------------------------------------------------------------------------- Ctrl-C inside a forward


class Interruptible(Net):
    """Net whose ``act`` can raise KeyboardInterrupt, as Ctrl-C lands in the middle of a forward."""

    def __init__(self):
        super().__init__()
        self.interrupt = False
        real = self.act.forward

        def act(x):
            if self.interrupt:
                raise KeyboardInterrupt
            return real(x)

        self.act.forward = act  # an instance forward: fastdump wraps over it


def test_keyboard_interrupt_inside_a_modules_forward_ends_the_pass_incomplete_and_the_next_is_clean(tmp_path):
    model, ref = Interruptible(), Net()  # (same seed: same weights)
    xs = {i: torch.randn(3, 16) for i in range(4)}
    with fastdump.attach(model, tmp_path, root_name="Net") as d:
        with torch.no_grad():
            model(xs[0])
            model.interrupt = True
            with pytest.raises(KeyboardInterrupt):
                model(xs[1])
            model.interrupt = False
            assert not d.in_pass
            model(xs[2])
            model(xs[3])
    assert d.stats()["incomplete_passes"] == 1
    ds = check_passes_against(tmp_path, xs, ref)
    rank = rank_of(ds)
    assert ds.passes("target", rank) == [0, 1, 2, 3]
    meta = ds.meta("target", rank, 1)
    assert meta["complete"] is False and "KeyboardInterrupt" in meta["incomplete"]
    assert sorted(ds.load("target", rank, 1)) == ["up"]  # what ran before the interrupt, nothing else
    for p in (0, 2, 3):  # names not shifted: no act#1 in the pass after the interrupted one
        assert sorted(ds.load("target", rank, p)) == ["Net", "act", "down", "up"]
    done = verify_cli(tmp_path)
    assert done.returncode == 0 and "pass 1 is incomplete" in done.stdout, done.stdout


PKG = os.path.dirname(fastdump.__file__)


class CtrlCAt:
    """A profile function raising KeyboardInterrupt at the n-th point of fastdump's own Python code
    where CPython delivers a signal: a Python function's start (its RESUME) and the return of a C
    function it called (the eval breaker checked after CALL). Deterministic, unlike a timer."""

    def __init__(self, n):
        self.n, self.seen, self.where = n, 0, None

    def __call__(self, frame, event, arg):
        if event in ("call", "c_return") and frame.f_code.co_filename.startswith(PKG):
            self.seen += 1
            if self.seen == self.n:
                self.where = f"{event} {frame.f_code.co_name}:{frame.f_lineno} {getattr(arg, '__name__', '')}"
                raise KeyboardInterrupt(self.where)


@pytest.mark.parametrize("inputs", [False, True])  # the C hot path; the Python path (inputs) too
def test_ctrl_c_at_every_point_of_the_dumpers_code_leaves_later_passes_whole_and_right(tmp_path, inputs):
    """A notebook user's Ctrl-C lands in fastdump's bookkeeping (a pass's begin waits for ring space
    in Python slices precisely so that Ctrl-C gets through). Whatever point it hits, the next pass
    must be dumped whole under the right names, and nothing on disk may be wrong."""
    model = Net()
    ref = copy.deepcopy(model)
    d = fastdump.attach(model, tmp_path, inputs=inputs, segment_passes=3)
    clean, interrupted, points = {}, {}, []
    try:
        for n in range(1, 400):
            x = torch.randn(2, 16)
            before = d.pass_id
            sys.setprofile(CtrlCAt(n))
            try:
                with torch.no_grad():
                    model(x)
            except KeyboardInterrupt as exc:
                points.append(str(exc))
            else:
                clean[d.pass_id] = x
                break  # n is past the last point of one forward: every point was tried
            finally:
                sys.setprofile(None)
            if d.pass_id > before:
                interrupted[d.pass_id] = x
            y = torch.randn(2, 16)  # (a pass left open is closed, marked incomplete, as this one begins)
            with torch.no_grad():
                out = model(y)
            assert same_bits(out, expected(ref, y)["Net"])
            assert not d.in_pass and d.status == "running", f"after Ctrl-C at {points[-1]}: a pass stays open"
            clean[d.pass_id] = y
            assert len(clean) == len(points), f"after Ctrl-C at {points[-1]}: the next forward was no pass"
            assert clean.keys().isdisjoint(interrupted)
    finally:
        sys.setprofile(None)
        stats = d.close()
    assert len(points) > 5, points
    assert stats["status"] == "closed", stats
    ds = fastdump.open(tmp_path)
    rank = rank_of(ds)
    for p, y in clean.items():
        got = {k: v for k, v in ds.load("target", rank, p, check=True).items() if ".input." not in k}
        want = expected(ref, y)
        assert sorted(got) == sorted(want), f"pass {p}: {sorted(got)}"
        assert all(same_bits(got[k], want[k]) for k in want), f"pass {p} holds wrong data"
        assert ds.meta("target", rank, p)["complete"] is True
    for p in ds.passes("target", rank):
        if p in interrupted:  # an interrupted pass is flagged, and what it holds is right
            got = {k: v for k, v in ds.load("target", rank, p, check=True).items() if ".input." not in k}
            want = expected(ref, interrupted[p])
            assert set(got) <= set(want) and all(same_bits(got[k], want[k]) for k in got), p
            # Flagged, unless the Ctrl-C came after the pass had ended whole.
            assert ds.meta("target", rank, p)["complete"] is False or set(got) == set(want), p
        else:
            assert p in clean, f"pass {p} is neither a clean nor an interrupted forward's"
    assert verify_cli(tmp_path).returncode == 0
