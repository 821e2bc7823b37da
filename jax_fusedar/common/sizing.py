"""How big one rank's workspace is, exactly as FlashInfer computes it, and whether a call
fits it. Framework-neutral (never imports jax or torch).

Line references ("ARF L...") are to FlashInfer 0.7.2.post1's
``trtllm_allreduce_fusion.cuh``; "AR.py" is its ``comm/trtllm_ar.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .limits import check_world_size, element_size, positive_int

# The Lamport stride is stored in an int32 word of the control block (word [3]), so one
# Lamport sub-buffer must stay below 2 GiB. FlashInfer rounds INT32_MAX down to 2 MiB (AR.py).
MAX_COMM_SIZE = (2**31 - 1) & ~((1 << 21) - 1)

# Two-shot barrier flags: an int32 array [BARRIER_FLAG_COUNT blocks][N ranks] per rank
# (kBarrierFlagCount, ARF L33).
BARRIER_FLAG_COUNT = 256

# The local (never shared) control block: {CTA counter, two-shot flag, Lamport index,
# lamport_comm_size, clear size}, all int32 (docs/architecture.md, workspace layout).
CONTROL_BLOCK_INTS = 5

# Buffers are rounded up to this many bytes (AR.py L507), which keeps every 16-byte vector
# access aligned.
_BUFFER_ALIGNMENT = 16


def _round_up(nbytes: int, alignment: int = _BUFFER_ALIGNMENT) -> int:
    return -(-nbytes // alignment) * alignment


@dataclass(frozen=True)
class WorkspaceSizes:
    """Per-rank byte sizes of one workspace (docs/architecture.md), all rounded up to 16 bytes.

    ``workspace_sizes`` builds it; every rank of a group computes identical values, and the
    launch policy (``launch_mode``) reads only these fields, so every rank makes the same choices.
    """

    world_size: int
    max_token_num: int
    hidden_dim: int
    dtype_name: str
    two_shot_buffer_bytes: int  # workspace[0..N): two-shot comm buffer, peer-mapped
    flag_bytes: int  # workspace[N..2N): barrier flags, peer-mapped, zero-initialised
    lamport_comm_bytes: int  # stride between the 3 Lamport sub-buffers (control word [3])
    lamport_buffer_bytes: int  # workspace[2N..3N): 3 Lamport sub-buffers, peer-mapped, -0.0

    @property
    def per_rank_bytes(self) -> int:
        """Device memory one rank allocates: the three shared buffers plus the control block."""
        return (
            self.two_shot_buffer_bytes
            + self.flag_bytes
            + self.lamport_buffer_bytes
            + CONTROL_BLOCK_INTS * 4
        )

    @property
    def use_fp32_lamport(self) -> bool:
        """The Lamport "not arrived" sentinel is -0.0 at the call dtype's width, so a float32
        call needs a float32-initialised workspace (an fp16 -0.0 pair is not an fp32 -0.0)."""
        return self.dtype_name == "float32"


def workspace_sizes(
    world_size: int, max_token_num: int, hidden_dim: int, dtype_name: str
) -> WorkspaceSizes:
    """Workspace sizes exactly as FlashInfer computes them (AR.py L474-491, L507).

    Element width e is 4 for float32, else 2 (bf16 and fp16 share a workspace layout).
    The Lamport stride is capped at MAX_COMM_SIZE; larger calls then go two-shot.
    """
    world_size = check_world_size(world_size)
    max_token_num = positive_int("max_token_num", max_token_num)
    hidden_dim = positive_int("hidden_dim", hidden_dim)
    e = element_size(dtype_name)
    full = world_size * max_token_num * hidden_dim * e
    # Round the stride too: it separates the sub-buffers, which must stay 16-byte aligned.
    # MAX_COMM_SIZE is 2 MiB-aligned, so capping before or after rounding is the same.
    lamport_comm = _round_up(min(full, MAX_COMM_SIZE))
    return WorkspaceSizes(
        world_size=world_size,
        max_token_num=max_token_num,
        hidden_dim=hidden_dim,
        dtype_name=dtype_name,
        two_shot_buffer_bytes=_round_up(full),
        flag_bytes=_round_up(world_size * BARRIER_FLAG_COUNT * 4),
        lamport_comm_bytes=lamport_comm,
        lamport_buffer_bytes=3 * lamport_comm,
    )


def buffer_fits(num_tokens: int, hidden_dim: int, sizes: WorkspaceSizes) -> bool:
    """FlashInfer's workspace check: an element count, so a workspace built for one hidden size
    serves any (tokens, hidden) with no more elements (AR.py L755-760). The kernel itself knows
    nothing of the workspace size: a call that does not fit writes past the peers' buffers."""
    return num_tokens * hidden_dim <= sizes.max_token_num * sizes.hidden_dim


def dtype_name(dtype) -> str:
    """The name of ``dtype`` as this layer reads dtypes ("bfloat16"): a name, a numpy or JAX
    dtype (``jnp.bfloat16``), or a torch dtype (``torch.bfloat16``, told apart by its type's
    package, since this layer imports no framework)."""
    if isinstance(dtype, str):
        return dtype
    if type(dtype).__module__.partition(".")[0] == "torch":
        return str(dtype).rpartition(".")[2]  # "torch.bfloat16"
    try:
        return np.dtype(dtype).name
    except TypeError:
        return repr(dtype)  # element_size names it as unsupported


def workspace_bytes(world_size: int, max_token_num: int, hidden_dim: int, dtype) -> int:
    """Device memory one rank's workspace takes, in bytes, for a TP group of ``world_size``
    serving calls of up to ``max_token_num`` x ``hidden_dim`` elements of ``dtype`` (a name,
    a numpy/JAX dtype or a torch dtype): the three peer-mapped buffers (two-shot, barrier
    flags, Lamport) and the control block, as FlashInfer sizes them. The same for the JAX
    workspace (``jax_fusedar.workspace_bytes``) and torch's (``torch_compat.workspace_bytes``);
    their repr shows it (``bytes_per_rank``). It grows with world_size x max_token_num x
    hidden_dim: 8192 x 8192 bf16 at TP 8 is 4 GiB per rank."""
    return workspace_sizes(world_size, max_token_num, hidden_dim, dtype_name(dtype)).per_rank_bytes


def format_bytes(n: int) -> str:
    """``n`` bytes for people: "4.00 GiB", "12.0 MiB", "512 B"."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            value = n / size
            return f"{value:.2f} {unit}" if value < 10 else f"{value:.1f} {unit}"
    return f"{n} B"
