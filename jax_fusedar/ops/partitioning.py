"""``row_parallel_allreduce_fusion``: the fused op for plain ``jax.jit`` + shardings (no shard_map).

Models written in MaxText's style never see the row-parallel all-reduce: they write
``y = h @ w`` with ``w`` sharded along its contracting dimension and the partitioner (Shardy,
JAX's default) inserts the all-reduce. This module gives such models one call for the
row-parallel matmul *and* what follows it::

    out = row_parallel_allreduce_fusion(h, w, residual=x, rms_gamma=gamma, workspace=ws)
    # out.residual_out = h @ w + x;  out.norm_out = RMSNorm(out.residual_out) * gamma

The matmul is any ``dot_general`` contraction without batch dims (``contracting_dims``, e.g.
an attention output projection ``bhtq,hqd->btd``); ``h [..., k] @ w [k, n]`` is the one that
contracts h's last dim with w's first. The op partitions itself:

* **Auto axes** (``jax.make_mesh(..., axis_types=(AxisType.Auto, ...))``, ``NamedSharding``
  on the arguments, MaxText's way): a ``jax.experimental.custom_partitioning`` op with a
  Shardy sharding rule (as TransformerEngine-JAX's ``cpp_extensions`` do). Its partition
  rule, which runs when XLA compiles the program, reads where the partitioner put ``w``'s
  contracted dimensions; each shard then runs its local contraction followed by
  ``allreduce_fusion`` over that mesh axis (the kernel when a workspace fits, else its
  fallback in XLA: ``psum`` in the matmul's dtype + residual add + RMSNorm).
* **Explicit axes** (``jax.make_mesh``'s default): the shardings are part of the types, so the
  same per-shard program is placed with ``jax.shard_map`` at trace time.

Either way the per-shard program is exactly what a user would write inside ``shard_map``
(``allreduce_fusion(h_local @ w_local, ...)``), so both give the same bits as that version.
When the contraction is not sharded, the plain math runs (one matmul, the residual add and
the norm, no reduction); when it is sharded over several mesh axes (size-1 axes do not
count), or no workspace serves the axis, the fallback runs (logged once; ``strict``
raises): by default the psum over those axes in the matmul's dtype, which is the
all-reduce the partitioner inserts for the plain matmul, then the residual add and RMSNorm
(``fallback="kernel_exact"``: the kernel's additions, as for ``allreduce_fusion``).
Outputs are sharded like ``h``'s free (token) dimensions, with the hidden dimension
replicated (RMSNorm needs whole rows). On Auto axes the op is a
``custom_vjp`` (custom_partitioning has no autodiff) whose backward is the plain math's
gradient; on Explicit axes ``allreduce_fusion``'s rules apply. ``jax.export`` works on
Explicit axes only (the Auto-axes partition rule is a Python callback, which artifacts
cannot carry).
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

from ..common import arguments, backend_choice, limits
from . import reference
from .dense import AllReduceFusionOutputs, allreduce_fusion
from .plan import as_fallback, fallback
from ..common.patterns import AllReduceFusionPattern
from ..workspace import AllReduceFusionWorkspace

_PATTERN = int(AllReduceFusionPattern.kARResidualRMSNorm)


class _Contraction(NamedTuple):
    """Static description of a ``dot_general`` without batch dims: h's and w's contracted
    dims (paired), and both ranks. h's other dims are the token dims, in order; w keeps
    one, n, the hidden size."""

    h_dims: tuple
    w_dims: tuple
    h_ndim: int
    w_ndim: int
    w_first: bool = False  # computed as dot_general(w, h), then n moved last

    @classmethod
    def matmul(cls, h_ndim: int) -> "_Contraction":
        """``h [..., k] @ w [k, n]``."""
        return cls((h_ndim - 1,), (0,), h_ndim, 2)

    @property
    def h_free(self) -> tuple:
        return tuple(d for d in range(self.h_ndim) if d not in self.h_dims)

    @property
    def w_free(self) -> int:
        return next(d for d in range(self.w_ndim) if d not in self.w_dims)

    def dimension_numbers(self):
        return ((self.h_dims, self.w_dims), ((), ()))

    def contract(self, h, w, precision):
        """The contraction as the caller's program computes it: ``dot_general(h, w)``, or
        with ``w_first`` ``dot_general(w, h)`` and its n dim moved last (a per-token
        ``Linear`` of an (out, in) weight under ``vmap``, Equinox's way), so the products
        are summed in the program's own order."""
        if not self.w_first:
            return jax.lax.dot_general(h, w, self.dimension_numbers(), precision=precision)
        out = jax.lax.dot_general(w, h, ((self.w_dims, self.h_dims), ((), ())), precision=precision)
        return jnp.moveaxis(out, 0, -1)


class _Config(NamedTuple):
    """Static (hashable) arguments of the partitioned op."""

    workspaces: tuple
    rms_eps: float
    weight_bias: float
    fp32_acc: bool
    use_oneshot: Optional[bool]
    strict: Optional[bool]  # resolved by _checked_config (None: $JAX_FUSEDAR_STRICT)
    precision: object
    dims: _Contraction
    fallback: str = "xla"  # plan.FALLBACKS


def row_parallel_allreduce_fusion(
    h,
    w,
    *,
    residual,
    rms_gamma,
    workspace: Union[AllReduceFusionWorkspace, Sequence[AllReduceFusionWorkspace], None] = None,
    rms_eps: float = 1e-6,
    weight_bias: float = 0.0,
    fp32_acc: bool = True,
    use_oneshot: Optional[bool] = None,
    strict: Optional[bool] = None,
    precision=None,
    contracting_dims=None,
    fallback: str = "xla",
    weight_first: bool = False,
) -> AllReduceFusionOutputs:
    """Row-parallel ``h @ w`` fused with the all-reduce, residual add and RMSNorm.

    Call it under ``jax.jit`` on globally shaped arrays, outside ``shard_map``; it partitions
    itself (module docstring). ``h``: ``[..., k]``; ``w``: ``[k, n]`` (shard ``k`` over the
    tensor-parallel axis); ``residual``: ``[..., n]``; ``rms_gamma``: ``[n]``; all of one
    dtype. ``workspace``: a workspace, or several (e.g. one per dtype or per axis), from
    ``create_allreduce_fusion_workspace``; the one created on the same mesh for the axis that
    shards ``k``, with the matmul's dtype, serves the call. None: the XLA path everywhere.
    ``precision`` is ``jax.lax.dot_general``'s. ``rms_gamma`` may also be float32 (a Flax
    ``param_dtype``): it is rounded to the dtype, where the kernel reads it, as
    ``allreduce_fusion`` does. ``contracting_dims``: ``((h dims), (w dims))`` contracted
    pairwise, as ``jax.lax.dot_general``'s, for any contraction (e.g. ``bhtq,hqd->btd``:
    ``((1, 3), (0, 1))``); h's other dims are token dims (in order) and w keeps exactly one
    free dim, ``n``. None: ``h [..., k] @ w [k, n]``. The other arguments are
    ``allreduce_fusion``'s; ``fallback`` also applies where no workspace serves the axis.
    ``weight_first``: contract as ``dot_general(w, h)`` with n then moved last (the same
    values, summed in that program's order; ``jax_fusedar.fuse`` passes it for per-token
    linears under ``vmap``).

    Returns ``AllReduceFusionOutputs`` with ``residual_out = h @ w + residual`` and
    ``norm_out = RMSNorm(residual_out) * (weight_bias + rms_gamma)`` (other fields None).
    """
    h, w, residual, rms_gamma, dims = _checked_operands(h, w, residual, rms_gamma, contracting_dims)
    if not isinstance(weight_first, (bool, np.bool_)):
        raise TypeError(f"weight_first must be True or False, got {weight_first!r}")
    dims = dims._replace(w_first=bool(weight_first))
    cfg = _checked_config(
        dims, workspace, rms_eps, weight_bias, fp32_acc, use_oneshot, strict, precision, fallback
    )
    _check_up_front(cfg, h, w, residual, rms_gamma)
    mesh = jax.typeof(h).sharding.mesh
    types = set(getattr(mesh, "axis_types", ()))
    if AxisType.Manual in types:
        # Inside shard_map the arrays are shards: the partial sums would never be reduced.
        raise ValueError(
            "row_parallel_allreduce_fusion is called on global arrays, outside "
            "shard_map; inside shard_map call jax_fusedar.allreduce_fusion on "
            "the local matmul"
        )
    if AxisType.Explicit in types:
        return _explicit(cfg, mesh, h, w, residual, rms_gamma)
    residual_out, norm_out = _differentiable(h, w, residual, rms_gamma, cfg)
    return AllReduceFusionOutputs(None, residual_out, norm_out, None, None)


# --- validation, once, while tracing -------------------------------------------------------------


def _checked_config(
    dims, workspace, rms_eps, weight_bias, fp32_acc, use_oneshot, strict, precision, fallback
) -> _Config:
    """The options, validated once, here, with ``allreduce_fusion``'s validators (never
    coerced: ``bool("false")`` is True). On Auto axes the per-shard program runs only when
    XLA compiles the partitioned op, where an error would be an INTERNAL custom_partitioner
    traceback; when the contraction is not sharded it never meets allreduce_fusion's checks
    at all."""
    workspaces = _as_workspaces(workspace)
    opts = arguments.fusion_options(
        rms_eps=rms_eps, weight_bias=weight_bias, fp32_acc=fp32_acc, use_oneshot=use_oneshot
    )
    return _Config(
        workspaces,
        opts.rms_eps,
        opts.weight_bias,
        opts.fp32_acc,
        opts.use_oneshot,
        backend_choice.strict_mode(strict),
        precision,
        dims,
        as_fallback(fallback),
    )


def _as_workspaces(workspace) -> tuple:
    if workspace is None:
        return ()
    many = tuple(workspace) if isinstance(workspace, (list, tuple)) else (workspace,)
    for ws in many:
        if not isinstance(ws, AllReduceFusionWorkspace):
            raise TypeError(
                "workspace must be an AllReduceFusionWorkspace from "
                "jax_fusedar.create_allreduce_fusion_workspace, a sequence of them, "
                f"or None; got {type(ws).__name__}"
            )
        if ws.destroyed:
            raise ValueError(f"workspace {ws!r} was destroyed")
    return many


def _checked_operands(h, w, residual, gamma, contracting_dims):
    """The four operands as arrays, checked against each other and the contraction (also
    returned): ``residual=None`` is zeros, as for allreduce_fusion, and a float32 gamma is
    rounded to h's dtype, where the kernel reads it."""
    for name, value in (("h", h), ("w", w), ("rms_gamma", gamma)):
        if value is None:
            raise ValueError(
                f"{name} is required (row_parallel_allreduce_fusion(h, w, "
                "residual=..., rms_gamma=...): h [..., k], w [k, n], "
                "rms_gamma [n], or any contraction with contracting_dims)"
            )
    h, w, gamma = jnp.asarray(h), jnp.asarray(w), jnp.asarray(gamma)
    dims = _as_contraction(contracting_dims, h, w)
    n = w.shape[dims.w_free]
    lead = tuple(h.shape[d] for d in dims.h_free)
    residual = jnp.zeros((*lead, n), h.dtype) if residual is None else jnp.asarray(residual)
    if residual.shape != (*lead, n):
        raise ValueError(
            f"residual must have shape {(*lead, n)} (h's free (token) dims, "
            f"w's n), got {residual.shape}"
        )
    if gamma.shape != (n,):
        raise ValueError(f"rms_gamma must have shape ({n},), got {gamma.shape}")
    for name, a in (("w", w), ("residual", residual), ("rms_gamma", gamma)):
        if a.dtype != h.dtype and not (name == "rms_gamma" and a.dtype == jnp.float32):
            raise ValueError(
                f"{name} has dtype {np.dtype(a.dtype).name} but h has "
                f"{np.dtype(h.dtype).name}; pass them in one dtype (rms_gamma "
                "may also be float32)"
            )
    return h, w, residual, gamma.astype(h.dtype), dims


def _as_contraction(contracting_dims, h, w) -> _Contraction:
    if contracting_dims is None:
        if h.ndim < 2:
            raise ValueError(f"h must be [..., tokens, k] (at least 2-D), got shape {h.shape}")
        if w.ndim != 2 or w.shape[0] != h.shape[-1]:
            raise ValueError(
                f"w must be [k, n] with k = h.shape[-1] = {h.shape[-1]}, got "
                f"shape {w.shape}; for another contraction pass contracting_dims"
            )
        return _Contraction.matmul(h.ndim)
    try:
        hd, wd = contracting_dims
        hd, wd = tuple(int(d) for d in hd), tuple(int(d) for d in wd)
    except (TypeError, ValueError):
        raise ValueError(
            "contracting_dims must be ((h dims), (w dims)) as in "
            f"jax.lax.dot_general, got {contracting_dims!r}"
        ) from None
    if len(hd) != len(wd) or not hd:
        raise ValueError(f"contracting_dims pairs h's and w's dims one to one, got {hd} and {wd}")
    hd = tuple(d % h.ndim if -h.ndim <= d < h.ndim else d for d in hd)
    wd = tuple(d % w.ndim if -w.ndim <= d < w.ndim else d for d in wd)
    if any(not 0 <= d < h.ndim for d in hd) or len(set(hd)) != len(hd):
        raise ValueError(f"contracting_dims: h's dims {hd} are not distinct dims of h {h.shape}")
    if any(not 0 <= d < w.ndim for d in wd) or len(set(wd)) != len(wd):
        raise ValueError(f"contracting_dims: w's dims {wd} are not distinct dims of w {w.shape}")
    if w.ndim - len(wd) != 1:
        raise ValueError(f"w {w.shape} must keep exactly one dim (n) out of the contraction {wd}")
    if h.ndim - len(hd) < 1:
        raise ValueError(
            f"h {h.shape} must keep at least one (token) dim out of the contraction {hd}"
        )
    for a, b in zip(hd, wd):
        if h.shape[a] != w.shape[b]:
            raise ValueError(
                f"contracting_dims pairs h's dim {a} ({h.shape[a]}) with w's dim {b} ({w.shape[b]})"
            )
    return _Contraction(hd, wd, h.ndim, w.ndim)


def _check_up_front(cfg: _Config, h, w, residual, gamma) -> None:
    """What the per-shard program would refuse for any partitioning, refused now: the plain
    math itself (e.g. ``precision``), and with a workspace of h's dtype the kernel's rules
    on the hidden size n (16-byte vectors always; in strict mode the launch limits too)."""
    jax.eval_shape(
        partial(_plain, cfg=cfg),
        *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (h, w, residual, gamma)),
    )
    dtype_name = np.dtype(h.dtype).name
    n = w.shape[cfg.dims.w_free]
    for ws in cfg.workspaces:
        if ws.dtype != np.dtype(h.dtype):
            continue
        width = limits.vector_width(dtype_name)
        if n % width:
            raise ValueError(
                f"w's free dim n = {n}, the hidden size of the fused op, is "
                f"not a multiple of {width} (16 bytes of {dtype_name}), as the "
                f"kernel requires; pass no {dtype_name} workspace for the XLA "
                "path"
            )
        problem = limits.kernel_support_problem(ws.world_size, n, dtype_name)
        if problem and cfg.strict:
            fallback("unsupported shape", problem, True, ws.backend)
    if (
        cfg.strict
        and cfg.workspaces
        and not any(ws.dtype == np.dtype(h.dtype) for ws in cfg.workspaces)
    ):
        fallback(
            "no matching workspace",
            f"no workspace was given for dtype {dtype_name}",
            True,
            "trtllm",
        )


