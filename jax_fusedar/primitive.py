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

import numpy as np
import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import mlir

from .common import native, results, tp_groups
from . import quant_reference, reference
from .common.patterns import TRAITS, AllReduceFusionPattern
from .workspace import _mesh_groups

FFI_TARGET = native.FFI_TARGETS["allreduce_fusion"]

allreduce_fusion_p = Primitive("jax_fusedar_allreduce_fusion")
allreduce_fusion_p.multiple_results = True


# --- varying-manual-axes (VMA) rule ------------------------------------------------------------
# Inside shard_map the all-reduced sum no longer varies over the TP axis (as for psum), so
# outputs drop `axis_name` from x's varying axes; the residual and gamma still contribute
# theirs (a per-rank residual makes residual_out per-rank again).

def _varying(aval) -> frozenset:
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", frozenset()))


def _with_varying(aval, vma: frozenset):
    if getattr(aval, "mat", None) is not None:
        return aval.update(manual_axis_type=aval.mat.update(varying=vma))
    return aval.update(vma=vma)


def _result_avals(x, pattern: int, layout: int, group_size: int):
    """(shape, dtype) of every result after the first (results.result_specs)."""
    specs = results.result_specs(pattern, *x.shape, np.dtype(x.dtype).name, layout,
                                 group_size)
    return [(spec.storage_shape, jnp.dtype(spec.dtype)) for spec in specs[1:]]


def _abstract_eval(*avals, axis_name, pattern, layout, block_quant_group_size, **_):
    traits = TRAITS[AllReduceFusionPattern(pattern)]
    x = avals[0]
    summed_vma = _varying(x) - frozenset(axis_name)
    if not traits.has_residual:
        return [_with_varying(x, summed_vma)]
    residual, gamma = avals[1], avals[2]
    res_vma = summed_vma | _varying(residual)
    norm_vma = res_vma | _varying(gamma) | (_varying(avals[3]) if len(avals) > 3 else frozenset())
    # norm_out and the quantized outputs all derive from the normalized sum.
    return [_with_varying(x, res_vma)] + [
        _with_varying(x.update(shape=shape, dtype=dtype), norm_vma)
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


def check_call_groups(mesh, axis_name: str, workspace_groups) -> None:
    """Refuse a call whose mesh groups the devices along ``axis_name`` otherwise than the
    workspace (tp_groups.groups_problem): a device would reduce with the wrong group, a
    silent wrong answer on GPUs. ``mesh``: a concrete Mesh (pmap runs as one too); None or
    an abstract mesh (export, cross-platform lowering, an inner shard_map nested in another)
    has nothing to compare: its ``devices`` raises instead of being absent."""
    if mesh is None or isinstance(mesh, jax.sharding.AbstractMesh):
        return
    devices = getattr(mesh, "devices", None)
    if not isinstance(devices, np.ndarray) or devices.dtype != object or devices.size == 0:
        return
    call_groups = [g.members for g in _mesh_groups(mesh, axis_name)]  # the workspace's rule
    problem = tp_groups.groups_problem(axis_name, workspace_groups, call_groups)
    if problem:
        raise ValueError(f"jax_fusedar.allreduce_fusion: {problem}")


def _check_mesh(ctx, axis_name, workspace_groups):
    """In every lowering (cuda and the reference ones): the mesh of the shard_map (or pmap)
    being lowered is known here even when it was not at trace time."""
    mesh = getattr(ctx.module_context.axis_context, "mesh", None)
    check_call_groups(mesh, axis_name[0], workspace_groups)


def _cuda_lowering(ctx, *args, axis_name, pattern, use_kernel, workspace_id, workspace_groups,
                   algorithm, fp32_acc, rms_eps, weight_bias, layout, block_quant_group_size,
                   plan=None):
    _check_mesh(ctx, axis_name, workspace_groups)
    if not use_kernel:
        from .export import check_reference_lowered_for_cuda
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
    _check_mesh(ctx, axis_name, workspace_groups)
    return _reference_lowering(ctx, *args, axis_name=axis_name, pattern=pattern,
                               rms_eps=rms_eps, weight_bias=weight_bias, fp32_acc=fp32_acc,
                               layout=layout, block_quant_group_size=block_quant_group_size)


mlir.register_lowering(allreduce_fusion_p, _default_lowering)
mlir.register_lowering(allreduce_fusion_p, _cuda_lowering, platform="cuda")


# --- FFI target registration -------------------------------------------------------------------

_registered = False


def register_ffi_targets() -> bool:
    """Registers the handlers with XLA once per process; False without the native module."""
    global _registered
    if _registered:
        return True
    if not native.available():
        return False
    for name, capsule in native.ext.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
    # Host twins (never run): a program exported for ("cpu", "cuda") keeps the cuda branch's
    # custom call in the module it compiles on CPU (ffi/xla/allreduce_fusion.cc).
    for name, capsule in getattr(native.ext, "host_registrations", dict)().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    _registered = True
    return True


# Autodiff and batching rules (they import this module).
from . import transforms  # noqa: E402,F401
