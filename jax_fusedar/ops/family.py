"""The op family: the one machinery behind every jax_fusedar FFI op (in the spirit of
TransformerEngine-JAX's ``BasePrimitive``, smaller). An op is declared once, as an ``FfiOp``.
An op of the pattern table (``common.patterns.TRAITS``: the dense op, both MoE ops) declares
only what is its own, the rest follows from the table:

* its operands (``patterns.operand_names``: by name, in the handler's order) and results
  (``results.result_specs``), from which the machinery derives its abstract evaluation
  (shapes, dtypes and the varying-manual-axes rule, ``table_abstract_eval``), its in-place
  alias (residual -> residual_out, ``table_aliases``) and its batching rule (fold the batch
  into tokens, or map: ``table_batch``), and by which its entry binds it (``FfiOp.call``);
* its reference math (every platform, and the cuda platform when a call was not cleared for
  the kernel at trace time), whose all-reduce is the call's fallback (``plan.fallback``:
  ``plan.FALLBACKS``, ``reference.fallback_allreduce``),
* the attributes and the in-place aliases of its custom call to the XLA FFI handler (cuda,
  when cleared for the kernel),
* its JVP rule (by default the tangent map of the reference math),

and is registered in the one registry of the package's FFI targets, from which
``jax_fusedar.export`` takes the targets it exempts from ``jax.export``'s custom-call check
(each op's target keeps its own compatibility guarantee: a versioned name whose operands,
results and attributes never change, and a handler that re-checks them). None of the ops
has a partition rule of its own (they run inside ``shard_map``);
``row_parallel_allreduce_fusion`` (``partitioning.py``) partitions the program around the
dense op.

Every op binds the same machinery parameters besides its own: ``axis_name`` (a 1-tuple),
``use_kernel`` (the trace-time decision, ``plan``), ``workspace_id`` and
``workspace_groups`` (the workspace's stable id, which the custom call carries, and its TP
groups, which every lowering checks against the mesh being lowered) and ``plan`` (what the
batching rule needs to decide again, and the fallback the reference computes). The
lowerings do the rest alike for every op: the mesh check, the reference for calls not cleared
for the kernel (with the export policy below), and the custom call. The custom call needs
only its target's name and attributes: a program is lowered (and exported) for cuda without
the native module, which only a process that compiles the program needs.
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from functools import partial
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from ..common import native, patterns, results
from ..common.patterns import TRAITS, AllReduceFusionPattern, QuantizationSFLayout
from .checks import check_call_groups
from .plan import FALLBACKS, decide, describe, kernel_problem

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
    from ..workspace import lookup

    ws = lookup(workspace_id)
    if ws is None or ws.backend != "xla" or getattr(ws, "xla_requested", False):
        return  # not the XLA backend, or the XLA backend asked for: served as asked
    if any(getattr(d, "platform", None) == "gpu" for d in ws.mesh.devices.flat):
        return  # the XLA backend chosen on GPUs: the user's (or auto's) explicit choice
    msg = (
        f"jax_fusedar: lowering for cuda with {ws!r}, an XLA-backend workspace of a process "
        "without GPUs (backend 'auto' found no GPU here): the program will run psum + "
        "RMSNorm, not the fused kernel. To export the kernel from this machine use "
        "jax_fusedar.abstract_workspace(..., backend='trtllm'), which serving processes "
        "match by key; to export psum + RMSNorm for cuda on purpose, ask for it with "
        "backend='xla' (abstract_workspace or create_allreduce_fusion_workspace)"
    )
    if _refuse_reference.get():
        raise ValueError(
            msg + " (or wrap the export in jax_fusedar.export.allow_reference_for_cuda())"
        )
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


def check_handlers_for_compiling(ctx, target: str) -> None:
    """The cuda lowering of the kernel's call: raises when this process would compile the
    program for its own GPUs without the handler (no native module), saying what to install
    (``native.require``'s words). Lowering for export, or for cuda on a machine without a
    cuda backend (to inspect or serialize the program), needs only the target's name and
    attributes: no module."""
    if native.available() or ctx.module_context.lowering_parameters.for_export:
        return
    try:
        jax.devices("cuda")
    except RuntimeError:
        return  # no cuda backend here: nothing in this process can compile it
    try:
        native.require()
    except RuntimeError as e:
        raise RuntimeError(
            f"jax_fusedar: this program calls the fused kernel ({target}) and would be "
            f"compiled here for this process's GPUs, but {e}"
        ) from e


def fallback_of(plan) -> str:
    """The fallback a call computes where the kernel does not serve it (``plan.fallback``;
    an op bound without a plan gets the default)."""
    return getattr(plan, "fallback", FALLBACKS[0])


# --- the family's rules, from the pattern table -------------------------------------------------
# A pattern's op takes the operands ``patterns.operand_names`` lists and writes the results
# ``results.result_specs`` lists: the rules below read both, so an op of the table declares
# neither its abstract evaluation, its aliases nor its batching rule.

# Operands that are no per-token rows: the norm's weight and the quantization's scale. They
# add their varying axes to the normalized results only; a batched one is never folded.
PARAMETER_OPERANDS = ("rms_gamma", "scale_factor")
# Operands laid out expert-major ([E, tokens, ...]), and the permuted rows that an index map
# (int32 [tokens, top_k], -1 = dropped) points into.
EXPERT_MAJOR_OPERANDS = ("expert_outputs", "expert_scales")
PERMUTED_ROWS, PERMUTED_INDEX = "permuted_input", "expanded_idx_to_permuted_idx"


def rows_operand(names) -> str:
    """The operand whose [tokens, hidden] the call's results have: the residual where the
    pattern reads one, else x."""
    return "residual" if "residual" in names else "x"


def result_specs_of(pattern, tokens, hidden, dtype_name, params):
    """The results of a call with these op parameters, in order (``results.result_specs``)."""
    return results.result_specs(
        pattern,
        tokens,
        hidden,
        dtype_name,
        params.get("layout", 0),
        params.get("block_quant_group_size") or None,
        params.get("allreduce_out", False),
    )


def table_abstract_eval(op, *avals, axis_name, **params):
    """The results' avals (``result_specs``) and their varying axes: the all-reduced sum no
    longer varies over the TP axis (as for psum); residual_out adds the residual's axes; the
    norm and everything derived from it add the gamma's and the scale's too."""
    ops = dict(zip(op.operand_names(params), avals, strict=True))
    local = [a for n, a in ops.items() if n not in ("residual", *PARAMETER_OPERANDS)]
    summed = frozenset().union(*(varying(a) for a in local)) - frozenset(axis_name)
    res = summed | (varying(ops["residual"]) if "residual" in ops else frozenset())
    norm = res.union(*(varying(ops[n]) for n in PARAMETER_OPERANDS if n in ops))
    vma = {"allreduce_out": summed, "residual_out": res}
    rows = ops[rows_operand(ops)]
    tokens, hidden = rows.shape
    specs = result_specs_of(
        op.pattern_of(params), tokens, hidden, np.dtype(rows.dtype).name, params
    )
    return [
        with_varying(
            rows.update(shape=spec.storage_shape, dtype=jnp.dtype(spec.dtype)),
            vma.get(spec.name, norm),
        )
        for spec in specs
    ]


def table_aliases(op, params) -> dict:
    """The residual is updated in place into residual_out (its first result), the in-place
    update FlashInfer and vLLM use (each element is read and written by the same thread)."""
    names = op.operand_names(params)
    return {names.index("residual"): 0} if "residual" in names else {}


def foldable(pattern, layout: int, tokens: int) -> bool:
    """Whether a folded call's outputs split back into per-element outputs by a reshape: the
    packed scales are one row per token but for whole tiles."""
    traits = TRAITS[AllReduceFusionPattern(pattern)]
    if traits.quant == "group_fp8":
        return tokens % 4 == 0  # (K, round_up(M, 4)) columns: no padding per element
    if traits.quant == "fp4" and layout != int(QuantizationSFLayout.LINEAR):
        return tokens % 128 == 0  # whole 128-row tiles, stored tile after tile
    return True


def _at_front(x, d, size):
    if d is None:
        return jnp.broadcast_to(x, (size, *x.shape))
    return jnp.moveaxis(x, d, 0)


def _fold(name, x, size, permuted_rows):
    """Operand ``name`` of a batch (batch dim first) as one call's operand."""
    if name in EXPERT_MAJOR_OPERANDS:  # [size, E, T, ...] -> [E, size * T, ...]
        x = jnp.swapaxes(x, 0, 1)
        return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])
    if name == PERMUTED_INDEX:  # each element's rows follow the previous element's
        offset = (jnp.arange(size, dtype=jnp.int32) * permuted_rows)[:, None, None]
        x = jnp.where((x >= 0) & (x < permuted_rows), x + offset, -1)
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def table_batch(op, args, dims, **params):
    """The batching rule: the op is row-wise, so a batch is folded into the token dimension
    (one call of batch x tokens rows, the plan decided again for that count), unless a
    parameter operand (gamma, scale) is batched, the results' layout does not split back
    (``foldable``), or the folded batch is too large for the workspace where one element
    fits (so the kernel still serves it): those run one call per element in a
    ``jax.lax.map`` (correct, but a launch per element)."""
    names = op.operand_names(params)
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    ops = dict(zip(names, args))
    batch_dim = dict(zip(names, dims))
    rows = rows_operand(names)
    shape = ops[rows].shape
    tokens, hidden = shape if batch_dim[rows] is None else tuple(np.delete(shape, batch_dim[rows]))
    dtype_name = np.dtype(ops[rows].dtype).name
    pattern = op.pattern_of(params)
    plan = params.get("plan")
    fold = (
        plan is not None
        and all(batch_dim[n] is None for n in PARAMETER_OPERANDS if n in names)
        and foldable(pattern, params.get("layout", 0), tokens)
    )
    if fold:

        def fits(n):
            return kernel_problem(n, hidden, dtype_name, plan.sizes, pattern) is None

        fold = fits(size * tokens) or not fits(tokens)
    if not fold:  # one call per batch element: the per-element plan (in params) stands
        batched = [i for i, d in enumerate(dims) if d is not None]

        def one(elements):
            call = list(args)
            for i, e in zip(batched, elements):
                call[i] = e
            return tuple(op.primitive.bind(*call, **params))

        outs = jax.lax.map(one, [jnp.moveaxis(args[i], dims[i], 0) for i in batched])
        return list(outs), [0] * len(outs)
    permuted_rows = ops[PERMUTED_ROWS].shape[-2] if PERMUTED_ROWS in ops else 0
    folded = [
        a
        if n in PARAMETER_OPERANDS
        else _fold(n, _at_front(a, batch_dim[n], size), size, permuted_rows)
        for n, a in ops.items()
    ]
    decided = decide(
        plan,
        describe(
            plan,
            size * tokens,
            hidden,
            dtype_name,
            pattern,
            layout=params.get("layout", 0),
            group_size=params.get("block_quant_group_size", 0),
            moe_allreduce_out=params.get("allreduce_out", False),
        ),
    )
    new = dict(params, use_kernel=decided.kernel)
    if "algorithm" in params:
        new["algorithm"] = decided.algorithm_code
    outs = op.primitive.bind(*folded, **new)
    unfolded, out_dims = [], []
    for spec, o in zip(decided.outputs, outs, strict=True):
        if spec.strides is not None:  # a transposed buffer (K, size * tokens): split axis 1
            unfolded.append(o.reshape(o.shape[0], size, o.shape[1] // size))
            out_dims.append(1)
        else:
            unfolded.append(o.reshape(size, o.shape[0] // size, *o.shape[1:]))
            out_dims.append(0)
    return unfolded, out_dims


# --- the ops -----------------------------------------------------------------------------------

MACHINERY_PARAMS = ("use_kernel", "workspace_id", "workspace_groups", "plan")

# The registry: every declared op by primitive name, and the FFI targets they call (ops may
# share a target: both MoE ops call one handler).
_ops: dict = {}
_targets: dict = {}


def declared_ops() -> tuple:
    """Every ``FfiOp`` declared so far."""
    return tuple(_ops.values())


def export_safe_targets() -> tuple:
    """The FFI targets of the declared ops, in ``common.native.FFI_TARGETS`` order (whatever
    order the ops were imported in): what ``jax_fusedar.export`` exempts from
    ``jax.export``'s check of custom calls without a compatibility guarantee."""
    return tuple(t for t in native.FFI_TARGETS.values() if t in _targets)


def op_params(params: dict) -> dict:
    """An op's own parameters: ``params`` without the machinery's (``MACHINERY_PARAMS``)."""
    return {k: v for k, v in params.items() if k not in MACHINERY_PARAMS}


class FfiOp:
    """A jax_fusedar FFI op: one primitive with every rule JAX needs, and its FFI target.

    ``name``: the primitive's name. ``target``: the role of its handler in
    ``common.native.FFI_TARGETS``. ``public_name``: how errors name the op.
    ``reference(**operands, axis_name, fallback, **params)``: the results in plain JAX (a
    list), the operands by name, its all-reduce ``reference.fallback_allreduce(...,
    fallback=fallback)``. ``attributes(**params)``: the custom call's attributes besides
    ``workspace_id`` (typed: np.int32, np.float32, bool).

    An op of the pattern table gives ``pattern`` (its code, or None where the op's
    ``pattern`` parameter carries it): its operands (``patterns.operand_names``), abstract
    evaluation, aliases and batching rule then follow from the table (``table_*``). An op
    outside it gives ``operands`` (the names, or a function of the op's parameters),
    ``abstract_eval(*avals, axis_name, **params)`` (``with_varying``), ``aliases(**params)``
    ({operand index: result index} updated in place) and ``batch(op, args, dims,
    **params)``. ``jvp(op, primals, tangents, **params)``: None for the tangent map of the
    reference math (``reference_jvp``). ``params`` are the op's own parameters
    (``op_params``) in ``reference``, ``attributes`` and ``aliases``, and all of them in
    ``abstract_eval``, ``jvp`` and ``batch``, which re-bind ``op.primitive``."""

    _TABLE = object()  # the pattern comes from the op's ``pattern`` parameter

    def __init__(
        self,
        name: str,
        *,
        target: str,
        public_name: str,
        reference: Callable,
        attributes: Callable,
        pattern=_TABLE,
        operands=None,
        abstract_eval: Optional[Callable] = None,
        aliases: Optional[Callable] = None,
        batch: Optional[Callable] = None,
        jvp: Optional[Callable] = None,
    ):
        if name in _ops:
            raise ValueError(f"the op {name} is declared twice")
        in_table = operands is None
        if not in_table and (abstract_eval is None or aliases is None or batch is None):
            raise ValueError(
                f"the op {name} is outside the pattern table: declare its abstract_eval, "
                "aliases and batch rule"
            )
        self.name = name
        self.public_name = public_name
        self.target = native.FFI_TARGETS[target]
        self.reference = reference
        self.attributes = attributes
        self._pattern = None if pattern is FfiOp._TABLE else pattern
        self._operands = operands
        self.aliases = aliases or (lambda **params: table_aliases(self, params))
        self.primitive = Primitive(name)
        self.primitive.multiple_results = True
        self.primitive.def_abstract_eval(abstract_eval or partial(table_abstract_eval, self))
        self.primitive.def_impl(self._outside_shard_map)
        self._reference_lowering = mlir.lower_fun(self.reference_of, multiple_results=True)
        mlir.register_lowering(self.primitive, partial(self._lower, kernel_platform=False))
        mlir.register_lowering(
            self.primitive, partial(self._lower, kernel_platform=True), platform="cuda"
        )
        ad.primitive_jvps[self.primitive] = partial(jvp or reference_jvp, self)
        batching.primitive_batchers[self.primitive] = partial(batch or table_batch, self)
        _ops[name] = self
        _targets.setdefault(self.target, []).append(self)

    def __repr__(self):
        return f"FfiOp({self.name!r}, target={self.target!r})"

    def pattern_of(self, params: dict):
        """The pattern of a call with these parameters."""
        return self._pattern if self._pattern is not None else params["pattern"]

    def operand_names(self, params: dict) -> tuple:
        """The call's operands by name, in the handler's order."""
        if self._operands is None:
            return patterns.operand_names(
                self.pattern_of(params),
                expert_scale_factor=params.get("has_expert_scale", False),
                shared_expert_output=params.get("has_shared_expert", False),
            )
        if callable(self._operands):
            return tuple(self._operands(**op_params(params)))
        return tuple(self._operands)

    def reference_of(self, *args, axis_name, fallback, **params):
        """The reference math of positional operands (as the primitive binds them)."""
        named = dict(zip(self.operand_names(params), args, strict=True))
        return self.reference(**named, axis_name=axis_name, fallback=fallback, **params)

    def bind(self, *operands, workspace, axis_name: str, use_kernel: bool, plan, **params):
        """Binds the primitive for a call on ``workspace`` over ``axis_name``, decided at
        trace time (``use_kernel``, ``plan``: ``plan``). Tracing needs no native module
        (an abstract workspace exports from any machine); compiling the kernel's call does
        (``_lower``)."""
        if use_kernel:
            register_ffi_targets()  # where the native module is present
        return self.primitive.bind(
            *operands,
            axis_name=(axis_name,),
            use_kernel=bool(use_kernel),
            workspace_id=workspace.id,
            workspace_groups=tuple(g.members for g in workspace.groups),
            plan=plan,
            **params,
        )

    def call(self, operands: dict, *, workspace, axis_name: str, plan, decided, **params) -> dict:
        """Binds a call of the pattern table, its operands by name (ordered here, from the
        table) and its ``decided`` plan (``common.plan.Plan``); returns its results by name,
        in the plan's order."""
        names = self.operand_names(params)
        if set(operands) != set(names):
            raise AssertionError(f"{self.name}: operands {sorted(operands)}, the table's {names}")
        outs = self.bind(
            *(operands[n] for n in names),
            workspace=workspace,
            axis_name=axis_name,
            use_kernel=decided.kernel,
            plan=plan,
            **params,
        )
        return {spec.name: o for spec, o in zip(decided.outputs, outs, strict=True)}

    def _outside_shard_map(self, *args, **params):
        raise ValueError(f"{self.public_name} must be called inside jax.shard_map")

    def _lower(
        self,
        ctx,
        *args,
        kernel_platform: bool,
        axis_name,
        use_kernel,
        workspace_id,
        workspace_groups,
        plan=None,
        **params,
    ):
        check_lowering_mesh(ctx, axis_name, workspace_groups)
        if kernel_platform and use_kernel:
            check_handlers_for_compiling(ctx, self.target)
            rule = jax.ffi.ffi_lowering(self.target, operand_output_aliases=self.aliases(**params))
            return rule(
                ctx, *args, workspace_id=np.int64(workspace_id), **self.attributes(**params)
            )
        if kernel_platform:
            check_reference_lowered_for_cuda(workspace_id)
        return self._reference_lowering(
            ctx, *args, axis_name=axis_name, fallback=fallback_of(plan), **params
        )


def reference_jvp(op: FfiOp, primals, tangents, **params):
    """The default JVP rule: the primal outputs from the op itself (the kernel on GPUs), the
    tangents from ``jax.jvp`` of the op's reference math along the floating operands (an
    index map gets none)."""
    outs = op.primitive.bind(*primals, **params)
    floating = [i for i, x in enumerate(primals) if jnp.issubdtype(x.dtype, jnp.floating)]
    own = dict(op_params(params), fallback=fallback_of(params.get("plan")))

    def reference_of_floats(*values):
        args = list(primals)
        for i, v in zip(floating, values):
            args[i] = v
        return op.reference_of(*args, **own)

    _, out_tangents = jax.jvp(
        reference_of_floats,
        [primals[i] for i in floating],
        [ad.instantiate_zeros(tangents[i]) for i in floating],
    )
    return outs, list(out_tangents)
