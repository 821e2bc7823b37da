"""One-shot (Lamport), two-shot (barrier) or, for large messages, the copy-engine path: which
all-reduce algorithm a call runs, decided alike on every rank. Framework-neutral (never
imports jax or torch).

Line references ("ARF L...") are to FlashInfer 0.7.2.post1's
``trtllm_allreduce_fusion.cuh``; "AR.py" is its ``comm/trtllm_ar.py``.
"""

from __future__ import annotations

from typing import Optional

from .limits import INT32_MAX, MIB, element_size, positive_int, vector_width
from .sizing import MAX_COMM_SIZE, WorkspaceSizes, buffer_fits

# Prefer one-shot while num_tokens * hidden * 2 * world * itemsize is at most this many MiB.
# 2/4/8 are FlashInfer's heuristic, measured on B200 (AR.py L712-725). FlashInfer has no
# entry for 16 (it raises KeyError); 21 is our extrapolation, halving the world-8 value as
# the world size doubles.
ONESHOT_MAX_MIB = {2: 512, 4: 64, 8: 42, 16: 21}


def _oneshot_problem(num_tokens: int, hidden_dim: int, sizes: WorkspaceSizes) -> Optional[str]:
    # One-shot pushes the whole input into every peer's Lamport slot at offset rank*size.
    needed = num_tokens * hidden_dim * sizes.world_size * element_size(sizes.dtype_name)
    if needed > sizes.lamport_comm_bytes:
        return (
            f"one-shot needs {needed} bytes of Lamport buffer "
            f"(tokens*hidden*world*itemsize) but the workspace has {sizes.lamport_comm_bytes} "
            f"(capped at MAX_COMM_SIZE={MAX_COMM_SIZE})"
        )
    return None


def _twoshot_problem(num_tokens: int, hidden_dim: int, sizes: WorkspaceSizes) -> Optional[str]:
    world = sizes.world_size
    if num_tokens <= world:
        # FlashInfer asserts this (AR.py): each rank reduces a slice of the tokens.
        return f"two-shot needs more tokens than ranks, got {num_tokens} tokens for {world} ranks"
    if hidden_dim // vector_width(sizes.dtype_name) < world:
        # The two-shot launch checks block_size >= nranks (ARF L1835); the block ends at
        # min(128, hidden/VEC) threads or more, so this is the whole condition.
        return (
            f"two-shot needs hidden_dim / {vector_width(sizes.dtype_name)} >= {world} "
            f"(one thread per rank per CTA), got hidden_dim={hidden_dim}"
        )
    needed = 2 * num_tokens * hidden_dim * element_size(sizes.dtype_name)
    if needed > sizes.two_shot_buffer_bytes:
        return (
            f"two-shot needs {needed} bytes of comm buffer (2*tokens*hidden*itemsize) but the "
            f"workspace has {sizes.two_shot_buffer_bytes}"
        )
    if 2 * num_tokens * hidden_dim > INT32_MAX:
        return (
            f"two-shot indexes 2*tokens*hidden = {2 * num_tokens * hidden_dim} elements with "
            f"32-bit ints (limit {INT32_MAX})"
        )
    return None


def oneshot_feasible(num_tokens: int, hidden_dim: int, sizes: WorkspaceSizes) -> bool:
    """Whether the Lamport one-shot path fits the workspace."""
    return _oneshot_problem(num_tokens, hidden_dim, sizes) is None


def twoshot_feasible(num_tokens: int, hidden_dim: int, sizes: WorkspaceSizes) -> bool:
    """Whether the barrier two-shot path can run: more tokens than ranks, a big enough comm
    buffer, hidden / VEC_SIZE >= world, and 2*tokens*hidden within int32."""
    return _twoshot_problem(num_tokens, hidden_dim, sizes) is None


def choose_oneshot(
    num_tokens: int, hidden_dim: int, sizes: WorkspaceSizes, requested: Optional[bool]
) -> bool:
    """True for the one-shot (Lamport) path, False for two-shot.

    A pure function of its arguments, on purpose: every rank of the group must pick the same
    mode (and hence the same grid) for the same call, or the peers' spin-waits never end
    (vLLM #43616). Never feed it anything rank-local (device, timing, free memory).

    ``requested`` True/False forces a mode and raises ValueError if it cannot run; None uses
    FlashInfer's size heuristic and falls back to the other mode when the preferred one is
    infeasible (e.g. few tokens force one-shot, a capped Lamport buffer forces two-shot).
    """
    num_tokens = positive_int("num_tokens", num_tokens)
    hidden_dim = positive_int("hidden_dim", hidden_dim)
    if not buffer_fits(num_tokens, hidden_dim, sizes):
        raise ValueError(
            f"{num_tokens} tokens x hidden {hidden_dim} do not fit the workspace, built for "
            f"max_token_num={sizes.max_token_num} x hidden {sizes.hidden_dim} elements; "
            f"create the workspace with a larger max_token_num"
        )
    oneshot_problem = _oneshot_problem(num_tokens, hidden_dim, sizes)
    twoshot_problem = _twoshot_problem(num_tokens, hidden_dim, sizes)
    if requested is None:
        comm_bytes = num_tokens * hidden_dim * 2 * sizes.world_size * element_size(sizes.dtype_name)
        prefer_oneshot = comm_bytes <= ONESHOT_MAX_MIB[sizes.world_size] * MIB
        if oneshot_problem is None and (prefer_oneshot or twoshot_problem is not None):
            return True
        if twoshot_problem is None:
            return False
        raise ValueError(
            f"neither all-reduce mode can run {num_tokens} tokens x hidden {hidden_dim}: "
            f"{oneshot_problem}; {twoshot_problem}"
        )
    if requested:
        if oneshot_problem is not None:
            raise ValueError(f"use_oneshot=True is not possible: {oneshot_problem}")
        return True
    if twoshot_problem is not None:
        raise ValueError(f"use_oneshot=False is not possible: {twoshot_problem}")
    return False


