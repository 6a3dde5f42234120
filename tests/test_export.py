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


def sglang_dir(rank):
    """SGLang's name of a rank directory: fastdump's, less its session suffix."""
    name, session = rank.rsplit("_", 1)
    assert re.fullmatch(r"\d{8}T\d{6}\.\d{6}Z-[0-9a-f]{8}", session) and re.fullmatch(r"TP\d+_PP\d+_Rank\d+_pid\d+", name)
    return name


def check_export(ds, out, split):
    for role in ds.roles:
        assert sorted(os.listdir(out / role if split else out)) == sorted(sglang_dir(r) for r in ds.ranks(role))
        for rank in ds.ranks(role):
            dest = out / role / sglang_dir(rank) if split else out / sglang_dir(rank)
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


@pytest.mark.parametrize("fmt", ["sglang", "sglang-dumper"])
def test_a_role_the_dump_lost_is_refused_unless_partial(tmp_path, capsys, fmt):
    """An EAGLE dump whose draft directory is gone (the root records it as attached; verify fails
    it): export wrote the target alone, laid out flat as a plain run's, exit 0, without a word."""
    import shutil

    make_dump(tmp_path / "dump", roles=("target", "draft"))
    shutil.rmtree(tmp_path / "dump" / "draft")
    out = tmp_path / "out"
    code, _, err = run_cli("--format", fmt, tmp_path / "dump", out, capsys=capsys)
    assert code == 2 and not out.exists()
    assert (f"fastdump export:   {tmp_path / 'dump' / 'draft'}: role 'draft' was attached here (fastdump.roles/draft) "
            "but its directory is gone: that role's dump is not here") in err.splitlines()
    code, _, err = run_cli("--format", fmt, "--partial", tmp_path / "dump", out, capsys=capsys)
    assert code == 0 and "role 'draft' was attached here" in err and "exported as written (--partial)" in err


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


def run_cli(*argv, capsys):
    from fastdump import cli

    code = cli.main(["export", *map(str, argv)])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


# --- sessions of one process ---------------------------------------------------------------------------


def test_sessions_of_one_process_keep_their_whole_names(tmp_path, capsys):
    """attach/close twice in one process: two sessions under one SGLang name. Each is exported under
    its whole directory name, with its own tensors: never merged into one directory."""
    for scale in (1.0, 5.0):
        with fastdump.attach(None, tmp_path / "dump", writer="thread") as d:
            d.dump("x", torch.full((3,), scale))
    ds = fastdump.open(tmp_path / "dump")
    first, second = ds.ranks("target")
    assert sglang_dir(first) == sglang_dir(second)
    code, _, err = run_cli(tmp_path / "dump", tmp_path / "out", capsys=capsys)
    assert code == 0
    assert sorted(os.listdir(tmp_path / "out")) == [first, second]
    assert f"target/{sglang_dir(first)} has 2 sessions" in err and first in err and second in err
    for rank, scale in ((first, 1.0), (second, 5.0)):
        got = torch.load(tmp_path / "out" / rank / "Pass00000.pt", weights_only=True)
        assert list(got) == ["x"] and torch.equal(got["x"], torch.full((3,), scale))


# --- dumps that are not whole --------------------------------------------------------------------------

RANKS = {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "rank": 0}
R0 = "TP0_PP0_Rank0_pid100_20260101T000000.000000Z-00000001"


def write_passes(root, ends=None, status="closed", info=None, passes=3):
    """A rank directory written by the real ChannelWriter, pass p holding {"a": p, "b": -p}, ended
    with ``ends[p]`` as ChannelWriter.on_end's keywords (incomplete=, dropped=, skipped=); ``info``:
    fields then set in rank.json (status "error" and its error, say)."""
    from fastdump import dtypes
    from fastdump.writer.channel_writer import ChannelWriter

    path = root / "target" / R0
    writer = ChannelWriter({"op": "open", "channel": 0, "dir": str(path), "role": "target", "rank": RANKS,
                            "pid": 100, "host": "h", "device": {}, "config": {"segment_passes": 2}})
    writer.on_name(0, "a")
    writer.on_name(1, "b")
    for p in range(passes):
        writer.on_begin(p, {"step": p})
        for slot, value in ((0, p), (1, -p)):
            data = torch.full((4,), float(value)).view(torch.uint8).numpy().copy()
            writer.on_tensor(slot, p, dtypes.code_of(torch.float32), (4,), data)
        writer.on_end(p, {}, **(ends or {}).get(p, {}))
    writer.close({}, status=status)
    if info:
        rank_json = path / "rank.json"
        rank_json.write_text(json.dumps({**json.loads(rank_json.read_text()), **info}))
    return root


