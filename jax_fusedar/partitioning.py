"""``row_parallel_allreduce_fusion``: the fused op for plain ``jax.jit`` + shardings (no shard_map).

Models written in MaxText's style never see the row-parallel all-reduce: they write
``y = h @ w`` with ``w`` sharded along its contracting dimension and the partitioner (Shardy,
JAX's default) inserts the all-reduce. This module gives such models one call for the
row-parallel matmul *and* what follows it::

    out = row_parallel_allreduce_fusion(h, w, residual=x, rms_gamma=gamma, workspace=ws)
    # out.residual_out = h @ w + x;  out.norm_out = RMSNorm(out.residual_out) * gamma

and partitions itself:

* **Auto axes** (``jax.make_mesh(..., axis_types=(AxisType.Auto, ...))``, ``NamedSharding``
  on the arguments, MaxText's way): a ``jax.experimental.custom_partitioning`` op with a
  Shardy ``sharding_rule`` (as TransformerEngine-JAX's ``cpp_extensions`` do). Its partition
  rule, which runs when XLA compiles the program, reads where the partitioner put ``w``'s
  contracting dimension ``k``; each shard then runs its local matmul followed by
  ``allreduce_fusion`` over that mesh axis (the kernel when a workspace fits, else the same
  math in XLA: ``psum`` + residual add + RMSNorm, with the kernel's rounding points).
* **Explicit axes** (``jax.make_mesh``'s default): the shardings are part of the types, so the
  same per-shard program is placed with ``jax.shard_map`` at trace time.

Either way the per-shard program is exactly what a user would write inside ``shard_map``
(``allreduce_fusion(h_local @ w_local, ...)``), so both give the same bits as that version.
When ``k`` is not sharded, the plain math runs (one matmul, the residual add and the norm,
no reduction); when ``k`` is sharded over several mesh axes, or no workspace serves the
axis, the reference all-reduce runs (logged once; ``strict`` raises). Outputs are sharded
like ``h``'s leading dimensions, with the hidden dimension replicated (RMSNorm needs whole
rows). On Auto axes the op is a ``custom_vjp`` (custom_partitioning has no autodiff) whose
backward is the plain math's gradient; on Explicit axes ``allreduce_fusion``'s rules apply.
``jax.export`` works on Explicit axes only (the Auto-axes partition rule is a Python
callback, which artifacts cannot carry).
"""
from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from .common import arguments, backend_choice, limits
from . import reference
from .api import AllReduceFusionOutputs, allreduce_fusion
from .call_plan import fallback
from .common.patterns import AllReduceFusionPattern
from .workspace import AllReduceFusionWorkspace

_PATTERN = int(AllReduceFusionPattern.kARResidualRMSNorm)

# h [..., k] @ w [k, n] (+ residual [..., n], gamma [n]) -> residual_out, norm_out [..., n].
# k is contracted (the partition rule reduces it); n must stay whole for RMSNorm.
SHARDING_RULE = "... k, k n, ... n, n -> ... n, ... n"


class _Config(NamedTuple):
    """Static (hashable) arguments of the partitioned op."""
    workspaces: tuple
    rms_eps: float
    weight_bias: float
    fp32_acc: bool
    use_oneshot: Optional[bool]
    strict: Optional[bool]
    precision: object


