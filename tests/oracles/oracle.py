"""Float64 numpy oracle for the fused op and the ulp-based error measure, independent of
jax_fusedar's own reference (no JAX here).

The kernel rounds twice before the norm (the all-reduce sum to T, then sum + residual to
T), so errors are measured in ulps of the *intermediate* magnitudes (docs/numerics.md):

  residual_out: |r - r64| / ulp_T(|s64| + |res|)                   expect <= 1
  norm_out:     |y - y64| / (ulp_T(|s64| + |res|) * inv64 * |wb + g| + ulp_T(|y64|))
  allreduce:    |s - s64| / ulp_T(|s64|)                            expect <= 1

The 1-ulp bounds assume an exact fp32 accumulation, as for 2 ranks of 16-bit values; the
``*_error_bound`` functions give the bounds that hold at every world size and for both
accumulations (docs/numerics.md derives them).
"""

from __future__ import annotations

import numpy as np

# (explicit mantissa bits, smallest normal exponent) of each dtype
_FORMATS = {"bfloat16": (7, -126), "float16": (10, -14), "float32": (23, -126)}


def ulp(magnitude, dtype_name: str) -> np.ndarray:
    """The spacing of dtype_name's numbers at |magnitude| (float64), subnormals included."""
    mant, emin = _FORMATS[dtype_name]
    a = np.abs(np.asarray(magnitude, dtype=np.float64))
    e = np.floor(np.log2(np.maximum(a, np.finfo(np.float64).tiny)))
    return np.exp2(np.maximum(e, emin) - mant)


def unit_roundoff(dtype_name: str) -> float:
    """Largest relative error of one round-to-nearest into dtype_name (normal range)."""
    return 2.0 ** -(_FORMATS[dtype_name][0] + 1)


def rounding_floor(dtype_name: str) -> float:
    """Largest absolute error of one rounding below the normal range: half the subnormal
    spacing for the 16-bit types, the whole normal threshold for float32 (the kernels flush
    to zero)."""
    mant, emin = _FORMATS[dtype_name]
    return 2.0**emin if dtype_name == "float32" else 2.0 ** (emin - mant - 1)


def rounding_step(dtype_name: str):
    """(relative, absolute) bound of the kernel's rounding of an exact a + b: the sum in
    float32, then (16-bit types) converted to dtype_name, two roundings."""
    u32, h32 = unit_roundoff("float32"), rounding_floor("float32")
    if dtype_name == "float32":
        return u32, h32
    u, h = unit_roundoff(dtype_name), rounding_floor(dtype_name)
    return u + u32 + u * u32, h + h32 * (1.0 + u)


def sum_error_bound(xs, dtype_name: str, *, fp32_acc: bool) -> np.ndarray:
    """Per element, a bound on |allreduce_out - sum_r x_r| for the kernel's all-reduce of the
    rank inputs ``xs`` (rank order, values in dtype_name). Without fp32_acc, rank order with
    every addition rounded: E_0 = 0, E_k = E_{k-1} (1 + d) + d |s_k| + h over the partial
    sums s_k ((d, h) = ``rounding_step``), so cancelling partial sums cost more. With
    fp32_acc (or float32) in any order: F = gamma_{N-1} sum_r |x_r| + (N - 1) h_32, then one
    rounding of the total, E = F + u_T (|s| + F) + h_T (docs/numerics.md)."""
    parts = [np.asarray(x, np.float64) for x in xs]
    s = np.sum(parts, axis=0)
    n = len(parts)
    if fp32_acc or dtype_name == "float32":
        u32, h32 = unit_roundoff("float32"), rounding_floor("float32")
        gamma = (n - 1) * u32 / (1.0 - (n - 1) * u32)
        bound = gamma * np.sum(np.abs(parts), axis=0) + (n - 1) * h32
        if dtype_name != "float32":
            bound = (
                bound + unit_roundoff(dtype_name) * (np.abs(s) + bound) + rounding_floor(dtype_name)
            )
        return bound
    d, h = rounding_step(dtype_name)
    partial = parts[0].copy()
    bound = np.zeros_like(partial)
    for x in parts[1:]:
        partial = partial + x
        bound = bound * (1.0 + d) + d * np.abs(partial) + h
    return bound


def psum_error_bound(xs, dtype_name: str) -> np.ndarray:
    """Per element, a bound on |allreduce_out - sum_r x_r| for XLA's all-reduce in the inputs'
    dtype (the "xla" fallback), which fixes neither the order nor the tree of the additions
    nor whether they round to dtype_name: over any tree, with S = sum_r |x_r|,
    E = ((1 + d)^(N-1) - (1 + d)) (S + h / d) + d |s| + h, or the float32 sum rounded once
    (``sum_error_bound(fp32_acc=True)``), whichever is larger (docs/numerics.md)."""
    parts = [np.asarray(x, np.float64) for x in xs]
    s = np.sum(parts, axis=0)
    n = len(parts)
    once = sum_error_bound(xs, dtype_name, fp32_acc=True)
    if dtype_name == "float32":
        return once
    d, h = rounding_step(dtype_name)
    total = np.sum(np.abs(parts), axis=0)
    tree = ((1.0 + d) ** (n - 1) - (1.0 + d)) * (total + h / d) + d * np.abs(s) + h
    return np.maximum(tree, once)


