"""Framework-neutral topology and policy logic for the fused all-reduce kernel.

Everything here is pure Python (stdlib + numpy) so that the JAX API and the torch layer make
the *same* decisions from the same inputs:

* what the FlashInfer kernel can run at all (world size, hidden size, dtype),
* how big the per-rank workspace is,
* whether a call fits a workspace and whether it runs one-shot or two-shot,
* which devices form each tensor-parallel (TP) group and in which rank order,
* the keys under which a group exchanges its IPC handles,
* which backend to use (our trtllm kernel or plain XLA collectives).

These are the decisions peer projects got wrong (DP groups built over WORLD, TP rank taken
from a device id, colliding random exchange keys, per-rank launch choices that differ), so
every rule states the reason it exists. Line references ("ARF L...") are to FlashInfer
0.7.2.post1's ``trtllm_allreduce_fusion.cuh``; "AR.py" is its ``comm/trtllm_ar.py``.

Never import jax or torch here.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import numpy as np

from . import arguments

# ---------------------------------------------------------------------------------------------
# Constants
# ---------------------------------------------------------------------------------------------

# The kernel is instantiated for these NRanks only; anything else throws (ARF L1874-1953).
SUPPORTED_WORLD_SIZES = (2, 4, 8, 16)

# The Lamport stride is stored in an int32 word of the control block (word [3]), so one
# Lamport sub-buffer must stay below 2 GiB. FlashInfer rounds INT32_MAX down to 2 MiB (AR.py).
MAX_COMM_SIZE = (2**31 - 1) & ~((1 << 21) - 1)

# Two-shot barrier flags: an int32 array [BARRIER_FLAG_COUNT blocks][N ranks] per rank
# (kBarrierFlagCount, ARF L33).
BARRIER_FLAG_COUNT = 256

# The local (never shared) control block: {CTA counter, two-shot flag, Lamport index,
# lamport_comm_size, clear size}, all int32 (spec §2.1).
CONTROL_BLOCK_INTS = 5

# The kernel moves 16 bytes per access (kBytesPerAccess), so a thread handles 16/sizeof(T)
# elements.
_BYTES_PER_ACCESS = 16

# Buffers are rounded up to this many bytes (AR.py L507), which keeps every 16-byte vector
# access aligned.
_BUFFER_ALIGNMENT = 16

# The kernel clusters at most 8 CTAs per token (min(8, device max); H100/H200/B200 allow 8)
# and a CTA has at most 1024 threads (ARF L1727-1735, L1836).
_MAX_CLUSTER_SIZE = 8
_MAX_THREADS_PER_BLOCK = 1024

# Element offsets in the kernel are 32-bit ``int`` (params.size, the two-shot index
# ``(tot_access + idx) * VEC_SIZE`` reaching 2*M*H, ARF L1608-1640).
_INT32_MAX = 2**31 - 1

_ELEMENT_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4}

_MIB = 1 << 20


# ---------------------------------------------------------------------------------------------
# dtypes and kernel limits
# ---------------------------------------------------------------------------------------------


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


def _is_int(value: object) -> bool:
    # bool is an int subclass; True as a size is a bug, not a 1.
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _positive_int(name: str, value: object) -> int:
    if not _is_int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _world_size_problem(world_size: object) -> Optional[str]:
    if _is_int(world_size) and world_size in SUPPORTED_WORLD_SIZES:
        return None
    return (
        f"world size {world_size!r} is not supported: the fused all-reduce kernel is built "
        f"for TP groups of {', '.join(map(str, SUPPORTED_WORLD_SIZES))} ranks"
    )


def _check_world_size(world_size: object) -> int:
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
    if not _is_int(hidden_dim) or hidden_dim <= 0 or hidden_dim % vec:
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


# ---------------------------------------------------------------------------------------------
# Workspace sizes
# ---------------------------------------------------------------------------------------------


def _round_up(nbytes: int, alignment: int = _BUFFER_ALIGNMENT) -> int:
    return -(-nbytes // alignment) * alignment


@dataclass(frozen=True)
class WorkspaceSizes:
    """Per-rank byte sizes of one workspace (spec §2.1), all rounded up to 16 bytes.

    ``workspace_sizes`` builds it; every rank of a group computes identical values, and the
    launch policy below reads only these fields, so every rank makes the same choices.
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
    world_size = _check_world_size(world_size)
    max_token_num = _positive_int("max_token_num", max_token_num)
    hidden_dim = _positive_int("hidden_dim", hidden_dim)
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


