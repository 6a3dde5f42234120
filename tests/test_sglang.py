"""SGLang drop-in, tested without SGLang on stand-ins shaped like SGLang's models.

Reference values come from plain forward hooks that clone at hook time on an identical run; the dump
must equal them bit for bit."""

import enum
import math
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

import fastdump
from fastdump.capture import close_all
from fastdump import format as fmt
from fastdump.integrations import sglang as fsg
from conftest import doc_example

H, V = 16, 32


class ForwardMode(enum.IntEnum):
    EXTEND = 1
    DECODE = 2
    TARGET_VERIFY = 3
    DRAFT_EXTEND = 4


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    input_ids: torch.Tensor
    seq_lens: torch.Tensor
    positions: torch.Tensor
    extend_seq_lens: torch.Tensor | None = None

    @property
    def batch_size(self):
        return self.seq_lens.shape[0]


@dataclass
class LogitsProcessorOutput:
    next_token_logits: torch.Tensor
    hidden_states: torch.Tensor | None = None


class Part(nn.Module):
    direct = False  # True: call children with .forward() like DeepSeek-V4 in SGLang (sglang#26269)

    def call(self, child, *args, **kwargs):
        return child.forward(*args, **kwargs) if self.direct else child(*args, **kwargs)


class RMSNorm(Part):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(H) + 0.5)

    def forward(self, x, residual=None):
        if residual is not None:  # fused add + norm, in place on residual as in SGLang's kernel
            residual.add_(x)
            x = residual
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return out if residual is None else (out, residual)


class RadixAttention(Part):
    def forward(self, q, k, v, forward_batch):
        s = (q @ k.T) / math.sqrt(q.shape[-1])
        return torch.softmax(s, -1) @ v


class Attention(Part):
    def __init__(self):
        super().__init__()
        self.qkv_proj = nn.Linear(H, 3 * H, bias=False)
        self.attn = RadixAttention()
        self.o_proj = nn.Linear(H, H, bias=False)

    def forward(self, positions, x, forward_batch):
        q, k, v = self.call(self.qkv_proj, x).chunk(3, -1)
        return self.call(self.o_proj, self.call(self.attn, q + positions[:, None], k, v, forward_batch))


class SiluAndMul(Part):
    def forward(self, x):
        a, b = x.chunk(2, -1)
        return nn.functional.silu(a) * b


class MLP(Part):
    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Linear(H, 4 * H, bias=False)
        self.act_fn = SiluAndMul()
        self.down_proj = nn.Linear(2 * H, H, bias=False)

    def forward(self, x):
        return self.call(self.down_proj, self.call(self.act_fn, self.call(self.gate_up_proj, x)))


class DecoderLayer(Part):
    def __init__(self):
        super().__init__()
        self.self_attn = Attention()
        self.mlp = MLP()
        self.input_layernorm = RMSNorm()
        self.post_attention_layernorm = RMSNorm()

    def forward(self, positions, x, forward_batch, residual):
        if residual is None:
            residual = x.clone()
            x = self.call(self.input_layernorm, x)
        else:
            x, residual = self.call(self.input_layernorm, x, residual)
        x = self.call(self.self_attn, positions, x, forward_batch)
        x, residual = self.call(self.post_attention_layernorm, x, residual)
        return self.call(self.mlp, x), residual


class LlamaModel(Part):
    def __init__(self, n_layers):
        super().__init__()
        self.embed_tokens = nn.Embedding(V, H)
        self.layers = nn.ModuleList(DecoderLayer() for _ in range(n_layers))
        self.norm = RMSNorm()

    def forward(self, input_ids, positions, forward_batch):
        x, residual = self.call(self.embed_tokens, input_ids), None
        for layer in self.layers:
            x, residual = self.call(layer, positions.float(), x, forward_batch, residual)
        x, _ = self.call(self.norm, x, residual)
        return x


class LogitsProcessor(Part):
    def forward(self, input_ids, hidden, lm_head, forward_batch):
        if forward_batch.forward_mode == ForwardMode.EXTEND:  # last token of each sequence
            hidden = hidden[torch.cumsum(forward_batch.extend_seq_lens, 0) - 1]
        return LogitsProcessorOutput(next_token_logits=hidden @ lm_head.weight.T)


class ParallelLMHead(nn.Module):
    """Like SGLang's: holds the weight, never called (LogitsProcessor multiplies by it)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(V, H))


class LlamaForCausalLM(Part):
    def __init__(self, n_layers=2, direct=False, seed=0):
        torch.manual_seed(seed)
        super().__init__()
        self.model = LlamaModel(n_layers)
        self.lm_head = ParallelLMHead()
        self.logits_processor = LogitsProcessor()
        self.set_direct(direct)

    def set_direct(self, direct):
        for m in self.modules():
            m.direct = direct

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch):
        hidden = self.call(self.model, input_ids, positions, forward_batch=forward_batch)
        return self.call(self.logits_processor, input_ids, hidden, self.lm_head, forward_batch)


def batches():
    """extend of two sequences (3 and 2 tokens), then two decode steps."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (5,), generator=g)
    yield ForwardBatch(ForwardMode.EXTEND, ids, torch.tensor([3, 2]), torch.tensor([0, 1, 2, 0, 1]),
                       extend_seq_lens=torch.tensor([3, 2]))
    for step in range(2):
        yield ForwardBatch(ForwardMode.DECODE, torch.randint(0, V, (2,), generator=g),
                           torch.tensor([4 + step, 3 + step]), torch.tensor([3 + step, 2 + step]))


def run(model, fb):
    return model(fb.input_ids, fb.positions, fb)


def flatten(name, value, out):
    if isinstance(value, torch.Tensor):
        out[name] = value.detach().clone()
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            flatten(f"{name}.{i}", v, out)
    elif isinstance(value, LogitsProcessorOutput):
        out[name] = value.next_token_logits.clone()
    return out


