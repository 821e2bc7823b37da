"""Shapes, layouts and (de)quantization helpers for the fused op's quantized outputs.

Everything here describes FlashInfer's trtllm_allreduce_fusion.cuh (ARF) byte for byte:

* FP8 (patterns 2/4 static per-tensor, 10/11 dynamic per-token, 8/9 per-token-group):
  ``quant_out`` is float8_e4m3fn ``[M, H]``.
    - static: no ``scale_out``; dequant ``x ~ q * scale_factor``.
    - dynamic: ``scale_out`` float32 ``[M, 1]``; dequant ``x ~ q * scale_out``.
    - per-token-group: ``scale_out`` holds one UE8M0 exponent byte per group of ``g``
      elements, packed 4 per int32 in DeepGEMM's MN-major TMA-aligned layout: the torch tensor
      FlashInfer validates has shape ``(M, K)`` and strides ``(1, T)`` with
      ``K = ceil((H/g)/4)`` and ``T = round_up(M, 4)`` (flashinfer/comm/allreduce.py, the
      per-token-group validation). Byte ``(pack*T + token)*4 + pos`` holds the exponent of
      group ``4*pack + pos`` of ``token`` (ARF ``write_group_scale``).
      **Our representation** is the dense physical buffer: an int32 array of shape
      ``group_scale_buffer_shape(M, H, g) == (K, T)`` whose row-major order *is* the memory
      order, so ``buf[pack, token]`` is the word of that pack and token. The tensor FlashInfer
      / DeepGEMM see is the strided view ``buf[:, :M].T`` (shape (M, K), strides (1, T)); in
      torch: ``torch.from_dlpack(buf)[:, :M].t()`` (no copy). The minimal storage of that
      view is ``(K-1)*T + M`` words; the dense buffer is ``K*T`` words, and the kernel never
      writes the last pack's padding tokens ``M..T-1`` (ARF comment in ``write_group_scale``).
      It zeroes all other padding bytes itself.
* NVFP4 (patterns 3/5): ``quant_out`` is uint8 ``[M, H/2]``, element ``2i`` in the low nibble,
  ``2i+1`` in the high nibble (e2m1 codes: sign bit 3, magnitude code 0..7 for
  {0, .5, 1, 1.5, 2, 3, 4, 6}). ``scale_out`` holds one float8_e4m3fn scale per 16 elements:
    - SWIZZLED_128x4 (0): 2-D ``(round_up(M,128), round_up(H/16,4))`` whose row-major bytes
      follow ``swizzled_128x4_offset``; padding bytes are not written by the kernel.
    - LINEAR (2): ``(M, H/16)`` row-major.
    - SWIZZLED_8x4 (1): the kernel writes nothing (ARF returns a null SF pointer); rejected.
  Dequant: ``x ~ e2m1(q) * float(SF) / global_scale``.

Shape helpers are plain Python (no JAX) so the primitive, the FFI handler and the torch layer
can share them; array helpers import jax lazily.
"""
from __future__ import annotations

import operator

import numpy as np

from . import arguments, topology
from .patterns import QuantizationSFLayout

FP8_E4M3_MAX = 448.0
E2M1_MAX = 6.0
NVFP4_BLOCK = 16  # CVT_FP4_SF_VEC_SIZE: elements per NVFP4 scale
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude codes 0..7


# ----------------------------------------------------------------------------- validation

def _as_dim(value, name: str) -> int:
    try:  # operator.index: ints, numpy ints and torch's SymInts, never 64.0
        if isinstance(value, (bool, np.bool_)):
            raise TypeError
        v = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {value!r}") from None
    return v


def _check_tokens(M) -> int:
    M = _as_dim(M, "num_tokens (M)")
    if M < 0:  # 0 tokens: empty buffers of the same layout (a call of 0 tokens is served)
        raise ValueError(f"num_tokens (M) must be >= 0, got {M}")
    return M


