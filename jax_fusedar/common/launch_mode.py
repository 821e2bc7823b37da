"""One-shot (Lamport) or two-shot (barrier): which all-reduce mode a call runs, decided
alike on every rank. Framework-neutral (never imports jax or torch).

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
        comm_bytes = (
            num_tokens * hidden_dim * 2 * sizes.world_size * element_size(sizes.dtype_name)
        )
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

