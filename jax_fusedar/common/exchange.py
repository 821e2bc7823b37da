"""Connecting the ranks of one TP group: framework-neutral (no JAX or torch import).

Members in this process reach each other through raw peer pointers (CUDA IPC cannot open a
handle in the process that exported it); members in other processes through CUDA IPC
handles passed over a ``Channel``: JAX's distributed key-value store, torch.distributed's
store, or an in-memory fake in tests. Keys come from ``exchange_key``: unique per
group (its ordered members) and per workspace, never from a random number generator.

Two phases, so that a process holding members of several groups never waits on a peer
that is itself waiting: every process first creates and publishes all its members of all
its groups (``create_and_publish``), then connects them (``connect_and_finalize``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Callable, Dict, Optional, Protocol, Sequence

from .limits import is_int
from .tp_groups import TPGroup


class Channel(Protocol):
    def publish(self, key: str, value: bytes) -> None: ...

    def fetch(self, key: str, who: str) -> bytes:
        """Blocks until ``key`` is published; raises TimeoutError naming ``who`` after the
        channel's timeout, so a missing member is an error, not a hang."""

    def barrier(self, key: str, processes: Sequence[int]) -> None: ...


@dataclasses.dataclass(frozen=True)
class Member:
    """One TP rank: the process that drives it and that process's CUDA device ordinal."""

    process: int
    device: int


@dataclasses.dataclass
class GroupPlan:
    group: TPGroup
    members: Sequence[Member]  # in TP-rank order
    # TP rank -> the native RankWorkspace (ext.Rank: one TP rank's workspace buffers on one
    # device) that this process created
    local: Dict[int, object]

    @property
    def processes(self):
        return sorted({m.process for m in self.members})


def exchange_key(namespace: str, group: TPGroup, workspace_serial: int, purpose: str) -> str:
    """Key under which a group exchanges data (IPC handles, barriers) for one workspace.

    Derived only from its arguments and the group's ordered members, so every process
    computes the same key without talking to the others, and two groups, two workspaces or
    two purposes never share a key. No random numbers: vLLM seeds ``random`` identically on
    every rank, so FlashInfer's random exchange ids collided across TP groups (docs/decisions.md).
    ``group.index`` is deliberately left out: the members identify the group.
    """
    if not isinstance(namespace, str) or not namespace:
        raise ValueError(f"namespace must be a non-empty string, got {namespace!r}")
    if not isinstance(purpose, str) or not purpose:
        raise ValueError(f"purpose must be a non-empty string, got {purpose!r}")
    if not is_int(workspace_serial) or workspace_serial < 0:
        raise ValueError(f"workspace_serial must be an int >= 0, got {workspace_serial!r}")
    identity = json.dumps([namespace, list(group.members), int(workspace_serial), purpose])
    digest = hashlib.sha256(identity.encode()).hexdigest()[:32]
    return f"{namespace}/{purpose}/ws{int(workspace_serial)}/tp{group.size}/{digest}"


def _key(namespace: str, plan: GroupPlan, serial: int, purpose: str) -> str:
    return exchange_key(namespace, plan.group, serial, purpose)


def create_and_publish(
    group: TPGroup,
    members: Sequence[Member],
    me: int,
    make_rank_workspace: Callable[[int, int], object],
    channel: Optional[Channel],
    *,
    namespace: str,
    serial: int,
) -> GroupPlan:
    """Creates this process's members of ``group`` (their rank workspaces,
    ``make_rank_workspace(device, tp_rank)``) and, if the group spans other processes,
    publishes their IPC handles."""
    if len(members) != group.size:
        raise ValueError(f"{len(members)} members given for a group of {group.size}")
    plan = GroupPlan(group, members, {})
    for tp_rank, m in enumerate(members):
        if m.process == me:
            plan.local[tp_rank] = make_rank_workspace(m.device, tp_rank)
    if plan.local and len(plan.processes) > 1:
        if channel is None:
            raise RuntimeError(
                "this TP group spans several processes but there is no "
                "channel to exchange workspace handles"
            )
        for tp_rank, rank_workspace in plan.local.items():
            channel.publish(
                _key(namespace, plan, serial, f"ipc/rank{tp_rank}"), rank_workspace.export_ipc()
            )
    return plan


def connect_and_finalize(
    plan: GroupPlan, me: int, channel: Optional[Channel], *, namespace: str, serial: int
) -> None:
    """Gives every local member all its peers' buffers, initialises it, and, across
    processes, waits until every member is initialised (no peer may launch earlier)."""
    for tp_rank, rank_workspace in plan.local.items():
        for peer, m in enumerate(plan.members):
            if peer == tp_rank:
                continue
            if m.process == me:
                rank_workspace.set_peer_pointers(peer, m.device, plan.local[peer].local_pointers())
            else:
                who = (
                    f"TP rank {peer} of group {plan.group.members} (process {m.process}, "
                    f"device {m.device})"
                )
                rank_workspace.open_peer_ipc(
                    peer, channel.fetch(_key(namespace, plan, serial, f"ipc/rank{peer}"), who)
                )
        rank_workspace.finalize()
    if plan.local and len(plan.processes) > 1:
        channel.barrier(_key(namespace, plan, serial, "ready"), plan.processes)
