"""Capture-side integrity (issue 9): nothing fastdump accepts may be lost, mixed or changed silently,
and nothing it does may raise into, stall or change the model it watches."""

import dataclasses
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import fastdump
from fastdump import _C
from fastdump.cli import dump as cli_dump
from fastdump.writer.loop import WriterLoop
from conftest import same_bits
from test_writer_loop import ScriptedConsumer, control, tensor

REPO = Path(__file__).resolve().parent.parent


def verify(root):
    return cli_dump.verify_dump(str(root))


class Mlp(nn.Module):
    def __init__(self, dim=8, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.up = nn.Linear(dim, 2 * dim)
        self.act = nn.ReLU()
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


# ------------------------------------------------------------------------------------- item 2: fork

FORK_SCRIPT = textwrap.dedent("""
    import os, sys, json, torch
    import fastdump
    root, child_root = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    d = fastdump.attach(lin, root, writer=sys.argv[3])
    xs = [torch.randn(2, 4) for _ in range(4)]
    outs = [lin(xs[0]).detach()]
    pid = os.fork()
    if pid == 0:                       # the child: serves, attaches its own dumper, exits normally
        lin(torch.randn(2, 4))         # the parent's wrappers are pass-throughs here
        c = fastdump.attach(torch.nn.Linear(4, 4), child_root)
        c.close()
        sys.exit(0)                    # atexit runs close_all(): it must not touch the parent's dump
    _, status = os.waitpid(pid, 0)
    outs += [lin(x).detach() for x in xs[1:]]
    stats = d.close()
    torch.save(outs, os.path.join(root, "outs.pt"))
    print(json.dumps({"child": status, "status": stats["status"], "passes": stats["passes"]}))
""")


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_a_forked_child_exiting_normally_leaves_the_parents_dump_alone(tmp_path, writer):
    root, child_root = tmp_path / "parent", tmp_path / "child"
    proc = subprocess.run([sys.executable, "-c", FORK_SCRIPT, str(root), str(child_root), writer],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"child": 0, "status": "closed", "passes": 4}
    outs = torch.load(root / "outs.pt")
    ds = fastdump.open(root)
    rank = ds.ranks("target")[0]
    assert ds.passes("target", rank) == [0, 1, 2, 3]  # the child's forward was never a parent pass
    for pass_id, want in enumerate(outs):
        assert same_bits(ds.load("target", rank, pass_id)["Linear"], want)
    assert not verify(root).problems
    child = fastdump.open(child_root)  # the child's own dumper worked, in its own engine
    assert child.rank_info("target", child.ranks("target")[0])["status"] == "closed"


# ------------------------------------------------------------------- item 3: too many dimensions


def test_a_tensor_with_33_dimensions_is_skipped_with_a_reason_and_costs_nothing_else(tmp_path):
    ok = torch.arange(6.0).reshape(2, 3)
    big = torch.arange(2.0).reshape([1] * 32 + [2])  # 33 dims: the ring takes it, HDF5 could not
    with fastdump.attach(None, tmp_path) as d:
        for step in range(3):
            d.begin_pass()
            d.dump("before", ok + step)
            d.dump("big", big)
            d.dump("after", ok - step)
            d.end_pass()
        stats = d.stats()
    assert stats["status"] == "running" and stats["skipped"] == 3
    assert d.stats()["status"] == "closed"
    ds = fastdump.open(tmp_path)
    rank = ds.ranks("target")[0]
    assert ds.passes("target", rank) == [0, 1, 2]
    for step in range(3):
        dumped = ds.load("target", rank, step)
        assert list(dumped) == ["before", "after"]
        assert same_bits(dumped["before"], ok + step) and same_bits(dumped["after"], ok - step)
        assert ds.meta("target", rank, step)["skipped"] == [{"name": "big", "reason": "more than 32 dimensions"}]
    assert _C.MAX_DIMS == 32
    assert not verify(tmp_path).problems


def _open_msg(tmp_path):
    return control(1, op="open", channel=0, dir=str(tmp_path / "target" / "TP0_PP0_Rank0_pid1"), role="target",
                   rank={}, pid=1, host="h", device={},
                   config={"segment_passes": 8, "segment_mb": 64, "segment_seconds": 60})


def test_the_writer_turns_a_bad_record_into_a_recorded_skip(tmp_path):
    """A 40-dim record (a producer without the capture-side check) and a tensor the channel raises
    on cost only themselves: the other tensors, the pass and the writer go on; verify fails on the
    second, which was lost."""
    from fastdump.writer import channel_writer

    good = torch.arange(4.0)
    deep = torch.zeros([1] * 39 + [2])
    original = channel_writer.ChannelWriter.on_tensor

    def raising_for_name_2(self, name_id, *args):
        if name_id == 2:
            raise RuntimeError("injected failure")
        return original(self, name_id, *args)

    records = [
        _open_msg(tmp_path),
        control(2, op="name", channel=0, id=0, name="good"),
        control(3, op="name", channel=0, id=1, name="deep"),
        control(4, op="name", channel=0, id=2, name="raises"),
        control(5, op="begin", channel=0, **{"pass": 0, "meta": {}}),
        tensor(0, 0, good), tensor(1, 0, deep), tensor(2, 0, good),
        control(6, op="end", channel=0, **{"pass": 0, "meta": {}, "dropped": 0, "skipped": [], "sent": 3}),
        control(7, op="begin", channel=0, **{"pass": 1, "meta": {}}),
        tensor(0, 1, good + 1),
        control(8, op="end", channel=0, **{"pass": 1, "meta": {}, "dropped": 0, "skipped": [], "sent": 1}),
        control(9, op="shutdown"),
    ]
    consumer = ScriptedConsumer(records)
    channel_writer.ChannelWriter.on_tensor = raising_for_name_2
    try:
        loop = WriterLoop(consumer)
        assert loop.run() == 0
    finally:
        channel_writer.ChannelWriter.on_tensor = original
    assert loop.failed is None and consumer.state[0] == _C.WRITER_EXITED
    ds = fastdump.open(tmp_path)
    rank = "TP0_PP0_Rank0_pid1"
    assert ds.passes("target", rank) == [0, 1]
    assert list(ds.load("target", rank, 0)) == ["good"] and torch.equal(ds.load("target", rank, 0)["good"], good)
    assert torch.equal(ds.load("target", rank, 1)["good"], good + 1)
    skipped = {s["name"]: s["reason"] for s in ds.meta("target", rank, 0)["skipped"]}
    assert set(skipped) == {"deep", "raises"}
    assert "bad record" in skipped["deep"] and "injected failure" in skipped["raises"]
    # "raises" was accepted and then lost (the writer's own failure): verify fails on it alone. A
    # record no writer can store ("deep") is a skip, as the capture side's are.
    problems = verify(tmp_path).problems
    assert len(problems) == 1 and "1 staged tensor(s) were lost after they were accepted" in problems[0]


# ---------------------------------------------------------------- item 5: attach over stale wrappers


def test_attach_a_attach_b_close_a_close_b_then_attach_c_dumps(tmp_path):
    model = Mlp()
    x = torch.randn(3, 8)
    a = fastdump.attach(model, tmp_path / "a")
    b = fastdump.attach(model, tmp_path / "b")  # wraps over a's wrappers
    a.close()  # a's wrappers stay (b is over them) and become pass-throughs
    b.close()
    c = fastdump.attach(model, tmp_path / "c")
    with torch.no_grad():
        want = model(x)
    assert c.close()["passes"] == 1
    ds = fastdump.open(tmp_path / "c")
    dumped = ds.load("target", ds.ranks("target")[0], 0)
    assert {"up", "act", "down", "Mlp"} <= set(dumped)
    assert same_bits(dumped["Mlp"], want)


# ---------------------------------------------------------------------------- item 7: negation bit


class ConjImag(nn.Module):
    def forward(self, z):
        return z.conj().imag  # a real tensor carrying torch's lazy negation bit


def test_real_views_with_the_negation_bit_are_dumped_with_their_sign(tmp_path):
    model = nn.Sequential(ConjImag())
    z = torch.tensor([1 + 2j, 3 + 4j])
    with fastdump.attach(model, tmp_path) as d:
        out = model(z)
        assert out.is_neg()
        d.dump("direct", z.conj().imag)
    ds = fastdump.open(tmp_path)
    assert torch.equal(ds.load("target", 0, 0)["0"], torch.tensor([-2.0, -4.0]))
    assert torch.equal(ds.load("target", 0, 0)["Sequential"], torch.tensor([-2.0, -4.0]))
    assert torch.equal(ds.load("target", 0, 1)["direct"], torch.tensor([-2.0, -4.0]))


# ----------------------------------------------------------------------------- item 8: threads


class Meet(nn.Module):
    """Every thread waits here for the others: their forwards surely overlap."""

    def __init__(self, barrier):
        super().__init__()
        self.barrier = barrier

    def forward(self, x):
        self.barrier.wait(timeout=60)
        return x * 2


def test_concurrent_forwards_on_one_dumper_are_reported_and_fail_verify(tmp_path, caplog):
    threads_n = 3
    model = nn.Sequential(nn.Linear(4, 4), Meet(threading.Barrier(threads_n)))
    errors = []

    def serve():
        try:
            for _ in range(4):
                with torch.no_grad():
                    model(torch.randn(1, 4))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    with caplog.at_level(logging.WARNING, logger="fastdump"):
        d = fastdump.attach(model, tmp_path)
        workers = [threading.Thread(target=serve) for _ in range(threads_n)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(120)
        stats = d.close()
    assert not errors
    assert stats["mixed_passes"] >= 1 and stats["incomplete_passes"] >= stats["mixed_passes"]
    said = [r for r in caplog.records if "several threads" in r.getMessage()]
    assert len(said) == 1  # logged once, not per pass
    ds = fastdump.open(tmp_path)
    mixed = [p for p in ds.passes("target", 0) if ds.meta("target", 0, p).get("mixed")]
    assert len(mixed) == stats["mixed_passes"]
    meta = ds.meta("target", 0, mixed[0])
    assert meta["complete"] is False and "several threads" in meta["incomplete"]
    report = verify(tmp_path)
    assert any("mixes tensors" in p for p in report.problems)


def test_forwards_of_several_threads_one_after_another_are_not_flagged(tmp_path):
    model = Mlp()
    with fastdump.attach(model, tmp_path) as d:
        for _ in range(3):
            t = threading.Thread(target=lambda: model(torch.randn(2, 8)))
            t.start()
            t.join()
    assert d.stats()["mixed_passes"] == 0 and d.stats()["incomplete_passes"] == 0
    assert not verify(tmp_path).problems and not verify(tmp_path).warnings


class CallsFromAWorker(nn.Module):
    """Runs its `shared` leaf on a worker thread while the forward's pass is open: what a module
    shared with another model (served from another thread) or a thread-pool branch does."""

    def __init__(self, shared):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.shared = shared

    def forward(self, x):
        x = self.first(x)
        worker = threading.Thread(target=lambda: self.shared(torch.ones(1, 4)))
        worker.start()
        worker.join()
        return self.shared(x)


@pytest.mark.parametrize("wrappers", ["native", "python"])
def test_a_leaf_called_from_another_thread_during_the_pass_marks_it_mixed(tmp_path, wrappers):
    """Only the root's forwards used to be checked for threads: a leaf called from another thread
    joined the open pass as `shared#0` silently (two forwards' values mixed, verify OK)."""
    model = CallsFromAWorker(nn.Linear(4, 4))
    x = torch.randn(1, 4)
    d = fastdump.attach(model, tmp_path)
    try:
        if wrappers == "python":
            d._use_python_wrappers()  # as under torch.compile
        with torch.no_grad():
            got = model(x)
    finally:
        stats = d.close()
    with torch.no_grad():
        assert torch.equal(got, model.shared(model.first(x)))  # served unchanged
    assert stats["mixed_passes"] == 1
    ds = fastdump.open(tmp_path)
    meta = ds.meta("target", 0, 0)
    assert meta["mixed"] is True and "several threads" in meta["incomplete"]
    dumped = ds.load("target", 0, 0)
    assert torch.equal(dumped["shared"], model.shared(torch.ones(1, 4)).detach())  # the worker's call came first
    assert any("mixes tensors" in p for p in verify(tmp_path).problems)


@pytest.mark.parametrize("opened_by", ["begin_pass", "root forward"])
def test_a_pass_ended_between_another_threads_mixed_mark_and_its_reason_is_stored_mixed(tmp_path, monkeypatch,
                                                                                        opened_by):
    """A second thread marks the open pass mixed (``_mixed``) before it calls _mark_mixed, which sets
    the reason: a thread switch there (any call is a point where another thread may run) lets the
    opener end the pass with ``_mixed`` set and no reason yet. _end gives it the mixed reason, and
    the C root pass's end leaves such a pass to it: the writer stores a pass as mixed only with a
    reason, so without them the pass read as whole (mutants that dropped either survived)."""
    from fastdump.capture import passes as passes_mod

    entered, ended = threading.Event(), threading.Event()
    real_mark_mixed = passes_mod.PassesMixin._mark_mixed

    def mark_mixed_after_a_switch(self):
        entered.set()
        ended.wait(30)  # the opener ends the pass here
        real_mark_mixed(self)

    monkeypatch.setattr(passes_mod.PassesMixin, "_mark_mixed", mark_mixed_after_a_switch)

    class Root(nn.Module):  # its forward returns once a worker's call of its leaf is held there
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            self.lin(x)
            self.worker = threading.Thread(target=lambda: self.lin(x))
            self.worker.start()
            assert entered.wait(30)
            return x * 2

    model = Root()
    x = torch.randn(1, 4)
    d = fastdump.attach(model, tmp_path, root_passes=opened_by == "root forward")
    try:
        with torch.no_grad():
            if opened_by == "begin_pass":
                d.begin_pass()
                model(x)
                d.end_pass()
            else:
                model(x)  # (a plain pass: the C root pass's, begin and end)
            ended.set()
            model.worker.join(30)
    finally:
        ended.set()
        stats = d.close()
    assert stats["mixed_passes"] == 1 and stats["incomplete_passes"] == 1, stats
    ds = fastdump.open(tmp_path)
    meta = ds.meta("target", 0, 0)
    assert meta["complete"] is False and meta["mixed"] is True and "several threads" in meta["incomplete"], meta
    assert any("mixes tensors" in p for p in verify(tmp_path).problems)


# ------------------------------------------------------------- item 9: failed and dangling passes


class Fails(nn.Module):
    def __init__(self):
        super().__init__()
        self.fail = False

    def forward(self, x):
        if self.fail:
            raise ValueError("bad batch")
        return x + 1


def test_a_pass_whose_forward_raised_is_recorded_incomplete_with_the_reason(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), Fails())
    with fastdump.attach(model, tmp_path) as d:
        model(torch.randn(1, 4))
        model[1].fail = True
        with pytest.raises(ValueError, match="bad batch"):
            model(torch.randn(1, 4))
        model[1].fail = False
        model(torch.randn(1, 4))
    assert d.stats()["incomplete_passes"] == 1
    ds = fastdump.open(tmp_path)
    assert ds.passes("target", 0) == [0, 1, 2]
    assert ds.meta("target", 0, 0)["complete"] is True and "incomplete" not in ds.meta("target", 0, 0)
    failed = ds.meta("target", 0, 1)
    assert failed["complete"] is False and "ValueError: bad batch" in failed["incomplete"]
    assert list(ds.load("target", 0, 1)) == ["0"]  # what ran before the failure is kept
    assert ds.meta("target", 0, 2)["complete"] is True
    report = verify(tmp_path)
    assert not report.problems and any("pass 1 is incomplete" in w for w in report.warnings)
    assert ds.summary("target", 0)["incomplete_passes"] == [1]


def test_a_dangling_manual_pass_is_closed_at_the_next_root_forward(tmp_path, caplog):
    model = Mlp()
    d = fastdump.attach(model, tmp_path)

    def start_step():
        d.begin_pass(step="forgotten")  # returns without end_pass()

    with caplog.at_level(logging.WARNING, logger="fastdump"):
        start_step()
        d.dump("extra", torch.ones(2))
        outs = [model(torch.randn(2, 8)) for _ in range(3)]
    d.close()
    ds = fastdump.open(tmp_path)
    assert ds.passes("target", 0) == [0, 1, 2, 3]  # not one pass swallowing every forward
    first = ds.meta("target", 0, 0)
    assert first["complete"] is False and "dangling manual pass" in first["incomplete"]
    assert list(ds.load("target", 0, 0)) == ["extra"]
    for pass_id, out in enumerate(outs, start=1):
        assert ds.meta("target", 0, pass_id)["complete"] is True
        assert same_bits(ds.load("target", 0, pass_id)["Mlp"], out)
    assert any("begin_pass" in r.getMessage() for r in caplog.records)


def test_begin_pass_in_a_loop_without_end_pass_closes_the_previous_one(tmp_path):
    model = Mlp()
    with fastdump.attach(model, tmp_path) as d:
        for _ in range(3):
            d.begin_pass()  # end_pass() forgotten: the same call runs again
            model(torch.randn(2, 8))
    ds = fastdump.open(tmp_path)
    assert ds.passes("target", 0) == [0, 1, 2]
    assert [ds.meta("target", 0, p)["complete"] for p in (0, 1, 2)] == [False, False, False]
    assert "ran again" in ds.meta("target", 0, 0)["incomplete"]
    assert "close()" in ds.meta("target", 0, 2)["incomplete"]  # still open at close
    assert all(list(ds.load("target", 0, p)) == ["up", "act", "down", "Mlp"] for p in (0, 1, 2))


def test_a_delimited_manual_pass_still_spans_several_forwards(tmp_path):
    model = Mlp()
    with fastdump.attach(model, tmp_path) as d:
        d.begin_pass()
        model(torch.randn(2, 8))
        model(torch.randn(2, 8))
        d.end_pass()
    ds = fastdump.open(tmp_path)
    assert ds.passes("target", 0) == [0]
    assert ds.meta("target", 0, 0)["complete"] is True
    assert "Mlp#1" in ds.load("target", 0, 0)


# ----------------------------------------------------------------------------- item 13: compile


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_compiled_model_serves_unchanged_and_dumps_its_real_values(tmp_path, backend):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = Mlp(seed=3)
    xs = [torch.randn(4, 8) for _ in range(3)]
    with torch.no_grad():
        plain = [model(x) for x in xs]
    d = fastdump.attach(model, tmp_path)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        outs = [compiled(x) for x in xs]
    stats = d.close()
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert graphs >= 3  # compiled for real: the leaves' graphs between the staging breaks
    assert stats["status"] == "closed" and stats["passes"] == 3 and stats["skipped"] == 0
    ds = fastdump.open(tmp_path)
    assert ds.passes("target", 0) == [0, 1, 2]
    for pass_id, (x, out) in enumerate(zip(xs, outs)):
        dumped = ds.load("target", 0, pass_id)
        assert list(dumped) == ["up", "act", "down", "Mlp"]
        assert same_bits(dumped["Mlp"], out)  # what the compiled model returned
        assert same_bits(dumped["down"], out)
        # Each leaf's dump is what that leaf really produced: the next leaf's input.
        assert same_bits(dumped["act"], torch.relu(dumped["up"]))
        if backend == "eager":
            assert same_bits(out, plain[pass_id])
            with torch.no_grad():
                assert same_bits(dumped["up"], model.up(x))


class _Scaled(nn.Module):
    """A submodule whose forward torch.compile must not trace (torch.compiler.disable)."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(8, 8)

    @torch.compiler.disable
    def forward(self, x):
        return self.inner(x) * 2


class _Disabled(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.up, self.mid, self.norm = nn.Linear(8, 8), _Scaled(), nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.mid(torch.tanh(self.up(x))))


def _disabled_leaves(model, x):
    up = model.up(x)
    inner = model.mid.inner(torch.tanh(up))
    out = model.norm(inner * 2)
    return {"up": up, "mid.inner": inner, "norm": out, "_Disabled": out}  # (leaves and the root)


@pytest.mark.parametrize("order", ["compile_then_attach", "attach_then_compile"])
def test_an_in_place_compiled_model_with_a_disabled_region_dumps_each_attach_and_its_gradients_are_unchanged(
        tmp_path, order):
    """nn.Module.compile() (in place: no OptimizedModule, no _orig_mod), aot_eager (functionalized
    graphs), a torch.compiler.disable'd submodule, grad mode with a backward after each forward, and
    a second Dumper on the same compiled model after the first closed (compiled code made with the
    first one's wrappers must not serve the second's attach): every pass bit for bit the eager
    model's, the gradients too, nothing left on the modules after each close."""
    torch._dynamo.reset()
    model, ref = _Disabled(), _Disabled()
    xs = [torch.randn(3, 8) for _ in range(5)]
    if order == "compile_then_attach":
        model.compile(backend="aot_eager")
        first = fastdump.attach(model, tmp_path / "1")
    else:
        first = fastdump.attach(model, tmp_path / "1")
        model.compile(backend="aot_eager")
    outs = []
    for i, x in enumerate(xs):
        if i == 2:
            first.close()
            assert not [n for n, m in model.named_modules() if "forward" in m.__dict__]
        if i == 3:
            second = fastdump.attach(model, tmp_path / "2")
        out = model(x)
        outs.append(out.detach())
        out.square().sum().backward()
        ref(x).square().sum().backward()
    second.close()
    assert not [n for n, m in model.named_modules() if "forward" in m.__dict__]
    torch._dynamo.reset()
    assert all(same_bits(a.grad, b.grad) for a, b in zip(model.parameters(), ref.parameters()))
    for where, ids in (("1", (0, 1)), ("2", (3, 4))):
        ds = fastdump.open(tmp_path / where)
        assert ds.passes("target", 0) == [0, 1], where
        for pass_id, i in enumerate(ids):
            got = ds.load("target", 0, pass_id)
            with torch.no_grad():
                want = _disabled_leaves(ref, xs[i])
            assert sorted(got) == sorted(want), (where, pass_id)
            assert all(same_bits(got[k], want[k]) for k in want), (where, pass_id)
            assert same_bits(got["_Disabled"], outs[i]) and not got["_Disabled"].requires_grad
        assert not verify(tmp_path / where).problems
    assert same_bits(outs[2], _disabled_leaves(ref, xs[2])["_Disabled"].detach())  # undumped, as computed


# -------------------------------------------------------------------------- item 14: odd outputs


@dataclasses.dataclass
class Pair:
    hidden: torch.Tensor
    scores: torch.Tensor
    label: str = "x"


class Odd(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, x):
        if self.kind == "nested_strided":
            return torch.nested.nested_tensor([x[0], x[1, :2]], layout=torch.strided)
        if self.kind == "nested_jagged":
            return torch.nested.nested_tensor([x[0], x[1, :2]], layout=torch.jagged)
        if self.kind == "deep":
            value = x + 1
            for _ in range(1500):
                value = [value]
            return value
        if self.kind == "cycle":
            value = [x + 2]
            value.append(value)
            return value
        if self.kind == "dataclass":
            return Pair(x + 3, x * 2)
        if self.kind == "object":
            return object()
        raise AssertionError(self.kind)


class OddModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.kinds = ["nested_strided", "nested_jagged", "deep", "cycle", "dataclass", "object"]
        self.odd = nn.ModuleList(Odd(k) for k in self.kinds)

    def forward(self, x):
        return [m(x) for m in self.odd]


def test_odd_outputs_never_raise_into_the_model_and_are_skipped_with_a_reason(tmp_path):
    model = OddModel()
    x = torch.arange(6.0).reshape(2, 3)
    with fastdump.attach(model, tmp_path, root_name="model"):
        outs = model(x)
    assert isinstance(outs[4], Pair)  # served unchanged
    ds = fastdump.open(tmp_path)
    dumped = ds.load("target", 0, 0)
    assert same_bits(dumped["odd.4.hidden"], x + 3) and same_bits(dumped["odd.4.scores"], x * 2)
    assert same_bits(dumped["odd.3.0"], x + 2)
    assert "odd.2" + ".0" * 31 not in dumped  # the deep one is skipped, not recursed into
    skipped = {s["name"]: s["reason"] for s in ds.meta("target", 0, 0)["skipped"]}
    assert "nested tensor" in skipped["odd.0"]
    assert "not strided" in skipped["odd.1"]
    assert "self-referencing" in skipped["odd.3.1"]
    assert any(name.startswith("odd.2.") and "deep" in reason for name, reason in skipped.items())
    assert "holds no tensor" in skipped["odd.5"]
    assert not verify(tmp_path).problems


FREED_STORAGE_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    import fastdump
    from fastdump import _C

    class Freed(torch.nn.Module):  # returns a tensor whose storage it then frees or shrinks (as FSDP does)
        def __init__(self, nbytes):
            super().__init__()
            self.nbytes = nbytes
        def forward(self, x):
            out = x * 2
            out.untyped_storage().resize_(self.nbytes)
            return out

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.before, self.freed, self.after = torch.nn.Identity(), Freed(0), torch.nn.Identity()
            self.shrunk = Freed(8)  # 2 of its 6 floats
        def forward(self, x):
            return self.before(x + 1), self.freed(x), self.shrunk(x), self.after(x - 1)

    model, x = Model(), torch.arange(6.0).reshape(2, 3)
    with fastdump.attach(model, sys.argv[1], root_name="m") as d:
        for _ in range(2):  # the first pass takes the general path (new names), the second the fast one
            model(x)
        d.begin_pass()
        d.dump("manual", model.freed(x))
        d.end_pass()
    print(json.dumps({"reader": _C.tensor_reader(), "no_data": _C.NO_DATA}))
""")


LYING_SUBCLASS_SCRIPT = textwrap.dedent("""
    import json, sys, torch, fastdump
    from torch.overrides import TorchFunctionMode

    class Liar(torch.Tensor):  # Python attributes that say another address and a larger shape
        def data_ptr(self):
            return 8
        @property
        def shape(self):
            return torch.Size([1 << 30])
        def stride(self, *dim):
            return (1 << 20,)

    class LyingMode(TorchFunctionMode):  # a mode answering data_ptr for every tensor
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.Tensor.data_ptr:
                return 16
            return func(*args, **(kwargs or {}))

    d = fastdump.attach(None, sys.argv[1])
    for p in range(2):  # pass 0 names each tensor (the general path), pass 1 is the hot path
        d.begin_pass()
        d.dump("liar", (torch.arange(6.0) + p).as_subclass(Liar))
        with LyingMode():
            d.dump("moded", torch.arange(4.0) - p)
        d.end_pass()
    print(json.dumps({"status": d.close()["status"]}))
""")


def run_with_reader(script: str, root, reader: str) -> dict:
    """Runs ``script`` (a model dumping into ``root``) in a fresh process with the tensor reader
    ("torch") or without it ("attributes"): the JSON of its last line. A fault in the copy would
    end that process, not the test's."""
    if reader == "torch":
        pytest.importorskip("fastdump._torch_reader", reason="the tensor reader is not built here")
    env = dict(os.environ, FASTDUMP_TORCH_READER="1" if reader == "torch" else "0")
    run = subprocess.run([sys.executable, "-c", script, str(root)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("reader", ["torch", "attributes"])
def test_a_subclass_or_mode_lying_about_its_layout_never_makes_the_copy_read_elsewhere(tmp_path, reader):
    """A tensor subclass (or a torch function mode) may answer data_ptr(), shape and stride()
    with anything. The copy reads exactly the range those facts give, so believing them read
    another address (the served process died with SIGSEGV without the tensor reader). Both ways
    read what the TensorImpl holds for a subclass, whose real values are dumped. A mode answers
    for plain tensors too: the tensor reader does not ask it; the attribute reads do, and then
    find the address outside the tensor's storage and record the tensor as skipped."""
    assert run_with_reader(LYING_SUBCLASS_SCRIPT, tmp_path, reader)["status"] == "closed"
    ds = fastdump.open(tmp_path)
    for p in range(2):
        got = ds.load("target", 0, p)
        assert same_bits(got["liar"], torch.arange(6.0) + p), p
        if reader == "torch":
            assert same_bits(got["moded"], torch.arange(4.0) - p), p
        else:
            skipped = {s["name"]: s["reason"] for s in ds.meta("target", 0, p)["skipped"]}
            assert "moded" not in got and "ends before its last element" in skipped["moded"], (p, skipped)


@pytest.mark.parametrize("reader", ["torch", "attributes"])
def test_a_tensor_whose_storage_was_freed_is_skipped_not_read(tmp_path, reader):
    """torch lets a storage be freed or shrunk under its tensors (``untyped_storage().resize_(0)``):
    the data pointer is then null (reading it faults: torch's own ``clone`` does) or points at a
    smaller allocation. The model must be served, the tensor recorded as skipped, the rest dumped."""
    info = run_with_reader(FREED_STORAGE_SCRIPT, tmp_path, reader)
    assert info["reader"] == (str(torch.__version__) if reader == "torch" else None)
    ds = fastdump.open(tmp_path)
    x = torch.arange(6.0).reshape(2, 3)
    short = "ends before its last element"  # the tensor reader's words: it also sees a shrunk storage
    for p in (0, 1):  # pass 0 names each tensor first (the general path), pass 1 is the hot path alone
        dumped = ds.load("target", 0, p)
        skipped = {s["name"]: s["reason"] for s in ds.meta("target", 0, p)["skipped"]}
        # Each output on its own: the root's tuple loses only its unreadable elements.
        for name, want in (("before", x + 1), ("after", x - 1), ("m.0", x + 1), ("m.3", x - 1)):
            assert same_bits(dumped[name], want), (p, name, skipped)
        assert "freed" not in dumped and "m.1" not in dumped
        for name in ("freed", "m.1"):
            assert info["no_data"] in skipped[name] or short in skipped[name], (p, skipped)
        # Both ways check the tensor's extent against its storage's size (the attribute reads ask
        # untyped_storage()): a storage shrunk under a view is not read past its end.
        assert "shrunk" not in dumped and "m.2" not in dumped, p
        assert short in skipped["shrunk"] and short in skipped["m.2"], (p, skipped)
        assert list(dumped) == ["before", "after", "m.0", "m.3"], (p, skipped)
    manual = {s["name"]: s["reason"] for s in ds.meta("target", 0, 2)["skipped"]}
    assert list(manual) == ["freed", "manual"] and "not read" in manual["manual"], manual
    assert not verify(tmp_path).problems



FREED_LAZY_VIEW_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    import fastdump

    class FreedView(torch.nn.Module):  # a lazy conj/neg view of a storage it then frees or shrinks
        def __init__(self, view, nbytes):
            super().__init__()
            self.view, self.nbytes = view, nbytes
        def forward(self, x):
            z = torch.complex(x * 0 + torch.arange(2e5), x * 0 + 1.0)
            out = self.view(z)
            z.untyped_storage().resize_(self.nbytes)
            return out

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            conj, neg = (lambda z: z.conj()), (lambda z: z.conj().imag)
            self.conj_freed, self.neg_freed = FreedView(conj, 0), FreedView(neg, 0)
            self.conj_shrunk, self.neg_shrunk = FreedView(conj, 16), FreedView(neg, 16)
            self.after = torch.nn.Identity()
        def forward(self, x):
            outs = [m(x) for m in (self.conj_freed, self.neg_freed, self.conj_shrunk, self.neg_shrunk)]
            return self.after(x - 1)

    model, x = Model(), torch.zeros(1)
    with fastdump.attach(model, sys.argv[1], root_name="m") as d:
        served = [model(x).tolist() for _ in range(2)]
    print(json.dumps({"served": served}))
""")


def test_a_lazy_conj_or_neg_view_of_a_freed_storage_is_skipped_not_resolved(tmp_path):
    """A conj or neg view is resolved into a copy before the staging path's storage check, by
    torch's own copy, which reads whatever the view addresses: of a storage freed under it
    (``resize_(0)``, as FSDP does) the served process died with SIGSEGV; of one shrunk under it
    the copy read past the allocation and was dumped. Now the storage is checked first: a
    recorded skip, the model served, the rest dumped."""
    info = run_with_reader(FREED_LAZY_VIEW_SCRIPT, tmp_path, "attributes")
    assert info["served"] == [[-1.0], [-1.0]]
    ds = fastdump.open(tmp_path)
    for p in (0, 1):
        dumped = ds.load("target", 0, p)
        skipped = {s["name"]: s["reason"] for s in ds.meta("target", 0, p)["skipped"]}
        assert sorted(dumped) == ["after", "m"], (p, skipped)
        assert same_bits(dumped["after"], torch.tensor([-1.0])), p
        assert set(skipped) == {"conj_freed", "neg_freed", "conj_shrunk", "neg_shrunk"}, p
        assert all("ends before its last element" in reason for reason in skipped.values()), skipped
    assert not verify(tmp_path).problems


ONE_ELEMENT_SHORT_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    import fastdump

    class Cut(torch.nn.Module):  # a view whose storage is then cut to ``keep`` bytes
        def __init__(self, view, keep):
            super().__init__()
            self.view, self.keep = view, keep
        def forward(self, x):
            z = torch.complex(x * 0 + torch.arange(1000.0), x * 0 - torch.arange(1000.0))
            out = self.view(z)
            z.untyped_storage().resize_(self.keep)
            return out

    plain, conj, neg = (lambda z: torch.view_as_real(z)[:, 0]), (lambda z: z.conj()), (lambda z: z.conj().imag)
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            # plain: float32 elements 0, 2, ..., 1998 of the storage's floats; conj: 1000 complex64;
            # neg: float32 elements 1, 3, ..., 1999. "_short": one element's bytes less than the
            # last element needs; "_whole": exactly what it needs.
            self.plain_short, self.plain_whole = Cut(plain, 1998 * 4), Cut(plain, 1999 * 4)
            self.conj_short, self.conj_whole = Cut(conj, 999 * 8), Cut(conj, 1000 * 8)
            self.neg_short, self.neg_whole = Cut(neg, 1999 * 4), Cut(neg, 2000 * 4)
        def forward(self, x):
            return [m(x) for m in (self.plain_short, self.plain_whole, self.conj_short, self.conj_whole,
                                   self.neg_short, self.neg_whole)]

    model, x = Model(), torch.zeros(1)
    with fastdump.attach(model, sys.argv[1], root_name="m", include="_short|_whole") as d:
        model(x)
    print(json.dumps({"ok": True}))
""")


@pytest.mark.parametrize("reader", ["torch", "attributes"])
def test_a_view_whose_storage_is_one_element_short_is_skipped_and_one_that_fits_is_dumped(tmp_path, reader):
    """The storage checks (the tensor reader's, C++ within_storage, and _check_storage before a lazy
    conj/neg view is resolved) are exact to the element: a storage one element shorter than the
    view's last element is a recorded skip, never a copy read past its end and dumped; one that
    holds the last element exactly is dumped bit-exact (with the conj/neg bits applied)."""
    run_with_reader(ONE_ELEMENT_SHORT_SCRIPT, tmp_path, reader)
    ds = fastdump.open(tmp_path)
    dumped = ds.load("target", 0, 0)
    skipped = {s["name"]: s["reason"] for s in ds.meta("target", 0, 0)["skipped"]}
    assert set(skipped) == {"plain_short", "conj_short", "neg_short"}, skipped
    assert all("ends before its last element" in reason for reason in skipped.values()), skipped
    assert sorted(dumped) == ["conj_whole", "neg_whole", "plain_whole"], sorted(dumped)
    re, im = torch.arange(1000.0), 0.0 - torch.arange(1000.0)  # (as the script makes them: +0.0 first)
    assert same_bits(dumped["plain_whole"], re)
    assert same_bits(dumped["conj_whole"], torch.complex(re, -im))
    assert same_bits(dumped["neg_whole"], -im)


DTENSOR_SCRIPT = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist, fastdump
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    dist.init_process_group("gloo", store=dist.FileStore(sys.argv[2], 1), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))

    class Sharded(torch.nn.Module):
        def forward(self, x):
            return distribute_tensor(x * 2, mesh, [Shard(0)]), distribute_tensor(x - 1, mesh, [Replicate()])

    model = torch.nn.Sequential(Sharded())
    d = fastdump.attach(model, sys.argv[1])
    with torch.no_grad():
        outs = [model(torch.arange(6.0).reshape(2, 3) + k) for k in range(2)]
    d.close()
    dist.destroy_process_group()
    print(json.dumps([[o.to_local().tolist() for o in out] for out in outs]))
""")


def test_a_dtensor_output_is_dumped_as_this_ranks_local_shard(tmp_path):
    """A DTensor (torch.distributed's tensor-parallel tensors) is a wrapper without storage of its
    own: its data pointer is null. It was skipped with a reason that spoke of a freed storage; its
    local shard is what this rank computed, and what a plain TP model's rank would hold."""
    pytest.importorskip("torch.distributed.tensor", reason="this torch has no torch.distributed.tensor")
    run = subprocess.run([sys.executable, "-c", DTENSOR_SCRIPT, str(tmp_path / "dump"), str(tmp_path / "store")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    served = json.loads(run.stdout.strip().splitlines()[-1])
    ds = fastdump.open(tmp_path / "dump")
    for p, (shard, replica) in enumerate(served):
        dumped = ds.load("target", 0, p)
        assert ds.meta("target", 0, p)["skipped"] == []
        assert same_bits(dumped["0.0"], torch.tensor(shard)) and same_bits(dumped["0.1"], torch.tensor(replica))
        assert same_bits(dumped["Sequential.0"], torch.tensor(shard))
    assert not verify(tmp_path / "dump").problems


FUNCOL_SCRIPT = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist, fastdump
    import torch.distributed._functional_collectives as funcol
    dist.init_process_group("gloo", store=dist.FileStore(sys.argv[2], 1), rank=0, world_size=1)

    class Reduced(torch.nn.Module):  # tensor parallelism's row-parallel output, the functional way
        def forward(self, x):
            return funcol.all_reduce(x * 2, "sum", dist.group.WORLD)

    class Parts(torch.nn.Module):  # a view of one, and one inside a tuple
        def forward(self, x):
            return funcol.all_reduce(x - 1, "sum", dist.group.WORLD)[1:], (funcol.all_reduce(x + 7, "sum", dist.group.WORLD),)

    model = torch.nn.Sequential(Reduced(), Parts())
    d = fastdump.attach(model, sys.argv[1], inputs=True)
    with torch.no_grad():
        outs = [model(torch.arange(6.0).reshape(2, 3) + k) for k in range(2)]
    d.close()
    dist.destroy_process_group()
    print(json.dumps([[type(o[0]).__name__, type(o[1][0]).__name__] for o in outs]))
""")


def test_a_functional_collectives_result_is_dumped_as_the_value_the_next_module_receives(tmp_path):
    """Functional collectives (torch-native tensor parallelism, a DTensor's to_local() after a
    redistribute) return an AsyncCollectiveTensor: a wrapper without storage whose values are the
    collective's output once waited for, as its first use does. Every such output was skipped as
    a tensor "without storage of its own"."""
    pytest.importorskip("torch.distributed._functional_collectives", reason="this torch has no functional collectives")
    run = subprocess.run([sys.executable, "-c", FUNCOL_SCRIPT, str(tmp_path / "dump"), str(tmp_path / "store")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == [["AsyncCollectiveTensor"] * 2] * 2  # served as they are
    ds = fastdump.open(tmp_path / "dump")
    for p in range(2):
        x = torch.arange(6.0).reshape(2, 3) + p
        dumped = ds.load("target", 0, p)
        assert ds.meta("target", 0, p)["skipped"] == [], p
        y = x * 2
        assert same_bits(dumped["0"], y) and same_bits(dumped["1.input.0"], y)  # what the next one got
        assert same_bits(dumped["1.0"], (y - 1)[1:]) and same_bits(dumped["1.1.0"], y + 7)
        assert same_bits(dumped["Sequential.0"], (y - 1)[1:]) and same_bits(dumped["Sequential.1.0"], y + 7)
    assert not verify(tmp_path / "dump").problems


# ------------------------------------------------------------------------- item 20: bad settings


@pytest.mark.parametrize("options", [
    {"ring_mb": float("nan")}, {"ring_mb": float("inf")}, {"ring_mb": "64"},
    {"segment_mb": float("nan")}, {"segment_seconds": float("inf")}, {"segment_passes": 2.5},
    {"every": 1.5}, {"every": True}, {"skip_passes": -1}, {"skip_passes": 0.5},
    {"device_ring_mb": -5}, {"device_ring_mb": float("nan")},
    {"max_bytes": float("nan")}, {"max_bytes": -1}, {"pass_range": (0.5, 3)}, {"pass_range": (0, "9")},
    {"layers": [1.5]}, {"tp_rank": True}, {"tp_size": 0}, {"pp_rank": 0.0}, {"dp_rank": -1},
    {"tp_size": 65537}, {"dp_size": 10**9, "dp_rank": 0},  # beyond what diff and export read back
])
def test_bad_numeric_settings_raise_at_attach(tmp_path, options):
    with pytest.raises(ValueError):
        fastdump.attach(Mlp(), tmp_path, **options)
    assert not any(tmp_path.iterdir())  # nothing started, nothing written


@pytest.mark.parametrize("root", ["", "  ", None, 5])
def test_a_missing_root_raises_at_attach(root, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="root"):
        fastdump.attach(Mlp(), root)
    assert not any(tmp_path.iterdir())


KILLED_PARENT_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time, torch
    import fastdump
    lin = torch.nn.Linear(4, 4)
    d = fastdump.attach(lin, sys.argv[1])
    lin(torch.randn(2, 4))
    child = os.fork()
    if child == 0:
        time.sleep(120)                # a long-lived child (a worker): it holds no pipe of the writer
        os._exit(0)
    print(child, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_the_writer_notices_a_killed_parent_while_its_forked_child_lives(tmp_path):
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-c", KILLED_PARENT_SCRIPT, str(tmp_path)], stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    child = int(proc.stdout.readline())
    proc.wait(60)
    try:
        deadline, status = time.monotonic() + 60, None
        while time.monotonic() < deadline and status != "incomplete":
            time.sleep(0.2)
            infos = list(tmp_path.glob("target/*/rank.json"))
            status = json.loads(infos[0].read_text()).get("status") if infos else None
        assert status == "incomplete"  # the writer saw EOF although the child still runs
        os.kill(child, 0)  # (it does)
    finally:
        os.kill(child, signal.SIGKILL)
    ds = fastdump.open(tmp_path)
    assert ds.passes("target", ds.ranks("target")[0]) == [0]


def test_two_threads_announcing_new_names_never_share_a_name_id(tmp_path):
    """A name announced by two threads at once must not leave two names under one id: that would
    mislabel every later pass, mixed or not."""
    import time

    d = fastdump.attach(None, tmp_path)
    control_msg = d._engine.control

    def slow_names(msg, *args, **kwargs):
        if msg.get("op") == "name":
            time.sleep(0.2)  # both threads are inside the announcement at once
        return control_msg(msg, *args, **kwargs)

    d._engine.control = slow_names
    d.begin_pass()
    threads = [threading.Thread(target=d.dump, args=(name, torch.full((2,), float(i))))
               for i, name in enumerate(("a", "b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    d.end_pass()
    d.begin_pass()  # one thread: this pass must read back exactly as dumped
    d.dump("a", torch.full((2,), 10.0))
    d.dump("b", torch.full((2,), 11.0))
    d.end_pass()
    d.close()
    ds = fastdump.open(tmp_path)
    later = ds.load("target", 0, 1)
    assert list(later) == ["a", "b"]
    assert torch.equal(later["a"], torch.full((2,), 10.0)) and torch.equal(later["b"], torch.full((2,), 11.0))
    assert ds.meta("target", 0, 0).get("mixed") is True  # the concurrent pass itself is reported


def test_odd_pass_metadata_never_raises_into_the_model(tmp_path):
    class BadStr:
        def __str__(self):
            raise RuntimeError("no str")

    loop = [1]
    loop += [loop, loop]  # inside itself, twice: naive recursion would never end
    deep = []
    for _ in range(1500):
        deep = [deep]
    model = Mlp()
    with fastdump.attach(model, tmp_path) as d:
        d.set_pass_meta(loop=loop, deep=deep, step=1)
        out = model(torch.randn(2, 8))
        d.set_pass_meta(bad=BadStr())
        model(torch.randn(2, 8))
    ds = fastdump.open(tmp_path)
    meta = ds.meta("target", 0, 0)
    assert meta["step"] == 1 and meta["loop"][0] == 1 and "refers to itself" in meta["loop"][1]
    assert same_bits(ds.load("target", 0, 0)["Mlp"], out)
    assert "no str" in ds.meta("target", 0, 1)["fastdump_meta_error"]


def test_pass_metadata_of_every_kind_is_kept_as_json(tmp_path):
    """Complex values (tensors, Python, numpy) are [real, imag] pairs; enum members their name;
    any other object its str(), whole (a Path or a config with a ``name`` field was recorded as
    that name alone). Before, a complex tensor raised TypeError out of the model's forward at the
    pass's end and the pass was lost with verify saying OK."""
    import enum
    import pathlib

    import numpy as np

    class Mode(enum.Enum):
        DECODE = 1

    @dataclasses.dataclass
    class Config:
        name: str
        layers: int

    path = pathlib.Path("/models/llama-8b/step_1000/model.safetensors")
    model = Mlp()
    with fastdump.attach(model, tmp_path) as d:
        d.set_pass_meta(z=torch.tensor([1 + 2j, -0.5j]), c=3 - 4j, npz=np.array([1j]), npf=np.float32(0.5),
                        mode=Mode.DECODE, path=path, config=Config("llama", 32))
        out = model(torch.randn(2, 8))
        d.begin_pass(z=torch.tensor(2j))  # a manual pass's meta too
        d.dump("x", torch.ones(2))
        d.end_pass()
    ds = fastdump.open(tmp_path)
    meta = ds.meta("target", 0, 0)
    assert meta["z"] == [[1.0, 2.0], [0.0, -0.5]] and meta["c"] == [3.0, -4.0] and meta["npz"] == [[0.0, 1.0]]
    assert meta["npf"] == 0.5 and meta["mode"] == "DECODE"
    assert meta["path"] == str(path) and meta["config"] == str(Config("llama", 32))
    assert meta["complete"] and same_bits(ds.load("target", 0, 0)["Mlp"], out)
    assert ds.meta("target", 0, 1)["z"] == [0.0, 2.0] and ds.meta("target", 0, 1)["complete"]
    assert subprocess.run([sys.executable, "-m", "fastdump", "verify", str(tmp_path)]).returncode == 0


@pytest.mark.parametrize("policy", ["block", "drop"])
def test_pass_metadata_larger_than_the_ring_can_carry_is_recorded_lost_and_the_pass_kept(tmp_path, policy):
    """A pass's metadata travels in its end record, and a record takes at most half the ring.
    Metadata larger than that is replaced by a note saying so, the end still goes, and verify warns.
    Before, under `block` the forward thread spun block_timeout_s on an end no wait could fit, the
    pass was stored incomplete, and (once lost ends were sent again) close() spun until its timeout."""
    import time

    model = Mlp()
    d = fastdump.attach(model, tmp_path, ring_mb=4, policy=policy)
    with torch.no_grad():
        d.set_pass_meta(step=0, big="x" * (3 << 20))  # 3 MiB; the ring's records take at most 2 MiB
        t0 = time.monotonic()
        out0 = model(torch.randn(2, 8))
        assert time.monotonic() - t0 < 1.0
        d.set_pass_meta(step=1)
        out1 = model(torch.randn(2, 8))
    t0 = time.monotonic()
    stats = d.close(timeout=30)
    assert time.monotonic() - t0 < 5.0 and stats["status"] == "closed", stats
    assert stats["lost_pass_ends"] == 0 and stats["late_pass_ends"] == 0, stats
    ds = fastdump.open(tmp_path)
    meta0, meta1 = ds.meta("target", 0, 0), ds.meta("target", 0, 1)
    assert meta0["complete"] and "big" not in meta0 and "step" not in meta0
    assert "more than the ring's record limit" in meta0["fastdump_meta_error"]
    assert meta1["complete"] and meta1["step"] == 1
    assert same_bits(ds.load("target", 0, 0)["Mlp"], out0) and same_bits(ds.load("target", 0, 1)["Mlp"], out1)
    done = subprocess.run([sys.executable, "-m", "fastdump", "verify", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0 and "pass 0: metadata not kept: the end message carrying it took" in done.stdout, \
        done.stdout


def test_a_control_message_no_ring_could_hold_is_refused_at_once(tmp_path):
    """Only an end can be cut to fit; any other message too large for a record is not sent, at once
    (a blocking send used to retry it, spinning, until its timeout)."""
    import time

    from fastdump import protocol

    model = Mlp()
    with fastdump.attach(model, tmp_path, ring_mb=4) as d:
        engine = d._engine
        t0 = time.monotonic()
        msg = protocol.note(d._channel.id, "running", error="e" * (3 << 20))
        assert engine.control(msg, block_timeout=10) == 0
        assert engine.control(msg, wait=True, timeout=10) is False
        assert time.monotonic() - t0 < 2.0
        model(torch.randn(2, 8))
    assert fastdump.open(tmp_path).meta("target", 0, 0)["complete"]


@pytest.mark.parametrize("selection", [dict(every=2), dict(skip_passes=1), dict(pass_range=(1, 3))])
def test_a_dump_outside_any_pass_is_kept_and_moves_no_forward_in_or_out(tmp_path, selection):
    """dump() outside a pass is a pass of its own: always dumped (the caller asked for that value),
    and not counted by every/skip_passes/pass_range, which pick the same forwards as without it.
    Before, it went through the selection: lost silently, and it shifted which forwards were dumped."""
    model = Mlp()
    xs = [torch.randn(2, 8, generator=torch.Generator().manual_seed(k)) for k in range(4)]
    with fastdump.attach(model, tmp_path / "plain", **selection) as d:
        for x in xs:
            model(x)
    plain_forwards = len(fastdump.open(tmp_path / "plain").passes("target", 0))
    with fastdump.attach(model, tmp_path / "mixed", **selection) as d:
        outs = []
        for k, x in enumerate(xs):
            outs.append(model(x))
            d.dump("extra", torch.full((3,), float(k)))
    ds = fastdump.open(tmp_path / "mixed")
    extras = [p for p in ds.passes("target", 0) if "extra" in ds.pass_names("target", 0, p)]
    forwards = [p for p in ds.passes("target", 0) if p not in extras]
    assert [ds.load("target", 0, p)["extra"].tolist() for p in extras] == [[float(k)] * 3 for k in range(4)]
    assert len(forwards) == plain_forwards
    expected = {"every": [0, 2], "skip_passes": [1, 2, 3], "pass_range": [1, 2]}[next(iter(selection))]
    assert forwards == [2 * k for k in expected]  # forward k is pass 2k: each is followed by a dump's pass
    for p, k in zip(forwards, expected):
        assert same_bits(ds.load("target", 0, p)["Mlp"], outs[k])


def test_a_model_that_cannot_be_wrapped_leaves_no_writer_and_no_wrapper(tmp_path):
    """A failure while wrapping the modules: the model keeps its forwards and no writer is left
    running (strict raises, the default records the error and serves on)."""
    import fastdump
    from fastdump.staging.engine import Engine

    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)

        def named_modules(self, *args, **kwargs):
            yield "", self
            yield "a", self.a
            raise RuntimeError("cannot list my modules")

        def forward(self, x):
            return self.b(self.a(x))

    model = Odd()
    x = torch.ones(1, 2)
    with torch.no_grad():
        want = model(x)
    with pytest.raises(RuntimeError, match="cannot list"):
        fastdump.attach(model, tmp_path / "strict", strict=True)
    assert "forward" not in model.a.__dict__ and "forward" not in model.__dict__
    assert Engine._current is None or Engine._current.closed
    d = fastdump.attach(model, tmp_path / "lenient")
    assert d.status == "error" and "cannot wrap" in d.error
    with torch.no_grad():
        assert torch.equal(model(x), want)
    assert "forward" not in model.a.__dict__
    assert Engine._current is None or Engine._current.closed
    assert d.close()["status"] == "error"


class CallsTwice(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(self.lin(x))


@pytest.mark.parametrize("native", [True, False])
def test_a_module_that_calls_itself_numbers_its_calls_as_they_start(tmp_path, monkeypatch, native):
    """Inputs, hooks' values and output of one call share its #k even when the calls nest: the outer
    call starts first (#0) and returns last. Numbered as they returned, the inner and the outer call
    both dumped `Nest.input.0` (two tensors under one name, which the reader then renamed)."""
    monkeypatch.setattr("fastdump.capture.wrappers._native_wrappers", native)

    class Nest(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = nn.Linear(4, 4)

        def forward(self, x, depth):
            h = self.lin(x)
            return (self(h, depth - 1) if depth else h) * 3

    model = Nest()
    d = fastdump.attach(model, tmp_path, inputs=True)
    x = torch.randn(2, 4)
    with torch.no_grad():
        out = model(x, 2)
    d.close()
    dumped = fastdump.open(tmp_path).load("target", 0, 0)
    with torch.no_grad():
        h0 = model.lin(x)
        h1 = model.lin(h0)
        h2 = model.lin(h1)
    assert same_bits(out, h2 * 3 * 3 * 3)
    want = {"Nest": out, "Nest#1": h2 * 3 * 3, "Nest#2": h2 * 3,
            "Nest.input.0": x, "Nest#1.input.0": h0, "Nest#2.input.0": h1,
            "lin": h0, "lin#1": h1, "lin#2": h2, "lin.input.0": x, "lin#1.input.0": h0, "lin#2.input.0": h1}
    assert sorted(dumped) == sorted(want)
    for name, value in want.items():
        assert same_bits(dumped[name], value), name
    assert verify(tmp_path).problems == []


@pytest.mark.parametrize("wrapper", ["native", "python", "watched"])
def test_a_call_during_which_its_pass_ended_is_numbered_in_the_pass_it_returns_in(tmp_path, monkeypatch, wrapper):
    """A module whose forward ends the open pass and begins the next (a step boundary inside a
    call): its output goes to the new pass, numbered there as a call that starts now, not with the
    number it had in the old pass (``Step#1`` in a pass with no ``Step``). The C wrapper (serial),
    the Python wrapper (pass id) and watch()'s hooked wrapper (_exit_call) each check it; mutants
    that kept the old number survived every test."""
    monkeypatch.setattr("fastdump.capture.wrappers._native_wrappers", wrapper == "native")
    holder = {}

    class Step(nn.Module):
        def __init__(self):
            super().__init__()
            self.boundary = False

        def forward(self, x):
            if self.boundary:
                holder["d"].end_pass()
                holder["d"].begin_pass()
            return x * 2

    step = Step()
    model = nn.Sequential(step) if wrapper == "watched" else step
    d = holder["d"] = fastdump.attach(model, tmp_path, root_passes=False, include="^$" if wrapper == "watched" else None)
    if wrapper == "watched":
        d.watch(step, "Step")
    x = torch.randn(2, 4)
    with torch.no_grad():
        d.begin_pass()
        step(x)  # Step in pass 0
        step.boundary = True
        out = step(x + 1)  # Step#1 as it starts in pass 0; returns in pass 1
        step.boundary = False
        d.end_pass()
    d.close()
    ds = fastdump.open(tmp_path)
    assert ds.passes("target", 0) == [0, 1]
    assert list(ds.load("target", 0, 0)) == ["Step"]
    dumped = ds.load("target", 0, 1)
    assert list(dumped) == ["Step"] and same_bits(dumped["Step"], out)
    assert verify(tmp_path).problems == []


def test_verify_fails_a_pass_holding_two_tensors_under_one_name(tmp_path, monkeypatch):
    """A dump() named like a numbered call (`lin#1`) collided with it: the pass held two tensors
    under one name, which is mixed data. dump() now refuses such a name (a recorded skip); with that
    check taken out, as a capture bug would, verify must still say so, and the reader keeps both."""
    from fastdump.capture import Dumper
    monkeypatch.setattr(Dumper, "_given_name_taken", lambda *args: None)
    model = CallsTwice()
    d = fastdump.attach(model, tmp_path)
    x = torch.randn(2, 4)
    marker = torch.full((3,), 7.0)
    with torch.no_grad():
        d.begin_pass()
        model(x)
        d.dump("lin#1", marker)
        d.end_pass()
    d.close()
    problems = verify(tmp_path).problems
    assert len(problems) == 1 and "pass 0: 2 tensors named 'lin#1'" in problems[0], problems
    dumped = fastdump.open(tmp_path).load("target", 0, 0)
    assert same_bits(dumped["lin#1"], model.lin(model.lin(x))) and same_bits(dumped["lin#1#dup1"], marker)
    assert cli_dump.main(["verify", str(tmp_path)]) == 1


class StrRaises(Exception):
    def __str__(self):
        raise RuntimeError("str() refused")


class RaisesUnprintable(nn.Module):
    def forward(self, x):
        raise StrRaises()


def test_a_model_exception_whose_str_raises_reaches_the_caller_as_itself(tmp_path):
    """The pass's record of the exception reads its text, which may raise: the model's exception
    must still reach the caller unchanged and its pass be marked incomplete. Before, the caller got
    fastdump's RuntimeError and the pass, missing its last tensors, was stored complete."""
    model = nn.Sequential(nn.Linear(4, 4), RaisesUnprintable(), nn.Linear(4, 4))
    with fastdump.attach(model, tmp_path):
        with pytest.raises(StrRaises):
            model(torch.randn(1, 4))
    meta = fastdump.open(tmp_path).meta("target", 0, 0)
    assert meta["complete"] is False and "StrRaises" in meta["incomplete"]
    assert any("pass 0 is incomplete" in w for w in verify(tmp_path).warnings)


def test_a_hook_raising_an_unprintable_exception_is_a_recorded_skip(tmp_path):
    model = Mlp()

    def convert(output):
        raise StrRaises()

    with fastdump.attach(model, tmp_path, exclude="up") as d:
        d.watch(model.up, "up", convert=convert)
        out = model(torch.randn(2, 8))  # no exception into the model
    assert out.shape == (2, 8)
    skipped = fastdump.open(tmp_path).meta("target", 0, 0)["skipped"]
    assert [s["name"] for s in skipped] == ["up"] and "StrRaises" in skipped[0]["reason"]


def test_pass_metadata_holding_an_int_json_cannot_print_is_kept_as_a_note(tmp_path):
    """json.dumps refuses ints of over 4300 digits: a pass's end carrying one raised ValueError into
    the model, and the pass lost its end while verify said OK."""
    model = Mlp()
    with fastdump.attach(model, tmp_path) as d:
        d.set_pass_meta(n=10 ** 5000, small=2 ** 70, step=1)
        out = model(torch.randn(2, 8))
        d.begin_pass(n=[-(10 ** 5000)])
        d.end_pass()
    assert d.stats()["interrupted_pass_ends"] == 0 and d.stats()["incomplete_passes"] == 0
    ds = fastdump.open(tmp_path)
    meta = ds.meta("target", 0, 0)
    assert meta["complete"] and meta["n"] == "<int of 16610 bits>" and meta["small"] == 2 ** 70
    assert meta["step"] == 1 and same_bits(ds.load("target", 0, 0)["Mlp"], out)
    assert ds.meta("target", 0, 1)["n"] == ["<int of 16610 bits>"]


class ReturnsLookalikes(nn.Module):
    def forward(self, x):
        return {1: x + 1, "1": x + 2, "a.b": x + 3, "a": {"b": x + 4, "c": x + 5}}


class TupleParent(nn.Module):
    """Its tuple output's first part reads `block.0`, the name of its own first child."""

    def __init__(self):
        super().__init__()
        self.add_module("0", nn.Linear(4, 4))

    def forward(self, x):
        y = getattr(self, "0")(x)
        return y * 2, y * 3


@pytest.mark.parametrize("native", [True, False])
def test_parts_of_an_output_named_alike_are_dumped_once_and_the_other_skipped(tmp_path, monkeypatch, native):
    """Parts are named after their keys' text: 1 and "1", "a.b" and "a" holding "b", or a tuple part
    of a watched module and its child (`block.0`). Before, both went under one name and verify failed
    the pass as mixed; now the first keeps the name, each later one is a recorded skip."""
    monkeypatch.setattr("fastdump.capture.wrappers._native_wrappers", native)
    model = nn.Sequential(ReturnsLookalikes())  # the root returns the same dict: its parts too
    x = torch.randn(2, 4)
    with fastdump.attach(model, tmp_path):
        model(x)
    dumped = fastdump.open(tmp_path).load("target", 0, 0)
    for prefix in ("0", "Sequential"):
        assert same_bits(dumped[f"{prefix}.1"], x + 1) and same_bits(dumped[f"{prefix}.a.b"], x + 3)
        assert same_bits(dumped[f"{prefix}.a.c"], x + 5)
    skipped = {s["name"]: s["reason"] for s in fastdump.open(tmp_path).meta("target", 0, 0)["skipped"]}
    assert set(skipped) == {"0.1", "0.a.b", "Sequential.1", "Sequential.a.b"}
    assert all("same name" in r for r in skipped.values())
    assert not [n for n in dumped if "#dup" in n] and not verify(tmp_path).problems

    block_root = tmp_path / "block"
    block = nn.Sequential(TupleParent())
    x = torch.randn(2, 4)
    with fastdump.attach(block, block_root, exclude="^0$") as d:
        d.watch(block[0], "0")
        block(x)
    dumped = fastdump.open(block_root).load("target", 0, 0)
    child = getattr(block[0], "0")(x)
    assert same_bits(dumped["0.0"], child) and same_bits(dumped["0.1"], child * 3)
    skipped = fastdump.open(block_root).meta("target", 0, 0)["skipped"]
    assert [s["name"] for s in skipped] == ["0.0"] and "module's name" in skipped[0]["reason"]
    assert not verify(block_root).problems


def test_a_root_name_its_tuple_parts_would_share_with_a_childs_is_refused_at_attach(tmp_path):
    """root_name="model" with a child `model` holding `0`: the root's tuple part `model.0` would be
    the child's name (one of them a recorded skip). attach refuses such a root_name, before anything
    is created or wrapped."""
    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Sequential(nn.Linear(4, 4))

        def forward(self, x):
            y = self.model(x)
            return y + 1, y + 2

    model = Root()
    with pytest.raises(ValueError, match="root_name='model' reads as the model's module 'model'"):
        fastdump.attach(model, tmp_path, root_name="model")
    assert "forward" not in model.__dict__ and not list(tmp_path.iterdir())


def test_end_pass_without_begin_pass_never_ends_a_root_forwards_pass(tmp_path, caplog):
    """An unmatched end_pass() inside a root forward ended the root's pass: the rest of the forward
    was not dumped and the pass read as whole."""
    class Root(nn.Module):
        def __init__(self, dumper_box):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.box = dumper_box

        def forward(self, x):
            y = self.a(x)
            self.box[0].end_pass()
            return self.b(y)

    box = []
    model = Root(box)
    x = torch.randn(2, 4)
    with caplog.at_level(logging.WARNING, logger="fastdump"):
        with fastdump.attach(model, tmp_path) as d:
            box.append(d)
            out = model(x)
            d.end_pass()  # outside any pass: nothing
    dumped = fastdump.open(tmp_path).load("target", 0, 0)
    assert list(dumped) == ["a", "b", "Root"] and same_bits(dumped["Root"], out)
    assert fastdump.open(tmp_path).meta("target", 0, 0)["complete"]
    assert "end_pass() without an open begin_pass(): ignored" in caplog.text


def test_pass_metadata_keys_the_reader_adds_itself_are_refused(tmp_path):
    """DumpSet.meta adds complete, dropped, skipped, tensors, bytes (and incomplete, mixed): a user's
    key of one of those names was overwritten, or read as fastdump's own flag."""
    model = Mlp()
    with fastdump.attach(model, tmp_path) as d:
        for key in ("complete", "incomplete", "mixed", "dropped", "tensors"):
            with pytest.raises(ValueError, match=repr(key)):
                d.set_pass_meta(**{key: 1})
            with pytest.raises(ValueError, match=repr(key)):
                d.begin_pass(**{key: 1})
        assert not d.in_pass
        d.set_pass_meta(step=3)
        model(torch.randn(2, 8))
    meta = fastdump.open(tmp_path).meta("target", 0, 0)
    assert meta["step"] == 3 and meta["complete"] is True and "mixed" not in meta


def test_verify_warns_of_a_pass_stored_incomplete_without_a_reason(tmp_path, monkeypatch):
    """A pass whose end never reached the writer (a full ring refused it and it was not sent later,
    or Ctrl-C cut it off) is stored not complete, with no reason: verify says so."""
    monkeypatch.setattr("fastdump.capture.passes._MAX_LATE_ENDS", 0)  # a refused end is lost, not sent later
    monkeypatch.setattr("fastdump.capture.wrappers._native_root_pass", False)  # every end through Channel.end
    model = Mlp()
    d = fastdump.attach(model, tmp_path, policy="drop")
    model(torch.randn(2, 8))
    channel = d._channel
    real_end = channel.end
    monkeypatch.setattr(channel, "end", lambda *args: 0 if args[0] == 1 else real_end(*args))
    model(torch.randn(2, 8))  # pass 1: its end "refused"
    monkeypatch.setattr(channel, "end", real_end)
    model(torch.randn(2, 8))
    d.close()
    assert d.stats()["lost_pass_ends"] == 1
    ds = fastdump.open(tmp_path)
    assert ds.meta("target", 0, 1)["complete"] is False and "incomplete" not in ds.meta("target", 0, 1)
    report = verify(tmp_path)
    assert any("stored incomplete without a reason" in w and "pass 1" in w for w in report.warnings), report.warnings


def test_pass_metadata_keys_that_read_alike_are_both_kept(tmp_path):
    """{1: "a", "1": "b"} became {"1": "b"}: JSON keys are text, and the first value was lost."""
    model = Mlp()
    with fastdump.attach(model, tmp_path) as d:
        d.set_pass_meta(keys={1: "a", "1": "b", "'1'": "c"})
        model(torch.randn(2, 8))
    # the later of two alike keys goes under its repr: "1" as '1', then "'1'" as "'1'"
    assert fastdump.open(tmp_path).meta("target", 0, 0)["keys"] == {"1": "a", "'1'": "b", "\"'1'\"": "c"}


# -- names that read as another's: `#k` is call numbering's, `b.0` a tuple part's ----------------
class CallLikeChild(nn.Module):
    """A child attribute named ``a#1`` beside ``a``, which the forward calls twice: the second call
    of ``a`` is stored as ``a#1`` too."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.add_module("a#1", nn.Linear(4, 4))

    def forward(self, x):
        return self.a(self.a(x)) + getattr(self, "a#1")(x)


def test_a_module_whose_name_reads_as_a_repeated_call_is_not_wrapped_and_nothing_reads_mixed(tmp_path, caplog):
    """Both were stored as 'a#1' and verify failed the pass as mixed; now 'a#1' the module is left
    unwrapped with the reason (rank.json's config, the log), and 'a#1' is a's second call."""
    model, x = CallLikeChild(), torch.randn(2, 4)
    with caplog.at_level(logging.WARNING, logger="fastdump"):
        with fastdump.attach(model, tmp_path) as d:
            out = model(x)
    ds = fastdump.open(tmp_path)
    tensors = ds.load("target", 0, 0)
    assert list(tensors) == ["a", "a#1", "CallLikeChild"]
    assert same_bits(tensors["a#1"], model.a(model.a(x)))
    assert same_bits(tensors["CallLikeChild"], out)
    assert not verify(tmp_path).problems
    config = json.loads((d.dir / "rank.json").read_text())["config"]
    assert "repeated call" in config["not_wrapped"]["a#1"]
    assert any("not wrapped: a#1" in r.getMessage() for r in caplog.records)


def test_names_given_to_dump_that_read_as_another_values_are_recorded_skips(tmp_path):
    """dump('a#1') beside a's second call, dump('b.0') beside module b's tuple output (named by the C
    wrapper) and beside dump('c', (t,)): two tensors under one name, which verify called mixed."""

    class TupleOut(nn.Module):
        def forward(self, x):
            return x + 1, x + 2

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.b = TupleOut()

        def forward(self, x):
            return self.b(x)

    model, x = Model(), torch.randn(3)
    with fastdump.attach(model, tmp_path) as d:
        d.begin_pass()
        model(x)
        d.dump("a", x * 10)
        d.dump("a", x * 11)
        d.dump("a#1", x * 12)             # reads as a's second call
        d.dump("b.0", x * 13)             # reads as b's first tuple part
        d.dump("c.0", x * 14)
        d.dump("c", (x * 15,))            # its part reads as the value above
        d.dump(7, x * 16)                 # not a name
        d.dump("c.0", x * 17)             # a second call of "c.0": its own name
        d.end_pass()
    ds = fastdump.open(tmp_path)
    passes = ds.passes("target", 0)
    tensors = ds.load("target", 0, passes[-1])
    assert list(tensors) == ["b.0", "b.1", "Model.0", "Model.1", "a", "a#1", "c.0", "c.0#1"]
    for name, factor in (("a", 10), ("a#1", 11), ("c.0", 14), ("c.0#1", 17)):
        assert same_bits(tensors[name], x * factor), name
    assert same_bits(tensors["b.0"], x + 1)
    skipped = {s["name"]: s["reason"] for s in ds.meta("target", 0, passes[-1])["skipped"]}
    assert set(skipped) == {"a#1", "b.0", "c.0", "<dump() name 7>"}
    assert "repeated call" in skipped["a#1"] and "module 'b'" in skipped["b.0"]
    assert "same name" in skipped["c.0"]
    assert not verify(tmp_path).problems


def test_a_watched_modules_before_values_and_output_parts_never_share_a_name(tmp_path):
    """before() returning {"0": ...} and the module's tuple output both named 'w.0'."""
    model = Mlp()
    with fastdump.attach(model, tmp_path, include="^$") as d:
        d.watch(model.up, "w", convert=lambda out: (out, out * 2), before=lambda args, kwargs: {"0": args[0]})
        x = torch.randn(2, 8)
        model(x)
    ds = fastdump.open(tmp_path)
    tensors = ds.load("target", 0, 0)
    assert same_bits(tensors["w.0"], x) and same_bits(tensors["w.1"], model.up(x) * 2)
    skipped = ds.meta("target", 0, 0)["skipped"]
    assert [s["name"] for s in skipped] == ["w.0"] and "same name" in skipped[0]["reason"]
    assert not verify(tmp_path).problems


@pytest.mark.parametrize("bad", ["x#1", "x#2.y", "", 5])
def test_root_name_that_reads_as_a_call_or_is_no_name_is_refused_at_attach(tmp_path, bad):
    with pytest.raises(ValueError, match="root_name"):
        fastdump.attach(Mlp(), tmp_path, root_name=bad)


def test_watch_refuses_a_name_that_reads_as_a_call(tmp_path):
    with fastdump.attach(Mlp(), tmp_path) as d, pytest.raises(ValueError, match="repeated call"):
        d.watch(nn.Linear(2, 2), "x#1")


# -- tensors too large to plan or to put together ---------------------------------------------------
def test_a_cpu_broadcast_view_whose_size_overflows_is_skipped_at_once(tmp_path):
    """expand(2**61) float64 claims 2**64 bytes: the size wrapped (0 bytes) and the producer planned
    one record per ring chunk for minutes before bad_alloc, on the model's thread."""
    import time

    huge = torch.tensor(1.5, dtype=torch.float64).expand(2 ** 61)
    with fastdump.attach(None, tmp_path, writer="thread") as d:
        d.begin_pass()
        d.dump("before", torch.arange(4.0))
        started = time.monotonic()
        d.dump("huge", huge)
        took = time.monotonic() - started
        d.dump("after", torch.arange(3.0))
        d.end_pass()
    assert took < 1.0
    ds = fastdump.open(tmp_path)
    assert list(ds.load("target", 0, 0)) == ["before", "after"]
    skipped = ds.meta("target", 0, 0)["skipped"]
    assert [s["name"] for s in skipped] == ["huge"] and "2^63 bytes" in skipped[0]["reason"]
    assert not verify(tmp_path).problems


def test_a_chunked_tensor_the_writer_cannot_put_together_is_lost_and_fails_verify(tmp_path, monkeypatch):
    """No memory to assemble a tensor split over ring records (an 8 TiB broadcast view): the writer
    died ("writer crashed: MemoryError") and dumping stopped everywhere. Now that tensor alone is
    lost, recorded (rank.json lost_tensors, the pass's skipped list), and verify fails on it."""
    from fastdump.writer import loop
    from fastdump.writer.channel_writer import ChannelWriter

    real = loop._Assembly.__init__

    def no_memory_for_big(self, total):
        if total > 2 << 20:
            raise MemoryError(f"Unable to allocate {total} bytes")
        real(self, total)

    monkeypatch.setattr(loop._Assembly, "__init__", no_memory_for_big)
    # (a valid tensor of 1 MiB or more is written chunk by chunk, never put together: this one is)
    monkeypatch.setattr(ChannelWriter, "streams", lambda self, *args: False)
    big, small = torch.arange(3 << 18, dtype=torch.float32), torch.arange(5.0)  # 3 MiB: 3 records of 1 MiB
    with fastdump.attach(None, tmp_path, writer="thread", ring_mb=4) as d:
        d.begin_pass()
        d.dump("big", big)
        d.dump("small", small)
        d.end_pass()
        d.begin_pass()
        d.dump("next", small * 2)
        d.end_pass()
    ds = fastdump.open(tmp_path)
    assert list(ds.load("target", 0, 0)) == ["small"] and same_bits(ds.load("target", 0, 0)["small"], small)
    assert same_bits(ds.load("target", 0, 1)["next"], small * 2)
    skipped = ds.meta("target", 0, 0)["skipped"]
    assert [s["name"] for s in skipped] == ["big"] and "MemoryError" in skipped[0]["reason"]
    info = json.loads((d.dir / "rank.json").read_text())
    assert info["status"] == "closed" and info["lost_tensors"] == 1
    assert any("1 staged tensor(s) were lost after they were accepted" in p for p in verify(tmp_path).problems)


def test_close_inside_the_models_forward_says_so(tmp_path):
    """The pass close() cut short was said to lack an end_pass() call, which a root forward never makes."""
    model = Mlp()
    box = []
    model.act.register_forward_hook(lambda *_: box[0].close() and None)
    box.append(fastdump.attach(model, tmp_path))
    model(torch.randn(2, 8))
    meta = fastdump.open(tmp_path).meta("target", 0, 0)
    assert meta["complete"] is False and meta["incomplete"] == "still open at close(): closed inside the model's forward"


@pytest.mark.parametrize("draft_root_passes", [True, False])
def test_an_eagle_draft_run_on_another_thread_inside_the_target_forward_fails_verify(tmp_path, draft_root_passes):
    """The draft (sharing the target's embedding and LM head) run on a worker thread that the
    target's forward waits for: a pass opened on another thread suspends nothing, so its calls of
    the shared modules reach the target's open pass as `embed#1`, `lm_head#1`. That pass is marked
    mixed and verify fails; the draft's own pass (root passes) holds its calls, whole."""
    from test_dumper import _Eagle3Draft, _Eagle3Target
    target = _Eagle3Target()
    draft = _Eagle3Draft(target)
    dt = fastdump.attach(target, tmp_path, role="target")
    dd = fastdump.attach(draft, tmp_path, role="draft", root_passes=draft_root_passes)
    drafted = []

    def run_draft(ids, hidden):
        worker = threading.Thread(target=lambda: drafted.append(draft(ids + 1, hidden)))
        worker.start()
        worker.join()

    target.run_draft = run_draft
    with torch.inference_mode():
        target(torch.tensor([[1, 2, 3]]))
    assert dd.close()["status"] == "closed" and dt.close()["mixed_passes"] == 1
    ds = fastdump.open(tmp_path)
    assert sorted(ds.load("target", 0, 0)) == ["_Eagle3Target", "embed", "embed#1", "layer", "lm_head", "lm_head#1"]
    meta = ds.meta("target", 0, 0)
    assert meta["mixed"] is True and "suspended_for" not in meta
    problems = verify(tmp_path).problems
    assert len(problems) == 1 and "target" in problems[0] and "pass 0 mixes tensors" in problems[0]
    if draft_root_passes:
        dumped = ds.load("draft", 0, 0)
        assert sorted(dumped) == ["_Eagle3Draft.0", "_Eagle3Draft.1", "embed", "fc", "lm_head"]
        assert same_bits(dumped["lm_head"], drafted[0][0]) and same_bits(dumped["fc"], drafted[0][1])
        assert ds.meta("draft", 0, 0)["complete"] and "nested_in" not in ds.meta("draft", 0, 0)
    else:
        assert ds.passes("draft", 0) == []


class _BlockOfOne(nn.Module):
    """A non-leaf whose output dict's key is its child's name: watched as "0", its part reads "0.lin"."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x):
        return {"lin": self.lin(x) * 2}


def test_a_watched_modules_output_part_named_as_its_child_is_a_recorded_skip(tmp_path, kind):
    """A watched module's output part whose name is a wrapped module's (its child ``0.lin``) would put
    two tensors under one name: the part is skipped with the reason, the child's output is kept.
    (The C wrapper stages the child without _name_taken, so only the module-name check catches it:
    a mutant without it survived every test.)"""
    model = nn.Sequential(_BlockOfOne())
    x = torch.randn(1, 2)
    with fastdump.attach(model, tmp_path, root_name="root") as d, torch.no_grad():
        d.watch(model[0], "0")
        model(x)
    ds = fastdump.open(tmp_path)
    dumped = ds.load("target", 0, 0)
    skipped = {s["name"]: s["reason"] for s in ds.meta("target", 0, 0)["skipped"]}
    assert list(dumped).count("0.lin") == 1 and same_bits(dumped["0.lin"], model[0].lin(x).detach())
    assert "reads as a module's name" in skipped.get("0.lin", ""), skipped
    assert verify(tmp_path).problems == []
