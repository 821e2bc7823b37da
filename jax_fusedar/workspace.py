"""Workspaces for the fused all-reduce under JAX: one per TP group of a mesh axis.

``create_allreduce_fusion_workspace(mesh, "tp", ...)`` builds, for every TP group along
``"tp"`` (a ``("dp", "tp")`` mesh has one per dp index), the FlashInfer workspace of each
member: local members (devices this process drives) reach each other through peer access
and raw pointers; members in other processes (``jax.distributed``) through CUDA IPC
handles exchanged over JAX's distributed key-value store, under keys unique to the group
and the workspace. All groups are registered under one id, which the custom call carries;
each device's XLA handler then finds its own rank by device ordinal.

The id is a hash of the workspace's *key* (backend, the mesh axis's TP groups by device id,
max_token_num, hidden_dim, dtype and an optional user-given ``name``), not a creation
counter: a program exported (``jax.export``) in one process finds, in another, the workspace
created there with the same arguments, whatever else that process created before. Two live
kernel workspaces with one key in one process are refused (give them distinct names).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import socket
import threading
import weakref
from typing import TYPE_CHECKING, Optional

import numpy as np

if TYPE_CHECKING:  # annotations only: this module imports jax lazily
    from jax.typing import DTypeLike

from .common import (
    arguments,
    backend_choice,
    join,
    lifecycle,
    limits,
    lost_traps,
    native,
    sizing,
    tp_groups,
)
from .common import (
    handshake as handshake_options,
)

log = logging.getLogger("jax_fusedar")

NAMESPACE = "jax_fusedar"  # of the exchange keys (exchange.exchange_key)

_serials = itertools.count(1)  # per-process creation counter: the exchange keys' serial
_serial_lock = threading.Lock()
_by_id: "weakref.WeakValueDictionary[int, AllReduceFusionWorkspace]" = weakref.WeakValueDictionary()


def _dtype_name(dtype) -> str:
    # np.dtype(None) is float64: name the argument instead of a dtype nobody passed.
    try:
        name = None if dtype is None else np.dtype(dtype).name
    except TypeError:
        name = None
    if name not in native.DTYPE_CODES:
        raise ValueError(
            f"dtype must be bfloat16, float16 or float32 (e.g. jnp.bfloat16), got "
            f"{dtype!r}" + (f" ({name})" if name and name != str(dtype) else "")
        )
    return name


def _check_mesh(mesh) -> None:
    import jax

    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(
            f"mesh must be a jax.sharding.Mesh (e.g. jax.make_mesh((2, 4), "
            f"(\"dp\", \"tp\"))), got {type(mesh).__name__}"
        )


class AllReduceFusionWorkspace(lifecycle.WorkspaceLifecycle):
    """Workspace of every TP group along ``axis_name`` of ``mesh``; see the module docstring.

    ``backend`` is ``"trtllm"`` (FlashInfer's kernel) or ``"xla"`` (the reference path: XLA's
    psum + RMSNorm, used on CPU and when asked for). Use as a context manager or call
    ``destroy()``; calls traced after ``destroy()`` raise. ``handshake``: whether the
    kernel's calls are checked across ranks (``common.handshake.resolve_handshake``; trtllm
    only). ``timeout_s``: how long any wait inside the kernel may last
    (``common.handshake.resolve_timeout_s``; 0 waits forever).
    """

    def __init__(
        self,
        *,
        mesh,
        axis_name: str,
        max_token_num: int,
        hidden_dim: int,
        dtype,
        backend: str,
        workspace_id: int,
        groups,
        sizes: sizing.WorkspaceSizes,
        handshake: bool = False,
        handshake_timeout_s: float = handshake_options.DEFAULT_HANDSHAKE_TIMEOUT_S,
        timeout_s: float = handshake_options.DEFAULT_TIMEOUT_S,
        name: Optional[str] = None,
        serial: Optional[int] = None,
        key: str = "",
    ):
        self.mesh = mesh
        self.axis_name = axis_name
        self.max_token_num = int(max_token_num)
        self.hidden_dim = int(hidden_dim)
        self.dtype = np.dtype(dtype)
        self.backend = backend
        self.id = workspace_id  # workspace_key_id(key): what the custom call carries
        self.serial = workspace_id if serial is None else serial  # exchange keys only
        self.name = name
        self.key = key
        self.groups = groups
        self.sizes = sizes
        self.handshake = bool(handshake)
        self.handshake_timeout_s = float(handshake_timeout_s)
        self.timeout_s = float(timeout_s)
        # Whether an "xla" backend is what the user asked for (backend="xla" or
        # $JAX_FUSEDAR_ALLREDUCE_BACKEND=xla) or describes GPU processes (abstract_workspace),
        # rather than what "auto" fell back to for lack of GPUs: only the latter is refused
        # when lowered for cuda (export.check_reference_lowered_for_cuda).
        self.xla_requested = False
        self._ranks: list = []  # native Rank objects this process owns
        self._destroyed = False

    @property
    def world_size(self) -> int:
        return self.sizes.world_size

    def is_buffer_size_sufficient(self, num_tokens: int, hidden_dim: int, dtype=None) -> bool:
        """Whether ``allreduce_fusion`` serves a call of ``num_tokens x hidden_dim`` (of
        ``dtype``, default the workspace's) with this workspace: the workspace's own dtype
        (a call of another dtype is refused), a hidden size of whole 16-byte vectors, and
        FlashInfer's element-count rule. 0 tokens fit (such a call returns empty outputs);
        a negative or non-int count is an error, not an answer."""
        num_tokens = arguments.as_int("num_tokens", num_tokens, minimum=0)
        hidden_dim = arguments.as_int("hidden_dim", hidden_dim, minimum=1)
        if dtype is not None:
            try:
                name = np.dtype(dtype).name
            except TypeError:
                return False
            if name != self.dtype.name:
                return False
        if hidden_dim % limits.vector_width(self.dtype.name):
            return False
        return self.buffer_problem(num_tokens, hidden_dim) is None

    def failures(self) -> list:
        """After a call failed (the stream reported a CUDA error): what each of this
        process's ranks recorded, one message per failed rank, naming the peer that did not
        arrive: a wait of the kernel that outlasted ``timeout_s``, or a failed handshake
        handshake. Readable after the trap killed the CUDA context; empty when nothing
        failed (and on the xla backend)."""
        return [m for m in (r.failure() for r in self._ranks if r.alive) if m]

    # The handshake and the bounded waits share one failure record.
    call_check_failures = failures  # its name in 0.1.0, kept

    def set_timeout(self, timeout_s) -> None:
        """Changes ``timeout_s`` (validated as at creation; 0 waits forever) on every rank of
        this process, effective for the next kernel (the device copy is updated between
        programs; the compiled programs are unchanged). Other processes keep theirs."""
        value = handshake_options.resolve_timeout_s(timeout_s) if timeout_s is not None else None
        if value is None:
            raise TypeError("timeout_s must be a number of seconds, got None")
        for r in self._ranks:
            if r.alive:
                r.set_timeout(value)
        self.timeout_s = value

    @contextlib.contextmanager
    def explain_errors(self):
        """A context in which an error (XLA reports a trapped kernel as a generic CUDA error,
        e.g. "CUDA_ERROR_LAUNCH_FAILED: unspecified launch failure") is re-raised as
        RuntimeError with the recorded text, naming the peer that did not arrive, when a
        call on this workspace failed; other errors pass through unchanged::

            with ws.explain_errors():
                out = step(x).block_until_ready()
        """
        try:
            yield self
        except Exception as e:
            failed = self.failures()
            if failed:
                raise RuntimeError("; ".join(failed)) from e
            raise

    def raise_if_failed(self) -> None:
        """Raises RuntimeError with the recorded text if a call on this workspace timed out
        or failed the handshake. For use where the computation's own error only says that
        the CUDA stream failed (a trap is reported by XLA as a generic CUDA error)."""
        failed = self.failures()
        if failed:
            raise RuntimeError("; ".join(failed))

    def _release(self) -> None:
        errors = []
        for rank in self._ranks:
            try:
                rank.destroy()
            except Exception as e:  # keep freeing the others
                errors.append(str(e))
        self._ranks.clear()
        if errors:
            raise RuntimeError("destroying the workspace: " + "; ".join(errors))

    def _repr_fields(self):
        return [
            f"id={self.id}",
            f"backend={self.backend!r}",
            *([] if self.name is None else [f"name={self.name!r}"]),
            f"axis={self.axis_name!r}",
            f"world_size={self.world_size}",
            f"groups={len(self.groups)}",
            f"max_token_num={self.max_token_num}",
            f"hidden_dim={self.hidden_dim}",
            f"dtype={self.dtype.name}",
        ]


def _register_static() -> None:
    """A workspace is configuration, never data: registered as a static pytree node (no
    leaves; hashed and compared by identity, as objects are), so passing it to a jitted
    function as an argument works like closing over it instead of JAX trying to trace it."""
    import jax

    jax.tree_util.register_static(AllReduceFusionWorkspace)


_register_static()


def mesh_groups(mesh, axis_name):
    """The TP groups along ``axis_name`` of ``mesh`` (by device id), in rank order."""
    ids = np.vectorize(lambda d: d.id, otypes=[np.int64])(mesh.devices)
    return tp_groups.tp_groups_from_grid(ids, tuple(mesh.axis_names), axis_name)


_backend_reasons_logged: set = set()


def resolve_backend(
    mesh,
    axis_name: str,
    backend: Optional[str] = "auto",
    *,
    platform: Optional[str] = None,
    exchange_timeout_s: Optional[float] = None,
) -> str:
    """The backend ("trtllm" or "xla") a workspace over ``axis_name`` of ``mesh`` gets
    when created with ``backend``, without creating it: the rule of
    ``create_allreduce_fusion_workspace`` (``platform``: the mesh's devices' by default).
    Under ``jax.distributed`` it learns the processes' host names (once per process).

    Every TP group along the axis is counted on its own members' hosts
    (``backend_choice.resolve_backend_for_groups``). One backend for the whole workspace:
    one program runs on every rank, so the custom call is in it for all groups or for none.
    "auto" with a group across nodes takes XLA's collectives, and says why once."""
    if platform is None:
        platform = mesh.devices.flat[0].platform
    if exchange_timeout_s is None:
        exchange_timeout_s = _HOSTNAME_TIMEOUT_S
    groups = mesh_groups(mesh, axis_name)
    backend_choice.resolve_backend(backend, platform=platform)  # a bad name fails before any wait
    choice = backend_choice.resolve_backend_for_groups(
        backend,
        platform=platform,
        groups=groups,
        host_of=_device_hosts(mesh, exchange_timeout_s),
        member_name="device",
    )
    if choice.reason:
        message = (
            f"jax_fusedar: the workspace over axis {axis_name!r} uses XLA's "
            f"all-reduce (psum + RMSNorm) for all its {len(groups)} TP groups, "
            f"since one program runs on every rank: {choice.reason}"
        )
        if message not in _backend_reasons_logged:
            _backend_reasons_logged.add(message)
            log.warning("%s", message)
    return choice.backend


def workspace_key(
    backend: str, groups, max_token_num: int, hidden_dim: int, dtype_name: str, name: Optional[str]
) -> str:
    """The stable identity a compiled or exported program refers to its workspace by."""
    return json.dumps(
        {
            "backend": backend,
            "groups": [list(g.members) for g in groups],
            "max_token_num": int(max_token_num),
            "hidden_dim": int(hidden_dim),
            "dtype": dtype_name,
            "name": name,
        },
        sort_keys=True,
    )


def workspace_key_id(key: str) -> int:
    """The key's 63-bit hash: the custom call's ``workspace_id`` attribute."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1


def lookup(workspace_id: int) -> Optional[AllReduceFusionWorkspace]:
    """The live workspace object of this process with that id, if any."""
    return _by_id.get(int(workspace_id))


def _check_name(name) -> Optional[str]:
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"name must be None or a non-empty str, got {name!r}")
    return name


def _describe(
    mesh, axis_name, max_token_num, hidden_dim, dtype, backend, name=None
) -> AllReduceFusionWorkspace:
    """The workspace object, validated; nothing allocated yet. The limits are the kernel's
    on every backend: what runs on CPU runs fused on the GPU. Its stable id follows from
    the backend: pass None when the backend is decided from the groups afterwards
    (``_set_backend``)."""
    _check_mesh(mesh)
    name = _check_name(name)
    if not isinstance(axis_name, str) or axis_name not in mesh.axis_names:
        raise ValueError(
            f"axis {axis_name!r} is not an axis of the mesh "
            f"{tuple(mesh.axis_names)} (axis_name must be one of them)"
        )
    dtype_name = _dtype_name(dtype)
    world = int(mesh.shape[axis_name])
    limits.check_kernel_supports(world, hidden_dim, dtype_name)
    sizes = sizing.workspace_sizes(world, max_token_num, hidden_dim, dtype_name)
    groups = mesh_groups(mesh, axis_name)
    with _serial_lock:
        serial = next(_serials)
    ws = AllReduceFusionWorkspace(
        mesh=mesh,
        axis_name=axis_name,
        max_token_num=max_token_num,
        hidden_dim=hidden_dim,
        dtype=dtype_name,
        backend=None,
        workspace_id=None,
        groups=groups,
        sizes=sizes,
        name=name,
        serial=serial,
    )
    if backend is not None:
        _set_backend(ws, backend)
    return ws


def _set_backend(ws: AllReduceFusionWorkspace, backend: str) -> None:
    """Fixes the backend, and with it the stable key and id programs find ``ws`` by."""
    ws.backend = backend
    ws.key = workspace_key(
        backend, ws.groups, ws.max_token_num, ws.hidden_dim, ws.dtype.name, ws.name
    )
    ws.id = workspace_key_id(ws.key)


class WorkspaceKeyTaken(ValueError):
    """A live kernel workspace with the same stable key exists in this process (give the
    second one another ``name``)."""


def _claim_id(ws: AllReduceFusionWorkspace, allocates: bool) -> None:
    """Records ``ws`` under its id; a second live kernel workspace with the same key would
    take over the first one's registration in the XLA handler, so it is refused."""
    with _serial_lock:
        old = _by_id.get(ws.id)
        if allocates and old is not None and old._ranks and not old.destroyed:
            raise WorkspaceKeyTaken(
                f"a live workspace with the same key already exists in this process ({old!r}); "
                "programs find their workspace by (backend, mesh axis members, max_token_num, "
                "hidden_dim, dtype, name): pass a distinct name= to each, or destroy the "
                "first"
            )
        if old is None or not old._ranks or old.destroyed:
            _by_id[ws.id] = ws


def create_allreduce_fusion_workspace(
    mesh,
    axis_name: str,
    *,
    max_token_num: int,
    hidden_dim: int,
    dtype: DTypeLike,
    backend: Optional[str] = "auto",
    exchange_timeout_s: float = 120.0,
    handshake: Optional[bool] = None,
    handshake_timeout_s: Optional[float] = None,
    name: Optional[str] = None,
    timeout_s: Optional[float] = None,
    check_calls: Optional[bool] = None,
    check_timeout_s: Optional[float] = None,
) -> AllReduceFusionWorkspace:
    """Creates the workspaces of every TP group along ``axis_name`` of ``mesh``.

    ``max_token_num * hidden_dim`` elements of ``dtype`` is the largest call it serves
    (any hidden size, FlashInfer's rule). ``backend``: ``"auto"`` (FlashInfer's kernel on
    GPUs when every TP group lies within one node, however many nodes the mesh spans; the
    XLA reference elsewhere, e.g. when a TP group spans nodes, logged once), ``"trtllm"``
    (raises if a TP group spans nodes), ``"xla"`` or ``"mnnvl"`` (refused: it needs NVLink
    multicast); the ``JAX_FUSEDAR_ALLREDUCE_BACKEND`` environment variable decides when
    ``backend`` is ``"auto"`` or ``None``. Hosts are told apart by ``socket.gethostname()``,
    exchanged through ``jax.distributed``'s key-value store (within ``exchange_timeout_s``).

    ``handshake`` (None: ``$JAX_FUSEDAR_HANDSHAKE``, default off) makes every kernel call
    first check, on the device, that all ranks of the group make the same call (pattern,
    dtype, shape, one-shot choice): a mismatch, or a rank missing for ``handshake_timeout_s``
    (None: ``$JAX_FUSEDAR_HANDSHAKE_TIMEOUT_S``, default 30 s), fails the stream with a CUDA error
    and a printed description instead of hanging (``failures()`` reads it back).
    One extra tiny kernel per call; every process must pass the same setting.
    ``check_calls`` and ``check_timeout_s`` are their names until 0.1.0, still taken.

    ``timeout_s`` (None: ``$JAX_FUSEDAR_TIMEOUT_S``, default 30 s; 0 waits forever) bounds
    every wait inside the kernel, always, checked or not: a rank that waits longer than this
    for a peer (one that never calls, died, or called with another shape) records which peer
    it waited for and traps, so the computation fails with a CUDA error instead of hanging;
    ``ws.failures()`` (or ``ws.raise_if_failed()``) gives the recorded text, and later calls
    on the workspace are refused with it. The device's CUDA context is unusable afterwards:
    restart the process.

    ``name`` (optional) is part of the workspace's stable key, which compiled and exported
    programs find it by (module docstring): needed only to keep two otherwise identical
    kernel workspaces apart in one process, and then given alike when exporting
    (``abstract_workspace(..., name=)``) and when serving.
    """
    _check_mesh(mesh)
    earlier = handshake_options.earlier_name
    handshake = handshake_options.resolve_handshake(earlier(handshake, check_calls, "handshake"))
    handshake_timeout_s = handshake_options.resolve_handshake_timeout_s(
        earlier(handshake_timeout_s, check_timeout_s, "handshake_timeout_s")
    )
    exchange_timeout_s = arguments.as_float("exchange_timeout_s", exchange_timeout_s)
    if exchange_timeout_s <= 0:
        raise ValueError(f"exchange_timeout_s must be > 0 seconds, got {exchange_timeout_s}")
    timeout_s = handshake_options.resolve_timeout_s(timeout_s)

    ws = _describe(mesh, axis_name, max_token_num, hidden_dim, dtype, None, name)
    _set_backend(
        ws, resolve_backend(mesh, axis_name, backend, exchange_timeout_s=exchange_timeout_s)
    )
    resolved = ws.backend
    ws.xla_requested = backend_choice.requested_backend(backend)[0] == "xla"
    _claim_id(ws, allocates=resolved == "trtllm")
    ws.handshake = handshake and resolved == "trtllm"
    ws.handshake_timeout_s = handshake_timeout_s
    ws.timeout_s = timeout_s
    if resolved == "trtllm":
        try:
            _build_native(ws, exchange_timeout_s)
        except BaseException:
            ws.destroy()
            raise
    log.info("created %r", ws)
    return ws


def abstract_workspace(
    mesh,
    axis_name: str,
    *,
    max_token_num: int,
    hidden_dim: int,
    dtype: DTypeLike,
    backend: str = "trtllm",
    name: Optional[str] = None,
) -> AllReduceFusionWorkspace:
    """A workspace description that allocates nothing: for lowering or exporting a program
    for GPUs on a machine without them (``jit(f).trace(...).lower(lowering_platforms=("cuda",))``,
    ``jax_fusedar.export.export``). The program refers to the workspace by its stable key, so
    it runs wherever a workspace with the same arguments (``name`` included) was created with
    ``create_allreduce_fusion_workspace``; elsewhere the call fails with an FFI error naming
    the missing key.

    ``backend`` ("trtllm", "xla" or "auto") is decided as ``create_allreduce_fusion_workspace``
    would on CUDA GPUs with the mesh's hosts: under ``jax.distributed`` each process's host
    name counts, so "trtllm" raises and "auto" takes XLA's collectives for TP groups that
    span hosts. An "xla" workspace exports psum + RMSNorm for cuda, as asked."""
    if backend not in ("auto", "trtllm", "xla"):
        raise ValueError(f"backend must be 'auto', 'trtllm' or 'xla', not {backend!r}")
    ws = _describe(mesh, axis_name, max_token_num, hidden_dim, dtype, None, name)
    _set_backend(ws, resolve_backend(mesh, axis_name, backend, platform="cuda"))
    ws.xla_requested = True  # decided for GPUs: "xla" here is what cuda programs should run
    _claim_id(ws, allocates=False)
    return ws


# --- native construction ---------------------------------------------------------------------


class _KVChannel:
    """Exchange within a TP group over JAX's distributed key-value store (multi-process)."""

    def __init__(self, timeout_s: float):
        from jax._src import distributed

        self.client = distributed.global_state.client
        if self.client is None:
            raise RuntimeError(
                "several JAX processes but no distributed client: call "
                "jax.distributed.initialize() first"
            )
        self.timeout_ms = int(timeout_s * 1000)

    def publish(self, key: str, value: bytes) -> None:
        self.client.key_value_set_bytes(key, value)

    def fetch(self, key: str, who: str) -> bytes:
        try:
            return self.client.blocking_key_value_get_bytes(key, self.timeout_ms)
        except Exception as e:  # the store raises on timeout: name who is missing
            raise TimeoutError(
                f"jax_fusedar: {who} did not publish its workspace handles "
                f"within {self.timeout_ms / 1000:.0f} s (key {key}): {e}"
            ) from e

    def barrier(self, key: str, process_ids) -> None:
        try:
            self.client.wait_at_barrier(key, self.timeout_ms, process_ids=sorted(process_ids))
        except TypeError:  # older jaxlib: barrier over all processes
            self.client.wait_at_barrier(key, self.timeout_ms)


_HOSTNAME_TIMEOUT_S = 120.0
_hostnames: dict = {}  # process index -> its host's name, learnt once per process


def _device_hosts(mesh, timeout_s: float) -> dict:
    """Device id -> the name of its process's host, for every device of ``mesh``. Under
    ``jax.distributed`` every process publishes ``socket.gethostname()`` once (keys in the
    store are write-once) and reads those of the mesh's other processes."""
    import jax

    devices = list(mesh.devices.flat)
    if jax.process_count() == 1:
        return {d.id: socket.gethostname() for d in devices}
    me = jax.process_index()
    missing = sorted({d.process_index for d in devices} - set(_hostnames) - {me})
    if me not in _hostnames or missing:
        chan = _KVChannel(timeout_s)
        if me not in _hostnames:
            chan.publish(f"jax_fusedar/hostname/{me}", socket.gethostname().encode())
            _hostnames[me] = socket.gethostname()
        for p in missing:
            _hostnames[p] = chan.fetch(
                f"jax_fusedar/hostname/{p}", f"process {p} (its host name)"
            ).decode()
    return {d.id: _hostnames[d.process_index] for d in devices}


def _build_native(ws: AllReduceFusionWorkspace, timeout_s: float) -> None:
    import jax

    ext = native.require()
    code = native.DTYPE_CODES[ws.dtype.name]
    me = jax.process_index()
    by_id = {d.id: d for d in ws.mesh.devices.flat}
    for d in by_id.values():
        if d.platform != "gpu":
            raise ValueError(f"the trtllm backend needs CUDA GPUs; {d} is {d.platform}")

    def make_rank(device: int, tp_rank: int):
        r = ext.Rank(
            device,
            ws.world_size,
            tp_rank,
            ws.max_token_num,
            ws.hidden_dim,
            code,
            handshake=ws.handshake,
            handshake_timeout_s=ws.handshake_timeout_s,
            timeout_s=ws.timeout_s,
        )
        ws._ranks.append(r)  # owned from birth, so a failure later still frees it
        lost_traps.watch(r, device)  # a trap the driver never reports ends the process
        return r

    # The GPU is the device's own CUDA ordinal (local_hardware_id), never the TP rank.
    joins = [
        join.GroupJoin(
            g,
            tuple(by_id[m].process_index for m in g.members),
            {
                r: by_id[m].local_hardware_id
                for r, m in enumerate(g.members)
                if by_id[m].process_index == me
            },
        )
        for g in ws.groups
    ]
    joins = [j for j in joins if j.my_devices]
    chan = _KVChannel(timeout_s) if any(j.spans_processes for j in joins) else None
    agreed = join_processes(joins, me, chan, serial=ws.serial, handshake=ws.handshake)
    plans = join.connect(
        agreed, me, chan, namespace=NAMESPACE, serial=ws.serial, make_rank=make_rank
    )
    for plan in plans:
        for tp_rank, rank in plan.local.items():
            ext.register_rank(ws.id, plan.members[tp_rank].device, rank)


def join_processes(joins, me: int, chan, *, serial: int, handshake: bool):
    """Steps 1-2 of the shared join protocol (common/join.py) for this process's groups:
    publish and agree, before anything is allocated (ValueError naming who differs, on
    every process alike)."""
    return join.agree(
        joins,
        me,
        chan,
        namespace=NAMESPACE,
        serial=serial,
        host=socket.gethostname(),
        options={"handshake": bool(handshake)},
        name=lambda g, p: f"process {p}",
        name_waited=lambda g, p: f"process {p} (TP group {list(g.members)})",
        what="processes",
    )
