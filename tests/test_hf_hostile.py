"""Hugging Face generate() dumped the way users run it: every dumped tensor equals, bit for bit, what
the module computed at that moment (recorded by forward hooks that clone it), the pass metadata says
what ran, and `fastdump verify` passes exactly when nothing was lost or mixed."""

import os
import subprocess
import sys
import warnings

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="transformers not installed (pip install fastdump[hf])")
transformers.logging.set_verbosity_error()

import fastdump  # noqa: E402
from fastdump.integrations.hf import dump_generate  # noqa: E402
from conftest import flatten_output  # noqa: E402


def tiny_llama(layers=2, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, **kw)
    return transformers.LlamaForCausalLM(cfg).eval()


def tiny_t5():
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1,
                                num_heads=2, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return transformers.T5ForConditionalGeneration(cfg).eval()


class Recorder:
    """The reference: each leaf's and the root's output, cloned by forward hooks, one dict per
    forward of ``root`` (until ``last`` returns) that ran at least one module (named as fastdump
    names them)."""

    def __init__(self, root, modules=None, last=None):
        self.passes, self.cur, self.calls, self.active = [], None, {}, False
        self.handles = [root.register_forward_pre_hook(self._begin)]
        named = modules or [(n, m) for n, m in root.named_modules() if n and not list(m.children())] + \
            [(type(root).__name__, root)]
        for name, module in named:
            self.handles.append(module.register_forward_hook(self._hook(name)))
        self.handles.append((last or root).register_forward_hook(self._end))  # the pass ends as it returns

    def _begin(self, module, args):
        self.cur, self.calls, self.active = {}, {}, True

    def _end(self, module, args, out):
        self.active = False

    def _hook(self, name):
        def hook(module, args, out):
            if not self.active:
                return
            if not self.passes or self.passes[-1] is not self.cur:
                self.passes.append(self.cur)
            k = self.calls.get(name, 0)
            self.calls[name] = k + 1
            flatten_output(name if k == 0 else f"{name}#{k}", out, self.cur)
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


def assert_dump_equals(root, role, passes):
    """The role's dump holds exactly ``passes`` (name -> tensor), bit for bit; returns the metas."""
    ds = fastdump.open(root)
    (rank,) = ds.ranks(role)
    ids = ds.passes(role, rank)
    assert len(ids) == len(passes)
    for p, ref in zip(ids, passes):
        got = ds.load(role, rank, p, check=True)
        assert sorted(got) == sorted(ref), p
        for name, t in ref.items():
            assert got[name].dtype == t.dtype and got[name].shape == t.shape and torch.equal(got[name], t), (p, name)
    return [ds.meta(role, rank, p) for p in ids]


def verify(root):
    r = subprocess.run([sys.executable, "-m", "fastdump", "verify", str(root)], capture_output=True, text=True,
                       timeout=60)
    return r.returncode, r.stdout + r.stderr


PROMPT = torch.tensor([[0, 0, 1, 5, 9, 7], [3, 3, 8, 2, 4, 6]])
MASK = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])


@pytest.mark.parametrize("kw, batch", [
    (dict(do_sample=False), 2),                                      # greedy, left padding
    (dict(do_sample=True, top_k=5), 2),                              # sampling
    (dict(num_beams=3, num_return_sequences=2, do_sample=False), 6),  # beams reordered between steps
    (dict(use_cache=False, do_sample=False), 2),                     # no cache: every call is a prefill
    (dict(cache_implementation="static", do_sample=False), 2),
    (dict(prefill_chunk_size=4, do_sample=False), 2),                # chunked prompt: prefill, extend
    (dict(output_hidden_states=True, output_attentions=True, output_logits=True,
          return_dict_in_generate=True, do_sample=False), 2),
])
def test_generate_modes_dump_what_ran(tmp_path, kw, batch):
    model = tiny_llama(attn_implementation="eager")
    rec = Recorder(model)
    with dump_generate(model, tmp_path, writer="thread"):
        model.generate(PROMPT, attention_mask=MASK, max_new_tokens=3, pad_token_id=0, **kw)
    rec.remove()
    metas = assert_dump_equals(tmp_path, "target", rec.passes)
    assert all(m["complete"] and m["batch_size"] == batch for m in metas)
    assert all("candidates" not in m and m["forward_mode"] != "verify" for m in metas)
    if kw.get("use_cache") is False:
        assert [m["forward_mode"] for m in metas] == ["prefill"] * 3
        assert [m["num_tokens"] for m in metas] == [12, 14, 16]
    elif "prefill_chunk_size" in kw:
        assert [(m["forward_mode"], m["cached_tokens"]) for m in metas] == \
            [("prefill", 0), ("extend", 4), ("decode", 6), ("decode", 7)]
    else:
        assert [(m["forward_mode"], m["cached_tokens"]) for m in metas] == \
            [("prefill", 0), ("decode", 6), ("decode", 7)]
    assert verify(tmp_path) == (0, "OK\n")