def reference_pass(model, fb, dump_layers=None):
    """One forward with plain hooks (clone at hook time) on what SGLang dumps: leaves + `model`."""
    model_direct = model.direct
    model.set_direct(False)  # plain hooks need __call__
    rec, handles = {}, []

    def hook(name):
        def record(mod, args, out):
            flatten(name, out, rec)  # returns None: the output is left alone
        return record

    for name, mod in model.named_modules():
        parts = name.split(".")
        if dump_layers is not None and parts[:2] == ["model", "layers"] and len(parts) > 2 \
                and int(parts[2]) not in dump_layers:
            continue
        if name == "model" or (name and not mod._modules and name != "lm_head"):
            handles.append(mod.register_forward_hook(hook(name)))
    for f in ("input_ids", "seq_lens", "positions"):
        rec[f"model.forward_batch_info.{f}"] = getattr(fb, f).clone()
    out = run(model, fb)
    for h in handles:
        h.remove()
    model.set_direct(model_direct)
    return rec, out


def assert_equal_bitwise(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(got[k].view(torch.uint8), want[k].contiguous().view(torch.uint8)), k


def only_rank(ds, role):
    (rank,) = ds.ranks(role)
    return rank


def dumped_pass(model, fb, root, *args, register=fsg.register_forward_hook_for_model, forward=None,
                role="target", open_at=None, **kwargs):
    """``register(model, root, *args, **kwargs)`` (the drop-in as a test calls it), one forward (``fb``
    through ``run``, or ``forward()``), close; returns (pass 0 of ``role``'s only rank in the dump at
    ``open_at`` or ``root``, as loaded; the forward's output; the returned SGLangDumper)."""
    d = register(model, root, *args, **kwargs)
    out = forward() if forward is not None else run(model, fb)
    d.close()
    ds = fastdump.open(root if open_at is None else open_at)
    return ds.load(role, only_rank(ds, role), 0), out, d


@pytest.mark.parametrize("direct", [False, True], ids=["call", "dot-forward"])
def test_dump_equals_reference(tmp_path, direct):
    model = LlamaForCausalLM(direct=direct)
    fbs = list(batches())
    refs = [reference_pass(model, fb) for fb in fbs]
    d = fsg.register_forward_hook_for_model(model, tmp_path, None, 1, 0, 0)
    assert d.get_dump_dir() == str(d.dumper.dir)
    # SGLang's TP/PP/Rank prefix, then pid and a session id (docs/FORMAT.md)
    assert Path(d.get_dump_dir()).name.startswith(f"TP0_PP0_Rank0_pid{os.getpid()}_")
    outs = [run(model, fb) for fb in fbs]
    d.dump_current_tensors()  # nothing pending: passes end when the model returns
    d.close()
    assert "forward" not in model.model.__dict__  # unwrapped

    ds = fastdump.open(tmp_path)
    assert list(ds.roles) == ["target"]
    rank = only_rank(ds, "target")
    assert list(ds.passes("target", rank)) == [0, 1, 2]
    for p, ((want, ref_out), out, fb) in enumerate(zip(refs, outs, fbs)):
        got = ds.load("target", rank, p)
        assert_equal_bitwise(got, want)
        # the LM head's logits are in the same pass as the layers that produced them
        assert torch.equal(got["logits_processor"], out.next_token_logits)
        assert torch.equal(got["logits_processor"], ref_out.next_token_logits)
        meta = ds.meta("target", rank, p)
        assert meta["forward_mode"] == fb.forward_mode.name
        assert meta["batch_size"] == 2 and meta["num_tokens"] == fb.input_ids.shape[0]


def test_dump_layers_filters_only_decoder_layers(tmp_path):
    model = LlamaForCausalLM(n_layers=3)
    fb = next(batches())
    want, _ = reference_pass(model, fb, dump_layers=[1])
    got, _, _ = dumped_pass(model, fb, str(tmp_path), dump_layers=[1])
    assert_equal_bitwise(got, want)
    assert any(k.startswith("model.layers.1.") for k in got)
    assert not any(k.startswith(("model.layers.0.", "model.layers.2.")) for k in got)
    assert {"model.embed_tokens", "model.norm.0", "model", "logits_processor"} <= set(got)


@pytest.mark.parametrize("exclude", ["mlp", ["mlp"], ("mlp", "^nothing$"), re.compile("mlp")],
                         ids=["str", "list", "tuple", "compiled"])
def test_exclude_given_in_any_form_leaves_out_what_it_names(tmp_path, exclude):
    # exclude= as a list or compiled pattern was formatted into the layer/root patterns as text:
    # ['mlp'] became a character class, leaving out every name holding m, l, p or a quote.
    model = LlamaForCausalLM(n_layers=2)
    fb = next(batches())
    want, _ = reference_pass(model, fb)
    got, _, _ = dumped_pass(model, fb, str(tmp_path), exclude=exclude)
    assert set(got) == {k for k in want if "mlp" not in k}
    assert any("mlp" in k for k in want) and "logits_processor" in got
    assert_equal_bitwise(got, {k: v for k, v in want.items() if k in got})


def test_dump_layers_with_other_layout(tmp_path, monkeypatch):
    monkeypatch.setenv("TENSOR_DUMP_LAYERS_MODULE_NAME", "blocks")  # SGLang's variable for such models

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(12))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    model = nn.Module()
    model.model = Inner()
    model.forward = lambda x: model.model(x)  # an instance forward, as engines sometimes have
    with torch.no_grad():
        got, _, _ = dumped_pass(model, None, tmp_path, dump_layers=[1, 10], forward=lambda: model(torch.ones(1, 4)))
    assert set(got) == {"model", "model.blocks.1", "model.blocks.10"}


def test_dump_current_tensors_ends_an_open_pass(tmp_path):
    model, fbs = LlamaForCausalLM(), list(batches())
    d = fsg.register_forward_hook_for_model(model, tmp_path)
    d.dumper.begin_pass()  # several forwards in one pass (e.g. a draft's steps)
    run(model, fbs[1])
    run(model, fbs[2])
    d.dump_current_tensors()  # ends it now
    run(model, fbs[0])
    d.close()
    ds = fastdump.open(tmp_path)
    rank = only_rank(ds, "target")
    assert ds.passes("target", rank) == [0, 1]
    first, second = ds.load("target", rank, 0), ds.load("target", rank, 1)
    assert "logits_processor#1" in first and "logits_processor#1" not in second
    assert ds.meta("target", rank, 1)["forward_mode"] == "EXTEND"