# ---------------------------------------------------------------------------------------------
# One-shot vs two-shot
# ---------------------------------------------------------------------------------------------

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
    if 2 * num_tokens * hidden_dim > _INT32_MAX:
        return (
            f"two-shot indexes 2*tokens*hidden = {2 * num_tokens * hidden_dim} elements with "
            f"32-bit ints (limit {_INT32_MAX})"
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
    num_tokens = _positive_int("num_tokens", num_tokens)
    hidden_dim = _positive_int("hidden_dim", hidden_dim)
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
        prefer_oneshot = comm_bytes <= ONESHOT_MAX_MIB[sizes.world_size] * _MIB
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
# Tensor-parallel groups
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TPGroup:
    """One tensor-parallel group.

    ``members`` are global device ids (JAX) or global process ranks (torch) in TP-rank order:
    the TP rank of a member is its position here, which is its position along the mesh's TP
    axis, not its id (vLLM used tp_rank as a device index and picked the wrong GPU).
    ``index`` numbers the group among its siblings (e.g. the DP replica).
    """

    members: tuple[int, ...]
    index: int

    def __post_init__(self) -> None:
        # Normalise (lists, numpy ints) so equal groups compare and hash equal.
        object.__setattr__(self, "members", tuple(int(m) for m in self.members))
        if not self.members:
            raise ValueError("a TP group needs at least one member")
        if len(set(self.members)) != len(self.members):
            raise ValueError(f"TP group members must be distinct, got {self.members}")

    @property
    def size(self) -> int:
        return len(self.members)

    def rank_of(self, member: int) -> int:
        """This member's TP rank (its position in ``members``)."""
        try:
            return self.members.index(member)
        except ValueError:
            raise ValueError(f"{member!r} is not a member of TP group {self.members}") from None


def tp_groups_from_grid(
    device_ids: "np.ndarray | Sequence", axis_names: Sequence[str], axis_name: str
) -> list[TPGroup]:
    """Split a device grid shaped like a JAX mesh into TP groups along ``axis_name``.

    ``device_ids`` holds one int per mesh position (e.g. ``[d.id for d in mesh.devices.flat]``
    reshaped to ``mesh.devices.shape``), ``axis_names`` names its axes. There is one group per
    combination of the other axes, in row-major order over those axes; each group's members
    are ordered by their coordinate on ``axis_name``, so TP rank = mesh position.
    """
    grid = np.asarray(device_ids)
    axis_names = tuple(axis_names)
    if grid.ndim != len(axis_names):
        raise ValueError(
            f"device grid has {grid.ndim} dimension(s) (shape {grid.shape}) but "
            f"{len(axis_names)} axis name(s) {axis_names}"
        )
    if len(set(axis_names)) != len(axis_names):
        raise ValueError(f"axis names must be distinct, got {axis_names}")
    if axis_name not in axis_names:
        raise ValueError(f"unknown axis {axis_name!r}: the mesh axes are {axis_names}")
    if grid.size == 0 or not np.issubdtype(grid.dtype, np.integer):
        raise ValueError(f"device_ids must be a non-empty grid of ints, got dtype {grid.dtype}")
    if len(np.unique(grid)) != grid.size:
        raise ValueError(f"device ids must be distinct, got {grid.tolist()}")
    axis = axis_names.index(axis_name)
    # Move the TP axis last; the remaining axes keep their order, so the reshape enumerates
    # the groups in row-major order over them.
    rows = np.moveaxis(grid, axis, -1).reshape(-1, grid.shape[axis])
    return [
        TPGroup(members=tuple(int(i) for i in row), index=index)
        for index, row in enumerate(rows)
    ]


def groups_problem(
    axis_name: str, workspace_groups: Sequence[Sequence[int]], call_groups: Sequence[Sequence[int]]
) -> Optional[str]:
    """Why a call whose mesh groups the devices along ``axis_name`` as ``call_groups`` cannot
    use a workspace built for ``workspace_groups`` (both: member ids in TP-rank order), or
    None. Each device finds its workspace rank by its own id, so every calling group must be
    one of the workspace's groups, members in the same order; comparing the flat device
    lists is not enough (a ("dp", "tp") and a ("tp", "dp") mesh over the same devices group
    them differently, and the kernel would then sum over the workspace's groups)."""
    have = {tuple(int(m) for m in g) for g in workspace_groups}
    if all(tuple(int(m) for m in g) in have for g in call_groups):
        return None

    def show(groups):
        return ", ".join(str(tuple(int(m) for m in g)) for g in groups)

    return (f"the mesh of this call groups the devices along {axis_name!r} as [{show(call_groups)}] "
            f"but the workspace was created for the groups [{show(workspace_groups)}] "
            f"(device ids in TP-rank order); create the workspace from the mesh the call runs "
            f"under")


def exchange_key(namespace: str, group: TPGroup, workspace_serial: int, purpose: str) -> str:
    """Key under which a group exchanges data (IPC handles, barriers) for one workspace.

    Derived only from its arguments and the group's ordered members, so every process
    computes the same key without talking to the others, and two groups, two workspaces or
    two purposes never share a key. No random numbers: vLLM seeds ``random`` identically on
    every rank, so FlashInfer's random exchange ids collided across TP groups (spec §2.3).
    ``group.index`` is deliberately left out: the members identify the group.
    """
    if not isinstance(namespace, str) or not namespace:
        raise ValueError(f"namespace must be a non-empty string, got {namespace!r}")
    if not isinstance(purpose, str) or not purpose:
        raise ValueError(f"purpose must be a non-empty string, got {purpose!r}")
    if not _is_int(workspace_serial) or workspace_serial < 0:
        raise ValueError(f"workspace_serial must be an int >= 0, got {workspace_serial!r}")
    identity = json.dumps([namespace, list(group.members), int(workspace_serial), purpose])
    digest = hashlib.sha256(identity.encode()).hexdigest()[:32]
    return f"{namespace}/{purpose}/ws{int(workspace_serial)}/tp{group.size}/{digest}"


# ---------------------------------------------------------------------------------------------
# Backend choice
# ---------------------------------------------------------------------------------------------

BACKENDS = ("auto", "trtllm", "mnnvl", "xla")
BACKEND_ENV_VAR = "JAX_FUSEDAR_ALLREDUCE_BACKEND"

_CUDA_PLATFORMS = ("gpu", "cuda")


def _backend_name(value: Optional[str]) -> str:
    """Normalise a backend name; None or an empty string mean "auto"."""
    if value is None:
        return "auto"
    if not isinstance(value, str):
        raise ValueError(f"backend must be a string or None, got {value!r}")
    return value.strip().lower() or "auto"


def requested_backend(
    requested: Optional[str], env: Optional[Mapping[str, str]] = None
) -> tuple[str, str]:
    """(backend name, where it came from): an explicit ``requested`` other than None/"auto",
    else $JAX_FUSEDAR_ALLREDUCE_BACKEND (``env`` defaults to os.environ), else "auto". Not
    yet checked against any list (JAX and torch have their own)."""
    env = os.environ if env is None else env
    name, source = _backend_name(requested), "backend argument"
    if name == "auto":
        name, source = _backend_name(env.get(BACKEND_ENV_VAR, "")), f"${BACKEND_ENV_VAR}"
    return name, source


def resolve_backend(
    requested: Optional[str],
    *,
    platform: str,
    num_nodes: int = 1,
    env: Optional[Mapping[str, str]] = None,
) -> str:
    """Resolve the all-reduce backend to "trtllm" (our kernel) or "xla" (plain collectives).

    Precedence: an explicit ``requested`` other than None/"auto", then
    $JAX_FUSEDAR_ALLREDUCE_BACKEND (``env`` defaults to os.environ), then "auto".
    ``platform`` is the JAX platform or lowering platform ("cuda", "gpu", "cpu", ...); "gpu"
    is taken to mean CUDA (JAX also says "gpu" on ROCm, so pass "rocm" there when known).
    ``num_nodes`` is the number of hosts the TP group spans: "auto" takes the kernel on
    CUDA within one node and XLA's collectives otherwise (never raising for a valid layout;
    ``resolve_backend_for_groups`` also says which groups span nodes, for the caller to log),
    an explicit "trtllm" across nodes raises.
    """
    num_nodes = _positive_int("num_nodes", num_nodes)
    name, source = requested_backend(requested, env)
    if name not in BACKENDS:
        raise ValueError(
            f"unknown all-reduce backend {name!r} (from the {source}); choose one of {BACKENDS}"
        )
    on_cuda = platform.lower() in _CUDA_PLATFORMS
    if name == "mnnvl":
        # FlashInfer's MNNVL backend binds memory to an NVLink multicast object
        # (cuMulticastCreate); jax_fusedar deliberately never creates one (DESIGN.md §3).
        raise ValueError(
            "the 'mnnvl' all-reduce backend needs NVLink multicast (cuMulticastCreate), which "
            "jax_fusedar never attempts; use 'trtllm' within one node or 'xla' otherwise"
        )
    if name == "xla":
        return "xla"
    if name == "auto":
        # A TP group across nodes is a valid layout: XLA's all-reduce (NCCL) serves it.
        return "trtllm" if on_cuda and num_nodes == 1 else "xla"
    # name == "trtllm"
    if not on_cuda:
        raise ValueError(
            f"the 'trtllm' all-reduce backend needs a CUDA GPU, but the platform is {platform!r}; "
            f"use 'xla' or 'auto'"
        )
    if num_nodes > 1:
        raise ValueError(
            f"the 'trtllm' all-reduce backend works only within one node, but the TP group "
            f"spans {num_nodes} nodes; use 'mnnvl' (FlashInfer, needs NVLink multicast; not "
            f"available in jax_fusedar) or 'xla'"
        )
    return "trtllm"


def group_hosts(group: TPGroup, host_of: Mapping[int, str]) -> dict[str, tuple[int, ...]]:
    """The hosts TP group ``group`` spans: host name -> the group's members on it (TP-rank
    order), hosts in the order of their first member. ``host_of`` maps each member (a device
    id under JAX, a global rank under torch) to the name of its host.

    The one rule, for JAX and torch alike, for how many nodes a group spans: count the
    distinct hosts of its own members, never of the whole mesh or world (a DP x TP layout
    with every TP group inside one node keeps the kernel however many nodes the DP axis
    spans). The kernel's peer memory (CUDA P2P / IPC) exists only between GPUs of one host.
    """
    missing = [m for m in group.members if m not in host_of]
    if missing:
        raise ValueError(f"no host known for member(s) {missing} of TP group "
                         f"{list(group.members)}")
    hosts: dict[str, list[int]] = {}
    for m in group.members:
        hosts.setdefault(str(host_of[m]), []).append(m)
    return {h: tuple(ms) for h, ms in hosts.items()}


@dataclass(frozen=True)
class BackendChoice:
    """What ``resolve_backend_for_groups`` decided for one workspace.

    ``backend``: "trtllm" or "xla", for every group of the workspace. ``spanning``: the
    groups whose members are on several hosts. ``reason``: set when "auto" chose "xla" on
    CUDA because groups span hosts (names them; the caller logs it once), else None.
    """

    backend: str
    spanning: tuple[TPGroup, ...] = ()
    reason: Optional[str] = None


# Why a TP group across nodes cannot use the kernel; one sentence for every message.
ONE_NODE_ONLY = (
    "the 'trtllm' kernel's peer-memory protocol works only within one node, and 'mnnvl' "
    "(FlashInfer's multi-node backend) needs NVLink multicast, which jax_fusedar refuses"
)


def describe_spanning(spanning, n_groups: int, member_name: str) -> str:
    """The text "TP group [...] (devices) spans N nodes (host: [members]; ...)" for
    ``spanning``, a list of (group, group_hosts(group)) pairs: the first in full, up to three
    more by their members."""
    (first, hosts), rest = spanning[0], spanning[1:]
    where = "; ".join(f"{h}: {list(ms)}" for h, ms in hosts.items())
    text = (f"TP group {list(first.members)} ({member_name}s) spans {len(hosts)} nodes "
            f"({where})")
    if rest:
        shown = ", ".join(str(list(g.members)) for g, _ in rest[:3])
        text += (f", as do {len(rest)} more of the workspace's {n_groups} TP groups "
                 f"({shown}{', ...' if len(rest) > 3 else ''})")
    return text


def resolve_backend_for_groups(
    requested: Optional[str],
    *,
    platform: str,
    groups: Sequence[TPGroup],
    host_of: Mapping[int, str],
    env: Optional[Mapping[str, str]] = None,
    member_name: str = "member",
) -> BackendChoice:
    """``resolve_backend`` for all TP groups of one workspace, each counted on its own hosts
    (``group_hosts``); ``member_name`` says what the members are in messages ("device",
    "global rank").

    One backend for the whole workspace, decided from its groups: under JAX one program runs
    on every device, so the custom call is in it for every group or for none (a per-group
    choice would make the program differ between ranks). Every group within one node: the
    kernel (on CUDA, unless "xla" is asked for). Some group across nodes: "auto" picks "xla"
    for all groups and ``reason`` names the spanning groups and their hosts; an explicit
    "trtllm" raises ValueError naming them. Every process must pass the same ``host_of``, so
    that all decide alike.
    """
    groups = list(groups)
    if not groups:
        raise ValueError("resolve_backend_for_groups needs at least one TP group")
    # The name, platform and environment are checked as for one node, so their errors
    # read the same whatever the layout.
    backend = resolve_backend(requested, platform=platform, num_nodes=1, env=env)
    spans = [(g, group_hosts(g, host_of)) for g in groups]
    spanning = [(g, h) for g, h in spans if len(h) > 1]
    if not spanning:
        return BackendChoice(backend)
    where = describe_spanning(spanning, len(groups), member_name)
    nodes = max(len(h) for _, h in spanning)
    if backend == "trtllm":
        try:
            backend = resolve_backend(requested, platform=platform, num_nodes=nodes, env=env)
        except ValueError as e:  # an explicit 'trtllm' (argument or environment)
            raise ValueError(f"{where}: {e}") from None
        return BackendChoice(backend, tuple(g for g, _ in spanning),
                             f"{where}: {ONE_NODE_ONLY}")
    return BackendChoice(backend, tuple(g for g, _ in spanning))


STRICT_ENV_VAR = "JAX_FUSEDAR_STRICT"


def strict_mode(explicit: Optional[bool], env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether to raise instead of falling back to XLA: ``explicit`` (a real bool) wins, else
    $JAX_FUSEDAR_STRICT (``arguments.env_bool``: 1/true/yes/on or 0/false/no/off, anything
    else is an error naming the variable)."""
    if explicit is not None:
        return arguments.as_bool(f"strict (None: ${STRICT_ENV_VAR})", explicit)
    return arguments.env_bool(STRICT_ENV_VAR, env)