def row_parallel_allreduce_fusion(
        h, w, *, residual, rms_gamma,
        workspace: Union[AllReduceFusionWorkspace, Sequence[AllReduceFusionWorkspace], None] = None,
        rms_eps: float = 1e-6, weight_bias: float = 0.0, fp32_acc: bool = True,
        use_oneshot: Optional[bool] = None, strict: Optional[bool] = None,
        precision=None, contracting_dims=None) -> AllReduceFusionOutputs:
    """Row-parallel ``h @ w`` fused with the all-reduce, residual add and RMSNorm.

    Call it under ``jax.jit`` on globally shaped arrays, outside ``shard_map``; it partitions
    itself (module docstring). ``h``: ``[..., k]``; ``w``: ``[k, n]`` (shard ``k`` over the
    tensor-parallel axis); ``residual``: ``[..., n]``; ``rms_gamma``: ``[n]``; all of one
    dtype. ``workspace``: a workspace, or several (e.g. one per dtype or per axis), from
    ``create_allreduce_fusion_workspace``; the one created on the same mesh for the axis that
    shards ``k``, with the matmul's dtype, serves the call. None: the XLA path everywhere.
    ``precision`` is ``jnp.dot``'s. ``rms_gamma`` may also be float32 (a Flax
    ``param_dtype``): it is rounded to the dtype, where the kernel reads it, as
    ``allreduce_fusion`` does. ``contracting_dims``: ``((h dims), (w dims))`` contracted
    pairwise, as ``jax.lax.dot_general``'s, for any contraction (e.g. ``bhtq,hqd->btd``:
    ``((1, 3), (0, 1))``); h's other dims are token dims (in order) and w keeps exactly one
    free dim, ``n``. None: ``h [..., k] @ w [k, n]``. The other arguments are
    ``allreduce_fusion``'s.

    Returns ``AllReduceFusionOutputs`` with ``residual_out = h @ w + residual`` and
    ``norm_out = RMSNorm(residual_out) * (weight_bias + rms_gamma)`` (other fields None).
    """
    if contracting_dims is not None:
        return _contraction_entry(h, w, contracting_dims, residual, rms_gamma, workspace,
                                  rms_eps, weight_bias, fp32_acc, use_oneshot, strict,
                                  precision)
    workspaces = _as_workspaces(workspace)
    cfg = _checked_config(workspaces, rms_eps, weight_bias, fp32_acc, use_oneshot, strict,
                          precision)
    h, w, residual, rms_gamma = _as_operands(h, w, residual, rms_gamma)
    _check_shapes(h, w, residual, rms_gamma)
    rms_gamma = _gamma_as(h.dtype, rms_gamma)
    _check_up_front(cfg, h, w, residual, rms_gamma)
    mesh = jax.typeof(h).sharding.mesh
    types = set(getattr(mesh, "axis_types", ()))
    if AxisType.Manual in types:
        # Inside shard_map the arrays are shards: the partial sums would never be reduced.
        raise ValueError("row_parallel_allreduce_fusion is called on global arrays, outside "
                         "shard_map; inside shard_map call jax_fusedar.allreduce_fusion on "
                         "the local matmul")
    if AxisType.Explicit in types:
        return _explicit(cfg, mesh, h, w, residual, rms_gamma)
    residual_out, norm_out = _differentiable(h, w, residual, rms_gamma, cfg)
    return AllReduceFusionOutputs(None, residual_out, norm_out, None, None)


def _as_workspaces(workspace) -> tuple:
    if workspace is None:
        return ()
    many = tuple(workspace) if isinstance(workspace, (list, tuple)) else (workspace,)
    for ws in many:
        if not isinstance(ws, AllReduceFusionWorkspace):
            raise TypeError("workspace must be an AllReduceFusionWorkspace from "
                            "jax_fusedar.create_allreduce_fusion_workspace, a sequence of them, "
                            f"or None; got {type(ws).__name__}")
        if ws.destroyed:
            raise ValueError(f"workspace {ws!r} was destroyed")
    return many


def _checked_config(workspaces, rms_eps, weight_bias, fp32_acc, use_oneshot, strict,
                    precision) -> _Config:
    """The options, validated once, here, with ``allreduce_fusion``'s validators (never
    coerced: ``bool("false")`` is True). On Auto axes the per-shard program runs only when
    XLA compiles the partitioned op, where an error would be an INTERNAL custom_partitioner
    traceback; when ``k`` is not sharded it never meets allreduce_fusion's checks at all."""
    opts = arguments.fusion_options(rms_eps=rms_eps, weight_bias=weight_bias,
                                    fp32_acc=fp32_acc, use_oneshot=use_oneshot)
    return _Config(workspaces, opts.rms_eps, opts.weight_bias, opts.fp32_acc, opts.use_oneshot,
                   backend_choice.strict_mode(strict), precision)


