"""JAX array helpers for the quantized outputs' layouts (``common.quant_layouts`` describes
them): NVFP4 scale swizzling, bit casts, and dequantization back to float32.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..common.quant_layouts import (
    E2M1_VALUES,
    NVFP4_BLOCK,
    QuantizationSFLayout,
    as_layout,
    check_group_size,
    check_hidden_fp4,
    check_tokens,
    group_scale_buffer_shape,
    nvfp4_scale_shape,
    round_up,
)


def swizzle_128x4(sf):
    """[M, H/16] scales (any 1-byte dtype) -> (round_up(M,128), round_up(H/16,4)) in the
    SWIZZLED_128x4 byte order; padding filled with zeros (the kernel leaves it unwritten)."""
    M, k = sf.shape
    Mp, kp = round_up(M, 128), round_up(k, 4)
    x = jnp.pad(sf, ((0, Mp - M), (0, kp - k)))
    # row m = mt*128 + inner*32 + outer, column k = kt*4 + kk; offset order (mt, kt, outer,
    # inner, kk)
    x = x.reshape(Mp // 128, 4, 32, kp // 4, 4).transpose(0, 3, 2, 1, 4)
    return x.reshape(Mp, kp)


def unswizzle_128x4(buf, M, H):
    """Inverse of swizzle_128x4: the (round_up(M,128), round_up(H/16,4)) buffer (or its flat
    bytes) -> [M, H/16]."""
    M = check_tokens(M)
    H = check_hidden_fp4(H)
    k = H // NVFP4_BLOCK
    Mp, kp = round_up(M, 128), round_up(k, 4)
    if buf.size != Mp * kp:
        raise ValueError(
            f"SWIZZLED_128x4 scale buffer for M={M}, H={H} has {Mp * kp} bytes, "
            f"got an array of shape {tuple(buf.shape)}"
        )
    x = buf.reshape(Mp // 128, kp // 4, 32, 4, 4).transpose(0, 3, 2, 1, 4)
    return x.reshape(Mp, kp)[:M, :k]


def nvfp4_scales_as_int32(x):
    """View e4m3 scale bytes (float8_e4m3fn or uint8, shape [..., C], C % 4 == 0) as the int32
    words vLLM stores (shape [..., C/4]; byte 4j+i is bits 8i..8i+7 of word j, little-endian as
    on the GPU). lax.bitcast_convert_type: free in XLA. For SWIZZLED_128x4 C = round_up(H/16,4)
    is always a multiple of 4; LINEAR (C = H/16) needs H % 64 == 0."""
    if x.dtype not in (jnp.float8_e4m3fn, jnp.uint8, jnp.int8):
        raise ValueError(f"expected float8_e4m3fn/uint8 scale bytes, got {x.dtype}")
    if x.ndim < 1 or x.shape[-1] % 4:
        raise ValueError(
            f"the last dimension must be a multiple of 4 to view as int32, got "
            f"shape {tuple(x.shape)}"
        )
    return lax.bitcast_convert_type(x.reshape(*x.shape[:-1], x.shape[-1] // 4, 4), jnp.int32)


def nvfp4_scales_as_fp8(x):
    """Inverse of nvfp4_scales_as_int32: int32 (or uint32) [..., W] -> float8_e4m3fn [..., 4W]."""
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
    K, T = group_scale_buffer_shape(M, H, group_size)
    M = int(M)
    groups = int(H) // int(group_size)
    if packed.dtype not in (jnp.int32, jnp.uint32):
        raise ValueError(f"packed group scales must be int32, got {packed.dtype}")
    if packed.size != K * T:
        raise ValueError(
            f"packed group scales for M={M}, H={H}, group_size={group_size} need "
            f"shape {(K, T)} ({K * T} words), got {tuple(packed.shape)}"
        )
    w = lax.bitcast_convert_type(packed.reshape(K, T), jnp.uint32)
    shifts = jnp.arange(4, dtype=jnp.uint32) * 8
    e = (w[:, :, None] >> shifts) & 0xFF  # [K, T, 4]
    e = e.transpose(1, 0, 2).reshape(T, K * 4)[:M, :groups]  # [M, groups]
    s = lax.bitcast_convert_type(e << 23, jnp.float32)
    return jnp.where(e == 0, jnp.float32(2.0**-127), s)


def dequantize_fp8(q, scale, *, group_size=None, out_dtype=None):
    """float8_e4m3fn [M, H] -> out_dtype (float32 by default) ``q * scale``.

    ``scale`` is one of:
      * per tensor: shape () or (1,) (static FP8: ``scale_factor`` itself, the divisor the
        kernel applied);
      * per token: shape (M, 1) float32 (dynamic FP8's ``scale_out``);
      * per token group: the packed int32 (K, T) buffer, with ``group_size`` given.
    """
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
            raise ValueError(
                f"scale must have shape (), (1,) or ({M}, 1) (or pass group_size "
                f"for packed group scales), got {tuple(scale.shape)}"
            )
        out = qf * s
    return out.astype(out_dtype or jnp.float32)


def e2m1_to_float(codes):
    """4-bit e2m1 codes (uint8 values 0..15) -> float32."""
    table = jnp.asarray(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), jnp.float32)
    return table[codes.astype(jnp.int32) & 0xF]


def unpack_fp4(packed):
    """uint8 [M, H/2] (two e2m1 per byte, element 2i low nibble) -> float32 [M, H]."""
    if packed.dtype != jnp.uint8:
        raise ValueError(f"packed NVFP4 values must be uint8, got {packed.dtype}")
    lo = e2m1_to_float(packed & 0xF)
    hi = e2m1_to_float(packed >> 4)
    return jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def nvfp4_block_scales(scales, M, H, layout):
    """The scale buffer in ``layout`` -> float32 [M, H/16] (SF per row and block)."""
    lay = as_layout(layout)
    shape = nvfp4_scale_shape(M, H, lay)
    if scales.dtype in (jnp.int32, jnp.uint32):
        scales = nvfp4_scales_as_fp8(scales.reshape(-1))
    elif scales.dtype == jnp.uint8:
        scales = lax.bitcast_convert_type(scales, jnp.float8_e4m3fn)
    if scales.dtype != jnp.float8_e4m3fn:
        raise ValueError(
            f"NVFP4 scales must be float8_e4m3fn (or uint8/int32 views), got {scales.dtype}"
        )
    if scales.size != shape[0] * shape[1]:
        raise ValueError(
            f"NVFP4 scale buffer for M={M}, H={H}, layout={lay.name} has shape "
            f"{shape}, got {tuple(scales.shape)}"
        )
    scales = scales.reshape(shape)
    if lay == QuantizationSFLayout.SWIZZLED_128x4:
        scales = unswizzle_128x4(scales, M, H)
    return scales.astype(jnp.float32)


def dequantize_nvfp4(packed, scales, global_scale, layout, M, H, *, out_dtype=None):
    """NVFP4 -> out_dtype (float32 default): ``x ~ e2m1(q) * float(SF) / global_scale`` with
    SF the block's e4m3 scale (the kernel's SF already includes global_scale)."""
    M = check_tokens(M)
    H = check_hidden_fp4(H)
    if tuple(packed.shape) != (M, H // 2):
        raise ValueError(
            f"packed NVFP4 values must have shape {(M, H // 2)}, got {tuple(packed.shape)}"
        )
    gs = check_scalar_scale(global_scale, "global_scale")
    sf = nvfp4_block_scales(scales, M, H, layout)  # [M, H/16]
    v = unpack_fp4(packed).reshape(M, H // NVFP4_BLOCK, NVFP4_BLOCK)
    out = (v * sf[:, :, None]) / gs
    return out.reshape(M, H).astype(out_dtype or jnp.float32)


def check_scalar_scale(scale, name: str):
    """A float32 array of shape () or (1,) -> float32 scalar (traceable). Python numbers are
    refused: the scale must be a runtime operand (a device array), as in the kernel, where it
    is read through a pointer so CUDA graphs stay valid when it changes."""
    if scale is None:
        raise ValueError(f"{name} is required (a float32 array of shape () or (1,))")
    if isinstance(scale, (int, float, bool, np.number)) or not hasattr(scale, "dtype"):
        raise ValueError(
            f"{name} must be a float32 array of shape () or (1,) (a runtime "
            f"operand, not a Python constant), got {type(scale).__name__}"
        )
    if scale.dtype != jnp.float32:
        raise ValueError(f"{name} must have dtype float32, got {scale.dtype}")
    if tuple(scale.shape) not in ((), (1,)):
        raise ValueError(f"{name} must have shape () or (1,), got {tuple(scale.shape)}")
    return jnp.asarray(scale).reshape(())
