"""Float64 numpy oracle for the fused op and the ulp-based error measure, independent of
jax_fusedar's own reference (no JAX here).

The kernel rounds twice before the norm (the all-reduce sum to T, then sum + residual to
T), so errors are measured in ulps of the *intermediate* magnitudes (docs/numerics.md):

  residual_out: |r - r64| / ulp_T(|s64| + |res|)                   expect <= 1
  norm_out:     |y - y64| / (ulp_T(|s64| + |res|) * inv64 * |wb + g| + ulp_T(|y64|))
  allreduce:    |s - s64| / ulp_T(|s64|)                            expect <= 1

The 1-ulp bounds assume the fp32 accumulation itself is exact, as it is for 2 ranks of
16-bit values (the GPU tests' world size); N ranks add up to (N - 1) * 2^-24 * sum(|x_r|).
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


def fused_reference(xs, residual, gamma, *, rms_eps: float, weight_bias: float):
    """xs: list of per-rank [M, H] arrays (already in the call dtype, any float type).
    Returns float64 (sum, residual_out, norm_out, inv) computed exactly in float64."""
    s = np.sum([np.asarray(x, dtype=np.float64) for x in xs], axis=0)
    r = s + np.asarray(residual, dtype=np.float64)
    inv = 1.0 / np.sqrt(np.mean(r * r, axis=-1, keepdims=True) + rms_eps)
    y = r * inv * (weight_bias + np.asarray(gamma, dtype=np.float64))
    return s, r, y, inv


def allreduce_error_ulps(out, s64, dtype_name: str) -> float:
    return float(np.max(np.abs(np.asarray(out, np.float64) - s64) / ulp(s64, dtype_name)))


def residual_error_ulps(out, s64, r64, residual, dtype_name: str) -> float:
    scale = ulp(np.abs(s64) + np.abs(np.asarray(residual, np.float64)), dtype_name)
    return float(np.max(np.abs(np.asarray(out, np.float64) - r64) / scale))


def norm_error_ulps(out, s64, y64, inv64, residual, gamma, *, weight_bias: float,
                    dtype_name: str) -> float:
    carried = (ulp(np.abs(s64) + np.abs(np.asarray(residual, np.float64)), dtype_name) * inv64
               * np.abs(weight_bias + np.asarray(gamma, np.float64)))
    scale = carried + ulp(y64, dtype_name)
    return float(np.max(np.abs(np.asarray(out, np.float64) - y64) / scale))
