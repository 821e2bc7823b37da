"""FlashInfer's MoE epilogues for JAX: the expert combine fused with the all-reduce, residual
add and RMSNorm (patterns 6 and 7), inside ``jax.shard_map``, on the workspace of
``create_allreduce_fusion_workspace``.

* ``moe_reduction_allreduce_fusion`` (pattern 6, ``kMoEReductionARResidualRMSNorm``): each
  rank holds its local experts' outputs for every token, ``expert_outputs`` [E, ..., H], their
  router weights ``expert_scales`` float32 [E, ...] and a per-token input ``token_input``
  [..., H] (e.g. a shared expert's or FC2's partial sum); the fused op sums
  ``expert_scales * expert_outputs`` over the local experts, adds ``token_input``, all-reduces
  over ``axis_name``, adds ``residual`` and applies RMSNorm.
* ``moe_finalize_allreduce_fusion`` (pattern 7, ``kMoEFinalizeARResidualRMSNorm``): each rank
  holds the permuted, padded expert rows ``permuted_input`` [P, H] of its experts and the map
  ``expanded_idx_to_permuted_idx`` int32 [..., top_k] (-1 = dropped, e.g. a token routed to
  another rank's expert, or over capacity); the fused op gathers each token's rows, scales
  them by ``expert_scale_factor`` [..., top_k] (the router weights, x's dtype) and sums them,
  multiplies by ``routed_scaling_factor``, adds ``shared_expert_output`` [..., H], then
  all-reduces, adds ``residual`` and applies RMSNorm.

Both return ``MoeAllReduceFusionOutputs(allreduce_out, residual_out, norm_out)``
(``allreduce_out`` only for pattern 6 with ``return_allreduce_out=True``), invariant over
``axis_name`` like ``psum``. The math and its rounding points are in ``moe_reference.py``,
the two ops (``family.FfiOp``) below.

Kernel or reference is decided at trace time from shapes, dtype and the workspace (as for
``allreduce_fusion``): the kernels run on 16-bit inputs, one-shot only (every token's row of
every rank must fit one Lamport buffer), hidden a multiple of 256; other calls, and every
call on CPU, run the reference lowering (logged once per kind of reason; ``strict`` raises),
whose all-reduce is the psum in the rows' dtype unless ``fallback="kernel_exact"``.

Index values: concrete ``expanded_idx_to_permuted_idx`` outside ``[-1, P)`` raise. Traced
ones cannot be checked at trace time; the op maps any such slot to -1 (dropped) before the
kernel sees it, so a bad index never reads outside ``permuted_input`` and the kernel and the
reference agree.

Transformations: ``jax.grad``/``jvp``/``vjp`` (the tangent is that of the reference math,
``jax.jvp`` of ``moe_reference``; the index map gets none); ``jax.vmap`` folds the batch into
tokens (pattern 7 offsets each element's indices into the stacked permuted rows); a batched
``rms_gamma`` runs one call per element.

The two ops behind them, the MoE entries of the op family (``family.FfiOp``), call one XLA
FFI handler (``jax_fusedar_moe_allreduce_fusion_v1``, ffi/xla/moe_allreduce_fusion.cc),
which checks the operand lists below, in this order:

* reduction: expert_scales float32 [E, M], expert_outputs [E, M, H], token_input [M, H],
  residual [M, H], rms_gamma [H];
* finalize: permuted_input [P, H], expanded_idx_to_permuted_idx int32 [M, top_k], residual
  [M, H], rms_gamma [H], then expert_scale_factor [M, top_k] and shared_expert_output [M, H]
  when given.

Results: residual_out, norm_out [M, H] (+ allreduce_out for the reduction when asked). The
residual is updated in place into residual_out, as for the dense op (each element is read
and written by the same thread). The math and its rounding points are in
``moe_reference.py`` (its all-reduce, where the kernel does not serve a call, is the call's
fallback: the psum in the rows' dtype unless ``fallback="kernel_exact"``); the JVP is the
tangent map of that math (``family.reference_jvp``); ``jax.vmap`` folds the batch into
tokens (the finalize offsets each element's indices into the stacked permuted rows), and a
batched ``rms_gamma`` runs one call per element.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..common import arguments, backend_choice, moe_limits
from ..common.patterns import AllReduceFusionPattern
from ..workspace import AllReduceFusionWorkspace
from . import moe_reference
from .checks import (
    as_gamma,
    as_residual,
    check_call_on_workspace,
    check_concrete_shape,
    check_operand,
    check_workspace,
)
from .family import FfiOp
from .plan import as_fallback, plan_moe

REDUCTION = int(AllReduceFusionPattern.kMoEReductionARResidualRMSNorm)
FINALIZE = int(AllReduceFusionPattern.kMoEFinalizeARResidualRMSNorm)

# --- the two ops: their reference math and attributes (the rest from the pattern table) -------


def _epilogue(local, residual, rms_gamma, axis_name, rms_eps, weight_bias, allreduce_out, fallback):
    summed, residual_out, norm_out = moe_reference.moe_epilogue(
        local,
        residual,
        rms_gamma,
        axis_name=axis_name[0],
        rms_eps=rms_eps,
        weight_bias=weight_bias,
        fallback=fallback,
    )
    return [residual_out, norm_out] + ([summed] if allreduce_out else [])


def _attributes(
    pattern,
    rms_eps,
    weight_bias,
    routed_scaling_factor=1.0,
    has_expert_scale=False,
    has_shared_expert=False,
    allreduce_out=False,
):
    return dict(
        pattern=np.int32(pattern),
        rms_eps=np.float32(rms_eps),
        weight_bias=np.float32(weight_bias),
        routed_scaling_factor=np.float32(routed_scaling_factor),
        has_expert_scale=bool(has_expert_scale),
        has_shared_expert=bool(has_shared_expert),
        allreduce_out=bool(allreduce_out),
    )


def _reduction_reference(
    *,
    expert_scales,
    expert_outputs,
    token_input,
    residual,
    rms_gamma,
    axis_name,
    rms_eps,
    weight_bias,
    allreduce_out,
    fallback,
):
    local = moe_reference.moe_reduction_local(expert_outputs, expert_scales, token_input)
    return _epilogue(
        local, residual, rms_gamma, axis_name, rms_eps, weight_bias, allreduce_out, fallback
    )


def _finalize_reference(
    *,
    permuted_input,
    expanded_idx_to_permuted_idx,
    residual,
    rms_gamma,
    expert_scale_factor=None,
    shared_expert_output=None,
    axis_name,
    rms_eps,
    weight_bias,
    routed_scaling_factor,
    has_expert_scale,
    has_shared_expert,
    fallback,
):
    del has_expert_scale, has_shared_expert  # which operands there are: given or None here
    local = moe_reference.moe_finalize_local(
        permuted_input,
        expanded_idx_to_permuted_idx,
        expert_scale_factor=expert_scale_factor,
        shared_expert_output=shared_expert_output,
        routed_scaling_factor=routed_scaling_factor,
    )
    return _epilogue(local, residual, rms_gamma, axis_name, rms_eps, weight_bias, False, fallback)


moe_reduction_op = FfiOp(
    "jax_fusedar_moe_reduction_allreduce_fusion",
    target="moe_allreduce_fusion",
    public_name="jax_fusedar.moe_reduction_allreduce_fusion",
    pattern=REDUCTION,
    reference=_reduction_reference,
    attributes=lambda **p: _attributes(REDUCTION, **p),
)
moe_finalize_op = FfiOp(
    "jax_fusedar_moe_finalize_allreduce_fusion",
    target="moe_allreduce_fusion",
    public_name="jax_fusedar.moe_finalize_allreduce_fusion",
    pattern=FINALIZE,
    reference=_finalize_reference,
    attributes=lambda **p: _attributes(FINALIZE, **p),
)
FFI_TARGET = moe_reduction_op.target

# The MoE kernels' rule, one for JAX, torch and the native launch (common/moe_limits.py).
kernel_problem = moe_limits.kernel_problem


class MoeAllReduceFusionOutputs(NamedTuple):
    allreduce_out: Optional[jax.Array]
    residual_out: jax.Array
    norm_out: jax.Array


def _check_call_context(workspace, axis_name, dtype_name):
    check_workspace(workspace, axis_name)
    if dtype_name not in moe_limits.MOE_DTYPES:
        raise ValueError(
            f"the MoE patterns take bfloat16 or float16 rows (FlashInfer's MoE "
            f"kernels exist for those only), got {dtype_name}"
        )
    check_call_on_workspace(
        workspace, axis_name, dtype_name, op="the MoE all-reduce fusion", dtype_of="the rows have"
    )


def _options(rms_eps, weight_bias, strict, fallback):
    return (
        arguments.as_float32("rms_eps", rms_eps, minimum=0.0),
        arguments.as_float32("weight_bias", weight_bias),
        backend_choice.strict_mode(strict),
        as_fallback(fallback),
    )


def _bind(op, operands, *, lead, hidden, workspace, axis_name, strict, fallback, **params):
    """Plans the call (``plan_moe``), binds ``op`` with its ``operands`` by name and names
    its results, back to the index map's leading dims."""
    plan, decided = plan_moe(
        workspace,
        op.pattern_of(params),
        (*lead, hidden),
        strict=strict,
        allreduce_out=params.get("allreduce_out", False),
        fallback=fallback,
    )
    outs = op.call(
        operands, workspace=workspace, axis_name=axis_name, plan=plan, decided=decided, **params
    )
    named = {name: o.reshape(*lead, hidden) for name, o in outs.items()}
    return MoeAllReduceFusionOutputs(**{f: named.get(f) for f in MoeAllReduceFusionOutputs._fields})


