"""The dense op's JVP rule (``ops/dense.py`` declares it with the op; it receives the
``family.FfiOp`` whose primitive it binds). Its batching rule is the family's
(``family.table_batch``).

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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.interpreters import ad

from . import reference
from ..common.patterns import TRAITS, AllReduceFusionPattern
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
    fallback = fallback_of(params.get("plan"))
    # The tangent map of the reference's roundings (round_to's, or convert_to's for
    # "xla_plain": reference.roundings).
    rounding, round_tangent = reference.roundings(fallback)
    # The tangents' all-reduce is the call's fallback: a psum in T moves no more than the
    # user's own tangent psum in forward mode (under grad its transpose is JAX's own).
    ds = (
        None
        if _is_zero(dx)
        else reference.fallback_allreduce(
            dx,
            params["axis_name"],
            fallback=fallback,
            fp32_acc=params["fp32_acc"],
            rounding=round_tangent,
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
        dr = reference.residual_add(ds, dres, rounding=round_tangent)
    elif ds is not None or dres is not None:
        only = ds if ds is not None else dres
        dr = round_tangent(only.astype(jnp.float32), dtype)
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
                rounding=rounding,
            )

        nz_primals = [r] * with_r + [gamma] * with_gamma
        nz_tangents = [out_tangents[0]] * with_r + [dgamma] * with_gamma
        _, dy = jax.jvp(norm, nz_primals, nz_tangents)
        out_tangents[1] = _match_vma(dy, outs[1])
    return outs, out_tangents
