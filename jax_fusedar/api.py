"""``jax_fusedar.allreduce_fusion``: FlashInfer's unified ``allreduce_fusion`` in functional form.

Call it on the local shard inside ``jax.shard_map``. Every decision (kernel or reference,
one-shot or two-shot) is made here at trace time from shapes, dtype, world size and the
workspace's metadata only, so every rank of a group makes the same choice and the kernel's
spin-wait always finds its peers.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from .common import (arguments, backend_choice, launch_mode, limits, patterns, quant_layouts,
                     sizing)
from . import quant_arrays
from .common.patterns import (MOE_PATTERNS, TRAITS, AllReduceFusionPattern, QuantizationSFLayout,
                              as_pattern)
from .primitive import allreduce_fusion_p, check_call_groups, register_ffi_targets
from .workspace import AllReduceFusionWorkspace

log = logging.getLogger("jax_fusedar")
# Kinds of fallback reason already logged: one warning per kind and process, not per shape
# (a model with many sequence lengths would otherwise log every one).
_fallback_reasons_logged: set = set()


class AllReduceFusionOutputs(NamedTuple):
    allreduce_out: Optional[jax.Array]
    residual_out: Optional[jax.Array]
    norm_out: Optional[jax.Array]
    quant_out: Optional[jax.Array]
    scale_out: Optional[jax.Array]


@dataclasses.dataclass(frozen=True)
class CallPlan:
    """What the trace-time kernel decision reads besides the call's shape, carried as a
    parameter of the primitive so that its batching rule (jax_fusedar/transforms.py) can
    decide again for the token count of the folded batch."""
    backend: str
    sizes: sizing.WorkspaceSizes
    strict: bool
    use_oneshot: Optional[bool]  # as requested: None picks by size


def _fallback(kind: str, reason: str, strict: bool, backend: str) -> None:
    if strict:
        raise ValueError(f"jax_fusedar: cannot use the fused kernel: {reason} (strict mode; "
                         f"unset {backend_choice.STRICT_ENV_VAR} or pass strict=False to fall "
                         "back to psum + RMSNorm)")
    # The xla backend never uses the kernel: nothing falls back there, nothing to report.
    if backend == "trtllm" and kind not in _fallback_reasons_logged:
        _fallback_reasons_logged.add(kind)
        log.warning("jax_fusedar: falling back to psum + RMSNorm: %s (logged once per kind "
                    "of reason; set %s=1 to raise instead)", reason, backend_choice.STRICT_ENV_VAR)


def _kernel_problem(tokens, hidden, dtype_name, sizes):
    """(kind, why) the kernel cannot serve this call (then it falls back), or None."""
    problem = limits.kernel_support_problem(sizes.world_size, hidden, dtype_name)
    if problem is not None:
        return "unsupported shape", problem
    if not sizing.buffer_fits(tokens, hidden, sizes):
        return "workspace too small", (
            f"{tokens}x{hidden} tokens exceed the workspace (max_token_num="
            f"{sizes.max_token_num} x hidden {sizes.hidden_dim}; every row of an N-D or "
            "vmapped call counts)")
    return None


def choose_path(plan: CallPlan, tokens: int, hidden: int, dtype_name: str):
    """(use_kernel, algorithm) for a call of ``tokens`` rows (algorithm: a launch_mode.ALGORITHM_*
    code): a pure function of the plan
    and the shape, so every rank decides alike (logs or raises per ``plan.strict``)."""
    use_kernel = plan.backend == "trtllm"
    if tokens == 0:
        # Every rank has the same empty shape: nothing to exchange, the reference serves it.
        return False, launch_mode.ALGORITHM_ONESHOT
    problem = _kernel_problem(tokens, hidden, dtype_name, plan.sizes)
    if problem is not None:
        _fallback(*problem, plan.strict, plan.backend)
        return False, launch_mode.ALGORITHM_ONESHOT
    # Raises for an explicit use_oneshot the workspace cannot serve (never degrade).
    algorithm = launch_mode.choose_algorithm(tokens, hidden, plan.sizes, plan.use_oneshot)
    return use_kernel, algorithm


def _quant_params(pattern, traits, x, hidden, scale_factor, layout_code, group_size,
                  workspace):
    """Validates the quantization arguments of ``pattern``; returns (layout, group size) as
    the primitive's attributes (0 where unused)."""
    name = pattern.name
    if not traits.uses_scale_factor and scale_factor is not None:
        raise ValueError(f"scale_factor applies to static FP8 and NVFP4 patterns, not {name}")
    if traits.quant != "fp4" and layout_code is not None:
        raise ValueError(f"layout_code applies to NVFP4 patterns only, not {name}")
    if traits.quant != "group_fp8" and group_size is not None:
        raise ValueError(f"block_quant_group_size applies to per-token-group FP8 patterns "
                         f"only, not {name}")
    if traits.quant == "fp4" and x.dtype == jnp.float32:
        raise ValueError("NVFP4 patterns need bfloat16 or float16 inputs")
    layout = group = 0
    if traits.quant == "fp4":
        layout = int(quant_layouts.as_layout(QuantizationSFLayout.SWIZZLED_128x4
                                       if layout_code is None else layout_code))
        quant_layouts.check_hidden_fp4(hidden)
        if workspace.backend == "trtllm":
            _require_sm100(workspace, pattern)
    if traits.quant == "group_fp8":
        if group_size is None:
            raise ValueError(f"{name} needs block_quant_group_size")
        group = quant_layouts.check_kernel_group_size(hidden, group_size, np.dtype(x.dtype).name)
    return layout, group