def test_static_cache_auto_compiled_decode_steps_are_one_pass_each(tmp_path):
    """generate() with a static cache compiles the model's __call__ for its decode steps on a GPU
    (``_valid_auto_compile_criteria``; ``_compile_all_devices`` asks for it on CPU here, backend
    eager): each compiled step is still one whole pass of the target, with the names and, to the
    rounding of the compiled attention, the values of the same generate run eagerly."""
    compile_config = transformers.CompileConfig(backend="eager")
    compile_config._compile_all_devices = True
    metas = {}
    for run, extra in (("eager", {}), ("compiled", {"compile_config": compile_config})):
        model = tiny_llama()
        with dump_generate(model, tmp_path / run, writer="thread"):
            model.generate(PROMPT, attention_mask=MASK, max_new_tokens=4, pad_token_id=0, do_sample=False,
                           cache_implementation="static", **extra)
        assert hasattr(model, "_compiled_call") == (run == "compiled")  # (the decode steps did run compiled)
        ds = fastdump.open(tmp_path / run)
        rank = ds.ranks("target")[0]
        metas[run] = [ds.meta("target", rank, p) for p in ds.passes("target", rank)]
        metas[run + "-tensors"] = [ds.load("target", rank, p) for p in ds.passes("target", rank)]
        assert verify(tmp_path / run) == (0, "OK\n")
    assert [(m["forward_mode"], m["cached_tokens"], m["complete"]) for m in metas["compiled"]] == \
        [("prefill", 0, True), ("decode", 6, True), ("decode", 7, True), ("decode", 8, True)]
    for eager, compiled in zip(metas["eager-tensors"], metas["compiled-tensors"], strict=True):
        assert sorted(eager) == sorted(compiled)
        for name in eager:
            torch.testing.assert_close(compiled[name], eager[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "speculative-sampling"])
def test_assisted_candidates_are_what_the_target_scored(tmp_path, sample):
    """Each target pass of assisted generation says how many candidates it scored: its lm_head has
    one row per candidate plus the next token's (logits_to_keep), and `verify` marks exactly the
    passes that score candidates on top of a cache."""
    model, draft = tiny_llama(2, 0), tiny_llama(1, 1)
    recs = {"target": Recorder(model), "draft": Recorder(draft)}
    with dump_generate(model, tmp_path, assistant_model=draft, writer="thread"):
        model.generate(torch.tensor([[1, 5, 9, 7]]), assistant_model=draft, max_new_tokens=5, do_sample=sample,
                       pad_token_id=0)
    for r in recs.values():
        r.remove()
    metas = assert_dump_equals(tmp_path, "target", recs["target"].passes)
    assert_dump_equals(tmp_path, "draft", recs["draft"].passes)
    for m, ref in zip(metas, recs["target"].passes):
        assert ref["lm_head"].shape[1] == m["candidates"] + 1
        assert m["forward_mode"] == ("prefill" if m["cached_tokens"] == 0 else
                                     "verify" if m["candidates"] else "decode")
    assert metas[-1]["candidates"] == 0 and any(m["forward_mode"] == "verify" for m in metas)
    assert verify(tmp_path) == (0, "OK\n")


def test_prompt_lookup_passes_verify(tmp_path):
    """Prompt lookup decoding has no assistant model, but its target passes score candidates all
    the same: they are `verify` passes with their candidate count, not `extend`."""
    model = tiny_llama()
    rec = Recorder(model)
    with dump_generate(model, tmp_path, writer="thread"):
        model.generate(torch.tensor([[1, 5, 9, 7, 1, 5, 9, 7]]), prompt_lookup_num_tokens=3, max_new_tokens=6,
                       do_sample=False, pad_token_id=0)
    rec.remove()
    metas = assert_dump_equals(tmp_path, "target", rec.passes)
    for m, ref in zip(metas, rec.passes):
        assert ref["lm_head"].shape[1] == m["candidates"] + 1
    modes = [m["forward_mode"] for m in metas]
    assert "verify" in modes and "extend" not in modes
    assert all((m["forward_mode"] == "verify") == (m["cached_tokens"] > 0 and m["candidates"] > 0) for m in metas)


def test_plain_generate_beside_an_assistant_verifies_nothing(tmp_path):
    """dump_generate(assistant_model=draft) does not make every multi-token call of the target a
    `verify`: a generate without the assistant (here a chunked prompt) scores no candidates."""
    model, draft = tiny_llama(2, 0), tiny_llama(1, 1)
    with dump_generate(model, tmp_path, assistant_model=draft, writer="thread"):
        model.generate(torch.tensor([[1, 5, 9, 7, 2, 3, 4, 5]]), prefill_chunk_size=3, max_new_tokens=2,
                       do_sample=False, pad_token_id=0)
    ds = fastdump.open(tmp_path)
    (rank,) = ds.ranks("target")
    metas = [ds.meta("target", rank, p) for p in ds.passes("target", rank)]
    assert [m["forward_mode"] for m in metas] == ["prefill", "extend", "extend", "decode"]
    assert all("candidates" not in m for m in metas)


