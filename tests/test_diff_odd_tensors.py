"""``fastdump diff`` and ``fastdump show`` on odd tensors, with every number checked against a
reference computed here with torch in float64 (or exactly in integers)."""

import math

import pytest

import torch

import fastdump
from fastdump import cli

from test_diff_missing import crafted

INF = float("inf")


def rows_by_name(result):
    return {row["name"]: row for row in result.rows}


def test_complex_element_with_an_infinite_part_that_differs_is_counted_non_finite(tmp_path):
    """inf+1j against inf+2j: the element fails (its imaginary parts differ) but |a - b| is NaN, so
    max_abs left it out and read 0 with no word why; it is now counted like a NaN on one side."""
    base = torch.tensor([complex(INF, 1), 1 + 1j, 2 + 0j], dtype=torch.complex128)
    target = torch.tensor([complex(INF, 2), 1 + 1j, 2 + 0.5j], dtype=torch.complex128)
    result = fastdump.diff(crafted(tmp_path / "b", {0: {"c": base}}), crafted(tmp_path / "t", {0: {"c": target}}))
    (row,) = result.rows
    finite = torch.isfinite(base) & torch.isfinite(target)
    diff = (target - base)[finite]
    assert row["max_abs"] == diff.abs().max().item() == 0.5
    assert row["max_rel"] == ((target - base).abs() / base.abs())[finite].max().item() == 0.25
    assert (row["status"], row["mismatches"], row["numel"]) == ("fail", 2, 3)
    assert row["reason"] == "exceeds allclose; 1 element(s) with a NaN or infinite part, left out of max_abs and max_rel"
    assert result.exit_code == 1


def test_odd_tensors_compare_with_exact_numbers(tmp_path):
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(4, 6, generator=gen, dtype=torch.float64).float()
    base = {"zero_d": torch.tensor(3.5), "empty": torch.zeros(0, 3), "bool": torch.tensor([True, False, True]),
            "c64": torch.tensor([1 + 2j, -3j, 0j], dtype=torch.complex64),
            "f8": torch.tensor([0.5, -1.0, 448.0]).to(torch.float8_e4m3fn), "noncontig": wide.t(),
            "expanded": torch.arange(3.).expand(4, 3), "u64": torch.tensor([0, 2 ** 63 + 5], dtype=torch.uint64),
            "i64": torch.tensor([-2 ** 63, 2 ** 63 - 1])}
    target = dict(base, zero_d=torch.tensor(3.75), bool=torch.tensor([True, True, True]),
                  c64=torch.tensor([1 + 2.5j, -3j, 0j], dtype=torch.complex64),
                  f8=torch.tensor([0.5, -1.0, 416.0]).to(torch.float8_e4m3fn), noncontig=(wide + 1e-3).t(),
                  expanded=torch.arange(1., 4.).expand(4, 3), u64=torch.tensor([0, 2 ** 63 + 6], dtype=torch.uint64),
                  i64=torch.tensor([-2 ** 63 + 1, 2 ** 63 - 1]))
    result = fastdump.diff(crafted(tmp_path / "b", {0: base}), crafted(tmp_path / "t", {0: target}), atol=0, rtol=0)
    rows = rows_by_name(result)
    for name in base:
        b, t = base[name], target[name]
        row = rows[name]
        assert row["shape"] == list(t.shape), name
        if b.dtype in (torch.uint64, torch.int64):  # exactly, in Python integers
            diffs = [abs(int(x) - int(y)) for x, y in zip(t.tolist(), b.tolist())]
            assert row["max_abs"] == float(max(diffs)) and row["mismatches"] == sum(d > 0 for d in diffs), name
            continue
        wide_b = b.to(torch.complex128 if b.is_complex() else torch.float64)
        wide_t = t.to(wide_b.dtype)
        err = (wide_t - wide_b).abs()
        assert row["mismatches"] == int((err > 0).sum()), name
        if b.numel() == 0:
            assert (row["max_abs"], row["status"]) == (0.0, "ok")
            continue
        assert math.isclose(row["max_abs"], err.max().item(), rel_tol=1e-15), name
        energy = (wide_t.abs() ** 2 + wide_b.abs() ** 2).sum().item()
        assert math.isclose(row["rel_diff"], (err ** 2).sum().item() / energy, rel_tol=1e-12), name
    assert rows["u64"]["max_abs"] == 1.0 and rows["i64"]["max_abs"] == 1.0
    assert rows["f8"]["max_abs"] == 32.0 and rows["bool"]["max_rel"] == INF


def test_an_undefined_distance_fails_its_metric_never_passes_it():
    """stats.compare gives no NaN distance today; should one come (a metric added, a change in
    its sums), rel_diff and cosine must fail it: 'nan > threshold' is False, which passed the row."""
    from fastdump import compare

    options = compare.Options(metric=["rel_diff=0.1", "cosine=0.1"])
    result = {"bitwise": False, "mismatches": 1, "nonfinite_mismatches": 0,
              "rel_diff": math.nan, "cosine_distance": math.nan}
    assert compare._verdict(result, options) == ["rel_diff>0.1", "cosine>0.1"]
    result.update(rel_diff=0.1, cosine_distance=0.0)  # (at the threshold: passes)
    assert compare._verdict(result, options) == []


@pytest.mark.parametrize("tensor", [
    torch.tensor([1.0, -0.0, 0.0, float("nan"), float("inf"), float("-inf"), 1e308, -1e-320, 3.5]),
    torch.tensor([float("nan"), float("inf")]),  # nothing finite: no sums at all
    torch.tensor([0.0, 0.0]),
    torch.randn(7, 5, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16),
    torch.randn(300, generator=torch.Generator().manual_seed(4)).to(torch.float16),
    torch.tensor(2.5, dtype=torch.float64),
    torch.tensor([2**53, 2**53 + 1, -7, 0], dtype=torch.int64),
    torch.tensor([True, False, True]),
    torch.tensor([3, 250, 0], dtype=torch.uint8),
    torch.empty(0, 4),
    torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
])
def test_identical_sides_compare_as_the_element_by_element_path_says(tensor):
    """Two sides of one dtype with the same bytes take a short path (most tensors of a passing diff:
    ~40 array operations per tensor were most of a diff of small tensors); it must return exactly
    what the element-by-element comparison returns, NaN, infinities and -0.0 included, and an
    element that differs by one bit must still go the long way."""
    from fastdump import stats

    copy = tensor.clone()
    assert stats.compare(tensor, copy, 1e-5, 1e-5) == stats._compare_values(tensor, copy, 1e-5, 1e-5)
    assert stats.compare(tensor, copy, 0.0, 0.0) == stats._compare_values(tensor, copy, 0.0, 0.0)
    if tensor.numel() and tensor.dtype.is_floating_point:  # its first element's last bit flipped
        other = tensor.clone().reshape(-1)
        other.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])[0] ^= 1
        result = stats.compare(tensor.reshape(-1), other, 0.0, 0.0)
        assert result == stats._compare_values(tensor.reshape(-1), other, 0.0, 0.0)
        assert result["mismatches"] == (1 if torch.isfinite(tensor.reshape(-1)[0]) else 0)  # (NaN is NaN)
