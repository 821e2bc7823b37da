"""The MoE patterns' math in plain JAX, with FlashInfer's MoE kernels' rounding points.

FlashInfer's MoE epilogues (``trtllm_moe_allreduce_fusion.cuh``) compute, per token row and in
the call's 16-bit dtype T, with every product and sum done in fp32 and rounded to T where
the kernel stores into its T-typed accumulator:

pattern 6, ``kMoEReductionARResidualRMSNorm`` (E local experts, in order e = 0..E-1)::

    acc = 0
    acc = T(acc + T(float(expert_outputs[e, t]) * expert_scales[e, t]))   for each e
    acc = T(acc + token_input[t])

pattern 7, ``kMoEFinalizeARResidualRMSNorm`` (slots k = 0..top_k-1 in order)::

    acc = 0
    for each k with p = expanded_idx_to_permuted_idx[t, k] != -1:
        acc = T(acc + T(float(permuted_input[p]) * float(expert_scale_factor[t, k])))
              (without expert_scale_factor: acc = T(acc + permuted_input[p]))
    acc = T(acc * routed_scaling_factor)          only when the factor is not 1
    acc = T(acc + shared_expert_output[t])        only when given

then, for both, -0.0 becomes +0.0 (the Lamport protocol's empty marker), the all-reduce adds
the ranks' rows in rank order 0..N-1 rounding to T after every addition (no fp32
accumulation; emulated by ``fallback="kernel_exact"``, at 2 x world size times the bytes of
a psum: the default fallback is the psum in T, XLA's all-reduce, as unfused code writes it,
``reference.fallback_allreduce``), and the dense epilogue follows:
``residual_out = T(sum + residual)``,
``norm_out = T(residual_out * rsqrt(mean(residual_out^2) + eps) * (weight_bias + gamma))``
(``reference.residual_add`` and ``reference.rms_norm``). Pattern 6 can also return the
all-reduced sum (``allreduce_out``).

The kernel is built with ``--use_fast_math`` (FlashInfer's flags): its ``rsqrtf`` and the
mean's division are approximate and fp32 subnormals flush to zero, so norm_out agrees with
this reference within a few ulps (the GPU tests state the bound), not bit for bit; the rows
before the norm agree exactly for normal values.

An index outside ``[-1, num_permuted_rows)`` is the caller's error (the kernel would read
outside ``permuted_input``): the Python entry points refuse concrete ones, and this reference
treats any such slot as dropped, so it never reads out of bounds.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

from ..common.patterns import AllReduceFusionPattern
from . import reference
from .reference import round_to


def _add(a, b, dtype):
    """T(float(a) + float(b)): the kernel's vec_add and its T-typed ``+=``."""
    return round_to(a.astype(jnp.float32) + b.astype(jnp.float32), dtype)


def _scaled(rows, scale, dtype):
    """T(float(rows) * scale): an fp32 product rounded to T, as the kernel's static_cast<T>."""
    return round_to(rows.astype(jnp.float32) * scale.astype(jnp.float32), dtype)


def positive_zero(x):
    """-0.0 -> +0.0 (the kernels' remove_neg_zero before the Lamport store). A select, not
    ``x + 0``, which XLA may simplify away."""
    return jnp.where(x == 0, jnp.zeros_like(x), x)


def moe_reduction_local(expert_outputs, expert_scales, token_input):
    """Pattern 6's per-rank row: the scaled sum over local experts plus the token input.

    ``expert_outputs`` [E, T, H] (dtype T), ``expert_scales`` [E, T] float32, ``token_input``
    [T, H]: returns [T, H] of dtype T."""
    dtype = token_input.dtype

    def body(acc, e):
        rows, scale = e
        return _add(acc, _scaled(rows, scale[:, None], dtype), dtype), None

    # The kernel's accumulator starts at +0: 0 + the first term (a -0.0 term becomes +0.0).
    first = _add(
        jnp.zeros((), dtype), _scaled(expert_outputs[0], expert_scales[0][:, None], dtype), dtype
    )
    acc, _ = jax.lax.scan(body, first, (expert_outputs[1:], expert_scales[1:]))
    return _add(acc, token_input, dtype)


