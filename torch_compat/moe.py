"""FlashInfer's MoE patterns 6 and 7 for torch, on the native core (``allreduce_fusion``
routes them here; names, defaults and return rules of FlashInfer 0.7.2.post1's unified
``allreduce_fusion`` on a TRT-LLM workspace).

* **Pattern 6, ``kMoEReductionARResidualRMSNorm``**: ``moe_reduction_device_num_experts`` E,
  ``moe_reduction_scale_input`` float32 [E, T] (expert-major: FlashInfer's docstring says
  [T, E], but its kernel reads element ``e * T + t``; a [T, E] tensor is refused unless E ==
  T), ``moe_reduction_active_experts_token_input`` [E * T, H] or [E, T, H],
  ``moe_reduction_token_input`` [T, H], ``residual_in`` [T, H], ``rms_gamma`` [H]. Writes
  ``norm_out`` (required: the kernel always writes it; FlashInfer would store through a null
  pointer), ``residual_out`` and ``output`` (the all-reduced combine) when given. ``input``
  is not read (as in FlashInfer). Returns ``norm_out``.
* **Pattern 7, ``kMoEFinalizeARResidualRMSNorm``**: ``input`` [P, H] the permuted expert
  rows, ``expanded_idx_to_permuted_idx`` int32 [T, top_k] (-1 = dropped),
  ``expert_scale_factor`` [T, top_k] in the input's dtype (the kernel reads the router
  weights in that dtype; FlashInfer would misread a float32 tensor) or None,
  ``shared_expert_output`` [T, H] or None, ``residual_in`` [T, H], ``rms_gamma`` [H];
  ``residual_out`` and ``norm_out`` are allocated when None (as in FlashInfer). Returns
  ``norm_out``. The index values are checked on the host (every index -1 or a row of
  ``input``) except while a CUDA graph is being captured (a device-to-host copy cannot be
  captured): then they are the caller's responsibility, as in FlashInfer.

Differences from FlashInfer, all toward failing loudly: 16-bit inputs only (FlashInfer's MoE
kernels exist for those only); hidden_dim a multiple of 256 (with a partial warp per token
the kernels read the next token's row and compute wrong norms) that FlashInfer's launcher can
place in one CTA (``jax_fusedar.common.moe_limits``, the rule JAX and the native launch apply
too, checked before FlashInfer's own check would fail the launch); ``quant_out``/``scale_out``
(FP4 output, sm100+) are refused; ``use_oneshot=False``, ``fp32_acc=True`` and
``trigger_completion_at_end=False`` are refused (the MoE kernels are one-shot only, round
after each rank's addition and trigger completion at the end; FlashInfer ignores the
arguments); an output a pattern does not write (``output`` for 7) is refused.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from jax_fusedar.common import arguments, moe_limits, native, patterns
from jax_fusedar.common import plan as rules

from . import cuda_state
from .tensors import (
    check_contiguous,
    check_gamma,
    check_like,
    check_placement,
    check_shape,
    refusal,
    static_shape,
)
from .workspace import TORCH_DTYPES, TorchAllReduceFusionWorkspace

REDUCTION = patterns.AllReduceFusionPattern.kMoEReductionARResidualRMSNorm
FINALIZE = patterns.AllReduceFusionPattern.kMoEFinalizeARResidualRMSNorm
HIDDEN_MULTIPLE = moe_limits.HIDDEN_MULTIPLE
_MOE_DTYPES = (torch.bfloat16, torch.float16)


class CheckedMoeCall(NamedTuple):
    pattern: patterns.AllReduceFusionPattern
    dtype_name: str
    token_num: int
    hidden_dim: int
    rms_eps: float
    weight_bias: float
    routed_scaling_factor: float
    launch_with_pdl: bool
    plan: Optional[rules.Plan]  # common.plan's; None for a shape known only at run time


def check_moe_call(
    pattern,
    workspace,
    *,
    input=None,
    residual_in=None,
    rms_gamma=None,
    rms_eps=1e-6,
    weight_bias=0.0,
    use_oneshot=None,
    fp32_acc=False,
    launch_with_pdl=False,
    trigger_completion_at_end=True,
    moe_reduction_device_num_experts=None,
    moe_reduction_scale_input=None,
    moe_reduction_active_experts_token_input=None,
    moe_reduction_token_input=None,
    expanded_idx_to_permuted_idx=None,
    expert_scale_factor=None,
    shared_expert_output=None,
    routed_scaling_factor=None,
    output=None,
) -> CheckedMoeCall:
    """Every check of an MoE call that needs no device memory (the eager op and the fake
    implementations of the custom ops both run it)."""
    if not isinstance(workspace, TorchAllReduceFusionWorkspace):
        raise TypeError(
            f"workspace must come from torch_compat.create_allreduce_fusion_"
            f"workspace, got {type(workspace).__name__}"
        )
    workspace.native_rank()  # raises once destroyed
    p = patterns.as_pattern(pattern)
    if p not in patterns.MOE_PATTERNS:
        raise ValueError(f"pattern {p.value} ({p.name}) is not an MoE pattern")
    use_oneshot = arguments.as_bool("use_oneshot", use_oneshot, allow_none=True)
    rules.check_moe_mode(p, use_oneshot)
    if arguments.as_bool("fp32_acc", fp32_acc):
        raise ValueError(
            f"fp32_acc does not apply to {p.name}: its kernel always rounds after "
            "each rank's addition (pass fp32_acc=False)"
        )
    if not arguments.as_bool("trigger_completion_at_end", trigger_completion_at_end):
        raise ValueError(
            f"{p.name}'s kernel always triggers completion at its end; pass "
            "trigger_completion_at_end=True"
        )
    launch_with_pdl = arguments.as_bool("launch_with_pdl", launch_with_pdl)
    rms_eps = arguments.as_float32("rms_eps", rms_eps, minimum=0.0)
    weight_bias = arguments.as_float32("weight_bias", weight_bias)
    missing = [k for k, v in (("residual_in", residual_in), ("rms_gamma", rms_gamma)) if v is None]
    if p == REDUCTION:
        missing += [
            k
            for k, v in (
                ("moe_reduction_device_num_experts", moe_reduction_device_num_experts),
                ("moe_reduction_scale_input", moe_reduction_scale_input),
                (
                    "moe_reduction_active_experts_token_input",
                    moe_reduction_active_experts_token_input,
                ),
                ("moe_reduction_token_input", moe_reduction_token_input),
            )
            if v is None
        ]
        extra = [
            k
            for k, v in (
                ("expanded_idx_to_permuted_idx", expanded_idx_to_permuted_idx),
                ("expert_scale_factor", expert_scale_factor),
                ("shared_expert_output", shared_expert_output),
                ("routed_scaling_factor", routed_scaling_factor),
            )
            if v is not None
        ]
    else:
        missing += (
            [] if expanded_idx_to_permuted_idx is not None else ["expanded_idx_to_permuted_idx"]
        )
        missing += [] if input is not None else ["input"]
        extra = [
            k
            for k, v in (
                ("moe_reduction_device_num_experts", moe_reduction_device_num_experts),
                ("moe_reduction_scale_input", moe_reduction_scale_input),
                (
                    "moe_reduction_active_experts_token_input",
                    moe_reduction_active_experts_token_input,
                ),
                ("moe_reduction_token_input", moe_reduction_token_input),
            )
            if v is not None
        ]
    if missing:
        raise ValueError(f"{p.name} needs {', '.join(missing)}")
    if extra:
        raise ValueError(f"{p.name} does not take {', '.join(extra)}")
    check_contiguous("residual_in", residual_in)
    if residual_in.dim() != 2:
        raise ValueError(
            f"residual_in must be 2-D [token_num, hidden_dim], got {list(residual_in.shape)}"
        )
    if residual_in.dtype not in _MOE_DTYPES:
        raise ValueError(
            f"{p.name} takes bfloat16 or float16 tensors (FlashInfer's MoE kernels "
            f"exist for those only), got {residual_in.dtype}"
        )
    dtype = residual_in.dtype
    name = TORCH_DTYPES[dtype]
    if name != workspace.sizes.dtype_name and {name, workspace.sizes.dtype_name} - {
        "bfloat16",
        "float16",
    }:
        raise ValueError(f"the workspace was created for {workspace.sizes.dtype_name}, not {name}")
    check_gamma(rms_gamma, residual_in)
    t, h = residual_in.shape
    routed = 1.0
    if p == REDUCTION:
        e = arguments.as_int("moe_reduction_device_num_experts", moe_reduction_device_num_experts)
        if e < 1:
            raise ValueError(f"moe_reduction_device_num_experts must be >= 1, got {e}")
        scale = moe_reduction_scale_input
        check_contiguous("moe_reduction_scale_input", scale)
        if scale.dtype != torch.float32 or tuple(scale.shape) != (e, t):
            raise ValueError(
                f"moe_reduction_scale_input must be float32 [num_experts, token_num] = "
                f"[{e}, {t}] (the kernel reads it expert-major, element e * token_num + t), got "
                f"{list(scale.shape)} {scale.dtype}"
            )
        x = moe_reduction_active_experts_token_input
        check_contiguous("moe_reduction_active_experts_token_input", x)
        if x.dtype != dtype or tuple(x.shape) not in ((e * t, h), (e, t, h)):
            raise ValueError(
                f"moe_reduction_active_experts_token_input must be [{e * t}, {h}] "
                f"or [{e}, {t}, {h}] of {dtype}, got {list(x.shape)} {x.dtype}"
            )
        check_shape("moe_reduction_token_input", moe_reduction_token_input, (t, h), dtype)
    else:
        check_contiguous("input", input)
        if input.dim() != 2 or input.shape[1] != h or input.dtype != dtype or input.shape[0] < 1:
            raise ValueError(
                f"input (the permuted expert rows) must be [rows >= 1, {h}] of "
                f"{dtype}, got {list(input.shape)} {input.dtype}"
            )
        idx = expanded_idx_to_permuted_idx
        check_contiguous("expanded_idx_to_permuted_idx", idx)
        if idx.dtype != torch.int32 or idx.dim() != 2 or idx.shape[0] != t or idx.shape[1] < 1:
            raise ValueError(
                f"expanded_idx_to_permuted_idx must be int32 [token_num, top_k] = "
                f"[{t}, top_k >= 1], got {list(idx.shape)} {idx.dtype}"
            )
        if expert_scale_factor is not None:
            check_shape("expert_scale_factor", expert_scale_factor, tuple(idx.shape), dtype)
        if shared_expert_output is not None:
            check_shape("shared_expert_output", shared_expert_output, (t, h), dtype)
        if routed_scaling_factor is not None:
            routed = arguments.as_float32("routed_scaling_factor", routed_scaling_factor)
    decided = None  # a shape known only at run time: the eager op plans it then
    if static_shape(residual_in):
        # The call's plan (common.plan: the MoE kernels' rule, one for JAX, torch and the
        # native launch); torch refuses what the kernel does not serve.
        decided = rules.plan_call(
            rules.Call(
                p,
                t,
                h,
                name,
                workspace.sizes,
                workspace.backend,
                use_oneshot,
                moe_allreduce_out=p == REDUCTION and output is not None,
            )
        )
        if not decided.kernel:
            raise ValueError(f"{p.name}: {refusal(decided)}")
    return CheckedMoeCall(p, name, t, h, rms_eps, weight_bias, routed, launch_with_pdl, decided)


def check_index_values(idx: torch.Tensor, rows: int) -> None:
    """Every index -1 or a row of the permuted input (one reduction and a device-to-host copy;
    skipped while capturing a CUDA graph)."""
    if cuda_state.capturing() or idx.numel() == 0:
        return
    lo, hi = int(idx.min()), int(idx.max())
    if lo < -1 or hi >= rows:
        bad = lo if lo < -1 else hi
        raise ValueError(
            f"expanded_idx_to_permuted_idx holds {bad}, not -1 (dropped) or a row "
            f"of input (0..{rows - 1}); input has {rows} rows, fewer than the "
            "indices need"
        )


def moe_allreduce_fusion(
    input,
    workspace,
    pattern,
    *,
    launch_with_pdl=False,
    trigger_completion_at_end=True,
    output=None,
    residual_out=None,
    norm_out=None,
    quant_out=None,
    scale_out=None,
    residual_in=None,
    rms_gamma=None,
    rms_eps=1e-6,
    scale_factor=None,
    layout_code=None,
    use_oneshot=None,
    fp32_acc=False,
    moe_reduction_device_num_experts=None,
    moe_reduction_scale_input=None,
    moe_reduction_active_experts_token_input=None,
    moe_reduction_token_input=None,
    expanded_idx_to_permuted_idx=None,
    expert_scale_factor=None,
    shared_expert_output=None,
    block_quant_group_size=None,
    weight_bias=0.0,
    moe_finalize_backend="trtllm",
    routed_scaling_factor=None,
):
    """Patterns 6 and 7 of ``torch_compat.allreduce_fusion`` (see the module docstring)."""
    call = check_moe_call(
        pattern,
        workspace,
        input=input,
        residual_in=residual_in,
        rms_gamma=rms_gamma,
        rms_eps=rms_eps,
        weight_bias=weight_bias,
        use_oneshot=use_oneshot,
        fp32_acc=fp32_acc,
        launch_with_pdl=launch_with_pdl,
        trigger_completion_at_end=trigger_completion_at_end,
        moe_reduction_device_num_experts=moe_reduction_device_num_experts,
        moe_reduction_scale_input=moe_reduction_scale_input,
        moe_reduction_active_experts_token_input=moe_reduction_active_experts_token_input,
        moe_reduction_token_input=moe_reduction_token_input,
        expanded_idx_to_permuted_idx=expanded_idx_to_permuted_idx,
        expert_scale_factor=expert_scale_factor,
        shared_expert_output=shared_expert_output,
        routed_scaling_factor=routed_scaling_factor,
        output=output,
    )
    p = call.pattern
    if quant_out is not None or scale_out is not None:
        raise ValueError(
            f"{p.name} with quant_out/scale_out (FP4 output) needs an sm100+ "
            "GPU and is not built into torch_compat"
        )
    if block_quant_group_size is not None:
        raise ValueError(f"block_quant_group_size does not apply to {p.name}")
    if p == FINALIZE and moe_finalize_backend != "trtllm":
        raise ValueError(
            f"moe_finalize_backend must be 'trtllm' here, got {moe_finalize_backend!r}"
        )
    del scale_factor, layout_code  # read only by the FP4 output, as in FlashInfer
    if p == FINALIZE:
        if output is not None:
            raise ValueError(f"{p.name} does not write output; pass None")
        norm_out = torch.empty_like(residual_in) if norm_out is None else norm_out
        residual_out = torch.empty_like(residual_in) if residual_out is None else residual_out
    elif norm_out is None:
        raise ValueError(f"{p.name} needs norm_out (the kernel always writes it)")
    tensors = {
        "residual_in": residual_in,
        "norm_out": norm_out,
        "residual_out": residual_out,
        "output": output,
    }
    for k, t in tensors.items():
        if t is not None:
            check_like(k, t, residual_in)
            check_placement(k, t, workspace)
    check_placement("rms_gamma", rms_gamma, workspace)
    reads = (
        [
            ("moe_reduction_scale_input", moe_reduction_scale_input, 4),
            (
                "moe_reduction_active_experts_token_input",
                moe_reduction_active_experts_token_input,
                16,
            ),
            ("moe_reduction_token_input", moe_reduction_token_input, 16),
        ]
        if p == REDUCTION
        else [
            ("input", input, 16),
            ("expanded_idx_to_permuted_idx", expanded_idx_to_permuted_idx, 4),
            ("expert_scale_factor", expert_scale_factor, 2),
            ("shared_expert_output", shared_expert_output, 16),
        ]
    )
    for k, t, align in reads:
        if t is not None:
            check_placement(k, t, workspace, align)
    if p == FINALIZE:
        # The index check copies to the host. After a wait on this workspace outlasted its
        # timeout and trapped, that copy would raise CUDA's generic error: raise the record
        # (naming the peer that did not arrive) instead, as the launch itself would.
        failed = workspace.failure()
        if failed:
            raise RuntimeError(failed)
        check_index_values(expanded_idx_to_permuted_idx, input.shape[0])

    def ptr(t: Optional[torch.Tensor]) -> int:
        return 0 if t is None else t.data_ptr()

    rank = workspace.native_rank()
    common = dict(
        residual_in=ptr(residual_in),
        residual_out=ptr(residual_out),
        norm_out=ptr(norm_out),
        rms_gamma=ptr(rms_gamma),
        rms_eps=call.rms_eps,
        weight_bias=call.weight_bias,
        launch_with_pdl=call.launch_with_pdl,
        stream=cuda_state.current_stream(workspace.device),
    )
    if p == REDUCTION:
        rank.moe_launch(
            int(p),
            native.DTYPE_CODES[call.dtype_name],
            call.token_num,
            call.hidden_dim,
            num_experts=int(moe_reduction_device_num_experts),
            expert_scales=ptr(moe_reduction_scale_input),
            expert_outputs=ptr(moe_reduction_active_experts_token_input),
            token_input=ptr(moe_reduction_token_input),
            allreduce_out=ptr(output),
            **common,
        )
    else:
        idx = expanded_idx_to_permuted_idx
        rank.moe_launch(
            int(p),
            native.DTYPE_CODES[call.dtype_name],
            call.token_num,
            call.hidden_dim,
            permuted_input=ptr(input),
            num_permuted_rows=input.shape[0],
            expanded_idx_to_permuted_idx=ptr(idx),
            top_k=idx.shape[1],
            expert_scale_factor=ptr(expert_scale_factor),
            shared_expert_output=ptr(shared_expert_output),
            routed_scaling_factor=call.routed_scaling_factor,
            **common,
        )
    return norm_out
