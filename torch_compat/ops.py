"""``allreduce_fusion`` for torch: FlashInfer's unified-API call on our native core.

Names, defaults and out-parameter semantics follow ``flashinfer.comm.allreduce_fusion`` on a
TRT-LLM workspace (allreduce.py), for the patterns this build supports (0 and 1):

* ``output`` is the all-reduce result of pattern 0; when None, a fresh
  ``torch.empty_like(input)`` is allocated and returned, as FlashInfer does. Pattern 1 does
  not write it (FlashInfer allocates one anyway and drops it; we allocate nothing).
* Pattern 1 writes the caller's ``residual_out`` (input-sum + residual) and ``norm_out``
  and returns ``norm_out``. FlashInfer passes None ones on to the kernel, which then stores
  through a null pointer; here they are required (ValueError).
* An output the pattern does not write (``residual_out``/``norm_out``/``quant_out``/
  ``scale_out`` with pattern 0; ``quant_out``/``scale_out`` with pattern 1) is refused:
  FlashInfer leaves it unwritten and, for pattern 0 with a ``norm_out``, even returns it.
  Inputs a pattern does not read (``residual_in``/``rms_gamma`` for pattern 0,
  ``scale_factor``, ``layout_code``, ``block_quant_group_size``) are ignored, as there.

Every check is on host metadata only, so the call can be captured in a CUDA graph (with
outputs passed in). One-shot vs two-shot comes from ``topology.choose_oneshot``: a pure
function of the shape, dtype width and workspace, so every rank picks the same mode.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from jax_fusedar import native, patterns, topology

from .workspace import TORCH_DTYPES, TorchAllReduceFusionWorkspace

# The patterns whose tensors this module checks. jax_fusedar may support more (quantized
# outputs); those need their own checks here (quant_out/scale_out shapes and dtypes,
# scale_factor) before torch callers may reach the kernel with them.
TORCH_PATTERNS = (patterns.AllReduceFusionPattern.kAllReduce,
                  patterns.AllReduceFusionPattern.kARResidualRMSNorm)

# The kernel moves 16-byte vectors: a tensor starting elsewhere (a view with an odd
# storage offset) faults with a misaligned address.
_ALIGNMENT = 16


def _current_stream(device: int) -> int:
    """The raw cudaStream_t of torch's current stream on ``device`` (so graph capture and
    user streams are honoured). A function so that CPU tests can stand in for it."""
    return torch.cuda.current_stream(device).cuda_stream


def _check_like(name: str, t, ref: torch.Tensor) -> None:
    """``t`` must look exactly like ``ref`` (the input): same shape, dtype, contiguous."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(ref.shape):
        raise ValueError(f"{name} must have the input's shape [token_num, hidden_dim] = "
                         f"{list(ref.shape)}, got {list(t.shape)}")
    if t.dtype != ref.dtype:
        raise ValueError(f"{name} must have the input's dtype {ref.dtype}, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_gamma(gamma, ref: torch.Tensor) -> None:
    hidden_dim = ref.shape[1]
    if not isinstance(gamma, torch.Tensor):
        raise ValueError(f"rms_gamma must be a torch.Tensor, got {type(gamma).__name__}")
    if tuple(gamma.shape) != (hidden_dim,):
        raise ValueError(f"rms_gamma must have shape [hidden_dim] = [{hidden_dim}], got "
                         f"{list(gamma.shape)}")
    if gamma.dtype != ref.dtype:
        raise ValueError(f"rms_gamma must have the input's dtype {ref.dtype}, got {gamma.dtype}")
    if not gamma.is_contiguous():
        raise ValueError("rms_gamma must be contiguous")


def _check_placement(name: str, t: torch.Tensor, ws: TorchAllReduceFusionWorkspace) -> None:
    if t.device != ws.torch_device:
        raise ValueError(f"{name} must be on {ws.torch_device} (the workspace's device), "
                         f"got {t.device}")
    if t.data_ptr() % _ALIGNMENT:
        raise ValueError(f"{name} must start on a {_ALIGNMENT}-byte boundary (the kernel "
                         f"loads 16-byte vectors); got address {t.data_ptr():#x}")


def _check_input(input, ws: TorchAllReduceFusionWorkspace) -> str:
    """Checks the input against the workspace; returns its dtype name."""
    if not isinstance(input, torch.Tensor):
        raise ValueError(f"input must be a torch.Tensor, got {type(input).__name__}")
    if input.dim() != 2:
        raise ValueError(f"input must be 2-D [token_num, hidden_dim], got shape "
                         f"{list(input.shape)}")
    if input.dtype not in TORCH_DTYPES:
        raise ValueError(f"input dtype {input.dtype} is not supported (bf16, fp16, fp32)")
    if not input.is_contiguous():
        raise ValueError("input must be contiguous")
    token_num, hidden_dim = input.shape
    if token_num == 0 or hidden_dim == 0:
        raise ValueError(f"input is empty (shape {list(input.shape)})")
    problem = ws.fit_problem(ws.world_size, token_num, hidden_dim, input.dtype)
    if problem:
        raise ValueError(f"the call does not fit the workspace: {problem}")
    name = TORCH_DTYPES[input.dtype]
    # The workspace may be reused with another hidden size: that one must launch too.
    topology.check_kernel_supports(ws.world_size, hidden_dim, name)
    return name


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
    block_quant_group_size: Optional[int] = None,
    weight_bias: float = 0.0,
) -> torch.Tensor:
    """All-reduce ``input`` over the workspace's TP group (+ residual add + RMSNorm).

    Collective: every rank of the group must make the same calls, in the same order, with
    the same shapes. ``pattern`` 0 (``kAllReduce``): returns ``output`` (allocated when
    None). ``pattern`` 1 (``kARResidualRMSNorm``): needs ``residual_in``, ``rms_gamma``
    ([hidden_dim]), ``residual_out`` and ``norm_out``; writes ``residual_out = sum +
    residual_in`` and ``norm_out = rmsnorm(residual_out) * (weight_bias + rms_gamma)``, and
    returns ``norm_out``. ``use_oneshot`` True/False forces a mode (ValueError if it cannot
    run the call), None picks FlashInfer's heuristic. See the module docstring for how this
    differs from FlashInfer where FlashInfer would write through null pointers.
    """
    if not isinstance(workspace, TorchAllReduceFusionWorkspace):
        raise TypeError(f"workspace must come from torch_compat.create_allreduce_fusion_"
                        f"workspace, got {type(workspace).__name__}")
    rank = workspace.native_rank()  # raises once destroyed
    p = patterns.as_pattern(pattern)  # ValueError naming the supported patterns
    if p not in TORCH_PATTERNS:
        raise ValueError(f"pattern {p.value} ({p.name}) is not supported by torch_compat; "
                         "supported: " + ", ".join(f"{q.value} ({q.name})" for q in TORCH_PATTERNS))
    traits = patterns.TRAITS[p]
    name = _check_input(input, workspace)
    token_num, hidden_dim = input.shape

    written = {"residual_out": traits.has_residual, "norm_out": traits.has_norm_out,
               "quant_out": traits.quant is not None, "scale_out": traits.writes_scale_out}
    given = {"residual_out": residual_out, "norm_out": norm_out, "quant_out": quant_out,
             "scale_out": scale_out}
    unwritten = [k for k, t in given.items() if t is not None and not written[k]]
    if unwritten:
        raise ValueError(f"pattern {p.value} ({p.name}) does not write {', '.join(unwritten)}; "
                         f"pass None (FlashInfer would leave it unwritten)")
    like_input = {"input": input, "output": output}
    if traits.has_residual:
        needed = {"residual_in": residual_in, "residual_out": residual_out}
        if traits.has_norm_out:
            needed["norm_out"] = norm_out
        missing = [k for k, t in {**needed, "rms_gamma": rms_gamma}.items() if t is None]
        if missing:
            raise ValueError(f"pattern {p.value} ({p.name}) needs {', '.join(missing)}")
        _check_gamma(rms_gamma, input)
        like_input.update(needed)
    like_input = {k: t for k, t in like_input.items() if t is not None}
    for k, t in like_input.items():
        _check_like(k, t, input)
        _check_placement(k, t, workspace)
    if traits.has_residual:
        _check_placement("rms_gamma", rms_gamma, workspace)

    oneshot = topology.choose_oneshot(token_num, hidden_dim, workspace.sizes,
                                      None if use_oneshot is None else bool(use_oneshot))
    if output is None and traits.has_allreduce_out:
        output = torch.empty_like(input)

    def ptr(t: Optional[torch.Tensor]) -> int:
        return 0 if t is None else t.data_ptr()

    rank.launch(
        int(p), native.DTYPE_CODES[name], token_num, hidden_dim, ptr(input),
        allreduce_out=ptr(output) if traits.has_allreduce_out else 0,
        residual_in=ptr(residual_in) if traits.has_residual else 0,
        residual_out=ptr(residual_out), norm_out=ptr(norm_out),
        rms_gamma=ptr(rms_gamma) if traits.has_residual else 0,
        rms_eps=float(rms_eps), weight_bias=float(weight_bias), use_oneshot=oneshot,
        fp32_acc=bool(fp32_acc), launch_with_pdl=bool(launch_with_pdl),
        trigger_completion_at_end=bool(trigger_completion_at_end),
        stream=_current_stream(workspace.device))
    return norm_out if traits.has_norm_out else output