def _require_sm100(workspace, pattern):
    """Refuses an NVFP4 pattern on a pre-Blackwell device of the mesh (patterns.device_problem)."""
    for d in workspace.mesh.devices.flat:
        cc = getattr(d, "compute_capability", None)
        if cc is not None:
            major, _, minor = str(cc).partition(".")
            problem = patterns.device_problem(pattern, str(d), int(major), int(minor or 0))
            if problem:
                raise ValueError(problem)


def _check_call_on_workspace(workspace, axis_name, dtype_name, *, op, dtype_of):
    """What every op on a workspace needs of its call (allreduce_fusion, the MoE ops): the
    workspace's dtype, inside shard_map over ``axis_name``, the workspace's world size and
    groups. ``op`` and ``dtype_of`` (e.g. "x has") name the call in the errors."""
    if dtype_name != workspace.dtype.name:
        raise ValueError(f"{dtype_of} dtype {dtype_name} but the workspace was created for "
                         f"{workspace.dtype.name}; create a workspace per dtype")
    try:
        world = jax.lax.axis_size(axis_name)
    except NameError:
        raise ValueError(f"{op} must be called inside jax.shard_map over an axis named "
                         f"{axis_name!r}") from None
    if world != workspace.world_size:
        raise ValueError(f"axis {axis_name!r} has size {world} but the workspace was created "
                         f"for world size {workspace.world_size}")
    _check_context_mesh(workspace, axis_name)


def _check_context_mesh(workspace, axis_name):
    """At trace time, when the concrete mesh is known (``jax.set_mesh``): the call's groups
    along ``axis_name`` must be the workspace's (primitive.check_call_groups). Otherwise the
    same check runs when the call is lowered, on every platform, from the mesh of the
    shard_map or pmap being lowered."""
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


def _check_operand(name, value, shape, dtype):
    if value.shape != shape or value.dtype != dtype:
        raise ValueError(f"{name} must have shape {shape} and dtype {np.dtype(dtype).name}, "
                         f"got {value.shape} {np.dtype(value.dtype).name}")


def _as_residual(residual, x):
    """The residual stream, checked against x: same shape and dtype (the kernel reads and
    writes it as x's dtype T)."""
    residual = jnp.asarray(residual)
    if (residual.dtype == jnp.float32 and x.dtype != jnp.float32
            and residual.shape == x.shape):
        t = np.dtype(x.dtype).name
        raise ValueError(
            f"residual has dtype float32 but x is {t}: the kernel reads and writes the "
            f"residual stream in x's dtype, so it cannot keep a float32 stream exactly. "
            f"Either round the stream to {t} (residual=residual.astype(x.dtype)), or keep "
            f"it in float32 end to end: x=x.astype(jnp.float32) with a float32 workspace "
            f"(the all-reduce then moves float32, and norm_out is float32)")
    _check_operand("residual", residual, x.shape, x.dtype)
    return residual


def _as_gamma(rms_gamma, x, hidden, pattern):
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
        raise ValueError(f"rms_gamma must have shape ({hidden},) and dtype "
                         f"{np.dtype(x.dtype).name}{also}, got {rms_gamma.shape} "
                         f"{np.dtype(rms_gamma.dtype).name}")
    return rms_gamma


