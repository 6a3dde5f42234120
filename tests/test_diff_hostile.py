"""Hostile tests of the comparator (fastdump diff / fastdump.diff) on real dumps made by
``fastdump.attach`` on small CPU models: odd dtypes and shapes, non-finite values, tolerance and
metric options at their edges, names/passes/roles/ranks on one side only, incomplete and corrupt
dumps, rank directories (several sessions, malformed rank.json, a pass or a rank missing on one TP
rank, ambiguous passes), JSON against text, and an EAGLE-style target + draft dump compared across
two runs.

Tests once marked ``xfail(strict=True, reason="BUG: ...")`` documented bugs found in fastdump; those
bugs are fixed and the tests pass.
"""

import glob
import json
import math
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
import warnings

import h5py
import numpy as np
import pytest
import torch
from torch import nn

import fastdump
from fastdump import cli, stats
from fastdump.compare import DiffError

from toy_models import TinyDraft, TinyLM
from conftest import restamp_tables, write_rank_dir

NAN, INF = float("nan"), float("inf")


# ------------------------------------------------------------------------------------- helpers


class Emit(nn.Module):
    """A module whose output is a fixed tensor: its dump holds exactly that tensor, under its name."""

    def __init__(self, tensor):
        super().__init__()
        self.tensor = tensor

    def forward(self, x):
        return self.tensor.clone()


class Bag(nn.Module):
    """Children named after the tensors they emit; the root ('Bag') returns its input unchanged."""

    def __init__(self, tensors):
        super().__init__()
        for name, tensor in tensors.items():
            self.add_module(name, Emit(tensor))

    def forward(self, x):
        for child in self.children():
            child(x)
        return x


def dump_bag(root, tensors, passes=1, role="target", **options):
    """Dump one pass per forward of a Bag of ``tensors`` ({name: tensor}) with fastdump.attach."""
    model = Bag(tensors)
    with fastdump.attach(model, root, role=role, writer="thread", **options), torch.inference_mode():
        for _ in range(passes):
            model(torch.zeros(1))
    return root


def pair(tmp_path, baseline, target, **kw):
    """Two dumps of a Bag: {name: tensor} each."""
    return dump_bag(tmp_path / "base", baseline, **kw), dump_bag(tmp_path / "target", target, **kw)


def row_of(result, name, pass_id=0, role="target"):
    (row,) = [r for r in result.rows if r["name"] == name and r["pass"] == pass_id and r["role"] == role]
    return row


