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

Framework-neutral (never imports jax or torch): the JAX primitive, the FFI handler's operand
list and the torch layer share these shapes. The JAX array helpers that (de)quantize these
layouts are in ``jax_fusedar.ops.quant_arrays``.
"""

from __future__ import annotations

import operator

import numpy as np

from . import arguments, limits
from .patterns import QuantizationSFLayout

FP8_E4M3_MAX = 448.0
E2M1_MAX = 6.0
NVFP4_BLOCK = 16  # CVT_FP4_SF_VEC_SIZE: elements per NVFP4 scale
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude codes 0..7


# ----------------------------------------------------------------------------- validation


def _as_dim(value, name: str) -> int:
    """``value`` as an int size; a symbolic size (``arguments.is_symbolic``) is returned as
    it is, unchecked: ``operator.index`` would fix it to one value (under torch.compile with
    a dynamic token count, a ConstraintViolationError), and the run checks the real size."""
    if arguments.is_symbolic(value):
        return value
    try:  # operator.index: ints and numpy ints, never 64.0
        if isinstance(value, (bool, np.bool_)):
            raise TypeError
        v = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {value!r}") from None
    return v


def check_tokens(M) -> int:
    M = _as_dim(M, "num_tokens (M)")
    # 0 tokens: empty buffers of the same layout (a call of 0 tokens is served).
    if not arguments.is_symbolic(M) and M < 0:
        raise ValueError(f"num_tokens (M) must be >= 0, got {M}")
    return M


def check_hidden_fp4(H) -> int:
    H = _as_dim(H, "hidden_dim (H)")
    if not arguments.is_symbolic(H) and (H < 1 or H % NVFP4_BLOCK):
        raise ValueError(
            f"NVFP4 needs hidden_dim divisible by {NVFP4_BLOCK} (one e4m3 scale per 16 "
            f"elements), got {H}"
        )
    return H


def check_group_size(H, group_size) -> int:
    """Validates a per-token-group size against hidden_dim; returns it as an int."""
    H = _as_dim(H, "hidden_dim (H)")
    if group_size is None:
        raise ValueError(
            "group_size (block_quant_group_size) is required for the "
            "per-token-group FP8 patterns (8/9)"
        )
    g = _as_dim(group_size, "group_size")
    if arguments.is_symbolic(H) or arguments.is_symbolic(g):
        return g  # checked by the run, on the real sizes (_as_dim)
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
    vec = limits.vector_width(dtype_name)
    if arguments.is_symbolic(g):
        return g  # checked by the run (check_group_size)
    if g < vec or g > 32 * vec or g & (g - 1):
        raise ValueError(
            f"block_quant_group_size must be a power of two from {vec} to "
            f"{32 * vec} for {dtype_name}, got {g}"
        )
    return g


def as_layout(layout) -> QuantizationSFLayout:
    """Validates an NVFP4 scale layout code. SWIZZLED_8x4 (1) is refused: the kernel's
    offset function returns nullptr for it, so it writes no scales at all."""
    lay = None
    if arguments.is_int(layout):  # 2.7 or "2" are refused, not truncated to LINEAR
        lay = next((q for q in QuantizationSFLayout if q.value == int(layout)), None)
    if lay is None:
        raise ValueError(
            f"unknown NVFP4 scale layout (layout_code) {layout!r}; valid: 0 "
            "(SWIZZLED_128x4), 2 (LINEAR), as a QuantizationSFLayout or an int"
        )
    if lay == QuantizationSFLayout.SWIZZLED_8x4:
        raise ValueError(
            "QuantizationSFLayout.SWIZZLED_8x4 (1) is not implemented by the "
            "fused all-reduce kernel (it writes no scales); use SWIZZLED_128x4 (0) "
            "or LINEAR (2)"
        )
    return lay


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


# ----------------------------------------------------------------------------- shapes


def group_scale_buffer_shape(M, H, group_size) -> tuple:
    """Shape ``(K, T)`` of the dense int32 buffer holding per-token-group UE8M0 scales:
    ``K = ceil((H/g)/4)`` packs of 4 exponent bytes, ``T = round_up(M, 4)`` (tma_aligned_mn).
    FlashInfer's tensor is the view ``buf[:, :M].T`` (shape (M, K), strides (1, T))."""
    M = check_tokens(M)
    g = check_group_size(H, group_size)
    groups = _as_dim(H, "hidden_dim (H)") // g  # symbolic sizes stay symbolic
    return ((groups + 3) // 4, round_up(M, 4))


def group_scale_min_storage_words(M, H, group_size) -> int:
    """int32 words FlashInfer's strided (M, K) tensor spans: ``(K-1)*T + M``."""
    K, T = group_scale_buffer_shape(M, H, group_size)
    return (K - 1) * T + int(M)


def nvfp4_scale_shape(M, H, layout) -> tuple:
    """2-D shape of the NVFP4 scale buffer, in float8_e4m3fn (byte) units:
    SWIZZLED_128x4 -> (round_up(M,128), round_up(H/16,4)); LINEAR -> (M, H/16)."""
    M = check_tokens(M)
    H = check_hidden_fp4(H)
    lay = as_layout(layout)
    k = H // NVFP4_BLOCK
    if lay == QuantizationSFLayout.SWIZZLED_128x4:
        return (round_up(M, 128), round_up(k, 4))
    return (M, k)


def nvfp4_scale_buffer_size(M, H, layout) -> int:
    """Bytes (= e4m3 elements) of the NVFP4 scale buffer: round_up(M,128)*round_up(H/16,4)
    for SWIZZLED_128x4 (FlashInfer's compute_fp4_swizzled_layout_sf_size), M*H/16 for LINEAR."""
    r, c = nvfp4_scale_shape(M, H, layout)
    return r * c


def nvfp4_quant_shape(M, H) -> tuple:
    """Shape of the packed NVFP4 values: uint8 (M, H/2)."""
    return (check_tokens(M), check_hidden_fp4(H) // 2)


def swizzled_128x4_offset(m, k, H):
    """Byte offset of the scale of row ``m``, 16-element block ``k`` in the SWIZZLED_128x4
    layout (ARF get_sf_out_offset_128x4, numRows unset, batch 0):

        ((m // 128) * ceil(H / 64) + k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4

    ``m`` and ``k`` may be Python ints or integer numpy arrays (broadcast)."""
    H = _as_dim(H, "hidden_dim (H)")
    num_k_tiles = (H + 63) // 64
    m = np.asarray(m, dtype=np.int64) if not isinstance(m, int) else m
    k = np.asarray(k, dtype=np.int64) if not isinstance(k, int) else k
    return ((m // 128) * num_k_tiles + k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4


def linear_offset(m, k, H):
    """Byte offset of scale (m, k) in the LINEAR layout: m * H/16 + k."""
    return m * (_as_dim(H, "hidden_dim (H)") // NVFP4_BLOCK) + k
