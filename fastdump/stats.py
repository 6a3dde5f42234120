"""Per-tensor statistics, shared by ``fastdump show`` (one tensor) and ``fastdump diff`` (two).

Everything is computed in float64, a chunk of elements at a time, so a tensor of any size and dtype
(bfloat16, float8, ...) never needs a second full-size float64 copy in memory. Non-finite values are
counted, never summed: one NaN must not turn every statistic into NaN.
"""

from __future__ import annotations

import itertools
import math
import warnings

import numpy as np
import torch

CHUNK_ELEMENTS = 1 << 20  # float64 elements per step: 8 MiB of scratch

# numpy does the arithmetic: on tensors of decode size (thousands of elements) each torch op costs
# far more in dispatch and thread hand-off than the work itself; numpy's cost is the work.
_NUMPY_NATIVE = {torch.float64, torch.float32, torch.float16, torch.int8, torch.int16, torch.int32, torch.int64,
                 torch.uint8, torch.bool}


def _chunk_to_float64(part) -> np.ndarray:
    # A signaling NaN (float32 0x7f800001, float16 0x7c01, bfloat16 0x7f81) widens to a quiet one, as
    # it should; numpy warns "invalid value encountered in cast" for it, which show and diff printed.
    with np.errstate(invalid="ignore"):
        if part.dtype in _NUMPY_NATIVE:
            return part.numpy().astype(np.float64)
        if part.dtype == torch.bfloat16:  # bfloat16 is the top half of a float32: widen the bits exactly
            bits = part.view(torch.int16).numpy().view(np.uint16).astype(np.uint32) << 16
            return bits.view(np.float32).astype(np.float64)
    return part.to(torch.float64).numpy()