class PPProxyTensors:
    """Like SGLang's: what a pipeline stage before the last returns, a dict of tensors inside an object."""

    def __init__(self, tensors):
        self.tensors = tensors


def test_pipeline_stage_output_and_unreadable_outputs(tmp_path):
    """PPProxyTensors from ``model`` are stored as model.pp_proxy_tensors.<key> (SGLang's names), in
    each call's name; an output object the hook does not know is a recorded skip, not an error."""
    model = LlamaForCausalLM()
    inner = model.model.forward
    model.model.forward = lambda *a, **k: PPProxyTensors({"hidden_states": inner(*a, **k), "residual": a[0] * 2})
    model.logits_processor.forward = lambda input_ids, hidden, lm_head, fb: object()  # no tensor in it
    mine = model.model.forward
    fbs = list(batches())[1:]
    d = fsg.register_forward_hook_for_model(model, tmp_path, writer="thread")
    d.dumper.begin_pass()
    outs = [run(model, fb) for fb in fbs]
    d.dumper.end_pass()
    stats = d.close()
    assert model.model.__dict__["forward"] is mine  # the instance forward set before is back
    ds = fastdump.open(tmp_path)
    got = ds.load("target", only_rank(ds, "target"), 0)
    for k, fb in enumerate(fbs):
        call = "" if k == 0 else f"#{k}"
        assert torch.equal(got[f"model{call}.pp_proxy_tensors.residual"], fb.input_ids * 2)
        assert torch.equal(got[f"model{call}.pp_proxy_tensors.hidden_states"],
                           got[f"model.norm{call}.0"])  # the final norm's output
        assert f"logits_processor{call}" not in got
    assert all(type(o) is object for o in outs)
    skipped = {s["name"]: s["reason"] for s in ds.meta("target", only_rank(ds, "target"), 0)["skipped"]}
    assert set(skipped) == {"logits_processor", "logits_processor#1"} and stats["skipped"] == 2
    assert "holds no tensor" in skipped["logits_processor"]


def test_rank_directory_naming(tmp_path):
    model = LlamaForCausalLM()
    got, out, d = dumped_pass(model, next(batches()), tmp_path, None, tp_size=4, tp_rank=3, pp_rank=1)
    assert torch.equal(got["logits_processor"], out.next_token_logits)
    name = Path(d.get_dump_dir()).name
    assert name.startswith(f"TP3_PP1_Rank7_pid{os.getpid()}_")  # rank = tp_size*pp_rank+tp_rank
    assert fmt.parse_rank_dir(name)[:4] == (3, 1, 7, os.getpid())


def test_role_for():
    assert fsg.role_for(False, None) is None
    assert fsg.role_for(False, "NGRAM") is None
    assert fsg.role_for(False, "EAGLE") == "target"
    # every algorithm of SGLang's is_eagle() family, as a name (any case) or an enum member's name
    for name in ("EAGLE3", "NEXTN", "FROZEN_KV_MTP", "nextn"):
        assert fsg.role_for(False, name) == "target", name
    assert fsg.role_for(False, enum.Enum("SpeculativeAlgorithm", ["FROZEN_KV_MTP"]).FROZEN_KV_MTP) == "target"
    assert fsg.role_for(True, "EAGLE3") == "draft"
    assert fsg.role_for(True, None) == "draft"  # any draft worker must not share the target's directory

    class Algo(enum.IntEnum):
        NONE = 0
        EAGLE = 1

        def is_eagle(self):
            return self == Algo.EAGLE

    assert fsg.role_for(False, Algo.EAGLE) == "target" and fsg.role_for(False, Algo.NONE) is None


def test_eagle_pair_in_one_process(tmp_path):
    target, draft = LlamaForCausalLM(n_layers=2, seed=0), LlamaForCausalLM(n_layers=1, seed=1)
    g = torch.Generator().manual_seed(2)

    def fb(mode, n):
        return ForwardBatch(mode, torch.randint(0, V, (n,), generator=g), torch.tensor([n]),
                            torch.arange(n), extend_seq_lens=torch.tensor([n]))

    # target extend, draft extend, 2 draft steps, target verify of 3 tokens, draft extend again
    schedule = [(target, fb(ForwardMode.EXTEND, 4)), (draft, fb(ForwardMode.DRAFT_EXTEND, 4)),
                (draft, fb(ForwardMode.DECODE, 1)), (draft, fb(ForwardMode.DECODE, 1)),
                (target, fb(ForwardMode.TARGET_VERIFY, 3)), (draft, fb(ForwardMode.DRAFT_EXTEND, 2))]
    refs = [reference_pass(m, b)[0] for m, b in schedule]
    dumpers = {
        "target": fsg.register_forward_hook_for_model(target, tmp_path, role=fsg.role_for(False, "EAGLE")),
        "draft": fsg.register_forward_hook_for_model(draft, tmp_path, role=fsg.role_for(True, "EAGLE")),
    }
    assert dumpers["target"].get_dump_dir() != dumpers["draft"].get_dump_dir()
    for m, b in schedule:
        run(m, b)
    for d in dumpers.values():
        d.close()

    ds = fastdump.open(tmp_path)
    assert sorted(ds.roles) == ["draft", "target"]
    seen = {"target": 0, "draft": 0}
    for (m, b), want in zip(schedule, refs):
        role = "target" if m is target else "draft"
        rank = only_rank(ds, role)
        assert_equal_bitwise(ds.load(role, rank, seen[role]), want)
        assert ds.meta(role, rank, seen[role])["forward_mode"] == b.forward_mode.name
        seen[role] += 1
    assert [len(list(ds.passes(r, only_rank(ds, r)))) for r in ("target", "draft")] == [2, 4]


