"""Per-tensor statistics, shared by ``fastdump show`` (one tensor) and ``fastdump diff`` (two).

Everything is computed in float64, a chunk of elements at a time, so a tensor of any size and dtype
(bfloat16, float8, ...) never needs a second full-size float64 copy in memory. Non-finite values are
counted, never summed: one NaN must not turn every statistic into NaN.
"""

from __future__ import annotations

import math

import torch

CHUNK_ELEMENTS = 1 << 20  # float64 elements per step: 8 MiB of scratch


def as_float64_chunks(tensor):
    """Yield the flattened tensor as float64 chunks (complex: interleaved real/imag parts).

    Raises TypeError for types with no arithmetic (bits*, sub-byte ints, float4): callers compare
    those bit for bit instead.
    """
    flat = tensor.reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat.to(torch.complex128)).reshape(-1)
    for start in range(0, flat.numel(), CHUNK_ELEMENTS):
        part = flat[start:start + CHUNK_ELEMENTS]
        try:
            yield part.to(torch.float64)
        except (RuntimeError, NotImplementedError, TypeError) as exc:
            raise TypeError(f"dtype {tensor.dtype} has no arithmetic ({exc})") from None


def has_arithmetic(dtype) -> bool:
    try:
        torch.zeros(1, dtype=dtype).to(torch.float64)
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


class Summary:
    """min / max / mean / std (population) over finite values, NaN and Inf counts; fed by chunks.

    Means and variances merge chunk by chunk (Chan et al.), which stays accurate where a running
    sum of squares would cancel.
    """

    def __init__(self):
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0
        self.min = math.inf
        self.max = -math.inf
        self.nan = 0
        self.inf = 0

    def add(self, chunk: torch.Tensor) -> None:
        finite_mask = torch.isfinite(chunk)
        nan = int(torch.isnan(chunk).sum())
        self.nan += nan
        self.inf += chunk.numel() - int(finite_mask.sum()) - nan
        finite = chunk[finite_mask]
        n = finite.numel()
        if n == 0:
            return
        mean = float(finite.mean())
        m2 = float(((finite - mean) ** 2).sum())
        total = self.count + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.count * n / total
        self.count = total
        self.min = min(self.min, float(finite.min()))
        self.max = max(self.max, float(finite.max()))

    def as_dict(self) -> dict:
        if self.count == 0:
            return {"min": None, "max": None, "mean": None, "std": None, "nan": self.nan, "inf": self.inf}
        return {"min": self.min, "max": self.max, "mean": self.mean, "std": math.sqrt(self.m2 / self.count),
                "nan": self.nan, "inf": self.inf}


def tensor_stats(tensor):
    """Summary statistics of one tensor (see ``Summary``); complex tensors by magnitude.

    Returns None for types with no arithmetic (bits*, sub-byte ints, float4): their raw bits are
    stored but have no values to summarize.
    """
    if tensor.is_complex():
        tensor = tensor.to(torch.complex128).abs()
    summary = Summary()
    try:
        for chunk in as_float64_chunks(tensor):
            summary.add(chunk)
    except TypeError:
        return None
    return summary.as_dict()


def compare(baseline, target, atol: float, rtol: float) -> dict:
    """Error statistics of ``target`` against ``baseline`` (same number of elements).

    ``mismatch``: fraction of elements breaking ``|target - baseline| <= atol + rtol * |baseline|``;
    NaN equals NaN and an infinity equals the same infinity (a NaN or Inf on one side only is a
    mismatch). ``rel_diff = 1 - 2*sum(xy) / sum(x^2 + y^2)`` and ``cosine`` are over the elements
    finite on both sides. ``max_rel`` is ``max |a-b| / |b|`` (inf where b is 0 and a is not).
    Types with no arithmetic are compared bit for bit (``bitwise`` True, metrics None).
    """
    numel = baseline.numel()
    if numel != target.numel():
        raise ValueError(f"{baseline.numel()} vs {target.numel()} elements")
    if not (has_arithmetic(baseline.dtype) and has_arithmetic(target.dtype)):
        equal = baseline.dtype == target.dtype and torch.equal(
            baseline.reshape(-1).view(torch.uint8), target.reshape(-1).view(torch.uint8))
        return {"numel": numel, "bitwise": True, "max_abs": None, "max_rel": None, "rel_diff": None,
                "cosine": None, "mismatch": 0.0 if equal else 1.0, "mismatches": 0 if equal else numel,
                "nonfinite_mismatches": 0, "baseline": None, "target": None}
    sxy = sxx = syy = 0.0
    max_abs = max_rel = 0.0
    mismatches = nonfinite_mismatches = 0
    base_summary, target_summary = Summary(), Summary()
    for b, a in zip(as_float64_chunks(baseline), as_float64_chunks(target)):
        base_summary.add(b)
        target_summary.add(a)
        finite = torch.isfinite(a) & torch.isfinite(b)
        # Non-finite elements: equal when identical (NaN==NaN, +inf==+inf), otherwise a mismatch.
        odd = ~finite
        if bool(odd.any()):
            same = (torch.isnan(a) & torch.isnan(b)) | (a == b)
            bad = int((odd & ~same).sum())
            nonfinite_mismatches += bad
            mismatches += bad
        af, bf = a[finite], b[finite]
        if af.numel() == 0:
            continue
        err = (af - bf).abs()
        abs_b = bf.abs()
        mismatches += int((err > atol + rtol * abs_b).sum())
        max_abs = max(max_abs, float(err.max()))
        rel = torch.where(err == 0, torch.zeros_like(err), err / abs_b)  # x/0 -> inf, 0/0 -> 0
        max_rel = max(max_rel, float(rel.max()))
        sxy += float((af * bf).sum())
        sxx += float((af * af).sum())
        syy += float((bf * bf).sum())
    energy = sxx + syy
    rel_diff = 0.0 if energy == 0 else 1.0 - 2.0 * sxy / energy
    norms = math.sqrt(sxx) * math.sqrt(syy)
    cosine = (1.0 if sxx == syy == 0 else 0.0) if norms == 0 else sxy / norms
    return {"numel": numel, "bitwise": False, "max_abs": max_abs, "max_rel": max_rel,
            "rel_diff": max(rel_diff, 0.0), "cosine": cosine,
            "mismatch": mismatches / numel if numel else 0.0, "mismatches": mismatches,
            "nonfinite_mismatches": nonfinite_mismatches,
            "baseline": base_summary.as_dict(), "target": target_summary.as_dict()}


def allclose_ok(result: dict) -> bool:
    return result["mismatches"] == 0
