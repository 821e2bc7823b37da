"""``flashinfer.comm`` as torch_compat: the unified all-reduce fusion API
(``create_allreduce_fusion_workspace``, ``allreduce_fusion``), the legacy TRT-LLM API
(``trtllm_create_ipc_workspace_for_all_reduce_fusion``, ``trtllm_allreduce_fusion``, ...) and
the pattern and layout codes; ``mnnvl.TorchDistBackend`` in :mod:`.mnnvl`."""

from __future__ import annotations

from .allreduce import (
    AllReduceFusionPattern,
    AllReduceFusionWorkspace,
    QuantizationSFLayout,
    TRTLLMAllReduceFusionWorkspace,
    allreduce_fusion,
    create_allreduce_fusion_workspace,
)
from .trtllm_ar import (
    compute_fp4_swizzled_layout_sf_size,
    trtllm_allreduce_fusion,
    trtllm_create_ipc_workspace_for_all_reduce_fusion,
    trtllm_destroy_ipc_workspace_for_all_reduce,
    trtllm_destroy_ipc_workspace_for_all_reduce_fusion,
)

IS_TORCH_COMPAT = True

__all__ = [
    "AllReduceFusionPattern",
    "AllReduceFusionWorkspace",
    "QuantizationSFLayout",
    "TRTLLMAllReduceFusionWorkspace",
    "allreduce_fusion",
    "compute_fp4_swizzled_layout_sf_size",
    "create_allreduce_fusion_workspace",
    "trtllm_allreduce_fusion",
    "trtllm_create_ipc_workspace_for_all_reduce_fusion",
    "trtllm_destroy_ipc_workspace_for_all_reduce",
    "trtllm_destroy_ipc_workspace_for_all_reduce_fusion",
]