def test_encoder_decoder_generate_dumps_the_encoder(tmp_path):
    """An encoder-decoder's generate() runs the encoder once, outside any forward of the model: it is
    a pass of its own (`encode`), its tensors what the encoder computed; the decoder's passes count
    the decoder's tokens."""
    model = tiny_t5()
    leaves = [(n, m) for n, m in model.named_modules() if n and not list(m.children())]
    enc = Recorder(model.get_encoder(), [(n, m) for n, m in leaves if n.startswith("encoder.")])
    dec = Recorder(model)
    with dump_generate(model, tmp_path, writer="thread"):
        model.generate(torch.tensor([[5, 6, 7, 8], [9, 9, 9, 9]]), max_new_tokens=3, do_sample=False)
    enc.remove()
    dec.remove()
    assert len(enc.passes) == 1 and enc.passes[0]
    metas = assert_dump_equals(tmp_path, "target", enc.passes + dec.passes)
    assert metas[0]["forward_mode"] == "encode" and metas[0]["num_tokens"] == 8
    assert [(m["forward_mode"], m["batch_size"], m["num_tokens"]) for m in metas[1:]] == \
        [("prefill", 2, 2)] + [("decode", 2, 2)] * (len(metas) - 2)
    assert verify(tmp_path) == (0, "OK\n")


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_encoder_raising_leaves_an_incomplete_pass(tmp_path, exc):
    """The encoder raising mid-way (a hook's error, Ctrl-C): its pass holds what ran, marked
    incomplete; the next generate's passes are whole and their own."""
    model = tiny_t5()
    armed = [True]

    def bomb(module, args, out):
        if armed[0]:
            armed[0] = False
            raise exc("stop")

    h = model.encoder.block[0].layer[1].register_forward_hook(bomb)
    with dump_generate(model, tmp_path, writer="thread"):
        with pytest.raises(exc):
            model.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=2, do_sample=False)
        model.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=2, do_sample=False)
    h.remove()
    ds = fastdump.open(tmp_path)
    (rank,) = ds.ranks("target")
    metas = [ds.meta("target", rank, p) for p in ds.passes("target", rank)]
    assert [(m["forward_mode"], m["complete"]) for m in metas] == \
        [("encode", False), ("encode", True), ("prefill", True), ("decode", True)]
    first = ds.load("target", rank, 0)
    assert "encoder.block.0.layer.0.SelfAttention.q" in first and "encoder.final_layer_norm" not in first
    assert "decoder.embed_tokens" not in ds.load("target", rank, 1)  # each pass holds its own call only
    code, out = verify(tmp_path)
    assert code == 0 and "pass 0 is incomplete" in out


def test_ctrl_c_closing_the_draft_still_closes_the_target(tmp_path):
    """Ctrl-C while dump_generate closes the draft's Dumper: the target's is closed and its model
    restored all the same, then the KeyboardInterrupt goes on."""
    model, draft = tiny_llama(2, 0), tiny_llama(1, 1)
    with pytest.raises(KeyboardInterrupt):
        with dump_generate(model, tmp_path, assistant_model=draft, writer="thread") as dumpers:
            model.generate(torch.tensor([[1, 5, 9, 7]]), assistant_model=draft, max_new_tokens=2, do_sample=False,
                           pad_token_id=0)
            close = dumpers["draft"].close

            def interrupted_close(*a, **k):
                close(*a, **k)
                raise KeyboardInterrupt

            dumpers["draft"].close = interrupted_close
    assert dumpers["target"].status == "closed"
    for m in (model, draft):
        assert not m._forward_pre_hooks and not any("forward" in vars(mod) for mod in m.modules())
    assert "_get_candidate_generator" not in vars(model)
    assert verify(tmp_path) == (0, "OK\n")


def test_early_exit_drafts_are_marked(tmp_path):
    """assistant_early_exit: the target drafts its own candidates with its first layers. Those calls
    are target passes too; `draft: True` tells them from the passes that score the candidates."""
    model = tiny_llama(2, 0)
    rec = Recorder(model)
    with dump_generate(model, tmp_path, writer="thread"):
        model.generate(torch.tensor([[1, 5, 9, 7]]), assistant_early_exit=1, max_new_tokens=4, do_sample=False,
                       pad_token_id=0)
    rec.remove()
    metas = assert_dump_equals(tmp_path, "target", rec.passes)
    assert any(m.get("draft") for m in metas) and any("candidates" in m for m in metas)
    for m, ref in zip(metas, rec.passes):
        drafted = "model.layers.1.mlp.down_proj" not in ref  # (the early exit ran layer 0 only)
        assert m.get("draft", False) == drafted and ("candidates" in m) == (not drafted)


