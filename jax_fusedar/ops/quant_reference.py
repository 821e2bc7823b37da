"""Bit-faithful JAX references of the fused op's quantized epilogues.

Each function is a pure function of ``y``, the RMSNorm output already rounded to the input
dtype T (``jax_fusedar.ops.reference.rms_norm`` gives exactly that), and of its parameters. Line
numbers are those of third_party/flashinfer/include/flashinfer/comm/trtllm_allreduce_fusion.cuh
(ARF). All arithmetic is fp32, one IEEE rounding per operation, in the kernel's order.

Static FP8 (patterns 2/4; ARF L1085-1086, L1133-1142)::

    r = fl(1 / scale_factor)                  (once per thread, FusedOp constructor)
    q = e4m3_satfinite(fl(float(y) * r))      (satfinite: |v| > 448 -> +-448, NaN -> NaN)

Dynamic per-token FP8 (10/11; ARF L34-39, L1274-1284, L1332-1365)::

    amax  = max(0, max over the row of |float(y)|)          (fmaxf: NaN elements ignored)
    scale = fmaxf(fl(amax / 448), fl(2^-9 / 448))           (scale_out[token], float32)
    q     = e4m3(fminf(fmaxf(fl(float(y) / scale), -448), 448))   (a NaN quotient -> -448)

Per-token-group FP8, UE8M0 scales (8/9; ARF L1144-1262)::

    amax = max(0, max over the group of |float(y)|)   (warp-shuffle path: NaN ignored;
                                                      shared-memory path: NaN wins, see below)
    s    = fmaxf(fl(amax / 448), 1e-10f), then rounded UP to a power of two by the bit trick
           ``bits = (bits + 0x800000) & 0x7f800000`` when the mantissa is non-zero (L1199-1205)
    q    = e4m3(fminf(fmaxf(fl(float(y) / s), -448), 448))
    byte = (bits(s) >> 23) & 0xff  (the biased exponent, UE8M0), written at byte
           (pack * round_up(M,4) + token) * 4 + pos for group 4*pack + pos (L1223-1236);
           padding zeroed (L1237-1259; the last pack's padding tokens are not written by the
           kernel, zero here).

NVFP4 (3/5; ARF L727-806, cvt_warp_fp16_to_fp4 with UE8M0_SF = false)::

    vecMax = max over the 16-element block of |y|, in T (__habs2/__hmax2: NaN ignored unless
             all 16 are NaN; L734-745)
    SF     = e4m3_satfinite(fl(gs * fl(float(vecMax) * fl(1/6))))        (L731, L764-766)
    oscale = float(SF) != 0 ? fl(gs / float(SF)) : 0                       (L772)
    q      = e2m1(fl(float(y) * oscale))  cvt.rn.satfinite.e2m1x2.f32: RNE onto
             {0, .5, 1, 1.5, 2, 3, 4, 6}, |v| > 6 -> 6, sign kept (also for zero), NaN -> +6
             (the cuda_fp4.hpp emulation of that instruction)             (L642-657, L784-799)
    gs     = scale_factor, the *global* scale: multiplied, not divided (L1087-1088).

Rounding model and the kernel's -use_fast_math (-ftz=true -prec-div=false -prec-sqrt=false
-fmad=true; ffi/core/CMakeLists.txt uses FlashInfer's flags):

* Multiplications are IEEE in the kernel too (there are no additions to contract into FMAs):
  identical except for flush-to-zero.
* Flush-to-zero: every fp32 operand and result below 2^-126 in magnitude is flushed to a
  signed zero here as in the kernel (``_ftz``). XLA:CPU runs with FTZ/DAZ anyway; the explicit
  flush makes other backends agree. It changes results only in NVFP4 with a huge global scale
  (elsewhere such values round to e4m3/e2m1 zero regardless).
* Divisions. Under -use_fast_math ``x / y`` becomes ``__fdividef`` (div.approx.ftz.f32:
  x * rcp.approx(y), documented max error 2 ulp) and ``1.f / y`` rcp.approx (1 ulp); a constant
  divisor (448) may be folded into a multiplication by fl(1/448). None of this is bit-
  specified, so each division is modelled one of two ways, chosen by ``division=``:
    - ``"ieee"`` (default): correctly rounded fl(a / b);
    - ``"reciprocal"``: fl(a * fl(1 / b)), i.e. the approximate division with a correctly
      rounded reciprocal -- what the kernel computes if MUFU.RCP returns the correctly
      rounded reciprocal of the divisors involved (448, the per-token scale, e4m3 SF values).
  The two agree wherever a divisor is a power of two. Per quantization:
    - static FP8: r = fl(1 / scale_factor) either way (the kernel multiplies by it); the
      kernel's rcp.approx may be an ulp off unless scale_factor is a power of two (then q is
      bit-exact); otherwise a q whose product lies within ~1 ulp of an e4m3 midpoint may move
      by one code;
    - dynamic FP8: ``scale_out`` = amax/448 differs between the modes by an ulp in about half
      of the rows, and q by one code near midpoints: GPU tests should accept either mode (or
      scale_out within 2 ulp and q within one code);
    - per-token-group: ``y / s`` divides by a power of two: exact in every model. ``amax/448``
      matters only through its power-of-two ceiling, i.e. only when the quotient is (within an
      ulp of) a power of two, which for bf16/fp16 inputs means amax = 7 * 2^j; both modes give
      exactly 2^(j-6) there (tested), so the modes coincide for the group path; a hardware
      reciprocal of 448 that is not correctly rounded could double such a group's scale: the
      GPU tests should include groups whose max is 7 * 2^j;
    - NVFP4: the SF bytes involve multiplications only (bit-exact); oscale = gs / float(SF)
      differs between the modes for some SF, moving q by one e2m1 code where float(y) * oscale
      lies within ~2 ulp of an e2m1 midpoint (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5).
  XLA itself rewrites ``A / broadcast(B)`` into ``A * broadcast(1/B)``; ``_div`` hides the
  operands behind an optimization barrier so that ``"ieee"`` really divides.
* e4m3 NaN sign: the reference produces XLA's NaN byte (0x7f/0xff by the sign of the NaN); the
  hardware's is not specified here; compare NaNs as NaNs.

Group path selection (ARF L1150-1155): the kernel reduces a group's max with warp shuffles
(fmaxf, NaN ignored) when group_size % VEC_SIZE == 0 and group_size / VEC_SIZE is a power of
two <= 32 (VEC_SIZE = 16 bytes / sizeof(T): 8 for bf16/fp16, so group sizes 8..256 that are
powers of two), otherwise with a shared-memory atomicMax on the float bits, where a NaN
(0x7fc00000 > +inf's bits) wins and the group gets the minimum scale 2^-33. Both are
modelled. (The shared-memory path also assumes no group straddles two thread blocks of a
token split over a cluster: a launch-configuration condition not modelled here.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..common import quant_layouts
from . import quant_arrays
from ..common.quant_layouts import FP8_E4M3_MAX, NVFP4_BLOCK, QuantizationSFLayout
from ..common.patterns import TRAITS, AllReduceFusionPattern

_TINY = float(np.finfo(np.float32).tiny)  # 2^-126
_RECIP6 = np.float32(1.0) / np.float32(6.0)  # constexpr 1.0f / 6.0f (L731)
_DYN_MIN_SCALE = np.float32(1.0 / 512.0) / np.float32(448.0)  # kDynamicFP8MinScale (L39)
_GROUP_MIN = np.float32(1e-10)  # 1e-10f (L1200), 0x2edbe6ff

_FP8_IN_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
_FP4_IN_DTYPES = (jnp.bfloat16, jnp.float16)


# ----------------------------------------------------------------------------- primitives


def _ftz(x):
    """Flush fp32 subnormals to a zero of the same sign (-ftz=true)."""
    return jnp.where(jnp.abs(x) < _TINY, x * 0.0, x)


def _f32(y):
    return _ftz(y.astype(jnp.float32))


DIVISION_MODES = ("ieee", "reciprocal")


def _div(a, b, division: str = "ieee"):
    """fp32 a / b with operands and result flushed like the kernel's .ftz ops.

    ``"ieee"``: correctly rounded. ``"reciprocal"``: fl(a * fl(1 / b)). XLA's algebraic
    simplifier rewrites ``A / broadcast(B)`` (a scalar or a row of scales, even a non-constant
    one) into ``A * broadcast(1 / B)``, which rounds twice; hiding the operands behind an
    optimization barrier keeps a true division."""
    if division not in DIVISION_MODES:
        raise ValueError(f"division must be one of {DIVISION_MODES}, got {division!r}")
    if division == "reciprocal":
        return _ftz(jnp.asarray(a, jnp.float32) * _div(jnp.float32(1.0), b))
    a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
    a, b = jax.lax.optimization_barrier((_ftz(a), _ftz(b)))
    return _ftz(a / b)


def _fmaxf(a, b):
    """C fmaxf: if one operand is NaN, the other."""
    return jnp.fmax(a, b)


def _fminf(a, b):
    return jnp.fmin(a, b)


def e4m3_satfinite(v):
    """fp32 -> float8_e4m3fn like ``__nv_fp8_e4m3(float)`` (cvt.rn.satfinite.e4m3x2.f32):
    RNE, finite values (and inf) beyond 448 clamp to +-448, NaN stays NaN."""
    # jnp.clip propagates NaN; after the clamp the conversion cannot overflow.
    return jnp.clip(v, -FP8_E4M3_MAX, FP8_E4M3_MAX).astype(jnp.float8_e4m3fn)


def e2m1_codes(v):
    """fp32 -> 4-bit e2m1 codes (uint8 0..15) like cvt.rn.satfinite.e2m1x2.f32.

    Magnitude code = number of RNE decision thresholds |v| passes: ties go to the even code,
    so 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0, 3.5 -> 4.0, 5 -> 4.0;
    everything above 5 (inf included) -> 6.0. Sign bit 3 follows the sign of v (-0.1 -> -0);
    NaN -> +6 (0x7)."""
    a = jnp.abs(v)
    mag = (
        (a > 0.25).astype(jnp.uint8)
        + (a >= 0.75)
        + (a > 1.25)
        + (a >= 1.75)
        + (a > 2.5)
        + (a >= 3.5)
        + (a > 5.0)
    ).astype(jnp.uint8)
    nan = jnp.isnan(v)
    sign = jnp.where(jnp.signbit(v) & ~nan, jnp.uint8(8), jnp.uint8(0))
    return jnp.where(nan, jnp.uint8(7), mag | sign)


def _check_y(y, dtypes, what: str):
    if not hasattr(y, "dtype") or y.ndim != 2:
        raise ValueError(
            f"{what}: y must be a 2-D [tokens, hidden] array, got "
            f"{getattr(y, 'shape', type(y).__name__)}"
        )
    if y.dtype not in dtypes:
        raise ValueError(
            f"{what}: y must be one of {[jnp.dtype(d).name for d in dtypes]}, got {y.dtype}"
        )
    if y.shape[0] < 1 or y.shape[1] < 1:
        raise ValueError(f"{what}: empty y of shape {tuple(y.shape)}")
    return y.shape


# ----------------------------------------------------------------------------- FP8


def quantize_fp8_static(y, scale_factor):
    """Patterns 2/4: float8_e4m3fn [M, H] = e4m3_satfinite(float(y) * fl(1/scale_factor)).

    ``scale_factor``: float32 array of shape () or (1,), the dequantization scale (the kernel
    divides by it, through a reciprocal computed once)."""
    _check_y(y, _FP8_IN_DTYPES, "quantize_fp8_static")
    s = quant_arrays.check_scalar_scale(scale_factor, "scale_factor")
    r = _div(jnp.float32(1.0), s)
    return e4m3_satfinite(_ftz(_f32(y) * r))


def quantize_fp8_dynamic(y, *, division: str = "ieee"):
    """Patterns 10/11: (q float8_e4m3fn [M, H], scale float32 [M, 1]) with
    scale = fmaxf(amax_row / 448, 2^-9 / 448), q = e4m3(clamp(float(y) / scale, +-448)).
    ``division``: how the two divisions round ("ieee" or "reciprocal", module docstring)."""
    _check_y(y, _FP8_IN_DTYPES, "quantize_fp8_dynamic")
    x = _f32(y)
    ax = jnp.abs(x)
    amax = jnp.max(jnp.where(jnp.isnan(ax), 0.0, ax), axis=-1, keepdims=True)  # acc starts 0
    scale = _fmaxf(_div(amax, FP8_E4M3_MAX, division), _DYN_MIN_SCALE)
    q = _fminf(_fmaxf(_div(x, scale, division), -FP8_E4M3_MAX), FP8_E4M3_MAX)
    return q.astype(jnp.float8_e4m3fn), scale


def group_uses_warp_shuffle(group_size: int, dtype) -> bool:
    """Which group-max reduction the kernel uses (ARF L1157-1160)."""
    vec = 16 // jnp.dtype(dtype).itemsize
    n = group_size // vec
    return group_size % vec == 0 and n <= 32 and (n & (n - 1)) == 0 and n > 0


def _ue8m0_round_up(s):
    """ARF compute_ue8m0_scale's bit trick: round a positive normal fp32 up to a power of 2."""
    bits = jax.lax.bitcast_convert_type(s, jnp.uint32)
    up = (bits + jnp.uint32(0x800000)) & jnp.uint32(0x7F800000)
    bits = jnp.where((bits & jnp.uint32(0x7FFFFF)) != 0, up, bits)
    return jax.lax.bitcast_convert_type(bits, jnp.float32), bits


