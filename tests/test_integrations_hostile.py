"""Hostile tests of the integrations, as a user of an inference engine meets them.

The rules checked throughout: what is dumped equals, bit for bit, what each module computed at the
moment it returned (references come from an identical run WITHOUT fastdump, recorded with plain
forward hooks that clone at hook time); the served model's outputs are unchanged by dumping (bit for
bit against that run); draft and target never overwrite or mix each other's files; ``fastdump
verify`` fails whenever data was lost or mixed; bad input is a clear error, never a crash of the model.

Tiny models only (hidden 32, 1-2 layers), built from configs: no network, no GPU."""

import dataclasses
import enum
import glob
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

V = 96


# ------------------------------------------------------------------------------------------ helpers


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach(), b.detach()
    return a.dtype == b.dtype and a.shape == b.shape and \
        torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def assert_same_pass(got: dict, want: dict, what=""):
    assert sorted(got) == sorted(want), (what, sorted(set(got) ^ set(want)))
    for k in want:
        assert same_bits(got[k], want[k]), (what, k, got[k].dtype, want[k].dtype, got[k].shape, want[k].shape)


def tiny_llama(layers=2, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, **kw)
    return transformers.LlamaForCausalLM(cfg).eval()


def flatten(name, value, into):
    """fastdump's naming of one output (tensor, tuple/list .i, dict/ModelOutput .key, dataclass .field)."""
    if isinstance(value, torch.Tensor):
        into[name] = value.detach().clone()
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            flatten(f"{name}.{i}", v, into)
    elif isinstance(value, dict):
        for k, v in value.items():
            flatten(f"{name}.{k}", v, into)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            flatten(f"{name}.{f.name}", getattr(value, f.name), into)


class Recorder:
    """Plain forward hooks on every leaf module and the root of each model given: one dict per root
    call, {fastdump name: clone at hook time}, per role. A module shared by several models is recorded
    in the pass of the root that is running (the innermost one)."""

    def __init__(self, **models):
        self.passes = {role: [] for role in models}
        self._stack, self._calls, self._handles = [], [], []
        for role, model in models.items():
            root = type(model).__name__
            self._handles.append(model.register_forward_pre_hook(self._begin(role)))
            self._handles.append(model.register_forward_hook(self._end(root)))
            for name, mod in model.named_modules():
                if name and not mod._modules:
                    self._handles.append(mod.register_forward_hook(self._leaf(name)))

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
        flatten(name if k == 0 else f"{name}#{k}", out, rec)

    def _leaf(self, name):
        def hook(mod, args, out):
            if self._stack:
                self._record(name, out)
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
