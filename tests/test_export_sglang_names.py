"""`fastdump export` against SGLang's own conventions.

The reference here is SGLang's tensor-dump hook rewritten for the test from its documented behaviour
(sglang.srt.debug_utils.tensor_dump_forward_hook): forward hooks on the leaf modules and on the
top-level `model`, whose hook adds its ForwardBatch, saves the pending dict as PassNNNNN.pt and then
adds its own output; a tuple output is stored as its one non-None tensor or as a list; a second call
overwrites the first. The dumper layout is read back with a loader written from SGLang's documented
file naming (name=…___step=…___rank=…___dump_index=….pt holding {"value", "meta"})."""

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import fastdump
from fastdump import export
from fastdump.integrations import sglang as fsg
from conftest import write_rank_dir
from test_sglang import (H, V, ForwardBatch, LogitsProcessor, LogitsProcessorOutput, ParallelLMHead, RadixAttention,
                         RMSNorm, batches)


class ParallelLinear(nn.Linear):
    """SGLang's *ParallelLinear: (output, output_bias) with the bias None."""

    def forward(self, x):
        return super().forward(x), None


class RotaryEmbedding(nn.Module):
    def forward(self, positions, q, k):  # a tuple of two tensors: one list under the name in SGLang
        c = torch.cos(positions.float())[:, None]
        return q * c, k * c


class Gate(nn.Module):
    def forward(self, x):  # (None, t): stored under the name alone in SGLang
        return None, torch.sigmoid(x)


class Scale(nn.Module):
    def forward(self, x):  # called twice per layer: SGLang keeps the second call
        return x * 1.5


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = RMSNorm()
        self.qkv_proj = ParallelLinear(H, 3 * H, bias=False)
        self.rotary_emb = RotaryEmbedding()
        self.attn = RadixAttention()
        self.o_proj = ParallelLinear(H, H, bias=False)
        self.gate = Gate()
        self.scale = Scale()

    def forward(self, positions, x, forward_batch, residual):
        if residual is None:
            residual = x.clone()
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        qkv, _ = self.qkv_proj(x)
        q, k, v = qkv.chunk(3, -1)
        q, k = self.rotary_emb(positions, q, k)
        o, _ = self.o_proj(self.attn(q, k, v, forward_batch))
        _, g = self.gate(o)
        return self.scale(self.scale(o * g)), residual


class Model(nn.Module):
    def __init__(self, n_layers, aux=False):
        super().__init__()
        self.embed_tokens = nn.Embedding(V, H)
        self.layers = nn.ModuleList(Layer() for _ in range(n_layers))
        self.norm = RMSNorm()
        self.aux = aux

    def forward(self, input_ids, positions, forward_batch):
        x, residual = self.embed_tokens(input_ids), None
        for i, layer in enumerate(self.layers):
            x, residual = layer(positions, x, forward_batch, residual)
            if i == 0:
                first = x
        x, _ = self.norm(x, residual)
        # aux: (hidden, an earlier layer's hidden), as EAGLE3 targets return their aux hidden states
        return (x, first) if self.aux else x


class ForCausalLM(nn.Module):
    def __init__(self, n_layers=2, seed=0, aux=False):
        torch.manual_seed(seed)
        super().__init__()
        self.model = Model(n_layers, aux)
        self.lm_head = ParallelLMHead()
        self.logits_processor = LogitsProcessor()

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch):
        hidden = self.model(input_ids, positions, forward_batch)  # positional, as SGLang's models do
        hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        return self.logits_processor(input_ids, hidden, self.lm_head, forward_batch)


class SGLangHookReference:
    """SGLang's hook semantics (see the module docstring); .cpu() is a copy on GPU, so clone here."""

    def __init__(self, model, directory, dump_layers=None):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True)
        self.current, self.pass_id = {}, 0
        # SGLang recurses through _modules: a module held under several names gets a hook on each
        for name, module in model.named_modules(remove_duplicate=False):
            parts = name.split(".")
            if dump_layers is not None and parts[:2] == ["model", "layers"] and len(parts) > 2 \
                    and int(parts[2]) not in dump_layers:
                continue
            if name and (name == "model" or not module._modules):
                module.register_forward_hook(self._hook(name, name == "model"))

    def add(self, name, value):
        if isinstance(value, (tuple, list)):
            tensors = [v.clone() for v in value if v is not None]
            self.current[name] = tensors[0] if len(tensors) == 1 else tensors
        elif isinstance(value, torch.Tensor):
            self.current[name] = value.clone()
        elif isinstance(value, LogitsProcessorOutput):
            self.current[name] = value.next_token_logits.clone()
        elif isinstance(value, ForwardBatch):
            for field in ("input_ids", "seq_lens", "positions"):
                self.current[f"{name}.forward_batch_info.{field}"] = getattr(value, field).clone()

    def save(self):
        if self.current:
            torch.save(self.current, self.dir / f"Pass{self.pass_id:05d}.pt")
            self.current, self.pass_id = {}, self.pass_id + 1

    def _hook(self, name, top):
        def hook(module, inputs, output):
            if top:
                for item in inputs:
                    if isinstance(item, ForwardBatch):
                        self.add(name, item)
                self.save()
            if output is not None:
                self.add(name, output)
        return hook


def assert_same_value(got, want, what):
    assert isinstance(got, list) == isinstance(want, list), what
    got, want = (got, want) if isinstance(got, list) else ([got], [want])
    assert len(got) == len(want), what
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, what
        assert torch.equal(g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)), what


def load_passes(directory):
    return {p.name: torch.load(p, weights_only=True) for p in sorted(Path(directory).glob("Pass*.pt"))}