def check_hidden_fp4(H) -> int:
    H = _as_dim(H, "hidden_dim (H)")
    if H < 1 or H % NVFP4_BLOCK:
        raise ValueError(
            f"NVFP4 needs hidden_dim divisible by {NVFP4_BLOCK} (one e4m3 scale per 16 "
            f"elements), got {H}")
    return H


def check_group_size(H, group_size) -> int:
    """Validates a per-token-group size against hidden_dim; returns it as an int."""
    H = _as_dim(H, "hidden_dim (H)")
    if group_size is None:
        raise ValueError("group_size (block_quant_group_size) is required for the "
                         "per-token-group FP8 patterns (8/9)")
    g = _as_dim(group_size, "group_size")
    if g <= 0:
        raise ValueError(f"group_size must be > 0, got {g}")
    if H % g:
        raise ValueError(f"hidden_dim must be divisible by group_size, got {H} and {g}")
    return g


def check_kernel_group_size(H, group_size, dtype_name: str) -> int:
    """``check_group_size`` plus the rule of the group sizes this project serves (JAX and
    torch alike): a power of two from one 16-byte vector to 32 vectors, the kernel's
    warp-shuffle path. Other sizes take a shared-memory reduction that needs whole groups
    per thread block, which is not guaranteed for every hidden size, so they are refused."""
    g = check_group_size(H, group_size)
    vec = topology.vector_width(dtype_name)
    if g < vec or g > 32 * vec or g & (g - 1):
        raise ValueError(f"block_quant_group_size must be a power of two from {vec} to "
                         f"{32 * vec} for {dtype_name}, got {g}")
    return g


def as_layout(layout) -> QuantizationSFLayout:
    """Validates an NVFP4 scale layout code. SWIZZLED_8x4 (1) is refused: the kernel's
    offset function returns nullptr for it, so it writes no scales at all."""
    lay = None
    if arguments.is_int(layout):  # 2.7 or "2" are refused, not truncated to LINEAR
        lay = next((q for q in QuantizationSFLayout if q.value == int(layout)), None)
    if lay is None:
        raise ValueError(f"unknown NVFP4 scale layout (layout_code) {layout!r}; valid: 0 "
                         "(SWIZZLED_128x4), 2 (LINEAR), as a QuantizationSFLayout or an int")
    if lay == QuantizationSFLayout.SWIZZLED_8x4:
        raise ValueError("QuantizationSFLayout.SWIZZLED_8x4 (1) is not implemented by the "
                         "fused all-reduce kernel (it writes no scales); use SWIZZLED_128x4 (0) "
                         "or LINEAR (2)")
    return lay


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


# ----------------------------------------------------------------------------- shapes

