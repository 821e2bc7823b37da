"""Autodiff and batching rules of the dense op (``ops/dense.py`` declares them with the op;
each rule receives the ``family.FfiOp`` whose primitive it binds).

**JVP (and so grad / vjp / linearize, by JAX's transposition).** The primal outputs come
from the primitive itself (the kernel on GPUs); the tangents are the tangent map of the
reference math (``reference.py``), written in plain JAX and applied to the tangents only,
so nothing of the forward is recomputed but the local RMSNorm statistics of residual_out:

    ds = fallback_allreduce(dx)             psum of the tangents in T (kernel_exact: the
                                            kernel's additions of the fp32 tangents)
    dr = T(float(ds) + float(dresidual))    the residual add's tangent
    dy = jvp of rms_norm at (residual_out, gamma) along (dr, dgamma)

Every op here is linear in the tangents and has a transpose (psum's is JAX's own: ``pvary``
under ``check_vma=True``, whatever ``jax.lax.psum`` does otherwise), and these are op for
op the operations ``jax.jvp`` of the reference performs (``reference.round_to`` has the
linear ``round_tangent`` as its derivative), so on the reference path the gradient of the
fused op equals, bit for bit, the gradient of the same math written unfused. Quantized
outputs (``quant_out``, ``scale_out``) are piecewise constant in the inputs: their tangent
is zero (like ``jnp.round``); differentiate through ``norm_out`` (or a straight-through
estimator of your own) to train through quantization. ``scale_factor`` only reaches those
outputs, so it gets no gradient.

**Batching (vmap).** The op is row-wise: a batched x / residual is folded into the token
dimension (one call of batch x tokens rows; the kernel decision is made again for that
count). A batch too large for the workspace, when one element fits, a batched
``rms_gamma`` or ``scale_factor``, or a scale layout that is not one row per token for the
per-element token count (swizzled NVFP4 needs tokens % 128 == 0, per-token-group FP8
tokens % 4 == 0), is not folded: those run one call per batch element in a
``jax.lax.map`` (correct, but a kernel launch per element).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad

from . import reference
from .plan import choose_path, kernel_problem
from ..common.patterns import TRAITS, AllReduceFusionPattern, QuantizationSFLayout
from .family import fallback_of, varying


def _is_zero(t) -> bool:
    return type(t) is ad.Zero


def _match_vma(t, like):
    """The tangent ``t`` marked varying over the axes its primal output varies over (a
    per-rank residual with no tangent still makes residual_out per-rank)."""
    missing = varying(jax.typeof(like)) - varying(jax.typeof(t))
    if missing:
        t = jax.lax.pcast(t, tuple(sorted(missing)), to="varying")
    return t


def jvp(op, primals, tangents, **params):
    """The JVP rule (module docstring)."""
    outs = op.primitive.bind(*primals, **params)
    traits = TRAITS[AllReduceFusionPattern(params["pattern"])]
    out_tangents = [ad.Zero(jax.typeof(o).to_tangent_aval()) for o in outs]
    dtype = outs[0].dtype
    dx = tangents[0]
    # The tangents' all-reduce is the call's fallback: a psum in T moves no more than the
    # user's own tangent psum in forward mode (under grad its transpose is JAX's own).
    ds = (
        None
        if _is_zero(dx)
        else reference.fallback_allreduce(
            dx,
            params["axis_name"],
            fallback=fallback_of(params.get("plan")),
            fp32_acc=params["fp32_acc"],
            rounding=reference.round_tangent,
        )
    )
    if traits.has_allreduce_out:
        if ds is not None:
            out_tangents[0] = _match_vma(ds, outs[0])
        return outs, out_tangents

    # residual_out = T(float(s) + float(residual)): a zero tangent term is left out, as
    # JAX's add does, so that forward-mode zeros keep their sign.
    dres, dgamma = tangents[1], tangents[2]
    dres = None if _is_zero(dres) else dres
    if ds is not None and dres is not None:
        dr = reference.residual_add(ds, dres, rounding=reference.round_tangent)
    elif ds is not None or dres is not None:
        only = ds if ds is not None else dres
        dr = reference.round_tangent(only.astype(jnp.float32), dtype)
    else:
        dr = None
    if dr is not None:
        out_tangents[0] = _match_vma(dr, outs[0])

    if traits.has_norm_out and (dr is not None or not _is_zero(dgamma)):
        r, gamma = outs[0], primals[2]
        with_r, with_gamma = dr is not None, not _is_zero(dgamma)

        def norm(*args):
            it = iter(args)
            return reference.rms_norm(
                next(it) if with_r else r,
                next(it) if with_gamma else gamma,
                rms_eps=params["rms_eps"],
                weight_bias=params["weight_bias"],
                out_dtype=dtype,
            )

        nz_primals = [r] * with_r + [gamma] * with_gamma
        nz_tangents = [out_tangents[0]] * with_r + [dgamma] * with_gamma
        _, dy = jax.jvp(norm, nz_primals, nz_tangents)
        out_tangents[1] = _match_vma(dy, outs[1])
    return outs, out_tangents


# --- batching ----------------------------------------------------------------------------------


def _foldable(traits, layout: int, tokens: int) -> bool:
    """Whether the folded call's outputs split back into per-element outputs by a reshape."""
    if traits.quant == "group_fp8":
        return tokens % 4 == 0  # (K, round_up(M, 4)) columns: no padding per element
    if traits.quant == "fp4" and layout != int(QuantizationSFLayout.LINEAR):
        return tokens % 128 == 0  # whole 128-row tiles, stored tile after tile
    return True