def test_metadata_that_cannot_be_read_never_stops_the_model(tmp_path):
    """A cache object whose length cannot be read (a custom or hybrid cache): the forward runs and is
    dumped, the pass's metadata says why it has none."""
    class Cache:
        def get_seq_length(self):
            raise NotImplementedError("hybrid cache: ask a layer")

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, input_ids, past_key_values=None):
            return self.proj(input_ids.float())

    model = Model()
    x = torch.ones(2, 3, 4)
    with dump_generate(model, tmp_path, writer="thread"):
        out = model(x, past_key_values=Cache())
    ds = fastdump.open(tmp_path)
    (rank,) = ds.ranks("target")
    assert torch.equal(ds.load("target", rank, 0)["proj"], out)
    assert ds.meta("target", rank, 0)["fastdump_meta_error"] == "NotImplementedError: hybrid cache: ask a layer"


def test_model_assisting_itself_is_one_role(tmp_path):
    """assistant_model=model (speculative decoding's sanity check: every candidate accepted): one
    Dumper in role target, its drafting calls marked, each call dumped once. Two Dumpers on one
    model put every call, drafting and verifying alike, in both roles."""
    model = tiny_llama(2, 0)
    rec = Recorder(model)
    with dump_generate(model, tmp_path, assistant_model=model, writer="thread") as dumpers:
        assert dumpers["draft"] is dumpers["target"]
        model.generate(torch.tensor([[1, 5, 9, 7]]), assistant_model=model, max_new_tokens=4, do_sample=False,
                       pad_token_id=0)
    rec.remove()
    assert fastdump.open(tmp_path).roles == ["target"]
    metas = assert_dump_equals(tmp_path, "target", rec.passes)
    assert any(m.get("draft") for m in metas)
    assert all(m.get("draft", False) != ("candidates" in m) for m in metas)
    assert verify(tmp_path) == (0, "OK\n")


def test_both_roles_merge_in_the_order_they_ran(tmp_path):
    """Pass ids count per role; `call_index` orders the passes of both roles as they ran, so the
    draft passes that proposed a verify pass's candidates are the ones just before it."""
    model, draft = tiny_llama(2, 0), tiny_llama(1, 1)
    draft.model.embed_tokens = model.model.embed_tokens  # an assistant sharing the target's embedding
    ran = []
    hooks = [m.register_forward_pre_hook(lambda mod, a, role=role: ran.append(role))
             for role, m in (("target", model), ("draft", draft))]
    recs = {"target": Recorder(model), "draft": Recorder(draft)}
    with dump_generate(model, tmp_path, assistant_model=draft, writer="thread"):
        model.generate(torch.tensor([[1, 5, 9, 7]]), assistant_model=draft, max_new_tokens=4, do_sample=False,
                       pad_token_id=0)
    for h in hooks:
        h.remove()
    merged = []
    for role, rec in recs.items():
        rec.remove()
        metas = assert_dump_equals(tmp_path, role, rec.passes)  # the shared embedding in each role's passes
        assert all("model.embed_tokens" in ref for ref in rec.passes)
        merged += [(m["call_index"], role) for m in metas]
    assert [role for _, role in sorted(merged)] == ran and "draft" in ran
    assert sorted(i for i, _ in merged) == list(range(len(ran)))


def test_close_from_another_thread_mid_generate(tmp_path):
    """close() from another thread while generate() is inside a forward: generate() finishes undisturbed,
    the passes before are whole, the one cut short is incomplete with what ran before the close, and
    nothing after the close is dumped (verify warns, never OK-without-a-word)."""
    import threading

    model = tiny_llama(2, 0)
    rec = Recorder(model)
    inside, closed, n = threading.Event(), threading.Event(), [0]

    def pause(module, args, out):  # the second pass, half-way: let the other thread close
        n[0] += 1
        if n[0] == 2:
            inside.set()
            assert closed.wait(10)

    h = model.model.layers[0].mlp.register_forward_hook(pause)
    result = {}
    with dump_generate(model, tmp_path, writer="thread") as dumpers:
        def run():
            result["out"] = model.generate(torch.tensor([[1, 5, 9, 7]]), max_new_tokens=4, do_sample=False,
                                           pad_token_id=0)
        t = threading.Thread(target=run)
        t.start()
        assert inside.wait(10)
        dumpers["target"].close()
        closed.set()
        t.join(10)
    h.remove()
    rec.remove()
    assert result["out"].shape == (1, 8) and len(rec.passes) == 4
    ds = fastdump.open(tmp_path)
    (rank,) = ds.ranks("target")
    assert ds.passes("target", rank) == [0, 1]
    got0 = ds.load("target", rank, 0)
    assert sorted(got0) == sorted(rec.passes[0]) and all(torch.equal(got0[k], v) for k, v in rec.passes[0].items())
    meta = ds.meta("target", rank, 1)
    assert not meta["complete"] and "closed inside the model's forward" in meta["incomplete"]
    cut = ds.load("target", rank, 1)
    assert cut and all(torch.equal(cut[k], rec.passes[1][k]) for k in cut)
    assert "model.layers.1.mlp.down_proj" not in cut  # (ran after the close)
    code, out = verify(tmp_path)
    assert code == 0 and "pass 1 is incomplete" in out


