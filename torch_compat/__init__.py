"""torch_compat: FlashInfer's fused all-reduce (+ residual add + RMSNorm) for PyTorch.

A drop-in for ``flashinfer.comm``'s unified API on the TRT-LLM backend
(``create_allreduce_fusion_workspace``, ``allreduce_fusion``), built on the same native
core as ``jax_fusedar`` and sharing its framework-neutral topology, exchange and pattern
logic. It never imports JAX.
"""

from __future__ import annotations

NEEDS_TORCH = "torch_compat needs PyTorch: pip install 'jax_fusedar[torch]'"

try:
    import torch  # noqa: F401 (every module below needs it)
except ModuleNotFoundError as e:
    if (e.name or "").split(".")[0] != "torch":
        raise
    raise ImportError(f"{NEEDS_TORCH} ({e})", name="torch") from e

from jax_fusedar.common.patterns import AllReduceFusionPattern, QuantizationSFLayout
from jax_fusedar.common.sizing import workspace_bytes

from . import library, moe
from .channel import StoreChannel
from .fusion_pass import AllReduceFusionPass, fuse_allreduce_rmsnorm
from .library import lookup_workspace, register_workspace, unregister_workspace
from .ops import allreduce_fusion
from .workspace import TorchAllReduceFusionWorkspace, create_allreduce_fusion_workspace


def install_as_flashinfer():
    """Makes ``import flashinfer`` / ``import flashinfer.comm`` in this process give
    torch_compat (``torch_compat.as_flashinfer``), so vLLM and SGLang run on it unchanged;
    call it before anything imports flashinfer. Returns the ``flashinfer.comm`` module.
    docs/torch.md says what it holds and how it differs from FlashInfer."""
    from . import as_flashinfer

    return as_flashinfer.install()


__all__ = [
    "AllReduceFusionPass",
    "AllReduceFusionPattern",
    "QuantizationSFLayout",
    "StoreChannel",
    "TorchAllReduceFusionWorkspace",
    "allreduce_fusion",
    "create_allreduce_fusion_workspace",
    "fuse_allreduce_rmsnorm",
    "install_as_flashinfer",
    "library",
    "lookup_workspace",
    "moe",
    "register_workspace",
    "unregister_workspace",
    "workspace_bytes",
]