NOT_WHOLE = {
    "incomplete pass": (dict(ends={1: {"incomplete": "a forward raised RuntimeError: boom"}}),
                        ["pass 1 is marked incomplete (a forward raised RuntimeError: boom)"]),
    "dropped tensors": (dict(ends={2: {"dropped": 3}}), ["pass 2 lost 3 tensor(s) (dropped under policy drop)"]),
    "status error": (dict(info={"status": "error", "error": "No space left on device"}),
                     ["status is 'error' (writing failed: No space left on device)"]),
    "status running": (dict(status="running"),
                       ["status is 'running' (the writer never finished: the dump is still being written, or its writer died "
                        "or the disk filled before it could say so; passes may be missing)"]),
    "status incomplete": (dict(status="incomplete"), ["status is 'incomplete' (the dumping process exited"]),
    # whole passes dropped leave gaps no pass's metadata shows: they were exported as if whole
    # (one is enough: a mutant refusing from two on survived)
    "dropped passes": (dict(info={"dropped_passes": 1}), ["1 whole pass(es) were dropped (gaps in the pass ids)"]),
    # a tensor accepted and then lost (torn by a failed CUDA drain; one the writer could not store) is
    # a skip in its pass's list: it was exported with a warning, as if the capture side had left it out
    "torn tensor": (dict(ends={1: {"skipped": [{"name": "c", "reason": "incomplete tensor (staging failed mid-copy)"}]}}),
                    ["pass 1 lost 1 tensor(s) after they were accepted (incomplete tensor (staging failed mid-copy)): c"]),
    # what the Dumper counted at close as never dumped (verify fails each): files that looked whole
    "lost at close": (dict(info={"stats": {"lost_at_close": 2}}),
                      ["2 staged tensor(s) were lost at close (a CUDA-graph capture still running held their batch)"]),
    "compiled undumped": (dict(info={"stats": {"compiled_not_dumped": 1}}),
                          ["1 dumped module(s) were compiled into graphs that may not break (torch.compile "
                           "fullgraph=True): their outputs are in no pass"]),
    "edits not followed": (dict(info={"stats": {"modules_not_followed": ["layers.1 replaced"]}}),
                           ["1 module edit(s) after attach could not be followed (their outputs are missing, or "
                            "under a name that no longer leads to them): layers.1 replaced"]),
    "tensor the writer lost": (dict(ends={2: {"skipped": [{"name": "c", "reason": "writer could not store it (boom)"}]}}),
                               ["pass 2 lost 1 tensor(s) after they were accepted (writer could not store it (boom)): c"]),
}