def _as_operands(h, w, residual, rms_gamma):
    """The four operands as arrays; ``residual=None`` is zeros, as for allreduce_fusion."""
    for name, value in (("h", h), ("w", w), ("rms_gamma", rms_gamma)):
        if value is None:
            raise ValueError(f"{name} is required (row_parallel_allreduce_fusion(h, w, "
                             "residual=..., rms_gamma=...): h [..., k], w [k, n], "
                             "rms_gamma [n])")
    h, w, rms_gamma = jnp.asarray(h), jnp.asarray(w), jnp.asarray(rms_gamma)
    if residual is None:  # (with a w that is not [k, n], _check_shapes names w)
        residual = jnp.zeros((*h.shape[:-1], w.shape[-1] if w.ndim == 2 else 0), h.dtype)
    return h, w, jnp.asarray(residual), rms_gamma


def _check_up_front(cfg: _Config, h, w, residual, gamma) -> None:
    """What the per-shard program would refuse for any partitioning, refused now: the plain
    math itself (e.g. ``precision``), and with a workspace of h's dtype the kernel's rules
    on the hidden size n (16-byte vectors always; in strict mode the launch limits too)."""
    jax.eval_shape(partial(_plain, cfg=cfg), *(jax.ShapeDtypeStruct(a.shape, a.dtype)
                                               for a in (h, w, residual, gamma)))
    dtype_name = np.dtype(h.dtype).name
    n = w.shape[1]
    for ws in cfg.workspaces:
        if ws.dtype != np.dtype(h.dtype):
            continue
        if n % limits.vector_width(dtype_name):
            raise ValueError(f"w is [k, n] with n = {n}, the hidden size of the fused op, "
                             f"which is not a multiple of {limits.vector_width(dtype_name)} "
                             f"(16 bytes of {dtype_name}), as the kernel requires")
        problem = limits.kernel_support_problem(ws.world_size, n, dtype_name)
        if problem and cfg.strict:
            fallback("unsupported shape", problem, True, ws.backend)
    if cfg.strict and cfg.workspaces and not any(
            ws.dtype == np.dtype(h.dtype) for ws in cfg.workspaces):
        fallback("no matching workspace", f"no workspace was given for dtype {dtype_name}",
                 True, "trtllm")


def _check_shapes(h, w, residual, gamma):
    if h.ndim < 2:
        raise ValueError(f"h must be [..., tokens, k] (at least 2-D), got shape {h.shape}")
    if w.ndim != 2 or w.shape[0] != h.shape[-1]:
        raise ValueError(f"w must be [k, n] with k = h.shape[-1] = {h.shape[-1]}, got shape "
                         f"{w.shape}")
    n = w.shape[1]
    if residual.shape != (*h.shape[:-1], n):
        raise ValueError(f"residual must have shape {(*h.shape[:-1], n)} (h's leading "
                         f"dimensions, w's n), got {residual.shape}")
    if gamma.shape != (n,):
        raise ValueError(f"rms_gamma must have shape ({n},), got {gamma.shape}")
    for name, a in (("w", w), ("residual", residual), ("rms_gamma", gamma)):
        if name == "rms_gamma" and a.dtype == jnp.float32:
            continue   # rounded to h's dtype (_gamma_as), as allreduce_fusion does
        if a.dtype != h.dtype:
            raise ValueError(f"{name} has dtype {np.dtype(a.dtype).name} but h has "
                             f"{np.dtype(h.dtype).name}; pass all four in one dtype")


# --- the per-shard program (one source for both partitioning paths) ------------------------------

def _axes(entry) -> tuple:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


class _Plan(NamedTuple):
    batch: tuple  # spec entries of h's leading dimensions (the outputs' too)
    k_axes: tuple  # mesh axes sharding the contracting dimension


def _plan(ndim: int, h_spec, w_spec) -> _Plan:
    """Where each operand must be: k sharded as w's contracting dimension is (h's if w's is
    not), h's leading dimensions as they are minus those axes, n replicated."""
    h_spec = tuple(h_spec) + (None,) * (ndim - len(tuple(h_spec)))
    w_spec = tuple(w_spec) + (None,) * (2 - len(tuple(w_spec)))
    k_axes = _axes(w_spec[0]) or _axes(h_spec[-1])
    batch = []
    for entry in h_spec[:-1]:
        kept = tuple(a for a in _axes(entry) if a not in k_axes)
        batch.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return _Plan(tuple(batch), k_axes)


