"""The dense entry of the op family (``family.FfiOp``): ``allreduce_fusion``, FlashInfer's
unified ``allreduce_fusion`` in functional form, and the op behind it: its reference math
and custom-call attributes here, its JVP in ``transforms.py``; its operands, results,
abstract evaluation, alias and batching rule follow from the pattern table.

Call it on the local shard inside ``jax.shard_map``. Every decision (kernel or reference,
one-shot or two-shot) is made at trace time from shapes, dtype, world size and the
workspace's metadata only (``plan``), so every rank of a group makes the same choice and
the kernel's spin-wait always finds its peers.

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

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from ..common import arguments, backend_choice, limits, patterns, quant_layouts, results
from ..common.patterns import (
    MOE_PATTERNS,
    TRAITS,
    AllReduceFusionPattern,
    QuantizationSFLayout,
    as_pattern,
)
from ..workspace import AllReduceFusionWorkspace
from . import quant_arrays, quant_reference, reference, transforms
from .checks import (
    as_gamma,
    as_residual,
    check_call_on_workspace,
    check_concrete_shape,
    check_workspace,
)
from .family import FfiOp
from .plan import as_fallback, plan_dense


# --- reference math, custom call ----------------------------------------------------------------
# Its operands, results, abstract evaluation, alias and batching rule follow from the pattern
# table (family.FfiOp); its JVP is transforms.jvp.


def _reference_outputs(
    *,
    x,
    residual=None,
    rms_gamma=None,
    scale_factor=None,
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
    ar, res, norm = reference.allreduce_fusion_reference(
        x,
        residual,
        rms_gamma,
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
        norm, pattern, scale_factor=scale_factor, layout=layout, group_size=block_quant_group_size
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


allreduce_fusion_op = FfiOp(
    "jax_fusedar_allreduce_fusion",
    target="allreduce_fusion",
    public_name="jax_fusedar.allreduce_fusion",
    reference=_reference_outputs,
    attributes=_attributes,
    jvp=transforms.jvp,
)
allreduce_fusion_p = allreduce_fusion_op.primitive
FFI_TARGET = allreduce_fusion_op.target


class AllReduceFusionOutputs(NamedTuple):
    allreduce_out: Optional[jax.Array]
    residual_out: Optional[jax.Array]
    norm_out: Optional[jax.Array]
    quant_out: Optional[jax.Array]
    scale_out: Optional[jax.Array]


def _quant_params(pattern, traits, x, hidden, scale_factor, layout_code, group_size, workspace):
    """Validates the quantization arguments of ``pattern``; returns (layout, group size) as
    the primitive's attributes (0 where unused)."""
    name = pattern.name
    if not traits.uses_scale_factor and scale_factor is not None:
        raise ValueError(f"scale_factor applies to static FP8 and NVFP4 patterns, not {name}")
    if traits.quant != "fp4" and layout_code is not None:
        raise ValueError(f"layout_code applies to NVFP4 patterns only, not {name}")
    if traits.quant != "group_fp8" and group_size is not None:
        raise ValueError(
            f"block_quant_group_size applies to per-token-group FP8 patterns only, not {name}"
        )
    if traits.quant == "fp4" and x.dtype == jnp.float32:
        raise ValueError("NVFP4 patterns need bfloat16 or float16 inputs")
    layout = group = 0
    if traits.quant == "fp4":
        layout = int(
            quant_layouts.as_layout(
                QuantizationSFLayout.SWIZZLED_128x4 if layout_code is None else layout_code
            )
        )
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


def _restore_leading(out, lead, what, traits, layout):
    """An output of the folded [M, ...] call back to x's leading dims, where its layout is
    one row per token; the packed scale buffers (per-token-group FP8, swizzled NVFP4) stay
    the 2-D buffers of the M folded rows."""
    if out is None or len(lead) == 1:
        return out
    if what == "scale_out" and (
        traits.quant == "group_fp8"
        or (traits.quant == "fp4" and layout != int(QuantizationSFLayout.LINEAR))
    ):
        return out
    return out.reshape(*lead, *out.shape[1:])