def test_docs_example(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, fb = LlamaForCausalLM(n_layers=3), next(batches())
    want, _ = reference_pass(model, fb, dump_layers=[0, 1])
    exec(compile(doc_example("sglang"), "INTEGRATIONS.md:sglang", "exec"), {"model": model, "forward_batch": fb})
    ds = fastdump.open("dump")
    assert_equal_bitwise(ds.load("target", only_rank(ds, "target"), 0), want)


def test_missing_top_level_module(tmp_path):
    with pytest.raises(ValueError, match="module named 'model'"):
        fsg.register_forward_hook_for_model(nn.Sequential(nn.Linear(2, 2)), tmp_path)


# --- install(): routing SGLang's own flag ---------------------------------------------------------

FAKE_SGLANG = {
    "sglang/__init__.py": "",
    "sglang/srt/__init__.py": "",
    "sglang/srt/debug_utils/__init__.py": "",
    "sglang/srt/debug_utils/tensor_dump_forward_hook.py": """
        def register_forward_hook_for_model(model, dump_dir, dump_layers, tp_size, tp_rank, pp_rank):
            raise AssertionError("SGLang's own dumper was used")
    """,
    "sglang/srt/model_executor/__init__.py": "",
    # What SGLang's ModelRunner.load_model does after PR #21694, reduced to the call.
    "sglang/srt/model_executor/model_runner.py": """
        import os
        import torch
        from sglang.srt.debug_utils.tensor_dump_forward_hook import register_forward_hook_for_model

        class TinyLM(torch.nn.Module):
            def __init__(self):
                super().__init__()
                torch.manual_seed(0)
                self.model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
                self.lm_head = torch.nn.Linear(4, 8)
            def forward(self, x):
                return self.lm_head(self.model(x))

        def load_and_run(folder, is_draft_worker, is_eagle):
            model = TinyLM()
            if is_eagle:
                folder = os.path.join(folder, "draft" if is_draft_worker else "target")
            dumper = register_forward_hook_for_model(model, folder, None, 1, 0, 0)
            with torch.no_grad():
                out = model(torch.ones(2, 4))
            dumper.close()
            return out
    """,
    # launch_server runs the model runner in a spawned process, as SGLang does.
    "sglang/launch_server.py": """
        import multiprocessing as mp
        import sys
        from sglang.srt.model_executor.model_runner import load_and_run

        if __name__ == "__main__":
            folder = sys.argv[sys.argv.index("--debug-tensor-dump-output-folder") + 1]
            p = mp.get_context("spawn").Process(target=load_and_run, args=(folder, False, False))
            p.start()
            p.join()
            sys.exit(p.exitcode)
    """,
}


@pytest.fixture
def fake_sglang(tmp_path, monkeypatch):
    pkg = tmp_path / "fake_sglang"
    for rel, text in FAKE_SGLANG.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(pkg))
    yield pkg
    for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
        del sys.modules[name]


