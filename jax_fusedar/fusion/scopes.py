"""Walking a program's scopes: which sites each jaxpr holds, what to emit and skip there, and
the plans of its sub-jaxprs (jit, shard_map, scan, while, cond, checkpoint, custom rules).

Calls in a site's way. A norm written in a call of its own (a jitted, checkpointed or
custom-rule norm function) is seen together with its all-reduce by splicing the call into
the scope, and so is a plain ``jax.jit`` call holding the all-reduce (a jitted per-linear
``shard_map``, a jitted psum helper). The scope is matched twice: once with every call near
a reduction spliced, to learn which calls a fusable site needs opened, then with only those
spliced. A ``jit`` or ``checkpoint`` call is opened when the site needs it (values
unchanged; the norm's remat policy no longer applies to it); a ``custom_jvp`` /
``custom_vjp`` call is never opened (its derivative rule would be lost): that site is
reported instead. Every other call keeps its boundary and rule, and is rewritten inside when
it holds sites of its own.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Any, Optional

from jax.extend import core as jcore

from ..ops.plan import fused_site_problem
from ..common import limits
from . import graph as G
from . import chain, jax_internals, matching, norm_proof, rotation
from . import report as R
from .matching import Scope
from .report import Reject

# Ops through which a value stays "near" a reduction (where a norm reading it may start).
_NEAR = (
    "add",
    "sub",
    "mul",
    "div",
    "neg",
    "square",
    "integer_pow",
    "pow",
    "rsqrt",
    "sqrt",
    "reduce_sum",
    "reduce_max",
    "abs",
    "max",
    "min",
    "clamp",
    "broadcast_in_dim",
    "reshape",
    "squeeze",
    "expand_dims",
    "all_gather",
    G.CAST,
) + G.NO_OPS
_REDUCTIONS = G.PSUMS + ("reduce_scatter",)
# A call near a start is spliced (opened into its caller) when it may hold part of a site:
# an op of the residual add or of the norm's statistic, or an output its inputs pass to
# through roundings, value-preserving ops, clips or multiplications (gamma's) alone. A call
# of activations (an MLP's jitted silu) or of a select (jnp.where's) holds no part: it stays
# a call, and the scope's two matching passes see the same program (one matching).
_SITE_OPS = frozenset(
    ("add", "add_any", "sub", "div", "square", "integer_pow", "pow", "rsqrt", "sqrt")
    + ("reduce_sum", "reduce_max", "all_gather")
    + _REDUCTIONS
)
_PASSING_OPS = frozenset(
    (G.CAST, "mul", "broadcast_in_dim", "reshape", "squeeze", "expand_dims")
    + ("max", "min", "clamp")  # an FP8 tail's clip (jnp.clip is a jitted call)
    + G.NO_OPS
)
# The eqns the matcher looks at (Analyzer._matches).
_MATCHED = frozenset(_REDUCTIONS + G.CUSTOM_RULE_CALLS + ("shard_map", "dot_general"))


@dataclasses.dataclass
class Plan:
    """What to change in one jaxpr: emitters by eqn index, eqns to drop, and plans for the
    sub-jaxprs of eqns (by eqn index -> {(param name, index): plan}). ``jaxpr`` is the
    jaxpr the indices refer to (the original with the calls that fused sites need spliced
    in: same inputs and outputs). ``context``: for shard_map bodies, (mesh, manual axes,
    check_vma). ``extra_out``: for a shard_map body that now also computes sites whose add
    and norm were outside it, the number of extra outputs it returns."""

    jaxpr: Any
    emit: dict
    skip: set
    children: dict
    context: Any = None
    extra_out: int = 0

    def empty(self) -> bool:
        return not self.emit and not self.children


def label(eqn) -> str:
    n = G.name(eqn)
    if n in ("jit", "pjit", "closed_call", "core_call") and eqn.params.get("name"):
        return f"jit({eqn.params['name']})"
    if n == "scan":
        return f"scan(length={eqn.params.get('length')})"
    if n == "remat2":
        return "checkpoint"
    return n


def subjaxprs(eqn):
    """(param name, index or None, jaxpr object) of every sub-jaxpr in the eqn's params."""
    out = []
    for k, v in eqn.params.items():
        if isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr)):
            out.append((k, None, v))
        elif (
            isinstance(v, (tuple, list))
            and v
            and all(isinstance(b, (jcore.Jaxpr, jcore.ClosedJaxpr)) for b in v)
        ):
            out.extend((k, j, b) for j, b in enumerate(v))
    return out


# --- splicing calls --------------------------------------------------------------------------


