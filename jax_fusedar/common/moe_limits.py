"""What FlashInfer's MoE kernels (patterns 6 and 7) can run: dtypes, hidden sizes, the launch
limit, the workspace fit and their one-shot Lamport buffer. Framework-neutral (never imports
jax or torch).

Line references ("MoE L...") are to FlashInfer 0.7.2.post1's
``trtllm_moe_allreduce_fusion.cuh`` (the launcher, ``moe_allreduce_fusion_kernel_launcher``).
"""

from __future__ import annotations

from typing import Optional

from . import limits, sizing

# FlashInfer instantiates its MoE kernels for 16-bit types only.
MOE_DTYPES = ("bfloat16", "float16")
# A token gets hidden / 8 threads rounded up to whole warps (MoE L1119-1122): whole warps of
# 8-element threads are 256 elements; the spare threads of a partial warp read the next
# token's row.
HIDDEN_MULTIPLE = 256
# The warps of a token are spread over a cluster of the largest of 8, 4, 2, 1 CTAs dividing
# the warp count; a CTA has at most 1024 threads (MoE L1129-1135).
MAX_CLUSTER_SIZE = 8
MAX_THREADS_PER_BLOCK = 1024
# The one-shot kernels exchange every rank's rows in one Lamport buffer, 2 bytes per element.
ELEMENT_BYTES = 2


def kernel_problem(
    tokens: int, hidden: int, dtype_name: str, sizes: sizing.WorkspaceSizes
) -> Optional[tuple]:
    """(kind, why) FlashInfer's MoE kernels cannot serve a call of ``tokens`` x ``hidden``,
    or None. A pure function of the shape and the workspace, so every rank decides alike;
    ffi/core/moe_launch.cpp enforces the same rules before launching."""
    if dtype_name not in MOE_DTYPES:
        return "unsupported dtype", f"the MoE kernels take bfloat16 or float16, not {dtype_name}"
    if sizes.dtype_name not in MOE_DTYPES:
        # The Lamport buffer's empty marker is -0.0 at the workspace's element width.
        return "unsupported dtype", (
            f"the MoE kernels need a 16-bit workspace, not a {sizes.dtype_name} one"
        )
    problem = limits.kernel_support_problem(sizes.world_size, hidden, dtype_name)
    if problem is not None:
        return "unsupported shape", problem
    if hidden % HIDDEN_MULTIPLE:
        return "unsupported shape", (
            f"hidden size {hidden} is not a multiple of {HIDDEN_MULTIPLE}: FlashInfer's MoE "
            "kernels give each token whole warps of 8-element threads, and the spare threads "
            "of a partial warp read the next token's row"
        )
    warps = hidden // HIDDEN_MULTIPLE
    cluster = MAX_CLUSTER_SIZE
    while warps % cluster:
        cluster //= 2
    if warps // cluster * 32 > MAX_THREADS_PER_BLOCK:
        return "unsupported shape", (
            f"hidden size {hidden} needs {warps // cluster * 32} threads per block, above "
            f"the launch limit of {MAX_THREADS_PER_BLOCK}"
        )
    if not sizing.buffer_fits(tokens, hidden, sizes):
        return "workspace too small", (
            f"{tokens}x{hidden} tokens exceed the workspace (max_token_num="
            f"{sizes.max_token_num} x hidden {sizes.hidden_dim})"
        )
    need = tokens * hidden * sizes.world_size * ELEMENT_BYTES
    if need > sizes.lamport_comm_bytes:
        return "workspace too small", (
            f"the MoE kernels are one-shot only and need {need} bytes of Lamport buffer; the "
            f"workspace has {sizes.lamport_comm_bytes}"
        )
    return None