def test_install_without_sglang_does_nothing(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # import sglang -> ImportError
    assert fsg.install() is False


def test_install_routes_eagle_dumps_to_roles(fake_sglang, tmp_path):
    assert fsg.install() is True
    from sglang.srt.model_executor import model_runner

    root = tmp_path / "dump"
    outs = {role: model_runner.load_and_run(str(root), role == "draft", True) for role in ("target", "draft")}
    ds = fastdump.open(root)
    assert sorted(ds.roles) == ["draft", "target"]
    for role, out in outs.items():
        got = ds.load(role, only_rank(ds, role), 0)
        assert torch.equal(got["lm_head"], out)  # root's child lm_head: same pass as model
        assert "model" in got and "model.0" in got


def test_launcher_patches_spawned_processes(fake_sglang, tmp_path):
    root = tmp_path / "dump"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(fake_sglang), str(Path(__file__).parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "fastdump.integrations.sglang",
                        "--debug-tensor-dump-output-folder", str(root)],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    ds = fastdump.open(root)
    assert list(ds.roles) == ["target"]
    got = ds.load("target", only_rank(ds, "target"), 0)
    assert {"model", "model.0", "model.1", "lm_head"} <= set(got)


def test_installed_entry_applies_fastdump_env(fake_sglang, tmp_path, monkeypatch):
    monkeypatch.setenv("FASTDUMP_EXCLUDE", "^lm_head$")
    monkeypatch.setenv("FASTDUMP_WRITER", "thread")
    assert fsg.install() is True
    from sglang.srt.model_executor import model_runner

    model_runner.load_and_run(str(tmp_path), False, False)  # not EAGLE: plain target role
    ds = fastdump.open(tmp_path)
    got = ds.load("target", only_rank(ds, "target"), 0)
    assert "lm_head" not in got and "model.0" in got
    assert ds.rank_info("target", only_rank(ds, "target"))["config"]["writer"] == "thread"


# --- paths as SGLang's model runner gives them (issue 13, items 1 and 7) -----------------------------


def test_public_function_called_like_sglang_eagle(tmp_path, monkeypatch):
    """SGLang calls the function with <folder>/draft and <folder>/target: fastdump.open(<folder>) finds
    both roles, and get_dump_dir() is SGLang's path (the folder as given, joined)."""
    monkeypatch.chdir(tmp_path)
    target, draft = LlamaForCausalLM(n_layers=2, seed=0), LlamaForCausalLM(n_layers=1, seed=1)
    fb = next(batches())
    want = {"target": reference_pass(target, fb)[0], "draft": reference_pass(draft, fb)[0]}
    os.mkdir("out")
    monkeypatch.chdir("out")  # a bare "target" / "draft", as SGLang would pass with folder "."
    dumpers = {role: fsg.register_forward_hook_for_model(m, role, None, 1, 0, 0)
               for role, m in (("target", target), ("draft", draft))}
    monkeypatch.chdir(tmp_path)
    for role, d in dumpers.items():
        assert d.get_dump_dir() == os.path.join(role, d.dumper.dir.name)  # relative, as given
        assert (tmp_path / "out" / d.get_dump_dir()).resolve() == d.dumper.dir
    run(target, fb)
    run(draft, fb)
    for d in dumpers.values():
        d.close()
    assert not (tmp_path / "out" / "target" / "target").exists()
    from fastdump import cli

    assert cli.main(["verify", "out"]) == 0  # the module list beside the segments is no problem
    ds = fastdump.open("out")
    assert sorted(ds.roles) == ["draft", "target"]
    for role in ("target", "draft"):
        assert_equal_bitwise(ds.load(role, only_rank(ds, role), 0), want[role])


def test_single_role_run_keeps_target_dir_and_reports_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = LlamaForCausalLM()
    got, out, d = dumped_pass(model, next(batches()), "plain", None, 1, 0, 0)
    assert torch.equal(got["logits_processor"], out.next_token_logits)
    where = d.get_dump_dir()
    assert where == os.path.join("plain", "target", d.dumper.dir.name)
    assert (tmp_path / where / fsg.NAMES_FILE).is_file() and list(fastdump.open("plain").roles) == ["target"]
    assert fastdump.open("plain").passes("target", Path(where).name) == [0]


def test_dump_layers_leaves_other_layer_stacks_alone(tmp_path):
    """layers= / dump_layers filter model.layers.N only: a vision tower's encoder.layers.N stays."""

    class Vision(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = nn.Module()
            self.encoder.layers = nn.ModuleList(nn.Linear(H, H) for _ in range(2))

        def forward(self, x):
            for layer in self.encoder.layers:
                x = layer(x)
            return x

    model = LlamaForCausalLM(n_layers=2)
    model.vision = Vision()
    fb = next(batches())
    d = fsg.register_forward_hook_for_model(model, tmp_path, dump_layers=[0])
    d.dumper.begin_pass()  # the vision tower and the language model in one pass
    with torch.no_grad():
        v = model.vision(torch.ones(1, H))
        run(model, fb)
    d.dumper.end_pass()
    d.close()
    ds = fastdump.open(tmp_path)
    rank = only_rank(ds, "target")
    names = set().union(*(ds.load("target", rank, p) for p in ds.passes("target", rank)))
    assert {"vision.encoder.layers.0", "vision.encoder.layers.1"} <= names
    assert any(n.startswith("model.layers.0.") for n in names)
    assert not any(n.startswith("model.layers.1.") for n in names)
    assert torch.equal(ds.load("target", rank, 0)["vision.encoder.layers.1"], v)


# --- install() against SGLang's two call-site layouts (issue 13, item 2) -----------------------------

_SGLANG_HOOK = """
    def register_forward_hook_for_model(model, dump_dir, dump_layers, tp_size, tp_rank, pp_rank):
        raise AssertionError("SGLang's own dumper was used")
"""
_TINY_LM = """
    import torch

    LOADED = []  # the model runner keeps its model for the server's lifetime

    class TinyLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            LOADED.append(self)
            torch.manual_seed(0)
            self.model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
            self.lm_head = torch.nn.Linear(4, 8)
        def forward(self, x):
            return self.lm_head(self.model(x))
"""
# SGLang 0.5.15: ModelRunner.load_model calls the function it imported by name.
SGLANG_0_5_15 = {
    "sglang/__init__.py": "",
    "sglang/srt/__init__.py": "",
    "sglang/srt/debug_utils/__init__.py": "",
    "sglang/srt/debug_utils/tensor_dump_forward_hook.py": _SGLANG_HOOK,
    "sglang/srt/model_executor/__init__.py": "",
    "sglang/srt/model_executor/tiny.py": _TINY_LM,
    "sglang/srt/model_executor/model_runner.py": """
        import os
        import torch
        from sglang.srt.debug_utils.tensor_dump_forward_hook import register_forward_hook_for_model
        from sglang.srt.model_executor.tiny import TinyLM

        def load_and_run(folder, is_draft_worker, is_eagle):
            model = TinyLM()
            if is_eagle:
                folder = os.path.join(folder, "draft" if is_draft_worker else "target")
            register_forward_hook_for_model(model, folder, None, 1, 0, 0)
            with torch.no_grad():
                return model(torch.ones(2, 4))
    """,
}
# SGLang 0.5.23: the call moved to load_model_utils.maybe_register_debug_tensor_dump_hook, which
# imports the function by name; model_runner no longer holds it.
SGLANG_0_5_23 = {
    **{k: v for k, v in SGLANG_0_5_15.items() if not k.endswith("model_runner.py")},
    "sglang/srt/model_executor/model_runner_components/__init__.py": "",
    "sglang/srt/model_executor/model_runner_components/load_model_utils.py": """
        import os
        from sglang.srt.debug_utils.tensor_dump_forward_hook import register_forward_hook_for_model

        def maybe_register_debug_tensor_dump_hook(*, model, folder, is_eagle, is_draft_worker,
                                                  tp_size, tp_rank, pp_rank):
            if folder is not None:
                if is_eagle:
                    folder = os.path.join(folder, "draft" if is_draft_worker else "target")
                register_forward_hook_for_model(model, folder, None, tp_size, tp_rank, pp_rank)
    """,
    "sglang/srt/model_executor/model_runner.py": """
        import torch
        from sglang.srt.model_executor.model_runner_components.load_model_utils import (
            maybe_register_debug_tensor_dump_hook,
        )
        from sglang.srt.model_executor.tiny import TinyLM

        def load_and_run(folder, is_draft_worker, is_eagle):
            model = TinyLM()
            maybe_register_debug_tensor_dump_hook(model=model, folder=folder, is_eagle=is_eagle,
                                                  is_draft_worker=is_draft_worker, tp_size=1, tp_rank=0,
                                                  pp_rank=0)
            with torch.no_grad():
                return model(torch.ones(2, 4))
    """,
}
_CALL_SITE = {"0.5.15": "sglang.srt.model_executor.model_runner",
              "0.5.23": "sglang.srt.model_executor.model_runner_components.load_model_utils"}


def _write_package(root, files):
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))