def residual_error_bound(
    xs, residual, dtype_name: str, *, fp32_acc: bool = True, sum_bound=None
) -> np.ndarray:
    """Per element, a bound on |residual_out - (sum_r x_r + residual)|: the all-reduce's bound
    E (``sum_bound`` when given) through one more rounded addition, E (1 + d) + d |r| + h."""
    e = sum_error_bound(xs, dtype_name, fp32_acc=fp32_acc) if sum_bound is None else sum_bound
    r = np.sum([np.asarray(x, np.float64) for x in xs], axis=0) + np.asarray(residual, np.float64)
    d, h = rounding_step(dtype_name)
    return e * (1.0 + d) + d * np.abs(r) + h


def bound_ratio(out, exact, bound) -> float:
    """max |out - exact| / bound: at most 1 where the bound holds (NaN propagates)."""
    return float(np.max(np.abs(np.asarray(out, np.float64) - exact) / bound))


# norm_out against the exact RMSNorm of the kernel's own residual_out, in ulps of that value:
# the output rounding is half an ulp, and the float32 arithmetic before it (a sum of squares
# reduced in about 18 float32 steps per row, fast-math rsqrt, three products) adds a relative
# error near 14 * 2^-24: negligible next to a 16-bit ulp (the bound 1 also covers a result
# that crosses a power of two), about 14 float32 ulps for float32 outputs.
NORM_GIVEN_RESIDUAL_ULPS = {"bfloat16": 1.0, "float16": 1.0, "float32": 16.0}


def norm_error_given_residual_ulps(
    norm_out, residual_out, gamma, *, rms_eps: float, weight_bias: float, dtype_name: str
) -> float:
    """max |norm_out - N(residual_out)| / ulp_T(|N(residual_out)|), N the exact RMSNorm of the
    kernel's own residual_out: the norm's own error, apart from the accumulation's."""
    r = np.asarray(residual_out, np.float64)
    inv = 1.0 / np.sqrt(np.mean(r * r, axis=-1, keepdims=True) + rms_eps)
    y = r * inv * (weight_bias + np.asarray(gamma, np.float64))
    return float(np.max(np.abs(np.asarray(norm_out, np.float64) - y) / ulp(y, dtype_name)))


def accumulation_errors(
    xs,
    residual=None,
    gamma=None,
    *,
    allreduce_out=None,
    residual_out=None,
    norm_out=None,
    fp32_acc: bool = True,
    rms_eps: float = 1e-6,
    weight_bias: float = 0.0,
    dtype_name: str,
) -> dict:
    """For the outputs given, the errors that hold at every world size: ``allreduce_bound``
    and ``residual_bound`` (error / bound, at most 1) and ``norm_own`` (ulps, at most
    NORM_GIVEN_RESIDUAL_ULPS). ``xs``: every rank's input in rank order."""
    xs = [np.asarray(x, np.float64) for x in xs]
    s64 = np.sum(xs, axis=0)
    out = {}
    if allreduce_out is not None:
        bound = sum_error_bound(xs, dtype_name, fp32_acc=fp32_acc)
        out["allreduce_bound"] = bound_ratio(allreduce_out, s64, bound)
    if residual_out is not None:
        res = np.asarray(residual, np.float64)
        bound = residual_error_bound(xs, res, dtype_name, fp32_acc=fp32_acc)
        out["residual_bound"] = bound_ratio(residual_out, s64 + res, bound)
        if norm_out is not None:
            out["norm_own"] = norm_error_given_residual_ulps(
                norm_out,
                residual_out,
                gamma,
                rms_eps=rms_eps,
                weight_bias=weight_bias,
                dtype_name=dtype_name,
            )
    return out


def fused_reference(xs, residual, gamma, *, rms_eps: float, weight_bias: float):
    """xs: per-rank [M, H] arrays (in the call dtype). Float64 (sum, residual_out, norm_out,
    inv), computed exactly in float64."""
    s = np.sum([np.asarray(x, dtype=np.float64) for x in xs], axis=0)
    r = s + np.asarray(residual, dtype=np.float64)
    inv = 1.0 / np.sqrt(np.mean(r * r, axis=-1, keepdims=True) + rms_eps)
    y = r * inv * (weight_bias + np.asarray(gamma, dtype=np.float64))
    return s, r, y, inv


def allreduce_error_ulps(out, s64, dtype_name: str) -> float:
    return float(np.max(np.abs(np.asarray(out, np.float64) - s64) / ulp(s64, dtype_name)))


def _carried_ulp(s64, residual, dtype_name):
    return ulp(np.abs(s64) + np.abs(np.asarray(residual, np.float64)), dtype_name)


def residual_error_ulps(out, s64, r64, residual, dtype_name: str) -> float:
    scale = _carried_ulp(s64, residual, dtype_name)
    return float(np.max(np.abs(np.asarray(out, np.float64) - r64) / scale))


def norm_error_ulps(
    out, s64, y64, inv64, residual, gamma, *, weight_bias: float, dtype_name: str
) -> float:
    g = np.abs(weight_bias + np.asarray(gamma, np.float64))
    scale = _carried_ulp(s64, residual, dtype_name) * inv64 * g + ulp(y64, dtype_name)
    return float(np.max(np.abs(np.asarray(out, np.float64) - y64) / scale))
