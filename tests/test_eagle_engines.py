"""EAGLE speculative decoding as SGLang and vLLM run it, on CPU stand-ins (tests/eagle_engines.py),
with fastdump attached as documented.

What is checked: each role's passes hold exactly what that role's forward computed, bit for bit
(references from plain forward hooks that clone at hook time, on a run without fastdump), a module
the draft shares with the target (the embedding and LM head themselves) under the name the running
role gives it and in that role's pass alone; the served outputs unchanged; ``fastdump verify``
fails whenever a rank was lost."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import fastdump
from fastdump import cli
from fastdump.cli import dump as cli_dump
from conftest import doc_example, flatten_output, same_bits
from eagle_engines import Draft, Target, V, VllmDraft, VllmTarget, eagle_schedule, load_drafter

TESTS = Path(__file__).parent


class Recorder:
    """Plain hooks on every leaf and root of the models given ({role: model}): one dict per root call,
    {fastdump name: clone}, in the order the passes ended. A module several models hold is recorded
    under the name the running role (the innermost root running) gives it."""

    def __init__(self, **models):
        self.passes, self._stack, self._handles = [], [], []
        names = {}
        for role, model in models.items():
            self._handles.append(model.register_forward_pre_hook(
                lambda mod, args, role=role: self._stack.append((role, {}, {}))))
            self._handles.append(model.register_forward_hook(self._end))
            for name, mod in model.named_modules(remove_duplicate=False):
                if name and not mod._modules:
                    names.setdefault(id(mod), (mod, {}))[1].setdefault(role, name)
        for mod, by_role in names.values():
            self._handles.append(mod.register_forward_hook(self._leaf(by_role)))

    def _end(self, mod, args, out):
        role, rec, _ = self._stack.pop()
        flatten_output(type(mod).__name__, out, rec)
        self.passes.append((role, rec))

    def _leaf(self, by_role):
        def hook(mod, args, out):
            if not self._stack:  # a call outside every root forward (vLLM's compute_logits)
                return
            role, rec, calls = self._stack[-1]
            name = by_role[role]
            k = calls.get(name, 0)
            calls[name] = k + 1
            flatten_output(name if k == 0 else f"{name}#{k}", out, rec)
        return hook

    def remove(self):
        for h in self._handles:
            h.remove()


def assert_roles_dumped(root, passes, sessions=None, rounded=()):
    """Each (role, reference) of ``passes`` is the role's next pass in its session (``sessions``:
    {role: rank directory}; default its only one), names and bits (to rounding for the ``rounded``
    roles: a model inductor compiled); nothing more dumped."""
    ds = fastdump.open(root)
    sessions = sessions or {role: only(ds.ranks(role)) for role in ds.roles}
    seen = dict.fromkeys(sessions, 0)
    for role, want in passes:
        got = ds.load(role, sessions[role], seen[role])
        assert sorted(got) == sorted(want), (role, seen[role], sorted(set(got) ^ set(want)))
        for name in want:
            if role in rounded:
                torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5)
            else:
                assert same_bits(got[name], want[name]), (role, seen[role], name)
        seen[role] += 1
    assert seen == {role: len(ds.passes(role, s)) for role, s in sessions.items()}, seen


def only(items):
    (item,) = items
    return item


def verify_ok(root) -> bool:
    return cli.main(["verify", str(root)]) == 0


def serve_on_a_forward_thread(models, schedule):
    """SGLang's overlap scheduler: the forwards run on a thread of their own, not the attaching one."""
    outs = []
    thread = threading.Thread(target=lambda: outs.extend(models[role](*args)[0] for role, _, args in schedule))
    thread.start()
    thread.join(120)
    assert not thread.is_alive()
    return outs


def unwrapped(*modules):
    return all("forward" not in m.__dict__ for m in modules)


# --------------------------------------------------------------------- SGLang's shape, one process


