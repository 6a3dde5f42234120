"""fastdump diff / fastdump.diff on dumps made by fastdump itself from the toy models."""

import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import torch

import fastdump
from fastdump import cli, stats
from fastdump.compare import DiffError

from toy_models import TinyLM

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def dump_model(root, model, steps=3, role="target", writer="thread"):
    """Prefill of 4 tokens then decode steps, each forward one pass, forward_mode in the metadata."""
    caches = model.new_cache()
    ids = torch.tensor([[3, 14, 15, 9]])
    with fastdump.attach(model, root, role=role, writer=writer) as dumper, torch.inference_mode():
        for step in range(steps):
            dumper.set_pass_meta(forward_mode="prefill" if step == 0 else "decode")
            logits = model(ids, caches)
            ids = logits[:, -1:].argmax(-1)
    return root


def run(capsys, *argv):
    code = cli.main(["diff", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    base = tmp_path_factory.mktemp("twins")
    return dump_model(base / "a", TinyLM(seed=0)), dump_model(base / "b", TinyLM(seed=0))


@pytest.fixture(scope="module")
def perturbed(tmp_path_factory, twins):
    model = TinyLM(seed=0)
    with torch.no_grad():
        model.model.layers[1].mlp.up.weight[0, 0] += 0.5
    return dump_model(tmp_path_factory.mktemp("perturbed") / "p", model)


# ---------------------------------------------------------------------------------------- models


def test_twin_models_pass(twins, capsys):
    code, out, err = run(capsys, *twins)
    assert code == 0, out + err
    assert out.splitlines()[0].startswith("no divergence:")
    result = fastdump.diff(*twins)
    assert result.ok and result.first_divergence is None and result.failed == 0
    names = fastdump.open(twins[0]).pass_names("target", 0, 0)
    assert result.compared == 3 * len(names) and result.missing == []
    assert all(row["max_abs"] == 0 and row["rel_diff"] == 0 and row["status"] == "ok" for row in result.rows)
    with fastdump.open(twins[0]) as opened:  # an open DumpSet works as well as a path
        assert fastdump.diff(opened, twins[1]).to_json() == result.to_json()


def test_perturbed_layer_is_the_first_divergence(twins, perturbed, capsys):
    code, out, err = run(capsys, twins[0], perturbed)
    assert code == 1, out + err
    lines = out.splitlines()
    assert lines[0].startswith("first divergence: target rank 0 pass 0 model.layers.1.mlp.up ")
    result = fastdump.diff(twins[0], perturbed)
    first = result.first_divergence
    assert (first["role"], first["rank"], first["pass"], first["name"]) == ("target", 0, 0, "model.layers.1.mlp.up")
    # Everything dumped before it in pass 0 is identical; one FAIL line per failing tensor.
    order = fastdump.open(twins[0]).pass_names("target", 0, 0)
    before = order[:order.index("model.layers.1.mlp.up")]
    assert {r["name"] for r in result.rows if r["pass"] == 0 and r["status"] == "ok"} >= set(before)
    assert len([line for line in lines if line.startswith("FAIL ")]) == result.failed > 1
    fail = next(line for line in lines if line.startswith("FAIL "))
    for word in ("max_abs", "max_rel", "rel_diff", "cosine", "mismatch"):
        assert word in fail
    assert first["max_abs"] > 0.01 and 0 < first["mismatch"] <= 1


def test_tiny_relative_perturbation_is_within_tolerance(twins, tmp_path, capsys):
    model = TinyLM(seed=0)
    with torch.no_grad():
        for p in model.model.layers[0].mlp.parameters():
            p.mul_(1 + 2e-7)
    nudged = dump_model(tmp_path / "n", model)
    code, out, err = run(capsys, twins[0], nudged)
    assert code == 0, out + err
    result = fastdump.diff(twins[0], nudged)
    assert max(row["max_abs"] for row in result.rows) > 0  # not bit-identical: the tolerance did it
    strict = fastdump.diff(twins[0], nudged, atol=0, rtol=0)
    assert not strict.ok and strict.first_divergence["name"].startswith("model.layers.0.mlp")
    # Per-name tolerance: loosened only where it fails, the strict run passes again.
    assert fastdump.diff(twins[0], nudged, atol=0, rtol=0, tol=[r".*=1e-5,1e-5"]).ok


def test_json_output(twins, perturbed, capsys):
    code, out, _ = run(capsys, twins[0], perturbed, "--json")
    assert code == 1
    def strict(constant):
        raise AssertionError(f"not strict JSON: {constant}")

    data = json.loads(out, parse_constant=strict)
    assert set(data) >= {"first_divergence", "compared", "failed", "missing", "rows"}
    first = data["first_divergence"]
    assert first["name"] == "model.layers.1.mlp.up" and first["pass"] == 0 and first["role"] == "target"
    assert {"rank", "max_abs", "rel_diff", "cosine", "mismatch"} <= set(first)
    assert data["failed"] == sum(row["status"] != "ok" for row in data["rows"])
    assert data["compared"] == len(data["rows"])


def test_html_report_names_the_divergence_and_holds_svg_plots(twins, perturbed, tmp_path, capsys):
    report = tmp_path / "report.html"
    code, out, _ = run(capsys, twins[0], perturbed, "--html", report)
    assert code == 1
    text = report.read_text()
    assert "model.layers.1.mlp.up" in text and "First divergence" in text
    assert not re.search(r"""(src|href)\s*=\s*["']?https?:""", text)  # self-contained
    svgs = re.findall(r"<svg.*?</svg>", text, flags=re.S)
    assert len(svgs) == 2
    plots = [ET.fromstring(svg) for svg in svgs]
    ns = "{http://www.w3.org/2000/svg}"
    line_plot, heat = plots
    assert len(line_plot.findall(f"{ns}circle")) == len(fastdump.open(twins[0]).pass_names("target", 0, 0))
    red = [c for c in line_plot.findall(f"{ns}circle") if c.get("fill") == "#d22820"]
    assert red and "model.layers.1.mlp.up" in red[0].find(f"{ns}title").text
    # Heatmap: 3 passes x (3 layers + other), layer 0 of pass 0 unchanged, layer 1 diverged.
    cells = [r.find(f"{ns}title").text for r in heat.findall(f"{ns}rect") if r.find(f"{ns}title") is not None]
    assert len(cells) == 3 * 4
    assert "pass 0 layer 0: max rel_diff 0" in cells
    (layer1,) = [t for t in cells if t.startswith("pass 0 layer 1:")]
    value, _, failing = layer1.partition("max rel_diff ")[2].partition(", ")
    assert float(value) > 1e-6 and failing.endswith(" failing")


# ------------------------------------------------------------------------------------ TP unshard


FULL = {
    "embed": lambda p: torch.arange(32, dtype=torch.float32).reshape(8, 4) + p,   # vocab-parallel: dim 0
    "qkv": lambda p: torch.linspace(-1, 1, 24).reshape(2, 12) * (p + 1),         # column-parallel: dim 1
    "norm": lambda p: torch.full((2, 4), 0.25 * (p + 1)),                         # replicated
    "o_partial": lambda p: torch.ones(2, 4) * (p + 3),                            # row-parallel partial sums
}


def shards_of(name, pass_id, tp):
    full = FULL[name](pass_id)
    if name == "embed":
        return list(full.chunk(tp, 0))
    if name == "qkv":
        return list(full.chunk(tp, 1))
    if name == "norm":
        return [full.clone() for _ in range(tp)]
    weights = [(r + 1) / (tp * (tp + 1) / 2) for r in range(tp)]
    return [full * w for w in weights]  # partial sums: unequal per rank, adding up to the full value


def manual_dump(root, tp, passes=3, change=None, layout=None, tp_ranks=None):
    dumpers = [fastdump.attach(None, root, tp_rank=r, tp_size=tp, writer="thread") for r in range(tp)]
    try:
        for pass_id in range(passes):
            for rank, dumper in enumerate(dumpers):
                if tp_ranks is not None and rank not in tp_ranks:
                    continue
                dumper.begin_pass(**({"tp_layout": layout} if layout else {}))
                for name in FULL:
                    shard = shards_of(name, pass_id, tp)[rank]
                    if change and change == (name, pass_id, rank):
                        shard = shard.clone()
                        shard.reshape(-1)[0] += 1.0
                    dumper.dump(name, shard)
                dumper.end_pass()
    finally:
        for dumper in dumpers:
            dumper.close()
    return root


def test_tp2_against_tp1_unshards(tmp_path, capsys):
    base = manual_dump(tmp_path / "tp1", 1)
    target = manual_dump(tmp_path / "tp2", 2)
    code, out, err = run(capsys, base, target, "--unshard", "partial$=sum")
    assert code == 0, out + err
    result = fastdump.diff(base, target, unshard={"partial$": "sum"})
    rules = {row["name"]: row["unshard"] for row in result.rows}
    assert rules == {"embed": 0, "qkv": 1, "norm": "replicated", "o_partial": "sum"}
    assert result.compared == 3 * 4
    assert all(row["max_abs"] == 0 for row in result.rows if row["name"] != "o_partial")
    assert all(row["max_abs"] <= 1e-6 for row in result.rows)  # partial sums round differently
    # Without the rule, partial sums look replicated but disagree across ranks: a failure with a hint.
    loose = fastdump.diff(base, target)
    bad = [row for row in loose.rows if row["status"] != "ok"]
    assert {row["name"] for row in bad} == {"o_partial"} and "partial sums" in bad[0]["reason"]


def test_sum_unshard_keeps_imaginary_parts(tmp_path):
    """Partial sums were added as .to(float64), which drops a complex shard's imaginary part:
    TP2 against TP4 compared only the real parts, and imaginary parts that differ passed."""
    full = torch.tensor([1 + 1j, 2 + 2j], dtype=torch.complex64)

    def dump(root, shards):
        for rank, shard in enumerate(shards):
            with fastdump.attach(None, root, tp_rank=rank, tp_size=len(shards), writer="thread") as dumper:
                dumper.begin_pass()
                dumper.dump("o_proj", shard)
                dumper.end_pass()
        return root

    base = dump(tmp_path / "tp2", [full / 2] * 2)
    target = dump(tmp_path / "tp4", [full.real.to(torch.complex64) / 4] * 4)  # imaginary parts 0
    result = fastdump.diff(base, target, unshard={"o_proj": "sum"})
    (row,) = result.rows
    assert not result.ok and row["status"] == "fail" and row["mismatches"] == 2 and row["max_abs"] == 2.0
    assert fastdump.diff(base, dump(tmp_path / "same", [full / 4] * 4), unshard={"o_proj": "sum"}).ok


def test_tp2_one_shard_changed_names_that_tensor(tmp_path, capsys):
    base = manual_dump(tmp_path / "tp1", 1)
    target = manual_dump(tmp_path / "tp2", 2, change=("qkv", 1, 1))
    code, out, err = run(capsys, base, target, "--unshard", "partial$=sum")
    assert code == 1, out + err
    assert out.splitlines()[0].startswith("first divergence: target rank dp0:merged pass 1 qkv ")
    result = fastdump.diff(base, target, unshard=["partial$=sum"])
    assert [(row["name"], row["pass"]) for row in result.failures] == [("qkv", 1)]
    assert result.failures[0]["mismatches"] == 1


def test_pp2_against_pp1_takes_stages_in_order(tmp_path):
    base = manual_dump(tmp_path / "pp1", 1)
    root = tmp_path / "pp2"
    names = list(FULL)
    stages = [fastdump.attach(None, root, pp_rank=r, pp_size=2, tp_rank=0, tp_size=1, writer="thread")
              for r in range(2)]
    try:
        for pass_id in range(3):
            for stage, dumper in enumerate(stages):  # stage 0 holds the first half of the model
                dumper.begin_pass()
                for name in names[2 * stage:2 * stage + 2]:
                    dumper.dump(name, shards_of(name, pass_id, 1)[0])
                dumper.end_pass()
    finally:
        for dumper in stages:
            dumper.close()
    result = fastdump.diff(base, root)
    assert result.ok and result.compared == 3 * 4
    assert [row["name"] for row in result.rows if row["pass"] == 0] == names
    assert {row["rank"] for row in result.rows} == {"dp0:merged"}


def test_recorded_layout_wins_over_inference(tmp_path):
    base = manual_dump(tmp_path / "tp1", 1)
    target = manual_dump(tmp_path / "tp2", 2, layout={"o_partial": "sum"})
    result = fastdump.diff(base, target)
    assert result.ok and {row["name"]: row["unshard"] for row in result.rows}["o_partial"] == "sum"
    # An explicit rule still wins over the recorded one (and here it is wrong: a failure).
    assert not fastdump.diff(base, target, unshard=["partial=replicated"]).ok


def test_tp2_against_tp2_pairs_ranks_by_number_not_directory(tmp_path):
    a = manual_dump(tmp_path / "a", 2)
    b = manual_dump(tmp_path / "b", 2, change=("embed", 0, 1))
    # Rename b's rank directories so that no name matches a's and tp rank 1 sorts first: pairing must
    # follow the rank numbers in rank.json, not names or listing order.
    for entry in os.listdir(b / "target"):
        prefix = "a" if entry.startswith("TP1_") else "z"
        os.rename(b / "target" / entry, b / "target" / f"{prefix}-{entry.replace('_pid', '_sessionX_pid')}")
    assert sorted(os.listdir(b / "target"))[0].startswith("a-TP1_")
    result = fastdump.diff(a, b)
    assert {row["rank"] for row in result.rows} == {0, 1}
    assert [(row["rank"], row["name"], row["pass"]) for row in result.failures] == [(1, "embed", 0)]


# ------------------------------------------------------------------------------------ multi-root


def test_multiple_roots_read_as_one_dump(tmp_path, capsys):
    base = manual_dump(tmp_path / "tp1", 1)
    target = manual_dump(tmp_path / "tp2", 2)
    host_a, host_b = tmp_path / "hostA", tmp_path / "hostB"
    for host, tp_rank in ((host_a, 0), (host_b, 1)):
        (host / "target").mkdir(parents=True)
        entry = next(e for e in os.listdir(target / "target") if e.startswith(f"TP{tp_rank}_"))
        shutil.copytree(target / "target" / entry, host / "target" / entry)
    with fastdump.open([host_a, host_b]) as ds:
        assert len(ds.ranks("target")) == 2
        assert ds.load("target", 1, 0)["qkv"].equal(shards_of("qkv", 0, 2)[1])
    code, out, err = run(capsys, "--baseline-root", base, "--target-root", host_a, "--target-root", host_b,
                         "--unshard", "partial$=sum")
    assert code == 0, out + err
    code, out, err = run(capsys, base, str(tmp_path / "host*"), "--unshard", "partial$=sum")  # a glob
    assert code == 0, out + err
    # The same rank in two roots is refused, not silently merged.
    shutil.copytree(host_a, tmp_path / "hostA2")
    with pytest.raises(ValueError, match="duplicate"):
        fastdump.open([host_a, tmp_path / "hostA2"])
    code, out, err = run(capsys, base, str(tmp_path / "host*"))
    assert code == 2 and "duplicate" in err


# --------------------------------------------------------------------------------- pass alignment


def test_align_by_metadata_field(tmp_path, twins):
    model = TinyLM(seed=0)
    caches = model.new_cache()
    root = tmp_path / "shifted"
    ids = torch.tensor([[3, 14, 15, 9]])
    with fastdump.attach(model, root, writer="thread", skip_passes=0) as dumper, torch.inference_mode():
        # A warm-up forward on a separate cache first: pass ids are shifted by one against the twin.
        dumper.set_pass_meta(forward_mode="warmup")
        model(ids, model.new_cache())
        for step in range(3):
            dumper.set_pass_meta(forward_mode="prefill" if step == 0 else "decode")
            ids = model(ids, caches)[:, -1:].argmax(-1)
    by_id = fastdump.diff(twins[0], root)
    assert not by_id.ok and by_id.failed  # pass 1 is a decode step here, the prefill there
    aligned = fastdump.diff(twins[0], root, align="meta:forward_mode=decode")
    assert aligned.ok and {(r["baseline_pass"], r["pass"]) for r in aligned.rows} == {(1, 2), (2, 3)}
    shifted = fastdump.diff(twins[0], root, align="offset:1")
    assert {(r["baseline_pass"], r["pass"]) for r in shifted.rows} == {(0, 1), (1, 2), (2, 3)} and shifted.ok
    assert shifted.missing == [{"kind": "passes", "only_in": "target", "role": "target", "rank": 0, "passes": [0]}]
    in_order = fastdump.diff(twins[0], root, align="order", passes="2")
    assert {(r["baseline_pass"], r["pass"]) for r in in_order.rows} == {(2, 2)} and not in_order.ok


def test_names_on_one_side_are_missing_not_errors(tmp_path, twins):
    model = TinyLM(seed=0)
    only_layers = dump_model(tmp_path / "sub", model)
    shutil.rmtree(tmp_path / "sub")
    caches = model.new_cache()
    with fastdump.attach(model, tmp_path / "sub", writer="thread", exclude=r"stats") as d, torch.inference_mode():
        for step in range(3):
            d.set_pass_meta(forward_mode="prefill" if step == 0 else "decode")
            model(torch.tensor([[3, 14, 15, 9]]) if step == 0 else torch.tensor([[1]]), caches)
    result = fastdump.diff(twins[0], only_layers, name=r"^model\.(embed|layers\.0\.)|stats")
    names = {m["name"] for m in result.missing if m["kind"] == "name"}
    assert names == {"model.stats.mean", "model.stats.max", "model.stats#1.mean", "model.stats#1.max"}
    assert all(m["only_in"] == "baseline" for m in result.missing)


# ------------------------------------------------------------------------------------ bad input


def test_missing_tp_rank_is_refused_not_blamed_on_shapes(tmp_path, capsys):
    base = manual_dump(tmp_path / "tp1", 1)
    target = manual_dump(tmp_path / "tp2", 2)
    (lost,) = [e for e in os.listdir(target / "target") if e.startswith("TP1_")]
    shutil.rmtree(target / "target" / lost)
    code, out, err = run(capsys, base, target)  # nothing else to compare: no rank in common (exit 2)
    assert code == 2 and "no rank in common" in err
    assert "rank pp0 tp1 (dp 0) only in the baseline" in err and "tp rank 1 of 2" in err


def test_bad_inputs_exit_2_without_traceback(tmp_path, twins, capsys):
    code, _, err = run(capsys, tmp_path / "nope", twins[1])
    assert code == 2 and "no dump directory" in err
    unrelated = tmp_path / "unrelated"
    seq = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    with fastdump.attach(seq, unrelated, writer="thread"), torch.inference_mode():
        seq(torch.ones(1, 4))
    code, _, err = run(capsys, twins[0], unrelated)
    assert code == 2 and "different models" in err
    code, _, err = run(capsys, twins[0], twins[1], "--role", "draft")
    assert code == 2 and "no role 'draft'" in err
    code, _, err = run(capsys, twins[0], twins[1], "--name", "no-such-name")
    assert code == 2 and "matches no tensor" in err
    for option, value, message in (("--tol", "bad", "REGEX=ATOL,RTOL"), ("--tol", "x=1,-1", ">= 0"),
                                   ("--unshard", "x=diagonal", "dimension, 'replicated' or 'sum'"),
                                   ("--metric", "l2", "one of allclose"), ("--align", "meta:mode", "offset:K"),
                                   ("--passes", "1..3", "N-M"), ("--name", "(", "bad regular expression")):
        code, _, err = run(capsys, twins[0], twins[1], option, value)
        assert code == 2 and message in err, (option, value, err)
    done = subprocess.run([sys.executable, "-m", "fastdump", "diff", str(twins[0]), str(unrelated)],
                          capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    assert done.returncode == 2 and "Traceback" not in done.stderr and "different models" in done.stderr


def _rank_dir(root):
    (entry,) = os.listdir(root / "target")
    return root / "target" / entry


def test_a_misspelt_option_of_fastdump_diff_names_the_closest(twins):
    """fastdump.diff(a, b, atl=1e-3) said "Options.__init__() got an unexpected keyword argument
    'atl'": the TypeError names diff and the option meant, as attach's does."""
    with pytest.raises(TypeError) as info:
        fastdump.diff(twins[0], twins[1], atl=1e-3, progres=True)
    message = str(info.value)
    assert message.startswith("diff: unknown option(s) 'atl' (did you mean 'atol'?), 'progres' (did you mean "
                              "'progress'?); the options are align, allow_running, atol,")
    assert fastdump.diff(twins[0], twins[1], atol=1e-3).ok  # the options spelt right still work


def test_dump_being_written_is_refused(tmp_path, twins):
    root = tmp_path / "live"
    shutil.copytree(twins[1], root)
    rank = _rank_dir(root)
    info = json.loads((rank / "rank.json").read_text())
    (rank / "rank.json").write_text(json.dumps({**info, "status": "running"}))
    (rank / ".seg-000009.h5.tmp").write_bytes(b"partial")
    with pytest.raises(DiffError, match="still being written.*seg-000009"):
        fastdump.diff(twins[0], root)
    assert fastdump.diff(twins[0], root, allow_running=True).ok


def test_corrupt_segment_is_reported_with_its_path(tmp_path, twins, capsys):
    root = tmp_path / "corrupt"
    shutil.copytree(twins[1], root)
    (segment,) = [p for p in _rank_dir(root).iterdir() if p.name.startswith("seg-")]
    segment.write_bytes(segment.read_bytes()[:200])
    code, out, err = run(capsys, twins[0], root)
    assert code == 2 and str(segment) in err + out and "Traceback" not in err


def test_damaged_block_is_a_read_error_row(tmp_path, twins, capsys):
    import h5py

    root = tmp_path / "damaged"
    shutil.copytree(twins[1], root)
    (segment,) = [p for p in _rank_dir(root).iterdir() if p.name.startswith("seg-")]
    with h5py.File(segment, "r+") as f:
        del f["blocks"]["0"]  # the index still points at it
    code, out, err = run(capsys, twins[0], root)
    assert code == 2, out + err
    result = fastdump.diff(twins[0], root)
    errors = result.read_errors
    assert errors and all(str(_rank_dir(root)) == row["path"] for row in errors) and result.exit_code == 2


# ------------------------------------------------------------------------------------- statistics


def test_compare_statistics_match_their_definitions():
    b = torch.tensor([1.0, 2.0, 0.0, float("nan"), float("inf"), 4.0], dtype=torch.float64)
    a = torch.tensor([1.0, 2.5, 1e-6, float("nan"), float("inf"), -4.0], dtype=torch.float64)
    r = stats.compare(b, a, atol=1e-5, rtol=1e-5)
    x, y = a[[0, 1, 2, 5]], b[[0, 1, 2, 5]]
    assert r["rel_diff"] == pytest.approx(1 - 2 * float((x * y).sum()) / float((x * x + y * y).sum()))
    assert r["cosine"] == pytest.approx(float((x * y).sum() / (x.norm() * y.norm())))
    assert r["max_abs"] == 8.0 and r["max_rel"] == float("inf")  # 1e-6 against an exact 0
    assert stats.compare(b[[0, 1, 5]], a[[0, 1, 5]], 0, 0)["max_rel"] == pytest.approx(2.0)
    assert r["mismatches"] == 2 and r["mismatch"] == pytest.approx(2 / 6)  # 2.5 vs 2, -4 vs 4; nan==nan, inf==inf
    one_sided = stats.compare(torch.tensor([1.0]), torch.tensor([float("nan")]), 1, 1)
    assert one_sided["mismatches"] == 1 and one_sided["nonfinite_mismatches"] == 1


def test_compare_across_dtypes_and_chunks(monkeypatch):
    monkeypatch.setattr(stats, "CHUNK_ELEMENTS", 7)  # many chunks: the merge must equal one pass
    full = torch.randn(5, 13, dtype=torch.float32)
    r = stats.compare(full, full.to(torch.bfloat16), atol=0, rtol=2 ** -8)
    assert r["mismatches"] == 0 and r["max_rel"] <= 2 ** -8 and r["max_abs"] > 0
    s = stats.tensor_stats(full)
    assert s["mean"] == pytest.approx(float(full.double().mean())) and s["std"] == pytest.approx(
        float(full.double().std(unbiased=False)))
    packed = torch.zeros(3, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    assert stats.compare(packed, packed, 0, 0)["bitwise"] and stats.compare(packed, packed, 0, 0)["mismatches"] == 0


def test_show_uses_the_shared_statistics(twins, capsys):
    assert cli.main(["show", str(twins[0]), "--pass", "0", "--name", "lm_head"]) == 0
    out = capsys.readouterr().out
    logits = fastdump.open(twins[0]).tensor("target", 0, "lm_head", 0)
    assert f"{float(logits.double().std(unbiased=False)):.6g}" in out


def test_large_passes_are_read_tensor_by_tensor(twins, perturbed, monkeypatch):
    from fastdump import compare, reader

    expected = fastdump.diff(twins[0], perturbed).to_json()
    monkeypatch.setattr(compare._PassCache, "PASS_CACHE_BYTES", 0)

    def no_whole_pass(*args, **kwargs):
        raise AssertionError("a pass over the cache budget must not be loaded whole")

    monkeypatch.setattr(reader.DumpSet, "load", no_whole_pass)
    assert fastdump.diff(twins[0], perturbed).to_json() == expected


def test_rank_filter_and_progress_off_without_terminal(tmp_path, capsys):
    a = manual_dump(tmp_path / "a", 2)
    b = manual_dump(tmp_path / "b", 2, change=("embed", 0, 1))
    assert fastdump.diff(a, b, rank=0).ok
    assert not fastdump.diff(a, b, rank=1, progress=True).ok
    assert capsys.readouterr().err == ""  # stderr is not a terminal here: no progress bar
    with pytest.raises(DiffError, match="no rank 5"):
        fastdump.diff(a, b, rank=5)


def test_bfloat16_against_float32_with_metrics(twins, tmp_path, capsys):
    low = dump_model(tmp_path / "bf16", TinyLM(seed=0).to(torch.bfloat16))
    strict = fastdump.diff(twins[0], low)
    assert strict.exit_code == 1 and strict.rows[0]["dtype"] == "bfloat16"
    assert strict.rows[0]["baseline_dtype"] == "float32"
    assert 0 < max(row["rel_diff"] for row in strict.rows) < 1e-3
    code, out, err = run(capsys, twins[0], low, "--metric", "rel_diff=1e-3", "--metric", "cosine=1e-3")
    assert code == 0, out + err
    # The verdict is the metrics': the first line said "all within tolerance (atol 1e-05, rtol 1e-05)",
    # which these bf16 tensors are not (the strict diff above fails them).
    assert out.splitlines()[0] == (f"no divergence: {strict.compared} tensor(s) compared, all within tolerance "
                                   f"(rel_diff <= 0.001; cosine distance <= 0.001)")
    report = tmp_path / "report.html"
    run(capsys, twins[0], low, "--metric", "rel_diff=1e-3", "--html", report)
    assert "<td>rel_diff &lt;= 0.001</td>" in report.read_text() and "rtol*|b|" not in report.read_text()
    code, out, _ = run(capsys, twins[0], twins[0], "--metric", "allclose", "--metric", "rel_diff=1e-3",
                       "--tol", "lm_head=1e-2,0")
    assert out.splitlines()[0].endswith("all within tolerance (atol 1e-05, rtol 1e-05 and 1 --tol rule(s); "
                                        "rel_diff <= 0.001)")
    code, out, err = run(capsys, twins[0], low, "--metric", "rel_diff=1e-9")
    assert code == 1 and "exceeds rel_diff>1e-09" in out


def _mark_pass_incomplete(rank_dir, pass_id):
    """What the writer records when a pass never ended (passes table complete = 0)."""
    import h5py

    from conftest import restamp_tables

    for segment in sorted(rank_dir.glob("seg-*.h5")):
        with h5py.File(segment, "r+") as f:
            passes = f["passes"][()]
            if pass_id not in passes["pass"]:
                continue
            passes["complete"][passes["pass"] == pass_id] = 0
            f["passes"][...] = passes
        restamp_tables(segment)
        return
    raise AssertionError(f"no pass {pass_id} in {rank_dir}")


def test_a_pass_incomplete_in_one_tp_shard_only_is_noted_in_text_json_and_html(tmp_path):
    base = manual_dump(tmp_path / "tp1", 1)
    target = manual_dump(tmp_path / "tp2", 2)
    (shard1,) = (target / "target").glob("TP1_*")
    _mark_pass_incomplete(shard1, 1)  # the second shard: the first one's pass is whole
    result = fastdump.diff(base, target, unshard={"partial$": "sum"})
    expected = f"target rank dp0:merged: target pass 1 is marked incomplete in {shard1.name}"
    assert result.ok and result.notes == [expected], result.notes
    assert expected in "\n".join(result.lines())
    assert json.loads(result.to_json())["notes"] == [expected]
    page = tmp_path / "report.html"
    result.to_html(page)
    html = page.read_text()
    assert "<h2>Notes</h2>" in html and f"marked incomplete in {shard1.name}" in html


def test_compare_md_worked_example_runs_as_written_and_prints_what_the_page_shows(tmp_path, monkeypatch, capsys):
    """docs/COMPARE.md's worked example, run twice as a reader trying it would: the second run
    added a second session to dumps/old and dumps/new, and the diff then refused both (exit 2).
    The page's output also printed `cosine 1` where the diff prints `1-4.86e-09`."""
    from conftest import DOCS, doc_example

    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        exec(compile(doc_example("dump-two-runs", "COMPARE.md"), "COMPARE.md:dump-two-runs", "exec"), {})
    code, out, _ = run(capsys, "dumps/old", "dumps/new", "--html", "report.html")
    page = (DOCS / "COMPARE.md").read_text()
    shown = page.split("$ fastdump diff dumps/old dumps/new --html report.html\n", 1)[1].split("$ echo $?")[0]
    shown_lines = [line for line in shown.splitlines() if line != "..."]
    assert code == 1 and out.splitlines()[:4] == shown_lines[:4]
    assert out.splitlines()[-3:] == shown_lines[-3:]
    assert "$ echo $?\n1\n" in page
    exec(compile(doc_example("diff-in-python", "COMPARE.md"), "COMPARE.md:diff-in-python", "exec"),
         {"fastdump": fastdump})
    assert (tmp_path / "report.html").stat().st_size > 0