@pytest.fixture(params=[False, True], ids=["tensor-top", "tuple-top"])
def sglang_and_fastdump(tmp_path, request):
    """The same three forwards dumped by SGLang's hook (reference) and by fastdump's drop-in; the
    top-level ``model`` returns a tensor, or a tuple (hidden, aux)."""
    fbs = list(batches())
    ref_model = ForCausalLM(aux=request.param)
    SGLangHookReference(ref_model, tmp_path / "sglang")
    for fb in fbs:
        ref_model(fb.input_ids, fb.positions, fb)
    model = ForCausalLM(aux=request.param)
    d = fsg.register_forward_hook_for_model(model, tmp_path / "fd", writer="thread")
    for fb in fbs:
        model(fb.input_ids, fb.positions, fb)
    d.close()
    return tmp_path / "sglang", tmp_path / "fd"


def run_cli(*argv):
    parser = argparse.ArgumentParser()
    export.add_arguments(parser.add_subparsers())
    args = parser.parse_args(["export", *map(str, argv)])
    return args.func(args)


def test_pass_shift_reproduces_sglang_files(sglang_and_fastdump, tmp_path):
    ref_dir, dump = sglang_and_fastdump
    assert run_cli("--format", "sglang", "--sglang-pass-shift", dump, tmp_path / "out") == 0
    (rank_dir,) = (tmp_path / "out").iterdir()
    got, want = load_passes(rank_dir), load_passes(ref_dir)
    assert list(got) == list(want) == ["Pass00000.pt", "Pass00001.pt", "Pass00002.pt"]
    for file, ref in want.items():
        # SGLang's order too: its top hook adds the ForwardBatch after the layers, just before saving
        assert list(got[file]) == list(ref), file
        for name in ref:
            assert_same_value(got[file][name], ref[name], f"{file}:{name}")
        assert (rank_dir / file).read_bytes() == (ref_dir / file).read_bytes(), file  # the same file, byte for byte
    # the conventions this covers, checked by name
    layer = want["Pass00001.pt"]
    assert isinstance(layer["model.layers.0.input_layernorm"], torch.Tensor)  # first layer: no residual
    assert isinstance(layer["model.layers.1.input_layernorm"], list)  # (x, residual)
    assert isinstance(layer["model.layers.0.rotary_emb"], list)
    assert isinstance(layer["model.layers.0.qkv_proj"], torch.Tensor)  # (out, None)
    assert isinstance(layer["model.layers.0.gate"], torch.Tensor)  # (None, t)
    assert "model" in layer and "model" not in want["Pass00000.pt"]  # late by one pass


def test_without_shift_a_pass_file_holds_its_own_logits(sglang_and_fastdump, tmp_path):
    ref_dir, dump = sglang_and_fastdump
    export.export_sglang(dump, tmp_path / "out")
    (rank_dir,) = (tmp_path / "out").iterdir()
    got, want = load_passes(rank_dir), load_passes(ref_dir)
    assert list(got) == ["Pass00000.pt", "Pass00001.pt", "Pass00002.pt"]
    for i, (file, tensors) in enumerate(got.items()):
        for name, value in tensors.items():
            late = name in ("model", "logits_processor")
            ref_file = f"Pass{i + 1:05d}.pt" if late else file
            if ref_file in want:  # SGLang never writes the last pass's late outputs
                assert_same_value(value, want[ref_file][name], f"{file}:{name}")
        assert {"model", "logits_processor", "model.layers.1.scale"} <= set(tensors)
        # SGLang's order: layers, the ForwardBatch (taken by the top hook), then the late outputs
        assert list(tensors)[-5:] == [f"model.forward_batch_info.{f}" for f in ("input_ids", "seq_lens", "positions")] \
            + ["model", "logits_processor"], file
    # storage keeps fastdump's names: tuple elements and the second call
    stored = fastdump.open(dump).load("target", None, 0)
    assert {"model.layers.1.input_layernorm.0", "model.layers.0.gate.1", "model.layers.0.scale#1"} <= set(stored)
    assert torch.equal(got["Pass00000.pt"]["model.layers.0.scale"], stored["model.layers.0.scale#1"])


_TOP_NAME = re.compile(r"^(?:model(?:#1)?(?:\.forward_batch_info\.\w+|\.\d)|logits_processor(?:#1)?)$")