@pytest.mark.parametrize("order", ["install-first", "sglang-first"])
@pytest.mark.parametrize("version", ["0.5.15", "0.5.23"])
def test_install_patches_every_call_site(tmp_path, monkeypatch, caplog, version, order):
    import importlib
    import logging

    pkg = tmp_path / f"sglang-{version}"
    _write_package(pkg, SGLANG_0_5_15 if version == "0.5.15" else SGLANG_0_5_23)
    monkeypatch.syspath_prepend(str(pkg))
    monkeypatch.setenv("FASTDUMP_WRITER", "thread")
    try:
        if order == "sglang-first":  # the call site bound SGLang's function before install()
            site = importlib.import_module(_CALL_SITE[version])
            assert "own dumper" in repr(site.register_forward_hook_for_model.__code__.co_consts)
        with caplog.at_level(logging.INFO, logger="fastdump.integrations.sglang"):
            assert fsg.install() is True
        assert _CALL_SITE[version] in caplog.text  # logged what it patched / verified
        site = importlib.import_module(_CALL_SITE[version])
        assert site.register_forward_hook_for_model is fsg._sglang_entry
        from sglang.srt.model_executor import model_runner

        root = tmp_path / "dump"
        outs = {role: model_runner.load_and_run(str(root), role == "draft", True) for role in ("target", "draft")}
        close_all()
        ds = fastdump.open(root)
        assert sorted(ds.roles) == ["draft", "target"]
        for role, out in outs.items():
            got = ds.load(role, only_rank(ds, role), 0)
            assert torch.equal(got["lm_head"], out)
    finally:
        close_all()
        for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
            del sys.modules[name]


def test_install_fails_loudly_when_a_call_site_keeps_another_function(tmp_path, monkeypatch):
    import importlib

    pkg = tmp_path / "sglang-odd"
    files = dict(SGLANG_0_5_23)
    files["sglang/srt/model_executor/model_runner_components/load_model_utils.py"] = """
        def register_forward_hook_for_model(*args):  # a local wrapper install() cannot see through
            raise AssertionError("not fastdump")
    """
    _write_package(pkg, files)
    monkeypatch.syspath_prepend(str(pkg))
    try:
        importlib.import_module(_CALL_SITE["0.5.23"])
        with pytest.raises(RuntimeError, match="load_model_utils"):
            fsg.install()
    finally:
        for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
            del sys.modules[name]


def test_launcher_with_sglang_0_5_23_layout(tmp_path):
    """The launcher's spawned scheduler process routes the 0.5.19+ call site (load_model_utils) too."""
    pkg = tmp_path / "sglang-0.5.23"
    _write_package(pkg, {**SGLANG_0_5_23, "sglang/launch_server.py": FAKE_SGLANG["sglang/launch_server.py"]})
    root = tmp_path / "dump"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(pkg), str(Path(__file__).parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "fastdump.integrations.sglang",
                        "--debug-tensor-dump-output-folder", str(root)],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    ds = fastdump.open(root)
    got = ds.load("target", only_rank(ds, "target"), 0)
    assert {"model", "model.0", "model.1", "lm_head"} <= set(got)


def test_a_logits_processor_below_the_top_module_holds_the_logits(tmp_path, monkeypatch):
    """A VL model served with TENSOR_DUMP_TOP_LEVEL_MODULE_NAME=language_model (SGLang's own
    deepseek-vl2 test): its logits processor is `language_model.logits_processor`. SGLang's hook
    stores that module's LogitsProcessorOutput as its logits; only a root-level logits_processor was
    watched, so the nested one was dumped as a dataclass (`...logits_processor.next_token_logits`)."""
    monkeypatch.setenv("TENSOR_DUMP_TOP_LEVEL_MODULE_NAME", "language_model")

    class VisionLanguage(Part):
        def __init__(self):
            super().__init__()
            self.vision = nn.Linear(H, H)
            self.language_model = LlamaForCausalLM()

        @torch.no_grad()
        def forward(self, input_ids, positions, forward_batch):
            return self.language_model(input_ids, positions, forward_batch)

    model = VisionLanguage()
    got, out, _ = dumped_pass(model, next(batches()), tmp_path, None, 1, 0, 0)
    assert torch.equal(got["language_model.logits_processor"], out.next_token_logits)
    assert not [name for name in got if "next_token_logits" in name]


def test_dump_current_tensors_inside_the_forward_returns_and_leaves_its_pass_whole(tmp_path):
    """SGLang's dumper API called from inside the model's forward (a hook, a nested call): it ended
    manual passes until none was open, and end_pass() never ends a root forward's pass, so it spun
    for ever inside the served forward. It returns, and the forward's pass stays one whole pass."""
    model, fbs = LlamaForCausalLM(), list(batches())
    d = fsg.register_forward_hook_for_model(model, tmp_path)
    calls = []
    model.model.layers[0].register_forward_hook(lambda *_: calls.append(d.dump_current_tensors()))
    reference = run(model, fbs[0])
    d.close()
    assert calls == [None]
    ds = fastdump.open(tmp_path)
    rank = only_rank(ds, "target")
    assert ds.passes("target", rank) == [0]
    assert ds.meta("target", rank, 0)["complete"]
    assert torch.equal(ds.load("target", rank, 0)["logits_processor"], reference.next_token_logits)


def test_the_pass_meta_of_a_forward_batch_without_batch_size_counts_its_sequences():
    """A ForwardBatch without batch_size (a duck-typed one, an older SGLang): the pass's batch_size
    is the number of its seq_lens, num_tokens that of its input_ids."""
    class Recorder:
        def set_pass_meta(self, **meta):
            self.meta = meta

    class Mode(enum.Enum):
        EXTEND = 1

    class Batch:
        forward_mode = Mode.EXTEND
        input_ids = torch.arange(7)
        seq_lens = torch.tensor([3, 4])
        positions = torch.arange(7)

    dumper = Recorder()
    got = fsg._batch_info(dumper)((), {"forward_batch": Batch()})
    assert dumper.meta == {"forward_mode": "EXTEND", "batch_size": 2, "num_tokens": 7}
    assert list(got["forward_batch_info"]) == ["input_ids", "seq_lens", "positions"]