def _k_entry(plan: _Plan):
    return None if not plan.k_axes else (
        plan.k_axes[0] if len(plan.k_axes) == 1 else plan.k_axes)


def _specs(plan: _Plan):
    """(in specs of h, w, residual, gamma; out spec of both results)."""
    k = _k_entry(plan)
    out = P(*plan.batch, None)
    return (P(*plan.batch, k), P(k, None), out, P(None)), out


def _mesh_ids(mesh):
    """The mesh's device ids, or None for an abstract mesh (explicit axes at trace time: the
    devices are checked when the kernel's call is lowered)."""
    if isinstance(mesh, jax.sharding.AbstractMesh):
        return None
    devices = getattr(mesh, "devices", None)
    if not isinstance(devices, np.ndarray) or devices.dtype != object:
        return None
    return tuple(int(d.id) for d in devices.flat)


def _same_mesh(ws_mesh, mesh) -> bool:
    if tuple(ws_mesh.axis_names) != tuple(mesh.axis_names):
        return False
    if dict(ws_mesh.shape) != dict(mesh.shape):
        return False
    ids = _mesh_ids(mesh)
    return ids is None or ids == _mesh_ids(ws_mesh)


def _pick_workspace(cfg: _Config, mesh, plan: _Plan, dtype):
    """(the workspace serving this call, None) or (None, why none does; None when the user
    gave no workspace, i.e. asked for the XLA path)."""
    if not cfg.workspaces:
        return None, None
    k_axes = _reduced_axes(plan.k_axes, mesh)
    if len(k_axes) > 1:
        return None, (f"the contracting dimension is sharded over several mesh axes "
                      f"{k_axes}; the fused kernel reduces over one")
    axis = k_axes[0]
    for ws in cfg.workspaces:
        if (ws.axis_name == axis and not ws.destroyed and ws.dtype == np.dtype(dtype)
                and _same_mesh(ws.mesh, mesh)):
            return ws, None
    return None, (f"no workspace was given for mesh axis {axis!r} of this mesh and dtype "
                  f"{np.dtype(dtype).name}")


def _local_program(cfg: _Config, mesh, plan: _Plan):
    """The per-shard program: the local matmul, then the fused op over the k axis."""

    def local(h, w, residual, gamma):
        partial_sum = jnp.dot(h, w, precision=cfg.precision)
        partial_sum = _reduce_size_one_axes(partial_sum, plan.k_axes, mesh)
        if not _reduced_axes(plan.k_axes, mesh):  # nothing to reduce: the plain math
            _, res, norm = reference.epilogue(partial_sum, residual, gamma, pattern=_PATTERN,
                                              rms_eps=cfg.rms_eps, weight_bias=cfg.weight_bias)
            return res, norm
        n = partial_sum.shape[-1]
        rows = (math.prod(partial_sum.shape[:-1]), n)
        x2, r2 = partial_sum.reshape(rows), residual.reshape(rows)
        ws, why = _pick_workspace(cfg, mesh, plan, h.dtype)
        if ws is not None:
            out = allreduce_fusion(x2, axis_name=_reduced_axes(plan.k_axes, mesh)[0],
                                   workspace=ws,
                                   residual=r2, rms_gamma=gamma, rms_eps=cfg.rms_eps,
                                   weight_bias=cfg.weight_bias, use_oneshot=cfg.use_oneshot,
                                   fp32_acc=cfg.fp32_acc, strict=cfg.strict)
            res, norm = out.residual_out, out.norm_out
        else:
            if why is not None:  # workspaces were given but none serves this call
                fallback("no matching workspace", why, backend_choice.strict_mode(cfg.strict),
                         "trtllm")
            axes = _reduced_axes(plan.k_axes, mesh)
            axis = axes[0] if len(axes) == 1 else axes
            _, res, norm = reference.allreduce_fusion_reference(
                x2, r2, gamma, axis_name=axis, pattern=_PATTERN, rms_eps=cfg.rms_eps,
                weight_bias=cfg.weight_bias, fp32_acc=cfg.fp32_acc)
        return res.reshape(partial_sum.shape), norm.reshape(partial_sum.shape)

    return local


# --- Auto axes: custom_partitioning with a Shardy rule -------------------------------------------

