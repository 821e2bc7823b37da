"""``jax_fusedar.fuse(fn, ...)``: the all-reduce fusion pass for JAX, as a function transform.

``fuse(fn, mesh=mesh, axis_name="tp")`` returns a function with ``fn``'s signature whose
computation has every matched

    psum (or psum_invariant, under check_vma) -> residual add -> RMSNorm [-> FP8 quantization]

replaced by one :func:`jax_fusedar.allreduce_fusion` call, like vLLM's ``AllReduceFusionPass``
does on torch.compile graphs (``torch_compat.fusion_pass`` is the torch twin). It works on the
jaxpr of ``fn``: it traces ``fn``, finds the sites (see ``docs/fusion_pass.md`` for the
equation sequences matched and where they come from), and re-traces the program with each
site replaced, looking through ``jit``, ``shard_map``, ``scan``, ``while`` / ``fori_loop``,
``cond``, ``checkpoint`` / ``remat``, ``custom_jvp`` / ``custom_vjp`` and nested calls. The
primitives around a site are re-bound unchanged, so a program with nothing to fuse is the
same program.

Exactness. A site is fused only when the fused op computes what the original computed, up to
the fused op's documented rounding (``reference.py``: the sum rounded once to the activation
dtype T, ``residual_out = T(s + residual)``, the norm in float32 from ``residual_out``,
``T(r * rsqrt(mean(r^2) + eps) * gamma)``). float32-internal differences (multiplying by
gamma before or after the rsqrt factor, ``mean`` as a division by H) are inside that rounding.
Forms that round differently are left alone with the reason reported, unless
``allow_rounding_change=True``:

* gamma multiplied in T after the normalized value was rounded to T (MaxText, Hugging Face);
* a float32 gamma (the kernel reads gamma in T: rounding it changes the result);
and never fused (reported): the residual add done in float32 (the kernel rounds the sum to T
first), the norm computed in T, eps or the mean's divisor traced rather than constant, the
norm over another axis, the norm output kept in float32, an intermediate used elsewhere.

Workspaces. With ``mesh`` and ``axis_name`` the transform creates workspaces (one per
activation dtype) sized for the largest site it meets, and reuses them across calls while
they are large enough; ``max_tokens`` caps them (larger sites stay unfused, like vLLM's
compile ranges). With ``workspace=`` it uses that one, and sites it cannot serve stay unfused.

Report. Each trace leaves a :class:`FusionReport` in ``fused.report`` (sites fused and not,
with reasons, as data) and logs one line (``jax_fusedar.fuse: fused 64 of 64 ...``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
from collections import Counter, defaultdict
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from .common import limits
from .common.patterns import AllReduceFusionPattern as Pattern

log = logging.getLogger("jax_fusedar")

_PSUMS = ("psum", "psum_invariant")
_FLOATS = ("bfloat16", "float16", "float32")
_CAST = "convert_element_type"
_SHAPE_OPS = ("broadcast_in_dim", "reshape", "squeeze", "expand_dims")
_NO_OPS = ("pvary", "pcast", "copy", "copy_p")  # value-preserving under check_vma


# --- the report ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Site:
    """One all-reduce met by the pass. ``where``: the path of wrappers around it (e.g.
    ``jit(model)/shard_map/scan``). ``reason``: why it was not fused (None when fused);
    ``rounding_change``: what rounding differs from the original, for sites fused only
    because ``allow_rounding_change`` was set."""

    where: str
    fused: bool
    reason: Optional[str]
    pattern: Optional[int] = None
    tokens: Optional[int] = None
    hidden: Optional[int] = None
    dtype: Optional[str] = None
    rms_eps: Optional[float] = None
    rounding_change: Optional[str] = None
    weight_bias: Optional[float] = None   # 1.0 for Gemma's (1 + gamma)
    runs: Optional[int] = 1   # times it runs per call (scan lengths multiplied; None: a while loop)


@dataclasses.dataclass
class FusionReport:
    sites: list

    @property
    def fused(self) -> list:
        return [s for s in self.sites if s.fused]

    @property
    def not_fused(self) -> list:
        return [s for s in self.sites if not s.fused]

    def fused_runs(self) -> Optional[int]:
        """Fused calls per run of the function (scan bodies count their length; every cond
        branch counts, so an upper bound there), or None when one sits in a while loop."""
        runs = [s.runs for s in self.fused]
        return None if any(r is None for r in runs) else sum(runs)

    def reasons(self) -> Counter:
        """{reason: number of sites} of the sites left unfused."""
        return Counter(s.reason for s in self.not_fused)

    def line(self) -> str:
        """vLLM-style one-line summary."""
        text = (f"jax_fusedar.fuse: fused {len(self.fused)} of {len(self.sites)} all-reduce + "
                f"residual + RMSNorm site(s)")
        runs = self.fused_runs()
        if runs is not None and runs != len(self.fused):
            text += f" ({runs} fused calls per run, loops counted)"
        if self.not_fused:
            text += "; not fused: " + "; ".join(f"{n} x {r}" for r, n in self.reasons().items())
        return text

    def as_dict(self) -> dict:
        return {"fused": len(self.fused), "sites": [dataclasses.asdict(s) for s in self.sites]}


# --- matching ------------------------------------------------------------------------------------

class _Reject(Exception):
    """A candidate all-reduce that is not fused; the message is the reported reason."""


@dataclasses.dataclass
class _Match:
    psum: int                   # eqn indices
    x: Any                      # the all-reduce's operand (Var)
    residual: Any               # atom
    res_var: Any                # the residual sum (residual_out)
    out_var: Any                # the norm output (norm_out)
    gamma: Any                  # root atom of gamma, or None (no scale: ones)
    eps: float
    core: set                   # eqns removed with the site
    aux: set                    # constant / gamma chains: removed when nothing else uses them
    rounding_change: Optional[str]
    dtype: str
    hidden: int
    tokens: int
    pattern: int = int(Pattern.kARResidualRMSNorm)
    scale: Any = None           # static FP8 scale atom
    quant_var: Any = None       # FP8 output
    scale_out_var: Any = None   # dynamic FP8 per-token scale
    emit_at: int = 0
    weight_bias: float = 0.0    # Gemma's (1 + gamma)


class _Graph:
    """Use-def information of one jaxpr."""

    def __init__(self, jaxpr):
        self.jaxpr = jaxpr
        self.eqns = jaxpr.eqns
        self.defs = {}
        self.uses = defaultdict(list)
        for i, e in enumerate(self.eqns):
            for v in e.invars:
                if isinstance(v, jcore.Var):
                    self.uses[v].append(i)
            for v in e.outvars:
                self.defs[v] = i
        self.outs = {v for v in jaxpr.outvars if isinstance(v, jcore.Var)}

    def eqn(self, v):
        i = self.defs.get(v)
        return (i, self.eqns[i]) if i is not None else (None, None)

    def users(self, v):
        return sorted(set(self.uses.get(v, ())))

    def only_user(self, v):
        us = self.users(v)
        if len(us) != 1 or v in self.outs:
            return None
        return us[0]


def _name(eqn) -> str:
    return eqn.primitive.name


def _dtype(atom) -> str:
    return np.dtype(atom.aval.dtype).name


def _shape(atom) -> tuple:
    return tuple(atom.aval.shape)


def _const(g: _Graph, atom, chain: set):
    """The Python value of a scalar constant atom (a literal, possibly through pvary,
    convert_element_type or broadcast_in_dim eqns, which are added to ``chain``), or None."""
    seen = []
    while True:
        if isinstance(atom, jcore.Literal):
            chain.update(seen)
            val = np.asarray(atom.val)
            return float(val.reshape(-1)[0]) if val.size >= 1 and np.all(val == val.reshape(-1)[0]) else None
        i, e = g.eqn(atom)
        if e is None or _name(e) not in _NO_OPS + (_CAST, "broadcast_in_dim", "reshape"):
            return None
        if len(e.invars) != 1:
            return None
        seen.append(i)
        atom = e.invars[0]


def _other(eqn, v):
    a, b = eqn.invars
    if a is v and b is not v:
        return b
    if b is v and a is not v:
        return a
    return None


def _follow_views(g: _Graph, v, ops, eqns: set):
    """Follows single-use eqns of the given names from ``v``; returns the last var."""
    while True:
        u = g.only_user(v)
        if u is None or _name(g.eqns[u]) not in ops:
            return v
        e = g.eqns[u]
        if _name(e) == _CAST and _dtype(e.outvars[0]) != _dtype(v):
            return v
        eqns.add(u)
        v = e.outvars[0]


def _gamma_root(g: _Graph, atom, hidden: int, aux: set):
    """Walks back from the operand multiplied into the norm through broadcasts, reshapes,
    pvary and casts to the gamma array, and through one float32 ``add`` of a constant
    (Gemma's ``1 + gamma``: the kernel's weight_bias). Returns (root atom, dtypes met on the
    way, weight_bias)."""
    dtypes = [_dtype(atom)]
    bias = 0.0
    while isinstance(atom, jcore.Var):
        i, e = g.eqn(atom)
        if e is None:
            break
        if _name(e) == "add" and not bias and _dtype(atom) == "float32":
            for const_side, other in ((0, 1), (1, 0)):
                c = _const(g, e.invars[const_side], aux)
                if c is not None and isinstance(e.invars[other], jcore.Var):
                    bias = c
                    break
            if not bias:
                break
            aux.add(i)
            atom = e.invars[other]
            dtypes.append(_dtype(atom))
            continue
        if len(e.invars) != 1 or _name(e) not in _SHAPE_OPS + _NO_OPS + (_CAST,):
            break
        aux.add(i)
        atom = e.invars[0]
        dtypes.append(_dtype(atom))
    shape = _shape(atom)
    if not shape or shape[-1] != hidden or math.prod(shape) != hidden:
        raise _Reject(f"gamma of shape {shape} is not a [{hidden}] vector")
    return atom, dtypes, bias


def _is_square(g, e, f):
    n = _name(e)
    if n == "mul":
        return e.invars[0] is f and e.invars[1] is f
    if n == "square":
        return e.invars[0] is f
    if n == "integer_pow":
        return e.invars[0] is f and e.params.get("y") == 2
    return False


def _match_norm(g: _Graph, m: _Match, allow: bool):
    """RMSNorm of the residual sum ``m.res_var``; fills gamma, eps, out_var, core, aux."""
    e_var = m.res_var
    T = m.dtype
    nd = len(_shape(e_var))
    # The float32 views of e: e itself (float32 models) or casts of it to float32.
    views = set()
    for u in g.users(e_var):
        ue = g.eqns[u]
        if _name(ue) == _CAST and _dtype(ue.outvars[0]) == "float32":
            views.add(ue.outvars[0])
            m.core.add(u)
    if T == "float32":
        views.add(e_var)
    # Find the square of a view.
    sq = None
    for f in list(views) + ([e_var] if T != "float32" else []):
        for u in g.users(f):
            if _is_square(g, g.eqns[u], f):
                sq = (u, f)
                break
        if sq:
            break
    if sq is None:
        raise _Reject("no RMSNorm of the residual sum in the same scope")
    if sq[1] is e_var and T != "float32":
        raise _Reject(f"RMSNorm computed in {T}, not float32")
    core = m.core
    core.add(sq[0])
    v = g.eqns[sq[0]].outvars[0]
    u = g.only_user(v)
    if u is None or _name(g.eqns[u]) != "reduce_sum":
        raise _Reject("the square is not only summed over the hidden axis")
    axes = tuple(g.eqns[u].params["axes"])
    if axes not in ((nd - 1,), (-1,)):
        raise _Reject(f"norm over axis {axes[0] if len(axes) == 1 else axes}, not the last")
    core.add(u)
    v = g.eqns[u].outvars[0]
    hidden = _shape(e_var)[-1]
    divisor = None
    eps = None
    # mean, + eps, with keepdims reshapes in any order, up to the rsqrt.
    while True:
        u = g.only_user(v)
        if u is None:
            raise _Reject("the mean of squares has other uses")
        e = g.eqns[u]
        n = _name(e)
        if n in ("broadcast_in_dim", "reshape"):
            out = _shape(e.outvars[0])
            if out not in (_shape(v) + (1,), _shape(v)) and out != _shape(e_var)[:-1] + (1,):
                raise _Reject(f"unexpected reshape {out} inside the norm")
        elif n in ("div", "mul", "add") and e.invars[0] is v:
            c = _const(g, e.invars[1], m.aux)
            if c is None:
                what = {"add": "eps", "div": "the mean's divisor", "mul": "the mean's factor"}[n]
                raise _Reject(f"{what} traced (not a constant)")
            if n == "div":
                divisor = c
            elif n == "mul":
                divisor = 1.0 / c if c else None
            else:
                if eps is not None:
                    raise _Reject("two additions inside the norm")
                eps = c
        elif n == "rsqrt":
            core.add(u)
            inv = e.outvars[0]
            break
        else:
            raise _Reject(f"{n} inside the norm")
        core.add(u)
        v = e.outvars[0]
    if divisor is None or not math.isclose(divisor, hidden, rel_tol=1e-6):
        raise _Reject(f"the mean divides by {divisor}, not the hidden size {hidden}")
    m.eps = float(eps or 0.0)

    def is_view(a):
        # a float32 view of e, or flax's (view - 0)
        if a in views:
            return True
        i, e = g.eqn(a)
        if e is not None and _name(e) == "sub" and e.invars[0] in views and \
                _const(g, e.invars[1], m.aux) == 0.0:
            core.add(i)
            return True
        return False

    # r * inv [* gamma] or r * (inv * gamma) (flax), then the cast to T.
    u = g.only_user(inv)
    if u is None or _name(g.eqns[u]) != "mul":
        raise _Reject("the rsqrt factor has other uses")
    e = g.eqns[u]
    other = _other(e, inv)
    gamma_op = None
    if other is not None and is_view(other):                       # o = r * inv
        core.add(u)
        cur = e.outvars[0]
        nxt = g.only_user(cur)
        if nxt is not None and _name(g.eqns[nxt]) == "mul":        # o * gamma
            gamma_op = _other(g.eqns[nxt], cur)
            core.add(nxt)
            cur = g.eqns[nxt].outvars[0]
        elif nxt is not None and _name(g.eqns[nxt]) == _CAST and \
                _dtype(g.eqns[nxt].outvars[0]) == T != "float32":
            # cast to T, then gamma multiplied in T (MaxText, Hugging Face)
            c = g.eqns[nxt].outvars[0]
            n2 = g.only_user(c)
            if n2 is not None and _name(g.eqns[n2]) == "mul" and _other(g.eqns[n2], c) is not None:
                if not allow:
                    raise _Reject(f"gamma multiplied in {T} after the norm is rounded")
                m.rounding_change = f"gamma multiplied in float32 before one rounding to {T}"
                core.update((nxt, n2))
                gamma_op = _other(g.eqns[n2], c)
                m.out_var = g.eqns[n2].outvars[0]
    elif other is not None:                                        # v = inv * gamma
        gamma_op = other
        core.add(u)
        v2 = e.outvars[0]
        n2 = g.only_user(v2)
        if n2 is None or _name(g.eqns[n2]) != "mul" or not is_view(_other(g.eqns[n2], v2)):
            raise _Reject("the normalized value is not r * rsqrt(...)")
        core.add(n2)
        cur = g.eqns[n2].outvars[0]
    else:
        raise _Reject("unrecognized norm")
    if m.out_var is None:
        if T == "float32":
            m.out_var = cur
        else:
            nxt = g.only_user(cur)
            if nxt is None or _name(g.eqns[nxt]) != _CAST or _dtype(g.eqns[nxt].outvars[0]) != T:
                raise _Reject(f"the norm output is not cast back to {T}")
            core.add(nxt)
            m.out_var = g.eqns[nxt].outvars[0]
    if gamma_op is not None:
        if _dtype(gamma_op) != "float32" and m.rounding_change is None:
            raise _Reject(f"gamma multiplied in {_dtype(gamma_op)}")
        root, dtypes, m.weight_bias = _gamma_root(g, gamma_op, hidden, m.aux)
        rounded = any(d == T for d in dtypes) or T == "float32"
        if not rounded and dtypes[-1] == "float32":
            if not allow:
                raise _Reject(f"float32 gamma (the kernel reads gamma in {T})")
            m.rounding_change = ((m.rounding_change + "; ") if m.rounding_change else "") + \
                f"gamma rounded to {T}"
        m.gamma = root
    if _shape(m.out_var) != _shape(e_var):
        raise _Reject("the norm output has another shape")


def _match_fp8(g: _Graph, m: _Match):
    """Extends a matched site with an FP8 tail on its norm output, when there is one:
    static ``clip(float(y) / scale, -448, 448) -> e4m3`` (patterns 2/4) or dynamic per-token
    ``scale = max(max|float(y)| / 448, 2^-9/448); clip(float(y) / scale) -> e4m3`` (10/11)."""
    y = m.out_var
    casts = [u for u in g.users(y) if _name(g.eqns[u]) == _CAST and
             _dtype(g.eqns[u].outvars[0]) == "float32"]
    if m.dtype == "float32" or len(casts) != 1:
        return
    y32 = g.eqns[casts[0]].outvars[0]
    tail = {casts[0]}
    divs = [u for u in g.users(y32) if _name(g.eqns[u]) == "div" and g.eqns[u].invars[0] is y32]
    absu = [u for u in g.users(y32) if _name(g.eqns[u]) == "abs"]
    if len(divs) != 1:
        return
    d = g.eqns[divs[0]]
    tail.add(divs[0])
    scale = d.invars[1]
    dyn_scale = None
    if absu:
        # dynamic: abs -> reduce_max(last) -> keepdims -> div 448 -> max(min scale)
        v = g.eqns[absu[0]].outvars[0]
        chain = {absu[0]}
        u = g.only_user(v)
        if u is None or _name(g.eqns[u]) != "reduce_max":
            return
        chain.add(u)
        v = g.eqns[u].outvars[0]
        v = _follow_views(g, v, ("broadcast_in_dim", "reshape"), chain)
        u = g.only_user(v)
        if u is None or _name(g.eqns[u]) != "div" or _const(g, g.eqns[u].invars[1], set()) != 448.0:
            return
        chain.add(u)
        v = g.eqns[u].outvars[0]
        u = g.only_user(v)
        if u is None or _name(g.eqns[u]) != "max":
            return
        lo = _const(g, _other(g.eqns[u], v), set())
        if lo is None or not math.isclose(lo, 1.0 / 512.0 / 448.0, rel_tol=1e-6):
            return
        chain.add(u)
        dyn_scale = g.eqns[u].outvars[0]
        if scale is not dyn_scale:
            return
        tail |= chain
    elif not (_shape(scale) in ((), (1,)) and _dtype(scale) == "float32"):
        return
    q = d.outvars[0]
    u = g.only_user(q)
    if u is None:
        return
    ce = g.eqns[u]
    if _name(ce) == "jit" and len(ce.invars) == 3 and ce.invars[0] is q and \
            _const(g, ce.invars[1], set()) == -448.0 and _const(g, ce.invars[2], set()) == 448.0:
        tail.add(u)                                   # jnp.clip(q, -448, 448)
        q = ce.outvars[0]
    elif _name(ce) == "clamp" and ce.invars[1] is q:
        if _const(g, ce.invars[0], set()) != -448.0 or _const(g, ce.invars[2], set()) != 448.0:
            return
        tail.add(u)
        q = ce.outvars[0]
    else:
        return
    u = g.only_user(q)
    if u is None or _name(g.eqns[u]) != _CAST or _dtype(g.eqns[u].outvars[0]) != "float8_e4m3fn":
        return
    tail.add(u)
    m.quant_var = g.eqns[u].outvars[0]
    norm_used = any(x not in tail for x in g.users(y)) or y in g.outs
    if dyn_scale is not None:
        # the scale may be used outside (dequantization); it is the kernel's scale_out
        m.scale_out_var = dyn_scale
        m.pattern = int(Pattern.kARResidualRMSNormOutDynamicFP8Quant if norm_used
                        else Pattern.kARResidualRMSNormDynamicFP8Quant)
    else:
        m.scale = scale
        m.pattern = int(Pattern.kARResidualRMSNormOutFP8Quant if norm_used
                        else Pattern.kARResidualRMSNormFP8Quant)
    m.core |= tail


def _match_site(g: _Graph, i: int, axis_name: str, allow: bool) -> _Match:
    ps = g.eqns[i]
    axes = tuple(ps.params.get("axes", ()))
    if ps.params.get("axis_index_groups") is not None:
        raise _Reject("all-reduce over axis_index_groups")
    if axes != (axis_name,):
        raise _Reject(f"all-reduce over {axes}, not the fused axis {axis_name!r}")
    if len(ps.invars) != 1 or not isinstance(ps.invars[0], jcore.Var):
        raise _Reject("all-reduce of several operands")
    x, d = ps.invars[0], ps.outvars[0]
    T = _dtype(d)
    if T not in _FLOATS:
        raise _Reject(f"all-reduce of {T}")
    if T == "float32":
        xi, xe = g.eqn(x)
        if xe is not None and _name(xe) == _CAST and _dtype(xe.invars[0]) != "float32":
            raise _Reject(f"all-reduce in float32 of {_dtype(xe.invars[0])} values (the kernel "
                          f"rounds the sum to {_dtype(xe.invars[0])} before the residual add)")
    u = g.only_user(d)
    if u is None or _name(g.eqns[u]) != "add":
        raise _Reject("the all-reduce is not followed by a residual add only")
    add = g.eqns[u]
    residual = _other(add, d)
    if residual is None or _shape(residual) != _shape(d) or _dtype(residual) != T:
        raise _Reject("the residual add's other operand differs in shape or dtype")
    shape = _shape(d)
    if len(shape) < 1 or shape[-1] == 0:
        raise _Reject(f"all-reduce of shape {shape}")
    m = _Match(psum=i, x=x, residual=residual, res_var=add.outvars[0], out_var=None,
               gamma=None, eps=0.0, core={i, u}, aux=set(), rounding_change=None, dtype=T,
               hidden=shape[-1], tokens=math.prod(shape[:-1]))
    _match_norm(g, m, allow)
    _match_fp8(g, m)
    # Everything removed must be used only inside the site.
    site = m.core | m.aux
    keep_vars = {m.res_var, m.out_var, m.quant_var, m.scale_out_var}
    for k in m.core:
        for ov in g.eqns[k].outvars:
            if ov in keep_vars:
                continue
            if ov in g.outs or any(x not in site for x in g.users(ov)):
                raise _Reject("an intermediate of the norm is used elsewhere")
    # The fused call goes where all of its inputs exist; every other user of its outputs
    # must come after that point.
    inputs = [a for a in (x, residual, m.gamma, m.scale) if isinstance(a, jcore.Var)]
    at = max([i] + [g.defs[a] + 1 for a in inputs if a in g.defs])
    for ov in keep_vars - {None}:
        if any(x < at and x not in site for x in g.users(ov)):
            raise _Reject("a result of the site is used before gamma is computed")
    m.emit_at = at
    return m


# --- analysis over nested jaxprs -------------------------------------------------------------------

@dataclasses.dataclass
class _Plan:
    """What to change in one jaxpr: sites to emit (by eqn index), eqns to drop, and plans
    for the sub-jaxprs of eqns (by eqn index -> {(param name, index): plan}). ``jaxpr``: the
    jaxpr the indices refer to (the original with norm calls inlined, see _inline_calls)."""
    jaxpr: Any
    emit: dict
    skip: set
    children: dict
    context: Any = None  # for shard_map bodies: (mesh, manual axes, check_vma)

    def empty(self) -> bool:
        return not self.emit and not self.children


def _subjaxprs(eqn):
    """(param name, index or None, jaxpr object) of every sub-jaxpr in the eqn's params."""
    out = []
    for k, v in eqn.params.items():
        if isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr)):
            out.append((k, None, v))
        elif isinstance(v, (tuple, list)) and v and all(
                isinstance(b, (jcore.Jaxpr, jcore.ClosedJaxpr)) for b in v):
            out.extend((k, j, b) for j, b in enumerate(v))
    return out