def batch(op, args, dims, **params):
    """The batching rule (module docstring): fold the batch into tokens, or map."""
    traits = TRAITS[AllReduceFusionPattern(params["pattern"])]
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    x, x_dim = args[0], dims[0]
    tokens, hidden = x.shape if x_dim is None else tuple(np.delete(x.shape, x_dim))
    plan = params.get("plan")
    rows_only = all(d is None for d in dims[2:])  # gamma, scale_factor
    fold = plan is not None and rows_only and _foldable(traits, params["layout"], tokens)
    if fold:
        # A batch the workspace cannot hold runs per element when one element fits (so the
        # kernel still serves it), decided from the workspace's sizes alone, on every backend.
        def fits(rows):
            return kernel_problem(rows, hidden, np.dtype(x.dtype).name, plan.sizes) is None

        fold = fits(size * tokens) or not fits(tokens)
    if fold:
        rows = [
            jnp.moveaxis(a, d, 0) if d is not None else jnp.broadcast_to(a, (size, *a.shape))
            for a, d in zip(args[:2], dims[:2])
        ]
        rows = [r.reshape(size * tokens, hidden) for r in rows]
        use_kernel, algorithm = choose_path(plan, size * tokens, hidden, np.dtype(x.dtype).name)
        outs = op.primitive.bind(
            *rows, *args[2:], **dict(params, use_kernel=use_kernel, algorithm=algorithm)
        )
        out_dims = []
        unfolded = []
        for i, o in enumerate(outs):
            if traits.quant == "group_fp8" and i == len(outs) - 1:  # (K, size * tokens)
                unfolded.append(o.reshape(o.shape[0], size, tokens))
                out_dims.append(1)
            else:
                unfolded.append(o.reshape(size, tokens, *o.shape[1:]))
                out_dims.append(0)
        return unfolded, out_dims

    # One call per batch element: the per-element decision (already in params) stands.
    batched = [i for i, d in enumerate(dims) if d is not None]

    def one(elements):
        call = list(args)
        for i, e in zip(batched, elements):
            call[i] = e
        return tuple(op.primitive.bind(*call, **params))

    outs = jax.lax.map(one, [jnp.moveaxis(args[i], dims[i], 0) for i in batched])
    return list(outs), [0] * len(outs)
