"""``allreduce_fusion`` for torch: FlashInfer's unified-API call on our native core.

Names, defaults and out-parameter semantics follow ``flashinfer.comm.allreduce_fusion`` on a
TRT-LLM workspace (allreduce.py) for every pattern the kernel serves: 0, 1, the static FP8
patterns 2/4, NVFP4 3/5 (sm100+ only), per-token-group FP8 8/9 and dynamic FP8 10/11.

* ``output`` is the all-reduce result of pattern 0; when None, a fresh
  ``torch.empty_like(input)`` is allocated and returned, as FlashInfer does. No other
  pattern writes it (FlashInfer allocates one anyway and drops it; we allocate nothing).
* Every other pattern reads ``residual_in`` and ``rms_gamma`` ([hidden_dim]) and writes the
  caller's ``residual_out`` (input-sum + residual); the norm patterns (1, and the ``...Out...``
  quantized ones 4, 5, 9, 11) also write ``norm_out``; the quantized ones write
  ``quant_out`` and, except static FP8, ``scale_out``. FlashInfer passes None outputs on to
  the kernel, which then stores through a null pointer; here every output the pattern
  writes is required (ValueError).
* Returned, as FlashInfer does: ``norm_out`` when the pattern writes it, else ``quant_out``
  for the quantized patterns, else ``output``.
* An output the pattern does not write (e.g. ``norm_out`` with pattern 2, ``scale_out`` with
  pattern 4) is refused: FlashInfer leaves it unwritten and may even return it. Inputs a
  pattern does not read (``residual_in``/``rms_gamma`` for pattern 0, ``scale_factor``,
  ``layout_code``, ``block_quant_group_size``) are ignored, as there.

Quantized outputs (shapes per rank, M tokens x H hidden; byte layouts in
``jax_fusedar/common/quant_layouts.py``, whose shape helpers are used here):

* FP8 ``quant_out``: ``torch.float8_e4m3fn`` ``[M, H]``, contiguous.
* static FP8 (2, 4): ``scale_factor`` the dequantization scale (the kernel multiplies by its
  reciprocal): a float32 CUDA tensor of one element, read on the device, so it may change
  between CUDA-graph replays. A Python float is accepted as FlashInfer accepts it (copied to
  a fresh device tensor per call), but not while a CUDA graph is being captured.
* dynamic FP8 (10, 11): ``scale_out`` float32 ``[M, 1]`` contiguous.
* per-token-group FP8 (8, 9): ``block_quant_group_size`` g (a power of two from 16 bytes'
  worth of elements to 32 times that, dividing H); ``scale_out`` int32 packed UE8M0 in
  FlashInfer's MN-major TMA-aligned layout: shape ``(M, K)`` and strides ``(1, T)`` with
  ``(K, T) = quant_layouts.group_scale_buffer_shape(M, H, g)``, e.g. ``torch.empty(K, T,
  dtype=torch.int32)[:, :M].t()`` or ``torch.empty_strided((M, K), (1, T), dtype=torch.int32)``.
* NVFP4 (3, 5), sm100+ only (on sm90 the kernel silently writes zeros, so it is refused
  there): bf16/fp16 input, H % 16 == 0, ``scale_factor`` the global scale (as above),
  ``layout_code`` SWIZZLED_128x4 (0, the default) or LINEAR (2); ``quant_out`` uint8
  ``[M, H/2]``; ``scale_out`` contiguous, uint8/float8_e4m3fn/int32, of exactly
  ``quant_layouts.nvfp4_scale_buffer_size(M, H, layout)`` bytes.

Every check is on host metadata only (shape, dtype, device, strides, 16-byte alignment of
the vectorised tensors, the device's compute capability), so the call can be captured in a
CUDA graph with its outputs passed in. Whether the kernel serves the call and with which
algorithm (one-shot, two-shot or, by size, the large-message path) is the call's plan
(``jax_fusedar.common.plan``, the one decision of both front ends): a pure function of the
shape, dtype and workspace, so every rank picks the same one.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple, Optional, Union

import torch

from jax_fusedar.common import arguments, native, patterns, quant_layouts, results
from jax_fusedar.common import plan as rules

from . import cuda_state
from .tensors import (
    SCALE_ALIGNMENT,
    check_gamma,
    check_like,
    check_placement,
    check_tensor,
    concrete,
    refusal,
    static_shape,
)
from .workspace import TORCH_DTYPES, TorchAllReduceFusionWorkspace

# Every pattern allreduce_fusion serves: the dense ones checked and launched here, and the MoE
# patterns 6 and 7 (torch_compat/moe.py). 12 is FlashInfer's MNNVL-only code, refused by
# patterns.as_pattern.
TORCH_PATTERNS = tuple(patterns.TRAITS)  # the dense patterns and the MoE ones

_FP4_SCALE_DTYPES = (torch.uint8, torch.float8_e4m3fn, torch.int32)


def _call(pattern, input, ws, use_oneshot=None, layout=0, group=0) -> rules.Call:
    """The call as the rules layer takes it (``common.plan``)."""
    token_num, hidden_dim = input.shape
    name = TORCH_DTYPES[input.dtype]
    return rules.Call(
        pattern, token_num, hidden_dim, name, ws.sizes, ws.backend, use_oneshot, layout, group
    )


def _check_input(input, ws: TorchAllReduceFusionWorkspace, pattern) -> str:
    """Checks the input against the workspace; returns its dtype name."""
    check_tensor("input", input)
    if input.dim() != 2:
        raise ValueError(
            f"input must be 2-D [token_num, hidden_dim], got shape {list(input.shape)}"
        )
    if input.dtype not in TORCH_DTYPES:
        raise ValueError(f"input dtype {input.dtype} is not supported (bf16, fp16, fp32)")
    if not input.is_contiguous():
        raise ValueError("input must be contiguous")
    name = TORCH_DTYPES[input.dtype]
    if not static_shape(input):
        return name
    # Whether the kernel serves a call of this shape: common.plan's rule (the one of the JAX
    # front and of is_buffer_size_sufficient); the full plan follows the other checks.
    problem = rules.kernel_problem(_call(pattern, input, ws))
    if problem is not None:
        raise ValueError(refusal(rules.Plan(False, None, *problem, ())))
    return name


def check_group_size(hidden_dim: int, group_size, dtype_name: str) -> int:
    """The per-token-group size rule (quant_layouts.check_kernel_group_size, shared with
    ``jax_fusedar.api``), after the torch-side presence and type checks."""
    if group_size is None:
        raise ValueError(
            "block_quant_group_size is required for the per-token-group FP8 patterns (8, 9)"
        )
    if arguments.is_symbolic(group_size):  # under torch.compile: checked by the eager op
        return quant_layouts.check_kernel_group_size(hidden_dim, group_size, dtype_name)
    if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral):
        raise ValueError(f"block_quant_group_size must be an int, got {group_size!r}")
    return quant_layouts.check_kernel_group_size(hidden_dim, int(group_size), dtype_name)


def _check_scale_factor(scale_factor, pattern) -> None:
    """``scale_factor``'s value and metadata (shared with the fake implementations)."""
    what = (
        "the dequantization scale"
        if patterns.TRAITS[pattern].quant == "fp8"
        else "the NVFP4 global scale"
    )
    if scale_factor is None:
        raise ValueError(
            f"pattern {pattern.value} ({pattern.name}) needs scale_factor "
            f"({what}: a float32 CUDA tensor of one element)"
        )
    if isinstance(scale_factor, torch.Tensor):
        if scale_factor.dtype != torch.float32:
            raise ValueError(f"scale_factor must be a float32 tensor, got {scale_factor.dtype}")
        if tuple(scale_factor.shape) not in ((), (1,)):
            raise ValueError(
                f"scale_factor must have shape [1] (or be 0-d), got {list(scale_factor.shape)}"
            )
        return
    if isinstance(scale_factor, bool) or not isinstance(scale_factor, numbers.Real):
        raise ValueError(
            f"scale_factor must be a float32 tensor or a float, got {type(scale_factor).__name__}"
        )
    value = float(scale_factor)
    if not (value > 0.0 and value < float("inf")):
        raise ValueError(f"scale_factor must be positive and finite, got {value}")


