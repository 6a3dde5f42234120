"""fastdump.integrations.vllm: each forward and the compute_logits after it as one pass, on CPU
stand-ins shaped like vLLM's models (tests/eagle_engines.py) and a model runner reduced to the calls
vLLM's GPUModelRunner makes (execute_model: the forward, compute_logits on the sampled rows, the
EAGLE proposer's k steps; a pipeline stage before the last returns hidden states; _dummy_run)."""

import pytest
import torch

import fastdump
from fastdump.integrations import vllm as fvllm
from conftest import same_bits
from eagle_engines import V, VllmDraft, VllmTarget, load_drafter
from test_eagle_engines import only, unwrapped, verify_ok, vllm_batches, vllm_reference


class VllmRunner:
    """vLLM's GPUModelRunner reduced to its calls of the model: ``execute_model`` runs the forward
    (``_model_forward``: ``self.model(...)``), then ``self.model.compute_logits`` on the rows it
    samples (``hidden[logits_indices]``), then the EAGLE proposer (``propose``: k steps, each the
    drafter's forward and its ``compute_logits``). A pipeline stage before the last returns its hidden
    states (no logits); ``_dummy_run`` is a forward alone (warm-up, profiling)."""

    def __init__(self, model, drafter=None, k=0, last_pp_rank=True):
        self.model, self.drafter, self.k, self.last_pp_rank = model, drafter, k, last_pp_rank

    def _model_forward(self, input_ids):
        return self.model(input_ids)

    def execute_model(self, input_ids):
        with torch.no_grad():
            hidden = self._model_forward(input_ids)
            if not self.last_pp_rank:
                return hidden
            logits = self.model.compute_logits(hidden[-1:])  # logits_indices: the last token
            token = logits.argmax(-1)
            if self.drafter is not None:
                self.propose(token, hidden[-1:])
            return token

    def propose(self, token, hidden):
        for _ in range(self.k):
            hidden = self.drafter(token, hidden)
            token = self.drafter.compute_logits(hidden).argmax(-1)

    def _dummy_run(self, num_tokens):
        with torch.no_grad():
            return self.model(torch.zeros(num_tokens, dtype=torch.long))


def test_each_forward_and_its_logits_are_one_pass_in_the_role_that_ran_them(tmp_path):
    """Target: one pass per engine step, its forward and logits; draft: one pass per draft step
    (forward and logits), the modules it shares with the target (embedding, LM head) in its own
    passes; every value the reference's bit for bit, verify OK, the models restored at close."""
    steps, k = 2, 3
    ref_passes, ref_logits = vllm_reference(steps, k)
    target, drafter = VllmTarget(), VllmDraft()
    load_drafter(target, drafter)
    runner = VllmRunner(target, drafter, k)
    with fvllm.attach(target, tmp_path, role="target") as t, fvllm.attach(drafter, tmp_path, role="draft") as d:
        for input_ids in vllm_batches(steps, k):
            runner.execute_model(input_ids)
            # each pass ended with its logits: an idle server holds no pass open (none waits for close)
            assert not t.dumper.in_pass and not d.dumper.in_pass
    assert unwrapped(target, drafter, target.model.embed_tokens)
    assert "compute_logits" not in vars(target) and "compute_logits" not in vars(drafter)
    assert not target._forward_pre_hooks and not target._forward_hooks
    ds = fastdump.open(tmp_path)
    for role in ("target", "draft"):
        rank = only(ds.ranks(role))
        refs = [rec for r, rec in ref_passes if r == role]
        assert ds.passes(role, rank) == list(range(len(refs))) and len(refs) == steps * (1 if role == "target" else k)
        for p, rec in enumerate(refs):
            got, want = ds.load(role, rank, p), dict(rec, logits_processor=ref_logits[role][p])
            assert sorted(got) == sorted(want), (role, p, sorted(set(got) ^ set(want)))
            assert all(same_bits(got[n], want[n]) for n in want), (role, p)
            assert ds.meta(role, rank, p)["num_tokens"] == (1 + k if role == "target" else 1)
    assert "model.embed_tokens" in ds.load("draft", only(ds.ranks("draft")), 0)
    assert verify_ok(tmp_path)


def test_a_forward_without_logits_is_a_whole_pass_ended_by_the_next_forward_or_close(tmp_path):
    """A pipeline stage before the last, and a dummy run, compute no logits: each forward is still
    one pass, whole, ended as the next call of the model begins (or at close)."""
    target = VllmTarget()
    runner = VllmRunner(target, last_pp_rank=False)
    batches = vllm_batches(3, 1)
    with fvllm.attach(target, tmp_path, role="target") as dumping:
        runner._dummy_run(5)
        outs = [runner.execute_model(ids) for ids in batches]
        assert dumping.dumper.in_pass  # the last forward's pass waits for a compute_logits
    ds = fastdump.open(tmp_path)
    rank = only(ds.ranks("target"))
    assert ds.passes("target", rank) == [0, 1, 2, 3]
    assert [ds.meta("target", rank, p)["num_tokens"] for p in range(4)] == [5, 2, 2, 2]
    for p, out in enumerate(outs, start=1):
        got = ds.load("target", rank, p)
        assert same_bits(got["VllmTarget"], out) and "logits_processor" not in got
        assert ds.meta("target", rank, p)["complete"]
    assert verify_ok(tmp_path)


