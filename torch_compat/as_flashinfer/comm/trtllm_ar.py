"""``flashinfer.comm.trtllm_ar``: FlashInfer's legacy TRT-LLM API (SGLang and older vLLM call
it), served by a torch_compat workspace.

``trtllm_create_ipc_workspace_for_all_reduce_fusion`` returns ``(ipc_handles,
workspace_tensor[, metadata])`` as FlashInfer does, but what they hold differs: FlashInfer's
``workspace_tensor`` is a device array of peer pointers that its kernel reads, and
``ipc_handles`` the pointers themselves; here ``workspace_tensor`` is a one-element int64
tensor on the workspace's device that names the workspace (the call finds it by the
tensor's storage, without reading it, so a CUDA graph can capture the call), and
``ipc_handles`` a list that owns it (pass it to the destroy functions). A 16-bit workspace
serves bfloat16 and float16 alike, as FlashInfer's does (``use_fp32_lamport`` picks the
element width, not the dtype).
"""

from __future__ import annotations

import threading
from typing import Any, Dict, Optional, Tuple

import torch

from jax_fusedar.common import arguments, quant_layouts
from jax_fusedar.common.patterns import AllReduceFusionPattern, QuantizationSFLayout

from ... import ops
from ...workspace import TorchAllReduceFusionWorkspace, create_allreduce_fusion_workspace

IS_TORCH_COMPAT = True

_lock = threading.Lock()
# workspace_tensor.data_ptr() -> its workspace; the creation arguments -> (handles, tensor,
# metadata) of the live workspace made with them (FlashInfer caches its function's results,
# so a second call with the same arguments returns the same workspace).
_by_tensor: Dict[int, TorchAllReduceFusionWorkspace] = {}
_by_args: Dict[Tuple, Tuple] = {}


class IpcHandles(list):
    """What ``trtllm_create_ipc_workspace_for_all_reduce_fusion`` returns first: it holds the
    workspace (``.workspace``) for the destroy functions; no raw pointers."""

    def __init__(self, workspace: TorchAllReduceFusionWorkspace, key: Tuple):
        super().__init__()
        self.workspace = workspace
        self.key = key


def trtllm_create_ipc_workspace_for_all_reduce_fusion(
    tp_rank: int,
    tp_size: int,
    max_token_num: int,
    hidden_dim,
    use_fp32_lamport: bool = False,
    group=None,
    create_metadata: bool = False,
    comm_backend=None,
    use_symm_dev_mem: bool = False,
):
    """FlashInfer's signature and returns: ``(ipc_handles, workspace_tensor)``, with
    ``create_metadata`` ``(ipc_handles, workspace_tensor, metadata)``. Collective over
    ``group`` (None: WORLD), as ``create_allreduce_fusion_workspace`` is, whose checks apply
    (``tp_rank``/``tp_size`` are the group's). ``use_symm_dev_mem`` (torch symmetric memory
    for the buffers) is refused: torch_compat allocates its own IPC memory."""
    use_fp32_lamport = arguments.as_bool("use_fp32_lamport", use_fp32_lamport)
    create_metadata = arguments.as_bool("create_metadata", create_metadata)
    if arguments.as_bool("use_symm_dev_mem", use_symm_dev_mem):
        raise ValueError(
            "use_symm_dev_mem=True is not supported by torch_compat (its workspace is its own "
            "IPC memory); leave it False"
        )
    key = (tp_rank, tp_size, max_token_num, hidden_dim, use_fp32_lamport, id(group))
    with _lock:
        cached = _by_args.get(key)
    if cached is not None and not cached[0].workspace.destroyed:
        return cached if create_metadata else cached[:2]
    ws = create_allreduce_fusion_workspace(
        "trtllm",
        world_size=tp_size,
        rank=tp_rank,
        max_token_num=max_token_num,
        hidden_dim=hidden_dim,
        dtype=torch.float32 if use_fp32_lamport else torch.bfloat16,
        comm_backend=comm_backend,
        group=group,
    )
    handles = IpcHandles(ws, key)
    tensor = torch.zeros(1, dtype=torch.int64, device=ws.torch_device)
    with _lock:
        _by_tensor[tensor.data_ptr()] = ws
        _by_args[key] = (handles, tensor, ws.metadata)
    return (handles, tensor, ws.metadata) if create_metadata else (handles, tensor)