def _scale_factor_tensor(scale_factor, ws: TorchAllReduceFusionWorkspace) -> torch.Tensor:
    """The float32 one-element device tensor the kernel reads ``scale_factor`` from (its
    value was checked by ``check_call``)."""
    if isinstance(scale_factor, torch.Tensor):
        check_placement("scale_factor", scale_factor, ws, SCALE_ALIGNMENT)
        return scale_factor
    value = float(scale_factor)
    if cuda_state.capturing():
        raise ValueError(
            "a Python float scale_factor needs a fresh device tensor per call, "
            "which a CUDA graph cannot capture; pass a float32 CUDA tensor of "
            "one element (it may change between replays)"
        )
    return torch.tensor([value], dtype=torch.float32, device=ws.torch_device)


def _check_quant_inputs(
    p, traits, name: str, input: torch.Tensor, scale_factor, layout_code, block_quant_group_size
):
    """The quantization inputs of ``p``; returns (layout code, group size) for the launch (0
    where unused; sizes that are symbolic, the group size included, are checked by the eager
    op)."""
    hidden_dim = input.shape[1]
    static = static_shape(input)
    layout = group = 0
    label = f"pattern {p.value} ({p.name})"
    if traits.quant == "fp4":
        if input.dtype == torch.float32:
            raise ValueError(f"{label} (NVFP4) needs a bfloat16 or float16 input, got float32")
        if static:
            quant_layouts.check_hidden_fp4(hidden_dim)
        layout = int(
            quant_layouts.as_layout(
                patterns.QuantizationSFLayout.SWIZZLED_128x4 if layout_code is None else layout_code
            )
        )
    if traits.quant == "group_fp8":
        group = check_group_size(hidden_dim, block_quant_group_size, name)
    if traits.uses_scale_factor:
        _check_scale_factor(scale_factor, p)
    return layout, group


