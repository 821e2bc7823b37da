"""Tensor-parallel (TP) groups: which devices (JAX) or processes (torch) form each group, in
which rank order, and which hosts a group spans. Framework-neutral (never imports jax or
torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import numpy as np


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
        TPGroup(members=tuple(int(i) for i in row), index=index) for index, row in enumerate(rows)
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

    return (
        f"the mesh of this call groups the devices along {axis_name!r} as "
        f"[{show(call_groups)}] but the workspace was created for the groups "
        f"[{show(workspace_groups)}] "
        f"(device ids in TP-rank order); create the workspace from the mesh the call runs "
        f"under"
    )


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
        raise ValueError(f"no host known for member(s) {missing} of TP group {list(group.members)}")
    hosts: dict[str, list[int]] = {}
    for m in group.members:
        hosts.setdefault(str(host_of[m]), []).append(m)
    return {h: tuple(ms) for h, ms in hosts.items()}