@pytest.mark.parametrize("fmt", ["sglang", "sglang-dumper"])
@pytest.mark.parametrize("case", list(NOT_WHOLE))
def test_a_dump_not_whole_is_refused_unless_partial(tmp_path, capsys, case, fmt):
    kwargs, reasons = NOT_WHOLE[case]
    dump = write_passes(tmp_path / "dump", **kwargs)
    out = tmp_path / "out"
    code, _, err = run_cli("--format", fmt, "--names", "fastdump", dump, out, capsys=capsys)
    assert code == 2 and not out.exists()
    assert "not exported: the dump is not whole" in err and "--partial" in err
    problem_lines = [line for line in err.splitlines() if line.startswith("fastdump export:   ")]
    assert len(problem_lines) == len(reasons)
    for line, reason in zip(problem_lines, reasons):
        assert f"target/{R0}: {reason}" in line
    api = export.export_sglang if fmt == "sglang" else export.export_sglang_dumper
    with pytest.raises(ValueError, match=re.escape(reasons[0])) as refused:
        api(dump, tmp_path / "out-api", names="fastdump")
    assert isinstance(refused.value, export.PartialDumpError) and not (tmp_path / "out-api").exists()

    # --partial: written as it is, one warning per rank/pass not whole, recorded with the pass
    code, _, err = run_cli("--format", fmt, "--names", "fastdump", "--partial", dump, out, capsys=capsys)
    assert code == 0
    warnings = [line for line in err.splitlines() if line.startswith("fastdump export: warning: ")]
    assert len(warnings) == len(reasons)
    for line, reason in zip(warnings, reasons):
        assert f"target/{R0}: {reason}" in line and line.endswith("exported as written (--partial)")
    ds = fastdump.open(dump)
    if fmt == "sglang":
        dest = out / "TP0_PP0_Rank0_pid100"
        assert sorted(p.name for p in dest.glob("Pass*.pt")) == ["Pass00000.pt", "Pass00001.pt", "Pass00002.pt"]
        recorded = json.loads((dest / "fastdump_passes.json").read_text())
        for p in range(3):
            got = torch.load(dest / f"Pass{p:05d}.pt", weights_only=True)
            assert torch.equal(got["a"], torch.full((4,), float(p))) and torch.equal(got["b"], torch.full((4,), -p * 1.0))
            assert recorded[str(p)] == json.loads(json.dumps(ds.meta("target", 0, p)))
    else:
        recorded = {}
        for path in out.glob("*.pt"):
            saved = torch.load(path, weights_only=False)
            recorded[saved["meta"]["step"]] = saved["meta"]["fastdump_pass"]
        assert len(list(out.glob("*.pt"))) == 6
        assert recorded == {p: ds.meta("target", 0, p) for p in range(3)}
    if case == "incomplete pass":
        assert recorded[1 if fmt == "sglang-dumper" else "1"]["complete"] is False
    if case == "dropped tensors":
        assert recorded[2 if fmt == "sglang-dumper" else "2"]["dropped"] == 3


def test_a_rank_json_without_status_is_not_known_whole(tmp_path, capsys):
    dump = write_passes(tmp_path / "dump")
    rank_json = dump / "target" / R0 / "rank.json"
    info = json.loads(rank_json.read_text())
    del info["status"]
    rank_json.write_text(json.dumps(info))
    code, _, err = run_cli(dump, tmp_path / "out", capsys=capsys)
    assert code == 2 and f"target/{R0}: rank.json has no status" in err and not (tmp_path / "out").exists()


def test_a_forward_that_raised_leaves_a_pass_export_refuses(tmp_path, capsys):
    """The audit's case through the real capture path: pass 1's forward raised half-way."""
    class Boom(nn.Module):
        fire = False

        def forward(self, x):
            if self.fire:
                raise RuntimeError("boom")
            return x * 2

    model = nn.Sequential(nn.Linear(4, 4), Boom(), nn.Linear(4, 4))
    with fastdump.attach(model, tmp_path / "dump", writer="thread"), torch.no_grad():
        for p in range(3):
            model[1].fire = p == 1
            try:
                model(torch.ones(1, 4))
            except RuntimeError:
                pass
    ds = fastdump.open(tmp_path / "dump")
    (rank,) = ds.ranks("target")
    assert ds.meta("target", rank, 1)["complete"] is False
    code, _, err = run_cli(tmp_path / "dump", tmp_path / "out", capsys=capsys)
    assert code == 2 and f"target/{rank}: pass 1 is marked incomplete (a forward raised RuntimeError: boom)" in err
    code, _, err = run_cli("--partial", tmp_path / "dump", tmp_path / "out", capsys=capsys)
    assert code == 0 and err.count("exported as written (--partial)") == 1
    dest = tmp_path / "out" / sglang_dir(rank)
    assert list(torch.load(dest / "Pass00001.pt", weights_only=True)) == ["0"]  # what was dumped before the raise
    assert json.loads((dest / "fastdump_passes.json").read_text())["1"]["incomplete"].endswith("boom")