@pytest.mark.parametrize("share", ["before-attach", "after-attach"])
@pytest.mark.parametrize("close_order", ["draft-first", "target-first"])
def test_shared_embedding_and_head_dump_in_the_running_roles_pass_under_its_name(tmp_path, share, close_order):
    """The draft holds the target's embedding and LM head themselves (under ``midlayer.embed_tokens``
    and ``lm_head``), given before both Dumpers attach or after (the engines share them once the
    draft is loaded). Forwards run on a forward thread; the verify forward takes a tree mask. Each
    call of a shared module is in the pass of the role whose forward ran it, under that role's name,
    once."""
    target, draft = Target(), Draft()
    draft.set_embed_and_head(target.model.embed_tokens, target.lm_head)
    schedule = eagle_schedule()
    rec = Recorder(target=target, draft=draft)
    ref = [{"target": target, "draft": draft}[role](*args)[0] for role, _, args in schedule]
    rec.remove()

    target, draft = Target(), Draft()
    old_embed, old_head = draft.midlayer.embed_tokens, draft.lm_head
    if share == "before-attach":
        draft.set_embed_and_head(target.model.embed_tokens, target.lm_head)
    dumpers = {"target": fastdump.attach(target, tmp_path, role="target"),
               "draft": fastdump.attach(draft, tmp_path, role="draft")}
    try:
        if share == "after-attach":
            draft.set_embed_and_head(target.model.embed_tokens, target.lm_head)
        outs = serve_on_a_forward_thread({"target": target, "draft": draft}, schedule)
    finally:
        for role in (("draft", "target") if close_order == "draft-first" else ("target", "draft")):
            dumpers[role].close()
    assert all(same_bits(a, b) for a, b in zip(outs, ref))
    assert unwrapped(target, draft, target.model.embed_tokens, target.lm_head, old_embed, old_head)
    assert_roles_dumped(tmp_path, rec.passes)
    ds = fastdump.open(tmp_path)
    draft_pass = ds.load("draft", only(ds.ranks("draft")), 0)
    assert "midlayer.embed_tokens" in draft_pass and "model.embed_tokens" not in draft_pass
    assert verify_ok(tmp_path)


def test_the_draft_worker_restarted_while_the_target_serves_on(tmp_path):
    """The draft's Dumper closed (its worker stopped) and a new one attached, the target serving
    throughout: the modules both wrap keep dumping into the target's one session, and each draft
    session holds its own forwards."""
    target, draft = Target(), Draft()
    draft.set_embed_and_head(target.model.embed_tokens, target.lm_head)
    schedule = eagle_schedule(steps=1)
    models = {"target": target, "draft": draft}
    rec = Recorder(**models)
    for role, _, args in schedule * 3:
        models[role](*args)
    rec.remove()
    passes = [rec.passes[i * len(schedule):(i + 1) * len(schedule)] for i in range(3)]

    target_dumper = fastdump.attach(target, tmp_path, role="target")
    sessions = []
    try:
        for phase in range(3):
            draft_dumper = fastdump.attach(draft, tmp_path, role="draft") if phase != 1 else None
            try:
                serve_on_a_forward_thread(models, schedule)
            finally:
                if draft_dumper is not None:
                    draft_dumper.close()
                    sessions.append(draft_dumper.dir.name)
    finally:
        target_dumper.close()
    assert unwrapped(target, draft, target.model.embed_tokens, target.lm_head)
    ds = fastdump.open(tmp_path)
    assert sorted(ds.ranks("draft")) == sorted(sessions)
    target_passes = [p for phase in passes for p in phase if p[0] == "target"]
    assert_roles_dumped(tmp_path, target_passes, sessions={"target": target_dumper.dir.name})
    for session, phase in zip(sessions, (passes[0], passes[2])):
        assert_roles_dumped(tmp_path, [p for p in phase if p[0] == "draft"], sessions={"draft": session})
    assert verify_ok(tmp_path)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compiled_target_beside_an_eager_draft_sharing_its_modules(tmp_path, backend):
    """torch.compile of the target (default mode) after attach, the draft eager, both running the
    shared embedding and LM head: each role's passes hold what its forward computed (the compiled
    target's own values: under inductor its logits and hidden states as served, bit for bit)."""
    target, draft = Target(), Draft()
    draft.set_embed_and_head(target.model.embed_tokens, target.lm_head)
    schedule = eagle_schedule(steps=1)
    models = {"target": target, "draft": draft}
    rec = Recorder(**models)
    ref = [models[role](*args)[0] for role, _, args in schedule]
    rec.remove()

    dumpers = [fastdump.attach(target, tmp_path, role="target"), fastdump.attach(draft, tmp_path, role="draft")]
    try:
        target.compile(backend=backend)
        served = [models[role](*args) for role, _, args in schedule]
    finally:
        for d in dumpers:
            d.close()
    assert unwrapped(target, draft, target.model.embed_tokens, target.lm_head)
    if backend == "eager":
        assert all(same_bits(a[0], b) for a, b in zip(served, ref))
        assert_roles_dumped(tmp_path, rec.passes)
    else:  # inductor's values, compared with eager ones to rounding; the served ones exactly
        assert_roles_dumped(tmp_path, rec.passes, rounded=("target",))
        ds = fastdump.open(tmp_path)
        rank = only(ds.ranks("target"))
        verify_outs = [out for (role, _, _), out in zip(schedule, served) if role == "target"]
        for p, (logits, hidden) in enumerate(verify_outs):
            got = ds.load("target", rank, p)
            assert same_bits(got["Target.0"], logits) and same_bits(got["Target.1"], hidden)
    assert verify_ok(tmp_path)