def _splice(eqn):
    """The eqns of a call-like eqn's jaxpr with its variables renamed into the caller's, each
    paired with the inner eqn it copies, or None when that is not a plain substitution
    (constants, pass-through outputs)."""
    sub = eqn.params.get(G.CALLS[G.name(eqn)])
    closed = isinstance(sub, jcore.ClosedJaxpr)
    inner = sub.jaxpr if closed else sub
    if (
        inner is None
        or (closed and sub.consts)
        or inner.constvars
        or len(inner.invars) != len(eqn.invars)
        or len(inner.outvars) != len(eqn.outvars)
        or eqn.params.get("num_consts", 0)
    ):
        return None
    subst = dict(zip(inner.invars, eqn.invars))
    defined = {v for e in inner.eqns for v in e.outvars}
    for iv, ov in zip(inner.outvars, eqn.outvars):
        if not isinstance(iv, jcore.Var) or iv in subst or iv not in defined:
            return None
        if not isinstance(ov, jcore.DropVar):
            if iv in subst.values():
                return None
            subst[iv] = ov
    out = []
    for e in inner.eqns:
        out.append(
            (
                e.replace(
                    invars=[subst.get(a, a) if isinstance(a, jcore.Var) else a for a in e.invars],
                    outvars=[subst.get(v, v) for v in e.outvars],
                ),
                e,
            )
        )
    return out


def _starts(g: G.Graph, manual: bool):
    """Vars a site's add and norm may start from: reduction outputs (manual scopes), and
    shard_map / matmul outputs (outside shard_map)."""
    out = []
    for e in g.eqns:
        if _is_start(e, manual):
            out.extend(e.outvars)
    return out


# Calls opened to reach a start inside them (a per-linear shard_map under its own jax.jit, a
# psum in a jitted helper): plain calls only, whose boundary carries no rule or policy.
_OPENED_FOR_STARTS = ("jit", "pjit", "closed_call", "core_call")
_BY_JAXPR: dict = {}  # (question, id(jaxpr)) -> (jaxpr, answer): each jaxpr read once


def _asked(question, jaxpr, answer):
    """``answer()``, the answer to ``question`` about ``jaxpr``, computed once per jaxpr
    (the entry holds the jaxpr, so its id is not reused while the entry lives)."""
    hit = _BY_JAXPR.get((question, id(jaxpr)))
    if hit is not None and hit[0] is jaxpr:
        return hit[1]
    found = answer()
    if len(_BY_JAXPR) > 8192:
        _BY_JAXPR.clear()
    _BY_JAXPR[(question, id(jaxpr))] = (jaxpr, found)
    return found


def _is_start(e, manual: bool) -> bool:
    n = G.name(e)
    if manual:
        return n in _REDUCTIONS or matching.custom_psum(e)
    return n in ("shard_map", "dot_general")


def _is_any_start(e) -> bool:
    """Whether a site can start from ``e`` in a scope of either kind."""
    return _is_start(e, True) or _is_start(e, False)


def _holds_start(eqn, manual: bool) -> bool:
    """Whether a plain call's jaxpr holds (in it, or in plain calls inside it) an eqn a site
    starts from; each jaxpr is read once per pass."""
    if G.name(eqn) not in _OPENED_FOR_STARTS:
        return False
    sub = G.open_jaxpr(eqn.params.get(G.CALLS[G.name(eqn)]))
    if sub is None:
        return False
    return _asked(
        ("start", manual),
        sub,
        lambda: any(_is_start(e, manual) or _holds_start(e, manual) for e in sub.eqns),
    )


def _holds_site_part(eqn) -> bool:
    """Whether a call's jaxpr may hold part of a site (``_SITE_OPS``, a start of either kind
    of scope, a call that may, or an output reached from the inputs by ``_PASSING_OPS``)."""
    sub = G.open_jaxpr(eqn.params.get(G.CALLS[G.name(eqn)]))
    if sub is None:
        return True  # not spliced anyway (_splice)

    def answer():
        passed = set(sub.invars)
        for e in sub.eqns:
            n = G.name(e)
            if n in _SITE_OPS or _is_any_start(e) or (n in G.CALLS and _holds_site_part(e)):
                return True
            if n in _PASSING_OPS and all(not G.is_var(a) or a in passed for a in e.invars):
                passed.update(e.outvars)
        return any(G.is_var(v) and v in passed for v in sub.outvars)

    return _asked("site part", sub, answer)