# --- the plan and the per-shard program (one source for both partitioning paths) -----------------


def _axes(entry) -> tuple:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _entry(axes: tuple):
    return None if not axes else axes[0] if len(axes) == 1 else axes


class _Plan(NamedTuple):
    in_specs: tuple  # of h, w, residual, gamma
    out_spec: P  # of both results
    k_axes: tuple  # the mesh axes sharding the contraction


def _plan(dims: _Contraction, h_spec, w_spec) -> _Plan:
    """Where each operand must be: each contracted pair sharded as w's dim is (h's when w's
    is not), h's free dims keeping their axes but those, and n whole (RMSNorm needs whole
    rows)."""
    h_spec = tuple(h_spec) + (None,) * (dims.h_ndim - len(tuple(h_spec)))
    w_spec = tuple(w_spec) + (None,) * (dims.w_ndim - len(tuple(w_spec)))
    pair_axes = [_axes(w_spec[b]) or _axes(h_spec[a]) for a, b in zip(dims.h_dims, dims.w_dims)]
    k_axes = []
    for axes in pair_axes:
        k_axes += [x for x in axes if x not in k_axes]
    h_in = [None] * dims.h_ndim
    w_in = [None] * dims.w_ndim
    seen = set()
    for a, b, axes in zip(dims.h_dims, dims.w_dims, pair_axes):  # an axis shards one pair only
        kept = tuple(x for x in axes if x not in seen)
        seen |= set(kept)
        h_in[a] = w_in[b] = _entry(kept)
    batch = [_entry(tuple(x for x in _axes(h_spec[d]) if x not in k_axes)) for d in dims.h_free]
    for d, entry in zip(dims.h_free, batch):
        h_in[d] = entry
    out = P(*batch, None)
    return _Plan((P(*h_in), P(*w_in), out, P(None)), out, tuple(k_axes))


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