def test_whisper_encoder_pass_counts_sequences_not_mel_bins(tmp_path):
    """Whisper's encoder takes features [batch, mel bins, frames]: its pass has the batch size and no
    token count (mel bins are no tokens); what it computed is dumped."""
    torch.manual_seed(0)
    cfg = transformers.WhisperConfig(vocab_size=64, num_mel_bins=8, encoder_layers=1, decoder_layers=1,
                                     encoder_attention_heads=2, decoder_attention_heads=2, d_model=16,
                                     encoder_ffn_dim=32, decoder_ffn_dim=32, max_source_positions=10,
                                     max_target_positions=32, decoder_start_token_id=1, pad_token_id=0,
                                     eos_token_id=2, bos_token_id=1, begin_suppress_tokens=None, suppress_tokens=None)
    model = transformers.WhisperForConditionalGeneration(cfg).eval()
    leaves = [(n, m) for n, m in model.named_modules() if n and not list(m.children())]
    enc = Recorder(model.get_encoder(), [(n, m) for n, m in leaves if ".encoder." in f".{n}"])
    dec = Recorder(model)
    with dump_generate(model, tmp_path, writer="thread"):
        model.generate(input_features=torch.randn(2, 8, 20), max_new_tokens=2, do_sample=False)
    enc.remove()
    dec.remove()
    metas = assert_dump_equals(tmp_path, "target", enc.passes + dec.passes)
    assert metas[0]["forward_mode"] == "encode" and metas[0]["batch_size"] == 2 and "num_tokens" not in metas[0]
    assert [m["forward_mode"] for m in metas[1:]] == ["prefill", "decode"]
    assert verify(tmp_path) == (0, "OK\n")


def tiny_llava():
    torch.manual_seed(0)
    vision = transformers.CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=8, patch_size=4, projection_dim=16)
    text = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1)
    return transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=5, vision_feature_select_strategy="full",
        vision_feature_layer=-1)).eval()


def test_vision_language_generate_dumps_the_image_encoder(tmp_path):
    """A VLM's generate() encodes the image (vision tower, projector) before the first forward, outside
    it: that is a pass of its own (`encode`, `modality` image) holding what they computed."""
    model = tiny_llava()
    leaves = [(n, m) for n, m in model.named_modules() if n and not list(m.children())]
    image = Recorder(model.model.vision_tower, [(n, m) for n, m in leaves if "vision_tower" in n or "projector" in n],
                     last=model.model.multi_modal_projector)  # one pass: the tower, then the projector
    text_passes = Recorder(model)
    with dump_generate(model, tmp_path, writer="thread"):
        model.generate(input_ids=torch.tensor([[1, 5, 5, 5, 5, 5, 7, 8]]), pixel_values=torch.randn(1, 3, 8, 8),
                       max_new_tokens=2, do_sample=False, pad_token_id=0)
    image.remove()
    text_passes.remove()
    assert len(image.passes) == 1 and "model.multi_modal_projector.linear_2" in image.passes[0]
    metas = assert_dump_equals(tmp_path, "target", image.passes + text_passes.passes)
    assert (metas[0]["forward_mode"], metas[0]["modality"]) == ("encode", "image")
    assert [m["forward_mode"] for m in metas[1:]] == ["prefill", "decode"]
    assert verify(tmp_path) == (0, "OK\n")


def test_image_encoder_raising_leaves_an_incomplete_pass(tmp_path):
    model = tiny_llava()

    def bomb(module, args, out):
        raise RuntimeError("projector failed")

    h = model.model.multi_modal_projector.register_forward_hook(bomb)
    with dump_generate(model, tmp_path, writer="thread"):
        with pytest.raises(RuntimeError, match="projector failed"):
            model.generate(input_ids=torch.tensor([[1, 5, 5, 5, 5, 5, 7, 8]]), pixel_values=torch.randn(1, 3, 8, 8),
                           max_new_tokens=2, do_sample=False, pad_token_id=0)
    h.remove()
    ds = fastdump.open(tmp_path)
    (rank,) = ds.ranks("target")
    assert ds.passes("target", rank) == [0]
    meta = ds.meta("target", rank, 0)
    assert meta["forward_mode"] == "encode" and meta["incomplete"] == "a forward raised RuntimeError: projector failed"
    assert "model.multi_modal_projector.linear_2" in ds.load("target", rank, 0)  # (what ran before the hook)