def as_float64_chunks(tensor, complex_parts: bool = False):
    """Yield the flattened tensor as float64 numpy chunks (complex: interleaved real/imag parts;
    ``complex_parts``: a real tensor too, with imaginary parts 0, to compare with a complex one).

    Raises TypeError for types with no arithmetic (bits*, sub-byte ints, float4): callers compare
    those bit for bit instead.
    """
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    pairs = flat.is_complex() or complex_parts
    # Complex: converted a chunk at a time too (a whole-tensor complex128 copy is 16 bytes an
    # element), half as many elements a chunk, as each yields two floats.
    step = max(1, CHUNK_ELEMENTS // 2) if pairs else CHUNK_ELEMENTS
    for start in range(0, flat.numel(), step):
        part = flat[start:start + step]
        if pairs:
            part = torch.view_as_real(part.to(torch.complex128)).reshape(-1)
        try:
            yield _chunk_to_float64(part)
        except (RuntimeError, NotImplementedError, TypeError) as exc:
            raise TypeError(f"dtype {tensor.dtype} has no arithmetic ({exc})") from None


def _summarized(chunk: np.ndarray, is_complex: bool, pairs: bool) -> np.ndarray:
    """What a side's statistics are over, from its (re, im) chunk: a complex side's magnitudes, a
    real side's values (``fastdump show``'s statistics, never the interleaved parts)."""
    if not pairs:
        return chunk
    return np.hypot(chunk[0::2], chunk[1::2]) if is_complex else chunk[0::2]


_ARITHMETIC: dict = {}


def has_arithmetic(dtype) -> bool:
    known = _ARITHMETIC.get(dtype)
    if known is None:
        try:
            with warnings.catch_warnings():  # (complex: "casting complex values to real discards ...")
                warnings.simplefilter("ignore")
                torch.zeros(1, dtype=dtype).to(torch.float64)
            known = True
        except (RuntimeError, NotImplementedError, TypeError):
            known = False
        _ARITHMETIC[dtype] = known
    return known


def _scaled(values: np.ndarray, exponent: int) -> np.ndarray:
    """values / 2**exponent, exact but where it underflows (np.ldexp, ten times slower, only where
    2**-exponent is not a normal float64)."""
    if -1022 <= exponent <= 1022:
        return values * math.ldexp(1.0, -exponent)
    return np.ldexp(values, -exponent)


class Summary:
    """min / max / mean / std (population) over finite values, NaN and Inf counts; fed by chunks.

    Means and variances merge chunk by chunk (Chan et al.), which stays accurate where a running
    sum of squares would cancel. They are kept divided by 2**scale (the largest magnitude's
    exponent so far): float64 values above 1e154 square past the float64 range, and a sum of values
    near 1e308 overflows (mean inf, std inf or NaN).
    """

    def __init__(self):
        self.count = 0
        self.scale = 0
        self.mean = 0.0  # / 2**scale
        self.m2 = 0.0  # / 2**(2*scale)
        self.min = math.inf
        self.max = -math.inf
        self.nan = 0
        self.inf = 0

    def add(self, chunk: np.ndarray) -> None:
        finite_mask = np.isfinite(chunk)
        n = int(np.count_nonzero(finite_mask))
        if n != chunk.size:
            nan = int(np.count_nonzero(np.isnan(chunk)))
            self.nan += nan
            self.inf += chunk.size - n - nan
            chunk = chunk[finite_mask]
        if n == 0:
            return
        low, high = float(chunk.min()), float(chunk.max())
        peak = max(-low, high)
        scale = math.frexp(peak)[1] if peak > 0 else self.scale
        if self.count == 0:
            self.scale = scale
        elif scale > self.scale:
            self.mean = math.ldexp(self.mean, self.scale - scale)
            self.m2 = math.ldexp(self.m2, 2 * (self.scale - scale))
            self.scale = scale
        chunk = _scaled(chunk, self.scale)  # |values| < 1
        mean = float(chunk.mean())
        centered = chunk - mean
        m2 = float(np.dot(centered, centered))
        total = self.count + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.count * n / total
        self.count = total
        self.min = min(self.min, low)
        self.max = max(self.max, high)

    def as_dict(self) -> dict:
        if self.count == 0:
            return {"min": None, "max": None, "mean": None, "std": None, "nan": self.nan, "inf": self.inf}
        return {"min": self.min, "max": self.max, "mean": math.ldexp(self.mean, self.scale),
                "std": math.ldexp(math.sqrt(self.m2 / self.count), self.scale), "nan": self.nan, "inf": self.inf}


def tensor_stats(tensor):
    """Summary statistics of one tensor (see ``Summary``); complex tensors by magnitude.

    Returns None for types with no arithmetic (bits*, sub-byte ints, float4): their raw bits are
    stored but have no values to summarize.
    """
    summary = Summary()
    try:
        for chunk in as_float64_chunks(tensor):
            summary.add(_summarized(chunk, tensor.is_complex(), tensor.is_complex()))
    except TypeError:
        return None
    return summary.as_dict()


def compare(baseline, target, atol: float, rtol: float) -> dict:
    """Error statistics of ``target`` against ``baseline`` (same number of elements).

    ``mismatch``: fraction of elements breaking ``|target - baseline| <= atol + rtol * |baseline|``;
    NaN equals NaN and an infinity equals the same infinity (a NaN or Inf on one side only is a
    mismatch). Integer pairs take their differences exactly (2**53 vs 2**53+1 differ); a complex
    element counts once. ``rel_diff = 1 - 2*sum(xy) / sum(x^2 + y^2)``, taken as
    ``sum((x-y)^2) / sum(x^2 + y^2)`` (no cancellation), ``cosine`` and ``cosine_distance`` (1 -
    cosine, kept where it is under float64's precision at 1: see ``_cosine``) are over the elements finite
    on both sides, summed scaled (no overflow), exactly 0 and 1 when those elements are all equal.
    ``max_rel`` is ``max |a-b| / |b|`` (inf where b is 0 and a is not); complex elements' ``max_abs``
    and ``max_rel`` are of magnitudes, over elements finite whole. Types with no arithmetic
    are compared bit for bit (``bitwise`` True, metrics None).
    """
    numel = baseline.numel()
    if numel != target.numel():
        raise ValueError(f"{baseline.numel()} vs {target.numel()} elements")
    if not (has_arithmetic(baseline.dtype) and has_arithmetic(target.dtype)):
        equal = baseline.dtype == target.dtype and torch.equal(
            baseline.reshape(-1).view(torch.uint8), target.reshape(-1).view(torch.uint8))
        return {"numel": numel, "bitwise": True, "max_abs": None, "max_rel": None, "rel_diff": None,
                "cosine": None, "cosine_distance": None, "mismatch": 0.0 if equal else 1.0, "mismatches": 0 if equal else numel,
                "nonfinite_mismatches": 0, "baseline": None, "target": None}
    if _same_values(baseline, target, atol, rtol):
        return _compare_identical(baseline)
    return _compare_values(baseline, target, atol, rtol)


def _same_values(baseline, target, atol: float, rtol: float) -> bool:
    """Whether the two sides are one real dtype with the same bytes (a rerun that reproduced its
    baseline: what most tensors of a passing diff are), and the tolerances not negative: then
    ``_compare_values`` finds no error and both sides' statistics are one side's."""
    return (baseline.dtype == target.dtype and not baseline.is_complex() and atol >= 0 and rtol >= 0
            and baseline.device.type == target.device.type == "cpu"
            and torch.equal(baseline.detach().reshape(-1).view(torch.uint8),
                            target.detach().reshape(-1).view(torch.uint8)))


def _compare_identical(tensor) -> dict:
    """What ``_compare_values`` returns for two real tensors of one dtype and the same bytes, with
    tolerances >= 0, without its ~40 array operations per chunk (a diff of small tensors spent
    most of its time there): every element equal (NaN to NaN, an infinity to itself), so no
    mismatch, max_abs and max_rel 0, distance exactly 0 (its ``equal``); each side's statistics are
    the one tensor's (the same chunks through the same ``Summary``)."""
    summary = Summary()
    for chunk in as_float64_chunks(tensor):
        summary.add(chunk)
    numel = tensor.numel()
    return {"numel": numel, "bitwise": False, "max_abs": 0.0, "max_rel": 0.0,
            "rel_diff": 0.0, "cosine": 1.0, "cosine_distance": 0.0,
            "mismatch": 0.0, "mismatches": 0, "nonfinite_mismatches": 0,
            "baseline": summary.as_dict(), "target": summary.as_dict()}


def _compare_values(baseline, target, atol: float, rtol: float) -> dict:
    """``compare`` of two tensors with arithmetic, element by element, a chunk at a time."""
    numel = baseline.numel()
    exact = _exact_int_dtype(baseline.dtype, target.dtype)
    ints = zip(_native_chunks(baseline, exact), _native_chunks(target, exact)) if exact else itertools.repeat(None)
    pairs = 2 if baseline.is_complex() or target.is_complex() else 1  # a complex element is 2 parts
    # Sums of x / 2**scale: huge float64 values must not overflow them. Each side has its own
    # scale (a common one underflowed the smaller side's squares to 0: cosine 0 for vectors
    # pointing the same way); sdd, of the differences, is at the larger of the two.
    sxy = sxx = syy = sdd = sdb = 0.0
    scale_a = scale_b = scale_d = -1100
    max_abs = max_rel = 0.0
    mismatches = nonfinite_mismatches = 0
    equal = True  # every element finite on both sides is equal: exact 0 distance, whatever the rounding
    base_summary, target_summary = Summary(), Summary()
    # A complex side against a real one: both as (real, imag) pairs, the real side's imag 0. (Each
    # alone yields one float per element on one side and two on the other: zip compared the wrong
    # parts, and left out the rest.)
    chunks = (as_float64_chunks(baseline, complex_parts=pairs == 2), as_float64_chunks(target, complex_parts=pairs == 2))
    for b, a, raw in zip(*chunks, ints):
        base_summary.add(_summarized(b, baseline.is_complex(), pairs == 2))
        target_summary.add(_summarized(a, target.is_complex(), pairs == 2))
        finite = np.isfinite(a) & np.isfinite(b)
        if raw is not None:  # integers: the exact difference, never rounded to 0 above 2**53
            rb, ra = raw
            err = (np.maximum(ra, rb).astype(np.uint64) - np.minimum(ra, rb).astype(np.uint64)).astype(np.float64)
        else:
            with np.errstate(invalid="ignore", over="ignore"):
                err = np.abs(a - b)
        abs_b = np.abs(b)
        # Non-finite elements: equal when identical (NaN==NaN, +inf==+inf), otherwise a mismatch.
        odd = ~finite & ~((np.isnan(a) & np.isnan(b)) | (a == b))
        bad = odd | (finite & (err > atol + rtol * abs_b))
        if pairs == 2:  # one complex element counts once, whichever of its parts differ
            odd, bad = odd.reshape(-1, 2).any(axis=1), bad.reshape(-1, 2).any(axis=1)
            # inf+1j against inf+2j differs in a finite part, but its |a - b| is not finite: left
            # out of max_abs like the others, it must be counted with them (it read max_abs 0).
            odd |= bad & ~finite.reshape(-1, 2).all(axis=1)
        nonfinite_mismatches += int(np.count_nonzero(odd))
        mismatches += int(np.count_nonzero(bad))
        if pairs == 2:  # max_abs, max_rel of complex elements: on magnitudes, elements finite whole
            whole = finite.reshape(-1, 2).all(axis=1)
            complex_abs, complex_rel = _complex_max_abs_rel(err.reshape(-1, 2)[whole], b.reshape(-1, 2)[whole])
        if not finite.all():
            a, b, err, abs_b = a[finite], b[finite], err[finite], abs_b[finite]
        if a.size == 0:
            continue
        chunk_max = float(err.max())
        equal = equal and chunk_max == 0
        if pairs == 2:
            max_abs, max_rel = max(max_abs, complex_abs), max(max_rel, complex_rel)
        else:
            max_abs = max(max_abs, chunk_max)
            with np.errstate(divide="ignore", invalid="ignore"):
                rel = np.where(err == 0, 0.0, err / abs_b)  # x/0 -> inf, 0/0 -> 0
            max_rel = max(max_rel, float(rel.max()))
        peak_a, peak_b = float(np.abs(a).max()), float(abs_b.max())
        new_a = max(scale_a, math.frexp(peak_a)[1]) if peak_a > 0 else scale_a  # (frexp(0) is 0)
        new_b = max(scale_b, math.frexp(peak_b)[1]) if peak_b > 0 else scale_b
        new_d = max(new_a, new_b)
        sxx = math.ldexp(sxx, 2 * (scale_a - new_a))
        syy = math.ldexp(syy, 2 * (scale_b - new_b))
        sxy = math.ldexp(sxy, scale_a - new_a + scale_b - new_b)
        sdd = math.ldexp(sdd, 2 * (scale_d - new_d))
        sdb = math.ldexp(sdb, 2 * (scale_d - new_d))
        scale_a, scale_b, scale_d = new_a, new_b, new_d
        # a - b, signed (integers: exact, 2**53 and 2**53+1 are one float64); where it overflowed
        # (1e308 against -1e308), the difference of the scaled values.
        if chunk_max < math.inf:
            d = _scaled(np.where(rb > ra if raw is not None else b > a, -err, err), scale_d)
        else:
            d = _scaled(a, scale_d) - _scaled(b, scale_d)
        b_at_d = None if scale_b == scale_d else _scaled(b, scale_d)  # b at the differences' scale
        a, b = _scaled(a, scale_a), _scaled(b, scale_b)
        sxy += float(np.dot(a, b))
        sxx += float(np.dot(a, a))
        syy += float(np.dot(b, b))
        sdd += float(np.dot(d, d))
        sdb += float(np.dot(d, b if b_at_d is None else b_at_d))
    # sum(x^2 + y^2) at the differences' scale
    energy = math.ldexp(sxx, 2 * (scale_a - scale_d)) + math.ldexp(syy, 2 * (scale_b - scale_d))
    if equal:
        rel_diff, cosine, cosine_distance = 0.0, 1.0, 0.0
    else:
        rel_diff = 0.0 if energy == 0 else sdd / energy
        cosine, cosine_distance = _cosine(sxx, syy, sxy, sdd, sdb, scale_a - scale_d, scale_b - scale_d)
    return {"numel": numel, "bitwise": False, "max_abs": max_abs, "max_rel": max_rel,
            "rel_diff": rel_diff, "cosine": cosine, "cosine_distance": cosine_distance,
            "mismatch": mismatches / numel if numel else 0.0, "mismatches": mismatches,
            "nonfinite_mismatches": nonfinite_mismatches,
            "baseline": base_summary.as_dict(), "target": target_summary.as_dict()}


def _cosine(sxx, syy, sxy, sdd, sdb, shift_a, shift_b):
    """(cosine, 1 - cosine) of sides with sums Σa², Σb², Σab (each side at its own scale) and
    Σ(a-b)², Σ(a-b)b (at the larger scale, a and b there 2**shift_a, 2**shift_b times theirs).

    1 - Σab/(|a||b|) rounds to 0 where it is under 1e-16: a tensor one ulp off passed cosine=0.
    Where the norms are close it is taken as (Σ(a-b)² - (|a|-|b|)²) / (2|a||b|), with |a|-|b| =
    (|a|²-|b|²)/(|a|+|b|) and |a|²-|b|² = 2Σ(a-b)b + Σ(a-b)²: no term there cancels (norms far
    apart would: (|a|-|b|)² ~ Σ(a-b)²; there the plain cosine loses nothing)."""
    norms = math.sqrt(sxx * syy)
    if norms == 0:
        cosine = 1.0 if sxx == syy == 0 else 0.0
        return cosine, 1.0 - cosine
    cosine = min(1.0, max(-1.0, sxy / norms))
    norm_a, norm_b = math.ldexp(math.sqrt(sxx), shift_a), math.ldexp(math.sqrt(syy), shift_b)
    if norm_a == 0 or norm_b == 0 or (norm_a - norm_b) ** 2 > norm_a * norm_b:
        return cosine, 1.0 - cosine
    gap = (2 * sdb + sdd) / (norm_a + norm_b)  # |a| - |b|
    distance = min(2.0, max(0.0, (sdd - gap * gap) / (2 * norm_a * norm_b)))
    return 1.0 - distance, distance


def _complex_max_abs_rel(err: np.ndarray, b: np.ndarray):
    """(max |a-b|, max |a-b| / |b|) of complex elements, from rows (re, im) of |a-b|'s parts and of
    b: on magnitudes, as the statistics (per part, 1+1j against 1+0j read max_rel inf, not 1). Each
    magnitude is its larger part times the hypot of the parts over it: |b| of finite parts near
    1e308 did not overflow, nor the ratio of two magnitudes near the ends of the range."""
    if err.size == 0:
        return 0.0, 0.0
    b = np.abs(b)
    top_e, top_b = err.max(axis=1), b.max(axis=1)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
        unit_e = np.hypot(err[:, 0] / top_e, err[:, 1] / top_e)  # in [1, sqrt 2]: NaN where top_e is 0 or inf
        unit_b = np.hypot(b[:, 0] / top_b, b[:, 1] / top_b)
        magnitude = top_e * unit_e
        rel = (top_e / top_b) * (unit_e / unit_b)
    magnitude = np.where(top_e == 0, 0.0, np.where(np.isinf(top_e), np.inf, magnitude))
    rel = np.where(top_e == 0, 0.0, np.where(np.isinf(top_e) | (top_b == 0), np.inf, rel))  # x/0 -> inf, 0/0 -> 0
    return float(magnitude.max()), float(rel.max())


# Integer types that int64 holds exactly (uint16/uint32 exist in newer torch only).
_INT64_SAFE = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64} | \
    {getattr(torch, name) for name in ("uint16", "uint32") if hasattr(torch, name)}


def _exact_int_dtype(*dtypes):
    """The numpy type that holds both integer dtypes exactly; None (compare in float64) when either
    is not an integer, or for uint64 against another type."""
    if all(d in _INT64_SAFE for d in dtypes):
        return np.int64
    if all(d == getattr(torch, "uint64", None) for d in dtypes):
        return np.uint64
    return None


def _native_chunks(tensor, np_dtype):
    flat = tensor.detach().reshape(-1).cpu()
    for start in range(0, flat.numel(), CHUNK_ELEMENTS):
        yield flat[start:start + CHUNK_ELEMENTS].numpy().astype(np_dtype)
