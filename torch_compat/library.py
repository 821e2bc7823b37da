"""The fused all-reduce as ``torch.library`` custom ops, for ``torch.compile``: every op
torch_compat registers is declared here.

Five functional ops (they allocate and return their outputs, which is what
``torch.compile`` and functionalization handle best; nothing is mutated):

* ``torch_compat::allreduce(Tensor input, bool? use_oneshot, bool fp32_acc,
  int workspace_handle) -> Tensor`` -- pattern 0 (``kAllReduce``): the sum over the group.
* ``torch_compat::allreduce_residual_rmsnorm(Tensor input, Tensor residual, Tensor gamma,
  float eps, float weight_bias, bool? use_oneshot, bool fp32_acc, int workspace_handle)
  -> (Tensor residual_out, Tensor norm_out)`` -- pattern 1 (``kARResidualRMSNorm``):
  ``residual_out = sum + residual``, ``norm_out = rmsnorm(residual_out) * (weight_bias +
  gamma)``.
* ``torch_compat::allreduce_residual_rmsnorm_quant(Tensor input, Tensor residual,
  Tensor gamma, float eps, float weight_bias, int pattern, Tensor? scale_factor,
  int? block_quant_group_size, int? layout_code, bool? use_oneshot, bool fp32_acc,
  int workspace_handle) -> (Tensor residual_out, Tensor norm_out, Tensor quant_out,
  Tensor scale_out)`` -- the quantized patterns 2, 3, 4, 5, 8, 9, 10, 11, with the tensors
  ``ops.allreduce_fusion`` documents. An output the pattern does not produce comes back as
  an empty tensor (shape [0]): ``norm_out`` for 2, 3, 8, 10; ``scale_out`` for 2, 4. The
  per-token-group ``scale_out`` is FlashInfer's (M, K) int32 tensor with strides (1, T).
* ``torch_compat::moe_reduction_allreduce_residual_rmsnorm(Tensor expert_outputs,
  Tensor expert_scales, Tensor token_input, Tensor residual, Tensor gamma, float eps,
  float weight_bias, int workspace_handle) -> (Tensor residual_out, Tensor norm_out,
  Tensor allreduce_out)`` -- MoE pattern 6 (``torch_compat.moe``): expert_outputs [E, T, H],
  expert_scales float32 [E, T], token_input [T, H].
* ``torch_compat::moe_finalize_allreduce_residual_rmsnorm(Tensor permuted_input,
  Tensor expanded_idx_to_permuted_idx, Tensor residual, Tensor gamma,
  Tensor? expert_scale_factor, Tensor? shared_expert_output, float routed_scaling_factor,
  float eps, float weight_bias, int workspace_handle) -> (Tensor residual_out,
  Tensor norm_out)`` -- MoE pattern 7.

A custom op cannot take a Python object, so the workspace travels as an int:
``register_workspace(ws)`` puts a live ``TorchAllReduceFusionWorkspace`` in a process-level
registry (beside the workspace, ``torch_compat.workspace``) and returns its handle;
``lookup_workspace(handle)`` gets it back; ``unregister_workspace(handle)`` drops it. The
handle is baked into a compiled graph as a constant, so keep the workspace registered (and
alive) as long as the graph may run.

The real kernel is registered for the CUDA dispatch key and calls
``torch_compat.ops.allreduce_fusion`` (the MoE ops ``torch_compat.moe.moe_allreduce_fusion``:
every argument check of the eager op applies). The fake (meta) implementations run the eager
op's checks of inputs and options (``ops.check_call``, ``moe.check_moe_call``, with the
workspace looked up from the handle) and return fresh tensors
of the outputs' metadata, so the ops trace under ``FakeTensorMode``, ``make_fx`` and
``torch.compile(fullgraph=True)`` without a GPU, and a call the op would refuse fails while
tracing, not at run time. Only what needs real memory or the GPU (device placement,
alignment, compute capability) waits for the run.

These ops are collectives: every rank of the workspace's group must call them in the same
order with the same shapes. They are declared functional (no mutated args); do not let a
compiler drop or reorder one on some ranks only (we only produce them from real all-reduces,
which carry the same constraint).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from jax_fusedar.common import patterns, results

from . import moe, ops
from .tensors import concrete
from .workspace import TORCH_DTYPES, lookup_workspace, register_workspace, unregister_workspace

__all__ = [
    "register_workspace",
    "lookup_workspace",
    "unregister_workspace",
    "allreduce",
    "allreduce_residual_rmsnorm",
    "allreduce_residual_rmsnorm_quant",
    "moe_reduction_allreduce_residual_rmsnorm",
    "moe_finalize_allreduce_residual_rmsnorm",
    "ALLREDUCE",
    "ALLREDUCE_RESIDUAL_RMSNORM",
    "ALLREDUCE_RESIDUAL_RMSNORM_QUANT",
    "MOE_REDUCTION_ALLREDUCE_RESIDUAL_RMSNORM",
    "MOE_FINALIZE_ALLREDUCE_RESIDUAL_RMSNORM",
    "QUANT_PATTERNS",
]

# --- the ops -------------------------------------------------------------------------------------


@torch.library.custom_op("torch_compat::allreduce", mutates_args=(), device_types="cuda")
def allreduce(
    input: torch.Tensor, use_oneshot: Optional[bool], fp32_acc: bool, workspace_handle: int
) -> torch.Tensor:
    """Pattern 0: the all-reduce (sum) of ``input`` over the workspace's group."""
    ws = lookup_workspace(workspace_handle)
    output = torch.empty_like(input, memory_format=torch.contiguous_format)
    return ops.allreduce_fusion(
        input, ws, 0, output=output, use_oneshot=use_oneshot, fp32_acc=fp32_acc
    )