def test_top_module_called_twice_in_a_pass_with_tuple_outputs(tmp_path):
    """Two forwards in one pass (a draft's steps under begin_pass): the top module's tuple output,
    its ForwardBatch and the logits of each call are named in capture order (``name#k.i``, as every
    leaf), hold what the model computed, and the export writes the file SGLang's naming gives: the
    last call under each name, at the first call's position, as from the earlier naming
    (``name.i#k``)."""
    fbs = list(batches())[1:]  # two decode steps
    model = ForCausalLM(aux=True)
    seen = {"model": [], "logits": []}  # reference: plain hooks, cloned at hook time
    hooks = [model.model.register_forward_hook(lambda m, a, out: seen["model"].append([t.clone() for t in out])),
             model.logits_processor.register_forward_hook(
                 lambda m, a, out: seen["logits"].append(out.next_token_logits.clone()))]
    for fb in fbs:
        model(fb.input_ids, fb.positions, fb)
    for h in hooks:
        h.remove()
    d = fsg.register_forward_hook_for_model(model, tmp_path / "fd", writer="thread")
    d.dumper.begin_pass()
    outs = [model(fb.input_ids, fb.positions, fb) for fb in fbs]
    d.dump_current_tensors()
    d.close()
    assert "forward" not in model.model.__dict__ and "forward" not in model.logits_processor.__dict__

    ds = fastdump.open(tmp_path / "fd")
    assert ds.passes("target", None) == [0]
    stored = ds.load("target", None, 0)
    fields = ("input_ids", "seq_lens", "positions")
    assert [n for n in stored if _TOP_NAME.match(n)] == \
        [f"model.forward_batch_info.{f}" for f in fields] + ["model.0", "model.1", "logits_processor"] + \
        [f"model#1.forward_batch_info.{f}" for f in fields] + ["model#1.0", "model#1.1", "logits_processor#1"]
    for k, (fb, out) in enumerate(zip(fbs, outs)):
        call = "" if k == 0 else f"#{k}"
        for f in fields:
            assert_same_value(stored[f"model{call}.forward_batch_info.{f}"], getattr(fb, f), f)
        for i in (0, 1):
            assert_same_value(stored[f"model{call}.{i}"], seen["model"][k][i], f"model{call}.{i}")
        assert_same_value(stored[f"logits_processor{call}"], seen["logits"][k], "logits")
        assert_same_value(stored[f"logits_processor{call}"], out.next_token_logits, "logits")

    assert export.export_sglang(tmp_path / "fd", tmp_path / "out") == 1
    (rank_dir,) = (tmp_path / "out").iterdir()
    got = load_passes(rank_dir)["Pass00000.pt"]
    assert_same_value(got["model"], seen["model"][1], "model")  # SGLang: the last call, as one list
    assert_same_value(got["logits_processor"], seen["logits"][1], "logits_processor")
    assert_same_value(got["model.forward_batch_info.input_ids"], fbs[1].input_ids, "input_ids")
    # the same file as the earlier naming of the drop-in (second call: name.i#1, name.field#1)
    earlier = {re.sub(r"^(model|logits_processor)#(\d+)(.*)$", r"\1\3#\2", n): t for n, t in stored.items()}
    assert "model.0#1" in earlier and "model.forward_batch_info.seq_lens#1" in earlier
    modules = [n for n, _ in model.named_modules() if n]
    want = export.sglang_names(earlier, modules)
    fields = [f"model.forward_batch_info.{f}" for f in fields]
    assert list(got) == [n for n in want if n not in fields and n != "model" and n != "logits_processor"] + \
        fields + ["model", "logits_processor"]  # SGLang's order: the ForwardBatch just before the top output
    for name in want:
        assert_same_value(got[name], want[name], name)


@pytest.mark.parametrize("dump_layers, tied", [(None, False), ([1, 2], False), ([0], False), ([2], True)],
                         ids=["all", "not-layer-0", "layer-0", "tied-embeddings"])
def test_a_leaf_shared_by_every_layer_is_under_each_of_its_names(tmp_path, dump_layers, tied):
    """SGLang's get_rope returns one cached rotary_emb for every layer: its hook is registered on
    each path, so every call is stored under every layer's name (the last call stays). fastdump wraps
    the instance once, under its first name; the export writes SGLang's file, and with dump_layers
    not keeping layer 0 the shared leaf is still dumped (its other names are kept). Tied embeddings
    (lm_head is model.embed_tokens): SGLang stores the embedding output as ``lm_head`` too."""
    def shared_rope(seed):
        model = ForCausalLM(n_layers=3, seed=seed)
        for layer in model.model.layers:
            layer.rotary_emb = model.model.layers[0].rotary_emb
        if tied:
            model.lm_head = model.model.embed_tokens
        return model

    fbs = list(batches())
    ref = shared_rope(0)
    SGLangHookReference(ref, tmp_path / "sglang", dump_layers)
    for fb in fbs:
        ref(fb.input_ids, fb.positions, fb)
    model = shared_rope(0)
    d = fsg.register_forward_hook_for_model(model, tmp_path / "fd", dump_layers, writer="thread")
    for fb in fbs:
        model(fb.input_ids, fb.positions, fb)
    d.close()
    assert run_cli("--format", "sglang", "--sglang-pass-shift", tmp_path / "fd", tmp_path / "out") == 0
    (rank_dir,) = (tmp_path / "out").iterdir()
    got, want = load_passes(rank_dir), load_passes(tmp_path / "sglang")
    assert list(got) == list(want) == ["Pass00000.pt", "Pass00001.pt", "Pass00002.pt"]
    kept = [0, 1, 2] if dump_layers is None else dump_layers
    for file, ref_tensors in want.items():
        assert [n for n in ref_tensors if n.endswith("rotary_emb")] == [f"model.layers.{i}.rotary_emb" for i in kept]
        assert ("lm_head" in ref_tensors) == tied
        assert list(got[file]) == list(ref_tensors), file
        for name in ref_tensors:
            assert_same_value(got[file][name], ref_tensors[name], f"{file}:{name}")
        assert (rank_dir / file).read_bytes() == (tmp_path / "sglang" / file).read_bytes(), file

    # the dumper layout: a file per call (SGLang's dumper), the shared leaf's 3 calls under its first kept name
    assert run_cli("--format", "sglang-dumper", tmp_path / "fd", tmp_path / "dumper") == 0
    rows = read_meta(tmp_path / "dumper")
    assert [r["name"] for r in rows if r["step"] == 0 and ".rotary_emb." in r["name"]] == \
        [f"model.layers.{kept[0]}.rotary_emb.{j}" for _ in range(3) for j in (0, 1)]


def test_fastdump_names_on_request(sglang_and_fastdump, tmp_path):
    _, dump = sglang_and_fastdump
    export.export_sglang(dump, tmp_path / "out", names="fastdump")
    (rank_dir,) = (tmp_path / "out").iterdir()
    got = load_passes(rank_dir)["Pass00001.pt"]
    assert set(got) == set(fastdump.open(dump).load("target", None, 1))


class NoExperts(nn.Module):
    def forward(self, x):  # (None, None): a rank holding none of a layer's experts; SGLang stores []
        return None, None


class Maybe(nn.Module):
    def forward(self, x, skip):  # called twice a layer: (t, t) and then () (SGLang: [] in place)
        return () if skip else (x * 2, x - 1)


class EmptyOutputsLayer(Layer):
    def __init__(self):
        super().__init__()
        self.experts = NoExperts()
        self.maybe = Maybe()
        self.empty = Maybe()

    def forward(self, positions, x, forward_batch, residual):
        self.experts(x)
        self.maybe(x, False)
        self.maybe(x, True)
        self.empty(x, True)  # (first call, C wrapper) () holding no tensor
        return super().forward(positions, x, forward_batch, residual)