def pack_group_scales(exps, M: int, H: int, group_size: int):
    """uint8 exponents [M, H/g] -> the dense int32 (K, round_up(M,4)) buffer (quant_layouts.py):
    word (pack, token) = sum over pos of exps[token, 4*pack + pos] << 8*pos; padding 0."""
    K, T = quant_layouts.group_scale_buffer_shape(M, H, group_size)
    groups = H // group_size
    e = jnp.pad(exps.astype(jnp.uint32), ((0, T - M), (0, 4 * K - groups)))
    e = e.reshape(T, K, 4)
    words = e[..., 0] | (e[..., 1] << 8) | (e[..., 2] << 16) | (e[..., 3] << 24)  # [T, K]
    return jax.lax.bitcast_convert_type(words.T, jnp.int32)


def quantize_fp8_group(y, group_size):
    """Patterns 8/9: (q float8_e4m3fn [M, H], scales int32 (K, round_up(M,4))).

    ``scales`` is the dense physical buffer of FlashInfer's MN-major tensor (shape (M, K),
    strides (1, round_up(M,4))): that tensor is ``scales[:, :M].T``; see
    quant_layouts.group_scale_buffer_shape / quant_arrays.unpack_ue8m0_scales. ``group_size``
    is static."""
    M, H = _check_y(y, _FP8_IN_DTYPES, "quantize_fp8_group")
    g = quant_layouts.check_group_size(H, group_size)
    G = H // g
    x = _f32(y).reshape(M, G, g)
    ax = jnp.abs(x)
    isnan = jnp.isnan(ax)
    amax = jnp.max(jnp.where(isnan, 0.0, ax), axis=-1, keepdims=True)
    if not group_uses_warp_shuffle(g, y.dtype):
        amax = jnp.where(jnp.any(isnan, axis=-1, keepdims=True), jnp.float32(jnp.nan), amax)
    s = _fmaxf(_div(amax, FP8_E4M3_MAX), _GROUP_MIN)
    s, bits = _ue8m0_round_up(s)
    q = _fminf(_fmaxf(_div(x, s), -FP8_E4M3_MAX), FP8_E4M3_MAX)
    q = q.reshape(M, H).astype(jnp.float8_e4m3fn)
    exps = ((bits >> 23) & 0xFF).astype(jnp.uint8).reshape(M, G)
    return q, pack_group_scales(exps, M, H, g)