def _open(j):
    return j.jaxpr if isinstance(j, jcore.ClosedJaxpr) else j


def _label(eqn) -> str:
    n = _name(eqn)
    if n in ("jit", "pjit", "closed_call", "core_call") and eqn.params.get("name"):
        return f"jit({eqn.params['name']})"
    if n == "scan":
        return f"scan(length={eqn.params.get('length')})"
    if n == "remat2":
        return "checkpoint"
    return n


# Call-like primitives and the parameter holding their jaxpr.
_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
          "remat2": "jaxpr", "checkpoint": "jaxpr", "custom_jvp_call": "call_jaxpr",
          "custom_vjp_call": "call_jaxpr"}


def _splice(eqn):
    """The eqns of a call-like eqn's jaxpr with its variables renamed into the caller's, or
    None when that is not a plain substitution (constants, pass-through outputs)."""
    sub = eqn.params.get(_CALLS[_name(eqn)])
    closed = isinstance(sub, jcore.ClosedJaxpr)
    inner = sub.jaxpr if closed else sub
    if inner is None or (closed and sub.consts) or inner.constvars or \
            len(inner.invars) != len(eqn.invars) or len(inner.outvars) != len(eqn.outvars):
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
        out.append(e.replace(
            invars=[subst.get(a, a) if isinstance(a, jcore.Var) else a for a in e.invars],
            outvars=[subst.get(v, v) for v in e.outvars]))
    return out


