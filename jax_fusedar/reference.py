"""The fused op's math in plain JAX, with the kernel's rounding points.

This is the lowering on every platform without the kernel (CPU, or a call the kernel
cannot serve) and the yardstick the GPU tests compare against. The kernel (FlashInfer's
FusedOp, fp32 accumulation) computes, per token row:

    s   = T(sum over ranks of float(x_r))          all-reduce, rounded once to T
    r   = T(float(s) + float(residual))            residual add: second rounding
    inv = rsqrt(mean(float(r)^2) + eps)            in fp32
    y   = T(float(r) * inv * (weight_bias + float(gamma)))

so residual_out is within about an ulp of |s| + |residual| (not of |r|), and norm_out
inherits that through inv * gamma. The all-reduce order differs (psum's vs the kernel's
rank order 0..N-1) only inside fp32, far below T's precision.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .patterns import TRAITS, AllReduceFusionPattern


def rms_norm(r, rms_gamma, *, rms_eps: float, weight_bias: float, out_dtype):
    """RMSNorm of the rounded residual ``r`` exactly where the kernel rounds (fp32 inside)."""
    r32 = r.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(r32 * r32, axis=-1, keepdims=True) + jnp.float32(rms_eps))
    scale = jnp.float32(weight_bias) + rms_gamma.astype(jnp.float32)
    return ((r32 * inv) * scale).astype(out_dtype)


def epilogue(summed, residual, rms_gamma, *, pattern, rms_eps: float, weight_bias: float):
    """Everything after the all-reduce, given the sum already rounded to the input dtype.

    Returns (allreduce_out, residual_out, norm_out) with None for what the pattern does not
    produce.
    """
    traits = TRAITS[AllReduceFusionPattern(pattern)]
    if traits.has_allreduce_out:
        return summed, None, None
    dtype = summed.dtype
    r = (summed.astype(jnp.float32) + residual.astype(jnp.float32)).astype(dtype)
    norm = rms_norm(r, rms_gamma, rms_eps=rms_eps, weight_bias=weight_bias, out_dtype=dtype)
    return None, r, norm


def allreduce_fusion_reference(x, residual, rms_gamma, *, axis_name, pattern, rms_eps: float,
                               weight_bias: float):
    """The whole op on one shard inside shard_map: psum in fp32, then the epilogue."""
    summed = jax.lax.psum(x.astype(jnp.float32), axis_name).astype(x.dtype)
    return epilogue(summed, residual, rms_gamma, pattern=pattern, rms_eps=rms_eps,
                    weight_bias=weight_bias)
