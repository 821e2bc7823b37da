"""Translation validation: a proven site's equations, evaluated in float64 on probe inputs of
the site's real shapes, must give the fused op's math.

The proof (norm_proof.py) reads the equations symbolically; this check runs them. The
matched equations (the norm, its gamma's broadcasts, the FP8 tail) are interpreted in numpy
float64 with every cast ignored (it checks the mathematics; where the roundings fall is the
proof's job), on a residual sum whose rows have very different scales (so eps and every
constant matter) and a gamma whose columns all differ (so a per-token factor cannot pass for
gamma, whatever the shape, T == H included). The result must equal what the proof claims,
``overall * r / sqrt(mean(r^2) + eps) * (weight_bias + col(gamma))`` (``col``: the steps of
gamma the rewrite replays, ``overall``: the float32 rounding of the program's constants, which
the proof bounds), and the FP8 tail's scale and quotient (with the program's own scale), to
1e-9: float64 evaluation noise. A site that fails is left unfused with the difference as its
reason.

Large sites are checked on a few rows (the norm is row-wise): the token dimension's size is
replaced in the equations' shape parameters, and where that is ambiguous (a shape the
substitution cannot tell apart) the check falls back to the full shape. Results are cached
per equation structure, so a model's repeated layers are checked once.
"""

from __future__ import annotations

import math

import numpy as np
from jax.extend import core as jcore

from . import graph as G
from .report import Reject

TOLERANCE = 1e-9
FULL_CHECK_ELEMENTS = 1 << 20  # sites up to this many elements are checked whole
_cache: dict = {}


class _Unsupported(Exception):
    pass


def _literal(a):
    return np.asarray(a.val, dtype=np.float64)


def _broadcast(x, shape, dims):
    expanded = [1] * len(shape)
    for src, dst in enumerate(dims):
        expanded[dst] = x.shape[src]
    return np.broadcast_to(x.reshape(expanded), shape)


def _eval_eqn(e, args, fix):
    n = G.name(e)
    p = e.params
    if n in G.NO_OPS or n in (G.CAST, "stop_gradient"):
        return [args[0]]
    if n in ("mul", "div", "add", "sub", "max", "min"):
        a, b = args
        fn = {
            "mul": np.multiply,
            "div": np.divide,
            "add": np.add,
            "sub": np.subtract,
            "max": np.maximum,
            "min": np.minimum,
        }[n]
        return [fn(a, b)]
    if n == "neg":
        return [-args[0]]
    if n == "abs":
        return [np.abs(args[0])]
    if n == "sqrt":
        return [np.sqrt(args[0])]
    if n == "rsqrt":
        return [1.0 / np.sqrt(args[0])]
    if n == "square":
        return [args[0] * args[0]]
    if n == "integer_pow":
        return [args[0] ** int(p["y"])]
    if n == "pow":
        return [np.power(args[0], args[1])]
    if n == "reduce_sum":
        return [np.sum(args[0], axis=tuple(p["axes"]))]
    if n == "reduce_max":
        return [np.max(args[0], axis=tuple(p["axes"]))]
    if n == "broadcast_in_dim":
        return [_broadcast(args[0], fix(tuple(p["shape"])), p["broadcast_dimensions"])]
    if n == "reshape":
        return [np.reshape(args[0], fix(tuple(p["new_sizes"])))]
    if n == "squeeze":
        return [np.squeeze(args[0], axis=tuple(p["dimensions"]))]
    if n == "expand_dims":
        return [np.expand_dims(args[0], tuple(p["dimensions"]))]
    if n == "clamp":
        lo, x, hi = args
        return [np.minimum(np.maximum(x, lo), hi)]
    if n in G.CALLS and n not in G.CUSTOM_RULE_CALLS:
        sub = G.open_jaxpr(p[G.CALLS[n]])
        consts = getattr(p[G.CALLS[n]], "consts", ())
        return _eval_jaxpr(sub, consts, args, fix)
    raise _Unsupported(n)