def test_a_logits_processor_inside_another_is_not_watched_on_its_own():
    """The outermost logits processor is watched (its output stored as SGLang's hook stores it); one
    inside it is part of its computation, not a second output."""
    class LogitsProcessor(nn.Module):
        def __init__(self, inner=False):
            super().__init__()
            self.proj = nn.Linear(2, 2)
            if inner:
                self.logits_processor = LogitsProcessor()

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Linear(2, 2)
            self.head = LogitsProcessor(inner=True)

    model = Model()
    assert fsg._logits_processors(model) == {"head": model.head}


# --- the installed entry's settings, and a top module that is the logits processor ------------------


def test_installed_entry_keeps_fastdump_layers_unless_sglang_names_layers(tmp_path, monkeypatch):
    """FASTDUMP_LAYERS applies when SGLang passes no dump_layers; SGLang's dump_layers wins over it."""
    monkeypatch.setenv("FASTDUMP_LAYERS", "1")
    model, fb = LlamaForCausalLM(n_layers=3), next(batches())
    for sub, dump_layers, kept in (("env", None, [1]), ("sglang", [2], [2])):
        want, _ = reference_pass(model, fb, dump_layers=kept)
        got, _, _ = dumped_pass(model, fb, str(tmp_path / sub), dump_layers, 1, 0, 0, register=fsg._sglang_entry)
        assert_equal_bitwise(got, want)
        assert {k.split(".")[2] for k in got if k.startswith("model.layers.")} == {str(i) for i in kept}


def test_installed_entry_eagle_folder_wins_over_fastdump_role(tmp_path, monkeypatch):
    """FASTDUMP_ROLE names the role of a single-role run only: under SGLang's EAGLE split the
    folder's last component (draft/target) is the role, and the files land where SGLang puts them."""
    monkeypatch.setenv("FASTDUMP_ROLE", "mine")
    model, fb = LlamaForCausalLM(n_layers=1), next(batches())
    want, _ = reference_pass(model, fb)
    got, _, d = dumped_pass(model, fb, str(tmp_path / "draft"), None, 1, 0, 0, register=fsg._sglang_entry,
                            role="draft", open_at=tmp_path)
    assert Path(d.get_dump_dir()).parent == tmp_path / "draft"
    assert list(fastdump.open(tmp_path).roles) == ["draft"]
    assert_equal_bitwise(got, want)
    # a single-role run's folder: FASTDUMP_ROLE is the role
    got, _, _ = dumped_pass(model, fb, str(tmp_path / "single"), None, 1, 0, 0, register=fsg._sglang_entry,
                            role="mine")
    assert list(fastdump.open(tmp_path / "single").roles) == ["mine"]
    assert_equal_bitwise(got, want)


def test_top_module_that_is_the_logits_processor_is_watched_once(tmp_path, monkeypatch):
    """TENSOR_DUMP_TOP_LEVEL_MODULE_NAME=logits_processor: the top module is also the logits
    processor; it is watched once (as the top: its ForwardBatch and its logits), not twice."""
    monkeypatch.setenv("TENSOR_DUMP_TOP_LEVEL_MODULE_NAME", "logits_processor")
    model, fb = LlamaForCausalLM(n_layers=1), next(batches())
    want, _ = reference_pass(model, fb)
    got, out, _ = dumped_pass(model, fb, tmp_path, None, 1, 0, 0)
    assert torch.equal(got["logits_processor"], out.next_token_logits)
    assert "logits_processor#1" not in got
    for f in ("input_ids", "seq_lens", "positions"):
        assert torch.equal(got[f"logits_processor.forward_batch_info.{f}"], getattr(fb, f))
    leaves = {k: v for k, v in want.items() if k != "model" and not k.startswith(("model.forward_batch_info", "logits_processor"))}
    assert_equal_bitwise({k: got[k] for k in leaves}, leaves)


# --- TENSOR_DUMP_MODE (a variant of SGLang's hook): what the drop-in dumps or refuses -----------------


def test_leaf_outputs_mode_dumps_what_sglangs_hook_dumps(tmp_path, monkeypatch):
    """TENSOR_DUMP_MODE=leaf_outputs (the variant's default, SGLang's hook) and mode="leaf_outputs"
    (the variant's keyword, or its seventh argument through the installed entry) dump as without it."""
    monkeypatch.setenv("TENSOR_DUMP_MODE", "leaf_outputs")
    model, fb = LlamaForCausalLM(n_layers=1), next(batches())
    want, _ = reference_pass(model, fb)
    got, _, _ = dumped_pass(model, fb, tmp_path / "env")
    assert_equal_bitwise(got, want)
    got, _, _ = dumped_pass(model, fb, tmp_path / "keyword", mode="leaf_outputs")
    assert_equal_bitwise(got, want)
    got, _, _ = dumped_pass(model, fb, str(tmp_path / "entry"), None, 1, 0, 0, "leaf_outputs",
                            register=fsg._sglang_entry)
    assert_equal_bitwise(got, want)


@pytest.mark.parametrize("how", ["env", "keyword", "entry-positional", "entry-keyword"])
@pytest.mark.parametrize("mode", ["all_io", "bogus", ""])
def test_a_dump_mode_the_drop_in_does_not_dump_is_refused_before_the_model_is_touched(tmp_path, monkeypatch,
                                                                                       mode, how):
    """all_io (every module's inputs and outputs, parents included) is not what fastdump wraps, and
    another value is no mode: a ValueError naming it, nothing wrapped, nothing written; never a
    smaller dump than the one asked for."""
    model = LlamaForCausalLM(n_layers=1)
    calls = {"env": lambda: fsg.register_forward_hook_for_model(model, tmp_path),
             "keyword": lambda: fsg.register_forward_hook_for_model(model, tmp_path, mode=mode),
             "entry-positional": lambda: fsg._sglang_entry(model, str(tmp_path), None, 1, 0, 0, mode),
             "entry-keyword": lambda: fsg._sglang_entry(model, str(tmp_path), None, 1, 0, 0, mode=mode)}
    if how == "env":
        monkeypatch.setenv("TENSOR_DUMP_MODE", mode)
    with pytest.raises(ValueError, match="all_io" if mode == "all_io" else "invalid tensor dump mode"):
        calls[how]()
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert list(tmp_path.iterdir()) == []