def _inline_calls(jaxpr):
    """Splices into ``jaxpr`` every call (nested jit, checkpoint, custom_jvp / custom_vjp)
    that receives the residual sum of an all-reduce, so that a norm written inside one is
    seen together with its all-reduce (forms d and e of docs/fusion_pass.md). Values are
    unchanged; the call's boundary (and, for a site then fused, its remat policy or custom
    derivative rule) is dropped."""
    for _ in range(8):  # nested calls: one level per round
        g = _Graph(jaxpr)
        targets = set()
        for e in g.eqns:
            if _name(e) not in _PSUMS:
                continue
            u = g.only_user(e.outvars[0])
            if u is not None and _name(g.eqns[u]) == "add":
                targets.update(c for c in g.users(g.eqns[u].outvars[0])
                               if _name(g.eqns[c]) in _CALLS)
        new, changed = [], False
        for i, e in enumerate(g.eqns):
            spliced = _splice(e) if i in targets else None
            if spliced is None:
                new.append(e)
            else:
                new.extend(spliced)
                changed = True
        if not changed:
            return jaxpr
        jaxpr = jaxpr.replace(eqns=new)
    return jaxpr


class _Analyzer:
    def __init__(self, fuser, axis_name):
        self.fuser = fuser
        self.axis = axis_name
        self.sites = []

    def plan(self, jaxpr, where: str, mesh_shape: Optional[dict], runs=1) -> _Plan:
        jaxpr = _inline_calls(jaxpr)
        g = _Graph(jaxpr)
        plan = _Plan(jaxpr=jaxpr, emit=defaultdict(list), skip=set(), children={})
        taken = set()
        for i, e in enumerate(g.eqns):
            if _name(e) in _PSUMS and i not in taken:
                self._site(g, i, where, mesh_shape, plan, taken, runs)
        for i, e in enumerate(g.eqns):
            if i in plan.skip:
                continue
            subs = _subjaxprs(e)
            if not subs:
                continue
            inner_shape = mesh_shape
            ctx = None
            if _name(e) == "shard_map":
                mesh = e.params["mesh"]
                inner_shape = dict(mesh.shape)
                manual = e.params.get("newly_manual_axes", e.params.get("manual_axes",
                                                                         frozenset(mesh.axis_names)))
                ctx = (mesh, frozenset(manual), e.params.get("check_vma", True))
            sub_plans = {}
            inner_runs = runs
            if _name(e) == "scan" and runs is not None:
                inner_runs = runs * int(e.params.get("length", 1))
            elif _name(e) == "while":
                inner_runs = None
            for k, j, sj in subs:
                p = self.plan(_open(sj), f"{where}/{_label(e)}" if where else _label(e),
                              inner_shape, inner_runs)
                if ctx is not None:
                    p.context = ctx
                sub_plans[(k, j)] = p
            if any(not p.empty() for p in sub_plans.values()):
                plan.children[i] = sub_plans
        return plan

    def _site(self, g, i, where, mesh_shape, plan, taken, runs):
        where = where or "top level"
        try:
            if mesh_shape is None:
                raise _Reject("all-reduce outside shard_map")
            m = _match_site(g, i, self.axis, self.fuser.allow_rounding_change)
            world = mesh_shape.get(self.axis)
            problem = limits.kernel_support_problem(world, m.hidden, m.dtype)
            if problem is None and m.hidden % limits.vector_width(m.dtype):
                problem = f"hidden size {m.hidden} is not a multiple of 16 bytes"
            if problem:
                raise _Reject(problem)
            if m.core & (taken | plan.skip):
                raise _Reject("overlaps another fused site")
            ws = self.fuser._workspace_for(m, world)  # raises _Reject when it cannot serve
        except _Reject as r:
            self.sites.append(Site(where=where, fused=False, reason=str(r),
                                   dtype=_dtype(g.eqns[i].outvars[0]),
                                   tokens=math.prod(_shape(g.eqns[i].outvars[0])[:-1]) if
                                   _shape(g.eqns[i].outvars[0]) else None,
                                   hidden=(_shape(g.eqns[i].outvars[0]) or (None,))[-1],
                                   runs=runs))
            return
        m.workspace = ws
        plan.emit[m.emit_at].append(m)
        plan.skip |= m.core
        site = m.core | m.aux
        for k in m.aux:
            if all(u in site for ov in g.eqns[k].outvars for u in g.users(ov)) and \
                    not any(ov in g.outs for ov in g.eqns[k].outvars):
                plan.skip.add(k)
        taken |= m.core
        self.sites.append(Site(where=where, fused=True, reason=None, pattern=m.pattern,
                               tokens=m.tokens, hidden=m.hidden, dtype=m.dtype, rms_eps=m.eps,
                               rounding_change=m.rounding_change,
                               weight_bias=m.weight_bias, runs=runs))