def test_candidates_of_an_interrupted_generate_label_no_later_pass(tmp_path):
    """Ctrl-C after the assistant proposed candidates but before the target scored them (a pre-hook
    of the user's): the next generate's prefill, the same length as that candidate sequence, scored
    no candidates."""
    model, draft = tiny_llama(2, 0), tiny_llama(1, 1)
    armed = [True]

    def interrupt(module, args):
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt

    h = model.register_forward_pre_hook(interrupt)  # before dump_generate's: the verify never starts
    with dump_generate(model, tmp_path, assistant_model=draft, writer="thread"):
        with pytest.raises(KeyboardInterrupt):
            model.generate(torch.tensor([[1, 5, 9, 7]]), assistant_model=draft, max_new_tokens=3, do_sample=False,
                           pad_token_id=0)
        model.generate(torch.tensor([[1, 5, 9, 7, 2]]), max_new_tokens=2, do_sample=False, pad_token_id=0)
    h.remove()
    ds = fastdump.open(tmp_path)
    (rank,) = ds.ranks("target")
    metas = [ds.meta("target", rank, p) for p in ds.passes("target", rank)]
    assert [(m["forward_mode"], m["num_tokens"]) for m in metas] == [("prefill", 5), ("decode", 1)]
    assert all("candidates" not in m for m in metas)


class Adapter(torch.nn.Module):
    """A wrapper as PEFT's PeftModel is one: generate() handed down to the model it holds two levels
    down (``base_model.model``), whose own forward, not the wrapper's, is what generate() calls."""

    def __init__(self, model):
        super().__init__()
        self.base_model = torch.nn.Module()
        self.base_model.model = model

    def forward(self, *args, **kwargs):
        return self.base_model.model(*args, **kwargs)

    def generate(self, *args, **kwargs):
        return self.base_model.model.generate(*args, **kwargs)


def test_wrapper_handing_generate_down_is_dumped(tmp_path):
    """dump_generate(peft_model) and peft_model.generate(): the wrapper's forward never runs, so no
    root forward would open a pass and nothing was dumped, verify OK. Each forward of the generation
    model inside is a pass."""
    inner = tiny_llama()
    model = Adapter(inner)
    rec = Recorder(inner, [(f"base_model.model.{n}", m) for n, m in inner.named_modules()
                           if n and not list(m.children())])
    with dump_generate(model, tmp_path, writer="thread"):
        model.generate(PROMPT, attention_mask=MASK, max_new_tokens=3, do_sample=False, pad_token_id=0)
        model(PROMPT)  # the wrapper's own forward: one pass, its modules once
    rec.remove()
    assert len(rec.passes) == 4
    ds = fastdump.open(tmp_path)
    (rank,) = ds.ranks("target")
    assert ds.passes("target", rank) == [0, 1, 2, 3]
    for p, ref in zip(range(3), rec.passes):
        got = ds.load("target", rank, p)
        assert sorted(got) == sorted(ref) and all(torch.equal(got[k], v) for k, v in ref.items())
    assert "Adapter.logits" in ds.load("target", rank, 3)
    metas = [ds.meta("target", rank, p) for p in range(4)]
    assert [(m["forward_mode"], m["cached_tokens"], m["batch_size"]) for m in metas] == \
        [("prefill", 0, 2), ("decode", 6, 2), ("decode", 7, 2), ("prefill", 0, 2)]
    assert verify(tmp_path) == (0, "OK\n")


def test_wrapper_handing_assisted_generate_down_counts_candidates(tmp_path):
    inner, draft = tiny_llama(2, 0), tiny_llama(1, 1)
    model = Adapter(inner)
    rec = Recorder(inner, [(f"base_model.model.{n}", m) for n, m in inner.named_modules()
                           if n and not list(m.children())])
    with dump_generate(model, tmp_path, assistant_model=draft, writer="thread"):
        model.generate(torch.tensor([[1, 5, 9, 7]]), assistant_model=draft, max_new_tokens=4, do_sample=False,
                       pad_token_id=0)
    rec.remove()
    assert "_get_candidate_generator" not in vars(inner)
    ds = fastdump.open(tmp_path)
    (rank,) = ds.ranks("target")
    assert len(ds.passes("target", rank)) == len(rec.passes)
    for p, ref in zip(ds.passes("target", rank), rec.passes):
        meta = ds.meta("target", rank, p)
        assert ref["base_model.model.lm_head"].shape[1] == meta["candidates"] + 1
        assert torch.equal(ds.load("target", rank, p)["base_model.model.lm_head"], ref["base_model.model.lm_head"])
    assert any(ds.meta("target", rank, p)["forward_mode"] == "verify" for p in ds.passes("target", rank))


def test_a_model_refusing_a_hook_leaves_nothing_attached(tmp_path):
    """dump_generate cannot hook a module it needs (a TorchScript encoder refuses forward hooks): the
    error is raised at once, and neither the Dumper nor a wrapper nor a hook is left on the model."""
    class EncoderDecoder(torch.nn.Module):
        config = type("Config", (), {"is_encoder_decoder": True})()

        def __init__(self):
            super().__init__()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # (torch.jit.script's)
                self.encoder = torch.jit.script(torch.nn.Linear(2, 2))
            self.head = torch.nn.Linear(2, 2)

        def get_encoder(self):
            return self.encoder

        def forward(self, x):
            return self.head(self.encoder(x))

    model = EncoderDecoder()
    with pytest.raises(RuntimeError, match="not supported on ScriptModules"):
        with dump_generate(model, tmp_path, writer="thread"):
            pass
    assert not model._forward_pre_hooks and "forward" not in vars(model.head)
    code, out = verify(tmp_path)
    assert code == 0, out  # a Dumper closed with no passes: nothing lost


