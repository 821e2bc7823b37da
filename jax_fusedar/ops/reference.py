"""The fused op's math in plain JAX, with the kernel's rounding points.

This is the lowering of every call the kernel does not serve (CPU, the xla backend, a call
the kernel cannot serve) and the yardstick the GPU tests compare against. Its all-reduce is
the call's fallback (``fallback_allreduce``, ``plan.FALLBACKS``): by default the psum
the user would have written, in the input's dtype (XLA's all-reduce, no more bytes than the
user's own); on request (``fallback="kernel_exact"``) the kernel's additions emulated
(``allreduce_sum``). Everything after the sum is the kernel's. The kernel (FlashInfer's
FusedOp, fp32 accumulation) computes, per token row:

    s   = T(sum over ranks of float(x_r))          all-reduce, rounded once to T (fp32_acc;
                                                   without it, rounded after every addition)
    r   = T(float(s) + float(residual))            residual add: second rounding
    inv = rsqrt(mean(float(r)^2) + eps)            in fp32
    y   = T(float(r) * inv * (weight_bias + float(gamma)))

so residual_out is within about an ulp of |s| + |residual| (not of |r|), and norm_out
inherits that through inv * gamma. With fp32_acc the summation order (psum's here, rank
order 0..N-1 in the kernel) differs only inside fp32: exact for 2 ranks of 16-bit values,
otherwise within (N - 1) * 2^-24 * sum(|x_r|), which under heavy cancellation can reach an
ulp or more of a small |s|.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..common.patterns import TRAITS, AllReduceFusionPattern


def rms_norm(r, rms_gamma, *, rms_eps: float, weight_bias: float, out_dtype, rounding=None):
    """RMSNorm of the rounded residual ``r`` exactly where the kernel rounds (fp32 inside);
    ``rounding``: as for ``residual_add``."""
    rounding = round_to if rounding is None else rounding
    r32 = r.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(r32 * r32, axis=-1, keepdims=True) + jnp.float32(rms_eps))
    scale = jnp.float32(weight_bias) + rms_gamma.astype(jnp.float32)
    return rounding((r32 * inv) * scale, out_dtype)


def epilogue(
    summed, residual, rms_gamma, *, pattern, rms_eps: float, weight_bias: float, rounding=None
):
    """Everything after the all-reduce, given the sum already rounded to the input dtype;
    ``rounding``: its two roundings to T (``roundings``; default ``round_to``).

    Returns (allreduce_out, residual_out, norm_out) with None for what the pattern does not
    produce.
    """
    traits = TRAITS[AllReduceFusionPattern(pattern)]
    if traits.has_allreduce_out:
        return summed, None, None
    dtype = summed.dtype
    r = residual_add(summed, residual, rounding=rounding)
    norm = rms_norm(
        r, rms_gamma, rms_eps=rms_eps, weight_bias=weight_bias, out_dtype=dtype, rounding=rounding
    )
    return None, r, norm


def residual_add(summed, residual, *, rounding=None):
    """T(float(summed) + float(residual)); ``rounding`` (default ``round_to``) is swapped for
    ``round_tangent`` to apply the same (linear) map to tangents (jax_fusedar/ops/transforms.py).

    With ``convert_to`` it is written as the add in T that unfused code writes: the same
    value (for a 16-bit T of p significand bits float32 has at least 2p + 2, so rounding the
    float32 sum to T rounds the exact sum, as T's own add does; for float32 it is that add),
    and XLA then treats it as the program's own add, excess precision included."""
    if rounding is convert_to:
        return summed + residual.astype(summed.dtype)
    rounding = round_to if rounding is None else rounding
    return rounding(summed.astype(jnp.float32) + residual.astype(jnp.float32), summed.dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def round_to(x32, dtype):
    """fp32 -> dtype with the rounding made explicit: XLA may otherwise keep excess
    precision inside a fusion and skip a rounding the kernel performs.

    Its derivative is that of ``x32.astype(dtype)`` (the tangent rounded to dtype, see
    ``round_tangent``), not the zero derivative of the subnormal branch's ``jnp.round``: the
    op's gradient is the unfused math's, and a rule linear in the tangent transposes."""
    info = jnp.finfo(dtype)
    rounded = jax.lax.reduce_precision(x32, info.nexp, info.nmant)
    if info.nexp < 8:
        # reduce_precision flushes float16 subnormals to zero; the kernel's conversion keeps
        # them, so round those to the subnormal grid (half to even, like the hardware).
        step = float(info.smallest_subnormal)
        rounded = jnp.where(
            jnp.abs(x32) < float(info.smallest_normal), jnp.round(x32 / step) * step, rounded
        )
    return rounded.astype(dtype)


def round_tangent(t32, dtype):
    """The tangent (and, transposed, cotangent) map of ``round_to``: linear, rounding fp32
    to dtype like ``astype`` (reduce_precision, so XLA cannot skip it; float16 subnormal
    tangents flush to zero there, where the values themselves are kept)."""
    info = jnp.finfo(dtype)
    return jax.lax.reduce_precision(t32, info.nexp, info.nmant).astype(dtype)


def convert_to(x32, dtype):
    """fp32 -> dtype as unfused code writes it: ``astype``, one conversion (its derivative
    the tangent's conversion). The same rounding as ``round_to`` (float16 subnormals kept
    alike) wherever XLA performs it; under XLA's default excess precision
    (``--xla_allow_excess_precision``) XLA may skip it, as it may in the code it stands for.
    Cheaper to compile than ``round_to``: no ``reduce_precision``, no subnormal branch."""
    return x32.astype(dtype)


def roundings(fallback: str):
    """(value rounding, tangent rounding) of a fallback's epilogue (``plan.FALLBACKS``):
    ``"xla_plain"`` writes them as unfused code does (``convert_to``; ``residual_add`` then
    adds in T), what ``fuse`` emits where no kernel serves a site; the others make them
    explicit (``round_to``, ``round_tangent``), the kernel's roundings whatever XLA's
    flags."""
    if fallback == "xla_plain":
        return convert_to, convert_to
    return round_to, round_tangent


@round_to.defjvp
def _round_to_jvp(dtype, primals, tangents):
    (x32,), (t32,) = primals, tangents
    return round_to(x32, dtype), round_tangent(t32, dtype)


def allreduce_sum(x, axis_name, *, fp32_acc: bool, rounding=None):
    """The kernel's all-reduce: with fp32_acc, the fp32 sum rounded once to x's dtype;
    without, ranks added in rank order 0..N-1 with a rounding after every addition.

    Linear in x but for ``round_to``'s subnormal branch; with ``rounding=round_tangent`` it
    is exactly this function's tangent map (what jax.jvp of it computes), applied to a
    tangent without recomputing the sum of the primal."""
    round_to_ = round_to if rounding is None else rounding
    if fp32_acc or x.dtype == jnp.float32:
        return round_to_(jax.lax.psum(x.astype(jnp.float32), axis_name), x.dtype)
    # Rank r's contribution alone, as an invariant value: a psum where every other rank
    # adds zeros is exact. (all_gather would do, but leaves the result marked per-rank.)
    me = jax.lax.axis_index(axis_name)
    x32 = x.astype(jnp.float32)

    def contribution(r):
        return jax.lax.psum(jnp.where(me == r, x32, 0.0), axis_name)

    acc = contribution(0)
    for r in range(1, jax.lax.axis_size(axis_name)):
        acc = round_to_(acc + contribution(r), x.dtype).astype(jnp.float32)
    return acc.astype(x.dtype)


def fallback_allreduce(x, axis_name, *, fallback: str, fp32_acc: bool, rounding=None):
    """The all-reduce of a call the kernel does not serve (``plan.FALLBACKS``), the one
    rule of the dense op, the MoE ops, their tangents and the plain-jit entry:

    * ``"xla"``: ``jax.lax.psum(x)`` in x's dtype, what unfused code writes: XLA's
      all-reduce, its bytes exactly those of the user's psum (docs/numerics.md bounds it);
      linear, so it is its own tangent map (``rounding`` does not apply);
    * ``"xla_plain"``: the same psum (what differs is its epilogue's roundings,
      ``roundings``);
    * ``"kernel_exact"``: ``allreduce_sum``, the kernel's additions (``fp32_acc``), at up to
      2 x world size times the bytes.
    """
    if fallback in ("xla", "xla_plain"):
        return jax.lax.psum(x, axis_name)
    if fallback != "kernel_exact":
        raise ValueError(f"unknown fallback {fallback!r}")  # plan.as_fallback checks it
    return allreduce_sum(x, axis_name, fp32_acc=fp32_acc, rounding=rounding)


def allreduce_fusion_reference(
    x,
    residual,
    rms_gamma,
    *,
    axis_name,
    pattern,
    rms_eps: float,
    weight_bias: float,
    fp32_acc: bool = True,
    fallback: str = "kernel_exact",
):
    """The whole op on one shard inside shard_map: the all-reduce (``fallback_allreduce``;
    by default the kernel's additions, this module being the kernel's math), then the
    epilogue."""
    summed = fallback_allreduce(x, axis_name, fallback=fallback, fp32_acc=fp32_acc)
    return epilogue(
        summed,
        residual,
        rms_gamma,
        pattern=pattern,
        rms_eps=rms_eps,
        weight_bias=weight_bias,
        rounding=roundings(fallback)[0],
    )