# --- rewriting -----------------------------------------------------------------------------------

def _trace_to_jaxpr(fun, in_avals, debug_info):
    """(jaxpr, consts) of ``fun`` traced at ``in_avals`` in the current context (axis env,
    abstract mesh): JAX's own staging routine, as its control-flow primitives use it. The
    public ``jax.make_jaxpr`` cannot take avals that vary over manual axes."""
    from jax._src.interpreters import partial_eval as pe
    if hasattr(pe, "trace_to_jaxpr_dynamic"):
        from jax._src import linear_util as lu
        wrapped = lu.wrap_init(fun, debug_info=debug_info)
        jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(wrapped, list(in_avals))
        return jaxpr, consts
    # Newer JAX: the FlatTree-based routine that replaced it.
    from jax._src.tree_util import FlatTree
    closed, _ = pe.trace_to_jaxpr(fun, FlatTree.flatten((tuple(in_avals), {})), debug_info)
    return closed.jaxpr, closed.consts


@contextlib.contextmanager
def _shard_map_context(ctx):
    """The context shard_map traces its body in: its manual axes bound (psum and the fused
    op look their sizes up), the manual abstract mesh, its check_vma setting."""
    if ctx is None:
        yield
        return
    from jax._src import config
    from jax._src import core
    from jax.sharding import AxisType, use_abstract_mesh
    mesh, manual, check_vma = ctx
    manual_all = set(manual) | set(getattr(mesh, "manual_axes", ()))
    inner = mesh.abstract_mesh.update_axis_types({n: AxisType.Manual for n in manual})
    with contextlib.ExitStack() as stack:
        stack.enter_context(core.extend_axis_env_nd(
            [(k, v) for k, v in mesh.shape.items() if k in manual_all]))
        stack.enter_context(use_abstract_mesh(inner))
        if hasattr(config, "_check_vma"):
            stack.enter_context(config._check_vma(check_vma))
        yield


