"""`fastdump export --format sglang`: SGLang's Pass*.pt layout, bit-exact with the HDF5 dump."""

import argparse
import json
import os
import re
import shlex

import pytest
import torch
from torch import nn

import fastdump
from fastdump import export
from conftest import DOCS, doc_example


class Block(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.proj = nn.Linear(8, 8).to(dtype)
        self.norm = nn.LayerNorm(8).to(dtype)

    def forward(self, x):
        h = self.proj(x)
        return self.norm(h), h  # tuple output -> name.0 / name.1


class Tiny(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.embed = nn.Embedding(16, 8).to(dtype)
        self.layers = nn.ModuleList(Block(dtype) for _ in range(2))

    @torch.no_grad()
    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x, _ = layer(x)
        return x


def make_dump(root, roles=("target",)):
    models = {role: Tiny(torch.bfloat16 if role == "draft" else torch.float32) for role in roles}
    for role, model in models.items():
        with fastdump.attach(model, root, role=role, writer="thread") as d:
            for step in range(3):
                d.begin_pass(step=step)  # one pass around the forward and an extra tensor
                model(torch.arange(step + 2))
                d.dump("extra.fp8", torch.linspace(-2, 2, 8).to(torch.float8_e4m3fn))
                d.end_pass()
    return fastdump.open(root)


def check_export(ds, out, split):
    for role in ds.roles:
        for rank in ds.ranks(role):
            dest = out / role / rank if split else out / rank
            passes = ds.passes(role, rank)
            assert sorted(p.name for p in dest.glob("Pass*.pt")) == [f"Pass{p:05d}.pt" for p in passes]
            metas = json.loads((dest / "fastdump_passes.json").read_text())
            for p in passes:
                got = torch.load(dest / f"Pass{p:05d}.pt", weights_only=True)
                want = ds.load(role, rank, p)
                assert list(got) == list(want)
                for name, t in want.items():
                    assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
                    assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name
                    assert got[name].untyped_storage().nbytes() == t.numel() * t.element_size()
                assert metas[str(p)]["complete"] is True and metas[str(p)]["step"] == p


def test_single_role_is_flat(tmp_path):
    ds = make_dump(tmp_path / "dump")
    assert export.export_sglang(tmp_path / "dump", tmp_path / "out") == 3
    assert not (tmp_path / "out" / "target").exists()
    check_export(ds, tmp_path / "out", split=False)
    # content sanity beyond the round trip: the tuple was split, bf16/fp8 kept
    got = torch.load(next((tmp_path / "out").rglob("Pass00000.pt")), weights_only=True)
    assert {"layers.0.norm", "layers.1.proj", "extra.fp8"} <= set(got)


def test_eagle_roles_get_subdirs_via_cli(tmp_path):
    ds = make_dump(tmp_path / "dump", roles=("target", "draft"))
    parser = argparse.ArgumentParser()
    export.add_arguments(parser.add_subparsers())
    args = parser.parse_args(["export", "--format", "sglang", str(tmp_path / "dump"), str(tmp_path / "out")])
    assert args.func(args) == 0
    assert sorted(os.listdir(tmp_path / "out")) == ["draft", "target"]
    check_export(ds, tmp_path / "out", split=True)
    got = torch.load(next((tmp_path / "out" / "draft").rglob("Pass00001.pt")), weights_only=True)
    assert got["layers.0.proj"].dtype == torch.bfloat16 and got["extra.fp8"].dtype == torch.float8_e4m3fn


def test_several_roles_cannot_be_flattened(tmp_path):
    make_dump(tmp_path / "dump", roles=("target", "draft"))
    with pytest.raises(ValueError, match="role subdirectories"):
        export.export_sglang(tmp_path / "dump", tmp_path / "out", role_subdirs=False)


def test_docs_example(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    ds = make_dump("dump")
    (command,) = re.findall(r"^fastdump export .*$", (DOCS / "INTEGRATIONS.md").read_text(), re.M)  # the documented command line
    from fastdump import cli

    assert cli.main(shlex.split(command)[1:]) == 0
    exec(compile(doc_example("export"), "INTEGRATIONS.md:export", "exec"), {})
    rank = ds.ranks("target")[0]
    assert capsys.readouterr().out.count("Pass0") == len(ds.passes("target", rank)) == 3
