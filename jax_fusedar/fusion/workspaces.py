"""The pass's workspaces, apart from its analysis.

``fuse`` runs in four steps (``transform.FusedFunction``): analyse the program, plan the
workspaces, allocate them, rewrite. This module is the middle two:

* ``Admission`` answers the analysis, allocating nothing: whether a matched site can be
  served (the given workspace's dtype, world size, size and device groups; ``max_tokens``;
  the site's mesh against fuse's), and what it needs (``Need``: dtype, hidden size, tokens,
  and the backend its workspace has or will have, which decides whether a rewrite would cost
  more than the original where no kernel serves it).
* ``plan_workspaces`` (a pure function) decides which workspace serves each need: the given
  one, one this transform made for an earlier trace, or a new one per dtype and hidden size,
  sized for every site that shares it (``Spec``).
* ``allocate`` creates the new ones, the one step with effects; a workspace that cannot be
  created leaves its sites unfused with the error as their reason (the analysis runs again
  with that refusal).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from ..common import sizing
from .report import Reject


@dataclasses.dataclass(eq=False)
class Need:
    """What one fused site needs of a workspace. ``backend`` and ``sizes`` stand for the
    workspace's until it is known (the site's own size: a workspace sized for several sites
    serves each). ``workspace``: the one serving it, once planned (given or earlier) or
    allocated."""

    match: object
    dtype: str
    hidden: int
    tokens: int
    backend: str
    sizes: sizing.WorkspaceSizes
    workspace: object = None

    @property
    def key(self) -> tuple:
        return (self.dtype, self.hidden)


@dataclasses.dataclass(frozen=True)
class Spec:
    """A workspace to create: over fuse's mesh axis, of this dtype and hidden size, for up to
    ``max_token_num`` tokens; it serves ``needs``."""

    dtype: str
    hidden: int
    max_token_num: int
    needs: tuple


def serving_problem(ws, need_dtype: str, tokens: int, hidden: int, world: int, mesh):
    """Why ``ws`` cannot serve a site, or None: its dtype, world size, size, and (where the
    site's shard_map mesh is known) the devices grouped along its axis (the fused op's own
    check, ops.checks.check_call_groups)."""
    if ws.dtype.name != need_dtype:
        return f"the workspace is for {ws.dtype.name}, the site is {need_dtype}"
    if ws.world_size != world:
        return (
            f"the workspace is for {ws.world_size} ranks over {ws.axis_name!r}, the site's "
            f"all-reduce over it has {world}"
        )
    if not ws.is_buffer_size_sufficient(tokens, hidden):
        return (
            f"tokens {tokens} x hidden {hidden} > workspace max "
            f"{ws.max_token_num} x {ws.hidden_dim}"
        )
    return _groups_problem(mesh, ws.axis_name, [g.members for g in ws.groups])


def _groups_problem(mesh, axis_name, groups) -> Optional[str]:
    from ..ops.checks import check_call_groups

    if mesh is None:
        return None
    try:
        check_call_groups(mesh, axis_name, groups)
    except ValueError as e:
        return str(e)
    return None


class Admission:
    """The analysis's questions about workspaces, answered without allocating anything.

    ``given``: the workspace passed to fuse (or None); ``existing``: the live ones this
    transform created for earlier traces; ``refused``: {(dtype, hidden): reason} of
    workspaces that could not be created (their sites stay unfused with that reason)."""

    def __init__(
        self,
        *,
        mesh,
        axis_name: str,
        given=None,
        existing=(),
        max_tokens: Optional[int] = None,
        backend: Optional[str] = "auto",
        allow_rounding_change: bool = False,
        refused: Optional[dict] = None,
    ):
        self.mesh = mesh
        self.axis_name = axis_name
        self.given = given
        self.existing = tuple(ws for ws in existing if not ws.destroyed)
        self.max_tokens = max_tokens
        self.backend = backend
        self.allow_rounding_change = allow_rounding_change
        self.refused = dict(refused or {})
        self._planned_backend = None
        self._groups = None

    def axis_size(self) -> int:
        return self.mesh.shape[self.axis_name]

    def need_for(self, m, world: int, site_mesh=None) -> Need:
        """What the matched site ``m`` needs, or raises Reject with why no workspace can
        serve it. ``world``: the size of the site's reduction axis; ``site_mesh``: the mesh
        of its shard_map (None under plain jit, where the partitioned entry picks the
        workspace of the mesh it runs on)."""
        if self.given is not None:
            problem = serving_problem(self.given, m.dtype, m.tokens, m.hidden, world, site_mesh)
            if problem:
                raise Reject(problem)
            return self._need(m, self.given)
        if self.max_tokens is not None and m.tokens > self.max_tokens:
            raise Reject(f"tokens {m.tokens} > max_tokens {self.max_tokens}")
        for ws in reversed(self.existing):
            if serving_problem(ws, m.dtype, m.tokens, m.hidden, world, site_mesh) is None:
                return self._need(m, ws)
        if self.axis_size() != world:
            raise Reject(
                f"the shard_map's axis {self.axis_name!r} has size {world}, the "
                f"mesh given to fuse has {self.axis_size()}"
            )
        why = self.refused.get((m.dtype, m.hidden))
        if why is not None:
            raise Reject(why)
        problem = _groups_problem(site_mesh, self.axis_name, self._mesh_groups())
        if problem:  # e.g. the site's mesh groups the axis otherwise than fuse's mesh
            raise Reject(problem)
        sizes = sizing.workspace_sizes(world, max(1, m.tokens), m.hidden, m.dtype)
        return Need(m, m.dtype, m.hidden, m.tokens, self._new_backend(), sizes)

    @staticmethod
    def _need(m, ws) -> Need:
        return Need(m, m.dtype, m.hidden, m.tokens, ws.backend, ws.sizes, workspace=ws)

    def _mesh_groups(self):
        if self._groups is None:
            from ..workspace import mesh_groups

            self._groups = [g.members for g in mesh_groups(self.mesh, self.axis_name)]
        return self._groups

    def _new_backend(self) -> str:
        """The backend a workspace created on fuse's mesh axis resolves to (the rule
        ``create_allreduce_fusion_workspace`` applies; decided once per trace)."""
        if self._planned_backend is None:
            from ..workspace import resolve_backend

            self._planned_backend = resolve_backend(self.mesh, self.axis_name, self.backend)
        return self._planned_backend


def plan_workspaces(needs, existing=()) -> list:
    """The workspaces to create for ``needs`` not yet served (``Spec``s, one per dtype and
    hidden size, in the order first needed): each for the most tokens any of its sites has
    (at least one: a 0-token site is served, a workspace holds a token), and never smaller
    than a live workspace of that dtype this transform already has (a later trace with more
    tokens then finds one that serves it). Pure."""
    groups: dict = {}
    for need in needs:
        if need.workspace is None:
            groups.setdefault(need.key, []).append(need)
    specs = []
    for (dtype, hidden), members in groups.items():
        grown = [
            ws.max_token_num * ws.hidden_dim // hidden
            for ws in existing
            if not ws.destroyed and ws.dtype.name == dtype
        ]
        tokens = max([1] + [n.tokens for n in members] + grown)
        specs.append(Spec(dtype, hidden, tokens, tuple(members)))
    return specs


def allocate(specs, create: Callable) -> dict:
    """Creates each spec's workspace with ``create(spec)`` and hands it to its needs.
    Returns {(dtype, hidden): reason} of those ``create`` refused (raising Reject): their
    sites must be analysed again as unfused."""
    refused = {}
    for spec in specs:
        try:
            ws = create(spec)
        except Reject as why:
            refused[(spec.dtype, spec.hidden)] = str(why)
            continue
        for need in spec.needs:
            need.workspace = ws
    return refused