def test_pass_meta_set_by_the_scheduler_thread_while_the_forward_thread_runs_a_pass_fails_verify(tmp_path):
    """SGLang's overlap scheduler prepares batch B on its thread while the forward thread runs batch
    A. Its ``set_pass_meta(forward_mode=...)`` for B, given while A's pass is open, went into A's
    pass silently (A read as B, verify OK). Now, as ``dump()`` from another thread, it marks the
    open pass mixed: verify fails; the forward thread's own meta (a pre-hook) is kept as ever."""
    target = Target()
    entered, release = threading.Event(), threading.Event()

    def hold(module, args):
        entered.set()
        assert release.wait(30)

    target.model.layers[0].register_forward_pre_hook(hold)
    target.register_forward_pre_hook(lambda m, a: dumper.set_pass_meta(batch="A"))  # the forward's thread
    ids, mask = torch.arange(4), None
    dumper = fastdump.attach(target, tmp_path, role="target")
    try:
        thread = threading.Thread(target=lambda: target(ids, mask))
        thread.start()
        assert entered.wait(30)  # A's pass is open on the forward thread
        dumper.set_pass_meta(forward_mode="DECODE", batch="B")  # the scheduler thread, for B
        release.set()
        thread.join(30)
        dumper.set_pass_meta(batch="C")  # between passes: the next pass's, from any thread
        release.set()
        target(ids, mask)
    finally:
        release.set()
        dumper.close()
    ds = fastdump.open(tmp_path)
    rank = only(ds.ranks("target"))
    first, second = ds.meta("target", rank, 0), ds.meta("target", rank, 1)
    assert first.get("mixed") is True and first["complete"] is False, first
    assert second["batch"] == "A" and not second.get("mixed"), second  # the pre-hook's, set after C
    assert not verify_ok(tmp_path)


def test_a_manual_pass_ended_by_another_thread_mid_forward_fails_verify(tmp_path):
    """The forward thread begins a pass and runs the model; the scheduler thread calls end_pass()
    while that forward is still inside it. The forward's later modules went to no pass while the
    pass read as whole (verify OK). Now that pass is marked mixed and verify fails."""
    target = Target()
    entered, release = threading.Event(), threading.Event()

    def hold(module, args):
        entered.set()
        assert release.wait(30)

    target.model.layers[1].register_forward_pre_hook(hold)
    dumper = fastdump.attach(target, tmp_path, role="target", root_passes=False)
    ended = []

    def forward_thread():
        dumper.begin_pass()
        target(torch.arange(4))
        ended.append(dumper.end_pass())

    try:
        thread = threading.Thread(target=forward_thread)
        thread.start()
        assert entered.wait(30)  # inside the forward, layer 0 done
        assert dumper.end_pass()  # the scheduler thread ends it
        release.set()
        thread.join(30)
    finally:
        release.set()
        dumper.close()
    assert ended == [False]  # (its own end found none open)
    ds = fastdump.open(tmp_path)
    rank = only(ds.ranks("target"))
    meta = ds.meta("target", rank, 0)
    assert "model.layers.1.up_proj" not in ds.load("target", rank, 0)
    assert meta.get("mixed") is True and meta["complete"] is False, meta
    assert not verify_ok(tmp_path)


# ------------------------------------------------------------------------------------ vLLM's shape


def vllm_batches(steps, k):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, V, (1 + k,), generator=g) for _ in range(steps)]


def vllm_reference(steps, k):
    """What each role computed, per engine step: the target's forward and logits, the drafter's
    k forwards and logits. {role: [{name: clone}]} with fastdump's names (the root called k times:
    ``VllmDraft#j``)."""
    target, drafter = VllmTarget(), VllmDraft()
    load_drafter(target, drafter)
    rec = Recorder(target=target, draft=drafter)
    lp = {"target": [], "draft": []}
    target.logits_processor.register_forward_hook(lambda m, a, o: lp["target"].append(o.clone()))
    drafter.logits_processor.register_forward_hook(lambda m, a, o: lp["draft"].append(o.clone()))
    with torch.no_grad():  # the docs' example's loop, without the Dumpers
        for input_ids in vllm_batches(steps, k):
            hidden = target(input_ids)
            logits = target.compute_logits(hidden[-1:])
            token, h = logits.argmax(-1), hidden[-1:]
            for _ in range(k):
                h = drafter(token, h)
                token = drafter.compute_logits(h).argmax(-1)
    rec.remove()
    return rec.passes, lp


