"""The JAX primitive behind ``allreduce_fusion``: abstract eval, VMA rule, lowerings.

* ``cuda`` lowering: a custom call to the XLA FFI handler (``jax_fusedar_allreduce_fusion_v2``)
  when the call was cleared for the kernel at trace time, else the reference.
* every other platform: the reference math (``reference.py``) lowered with ``lower_fun``.

Operands: x, then residual_in and rms_gamma for residual patterns, then scale_factor (float32
[1], a runtime operand) for static FP8 / NVFP4. Results: allreduce_out, or residual_out
[+ norm_out] [+ quant_out [+ scale_out]] (common/results.py gives their shapes; quant_layouts.py
describes the quantized layouts; ffi/xla/allreduce_fusion.cc checks the same lists). residual_in is aliased to
residual_out, the in-place update FlashInfer and vLLM use (safe: each element is read and
written by the same thread).
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import quant_reference, reference, transforms
from .common import native, results
from .common.patterns import TRAITS, AllReduceFusionPattern
from .ffi_op import (check_lowering_mesh, check_reference_lowered_for_cuda, varying,
                     with_varying)

FFI_TARGET = native.FFI_TARGETS["allreduce_fusion"]

allreduce_fusion_p = Primitive("jax_fusedar_allreduce_fusion")
allreduce_fusion_p.multiple_results = True


# --- abstract evaluation ----------------------------------------------------------------------
# The outputs drop `axis_name` from x's varying axes (ffi_op.varying); residual and gamma
# still contribute theirs.

def _result_avals(x, pattern: int, layout: int, group_size: int):
    """(shape, dtype) of every result after the first (results.result_specs)."""
    specs = results.result_specs(pattern, *x.shape, np.dtype(x.dtype).name, layout,
                                 group_size)
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
        for shape, dtype in _result_avals(x, pattern, layout, block_quant_group_size)]


allreduce_fusion_p.def_abstract_eval(_abstract_eval)
allreduce_fusion_p.def_impl(lambda *a, **k: (_ for _ in ()).throw(ValueError(
    "jax_fusedar.allreduce_fusion must be called inside jax.shard_map")))


# --- lowerings ---------------------------------------------------------------------------------

def _reference_outputs(*args, axis_name, pattern, rms_eps, weight_bias, fp32_acc, layout,
                       block_quant_group_size, **_):
    traits = TRAITS[AllReduceFusionPattern(pattern)]
    x = args[0]
    residual, gamma = (args[1], args[2]) if traits.has_residual else (None, None)
    ar, res, norm = reference.allreduce_fusion_reference(
        x, residual, gamma, axis_name=axis_name, pattern=pattern, rms_eps=rms_eps,
        weight_bias=weight_bias, fp32_acc=fp32_acc)
    if traits.has_allreduce_out:
        return [ar]
    outs = [res] + ([norm] if traits.has_norm_out else [])
    if x.shape[0] == 0:  # no tokens: empty quantized outputs of the documented shapes
        specs = results.result_specs(pattern, 0, x.shape[1], np.dtype(x.dtype).name, layout,
                                     block_quant_group_size)
        return outs + [jnp.zeros(spec.storage_shape, spec.dtype) for spec in specs
                       if spec.name in ("quant_out", "scale_out")]
    quant, scale = quant_reference.quantize_for_pattern(
        norm, pattern, scale_factor=args[3] if traits.uses_scale_factor else None,
        layout=layout, group_size=block_quant_group_size)
    return outs + [o for o in (quant, scale) if o is not None]


_reference_lowering = mlir.lower_fun(_reference_outputs, multiple_results=True)


def _cuda_lowering(ctx, *args, axis_name, pattern, use_kernel, workspace_id, workspace_groups,
                   algorithm, fp32_acc, rms_eps, weight_bias, layout, block_quant_group_size,
                   plan=None):
    check_lowering_mesh(ctx, axis_name, workspace_groups)
    if not use_kernel:
        check_reference_lowered_for_cuda(workspace_id)
        return _reference_lowering(ctx, *args, axis_name=axis_name, pattern=pattern,
                                   rms_eps=rms_eps, weight_bias=weight_bias, fp32_acc=fp32_acc,
                                   layout=layout, block_quant_group_size=block_quant_group_size)
    traits = TRAITS[AllReduceFusionPattern(pattern)]
    aliases = {1: 0} if traits.has_residual else {}
    rule = jax.ffi.ffi_lowering(FFI_TARGET, operand_output_aliases=aliases)
    return rule(ctx, *args, workspace_id=np.int64(workspace_id), pattern=np.int32(pattern),
                algorithm=np.int32(algorithm), fp32_acc=bool(fp32_acc),
                rms_eps=np.float32(rms_eps), weight_bias=np.float32(weight_bias),
                layout=np.int32(layout), block_quant_group_size=np.int32(block_quant_group_size))


def _default_lowering(ctx, *args, axis_name, pattern, rms_eps, weight_bias, fp32_acc, layout,
                      block_quant_group_size, workspace_groups, **_):
    check_lowering_mesh(ctx, axis_name, workspace_groups)
    return _reference_lowering(ctx, *args, axis_name=axis_name, pattern=pattern,
                               rms_eps=rms_eps, weight_bias=weight_bias, fp32_acc=fp32_acc,
                               layout=layout, block_quant_group_size=block_quant_group_size)


mlir.register_lowering(allreduce_fusion_p, _default_lowering)
mlir.register_lowering(allreduce_fusion_p, _cuda_lowering, platform="cuda")


# --- autodiff and batching (transforms.py) ------------------------------------------------------

ad.primitive_jvps[allreduce_fusion_p] = partial(transforms.jvp, allreduce_fusion_p)
batching.primitive_batchers[allreduce_fusion_p] = partial(transforms.batch, allreduce_fusion_p)