def test_recorded_skips_are_exported_with_a_warning(tmp_path, capsys):
    skip = {"skipped": [{"name": "q", "reason": "quantized tensor (scale/zero point are not part of its bytes)"}]}
    dump = write_passes(tmp_path / "dump", ends={0: skip, 2: skip})
    code, _, err = run_cli("--names", "fastdump", dump, tmp_path / "out", capsys=capsys)
    assert code == 0
    (line,) = [line for line in err.splitlines() if "warning" in line]
    assert f"target/{R0}: 2 tensor(s) in 2 pass(es) were not dumped (quantized tensor" in line and ": q left out" in line
    dest = tmp_path / "out" / "TP0_PP0_Rank0_pid100"
    assert list(torch.load(dest / "Pass00000.pt", weights_only=True)) == ["a", "b"]
    assert json.loads((dest / "fastdump_passes.json").read_text())["0"]["skipped"] == skip["skipped"]


def test_modules_left_unwrapped_are_named_by_export(tmp_path, capsys):
    """A submodule whose own name holds ``#<digits>`` reads as a repeated call's part, so it is left
    unwrapped (rank.json config.not_wrapped); SGLang's hook would dump it. The export, which lacks
    it, says so and names it instead of writing files that look whole."""
    class Add(nn.Module):
        def forward(self, x):
            return x + 1

    model = nn.Sequential()
    model.add_module("a", Add())
    model.add_module("b#1", Add())
    x = torch.randn(3)
    with fastdump.attach(model, tmp_path / "dump", writer="thread"):
        model(x)
    code, _, err = run_cli("--names", "fastdump", tmp_path / "dump", tmp_path / "out", capsys=capsys)
    assert code == 0
    (line,) = [line for line in err.splitlines() if "not wrapped" in line]
    assert "1 module(s) were not wrapped, so not dumped, and are missing from the export" in line
    assert line.endswith(": b#1") and "reads as a repeated call's" in line
    (rank_dir,) = (tmp_path / "out").iterdir()
    got = torch.load(rank_dir / "Pass00000.pt", weights_only=True)
    assert list(got) == ["a", "Sequential"] and torch.equal(got["a"], x + 1)


@pytest.mark.parametrize("fmt", ["sglang", "sglang-dumper"])
def test_out_must_be_new_or_empty_and_never_the_current_directory(tmp_path, monkeypatch, fmt):
    """File names carry no session: a second export into the same OUT left the first's passes
    beside its own, read by SGLang's tools as one run; a link left in OUT was followed out of it
    (a victim file overwritten with a zip); OUT "" (an unset $OUT) wrote into the current directory."""
    make_dump(tmp_path / "dump")
    write = export.export_sglang if fmt == "sglang" else export.export_sglang_dumper
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="OUT is empty"):
        write(tmp_path / "dump", "")
    assert sorted(os.listdir(tmp_path)) == ["dump"]
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    out = tmp_path / "out"
    out.mkdir()
    (out / "Pass00000.pt").symlink_to(victim / "precious.txt")
    with pytest.raises(ValueError, match="not empty"):
        write(tmp_path / "dump", out)
    assert (victim / "precious.txt").read_text() == "keep me" and os.listdir(out) == ["Pass00000.pt"]
    (out / "Pass00000.pt").unlink()
    assert write(tmp_path / "dump", out) > 0  # an empty OUT is fine
    with pytest.raises(ValueError, match="not empty"):
        write(tmp_path / "dump", out)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="not a directory"):
        write(tmp_path / "dump", tmp_path / "file")