def run(capsys, *argv):
    code = cli.main(["diff", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


def rank_dir(root, role="target"):
    (entry,) = os.listdir(os.path.join(root, role))
    return os.path.join(root, role, entry)


def dump_lm(root, model, steps=3, role="target", **options):
    caches = model.new_cache()
    ids = torch.tensor([[3, 14, 15, 9]])
    with fastdump.attach(model, root, role=role, writer="thread", **options) as dumper, torch.inference_mode():
        for step in range(steps):
            dumper.set_pass_meta(forward_mode="prefill" if step == 0 else "decode")
            ids = model(ids, caches)[:, -1:].argmax(-1)
    return root


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return dump_lm(tmp_path_factory.mktemp("lm") / "a", TinyLM(seed=0))


# ------------------------------------------------------------------------------ dtypes and shapes


def test_same_values_in_other_dtypes_compare_equal_and_both_dtypes_are_reported(tmp_path):
    values = [1.0, -2.5, 0.375, 1024.0]  # exact in every float type used here
    base, target = pair(tmp_path, {"f": torch.tensor(values), "b": torch.tensor(values),
                                   "i": torch.tensor([1, -2, 3], dtype=torch.int8)},
                        {"f": torch.tensor(values, dtype=torch.float64), "b": torch.tensor(values, dtype=torch.bfloat16),
                         "i": torch.tensor([1, -2, 3], dtype=torch.int64)})
    result = fastdump.diff(base, target, atol=0, rtol=0)
    assert result.ok and result.exit_code == 0 and result.compared == 4
    for name, dtype, baseline_dtype in (("f", "float64", "float32"), ("b", "bfloat16", "float32"),
                                        ("i", "int64", "int8")):
        row = row_of(result, name)
        assert (row["dtype"], row["baseline_dtype"], row["max_abs"], row["mismatches"]) == \
            (dtype, baseline_dtype, 0.0, 0)


def test_same_numel_other_shape_fails_that_name_only(tmp_path, capsys):
    base, target = pair(tmp_path, {"x": torch.ones(2, 3), "r": torch.ones(6), "e": torch.zeros(0, 3)},
                        {"x": torch.ones(3, 2), "r": torch.ones(1, 6), "e": torch.zeros(0, 4)})
    result = fastdump.diff(base, target)
    assert result.exit_code == 1 and result.failed == 3
    assert result.compared == 1  # only the root 'Bag' had numbers
    reasons = {row["name"]: row["reason"] for row in result.failures}
    assert reasons == {"x": "shape [3, 2] vs baseline [2, 3]", "r": "shape [1, 6] vs baseline [6]",
                       "e": "shape [0, 4] vs baseline [0, 3]"}
    assert all(row["status"] == "fail" and row["max_abs"] is None for row in result.failures)
    assert result.first_divergence["name"] == "x"
    code, out, err = run(capsys, base, target)
    assert code == 1 and "Traceback" not in err
    assert "FAIL target rank 0 pass 0 x  [shape [3, 2] vs baseline [2, 3]]" in out.splitlines()
    assert out.splitlines()[-1] == "compared 1, failed 3, missing 0"


def test_nan_positions_equal_pass_one_sided_nan_and_inf_sign_fail(tmp_path):
    base, target = pair(
        tmp_path,
        {"same": torch.tensor([NAN, 1.0, INF, -INF]), "moved": torch.tensor([NAN, 1.0, 2.0]),
         "sign": torch.tensor([INF, 1.0]), "allnan": torch.full((3,), NAN)},
        {"same": torch.tensor([NAN, 1.0, INF, -INF]), "moved": torch.tensor([1.0, NAN, 2.5]),
         "sign": torch.tensor([-INF, 1.0]), "allnan": torch.ones(3)})
    result = fastdump.diff(base, target, atol=0, rtol=0)
    same = row_of(result, "same")
    assert (same["status"], same["max_abs"], same["mismatches"], same["rel_diff"], same["cosine"]) == \
        ("ok", 0.0, 0, 0.0, 1.0)
    assert same["target_stats"]["nan"] == 1 and same["target_stats"]["inf"] == 2
    moved = row_of(result, "moved")  # NaN moved from element 0 to 1; element 2: 2 vs 2.5
    assert moved["status"] == "fail" and moved["mismatches"] == 3 and moved["mismatch"] == 1.0
    assert moved["max_abs"] == 0.5 and moved["max_rel"] == 0.25  # over elements finite on both sides
    sign = row_of(result, "sign")  # +inf against -inf: a mismatch, invisible in the finite-only numbers
    assert sign["status"] == "fail" and sign["mismatches"] == 1 and sign["mismatch"] == 0.5
    assert sign["max_abs"] == 0.0
    allnan = row_of(result, "allnan")
    assert allnan["status"] == "fail" and allnan["mismatches"] == 3 and allnan["baseline_stats"]["nan"] == 3
    # NaN on one side is a failure under every metric, not only allclose.
    for metric in ("rel_diff=1", "cosine=2"):
        loose = fastdump.diff(base, target, metric=[metric])
        assert {r["name"] for r in loose.failures} == {"moved", "sign", "allnan"}, metric


def test_a_failure_only_in_non_finite_elements_says_so_in_its_line(tmp_path, capsys):
    """+inf against -inf (or a NaN on one side only) fails, but every number of the FAIL line is
    over the elements finite on both sides: it read "max_abs 0 ... rel_diff 0 cosine 1", as a
    match would, with no word of why."""
    base, target = pair(tmp_path, {"sign": torch.tensor([INF, 1.0])}, {"sign": torch.tensor([-INF, 1.0])})
    code, out, err = run(capsys, base, target)
    assert code == 1 and out.splitlines()[0] == (
        "first divergence: target rank 0 pass 0 sign  max_abs 0  max_rel 0  rel_diff 0  cosine 1  mismatch 50.00%  "
        "[exceeds allclose; 1 element(s) NaN or infinite on one side only (or infinite of opposite signs), left "
        "out of max_abs, rel_diff and cosine]")


def test_negative_zero_equals_zero_at_zero_tolerance(tmp_path):
    base, target = pair(tmp_path, {"z": torch.tensor([0.0, -0.0, 1.0])}, {"z": torch.tensor([-0.0, 0.0, 1.0])})
    row = row_of(fastdump.diff(base, target, atol=0, rtol=0), "z")
    assert (row["status"], row["max_abs"], row["max_rel"], row["mismatches"]) == ("ok", 0.0, 0.0, 0)


def _bits(values, int_dtype, dtype):
    return torch.tensor(values, dtype=int_dtype).view(dtype)


def test_nans_equal_whatever_their_sign_and_payload_even_signaling_at_zero_tolerance(tmp_path, capsys):
    """diff compares values, not bits (docs/COMPARE.md): quiet, signaling and negative NaNs are one
    NaN, in every type with arithmetic, and -0.0 is 0.0; a signaling NaN is no reason to warn."""
    i16, u8 = torch.int16, torch.uint8
    base = {"f32": _bits([0x7FC00000, 0, 5], torch.int32, torch.float32),
            "f16": _bits([0x7E00, 0x7E00, 0], i16, torch.float16),
            "bf16": _bits([0x7FC0, 0x7FC0, 0], i16, torch.bfloat16),
            "e4m3fn": _bits([0x7F, 0x00], u8, torch.float8_e4m3fn),
            "e5m2": _bits([0x7E, 0x7F, 0x00], u8, torch.float8_e5m2),
            "c64": torch.complex(_bits([0x7FC00000, 0], torch.int32, torch.float32), torch.zeros(2))}
    target = {"f32": _bits([0x7F800001, -(1 << 31), 5], torch.int32, torch.float32),  # signaling; -0.0
              "f16": _bits([0x7C01, -0x0200, -(1 << 15)], i16, torch.float16),  # signaling; -NaN (0xFE00); -0.0
              "bf16": _bits([0x7F81, -0x0001, -(1 << 15)], i16, torch.bfloat16),  # signaling; -NaN 0xFFFF
              "e4m3fn": _bits([0xFF, 0x80], u8, torch.float8_e4m3fn),  # -NaN; -0.0
              "e5m2": _bits([0xFD, 0x7D, 0x80], u8, torch.float8_e5m2),  # NaNs of other payloads; -0.0
              "c64": torch.complex(_bits([0x7F800001, -(1 << 31)], torch.int32, torch.float32), torch.zeros(2))}
    assert all(not torch.equal(base[k].view(u8), target[k].view(u8)) for k in base)  # (they differ in bits)
    code, out, err = run(capsys, "--atol", "0", "--rtol", "0", *pair(tmp_path, base, target))
    assert code == 0 and err == "", err
    assert out.splitlines()[0].startswith("no divergence: 7 tensor(s) compared"), out
    result = fastdump.diff(tmp_path / "base", tmp_path / "target", atol=0, rtol=0)
    for name in base:
        row = row_of(result, name)
        assert (row["status"], row["mismatches"], row["max_abs"]) == ("ok", 0, 0.0), name
        assert row["baseline_stats"]["nan"] == row["target_stats"]["nan"] >= 1, name


def test_integer_and_bool_tensors_report_exact_numbers(tmp_path):
    base, target = pair(tmp_path, {"i": torch.tensor([1, 2, 3], dtype=torch.int32),
                                   "flag": torch.tensor([True, False, True, False])},
                        {"i": torch.tensor([1, 2, 4], dtype=torch.int32),
                         "flag": torch.tensor([True, True, True, False])})
    result = fastdump.diff(base, target, atol=0, rtol=0)
    i = row_of(result, "i")
    assert (i["status"], i["max_abs"], i["mismatches"], i["dtype"]) == ("fail", 1.0, 1, "int32")
    assert i["max_rel"] == pytest.approx(1 / 3)
    flag = row_of(result, "flag")
    assert (flag["status"], flag["max_abs"], flag["mismatches"], flag["mismatch"], flag["dtype"]) == \
        ("fail", 1.0, 1, 0.25, "bool")
    assert flag["max_rel"] == INF  # True against a False baseline
    # 0 and 1 tolerate a bool flip; the rows then pass.
    assert fastdump.diff(base, target, atol=1, rtol=0).ok


def test_int64_beyond_2_pow_53_differing_by_one_is_a_mismatch(tmp_path):
    base, target = pair(tmp_path, {"ids": torch.tensor([2 ** 53, 7])}, {"ids": torch.tensor([2 ** 53 + 1, 7])})
    result = fastdump.diff(base, target, atol=0, rtol=0)
    row = row_of(result, "ids")
    assert row["status"] == "fail" and row["mismatches"] == 1 and row["max_abs"] == 1.0


def test_complex_tensors_compare_real_and_imaginary_parts(tmp_path):
    base, target = pair(tmp_path, {"c": torch.tensor([1 + 2j, 3 + 4j])}, {"c": torch.tensor([1 + 2j, 3 - 4j])})
    result = fastdump.diff(base, target, atol=0, rtol=0)
    row = row_of(result, "c")
    assert (row["status"], row["dtype"], row["numel"], row["mismatches"], row["mismatch"], row["max_abs"]) == \
        ("fail", "complex64", 2, 1, 0.5, 8.0)
    assert fastdump.diff(base, base, atol=0, rtol=0).ok


def test_complex_max_abs_and_max_rel_are_of_magnitudes_as_an_exact_reference_says(tmp_path):
    """max_rel of complex elements was taken per part: 1+1j against 1+0j read inf (|a-b|/|b| is 1),
    against 1+0.001j 999 (0.999). Now max_abs and max_rel are of magnitudes, checked against the
    same formula in 60-digit decimals, also near the float64 range's ends."""
    from decimal import Decimal, localcontext

    pairs = [(1 + 0j, 1 + 1j), (1 + 1e-3j, 1 + 1j), (3 + 4j, 3 - 4j), (-2.5 + 0.125j, 1e-3 - 7j),
             (1.5e308 + 1.5e308j, 1.5e308 + 1e308j),  # |b| above the float64 range, parts finite
             (3e-320j, 1e-320 + 2e-320j), (1e300 + 0j, 1e300 + 1e-300j), (0.1 + 0.2j, 0.1 + 0.2j)]
    base = {f"c{i}": torch.tensor([b], dtype=torch.complex128) for i, (b, _) in enumerate(pairs)}
    target = {f"c{i}": torch.tensor([a], dtype=torch.complex128) for i, (_, a) in enumerate(pairs)}
    base["all"] = torch.tensor([b for b, _ in pairs], dtype=torch.complex128)
    target["all"] = torch.tensor([a for _, a in pairs], dtype=torch.complex128)
    result = fastdump.diff(*pair(tmp_path, base, target), atol=0, rtol=0)

    def exact(b, a):  # (|a-b|, |a-b| / |b|) of the float64 parts, in decimals
        with localcontext() as ctx:
            ctx.prec = 60
            d = ((Decimal(a.real) - Decimal(b.real)) ** 2 + (Decimal(a.imag) - Decimal(b.imag)) ** 2).sqrt()
            return float(d), float(d / (Decimal(b.real) ** 2 + Decimal(b.imag) ** 2).sqrt())

    want = [exact(b, a) for b, a in pairs]
    for i, (abs_, rel) in enumerate(want):
        row = row_of(result, f"c{i}")
        assert row["max_abs"] == pytest.approx(abs_, rel=1e-15, abs=0), (i, row["max_abs"], abs_)
        assert row["max_rel"] == pytest.approx(rel, rel=1e-15, abs=0), (i, row["max_rel"], rel)
    assert want[0] == (1.0, 1.0) and want[-1] == (0.0, 0.0)
    row = row_of(result, "all")
    assert (row["max_abs"], row["max_rel"]) == pytest.approx((max(w[0] for w in want), max(w[1] for w in want)),
                                                             rel=1e-15, abs=0)


def test_complex_statistics_are_magnitudes_as_in_show(tmp_path, capsys):
    """diff's baseline_stats/target_stats are `fastdump show`'s statistics. They were taken over
    the interleaved (re, im) parts: 3+4j, 6+8j gave min 3, max 8 (show: 5, 10), and a real tensor
    compared with a complex one had zeros mixed in (1, 2 gave min 0, mean 0.75)."""
    c = torch.tensor([3 + 4j, 6 + 8j, complex(NAN, NAN)], dtype=torch.complex64)
    base, target = pair(tmp_path, {"c": c, "r": torch.tensor([1.0, 2.0])},
                        {"c": c, "r": torch.tensor([1 + 0j, 2 + 0j], dtype=torch.complex64)})
    result = fastdump.diff(base, target)
    assert result.ok
    for side in ("baseline_stats", "target_stats"):
        assert row_of(result, "c")[side] == {"min": 5.0, "max": 10.0, "mean": 7.5, "std": 2.5, "nan": 1, "inf": 0}
        assert row_of(result, "r")[side] == {"min": 1.0, "max": 2.0, "mean": 1.5, "std": 0.5, "nan": 0, "inf": 0}
    assert cli.main(["show", str(target), "--pass", "0", "--name", "^c$"]) == 0
    assert "c     complex64  [3]    5    10   7.5   2.5  1    0" in capsys.readouterr().out


def test_float64_statistics_near_the_float64_limit_do_not_overflow(tmp_path, capsys):
    """Sums of values near 1e308 overflowed (mean inf, std NaN), squares of values above 1e154 too
    (std inf), in `fastdump show` and in diff's statistics."""
    big = torch.tensor([1e308, 1e308], dtype=torch.float64)
    wide = torch.tensor([1e200, -1e200], dtype=torch.float64)
    base, _ = pair(tmp_path, {"big": big, "wide": wide}, {"big": big, "wide": wide})
    result = fastdump.diff(base, base)
    assert row_of(result, "big")["baseline_stats"] == {"min": 1e308, "max": 1e308, "mean": 1e308, "std": 0.0,
                                                       "nan": 0, "inf": 0}
    wide_stats = row_of(result, "wide")["target_stats"]
    assert wide_stats["mean"] == 0.0 and wide_stats["std"] == pytest.approx(1e200, rel=1e-15)
    assert cli.main(["show", str(base), "--pass", "0", "--name", "big|wide"]) == 0
    table = capsys.readouterr().out.splitlines()[1:]
    assert table[1].split()[3:] == ["1e+308", "1e+308", "1e+308", "0", "0", "0"]
    assert table[2].split()[3:] == ["-1e+200", "1e+200", "0", "1e+200", "0", "0"]


def test_complex_mismatch_fraction_is_at_most_one(tmp_path, capsys):
    base, target = pair(tmp_path, {"c": torch.tensor([1 + 1j])}, {"c": torch.tensor([2 + 2j])})
    row = row_of(fastdump.diff(base, target, atol=0, rtol=0), "c")
    assert row["numel"] == 1 and row["mismatches"] <= 1 and row["mismatch"] <= 1.0


def test_zero_dim_and_empty_tensors(tmp_path):
    base, target = pair(tmp_path, {"s": torch.tensor(3.0), "e": torch.zeros(0, 3)},
                        {"s": torch.tensor(4.0), "e": torch.zeros(0, 3)})
    result = fastdump.diff(base, target)
    s = row_of(result, "s")
    assert (s["status"], s["shape"], s["numel"], s["max_abs"], s["mismatch"]) == ("fail", [], 1, 1.0, 1.0)
    assert s["max_rel"] == pytest.approx(1 / 3)
    e = row_of(result, "e")  # an empty tensor is compared (counted) and passes
    assert (e["status"], e["shape"], e["numel"], e["max_abs"], e["mismatch"], e["mismatches"]) == \
        ("ok", [0, 3], 0, 0.0, 0.0, 0)
    assert result.compared == 3 and result.failed == 1


def test_float16_overflow_to_inf_and_float32_extremes(tmp_path):
    big = 3.0e38
    base, target = pair(tmp_path, {"h": torch.tensor([65504.0, 1.0], dtype=torch.float16),
                                   "f": torch.tensor([big, 1.0])},
                        {"h": torch.tensor([INF, 1.0], dtype=torch.float16), "f": torch.tensor([-big, 1.0])})
    result = fastdump.diff(base, target)
    h = row_of(result, "h")
    assert (h["status"], h["mismatches"], h["max_abs"]) == ("fail", 1, 0.0)
    assert h["target_stats"]["inf"] == 1 and h["baseline_stats"]["max"] == 65504.0
    f = row_of(result, "f")  # the difference 6e38 overflows float32 but not the float64 arithmetic
    assert f["status"] == "fail" and f["max_abs"] == pytest.approx(2 * float(torch.tensor(big)))
    assert f["max_rel"] == pytest.approx(2.0) and f["cosine"] < 0 and f["rel_diff"] > 1
    for metric in ("rel_diff", "cosine"):
        assert not fastdump.diff(base, target, name="^f$", metric=[metric]).ok


@pytest.mark.parametrize("metric", ["rel_diff", "cosine"])
def test_huge_float64_opposite_tensors_fail_rel_diff_and_cosine(tmp_path, metric):
    huge = torch.full((3,), 1e200, dtype=torch.float64)
    base, target = pair(tmp_path, {"x": huge}, {"x": -huge})
    result = fastdump.diff(base, target, name="^x$", metric=[metric])
    assert not result.ok and result.failed == 1


def test_huge_float64_opposite_tensors_fail_allclose(tmp_path, capsys):
    huge = torch.full((3,), 1e200, dtype=torch.float64)
    base, target = pair(tmp_path, {"x": huge}, {"x": -huge})
    row = row_of(fastdump.diff(base, target), "x")
    assert row["status"] == "fail" and row["max_abs"] == 2e200 and row["mismatches"] == 3
    code, out, _ = run(capsys, base, target, "--json")
    assert code == 1
    (x,) = [r for r in json.loads(out)["rows"] if r["name"] == "x"]
    assert x["max_abs"] == 2e200  # strict JSON even where the metrics are not finite


# ----------------------------------------------------------------------- tolerance and metric edges


def test_self_comparison_is_all_equal_even_at_zero_tolerance(lm, capsys):
    names = fastdump.open(lm).pass_names("target", 0, 0)
    result = fastdump.diff(lm, lm, atol=0, rtol=0, metric=["allclose", "rel_diff=0"])
    assert result.ok and result.failed == 0 and result.missing == [] and result.problems == []
    assert result.compared == 3 * len(names)
    assert all(row["max_abs"] == 0 and row["rel_diff"] == 0 and row["mismatches"] == 0 for row in result.rows)
    code, out, err = run(capsys, lm, lm, "--atol", "0", "--rtol", "0")
    assert code == 0 and out.splitlines()[0] == \
        f"no divergence: {3 * len(names)} tensor(s) compared, all within tolerance (atol 0, rtol 0)"


def test_self_comparison_passes_cosine_zero(lm):
    result = fastdump.diff(lm, lm, metric=["cosine=0"])
    assert result.ok and result.failed == 0


@pytest.mark.parametrize("option,value,message", [
    ("--atol", "-1", "atol and rtol must be >= 0"), ("--rtol", "nan", "atol and rtol must be >= 0"),
    ("--atol", "nan", "atol and rtol must be >= 0"), ("--tol", "x=nan,0", "tolerances must be >= 0"),
    ("--tol", "x=0,-1e-9", "tolerances must be >= 0"), ("--metric", "cosine=abc", "threshold must be a number"),
    ("--metric", "allclose=1", "takes no threshold"), ("--passes", "-1", "N-M"), ("--align", "offset:x", "offset:K"),
    # torch.cat said "Overflow when unpacking long long" per row, and only where shards were merged
    ("--unshard", f"x={10 ** 23}", f"--unshard 'x={10 ** 23}': dimension {10 ** 23} is out of range (a tensor has "
                                   "at most 64)"),
    ("--unshard", "x=-65", "--unshard 'x=-65': dimension -65 is out of range"),
])
def test_bad_tolerances_and_options_exit_2_with_message(lm, capsys, option, value, message):
    code, out, err = run(capsys, lm, lm, f"{option}={value}")
    assert code == 2 and message in err and out == "" and "Traceback" not in err


@pytest.mark.parametrize("value,message", [
    ("{tmp}/no/such/dir/r.html", "--html '{tmp}/no/such/dir/r.html': no directory '{tmp}/no/such/dir'"),
    ("{tmp}", "--html '{tmp}': is a directory"), ("", "--html: give a file name"),
])
def test_a_report_that_cannot_be_written_is_refused_before_comparing(lm, tmp_path, capsys, monkeypatch, value,
                                                                    message):
    """The report path was first tried after the whole comparison (hours, on a large dump): the
    verdict was lost to an error naming a temporary file, and an empty --html was ignored."""
    from fastdump import compare

    monkeypatch.setattr(compare, "diff", lambda *a, **k: pytest.fail("compared before checking --html"))
    code, out, err = run(capsys, lm, lm, f"--html={value.format(tmp=tmp_path)}")
    assert (code, out, err) == (2, "", f"fastdump diff: {message.format(tmp=tmp_path)}\n")


@pytest.mark.parametrize("kind", ["fifo", "link"])
def test_a_report_path_that_is_no_regular_file_is_refused_and_left_as_it_is(lm, tmp_path, capsys, kind):
    """The report is renamed into place, which replaced whatever was at the path: `--html /dev/null`
    run as root (a container) replaced the device node with the report, and a FIFO or a symbolic
    link was replaced alike. Refused, before comparing and by ``DiffResult.to_html``; the entry is
    left as it was."""
    path = tmp_path / "report.html"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        os.symlink(tmp_path / "elsewhere.html", path)
    code, out, err = run(capsys, lm, lm, f"--html={path}")
    what = "a device, FIFO or socket" if kind == "fifo" else "a symbolic link"
    assert (code, out) == (2, "") and f"--html '{path}': is {what}, not a regular file" in err
    with pytest.raises(ValueError, match=f"is {what}, not a regular file"):
        fastdump.diff(lm, lm).to_html(path)
    assert (os.path.islink(path) if kind == "link" else stat.S_ISFIFO(os.lstat(path).st_mode))
    assert sorted(os.listdir(tmp_path)) == ["report.html"]  # (no report, no temporary file left)


def test_a_pass_range_that_ends_before_it_starts_is_a_usage_error(lm, capsys):
    """'--passes 5-2' selected nothing and the diff blamed the dumps ("no passes in common")."""
    code, out, err = run(capsys, lm, lm, "--passes", "0,5-2")
    assert (code, out, err) == (2, "", "fastdump diff: --passes '0,5-2': '5-2' ends before it starts\n")


def test_nan_metric_threshold_is_refused(tmp_path, capsys):
    base, target = pair(tmp_path, {"x": torch.tensor([1.0, 2.0])}, {"x": torch.tensor([-1.0, -2.0])})
    code, out, err = run(capsys, base, target, "--metric", "rel_diff=nan")
    assert code == 2 and "threshold" in err


def test_negative_metric_threshold_is_refused(lm, capsys):
    code, out, err = run(capsys, lm, lm, "--metric", "rel_diff=-1")
    assert code == 2 and "threshold" in err


def test_tolerance_edges_infinite_atol_and_first_matching_tol(tmp_path, capsys):
    base, target = pair(tmp_path, {"x": torch.tensor([1.0, 2.0]), "y": torch.tensor([1.0, NAN])},
                        {"x": torch.tensor([1e30, 2.0]), "y": torch.tensor([1.0, 1.0])})
    # atol inf absorbs any finite difference, never a NaN on one side.
    result = fastdump.diff(base, target, atol=INF)
    assert row_of(result, "x")["status"] == "ok" and row_of(result, "y")["status"] == "fail"
    # The first matching --tol wins: x strict (0,0) before the catch-all.
    code, out, err = run(capsys, base, target, "--tol", "^x$=0,0", "--tol", ".*=inf,0")
    assert code == 1
    fails = [line.split()[6] for line in out.splitlines() if line.startswith("FAIL ")]
    assert fails == ["x", "y"]
    result = fastdump.diff(base, target, tol=["^x$=0,0", ".*=inf,0"])
    assert (row_of(result, "x")["atol"], row_of(result, "Bag")["atol"]) == (0.0, INF)


def test_one_ulp_difference_at_zero_tolerance_reports_exact_numbers(tmp_path):
    one = torch.tensor([1.0, 1.0])
    ulp = torch.nextafter(one, torch.tensor(2.0))
    base, target = pair(tmp_path, {"x": one}, {"x": ulp})
    row = row_of(fastdump.diff(base, target, atol=0, rtol=0), "x")
    assert row["status"] == "fail" and row["mismatches"] == 2 and row["max_abs"] == 2.0 ** -23
    assert row["max_rel"] == 2.0 ** -23
    assert fastdump.diff(base, target, atol=0, rtol=2.0 ** -23).ok  # |a-b| <= rtol*|b| exactly


def test_rel_diff_of_a_one_ulp_difference_is_not_lost_to_cancellation(tmp_path):
    """rel_diff was 1 - 2*sum(ab)/sum(a^2+b^2): one float32 element of 4096 one ulp off gave
    exactly 0 (so `--metric rel_diff=0`, "equal", passed a tensor that differs), and every
    element one ulp off in 2**20 gave 3.9e-14 for 3.9e-15. It is now sum((a-b)^2)/sum(a^2+b^2),
    the same quantity without the cancellation."""
    torch.manual_seed(0)
    x = torch.randn(4096)
    one = x.clone()
    one[7] = torch.nextafter(x[7], torch.tensor(INF))
    base, target = pair(tmp_path, {"x": x}, {"x": one})
    row = row_of(fastdump.diff(base, target), "x")
    d = one.double() - x.double()
    expected = float((d * d).sum() / (one.double() ** 2 + x.double() ** 2).sum())
    assert row["rel_diff"] == pytest.approx(expected, rel=1e-12, abs=0)
    assert not fastdump.diff(base, target, name="^x$", metric=["rel_diff=0"]).ok
    ints = stats.compare(torch.tensor([2 ** 53, 3]), torch.tensor([2 ** 53 + 1, 3]), 0, 0)  # one float64
    assert ints["rel_diff"] == pytest.approx(1 / (2 ** 107 + 2 ** 54 + 18), rel=1e-12, abs=0)
    many = torch.randn(1 << 20, dtype=torch.float32)
    ulps = torch.nextafter(many, torch.full_like(many, INF))
    r = stats.compare(many, ulps, 0, 0)
    d = ulps.double() - many.double()
    assert r["rel_diff"] == pytest.approx(float((d * d).sum() / (ulps.double() ** 2 + many.double() ** 2).sum()),
                                          rel=1e-9, abs=0)


def _exact_cosine_distance(a, b):
    """1 - cosine of two tensors' float64 values, from rationals: (1 - cos²) / (1 + cos)."""
    from fractions import Fraction

    a, b = ([Fraction(v) for v in t.double().reshape(-1).tolist()] for t in (a, b))
    ab, aa, bb = sum(x * y for x, y in zip(a, b)), sum(x * x for x in a), sum(y * y for y in b)
    square = ab * ab / (aa * bb)
    return float((1 - square) / (1 + Fraction(math.copysign(math.sqrt(float(square)), ab))))


def test_cosine_of_a_tensor_one_ulp_off_is_not_1_and_fails_cosine_zero(tmp_path, capsys):
    """1 - cosine of a tensor one ulp off is ~1e-36: 1 - Σab/(|a||b|) rounded it to 0, cosine read
    1 and `--metric cosine=0` passed a tensor that differs. 1 - cosine is now kept (checked against
    rationals), printed as `1-X`; equal tensors still give exactly 0 and pass."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1000, dtype=torch.float64, generator=g)
    one = x.clone()
    one[3] = torch.nextafter(x[3], torch.tensor(INF, dtype=torch.float64))
    f32 = torch.randn(4096, generator=g)
    f32_one = f32.clone()
    f32_one[100] = torch.nextafter(f32[100], torch.tensor(-INF))
    ints, noisy = torch.arange(1, 100), x + 0.3 * torch.randn(1000, dtype=torch.float64, generator=g)
    base, target = pair(tmp_path, {"x": x, "f32": f32, "ints": ints, "noisy": x, "same": x},
                        {"x": one, "f32": f32_one, "ints": ints + (ints == 6), "noisy": noisy, "same": x.clone()})
    result = fastdump.diff(base, target, metric=["cosine=0"])
    for name, b, t in (("x", x, one), ("f32", f32, f32_one), ("ints", ints, ints + (ints == 6)), ("noisy", x, noisy)):
        row = row_of(result, name)
        assert row["status"] == "fail" and row["reason"] == "exceeds cosine>0", row
        assert row["cosine_distance"] == pytest.approx(_exact_cosine_distance(b, t), rel=1e-12, abs=0), name
    assert 0 < row_of(result, "x")["cosine_distance"] < 1e-30 and row_of(result, "x")["cosine"] == 1.0
    same = row_of(result, "same")
    assert (same["status"], same["cosine"], same["cosine_distance"]) == ("ok", 1.0, 0.0)
    code, out, _ = run(capsys, base, target, "--metric", "cosine=0", "--name", "^x$")
    want = f"cosine 1-{row_of(result, 'x')['cosine_distance']:.3g}  mismatch"
    assert code == 1 and want in out.splitlines()[0], out


@pytest.mark.parametrize("base,target,cosine", [
    ([1e160, 1e160], [1e-160, 2e-160], 3 / 10 ** 0.5),  # parallel-ish, magnitudes 1e320 apart
    ([-235.0], [-1e-310], 1.0),  # a subnormal against a normal number of the same sign
])
def test_cosine_of_sides_far_apart_in_magnitude(base, target, cosine):
    """Both sides' sums were scaled by the larger side's power of two: the smaller side's squares
    then underflowed to 0 and cosine came out 0 for vectors pointing the same way."""
    r = stats.compare(torch.tensor(base, dtype=torch.float64), torch.tensor(target, dtype=torch.float64), 0, 0)
    assert r["cosine"] == pytest.approx(cosine, rel=1e-12)


def test_a_few_mismatches_in_a_large_tensor_never_read_zero_percent(tmp_path, capsys):
    """The mismatch fraction was printed with two decimals: one element of 2**20 off made a FAIL
    line (and the report's table) read "mismatch 0.00%"."""
    x = torch.zeros(1 << 20)
    y = x.clone()
    y[5] = 1.0
    base, target = pair(tmp_path, {"x": x}, {"x": y})
    report = tmp_path / "r.html"
    code, out, _ = run(capsys, base, target, "--html", report)
    (line,) = [line for line in out.splitlines() if line.startswith("FAIL ")]
    assert code == 1 and "0.00%" not in line and "mismatch 9.5e-05%" in line
    assert "0.00%" not in report.read_text() and "9.5e-05%" in report.read_text()


@pytest.mark.parametrize("unshard,reason", [
    (None, "tp ranks 0 and 1 disagree on a tensor treated as replicated (their bits differ)"),
    ({"w": "sum"}, "cannot be summed (no arithmetic)"),
])
def test_tp_shards_of_a_type_with_no_arithmetic_fail_never_crash(tmp_path, unshard, reason):
    """float4 shards are compared bit for bit, with no max abs: the replicated check formatted
    None with .3g and a sum rule called .to(float64); both raised out of diff (a traceback)."""
    def f4(*values):
        return torch.tensor(values, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)

    def dump(root, shards):
        for rank, shard in enumerate(shards):
            with fastdump.attach(None, root, tp_rank=rank, tp_size=len(shards), writer="thread") as dumper:
                dumper.begin_pass()
                dumper.dump("w", shard)
                dumper.dump("x", torch.ones(2))  # (a diff that compares nothing exits 2)
                dumper.end_pass()
        return root

    base, target = dump(tmp_path / "tp1", [f4(1, 2)]), dump(tmp_path / "tp2", [f4(1, 2), f4(1, 3)])
    result = fastdump.diff(base, target, unshard=unshard)
    row = row_of(result, "w")
    assert result.exit_code == 1 and row["status"] == "fail" and reason in row["reason"]


# ------------------------------------------------------------------ names, passes, roles, ranks


def test_names_on_one_side_are_listed_missing_with_their_passes(tmp_path, capsys):
    base = dump_bag(tmp_path / "base", {"x": torch.ones(2), "only_base": torch.ones(1)}, passes=2)
    target = dump_bag(tmp_path / "target", {"x": torch.ones(2), "only_target": torch.ones(1)}, passes=2)
    result = fastdump.diff(base, target)
    assert result.exit_code == 0 and result.compared == 4  # x and Bag, 2 passes
    assert sorted((m["name"], m["only_in"], m["pass_count"], m["pass_ranges"]) for m in result.missing) == \
        [("only_base", "baseline", 2, [[0, 1]]), ("only_target", "target", 2, [[0, 1]])]
    code, out, err = run(capsys, base, target)
    assert code == 0
    assert "missing: role target rank 0: 'only_base' only in the baseline (passes 0,1)" in out.splitlines()
    assert "missing: role target rank 0: 'only_target' only in the target (passes 0,1)" in out.splitlines()
    assert out.splitlines()[-1] == "compared 4, failed 0, missing 2"
    # --name restricting to a one-sided name: nothing to compare is an error, not a pass.
    code, out, err = run(capsys, base, target, "--name", "only_")
    assert code == 2 and "matches no tensor present on both sides" in err


def test_different_pass_counts_list_the_extra_passes(lm, tmp_path, capsys):
    short = dump_lm(tmp_path / "short", TinyLM(seed=0), steps=2)
    names = fastdump.open(lm).pass_names("target", 0, 0)
    result = fastdump.diff(lm, short)
    assert result.ok and result.compared == 2 * len(names)
    assert result.missing == [{"kind": "passes", "only_in": "baseline", "role": "target", "rank": 0, "passes": [2]}]
    code, out, _ = run(capsys, short, lm)
    assert code == 0 and "missing: role target rank 0: passes 2 only in the target" in out
    code, out, err = run(capsys, lm, short, "--passes", "2-")
    assert code == 2 and "--passes '2-' selects none of the 2 target pass(es) paired with a baseline pass" in err


def test_names_and_passes_on_one_side_only_are_in_the_first_line_never_all_within_tolerance(tmp_path, capsys):
    """A target that never dumped 'y' and stopped a pass early read "no divergence: 2 tensor(s)
    compared, all within tolerance" on its first line: the line a CI log shows."""
    base = dump_bag(tmp_path / "base", {"x": torch.ones(2), "y": torch.ones(1)}, passes=3)
    target = dump_bag(tmp_path / "target", {"x": torch.ones(2)}, passes=2)
    code, out, err = run(capsys, base, target, "--name", "^[xy]$")
    assert code == 0 and out.splitlines()[0] == (
        "no divergence in the 2 tensor(s) compared (atol 1e-05, rtol 1e-05); not compared: 1 name(s) and 1 "
        "pass(es) on one side only (listed below)")
    page = fastdump.diff(base, target).to_html(tmp_path / "r.html")
    assert "all within tolerance" not in open(page).read()


def test_an_empty_root_and_a_dump_with_no_pass_exit_2(lm, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out, err = run(capsys, lm, empty)
    assert code == 2 and "no rank directories" in err and out == ""
    nothing = tmp_path / "nothing"
    with fastdump.attach(TinyLM(seed=0), nothing, writer="thread"):
        pass  # attached, closed, no forward
    code, out, err = run(capsys, lm, nothing)
    assert code == 2 and err == "fastdump diff: no pass in a segment file on the target: nothing was dumped\n"


def test_other_role_on_one_side_is_missing_and_role_filter(lm, tmp_path, capsys):
    other = tmp_path / "other"
    dump_lm(other, TinyLM(seed=0))
    dump_lm(other, TinyLM(seed=0), role="extra")
    result = fastdump.diff(lm, other)  # a role on one side only: none of its data compared (exit 1)
    assert result.exit_code == 1 and result.failed == 0
    assert result.missing == [{"kind": "role", "only_in": "target", "role": "extra"}]
    code, out, err = run(capsys, lm, other, "--role", "extra")
    assert code == 2 and "no role 'extra'" in err
    code, out, err = run(capsys, other, lm)
    assert code == 1 and "missing: role 'extra' only in the baseline" in out
    assert out.startswith("data missing: 1 role(s) on one side only")
    assert run(capsys, other, lm, "--role", "target")[0] == 0  # the roles both have: the same


def test_a_role_given_twice_is_compared_once(lm, capsys):
    """--role target --role target compared every tensor twice: 'compared' and 'failed' doubled."""
    once = fastdump.diff(lm, lm, role="target")
    code, out, err = run(capsys, lm, lm, "--role", "target", "--role", "target")
    assert code == 0 and out.splitlines()[-1] == f"compared {once.compared}, failed 0, missing 0"
    assert once.compared == len(fastdump.diff(lm, lm, role=["target", "target"]).rows) > 0


def test_ranks_with_nothing_in_common_exit_2(tmp_path, capsys):
    dp0 = dump_lm(tmp_path / "dp0", TinyLM(seed=0), dp_rank=0, dp_size=2)
    dp1 = dump_lm(tmp_path / "dp1", TinyLM(seed=0), dp_rank=1, dp_size=2)
    code, out, err = run(capsys, dp0, dp1)
    assert code == 2 and out == "" and "Traceback" not in err
    code, out, err = run(capsys, dp0, dp0, "--rank", "1")
    assert code == 2 and "no rank 1 present on both sides" in err


def test_ranks_with_nothing_in_common_are_named(tmp_path, capsys):
    dp0 = dump_lm(tmp_path / "dp0", TinyLM(seed=0), dp_rank=0, dp_size=2)
    dp1 = dump_lm(tmp_path / "dp1", TinyLM(seed=0), dp_rank=1, dp_size=2)
    code, out, err = run(capsys, dp0, dp1)
    assert code == 2 and "rank" in err.split("\n")[0] and "passes in common" not in err


# ----------------------------------------------------------------------------- EAGLE target/draft


def run_eagle(root, nudge=0.0, steps=2, k=2):
    """Prefill, then rounds of k draft passes (role draft) and one verify pass (role target)."""
    target = TinyLM(seed=0)
    draft = TinyDraft(target, seed=1)
    with torch.no_grad():
        draft.fc.weight[0, -1] += nudge  # acts on the token embedding half (hidden is 0 at pass 0)
    dt = fastdump.attach(target, root, role="target", writer="thread")
    dd = fastdump.attach(draft, root, role="draft", writer="thread")
    try:
        with torch.inference_mode():
            tcache, dcache = target.new_cache(), {"k": [], "v": []}
            logits = target(torch.tensor([[3, 14, 15, 92, 65]]), tcache)
            hidden = torch.zeros(1, 1, target.model.embed.embedding_dim)
            tok = logits[:, -1:].argmax(-1)
            for _ in range(steps):
                drafted = []
                for _ in range(k):
                    dl, hidden = draft(tok, hidden, dcache)
                    tok = dl.argmax(-1)
                    drafted.append(tok)
                tok = target(torch.cat(drafted, 1), tcache)[:, -1:].argmax(-1)
    finally:
        assert dt.close()["status"] == "closed" and dd.close()["status"] == "closed"
    return root


@pytest.fixture(scope="module")
def eagle(tmp_path_factory):
    base = tmp_path_factory.mktemp("eagle")
    return run_eagle(base / "a"), run_eagle(base / "b"), run_eagle(base / "nudged", nudge=0.5)


def test_eagle_two_runs_compare_equal_role_by_role(eagle):
    a, b, _ = eagle
    result = fastdump.diff(a, b, atol=0, rtol=0)
    assert result.ok and result.missing == []
    with fastdump.open(a) as ds:
        assert ds.roles == ["draft", "target"]
        expected = sum(len(ds.pass_names(role, 0, p)) for role in ds.roles for p in ds.passes(role, 0))
    assert result.compared == expected
    assert {row["role"] for row in result.rows} == {"draft", "target"}


def test_eagle_nudged_draft_diverges_in_the_draft_role_first(eagle, capsys):
    a, _, nudged = eagle
    result = fastdump.diff(a, nudged)
    first = result.first_divergence
    assert (first["role"], first["pass"], first["name"]) == ("draft", 0, "fc")
    # The target's prefill (pass 0) ran before any draft pass: untouched.
    assert all(row["status"] == "ok" for row in result.rows if row["role"] == "target" and row["pass"] == 0)
    # Restricted to the target role's prefill: no divergence; to the draft role: the same first row.
    assert fastdump.diff(a, nudged, role="target", passes="0").ok
    only_draft = fastdump.diff(a, nudged, role="draft")
    assert only_draft.first_divergence["name"] == "fc" and {r["role"] for r in only_draft.rows} == {"draft"}
    code, out, err = run(capsys, a, nudged, "--role", "draft")
    assert code == 1 and out.startswith("first divergence: draft rank 0 pass 0 fc  ")


def test_eagle_draft_role_missing_in_one_run(eagle, tmp_path, capsys):
    a, _, _ = eagle
    target_only = tmp_path / "target_only"
    shutil.copytree(a, target_only)
    # A run that dumped the target alone: no draft directory, and no record of a draft attached.
    shutil.rmtree(target_only / "draft")
    shutil.rmtree(target_only / "fastdump.sessions" / "draft")
    (target_only / "fastdump.roles" / "draft").unlink()
    result = fastdump.diff(a, target_only)  # the draft's data is missing: exit 1 (it was 0)
    assert result.exit_code == 1 and result.missing == [{"kind": "role", "only_in": "baseline", "role": "draft"}]
    assert {row["role"] for row in result.rows} == {"target"} and result.failed == 0
    assert fastdump.diff(a, target_only, role="target").ok
    code, out, err = run(capsys, a, target_only, "--role", "draft")
    assert code == 2 and "target" in err and "no role 'draft'" in err


def test_eagle_draft_role_removed_after_the_run_is_a_damaged_dump(eagle, tmp_path):
    """The draft's directory removed from a root that records a draft attached: not a run without a
    draft but a dump that lost one, so diff refuses it as damaged (exit 2) and names the lost role."""
    a, _, _ = eagle
    damaged = tmp_path / "damaged"
    shutil.copytree(a, damaged)
    shutil.rmtree(damaged / "draft")
    result = fastdump.diff(a, damaged)
    assert result.exit_code == 2
    assert len(result.problems) == 1 and "role 'draft' was attached here" in result.problems[0]


# ----------------------------------------------------------------------- incomplete and corrupt


def test_writer_killed_mid_dump_is_refused(tmp_path, lm, capsys):
    """A real writer process killed with SIGKILL after it wrote two passes, serving goes on."""
    model = TinyLM(seed=0)
    caches = model.new_cache()
    root = tmp_path / "killed"
    dumper = fastdump.attach(model, root, segment_passes=1)  # the process writer, one segment per pass
    ids = torch.tensor([[3, 14, 15, 9]])
    with torch.inference_mode():
        for step in range(2):
            dumper.set_pass_meta(forward_mode="prefill" if step == 0 else "decode")
            ids = model(ids, caches)[:, -1:].argmax(-1)
        deadline = time.monotonic() + 30
        while len(glob.glob(str(root / "target" / "*" / "seg-*.h5"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(glob.glob(str(root / "target" / "*" / "seg-*.h5"))) == 2
        os.kill(dumper._engine._proc.pid, signal.SIGKILL)
        dumper._engine._proc.wait()
        dumper.set_pass_meta(forward_mode="decode")
        model(ids, caches)
    assert dumper.close()["status"] == "error"
    assert json.load(open(os.path.join(rank_dir(root), "rank.json")))["status"] == "running"
    code, out, err = run(capsys, lm, root)
    assert "Traceback" not in err
    assert code == 2 and "writer" in err


@pytest.mark.parametrize("status", ["incomplete", "error"])
def test_incomplete_or_failed_dump_is_reported(lm, tmp_path, status):
    root = tmp_path / "bad"
    shutil.copytree(lm, root)
    path = os.path.join(rank_dir(root), "rank.json")
    info = json.load(open(path))
    info["status"] = status
    if status == "error":
        info["error"] = "No space left on device"
    with open(path, "w") as f:
        json.dump(info, f)
    if status == "error":  # writing failed: refused like 'running' (docs/COMPARE.md 'Bad input')
        with pytest.raises(DiffError, match="No space left on device"):
            fastdump.diff(lm, root)
        assert fastdump.diff(lm, root, allow_running=True).notes
        return
    result = fastdump.diff(lm, root)  # 'incomplete': compared, with a note
    text = "\n".join(result.lines())
    assert result.ok and "note: target " in text and "status is 'incomplete'" in text
    assert result.notes == json.loads(result.to_json())["notes"] and len(result.notes) == 1


def test_pass_marked_incomplete_is_reported(lm, tmp_path):
    root = tmp_path / "incomplete_pass"
    shutil.copytree(lm, root)
    (segment,) = glob.glob(os.path.join(rank_dir(root), "seg-*.h5"))
    with h5py.File(segment, "r+") as f:
        passes = f["passes"][()]
        passes["complete"][passes["pass"] == 1] = 0
        f["passes"][...] = passes
    restamp_tables(segment)  # as the writer marks it, not damage
    assert fastdump.open(root).meta("target", 0, 1)["complete"] is False
    result = fastdump.diff(lm, root)
    text = "\n".join(result.lines())
    assert "note: target rank 0: target pass 1 is marked incomplete" in text
    assert json.loads(result.to_json())["notes"] == result.notes and len(result.notes) == 1


def _flip_one_data_bit(root, name, pass_id):
    (segment,) = glob.glob(os.path.join(rank_dir(root), "seg-*.h5"))
    with h5py.File(segment, "r") as f:
        index, names = f["index"][()], json.loads(f["names"][()])
        row = index[(index["pass"] == pass_id) & (index["name"] == names.index(name))][0]
        block = f["blocks"][str(row["block"])]
        offset = block.id.get_offset()
        row_bytes = block.dtype.itemsize * int(np.prod(block.shape[1:]))
    raw = bytearray(open(segment, "rb").read())
    raw[offset + int(row["first_row"]) * row_bytes + 5] ^= 0x01
    with open(segment, "wb") as f:
        f.write(bytes(raw))
    return segment


def test_flipped_data_bit_is_a_corruption_not_a_divergence(tmp_path, capsys):
    base = dump_bag(tmp_path / "base", {"x": torch.arange(8, dtype=torch.float32)}, passes=3)
    target = tmp_path / "target"
    shutil.copytree(base, target)
    segment = _flip_one_data_bit(target, "x", 1)
    code, out, err = run(capsys, base, target)
    assert code == 2 and "checksum" in out + err and segment in out + err


def test_a_tensor_that_cannot_be_read_is_never_named_the_first_divergence(tmp_path, capsys):
    """A flipped bit in pass 1's 'x' (damage, exit 2) was the headline's "first divergence" and
    ``first_divergence`` of the JSON and the API: the damage blamed on the model, ahead of the
    model's real divergence ('y' of pass 2); with no real one, the headline named it too."""
    tensors = {"x": torch.arange(8, dtype=torch.float32), "y": torch.ones(3)}
    base = dump_bag(tmp_path / "base", tensors, passes=3)
    damaged = tmp_path / "damaged"
    shutil.copytree(base, damaged)
    _flip_one_data_bit(damaged, "x", 1)
    code, out, _ = run(capsys, base, damaged)
    lines = out.splitlines()
    assert code == 2
    assert lines[0] == ("no divergence in the 8 tensor(s) compared, but 1 tensor(s) could not be read (ERROR "
                        "lines below): the comparison is incomplete")
    assert lines[1].startswith("ERROR target rank 0 pass 1 x  [cannot read pass 1 (DumpError: ")
    result = fastdump.diff(base, damaged)
    assert result.first_divergence is None and json.loads(result.to_json())["first_divergence"] is None
    assert result.exit_code == 2 and [row["status"] for row in result.failures] == ["error"]

    # The model diverges in pass 2 ('y'): that is the first divergence, the damage before it said.
    diverged = tmp_path / "diverged"
    write_rank_dir(os.path.join(diverged, "target", "TP0_PP0_Rank0_pid100"),
                   {0: tensors, 1: tensors, 2: dict(tensors, y=torch.full((3,), 2.0))}, segment_passes=500)
    _flip_one_data_bit(diverged, "x", 1)
    code, out, _ = run(capsys, base, diverged)
    lines = out.splitlines()
    assert code == 2
    assert lines[0].startswith("first divergence: target rank 0 pass 2 y  max_abs 1  ")
    assert lines[0].endswith("[exceeds allclose]; 1 tensor(s) could not be read (ERROR lines below)")
    assert lines[1].startswith("ERROR target rank 0 pass 1 x  [cannot read pass 1 (DumpError: ")
    assert lines[2].startswith("FAIL target rank 0 pass 2 y  max_abs 1  ")
    result = fastdump.diff(base, diverged)
    assert (result.first_divergence["pass"], result.first_divergence["name"]) == (2, "y")
    # A read problem of the dump (its rank.json damaged) is said the same way after the divergence.
    with open(os.path.join(rank_dir(diverged), "rank.json"), "w") as f:
        f.write("{not json")
    code, out, _ = run(capsys, base, diverged)
    assert code == 2 and out.splitlines()[0].endswith(
        "[exceeds allclose]; 1 tensor(s) could not be read and 1 read problem(s) (ERROR lines below)")


def test_flipped_data_bit_is_never_silently_equal(tmp_path, capsys):
    """What diff does today with a flipped bit: at least not 'equal' (the bit is in the mantissa)."""
    base = dump_bag(tmp_path / "base", {"x": torch.arange(8, dtype=torch.float32)}, passes=3)
    target = tmp_path / "target"
    shutil.copytree(base, target)
    _flip_one_data_bit(target, "x", 1)
    code, out, err = run(capsys, base, target)
    assert code != 0 and "Traceback" not in err


@pytest.mark.parametrize("damage", ["header", "empty", "truncated"])
def test_corrupt_segment_exits_2_naming_the_file(tmp_path, lm, capsys, damage):
    root = tmp_path / "corrupt"
    shutil.copytree(lm, root)
    (segment,) = glob.glob(os.path.join(rank_dir(root), "seg-*.h5"))
    raw = bytearray(open(segment, "rb").read())
    if damage == "header":
        raw[:64] = bytes(b ^ 0xFF for b in raw[:64])
    elif damage == "empty":
        raw = bytearray()
    else:
        raw = raw[:len(raw) // 2]
    with open(segment, "wb") as f:
        f.write(bytes(raw))
    code, out, err = run(capsys, lm, root)
    assert code == 2 and segment in out + err and "Traceback" not in err
    code, out, err = run(capsys, lm, root, "--json")
    assert code == 2 and "Traceback" not in err


def test_garbage_rank_json_is_a_problem_exit_2(tmp_path, lm, capsys):
    root = tmp_path / "garbage"
    shutil.copytree(lm, root)
    path = os.path.join(rank_dir(root), "rank.json")
    with open(path, "w") as f:
        f.write("{not json")
    code, out, err = run(capsys, lm, root)
    assert code == 2 and "Traceback" not in err
    assert any(line.startswith("ERROR: ") and path in line and "not valid JSON" in line for line in out.splitlines())
    assert out.splitlines()[-1].endswith(", problems 1")


@pytest.mark.parametrize("damage", ["deleted", "no status"])
def test_a_rank_without_rank_json_or_its_status_is_not_compared_as_finished(tmp_path, lm, capsys, damage):
    """A rank directory whose rank.json is gone (or holds no status) fails verify ("not a finished
    dump"); diff compared its segments as a closed dump's and printed "no divergence", exit 0."""
    root = tmp_path / "damaged"
    shutil.copytree(lm, root)
    path = os.path.join(rank_dir(root), "rank.json")
    if damage == "deleted":
        os.remove(path)
    else:
        with open(path) as f:
            info = json.load(f)
        del info["status"]
        with open(path, "w") as f:
            json.dump(info, f)
    code, out, err = run(capsys, lm, root)
    assert (code, out) == (2, "")
    said = "rank.json is missing" if damage == "deleted" else "rank.json holds no status"
    assert err.startswith(f"fastdump diff: target {rank_dir(root)}: {said}: not known to be a finished dump")
    assert err.rstrip().endswith("pass --allow-running to compare what is there") and "Traceback" not in err
    # --allow-running compares what is there, saying so.
    code, out, _ = run(capsys, lm, root, "--allow-running")
    assert code == 0
    assert f"note: target {rank_dir(root)}: {said}: not known to be a finished dump" in out.splitlines()


# -------------------------------------------------------------------------------- JSON vs text


def test_json_matches_text_output(tmp_path, capsys):
    base = dump_bag(tmp_path / "base", {"a": torch.tensor([1.0, 2.0]), "z": torch.tensor([0.0, 1.0]),
                                        "s": torch.ones(2, 2), "gone": torch.ones(1)}, passes=2)
    target = dump_bag(tmp_path / "target", {"a": torch.tensor([1.0, 2.0]), "z": torch.tensor([1e-3, 1.0]),
                                            "s": torch.ones(4), "new": torch.ones(1)}, passes=2)
    code_text, out, _ = run(capsys, base, target)
    code_json, raw, _ = run(capsys, base, target, "--json")

    def strict(constant):
        raise AssertionError(f"not strict JSON: {constant}")

    data = json.loads(raw, parse_constant=strict)
    assert code_text == code_json == data["exit_code"] == 1 and data["ok"] is False
    lines = out.splitlines()
    assert lines[-1] == f"compared {data['compared']}, failed {data['failed']}, missing {len(data['missing'])}"
    assert (data["compared"], data["failed"], len(data["missing"])) == (6, 4, 2)  # a, z, Bag x 2 passes
    fail_rows = [r for r in data["rows"] if r["status"] != "ok"]
    assert [(line.split()[4], line.split()[5]) for line in lines if line.startswith("FAIL ")] == \
        [("pass", str(r["pass"])) for r in fail_rows]
    assert [line.split()[6] for line in lines if line.startswith("FAIL ")] == [r["name"] for r in fail_rows] == \
        ["z", "s", "z", "s"]
    first = data["first_divergence"]
    assert lines[0].startswith(f"first divergence: target rank 0 pass 0 {first['name']}  ") and first["name"] == "z"
    assert first["max_rel"] == "inf" and first["max_abs"] == pytest.approx(1e-3)  # 1e-3 against an exact 0
    assert "max_rel inf" in lines[0]
    (s_row,) = [r for r in fail_rows if r["name"] == "s" and r["pass"] == 0]
    assert s_row["reason"] == "shape [4] vs baseline [2, 2]" and s_row["max_abs"] is None
    missing = {(m["name"], m["only_in"]) for m in data["missing"]}
    assert missing == {("gone", "baseline"), ("new", "target")}
    assert sum(line.startswith("missing: ") for line in lines) == 2
    assert data["options"]["atol"] == 1e-5 and data["rows"][0]["atol"] == 1e-5


# ------------------------------------------------- rank directories: sessions, rank.json, TP groups


def crafted_rank(root, passes, tp=0, tp_size=1, pp=0, pp_size=1):
    """A rank directory written by the real writer from {pass id: {name: tensor}}, named as fastdump
    names it (one session per rank, as separate processes have)."""
    number = pp * tp_size + tp
    rank = {"tp_rank": tp, "tp_size": tp_size, "pp_rank": pp, "pp_size": pp_size, "rank": number}
    name = f"TP{tp}_PP{pp}_Rank{number}_pid100_20260101T000000.000000Z-{number:08x}"
    return write_rank_dir(os.path.join(root, "target", name), passes, rank=rank)


def edit_rank_json(rank_path, **fields):
    """Set top-level fields of a rank directory's rank.json ('rank' replaces the whole object)."""
    path = os.path.join(rank_path, "rank.json")
    with open(path) as f:
        info = json.load(f)
    info.update(fields)
    with open(path, "w") as f:
        json.dump(info, f)
    return path


def test_two_sessions_of_one_rank_are_refused_naming_both(tmp_path, capsys):
    base = dump_bag(tmp_path / "base", {"x": torch.ones(2)}, passes=2)
    target = dump_bag(tmp_path / "target", {"x": torch.ones(2)}, passes=2)
    dump_bag(tmp_path / "target", {"x": torch.ones(2) * 5}, passes=2)  # attach/close again: a second session
    sessions = sorted(os.listdir(target / "target"))  # same pid: in start order
    assert len(sessions) == 2
    code, out, err = run(capsys, base, target)
    assert code == 2 and out == "" and "Traceback" not in err
    assert "target role 'target': rank 0 (dp 0 pp 0 tp 0) has 2 sessions" in err
    assert all(str(target / "target" / session) in err for session in sessions)
    # What the message says to do works: a session alone in a root of its own is compared.
    for session, expected_code in zip(sessions, (0, 1)):
        alone = tmp_path / f"alone-{expected_code}" / "target"
        shutil.copytree(target / "target" / session, alone / session)
        assert run(capsys, base, alone.parent)[0] == expected_code


@pytest.mark.parametrize("size", [10**9, 10**30])
def test_absurd_tp_size_in_rank_json_exits_2_at_once(tmp_path, size):
    passes = {p: {"a": torch.ones(4) * p} for p in range(2)}
    crafted_rank(tmp_path / "base", passes)
    edit_rank_json(crafted_rank(tmp_path / "target", passes),
                   rank={"tp_rank": 0, "tp_size": size, "pp_rank": 0, "pp_size": 1, "rank": 0})

    def bounded_memory():  # 10**9 once made diff allocate a list of 10**9 ranks until it was killed
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    done = subprocess.run([sys.executable, "-m", "fastdump", "diff", str(tmp_path / "base"), str(tmp_path / "target")],
                          capture_output=True, text=True, timeout=120, preexec_fn=bounded_memory)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert f"rank.json: rank.tp_size is {size}, expected an integer 1..65536" in done.stderr


@pytest.mark.parametrize("field, value, message", [
    ("rank", 5, '"rank" is 5, not an object of rank numbers'),
    ("rank", "x", '"rank" is "x", not an object of rank numbers'),
    ("rank", [0], '"rank" is [0], not an object of rank numbers'),
    ("rank.tp_rank", "0", 'rank.tp_rank is "0", expected an integer >= 0'),
    ("rank.pp_rank", True, "rank.pp_rank is true, expected an integer >= 0"),
    ("rank.dp_rank", -1, "rank.dp_rank is -1, expected an integer >= 0"),
    ("rank.pp_size", 0, "rank.pp_size is 0, expected an integer 1..65536"),
    ("rank.tp_size", 2.0, "rank.tp_size is 2.0, expected an integer 1..65536"),
    ("rank.tp_rank", 3, "rank.tp_rank 3 is not below rank.tp_size 1"),
    ("status", ["closed"], "status is ['closed'], not a string"),
])
def test_malformed_rank_json_field_exits_2_naming_file_and_field(tmp_path, capsys, field, value, message):
    passes = {p: {"a": torch.ones(4) * p} for p in range(2)}
    crafted_rank(tmp_path / "base", passes)
    target = crafted_rank(tmp_path / "target", passes)
    with open(os.path.join(target, "rank.json")) as f:
        info = json.load(f)
    if field.startswith("rank."):
        value = {**info["rank"], field.partition(".")[2]: value}
        field = "rank"
    path = edit_rank_json(target, **{field: value})
    code, out, err = run(capsys, tmp_path / "base", tmp_path / "target")
    assert code == 2 and out == "" and "Traceback" not in err
    assert err == f"fastdump diff: target {path}: {message}\n"


def test_tp_ranks_disagreeing_on_tp_size_exit_2(tmp_path, capsys):
    full = torch.arange(8, dtype=torch.float32)
    crafted_rank(tmp_path / "base", {0: {"a": full}})
    crafted_rank(tmp_path / "target", {0: {"a": full[:4]}}, tp=0, tp_size=2)
    crafted_rank(tmp_path / "target", {0: {"a": full[4:]}}, tp=1, tp_size=3)
    code, out, err = run(capsys, tmp_path / "base", tmp_path / "target")
    assert code == 2 and "Traceback" not in err
    assert "role 'target' pp 0: the rank directories disagree on tp_size [2, 3]" in err


@pytest.mark.parametrize("baseline_tp", [1, 2], ids=["merged", "paired"])
@pytest.mark.parametrize("lacking", [0, 1], ids=["lead-rank", "other-rank"])
def test_a_pass_missing_on_one_tp_rank_fails_naming_that_rank(tmp_path, capsys, baseline_tp, lacking):
    full = {p: torch.arange(8, dtype=torch.float32) + p for p in range(3)}

    def shards(tp, tp_size, pass_ids):
        return {p: {"a": full[p].chunk(tp_size)[tp]} for p in pass_ids}

    for tp in range(baseline_tp):
        crafted_rank(tmp_path / "base", shards(tp, baseline_tp, range(3)), tp=tp, tp_size=baseline_tp)
    target = tmp_path / "target"
    for tp in range(2):
        path = crafted_rank(target, shards(tp, 2, (0, 2) if tp == lacking else range(3)), tp=tp, tp_size=2)
        if tp == lacking:
            lacking_path = path
    code, out, err = run(capsys, tmp_path / "base", target)
    assert code == 1 and "Traceback" not in err
    label = "dp0:merged" if baseline_tp == 1 else lacking
    assert out.splitlines()[0] == (f"first divergence: target rank {label} pass 1 a  "
                                   f"[pass 1 missing on target rank {lacking}] ({lacking_path})")
    result = fastdump.diff(tmp_path / "base", target)
    expected = [(1, f"pass 1 missing on target rank {lacking}")]
    assert [(row["pass"], row["reason"]) for row in result.failures] == expected
    assert result.missing == []


def test_a_pass_missing_on_a_whole_pp_stage_fails_naming_that_stage(tmp_path, capsys):
    """Every PP stage runs every pass: a pass the target's stage 1 lacks while its stage 0 ran it
    is missing data (exit 1), not a pass "only in the baseline" (exit 0, as it was)."""
    def stage(pp, pass_ids):
        return {p: {f"model.layers.{pp}.mlp": torch.arange(4, dtype=torch.float32) + p} for p in pass_ids}

    for pp in range(2):
        crafted_rank(tmp_path / "base", stage(pp, range(3)), pp=pp, pp_size=2)
        path = crafted_rank(tmp_path / "target", stage(pp, (0, 2) if pp == 1 else range(3)), pp=pp, pp_size=2)
    code, out, err = run(capsys, tmp_path / "base", tmp_path / "target")
    assert code == 1 and "Traceback" not in err, out + err
    result = fastdump.diff(tmp_path / "base", tmp_path / "target")
    assert [(row["pass"], row["reason"]) for row in result.failures] == [(1, "pass 1 missing on target rank 1")]
    assert str(path) in out


def test_first_divergence_across_ranks_follows_execution_order(tmp_path, capsys):
    """Same layout on both sides (each rank paired with its twin): TP ranks run each layer at once,
    PP stages one after the other, so the first divergence is the earliest layer on any TP rank,
    and in the earliest stage."""
    names = [f"model.layers.{i}.mlp" for i in range(4)]

    def passes(nudged_layer=None):
        tensors = {name: torch.arange(4, dtype=torch.float32) + i for i, name in enumerate(names)}
        if nudged_layer is not None:
            tensors[names[nudged_layer]] = tensors[names[nudged_layer]] + 1
        return {0: tensors, 1: {name: t.clone() for name, t in tensors.items()}}

    nudges = {(0, 0): 3, (1, 0): 1, (0, 1): 0}  # (tp, pp) -> the layer that rank diverges at in pass 0
    for side in ("base", "target"):
        for (tp, pp), layer in nudges.items():
            crafted_rank(tmp_path / side, passes(layer if side == "target" else None), tp=tp, tp_size=2, pp=pp,
                         pp_size=2)
        crafted_rank(tmp_path / side, passes(), tp=1, tp_size=2, pp=1, pp_size=2)
    code, out, err = run(capsys, tmp_path / "base", tmp_path / "target")
    assert code == 1 and out.startswith("first divergence: target rank 1 pass 0 model.layers.1.mlp  ")
    result = fastdump.diff(tmp_path / "base", tmp_path / "target")
    # tp rank 1's layer 1, then tp rank 0's layer 3 (stage 0), then stage 1 (global rank 2)
    assert [(row["rank"], row["pass"], row["name"]) for row in result.failures] == [
        (1, 0, names[1]), (0, 0, names[3]), (2, 0, names[0])] + [
        (rank, 1, names[layer]) for rank, layer in ((1, 1), (0, 3), (2, 0))]


def test_first_divergence_across_tp_ranks_is_by_layer_when_one_rank_lacks_a_tensor(tmp_path):
    """Target TP rank 0 lacks layer 1's tensor (dropped; listed missing) and diverges at layer 5;
    TP rank 1 diverges at layer 4, which ran before layer 5. Rows were ordered by each rank's own
    position in its pass: rank 0's layer 5 stood at position 4, as rank 1's layer 4, and the lower
    rank won the tie, so layer 5 was named the first divergence."""
    names = [f"model.layers.{i}.mlp" for i in range(7)]
    tensors = {name: torch.arange(4, dtype=torch.float32) + i for i, name in enumerate(names)}
    for tp in (0, 1):
        crafted_rank(tmp_path / "base", {0: tensors}, tp=tp, tp_size=2)
    lacking = {name: t + (name == names[5]) for name, t in tensors.items() if name != names[1]}
    crafted_rank(tmp_path / "target", {0: lacking}, tp=0, tp_size=2)
    crafted_rank(tmp_path / "target", {0: {name: t + (name == names[4]) for name, t in tensors.items()}},
                 tp=1, tp_size=2)
    result = fastdump.diff(tmp_path / "base", tmp_path / "target")
    assert [(row["rank"], row["name"]) for row in result.failures] == [(1, names[4]), (0, names[5])]
    assert (result.first_divergence["rank"], result.first_divergence["name"]) == (1, names[4])
    # every row in layer order, the lower rank first within a layer
    assert [(row["name"], row["rank"]) for row in result.rows] == sorted(
        (name, tp) for name in names for tp in (0, 1) if (name, tp) != (names[1], 0))


def test_a_rank_missing_on_one_side_is_a_difference(tmp_path, capsys):
    passes = {p: {"a": torch.ones(4) * p} for p in range(2)}
    crafted_rank(tmp_path / "base", passes, tp=0, tp_size=2)
    lost = crafted_rank(tmp_path / "base", passes, tp=1, tp_size=2)
    crafted_rank(tmp_path / "target", passes, tp=0, tp_size=2)  # its tp rank 1 directory is gone
    code, out, err = run(capsys, tmp_path / "base", tmp_path / "target")
    lines = out.splitlines()
    assert code == 1 and "Traceback" not in err
    assert lines[0] == ("ranks missing: 1 rank(s) on one side only (listed below); "
                        "the 2 tensor(s) compared are within tolerance")
    assert f"missing: role target rank 1 (dp 0) only in the baseline ({lost})" in lines
    result = fastdump.diff(tmp_path / "base", tmp_path / "target")
    assert result.exit_code == 1 and not result.ok and result.first_divergence is None
    assert json.loads(result.to_json())["exit_code"] == 1
    result.to_html(tmp_path / "report.html")  # the page says so too, not "no divergence"
    page = (tmp_path / "report.html").read_text()
    assert "fastdump diff: FAIL" in page and "ranks missing: 1 rank(s)" in page and "no divergence" not in page.lower()
    # --rank 0 asks about rank 0 only: present and equal on both sides.
    assert fastdump.diff(tmp_path / "base", tmp_path / "target", rank=0).exit_code == 0


def test_a_pass_in_two_segments_is_ambiguous_never_silently_equal(tmp_path, capsys):
    """A segment of another session holding passes 0 and 1 copied into a rank directory: pass 0
    has two versions of 'a'. Neither is picked: the pass is a read problem naming where it is."""
    passes = {p: {"a": torch.ones(3) * p} for p in range(4)}
    crafted_rank(tmp_path / "base", passes)
    rank_path = crafted_rank(tmp_path / "target", passes)
    other = write_rank_dir(tmp_path / "other", {p: {"a": torch.ones(3) * p + 100} for p in range(2)})
    shutil.copy(sorted(glob.glob(os.path.join(other, "seg-*.h5")))[0], os.path.join(rank_path, "seg-000002.h5"))
    code, out, err = run(capsys, tmp_path / "base", tmp_path / "target")
    assert code == 2 and "Traceback" not in err and not out.startswith("no divergence:")
    where = f"target dump {tmp_path / 'target'}, role 'target', rank 0 ({os.path.basename(rank_path)}), pass "
    # The reader may refuse the pass itself (DumpError) or list 'a' twice: either way, both passes named.
    assert all(f"{where}{pass_id}: " in out + err for pass_id in (0, 1)), out + err


@pytest.mark.parametrize("listed", [["a", "a"], ["a", "a#dup1"]])
def test_a_name_listed_twice_in_a_pass_is_not_dropped(tmp_path, capsys, monkeypatch, listed):
    from fastdump import reader

    passes = {p: {"a": torch.ones(3) * p} for p in range(2)}
    crafted_rank(tmp_path / "base", passes)
    rank_path = crafted_rank(tmp_path / "target", passes)
    real = reader.DumpSet.pass_names

    def pass_names(self, role=None, rank=None, pass_id=None, **kwargs):
        if self.root == str(tmp_path / "target") and pass_id == 0:
            return list(listed)  # what the reader returns for a pass found in two segments
        return real(self, role, rank, pass_id, **kwargs)

    monkeypatch.setattr(reader.DumpSet, "pass_names", pass_names)
    code, out, err = run(capsys, tmp_path / "base", tmp_path / "target")
    assert code == 2
    assert (f"ERROR: target dump {tmp_path / 'target'}, role 'target', rank 0 ({os.path.basename(rank_path)}), "
            f"pass 0: tensor '{listed[1]}' is in the pass twice") in out.splitlines()[1]
    assert out.splitlines()[-1] == "compared 1, failed 0, missing 0, problems 1"  # pass 1 still compared


@pytest.mark.parametrize("error", ["DumpError", "ValueError", "KeyError", "OSError"])
def test_a_read_error_in_one_pass_exits_2_naming_dump_role_rank_and_pass(tmp_path, capsys, monkeypatch, error):
    from fastdump import reader

    passes = {p: {"a": torch.ones(3) * p} for p in range(3)}
    crafted_rank(tmp_path / "base", passes)
    rank_path = crafted_rank(tmp_path / "target", passes)
    exception = {"DumpError": reader.DumpError, "ValueError": ValueError, "KeyError": KeyError,
                 "OSError": OSError}[error]
    real = reader.DumpSet.pass_names

    def pass_names(self, role=None, rank=None, pass_id=None, **kwargs):
        if self.root == str(tmp_path / "target") and pass_id == 1:
            raise exception("boom")
        return real(self, role, rank, pass_id, **kwargs)

    monkeypatch.setattr(reader.DumpSet, "pass_names", pass_names)
    code, out, err = run(capsys, tmp_path / "base", tmp_path / "target")
    assert code == 2 and "Traceback" not in err
    assert (f"ERROR: target dump {tmp_path / 'target'}, role 'target', rank 0 ({os.path.basename(rank_path)}), "
            f"pass 1: cannot read ({error}: boom)") in out.splitlines()
    assert {row["pass"] for row in fastdump.diff(tmp_path / "base", tmp_path / "target").rows} == {0, 2}


def test_a_read_error_listing_a_ranks_passes_exits_2_naming_dump_role_and_rank(tmp_path, capsys, monkeypatch):
    from fastdump import reader

    passes = {p: {"a": torch.ones(3) * p} for p in range(2)}
    crafted_rank(tmp_path / "base", passes)
    rank_path = crafted_rank(tmp_path / "target", passes)
    real = reader.DumpSet.passes

    def broken_passes(self, role=None, rank=None, **kwargs):
        if self.root == str(tmp_path / "base"):
            raise reader.DumpError("pass 0 is complete in two segments")
        return real(self, role, rank, **kwargs)

    monkeypatch.setattr(reader.DumpSet, "passes", broken_passes)
    code, out, err = run(capsys, tmp_path / "base", tmp_path / "target")
    assert code == 2 and out == "" and "Traceback" not in err
    assert err == (f"fastdump diff: baseline dump {tmp_path / 'base'}, role 'target', rank 0 "
                   f"({os.path.basename(rank_path)}): cannot read (DumpError: pass 0 is complete in two segments)\n")


@pytest.mark.parametrize("big", [False, True])
def test_complex_against_real_compares_both_as_complex(tmp_path, big):
    """A complex tensor yields two floats per element and a real one one: zipping the two streams
    compared the wrong parts. Small tensors raised numpy's shape error (exit 2); a real tensor
    holding the first half of the complex one's (re, im) pairs compared equal (exit 0)."""
    n = (1 << 20) if big else 2
    values = torch.complex(torch.arange(n, dtype=torch.float32), torch.arange(n, dtype=torch.float32) + 0.5)
    lookalike = torch.view_as_real(values[: n // 2]).reshape(-1).clone()  # as many elements, other values
    base, target = pair(tmp_path, {"x": values}, {"x": lookalike})
    result = fastdump.diff(base, target)
    row = row_of(result, "x")
    assert not result.ok and row["status"] == "fail" and row["mismatch"] == 1.0, row
    real = tmp_path / "real"
    dump_bag(real, {"x": values.real.clone()})
    row = row_of(fastdump.diff(base, real), "x")  # the real parts are equal, the imaginary ones not
    assert row["status"] == "fail" and row["mismatch"] == 1.0
    if not big:
        same = tmp_path / "same"
        dump_bag(same, {"x": torch.complex(values.real, torch.zeros(n))})
        assert fastdump.diff(same, real).ok  # a complex tensor with no imaginary part equals its real one


def test_a_block_hdf5_cannot_read_is_a_dump_error_naming_the_file(tmp_path, lm, capsys, monkeypatch):
    """HDF5's own errors on a damaged file (a flipped bit in a group's metadata: RuntimeError
    "incorrect metadata checksum") reached load() as they were, and `fastdump show` and `export`
    printed a traceback. They are a DumpError naming the file now."""
    from fastdump import reader

    def damaged(self, h5file, number):
        raise RuntimeError("Unable to synchronously check link existence (incorrect metadata checksum)")

    monkeypatch.setattr(reader.SegmentIndex, "block", damaged)
    with pytest.raises(reader.DumpError, match=r"seg-000000\.h5: block 0 cannot be read .*metadata checksum"):
        fastdump.open(lm).load("target", 0, 0)
    for argv in (["show", lm, "--pass", "0"], ["export", "--format", "sglang", lm, tmp_path / "out"]):
        code = cli.main([str(a) for a in argv])
        err = capsys.readouterr().err
        assert code != 0 and "seg-000000.h5: block 0 cannot be read" in err and "Traceback" not in err


def test_pp_stages_compare_the_roots_output_from_the_last_stage(tmp_path):
    """One computation dumped with PP=1 and with PP=2 (every stage runs the root module): the
    PP=1 root output is the model's, the last stage's; stage 0's is its hidden states. Before,
    the first stage's was compared, and identical runs diverged at the root."""
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    class Net(nn.Module):
        def __init__(self, own):
            super().__init__()
            self.own = own
            self.layers = nn.ModuleDict({str(i): layers[i] for i in own})

        def forward(self, x):
            for i in self.own:
                x = self.layers[str(i)](x)
            return x

    x = torch.randn(2, 8)
    one, two = tmp_path / "pp1", tmp_path / "pp2"
    with torch.inference_mode():
        whole = Net([0, 1, 2, 3])
        with fastdump.attach(whole, one, writer="thread", inputs=True, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1):
            whole(x)
        first, last = Net([0, 1]), Net([2, 3])
        d0 = fastdump.attach(first, two, writer="thread", inputs=True, tp_rank=0, tp_size=1, pp_rank=0, pp_size=2)
        d1 = fastdump.attach(last, two, writer="thread", inputs=True, tp_rank=0, tp_size=1, pp_rank=1, pp_size=2)
        last(first(x))
        d0.close()
        d1.close()
    result = fastdump.diff(one, two, atol=0, rtol=0)
    assert result.ok, [(r["name"], r["status"], r.get("reason")) for r in result.rows]
    names = [r["name"] for r in result.rows]
    assert "Net" in names and "Net.input.0" in names  # output from stage 1, input from stage 0
    assert names.index("Net") == len(names) - 1  # executed last: after every layer


def manual_rank(root, passes, **ranks):
    """One rank directory of ``passes`` ([{name: tensor}], dumped by hand), ranks as attach takes them."""
    with fastdump.attach(None, root, writer="thread", **ranks) as d:
        for tensors in passes:
            d.begin_pass()
            for name, tensor in tensors.items():
                d.dump(name, tensor)
            d.end_pass()
    return root


def test_a_pp_stage_or_tp_rank_absent_on_one_side_of_merged_layouts_fails(tmp_path, capsys):
    """TP1/PP1 against TP1/PP2 (or TP2/PP2), with stage 1 absent, or a TP rank of it: the stage's
    names were listed only as names on one side ("no divergence", exit 0), or the diff stopped at
    once (exit 2, every other role uncompared). The absent ranks are missing ranks now (exit 1)."""
    torch.manual_seed(0)
    l = [torch.randn(2, 4) for _ in range(4)]
    base = manual_rank(tmp_path / "base", [{f"layers.{i}": l[i] for i in range(4)}])
    manual_rank(tmp_path / "base", [{"other": l[0]}], role="draft")
    stage0 = tmp_path / "stage0"
    manual_rank(stage0, [{"layers.0": l[0], "layers.1": l[1]}], pp_rank=0, pp_size=2)
    manual_rank(stage0, [{"other": l[0]}], role="draft")
    code, out, _ = run(capsys, base, stage0)
    assert code == 1 and "rank pp1 (dp 0) only in the baseline" in out and "pp stage 1 of 2" in out, out
    torn = tmp_path / "torn"  # stage 1 of TP 2 with its tp rank 1 absent: cannot be reassembled
    manual_rank(torn, [{"layers.0": l[0], "layers.1": l[1]}], pp_rank=0, pp_size=2)
    manual_rank(torn, [{"layers.2": l[2][:, :2], "layers.3": l[3][:, :2]}], tp_rank=0, tp_size=2, pp_rank=1,
                pp_size=2)
    manual_rank(torn, [{"other": l[0]}], role="draft")
    result = fastdump.diff(base, torn)
    assert result.exit_code == 1 and {r["role"] for r in result.rows} == {"target", "draft"}
    assert any(item["kind"] == "rank" and item["rank"] == "pp1 tp1" for item in result.missing), result.missing


def test_rank_filter_keeps_the_absent_ranks_of_a_merged_layout(tmp_path, capsys):
    """--rank K with merged layouts (TP1/PP1 against a PP2 run whose stage 1 lost TP rank 1): the
    absent rank is labelled 'pp1 tp1', never equal to K, so the filter dropped it and --rank 0 read
    "no divergence" (exit 0) where the plain diff fails (exit 1). A merged unit holds every rank of
    its DP replica: --rank K of that replica keeps the replica's absent ranks, also where no stage
    of the role could be reassembled (the draft role compared alone, exit 0 before)."""
    torch.manual_seed(0)
    l = [torch.randn(2, 4) for _ in range(4)]
    base = manual_rank(tmp_path / "base", [{f"layers.{i}": l[i] for i in range(4)}])
    manual_rank(base, [{"other": l[0]}], role="draft")
    torn = tmp_path / "torn"  # target ranks 0 (pp0) and 2 (pp1 tp0); pp1 tp1 (rank 3) absent
    manual_rank(torn, [{"layers.0": l[0], "layers.1": l[1]}], pp_rank=0, pp_size=2)
    manual_rank(torn, [{"layers.2": l[2][:, :2], "layers.3": l[3][:, :2]}], tp_rank=0, tp_size=2, pp_rank=1,
                pp_size=2)
    manual_rank(torn, [{"other": l[0]}], role="draft")
    assert fastdump.diff(base, torn).exit_code == 1
    for rank in (0, 2):  # (rank 2's own stage cannot be reassembled: it said "no rank 2 present", exit 2)
        code, out, _ = run(capsys, base, torn, "--rank", rank)
        assert code == 1 and out.startswith("ranks missing: 1 rank(s) on one side only"), out
        assert "missing: role target rank pp1 tp1 (dp 0) only in the baseline" in out
    half = tmp_path / "half"  # TP2 with TP rank 1 absent: the target role has no stage to compare
    manual_rank(half, [{f"layers.{i}": l[i][:, :2] for i in range(4)}], tp_rank=0, tp_size=2)
    manual_rank(half, [{"other": l[0]}], role="draft")
    result = fastdump.diff(base, half, rank=0)
    assert result.exit_code == 1 and {row["role"] for row in result.rows} == {"draft"}
    assert [(m["kind"], m["role"], m["rank"]) for m in result.missing] == [("rank", "target", "pp0 tp1")]


def test_a_pass_a_whole_pp_stage_lacks_in_merged_layouts_fails(tmp_path, capsys):
    """Merged layouts (TP1/PP2 against TP2/PP2): a pass that every rank of a stage lacks, while the
    other stage ran it, dropped that stage's names, listed as names on one side: exit 0."""
    torch.manual_seed(0)
    l = [torch.randn(2, 4) for _ in range(4)]
    p = [{f"layers.{i}": l[i] + k for i in range(4)} for k in range(2)]
    base = tmp_path / "base"
    manual_rank(base, [{n: t[n] for n in ("layers.0", "layers.1")} for t in p], pp_rank=0, pp_size=2)
    manual_rank(base, [{n: t[n] for n in ("layers.2", "layers.3")} for t in p], pp_rank=1, pp_size=2)
    target = tmp_path / "target"
    for tp in range(2):
        cols = slice(2 * tp, 2 * tp + 2)
        manual_rank(target, [{n: t[n][:, cols] for n in ("layers.0", "layers.1")} for t in p], tp_rank=tp, tp_size=2,
                    pp_rank=0, pp_size=2)
        manual_rank(target, [{n: t[n][:, cols] for n in ("layers.2", "layers.3")} for t in p[:1]], tp_rank=tp,
                    tp_size=2, pp_rank=1, pp_size=2)  # stage 1 ran pass 0 only
    code, out, _ = run(capsys, base, target, "--unshard", "layers=1")
    assert code == 1 and "passes 1 missing on every rank of the target's pp stage 1" in out, out


def test_equal_tp_sizes_with_different_pp_sizes_compare_rank_by_rank(tmp_path):
    """TP2/PP1 against TP2/PP2, the same column shards: merged, equal shard shapes were taken as
    replicated and failed ("tp ranks 0 and 1 disagree"). With as many shards on both sides, rank
    k is compared with rank k, and a difference on one rank still fails."""
    torch.manual_seed(0)
    l0, l1 = torch.randn(3, 8), torch.randn(3, 8)
    base, target, nudged = tmp_path / "base", tmp_path / "target", tmp_path / "nudged"
    for r in range(2):
        cols = slice(4 * r, 4 * r + 4)
        manual_rank(base, [{"layers.0": l0[:, cols], "layers.1": l1[:, cols]}], tp_rank=r, tp_size=2)
        for root, bump in ((target, 0.0), (nudged, 1.0 if r == 1 else 0.0)):
            manual_rank(root, [{"layers.0": l0[:, cols]}], tp_rank=r, tp_size=2, pp_rank=0, pp_size=2)
            manual_rank(root, [{"layers.1": l1[:, cols] + bump}], tp_rank=r, tp_size=2, pp_rank=1, pp_size=2)
    result = fastdump.diff(base, target, atol=0, rtol=0)
    assert result.ok and {r["unshard"] for r in result.rows} == {"pairwise"}, result.rows
    result = fastdump.diff(base, nudged)
    assert [r["name"] for r in result.failures] == ["layers.1"] and result.failures[0]["mismatch"] == 0.5
    # The merged row names no rank: it says whose shard differs.
    assert result.failures[0]["failing_tp_ranks"] == {"target": [1]}
    assert result.failures[0]["reason"].endswith("(in the shard of target tp rank 1)")


def test_dp_replicas_are_named_in_rows_lines_and_the_report(tmp_path, capsys):
    """Rank numbers repeat per DP replica: rows of two replicas could not be told apart, and the
    HTML report plotted both replicas' tensors as one pass."""
    torch.manual_seed(0)
    l = [torch.randn(2, 4) for _ in range(3)]
    base, target = tmp_path / "base", tmp_path / "target"
    for dp in range(2):
        manual_rank(base, [{f"layers.{i}": l[i] for i in range(3)}], dp_rank=dp, dp_size=2)
        manual_rank(target, [{f"layers.{i}": l[i] + (dp == 1 and i > 0) for i in range(3)}], dp_rank=dp, dp_size=2)
    result = fastdump.diff(base, target)
    assert {(r["dp_rank"], r["name"]) for r in result.failures} == {(1, "layers.1"), (1, "layers.2")}
    assert result.lines()[0].startswith("first divergence: target rank 0 (dp 1) pass 0 layers.1")
    page = open(result.to_html(tmp_path / "r.html")).read()
    assert "target rank 0 (dp 1) pass 0" in page


def test_names_from_a_dump_never_reach_the_terminal_raw(tmp_path, capsys):
    """A tensor name holding ANSI escapes or a newline could forge lines of the report ("no
    divergence"); show escaped them, diff did not."""
    evil = "evil\x1b[2J\x1b[H\nno divergence: all fine"
    base, target = pair(tmp_path, {evil: torch.zeros(2)}, {evil: torch.ones(2)})
    code, out, err = run(capsys, base, target)
    assert code == 1 and "\x1b" not in out and "\\x1b[2J" in out
    assert all(not line.startswith("no divergence") for line in out.splitlines())


def test_html_report_of_a_name_with_a_lone_surrogate_is_written(tmp_path, capsys):
    """Dump names are any Python str, a lone surrogate too (the dump and the other reports keep
    it). Encoding the page as UTF-8 raised, and `diff --html` exited 2 without a report."""
    name = "layers.0.a\ud800b"
    for side, value in (("base", 0.0), ("target", 1.0)):
        with fastdump.attach(None, tmp_path / side, writer="thread") as dumper:
            dumper.begin_pass()
            dumper.dump(name, torch.full((2,), value))
            dumper.end_pass()
    report = tmp_path / "r.html"
    code, out, err = run(capsys, tmp_path / "base", tmp_path / "target", "--html", report)
    assert code == 1 and err == "" and "a\\ud800b" in out
    page = report.read_text(encoding="utf-8")
    assert "a\\ud800b" in page and "First divergence" in page


def test_asking_whether_complex_has_arithmetic_warns_of_nothing():
    """stats.has_arithmetic(complex64) cast a complex zero to float64 to find out, and torch warned
    "Casting complex values to real discards the imaginary part" into every diff of complex dumps."""
    stats._ARITHMETIC.pop(torch.complex64, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert stats.has_arithmetic(torch.complex64)


def test_html_report_of_hostile_names_is_escaped_well_formed_and_bounded(tmp_path):
    """Names, paths and option values from the dump's world reach the report: markup must stay
    text, control characters must not make the page malformed (a raw NUL, form feed), a newline
    must not join two names, and a 100k-character name must not make the report 100 KB per
    mention. The page parses as XML, so every element is closed and every text escaped."""
    import xml.etree.ElementTree as ET

    names = ["layers.0.<script>alert(1)</script>", 'layers.1."q"&amp;', "layers.2.]]><!--", "a\nb\x00c\x07\x0c",
             "é✓\u202egnp.exe", "layers.3." + "x" * 100_000]
    roots = []
    for side, value in (('b<i>&"', 0.0), ("t</svg>", 1.0)):
        with fastdump.attach(None, tmp_path / side, writer="thread") as dumper:
            for _ in range(2):
                dumper.begin_pass()
                dumper.set_pass_meta(mode="<script>")
                for name in names:
                    dumper.dump(name, torch.full((2,), value))
                dumper.end_pass()
        roots.append(tmp_path / side)
    result = fastdump.diff(*roots, align="meta:mode=<script>")
    assert result.failed == 2 * len(names)
    page = open(result.to_html(tmp_path / "r.html"), encoding="utf-8").read()
    tree = ET.fromstring(page)  # raises on malformed markup or a raw control character
    assert not [e for e in tree.iter() if e.tag.split("}")[-1] in ("script", "i")]
    cells = ["".join(td.itertext()) for td in tree.iter("td")]
    assert "layers.0.<script>alert(1)</script>" in cells and 'layers.1."q"&amp;' in cells
    assert "layers.2.]]><!--" in cells and "a\\nb\\x00c\\x07\\x0c" in cells and "é✓\\u202egnp.exe" in cells
    assert any(c.startswith("layers.3.xxx") and "more characters]" in c for c in cells)
    assert str(tmp_path / 'b<i>&"') in cells and "{'role': None" in "".join(cells)
    assert "meta:mode=<script>" in "".join(cells)
    assert "x" * 2000 not in page and len(page) < 60_000


def _dump_passes(root, passes, value):
    with fastdump.attach(None, root, writer="thread") as dumper:
        for _ in range(passes):
            dumper.begin_pass()
            for i in range(20):
                dumper.dump(f"model.layers.{i % 4}.m{i}", torch.full((4,), value + i))
            dumper.end_pass()
    return root


def test_diff_memory_is_bounded_whatever_the_number_of_rows(tmp_path, capfd, monkeypatch):
    """diff kept every row (~1.2 KB each) and printed the JSON as one string: 40k passes of 95
    tensors held 663 MB. Past rowlog.MEMORY_ROWS the rows go to a temporary file, and the text,
    JSON and HTML outputs are written from it a row at a time: four times the rows (every one
    failing) must not take more memory, and every row is still in the outputs."""
    import tracemalloc

    from fastdump import report, rowlog

    monkeypatch.setattr(rowlog, "MEMORY_ROWS", 50)
    monkeypatch.setattr(report, "_MAX_TABLE_ROWS", 20)  # (the report's bound; 2000 rows by default)
    peaks = {}
    for passes in (15, 60):
        base = _dump_passes(tmp_path / f"a{passes}", passes, 0.0)
        target = _dump_passes(tmp_path / f"b{passes}", passes, 1.0)
        page = tmp_path / f"r{passes}.html"
        argv = ["diff", str(base), str(target), "--html", str(page)]
        if not peaks:
            assert cli.main(argv + ["--json"]) == 1  # (imports and caches warm before measuring)
            capfd.readouterr()
        tracemalloc.start()
        try:
            assert cli.main(argv + ["--json"]) == 1
            assert cli.main(argv) == 1
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        peaks[passes] = peak
        out = capfd.readouterr().out.splitlines()
        data = json.loads(out[0])
        assert len(data["rows"]) == data["failed"] == passes * 20 and data["exit_code"] == 1
        assert [(r["pass"], r["name"]) for r in data["rows"]] == \
            [(p, f"model.layers.{i % 4}.m{i}") for p in range(passes) for i in range(20)]
        assert data["rows"][-1]["max_abs"] == 1.0 and data["rows"][-1]["target_stats"]["max"] == 20.0
        assert data["first_divergence"] == data["rows"][0]
        text = out[1:]
        assert text[0].startswith("first divergence: target rank 0 pass 0 model.layers.0.m0")
        assert sum(line.startswith("FAIL ") for line in text) == passes * 20
        assert text[-2] == f"compared {passes * 20}, failed {passes * 20}, missing 0"
        page = page.read_text()
        assert f"<h2>Failing tensors ({passes * 20})</h2>" in page and f"{passes * 20 - 20} more" in page
    assert peaks[60] < peaks[15] * 1.2 + (200 << 10), peaks


def test_spilled_rows_leave_no_file_behind_and_read_back_as_written(tmp_path, monkeypatch):
    """The rows past rowlog.MEMORY_ROWS went to a named file in TMPDIR, removed at close or
    garbage collection: a diff killed with SIGKILL (or Ctrl-C'd twice) left it there. The file has
    no name now; the rows still read back in order, as often as asked, also interleaved."""
    import tempfile

    from fastdump import rowlog

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    log = rowlog.RowLog(memory_rows=3)
    rows = [{"pass": p, "name": f"m{p}\u00e9\ud800", "status": "fail" if p % 2 else "ok", "max_abs": float("inf")}
            for p in range(2000)]  # (about 150 KB: more than one read of the file)
    for k, row in enumerate(rows):
        log.append(row)
        assert log.spilled == (k >= 3), k  # memory_rows rows are held in memory, the next one spills
    assert log.spilled and os.listdir(tmp_path) == []
    assert [r["pass"] for r in log] == list(range(2000)) and log[1999]["name"] == rows[1999]["name"]
    outer = iter(log)
    assert next(outer)["pass"] == 0 and [r["pass"] for r in log][:2] == [0, 1] and next(outer)["pass"] == 1
    assert log.failed == 1000 and log.first_divergence["pass"] == 1
    log.close()
    assert os.listdir(tmp_path) == []


def test_heatmap_marks_a_failing_cell_whose_rel_diff_reads_identical(tmp_path):
    """A NaN on one side only fails the tensor, but its rel_diff (over elements finite on both
    sides) is 0: the heatmap colored its cell as identical, the same as the cells that match."""
    import xml.etree.ElementTree as ET

    for side, first in (("base", 1.0), ("target", NAN)):
        with fastdump.attach(None, tmp_path / side, writer="thread") as dumper:
            dumper.begin_pass()
            dumper.dump("layers.0.a", torch.tensor([first, 2.0]))
            dumper.dump("layers.1.b", torch.tensor([1.0, 2.0]))
            dumper.end_pass()
    result = fastdump.diff(tmp_path / "base", tmp_path / "target")
    assert [(r["name"], r["rel_diff"]) for r in result.failures] == [("layers.0.a", 0.0)]
    tree = ET.parse(result.to_html(tmp_path / "r.html"))
    cells = {rect.find("{http://www.w3.org/2000/svg}title").text: rect.get("stroke")
             for rect in tree.iter("{http://www.w3.org/2000/svg}rect")
             if rect.find("{http://www.w3.org/2000/svg}title") is not None}
    assert cells["pass 0 layer 0: max rel_diff 0, 1 failing"] == "#d22820"
    assert cells["pass 0 layer 1: max rel_diff 0"] is None


def test_html_report_lists_and_plot_are_bounded_and_keep_the_first_divergence(tmp_path, monkeypatch):
    """Missing items, notes and problems were listed whole and the plot drew every tensor of the
    pass: the report grew with the dump. Past their bounds they say how many more, and a sampled
    plot still draws the first divergence."""
    import xml.etree.ElementTree as ET

    from fastdump import report

    monkeypatch.setattr(report, "_MAX_LIST_ITEMS", 2)
    monkeypatch.setattr(report, "_MAX_PLOT_POINTS", 3)
    for side, names, changed in (("base", range(15), None), ("target", range(10), "layers.5.x")):
        with fastdump.attach(None, tmp_path / side, writer="thread") as dumper:
            dumper.begin_pass()
            for i in names:
                dumper.dump(f"layers.{i}.x", torch.full((2,), 1.0 + (f"layers.{i}.x" == changed)))
            dumper.end_pass()
    result = fastdump.diff(tmp_path / "base", tmp_path / "target")
    assert len(result.missing) == 5 and result.first_divergence["name"] == "layers.5.x"
    page = open(result.to_html(tmp_path / "r.html")).read()
    tree = ET.fromstring(page)
    (missing,) = [ul for ul in tree.iter("ul")]
    assert [li.text for li in missing][1:] == ["role target rank 0: 'layers.11.x' only in the baseline (passes 0)",
                                               "… 3 more (see the text or --json output)"]
    svg = "{http://www.w3.org/2000/svg}"
    circles = [c.find(f"{svg}title").text for c in tree.iter(f"{svg}circle")]
    assert [c.partition(":")[0] for c in circles] == ["0", "4", "5", "8"]
    assert "(every 4th of 10 tensors)" in page


def test_a_merged_row_names_the_shard_that_differs_by_its_own_slice(tmp_path):
    """TP1 against TP2 column shards, merged along dim 1: each shard is checked against its own
    slice of the other side (columns 0-3, then 4-7). Shard 0 differs; shard 1 equals its slice
    (and differs from columns 0-3, which a check against the first slice would blame)."""
    torch.manual_seed(0)
    whole = torch.randn(3, 8)
    base, target = tmp_path / "base", tmp_path / "target"
    manual_rank(base, [{"layers.0": whole}])
    for r in range(2):
        manual_rank(target, [{"layers.0": whole[:, 4 * r:4 * r + 4] + (1.0 if r == 0 else 0.0)}], tp_rank=r, tp_size=2)
    result = fastdump.diff(base, target, unshard={"layers": 1})
    (row,) = result.failures
    assert row["unshard"] == 1 and row["mismatch"] == 0.5
    assert row["failing_tp_ranks"] == {"target": [0]} and row["reason"].endswith("(in the shard of target tp rank 0)")


# ------------------------------------------------------------- comparison rules pinned by mutants


def test_rtol_scales_with_the_baseline_not_the_target():
    """|a - b| <= atol + rtol*|b|, b the baseline (the CLI's help says so): 1.105 against a baseline
    1.0 is 0.105 off, over 0.1*1.0; the other way round it is within 0.1*1.105. (A mutant scaling
    rtol by the target passed both.)"""
    one, more = torch.tensor([1.0], dtype=torch.float64), torch.tensor([1.105], dtype=torch.float64)
    assert stats.compare(one, more, 0, 0.1)["mismatches"] == 1
    assert stats.compare(more, one, 0, 0.1)["mismatches"] == 0


def test_a_difference_in_an_early_chunk_is_not_forgotten_by_an_equal_last_chunk(monkeypatch):
    """Distances over several chunks: the first chunk differs, the last ones are equal. Equality
    must hold over every chunk to give exact 0 distance (a mutant keeping only the last chunk's
    read rel_diff 0 and cosine 1, and `--metric rel_diff=0` passed the tensor)."""
    monkeypatch.setattr(stats, "CHUNK_ELEMENTS", 4)
    base = torch.arange(1.0, 13.0, dtype=torch.float64)
    target = base.clone()
    target[1] += 0.5
    r = stats.compare(base, target, 0, 0)
    d = target - base
    assert r["rel_diff"] == pytest.approx(float((d * d).sum() / (base * base + target * target).sum()), rel=1e-12)
    assert r["cosine_distance"] > 0 and r["mismatches"] == 1 and r["max_abs"] == 0.5


def test_a_type_with_no_arithmetic_against_one_with_it_is_compared_bit_for_bit():
    """float4 (no arithmetic) against uint8 holding the same bytes: bit for bit, and different
    dtypes never equal. Compared as numbers (a mutant needing only one side with arithmetic), the
    float4 side raised TypeError out of the diff."""
    raw = torch.tensor([0, 1, 2], dtype=torch.uint8)
    for base, target in ((raw, raw.view(torch.float4_e2m1fn_x2)), (raw.view(torch.float4_e2m1fn_x2), raw)):
        r = stats.compare(base, target, 0, 0)
        assert r["bitwise"] and r["mismatches"] == 3 and r["max_abs"] is None
    # Two types with no arithmetic, the same bytes: still two dtypes, never "same".
    assert stats.compare(raw.view(torch.bits8), raw.view(torch.float4_e2m1fn_x2), 0, 0)["mismatches"] == 3
    assert stats.compare(raw.view(torch.bits8), raw.clone().view(torch.bits8), 0, 0)["mismatches"] == 0


def test_integers_against_floats_keep_the_fractions():
    """Exact integer differences only when both sides are integers: int64 against float32 is
    compared in float64 (a mutant taking either side's integer type cast 1.5 to 1: equal)."""
    ints, floats = torch.tensor([1, 2, 3]), torch.tensor([1.5, 2.0, 3.0])
    for base, target in ((ints, floats), (floats, ints)):
        r = stats.compare(base, target, 0, 0)
        assert r["mismatches"] == 1 and r["max_abs"] == 0.5


def test_statistics_of_huge_negative_values_do_not_overflow():
    """The scale of a chunk is its largest magnitude, a negative one too: values near -1e300
    squared past float64 (std inf) under a mutant scaling by the largest value only."""
    s = stats.tensor_stats(torch.tensor([-1e300, -3e300], dtype=torch.float64))
    assert s["mean"] == pytest.approx(-2e300, rel=1e-12) and s["std"] == pytest.approx(1e300, rel=1e-12)


def test_distance_metrics_on_a_type_with_no_arithmetic_compare_its_bits(tmp_path):
    """--metric rel_diff or cosine on float4 tensors (no values: bit for bit, distance None) is
    the bitwise verdict: equal bits pass, other bits fail (a mutant reading the distance raised
    TypeError out of the diff)."""
    def f4(*values):
        return torch.tensor(values, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)

    base, target = pair(tmp_path, {"same": f4(1, 2), "other": f4(1, 2)}, {"same": f4(1, 2), "other": f4(1, 3)})
    result = fastdump.diff(base, target, metric=["rel_diff", "cosine"])
    assert row_of(result, "same")["status"] == "ok" and row_of(result, "same")["bitwise"]
    other = row_of(result, "other")
    assert other["status"] == "fail" and other["reason"] == "exceeds rel_diff>0.001, cosine>0.001"
    assert result.exit_code == 1 and result.compared == 3  # bitwise rows are compared rows (and Bag's)


def test_the_same_values_in_another_shape_fail(tmp_path):
    """[2, 3] against [3, 2] holding the same six values in the same order: the shapes differ, the
    row fails naming both (a mutant without the shape check compared the elements: ok)."""
    six = torch.arange(6.0)
    base, target = pair(tmp_path, {"x": six.reshape(2, 3)}, {"x": six.reshape(3, 2)})
    result = fastdump.diff(base, target)
    row = row_of(result, "x")
    assert row["status"] == "fail" and row["reason"] == "shape [3, 2] vs baseline [2, 3]" and result.exit_code == 1


def test_replicated_shards_of_other_shapes_fail_even_with_the_same_values(tmp_path):
    """--unshard x=replicated with TP shards [2, 3] and [3, 2] holding the same six values: not one
    tensor replicated, the row fails naming both shapes (a mutant without the shape check compared
    the elements and passed the row)."""
    six, y = torch.arange(6.0), torch.ones(2)  # (y: a diff that compares nothing exits 2)
    base = manual_rank(tmp_path / "base", [{"x": six.reshape(2, 3), "y": y}])
    target = tmp_path / "target"
    for r, shape in enumerate(((2, 3), (3, 2))):
        manual_rank(target, [{"x": six.reshape(shape), "y": y}], tp_rank=r, tp_size=2)
    result = fastdump.diff(base, target, unshard={"x": "replicated"})
    row = row_of(result, "x")
    assert row["status"] == "fail" and result.exit_code == 1
    assert row["reason"] == "target: replicated tensor has shape [3, 2] on tp rank 1, [2, 3] on tp rank 0"


def _replicated_tp2(root, rank1_value, y):
    """A TP2 dump whose tensor 'norm' is replicated, rank 1's copy ``rank1_value``."""
    x = torch.linspace(1, 2, 64)
    for r, value in enumerate((x, rank1_value)):
        manual_rank(root, [{"norm": value, "y": y}], tp_rank=r, tp_size=2)
    return root


def test_the_replicated_shard_check_uses_the_metric_the_user_chose_and_says_which_failed(tmp_path):
    """TP1 against TP2 with 'norm' replicated: TP rank 1's copy was checked against rank 0's with
    allclose whatever --metric said. Under --metric rel_diff=1e-3, all-reduce noise of 1e-4
    between the ranks failed the diff (allclose); under --metric rel_diff=1e-9 --atol 1, a rank 1
    off by 0.5 (rel_diff 0.05) passed it (exit 0: allclose with atol 1). The check is the user's
    criterion now, and the reason names the criterion that failed."""
    x, y = torch.linspace(1, 2, 64), torch.ones(2)  # (y: a diff whose one row fails this way exits 2)
    base = manual_rank(tmp_path / "base", [{"norm": x, "y": y}])
    noisy = _replicated_tp2(tmp_path / "noisy", x * (1 + 1e-4), y)
    off = _replicated_tp2(tmp_path / "off", x + 0.5, y)
    assert fastdump.diff(base, noisy, metric=["rel_diff=1e-3"]).exit_code == 0
    allclose = row_of(fastdump.diff(base, noisy), "norm")  # (the default criterion still sees the noise)
    assert allclose["status"] == "fail" and "(exceeds allclose; max abs 0.0002)" in allclose["reason"]
    result = fastdump.diff(base, off, metric=["rel_diff=1e-9"], atol=1)
    row = row_of(result, "norm")
    assert result.exit_code == 1 and row["status"] == "fail"
    assert row["reason"].startswith("target: tp ranks 0 and 1 disagree on a tensor treated as replicated "
                                    "(exceeds rel_diff>1e-09; rel_diff ")
    # Every metric given must hold for the copies too: cosine passes (x + 0.5 points nearly the same
    # way) only at a loose threshold, rel_diff=1 always; cosine=1e-12 fails and is named alone.
    both = row_of(fastdump.diff(base, off, metric=["cosine=1e-12", "rel_diff=1"]), "norm")
    assert "(exceeds cosine>1e-12; cosine distance " in both["reason"] and "rel_diff>" not in both["reason"]
    assert fastdump.diff(base, off, metric=["cosine=1", "rel_diff=1"]).exit_code == 0


def test_rows_of_two_roles_go_pass_by_pass(tmp_path):
    """Execution order across roles: pass 0 of every role (the target first), then pass 1 (an
    EAGLE step runs the draft and the target in turn). The target's pass 0 diverges before the draft's pass 1 (a
    mutant ordering role by role named the draft's pass 1 first)."""
    x = torch.ones(2)
    base, target = tmp_path / "base", tmp_path / "target"
    for role in ("draft", "target"):
        manual_rank(base, [{"x": x}, {"x": x}], role=role)
    manual_rank(target, [{"x": x}, {"x": x + 1}], role="draft")
    manual_rank(target, [{"x": x + 1}, {"x": x}], role="target")
    result = fastdump.diff(base, target)
    assert [(r["pass"], r["role"]) for r in result.rows] == [(0, "target"), (0, "draft"), (1, "target"), (1, "draft")]
    first = result.first_divergence
    assert (first["role"], first["pass"], first["name"]) == ("target", 0, "x") and result.failed == 2


def test_at_one_pass_id_the_target_role_comes_before_the_draft(tmp_path):
    """A change that moves both roles' pass 0 (a kernel the target's prefill and the draft's first
    pass share): the draft was named the first divergence ('draft' sorts before 'target'), though
    the target's prefill runs first and feeds the draft its hidden states. Whatever order --role
    gives the roles in."""
    x = torch.ones(2)
    base, target = tmp_path / "base", tmp_path / "target"
    for role in ("draft", "target"):
        manual_rank(base, [{"x": x}], role=role)
        manual_rank(target, [{"x": x + 1}], role=role)
    for roles in (None, ["draft", "target"]):
        result = fastdump.diff(base, target, role=roles)
        assert [(r["role"], r["status"]) for r in result.rows] == [("target", "fail"), ("draft", "fail")]
        assert result.first_divergence["role"] == "target"
        assert result.lines()[0].startswith("first divergence: target rank 0 pass 0 x  ")


def test_rows_name_the_dp_replica_when_only_the_target_has_several(tmp_path, capsys):
    """The baseline holds DP replica 0 alone, the target replicas 0 and 1: the compared rows are
    replica 0's and say so, as the missing replica 1 is named (a mutant counting the baseline's
    replicas only left the rows without dp_rank, reading as the role's only replica)."""
    x = torch.ones(2)
    base, target = tmp_path / "base", tmp_path / "target"
    manual_rank(base, [{"x": x}], dp_rank=0, dp_size=2)
    for dp in range(2):
        manual_rank(target, [{"x": x + 1}], dp_rank=dp, dp_size=2)
    result = fastdump.diff(base, target)
    assert [(r["dp_rank"], r["name"], r["status"]) for r in result.rows] == [(0, "x", "fail")]
    assert result.lines()[0].startswith("first divergence: target rank 0 (dp 0) pass 0 x")
    assert [(m["kind"], m["only_in"], m["dp_rank"]) for m in result.missing] == [("rank", "target", 1)]


def test_sizes_missing_from_rank_json_are_counted_per_stage(tmp_path):
    """A rank.json with tp_rank and pp_rank but no sizes (an older or hand-made dump): tp_size is
    the number of ranks of its own stage, pp_size the number of stages. Two PP stages of one TP rank
    each are TP 1, PP 2, as the other side records, and pair rank by rank (a mutant counting every
    rank of the role made them TP 2 with a TP rank missing: exit 1 for identical dumps)."""
    x = torch.ones(2)
    base, target = tmp_path / "base", tmp_path / "target"
    for root in (base, target):
        for pp in range(2):
            manual_rank(root, [{f"layers.{pp}": x + pp}], tp_rank=0, tp_size=1, pp_rank=pp, pp_size=2)
    for directory in glob.glob(str(base / "target" / "*")):
        path = os.path.join(directory, "rank.json")
        info = json.loads(open(path).read())
        info["rank"] = {"tp_rank": info["rank"]["tp_rank"], "pp_rank": info["rank"]["pp_rank"]}
        with open(path, "w") as f:
            json.dump(info, f)
    result = fastdump.diff(base, target)
    assert result.exit_code == 0 and result.missing == [], result.lines()
    assert sorted((r["rank"], r["name"]) for r in result.rows) == [(0, "layers.0"), (1, "layers.1")]