@partial(custom_partitioning, static_argnums=(4,))
def _partitioned(h, w, residual, gamma, cfg):
    # The unpartitioned meaning (one device, or inside a fully manual region): plain math.
    return _plain(h, w, residual, gamma, cfg)


def _plain(h, w, residual, gamma, cfg):
    _, res, norm = reference.epilogue(jnp.dot(h, w, precision=cfg.precision), residual, gamma,
                                      pattern=_PATTERN, rms_eps=cfg.rms_eps,
                                      weight_bias=cfg.weight_bias)
    return res, norm


# custom_partitioning has no autodiff rule: the forward is the partitioned op, the backward
# the gradient of the plain math (matmul, residual add, RMSNorm), which the partitioner
# shards like any jnp code (the all-reduce's transpose is the broadcast it already is).
@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _differentiable(h, w, residual, gamma, cfg):
    return _partitioned(h, w, residual, gamma, cfg)


def _differentiable_fwd(h, w, residual, gamma, cfg):
    return _partitioned(h, w, residual, gamma, cfg), (h, w, residual, gamma)


def _differentiable_bwd(cfg, saved, cotangents):
    _, vjp = jax.vjp(lambda *a: _plain(*a, cfg), *saved)
    return vjp(tuple(cotangents))


_differentiable.defvjp(_differentiable_fwd, _differentiable_bwd)


def _spec_of(sharding, ndim):
    spec = getattr(sharding, "spec", None)
    return tuple(spec) if spec is not None else (None,) * ndim


def partition(cfg, mesh, arg_shapes, result_shape):
    """The partition rule (also called directly by the tests): the shardings every operand
    and result must have, and the per-shard program."""
    h, w = arg_shapes[0], arg_shapes[1]
    plan = _plan(len(h.shape), _spec_of(h.sharding, len(h.shape)), _spec_of(w.sharding, 2))
    in_specs, out_spec = _specs(plan)
    arg_shardings = tuple(NamedSharding(mesh, s) for s in in_specs)
    out = NamedSharding(mesh, out_spec)
    return mesh, _local_program(cfg, mesh, plan), (out, out), arg_shardings


def _infer_sharding_from_operands(cfg, mesh, arg_shapes, result_shape):
    # For the GSPMD partitioner (Shardy uses the sharding rule).
    h, w = arg_shapes[0], arg_shapes[1]
    plan = _plan(len(h.shape), _spec_of(h.sharding, len(h.shape)), _spec_of(w.sharding, 2))
    out = NamedSharding(mesh, _specs(plan)[1])
    return (out, out)


_partitioned.def_partition(partition=partition,
                           infer_sharding_from_operands=_infer_sharding_from_operands,
                           sharding_rule=SHARDING_RULE, need_replication_factors=("n",))


# --- Explicit axes: the shardings are in the types -----------------------------------------------

def _explicit(cfg, mesh, h, w, residual, gamma):
    plan = _plan(h.ndim, jax.typeof(h).sharding.spec, jax.typeof(w).sharding.spec)
    in_specs, out_spec = _specs(plan)
    args = [jax.sharding.reshard(a, s) for a, s in zip((h, w, residual, gamma), in_specs)]
    local = _local_program(cfg, mesh, plan)
    res, norm = jax.shard_map(local, mesh=mesh, in_specs=in_specs,
                              out_specs=(out_spec, out_spec))(*args)
    return AllReduceFusionOutputs(None, res, norm, None, None)


# --- size-1 mesh axes and float32 gammas (both entries) ------------------------------------------

def _reduced_axes(axes, mesh) -> tuple:
    """The mesh axes a reduction over ``axes`` really sums over: those of size > 1 (a
    sharding over ('y', 'z') with z of size 1 is a sharding over 'y')."""
    sizes = dict(mesh.shape)
    return tuple(a for a in axes if sizes.get(a, 1) != 1)


def _reduce_size_one_axes(x, axes, mesh):
    """psum over the size-1 axes of ``axes``: no change in value, but the result no longer
    varies over them (what the outputs' specs, which leave them out, require)."""
    sizes = dict(mesh.shape)
    ones = tuple(a for a in axes if sizes.get(a, 1) == 1)
    return jax.lax.psum(x, ones) if ones else x