def _pick_workspace(cfg: _Config, mesh, axes: tuple, dtype):
    """(the workspace serving a reduction over ``axes``, None) or (None, why none does;
    None when the user gave no workspace, i.e. asked for the XLA path)."""
    if not cfg.workspaces:
        return None, None
    if len(axes) > 1:
        return None, (
            f"the contracting dimension is sharded over several mesh axes "
            f"{axes}; the fused kernel reduces over one"
        )
    axis = axes[0]
    for ws in cfg.workspaces:
        if (
            ws.axis_name == axis
            and not ws.destroyed
            and ws.dtype == np.dtype(dtype)
            and _same_mesh(ws.mesh, mesh)
        ):
            return ws, None
    return None, (
        f"no workspace was given for mesh axis {axis!r} of this mesh and dtype "
        f"{np.dtype(dtype).name}"
    )


def _local_program(cfg: _Config, mesh, k_axes: tuple):
    """The per-shard program: the local contraction, then the fused op over the k axis."""

    def local(h, w, residual, gamma):
        partial_sum = cfg.dims.contract(h, w, cfg.precision)
        partial_sum = _reduce_size_one_axes(partial_sum, k_axes, mesh)
        axes = _reduced_axes(k_axes, mesh)
        if not axes:  # nothing to reduce: the plain math
            return _epilogue(partial_sum, residual, gamma, cfg)
        n = partial_sum.shape[-1]
        rows = (math.prod(partial_sum.shape[:-1]), n)
        x2, r2 = partial_sum.reshape(rows), residual.reshape(rows)
        ws, why = _pick_workspace(cfg, mesh, axes, h.dtype)
        if ws is not None:
            out = allreduce_fusion(
                x2,
                axis_name=axes[0],
                workspace=ws,
                residual=r2,
                rms_gamma=gamma,
                rms_eps=cfg.rms_eps,
                weight_bias=cfg.weight_bias,
                use_oneshot=cfg.use_oneshot,
                fp32_acc=cfg.fp32_acc,
                strict=cfg.strict,
                fallback=cfg.fallback,
            )
            res, norm = out.residual_out, out.norm_out
        else:
            if why is not None:  # workspaces were given but none serves this call
                fallback(
                    "no matching workspace", why, backend_choice.strict_mode(cfg.strict), "trtllm"
                )
            _, res, norm = reference.allreduce_fusion_reference(
                x2,
                r2,
                gamma,
                axis_name=_entry(axes),
                pattern=_PATTERN,
                rms_eps=cfg.rms_eps,
                weight_bias=cfg.weight_bias,
                fp32_acc=cfg.fp32_acc,
                fallback=cfg.fallback,
            )
        return res.reshape(partial_sum.shape), norm.reshape(partial_sum.shape)

    return local


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