def test_vllm_logits_computed_after_the_forward_join_its_pass_through_manual_passes(tmp_path, monkeypatch):
    """vLLM calls ``compute_logits`` after the model's forward: with root passes that call is in no
    pass and the logits are not dumped (the docs say so); the docs' way, ``root_passes=False`` and a
    manual pass per engine step, puts them in the step's pass, and the drafter's k steps in one
    draft pass (``#j``), the shared modules in the role that ran them."""
    steps, k = 2, 3
    ref_passes, ref_logits = vllm_reference(steps, k)

    # root passes: the forward is the pass; the logits computed after it are not in it
    target = VllmTarget()
    with fastdump.attach(target, tmp_path / "root-passes", role="target"):
        with torch.no_grad():
            target.compute_logits(target(torch.arange(4) % V))
    ds = fastdump.open(tmp_path / "root-passes")
    assert ds.passes("target", 0) == [0] and "logits_processor" not in ds.load("target", 0, 0)

    monkeypatch.chdir(tmp_path)
    target, drafter = VllmTarget(), VllmDraft()
    load_drafter(target, drafter)
    ns = {"target": target, "drafter": drafter, "batches": vllm_batches(steps, k), "k": k}
    exec(compile(doc_example("vllm"), "INTEGRATIONS.md:vllm", "exec"), ns)
    assert unwrapped(target, drafter, target.model.embed_tokens)
    ds = fastdump.open(tmp_path / "dump")
    for role in ("target", "draft"):
        rank = only(ds.ranks(role))
        refs = [rec for r, rec in ref_passes if r == role]
        calls = 1 if role == "target" else k
        assert ds.passes(role, rank) == list(range(steps))
        for step in range(steps):
            got = ds.load(role, rank, step)
            want = {}
            for j, rec in enumerate(refs[step * calls:(step + 1) * calls]):
                want.update({name + (f"#{j}" if j else ""): t for name, t in rec.items()})  # plain tensors
                want["logits_processor" + (f"#{j}" if j else "")] = ref_logits[role][step * calls + j]
            assert sorted(got) == sorted(want), (role, step, sorted(set(got) ^ set(want)))
            assert all(same_bits(got[n], want[n]) for n in want), (role, step)
    assert "model.embed_tokens" in ds.load("draft", only(ds.ranks("draft")), 0)
    assert verify_ok(tmp_path / "dump")


# ------------------------------------------------------------------------------- engine processes


# One engine process: target and draft sharing modules, attached as SGLang's model runners attach
# them (target first, the share given after the draft is loaded), the EAGLE schedule served on a
# forward thread. argv: root, where to save what it served, and (TP) a JSON config.
ENGINE = textwrap.dedent("""
    import json, os, signal, sys, threading
    import torch
    torch.set_num_threads(1)
    sys.path.insert(0, sys.argv[3])
    import eagle_engines as e
    import fastdump

    root, out = sys.argv[1], sys.argv[2]
    cfg = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    rank = cfg.get("rank", 0)
    if cfg:
        import torch.distributed as dist
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]))
        dist.init_process_group("gloo", rank=rank, world_size=2)

        class RowParallel(torch.nn.Module):  # this rank's half of the inputs, partial sums all-reduced
            def __init__(self, lin):
                super().__init__()
                self.n = lin.in_features // 2
                self.weight = torch.nn.Parameter(lin.weight[:, rank * self.n:(rank + 1) * self.n].clone())
                self.bias = torch.nn.Parameter(lin.bias.clone())
            def forward(self, x):
                y = x[..., rank * self.n:(rank + 1) * self.n] @ self.weight.T
                if cfg.get("kill") == [rank, len(served)]:  # dies inside this forward, before the all-reduce
                    torch.save(served, out)
                    os.kill(os.getpid(), signal.SIGKILL)
                dist.all_reduce(y)
                return y + self.bias

    target, draft = e.Target(), e.Draft()
    if cfg:
        for model in (target, draft):
            for layer in model.modules():
                if isinstance(layer, e.DecoderLayer):
                    layer.down_proj = RowParallel(layer.down_proj)
    models = {"target": target, "draft": draft}
    dumpers = [fastdump.attach(target, root, role="target"), fastdump.attach(draft, root, role="draft")]
    draft.set_embed_and_head(target.model.embed_tokens, target.lm_head)
    served, errors = [], []

    def serve():
        try:
            for role, _, args in e.eagle_schedule():
                served.append((role, models[role](*args)[0].clone()))
        except Exception as exc:  # a peer rank died: the collective fails
            errors.append(repr(exc))

    thread = threading.Thread(target=serve)
    thread.start()
    thread.join()
    torch.save(served, out)
    for d in dumpers:
        d.close()
    print(json.dumps({"dirs": {d.role: d.dir.name for d in dumpers}, "errors": errors}))
""")