def _fix_vma(val, aval):
    """Marks ``val`` varying over the axes the original value varied over (under check_vma
    the fused op's outputs may vary over fewer axes than a twin written with pvary)."""
    want = frozenset(getattr(aval, "vma", frozenset()) or ())
    have = frozenset(getattr(jax.typeof(val), "vma", frozenset()) or ())
    missing = tuple(sorted(want - have))
    return jax.lax.pcast(val, missing, to="varying") if missing else val


def _emit(m: _Match, read, write, fuser):
    from .api import allreduce_fusion
    T = jnp.dtype(m.dtype)
    x = read(m.x)
    residual = read(m.residual)
    gamma = jnp.ones((m.hidden,), T) if m.gamma is None else \
        read(m.gamma).reshape(m.hidden).astype(T)
    kwargs = {}
    if m.scale is not None:
        kwargs["scale_factor"] = jnp.asarray(read(m.scale), jnp.float32)
    # The fused op takes [tokens, hidden]; models carry [batch, seq, hidden].
    out = allreduce_fusion(x.reshape(-1, m.hidden), axis_name=fuser.axis_name,
                           workspace=m.workspace, pattern=m.pattern,
                           residual=residual.reshape(-1, m.hidden), rms_gamma=gamma,
                           rms_eps=m.eps, weight_bias=m.weight_bias,
                           use_oneshot=fuser.use_oneshot, strict=fuser.strict,
                           **kwargs)
    shape = _shape(m.res_var)
    write(m.res_var, _fix_vma(out.residual_out.reshape(shape), m.res_var.aval))
    if out.norm_out is not None:
        write(m.out_var, _fix_vma(out.norm_out.reshape(shape), m.out_var.aval))
    if m.quant_var is not None:
        write(m.quant_var, _fix_vma(out.quant_out.reshape(shape), m.quant_var.aval))
    if m.scale_out_var is not None:
        write(m.scale_out_var, _fix_vma(out.scale_out.reshape(_shape(m.scale_out_var)),
                                        m.scale_out_var.aval))