def moe_reduction_allreduce_fusion(
    expert_outputs,
    expert_scales,
    token_input,
    *,
    axis_name: str,
    workspace: AllReduceFusionWorkspace,
    residual=None,
    rms_gamma=None,
    rms_eps: float = 1e-6,
    weight_bias: float = 0.0,
    return_allreduce_out: bool = False,
    strict: Optional[bool] = None,
    fallback: str = "xla",
) -> MoeAllReduceFusionOutputs:
    """Pattern 6 (``kMoEReductionARResidualRMSNorm``) on this rank's shard, inside shard_map.

    ``expert_outputs`` [E, ..., H] (bfloat16/float16, E >= 1 local experts), ``expert_scales``
    float32 [E, ...] (FlashInfer's ``moe_reduction_scale_input``; expert-major, as the kernel
    reads it), ``token_input`` [..., H]; ``residual`` [..., H] (zeros when None),
    ``rms_gamma`` [H] (x's dtype or float32, rounded to it). Returns
    ``MoeAllReduceFusionOutputs(allreduce_out, residual_out, norm_out)``, ``allreduce_out``
    (the all-reduced combine, FlashInfer's ``output=``) only with
    ``return_allreduce_out=True``. ``fallback``: what a call the kernel does not serve
    computes, as for ``allreduce_fusion`` (``"xla"``: the combine all-reduced in its dtype;
    ``"kernel_exact"``: the kernel's rank-order additions, one float32 psum per rank)."""
    rms_eps, weight_bias, strict, fallback = _options(rms_eps, weight_bias, strict, fallback)
    return_allreduce_out = arguments.as_bool("return_allreduce_out", return_allreduce_out)
    token_input = jnp.asarray(token_input)
    expert_outputs, expert_scales = jnp.asarray(expert_outputs), jnp.asarray(expert_scales)
    if token_input.ndim < 2:
        raise ValueError(
            f"token_input must be [..., hidden] with at least one token dim, got "
            f"shape {token_input.shape}"
        )
    check_concrete_shape("token_input", token_input.shape, "the MoE all-reduce fusion")
    dtype_name = np.dtype(token_input.dtype).name
    _check_call_context(workspace, axis_name, dtype_name)
    lead, hidden = token_input.shape[:-1], token_input.shape[-1]
    if expert_outputs.ndim != token_input.ndim + 1 or expert_outputs.shape[0] < 1:
        raise ValueError(
            f"expert_outputs must be [experts >= 1, *{list(token_input.shape)}] "
            f"(token_input's shape after the expert dim), got "
            f"{expert_outputs.shape}"
        )
    experts = expert_outputs.shape[0]
    check_operand("expert_outputs", expert_outputs, (experts, *lead, hidden), token_input.dtype)
    check_operand("expert_scales", expert_scales, (experts, *lead), jnp.float32)
    # Not zeros_like: that would carry token_input's variance over the axis (api.py).
    residual = (
        jnp.zeros(token_input.shape, token_input.dtype)
        if residual is None
        else as_residual(residual, token_input)
    )
    gamma = as_gamma(
        rms_gamma, token_input, hidden, AllReduceFusionPattern.kMoEReductionARResidualRMSNorm
    )
    tokens = math.prod(lead)
    operands = dict(
        expert_scales=expert_scales.reshape(experts, tokens),
        expert_outputs=expert_outputs.reshape(experts, tokens, hidden),
        token_input=token_input.reshape(tokens, hidden),
        residual=residual.reshape(tokens, hidden),
        rms_gamma=gamma,
    )
    return _bind(
        moe_reduction_op,
        operands,
        lead=lead,
        hidden=hidden,
        workspace=workspace,
        axis_name=axis_name,
        strict=strict,
        fallback=fallback,
        rms_eps=rms_eps,
        weight_bias=weight_bias,
        allreduce_out=return_allreduce_out,
    )