@pytest.mark.parametrize("fmt", ["sglang", "sglang-dumper"])
def test_out_inside_the_dump_is_refused_and_the_dump_stays_whole(tmp_path, capsys, fmt):
    """`fastdump export ROOT ROOT/sglang`: the Pass layout's rank directories (TP0_PP0_Rank0_pid...)
    under ROOT/sglang read as a role 'sglang' whose sessions recorded nothing, and `fastdump verify
    ROOT` failed the dump it was exported from (exit 1); the dumper layout's files were left in the
    evidence. OUT inside a dump root is refused before anything is written."""
    from fastdump import cli

    make_dump(tmp_path / "dump")
    for out in (tmp_path / "dump" / "sglang", tmp_path / "dump" / "target" / "x"):
        code, _, err = run_cli("--format", fmt, tmp_path / "dump", out, capsys=capsys)
        assert code == 2 and not out.exists(), err
        assert err.splitlines()[-1] == (f"fastdump export: OUT {out}: inside the dump root {tmp_path / 'dump'}; "
                                        "export outside it (files written there would be read as part of the dump)")
    assert cli.main(["verify", str(tmp_path / "dump")]) == 0
    assert run_cli("--format", fmt, tmp_path / "dump", tmp_path / "dumpling", capsys=capsys)[0] == 0  # (a prefix)


@pytest.mark.parametrize("name, message", [("a/b", "contains '/'"), ("é" * 120, "too long for a file name")])
def test_a_name_the_dumper_layout_cannot_hold_is_refused_before_anything_is_written(tmp_path, capsys, name, message):
    """Checked as each file was written, a bad name in pass 1 left pass 0's files behind (exit 2,
    "refused"); a name too long for a file name failed the write (exit 1, "nothing written")."""
    with fastdump.attach(None, tmp_path / "dump", writer="thread") as d:
        for p in range(2):
            d.begin_pass()
            d.dump("ok", torch.ones(2))
            if p == 1:
                d.dump(name, torch.zeros(2))
            d.end_pass()
    parser = argparse.ArgumentParser()
    export.add_arguments(parser.add_subparsers())
    args = parser.parse_args(["export", "--format", "sglang-dumper", str(tmp_path / "dump"), str(tmp_path / "out")])
    assert args.func(args) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "out").exists()


def write_tp_group(root, passes_of_rank):
    """Ranks of one TP group (tp_size = len(passes_of_rank)), rank k holding the passes
    ``passes_of_rank[k]``, pass p's "x" = 10 * p + k, each closed with no drop recorded."""
    from conftest import write_rank_dir

    size = len(passes_of_rank)
    for k, passes in enumerate(passes_of_rank):
        numbers = {"tp_rank": k, "tp_size": size, "pp_rank": 0, "pp_size": 1, "rank": k}
        write_rank_dir(root / "target" / f"TP{k}_PP0_Rank{k}_pid10{k}_20260101T000000.000000Z-0000000{k}",
                       {p: {"x": torch.full((2,), 10.0 * p + k)} for p in passes}, rank=numbers)
    return root


@pytest.mark.parametrize("fmt", ["sglang", "sglang-dumper"])
def test_a_pass_one_tp_rank_lacks_is_refused_unless_partial(tmp_path, capsys, fmt):
    """TP rank 1 lacks pass 1 and its rank.json records no drop. Exported, SGLang's comparator read
    pass 1 from rank 0 alone as if whole: exit 0 and no word. It is refused like any pass not whole;
    --partial exports it as written, with a warning naming the rank and the pass."""
    dump = write_tp_group(tmp_path / "dump", [[0, 1, 2], [0, 2]])
    rank1 = "TP1_PP0_Rank1_pid101_20260101T000000.000000Z-00000001"
    assert fastdump.open(dump).rank_info("target", rank1).get("dropped_passes", 0) == 0
    want = (f"target/{rank1}: pass(es) 1 missing, which other TP ranks of its group (dp rank 0, pp rank 0) hold: "
            "lost, whatever rank.json says")
    out = tmp_path / "out"
    code, _, err = run_cli("--format", fmt, "--names", "fastdump", dump, out, capsys=capsys)
    assert code == 2 and not out.exists()
    assert [line for line in err.splitlines() if line.startswith("fastdump export:   ")] == [f"fastdump export:   {want}"]
    code, _, err = run_cli("--format", fmt, "--names", "fastdump", "--partial", dump, out, capsys=capsys)
    assert code == 0
    assert [line for line in err.splitlines() if "warning" in line] == \
        [f"fastdump export: warning: {want}; exported as written (--partial)"]
    if fmt == "sglang":
        dest = out / "TP0_PP0_Rank0_pid100"
        assert sorted(p.name for p in (out / "TP1_PP0_Rank1_pid101").glob("*.pt")) == ["Pass00000.pt", "Pass00002.pt"]
        assert torch.equal(torch.load(dest / "Pass00001.pt", weights_only=True)["x"], torch.full((2,), 10.0))
    else:
        assert sorted(p.name for p in out.glob("*step=1*")) == ["name=x___step=1___rank=0___dump_index=2.pt"]


