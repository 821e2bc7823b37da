"""torch_compat: FlashInfer's fused all-reduce (+ residual add + RMSNorm) for PyTorch.

A drop-in for ``flashinfer.comm``'s unified API on the TRT-LLM backend
(``create_allreduce_fusion_workspace``, ``allreduce_fusion``), built on the same native
core as ``jax_fusedar`` and sharing its framework-neutral topology, exchange and pattern
logic. It never imports JAX.
"""

from __future__ import annotations

from jax_fusedar.common.patterns import AllReduceFusionPattern, QuantizationSFLayout
from jax_fusedar.common.sizing import workspace_bytes

from . import library, moe
from .channel import StoreChannel
from .fusion_pass import AllReduceFusionPass, fuse_allreduce_rmsnorm
from .library import lookup_workspace, register_workspace, unregister_workspace
from .ops import allreduce_fusion
from .workspace import TorchAllReduceFusionWorkspace, create_allreduce_fusion_workspace

__all__ = [
    "AllReduceFusionPass",
    "AllReduceFusionPattern",
    "QuantizationSFLayout",
    "StoreChannel",
    "TorchAllReduceFusionWorkspace",
    "allreduce_fusion",
    "create_allreduce_fusion_workspace",
    "fuse_allreduce_rmsnorm",
    "library",
    "lookup_workspace",
    "moe",
    "register_workspace",
    "unregister_workspace",
    "workspace_bytes",
]
