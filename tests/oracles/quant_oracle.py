"""Independent numpy oracle for the quantized epilogues (no JAX, no jax_fusedar import),
written from the kernel (trtllm_allreduce_fusion.cuh) apart from
jax_fusedar/ops/quant_reference.py, with other machinery: fp32 arithmetic in float64
rounded once to float32 (``fl``: exact for a product, correctly rounded for a quotient) and
flushed like the kernel's -ftz=true; e4m3 by ml_dtypes after a saturating clamp; e2m1 by a
distance search over its values, ties to the even code; UE8M0 by frexp; the layouts by
explicit loops writing each byte where the formula puts it.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

E4M3 = ml_dtypes.float8_e4m3fn
TINY = 2.0**-126
E2M1_TABLE = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def ftz(x):
    x = np.asarray(x, dtype=np.float64)
    return np.where(np.abs(x) < TINY, np.copysign(0.0, x), x)


def fl(x):
    """Round float64 to float32 (RNE), flush subnormals; returned as float64."""
    with np.errstate(over="ignore", invalid="ignore"):
        return ftz(np.asarray(x, dtype=np.float64).astype(np.float32).astype(np.float64))


def f64(y):
    """Input of dtype T (numpy array of bf16/fp16/fp32) -> float64, DAZ."""
    return ftz(np.asarray(y).astype(np.float64))


def e4m3_bytes_sat(v):
    """float64 -> e4m3 bytes: clamp to +-448 keeping NaN, then RNE (ml_dtypes)."""
    v = np.asarray(v, dtype=np.float64)
    c = np.where(np.isnan(v), v, np.minimum(np.maximum(v, -448.0), 448.0))
    return c.astype(np.float32).astype(E4M3).view(np.uint8)


def e4m3_value(b):
    return np.asarray(b, dtype=np.uint8).view(E4M3).astype(np.float64)


def _ordinal(b):
    b = np.asarray(b).astype(np.int32)
    return np.where(b & 0x80, -(b & 0x7F), b & 0x7F)


def code_steps(a_bytes, b_bytes):
    """Distance in e4m3 codes between two arrays of e4m3 bytes (codes ordered by value)."""
    return np.abs(_ordinal(a_bytes) - _ordinal(b_bytes))


def e2m1_codes(v):
    """float64 -> 4-bit e2m1 codes: nearest table value (distance search), ties to the even
    code, |v| >= 6 (inf too) -> 6, sign bit 3 from the sign of v (also for zero), NaN -> +6."""
    v = np.asarray(v, dtype=np.float64)
    a = np.abs(v).reshape(-1)
    with np.errstate(invalid="ignore"):
        d = np.abs(E2M1_TABLE[None, :] - a[:, None])
    best = np.argmin(np.where(np.isnan(d), np.inf, d), axis=1)  # lowest index among equals
    nxt = np.minimum(best + 1, 7)
    rows = np.arange(a.size)
    tie = (best % 2 == 1) & (d[rows, nxt] == d[rows, best]) & (nxt != best)
    best = np.where(tie, best + 1, best)
    best = np.where(a >= 6.0, 7, best)
    sign = np.where(np.signbit(v.reshape(-1)), 8, 0)
    code = np.where(np.isnan(a), 7, best | sign)
    return code.astype(np.uint8).reshape(v.shape)


def _nan_ignoring_max(a, axis):
    """fmaxf fold from 0: NaNs ignored."""
    return np.max(np.where(np.isnan(a), 0.0, a), axis=axis, keepdims=True)


# ----------------------------------------------------------------------------- FP8


def fp8_static(y, scale_factor: float):
    """-> e4m3 bytes [M, H]."""
    r = fl(1.0 / fl(scale_factor))
    with np.errstate(invalid="ignore", over="ignore"):
        return e4m3_bytes_sat(fl(f64(y) * r))


def divide(a, b, division: str):
    """fp32 a / b: "ieee" correctly rounded, "reciprocal" fl(a * fl(1/b)); flushed."""
    a, b = ftz(a), ftz(b)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        if division == "ieee":
            return fl(a / b)
        assert division == "reciprocal", division
        return fl(a * fl(1.0 / b))


def fp8_dynamic(y, division: str = "ieee"):
    """-> (e4m3 bytes [M, H], scale float32 [M, 1])."""
    x = f64(y)
    amax = _nan_ignoring_max(np.abs(x), axis=-1)
    min_scale = fl(fl(1.0 / 512.0) / 448.0)
    s = np.fmax(divide(amax, 448.0, division), min_scale)
    with np.errstate(invalid="ignore"):
        q = np.fmin(np.fmax(divide(x, s, division), -448.0), 448.0)
    return e4m3_bytes_sat(q), s.astype(np.float32)


def group_warp_shuffle(group_size: int, itemsize: int) -> bool:
    vec = 16 // itemsize
    if group_size % vec:
        return False
    n = group_size // vec
    return n in (1, 2, 4, 8, 16, 32)


def ue8m0_pow2_ceil(s: float):
    """Smallest power of two >= s (s > 0 normal, or inf) and its biased exponent byte."""
    if math.isinf(s):
        return math.inf, 255
    m, e = math.frexp(s)  # s = m * 2^e, m in [0.5, 1)
    p = e - 1 if m == 0.5 else e
    return math.ldexp(1.0, p), p + 127


def fp8_group(y, group_size: int):
    """-> (e4m3 bytes [M, H], dense int32 buffer (K, round_up(M,4)))."""
    y = np.asarray(y)
    M, H = y.shape
    g = group_size
    G = H // g
    x = f64(y).reshape(M, G, g)
    a = np.abs(x)
    amax = _nan_ignoring_max(a, axis=-1)  # [M, G, 1]
    if not group_warp_shuffle(g, y.dtype.itemsize):  # atomicMax on bits: NaN wins
        amax = np.where(np.isnan(a).any(axis=-1, keepdims=True), np.nan, amax)
    lo = float(fl(1e-10))
    s = np.zeros_like(amax)
    exps = np.zeros((M, G), dtype=np.uint8)
    for idx in np.ndindex(M, G):
        am = float(amax[idx][0])
        s0 = lo if math.isnan(am) else max(float(fl(am / 448.0)), lo)  # fmaxf(NaN, lo) = lo
        s[idx][0], exps[idx] = ue8m0_pow2_ceil(s0)
    with np.errstate(invalid="ignore"):
        qq = np.fmin(np.fmax(fl(x / s), -448.0), 448.0)
    q = e4m3_bytes_sat(qq).reshape(M, H)
    K = (G + 3) // 4
    T = (M + 3) // 4 * 4
    buf = np.zeros(K * T * 4, dtype=np.uint8)
    for m in range(M):
        for j in range(G):
            pack, pos = divmod(j, 4)
            buf[(pack * T + m) * 4 + pos] = exps[m, j]
    return q, buf.view("<i4").reshape(K, T).astype(np.int32)


# ----------------------------------------------------------------------------- NVFP4


def swizzle_offset(m: int, k: int, H: int) -> int:
    k_tiles = -(-H // 64)
    return ((m // 128) * k_tiles + k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4


def nvfp4(y, global_scale: float, division: str = "ieee"):
    """-> (packed uint8 [M, H/2], scale bytes uint8 [M, H/16] in row/block order)."""
    y = np.asarray(y)
    M, H = y.shape
    nb = H // 16
    x = f64(y).reshape(M, nb, 16)
    gs = float(fl(global_scale))
    recip6 = float(fl(1.0 / 6.0))
    a = np.abs(x)
    allnan = np.isnan(a).all(axis=-1)
    vmax = np.where(allnan, np.nan, np.max(np.where(np.isnan(a), -np.inf, a), axis=-1))
    with np.errstate(invalid="ignore", over="ignore"):
        sf_in = fl(gs * fl(vmax * recip6))
    sf_b = e4m3_bytes_sat(sf_in)  # [M, nb]
    qsf = e4m3_value(sf_b)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        osc = np.where(qsf != 0, divide(gs, np.where(qsf != 0, qsf, 1.0), division), 0.0)
        osc = np.where(np.isnan(qsf), np.nan, osc)
        v = fl(x * osc[..., None])
    codes = e2m1_codes(v).reshape(M, H)
    packed = np.zeros((M, H // 2), dtype=np.uint8)
    for i in range(H // 2):
        packed[:, i] = codes[:, 2 * i] | (codes[:, 2 * i + 1] << 4)
    return packed, sf_b


def nvfp4_scale_buffer(sf_b, H: int, layout: int):
    """[M, H/16] scale bytes scattered one at a time into the kernel's buffer (layout 0:
    SWIZZLED_128x4, round_up(M,128)*round_up(H/16,4) bytes; 2: LINEAR, M*H/16) -> (flat
    uint8 buffer, written mask): padding bytes are 0 / False."""
    M, nb = sf_b.shape
    if layout == 0:
        size = (-(-M // 128) * 128) * (-(-nb // 4) * 4)
    elif layout == 2:
        size = M * nb
    else:
        raise ValueError(layout)
    buf = np.zeros(size, dtype=np.uint8)
    written = np.zeros(size, dtype=bool)
    for m in range(M):
        for k in range(nb):
            off = swizzle_offset(m, k, H) if layout == 0 else m * nb + k
            assert not written[off], (m, k, off)
            buf[off] = sf_b[m, k]
            written[off] = True
    return buf, written
