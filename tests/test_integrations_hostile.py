"""Hostile tests of the integrations, as a user of an inference engine meets them.

The rules checked throughout: what is dumped equals, bit for bit, what each module computed at the
moment it returned (references come from an identical run WITHOUT fastdump, recorded with plain
forward hooks that clone at hook time); the served model's outputs are unchanged by dumping (bit for
bit against that run); draft and target never overwrite or mix each other's files; ``fastdump
verify`` fails whenever data was lost or mixed; bad input is a clear error, never a crash of the model.

Tiny models only (hidden 32, 1-2 layers), built from configs: no network, no GPU."""

import enum
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import fastdump  # noqa: E402
from fastdump import cli  # noqa: E402
from fastdump.integrations import sglang as fsg  # noqa: E402

transformers = pytest.importorskip("transformers", reason="transformers not installed (pip install fastdump[hf])")
from fastdump.integrations.hf import dump_generate  # noqa: E402
from conftest import flatten_output, same_bits  # noqa: E402

V = 96


# ------------------------------------------------------------------------------------------ helpers


def assert_same_pass(got: dict, want: dict, what=""):
    assert sorted(got) == sorted(want), (what, sorted(set(got) ^ set(want)))
    for k in want:
        assert same_bits(got[k], want[k]), (what, k, got[k].dtype, want[k].dtype, got[k].shape, want[k].shape)


def tiny_llama(layers=2, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, **kw)
    return transformers.LlamaForCausalLM(cfg).eval()


class Recorder:
    """Plain forward hooks on every leaf module and the root of each model given: one dict per root
    call, {fastdump name: clone at hook time}, per role. A module shared by several models is recorded
    in the pass of the root that is running (the innermost one)."""

    def __init__(self, **models):
        self.passes = {role: [] for role in models}
        self._stack, self._calls, self._handles = [], [], []
        names = {}  # id(leaf) -> (leaf, {role: its name in that role's model})
        for role, model in models.items():
            root = type(model).__name__
            self._handles.append(model.register_forward_pre_hook(self._begin(role)))
            self._handles.append(model.register_forward_hook(self._end(root)))
            for name, mod in model.named_modules(remove_duplicate=False):
                if name and not mod._modules:
                    names.setdefault(id(mod), (mod, {}))[1].setdefault(role, name)
        for mod, by_role in names.values():  # one hook per module, shared or not
            self._handles.append(mod.register_forward_hook(self._leaf(by_role)))

    def _begin(self, role):
        def hook(mod, args):
            self._stack.append(({}, role))
            self._calls.append({})
        return hook

    def _record(self, name, out):
        rec, _ = self._stack[-1]
        calls = self._calls[-1]
        k = calls.get(name, 0)
        calls[name] = k + 1
        flatten_output(name if k == 0 else f"{name}#{k}", out, rec)

    def _leaf(self, by_role):
        def hook(mod, args, out):
            if self._stack and self._stack[-1][1] in by_role:
                self._record(by_role[self._stack[-1][1]], out)
        return hook

    def _end(self, root):
        def hook(mod, args, out):
            self._record(root, out)
            rec, role = self._stack.pop()
            self._calls.pop()
            self.passes[role].append(rec)
        return hook

    def remove(self):
        for h in self._handles:
            h.remove()


def only_rank(ds, role):
    (rank,) = ds.ranks(role)
    return rank


def dumped_passes(root, role):
    ds = fastdump.open(root)
    rank = only_rank(ds, role)
    return [ds.load(role, rank, p) for p in ds.passes(role, rank)], [ds.meta(role, rank, p) for p in ds.passes(role, rank)]


def verify_ok(root) -> bool:
    return cli.main(["verify", str(root)]) == 0


# ------------------------------------------------------------------------------ Hugging Face generate


