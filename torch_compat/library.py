"""The fused all-reduce as ``torch.library`` custom ops, for ``torch.compile``.

Two functional ops (they allocate and return their outputs, which is what ``torch.compile``
and functionalization handle best; nothing is mutated):

* ``torch_compat::allreduce(Tensor input, bool? use_oneshot, bool fp32_acc,
  int workspace_handle) -> Tensor`` -- pattern 0 (``kAllReduce``): the sum over the group.
* ``torch_compat::allreduce_residual_rmsnorm(Tensor input, Tensor residual, Tensor gamma,
  float eps, float weight_bias, bool? use_oneshot, bool fp32_acc, int workspace_handle)
  -> (Tensor residual_out, Tensor norm_out)`` -- pattern 1 (``kARResidualRMSNorm``):
  ``residual_out = sum + residual``, ``norm_out = rmsnorm(residual_out) * (weight_bias +
  gamma)``.

A custom op cannot take a Python object, so the workspace travels as an int:
``register_workspace(ws)`` puts a live ``TorchAllReduceFusionWorkspace`` in a process-level
registry and returns its handle; ``lookup_workspace(handle)`` gets it back;
``unregister_workspace(handle)`` drops it. The handle is baked into a compiled graph as a
constant, so keep the workspace registered (and alive) as long as the graph may run.

The real kernel is registered for the CUDA dispatch key and calls
``torch_compat.ops.allreduce_fusion`` (every argument check of the eager op applies). The
fake (meta) implementations return ``empty_like(input)`` tensors, so the ops trace under
``FakeTensorMode``, ``make_fx`` and ``torch.compile(fullgraph=True)`` without a GPU.

These ops are collectives: every rank of the workspace's group must call them in the same
order with the same shapes. They are declared functional (no mutated args); do not let a
compiler drop or reorder one on some ranks only (we only produce them from real all-reduces,
which carry the same constraint).
"""
from __future__ import annotations

import itertools
import threading
from typing import Dict, Optional, Tuple

import torch

from . import ops
from .workspace import TorchAllReduceFusionWorkspace

__all__ = [
    "register_workspace", "lookup_workspace", "unregister_workspace",
    "allreduce", "allreduce_residual_rmsnorm",
    "ALLREDUCE", "ALLREDUCE_RESIDUAL_RMSNORM",
]

# --- workspace registry --------------------------------------------------------------------------

_registry: Dict[int, TorchAllReduceFusionWorkspace] = {}
_handles = itertools.count(1)
_lock = threading.Lock()


def register_workspace(ws: TorchAllReduceFusionWorkspace) -> int:
    """Registers ``ws`` and returns its int handle (the same handle if already registered)."""
    if not isinstance(ws, TorchAllReduceFusionWorkspace):
        raise TypeError(f"expected a TorchAllReduceFusionWorkspace, got {type(ws).__name__}")
    with _lock:
        for h, w in _registry.items():
            if w is ws:
                return h
        h = next(_handles)
        _registry[h] = ws
        return h


def lookup_workspace(handle: int) -> TorchAllReduceFusionWorkspace:
    """The workspace registered under ``handle``; KeyError if none, RuntimeError if it was
    destroyed since."""
    with _lock:
        ws = _registry.get(int(handle))
    if ws is None:
        raise KeyError(f"no all-reduce fusion workspace is registered under handle {handle} "
                       f"(torch_compat.library.register_workspace)")
    if ws.destroyed:
        raise RuntimeError(f"workspace handle {handle} refers to a destroyed workspace: {ws!r}")
    return ws


def unregister_workspace(handle: int) -> None:
    """Drops ``handle`` from the registry (idempotent). Does not destroy the workspace."""
    with _lock:
        _registry.pop(int(handle), None)


# --- the ops -------------------------------------------------------------------------------------


@torch.library.custom_op("torch_compat::allreduce", mutates_args=(), device_types="cuda")
def allreduce(input: torch.Tensor, use_oneshot: Optional[bool], fp32_acc: bool,
              workspace_handle: int) -> torch.Tensor:
    """Pattern 0: the all-reduce (sum) of ``input`` over the workspace's group."""
    ws = lookup_workspace(workspace_handle)
    output = torch.empty_like(input, memory_format=torch.contiguous_format)
    return ops.allreduce_fusion(input, ws, 0, output=output, use_oneshot=use_oneshot,
                                fp32_acc=fp32_acc)


@allreduce.register_fake
def _allreduce_fake(input, use_oneshot, fp32_acc, workspace_handle):
    return torch.empty_like(input, memory_format=torch.contiguous_format)


@torch.library.custom_op("torch_compat::allreduce_residual_rmsnorm", mutates_args=(),
                         device_types="cuda")
def allreduce_residual_rmsnorm(input: torch.Tensor, residual: torch.Tensor,
                               gamma: torch.Tensor, eps: float, weight_bias: float,
                               use_oneshot: Optional[bool], fp32_acc: bool,
                               workspace_handle: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pattern 1: ``(residual_out, norm_out)`` = (sum + residual, rmsnorm(that) * (weight_bias
    + gamma)), the sum being over the workspace's group."""
    ws = lookup_workspace(workspace_handle)
    residual_out = torch.empty_like(input, memory_format=torch.contiguous_format)
    norm_out = torch.empty_like(input, memory_format=torch.contiguous_format)
    ops.allreduce_fusion(input, ws, 1, residual_out=residual_out, norm_out=norm_out,
                         residual_in=residual, rms_gamma=gamma, rms_eps=eps,
                         use_oneshot=use_oneshot, fp32_acc=fp32_acc, weight_bias=weight_bias)
    return residual_out, norm_out


@allreduce_residual_rmsnorm.register_fake
def _allreduce_residual_rmsnorm_fake(input, residual, gamma, eps, weight_bias, use_oneshot,
                                     fp32_acc, workspace_handle):
    torch._check(residual.shape == input.shape,
                 lambda: f"residual shape {list(residual.shape)} != input {list(input.shape)}")
    torch._check(gamma.dim() == 1 and gamma.shape[0] == input.shape[-1],
                 lambda: f"gamma must be [hidden_dim], got {list(gamma.shape)}")
    return (torch.empty_like(input, memory_format=torch.contiguous_format),
            torch.empty_like(input, memory_format=torch.contiguous_format))


# The OpOverloads, as they appear in FX graphs.
ALLREDUCE = torch.ops.torch_compat.allreduce.default
ALLREDUCE_RESIDUAL_RMSNORM = torch.ops.torch_compat.allreduce_residual_rmsnorm.default