def test_tp_ranks_holding_the_same_passes_export_without_a_warning(tmp_path, capsys):
    dump = write_tp_group(tmp_path / "dump", [[0, 1, 2], [0, 1, 2]])
    code, _, err = run_cli("--format", "sglang-dumper", "--names", "fastdump", dump, tmp_path / "out", capsys=capsys)
    assert code == 0 and err == ""
    got = torch.load(tmp_path / "out" / "name=x___step=2___rank=1___dump_index=3.pt", weights_only=False)
    assert torch.equal(got["value"], torch.full((2,), 21.0))


def test_a_tp_group_with_a_rank_twice_is_not_checked_for_missing_passes(tmp_path, capsys):
    """Two sessions of TP rank 0 in one dump (attach/close twice): which ranks ran together cannot be
    told, so a pass one session lacks is no loss the export can name; each session is exported as
    written, under its whole name, no pass refused."""
    from conftest import write_rank_dir

    dump = write_tp_group(tmp_path / "dump", [[0, 1, 2], [0, 1, 2]])
    again = "TP0_PP0_Rank0_pid100_20260101T000001.000000Z-00000002"
    write_rank_dir(dump / "target" / again, {0: {"x": torch.full((2,), 7.0)}},
                   rank={"tp_rank": 0, "tp_size": 2, "pp_rank": 0, "pp_size": 1, "rank": 0})
    code, _, err = run_cli("--format", "sglang", "--names", "fastdump", dump, tmp_path / "out", capsys=capsys)
    assert code == 0, err
    assert "missing" not in err and "has 2 sessions" in err
    assert sorted(p.name for p in (tmp_path / "out" / again).glob("*.pt")) == ["Pass00000.pt"]
    assert torch.equal(torch.load(tmp_path / "out" / again / "Pass00000.pt", weights_only=True)["x"], torch.full((2,), 7.0))


def test_the_dumper_layout_records_the_world_of_tp_and_pp_and_saves_each_tensor_alone(tmp_path, capsys):
    """TP1 x PP2: world_size is tp_size * pp_size (2), each stage's world rank its own. Each file
    holds its tensor's bytes only: a loaded tensor may view a larger block, and torch.save writes
    a view's whole storage (every other tensor of the pass, in every file)."""
    from conftest import write_rank_dir

    dump = tmp_path / "dump"
    big = {f"t{i}": torch.full((64,), float(i)) for i in range(8)}
    for pp in range(2):
        numbers = {"tp_rank": 0, "tp_size": 1, "pp_rank": pp, "pp_size": 2, "rank": pp}
        write_rank_dir(dump / "target" / f"TP0_PP{pp}_Rank{pp}_pid10{pp}_20260101T000000.000000Z-0000000{pp}",
                       {p: big for p in range(3)}, rank=numbers)
    code, _, err = run_cli("--format", "sglang-dumper", "--names", "fastdump", dump, tmp_path / "out", capsys=capsys)
    assert code == 0, err
    for pp in range(2):
        got = torch.load(tmp_path / "out" / f"name=t3___step=0___rank={pp}___dump_index=4.pt", weights_only=False)
        assert got["meta"]["world_size"] == 2 and got["meta"]["world_rank"] == pp
        assert got["meta"]["sglang_parallel_info"] == {"tp_rank": 0, "tp_size": 1, "pp_rank": pp, "pp_size": 2}
        value = got["value"]
        assert torch.equal(value, big["t3"]) and value.untyped_storage().nbytes() == 64 * 4


