"""Site matching: a reduction (``psum``, ``psum_scatter``, a ``custom_vjp`` around a psum, a
``shard_map`` whose output is a psum, or under plain jit a ``dot_general``), the residual add
after it, and the proven RMSNorm (norm_proof.py) of the sum, checked on probes
(validation.py). Each function returns a :class:`Match` or raises Reject with the reason."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import numpy as np
from jax.sharding import PartitionSpec as P

from . import graph as G
from . import norm_proof, validation
from . import report as R
from .jax_internals import CustomVJPParts, MissingJaxInternal, shard_map_body_context
from .report import Reject


@dataclasses.dataclass
class Scope:
    """Where a jaxpr sits: its path of wrappers, the mesh axes it is manual over (None
    outside shard_map), the enclosing shard_map's (mesh, manual axes, check_vma), and how
    many times it runs per call (None inside a while loop)."""

    where: str
    mesh_shape: Optional[dict]
    ctx: Any
    runs: Optional[int]

    @property
    def manual(self) -> bool:
        return self.mesh_shape is not None


@dataclasses.dataclass
class Source:
    """Where the summed value comes from."""

    kind: str
    eqns: set  # eqns the fused op replaces
    out: Any  # the sum the residual is added to (dtype T)
    x: Any  # the local partial sum
    axis: str  # the mesh axis reduced over
    size_one_axes: tuple = ()  # other axes of the reduction, all of size 1
    rounding_change: Optional[str] = None
    custom_vjp: Any = None  # (CustomVJPParts) a custom_vjp's backward to keep
    scatter_dim: Optional[int] = None  # psum_scatter's token dimension


@dataclasses.dataclass
class Match:
    """A site the pass can fuse (kernel support and workspaces are checked afterwards)."""

    kind: str
    source: Optional[Source]
    residual: Any
    r: Any  # the residual sum: becomes residual_out
    norm: norm_proof.NormProof
    dtype: str
    hidden: int
    tokens: int
    skip: set  # eqns the emitted call replaces
    emit_at: int = 0
    rounding_change: Optional[str] = None
    # sequence parallelism: the residual's shard var and the gathered sum's var
    r_full: Any = None
    gather_norm: Any = None  # SP with the norm on the shard: the gathered norm var
    # plain jit: the matmul
    dot: Any = None
    # shard_map boundary: (shard_map eqn index, output index, reduction's index in the body),
    # the body's output that carried the sum (it becomes residual_out), and the body's own
    # var of the residual when the same shard_map returns it
    boundary: Optional[tuple] = None
    body_out: Any = None
    residual_body: Any = None
    workspace: Any = None
    world: Optional[int] = None

    @property
    def rounding(self) -> Optional[str]:
        parts = [c for c in (self.rounding_change, self.norm.rounding_change) if c]
        return "; ".join(parts) or None


# --- reductions -----------------------------------------------------------------------------


def _axes_problem(axes, axis, mesh_shape):
    """(size-1 axes to drop, None) or (None, reason) for a reduction over ``axes``."""
    if any(not isinstance(a, str) for a in axes):
        return None, f"all-reduce over positional axes {axes}"
    if axis not in axes:
        return None, f"all-reduce over {axes}, not the fused axis {axis!r}"
    others = tuple(a for a in axes if a != axis)
    big = [a for a in others if mesh_shape.get(a, 0) != 1]
    if big:
        return None, (
            f"all-reduce over {axes}: the fused op reduces over one mesh axis "
            f"({axis!r}) and {big} have size > 1"
        )
    return others, None


def _single_psum_body(call_eqn):
    """The psum eqn of a custom-rule call whose body is one psum of its one input (through
    value-preserving ops), or None."""
    sub = G.open_jaxpr(call_eqn.params["call_jaxpr"])
    consts = getattr(call_eqn.params["call_jaxpr"], "consts", ())
    if (
        consts
        or len(sub.invars) != 1
        or len(sub.outvars) != 1
        or call_eqn.params.get("num_consts", 0)
    ):
        return None
    core = [e for e in sub.eqns if G.name(e) not in G.NO_OPS]
    if len(core) != 1 or G.name(core[0]) not in G.PSUMS:
        return None
    return core[0]


def custom_psum(eqn) -> bool:
    return G.name(eqn) in G.CUSTOM_RULE_CALLS and _single_psum_body(eqn) is not None


def _check_jvp_rule(call_eqn, ps, scope):
    """A custom_jvp around a psum is fused when its rule's tangent is that psum's own."""
    fun = call_eqn.params.get("jvp_jaxpr_fun")
    if fun is None:
        raise Reject("psum inside a custom_jvp whose rule cannot be read")
    try:
        with shard_map_body_context(*scope.ctx):
            jaxpr, _, _ = fun.call_wrapped(False)
    except MissingJaxInternal:
        raise
    except Exception as e:  # noqa: BLE001 - a rule that cannot be traced alone
        raise Reject(f"psum inside a custom_jvp whose rule cannot be traced alone ({e})")
    jaxpr = G.open_jaxpr(jaxpr)
    tangent_in = jaxpr.invars[-1]
    tangent_out = jaxpr.outvars[-1]
    g = G.Graph(jaxpr)
    v = tangent_out
    while True:
        i, e = g.eqn(v)
        if e is None:
            break
        if G.name(e) in G.NO_OPS:
            v = e.invars[0]
            continue
        if G.name(e) in G.PSUMS and tuple(e.params["axes"]) == tuple(ps.params["axes"]):
            w = e.invars[0]
            while True:
                j, f = g.eqn(w)
                if f is None or G.name(f) not in G.NO_OPS:
                    break
                w = f.invars[0]
            if w is tangent_in:
                return
        break
    raise Reject(
        "psum inside a custom_jvp whose tangent rule is not the psum of the tangent "
        "(fusing would change the derivative)"
    )


def _custom_vjp_parts(call_eqn, scope):
    try:
        parts = CustomVJPParts(call_eqn)
        with shard_map_body_context(*scope.ctx):
            n_res = parts.num_residuals()
    except MissingJaxInternal:
        raise
    except Exception as e:  # noqa: BLE001
        raise Reject(f"psum inside a custom_vjp whose forward rule cannot be traced alone ({e})")
    if n_res:
        raise Reject(
            "psum inside a custom_vjp whose forward rule saves residuals (the fused "
            "op keeps only its backward rule when it needs none)"
        )
    return parts


def reduction_source(g: G.Graph, i: int, scope: Scope, axis: str) -> Source:
    e = g.eqns[i]
    n = G.name(e)
    kind = R.PSUM
    parts = None
    if n in G.CUSTOM_RULE_CALLS:
        ps = _single_psum_body(e)
        kind = R.CUSTOM_RULE_PSUM
        if n == "custom_jvp_call":
            _check_jvp_rule(e, ps, scope)
        else:
            parts = _custom_vjp_parts(e, scope)
        axes = tuple(ps.params["axes"])
        groups = ps.params.get("axis_index_groups")
    elif n == "reduce_scatter":
        kind = R.REDUCE_SCATTER
        axes = tuple(e.params["axis_name"])
        groups = e.params.get("axis_index_groups")
    else:
        axes = tuple(e.params.get("axes", ()))
        groups = e.params.get("axis_index_groups")
    if groups is not None:
        raise Reject("all-reduce over axis_index_groups")
    drop, problem = _axes_problem(axes, axis, scope.mesh_shape)
    if problem:
        raise Reject(problem)
    if len(e.invars) != 1 or not G.is_var(e.invars[0]) or len(e.outvars) != 1:
        raise Reject("all-reduce of several operands")
    src = Source(
        kind=kind,
        eqns={i},
        out=e.outvars[0],
        x=e.invars[0],
        axis=axis,
        size_one_axes=drop,
        custom_vjp=parts,
    )
    if kind == R.REDUCE_SCATTER:
        if not e.params.get("tiled", False):
            raise Reject("psum_scatter without tiled=True")
        src.scatter_dim = int(e.params["scatter_dimension"])
    return src


def _sum_cast_down(src: Source, to: str, allow: bool) -> None:
    """An all-reduce in float32 cast to ``to`` before the residual add: the fused op sums
    ``to`` partials (each rank's float32 partial rounded first), a declared rounding change
    wherever the cast sits (in the scope, or on either side of a shard_map's boundary)."""
    if src.kind == R.REDUCE_SCATTER:
        raise Reject(f"psum_scatter in float32, cast to {to} before the add")
    changes = []
    norm_proof.RoundingChange(
        f"all-reduce in float32, cast to {to} before the residual add: the fused op sums "
        f"{to} partials (pass allow_rounding_change=True to fuse it)",
        f"each rank's float32 partial sum rounded to {to} before the sum",
    ).declare(allow, changes)
    src.rounding_change = changes[0]


def _f32_cast_user(g: G.Graph, d):
    """The eqn index casting the float32 sum ``d`` (its only use) to a 16-bit dtype, or
    None."""
    if G.dtype(d) != "float32":
        return None
    u = g.only_user(d)
    if u is None or G.name(g.eqns[u]) != G.CAST:
        return None
    if np.dtype(g.eqns[u].params["new_dtype"]).name not in ("bfloat16", "float16"):
        return None
    return u


def _after_cast(g: G.Graph, src: Source, allow: bool) -> None:
    """(e): an all-reduce in float32 cast to a 16-bit dtype before the add; the fused op
    sums the partials in that dtype (each rank's partial rounded first)."""
    d = src.out
    if G.dtype(d) != "float32":
        return
    u = g.only_user(d)
    if u is None or G.name(g.eqns[u]) != G.CAST:
        xi, xe = g.eqn(src.x)
        if (
            xe is not None
            and G.name(xe) == G.CAST
            and G.dtype(xe.invars[0]) in ("bfloat16", "float16")
        ):
            t = G.dtype(xe.invars[0])
            raise Reject(
                f"all-reduce in float32 of {t} values (the kernel rounds the sum to "
                f"{t} before the residual add)"
            )
        return
    if _f32_cast_user(g, d) is None:
        return
    _sum_cast_down(src, G.dtype(g.eqns[u].outvars[0]), allow)
    src.eqns.add(u)
    src.out = g.eqns[u].outvars[0]


def _through_no_ops(g: G.Graph, d):
    """(var, eqn indices): ``d`` followed through value-preserving eqns that are its only
    use (the ``pvary`` JAX puts before adding a varying residual under check_vma, a copy)."""
    via = []
    while True:
        u = g.only_user(d)
        if u is None or G.name(g.eqns[u]) not in G.NO_OPS or len(g.eqns[u].invars) != 1:
            return d, via
        via.append(u)
        d = g.eqns[u].outvars[0]


def _not_followed_by_add(g: G.Graph, d) -> str:
    """The reason for an all-reduce whose sum is not (only) added to a residual."""
    d, _ = _through_no_ops(g, d)
    us = g.users(d)
    if not us and d not in g.outs:
        return "the all-reduce's result is unused"
    if len(us) == 1 and d not in g.outs:
        try:
            proof = norm_proof.prove_rms_norm(g, d, True)
        except Reject:
            proof = None
        if proof is not None:
            after = [G.name(g.eqns[u]) for u in g.users(proof.out_var)]
            if "add" in after:
                return (
                    "sandwich norm: the all-reduce's output is normalized before the "
                    "residual add (the fused op normalizes after it; correctly not fused)"
                )
            return "post-norm: the all-reduce's output is normalized with no residual add first"
    if any(G.name(g.eqns[u]) == "add" for u in us):
        return "the all-reduce's result has other uses besides the residual add"
    return "the all-reduce is not followed by a residual add"


def _residual_add(g: G.Graph, d):
    """(add eqn index, residual atom, value-preserving eqns on the way) of the add consuming
    the sum ``d``, or raises."""
    d0 = d
    d, via = _through_no_ops(g, d)
    u = g.only_user(d)
    if u is None or G.name(g.eqns[u]) != "add":
        raise Reject(_not_followed_by_add(g, d0))
    add = g.eqns[u]
    residual = G.other_operand(add, d)
    if residual is None:
        raise Reject("the all-reduce's sum is added to itself")
    if G.shape(residual) != G.shape(d) or G.dtype(residual) != G.dtype(d):
        if G.dtype(residual) != G.dtype(d):
            raise Reject(
                f"the residual is {G.dtype(residual)}, the sum {G.dtype(d)} (the "
                "kernel adds them in one dtype)"
            )
        raise Reject(
            f"the residual's shape {G.shape(residual)} differs from the sum's {G.shape(d)}"
        )
    return u, residual, set(via)


def written_vars(m: Match) -> set:
    """The vars of the scope the emitted call writes."""
    norm = m.norm
    out = {norm.out_var, norm.quant_var, norm.scale_out_var, m.r, m.r_full, m.gather_norm}
    return out - {None}


def _finish(g: G.Graph, m: Match, inputs, exempt=()) -> Match:
    """Emission point, what is skipped, and the checks every kind shares (``exempt``: eqns
    whose other outputs the emitter writes itself: a shard_map rewritten whole)."""
    norm = m.norm
    validation.check(g, norm, m.r if m.r_full is None else m.r_full)
    written = written_vars(m)
    skip = set(m.skip)
    for v in written:
        i = g.defs.get(v)
        if i is not None:
            skip.add(i)
    m.skip = skip
    vars_in = [a for a in inputs if G.is_var(a)]
    at = max([min(skip)] + [g.defs[a] + 1 for a in vars_in if a in g.defs])
    for v in written:
        if any(u < at and u not in skip for u in g.users(v)):
            raise Reject("a result of the site is used before gamma is computed")
    for i in skip:
        if i >= at:
            continue
        if i in exempt:
            continue
        for v in g.eqns[i].outvars:
            if v in written:
                continue
            if any(u not in skip for u in g.users(v)) or v in g.outs:
                if i not in norm.eqns:
                    raise Reject("an intermediate of the site is used elsewhere")
    m.emit_at = at
    return m


def match_reduction(g: G.Graph, i: int, scope: Scope, axis: str, allow: bool) -> Match:
    """A site inside shard_map: a psum (or custom-rule psum, or psum_scatter) at eqn i."""
    src = reduction_source(g, i, scope, axis)
    _after_cast(g, src, allow)
    d = src.out
    T = G.dtype(d)
    if T not in G.FLOATS:
        raise Reject(f"all-reduce of {T}")
    if len(G.shape(d)) < 1 or G.shape(d)[-1] == 0:
        raise Reject(f"all-reduce of shape {G.shape(d)}")
    _require_concrete(d)
    add_i, residual, via = _residual_add(g, d)
    r = g.eqns[add_i].outvars[0]
    skip = set(src.eqns) | {add_i} | via
    if src.kind == R.REDUCE_SCATTER:
        return _match_sequence_parallel(g, src, add_i, residual, r, skip, allow)
    norm = norm_proof.prove_rms_norm(g, r, allow)
    if src.custom_vjp is not None:
        norm_proof.drop_tail(norm, "FP8 tail not fused: the all-reduce keeps a custom_vjp rule")
    shape = G.shape(r)
    m = Match(
        kind=src.kind,
        source=src,
        residual=residual,
        r=r,
        norm=norm,
        dtype=T,
        hidden=shape[-1],
        tokens=math.prod(shape[:-1]),
        skip=skip,
        rounding_change=src.rounding_change,
    )
    return _finish(g, m, [src.x, residual, norm.gamma, norm.scale])


def _require_concrete(v) -> None:
    problem = norm_proof.concrete_problem(G.shape(v))
    if problem:
        raise Reject(problem)


def _gather_of(g: G.Graph, v, axis: str, dim: int):
    """The eqn index gathering ``v`` back over ``axis`` along ``dim`` (tiled), or None."""
    for u in g.users(v):
        e = g.eqns[u]
        if (
            G.name(e) == "all_gather"
            and tuple(e.params["axis_name"]) == (axis,)
            and int(e.params["all_gather_dimension"]) == dim
            and e.params.get("tiled")
            and e.params.get("axis_index_groups") is None
        ):
            return u
    return None


def _match_sequence_parallel(g, src, add_i, residual, r_shard, skip, allow):
    """psum_scatter (tokens) -> add the residual shard -> all_gather -> RMSNorm, or
    -> RMSNorm on the shard -> all_gather of the norm: one fused all-reduce on all tokens
    (the residual shard is gathered first), the shards sliced back out."""
    dim = src.scatter_dim
    nd = len(G.shape(r_shard))
    if dim >= nd - 1:
        raise Reject("psum_scatter over the hidden axis (the norm needs whole rows)")
    if src.size_one_axes:
        raise Reject("psum_scatter over several mesh axes")
    gi = _gather_of(g, r_shard, src.axis, dim)
    m = None
    if gi is not None:
        r_full = g.eqns[gi].outvars[0]
        norm = norm_proof.prove_rms_norm(g, r_full, allow)
        shape = G.shape(r_full)
        m = Match(
            kind=R.REDUCE_SCATTER,
            source=src,
            residual=residual,
            r=r_shard,
            norm=norm,
            dtype=G.dtype(r_shard),
            hidden=shape[-1],
            tokens=math.prod(shape[:-1]),
            skip=skip | {gi},
            r_full=r_full,
        )
    else:
        try:
            norm = norm_proof.prove_rms_norm(g, r_shard, allow)
        except Reject as why:
            raise Reject(f"psum_scatter + residual add, then {why}") from None
        ni = _gather_of(g, norm.out_var, src.axis, dim)
        if ni is None or norm.quant_var is not None:
            raise Reject(
                "psum_scatter + add + RMSNorm on the token shard whose output is not "
                "all-gathered (the fused all-reduce would move more data; left as "
                "it is)"
            )
        full = G.shape(g.eqns[ni].outvars[0])
        m = Match(
            kind=R.REDUCE_SCATTER,
            source=src,
            residual=residual,
            r=r_shard,
            norm=norm,
            dtype=G.dtype(r_shard),
            hidden=full[-1],
            tokens=math.prod(full[:-1]),
            skip=skip | {ni},
            gather_norm=g.eqns[ni].outvars[0],
        )
    if m.norm.quant_var is not None and m.r_full is None:
        raise Reject("psum_scatter with an FP8 tail on the shard")
    return _finish(g, m, [src.x, residual, m.norm.gamma, m.norm.scale])


# --- across a shard_map boundary (per-linear shard_map) --------------------------------------


_BODY_GRAPHS: dict = {}  # id(body jaxpr) -> (body, its Graph): one Graph per body per pass


def _body_graph(sm_eqn):
    body = G.open_jaxpr(sm_eqn.params["jaxpr"])
    hit = _BODY_GRAPHS.get(id(body))
    if hit is None or hit[0] is not body:
        if len(_BODY_GRAPHS) > 256:
            _BODY_GRAPHS.clear()
        hit = _BODY_GRAPHS[id(body)] = (body, G.Graph(body))
    return hit


def body_psum(sm_eqn, k: int):
    """(body, body graph, reduction eqn index, chain) when the shard_map's output k is an
    all-reduce (a psum, or a custom-rule psum) inside its body, through value-preserving
    eqns and at most one cast of a float32 sum to 16 bits; ``chain``: the body eqns from the
    reduction's output to output k, in order. None when output k is something else."""
    body, bg = _body_graph(sm_eqn)
    v = body.outvars[k]
    chain = []
    cast = False
    while True:
        i, e = bg.eqn(v)
        if e is None:
            return None
        n = G.name(e)
        if n in G.NO_OPS and len(e.invars) == 1:
            chain.append(i)
            v = e.invars[0]
            continue
        if (
            n == G.CAST
            and not cast
            and G.dtype(e.invars[0]) == "float32"
            and G.dtype(v) in ("bfloat16", "float16")
        ):
            cast = True
            chain.append(i)
            v = e.invars[0]
            continue
        break
    if G.name(e) not in G.PSUMS and not custom_psum(e):
        return None
    return body, bg, i, chain[::-1]


def body_source(sm_eqn, k: int, scope_inner: Scope, axis: str):
    """(body graph, source eqn index, Source) when the shard_map's output k is an all-reduce
    over ``axis`` inside its body, else raises."""
    found = body_psum(sm_eqn, k)
    if found is None:
        raise Reject("the shard_map output is not an all-reduce")
    _, bg, i, _ = found
    return bg, i, reduction_source(bg, i, scope_inner, axis)


def _other_uses_in_body(body, bg, i, chain, k) -> Optional[str]:
    """Why the all-reduce's value has other uses than leaving as output k (returned twice,
    copied, read inside the body), or None: the rewrite turns output k into residual_out,
    so any other use would read residual_out instead of the sum."""
    values = [bg.eqns[i].outvars[0]] + [bg.eqns[c].outvars[0] for c in chain]
    others = sorted({kk for kk, v in enumerate(body.outvars) if any(v is w for w in values)} - {k})
    if others or sum(v is values[-1] for v in body.outvars) > 1:
        outs = ", ".join(str(x) for x in sorted(set(others) | {k}))
        return (
            "the all-reduce's result has other uses besides the residual add (the "
            f"shard_map returns it as outputs {outs})"
        )
    inner = [u for v in values for u in bg.users(v) if u not in chain]
    if inner:
        return (
            "the all-reduce's result has other uses besides the residual add (inside the "
            f"shard_map: {G.name(bg.eqns[inner[0]])})"
        )
    return None


def _spec_axes(entry):
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def match_boundary(
    g: G.Graph, j: int, k: int, scope: Scope, axis: str, allow: bool, inner: Scope
) -> Match:
    """shard_map output k (a psum over ``axis`` inside) -> residual add -> RMSNorm outside.
    Once the add is found, every refusal is ``late``: it is the reason of the body's psum."""
    sm = g.eqns[j]
    found = body_psum(sm, k)
    if found is None:
        raise Reject("the shard_map output is not an all-reduce")
    d = sm.outvars[k]
    cast = _f32_cast_user(g, d)  # a float32 sum cast down after the shard_map
    add_i, residual, via = _residual_add(g, d if cast is None else g.eqns[cast].outvars[0])
    try:
        return _boundary_site(g, j, k, scope, axis, allow, inner, found, cast, add_i, residual, via)
    except Reject as why:
        raise Reject(str(why), late=True) from None


def _boundary_site(g, j, k, scope, axis, allow, inner, found, cast, add_i, residual, via):
    """match_boundary once the residual add is found."""
    sm = g.eqns[j]
    body, bg, pi, chain = found
    src = reduction_source(bg, pi, inner, axis)
    out_specs = sm.params["out_specs"]
    spec = tuple(out_specs[k])
    named = [a for entry in spec for a in _spec_axes(entry)]
    if axis in named:
        raise Reject(f"the shard_map returns its all-reduce sharded over {axis!r}")
    d = sm.outvars[k]
    if len(spec) >= len(G.shape(d)) and spec[len(G.shape(d)) - 1] is not None:
        raise Reject("the shard_map returns its all-reduce sharded along the hidden axis")
    skip = {j, add_i} | via
    # A float32 sum cast down, inside the body or after the shard_map.
    if any(G.name(bg.eqns[c]) == G.CAST for c in chain):
        _sum_cast_down(src, G.dtype(d), allow)
    elif cast is not None:
        d = g.eqns[cast].outvars[0]
        _sum_cast_down(src, G.dtype(d), allow)
        skip.add(cast)
    T = G.dtype(d)
    if T not in G.FLOATS:
        raise Reject(f"all-reduce of {T}")
    _require_concrete(d)
    problem = _other_uses_in_body(body, bg, pi, chain, k)
    if problem:
        raise Reject(problem)
    residual_body = None
    if g.defs.get(residual) == j:  # the same shard_map returns the residual
        jj = next(n for n, v in enumerate(sm.outvars) if v is residual)
        if tuple(out_specs[jj]) != spec:
            raise Reject(
                f"the residual is output {jj} of the shard_map that returns the all-reduce, "
                f"laid out as {P(*out_specs[jj])}, the sum as {P(*spec)}: return both "
                "alike (or compute the residual outside the shard_map)"
            )
        residual_body = body.outvars[jj]
    r = g.eqns[add_i].outvars[0]
    norm = norm_proof.prove_rms_norm(g, r, allow)
    if src.custom_vjp is not None:
        norm_proof.drop_tail(norm, "FP8 tail not fused: the all-reduce keeps a custom_vjp rule")
    shape = G.shape(r)
    local_tokens = math.prod(shape[:-1])
    # The body's view of the sum has the local shape: tokens as the out spec splits them.
    mesh = sm.params["mesh"]
    for dim, entry in enumerate(spec[: len(shape) - 1]):
        for a in _spec_axes(entry):
            local_tokens //= dict(mesh.shape)[a]
    m = Match(
        kind=R.PSUM_IN_SHARD_MAP,
        source=src,
        residual=residual,
        r=r,
        norm=norm,
        dtype=G.dtype(d),
        hidden=shape[-1],
        tokens=local_tokens,
        skip=skip,
        boundary=(j, k, pi),
        rounding_change=src.rounding_change,
        body_out=body.outvars[k],
        residual_body=residual_body,
    )
    # Everything the new shard_map replaces must be used only after it runs (BoundaryEmit
    # writes every output of the shard_map at the emission point).
    m = _finish(g, m, [residual, norm.gamma, norm.scale] + list(sm.invars), exempt={j})
    for v in sm.outvars:
        if any(u < m.emit_at and u not in m.skip for u in g.users(v)):
            raise Reject("an output of the shard_map is used before gamma is computed")
    return m


# --- plain jit (the partitioner's all-reduce) --------------------------------------------------


def dot_candidate(g: G.Graph, i: int) -> bool:
    """Whether the dot_general at eqn i is worth reporting: its output (possibly cast) is
    added to something a norm then reads, or is itself normalized (a sandwich norm)."""
    d = g.eqns[i].outvars[0]
    u = g.only_user(d)
    if u is not None and G.name(g.eqns[u]) == G.CAST:
        d = g.eqns[u].outvars[0]
        u = g.only_user(d)
    if u is None:
        return False
    if G.name(g.eqns[u]) == "add":
        return norm_proof.norm_like(g, g.eqns[u].outvars[0])
    return norm_proof.norm_like(g, d)


def match_plain_dot(g: G.Graph, i: int, scope: Scope, allow: bool) -> Match:
    """dot_general (no batch dims, one free dim of w) -> add residual -> RMSNorm, outside
    shard_map: the partitioner inserts the all-reduce when the contraction is sharded."""
    e = g.eqns[i]
    (hc, wc), (hb, wb) = e.params["dimension_numbers"]
    h, w = e.invars
    if hb or wb:
        raise Reject("a batched dot_general (the fused entry takes h [..., k] and w [k, n])")
    if len(G.shape(w)) - len(wc) != 1:
        raise Reject("the matmul's weight has several free dimensions")
    d = e.outvars[0]
    skip = {i}
    change = None
    T = G.dtype(d)
    if G.dtype(h) != G.dtype(w):
        raise Reject("the matmul's operands have different dtypes")
    if T != G.dtype(h):
        u = g.only_user(d)
        if (
            T == "float32"
            and u is not None
            and G.name(g.eqns[u]) == G.CAST
            and np.dtype(g.eqns[u].params["new_dtype"]).name == G.dtype(h)
        ):
            if not allow:
                raise Reject(
                    f"matmul accumulated in float32, cast to {G.dtype(h)} before the "
                    f"residual add: under sharding the fused op sums {G.dtype(h)} "
                    "partials (pass allow_rounding_change=True to fuse it)"
                )
            change = f"each shard's float32 partial product rounded to {G.dtype(h)}"
            skip.add(u)
            d = g.eqns[u].outvars[0]
            T = G.dtype(d)
        else:
            raise Reject(f"the matmul outputs {T}, its operands are {G.dtype(h)}")
    if T not in G.FLOATS:
        raise Reject(f"a matmul of {T}")
    _require_concrete(d)
    add_i, residual, via = _residual_add(g, d)
    skip |= via
    r = g.eqns[add_i].outvars[0]
    norm = norm_proof.prove_rms_norm(g, r, allow)
    norm_proof.drop_tail(norm, "FP8 tail not fused: the plain-jit entry computes the norm only")
    shape = G.shape(r)
    m = Match(
        kind=R.PLAIN_JIT_MATMUL,
        source=None,
        residual=residual,
        r=r,
        norm=norm,
        dtype=T,
        hidden=shape[-1],
        tokens=math.prod(shape[:-1]),
        skip=skip | {add_i},
        dot=e,
        rounding_change=change,
    )
    return _finish(g, m, [h, w, residual, norm.gamma])