def _workspace_of(workspace_ptrs) -> TorchAllReduceFusionWorkspace:
    if not isinstance(workspace_ptrs, torch.Tensor):
        raise TypeError(
            "workspace_ptrs must be the workspace tensor from "
            f"trtllm_create_ipc_workspace_for_all_reduce_fusion, got {type(workspace_ptrs)}"
        )
    with _lock:
        ws = _by_tensor.get(workspace_ptrs.data_ptr())
    if ws is None:
        raise ValueError(
            "workspace_ptrs is not a workspace tensor of torch_compat's "
            "trtllm_create_ipc_workspace_for_all_reduce_fusion (or it was destroyed)"
        )
    return ws


def _destroy(workspace, what: str) -> None:
    if not isinstance(workspace, IpcHandles):
        raise TypeError(
            f"{what}: pass the ipc_handles that trtllm_create_ipc_workspace_for_all_reduce_fusion "
            f"returned, got {type(workspace)}"
        )
    with _lock:
        for ptr, ws in list(_by_tensor.items()):
            if ws is workspace.workspace:
                del _by_tensor[ptr]
        if _by_args.get(workspace.key, (None,))[0] is workspace:
            del _by_args[workspace.key]
    workspace.workspace.destroy()


def trtllm_destroy_ipc_workspace_for_all_reduce_fusion(workspace, group=None) -> None:
    """Frees the workspace (FlashInfer drops its references; here the memory is released,
    so every rank must have finished its calls first)."""
    _destroy(workspace, "trtllm_destroy_ipc_workspace_for_all_reduce_fusion")


def trtllm_destroy_ipc_workspace_for_all_reduce(workspace, group=None) -> None:
    """The older destroy function, which some callers use for fusion workspaces too: the same
    as :func:`trtllm_destroy_ipc_workspace_for_all_reduce_fusion` for those (torch_compat has
    no plain custom all-reduce workspace)."""
    _destroy(workspace, "trtllm_destroy_ipc_workspace_for_all_reduce")


def _check_metadata(metadata: Dict[str, Any], ws: TorchAllReduceFusionWorkspace) -> None:
    missing = [
        k
        for k in ("max_token_num", "tp_size", "hidden_dim", "use_fp32_lamport")
        if k not in metadata
    ]
    if missing:
        raise ValueError(f"workspace metadata is missing required keys: {missing}")
    mine = ws.metadata
    differs = [k for k in mine if k in metadata and metadata[k] != mine[k]]
    if differs:
        raise ValueError(
            "metadata does not describe workspace_ptrs's workspace: "
            + ", ".join(f"{k} {metadata[k]!r} != {mine[k]!r}" for k in differs)
        )


def _as_2d(name: str, t: Optional[torch.Tensor], token_num: int, hidden_dim: int):
    if t is None or t.dim() == 2:
        return t
    if t.numel() != token_num * hidden_dim or not t.is_contiguous():
        raise ValueError(
            f"{name} must hold token_num x hidden_dim = {token_num} x {hidden_dim} contiguous "
            f"elements, got shape {list(t.shape)}"
        )
    return t.view(token_num, hidden_dim)


