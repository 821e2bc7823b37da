"""What every jax_fusedar FFI op shares: the varying-manual-axes (VMA) helpers of its
abstract evaluation, the mesh check and the reference policy of its lowerings, and the
registration of the native handlers with XLA.
"""
from __future__ import annotations

import contextlib
import contextvars
import warnings

import jax

from .call_checks import check_call_groups
from .common import native

# --- varying-manual-axes (VMA) -----------------------------------------------------------------
# Inside shard_map the all-reduced sum no longer varies over the TP axis (as for psum), so
# outputs drop `axis_name` from the summed operands' varying axes; the residual and gamma
# still contribute theirs (a per-rank residual makes residual_out per-rank again).

def varying(aval) -> frozenset:
    """The manual mesh axes ``aval`` varies over."""
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", frozenset()))


def with_varying(aval, vma: frozenset):
    """``aval`` marked varying over exactly ``vma``."""
    if getattr(aval, "mat", None) is not None:
        return aval.update(manual_axis_type=aval.mat.update(varying=vma))
    return aval.update(vma=vma)


# --- lowering ----------------------------------------------------------------------------------

def check_lowering_mesh(ctx, axis_name, workspace_groups):
    """In every lowering (cuda and the reference ones): the mesh of the shard_map (or pmap)
    being lowered is known here even when it was not at trace time."""
    mesh = getattr(ctx.module_context.axis_context, "mesh", None)
    check_call_groups(mesh, axis_name[0], workspace_groups)


_refuse_reference = contextvars.ContextVar("jax_fusedar_export_refuses_reference", default=False)
_allow_reference = contextvars.ContextVar("jax_fusedar_export_allows_reference", default=False)


@contextlib.contextmanager
def refusing_reference_for_cuda():
    """``jax_fusedar.export``'s context: a cuda lowering that would silently hold the
    reference for an XLA-backend workspace of a GPU-less process raises instead of warning
    (unless ``allowing_reference_for_cuda`` is also in effect)."""
    token = _refuse_reference.set(not _allow_reference.get())
    try:
        yield
    finally:
        _refuse_reference.reset(token)


@contextlib.contextmanager
def allowing_reference_for_cuda():
    """Let a cuda lowering keep the reference for XLA-backend workspaces silently."""
    token = _allow_reference.set(True)
    try:
        yield
    finally:
        _allow_reference.reset(token)


def check_reference_lowered_for_cuda(workspace_id: int) -> None:
    """Called by the cuda lowering of a call that was not cleared for the kernel: when the
    reason is that the workspace is on the XLA backend of a process without GPUs, the cuda
    program would silently lack the kernel. Raises inside ``export``, else warns."""
    if _allow_reference.get():
        return
    from .workspace import lookup
    ws = lookup(workspace_id)
    if ws is None or ws.backend != "xla":
        return
    if any(getattr(d, "platform", None) == "gpu" for d in ws.mesh.devices.flat):
        return  # the XLA backend chosen on GPUs: the user's (or auto's) explicit choice
    msg = (f"jax_fusedar: lowering for cuda with {ws!r}, an XLA-backend workspace of a process "
           "without GPUs: the program will run psum + RMSNorm, not the fused kernel. To "
           "export the kernel from this machine use jax_fusedar.abstract_workspace(..., "
           "backend='trtllm'), which serving processes match by key")
    if _refuse_reference.get():
        raise ValueError(msg + " (or wrap the export in "
                         "jax_fusedar.export.allow_reference_for_cuda() to keep the reference)")
    warnings.warn(msg, stacklevel=2)


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