def _check_quant_outputs(p, traits, input: torch.Tensor, ws, quant_out, scale_out, layout, group):
    """Checks the quantized outputs of ``p`` (eager only: they are the caller's tensors)
    against ``results.result_specs``."""
    token_num, hidden_dim = input.shape
    label = f"pattern {p.value} ({p.name})"
    missing = [
        k
        for k, t in (("quant_out", quant_out), ("scale_out", scale_out))
        if t is None and (k == "quant_out" or traits.writes_scale_out)
    ]
    if missing:
        raise ValueError(f"{label} needs {', '.join(missing)}")
    specs = {
        spec.name: spec
        for spec in results.result_specs(
            p, token_num, hidden_dim, TORCH_DTYPES[input.dtype], layout, group
        )
    }

    # quant_out
    check_tensor("quant_out", quant_out)
    want = specs["quant_out"]
    want_dtype = getattr(torch, want.dtype)
    if tuple(quant_out.shape) != tuple(want.shape):
        raise ValueError(
            f"quant_out must have shape {list(want.shape)} for {label}, got {list(quant_out.shape)}"
        )
    if quant_out.dtype != want_dtype:
        raise ValueError(
            f"quant_out must have dtype {want_dtype} for {label}, got {quant_out.dtype}"
        )
    if not quant_out.is_contiguous():
        raise ValueError("quant_out must be contiguous")
    check_placement("quant_out", quant_out, ws)

    # scale_out
    want = specs.get("scale_out")
    if traits.quant == "dynamic_fp8":
        check_tensor("scale_out", scale_out)
        if tuple(scale_out.shape) != want.shape:
            raise ValueError(
                f"scale_out must have shape [token_num, 1] = [{token_num}, 1] for "
                f"{label}, got {list(scale_out.shape)}"
            )
        if scale_out.dtype != getattr(torch, want.dtype):
            raise ValueError(
                f"scale_out must have dtype torch.{want.dtype} for {label}, got {scale_out.dtype}"
            )
        if not scale_out.is_contiguous():
            raise ValueError("scale_out must be contiguous")
        check_placement("scale_out", scale_out, ws, SCALE_ALIGNMENT)
    elif traits.quant == "group_fp8":
        check_tensor("scale_out", scale_out)
        shape, strides = want.shape, want.strides
        if scale_out.dtype != getattr(torch, want.dtype):
            raise ValueError(
                f"scale_out must have dtype torch.{want.dtype} (packed UE8M0) for "
                f"{label}, got {scale_out.dtype}"
            )
        if tuple(scale_out.shape) != shape:
            raise ValueError(
                f"scale_out shape must be {shape} (token_num, ceil(hidden_dim/"
                f"group_size/4)) for {label}, got {tuple(scale_out.shape)}"
            )
        if tuple(scale_out.stride()) != strides:
            raise ValueError(
                f"scale_out stride must be {strides} (MN-major, tma_aligned_mn = "
                f"round_up(token_num, 4) = {strides[1]}), got {tuple(scale_out.stride())}; "
                f"allocate torch.empty({shape[1]}, {strides[1]}, dtype=torch.int32)"
                f"[:, :{token_num}].t()"
            )
        check_placement("scale_out", scale_out, ws, SCALE_ALIGNMENT)
    elif traits.quant == "fp4":
        check_tensor("scale_out", scale_out)
        size = quant_layouts.nvfp4_scale_buffer_size(token_num, hidden_dim, layout)
        if scale_out.dtype not in _FP4_SCALE_DTYPES:
            raise ValueError(
                f"scale_out must have dtype torch.float8_e4m3fn, torch.uint8 or "
                f"torch.int32 for {label}, got {scale_out.dtype}"
            )
        if not scale_out.is_contiguous():
            raise ValueError("scale_out must be contiguous")
        nbytes = scale_out.numel() * scale_out.element_size()
        if nbytes != size:
            lay = patterns.QuantizationSFLayout(layout).name
            raise ValueError(
                f"scale_out must hold exactly {size} bytes of e4m3 scales for "
                f"{token_num}x{hidden_dim} in layout {lay} "
                f"(quant_layouts.nvfp4_scale_shape: "
                f"{quant_layouts.nvfp4_scale_shape(token_num, hidden_dim, layout)}), "
                f"got {nbytes} bytes (shape {list(scale_out.shape)}, "
                f"{scale_out.dtype})"
            )
        check_placement("scale_out", scale_out, ws, SCALE_ALIGNMENT)


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _option(check, name: str, value, **kw):
    """``check`` (an ``arguments`` validator) of an option, except a symbolic value that
    torch.compile may trace a scalar argument as: only the eager op sees its value."""
    return value if isinstance(value, _SYMBOLIC) else check(name, value, **kw)