# ----------------------------------------------------------------------------- NVFP4


def quantize_nvfp4(
    y, global_scale, layout=QuantizationSFLayout.SWIZZLED_128x4, *, division: str = "ieee"
):
    """Patterns 3/5: (packed uint8 [M, H/2], scales float8_e4m3fn 2-D).

    ``global_scale``: float32 array of shape () or (1,), multiplied in (typically
    448 * 6 / amax of the tensor). ``layout`` (static): SWIZZLED_128x4 (0) -> scales of shape
    (round_up(M,128), round_up(H/16,4)) whose row-major bytes are the kernel's buffer, padding
    zero (the kernel leaves padding unwritten: tests must ignore it); LINEAR (2) -> (M, H/16).
    SWIZZLED_8x4 (1) raises ValueError (the kernel writes no scales for it). ``division``:
    how gs / float(SF) rounds ("ieee" or "reciprocal", module docstring)."""
    M, H = _check_y(y, _FP4_IN_DTYPES, "quantize_nvfp4")
    quant_layouts.check_hidden_fp4(H)
    lay = quant_layouts.as_layout(layout)
    gs = _ftz(quant_arrays.check_scalar_scale(global_scale, "global_scale"))
    nb = H // NVFP4_BLOCK
    yb = y.reshape(M, nb, NVFP4_BLOCK)
    a = jnp.abs(yb)  # exact in T; max is exact in T too
    isnan = jnp.isnan(a)
    vmax = jnp.max(jnp.where(isnan, -jnp.inf, a.astype(jnp.float32)), axis=-1, keepdims=True)
    vmax = jnp.where(jnp.all(isnan, axis=-1, keepdims=True), jnp.float32(jnp.nan), vmax)
    vmax = _ftz(vmax)
    sf = e4m3_satfinite(_ftz(gs * _ftz(vmax * _RECIP6)))
    qsf = sf.astype(jnp.float32)
    oscale = jnp.where(qsf != 0, _div(gs, qsf, division), jnp.float32(0.0))
    v = _ftz(_f32(yb) * oscale)
    codes = e2m1_codes(v).reshape(M, H // 2, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    sf = sf.reshape(M, nb)
    if lay == QuantizationSFLayout.SWIZZLED_128x4:
        sf = quant_arrays.swizzle_128x4(sf)
    return packed, sf


# ----------------------------------------------------------------------------- by pattern


def quantize_for_pattern(
    y,
    pattern,
    *,
    scale_factor=None,
    layout=QuantizationSFLayout.SWIZZLED_128x4,
    group_size=None,
    division: str = "ieee",
):
    """(quant_out, scale_out) of a fusion pattern given its norm output ``y`` (in T);
    scale_out is None for static FP8, both are None for unquantized patterns."""
    traits = TRAITS[AllReduceFusionPattern(int(pattern))]
    if traits.quant is None:
        return None, None
    if traits.quant == "fp8":
        return quantize_fp8_static(y, scale_factor), None
    if traits.quant == "fp4":
        return quantize_nvfp4(y, scale_factor, layout, division=division)
    if traits.quant == "dynamic_fp8":
        return quantize_fp8_dynamic(y, division=division)
    return quantize_fp8_group(y, group_size)
