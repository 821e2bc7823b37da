"""The two MoE ops behind ``moe_reduction_allreduce_fusion`` (pattern 6) and
``moe_finalize_allreduce_fusion`` (pattern 7), declared through ``ffi_op.FfiOp``. Both call
one XLA FFI handler (``jax_fusedar_moe_allreduce_fusion_v1``, ffi/xla/moe_allreduce_fusion.cc),
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
tangent map of that math (``ffi_op.reference_jvp``); ``jax.vmap`` folds the batch into
tokens (the finalize offsets each element's indices into the stacked permuted rows), and a
batched ``rms_gamma`` runs one call per element.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import moe_reference
from .call_plan import choose_moe_kernel
from .common.patterns import AllReduceFusionPattern
from .ffi_op import FfiOp, varying, with_varying

REDUCTION = int(AllReduceFusionPattern.kMoEReductionARResidualRMSNorm)
FINALIZE = int(AllReduceFusionPattern.kMoEFinalizeARResidualRMSNorm)

REDUCTION_OPERANDS = ("expert_scales", "expert_outputs", "token_input", "residual", "rms_gamma")


def finalize_operands(has_expert_scale: bool, has_shared_expert: bool) -> tuple:
    """The finalize op's operand names, in the handler's order."""
    return (
        ("permuted_input", "expanded_idx_to_permuted_idx", "residual", "rms_gamma")
        + ("expert_scale_factor",) * has_expert_scale
        + ("shared_expert_output",) * has_shared_expert
    )


def _abstract_eval(ops: dict, axis_name, allreduce_out: bool):
    """residual_out, norm_out [, allreduce_out]: the all-reduced rows no longer vary over the
    TP axis; the residual and gamma still contribute their varying axes."""
    local = [v for k, v in ops.items() if k not in ("residual", "rms_gamma")]
    summed = frozenset().union(*(varying(a) for a in local)) - frozenset(axis_name)
    res_vma = summed | varying(ops["residual"])
    norm_vma = res_vma | varying(ops["rms_gamma"])
    row = ops["residual"]
    outs = [with_varying(row, res_vma), with_varying(row, norm_vma)]
    if allreduce_out:
        outs.append(with_varying(row, summed))
    return outs


def _epilogue(local, ops, axis_name, rms_eps, weight_bias, allreduce_out: bool, fallback):
    summed, residual_out, norm_out = moe_reference.moe_epilogue(
        local,
        ops["residual"],
        ops["rms_gamma"],
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


def _at_front(x, d, size):
    if d is None:
        return jnp.broadcast_to(x, (size, *x.shape))
    return jnp.moveaxis(x, d, 0)


def _flat(x):
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _batch(op, names, fold, args, dims, params, n_out):
    """The MoE ops' batching: one call per element when ``rms_gamma`` is batched, else the
    batch folded into tokens (``fold(ops, size)`` returns the folded operands by name) and
    the kernel decided again for the folded token count."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    ops = {n: _at_front(a, d, size) for n, a, d in zip(names, args, dims)}
    if dims[names.index("rms_gamma")] is not None:

        def one(xs):
            return tuple(op.primitive.bind(*xs, **params))

        outs = jax.lax.map(one, tuple(ops[n] for n in names))
        return list(outs), [0] * n_out
    tokens, hidden = ops["residual"].shape[1:]
    folded = dict(
        ops,
        residual=_flat(ops["residual"]),
        rms_gamma=args[names.index("rms_gamma")],
        **fold(ops, size),
    )
    params = dict(
        params,
        use_kernel=choose_moe_kernel(
            params["plan"], size * tokens, hidden, np.dtype(ops["residual"].dtype).name
        ),
    )
    outs = op.primitive.bind(*(folded[n] for n in names), **params)
    return [o.reshape(size, tokens, hidden) for o in outs], [0] * n_out


# --- pattern 6: the expert reduction ------------------------------------------------------------


def _reduction_abstract_eval(*avals, axis_name, allreduce_out, **_):
    return _abstract_eval(dict(zip(REDUCTION_OPERANDS, avals)), axis_name, allreduce_out)