def _eval_jaxpr(jaxpr, consts, args, fix):
    env = {}

    def read(a):
        return _literal(a) if isinstance(a, jcore.Literal) else env[a]

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = np.asarray(c, np.float64)
    for v, a in zip(jaxpr.invars, args):
        env[v] = a
    for e in jaxpr.eqns:
        for v, val in zip(e.outvars, _eval_eqn(e, [read(a) for a in e.invars], fix)):
            env[v] = val
    return [read(a) for a in jaxpr.outvars]


def _run(g, eqns, inputs, outs, fix):
    env = dict(inputs)

    def read(a):
        if isinstance(a, jcore.Literal):
            return _literal(a)
        if a not in env:
            raise _Unsupported(f"an input the proof did not account for ({a.aval.str_short()})")
        return env[a]

    for i in sorted(eqns):
        e = g.eqns[i]
        for v, val in zip(e.outvars, _eval_eqn(e, [read(a) for a in e.invars], fix)):
            env[v] = val
    return [env[v] for v in outs]


def _signature(g, eqns, roles):
    """The structure of the checked equations (what the check's outcome depends on)."""
    names = {}

    def ref(a):
        if isinstance(a, jcore.Literal):
            return ("lit", repr(np.asarray(a.val).tolist()), str(a.aval))
        if a not in names:
            names[a] = len(names)
        return ("var", names[a], str(a.aval))

    for role, v in roles:
        if v is not None and G.is_var(v):
            names.setdefault(v, role)
    out = []
    for i in sorted(eqns):
        e = g.eqns[i]
        params = tuple(
            sorted(
                (k, repr(v))
                for k, v in e.params.items()
                if k not in ("ctx_mesh", "out_sharding", "sharding")
            )
        )
        out.append(
            (G.name(e), params, tuple(ref(a) for a in e.invars), tuple(ref(v) for v in e.outvars))
        )
    return tuple(out), tuple(role for role, _ in roles)


def signature(g, eqns, roles):
    """The structure of ``eqns`` with the vars of ``roles`` ((name, var)) named by role:
    equal for two sets of equations that compute the same thing of their role vars.
    Value-preserving eqns (graph.NO_OPS: a sharding constraint, a checkpoint name) are left
    out, their results read as their operands."""
    alias = {}
    kept = set()
    for i in sorted(eqns):
        e = g.eqns[i]
        if G.name(e) in G.NO_OPS and len(e.invars) == 1 and G.is_var(e.invars[0]):
            alias[e.outvars[0]] = alias.get(e.invars[0], e.invars[0])
        else:
            kept.add(i)
    if not alias:
        return _signature(g, eqns, roles)

    class _View:  # the graph with the aliases substituted
        pass

    view = _View()
    view.eqns = {
        i: g.eqns[i].replace(
            invars=[alias.get(a, a) if G.is_var(a) else a for a in g.eqns[i].invars]
        )
        for i in kept
    }
    roles = [(role, alias.get(v, v) if G.is_var(v) else v) for role, v in roles]
    return _signature(view, kept, roles)


def _probe_rows(shape, rng):
    tokens = math.prod(shape[:-1])
    rows = np.arange(tokens)
    scales = np.exp2(((rows * 5) % 23) - 11.0)  # 2^-11 .. 2^11 across rows
    r = rng.standard_normal((tokens, shape[-1])) * scales[:, None]
    return r.reshape(shape)


def _col(gamma, ops):
    """gamma after the proof's replayed steps, in float64 (casts ignored, additions kept)."""
    for op in ops:
        if op[0] == "add":
            gamma = gamma + op[1]
    return gamma


def _reference(r, gamma, eps, weight_bias, proof, scale, bias=None):
    f = r
    inv = 1.0 / np.sqrt(np.mean(f * f, axis=-1, keepdims=True) + eps)
    g = (
        np.ones(f.shape[-1])
        if gamma is None
        else weight_bias + _col(gamma.reshape(-1), proof.gamma_ops)
    )
    y = proof.overall * f * inv * g
    if proof.bias is not None:
        y = y + bias.reshape(-1)
    out = {"norm": y}
    if proof.scale_out_var is not None:
        s = np.maximum(np.max(np.abs(y), axis=-1, keepdims=True) / 448.0, 1.0 / (512 * 448))
        out["scale_out"] = s
        out["quant"] = np.clip(y / s, -448.0, 448.0)
    elif proof.quant_var is not None:
        out["quant"] = np.clip(y / scale, -448.0, 448.0)
    return out