def start_engine(root, out, cfg=None):
    argv = [sys.executable, "-c", ENGINE, str(root), str(out), str(TESTS)] + ([json.dumps(cfg)] if cfg else [])
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc):
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:  # (a rank hung in a collective): never leave it running
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"engine process hung: {err[-3000:]}")
    return proc.returncode, (json.loads(out.splitlines()[-1]) if proc.returncode == 0 else None), err


def assert_served_is_dumped(root, served, dirs):
    """Every forward the engine served is its role's next pass, its logits bit for bit."""
    ds = fastdump.open(root)
    seen = dict.fromkeys(dirs, 0)
    for role, logits in served:
        assert same_bits(ds.load(role, dirs[role], seen[role])["lm_head"], logits), (role, seen[role])
        seen[role] += 1
    assert seen == {role: len(ds.passes(role, d)) for role, d in dirs.items()}


def test_two_engines_at_once_and_a_restart_on_one_root(tmp_path):
    """Two engine processes dumping into one root at the same time, then a restart on it: each
    session holds exactly its engine's forwards, and the root verifies."""
    root = tmp_path / "dump"
    procs = [start_engine(root, tmp_path / f"served{i}.pt") for i in range(2)]
    results = [finish(p) for p in procs]
    proc = start_engine(root, tmp_path / "served2.pt")
    results.append(finish(proc))
    for i, (code, result, err) in enumerate(results):
        assert code == 0 and not result["errors"], err[-3000:]
        assert_served_is_dumped(root, torch.load(tmp_path / f"served{i}.pt"), result["dirs"])
    ds = fastdump.open(root)
    assert {role: len(ds.ranks(role)) for role in ds.roles} == {"target": 3, "draft": 3}
    assert verify_ok(root)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="this torch has no gloo backend")
def test_tp2_rank_killed_inside_a_verify_forward_fails_verify_naming_it(tmp_path):
    """Tensor parallel, two ranks (gloo), each dumping both roles into its rank directories; rank 1
    is killed (SIGKILL) inside a target verify, before its all-reduce. Rank 0's all-reduce fails:
    its pass is kept, incomplete, and its engine closes. verify fails, every problem naming rank 1;
    all that each rank finished is dumped bit for bit."""
    root, port = tmp_path / "dump", free_port()
    kill_at = [i for i, (role, _, _) in enumerate(eagle_schedule()) if role == "target"][1]  # the first verify
    procs = [start_engine(root, tmp_path / f"served{r}.pt", {"rank": r, "port": port, "kill": [1, kill_at]})
             for r in range(2)]
    (code0, result0, err0), (code1, _, _) = finish(procs[0]), finish(procs[1])
    assert code0 == 0 and code1 == -signal.SIGKILL, err0[-3000:]
    assert result0["errors"], "rank 0's all-reduce should have failed"
    report = cli_dump.verify_dump(str(root))
    assert report.problems and all("TP1_PP0_Rank1" in p for p in report.problems), report.problems
    assert not verify_ok(root)
    ds = fastdump.open(root)
    assert_served_is_dumped_upto(ds, torch.load(tmp_path / "served0.pt"), 0)
    assert_served_is_dumped_upto(ds, torch.load(tmp_path / "served1.pt"), 1)
    interrupted = ds.meta("target", 0, ds.passes("target", 0)[-1])
    assert interrupted["complete"] is False and "RuntimeError" in interrupted["incomplete"]


def assert_served_is_dumped_upto(ds, served, rank):
    """The forwards a rank finished are its first passes, logits bit for bit (a pass it was in when
    the run broke may follow them)."""
    seen = {"target": 0, "draft": 0}
    for role, logits in served:
        assert same_bits(ds.load(role, rank, seen[role])["lm_head"], logits), (rank, role, seen[role])
        seen[role] += 1
    assert all(len(ds.passes(role, rank)) in (n, n + 1) for role, n in seen.items()), (rank, seen)
