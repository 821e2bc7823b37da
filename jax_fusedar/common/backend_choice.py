"""Which all-reduce backend a workspace uses ("trtllm": the kernel, "xla": plain
collectives), and strict mode (raise instead of falling back). Framework-neutral (never
imports jax or torch)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from . import arguments
from .limits import positive_int
from .tp_groups import TPGroup, group_hosts

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


def requested_backend_name(
    requested: Optional[str], env: Optional[Mapping[str, str]] = None
) -> str:
    """``requested_backend``'s name, checked against ``BACKENDS`` (ValueError naming where
    it came from: the argument or $JAX_FUSEDAR_ALLREDUCE_BACKEND)."""
    name, source = requested_backend(requested, env)
    if name not in BACKENDS:
        raise ValueError(
            f"unknown all-reduce backend {name!r} (from the {source}); choose one of {BACKENDS}"
        )
    return name


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
    num_nodes = positive_int("num_nodes", num_nodes)
    name = requested_backend_name(requested, env)
    on_cuda = platform.lower() in _CUDA_PLATFORMS
    if name == "mnnvl":
        # FlashInfer's MNNVL backend binds memory to an NVLink multicast object
        # (cuMulticastCreate); jax_fusedar deliberately never creates one (docs/decisions.md).
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
    text = f"TP group {list(first.members)} ({member_name}s) spans {len(hosts)} nodes ({where})"
    if rest:
        shown = ", ".join(str(list(g.members)) for g, _ in rest[:3])
        text += (
            f", as do {len(rest)} more of the workspace's {n_groups} TP groups "
            f"({shown}{', ...' if len(rest) > 3 else ''})"
        )
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
        return BackendChoice(backend, tuple(g for g, _ in spanning), f"{where}: {ONE_NODE_ONLY}")
    return BackendChoice(backend, tuple(g for g, _ in spanning))


STRICT_ENV_VAR = "JAX_FUSEDAR_STRICT"


def strict_mode(explicit: Optional[bool], env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether to raise instead of falling back to XLA: ``explicit`` (a real bool) wins, else
    $JAX_FUSEDAR_STRICT (``arguments.env_bool``: 1/true/yes/on or 0/false/no/off, anything
    else is an error naming the variable)."""
    if explicit is not None:
        return arguments.as_bool(f"strict (None: ${STRICT_ENV_VAR})", explicit)
    return arguments.env_bool(STRICT_ENV_VAR, env)