def _restore_leading(out, lead, what, traits, layout):
    """An output of the folded [M, ...] call back to x's leading dims, where its layout is
    one row per token; the packed scale buffers (per-token-group FP8, swizzled NVFP4) stay
    the 2-D buffers of the M folded rows."""
    if out is None or len(lead) == 1:
        return out
    if what == "scale_out" and (traits.quant == "group_fp8" or (
            traits.quant == "fp4" and layout != int(QuantizationSFLayout.LINEAR))):
        return out
    return out.reshape(*lead, *out.shape[1:])


def allreduce_fusion(x: ArrayLike, *, axis_name: str, workspace: AllReduceFusionWorkspace,
                     pattern=AllReduceFusionPattern.kARResidualRMSNorm,
                     residual: Optional[ArrayLike] = None,
                     rms_gamma: Optional[ArrayLike] = None, rms_eps: float = 1e-6,
                     weight_bias: float = 0.0, scale_factor: Optional[ArrayLike] = None,
                     layout_code=None, use_oneshot: Optional[bool] = None,
                     fp32_acc: bool = True, block_quant_group_size: Optional[int] = None,
                     strict: Optional[bool] = None) -> AllReduceFusionOutputs:
    """All-reduce ``x`` over ``axis_name`` fused with residual add + RMSNorm.

    Args mirror ``flashinfer.comm.allreduce_fusion``. ``x``: the local ``[..., hidden]``
    partial sum; every leading dim is a token dim (the norm is over the last axis, and all
    rows count against the workspace). ``residual``: x's shape and dtype, added after the
    all-reduce (zeros when None, for residual patterns). ``rms_gamma``: ``[hidden]`` of x's
    dtype or float32 (then rounded to x's dtype, as the kernel reads it).
    ``weight_bias=1.0`` gives Gemma's ``(1 + gamma)``.
    Quantized patterns (table in the README, layouts in ``jax_fusedar.common.quant_layouts``):
    ``scale_factor`` (static FP8: the dequantization scale; NVFP4: the global scale) is a
    float32 array of shape () or (1,), a runtime operand, never a baked constant;
    ``layout_code`` picks the NVFP4 scale layout (default SWIZZLED_128x4);
    ``block_quant_group_size`` is the per-token-group FP8 group size (8 to 256, a power of
    two dividing hidden). ``use_oneshot``: None picks by size (FlashInfer's heuristic).
    ``fp32_acc``: sum the ranks in fp32 and round once (default, vLLM's choice) or round
    after every addition (FlashInfer's default). ``strict`` (default: the
    ``JAX_FUSEDAR_STRICT`` environment variable): raise instead of falling back to psum +
    RMSNorm when the kernel cannot serve the call.

    Returns ``AllReduceFusionOutputs(allreduce_out, residual_out, norm_out, quant_out,
    scale_out)`` with None for what the pattern does not produce; x's leading dims are kept
    (but for the packed scale buffers, which describe the M = prod(leading dims) rows). The
    outputs are invariant over ``axis_name`` (like ``psum``), so ``shard_map``'s default
    ``check_vma=True`` works. Differentiable (``jax.grad``/``jvp``/``vjp``) with the
    gradient of the same math unfused; ``quant_out``/``scale_out`` have zero derivative
    (like ``jnp.round``). ``jax.vmap`` folds the batch into tokens.
    """
    pattern = as_pattern(pattern)
    if pattern in MOE_PATTERNS:
        raise ValueError(f"pattern {pattern.value} ({pattern.name}) has its own inputs: call "
                         "jax_fusedar.moe_reduction_allreduce_fusion (6) or "
                         "moe_finalize_allreduce_fusion (7)")
    traits = TRAITS[pattern]
    strict = backend_choice.strict_mode(strict)
    # Options are taken as given, never coerced (bool("false") is True): arguments.py.
    rms_eps, weight_bias, fp32_acc, use_oneshot = arguments.fusion_options(
        rms_eps=rms_eps, weight_bias=weight_bias, fp32_acc=fp32_acc, use_oneshot=use_oneshot)
    if block_quant_group_size is not None:
        block_quant_group_size = arguments.as_int("block_quant_group_size",
                                                  block_quant_group_size)
    if not isinstance(workspace, AllReduceFusionWorkspace):
        if isinstance(workspace, jax.core.Tracer):  # e.g. a pytree node of the user's own
            raise TypeError("workspace is a JAX tracer: pass the workspace itself, closed over "
                            "or as a static argument (jax.jit(f, static_argnums=...)), not "
                            "inside a traced pytree")
        raise TypeError(f"workspace must come from jax_fusedar.create_allreduce_fusion_"
                        f"workspace, got {type(workspace).__name__}")
    if workspace.destroyed:
        raise ValueError(f"{workspace!r} was destroyed")
    if workspace.axis_name != axis_name:
        raise ValueError(f"axis_name={axis_name!r}: the workspace was created for axis "
                         f"{workspace.axis_name!r}, not {axis_name!r}")
    x = jnp.asarray(x)
    if x.ndim < 1:
        raise ValueError(f"x must be [..., hidden] (at least 1-D), got shape {x.shape}")
    dtype_name = np.dtype(x.dtype).name
    if dtype_name not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"x has dtype {dtype_name}; supported: bfloat16, float16, float32")
    _check_call_on_workspace(workspace, axis_name, dtype_name, op="allreduce_fusion",
                             dtype_of="x has")
    if not all(isinstance(d, (int, np.integer)) for d in x.shape):
        # jax.export with symbolic shapes. The kernel's one-/two-shot choice and workspace fit
        # are trace-time decisions every rank must make alike, so they need concrete sizes;
        # and the reference cannot serve either: in JAX 0.10 a shape-polymorphic shard_map
        # body fails to compile on CPU ("Module has dynamic shapes") as soon as it broadcasts.
        raise ValueError(
            f"x has a symbolic shape {x.shape}: allreduce_fusion needs concrete token and "
            "hidden sizes (the kernel decides one-/two-shot and the workspace fit at trace "
            "time); export one artifact per token count (e.g. per serving bucket)")
    lead, hidden = x.shape[:-1], x.shape[-1]
    tokens = math.prod(lead)
    # World size and vector width are limits of the op itself, on every platform.
    vec = limits.vector_width(dtype_name)
    if hidden % vec:
        raise ValueError(f"hidden size {hidden} is not a multiple of {vec} (16 bytes of "
                         f"{dtype_name}), which the kernel requires")

    operands = [x]
    if traits.has_residual:
        # jnp.zeros, not zeros_like: x varies over axis_name and zeros_like would carry
        # that, making the outputs vary too (out_specs=P() refused) though the sum does not.
        residual = (jnp.zeros(x.shape, x.dtype) if residual is None
                    else _as_residual(residual, x))
        operands += [residual, _as_gamma(rms_gamma, x, hidden, pattern)]
    elif residual is not None or rms_gamma is not None:
        raise ValueError(f"pattern {pattern.name} takes no residual or rms_gamma")
    # The primitive sees [tokens, hidden] rows (the op is row-wise).
    operands[:2] = [o.reshape(tokens, hidden) for o in operands[:2]]
    layout, group_size = _quant_params(pattern, traits, x, hidden, scale_factor, layout_code,
                                       block_quant_group_size, workspace)
    if traits.uses_scale_factor:
        operands.append(quant_arrays.check_scalar_scale(scale_factor, "scale_factor").reshape(1))

    # Trace-time decision: the kernel, or the reference with a logged reason.
    plan = CallPlan(workspace.backend, workspace.sizes, strict,
                    None if use_oneshot is None else bool(use_oneshot))
    use_kernel, algorithm = choose_path(plan, tokens, hidden, dtype_name)
    if use_kernel and not register_ffi_targets():
        raise RuntimeError("the workspace uses the trtllm kernel but jax_fusedar's native "
                           "extension is not available")

    outs = allreduce_fusion_p.bind(
        *operands, axis_name=(axis_name,), pattern=int(pattern), use_kernel=use_kernel,
        workspace_id=workspace.id,
        workspace_groups=tuple(g.members for g in workspace.groups),
        algorithm=int(algorithm), fp32_acc=bool(fp32_acc), rms_eps=float(rms_eps),
        weight_bias=float(weight_bias), layout=layout, block_quant_group_size=group_size,
        plan=plan)
    if traits.has_allreduce_out:
        named = {"allreduce_out": outs[0]}
    else:
        outs = list(outs)
        named = {"residual_out": outs.pop(0)}
        named["norm_out"] = outs.pop(0) if traits.has_norm_out else None
        named["quant_out"] = outs.pop(0) if traits.quant else None
        named["scale_out"] = outs.pop(0) if traits.writes_scale_out else None
    return AllReduceFusionOutputs(**{
        f: _restore_leading(named.get(f), lead, f, traits, layout)
        for f in AllReduceFusionOutputs._fields})