def _is_moe_pattern(pattern) -> bool:
    """Whether ``pattern`` is a valid code of an MoE pattern (anything else, including an
    invalid value, goes on to ``check_call``, which names the problem)."""
    try:
        return patterns.as_pattern(pattern) in patterns.MOE_PATTERNS
    except ValueError:
        return False


class CheckedCall(NamedTuple):
    """What ``check_call`` found: the call's pattern and traits, input dtype name, NVFP4
    layout and group size for the launch, its plan (None while sizes are symbolic) and the
    options as strictly typed values."""

    pattern: patterns.AllReduceFusionPattern
    traits: patterns.PatternTraits
    dtype_name: str
    layout: int
    group: int
    plan: Optional[rules.Plan]  # common.plan's; None for a shape known only at run time
    rms_eps: float
    weight_bias: float
    fp32_acc: bool
    launch_with_pdl: bool
    trigger_completion_at_end: bool


def check_call(
    input,
    workspace,
    pattern,
    *,
    residual_in=None,
    rms_gamma=None,
    rms_eps=1e-6,
    scale_factor=None,
    layout_code=None,
    use_oneshot=None,
    fp32_acc=False,
    block_quant_group_size=None,
    weight_bias=0.0,
    launch_with_pdl=False,
    trigger_completion_at_end=True,
) -> CheckedCall:
    """Every check of a call's inputs and options that needs no device memory: the eager op
    and the fake (meta) implementations of ``torch_compat.library`` both run it, so what the
    op refuses at run time ``torch.compile`` refuses while tracing. The caller's output
    tensors, device placement and alignment, and the GPU's compute capability are checked by
    the eager op only (fake tensors have no memory and the tracing machine may have no GPU).
    """
    if not isinstance(workspace, TorchAllReduceFusionWorkspace):
        raise TypeError(
            f"workspace must come from torch_compat.create_allreduce_fusion_"
            f"workspace, got {type(workspace).__name__}"
        )
    workspace.native_rank()  # raises once destroyed
    pattern, layout_code = concrete(pattern), concrete(layout_code)
    p = patterns.as_pattern(pattern)  # ValueError naming the valid patterns
    if p in patterns.MOE_PATTERNS:
        raise ValueError(
            f"pattern {p.value} ({p.name}) is checked by "
            "torch_compat.moe.check_moe_call (it has its own inputs)"
        )
    if p not in TORCH_PATTERNS:
        raise ValueError(
            f"pattern {p.value} ({p.name}) is not supported by torch_compat; "
            "supported: " + ", ".join(f"{q.value} ({q.name})" for q in TORCH_PATTERNS)
        )
    traits = patterns.TRAITS[p]
    # Options are taken as given, never coerced (bool("false") is True): arguments.py.
    use_oneshot = _option(arguments.as_bool, "use_oneshot", use_oneshot, allow_none=True)
    options = dict(
        fp32_acc=_option(arguments.as_bool, "fp32_acc", fp32_acc),
        launch_with_pdl=_option(arguments.as_bool, "launch_with_pdl", launch_with_pdl),
        trigger_completion_at_end=_option(
            arguments.as_bool, "trigger_completion_at_end", trigger_completion_at_end
        ),
        rms_eps=_option(arguments.as_float32, "rms_eps", rms_eps, minimum=0.0),
        weight_bias=_option(arguments.as_float32, "weight_bias", weight_bias),
    )
    name = _check_input(input, workspace, p)
    if traits.has_residual:
        missing = [
            k for k, t in (("residual_in", residual_in), ("rms_gamma", rms_gamma)) if t is None
        ]
        if missing:
            raise ValueError(f"pattern {p.value} ({p.name}) needs {', '.join(missing)}")
        check_like("residual_in", residual_in, input)
        check_gamma(rms_gamma, input)
    layout, group = 0, 0
    if traits.quant is not None:
        layout, group = _check_quant_inputs(
            p, traits, name, input, scale_factor, layout_code, block_quant_group_size
        )
    decided = None  # a shape known only at run time: the eager op plans it then
    if static_shape(input):
        decided = rules.plan_call(_call(p, input, workspace, use_oneshot, layout, group))
        if not decided.kernel:  # a workspace that never uses the kernel
            raise ValueError(refusal(decided))
    return CheckedCall(p, traits, name, layout, group, decided, **options)


