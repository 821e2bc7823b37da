"""The dense op behind ``allreduce_fusion``, declared through ``ffi_op.FfiOp``: its abstract
evaluation, reference math, custom-call attributes and aliases here, its JVP and batching
rules in ``transforms.py``.

* ``cuda``: a custom call to the XLA FFI handler (``jax_fusedar_allreduce_fusion_v2``) when
  the call was cleared for the kernel at trace time, else the reference.
* every other platform: the reference math (``reference.py``, ``quant_reference.py``).

The reference's all-reduce is the call's fallback (``reference.fallback_allreduce``): the
psum in x's dtype by default, the kernel's additions (``fp32_acc``) on request.

Operands: x, then residual_in and rms_gamma for residual patterns, then scale_factor (float32
[1], a runtime operand) for static FP8 / NVFP4. Results: allreduce_out, or residual_out
[+ norm_out] [+ quant_out [+ scale_out]] (common/results.py gives their shapes;
quant_layouts.py describes the quantized layouts; ffi/xla/allreduce_fusion.cc checks the
same lists). residual_in is aliased to residual_out, the in-place update FlashInfer and vLLM
use (safe: each element is read and written by the same thread).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from . import quant_reference, reference, transforms
from .common import results
from .common.patterns import TRAITS, AllReduceFusionPattern
from .ffi_op import FfiOp, varying, with_varying


# --- abstract evaluation ----------------------------------------------------------------------
# The outputs drop `axis_name` from x's varying axes (ffi_op.varying); residual and gamma
# still contribute theirs.


def _result_avals(x, pattern: int, layout: int, group_size: int):
    """(shape, dtype) of every result after the first (results.result_specs)."""
    specs = results.result_specs(pattern, *x.shape, np.dtype(x.dtype).name, layout, group_size)
    return [(spec.storage_shape, jnp.dtype(spec.dtype)) for spec in specs[1:]]


def _abstract_eval(*avals, axis_name, pattern, layout, block_quant_group_size, **_):
    traits = TRAITS[AllReduceFusionPattern(pattern)]
    x = avals[0]
    summed_vma = varying(x) - frozenset(axis_name)
    if not traits.has_residual:
        return [with_varying(x, summed_vma)]
    residual, gamma = avals[1], avals[2]
    res_vma = summed_vma | varying(residual)
    norm_vma = res_vma | varying(gamma) | (varying(avals[3]) if len(avals) > 3 else frozenset())
    # norm_out and the quantized outputs all derive from the normalized sum.
    return [with_varying(x, res_vma)] + [
        with_varying(x.update(shape=shape, dtype=dtype), norm_vma)
        for shape, dtype in _result_avals(x, pattern, layout, block_quant_group_size)
    ]


# --- reference math, custom call ----------------------------------------------------------------


def _reference_outputs(
    *args,
    axis_name,
    pattern,
    rms_eps,
    weight_bias,
    fp32_acc,
    layout,
    block_quant_group_size,
    algorithm,
    fallback,
):
    del algorithm  # the kernel's choice; the reference computes the same sum either way
    traits = TRAITS[AllReduceFusionPattern(pattern)]
    x = args[0]
    residual, gamma = (args[1], args[2]) if traits.has_residual else (None, None)
    ar, res, norm = reference.allreduce_fusion_reference(
        x,
        residual,
        gamma,
        axis_name=axis_name,
        pattern=pattern,
        rms_eps=rms_eps,
        weight_bias=weight_bias,
        fp32_acc=fp32_acc,
        fallback=fallback,
    )
    if traits.has_allreduce_out:
        return [ar]
    outs = [res] + ([norm] if traits.has_norm_out else [])
    if x.shape[0] == 0:  # no tokens: empty quantized outputs of the documented shapes
        specs = results.result_specs(
            pattern, 0, x.shape[1], np.dtype(x.dtype).name, layout, block_quant_group_size
        )
        return outs + [
            jnp.zeros(spec.storage_shape, spec.dtype)
            for spec in specs
            if spec.name in ("quant_out", "scale_out")
        ]
    quant, scale = quant_reference.quantize_for_pattern(
        norm,
        pattern,
        scale_factor=args[3] if traits.uses_scale_factor else None,
        layout=layout,
        group_size=block_quant_group_size,
    )
    return outs + [o for o in (quant, scale) if o is not None]


def _attributes(
    *, pattern, algorithm, fp32_acc, rms_eps, weight_bias, layout, block_quant_group_size
):
    # The handler finds its rank's workspace by workspace_id and the device ordinal.
    return dict(
        pattern=np.int32(pattern),
        algorithm=np.int32(algorithm),
        fp32_acc=bool(fp32_acc),
        rms_eps=np.float32(rms_eps),
        weight_bias=np.float32(weight_bias),
        layout=np.int32(layout),
        block_quant_group_size=np.int32(block_quant_group_size),
    )


def _aliases(*, pattern, **_):
    return {1: 0} if TRAITS[AllReduceFusionPattern(pattern)].has_residual else {}


allreduce_fusion_op = FfiOp(
    "jax_fusedar_allreduce_fusion",
    target="allreduce_fusion",
    public_name="jax_fusedar.allreduce_fusion",
    abstract_eval=_abstract_eval,
    reference=_reference_outputs,
    attributes=_attributes,
    aliases=_aliases,
    jvp=transforms.jvp,
    batch=transforms.batch,
)
allreduce_fusion_p = allreduce_fusion_op.primitive
FFI_TARGET = allreduce_fusion_op.target