def group_scale_buffer_shape(M, H, group_size) -> tuple:
    """Shape ``(K, T)`` of the dense int32 buffer holding per-token-group UE8M0 scales:
    ``K = ceil((H/g)/4)`` packs of 4 exponent bytes, ``T = round_up(M, 4)`` (tma_aligned_mn).
    FlashInfer's tensor is the view ``buf[:, :M].T`` (shape (M, K), strides (1, T))."""
    M = _check_tokens(M)
    g = check_group_size(H, group_size)
    groups = int(H) // g
    return ((groups + 3) // 4, _round_up(M, 4))


def group_scale_min_storage_words(M, H, group_size) -> int:
    """int32 words FlashInfer's strided (M, K) tensor spans: ``(K-1)*T + M``."""
    K, T = group_scale_buffer_shape(M, H, group_size)
    return (K - 1) * T + int(M)


def nvfp4_scale_shape(M, H, layout) -> tuple:
    """2-D shape of the NVFP4 scale buffer, in float8_e4m3fn (byte) units:
    SWIZZLED_128x4 -> (round_up(M,128), round_up(H/16,4)); LINEAR -> (M, H/16)."""
    M = _check_tokens(M)
    H = check_hidden_fp4(H)
    lay = as_layout(layout)
    k = H // NVFP4_BLOCK
    if lay == QuantizationSFLayout.SWIZZLED_128x4:
        return (_round_up(M, 128), _round_up(k, 4))
    return (M, k)


def nvfp4_scale_buffer_size(M, H, layout) -> int:
    """Bytes (= e4m3 elements) of the NVFP4 scale buffer: round_up(M,128)*round_up(H/16,4)
    for SWIZZLED_128x4 (FlashInfer's compute_fp4_swizzled_layout_sf_size), M*H/16 for LINEAR."""
    r, c = nvfp4_scale_shape(M, H, layout)
    return r * c


def nvfp4_quant_shape(M, H) -> tuple:
    """Shape of the packed NVFP4 values: uint8 (M, H/2)."""
    return (_check_tokens(M), check_hidden_fp4(H) // 2)


def swizzled_128x4_offset(m, k, H):
    """Byte offset of the scale of row ``m``, 16-element block ``k`` in the SWIZZLED_128x4
    layout (ARF get_sf_out_offset_128x4, numRows unset, batch 0):

        ((m // 128) * ceil(H / 64) + k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4

    ``m`` and ``k`` may be Python ints or integer numpy arrays (broadcast)."""
    H = _as_dim(H, "hidden_dim (H)")
    num_k_tiles = (H + 63) // 64
    m = np.asarray(m, dtype=np.int64) if not isinstance(m, int) else m
    k = np.asarray(k, dtype=np.int64) if not isinstance(k, int) else k
    return (((m // 128) * num_k_tiles + k // 4) * 512 + (m % 32) * 16
            + ((m % 128) // 32) * 4 + k % 4)


def linear_offset(m, k, H):
    """Byte offset of scale (m, k) in the LINEAR layout: m * H/16 + k."""
    return m * (_as_dim(H, "hidden_dim (H)") // NVFP4_BLOCK) + k


# ----------------------------------------------------------------------------- array helpers

def _jnp():
    import jax.numpy as jnp
    return jnp


def _lax():
    import jax
    return jax.lax


def swizzle_128x4(sf):
    """[M, H/16] scales (any 1-byte dtype) -> (round_up(M,128), round_up(H/16,4)) in the
    SWIZZLED_128x4 byte order; padding filled with zeros (the kernel leaves it unwritten)."""
    jnp = _jnp()
    M, k = sf.shape
    Mp, kp = _round_up(M, 128), _round_up(k, 4)
    x = jnp.pad(sf, ((0, Mp - M), (0, kp - k)))
    # row m = mt*128 + inner*32 + outer, column k = kt*4 + kk; offset order (mt, kt, outer,
    # inner, kk)
    x = x.reshape(Mp // 128, 4, 32, kp // 4, 4).transpose(0, 3, 2, 1, 4)
    return x.reshape(Mp, kp)


def unswizzle_128x4(buf, M, H):
    """Inverse of swizzle_128x4: the (round_up(M,128), round_up(H/16,4)) buffer (or its flat
    bytes) -> [M, H/16]."""
    M = _check_tokens(M)
    H = check_hidden_fp4(H)
    k = H // NVFP4_BLOCK
    Mp, kp = _round_up(M, 128), _round_up(k, 4)
    if buf.size != Mp * kp:
        raise ValueError(f"SWIZZLED_128x4 scale buffer for M={M}, H={H} has {Mp * kp} bytes, "
                         f"got an array of shape {tuple(buf.shape)}")
    x = buf.reshape(Mp // 128, kp // 4, 32, 4, 4).transpose(0, 3, 2, 1, 4)
    return x.reshape(Mp, kp)[:M, :k]


def nvfp4_scales_as_int32(x):
    """View e4m3 scale bytes (float8_e4m3fn or uint8, shape [..., C], C % 4 == 0) as the int32
    words vLLM stores (shape [..., C/4]; byte 4j+i is bits 8i..8i+7 of word j, little-endian as
    on the GPU). lax.bitcast_convert_type: free in XLA. For SWIZZLED_128x4 C = round_up(H/16,4)
    is always a multiple of 4; LINEAR (C = H/16) needs H % 64 == 0."""
    jnp, lax = _jnp(), _lax()
    if x.dtype not in (jnp.float8_e4m3fn, jnp.uint8, jnp.int8):
        raise ValueError(f"expected float8_e4m3fn/uint8 scale bytes, got {x.dtype}")
    if x.ndim < 1 or x.shape[-1] % 4:
        raise ValueError(f"the last dimension must be a multiple of 4 to view as int32, got "
                         f"shape {tuple(x.shape)}")
    return lax.bitcast_convert_type(x.reshape(*x.shape[:-1], x.shape[-1] // 4, 4), jnp.int32)


def nvfp4_scales_as_fp8(x):
    """Inverse of nvfp4_scales_as_int32: int32 (or uint32) [..., W] -> float8_e4m3fn [..., 4W]."""
    jnp, lax = _jnp(), _lax()
    if x.dtype not in (jnp.int32, jnp.uint32):
        raise ValueError(f"expected int32 scale words, got {x.dtype}")
    b = lax.bitcast_convert_type(x, jnp.float8_e4m3fn)  # [..., W, 4]
    return b.reshape(*x.shape[:-1], x.shape[-1] * 4)


def unpack_ue8m0_scales(packed, M, H, group_size):
    """Per-token-group scales from the packed buffer -> float32 [M, H/g].

    ``packed``: the dense (K, T) int32 buffer (or any array with K*T words in memory order).
    Byte value e means 2^(e-127) (UE8M0). The kernel only writes 94..254 (its scale is a power
    of two in [2^-33, 2^127]) or 255 for an infinite group max (its scale is then +inf, so 255
    maps to +inf here, not OCP's NaN); 0 maps to 2^-127."""
    jnp, lax = _jnp(), _lax()
    K, T = group_scale_buffer_shape(M, H, group_size)
    M = int(M)
    groups = int(H) // int(group_size)
    if packed.dtype not in (jnp.int32, jnp.uint32):
        raise ValueError(f"packed group scales must be int32, got {packed.dtype}")
    if packed.size != K * T:
        raise ValueError(f"packed group scales for M={M}, H={H}, group_size={group_size} need "
                         f"shape {(K, T)} ({K * T} words), got {tuple(packed.shape)}")
    w = lax.bitcast_convert_type(packed.reshape(K, T), jnp.uint32)
    shifts = jnp.arange(4, dtype=jnp.uint32) * 8
    e = (w[:, :, None] >> shifts) & 0xFF                        # [K, T, 4]
    e = e.transpose(1, 0, 2).reshape(T, K * 4)[:M, :groups]     # [M, groups]
    s = lax.bitcast_convert_type(e << 23, jnp.float32)
    return jnp.where(e == 0, jnp.float32(2.0 ** -127), s)


def dequantize_fp8(q, scale, *, group_size=None, out_dtype=None):
    """float8_e4m3fn [M, H] -> out_dtype (float32 by default) ``q * scale``.

    ``scale`` is one of:
      * per tensor: shape () or (1,) (static FP8: ``scale_factor`` itself, the divisor the
        kernel applied);
      * per token: shape (M, 1) float32 (dynamic FP8's ``scale_out``);
      * per token group: the packed int32 (K, T) buffer, with ``group_size`` given.
    """
    jnp = _jnp()
    if q.ndim != 2:
        raise ValueError(f"q must be [M, H], got shape {tuple(q.shape)}")
    if q.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"q must be float8_e4m3fn, got {q.dtype}")
    if scale is None:
        raise ValueError("a scale is required to dequantize FP8")
    M, H = q.shape
    qf = q.astype(jnp.float32)
    if group_size is not None:
        g = check_group_size(H, group_size)
        s = unpack_ue8m0_scales(scale, M, H, g)
        out = (qf.reshape(M, H // g, g) * s[:, :, None]).reshape(M, H)
    else:
        scale = jnp.asarray(scale)
        if scale.shape in ((), (1,)):
            s = scale.reshape(()).astype(jnp.float32)
        elif scale.shape == (M, 1):
            s = scale.astype(jnp.float32)
        else:
            raise ValueError(f"scale must have shape (), (1,) or ({M}, 1) (or pass group_size "
                             f"for packed group scales), got {tuple(scale.shape)}")
        out = qf * s
    return out.astype(out_dtype or jnp.float32)


def e2m1_to_float(codes):
    """4-bit e2m1 codes (uint8 values 0..15) -> float32."""
    jnp = _jnp()
    table = jnp.asarray(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), jnp.float32)
    return table[codes.astype(jnp.int32) & 0xF]


def unpack_fp4(packed):
    """uint8 [M, H/2] (two e2m1 per byte, element 2i low nibble) -> float32 [M, H]."""
    jnp = _jnp()
    if packed.dtype != jnp.uint8:
        raise ValueError(f"packed NVFP4 values must be uint8, got {packed.dtype}")
    lo = e2m1_to_float(packed & 0xF)
    hi = e2m1_to_float(packed >> 4)
    return jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def nvfp4_block_scales(scales, M, H, layout):
    """The scale buffer in ``layout`` -> float32 [M, H/16] (SF per row and block)."""
    jnp, lax = _jnp(), _lax()
    lay = as_layout(layout)
    shape = nvfp4_scale_shape(M, H, lay)
    if scales.dtype in (jnp.int32, jnp.uint32):
        scales = nvfp4_scales_as_fp8(scales.reshape(-1))
    elif scales.dtype == jnp.uint8:
        scales = lax.bitcast_convert_type(scales, jnp.float8_e4m3fn)
    if scales.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"NVFP4 scales must be float8_e4m3fn (or uint8/int32 views), got "
                         f"{scales.dtype}")
    if scales.size != shape[0] * shape[1]:
        raise ValueError(f"NVFP4 scale buffer for M={M}, H={H}, layout={lay.name} has shape "
                         f"{shape}, got {tuple(scales.shape)}")
    scales = scales.reshape(shape)
    if lay == QuantizationSFLayout.SWIZZLED_128x4:
        scales = unswizzle_128x4(scales, M, H)
    return scales.astype(jnp.float32)


def dequantize_nvfp4(packed, scales, global_scale, layout, M, H, *, out_dtype=None):
    """NVFP4 -> out_dtype (float32 default): ``x ~ e2m1(q) * float(SF) / global_scale`` with
    SF the block's e4m3 scale (the kernel's SF already includes global_scale)."""
    jnp = _jnp()
    M = _check_tokens(M)
    H = check_hidden_fp4(H)
    if tuple(packed.shape) != (M, H // 2):
        raise ValueError(f"packed NVFP4 values must have shape {(M, H // 2)}, got "
                         f"{tuple(packed.shape)}")
    gs = check_scalar_scale(global_scale, "global_scale")
    sf = nvfp4_block_scales(scales, M, H, layout)                  # [M, H/16]
    v = unpack_fp4(packed).reshape(M, H // NVFP4_BLOCK, NVFP4_BLOCK)
    out = (v * sf[:, :, None]) / gs
    return out.reshape(M, H).astype(out_dtype or jnp.float32)


def check_scalar_scale(scale, name: str):
    """A float32 array of shape () or (1,) -> float32 scalar (traceable). Python numbers are
    refused: the scale must be a runtime operand (a device array), as in the kernel, where it
    is read through a pointer so CUDA graphs stay valid when it changes."""
    jnp = _jnp()
    if scale is None:
        raise ValueError(f"{name} is required (a float32 array of shape () or (1,))")
    if isinstance(scale, (int, float, bool, np.number)) or not hasattr(scale, "dtype"):
        raise ValueError(f"{name} must be a float32 array of shape () or (1,) (a runtime "
                         f"operand, not a Python constant), got {type(scale).__name__}")
    if scale.dtype != jnp.float32:
        raise ValueError(f"{name} must have dtype float32, got {scale.dtype}")
    if tuple(scale.shape) not in ((), (1,)):
        raise ValueError(f"{name} must have shape () or (1,), got {tuple(scale.shape)}")
    return jnp.asarray(scale).reshape(())