def test_interrupted_inner_pass_does_not_mark_the_next_forward(tmp_path):
    """Ctrl-C inside a pass dump_generate opened for a handed-down generate: that pass is incomplete;
    the wrapper's own forward after it (a root pass, the inner model inside it) is whole."""
    inner = tiny_llama()
    model = Adapter(inner)
    armed = [True]

    def interrupt(module, args, out):
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt

    h = inner.model.layers[1].register_forward_hook(interrupt)
    with dump_generate(model, tmp_path, writer="thread"):
        with pytest.raises(KeyboardInterrupt):
            model.generate(PROMPT, attention_mask=MASK, max_new_tokens=2, do_sample=False, pad_token_id=0)
        model(PROMPT)
        model.generate(PROMPT, attention_mask=MASK, max_new_tokens=1, do_sample=False, pad_token_id=0)
    h.remove()
    ds = fastdump.open(tmp_path)
    (rank,) = ds.ranks("target")
    metas = [ds.meta("target", rank, p) for p in ds.passes("target", rank)]
    assert [m["complete"] for m in metas] == [False, True, True]
    assert "Adapter.logits" in ds.load("target", rank, 1)
    code, out = verify(tmp_path)
    assert code == 0 and "pass 0 is incomplete" in out and "pass 1 " not in out


def word_tokenizer(words):
    tokenizers = pytest.importorskip("tokenizers")
    t = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    t.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    t.decoder = tokenizers.decoders.WordPiece()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=t, unk_token=words[0], pad_token=words[0],
                                                eos_token=words[1])


def test_universal_assisted_pruned_lm_head_is_dumped(tmp_path):
    """Universal assisted generation (assistant with its own tokenizer, sampling) prunes the
    assistant's lm_head into a new module as generate() starts: its logits are dumped too (no
    wrapper ran for it: the draft's passes had no logits, verify OK)."""
    target_tok = word_tokenizer([f"w{i}" for i in range(128)])
    draft_tok = word_tokenizer([f"w{i}" for i in range(64)] + [f"x{i}" for i in range(32)])
    model = tiny_llama(2, 0)
    torch.manual_seed(1)
    draft = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2)).eval()
    rec = Recorder(draft)
    heads = []  # (module, output) of every Linear call: the pruned head does not exist yet
    hook = torch.nn.modules.module.register_module_forward_hook(
        lambda m, a, out: heads.append((m, out.detach().clone())) if type(m) is torch.nn.Linear else None)
    try:
        with dump_generate(model, tmp_path, assistant_model=draft, writer="thread"):
            model.generate(target_tok("w5 w9 w7 w3", return_tensors="pt").input_ids, assistant_model=draft,
                           tokenizer=target_tok, assistant_tokenizer=draft_tok, max_new_tokens=3, do_sample=True,
                           pad_token_id=0)
    finally:
        hook.remove()
        rec.remove()
    pruned = draft.lm_head.pruned_lm_head  # (transformers leaves the assistant pruned)
    logits = [out for m, out in heads if m is pruned]
    ds = fastdump.open(tmp_path)
    (rank,) = ds.ranks("draft")
    passes = ds.passes("draft", rank)
    assert len(passes) == len(rec.passes) == len(logits) > 0
    for p, ref, want in zip(passes, rec.passes, logits):
        got = ds.load("draft", rank, p)
        assert torch.equal(got.pop("lm_head.pruned_lm_head"), want)
        assert sorted(got) == sorted(k for k in ref if k != "lm_head")  # (the original head no longer runs)
        assert all(torch.equal(got[k], ref[k]) for k in got)
    assert verify(tmp_path) == (0, "OK\n")


def test_assistant_held_inside_the_target_stays_in_its_role(tmp_path):
    """An assistant that is a submodule of the target (a drafter shipped inside the model): its
    forwards are the draft's passes, not also passes of the target's (both Dumpers wrap its leaves)."""
    model, draft = tiny_llama(2, 0), tiny_llama(1, 1)
    model.drafter = draft
    recs = {"target": Recorder(model, [(n, m) for n, m in model.named_modules()
                                       if n and not list(m.children()) and not n.startswith("drafter.")]
                       + [("LlamaForCausalLM", model)]),
            "draft": Recorder(draft)}
    with dump_generate(model, tmp_path, assistant_model=draft, writer="thread"):
        model.generate(torch.tensor([[1, 5, 9, 7]]), assistant_model=draft, max_new_tokens=3, do_sample=False,
                       pad_token_id=0)
    for r in recs.values():
        r.remove()
    for role, rec in recs.items():
        assert_dump_equals(tmp_path, role, rec.passes)