def _gamma_as(dtype, gamma):
    """A float32 gamma rounded to the call's dtype, where the kernel reads it."""
    return gamma.astype(dtype) if gamma.dtype != dtype else gamma


# --- any contraction: contracting_dims ------------------------------------------------------------

class _Contraction(NamedTuple):
    """Static description of a ``dot_general`` without batch dims: h's and w's contracted
    dims (paired), and both ranks."""
    h_dims: tuple
    w_dims: tuple
    h_ndim: int
    w_ndim: int

    @property
    def h_free(self) -> tuple:
        return tuple(d for d in range(self.h_ndim) if d not in self.h_dims)

    @property
    def w_free(self) -> int:
        return next(d for d in range(self.w_ndim) if d not in self.w_dims)

    def dimension_numbers(self):
        return ((self.h_dims, self.w_dims), ((), ()))


class _ContractionConfig(NamedTuple):
    base: _Config
    dims: _Contraction


def _as_contraction(contracting_dims, h, w) -> _Contraction:
    try:
        hd, wd = contracting_dims
        hd, wd = tuple(int(d) for d in hd), tuple(int(d) for d in wd)
    except (TypeError, ValueError):
        raise ValueError("contracting_dims must be ((h dims), (w dims)) as in "
                         f"jax.lax.dot_general, got {contracting_dims!r}") from None
    if len(hd) != len(wd) or not hd:
        raise ValueError(f"contracting_dims pairs h's and w's dims one to one, got {hd} and "
                         f"{wd}")
    hd = tuple(d % h.ndim if -h.ndim <= d < h.ndim else d for d in hd)
    wd = tuple(d % w.ndim if -w.ndim <= d < w.ndim else d for d in wd)
    if any(not 0 <= d < h.ndim for d in hd) or len(set(hd)) != len(hd):
        raise ValueError(f"contracting_dims: h's dims {hd} are not distinct dims of h "
                         f"{h.shape}")
    if any(not 0 <= d < w.ndim for d in wd) or len(set(wd)) != len(wd):
        raise ValueError(f"contracting_dims: w's dims {wd} are not distinct dims of w "
                         f"{w.shape}")
    if w.ndim - len(wd) != 1:
        raise ValueError(f"w {w.shape} must keep exactly one dim (n) out of the contraction "
                         f"{wd}")
    if h.ndim - len(hd) < 1:
        raise ValueError(f"h {h.shape} must keep at least one (token) dim out of the "
                         f"contraction {hd}")
    for a, b in zip(hd, wd):
        if h.shape[a] != w.shape[b]:
            raise ValueError(f"contracting_dims pairs h's dim {a} ({h.shape[a]}) with w's dim "
                             f"{b} ({w.shape[b]})")
    return _Contraction(hd, wd, h.ndim, w.ndim)


def _contraction_entry(h, w, contracting_dims, residual, rms_gamma, workspace, rms_eps,
                       weight_bias, fp32_acc, use_oneshot, strict, precision):
    workspaces = _as_workspaces(workspace)
    base = _checked_config(workspaces, rms_eps, weight_bias, fp32_acc, use_oneshot, strict,
                           precision)
    for name, value in (("h", h), ("w", w), ("rms_gamma", rms_gamma)):
        if value is None:
            raise ValueError(f"{name} is required (row_parallel_allreduce_fusion(h, w, "
                             "residual=..., rms_gamma=..., contracting_dims=...))")
    h, w, rms_gamma = jnp.asarray(h), jnp.asarray(w), jnp.asarray(rms_gamma)
    dims = _as_contraction(contracting_dims, h, w)
    n = w.shape[dims.w_free]
    lead = tuple(h.shape[d] for d in dims.h_free)
    residual = jnp.zeros((*lead, n), h.dtype) if residual is None else jnp.asarray(residual)
    if residual.shape != (*lead, n):
        raise ValueError(f"residual must have shape {(*lead, n)} (h's free dims, w's n), got "
                         f"{residual.shape}")
    if rms_gamma.shape != (n,):
        raise ValueError(f"rms_gamma must have shape ({n},), got {rms_gamma.shape}")
    for name, a in (("w", w), ("residual", residual), ("rms_gamma", rms_gamma)):
        if a.dtype != h.dtype and not (name == "rms_gamma" and a.dtype == jnp.float32):
            raise ValueError(f"{name} has dtype {np.dtype(a.dtype).name} but h has "
                             f"{np.dtype(h.dtype).name}; pass them in one dtype (rms_gamma "
                             "may also be float32)")
    rms_gamma = _gamma_as(h.dtype, rms_gamma)
    cfg = _ContractionConfig(base, dims)
    mesh = jax.typeof(h).sharding.mesh
    types = set(getattr(mesh, "axis_types", ()))
    if AxisType.Manual in types:
        raise ValueError("row_parallel_allreduce_fusion is called on global arrays, outside "
                         "shard_map; inside shard_map call jax_fusedar.allreduce_fusion on "
                         "the local matmul")
    if AxisType.Explicit in types:
        return _contraction_explicit(cfg, mesh, h, w, residual, rms_gamma)
    residual_out, norm_out = _contraction_differentiable(h, w, residual, rms_gamma, cfg)
    return AllReduceFusionOutputs(None, residual_out, norm_out, None, None)