def prompts(batch):
    """Left-padded prompts (pad 0) with their attention mask."""
    if batch == 1:
        ids = torch.tensor([[1, 5, 9, 7]])
        return ids, torch.ones_like(ids)
    ids = torch.tensor([[0, 0, 5, 9, 7], [3, 3, 8, 2, 4], [0, 6, 6, 1, 2]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    return ids, mask


def greedy(model, ids, mask, **kw):
    return model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, pad_token_id=0, **kw)


@pytest.mark.parametrize("use_cache", [True, False], ids=["kv-cache", "no-cache"])
@pytest.mark.parametrize("batch", [1, 3], ids=["b1", "b3-padded"])
def test_hf_greedy_generate_every_module_bit_exact_and_logits_are_generates(tmp_path, use_cache, batch):
    model = tiny_llama()
    ids, mask = prompts(batch)
    rec = Recorder(target=model)
    ref = greedy(model, ids, mask, use_cache=use_cache)  # the run without fastdump
    rec.remove()

    with dump_generate(model, tmp_path) as dumpers:
        out = greedy(model, ids, mask, use_cache=use_cache)
    assert dumpers["target"].status == "closed"
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.logits) == len(ref.logits) == 5
    assert all(same_bits(a, b) for a, b in zip(out.logits, ref.logits))

    got, metas = dumped_passes(tmp_path, "target")
    assert len(got) == len(rec.passes["target"]) == len(out.logits)
    for p, (g, want, logits) in enumerate(zip(got, rec.passes["target"], out.logits)):
        assert_same_pass(g, want, p)
        assert same_bits(g["lm_head"][:, -1, :].float(), logits)  # each step's logits, as generate returned them
    modes = [m["forward_mode"] for m in metas]
    assert modes == (["prefill"] + ["decode"] * 4 if use_cache else ["prefill"] * 5)
    assert all(m["batch_size"] == batch and m["complete"] for m in metas)
    assert verify_ok(tmp_path)


def eagle_pair():
    """A target and a 1-layer draft that shares the target's embedding and LM head (EAGLE's way)."""
    target, draft = tiny_llama(2, seed=0), tiny_llama(1, seed=1)
    draft.model.embed_tokens = target.model.embed_tokens
    draft.lm_head = target.lm_head
    return target, draft


@pytest.mark.parametrize("close_order", ["target-first", "draft-first"])
def test_hf_assisted_generate_with_shared_modules_dumps_each_role_alone(tmp_path, close_order):
    """The shared embedding and LM head are dumped under the role whose forward runs them, never in
    the other role's pass; both roles bit exact against the undumped run; each role verifies alone."""
    target, draft = eagle_pair()
    ids, mask = prompts(1)
    rec = Recorder(target=target, draft=draft)
    ref = greedy(target, ids, mask, assistant_model=draft)
    rec.remove()

    target_dumper = fastdump.attach(target, tmp_path, role="target")
    draft_dumper = fastdump.attach(draft, tmp_path, role="draft")
    try:
        out = greedy(target, ids, mask, assistant_model=draft)
    finally:
        for d in ([target_dumper, draft_dumper] if close_order == "target-first" else [draft_dumper, target_dumper]):
            d.close()
    for m in (target, draft, target.lm_head, target.model.embed_tokens):
        assert "forward" not in m.__dict__  # both Dumpers' wrappers are gone, whatever the order
    assert torch.equal(out.sequences, ref.sequences)
    assert all(same_bits(a, b) for a, b in zip(out.logits, ref.logits))

    for role in ("target", "draft"):
        got, metas = dumped_passes(tmp_path, role)
        assert len(got) == len(rec.passes[role]) > 1, role
        for p, (g, want) in enumerate(zip(got, rec.passes[role])):
            assert_same_pass(g, want, (role, p))
            assert "model.embed_tokens#1" not in g and "lm_head#1" not in g  # no call of the other role
        # each role alone: a copy of its directory verifies by itself
        alone = tmp_path.parent / f"{tmp_path.name}-{role}"
        shutil.copytree(tmp_path / role, alone / role)
        shutil.copy(tmp_path / "fastdump.json", alone / "fastdump.json")
        assert verify_ok(alone), role
    assert verify_ok(tmp_path)


def test_hf_dump_generate_with_shared_modules(tmp_path):
    """The same through dump_generate, whose meta hooks sit on both roots."""
    target, draft = eagle_pair()
    ids, mask = prompts(1)
    rec = Recorder(target=target, draft=draft)
    ref = greedy(target, ids, mask, assistant_model=draft)
    rec.remove()
    with dump_generate(target, tmp_path, assistant_model=draft):
        out = greedy(target, ids, mask, assistant_model=draft)
    assert torch.equal(out.sequences, ref.sequences)
    for role in ("target", "draft"):
        got, metas = dumped_passes(tmp_path, role)
        assert len(got) == len(rec.passes[role])
        for p, (g, want) in enumerate(zip(got, rec.passes[role])):
            assert_same_pass(g, want, (role, p))
    _, metas = dumped_passes(tmp_path, "target")
    assert "verify" in [m["forward_mode"] for m in metas]
    assert verify_ok(tmp_path)