def _eval(jaxpr, consts, args, plan: _Plan, fuser):
    env = {}

    def read(a):
        return a.val if isinstance(a, jcore.Literal) else env[a]

    def write(v, val):
        env[v] = val

    for v, c in zip(jaxpr.constvars, consts):
        write(v, c)
    for v, a in zip(jaxpr.invars, args):
        write(v, a)
    for i, eqn in enumerate(jaxpr.eqns):
        for m in plan.emit.get(i, ()):
            _emit(m, read, write, fuser)
        if i in plan.skip:
            continue
        params = eqn.params
        if i in plan.children:
            params = dict(params)
            for (k, j), sub in plan.children[i].items():
                orig = params[k] if j is None else params[k][j]
                new = _rewrite(orig, sub, fuser)
                if j is None:
                    params[k] = new
                else:
                    seq = list(params[k])
                    seq[j] = new
                    params[k] = type(params[k])(seq)
        bind_params = eqn.primitive.get_bind_params(params)
        if isinstance(bind_params, tuple):  # older JAX: (subfuns, params)
            subfuns, bind_params = bind_params
        else:
            subfuns = ()
        with eqn.ctx.manager if hasattr(eqn, "ctx") else contextlib.nullcontext():
            ans = eqn.primitive.bind(*subfuns, *[read(a) for a in eqn.invars], **bind_params)
        if eqn.primitive.multiple_results:
            for v, a in zip(eqn.outvars, ans):
                write(v, a)
        else:
            write(eqn.outvars[0], ans)
    for m in plan.emit.get(len(jaxpr.eqns), ()):
        _emit(m, read, write, fuser)
    return [read(a) for a in jaxpr.outvars]