def _epilogue(summed, residual, gamma, cfg):
    """(residual_out, norm_out) of a complete sum: the residual add and RMSNorm, rounding as
    the call's fallback does (``reference.roundings``)."""
    _, res, norm = reference.epilogue(
        summed,
        residual,
        gamma,
        pattern=_PATTERN,
        rms_eps=cfg.rms_eps,
        weight_bias=cfg.weight_bias,
        rounding=reference.roundings(cfg.fallback)[0],
    )
    return res, norm


def _plain(h, w, residual, gamma, cfg):
    """The op's meaning on one device: the contraction, the residual add and the norm."""
    return _epilogue(cfg.dims.contract(h, w, cfg.precision), residual, gamma, cfg)


def row_parallel_without_kernel(
    summed, *, residual, rms_gamma, rms_eps: float, weight_bias: float, fallback: str = "xla"
) -> AllReduceFusionOutputs:
    """``row_parallel_allreduce_fusion``'s result where no kernel can serve it, written as
    the unfused program writes it: ``summed``, the row-parallel contraction computed by the
    caller's own ``dot_general`` on global arrays (its all-reduce is the one XLA's
    partitioner inserts, in the matmul's dtype: that of the ``"xla"`` fallback), then the
    residual add and RMSNorm at the fused op's rounding points (``fallback``: "xla" or
    "xla_plain", ``reference.roundings``). No ``custom_partitioning`` is compiled:
    ``jax_fusedar.fuse`` emits this for a plain-jit site whose workspace has no kernel (the
    xla backend), so that the rewritten program costs what the original did to run and to
    compile."""
    fallback = as_fallback(fallback)
    opts = arguments.fusion_options(
        rms_eps=rms_eps, weight_bias=weight_bias, fp32_acc=True, use_oneshot=None
    )
    _, res, norm = reference.epilogue(
        summed,
        residual,
        jnp.asarray(rms_gamma).astype(summed.dtype),
        pattern=_PATTERN,
        rms_eps=opts.rms_eps,
        weight_bias=opts.weight_bias,
        rounding=reference.roundings(fallback)[0],
    )
    return AllReduceFusionOutputs(None, res, norm, None, None)