def moe_finalize_local(
    permuted_input,
    expanded_idx_to_permuted_idx,
    *,
    expert_scale_factor=None,
    shared_expert_output=None,
    routed_scaling_factor: float = 1.0,
):
    """Pattern 7's per-rank row: the gather of each token's top_k rows, scaled and summed,
    times ``routed_scaling_factor``, plus the shared expert.

    ``permuted_input`` [P, H], ``expanded_idx_to_permuted_idx`` int32 [T, K] (-1 = dropped),
    ``expert_scale_factor`` [T, K] of dtype T or None, ``shared_expert_output`` [T, H] or
    None: returns [T, H] of dtype T."""
    dtype = permuted_input.dtype
    idx = expanded_idx_to_permuted_idx
    tokens, top_k = idx.shape
    rows_available = permuted_input.shape[0]
    acc = jnp.zeros((tokens, permuted_input.shape[1]), dtype)
    for k in range(top_k):  # top_k is small (<= 8 in practice) and the order matters
        p = idx[:, k]
        valid = (p >= 0) & (p < rows_available)
        rows = jnp.take(permuted_input, jnp.where(valid, p, 0), axis=0)
        if expert_scale_factor is not None:
            rows = _scaled(rows, expert_scale_factor[:, k, None], dtype)
        acc = jnp.where(valid[:, None], _add(acc, rows, dtype), acc)
    if float(routed_scaling_factor) != 1.0:
        acc = round_to(acc.astype(jnp.float32) * jnp.float32(routed_scaling_factor), dtype)
    if shared_expert_output is not None:
        acc = _add(acc, shared_expert_output, dtype)
    return acc


def moe_epilogue(
    local,
    residual,
    rms_gamma,
    *,
    axis_name,
    rms_eps: float,
    weight_bias: float,
    fallback: str = "kernel_exact",
):
    """The all-reduce of the per-rank rows (``reference.fallback_allreduce``; by default the
    kernel's: rank order, rounded after every addition) and the dense epilogue: returns
    (allreduce_out, residual_out, norm_out)."""
    summed = reference.fallback_allreduce(
        positive_zero(local), axis_name, fallback=fallback, fp32_acc=False
    )
    _, residual_out, norm_out = reference.epilogue(
        summed,
        residual,
        rms_gamma,
        pattern=AllReduceFusionPattern.kARResidualRMSNorm,
        rms_eps=rms_eps,
        weight_bias=weight_bias,
        rounding=reference.roundings(fallback)[0],
    )
    return summed, residual_out, norm_out


def moe_reduction_reference(
    expert_outputs,
    expert_scales,
    token_input,
    residual,
    rms_gamma,
    *,
    axis_name,
    rms_eps: float = 1e-6,
    weight_bias: float = 0.0,
):
    """Pattern 6 on one shard inside shard_map: (allreduce_out, residual_out, norm_out)."""
    local = moe_reduction_local(expert_outputs, expert_scales, token_input)
    return moe_epilogue(
        local, residual, rms_gamma, axis_name=axis_name, rms_eps=rms_eps, weight_bias=weight_bias
    )


def moe_finalize_reference(
    permuted_input,
    expanded_idx_to_permuted_idx,
    residual,
    rms_gamma,
    *,
    axis_name,
    expert_scale_factor=None,
    shared_expert_output=None,
    routed_scaling_factor: float = 1.0,
    rms_eps: float = 1e-6,
    weight_bias: float = 0.0,
):
    """Pattern 7 on one shard inside shard_map: (residual_out, norm_out)."""
    local = moe_finalize_local(
        permuted_input,
        expanded_idx_to_permuted_idx,
        expert_scale_factor=expert_scale_factor,
        shared_expert_output=shared_expert_output,
        routed_scaling_factor=routed_scaling_factor,
    )
    _, residual_out, norm_out = moe_epilogue(
        local, residual, rms_gamma, axis_name=axis_name, rms_eps=rms_eps, weight_bias=weight_bias
    )
    return residual_out, norm_out