class Gate(nn.Module):
    """Holds a forward of the target open until the draft has run (two serving threads)."""

    def __init__(self):
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def forward(self, x):
        self.entered.set()
        assert self.release.wait(30)
        return x


def test_shared_module_run_by_another_thread_never_lands_in_the_open_pass_of_the_other_role(tmp_path):
    target, draft = eagle_pair()
    ids = torch.tensor([[1, 5, 9, 7]])
    with torch.no_grad():
        ref_target, ref_draft = target(ids).logits, draft(ids).logits
    gate = Gate()
    target.model.layers[0].register_forward_pre_hook(lambda m, a: (gate(a[0]), None)[1])
    dumpers = [fastdump.attach(target, tmp_path, role="target"), fastdump.attach(draft, tmp_path, role="draft")]
    try:
        results = {}

        def serve_target():
            with torch.no_grad():
                results["target"] = target(ids).logits

        t = threading.Thread(target=serve_target)
        t.start()
        assert gate.entered.wait(30)  # the target's pass is open, inside layer 0
        with torch.no_grad():
            results["draft"] = draft(ids).logits  # runs the shared embedding and LM head
        gate.release.set()
        t.join(30)
    finally:
        for d in dumpers:
            d.close()
    assert same_bits(results["target"], ref_target) and same_bits(results["draft"], ref_draft)
    ds = fastdump.open(tmp_path)
    tgt = ds.load("target", only_rank(ds, "target"), 0)
    mixed = [n for n in tgt if "#1" in n]
    # Either the draft's calls stay out of the target's pass, or the pass is marked mixed and verify fails.
    assert not mixed or not verify_ok(tmp_path), mixed
    assert mixed and ds.meta("target", only_rank(ds, "target"), 0).get("mixed") is True  # flagged, not hidden


# ------------------------------------------------------------------ sessions, dtypes, compile, grads


def forward_steps(model, steps=3):
    """Prefill then decode steps with HF's cache, called as an engine calls the model."""
    ids = torch.tensor([[1, 5, 9, 7], [2, 4, 6, 8]])
    outs, cache = [], None
    with torch.no_grad():
        for _ in range(steps):
            o = model(input_ids=ids, cache=cache, use_cache=True)
            cache = o.cache
            outs.append(o.logits.clone())
            ids = o.logits[:, -1:].argmax(-1)
    return outs


def test_attach_run_close_attach_again_restarts_names_and_pass_ids_and_keeps_the_old_session(tmp_path):
    model = tiny_llama()
    rec = Recorder(target=model)
    ref = forward_steps(model)
    rec.remove()
    sessions = []
    for cycle in range(3):
        with fastdump.attach(model, tmp_path, role="target") as d:
            outs = forward_steps(model, steps=cycle + 1)
        sessions.append(d.dir.name)
        assert all(same_bits(a, b) for a, b in zip(outs, ref))
        assert "forward" not in model.__dict__ and "forward" not in model.lm_head.__dict__
    ds = fastdump.open(tmp_path)
    assert sorted(ds.ranks("target")) == sorted(sessions)
    with pytest.raises(ValueError, match="session"):
        ds.load("target", 0, 0)  # three sessions of rank 0: never guessed, never merged
    for cycle, name in enumerate(sessions):
        assert ds.passes("target", name) == list(range(cycle + 1))  # pass ids restart per session
        for p in range(cycle + 1):
            assert_same_pass(ds.load("target", name, p), rec.passes["target"][p], (cycle, p))
    assert verify_ok(tmp_path)


@pytest.mark.parametrize("convert", ["half", "bfloat16", "to-float64"])
def test_dtype_change_after_attach_is_dumped_in_the_new_dtype_bit_exact(tmp_path, convert):
    def change(m):
        return {"half": m.half, "bfloat16": m.bfloat16, "to-float64": lambda: m.to(torch.float64)}[convert]()

    plain, model = tiny_llama(), tiny_llama()
    change(plain)
    rec = Recorder(target=plain)
    ref = forward_steps(plain, steps=2)
    rec.remove()
    with fastdump.attach(model, tmp_path) as d:
        assert change(model) is model
        outs = forward_steps(model, steps=2)
    assert d.status == "closed"
    assert all(same_bits(a, b) for a, b in zip(outs, ref))
    got, _ = dumped_passes(tmp_path, "target")
    assert len(got) == 2
    for p, (g, want) in enumerate(zip(got, rec.passes["target"])):
        assert_same_pass(g, want, p)
    assert got[0]["lm_head"].dtype == ref[0].dtype != torch.float32
    assert verify_ok(tmp_path)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "grad-checkpointing"])