def empty_outputs_model():
    model = ForCausalLM()
    torch.manual_seed(3)
    model.model.layers = nn.ModuleList(EmptyOutputsLayer() for _ in range(2))
    return model


def test_outputs_holding_no_tensor_export_as_sglang_stores_them(tmp_path):
    """A module returning (None, None) or () stores no tensor; SGLang's hook stores [] under its name
    (last call wins, at the first call's place). The pass's structure record lets the export write
    SGLang's file byte for byte (key order included), and a reader that ignores the record still
    reads the pass."""
    fbs = list(batches())
    ref_model = empty_outputs_model()
    SGLangHookReference(ref_model, tmp_path / "sglang")
    for fb in fbs:
        ref_model(fb.input_ids, fb.positions, fb)
    model = empty_outputs_model()
    d = fsg.register_forward_hook_for_model(model, tmp_path / "fd", writer="thread")
    for fb in fbs:
        model(fb.input_ids, fb.positions, fb)
    d.close()
    want = load_passes(tmp_path / "sglang")
    assert want["Pass00001.pt"]["model.layers.0.experts"] == [] and want["Pass00001.pt"]["model.layers.1.maybe"] == []

    assert run_cli("--format", "sglang", "--sglang-pass-shift", tmp_path / "fd", tmp_path / "out") == 0
    (rank_dir,) = (tmp_path / "out").iterdir()
    got = load_passes(rank_dir)
    assert list(got) == list(want)
    for file in want:
        assert list(got[file]) == list(want[file]), file
        assert (rank_dir / file).read_bytes() == (tmp_path / "sglang" / file).read_bytes(), file

    ds = fastdump.open(tmp_path / "fd")
    assert not any(".experts" in n or ".empty" in n for n in ds.names("target", None))
    assert ds.structure("target", None, 0)["model.layers.0.experts"]["kinds"] == {"": "tuple:empty"}
    assert ds.structure("target", None, 0)["model.layers.1.maybe#1"]["kinds"] == {"": "tuple:empty"}
    assert "structure" not in ds.meta("target", None, 0)  # (the metadata a user sees is unchanged)
    assert subprocess.run([sys.executable, "-m", "fastdump", "verify", str(tmp_path / "fd")],
                          capture_output=True).returncode == 0


def test_a_dict_output_with_digit_keys_keeps_its_names(tmp_path):
    """{"0": a, "1": b} is stored as name.0, name.1, like a tuple's parts; the export keeps a dict's
    parts under their names (SGLang's hook saves no dict), where a tuple's become one list. A dict
    inside a tuple keeps its parts' names too."""
    class Router(nn.Module):
        def forward(self, x):
            return {"0": x + 1, "1": x * 2}

    class Pair(nn.Module):
        def forward(self, x):
            return x - 1, {"0": x * 3}

    class Top(nn.Module):
        def __init__(self):
            super().__init__()
            self.router, self.pair, self.tup = Router(), Pair(), RotaryEmbedding()

        def forward(self, x):
            return self.router(x)["0"] + self.pair(x)[0] + self.tup(torch.arange(4), x, x)[0]

    model, x = Top(), torch.randn(4, H)
    d = fastdump.attach(model, tmp_path / "fd", writer="thread")
    model(x)
    d.close()
    modules = [n for n, _ in model.named_modules() if n]
    (d.dir / fsg.NAMES_FILE).write_text(json.dumps({"top": "model", "modules": modules}))  # (as the drop-in)
    export.export_sglang(tmp_path / "fd", tmp_path / "out")
    (got,) = load_passes(next((tmp_path / "out").iterdir())).values()
    ds = fastdump.open(tmp_path / "fd")
    stored = ds.load("target", None, 0)
    assert {"router.0", "router.1", "pair.0", "pair.1.0", "tup.0", "tup.1"} <= set(stored)
    for name in ("router.0", "router.1", "pair.1.0"):
        assert_same_value(got[name], stored[name], name)
    assert_same_value(got["router.0"], x + 1, "router.0")
    assert_same_value(got["pair"], x - 1, "pair")  # (t, dict): its one tensor part under the name
    assert_same_value(got["tup"], [stored["tup.0"], stored["tup.1"]], "tup")  # a tuple: one list
    assert "router" not in got
    direct = export.sglang_names(stored, modules, ds.structure("target", None, 0))
    assert list(got) == list(direct)
    # a dump made before the structure was recorded: names alone, as before
    assert_same_value(export.sglang_names(stored, modules)["router"], [stored["router.0"], stored["router.1"]], "old")


def test_sglang_names_rules():
    t = [torch.full((1,), float(i)) for i in range(6)]
    modules = {"model", "model.norm", "model.experts", "model.experts.0", "model.experts.1", "lm"}
    stored = {"model.forward_batch_info.input_ids": t[0], "model.experts.0": t[1], "model.experts.1": t[2],
              "model.norm.0": t[3], "model.norm.1": t[4], "model.norm#1.1": t[5], "extra.value": t[0],
              "lm.0": t[1], "lm#1": t[2]}
    got = export.sglang_names(stored, modules)
    assert list(got) == ["model.forward_batch_info.input_ids", "model.experts.0", "model.experts.1", "model.norm",
                         "extra.value", "lm"]
    assert got["model.experts.1"] is t[2]  # a child module named by a number is not a tuple element
    assert got["model.norm"] is t[5]  # second call, (None, t): overwrites the first call's list
    assert got["lm"] is t[2]
    assert export.sglang_names(stored, None) == stored


# --- SGLang's dumper layout ---------------------------------------------------------------------------