def _reduction_reference(*args, axis_name, rms_eps, weight_bias, allreduce_out, fallback):
    ops = dict(zip(REDUCTION_OPERANDS, args))
    local = moe_reference.moe_reduction_local(
        ops["expert_outputs"], ops["expert_scales"], ops["token_input"]
    )
    return _epilogue(local, ops, axis_name, rms_eps, weight_bias, allreduce_out, fallback)


def _reduction_batch(op, args, dims, **params):
    def fold(ops, size):
        e, tokens, hidden = ops["expert_outputs"].shape[1:]
        return {
            "token_input": _flat(ops["token_input"]),
            "expert_outputs": jnp.swapaxes(ops["expert_outputs"], 0, 1).reshape(
                e, size * tokens, hidden
            ),
            "expert_scales": jnp.swapaxes(ops["expert_scales"], 0, 1).reshape(e, size * tokens),
        }

    return _batch(
        op, REDUCTION_OPERANDS, fold, args, dims, params, 3 if params["allreduce_out"] else 2
    )


moe_reduction_op = FfiOp(
    "jax_fusedar_moe_reduction_allreduce_fusion",
    target="moe_allreduce_fusion",
    public_name="jax_fusedar.moe_reduction_allreduce_fusion",
    abstract_eval=_reduction_abstract_eval,
    reference=_reduction_reference,
    attributes=lambda **p: _attributes(REDUCTION, **p),
    aliases=lambda **_: {REDUCTION_OPERANDS.index("residual"): 0},
    batch=_reduction_batch,
)


# --- pattern 7: the finalize (gather of the permuted expert rows) --------------------------------


def _finalize_abstract_eval(*avals, axis_name, has_expert_scale, has_shared_expert, **_):
    names = finalize_operands(has_expert_scale, has_shared_expert)
    return _abstract_eval(dict(zip(names, avals)), axis_name, False)


def _finalize_reference(
    *args,
    axis_name,
    rms_eps,
    weight_bias,
    routed_scaling_factor,
    has_expert_scale,
    has_shared_expert,
    fallback,
):
    ops = dict(zip(finalize_operands(has_expert_scale, has_shared_expert), args))
    local = moe_reference.moe_finalize_local(
        ops["permuted_input"],
        ops["expanded_idx_to_permuted_idx"],
        expert_scale_factor=ops.get("expert_scale_factor"),
        shared_expert_output=ops.get("shared_expert_output"),
        routed_scaling_factor=routed_scaling_factor,
    )
    return _epilogue(local, ops, axis_name, rms_eps, weight_bias, False, fallback)


def _finalize_batch(op, args, dims, **params):
    names = finalize_operands(params["has_expert_scale"], params["has_shared_expert"])

    def fold(ops, size):
        rows = ops["permuted_input"].shape[1]
        idx = ops["expanded_idx_to_permuted_idx"]
        offset = (jnp.arange(size, dtype=jnp.int32) * rows)[:, None, None]
        folded = {
            "expanded_idx_to_permuted_idx": _flat(
                jnp.where((idx >= 0) & (idx < rows), idx + offset, -1)
            ),
            "permuted_input": _flat(ops["permuted_input"]),
        }
        for n in ("expert_scale_factor", "shared_expert_output"):
            if n in ops:
                folded[n] = _flat(ops[n])
        return folded

    return _batch(op, names, fold, args, dims, params, 2)


moe_finalize_op = FfiOp(
    "jax_fusedar_moe_finalize_allreduce_fusion",
    target="moe_allreduce_fusion",
    public_name="jax_fusedar.moe_finalize_allreduce_fusion",
    abstract_eval=_finalize_abstract_eval,
    reference=_finalize_reference,
    attributes=lambda **p: _attributes(FINALIZE, **p),
    aliases=lambda **_: {finalize_operands(False, False).index("residual"): 0},
    batch=_finalize_batch,
)

FFI_TARGET = moe_reduction_op.target