def _contraction_plan(cfg: _ContractionConfig, h_spec, w_spec):
    """(in specs of h, w, residual, gamma; out spec; the mesh axes sharding the
    contraction). Each contracted pair is sharded as w's dim is (h's when w's is not), h's
    free dims keep their axes but those, and n stays whole (RMSNorm needs whole rows)."""
    dims = cfg.dims
    h_spec = tuple(h_spec) + (None,) * (dims.h_ndim - len(tuple(h_spec)))
    w_spec = tuple(w_spec) + (None,) * (dims.w_ndim - len(tuple(w_spec)))
    pair_axes = [_axes(w_spec[b]) or _axes(h_spec[a]) for a, b in zip(dims.h_dims, dims.w_dims)]
    k_axes = []
    for axes in pair_axes:
        k_axes += [x for x in axes if x not in k_axes]
    k_axes = tuple(k_axes)
    seen = set()
    pair_entries = []
    for axes in pair_axes:   # an axis shards one contracted dim only
        kept = tuple(a for a in axes if a not in seen)
        seen |= set(kept)
        pair_entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    batch = []
    for d in dims.h_free:
        kept = tuple(a for a in _axes(h_spec[d]) if a not in k_axes)
        batch.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    h_in = [None] * dims.h_ndim
    w_in = [None] * dims.w_ndim
    for (a, b), entry in zip(zip(dims.h_dims, dims.w_dims), pair_entries):
        h_in[a] = w_in[b] = entry
    for d, entry in zip(dims.h_free, batch):
        h_in[d] = entry
    out = P(*batch, None)
    return (P(*h_in), P(*w_in), out, P(None)), out, k_axes


def _contraction_local(cfg: _ContractionConfig, mesh, k_axes):
    base = cfg.base
    plan = _Plan(batch=(), k_axes=k_axes)

    def local(h, w, residual, gamma):
        partial_sum = jax.lax.dot_general(h, w, cfg.dims.dimension_numbers(),
                                          precision=base.precision)
        partial_sum = _reduce_size_one_axes(partial_sum, k_axes, mesh)
        axes = _reduced_axes(k_axes, mesh)
        if not axes:  # nothing to reduce: the plain math
            _, res, norm = reference.epilogue(partial_sum, residual, gamma, pattern=_PATTERN,
                                              rms_eps=base.rms_eps,
                                              weight_bias=base.weight_bias)
            return res, norm
        n = partial_sum.shape[-1]
        rows = (math.prod(partial_sum.shape[:-1]), n)
        x2, r2 = partial_sum.reshape(rows), residual.reshape(rows)
        ws, why = _pick_workspace(base, mesh, plan, h.dtype)
        if ws is not None:
            out = allreduce_fusion(x2, axis_name=axes[0], workspace=ws, residual=r2,
                                   rms_gamma=gamma, rms_eps=base.rms_eps,
                                   weight_bias=base.weight_bias, use_oneshot=base.use_oneshot,
                                   fp32_acc=base.fp32_acc, strict=base.strict)
            res, norm = out.residual_out, out.norm_out
        else:
            if why is not None:  # workspaces were given but none serves this call
                fallback("no matching workspace", why, backend_choice.strict_mode(base.strict),
                         "trtllm")
            _, res, norm = reference.allreduce_fusion_reference(
                x2, r2, gamma, axis_name=axes[0] if len(axes) == 1 else axes,
                pattern=_PATTERN, rms_eps=base.rms_eps, weight_bias=base.weight_bias,
                fp32_acc=base.fp32_acc)
        return res.reshape(partial_sum.shape), norm.reshape(partial_sum.shape)

    return local