def test_training_step_with_dumper_attached_keeps_loss_gradients_and_dumps_the_forward(tmp_path, checkpointing):
    ids = torch.tensor([[1, 5, 9, 7, 3], [2, 4, 6, 8, 10]])

    def step(model):
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    plain = tiny_llama()
    rec = Recorder(target=plain)
    want_loss, want_grads = step(plain)
    rec.remove()
    model = tiny_llama()
    with fastdump.attach(model, tmp_path, root_name="LlamaForCausalLM") as d:
        loss, grads = step(model)  # the backward (and its recomputed forwards) runs outside the pass
    assert d.status == "closed"
    assert same_bits(loss, want_loss)
    assert grads.keys() == want_grads.keys() and all(same_bits(grads[n], want_grads[n]) for n in grads)
    got, metas = dumped_passes(tmp_path, "target")
    assert len(got) == 1 and metas[0]["complete"]  # checkpointing's recomputation is no pass of its own
    assert_same_pass(got[0], rec.passes["target"][0])
    assert not any(t.requires_grad for t in got[0].values())
    assert verify_ok(tmp_path)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compiled_hf_model_dumps_what_the_compiled_model_computed(tmp_path, backend):
    """torch.compile of an HF model with a Dumper attached: eager names, the logits it returned bit for
    bit, every module equal to the eager run (bit for bit where the backend keeps eager's kernels)."""
    if backend == "inductor" and shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("inductor on CPU needs a C++ compiler")
    torch._dynamo.reset()
    model = tiny_llama()
    rec = Recorder(target=model)
    ref = forward_steps(model, steps=2)
    rec.remove()
    with fastdump.attach(model, tmp_path) as d:
        compiled = torch.compile(model, backend=backend)
        outs = forward_steps(compiled, steps=2)
    torch._dynamo.reset()
    assert d.status == "closed" and d.stats()["skipped"] == 2  # the cache object of each pass, recorded
    got, metas = dumped_passes(tmp_path, "target")
    assert len(got) == 2 and all(m["complete"] for m in metas)
    for p, (g, want, out) in enumerate(zip(got, rec.passes["target"], outs)):
        assert sorted(g) == sorted(want), p  # eager names, no _orig_mod
        assert same_bits(g["LlamaForCausalLM.logits"], out) and same_bits(g["lm_head"], out)
        for name in want:
            if backend == "inductor":
                torch.testing.assert_close(g[name], want[name], rtol=1e-4, atol=1e-5)
            else:
                assert same_bits(g[name], want[name]), (p, name)
    if backend != "inductor":
        assert all(same_bits(a, b) for a, b in zip(outs, ref))
    assert verify_ok(tmp_path)


def test_module_names_that_look_like_call_indices_are_left_unwrapped_not_mixed(tmp_path):
    """A module literally named ``lin#1`` next to a ``lin`` called twice: two tensors got one name,
    and verify failed the pass as mixed. Now ``d.lin#1`` is left unwrapped (with the reason in
    rank.json) and ``d.lin#1`` in the dump is ``d.lin``'s second call."""

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.d = nn.ModuleDict({"lin": nn.Linear(2, 2), "lin#1": nn.Linear(2, 2)})

        def forward(self, x):
            return self.d["lin"](self.d["lin"](x)), self.d["lin#1"](x)

    model = Odd()
    with torch.no_grad():
        want = model(torch.ones(1, 2))
        with fastdump.attach(model, tmp_path) as d:
            got = model(torch.ones(1, 2))
    assert all(same_bits(a, b) for a, b in zip(got, want))
    assert "d.lin#1" in d.not_wrapped
    tensors = fastdump.open(tmp_path).load("target", 0, 0)
    assert list(tensors) == ["d.lin", "d.lin#1", "Odd.0", "Odd.1"]
    assert same_bits(tensors["d.lin#1"], want[0])
    assert verify_ok(tmp_path)