def read_meta(directory):
    """Rows of a dumper directory, parsed as SGLang's naming documents: the file stem is
    `___`-separated `key=value` pairs; step, rank and dump_index are integers."""
    rows = []
    for path in Path(directory).glob("*.pt"):
        row = dict(kv.split("=", 1) for kv in path.stem.split("___"))
        for key in ("step", "rank", "dump_index"):
            row[key] = int(row[key])
        rows.append({"filename": path.name, **row})
    return sorted(rows, key=lambda r: (r["rank"], r["dump_index"]))


def test_dumper_layout_reads_back(tmp_path):
    fbs = list(batches())
    models, want = {}, {}
    for tp_rank in (0, 1):  # two tensor-parallel ranks of one role: one directory, rank in the file name
        models[tp_rank] = ForCausalLM(seed=tp_rank)
        d = fsg.register_forward_hook_for_model(models[tp_rank], tmp_path / "fd", None, 2, tp_rank, 0,
                                                writer="thread")
        for fb in fbs:
            models[tp_rank](fb.input_ids, fb.positions, fb)
        d.close()
    ds = fastdump.open(tmp_path / "fd")
    for tp_rank, rank in enumerate(ds.ranks("target")):
        modules = set(name for name, _ in models[tp_rank].named_modules() if name)
        want[tp_rank] = {p: export.sglang_calls(ds.load("target", rank, p), modules) for p in ds.passes("target", rank)}

    assert run_cli("--format", "sglang-dumper", tmp_path / "fd", tmp_path / "out") == 0
    rows = read_meta(tmp_path / "out")
    assert {r["rank"] for r in rows} == {0, 1}
    for rank in (0, 1):
        mine = [r for r in rows if r["rank"] == rank]
        assert [r["dump_index"] for r in mine] == list(range(1, len(mine) + 1))
        expected = [(p, name, i, t) for p, calls in want[rank].items() for (name, _), value in calls
                    for i, t in (enumerate(value) if isinstance(value, list) else [(None, value)])]
        assert len(mine) == len(expected)
        for row, (p, name, i, t) in zip(mine, expected):
            assert row["step"] == p and row["name"] == (name if i is None else f"{name}.{i}")
            saved = torch.load(tmp_path / "out" / row["filename"], weights_only=False)
            assert torch.equal(saved["value"], t) and saved["value"].dtype == t.dtype
            meta = saved["meta"]
            assert {k: meta[k] for k in ("name", "step", "rank", "dump_index")} == \
                {k: row[k] for k in ("name", "step", "rank", "dump_index")}
            assert meta["sglang_parallel_info"]["tp_size"] == 2 and meta["sglang_parallel_info"]["tp_rank"] == rank
            assert meta["world_size"] == 2 and meta["fastdump_pass"]["forward_mode"] in ("EXTEND", "DECODE")
    names = {r["name"] for r in rows}
    assert {"model.layers.1.input_layernorm.0", "model.layers.1.input_layernorm.1", "model.layers.0.qkv_proj",
            "model.layers.0.scale", "logits_processor", "model.forward_batch_info.input_ids"} <= names


def test_dumper_layout_roles_and_bad_names(tmp_path):
    for role in ("target", "draft"):
        with fastdump.attach(None, tmp_path / "fd", role=role, writer="thread") as d:
            d.dump("x", torch.arange(3))
    assert export.export_sglang_dumper(tmp_path / "fd", tmp_path / "out") == 2
    assert sorted(os.listdir(tmp_path / "out")) == ["draft", "target"]
    assert [r["name"] for r in read_meta(tmp_path / "out" / "draft")] == ["x"]
    with fastdump.attach(None, tmp_path / "bad", writer="thread") as d:
        d.dump("a=b", torch.arange(3))
    with pytest.raises(ValueError, match="'a=b'"):
        export.export_sglang_dumper(tmp_path / "bad", tmp_path / "out2")


def test_pass_shift_is_refused_for_the_dumper_layout(sglang_and_fastdump, tmp_path, capsys):
    _, dump = sglang_and_fastdump
    assert run_cli("--format", "sglang-dumper", "--sglang-pass-shift", dump, tmp_path / "out") == 2
    assert "--format sglang only" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_pass_shift_moves_pipeline_proxy_outputs_too():
    t = [torch.full((1,), float(i)) for i in range(6)]
    passes = [(0, {"model.forward_batch_info.input_ids": t[0], "model.embed_tokens": t[1],
                   "model.pp_proxy_tensors.hidden_states": t[2]}),
              (1, {"model.forward_batch_info.input_ids": t[3], "model.embed_tokens": t[4],
                   "model.pp_proxy_tensors.hidden_states": t[5]})]
    got = dict(export._shift_late(iter(passes), "model"))
    assert list(got[0]) == ["model.forward_batch_info.input_ids", "model.embed_tokens"]
    assert got[1]["model.pp_proxy_tensors.hidden_states"] is t[2] and got[1]["model.embed_tokens"] is t[4]


def test_pass_shift_carries_a_late_part_into_the_next_pass_only():
    """Passes 0, 1 and 3 (2 not in the dump: every=, a lost pass): pass 1's late part (``model``'s
    output) belongs to pass 2's file, which is not written; it must not land in pass 3's."""
    passes = [(p, {"model.embed_tokens": torch.full((1,), float(p)), "model": torch.full((1,), -float(p))})
              for p in (0, 1, 3)]
    got = dict(export._shift_late(iter(passes), "model"))
    assert list(got) == [0, 1, 3]
    assert list(got[1]) == ["model", "model.embed_tokens"] and got[1]["model"] is passes[0][1]["model"]
    assert list(got[3]) == ["model.embed_tokens"] and got[3]["model.embed_tokens"] is passes[2][1]["model.embed_tokens"]


# --- sglang_names.json: each rank's own, read as safely as every file of a dump --------------------------

MLP = {p: {"model.layers.0.mlp.0": torch.full((2,), float(p)), "model.layers.0.mlp.1": torch.full((2,), -float(p)),
           "model": torch.zeros(1)} for p in range(2)}
