"""Hugging Face generate (plain and assisted) dumped as roles target/draft; tiny random Llamas, offline."""

import inspect
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="transformers not installed (pip install fastdump[hf])")

import fastdump  # noqa: E402
from fastdump.integrations.hf import dump_generate, forward_meta  # noqa: E402
from conftest import doc_example


def tiny_llama(layers, seed):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(cfg).eval()


def record_lm_head(model, into):
    def hook(module, args, out):
        into.append(out.detach().clone())  # returns None: output unchanged

    return model.lm_head.register_forward_hook(hook)


def generate(model, draft=None, **kw):
    # assisted generation takes one sequence at a time
    prompt = torch.tensor([[1, 5, 9, 7]] if draft is not None else [[1, 5, 9, 7], [3, 3, 8, 2]])
    return model.generate(prompt, assistant_model=draft, max_new_tokens=6,
                          do_sample=False, output_logits=True, return_dict_in_generate=True,
                          pad_token_id=0, **kw)


def lm_heads(ds, role):
    (rank,) = ds.ranks(role)
    return [ds.load(role, rank, p)["lm_head"] for p in ds.passes(role, rank)], \
           [ds.meta(role, rank, p) for p in ds.passes(role, rank)]


def test_plain_generate(tmp_path):
    model = tiny_llama(2, 0)
    ref = []
    h = record_lm_head(model, ref)  # reference, recorded independently of fastdump
    with dump_generate(model, tmp_path, writer="thread") as dumpers:
        assert set(dumpers) == {"target"}
        out = generate(model)
    h.remove()
    got, metas = lm_heads(fastdump.open(tmp_path), "target")
    assert len(got) == len(ref) == len(out.logits)
    for g, r, logits in zip(got, ref, out.logits):
        assert torch.equal(g, r)
        assert torch.equal(g[:, -1, :], logits)  # what generate() returned
    assert [m["forward_mode"] for m in metas] == ["prefill"] + ["decode"] * (len(got) - 1)
    assert metas[0]["batch_size"] == 2 and metas[0]["num_tokens"] == 8 and metas[1]["num_tokens"] == 2


def test_assisted_generate_two_roles(tmp_path):
    model, draft = tiny_llama(2, 0), tiny_llama(1, 1)
    # Reference run without fastdump: the dumped run must compute exactly the same.
    ref = {"target": [], "draft": []}
    hooks = [record_lm_head(model, ref["target"]), record_lm_head(draft, ref["draft"])]
    ref_out = generate(model, draft)
    for h in hooks:
        h.remove()

    sig = inspect.signature(model.forward)
    with dump_generate(model, tmp_path, assistant_model=draft, writer="thread") as dumpers:
        assert set(dumpers) == {"target", "draft"}
        assert inspect.signature(model.forward) == sig  # generate() inspects it
        out = generate(model, draft)
    assert "forward" not in model.__dict__ and "forward" not in draft.__dict__
    assert torch.equal(out.sequences, ref_out.sequences)

    ds = fastdump.open(tmp_path)
    assert sorted(ds.roles) == ["draft", "target"]
    for role in ("target", "draft"):
        got, metas = lm_heads(ds, role)
        assert len(got) == len(ref[role]) > 1
        for g, r in zip(got, ref[role]):
            assert torch.equal(g, r)
        assert metas[0]["forward_mode"] == "prefill"
        assert all(m["forward_mode"] in ("decode", "verify" if role == "target" else "extend") for m in metas[1:])
    got, metas = lm_heads(ds, "target")
    assert any(m["forward_mode"] == "verify" and m["num_tokens"] > m["batch_size"] for m in metas)
    # generate()'s logits are rows of the target's lm_head outputs, pass by pass, in order
    rows = [g[0, i] for g in got for i in range(g.shape[1])]
    it = iter(rows)
    assert all(any(torch.equal(logit[0], row) for row in it) for logit in out.logits)


def test_forward_meta_modes():
    ids1, ids3 = torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long)

    class Cache:
        def __init__(self, n):
            self.n = n

        def get_seq_length(self):
            return self.n

    assert forward_meta((ids3,), {})["forward_mode"] == "prefill"
    assert forward_meta((), {"input_ids": ids3, "cache": Cache(0)})["forward_mode"] == "prefill"
    assert forward_meta((), {"input_ids": ids1, "cache": Cache(5)}) == \
        {"forward_mode": "decode", "batch_size": 2, "num_tokens": 2, "cached_tokens": 5}
    assert forward_meta((), {"input_ids": ids3, "past_key_values": Cache(5)}, verifies=True)["forward_mode"] == "verify"
    assert forward_meta((), {"input_ids": ids3, "past_key_values": Cache(5)})["forward_mode"] == "extend"
    # a counted verify says how many candidates; a call scoring none is what its shape says
    assert forward_meta((), {"input_ids": ids3, "cache": Cache(5)}, candidates=2) == \
        {"forward_mode": "verify", "batch_size": 2, "num_tokens": 6, "cached_tokens": 5, "candidates": 2}
    assert forward_meta((), {"input_ids": ids1, "cache": Cache(5)}, candidates=0)["forward_mode"] == "decode"
    # an encoder-decoder's call: the decoder's tokens, not the encoder's
    assert forward_meta((), {"input_ids": ids3, "decoder_input_ids": ids1, "cache": Cache(5)})["num_tokens"] == 2
    legacy = ((torch.zeros(2, 4, 7, 8), torch.zeros(2, 4, 7, 8)),)
    assert forward_meta((), {"inputs_embeds": torch.zeros(2, 1, 16), "past_key_values": legacy})["cached_tokens"] == 7


def test_docs_example(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns = {}
    exec(compile(doc_example("hf"), "INTEGRATIONS.md:hf", "exec"), ns)
    ds = fastdump.open("dump")
    assert sorted(ds.roles) == ["draft", "target"]
    got, _ = lm_heads(ds, "target")
    rows = iter([g[0, i] for g in got for i in range(g.shape[1])])
    assert all(any(torch.equal(logit[0], row) for row in rows) for logit in ns["out"].logits)