def _check_once(g, proof, r_var, restricted_dim, restricted_size):
    shape = G.shape(r_var)
    m = len(shape) - 1

    if restricted_dim is None:

        def fix(s):
            return s

        probe_shape = shape
    else:
        full = shape[restricted_dim]

        def fix(s):
            if len(s) in (m, m + 1) and s[restricted_dim] == full:
                return s[:restricted_dim] + (restricted_size,) + s[restricted_dim + 1 :]
            return s

        probe_shape = fix(shape)
    rng = np.random.default_rng(20260922)
    r = _probe_rows(probe_shape, rng)
    inputs = {r_var: r}
    gamma = None
    if proof.gamma is not None:
        gamma = rng.uniform(0.5, 1.5, G.shape(proof.gamma))
        inputs[proof.gamma] = gamma
    bias = None
    if proof.bias is not None and proof.bias is proof.gamma:
        bias = gamma  # one array, both gamma and the bias
    elif proof.bias is not None:
        bias = rng.uniform(-0.5, 0.5, G.shape(proof.bias))
        inputs[proof.bias] = bias
    scale = 0.037
    if isinstance(proof.scale, jcore.Literal):  # the program's own scale
        scale = float(np.asarray(proof.scale.val, np.float64).reshape(-1)[0])
    elif proof.scale is not None:
        inputs[proof.scale] = np.full(G.shape(proof.scale), scale)
    names = ["norm"]
    outs = [proof.out_var]
    if proof.quant_var is not None:
        names.append("quant")
        outs.append(proof.quant_var)
    if proof.scale_out_var is not None:
        names.append("scale_out")
        outs.append(proof.scale_out_var)
    with np.errstate(all="ignore"):
        got = _run(g, proof.eqns, inputs, outs, fix)
    want = _reference(r, gamma, proof.eps, proof.weight_bias, proof, scale, bias)
    worst = 0.0
    for name, value in zip(names, got):
        ref = want[name]
        value = np.asarray(value, np.float64).reshape(ref.shape)
        err = np.abs(value - ref) / np.maximum(np.abs(ref), 1e-30)
        worst = max(worst, float(np.max(err)) if err.size else 0.0)
        if not np.all(np.isfinite(value)) or worst > TOLERANCE:
            return (
                f"the site's {name} output differs from the fused op's by {worst:.3g} "
                "(relative) on probe inputs; please report this form"
            )
    return None


def check(g: G.Graph, proof, r_var) -> None:
    """Raises Reject when the proven site's equations do not compute the fused op's math."""
    roles = [("r", r_var), ("gamma", proof.gamma), ("scale", proof.scale), ("bias", proof.bias)]
    # The outcome depends on the equations and on the formula the proof claims for them.
    key = (
        _signature(g, proof.eqns, roles),
        proof.eps,
        proof.weight_bias,
        proof.gamma_ops,
        proof.bias_ops,
        proof.overall,
        proof.pattern,
        proof.out_var is not None,
        proof.quant_var is not None,
        proof.scale_out_var is not None,
    )
    if key in _cache:
        problem = _cache[key]
    else:
        shape = G.shape(r_var)
        problem = None
        done = False
        if math.prod(shape) > FULL_CHECK_ELEMENTS and len(shape) > 1:
            dim = int(np.argmax(shape[:-1]))
            others = math.prod(shape) // shape[dim]
            size = max(2, min(shape[dim], FULL_CHECK_ELEMENTS // max(others, 1)))
            try:
                problem = _check_once(g, proof, r_var, dim, size)
                done = True
            except (_Unsupported, ValueError, IndexError):
                done = False  # a shape the substitution could not follow: check it whole
        if not done:
            try:
                problem = _check_once(g, proof, r_var, None, None)
            except _Unsupported as e:
                problem = f"the norm could not be checked on probe inputs ({e})"
            except (ValueError, IndexError) as e:
                problem = f"the norm could not be checked on probe inputs ({e})"
        _cache[key] = problem
    if problem:
        raise Reject(problem)