MODULES = {"top": "model", "modules": ["model", "model.layers.0", "model.layers.0.mlp"]}


def mlp_rank(root, tp_rank, session):
    ranks = {"tp_rank": tp_rank, "tp_size": 2, "pp_rank": 0, "pp_size": 1, "rank": tp_rank}
    path = root / "target" / f"TP{tp_rank}_PP0_Rank{tp_rank}_pid100_20260101T000000.000000Z-{session}"
    return write_rank_dir(path, MLP, rank=ranks)


def test_multi_root_export_reads_each_ranks_own_module_list(tmp_path, capsys):
    roots = [tmp_path / "host0", tmp_path / "host1"]
    for tp_rank, root in enumerate(roots):
        (mlp_rank(root, tp_rank, f"0000000{tp_rank}") / "sglang_names.json").write_text(json.dumps(MODULES))
    assert export.export_sglang(roots, tmp_path / "out") == 4
    assert "no module list" not in capsys.readouterr().err
    assert len(os.listdir(tmp_path / "out")) == 2
    for rank_dir in (tmp_path / "out").iterdir():
        got = load_passes(rank_dir)["Pass00001.pt"]
        assert list(got) == ["model.layers.0.mlp", "model"]  # SGLang's names: the tuple as one list
        assert [t.tolist() for t in got["model.layers.0.mlp"]] == [[1.0, 1.0], [-1.0, -1.0]]