def test_logits_without_a_forward_and_raising_calls(tmp_path):
    """compute_logits with no forward before it is a pass of its own (logits_only); a forward or a
    compute_logits that raises leaves its pass incomplete, and the exception reaches the caller."""
    target = VllmTarget()
    hidden = torch.randn(1, 16)
    with fvllm.attach(target, tmp_path, role="target"):
        with torch.no_grad():
            logits = target.compute_logits(hidden)  # pass 0: logits only
            with pytest.raises(IndexError):
                target(torch.tensor([V + 7]))  # pass 1: the embedding raises
            target.compute_logits(hidden)  # pass 2: logits only again (pass 1 was ended)
            out = target(torch.arange(3))  # pass 3
            with pytest.raises(RuntimeError):
                target.compute_logits(torch.randn(1, 5))  # ... whose logits raise
            target(torch.arange(2))  # pass 4, ended at close
    ds = fastdump.open(tmp_path)
    rank = only(ds.ranks("target"))
    assert ds.passes("target", rank) == [0, 1, 2, 3, 4]
    assert ds.meta("target", rank, 0)["logits_only"] is True
    assert same_bits(ds.load("target", rank, 0)["logits_processor"], logits)
    assert [bool(ds.meta("target", rank, p)["complete"]) for p in range(5)] == [True, False, True, False, True]
    assert "raised" in ds.meta("target", rank, 1)["incomplete"]
    assert "compute_logits raised RuntimeError" in ds.meta("target", rank, 3)["incomplete"]
    assert same_bits(ds.load("target", rank, 3)["VllmTarget"], out)


def test_a_pass_the_caller_opened_holds_the_whole_step(tmp_path):
    """Inside the caller's manual_pass (the docs' recipe: a whole engine step as one pass) the
    helper opens nothing: the step's forwards and logits are that pass's calls."""
    target = VllmTarget()
    runner = VllmRunner(target)
    with fvllm.attach(target, tmp_path, role="target") as dumping:
        with dumping.dumper.manual_pass(forward_mode="step"):
            runner._dummy_run(2)
            runner.execute_model(torch.arange(4) % V)
    ds = fastdump.open(tmp_path)
    rank = only(ds.ranks("target"))
    assert ds.passes("target", rank) == [0]
    got = ds.load("target", rank, 0)
    assert {"VllmTarget", "VllmTarget#1", "logits_processor"} <= set(got) and "logits_processor#1" not in got
    assert ds.meta("target", rank, 0)["forward_mode"] == "step"


def test_attach_refuses_what_it_cannot_pair(tmp_path):
    with pytest.raises(TypeError, match="compute_logits"):
        fvllm.attach(torch.nn.Linear(2, 2), tmp_path / "a")
    with pytest.raises(ValueError, match="root_passes"):
        fvllm.attach(VllmTarget(), tmp_path / "b", root_passes=True)


def test_docs_example(tmp_path, monkeypatch):
    """INTEGRATIONS.md's vllm-helper example, run as written: the same passes as the engine's runner."""
    from conftest import doc_example

    steps, k = 2, 2
    ref_passes, ref_logits = vllm_reference(steps, k)
    monkeypatch.chdir(tmp_path)
    target, drafter = VllmTarget(), VllmDraft()
    load_drafter(target, drafter)
    exec(compile(doc_example("vllm-helper"), "INTEGRATIONS.md:vllm-helper", "exec"),
         {"target": target, "drafter": drafter, "batches": vllm_batches(steps, k), "k": k})
    ds = fastdump.open(tmp_path / "dump")
    for role in ("target", "draft"):
        rank = only(ds.ranks(role))
        refs = [rec for r, rec in ref_passes if r == role]
        assert len(ds.passes(role, rank)) == len(refs)
        for p, rec in enumerate(refs):
            got = ds.load(role, rank, p)
            assert same_bits(got["logits_processor"], ref_logits[role][p])
            assert all(same_bits(got[n], t) for n, t in rec.items())
    assert verify_ok(tmp_path / "dump")


def test_forwards_of_one_model_on_two_threads_at_once_fail_verify(tmp_path):
    """Two threads in the model at once (micro-batches overlapped on threads): the second forward's
    pre-hook ends the first one's pass from another thread and the first thread's later calls run in
    the second's pass; both are marked mixed and verify fails, never a pass that reads as whole."""
    import threading

    target = VllmTarget()
    inside, release = threading.Event(), threading.Event()
    first = []

    def hold_first(module, args):
        if threading.current_thread() is first[0]:
            inside.set()
            assert release.wait(30)

    target.model.layers[0].register_forward_pre_hook(hold_first)
    with fvllm.attach(target, tmp_path, role="target"), torch.no_grad():
        first.append(threading.Thread(target=lambda: target.compute_logits(target(torch.arange(3))[-1:])))
        first[0].start()
        assert inside.wait(30)
        target.compute_logits(target(torch.arange(2))[-1:])  # the other thread's whole step meanwhile
        release.set()
        first[0].join(30)
    ds = fastdump.open(tmp_path)
    rank = only(ds.ranks("target"))
    metas = [ds.meta("target", rank, p) for p in ds.passes("target", rank)]
    assert any(m.get("mixed") for m in metas), metas
    assert not verify_ok(tmp_path)