def _rewrite(orig, plan: _Plan, fuser):
    """``orig`` (Jaxpr or ClosedJaxpr) with the plan applied, same signature."""
    closed = isinstance(orig, jcore.ClosedJaxpr)
    consts = orig.consts if closed else ()
    jaxpr = plan.jaxpr  # the original, with norm calls inlined: same inputs and outputs
    in_avals = [v.aval for v in jaxpr.invars]
    with _shard_map_context(plan.context):
        new, new_consts = _trace_to_jaxpr(
            lambda *a: _eval(jaxpr, consts, a, plan, fuser), in_avals, jaxpr.debug_info)
    old_out = [v.aval for v in jaxpr.outvars]
    new_out = [v.aval for v in new.outvars]
    for a, b in zip(old_out, new_out):
        if a.shape != b.shape or a.dtype != b.dtype:
            raise AssertionError(f"jax_fusedar.fuse changed an output type: {a} -> {b}")
    if closed:
        return jcore.ClosedJaxpr(new, new_consts)
    if new_consts:
        raise AssertionError("jax_fusedar.fuse: a rewritten open jaxpr captured constants "
                             f"({len(new_consts)}); please report this form")
    return new


# --- the transform -------------------------------------------------------------------------------

class FusedFunction:
    """The callable returned by :func:`fuse`; see the module docstring."""

    def __init__(self, fn, *, mesh, axis_name, workspace, max_tokens, backend,
                 allow_rounding_change, use_oneshot, strict, log_level):
        self.fn = fn
        self.mesh = mesh
        self.axis_name = axis_name
        self.max_tokens = max_tokens
        self.backend = backend
        self.allow_rounding_change = bool(allow_rounding_change)
        self.use_oneshot = use_oneshot
        self.strict = strict
        self.log_level = log_level
        self.given_workspace = workspace
        self.workspaces = []        # the ones this transform created
        self.report: Optional[FusionReport] = None
        self._jitted = jax.jit(self._run)
        functools.update_wrapper(self, fn, updated=())

    # workspaces -----------------------------------------------------------------------------
    def _workspace_for(self, m: _Match, world: int):
        ws = self.given_workspace
        if ws is not None:
            if ws.dtype.name != m.dtype:
                raise _Reject(f"the workspace is for {ws.dtype.name}, the site is {m.dtype}")
            if not ws.is_buffer_size_sufficient(m.tokens, m.hidden):
                raise _Reject(f"tokens {m.tokens} x hidden {m.hidden} > workspace max "
                              f"{ws.max_token_num} x {ws.hidden_dim}")
            return ws
        if self.max_tokens is not None and m.tokens > self.max_tokens:
            raise _Reject(f"tokens {m.tokens} > max_tokens {self.max_tokens}")
        for ws in reversed(self.workspaces):
            if not ws.destroyed and ws.dtype.name == m.dtype and \
                    ws.is_buffer_size_sufficient(m.tokens, m.hidden):
                return ws
        from .workspace import create_allreduce_fusion_workspace
        if self.mesh.shape[self.axis_name] != world:
            raise _Reject(f"the shard_map's axis {self.axis_name!r} has size {world}, the "
                          f"mesh given to fuse has {self.mesh.shape[self.axis_name]}")
        want = max([m.tokens] + [ws.max_token_num * ws.hidden_dim // m.hidden
                                 for ws in self.workspaces if ws.dtype.name == m.dtype])
        try:
            ws = create_allreduce_fusion_workspace(self.mesh, self.axis_name,
                                                   max_token_num=want, hidden_dim=m.hidden,
                                                   dtype=m.dtype, backend=self.backend)
        except (ValueError, RuntimeError, MemoryError) as e:
            raise _Reject(f"cannot create a workspace: {e}") from None
        self.workspaces.append(ws)
        return ws

    def close(self) -> None:
        """Destroys the workspaces this transform created (programs using them must not
        run afterwards)."""
        for ws in self.workspaces:
            ws.destroy()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # tracing --------------------------------------------------------------------------------
    def _run(self, *args, **kwargs):
        closed, out_shape = jax.make_jaxpr(self.fn, return_shape=True)(*args, **kwargs)
        flat, _ = jax.tree.flatten((args, kwargs))
        analyzer = _Analyzer(self, self.axis_name)
        plan = analyzer.plan(closed.jaxpr, "", None)
        self.report = FusionReport(analyzer.sites)
        log.log(self.log_level, "%s", self.report.line())
        outs = _eval(plan.jaxpr, closed.consts, flat, plan, self)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    def __call__(self, *args, **kwargs):
        return self._jitted(*args, **kwargs)

    def analyze(self, *args, **kwargs) -> FusionReport:
        """Traces ``fn`` at these arguments (arrays or ShapeDtypeStructs) and returns the
        report without running anything (workspaces are still created as needed)."""
        jax.eval_shape(self._run, *args, **kwargs)
        return self.report