def trtllm_allreduce_fusion(
    allreduce_in: torch.Tensor,
    world_size: int,
    world_rank: int,
    token_num: int,
    hidden_dim: int,
    workspace_ptrs: torch.Tensor,
    launch_with_pdl: bool,
    trigger_completion_at_end: bool,
    fp32_acc: bool,
    pattern_code,
    use_oneshot: Optional[bool],
    allreduce_out: Optional[torch.Tensor],
    residual_in: Optional[torch.Tensor],
    residual_out: Optional[torch.Tensor],
    norm_out: Optional[torch.Tensor],
    quant_out: Optional[torch.Tensor],
    scale_out: Optional[torch.Tensor],
    rms_gamma: Optional[torch.Tensor],
    rms_eps: Optional[float],
    scale_factor,
    layout_code,
    metadata: Optional[dict] = None,
    block_quant_group_size: Optional[int] = None,
    weight_bias: Optional[float] = None,
) -> None:
    """FlashInfer's legacy call, in its argument order, served by ``allreduce_fusion`` on the
    workspace behind ``workspace_ptrs``: the same outputs are written (returns None).
    ``world_size``/``world_rank`` must be the workspace's, ``token_num`` x ``hidden_dim``
    the input's (FlashInfer launches on those numbers whatever the tensors hold; here a
    mismatch raises), ``metadata`` when given must describe the workspace."""
    ws = _workspace_of(workspace_ptrs)
    world_size = arguments.as_int("world_size", world_size, minimum=1)
    world_rank = arguments.as_int("world_rank", world_rank, minimum=0)
    token_num = arguments.as_int("token_num", token_num, minimum=1)
    hidden_dim = arguments.as_int("hidden_dim", hidden_dim, minimum=1)
    if (world_size, world_rank) != (ws.world_size, ws.rank):
        raise ValueError(
            f"world_size {world_size} / world_rank {world_rank} are not the workspace's "
            f"({ws.world_size} / {ws.rank})"
        )
    if metadata is not None:
        _check_metadata(metadata, ws)
    if not isinstance(allreduce_in, torch.Tensor):
        raise TypeError(f"allreduce_in must be a tensor, got {type(allreduce_in)}")
    x = _as_2d("allreduce_in", allreduce_in, token_num, hidden_dim)
    if tuple(x.shape) != (token_num, hidden_dim):
        raise ValueError(
            f"allreduce_in has shape {list(x.shape)}, not token_num x hidden_dim = "
            f"[{token_num}, {hidden_dim}]"
        )
    ops.allreduce_fusion(
        x,
        ws,
        pattern_code,
        launch_with_pdl=launch_with_pdl,
        trigger_completion_at_end=trigger_completion_at_end,
        output=_as_2d("allreduce_out", allreduce_out, token_num, hidden_dim),
        residual_out=_as_2d("residual_out", residual_out, token_num, hidden_dim),
        norm_out=_as_2d("norm_out", norm_out, token_num, hidden_dim),
        quant_out=quant_out,
        scale_out=scale_out,
        residual_in=_as_2d("residual_in", residual_in, token_num, hidden_dim),
        rms_gamma=rms_gamma,
        rms_eps=1e-6 if rms_eps is None else rms_eps,
        scale_factor=scale_factor,
        layout_code=layout_code,
        use_oneshot=use_oneshot,
        fp32_acc=fp32_acc,
        block_quant_group_size=block_quant_group_size,
        weight_bias=0.0 if weight_bias is None else weight_bias,
    )


def compute_fp4_swizzled_layout_sf_size(total_row: int, total_column: int) -> int:
    """``round_up(total_row, 128) * round_up(total_column, 4)``: the NVFP4 scale buffer's
    element count in the SWIZZLED_128x4 layout (``total_column`` = hidden / 16)."""
    rows = arguments.as_int("total_row", total_row, minimum=0)
    cols = arguments.as_int("total_column", total_column, minimum=0)
    return quant_layouts.round_up(rows, 128) * quant_layouts.round_up(cols, 4)


__all__ = [
    "AllReduceFusionPattern",
    "QuantizationSFLayout",
    "compute_fp4_swizzled_layout_sf_size",
    "trtllm_allreduce_fusion",
    "trtllm_create_ipc_workspace_for_all_reduce_fusion",
    "trtllm_destroy_ipc_workspace_for_all_reduce",
    "trtllm_destroy_ipc_workspace_for_all_reduce_fusion",
]