@allreduce.register_fake
def _allreduce_fake(input, use_oneshot, fp32_acc, workspace_handle):
    # The eager op's own checks (ops.check_call), so tracing refuses what running would.
    ops.check_call(
        input, lookup_workspace(workspace_handle), 0, use_oneshot=use_oneshot, fp32_acc=fp32_acc
    )
    return torch.empty_like(input, memory_format=torch.contiguous_format)


@torch.library.custom_op(
    "torch_compat::allreduce_residual_rmsnorm", mutates_args=(), device_types="cuda"
)
def allreduce_residual_rmsnorm(
    input: torch.Tensor,
    residual: torch.Tensor,
    gamma: torch.Tensor,
    eps: float,
    weight_bias: float,
    use_oneshot: Optional[bool],
    fp32_acc: bool,
    workspace_handle: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pattern 1: ``(residual_out, norm_out)`` = (sum + residual, rmsnorm(that) * (weight_bias
    + gamma)), the sum being over the workspace's group."""
    ws = lookup_workspace(workspace_handle)
    residual_out = torch.empty_like(input, memory_format=torch.contiguous_format)
    norm_out = torch.empty_like(input, memory_format=torch.contiguous_format)
    ops.allreduce_fusion(
        input,
        ws,
        1,
        residual_out=residual_out,
        norm_out=norm_out,
        residual_in=residual,
        rms_gamma=gamma,
        rms_eps=eps,
        use_oneshot=use_oneshot,
        fp32_acc=fp32_acc,
        weight_bias=weight_bias,
    )
    return residual_out, norm_out


@allreduce_residual_rmsnorm.register_fake
def _allreduce_residual_rmsnorm_fake(
    input, residual, gamma, eps, weight_bias, use_oneshot, fp32_acc, workspace_handle
):
    ops.check_call(
        input,
        lookup_workspace(workspace_handle),
        1,
        residual_in=residual,
        rms_gamma=gamma,
        rms_eps=eps,
        weight_bias=weight_bias,
        use_oneshot=use_oneshot,
        fp32_acc=fp32_acc,
    )
    return (
        torch.empty_like(input, memory_format=torch.contiguous_format),
        torch.empty_like(input, memory_format=torch.contiguous_format),
    )


QUANT_PATTERNS = tuple(int(p) for p, t in patterns.TRAITS.items() if t.quant is not None)


def _check_quant_call(
    input,
    residual,
    gamma,
    eps,
    weight_bias,
    pattern,
    scale_factor,
    block_quant_group_size,
    layout_code,
    use_oneshot,
    fp32_acc,
    workspace_handle,
) -> None:
    """The quantized op's checks, the same in the real and the fake implementation: its
    patterns only, then every check of the eager op (ops.check_call)."""
    pattern = concrete(pattern)
    torch._check(
        pattern in QUANT_PATTERNS,
        lambda: (
            f"allreduce_residual_rmsnorm_quant serves the quantized patterns "
            f"{QUANT_PATTERNS}, got {pattern} (patterns 0 and 1 have their own ops)"
        ),
    )
    ops.check_call(
        input,
        lookup_workspace(workspace_handle),
        pattern,
        residual_in=residual,
        rms_gamma=gamma,
        rms_eps=eps,
        weight_bias=weight_bias,
        scale_factor=scale_factor,
        block_quant_group_size=block_quant_group_size,
        layout_code=layout_code,
        use_oneshot=use_oneshot,
        fp32_acc=fp32_acc,
    )


def _quant_outputs(
    input: torch.Tensor,
    pattern: int,
    block_quant_group_size: Optional[int],
    layout_code: Optional[int],
):
    """Fresh (residual_out, norm_out, quant_out, scale_out) for a quantized pattern, the
    same in the real and the fake implementation (so their metadata agree), shaped by
    ``results.result_specs``; an output the pattern does not write is an empty [0] tensor."""
    pattern, layout_code = concrete(pattern), concrete(layout_code)
    torch._check(
        pattern in QUANT_PATTERNS,
        lambda: (
            f"allreduce_residual_rmsnorm_quant serves the quantized patterns "
            f"{QUANT_PATTERNS}, got {pattern} (patterns 0 and 1 have their own ops)"
        ),
    )
    layout = patterns.QuantizationSFLayout.SWIZZLED_128x4 if layout_code is None else layout_code
    m, h = input.shape
    specs = {
        spec.name: spec
        for spec in results.result_specs(
            pattern, m, h, TORCH_DTYPES[input.dtype], layout, block_quant_group_size
        )
    }
    absent_dtypes = {"norm_out": input.dtype, "scale_out": torch.float32}
    outputs = []
    for name in ("residual_out", "norm_out", "quant_out", "scale_out"):
        spec = specs.get(name)
        if spec is None:
            outputs.append(torch.empty((0,), dtype=absent_dtypes[name], device=input.device))
        elif spec.strides is not None:
            outputs.append(
                torch.empty_strided(
                    spec.shape, spec.strides, dtype=getattr(torch, spec.dtype), device=input.device
                )
            )
        else:
            outputs.append(
                torch.empty(spec.shape, dtype=getattr(torch, spec.dtype), device=input.device)
            )
    return tuple(outputs)


@torch.library.custom_op(
    "torch_compat::allreduce_residual_rmsnorm_quant", mutates_args=(), device_types="cuda"
)
def allreduce_residual_rmsnorm_quant(
    input: torch.Tensor,
    residual: torch.Tensor,
    gamma: torch.Tensor,
    eps: float,
    weight_bias: float,
    pattern: int,
    scale_factor: Optional[torch.Tensor],
    block_quant_group_size: Optional[int],
    layout_code: Optional[int],
    use_oneshot: Optional[bool],
    fp32_acc: bool,
    workspace_handle: int,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A quantized pattern: ``(residual_out, norm_out, quant_out, scale_out)``, empty [0]
    tensors for the outputs the pattern does not produce."""
    ws = lookup_workspace(workspace_handle)
    # Checked before the outputs are shaped from the input (a 3-D input must not get there).
    _check_quant_call(
        input,
        residual,
        gamma,
        eps,
        weight_bias,
        pattern,
        scale_factor,
        block_quant_group_size,
        layout_code,
        use_oneshot,
        fp32_acc,
        workspace_handle,
    )
    residual_out, norm_out, quant_out, scale_out = _quant_outputs(
        input, pattern, block_quant_group_size, layout_code
    )
    traits = patterns.TRAITS[patterns.AllReduceFusionPattern(pattern)]
    ops.allreduce_fusion(
        input,
        ws,
        pattern,
        residual_out=residual_out,
        norm_out=norm_out if traits.has_norm_out else None,
        quant_out=quant_out,
        scale_out=scale_out if traits.writes_scale_out else None,
        residual_in=residual,
        rms_gamma=gamma,
        rms_eps=eps,
        scale_factor=scale_factor,
        layout_code=layout_code,
        use_oneshot=use_oneshot,
        fp32_acc=fp32_acc,
        block_quant_group_size=block_quant_group_size,
        weight_bias=weight_bias,
    )
    return residual_out, norm_out, quant_out, scale_out


@allreduce_residual_rmsnorm_quant.register_fake
def _allreduce_residual_rmsnorm_quant_fake(
    input,
    residual,
    gamma,
    eps,
    weight_bias,
    pattern,
    scale_factor,
    block_quant_group_size,
    layout_code,
    use_oneshot,
    fp32_acc,
    workspace_handle,
):
    _check_quant_call(
        input,
        residual,
        gamma,
        eps,
        weight_bias,
        pattern,
        scale_factor,
        block_quant_group_size,
        layout_code,
        use_oneshot,
        fp32_acc,
        workspace_handle,
    )
    return _quant_outputs(input, pattern, block_quant_group_size, layout_code)


# --- the MoE ops (patterns 6 and 7, torch_compat.moe) --------------------------------------------


@torch.library.custom_op(
    "torch_compat::moe_reduction_allreduce_residual_rmsnorm", mutates_args=(), device_types="cuda"
)
def moe_reduction_allreduce_residual_rmsnorm(
    expert_outputs: torch.Tensor,
    expert_scales: torch.Tensor,
    token_input: torch.Tensor,
    residual: torch.Tensor,
    gamma: torch.Tensor,
    eps: float,
    weight_bias: float,
    workspace_handle: int,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pattern 6: ``(residual_out, norm_out, allreduce_out)`` for expert_outputs [E, T, H],
    expert_scales float32 [E, T], token_input [T, H]."""
    ws = lookup_workspace(workspace_handle)
    outs = [torch.empty_like(residual, memory_format=torch.contiguous_format) for _ in range(3)]
    moe.moe_allreduce_fusion(
        None,
        ws,
        moe.REDUCTION,
        residual_out=outs[0],
        norm_out=outs[1],
        output=outs[2],
        residual_in=residual,
        rms_gamma=gamma,
        rms_eps=eps,
        weight_bias=weight_bias,
        moe_reduction_device_num_experts=expert_outputs.shape[0],
        moe_reduction_scale_input=expert_scales,
        moe_reduction_active_experts_token_input=expert_outputs,
        moe_reduction_token_input=token_input,
    )
    return outs[0], outs[1], outs[2]


@moe_reduction_allreduce_residual_rmsnorm.register_fake
def _moe_reduction_fake(
    expert_outputs, expert_scales, token_input, residual, gamma, eps, weight_bias, workspace_handle
):
    moe.check_moe_call(
        moe.REDUCTION,
        lookup_workspace(workspace_handle),
        residual_in=residual,
        rms_gamma=gamma,
        rms_eps=eps,
        weight_bias=weight_bias,
        moe_reduction_device_num_experts=expert_outputs.shape[0],
        moe_reduction_scale_input=expert_scales,
        moe_reduction_active_experts_token_input=expert_outputs,
        moe_reduction_token_input=token_input,
    )
    return tuple(
        torch.empty_like(residual, memory_format=torch.contiguous_format) for _ in range(3)
    )


@torch.library.custom_op(
    "torch_compat::moe_finalize_allreduce_residual_rmsnorm", mutates_args=(), device_types="cuda"
)
def moe_finalize_allreduce_residual_rmsnorm(
    permuted_input: torch.Tensor,
    expanded_idx_to_permuted_idx: torch.Tensor,
    residual: torch.Tensor,
    gamma: torch.Tensor,
    expert_scale_factor: Optional[torch.Tensor],
    shared_expert_output: Optional[torch.Tensor],
    routed_scaling_factor: float,
    eps: float,
    weight_bias: float,
    workspace_handle: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pattern 7: ``(residual_out, norm_out)``."""
    ws = lookup_workspace(workspace_handle)
    outs = [torch.empty_like(residual, memory_format=torch.contiguous_format) for _ in range(2)]
    moe.moe_allreduce_fusion(
        permuted_input,
        ws,
        moe.FINALIZE,
        residual_out=outs[0],
        norm_out=outs[1],
        residual_in=residual,
        rms_gamma=gamma,
        rms_eps=eps,
        weight_bias=weight_bias,
        expanded_idx_to_permuted_idx=expanded_idx_to_permuted_idx,
        expert_scale_factor=expert_scale_factor,
        shared_expert_output=shared_expert_output,
        routed_scaling_factor=routed_scaling_factor,
    )
    return outs[0], outs[1]


@moe_finalize_allreduce_residual_rmsnorm.register_fake
def _moe_finalize_fake(
    permuted_input,
    expanded_idx_to_permuted_idx,
    residual,
    gamma,
    expert_scale_factor,
    shared_expert_output,
    routed_scaling_factor,
    eps,
    weight_bias,
    workspace_handle,
):
    moe.check_moe_call(
        moe.FINALIZE,
        lookup_workspace(workspace_handle),
        input=permuted_input,
        residual_in=residual,
        rms_gamma=gamma,
        rms_eps=eps,
        weight_bias=weight_bias,
        expanded_idx_to_permuted_idx=expanded_idx_to_permuted_idx,
        expert_scale_factor=expert_scale_factor,
        shared_expert_output=shared_expert_output,
        routed_scaling_factor=routed_scaling_factor,
    )
    return tuple(
        torch.empty_like(residual, memory_format=torch.contiguous_format) for _ in range(2)
    )


# The OpOverloads, as they appear in FX graphs.
ALLREDUCE = torch.ops.torch_compat.allreduce.default
ALLREDUCE_RESIDUAL_RMSNORM = torch.ops.torch_compat.allreduce_residual_rmsnorm.default
ALLREDUCE_RESIDUAL_RMSNORM_QUANT = torch.ops.torch_compat.allreduce_residual_rmsnorm_quant.default
MOE_REDUCTION_ALLREDUCE_RESIDUAL_RMSNORM = (
    torch.ops.torch_compat.moe_reduction_allreduce_residual_rmsnorm.default
)
MOE_FINALIZE_ALLREDUCE_RESIDUAL_RMSNORM = (
    torch.ops.torch_compat.moe_finalize_allreduce_residual_rmsnorm.default
)