@pytest.mark.parametrize("kind", ["symlink", "fifo", "not an object"])
def test_a_module_list_that_is_not_a_plain_file_is_not_read(tmp_path, kind):
    """A link out of the dump is not followed and a FIFO is not waited on: the names fall back to the
    stored ones, as without the file, and stderr says why."""
    rank_dir = mlp_rank(tmp_path / "dump", 0, "00000001")
    names_file = rank_dir / "sglang_names.json"
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps(MODULES))
    if kind == "symlink":
        names_file.symlink_to(outside)
    elif kind == "fifo":
        os.mkfifo(names_file)
    else:
        names_file.write_text(json.dumps(["model"]))
    # a subprocess: a FIFO opened for reading would block this test forever
    done = subprocess.run([sys.executable, "-m", "fastdump", "export", str(tmp_path / "dump"), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "Traceback" not in done.stderr
    assert "warning: target/" in done.stderr and "sglang_names.json not read (" in done.stderr
    assert "names kept as stored" in done.stderr
    if kind == "symlink":
        assert "symbolic links are not followed" in done.stderr
    (out_dir,) = (tmp_path / "out").iterdir()
    got = load_passes(out_dir)["Pass00001.pt"]
    assert list(got) == list(MLP[1])  # fastdump's names: the module list was not used
    assert all(torch.equal(got[name], MLP[1][name]) for name in got)


@pytest.mark.parametrize("aliases, refused", [({"model.layers.0.mlp": "x"}, None),
                                               ({"model.layers.0.mlp": ["a", "../outside"]}, "'/'")],
                         ids=["not a list", "a name no file can hold"])
def test_recorded_aliases_are_checked(tmp_path, capsys, aliases, refused):
    """sglang_names.json's "aliases" (a shared leaf's SGLang names) come from the dump: a malformed
    entry is not used (names kept as stored, said on stderr), and a name the dumper layout cannot
    hold is refused before anything is written."""
    rank_dir = mlp_rank(tmp_path / "dump", 0, "00000001")
    (rank_dir / "sglang_names.json").write_text(json.dumps({**MODULES, "aliases": aliases}))
    code = run_cli("--format", "sglang-dumper", tmp_path / "dump", tmp_path / "out")
    err = capsys.readouterr().err
    if refused:
        assert code == 2 and refused in err and not (tmp_path / "out").exists()
        assert not (tmp_path / "outside").exists()
    else:
        assert code == 0 and '"aliases" is not {name: [name, ...]}' in err and "names kept as stored" in err
        assert {r["name"] for r in read_meta(tmp_path / "out")} == set(MLP[0])


# --- rank.json's rank numbers, as the dumper layout uses them ---------------------------------------------

BAD_RANKS = {
    "not an object (5)": (5, 'rank.json "rank" is 5, not an object of rank numbers'),
    "not an object (x)": ("x", 'rank.json "rank" is "x", not an object of rank numbers'),
    "not an object ([0])": ([0], 'rank.json "rank" is [0], not an object of rank numbers'),
    "no rank number": ({"tp_rank": 0, "tp_size": 1}, "rank.json has no rank number (rank.rank)"),
    "rank a bool": ({"rank": True}, "rank.json rank.rank is true, expected an integer >= 0"),
    "tp_size null": ({"rank": 0, "tp_size": None}, "rank.json rank.tp_size is null, expected an integer 1..65536"),
    "tp_size 0": ({"rank": 0, "tp_size": 0}, "rank.json rank.tp_size is 0, expected an integer 1..65536"),
    "tp_size a string": ({"rank": 0, "tp_size": "2"}, 'rank.json rank.tp_size is "2", expected an integer 1..65536'),
    "pp_size 1.5": ({"rank": 0, "pp_size": 1.5}, "rank.json rank.pp_size is 1.5, expected an integer 1..65536"),
    "negative rank": ({"rank": -1}, "rank.json rank.rank is -1, expected an integer >= 0"),
    "huge rank": ({"rank": 10**30}, "rank.json rank.rank 1000000000000000000000000000000 is not below tp_size * pp_size = 1"),
    "tp_rank outside tp_size": ({"rank": 0, "tp_rank": 2, "tp_size": 2}, "rank.json rank.tp_rank 2 is not below rank.tp_size 2"),
    "rank outside the world": ({"rank": 4, "tp_size": 2, "pp_size": 2}, "rank.json rank.rank 4 is not below tp_size * pp_size = 4"),
}


@pytest.mark.parametrize("case", list(BAD_RANKS))
def test_dumper_layout_refuses_a_malformed_rank_json(tmp_path, capsys, case):
    from fastdump import cli

    value, message = BAD_RANKS[case]
    rank_dir = mlp_rank(tmp_path / "dump", 0, "00000001")
    info = json.loads((rank_dir / "rank.json").read_text())
    (rank_dir / "rank.json").write_text(json.dumps({**info, "rank": value}))
    code = cli.main(["export", "--format", "sglang-dumper", str(tmp_path / "dump"), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert f"fastdump export: target/{rank_dir.name}: {message}" in err
    assert not (tmp_path / "out").exists()  # checked before anything is written
    with pytest.raises(ValueError, match=re.escape(message)):
        export.export_sglang_dumper(tmp_path / "dump", tmp_path / "out")


def test_dumper_layout_keeps_every_call_of_a_module(tmp_path):
    """SGLang's dumper writes one file per dump() call: a name dumped twice in a step is two files
    (read_meta tells them apart by dump_index, its duplicate_index). The dumper layout used to keep
    only a module's last call per pass, as the Pass*.pt layout must (a dict entry overwritten), and
    to copy a shared leaf's last call under each layer's name: earlier calls were dropped without a
    word. Now every call is a file of its own, in call order, a shared leaf's under its first name
    (SGLang's dumper hooks named_modules(), which lists a shared module once)."""
    def model_with_shared_rope(seed):
        model = ForCausalLM(n_layers=3, seed=seed)
        for layer in model.model.layers:
            layer.rotary_emb = model.model.layers[0].rotary_emb
        return model

    fbs = list(batches())
    ref = model_with_shared_rope(0)
    calls = every_call(ref)  # a shared module once, under its first name
    for fb in fbs:
        ref(fb.input_ids, fb.positions, fb)
    model = model_with_shared_rope(0)
    d = fsg.register_forward_hook_for_model(model, tmp_path / "fd", writer="thread")
    for fb in fbs:
        model(fb.input_ids, fb.positions, fb)
    d.close()

    assert run_cli("--format", "sglang-dumper", tmp_path / "fd", tmp_path / "out") == 0
    got = {}
    for row in read_meta(tmp_path / "out"):  # in dump_index order
        value = torch.load(tmp_path / "out" / row["filename"], weights_only=False)["value"]
        got.setdefault((row["step"], row["name"]), []).append(value)
    batch_info = {key for key in got if ".forward_batch_info." in key[1]}
    assert set(got) - batch_info == set(calls)
    assert len(got[0, "model.layers.0.scale"]) == 2 and len(got[0, "model.layers.0.rotary_emb.0"]) == 3
    assert not any(".layers.1.rotary_emb" in name for _, name in got)
    for key, want in calls.items():
        assert len(got[key]) == len(want), key
        for g, w in zip(got[key], want):
            assert_same_value(g, w, key)


# --- both layouts read as SGLang's own tools read them, against the models' values --------------------

# The rank directory SGLang's hook makes (TensorDumper: TP{tp_rank}_PP{pp_rank}_Rank{rank}_pid{pid},
# rank = tp_size * pp_rank + tp_rank); its readers glob PassNNNNN.pt in it and torch.load each file.
_SGLANG_RANK_DIR = re.compile(r"^TP(\d+)_PP(\d+)_Rank(\d+)_pid(\d+)$")


def every_call(model):
    """{(step, name): [value of each call, in call order]} of ``model``'s leaves, ``model`` and
    ``logits_processor``, grouped as SGLang's hook groups an output (a LogitsProcessorOutput is its
    logits, a tuple its non-None tensors: one under the name, several as a list) and then split as
    SGLang's dumper splits a list (``name.0``, ``name.1``); recorded by plain hooks from now on."""
    calls, step = {}, [-1]

    def grouped(value):
        if isinstance(value, LogitsProcessorOutput):
            value = value.next_token_logits
        if isinstance(value, torch.Tensor):
            return [("", value.clone())]
        tensors = [v.clone() for v in value if v is not None]
        return [("", tensors[0])] if len(tensors) == 1 else [(f".{i}", t) for i, t in enumerate(tensors)]

    def record(name):
        def hook(module, inputs, output):
            for suffix, t in grouped(output):
                calls.setdefault((step[0], name + suffix), []).append(t)
        return hook

    model.model.register_forward_pre_hook(lambda m, args: step.__setitem__(0, step[0] + 1))
    for name, module in model.named_modules():  # each module once, under its first name
        if name and (name == "model" or name == "logits_processor" or not module._modules):
            module.register_forward_hook(record(name))
    return calls


def test_both_layouts_read_back_with_sglangs_reading_idiom(tmp_path):
    """An EAGLE pair as SGLang's model runner registers it (``<folder>/target`` at TP 2, ``<folder>/draft``
    at TP 1), exported in both layouts and read back only as SGLang's tools read them:

    - Pass layout: ``<out>/<role>/TP{tp}_PP{pp}_Rank{rank}_pid{pid}/PassNNNNN.pt``, each
      ``torch.load``-ed into {name: tensor or list of tensors}; it equals, file for file and bit for
      bit, what SGLang's hook (SGLangHookReference) writes for the same model on that rank
      (``--sglang-pass-shift``: SGLang's late model/logits_processor outputs);
    - dumper layout: every ``*.pt`` of ``<out>/<role>/`` (all ranks in one directory), its stem split on
      ``___`` into ``key=value`` (the value split off at the first ``=``), step/rank/dump_index read as
      integers; rows of one (rank, step, name) in dump_index order are that name's calls in call
      order (the comparator's duplicate_index); each file a dict ``{"value": tensor, "meta": dict}``
      whose meta repeats the file name's fields and gives world_rank, world_size and
      sglang_parallel_info (tp_rank, tp_size). Each value equals the model's output for that call."""
    fbs = list(batches())
    plan = {("target", 0): (2, 0), ("target", 1): (2, 1), ("draft", 0): (1, 0)}  # (tp_size, seed)
    seeds = {("target", 0): 0, ("target", 1): 1, ("draft", 0): 2}
    refs, calls = {}, {}
    for (role, tp_rank), (tp_size, _) in plan.items():
        ref_model = ForCausalLM(n_layers=1 if role == "draft" else 2, seed=seeds[role, tp_rank])
        SGLangHookReference(ref_model, tmp_path / "sglang" / role / f"rank{tp_rank}")
        for fb in fbs:
            ref_model(fb.input_ids, fb.positions, fb)
        refs[role, tp_rank] = tmp_path / "sglang" / role / f"rank{tp_rank}"
        model = ForCausalLM(n_layers=1 if role == "draft" else 2, seed=seeds[role, tp_rank])
        calls[role, tp_rank] = every_call(model)
        d = fsg.register_forward_hook_for_model(model, str(tmp_path / "fd" / role), None, tp_size, tp_rank, 0,
                                                writer="thread")
        for fb in fbs:
            model(fb.input_ids, fb.positions, fb)
        d.close()

    assert run_cli("--format", "sglang", "--sglang-pass-shift", tmp_path / "fd", tmp_path / "pass") == 0
    assert run_cli("--format", "sglang-dumper", tmp_path / "fd", tmp_path / "dumper") == 0
    assert sorted(os.listdir(tmp_path / "pass")) == sorted(os.listdir(tmp_path / "dumper")) == ["draft", "target"]

    # Pass layout: one SGLang rank directory per (role, TP rank), named as SGLang names it
    for role in ("target", "draft"):
        rank_dirs = sorted(os.listdir(tmp_path / "pass" / role))
        found = {}
        for name in rank_dirs:
            m = _SGLANG_RANK_DIR.match(name)
            assert m, name
            tp, pp, rank, pid = map(int, m.groups())
            assert pp == 0 and rank == plan[role, tp][0] * pp + tp and pid == os.getpid()
            found[tp] = tmp_path / "pass" / role / name
        assert sorted(found) == sorted(tp for r, tp in plan if r == role)
        for tp, rank_dir in found.items():
            got, want = load_passes(rank_dir), load_passes(refs[role, tp])
            assert list(got) == list(want) == ["Pass00000.pt", "Pass00001.pt", "Pass00002.pt"]
            for file, ref in want.items():
                assert list(got[file]) == list(ref), (role, tp, file)
                for name in ref:
                    assert_same_value(got[file][name], ref[name], f"{role}/TP{tp}/{file}:{name}")
                assert torch.load(rank_dir / file, weights_only=True).keys() == ref.keys()

    # dumper layout: one directory per role, every rank's files in it
    for role in ("target", "draft"):
        rows = []
        for path in (tmp_path / "dumper" / role).glob("*.pt"):
            row = dict(kv.split("=", 1) for kv in path.stem.split("___"))
            rows.append({"filename": path.name, **row, **{k: int(row[k]) for k in ("step", "rank", "dump_index")}})
        rows.sort(key=lambda r: (r["rank"], r["dump_index"]))
        assert {r["rank"] for r in rows} == {tp for r, tp in plan if r == role}
        got = {}
        for row in rows:
            saved = torch.load(tmp_path / "dumper" / role / row["filename"], weights_only=True)
            assert set(saved) == {"value", "meta"}
            meta = saved["meta"]
            assert {k: meta[k] for k in ("name", "step", "rank", "dump_index")} == \
                {k: row[k] for k in ("name", "step", "rank", "dump_index")}
            tp_size = plan[role, row["rank"]][0]
            assert meta["world_rank"] == row["rank"] and meta["world_size"] == tp_size
            assert meta["sglang_parallel_info"]["tp_rank"] == row["rank"]
            assert meta["sglang_parallel_info"]["tp_size"] == tp_size
            got.setdefault((row["rank"], row["step"], row["name"]), []).append(saved["value"])
        for tp in (tp for r, tp in plan if r == role):
            assert [r["dump_index"] for r in rows if r["rank"] == tp] == \
                list(range(1, sum(r["rank"] == tp for r in rows) + 1))
            mine = {key[1:]: values for key, values in got.items() if key[0] == tp}
            batch = {key for key in mine if ".forward_batch_info." in key[1]}
            assert set(mine) - batch == set(calls[role, tp])
            for (step, name), want in calls[role, tp].items():
                assert len(mine[step, name]) == len(want), (role, tp, step, name)
                for g, w in zip(mine[step, name], want):
                    assert_same_value(g, w, f"{role}/rank{tp}/step{step}/{name}")
            for step, fb in enumerate(fbs):
                for field in ("input_ids", "seq_lens", "positions"):
                    (value,) = mine[step, f"model.forward_batch_info.{field}"]
                    assert_same_value(value, getattr(fb, field), f"{role}/rank{tp}/step{step}/{field}")


def test_sglang_names_read_a_list_output_as_a_tuple_and_a_dict_with_digit_keys_as_names():
    """By the pass's structure record: a module that returned a list is stored by SGLang as one list
    under its name, as a tuple is; one that returned a dict keyed '0', '1' keeps its parts' names."""
    t = [torch.full((1,), float(i)) for i in range(4)]
    stored = {"mod.0": t[0], "mod.1": t[1], "dct.0": t[2], "dct.1": t[3]}
    structure = {"mod": {"kinds": {"": "list:2"}}, "dct": {"kinds": {"": "dict:2"}}}
    got = export.sglang_names(stored, {"mod", "dct"}, structure)
    assert list(got) == ["mod", "dct.0", "dct.1"]
    assert [id(v) for v in got["mod"]] == [id(t[0]), id(t[1])] and got["dct.0"] is t[2] and got["dct.1"] is t[3]