# ------------------------------------------------------------------------------- the SGLang drop-in

from test_sglang import V as SG_V, ForwardBatch, ForwardMode, LlamaForCausalLM as SGLlama  # noqa: E402
from test_sglang import reference_pass, run as sg_run  # noqa: E402


def sg_eagle_pair():
    """SGLang's EAGLE worker pair: the draft gets the target's embedding and LM head (set_embed_and_head)."""
    target, draft = SGLlama(n_layers=2, seed=0), SGLlama(n_layers=1, seed=1)
    draft.model.embed_tokens = target.model.embed_tokens
    draft.lm_head = target.lm_head
    return target, draft


def eagle_schedule(target, draft, steps=2, k=3):
    """What SGLang's EAGLE worker runs per step: several draft forwards and one target verify."""
    g = torch.Generator().manual_seed(7)

    def fb(mode, n):
        return ForwardBatch(mode, torch.randint(0, SG_V, (n,), generator=g), torch.tensor([n]), torch.arange(n),
                            extend_seq_lens=torch.tensor([n]))

    schedule = [(target, fb(ForwardMode.EXTEND, 5)), (draft, fb(ForwardMode.DRAFT_EXTEND, 5))]
    for _ in range(steps):
        schedule += [(draft, fb(ForwardMode.DECODE, 1)) for _ in range(k)]
        schedule += [(target, fb(ForwardMode.TARGET_VERIFY, k + 1)), (draft, fb(ForwardMode.DRAFT_EXTEND, 2))]
    return schedule


@pytest.fixture
def eagle_sglang_dump(tmp_path):
    """Target and draft dumped by the entry install() puts into SGLang, called as its model runner
    calls it (positional, ``<folder>/target`` and ``<folder>/draft``), under an odd folder name."""
    folder = tmp_path / "dump dir ü #1 [x]"
    target, draft = sg_eagle_pair()
    schedule = eagle_schedule(target, draft)
    refs = [reference_pass(m, fb) for m, fb in schedule]
    dumpers = {role: fsg._sglang_entry(m, os.path.join(str(folder), role) + os.sep, None, 1, 0, 0)
               for role, m in (("target", target), ("draft", draft))}
    outs = []
    try:
        for m, fb in schedule:
            outs.append(sg_run(m, fb))
            for d in dumpers.values():
                d.dump_current_tensors()  # nothing pending after a forward: changes nothing
    finally:
        for d in dumpers.values():
            d.close()
    return folder, target, draft, schedule, refs, outs, dumpers


def test_sglang_eagle_pair_sharing_embedding_one_process_each_role_bit_exact(eagle_sglang_dump):
    folder, target, draft, schedule, refs, outs, dumpers = eagle_sglang_dump
    for role, d in dumpers.items():
        assert Path(d.get_dump_dir()).parent == folder / role  # SGLang's place, the odd name kept
    assert "forward" not in target.model.embed_tokens.__dict__
    ds = fastdump.open(folder)
    assert sorted(ds.roles) == ["draft", "target"]
    seen = {"target": 0, "draft": 0}
    for (m, fb), (want, ref_out), out in zip(schedule, refs, outs):
        role = "target" if m is target else "draft"
        rank = only_rank(ds, role)
        got = ds.load(role, rank, seen[role])
        assert_same_pass(got, want, (role, seen[role]))
        assert same_bits(out.next_token_logits, ref_out.next_token_logits)  # served unchanged
        assert same_bits(got["logits_processor"], out.next_token_logits)
        assert ds.meta(role, rank, seen[role])["forward_mode"] == fb.forward_mode.name
        seen[role] += 1
    assert seen == {"target": 3, "draft": 9}
    assert verify_ok(folder)


