"""The argument and workspace checks every op on a workspace makes at trace time (the dense
``allreduce_fusion`` and the MoE ops): the workspace itself, the call's place inside
``shard_map`` over the workspace's axis and mesh groups, concrete shapes, each operand's shape
and dtype, and the residual and gamma operands the kernels read in the call's dtype.

Every error names the argument and says what to do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..common import tp_groups
from ..workspace import AllReduceFusionWorkspace, mesh_groups


def check_workspace(workspace, axis_name: str) -> AllReduceFusionWorkspace:
    """``workspace`` is a live workspace created for ``axis_name``."""
    if not isinstance(workspace, AllReduceFusionWorkspace):
        if isinstance(workspace, jax.core.Tracer):  # e.g. a pytree node of the user's own
            raise TypeError(
                "workspace is a JAX tracer: pass the workspace itself, closed over "
                "or as a static argument (jax.jit(f, static_argnums=...)), not "
                "inside a traced pytree"
            )
        raise TypeError(
            f"workspace must come from jax_fusedar.create_allreduce_fusion_"
            f"workspace, got {type(workspace).__name__}"
        )
    if workspace.destroyed:
        raise ValueError(f"{workspace!r} was destroyed")
    if workspace.axis_name != axis_name:
        raise ValueError(
            f"axis_name={axis_name!r}: the workspace was created for axis "
            f"{workspace.axis_name!r}, not {axis_name!r}"
        )
    return workspace


def check_call_on_workspace(workspace, axis_name, dtype_name, *, op, dtype_of):
    """What every op on a workspace needs of its call (allreduce_fusion, the MoE ops): the
    workspace's dtype, inside shard_map over ``axis_name``, the workspace's world size and
    groups. ``op`` and ``dtype_of`` (e.g. "x has") name the call in the errors."""
    if dtype_name != workspace.dtype.name:
        raise ValueError(
            f"{dtype_of} dtype {dtype_name} but the workspace was created for "
            f"{workspace.dtype.name}; create a workspace per dtype"
        )
    try:
        world = jax.lax.axis_size(axis_name)
    except NameError:
        raise ValueError(
            f"{op} must be called inside jax.shard_map over an axis named {axis_name!r}"
        ) from None
    if world != workspace.world_size:
        raise ValueError(
            f"axis {axis_name!r} has size {world} but the workspace was created "
            f"for world size {workspace.world_size}"
        )
    check_context_mesh(workspace, axis_name)


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
    call_groups = [g.members for g in mesh_groups(mesh, axis_name)]  # the workspace's rule
    problem = tp_groups.groups_problem(axis_name, workspace_groups, call_groups)
    if problem:
        raise ValueError(f"jax_fusedar.allreduce_fusion: {problem}")


def check_context_mesh(workspace, axis_name):
    """At trace time, when the concrete mesh is known (``jax.set_mesh``): the call's groups
    along ``axis_name`` must be the workspace's (``check_call_groups``). Otherwise the same
    check runs when the call is lowered, on every platform, from the mesh of the shard_map
    or pmap being lowered."""
    try:
        from jax._src.mesh import get_concrete_mesh  # no public accessor inside jit

        mesh = get_concrete_mesh()
    except Exception:  # another JAX version: the lowering still checks
        return
    if mesh is None or mesh.empty:
        return
    context = jax.sharding.get_abstract_mesh()
    # Only the mesh this call runs under: same axes and sizes as the one in context.
    if tuple(mesh.shape.items()) == tuple(getattr(context, "shape", {}).items()):
        check_call_groups(mesh, axis_name, [g.members for g in workspace.groups])


def check_concrete_shape(name: str, shape, op: str) -> None:
    """Refuse a symbolic shape (``jax.export`` with shape polymorphism): the kernel decision
    and the workspace fit are trace-time decisions every rank must make alike, so they need
    concrete sizes; and the reference cannot serve either: in JAX 0.10 a shape-polymorphic
    shard_map body fails to compile on CPU ("Module has dynamic shapes") as soon as it
    broadcasts."""
    if not all(isinstance(d, (int, np.integer)) for d in shape):
        raise ValueError(
            f"{name} has a symbolic shape {shape}: {op} needs concrete token and hidden sizes "
            "(the kernel decision and the workspace fit are made at trace time); export one "
            "artifact per token count (e.g. per serving bucket)"
        )


def check_operand(name, value, shape, dtype) -> None:
    if tuple(value.shape) != tuple(shape) or value.dtype != dtype:
        raise ValueError(
            f"{name} must have shape {tuple(shape)} and dtype "
            f"{np.dtype(dtype).name}, got {tuple(value.shape)} "
            f"{np.dtype(value.dtype).name}"
        )


def as_residual(residual, x):
    """The residual stream, checked against x: same shape and dtype (the kernel reads and
    writes it as x's dtype T)."""
    residual = jnp.asarray(residual)
    if residual.dtype == jnp.float32 and x.dtype != jnp.float32 and residual.shape == x.shape:
        t = np.dtype(x.dtype).name
        raise ValueError(
            f"residual has dtype float32 but x is {t}: the kernel reads and writes the "
            f"residual stream in x's dtype, so it cannot keep a float32 stream exactly. "
            f"Either round the stream to {t} (residual=residual.astype(x.dtype)), or keep "
            f"it in float32 end to end: x=x.astype(jnp.float32) with a float32 workspace "
            f"(the all-reduce then moves float32, and norm_out is float32)"
        )
    check_operand("residual", residual, x.shape, x.dtype)
    return residual


def as_gamma(rms_gamma, x, hidden, pattern):
    """rms_gamma of x's dtype, or float32 (e.g. a Flax param_dtype) rounded to x's dtype
    (round to nearest even) here, where the kernel would read it: the kernel, the
    reference and their gradients all see the rounded gamma (its cotangent flows back to
    the float32 parameter through the cast)."""
    if rms_gamma is None:
        raise ValueError(f"pattern {pattern.name} needs rms_gamma of shape ({hidden},)")
    rms_gamma = jnp.asarray(rms_gamma)
    if rms_gamma.dtype == jnp.float32 and rms_gamma.shape == (hidden,):
        return rms_gamma.astype(x.dtype)
    if rms_gamma.shape != (hidden,) or rms_gamma.dtype != x.dtype:
        also = "" if x.dtype == jnp.float32 else " (or float32, rounded to it)"
        raise ValueError(
            f"rms_gamma must have shape ({hidden},) and dtype "
            f"{np.dtype(x.dtype).name}{also}, got {rms_gamma.shape} "
            f"{np.dtype(rms_gamma.dtype).name}"
        )
    return rms_gamma