def _contraction_plain(h, w, residual, gamma, cfg: _ContractionConfig):
    summed = jax.lax.dot_general(h, w, cfg.dims.dimension_numbers(), precision=cfg.base.precision)
    _, res, norm = reference.epilogue(summed, residual, gamma, pattern=_PATTERN,
                                      rms_eps=cfg.base.rms_eps, weight_bias=cfg.base.weight_bias)
    return res, norm


def _contraction_rule(cfg: _ContractionConfig, mesh, value_types, result_types):
    """The Shardy rule: one factor per dim of h (contracted ones shared with w), n for w's
    free dim, which the norm needs whole."""
    dims = cfg.dims
    h_names = [f"c{dims.h_dims.index(d)}" if d in dims.h_dims else f"t{d}"
               for d in range(dims.h_ndim)]
    w_names = [f"c{dims.w_dims.index(d)}" if d in dims.w_dims else "n"
               for d in range(dims.w_ndim)]
    lead = " ".join(f"t{d}" for d in dims.h_free)
    rule = (f"{' '.join(h_names)}, {' '.join(w_names)}, {lead} n, n -> {lead} n, {lead} n")
    return rule, {"need_replication_factors": ("n",)}


@partial(custom_partitioning, static_argnums=(4,))
def _contraction_partitioned(h, w, residual, gamma, cfg):
    return _contraction_plain(h, w, residual, gamma, cfg)


def partition_contraction(cfg, mesh, arg_shapes, result_shape):
    h, w = arg_shapes[0], arg_shapes[1]
    in_specs, out_spec, k_axes = _contraction_plan(
        cfg, _spec_of(h.sharding, len(h.shape)), _spec_of(w.sharding, len(w.shape)))
    out = NamedSharding(mesh, out_spec)
    return (mesh, _contraction_local(cfg, mesh, k_axes), (out, out),
            tuple(NamedSharding(mesh, s) for s in in_specs))


def _contraction_infer(cfg, mesh, arg_shapes, result_shape):
    h, w = arg_shapes[0], arg_shapes[1]
    _, out_spec, _ = _contraction_plan(
        cfg, _spec_of(h.sharding, len(h.shape)), _spec_of(w.sharding, len(w.shape)))
    out = NamedSharding(mesh, out_spec)
    return (out, out)


_contraction_partitioned.def_partition(partition=partition_contraction,
                                       infer_sharding_from_operands=_contraction_infer,
                                       sharding_rule=_contraction_rule)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _contraction_differentiable(h, w, residual, gamma, cfg):
    return _contraction_partitioned(h, w, residual, gamma, cfg)


def _contraction_differentiable_fwd(h, w, residual, gamma, cfg):
    return _contraction_partitioned(h, w, residual, gamma, cfg), (h, w, residual, gamma)


def _contraction_differentiable_bwd(cfg, saved, cotangents):
    _, vjp = jax.vjp(lambda *a: _contraction_plain(*a, cfg), *saved)
    return vjp(tuple(cotangents))


_contraction_differentiable.defvjp(_contraction_differentiable_fwd,
                                   _contraction_differentiable_bwd)


def _contraction_explicit(cfg, mesh, h, w, residual, gamma):
    in_specs, out_spec, k_axes = _contraction_plan(
        cfg, jax.typeof(h).sharding.spec, jax.typeof(w).sharding.spec)
    args = [jax.sharding.reshard(a, s) for a, s in zip((h, w, residual, gamma), in_specs)]
    res, norm = jax.shard_map(_contraction_local(cfg, mesh, k_axes), mesh=mesh,
                              in_specs=in_specs, out_specs=(out_spec, out_spec))(*args)
    return AllReduceFusionOutputs(None, res, norm, None, None)