def fuse(fn=None, *, mesh=None, axis_name: Optional[str] = None, workspace=None,
         max_tokens: Optional[int] = None, backend: Optional[str] = "auto",
         allow_rounding_change: bool = False, use_oneshot: Optional[bool] = None,
         strict: Optional[bool] = None, log_level: int = logging.INFO):
    """Returns ``fn`` with every matched all-reduce + residual add + RMSNorm (+ FP8 tail)
    replaced by :func:`jax_fusedar.allreduce_fusion`; see the module docstring.

    Args:
      fn: the function (its arguments: arrays or pytrees of arrays; bind static ones with
        ``functools.partial``). May itself be jitted, contain ``shard_map`` and loops.
      mesh, axis_name: where workspaces are created (the mesh ``fn``'s shard_map runs on,
        and its tensor-parallel axis; ``axis_name`` may be left out for a 1-D mesh).
      workspace: use this workspace instead (its mesh and axis); sites it cannot serve stay
        unfused.
      max_tokens: the largest site (tokens) to fuse with created workspaces.
      backend: passed to ``create_allreduce_fusion_workspace`` ("auto": the kernel on GPUs).
      allow_rounding_change: also fuse forms whose rounding differs from the fused op's
        (gamma multiplied in the activation dtype, a float32 gamma); reported per site.
      use_oneshot, strict: passed to every ``allreduce_fusion`` call.
      log_level: level of the one-line report logged at each trace.
    Can be used as a decorator: ``@functools.partial(fuse, mesh=mesh)``.
    """
    if fn is None:
        return functools.partial(fuse, mesh=mesh, axis_name=axis_name, workspace=workspace,
                                 max_tokens=max_tokens, backend=backend,
                                 allow_rounding_change=allow_rounding_change,
                                 use_oneshot=use_oneshot, strict=strict, log_level=log_level)
    if not callable(fn):
        raise TypeError(f"fuse: fn must be callable, got {fn!r}")
    if workspace is not None:
        from .workspace import AllReduceFusionWorkspace
        if not isinstance(workspace, AllReduceFusionWorkspace):
            raise TypeError("fuse: workspace must come from "
                            "jax_fusedar.create_allreduce_fusion_workspace")
        if mesh is not None and mesh is not workspace.mesh:
            raise ValueError("fuse: pass either mesh= or workspace=, not both")
        if axis_name is not None and axis_name != workspace.axis_name:
            raise ValueError(f"fuse: axis_name {axis_name!r} differs from the workspace's "
                             f"axis {workspace.axis_name!r}")
        mesh, axis_name = workspace.mesh, workspace.axis_name
    else:
        if mesh is None:
            raise ValueError("fuse needs mesh= (and axis_name=) to create workspaces, or "
                             "workspace=")
        if not isinstance(mesh, jax.sharding.Mesh):
            raise TypeError(f"fuse: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
        if axis_name is None:
            if len(mesh.axis_names) != 1:
                raise ValueError(f"fuse: the mesh has axes {tuple(mesh.axis_names)}; pass "
                                 f"axis_name= (the tensor-parallel axis)")
            axis_name = mesh.axis_names[0]
        if axis_name not in mesh.axis_names:
            raise ValueError(f"fuse: axis_name {axis_name!r} is not an axis of the mesh "
                             f"{tuple(mesh.axis_names)}")
    if max_tokens is not None and (isinstance(max_tokens, bool) or
                                   not isinstance(max_tokens, (int, np.integer)) or
                                   max_tokens <= 0):
        raise ValueError(f"fuse: max_tokens must be a positive integer, got {max_tokens!r}")
    if backend not in (None, "auto", "trtllm", "xla"):
        raise ValueError(f"fuse: backend must be 'auto', 'trtllm' or 'xla', got {backend!r}")
    for name, value in (("use_oneshot", use_oneshot), ("strict", strict)):
        if value is not None and not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"fuse: {name} must be None, True or False, got {value!r}")
    if isinstance(log_level, bool) or not isinstance(log_level, int):
        raise TypeError(f"fuse: log_level must be a logging level (int), got {log_level!r}")
    if not isinstance(allow_rounding_change, (bool, np.bool_)):
        raise TypeError(f"fuse: allow_rounding_change must be True or False, got "
                        f"{allow_rounding_change!r}")
    return FusedFunction(fn, mesh=mesh, axis_name=axis_name, workspace=workspace,
                         max_tokens=None if max_tokens is None else int(max_tokens),
                         backend=backend, allow_rounding_change=allow_rounding_change,
                         use_oneshot=use_oneshot, strict=strict, log_level=log_level)