def allreduce_fusion(
    x: ArrayLike,
    *,
    axis_name: str,
    workspace: AllReduceFusionWorkspace,
    pattern=AllReduceFusionPattern.kARResidualRMSNorm,
    residual: Optional[ArrayLike] = None,
    rms_gamma: Optional[ArrayLike] = None,
    rms_eps: float = 1e-6,
    weight_bias: float = 0.0,
    scale_factor: Optional[ArrayLike] = None,
    layout_code=None,
    use_oneshot: Optional[bool] = None,
    fp32_acc: bool = True,
    block_quant_group_size: Optional[int] = None,
    strict: Optional[bool] = None,
    fallback: str = "xla",
) -> AllReduceFusionOutputs:
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
    RMSNorm when the kernel cannot serve the call. ``fallback``: what a call the kernel does
    not serve (CPU, the xla backend, beyond the workspace) computes: ``"xla"`` (default)
    all-reduces x in its own dtype, as unfused code does (XLA's all-reduce, the bytes of the
    user's psum; ``fp32_acc`` then does not apply), then the residual add and RMSNorm;
    ``"kernel_exact"`` emulates the kernel's additions (``fp32_acc`` included) for
    kernel-identical numbers, at 2x the bytes (``fp32_acc=True``) or 2 x world size times
    (``False``); docs/numerics.md gives both bounds; ``"xla_plain"``: as ``"xla"``, its
    roundings written as unfused code writes them, which XLA's excess precision may skip
    (fuse's choice, docs/jax_api.md).

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
        raise ValueError(
            f"pattern {pattern.value} ({pattern.name}) has its own inputs: call "
            "jax_fusedar.moe_reduction_allreduce_fusion (6) or "
            "moe_finalize_allreduce_fusion (7)"
        )
    traits = TRAITS[pattern]
    strict = backend_choice.strict_mode(strict)
    # Options are taken as given, never coerced (bool("false") is True): arguments.py.
    rms_eps, weight_bias, fp32_acc, use_oneshot = arguments.fusion_options(
        rms_eps=rms_eps, weight_bias=weight_bias, fp32_acc=fp32_acc, use_oneshot=use_oneshot
    )
    fallback = as_fallback(fallback)
    if block_quant_group_size is not None:
        block_quant_group_size = arguments.as_int("block_quant_group_size", block_quant_group_size)
    check_workspace(workspace, axis_name)
    x = jnp.asarray(x)
    if x.ndim < 1:
        raise ValueError(f"x must be [..., hidden] (at least 1-D), got shape {x.shape}")
    dtype_name = np.dtype(x.dtype).name
    if dtype_name not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"x has dtype {dtype_name}; supported: bfloat16, float16, float32")
    check_call_on_workspace(
        workspace, axis_name, dtype_name, op="allreduce_fusion", dtype_of="x has"
    )
    check_concrete_shape("x", x.shape, "allreduce_fusion")
    lead, hidden = x.shape[:-1], x.shape[-1]
    tokens = math.prod(lead)
    # World size and vector width are limits of the op itself, on every platform.
    vec = limits.vector_width(dtype_name)
    if hidden % vec:
        raise ValueError(
            f"hidden size {hidden} is not a multiple of {vec} (16 bytes of "
            f"{dtype_name}), which the kernel requires"
        )

    # The op sees [tokens, hidden] rows (it is row-wise); its operands by name, ordered by
    # the pattern table.
    operands = {"x": x.reshape(tokens, hidden)}
    if traits.has_residual:
        # jnp.zeros, not zeros_like: x varies over axis_name and zeros_like would carry
        # that, making the outputs vary too (out_specs=P() refused) though the sum does not.
        residual = jnp.zeros(x.shape, x.dtype) if residual is None else as_residual(residual, x)
        operands["residual"] = residual.reshape(tokens, hidden)
        operands["rms_gamma"] = as_gamma(rms_gamma, x, hidden, pattern)
    elif residual is not None or rms_gamma is not None:
        raise ValueError(f"pattern {pattern.name} takes no residual or rms_gamma")
    layout, group_size = _quant_params(
        pattern, traits, x, hidden, scale_factor, layout_code, block_quant_group_size, workspace
    )
    if traits.uses_scale_factor:
        scale = quant_arrays.check_scalar_scale(scale_factor, "scale_factor")
        operands["scale_factor"] = scale.reshape(1)

    # Trace-time decision (common.plan): the kernel, or the fallback with a logged reason.
    plan, decided = plan_dense(
        workspace,
        pattern,
        x.shape,
        dtype_name,
        use_oneshot=use_oneshot,
        strict=strict,
        layout=layout,
        group_size=group_size,
        fallback=fallback,
    )
    named = allreduce_fusion_op.call(
        operands,
        workspace=workspace,
        axis_name=axis_name,
        plan=plan,
        decided=decided,
        pattern=int(pattern),
        algorithm=decided.algorithm_code,
        fp32_acc=bool(fp32_acc),
        rms_eps=float(rms_eps),
        weight_bias=float(weight_bias),
        layout=layout,
        block_quant_group_size=group_size,
    )
    return AllReduceFusionOutputs(
        **{
            f: _restore_leading(named.get(f), lead, f, traits, layout)
            for f in AllReduceFusionOutputs._fields
        }
    )
