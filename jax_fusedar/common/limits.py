"""What the FlashInfer kernel can run at all: world sizes, dtypes, hidden sizes, and the
hardware and index limits behind them. Framework-neutral (never imports jax or torch).

Line references ("ARF L...") are to FlashInfer 0.7.2.post1's
``trtllm_allreduce_fusion.cuh``; "AR.py" is its ``comm/trtllm_ar.py``.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

# The kernel is instantiated for these NRanks only; anything else throws (ARF L1874-1953).
SUPPORTED_WORLD_SIZES = (2, 4, 8, 16)

# The kernel moves 16 bytes per access (kBytesPerAccess), so a thread handles 16/sizeof(T)
# elements.
_BYTES_PER_ACCESS = 16

# The kernel clusters at most 8 CTAs per token (min(8, device max); H100/H200/B200 allow 8)
# and a CTA has at most 1024 threads (ARF L1727-1735, L1836).
_MAX_CLUSTER_SIZE = 8
_MAX_THREADS_PER_BLOCK = 1024

# Element offsets in the kernel are 32-bit ``int`` (params.size, the two-shot index
# ``(tot_access + idx) * VEC_SIZE`` reaching 2*M*H, ARF L1608-1640).
INT32_MAX = 2**31 - 1

_ELEMENT_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4}

MIB = 1 << 20


def element_size(dtype_name: str) -> int:
    """Bytes per element of a supported dtype given by name ("bfloat16", "float16", "float32")."""
    try:
        return _ELEMENT_SIZES[dtype_name]
    except (KeyError, TypeError):
        raise ValueError(_unknown_dtype_message(dtype_name)) from None


def vector_width(dtype_name: str) -> int:
    """Elements per 16-byte access (the kernel's VEC_SIZE): 8 for 16-bit types, 4 for float32."""
    return _BYTES_PER_ACCESS // element_size(dtype_name)


def _unknown_dtype_message(dtype_name: object) -> str:
    return (
        f"unsupported dtype {dtype_name!r}: the fused all-reduce kernel supports "
        f"{', '.join(_ELEMENT_SIZES)} (pass the name, e.g. np.dtype(x).name)"
    )


def is_int(value: object) -> bool:
    """A Python or numpy int, not a bool (sizes come as either; unlike ``arguments.is_int``,
    other ``numbers.Integral`` types are not sizes here)."""
    # bool is an int subclass; True as a size is a bug, not a 1.
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def positive_int(name: str, value: object) -> int:
    if not is_int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _world_size_problem(world_size: object) -> Optional[str]:
    if is_int(world_size) and world_size in SUPPORTED_WORLD_SIZES:
        return None
    return (
        f"world size {world_size!r} is not supported: the fused all-reduce kernel is built "
        f"for TP groups of {', '.join(map(str, SUPPORTED_WORLD_SIZES))} ranks"
    )


def check_world_size(world_size: object) -> int:
    problem = _world_size_problem(world_size)
    if problem:
        raise ValueError(problem)
    return int(world_size)


def kernel_support_problem(world_size: int, hidden_dim: int, dtype_name: str) -> Optional[str]:
    """Why the FlashInfer kernel cannot run this configuration, or None if it can.

    Used where the caller falls back to XLA collectives and logs the reason. The launch rule
    (ARF L1727-1736, L1811, L1836): a token's ``t = hidden_dim / VEC_SIZE`` vector accesses
    are spread over a cluster of ``c`` CTAs, ``c`` the largest of 8, 4, 2, 1 that divides
    ``t``, so one CTA needs ``t / c`` threads and that must be <= 1024. Hence hidden sizes
    up to ``8192 * VEC_SIZE`` when ``t`` is a multiple of 8, but only ``1024 * VEC_SIZE`` when
    ``t`` is odd. (Growing small blocks by halving the cluster keeps ``block * cluster == t``
    and never exceeds 1024; the register budget is enforced by the launch itself.)
    """
    problem = _world_size_problem(world_size)
    if problem:
        return problem
    if dtype_name not in _ELEMENT_SIZES:
        return _unknown_dtype_message(dtype_name)
    vec = vector_width(dtype_name)
    if not is_int(hidden_dim) or hidden_dim <= 0 or hidden_dim % vec:
        return (
            f"hidden_dim={hidden_dim!r} is not supported for {dtype_name}: it must be a positive "
            f"multiple of {vec} (the kernel moves 16-byte vectors of {vec} elements)"
        )
    threads_per_token = hidden_dim // vec
    cluster = _MAX_CLUSTER_SIZE
    while threads_per_token % cluster:
        cluster //= 2
    threads_per_block = threads_per_token // cluster
    if threads_per_block > _MAX_THREADS_PER_BLOCK:
        return (
            f"hidden_dim={hidden_dim} cannot be launched for {dtype_name}: a token is "
            f"{threads_per_token} vectors of {vec} elements, split over a cluster of {cluster} "
            f"CTA(s) (the largest power of two <= {_MAX_CLUSTER_SIZE} dividing "
            f"{threads_per_token}), which needs {threads_per_block} threads per CTA; the "
            f"limit is {_MAX_THREADS_PER_BLOCK} (so hidden_dim / {vec} divided by that cluster "
            f"size must be <= {_MAX_THREADS_PER_BLOCK}, e.g. hidden_dim <= "
            f"{_MAX_THREADS_PER_BLOCK * _MAX_CLUSTER_SIZE * vec} when hidden_dim / {vec} is a "
            f"multiple of {_MAX_CLUSTER_SIZE})"
        )
    return None


def check_kernel_supports(world_size: int, hidden_dim: int, dtype_name: str) -> None:
    """Raise ValueError with the reason if the kernel cannot run this configuration."""
    problem = kernel_support_problem(world_size, hidden_dim, dtype_name)
    if problem:
        raise ValueError(problem)