def test_target_modules_a_candidate_generator_calls_itself_join_no_pass(tmp_path, monkeypatch):
    # DFlash (noise embeddings, candidate logits) and Gemma 4's assistant (the last token's embedding)
    # call the target's modules from get_candidates, outside any forward (MTP's calls are inside its
    # MtpModel's forward: draft passes, test_mtp_layers_made_inside_generate_are_the_draft_role). Those calls belong to no pass: each pass holds its
    # forward's calls alone (a call before the forward would take the name, the forward's `#1`).
    from transformers.generation import candidate_generator as cg

    target, draft = tiny_llama(), tiny_llama(layers=1, seed=1)
    made = []
    real = cg.AssistedCandidateGenerator.get_candidates

    def get_candidates(self, input_ids, *args, **kwargs):
        made.append(target.model.embed_tokens(input_ids[:, -1:]))
        out = real(self, input_ids, *args, **kwargs)
        made.append(target.lm_head(made[-1]))
        return out

    monkeypatch.setattr(cg.AssistedCandidateGenerator, "get_candidates", get_candidates)
    fed = []
    hook = target.register_forward_pre_hook(lambda m, args, kwargs: fed.append(kwargs["input_ids"].clone()),
                                            with_kwargs=True)
    with dump_generate(target, tmp_path, assistant_model=draft):
        with torch.no_grad():
            target.generate(PROMPT[:1], assistant_model=draft, max_new_tokens=5, do_sample=False)
    hook.remove()
    assert len(made) >= 4
    ds = fastdump.open(tmp_path)
    assert ds.passes("target", 0) == list(range(len(fed)))
    for p, ids in enumerate(fed):
        dumped = ds.load("target", 0, p)
        assert not [n for n in dumped if "#" in n], (p, list(dumped))
        assert torch.equal(dumped["model.embed_tokens"], target.model.embed_tokens.weight[ids]), p
    assert verify(tmp_path)[0] == 0


def test_mtp_layers_made_inside_generate_are_the_draft_role(tmp_path, monkeypatch):
    """use_mtp=True: generate() makes the multi-token-prediction layers (MtpModel, sharing the target's
    embedding, rotary embedding and head) after attach. They draft the candidates the target
    verifies, as an EAGLE draft does: each MtpModel forward is a `draft` pass holding every MTP leaf
    and its calls of the shared modules, bit for bit; the target's passes hold its own forwards
    alone. They had no role and were not dumped. A second generate's new MtpModel gets a new draft
    Dumper and the first one is closed."""
    from transformers import modeling_layers

    target = tiny_llama(num_mtp_layers=1)
    made = []  # (MtpModel, its Recorder) per generate

    def from_pretrained(cls, main_model, device_map=None, **kw):  # (no checkpoint: fresh MTP weights)
        torch.manual_seed(7)
        mtp = cls(main_model, main_model.config.num_mtp_layers).eval()
        made.append((mtp, Recorder(mtp)))
        return mtp

    monkeypatch.setattr(modeling_layers.MtpModel, "from_pretrained", classmethod(from_pretrained))
    rec = Recorder(target)
    with dump_generate(target, tmp_path, writer="thread") as dumpers:
        with torch.no_grad():
            target.generate(PROMPT[:1], use_mtp=True, max_new_tokens=5, do_sample=False)
        first = dumpers["draft"]
        assert first.status == "running" and len(made) == 1
        made[0][1].remove()
        first_passes, first_target = made[0][1].passes, list(rec.passes)
        rec.passes = []
        with torch.no_grad():
            target.generate(PROMPT[:1], use_mtp=True, max_new_tokens=2, do_sample=False)
        assert len(made) == 2 and first.status == "closed" and dumpers["draft"] is not first
        second = dumpers["draft"]
    made[1][1].remove()
    rec.remove()
    assert second.status == "closed"
    assert len(first_passes) >= 3 and all("layers.0.eh_proj" in p and "shared_head" in p for p in first_passes)
    ds = fastdump.open(tmp_path)
    assert ds.ranks("draft") == [first.dir.name, second.dir.name]
    for dumper, (_, recorded) in zip((first, second), made):
        ids = ds.passes("draft", dumper.dir.name)
        assert len(ids) == len(recorded.passes)
        for p, ref in zip(ids, recorded.passes):
            got = ds.load("draft", dumper.dir.name, p, check=True)
            assert sorted(got) == sorted(ref) and all(torch.equal(got[n], ref[n]) for n in ref), p
            assert ds.meta("draft", dumper.dir.name, p)["complete"]
    assert [ds.meta("draft", first.dir.name, p)["forward_mode"] for p in ds.passes("draft", first.dir.name)] == \
        ["prefill"] + ["decode"] * (len(first_passes) - 1)
    metas = assert_dump_equals(tmp_path, "target", first_target + rec.passes)
    assert all(m["complete"] for m in metas)
    assert verify(tmp_path) == (0, "OK\n")