def test_a_pass_without_tensors_writes_no_pass_file(tmp_path, capsys):
    """A pass that dumped nothing has nothing for SGLang's tools: no Pass file (an empty dict read
    as a pass of the model), and it is not counted as written; its metadata is still recorded (a
    mutant writing every pass survived). A dump of such passes only writes nothing: exit 1 (a
    mutant exiting 0 survived)."""
    root = tmp_path / "dump"
    with fastdump.attach(None, root, writer="thread") as d:
        for p in range(3):
            d.begin_pass()
            if p != 1:
                d.dump("a", torch.full((2,), float(p)))
            d.end_pass()
    out = tmp_path / "out"
    assert export.export_sglang(root, out, names="fastdump") == 2
    (dest,) = out.iterdir()
    assert sorted(p.name for p in dest.glob("Pass*.pt")) == ["Pass00000.pt", "Pass00002.pt"]
    assert torch.equal(torch.load(dest / "Pass00002.pt", weights_only=True)["a"], torch.full((2,), 2.0))
    assert sorted(json.loads((dest / "fastdump_passes.json").read_text())) == ["0", "1", "2"]
    empty = tmp_path / "empty"
    with fastdump.attach(None, empty, writer="thread") as d:
        d.begin_pass()
        d.end_pass()
    for fmt in ("sglang", "sglang-dumper"):
        code, out, _ = run_cli("--format", fmt, "--names", "fastdump", empty, tmp_path / f"out-{fmt}", capsys=capsys)
        assert code == 1 and out.startswith("wrote 0 "), (fmt, out)


def test_file_numbers_and_steps_are_pass_ids_counting_the_forwards_left_out(tmp_path):
    """FASTDUMP_SKIP / every: the exported Pass file number (and the dumper layout's step) is the pass
    id, which counts every forward of the role (docs/INTEGRATIONS.md, Export): skip 2 of 4 forwards
    gives Pass00002 and Pass00003, not SGLang's gapless Pass00000 and Pass00001."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    outs = []
    with fastdump.attach(model, tmp_path / "dump", skip_passes=2, writer="thread"), torch.no_grad():
        for i in range(4):
            outs.append(model(torch.full((1, 3), float(i))))
    assert export.export_sglang(tmp_path / "dump", tmp_path / "pass") == 2
    (rank_dir,) = (tmp_path / "pass").iterdir()
    assert sorted(p.name for p in rank_dir.glob("Pass*.pt")) == ["Pass00002.pt", "Pass00003.pt"]
    assert torch.equal(torch.load(rank_dir / "Pass00003.pt", weights_only=True)["1"], outs[3])
    export.export_sglang_dumper(tmp_path / "dump", tmp_path / "dumper")
    steps = {int(re.search(r"___step=(\d+)", p.name).group(1)) for p in (tmp_path / "dumper").glob("*.pt")}
    assert steps == {2, 3}


def test_every_sub_byte_integer_type_is_exported_as_its_8_bit_type_bit_for_bit(capsys):
    """torch.save cannot write uint1..uint7 nor int1..int7: each is exported as the 8-bit integer of
    its signedness, one element a byte, its bits unchanged, said once per rank and type."""
    import io


    said = set()
    kinds = [(f"{kind}{bits}", torch.uint8 if kind == "uint" else torch.int8) for kind in ("uint", "int")
             for bits in range(1, 8)]
    kinds = [(name, container) for name, container in kinds if hasattr(torch, name)]
    assert ("uint7", torch.uint8) in kinds  # (this torch has the sub-byte types at all)
    for name, container in kinds:
        stored = torch.tensor([0, 1, 3], dtype=container).view(getattr(torch, name))
        saved = export._savable(stored, "target", 0, said)
        assert saved.dtype == container and saved.tolist() == [0, 1, 3], name
        torch.save(saved, io.BytesIO())
    assert said == {("target", 0, name) for name, _ in kinds}
    assert capsys.readouterr().err.count("torch.save cannot write") == len(kinds)