def check_permuted_indices(expanded_idx_to_permuted_idx, num_permuted_rows: int) -> None:
    """Raises ValueError unless every index is -1 or a row of ``permuted_input`` (concrete
    values only; a traced index map is checked by nobody, see the module docstring)."""
    if isinstance(expanded_idx_to_permuted_idx, jax.core.Tracer):
        return
    idx = np.asarray(expanded_idx_to_permuted_idx)
    bad = (idx < -1) | (idx >= num_permuted_rows)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"expanded_idx_to_permuted_idx{list(where)} = {int(idx[where])} is not -1 (dropped) "
            f"or a row of permuted_input (0..{num_permuted_rows - 1}); permuted_input has "
            f"{num_permuted_rows} rows, fewer than the indices need"
        )


def moe_finalize_allreduce_fusion(
    permuted_input,
    expanded_idx_to_permuted_idx,
    *,
    axis_name: str,
    workspace: AllReduceFusionWorkspace,
    residual=None,
    rms_gamma=None,
    expert_scale_factor=None,
    shared_expert_output=None,
    routed_scaling_factor: float = 1.0,
    rms_eps: float = 1e-6,
    weight_bias: float = 0.0,
    strict: Optional[bool] = None,
    fallback: str = "xla",
) -> MoeAllReduceFusionOutputs:
    """Pattern 7 (``kMoEFinalizeARResidualRMSNorm``) on this rank's shard, inside shard_map.

    ``permuted_input`` [P, H] (bfloat16/float16): this rank's expert rows in permuted
    (expert-sorted, padded) order; ``expanded_idx_to_permuted_idx`` int32 [..., top_k]: the
    row of each (token, slot), -1 = dropped; ``expert_scale_factor`` [..., top_k] of
    permuted_input's dtype (the kernel reads the router weights in that dtype) or None
    (unweighted); ``shared_expert_output`` [..., H] or None; ``routed_scaling_factor``
    multiplies the routed sum (DeepSeek-V3's 2.5); ``residual`` [..., H] (zeros when None),
    ``rms_gamma`` [H]. Returns ``MoeAllReduceFusionOutputs(None, residual_out, norm_out)``
    with the index map's leading dims. ``fallback``: as for
    ``moe_reduction_allreduce_fusion``."""
    rms_eps, weight_bias, strict, fallback = _options(rms_eps, weight_bias, strict, fallback)
    routed_scaling_factor = arguments.as_float32("routed_scaling_factor", routed_scaling_factor)
    permuted_input = jnp.asarray(permuted_input)
    idx = jnp.asarray(expanded_idx_to_permuted_idx)
    if permuted_input.ndim != 2 or permuted_input.shape[0] < 1:
        raise ValueError(
            f"permuted_input must be [rows >= 1, hidden], got shape {permuted_input.shape}"
        )
    check_concrete_shape("permuted_input", permuted_input.shape, "the MoE all-reduce fusion")
    check_concrete_shape("expanded_idx_to_permuted_idx", idx.shape, "the MoE all-reduce fusion")
    dtype = permuted_input.dtype
    _check_call_context(workspace, axis_name, np.dtype(dtype).name)
    rows, hidden = permuted_input.shape
    given = getattr(expanded_idx_to_permuted_idx, "dtype", idx.dtype)  # before x64 narrowing
    if given != jnp.int32 or idx.ndim < 2 or idx.shape[-1] < 1:
        raise ValueError(
            f"expanded_idx_to_permuted_idx must be int32 [..., top_k >= 1], got "
            f"{idx.shape} {np.dtype(given).name}"
        )
    check_permuted_indices(expanded_idx_to_permuted_idx, rows)
    lead, top_k = idx.shape[:-1], idx.shape[-1]
    tokens = math.prod(lead)
    like = jnp.zeros((*lead, hidden), dtype)
    residual = like if residual is None else as_residual(residual, like)
    gamma = as_gamma(rms_gamma, like, hidden, AllReduceFusionPattern.kMoEFinalizeARResidualRMSNorm)
    # A bad traced index becomes "dropped" (the kernel would read outside permuted_input).
    idx = jnp.where((idx >= -1) & (idx < rows), idx, -1).reshape(tokens, top_k)
    operands = dict(
        permuted_input=permuted_input,
        expanded_idx_to_permuted_idx=idx,
        residual=residual.reshape(tokens, hidden),
        rms_gamma=gamma,
    )
    if expert_scale_factor is not None:
        expert_scale_factor = jnp.asarray(expert_scale_factor)
        check_operand("expert_scale_factor", expert_scale_factor, (*lead, top_k), dtype)
        operands["expert_scale_factor"] = expert_scale_factor.reshape(tokens, top_k)
    if shared_expert_output is not None:
        shared_expert_output = jnp.asarray(shared_expert_output)
        check_operand("shared_expert_output", shared_expert_output, (*lead, hidden), dtype)
        operands["shared_expert_output"] = shared_expert_output.reshape(tokens, hidden)
    return _bind(
        moe_finalize_op,
        operands,
        lead=lead,
        hidden=hidden,
        workspace=workspace,
        axis_name=axis_name,
        strict=strict,
        fallback=fallback,
        rms_eps=rms_eps,
        weight_bias=weight_bias,
        routed_scaling_factor=routed_scaling_factor,
        has_expert_scale=expert_scale_factor is not None,
        has_shared_expert=shared_expert_output is not None,
    )