# ---------------------------------------------------------------------------------------------
# The large-message algorithm
# ---------------------------------------------------------------------------------------------

# Algorithm codes of the native launch (fusedar_algorithm in ffi/core/include/fusedar/core.h).
ALGORITHM_TWOSHOT = 0
ALGORITHM_ONESHOT = 1
ALGORITHM_LARGE_MESSAGE = 2
ALGORITHM_NAMES = {
    ALGORITHM_TWOSHOT: "twoshot",
    ALGORITHM_ONESHOT: "oneshot",
    ALGORITHM_LARGE_MESSAGE: "large",
}

# Auto picks the large-message algorithm (reduce-scatter + epilogue + all-gather with copy
# engines, ffi/kernels/large_message.h; the two-shot math bit for bit) from this many MiB of
# input per rank (tokens * hidden * itemsize). Measured on 2 x H200 over NVLink, bf16, pattern 1,
# CUDA-graph replay, median of 7 x 20 calls (tools/large_message_bench.cu, one run):
#
#     tokens x hidden          FlashInfer one-shot / two-shot    large-message
#     1024 x 8192 (16 MiB)          78.6 /  85.2 us                 138.8 us
#     2048 x 8192 (32 MiB)         153.2 / 163.4                    165.7
#     4096 x 4096 (32 MiB)         167.0 / 182.6                    174.2
#     8192 x 4096 (64 MiB)         331.3 / 352.9                    260.3
#     4096 x 8192 (64 MiB)         301.7 / 315.9                    259.7
#     8192 x 8192 (128 MiB)        601.4 / 616.0                    444.2
#
# Linear fits in the message size cross near 39 MiB; 48 keeps a margin on both sides. The
# copy engines add a fixed latency per chunk (about 80 us in all), so small messages stay with
# FlashInfer's kernels. World sizes 4, 8 and 16 were not measured: None keeps them on
# FlashInfer's kernels until they are.
LARGE_MESSAGE_MIN_MIB = {2: 48, 4: None, 8: None, 16: None}

# Where the native core instantiates it (large_message.h compiled_for): 16-bit inputs only.
LARGE_MESSAGE_WORLD_SIZES = (2, 4, 8)


def large_message_bytes_needed(
    num_tokens: int, hidden_dim: int, world_size: int, dtype_name: str
) -> int:
    """Bytes of each rank's two-shot buffer the large-message algorithm uses: a receive slot and
    a gather slot of ceil(tokens / world) rows per rank (large_message.h buffer_bytes_needed)."""
    slot_rows = -(-num_tokens // world_size)
    return 2 * world_size * slot_rows * hidden_dim * element_size(dtype_name)


def large_message_problem(num_tokens: int, hidden_dim: int, sizes: WorkspaceSizes) -> Optional[str]:
    """Why the large-message algorithm cannot run this call, or None. It needs what two-shot
    needs (it reduces the same per-rank slices with the same launch shape) and its slots in the
    two-shot buffer."""
    if sizes.world_size not in LARGE_MESSAGE_WORLD_SIZES or sizes.dtype_name == "float32":
        return (
            "the large-message algorithm is compiled for float16/bfloat16 at world sizes "
            f"{', '.join(map(str, LARGE_MESSAGE_WORLD_SIZES))}"
        )
    problem = _twoshot_problem(num_tokens, hidden_dim, sizes)
    if problem is not None:
        return problem
    needed = large_message_bytes_needed(num_tokens, hidden_dim, sizes.world_size, sizes.dtype_name)
    if needed > sizes.two_shot_buffer_bytes:
        return (
            f"the large-message algorithm needs {needed} bytes of the two-shot buffer, the "
            f"workspace has {sizes.two_shot_buffer_bytes}"
        )
    return None


def prefers_large_message(num_tokens: int, hidden_dim: int, sizes: WorkspaceSizes) -> bool:
    """Whether auto picks the large-message algorithm: measured faster at this world size and
    message size, and feasible in this workspace."""
    min_mib = LARGE_MESSAGE_MIN_MIB.get(sizes.world_size)
    if min_mib is None:
        return False
    message = num_tokens * hidden_dim * element_size(sizes.dtype_name)
    return message >= min_mib * MIB and large_message_problem(num_tokens, hidden_dim, sizes) is None


def choose_algorithm(
    num_tokens: int, hidden_dim: int, sizes: WorkspaceSizes, requested: Optional[bool]
) -> int:
    """The ALGORITHM_* code a call runs: a pure function of its arguments, like
    ``choose_oneshot`` (every rank must run the same algorithm). ``requested`` True/False forces
    FlashInfer's one-shot/two-shot kernel; None picks by size, the large-message algorithm
    included."""
    oneshot = choose_oneshot(num_tokens, hidden_dim, sizes, requested)
    if requested is None and prefers_large_message(num_tokens, hidden_dim, sizes):
        return ALGORITHM_LARGE_MESSAGE
    return ALGORITHM_ONESHOT if oneshot else ALGORITHM_TWOSHOT