def allreduce_fusion(
    input: torch.Tensor,
    workspace: TorchAllReduceFusionWorkspace,
    pattern: int,
    launch_with_pdl: bool = False,
    trigger_completion_at_end: bool = True,
    output: Optional[torch.Tensor] = None,
    residual_out: Optional[torch.Tensor] = None,
    norm_out: Optional[torch.Tensor] = None,
    quant_out: Optional[torch.Tensor] = None,
    scale_out: Optional[torch.Tensor] = None,
    residual_in: Optional[torch.Tensor] = None,
    rms_gamma: Optional[torch.Tensor] = None,
    rms_eps: float = 1e-6,
    scale_factor: Optional[Union[torch.Tensor, float]] = None,
    layout_code: Optional[int] = None,
    use_oneshot: Optional[bool] = None,
    fp32_acc: bool = False,
    moe_reduction_device_num_experts: Optional[int] = None,
    moe_reduction_scale_input: Optional[torch.Tensor] = None,
    moe_reduction_active_experts_token_input: Optional[torch.Tensor] = None,
    moe_reduction_token_input: Optional[torch.Tensor] = None,
    expanded_idx_to_permuted_idx: Optional[torch.Tensor] = None,
    expert_scale_factor: Optional[torch.Tensor] = None,
    shared_expert_output: Optional[torch.Tensor] = None,
    block_quant_group_size: Optional[int] = None,
    weight_bias: float = 0.0,
    *,
    moe_finalize_backend: str = "trtllm",
    routed_scaling_factor: Optional[float] = None,
) -> torch.Tensor:
    """All-reduce ``input`` over the workspace's TP group (+ residual add + RMSNorm
    [+ quantization]).

    Collective: every rank of the group must make the same calls, in the same order, with
    the same shapes. ``pattern`` 0 (``kAllReduce``): returns ``output`` (allocated when
    None). ``pattern`` 1 (``kARResidualRMSNorm``): needs ``residual_in``, ``rms_gamma``
    ([hidden_dim]), ``residual_out`` and ``norm_out``; writes ``residual_out = sum +
    residual_in`` and ``norm_out = rmsnorm(residual_out) * (weight_bias + rms_gamma)``, and
    returns ``norm_out``. The quantized patterns (2, 3, 4, 5, 8, 9, 10, 11) quantize that
    norm output (rounded to the input dtype first) into ``quant_out`` (+ ``scale_out``); see
    the module docstring for their tensors. ``use_oneshot`` True/False forces a mode
    (ValueError if it cannot run the call), None picks FlashInfer's heuristic.

    The MoE patterns 6 (``kMoEReductionARResidualRMSNorm``, the ``moe_reduction_*``
    arguments) and 7 (``kMoEFinalizeARResidualRMSNorm``, ``input`` = the permuted expert
    rows, ``expanded_idx_to_permuted_idx``, ``expert_scale_factor``,
    ``shared_expert_output``) are served by ``torch_compat.moe.moe_allreduce_fusion`` with
    FlashInfer's names, defaults and return rules (see there). ``moe_finalize_backend``
    (FlashInfer's, keyword-only) takes only "trtllm"; ``routed_scaling_factor``
    (keyword-only, not in FlashInfer's unified API, which passes None = 1.0) scales pattern
    7's routed sum.
    """
    if _is_moe_pattern(pattern):
        from . import moe

        return moe.moe_allreduce_fusion(
            input,
            workspace,
            pattern,
            launch_with_pdl=launch_with_pdl,
            trigger_completion_at_end=trigger_completion_at_end,
            output=output,
            residual_out=residual_out,
            norm_out=norm_out,
            quant_out=quant_out,
            scale_out=scale_out,
            residual_in=residual_in,
            rms_gamma=rms_gamma,
            rms_eps=rms_eps,
            scale_factor=scale_factor,
            layout_code=layout_code,
            use_oneshot=use_oneshot,
            fp32_acc=fp32_acc,
            moe_reduction_device_num_experts=moe_reduction_device_num_experts,
            moe_reduction_scale_input=moe_reduction_scale_input,
            moe_reduction_active_experts_token_input=moe_reduction_active_experts_token_input,
            moe_reduction_token_input=moe_reduction_token_input,
            expanded_idx_to_permuted_idx=expanded_idx_to_permuted_idx,
            expert_scale_factor=expert_scale_factor,
            shared_expert_output=shared_expert_output,
            block_quant_group_size=block_quant_group_size,
            weight_bias=weight_bias,
            moe_finalize_backend=moe_finalize_backend,
            routed_scaling_factor=routed_scaling_factor,
        )
    moe_only = {
        k: v
        for k, v in (
            ("moe_reduction_device_num_experts", moe_reduction_device_num_experts),
            ("moe_reduction_scale_input", moe_reduction_scale_input),
            ("moe_reduction_active_experts_token_input", moe_reduction_active_experts_token_input),
            ("moe_reduction_token_input", moe_reduction_token_input),
            ("expanded_idx_to_permuted_idx", expanded_idx_to_permuted_idx),
            ("expert_scale_factor", expert_scale_factor),
            ("shared_expert_output", shared_expert_output),
            ("routed_scaling_factor", routed_scaling_factor),
        )
        if v is not None
    }
    if moe_only:
        raise ValueError(
            f"{', '.join(moe_only)} apply to the MoE patterns 6 and 7 only, not pattern {pattern!r}"
        )
    if moe_finalize_backend != "trtllm":
        raise ValueError(
            f"moe_finalize_backend applies to pattern 7 and takes only "
            f"'trtllm' here, got {moe_finalize_backend!r}"
        )
    call = check_call(
        input,
        workspace,
        pattern,
        residual_in=residual_in,
        rms_gamma=rms_gamma,
        rms_eps=rms_eps,
        scale_factor=scale_factor,
        layout_code=layout_code,
        use_oneshot=use_oneshot,
        fp32_acc=fp32_acc,
        block_quant_group_size=block_quant_group_size,
        weight_bias=weight_bias,
        launch_with_pdl=launch_with_pdl,
        trigger_completion_at_end=trigger_completion_at_end,
    )
    rank = workspace.native_rank()
    p, traits, name = call.pattern, call.traits, call.dtype_name
    if traits.needs_sm100:
        problem = patterns.device_problem(
            p, f"cuda:{workspace.device}", *cuda_state.compute_capability(workspace.device)
        )
        if problem:
            raise ValueError(problem)
    token_num, hidden_dim = input.shape

    # Every output the pattern does not write is refused, output= included (FlashInfer
    # would leave it unwritten and may even return it).
    # What the plan says the call writes, by FlashInfer's names (its output= is allreduce_out).
    written = {"output" if s.name == "allreduce_out" else s.name for s in call.plan.outputs}
    given = {
        "output": output,
        "residual_out": residual_out,
        "norm_out": norm_out,
        "quant_out": quant_out,
        "scale_out": scale_out,
    }
    unwritten = [k for k, t in given.items() if t is not None and k not in written]
    if unwritten:
        raise ValueError(
            f"pattern {p.value} ({p.name}) does not write {', '.join(unwritten)}; "
            f"pass None (FlashInfer would leave it unwritten)"
        )
    like_input = {"input": input, "output": output}
    if traits.has_residual:
        needed = {"residual_out": residual_out}
        if traits.has_norm_out:
            needed["norm_out"] = norm_out
        missing = [k for k, t in needed.items() if t is None]
        if missing:
            raise ValueError(f"pattern {p.value} ({p.name}) needs {', '.join(missing)}")
        like_input.update(needed, residual_in=residual_in)
    like_input = {k: t for k, t in like_input.items() if t is not None}
    for k, t in like_input.items():
        check_like(k, t, input)
        check_placement(k, t, workspace)
    if traits.has_residual:
        check_placement("rms_gamma", rms_gamma, workspace)
    sf = None
    if traits.quant is not None:
        _check_quant_outputs(
            p, traits, input, workspace, quant_out, scale_out, call.layout, call.group
        )
        if traits.uses_scale_factor:
            sf = _scale_factor_tensor(scale_factor, workspace)
    layout, group, algorithm = call.layout, call.group, call.plan.algorithm_code

    if output is None and traits.has_allreduce_out:
        output = torch.empty_like(input)

    def ptr(t: Optional[torch.Tensor]) -> int:
        return 0 if t is None else t.data_ptr()

    rank.launch(
        int(p),
        native.DTYPE_CODES[name],
        token_num,
        hidden_dim,
        ptr(input),
        allreduce_out=ptr(output) if traits.has_allreduce_out else 0,
        residual_in=ptr(residual_in) if traits.has_residual else 0,
        residual_out=ptr(residual_out),
        norm_out=ptr(norm_out),
        quant_out=ptr(quant_out),
        scale_out=ptr(scale_out),
        rms_gamma=ptr(rms_gamma) if traits.has_residual else 0,
        scale_factor=ptr(sf),
        rms_eps=call.rms_eps,
        weight_bias=call.weight_bias,
        algorithm=algorithm,
        fp32_acc=call.fp32_acc,
        layout=layout,
        block_quant_group_size=group,
        launch_with_pdl=call.launch_with_pdl,
        trigger_completion_at_end=call.trigger_completion_at_end,
        stream=cuda_state.current_stream(workspace.device),
    )
    if traits.has_norm_out:
        return norm_out
    if traits.quant is not None:
        return quant_out
    return output