def test_sglang_eagle_dump_exports_to_both_sglang_layouts_and_reads_back(eagle_sglang_dump, tmp_path):
    folder, target, draft, schedule, refs, outs, _ = eagle_sglang_dump
    want = {"target": [], "draft": []}
    for (m, _), (rec, _), out in zip(schedule, refs, outs):
        want["target" if m is target else "draft"].append((rec, out))

    out_dir = tmp_path / "pt out"
    assert cli.main(["export", "--format", "sglang", str(folder), str(out_dir)]) == 0
    for role in ("target", "draft"):
        (rank_dir,) = (out_dir / role).iterdir()
        files = sorted(rank_dir.glob("Pass*.pt"))
        assert [f.name for f in files] == [f"Pass{p:05d}.pt" for p in range(len(want[role]))]
        for f, (rec, out) in zip(files, want[role]):
            got = torch.load(f, weights_only=True)
            assert same_bits(got["logits_processor"], out.next_token_logits)
            assert same_bits(got["model.embed_tokens"], rec["model.embed_tokens"])
            assert same_bits(got["model"], rec["model"])
            # the fused add + norm's (out, residual): one list under the module's name, as SGLang's hook
            norm = got["model.layers.0.post_attention_layernorm"]
            assert isinstance(norm, list) and len(norm) == 2
            assert all(same_bits(a, rec[f"model.layers.0.post_attention_layernorm.{i}"]) for i, a in enumerate(norm))
            assert "model.embed_tokens#1" not in got

    dumper_dir = tmp_path / "dumper out"
    assert cli.main(["export", "--format", "sglang-dumper", str(folder), str(dumper_dir)]) == 0
    assert sorted(os.listdir(dumper_dir)) == ["draft", "target"]
    for role in ("target", "draft"):
        rows = {}
        for path in (dumper_dir / role).glob("*.pt"):
            key = dict(kv.split("=", 1) for kv in path.stem.split("___"))
            rows[(key["name"], int(key["step"]))] = path
        steps = {step for _, step in rows}
        assert steps == set(range(len(want[role])))
        for step, (rec, out) in enumerate(want[role]):
            saved = torch.load(rows[("logits_processor", step)], weights_only=False)
            assert same_bits(saved["value"], out.next_token_logits)
            assert saved["meta"]["step"] == step and saved["meta"]["rank"] == 0
            saved = torch.load(rows[("model.embed_tokens", step)], weights_only=False)
            assert same_bits(saved["value"], rec["model.embed_tokens"])


def test_sglang_data_lost_in_one_role_fails_verify_of_the_root(eagle_sglang_dump):
    folder = eagle_sglang_dump[0]
    assert verify_ok(folder)
    segs = list((folder / "draft").glob("*/seg-*.h5"))
    assert segs
    segs[-1].unlink()
    assert not verify_ok(folder)


def test_sglang_rerun_into_the_same_folder_keeps_both_sessions_apart(tmp_path, capsys):
    """A server restarted with the same --debug-tensor-dump-output-folder (same pid in a container):
    two sessions of rank 0 side by side, each whole; the per-tensor export refuses to merge them."""
    model = SGLlama(seed=0)
    fbs = eagle_schedule(model, model, steps=1, k=1)
    refs = [reference_pass(model, fb)[0] for _, fb in fbs]
    for _ in range(2):
        d = fsg._sglang_entry(model, str(tmp_path / "dump"), None, 1, 0, 0)
        for _, fb in fbs:
            sg_run(model, fb)
        d.close()
    ds = fastdump.open(tmp_path / "dump")
    assert len(ds.ranks("target")) == 2
    for rank in ds.ranks("target"):
        for p, want in enumerate(refs):
            assert_same_pass(ds.load("target", rank, p), want, (rank, p))
    assert verify_ok(tmp_path / "dump")
    assert cli.main(["export", "--format", "sglang", str(tmp_path / "dump"), str(tmp_path / "pt")]) == 0
    assert len(list((tmp_path / "pt").iterdir())) == 2  # one directory per session
    capsys.readouterr()
    assert cli.main(["export", "--format", "sglang-dumper", str(tmp_path / "dump"), str(tmp_path / "d")]) != 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "export them separately" in err


def test_sglang_bad_input_is_a_clear_error_before_the_model_is_touched(tmp_path, monkeypatch):
    model = SGLlama(seed=0)
    fb = next(iter(eagle_schedule(model, model)))[1]
    want = sg_run(model, fb).next_token_logits
    monkeypatch.setenv("TENSOR_DUMP_TOP_LEVEL_MODULE_NAME", "transformer")
    with pytest.raises(ValueError, match="transformer"):
        fsg._sglang_entry(model, str(tmp_path / "a"), None, 1, 0, 0)
    monkeypatch.delenv("TENSOR_DUMP_TOP_LEVEL_MODULE_NAME")
    with pytest.raises(ValueError):
        fsg._sglang_entry(model, "", None, 1, 0, 0)
    with pytest.raises((ValueError, TypeError)):
        fsg._sglang_entry(model, str(tmp_path / "b"), ["x"], 1, 0, 0)
    monkeypatch.setenv("FASTDUMP_EVERY", "0")
    with pytest.raises(ValueError, match="FASTDUMP_EVERY"):
        fsg._sglang_entry(model, str(tmp_path / "c"), None, 1, 0, 0)
    for m in model.modules():
        assert "forward" not in m.__dict__  # nothing left wrapped by a refused call
    assert same_bits(sg_run(model, fb).next_token_logits, want)


class KwOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(32, 32) / 8)

    def forward(self, *, hidden_states, scale=None):  # keyword arguments only
        return transformers.modeling_outputs.BaseModelOutputWithPast(last_hidden_state=hidden_states @ self.weight,
                                                                     past_key_values=None, attentions=None)


class InPlace(nn.Module):
    def forward(self, x):
        return x.mul_(2)  # returns its input, changed in place


class WithNone(nn.Module):
    def forward(self, x):
        return (None, x + 1, (None, x - 1))


def test_hf_style_odd_signatures_and_outputs_inside_generate(tmp_path):
    """Leaves called with keywords only, returning a ModelOutput with None fields, a tuple with None
    in it, or their own input changed in place (then changed again by the next module): each dumped as
    it was when it returned; generate() unchanged."""

    def build():
        model = tiny_llama(1)
        layer = model.model.layers[0]
        kw, inplace, with_none = KwOnly(), InPlace(), WithNone()
        layer.kw, layer.inplace, layer.with_none = kw, inplace, with_none
        real = layer.mlp.forward

        def mlp(x):
            h = kw(hidden_states=x).last_hidden_state
            h = inplace(h)
            h = inplace(h)  # the same tensor again: name#1, twice the value of the first call
            return real(h + with_none(h)[1] * 0)

        layer.mlp.forward = mlp
        return model

    ids, mask = prompts(3)
    plain = build()
    rec = Recorder(target=plain)
    ref = greedy(plain, ids, mask)
    rec.remove()
    model = build()
    with dump_generate(model, tmp_path):
        out = greedy(model, ids, mask)
    assert torch.equal(out.sequences, ref.sequences) and all(same_bits(a, b) for a, b in zip(out.logits, ref.logits))
    got, _ = dumped_passes(tmp_path, "target")
    assert len(got) == len(rec.passes["target"]) == 5
    for p, (g, want) in enumerate(zip(got, rec.passes["target"])):
        assert_same_pass(g, want, p)
        first, second = g["model.layers.0.inplace"], g["model.layers.0.inplace#1"]
        assert same_bits(second, first * 2)  # each call as it returned, not the final value
        assert "model.layers.0.kw.last_hidden_state" in g and "model.layers.0.with_none.2.1" in g
    assert verify_ok(tmp_path)


def test_sglang_inputs_by_keyword_are_dumped_with_fastdump_inputs(tmp_path, monkeypatch):
    """FASTDUMP_INPUTS=1 under the SGLang entry: the ForwardBatch given to ``model`` by keyword is
    dumped (its tensor fields; its enum field is no tensor data and is left out)."""
    monkeypatch.setenv("FASTDUMP_INPUTS", "1")
    model = SGLlama(seed=0)
    (_, fb), = eagle_schedule(model, model)[:1]
    want, ref_out = reference_pass(model, fb)
    d = fsg._sglang_entry(model, str(tmp_path), None, 1, 0, 0)
    try:
        out = sg_run(model, fb)
    finally:
        stats = d.close()
    assert same_bits(out.next_token_logits, ref_out.next_token_logits)
    got = fastdump.open(tmp_path).load("target", only_rank(fastdump.open(tmp_path), "target"), 0)
    for k, t in want.items():
        assert same_bits(got[k], t), k
    assert same_bits(got["model.input.forward_batch.input_ids"], fb.input_ids)
    assert same_bits(got["model.input.forward_batch.extend_seq_lens"], fb.extend_seq_lens)
    # the LM head module handed to logits_processor is no tensor: a recorded skip, nothing else is
    skipped = fastdump.open(tmp_path).meta("target", only_rank(fastdump.open(tmp_path), "target"), 0)["skipped"]
    assert [s["name"] for s in skipped] == ["logits_processor.input.2"] and stats["skipped"] == 1
    assert verify_ok(tmp_path)