def _may_hold_site(jaxpr) -> bool:
    """Whether ``jaxpr``, or any jaxpr inside it, holds an eqn a site can start from in a
    scope of either kind (a reduction, a shard_map, a matmul): a scope without one has no
    site, rotation or near miss, and is not analysed (most of a model's scopes are small
    helper calls, e.g. jnp.where's)."""
    return _asked(
        "may hold a site",
        jaxpr,
        lambda: any(
            _is_any_start(e) or any(_may_hold_site(G.open_jaxpr(sub)) for _, _, sub in subjaxprs(e))
            for e in jaxpr.eqns
        ),
    )


def _near(g: G.Graph, starts) -> set:
    seen = set()
    todo = list(starts)
    while todo:
        v = todo.pop()
        if v in seen:
            continue
        seen.add(v)
        for u in g.users(v):
            e = g.eqns[u]
            if G.name(e) in _NEAR or G.name(e) in G.CALLS:
                todo.extend(e.outvars)
    return seen


def inline_view(jaxpr, manual: bool, wanted=None):
    """(jaxpr with calls spliced, its Graph, stable keys, origins). Calls receiving a value
    near a reduction (when they may hold part of a site), and plain calls holding a reduction
    (or, outside shard_map, a shard_map or a matmul), are spliced: all of them when ``wanted``
    is None, else those coming from a top-level call whose id is in ``wanted``; custom-psum
    calls (reductions themselves) never are. ``stable[id(eqn)]``: the id of the original eqn
    a spliced eqn copies (the same in every view); ``origin[id(eqn)]``: the id of the scope's
    own call it was spliced from."""
    stable, origin, alive = {}, {}, []
    for _ in range(8):  # nested calls: one level per round
        g = G.Graph(jaxpr)
        near = _near(g, _starts(g, manual))
        new, changed = [], False
        for e in g.eqns:
            o = origin.get(id(e), id(e))
            spliced = None
            if (
                G.name(e) in G.CALLS
                and not matching.custom_psum(e)
                and (
                    (any(G.is_var(a) and a in near for a in e.invars) and _holds_site_part(e))
                    or _holds_start(e, manual)
                )
                and (wanted is None or o in wanted)
            ):
                spliced = _splice(e)
            if spliced is None:
                new.append(e)
                continue
            changed = True
            alive.append(e)  # ids stay unique while the maps are built
            for copy, inner in spliced:
                new.append(copy)
                stable[id(copy)] = stable.get(id(inner), id(inner))
                origin[id(copy)] = o
        if not changed:
            return jaxpr, g, stable, origin
        jaxpr = jaxpr.replace(eqns=new)
    return jaxpr, G.Graph(jaxpr), stable, origin


# --- the analyzer ----------------------------------------------------------------------------


_MISSES_KEPT = 64  # near misses kept per analysis


def _followers(g: G.Graph, v, depth: int = 4) -> tuple:
    """The ops reading ``v`` and, while each value has one use, what reads theirs (at most
    ``depth``): e.g. ``("name", "sharding_constraint", "add", "convert_element_type")``."""
    out = []
    for _ in range(depth):
        us = g.users(v)
        if v in g.outs:
            out.append("(output)")
        if len(us) != 1:
            out.extend(G.name(g.eqns[u]) for u in us[:3])
            if len(us) > 3:
                out.append(f"+{len(us) - 3} more")
            break
        e = g.eqns[us[0]]
        out.append(G.name(e))
        if len(e.outvars) != 1:
            break
        v = e.outvars[0]
    return tuple(out)


def _emitter_inputs(m) -> set:
    """The vars of the scope the emitted call for ``m`` reads."""
    atoms = [m.residual, m.norm.gamma, m.norm.scale, m.norm.bias]
    if m.source is not None:
        atoms.append(m.source.x)
    if m.dot is not None:
        atoms.extend(m.dot.invars)
    return {a for a in atoms if G.is_var(a)}


@dataclasses.dataclass
class BodyRole:
    """A psum in a shard_map body whose add and norm are outside: fused by the outer scope
    (``match`` set, its extra inputs and outputs numbered by ``slot``) or reported with the
    outer scope's reason; or (``skip``) an eqn between that psum and the body's output, which
    the fused call replaces."""

    match: Any = None
    slot: int = 0
    reason: Optional[str] = None
    skip: bool = False


