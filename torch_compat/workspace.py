"""FlashInfer-compatible workspace creation for torch: one workspace per TP process group.

``create_allreduce_fusion_workspace`` keeps the names and defaults of
``flashinfer.comm.create_allreduce_fusion_workspace`` but fixes by construction the DP+TP
bugs vLLM hit with it (docs/decisions.md):

1. the group is the TP ``ProcessGroup`` passed in (WORLD only when none is), and the
   exchange involves only its members;
2. ``world_size``/``rank`` are group-local and checked against ``dist.get_rank(group)``,
   so a global rank passed by mistake is an error, not a wrong peer;
3. the GPU is ``torch.cuda.current_device()``, never the TP rank;
4. exchange keys derive from the group's global ranks and a per-group serial
   (``exchange.exchange_key``), never from ``random`` (vLLM seeds it identically
   everywhere).

The handles travel through the c10d store (``channel.StoreChannel``), with a timeout, so a
member that never joins is a ``TimeoutError`` naming it. Memory and kernels are the shared
native core (``Rank`` of the extension ``jax_fusedar.common.native`` loads); no JAX is
imported.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from jax_fusedar.common import (
    arguments,
    backend_choice,
    exchange,
    join,
    lifecycle,
    limits,
    lost_traps,
    native,
    sizing,
    tp_groups,
)
from jax_fusedar.common import (
    handshake as handshake_options,
)
from jax_fusedar.common import plan as rules

from .channel import StoreChannel
from .tensors import concrete

log = logging.getLogger("torch_compat")

NAMESPACE = "torch_compat"

TORCH_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}

# One counter per group (its ordered global ranks): every member of a group creates the
# group's workspaces in the same order, so they agree on the serial even when a process
# also creates workspaces over other groups that its peers are not part of.
_serials: Dict[Tuple[int, ...], "itertools.count[int]"] = {}
_serial_lock = threading.Lock()


def _next_serial(global_ranks: Sequence[int]) -> int:
    with _serial_lock:
        return next(_serials.setdefault(tuple(global_ranks), itertools.count(1)))


def dtype_name(dtype) -> str:
    """The topology name of a supported torch dtype; ValueError otherwise."""
    try:
        return TORCH_DTYPES[dtype]
    except (KeyError, TypeError):
        raise ValueError(
            f"dtype must be torch.bfloat16, torch.float16 or torch.float32, got {dtype!r}"
        ) from None


class TorchAllReduceFusionWorkspace(lifecycle.WorkspaceLifecycle):
    """One TP rank's workspace (FlashInfer's ``TRTLLMAllReduceFusionWorkspace`` for torch).

    ``world_size``/``rank`` are the TP group's size and this process's rank in it,
    ``global_ranks`` the group's members in TP-rank order, ``device`` the CUDA ordinal the
    buffers live on. A call fits when ``num_tokens * hidden_dim <= max_token_num *
    hidden_dim`` (any hidden size, FlashInfer's element-count rule) and its dtype has the
    workspace's element width (bf16 and fp16 share a workspace, float32 needs its own).
    ``destroy()`` frees it (idempotent; every later use raises); it is also a context
    manager. All ranks must have finished their calls before any of them destroys.
    """

    backend = "trtllm"

    def __init__(
        self,
        *,
        native_rank,
        global_ranks: Sequence[int],
        rank: int,
        device: int,
        max_token_num: int,
        hidden_dim: int,
        dtype: torch.dtype,
        sizes: sizing.WorkspaceSizes,
        members: Sequence[exchange.Member] = (),
        handshake: bool = False,
        timeout_s: float = handshake_options.DEFAULT_TIMEOUT_S,
    ):
        self._rank_obj = native_rank
        self.global_ranks = tuple(int(g) for g in global_ranks)
        self.world_size = len(self.global_ranks)
        self.rank = int(rank)
        self.device = int(device)
        # Where inputs must live; a plain attribute so the CPU tests can point it elsewhere.
        self.torch_device = torch.device("cuda", self.device)
        self.max_token_num = int(max_token_num)
        self.hidden_dim = int(hidden_dim)
        self.dtype = dtype
        self.sizes = sizes
        self.members = tuple(members)
        self.handshake = bool(handshake)  # calls checked across ranks on the device
        self.timeout_s = float(timeout_s)  # bound on every wait inside the kernel (0: none)
        self._destroyed = False

    @property
    def metadata(self) -> Dict[str, Any]:
        """FlashInfer's workspace metadata (trtllm_ar.py, ``create_metadata=True``)."""
        self._check_alive()
        s = self.sizes
        return {
            "tp_rank": self.rank,
            "tp_size": self.world_size,
            "max_token_num": self.max_token_num,
            "hidden_dim": self.hidden_dim,
            "use_fp32_lamport": s.use_fp32_lamport,
            "buffer_size": s.two_shot_buffer_bytes,
            "flag_size": s.flag_bytes,
            "lamport_comm_size": s.lamport_comm_bytes,
            "lamport_buffer_size": s.lamport_buffer_bytes,
        }

    def native_rank(self):
        """The native ``Rank`` (raises once destroyed)."""
        self._check_alive()
        return self._rank_obj

    def fit_problem(
        self,
        tp_size: int,
        num_tokens: int,
        hidden_dim: int,
        dtype,
        use_oneshot: Optional[bool] = None,
    ) -> Optional[str]:
        """Why a call of this size cannot use the workspace, or None if it can: the one rule
        of both ``is_buffer_size_sufficient`` and the op (``ops.check_call``)."""
        self._check_alive()
        problems = []
        if tp_size != self.world_size:
            problems.append(
                f"tp_size {tp_size} does not match the workspace's TP size {self.world_size}"
            )
        if dtype not in TORCH_DTYPES:
            problems.append(f"dtype {dtype} is not supported (bf16, fp16, fp32)")
        else:
            # The op's own rule (common.plan), the same for every dense pattern; with
            # use_oneshot True/False also that this mode can run the call (FlashInfer's trtllm
            # workspace ignores use_oneshot).
            call = rules.Call(
                rules.DENSE_RULE,
                num_tokens,
                hidden_dim,
                TORCH_DTYPES[dtype],
                self.sizes,
                use_oneshot=use_oneshot,
            )
            problem = rules.kernel_problem(call)
            if problem is not None:
                problems.append(problem[1])
            elif use_oneshot is not None:
                try:
                    rules.plan_call(call)
                except ValueError as e:
                    problems.append(str(e))
        return "; ".join(problems) or None

    def is_buffer_size_sufficient(
        self,
        tp_size: int,
        num_tokens: int,
        hidden_dim: int,
        dtype: torch.dtype,
        use_oneshot: Optional[Any] = None,
    ) -> bool:
        """FlashInfer's check (``check_trtllm_allreduce_fusion_workspace_metadata``): same TP
        size, ``num_tokens * hidden_dim <= max_token_num * hidden_dim``, same element width;
        and what the kernel needs of the hidden size (whole 16-byte vectors, within the
        launch limit) and, when ``use_oneshot`` is True/False, that this mode can run the
        call: the op's own rule, ``common.plan``. It agrees with what ``allreduce_fusion``
        accepts: 0 tokens do not fit (the op refuses an empty input); a negative or non-int
        count, or a ``use_oneshot`` that is not a bool, is an error rather than an answer."""
        tp_size = arguments.as_int("tp_size", tp_size, minimum=1)
        num_tokens = arguments.as_int("num_tokens", num_tokens, minimum=0)
        hidden_dim = arguments.as_int("hidden_dim", hidden_dim, minimum=1)
        use_oneshot = arguments.as_bool("use_oneshot", use_oneshot, allow_none=True)
        problem = self.fit_problem(tp_size, num_tokens, hidden_dim, dtype, use_oneshot)
        if problem:
            log.warning("Workspace is insufficient for problem size. %s", problem)
        return problem is None

    def failure(self) -> str:
        """After a call failed with a CUDA error: what this rank recorded, naming the peer
        that did not arrive (a wait of the kernel that outlasted ``timeout_s``, or a failed
        handshake); readable after the trap killed the CUDA context; "" when
        nothing failed. Later calls on the workspace raise RuntimeError with this text."""
        return self.native_rank().failure()

    # The handshake and the bounded waits share one failure record.
    call_check_failure = failure  # its name in 0.1.0, kept

    def _release(self) -> None:
        rank, self._rank_obj = self._rank_obj, None
        rank.destroy()

    def _repr_fields(self):
        return [
            "backend='trtllm'",
            f"tp_rank={self.rank}",
            f"tp_size={self.world_size}",
            f"global_ranks={list(self.global_ranks)}",
            f"device=cuda:{self.device}",
            f"max_token_num={self.max_token_num}",
            f"hidden_dim={self.hidden_dim}",
            f"dtype={self.dtype}",
        ]


# --- argument checks ----------------------------------------------------------------------------

# torch_compat's own backends: JAX's list has "xla" (JAX's collectives), which does not exist
# here, so neither its messages nor its advice can be reused as they are.
TORCH_BACKENDS = ("auto", "trtllm")
_UNFUSED = "torch.distributed.all_reduce + an RMSNorm"


def resolve_backend(
    backend: Optional[str],
    group: Optional[tp_groups.TPGroup] = None,
    host_of: Optional[Dict[int, str]] = None,
) -> str:
    """The torch backend: "trtllm" (the kernel, one node), from ``backend`` or, for "auto"/None,
    $JAX_FUSEDAR_ALLREDUCE_BACKEND (backend_choice.requested_backend, the JAX precedence). With
    ``group`` and ``host_of`` (global rank -> host name) the group's own hosts are counted
    (tp_groups.group_hosts, JAX's rule): a group across nodes is refused, naming its ranks and
    hosts. Every refusal lists torch_compat's choices only."""
    name, source = backend_choice.requested_backend(backend)
    choices = f"torch_compat's backends: {', '.join(map(repr, TORCH_BACKENDS))}"
    if name == "xla":
        raise ValueError(
            f"all-reduce backend 'xla' (from the {source}) means JAX's "
            f"collectives and does not exist under torch; {choices} (for the "
            f"unfused path use {_UNFUSED})"
        )
    if name == "mnnvl":
        raise ValueError(
            f"the 'mnnvl' all-reduce backend (from the {source}) needs NVLink "
            f"multicast (cuMulticastCreate), which torch_compat never attempts; "
            f"use 'trtllm' (or 'auto') within one node, {_UNFUSED} across nodes"
        )
    if name not in TORCH_BACKENDS:
        raise ValueError(f"unknown all-reduce backend {name!r} (from the {source}); {choices}")
    if group is not None:
        hosts = tp_groups.group_hosts(group, host_of)
        if len(hosts) > 1:
            where = backend_choice.describe_spanning([(group, hosts)], 1, "global rank")
            raise ValueError(
                f"{where}: {backend_choice.ONE_NODE_ONLY}; use {_UNFUSED} across nodes"
            )
    return "trtllm"


def _group_membership(group, world_size, rank) -> Tuple[List[int], int]:
    """(the group's global ranks in TP-rank order, this process's TP rank), after checking
    that ``world_size``/``rank`` are the group-local ones (None: taken from the group)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call "
            "torch.distributed.init_process_group() (any backend; gloo is "
            "enough) before creating the workspace"
        )
    if group is None:
        group = dist.group.WORLD
    local_rank = dist.get_rank(group)
    if local_rank < 0:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of "
            f"the process group passed as group="
        )
    global_ranks = [int(g) for g in dist.get_process_group_ranks(group)]
    size = len(global_ranks)
    if world_size is not None and world_size != size:
        raise ValueError(
            f"world_size={world_size!r} but the TP group has {size} ranks (global ranks "
            f"{global_ranks}): world_size is the size of `group` (dist.get_world_size(group)), "
            f"not of WORLD; pass the TP ProcessGroup as group="
        )
    if rank is not None and rank != local_rank:
        raise ValueError(
            f"rank={rank!r} but this process is rank {local_rank} of the TP group (global "
            f"rank {dist.get_rank()}, group members {global_ranks}): `rank` is group-local "
            f"(dist.get_rank(group)), not the global rank nor a device index"
        )
    return global_ranks, local_rank


def _check_flashinfer_options(
    world_size, rank, max_token_num, hidden_dim, gpus_per_node, force_oneshot_support
):
    """FlashInfer's sizes and flags, typed as given (never coerced: ``world_size=2.0`` or
    ``force_oneshot_support="no"`` are refused), even the two only its MNNVL backend reads.
    Returns (world_size, rank) as ints, or None where not given."""
    if gpus_per_node is not None:
        arguments.as_int("gpus_per_node", gpus_per_node, minimum=1)
    limits.positive_int("max_token_num", max_token_num)  # before any rule on the group
    limits.positive_int("hidden_dim", hidden_dim)
    arguments.as_bool("force_oneshot_support", force_oneshot_support)
    return (
        None if world_size is None else arguments.as_int("world_size", world_size, minimum=1),
        None if rank is None else arguments.as_int("rank", rank, minimum=0),
    )


def _check_comm_backend(comm_backend, world_size: int, rank: int) -> None:
    """FlashInfer's ``comm_backend`` (e.g. ``TorchDistBackend(tp_group)``) is not needed: the
    exchange goes over ``group``'s c10d store. When one is given, it must describe the same
    group (vLLM's first DP+TP bug was a workspace built over WORLD)."""
    if comm_backend is None:
        return
    for what, mine, getter in (("size", world_size, "Get_size"), ("rank", rank, "Get_rank")):
        fn = getattr(comm_backend, getter, None)
        theirs = fn() if fn is not None else mine
        if theirs != mine:
            raise ValueError(
                f"comm_backend.{getter}() = {theirs} but `group` gives TP {what} {mine}: "
                f"comm_backend and group must describe the same TP group"
            )


def _current_cuda_device() -> int:
    if not torch.cuda.is_available():
        raise RuntimeError(
            "the fused all-reduce needs a CUDA GPU, but torch sees none "
            f"(torch {torch.__version__}, CUDA build: "
            f"{torch.version.cuda is not None})"
        )
    # The device this process drives (vLLM bug #3 used the TP rank as the device index).
    return torch.cuda.current_device()


# --- the exchange --------------------------------------------------------------------------------


def _join_group(
    *,
    global_ranks: Sequence[int],
    me: int,
    device: int,
    host: str,
    channel: StoreChannel,
    serial: int,
    backend: Optional[str],
    make_rank: Callable[[int, int], Any],
    handshake: bool = False,
):
    """Joins this process's member to its group by the shared protocol (``common/join.py``:
    publish, agree, create, connect); returns (native rank, members). Pure values in, so tests
    can drive it with threads, a HashStore and fake ranks. One member per process, so the
    process is the member's global rank."""
    group = tp_groups.TPGroup(tuple(global_ranks), 0)
    tp_rank = group.rank_of(me)
    joining = join.GroupJoin(group, group.members, {tp_rank: device})

    def accept(_, infos):
        # Same infos on every member, so every member accepts or refuses alike.
        resolve_backend(backend, group, {g: infos[g]["host"] for g in group.members})
        places = [
            (infos[g]["host"], infos[g]["devices"][str(r)]) for r, g in enumerate(group.members)
        ]
        if len(set(places)) < len(places):
            # Legal (ranks time-slice one GPU, as in tests), but in production it is usually
            # a device chosen from the TP rank instead of torch.cuda.set_device(local device).
            log.warning(
                "TP group %s: several ranks share a GPU (host, device): %s",
                list(group.members),
                places,
            )

    agreed = join.agree(
        [joining],
        me,
        channel,
        namespace=NAMESPACE,
        serial=serial,
        host=host,
        options={"handshake": bool(handshake)},
        accept=accept,
        name=lambda g, p: f"TP rank {g.rank_of(p)} (global rank {p})",
        name_waited=lambda g, p: (
            f"TP rank {g.rank_of(p)} of group {list(g.members)} (global rank {p})"
        ),
    )
    (plan,) = join.connect(
        agreed, me, channel, namespace=NAMESPACE, serial=serial, make_rank=make_rank
    )
    return plan.local[tp_rank], list(agreed[0].members)


def create_allreduce_fusion_workspace(
    backend: str = "auto",
    world_size: int = None,
    rank: int = None,
    max_token_num: int = None,
    hidden_dim: int = None,
    dtype: torch.dtype = None,
    gpus_per_node: int = None,
    comm_backend=None,
    force_oneshot_support: bool = False,
    group=None,
    *,
    timeout_s: float = 120.0,
    handshake: Optional[bool] = None,
    handshake_timeout_s: Optional[float] = None,
    kernel_timeout_s: Optional[float] = None,
    check_calls: Optional[bool] = None,
    check_timeout_s: Optional[float] = None,
) -> TorchAllReduceFusionWorkspace:
    """Creates this process's workspace of the TP group ``group``; collective over the group.

    FlashInfer's signature. ``group``: the TP ``ProcessGroup`` (None: WORLD).
    ``world_size``/``rank``: the group's size and this process's rank in it (group-local;
    None takes them from ``group``). The GPU is ``torch.cuda.current_device()``: call
    ``torch.cuda.set_device`` first. ``backend``: "auto" or "trtllm" (the kernel, one node),
    "mnnvl" is refused (it needs NVLink multicast), "xla" does not exist under torch;
    $JAX_FUSEDAR_ALLREDUCE_BACKEND decides for "auto". ``gpus_per_node`` and
    ``force_oneshot_support`` only matter to FlashInfer's MNNVL backend and are ignored;
    ``comm_backend`` is not used for the exchange (the group's c10d store is) but, when
    given, must agree with ``group``. ``timeout_s`` bounds each wait for the other members:
    a member that never joins raises ``TimeoutError`` naming it.

    ``handshake`` (None: ``$JAX_FUSEDAR_HANDSHAKE``, default off; not in FlashInfer): every
    call first checks on the device that all ranks make the same call (pattern, dtype, shape,
    one-shot choice); a mismatch, or a rank missing for ``handshake_timeout_s`` (None:
    ``$JAX_FUSEDAR_HANDSHAKE_TIMEOUT_S``, default 30 s), fails the stream with a CUDA error and a
    printed description instead of hanging (``ws.failure()`` reads it back). One
    extra tiny kernel per call; every member must pass the same setting. ``check_calls`` and
    ``check_timeout_s`` are their names until 0.1.0, still taken.

    ``kernel_timeout_s`` (None: ``$JAX_FUSEDAR_TIMEOUT_S``, default 30 s; 0 waits forever; not
    in FlashInfer, and named apart from ``timeout_s``, which FlashInfer's signature does not
    have either but which here bounds the creation exchange) bounds every wait inside the
    kernel, always: a rank that waits longer for a peer (one that never calls, died, or
    called with another shape) records which peer and traps, so the stream fails with a CUDA
    error instead of hanging, and every later call on the workspace raises RuntimeError with
    the recorded text (``ws.failure()`` reads it). Restart the process afterwards.
    """
    resolve_backend(backend)  # a bad name fails before anyone waits
    world_size, rank = _check_flashinfer_options(
        world_size, rank, max_token_num, hidden_dim, gpus_per_node, force_oneshot_support
    )
    timeout_s = arguments.as_float("timeout_s", timeout_s)
    earlier = handshake_options.earlier_name
    handshake = handshake_options.resolve_handshake(earlier(handshake, check_calls, "handshake"))
    handshake_timeout_s = handshake_options.resolve_handshake_timeout_s(
        earlier(handshake_timeout_s, check_timeout_s, "handshake_timeout_s")
    )
    kernel_timeout_s = handshake_options.resolve_timeout_s(
        kernel_timeout_s, name="kernel_timeout_s"
    )
    name = dtype_name(dtype)
    global_ranks, tp_rank = _group_membership(group, world_size, rank)
    _check_comm_backend(comm_backend, len(global_ranks), tp_rank)
    limits.check_kernel_supports(len(global_ranks), hidden_dim, name)
    sizes = sizing.workspace_sizes(len(global_ranks), max_token_num, hidden_dim, name)
    device = _current_cuda_device()
    ext = native.require()
    me = dist.get_rank()
    channel = StoreChannel(timeout_s=timeout_s, process=me)
    # Taken only after every local check passed, so a member that refused its arguments
    # does not leave the others' serials one ahead of its own.
    serial = _next_serial(global_ranks)

    created = []

    def make_rank(dev: int, r: int):
        created.append(
            ext.Rank(
                dev,
                sizes.world_size,
                r,
                sizes.max_token_num,
                sizes.hidden_dim,
                native.DTYPE_CODES[name],
                handshake=handshake,
                handshake_timeout_s=handshake_timeout_s,
                timeout_s=kernel_timeout_s,
            )
        )
        lost_traps.watch(created[-1], dev)  # a trap the driver never reports ends the process
        return created[-1]

    try:
        native_rank, members = _join_group(
            global_ranks=global_ranks,
            me=me,
            device=device,
            host=socket.gethostname(),
            channel=channel,
            serial=serial,
            backend=backend,
            make_rank=make_rank,
            handshake=handshake,
        )
    except BaseException:
        for r in created:  # owned from birth: a failed exchange frees what it allocated
            r.destroy()
        raise
    ws = TorchAllReduceFusionWorkspace(
        native_rank=native_rank,
        global_ranks=global_ranks,
        rank=tp_rank,
        device=device,
        max_token_num=sizes.max_token_num,
        hidden_dim=sizes.hidden_dim,
        dtype=dtype,
        sizes=sizes,
        members=members,
        handshake=handshake,
        timeout_s=kernel_timeout_s,
    )
    log.info("created %r", ws)
    return ws


# --- handles: the workspace as an int, for torch.library ops ------------------------------------
# A custom op cannot take a Python object; its graph carries this handle instead
# (torch_compat.library).

_registry: Dict[int, TorchAllReduceFusionWorkspace] = {}
_handles = itertools.count(1)
_registry_lock = threading.Lock()


def register_workspace(ws: TorchAllReduceFusionWorkspace) -> int:
    """Registers ``ws`` and returns its int handle (the same handle if already registered)."""
    if not isinstance(ws, TorchAllReduceFusionWorkspace):
        raise TypeError(f"expected a TorchAllReduceFusionWorkspace, got {type(ws).__name__}")
    with _registry_lock:
        for h, w in _registry.items():
            if w is ws:
                return h
        h = next(_handles)
        _registry[h] = ws
        return h


def _as_handle(handle) -> int:
    """A handle is an int (a SymInt while torch.compile traces with dynamic=True: its value,
    under a guard), never "1" or 1.9 coerced to one."""
    return arguments.as_int("workspace_handle", concrete(handle))


def lookup_workspace(handle: int) -> TorchAllReduceFusionWorkspace:
    """The workspace registered under ``handle``; KeyError if none, RuntimeError if it was
    destroyed since."""
    handle = _as_handle(handle)
    with _registry_lock:
        ws = _registry.get(handle)
    if ws is None:
        raise KeyError(
            f"no all-reduce fusion workspace is registered under handle {handle} "
            f"(torch_compat.library.register_workspace)"
        )
    if ws.destroyed:
        raise RuntimeError(f"workspace handle {handle} refers to a destroyed workspace: {ws!r}")
    return ws


def unregister_workspace(handle: int) -> None:
    """Drops ``handle`` from the registry (idempotent). Does not destroy the workspace."""
    handle = _as_handle(handle)
    with _registry_lock:
        _registry.pop(handle, None)