def test_last_token_only_is_said_and_whole_tensors_are_dumped(tmp_path, monkeypatch, caplog):
    import logging

    monkeypatch.setenv("TENSOR_DUMP_LAST_TOKEN_ONLY", "1")
    model, fb = LlamaForCausalLM(n_layers=1), next(batches())
    want, _ = reference_pass(model, fb)
    with caplog.at_level(logging.WARNING, logger="fastdump.integrations.sglang"):
        got, _, _ = dumped_pass(model, fb, tmp_path)
    assert "TENSOR_DUMP_LAST_TOKEN_ONLY=1 is not applied" in caplog.text
    assert_equal_bitwise(got, want)  # whole tensors: 5 rows of the extend batch, not the last one
    assert got["model.embed_tokens"].shape[0] == 5


# --- SGLang's signature as each version has it (the call site passes it by position) ------------------

# SGLang before --debug-tensor-dump-layers (sgl-project/sglang tensor_dump_forward_hook.py at 19fed5ff):
# no dump_layers; ModelRunner.load_model calls (model, folder, tp_size, tp_rank, pp_rank).
SGLANG_WITHOUT_DUMP_LAYERS = {
    **SGLANG_0_5_15,
    "sglang/srt/debug_utils/tensor_dump_forward_hook.py": """
        def register_forward_hook_for_model(model, dump_dir, tp_size, tp_rank, pp_rank):
            raise AssertionError("SGLang's own dumper was used")
    """,
    "sglang/srt/model_executor/model_runner.py": """
        import torch
        from sglang.srt.debug_utils.tensor_dump_forward_hook import register_forward_hook_for_model
        from sglang.srt.model_executor.tiny import TinyLM

        def load_and_run(folder, tp_size, tp_rank, pp_rank):
            model = TinyLM()
            register_forward_hook_for_model(model, folder, tp_size, tp_rank, pp_rank)
            with torch.no_grad():
                return model(torch.ones(2, 4))
    """,
}


def test_installed_entry_reads_its_arguments_by_the_replaced_functions_signature(tmp_path, monkeypatch):
    """SGLang's call site passes its arguments by position, in the order of the function it imported:
    before dump_layers existed that was (model, folder, tp_size, tp_rank, pp_rank), which the entry
    read as dump_layers=tp_size ... and failed the model's load with "'int' object is not iterable"."""
    import importlib

    pkg = tmp_path / "sglang-old"
    _write_package(pkg, SGLANG_WITHOUT_DUMP_LAYERS)
    monkeypatch.syspath_prepend(str(pkg))
    monkeypatch.setenv("FASTDUMP_WRITER", "thread")
    monkeypatch.setattr(fsg, "_sglang_params", fsg._sglang_params)  # (install() sets it: put back after)
    try:
        assert fsg.install() is True
        model_runner = importlib.import_module("sglang.srt.model_executor.model_runner")
        root = tmp_path / "dump"
        out = model_runner.load_and_run(str(root), 2, 1, 0)  # TP rank 1 of 2
        close_all()
        ds = fastdump.open(root)
        rank = only_rank(ds, "target")
        assert fmt.parse_rank_dir(rank)[:3] == (1, 0, 1)  # TP1_PP0_Rank1, as SGLang names it
        numbers = ds.rank_info("target", rank)["rank"]
        assert (numbers["tp_rank"], numbers["tp_size"], numbers["pp_rank"]) == (1, 2, 0)
        got = ds.load("target", rank, 0)
        assert torch.equal(got["lm_head"], out) and {"model", "model.0", "model.1"} <= set(got)
    finally:
        close_all()
        for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
            del sys.modules[name]


def test_installed_entry_takes_a_hook_variants_skip_passes(tmp_path, monkeypatch):
    """A hook variant with a ``skip_passes`` parameter (warm-up passes left out): the entry reads it
    by that name and fastdump skips as many passes; its default 0 leaves FASTDUMP_SKIP in force."""
    monkeypatch.setattr(fsg, "_sglang_params", fsg._replaced_params(
        lambda model, dump_dir, dump_layers=None, tp_size=1, tp_rank=0, pp_rank=0, skip_passes=0: None))
    model, batch = LlamaForCausalLM(n_layers=1), list(batches())[:3]
    for sub, args, env, kept in (("given", (None, 1, 0, 0, 2), None, [2]), ("env", (None, 1, 0, 0, 0), "1", [1, 2])):
        if env is not None:
            monkeypatch.setenv("FASTDUMP_SKIP", env)
        d = fsg._sglang_entry(model, str(tmp_path / sub), *args)
        with torch.no_grad():
            for fb in batch:
                run(model, fb)
        d.close()
        ds = fastdump.open(tmp_path / sub)
        assert ds.passes("target", only_rank(ds, "target")) == kept


@pytest.mark.parametrize("dump_layers", [3, "0 1", [0, "x"]])
def test_dump_layers_that_is_no_list_of_indices_is_refused_naming_it(tmp_path, dump_layers):
    """An SGLang between its first --debug-tensor-dump-layers and the list form (PR #12691) passed one
    int: refused with a ValueError naming dump_layers before anything is made (it was a TypeError
    "'int' object is not iterable" that named nothing)."""
    with pytest.raises(ValueError, match="dump_layers must be a list of layer indices"):
        fsg.register_forward_hook_for_model(LlamaForCausalLM(n_layers=2), str(tmp_path / "d"), dump_layers)
    assert not (tmp_path / "d").exists()