class Analyzer:
    """The analysis step of the pass: the plan of a program's rewrite (``plan``), its sites
    (``sites``, for the report) and what each fused site needs of a workspace (``needs``,
    workspaces.Need, in the order of the fused sites), asking ``admission``
    (workspaces.Admission) whether a site can be served; nothing is allocated."""

    def __init__(self, admission, axis_name: str):
        self.admission = admission
        self.axis = axis_name
        self.sites = []
        self.needs = []
        self.custom_rule_reasons = {}  # stable key of a source eqn -> reason
        # Stable key of a call body's reduction -> why its site, whose norm is in the next
        # call, is not joined with it (chain.find_chains): said instead of "no norm".
        self.stranded_reasons = {}
        # (stable key of a shard_map eqn, output) -> (reason, late): from either pass, as
        # the shard_map may be seen spliced in one and inside its call in the other
        self.boundary_failures = {}
        self.boundary_sites = {}  # (id of a scope's graph, shard_map eqn index) -> [Match]
        # (graph, eqn index, scope, reason or None): reductions and matmuls no site was
        # fused for, for the near misses of a report where nothing fused.
        self._missed = []
        self._site_norms = {}  # index in sites -> the fused site's norm output var

    # --- one scope ---------------------------------------------------------------------------
    def plan(self, jaxpr, scope: Scope, roles: Optional[dict] = None) -> Plan:
        roles = roles or {}
        if not roles and not _may_hold_site(jaxpr):
            return Plan(jaxpr=jaxpr, emit=defaultdict(list), skip=set(), children={})
        manual = scope.manual
        # Pass 1: every nearby call spliced, to find the calls fusable sites need opened.
        view, g, keys, origin = inline_view(jaxpr, manual)
        needed = set()
        found = {}  # stable key of a start -> its Match or Reject, on this view
        for i, m in self._matches(g, scope, roles, keys, found, dry=True):
            calls = {origin.get(id(g.eqns[j])) for j in m.skip | m.norm.eqns} - {None}
            custom = [
                c for c in calls if G.name(self._call_by_key(jaxpr, c)) in G.CUSTOM_RULE_CALLS
            ]
            if custom:
                what = G.name(self._call_by_key(jaxpr, custom[0])).replace("_call", "")
                self.custom_rule_reasons[keys.get(id(g.eqns[i]), id(g.eqns[i]))] = (
                    f"the RMSNorm is inside a {what} (fusing would drop its derivative "
                    "rule): move the norm out of it, or put the all-reduce and the add in it"
                )
            else:
                needed |= calls
        # Pass 2: only the calls fused sites need; the same view (and matches) when pass 1
        # spliced no other.
        if not set(origin.values()) <= needed:
            view, g, keys, _ = inline_view(jaxpr, manual, wanted=needed)
            found = {}
        plan = Plan(jaxpr=view, emit=defaultdict(list), skip=set(), children={})
        from . import rewriting

        for i, e in enumerate(g.eqns):  # psums whose add and norm the outer scope fused
            role = roles.get(keys.get(id(e), id(e)))
            if role is None or (role.match is None and not role.skip):
                continue
            plan.skip.add(i)
            if role.match is not None:
                # After the residual when the body computes it (the chain to the output,
                # skipped, has no other use: the sum may be written later).
                rb = role.match.residual_body
                at = max(i, g.defs[rb] + 1) if G.is_var(rb) and rb in g.defs else i
                plan.emit[at].append(rewriting.BodyEmit(role.match, role.slot))
        removable = set()
        read = set()  # vars the emitted calls read: never dropped
        boundary = defaultdict(list)  # shard_map eqn index -> [(k, match)]
        for i, m in self._matches(g, scope, roles, keys, found, dry=False):
            if isinstance(m, Reject):
                continue
            plan.skip |= m.skip
            removable |= m.norm.eqns
            read |= _emitter_inputs(m)
            if m.boundary is not None:
                boundary[m.boundary[0]].append(m)
            else:
                plan.emit[m.emit_at].append(self._emitter(m))
        self._drop_dead(g, plan, removable, read)
        allow = self.admission.allow_rounding_change
        for links in chain.find_chains(g, allow, self.stranded_reasons):
            self._plan_chain(links, g, scope, plan, read)
        # Sub-jaxprs.
        for j, e in enumerate(g.eqns):
            if j in plan.skip and j not in boundary:
                continue
            if G.name(e) == "scan" and self._plan_scan(e, j, g, scope, plan, read):
                continue
            # A custom-rule psum is a site itself (reported above): its body is that psum.
            if scope.manual and matching.custom_psum(e):
                continue
            subs = subjaxprs(e)
            if not subs:
                continue
            if j in boundary:
                at = max(m.emit_at for m in boundary[j])
                plan.emit[at].append(self._boundary_emitter(e, boundary[j], scope, g))
                continue
            child_scope, ctx = self._child_scope(e, scope)
            sub_roles = (
                self._roles_for(e, keys.get(id(e), id(e)), scope)
                if G.name(e) == "shard_map"
                else {}
            )
            sub_plans = {}
            for k, idx, sj in subs:
                p = self.plan(G.open_jaxpr(sj), child_scope, sub_roles)
                if ctx is not None:
                    p.context = ctx
                sub_plans[(k, idx)] = p
            if any(not p.empty() for p in sub_plans.values()):
                plan.children[j] = sub_plans
        return plan

    def _plan_scan(self, e, j, g, scope, plan, read) -> bool:
        """A scan whose body normalizes a carry that it adds to at its end: planned as
        written and rotated (fusion/rotation.py), keeping the rotation when more sites fuse
        in it. True when the scan was planned here."""
        rot = rotation.rotation_candidate(e, self.admission.allow_rounding_change)
        if rot is None:
            return False
        child, _ = self._child_scope(e, scope)
        n0, k0 = len(self.sites), len(self.needs)
        plain = self.plan(G.open_jaxpr(e.params["jaxpr"]), child)
        as_written, needs_as_written = self.sites[n0:], self.needs[k0:]
        del self.sites[n0:], self.needs[k0:]
        rotated = self.plan(rot.view, child)
        fused = sum(s.fused for s in self.sites[n0:])
        if fused <= sum(s.fused for s in as_written):
            del self.sites[n0:], self.needs[k0:]
            self.sites.extend(as_written)
            self.needs.extend(needs_as_written)
            if not plain.empty():
                plan.children[j] = {("jaxpr", None): plain}
            return True
        rot.final = rotation.final_norm(g, j, rot, self.admission.allow_rounding_change)
        self._note_rotated(n0, rot, e, child)
        plan.skip.add(j)
        plan.emit[j].append(rotation.RotatedScanEmit(e, rot, rotated))
        if rot.final is not None:
            plan.skip.add(g.defs[rot.final.out_var])
            self._drop_dead(g, plan, rot.final.eqns, read)
        return True

    def _plan_chain(self, links, g, scope, plan, read) -> None:
        """Checkpoint calls one after another (fusion/chain.py): rotated when more sites fuse
        than in the calls as written (then planned here), else left to the plain planning."""
        if any(link.i in plan.skip for link in links):
            return
        n0, k0 = len(self.sites), len(self.needs)
        for link in links:
            child, _ = self._child_scope(g.eqns[link.i], scope)
            link.plan = self.plan(chain.build_view(g, link), child)
        rotated = self.sites[n0:]
        # The fused sites across calls: their norm is a rotated call's new h output.
        tails = {
            n0 + k
            for k, s in enumerate(rotated)
            if s.fused and any(self._site_norms.get(n0 + k) is link.h_out for link in links)
        }
        # The calls as written hold the rotated bodies' sites but the tails (a body's last
        # add has no norm in it, the head norm reads the call's input): when every site of
        # the rotated bodies fused and a tail is among them, rotating fuses more, and the
        # calls are not planned as written to count theirs.
        if not (tails and all(s.fused for s in rotated)):
            needs, norms = self.needs[k0:], dict(self._site_norms)
            del self.sites[n0:], self.needs[k0:]
            for link in links:
                child, _ = self._child_scope(g.eqns[link.i], scope)
                self.plan(chain.call_body(g.eqns[link.i]), child)
            as_written = sum(s.fused for s in self.sites[n0:])
            del self.sites[n0:], self.needs[k0:]
            if sum(s.fused for s in rotated) <= as_written:
                return
            self.sites.extend(rotated)
            self.needs.extend(needs)
            self._site_norms = norms
        for k in tails:
            site = self.sites[k]
            note = "across checkpoint calls: the calls rotated, the original derivative kept"
            self.sites[k] = dataclasses.replace(
                site, note="; ".join(n for n in (site.note, note) if n)
            )
        h_var = {}
        for n, link in enumerate(links):
            nxt = links[n + 1].i if n + 1 < len(links) else None
            plan.skip.add(link.i)
            plan.emit[link.at].append(chain.ChainCallEmit(g, link, h_var, nxt))
            if link.final is not None:
                plan.skip.add(g.defs[link.final.out_var])
                self._drop_dead(g, plan, link.final.eqns, read)

    def _note_rotated(self, n0, rot, e, child):
        """The rotated site (its norm is the view's new carry out) says so; without a final
        norm after the loop its last iteration's norm is unused: it counts one run less."""
        h_out = rot.view.outvars[jax_internals.scan_layout(e)[1]]
        for k in range(n0, len(self.sites)):
            site = self.sites[k]
            if not site.fused or self._site_norms.get(k) is not h_out:
                continue
            if rot.final is not None:
                note = (
                    "across scan iterations: the loop rotated, the last iteration's norm "
                    "is the final norm after the loop"
                )
                runs = site.runs
            else:
                note = (
                    "across scan iterations: the loop rotated; the last iteration's sum "
                    "has no norm after the loop, its fused norm is unused"
                )
                length = int(e.params.get("length", 1))
                runs = None if site.runs is None else site.runs // length * (length - 1)
            self.sites[k] = dataclasses.replace(
                site, runs=runs, note="; ".join(n for n in (site.note, note) if n)
            )

    @staticmethod
    def _call_by_key(jaxpr, key):
        for e in jaxpr.eqns:
            if id(e) == key:
                return e
        return None

    def _child_scope(self, e, scope: Scope):
        where = f"{scope.where}/{label(e)}" if scope.where else label(e)
        runs = scope.runs
        if G.name(e) == "scan" and runs is not None:
            runs = runs * int(e.params.get("length", 1))
        elif G.name(e) == "while":
            runs = None
        if G.name(e) == "shard_map":
            mesh = e.params["mesh"]
            manual = e.params.get(
                "newly_manual_axes", e.params.get("manual_axes", frozenset(mesh.axis_names))
            )
            ctx = (mesh, frozenset(manual), e.params.get("check_vma", True))
            return Scope(where, dict(mesh.shape), ctx, runs, scope.saving_policy), ctx
        policy = scope.saving_policy
        if G.name(e) in ("remat2", "checkpoint"):
            p = e.params.get("policy")
            policy = None if p is None else getattr(p, "__name__", None) or repr(p)
        return Scope(where, scope.mesh_shape, scope.ctx, runs, policy), None

    # --- candidates ------------------------------------------------------------------------
    def _matches(self, g, scope: Scope, roles, keys, found: dict, dry: bool):
        """(eqn index, Match) of every fused site of the scope, in eqn order; sites left
        unfused are reported (when not ``dry``) and yield nothing. ``found``: the matcher's
        answers on ``g`` so far, by stable key (a scope's two passes may share them)."""
        taken = set()
        self.boundary_sites = {}
        manual = scope.manual
        for i, e in enumerate(g.eqns):
            n = G.name(e)
            if n not in _MATCHED:
                continue
            stable = keys.get(id(e), id(e))
            if manual and (n in _REDUCTIONS or matching.custom_psum(e)):
                role = roles.get(stable)
                if role is not None:
                    if not dry and role.reason is not None:
                        self._report_unfused(g, i, scope, role.reason, R.PSUM_IN_SHARD_MAP)
                    continue
                yield from self._try(
                    g,
                    i,
                    scope,
                    taken,
                    dry,
                    stable,
                    lambda: matching.match_reduction(
                        g, i, scope, self.axis, self.admission.allow_rounding_change
                    ),
                    found,
                )
            elif not manual and n == "shard_map":
                inner, _ = self._child_scope(e, scope)
                for k in range(len(e.outvars)):
                    if matching.body_psum(e, k) is None:
                        continue
                    yield from self._try(
                        g,
                        i,
                        scope,
                        taken,
                        dry,
                        (stable, k),
                        lambda k=k: matching.match_boundary(
                            g, i, k, scope, self.axis, self.admission.allow_rounding_change, inner
                        ),
                        found,
                        boundary=True,
                    )
            elif not manual and n in _REDUCTIONS:
                if not dry:
                    self._report_unfused(
                        g,
                        i,
                        scope,
                        "all-reduce outside shard_map (the fused op runs inside jax.shard_map)",
                        self._kind_of(e, scope),
                    )
            elif not manual and n == "dot_general":
                if ("candidate", stable) not in found:
                    found[("candidate", stable)] = matching.dot_candidate(g, i)
                if not found[("candidate", stable)]:
                    if not dry and len(self._missed) < _MISSES_KEPT:
                        self._missed.append((g, i, scope, None))
                    continue
                yield from self._try(
                    g,
                    i,
                    scope,
                    taken,
                    dry,
                    stable,
                    lambda: matching.match_plain_dot(
                        g, i, scope, self.admission.allow_rounding_change
                    ),
                    found,
                )

    def _try(self, g, i, scope, taken, dry, stable, match, found, boundary=False):
        m = None
        try:
            if stable not in found:
                try:
                    found[stable] = match()
                except Reject as why:
                    found[stable] = why
            m = found[stable]
            if isinstance(m, Reject):
                why, m = m, None
                raise why.with_traceback(None)
            if stable in self.custom_rule_reasons:
                raise Reject(self.custom_rule_reasons[stable])
            if not dry:
                self._admit(m, scope, taken, g)
        except Reject as why:
            reason = self.custom_rule_reasons.get(stable, str(why))
            if reason == norm_proof.NO_NORM_IN_SCOPE:
                reason = self.stranded_reasons.get(stable, reason)
            if boundary:
                # Reported by the body's analysis, with this reason (_roles_for), when it
                # came once the site was found (in the matcher after the add, or here).
                late = m is not None or getattr(why, "late", False)
                self.boundary_failures[stable] = (reason, late)
                return
            if not dry:
                kind = self._kind_of(g.eqns[i], scope)
                self._report_unfused(g, i, scope, reason, kind)
            return
        if not dry:
            taken |= m.skip
            self._admitted(m, g)
            self._report_fused(m, scope)
        yield i, m

    def _kind_of(self, e, scope):
        n = G.name(e)
        if n == "reduce_scatter":
            return R.REDUCE_SCATTER
        if n in G.CUSTOM_RULE_CALLS:
            return R.CUSTOM_RULE_PSUM
        if n == "dot_general":
            return R.PLAIN_JIT_MATMUL
        return R.PSUM

    def _roles_for(self, sm_eqn, key, scope):
        """Roles of the body psums whose sites the outer scope refused once it had found
        their residual add (a refusal before it says only that the output is not a site:
        the body's own analysis of the psum then gives the reason)."""
        roles = {}
        for k in range(len(sm_eqn.outvars)):
            got = self.boundary_failures.pop((key, k), None)
            found = matching.body_psum(sm_eqn, k)
            if got is None or found is None or not got[1]:
                continue
            body, _, pi, _ = found
            roles.setdefault(id(body.eqns[pi]), BodyRole(reason=got[0]))
        return roles

    # --- admission: kernel limits, overlaps, workspaces --------------------------------------
    def _world(self, m, scope: Scope, g):
        if m.boundary is not None:
            return dict(g.eqns[m.boundary[0]].params["mesh"].shape)[self.axis]
        if scope.manual:
            return scope.mesh_shape.get(self.axis)
        return self.admission.axis_size()

    def _admit(self, m, scope, taken, g):
        world = self._world(m, scope, g)
        problem = limits.kernel_support_problem(world, m.hidden, m.dtype)
        if problem is None and m.hidden % limits.vector_width(m.dtype):
            problem = f"hidden size {m.hidden} is not a multiple of 16 bytes"
        if problem:
            raise Reject(problem)
        overlap = m.skip & taken
        if m.boundary is not None:  # several outputs of one shard_map may each be a site
            overlap.discard(m.boundary[0])
            self._share_boundary(m, g)
        if overlap:
            raise Reject("overlaps another fused site")
        self._check_names(m, scope, g)
        m.world = world
        if m.boundary is not None:
            mesh = g.eqns[m.boundary[0]].params["mesh"]
        else:
            mesh = scope.ctx[0] if scope.manual else None
        need = self.admission.need_for(m, world, mesh)  # raises Reject when none can serve
        # Never costlier than the original: where no kernel serves the site, a rewrite that
        # adds collectives stays as written (ops.plan.fused_site_problem).
        costlier = fused_site_problem(
            need, m.tokens, m.hidden, m.dtype, adds_collectives=m.kind == R.REDUCE_SCATTER
        )
        if costlier:
            raise Reject(costlier)
        m.workspace = None  # the allocation step gives it (transform.FusedFunction)
        self.needs.append(need)

    @staticmethod
    def _check_names(m, scope, g):
        """A ``checkpoint_name`` on a value the fused call does not compute (the all-reduce's
        sum before the residual add) names nothing any more: inside a checkpoint whose policy
        may save named values, the site stays as written (what was saved stays saved)."""
        if scope.saving_policy is None:
            return
        written = matching.written_vars(m)
        for i in sorted(m.skip):
            e = g.eqns[i]
            if G.name(e) == G.CHECKPOINT_NAME and not set(e.outvars) & written:
                raise Reject(
                    f"checkpoint_name {e.params.get('name')!r} on the all-reduce's sum, which "
                    f"the fused op does not compute, inside a checkpoint whose policy "
                    f"({scope.saving_policy}) may save it: name the residual sum instead, or "
                    "use a policy that saves nothing inside the layer"
                )

    def _share_boundary(self, m, g):
        """A second site on the same shard_map: one rewritten shard_map serves both, at the
        later emission point, where nothing may read their results or the shard_map's
        outputs before it."""
        others = self.boundary_sites.get((id(g), m.boundary[0]), [])
        if others:
            sites = others + [m]
            at = max(s.emit_at for s in sites)
            skip = set().union(*(s.skip for s in sites))
            written = set(g.eqns[m.boundary[0]].outvars)
            for s in sites:
                written |= matching.written_vars(s)
            for v in written:
                if any(u < at and u not in skip for u in g.users(v)):
                    raise Reject(
                        "an output of the shard_map is used before the gamma of its other "
                        "fused all-reduce is computed"
                    )

    def _admitted(self, m, g):
        if m.boundary is not None:
            self.boundary_sites.setdefault((id(g), m.boundary[0]), []).append(m)

    # --- reporting ---------------------------------------------------------------------------
    def near_misses(self) -> list:
        """What stopped each reduction and matmul met from being a site, when no site fused
        (report.NearMiss); [] otherwise. Matmuls that are no candidate are matched once
        more here, for their reason."""
        if any(s.fused for s in self.sites):
            return []
        out = []
        for g, i, scope, reason in self._missed:
            e = g.eqns[i]
            if reason is None:
                try:
                    matching.match_plain_dot(g, i, scope, self.admission.allow_rounding_change)
                    reason = "its result is added to a residual, but no RMSNorm reads the sum"
                except Reject as why:
                    reason = str(why)
            out.append(
                R.NearMiss(
                    where=scope.where or "top level",
                    op=G.name(e),
                    shape=G.shape(e.outvars[0]) if e.outvars else (),
                    followed_by=_followers(g, e.outvars[0]) if e.outvars else (),
                    reason=reason,
                )
            )
        # Those followed by an add first: the likeliest sites.
        return sorted(out, key=lambda n: "add" not in n.followed_by)

    def _report_unfused(self, g, i, scope, reason, kind):
        if len(self._missed) < _MISSES_KEPT:
            self._missed.append((g, i, scope, reason))
        e = g.eqns[i]
        out = e.outvars[0] if e.outvars else None
        shp = G.shape(out) if out is not None else ()
        self.sites.append(
            R.Site(
                where=scope.where or "top level",
                fused=False,
                reason=reason,
                kind=kind,
                dtype=G.dtype(out) if out is not None else None,
                tokens=math.prod(shp[:-1]) if shp else None,
                hidden=shp[-1] if shp else None,
                runs=scope.runs,
            )
        )

    def _report_fused(self, m, scope):
        where = scope.where or "top level"
        if m.boundary is not None:
            where = f"{where}/shard_map"
        self._site_norms[len(self.sites)] = m.norm.out_var
        self.sites.append(
            R.Site(
                where=where,
                fused=True,
                reason=None,
                kind=m.kind,
                pattern=m.norm.pattern,
                tokens=m.tokens,
                hidden=m.hidden,
                dtype=m.dtype,
                rms_eps=m.norm.eps,
                rounding_change=m.rounding,
                weight_bias=m.norm.weight_bias,
                runs=scope.runs,
                note=m.norm.tail_note,
            )
        )

    # --- what is dropped -----------------------------------------------------------------------
    @staticmethod
    def _drop_dead(g, plan: Plan, removable: set, read: set):
        """Drops the proof's eqns whose results nothing live reads any more (the fused call
        computes them); the others stay and read the fused call's residual_out. A value a
        fused call reads (the next site's residual, through a sharding constraint, say) is
        live."""
        for i in sorted(removable - plan.skip, reverse=True):
            e = g.eqns[i]
            live = any(
                v in g.outs or v in read or any(u not in plan.skip for u in g.users(v))
                for v in e.outvars
            )
            if not live:
                plan.skip.add(i)

    # --- emitters ----------------------------------------------------------------------------
    @staticmethod
    def _emitter(m):
        from . import rewriting

        if m.kind == R.PLAIN_JIT_MATMUL:
            return rewriting.PlainJitEmit(m)
        if m.kind == R.REDUCE_SCATTER:
            return rewriting.SequenceParallelEmit(m)
        return rewriting.InScopeEmit(m)

    def _boundary_emitter(self, sm_eqn, matches, scope, g):
        from . import rewriting

        inner, ctx = self._child_scope(sm_eqn, scope)
        body = G.open_jaxpr(sm_eqn.params["jaxpr"])
        roles = {}
        for slot, m in enumerate(matches):
            _, _, pi, chain = matching.body_psum(sm_eqn, m.boundary[1])
            roles[id(body.eqns[pi])] = BodyRole(match=m, slot=slot)
            for c in chain:
                roles[id(body.eqns[c])] = BodyRole(skip=True)
        body_plan = self.plan(body, inner, roles)
        body_plan.context = ctx
        return rewriting.BoundaryEmit(sm_eqn, matches, body_plan)
