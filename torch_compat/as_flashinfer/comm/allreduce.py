"""``flashinfer.comm.allreduce``: the unified API, as torch_compat implements it."""

from __future__ import annotations

from jax_fusedar.common.patterns import AllReduceFusionPattern, QuantizationSFLayout

from ...ops import allreduce_fusion
from ...workspace import TorchAllReduceFusionWorkspace, create_allreduce_fusion_workspace

IS_TORCH_COMPAT = True

# FlashInfer's base class and its TRT-LLM workspace are one class here (the only backend).
AllReduceFusionWorkspace = TorchAllReduceFusionWorkspace
TRTLLMAllReduceFusionWorkspace = TorchAllReduceFusionWorkspace

__all__ = [
    "AllReduceFusionPattern",
    "AllReduceFusionWorkspace",
    "QuantizationSFLayout",
    "TRTLLMAllReduceFusionWorkspace",
    "allreduce_fusion",
    "create_allreduce_fusion_workspace",
]