# --- Auto axes: custom_partitioning with a Shardy rule -------------------------------------------


@partial(custom_partitioning, static_argnums=(4,))
def _partitioned(h, w, residual, gamma, cfg):
    # The unpartitioned meaning (one device, or inside a fully manual region): plain math.
    return _plain(h, w, residual, gamma, cfg)


# custom_partitioning has no autodiff rule: the forward is the partitioned op, the backward
# the gradient of the plain math (contraction, residual add, RMSNorm), which the partitioner
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


def _plan_of(cfg: _Config, arg_shapes) -> _Plan:
    h, w = arg_shapes[0], arg_shapes[1]
    return _plan(cfg.dims, _spec_of(h.sharding, len(h.shape)), _spec_of(w.sharding, len(w.shape)))


def partition(cfg, mesh, arg_shapes, result_shape):
    """The partition rule (also called directly by the tests): the shardings every operand
    and result must have, and the per-shard program."""
    plan = _plan_of(cfg, arg_shapes)
    out = NamedSharding(mesh, plan.out_spec)
    return (
        mesh,
        _local_program(cfg, mesh, plan.k_axes),
        (out, out),
        tuple(NamedSharding(mesh, s) for s in plan.in_specs),
    )


def _infer_sharding_from_operands(cfg, mesh, arg_shapes, result_shape):
    # For the GSPMD partitioner (Shardy uses the sharding rule).
    out = NamedSharding(mesh, _plan_of(cfg, arg_shapes).out_spec)
    return (out, out)


def _sharding_rule(cfg, mesh, value_types, result_types):
    """The Shardy rule: one factor per dim of h (contracted ones shared with w: the
    partition rule reduces them), n for w's free dim, which the norm needs whole. For
    ``h [..., k] @ w [k, n]``: ``... k, k n, ... n, n -> ... n, ... n``."""
    dims = cfg.dims
    h_names = [
        f"c{dims.h_dims.index(d)}" if d in dims.h_dims else f"t{d}" for d in range(dims.h_ndim)
    ]
    w_names = [f"c{dims.w_dims.index(d)}" if d in dims.w_dims else "n" for d in range(dims.w_ndim)]
    lead = " ".join(f"t{d}" for d in dims.h_free)
    rule = f"{' '.join(h_names)}, {' '.join(w_names)}, {lead} n, n -> {lead} n, {lead} n"
    return rule, {"need_replication_factors": ("n",)}


_partitioned.def_partition(
    partition=partition,
    infer_sharding_from_operands=_infer_sharding_from_operands,
    sharding_rule=_sharding_rule,
)


# --- Explicit axes: the shardings are in the types -----------------------------------------------


def _explicit(cfg, mesh, h, w, residual, gamma):
    plan = _plan(cfg.dims, jax.typeof(h).sharding.spec, jax.typeof(w).sharding.spec)
    # Shardings on the operands' own mesh: a PartitionSpec alone needs a mesh set
    # (jax.set_mesh), which a program given NamedSharding operands does not.
    args = [
        jax.sharding.reshard(a, NamedSharding(mesh, s))
        for a, s in zip((h, w, residual, gamma), plan.in_specs)
    ]
    res, norm = jax.shard_map(
        _local_program(cfg, mesh, plan.k_axes),
        mesh=mesh,
        in_specs=plan.in_specs,
        out_specs=(plan.out_spec, plan.out_spec),
    )(*args)
    return AllReduceFusionOutputs(None, res, norm, None, None)
