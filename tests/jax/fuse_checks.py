"""What the tests of jax_fusedar.fuse hold a fused program to (docs/fusion_pass.md, "The
bound"), and the programs they build (a site in one shard_map, the row-parallel linear).

Exactness is compared with XLA computing every rounding the programs write (``compiled``).
With ``xla_allow_excess_precision`` on (XLA's default) a bfloat16 value may stay float32
inside a fusion: the original program itself would not round where it says. The CPU suite's
XLA_FLAGS turn it off too (tests/cpu_devices.py); the option keeps it off under other flags.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import NamedSharding, PartitionSpec as P

import jax_fusedar as jf
from tests.jax.cpu_helpers import bits
from tests.oracles.oracle import ulp

T, H, F = 8, 64, 128  # tokens, hidden size, the linear's input features
EPS = 1e-6
MESH = jax.make_mesh((8,), ("tp",))

# XLA rounds where the program says (a per-compilation option: the rest of the suite keeps
# its flags).
EXACT_ROUNDING = {"xla_allow_excess_precision": False}

# A difference between the fused op and the program that float32 arithmetic alone explains
# (another order of operations, a float32 constant for 1/H) moves the value before its last
# rounding by a few float32 ulps: it can tip that rounding only where the exact value lies
# this close (relative) to the midpoint of two neighbours in T.
BORDERLINE = 2.0**-18


def compiled(fn):
    """``fn`` jitted with XLA computing the roundings as written."""
    return jax.jit(fn, compiler_options=EXACT_ROUNDING)


def fuse_and_run(fn, args, mesh, *, jit=compiled, grads=False, workspace=None, **kw):
    """(fused program, its outputs, the original's), fused on the xla backend over "tp" (or on
    ``workspace``), run under ``jit``; with ``grads``, then both programs' gradients w.r.t.
    every argument (random cotangents)."""
    if workspace is None:
        fused = jf.fuse(fn, mesh=mesh, axis_name="tp", backend="xla", **kw)
    else:
        fused = jf.fuse(fn, workspace=workspace, **kw)
    with jax.set_mesh(mesh):
        out, want = jit(fused)(*args), jit(fn)(*args)
        if not grads:
            return fused, out, want
        rng = np.random.default_rng(9)
        cts = [
            jnp.asarray(rng.standard_normal(o.shape), jnp.float32)
            for o in jax.eval_shape(fn, *args)
        ]

        def grad(f):
            loss = lambda *a: sum(jnp.sum(o.astype(jnp.float32) * c) for o, c in zip(f(*a), cts))
            return jit(jax.grad(loss, argnums=tuple(range(len(args)))))(*args)

        return fused, out, want, grad(fused), grad(fn)


def assert_bit_equal(a, b, what=""):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(bits(u), bits(v), err_msg=what)


def assert_equal_values(a, b):
    """The pytrees' leaves hold the same values (compared in float32)."""
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(u, np.float32), np.asarray(v, np.float32))


def assert_close(a, b, bound, floor=1e-30):
    """Per leaf: max |a - b| <= bound * max(max |b|, floor)."""
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        u, v = np.asarray(u, np.float64), np.asarray(v, np.float64)
        err, scale = np.max(np.abs(u - v)), max(np.max(np.abs(v)), floor)
        assert err <= bound * scale, err / scale


def rms_norm(r, g, eps=EPS):
    """RMSNorm in the fused op's own order: float32 inside, gamma multiplied in float32, the
    output rounded to r's dtype."""
    x = r.astype(jnp.float32)
    n = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return (n * g.astype(jnp.float32)).astype(r.dtype)


def norm_after(sum_fn):
    """A model of (x, w, res, g): ``r = sum_fn(x, w) + res``, returning ``(r, rms_norm(r, g))``."""

    def model(x, w, res, g):
        r = sum_fn(x, w) + res
        return r, rms_norm(r, g)

    return model


def one_scope(norm, extra_outs=None):
    """The per-rank body of a site in one shard_map: ``r = psum(x[0]) + res``, returning
    ``(r, norm(r, g))`` or ``extra_outs(r, y, *extra)``."""

    def body(x, res, g, *extra):
        r = jax.lax.psum(x[0], "tp") + res
        y = norm(r, g)
        return (r, y) if extra_outs is None else extra_outs(r, y, *extra)

    return body


def megatron_g(rule="custom_vjp", varying=True):
    """A psum over "tp" with a derivative rule of its own (Megatron's "g"): a custom_vjp whose
    backward is the identity (typed as the varying input when ``varying``, as check_vma
    needs), or a custom_jvp whose tangent rule is psum's own."""

    def g_op(v):
        return jax.lax.psum(v, "tp")

    if rule == "custom_jvp":
        g_op = jax.custom_jvp(g_op)
        g_op.defjvp(lambda p, t: (g_op(*p), jax.lax.psum(t[0], "tp")))
        return g_op
    g_op = jax.custom_vjp(g_op)
    back = (lambda ct: jax.lax.pcast(ct, "tp", to="varying")) if varying else (lambda ct: ct)
    g_op.defvjp(lambda v: (g_op(v), None), lambda _, ct: (back(ct),))
    return g_op


def statistic(r, eps):
    """``rsqrt(mean(f^2) + eps)`` per row, in float32 by XLA (as the program and the fused op
    compute it), as float64."""
    r32 = jnp.asarray(r).astype(jnp.float32)
    inv = compiled(lambda x: jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps))(r32)
    return np.asarray(inv, np.float64)


def assert_rounds_like_the_program(fused, program, exact, dtype, what=""):
    """The fused norm output is the program's bit for bit, except where both are the two
    neighbours in ``dtype`` of ``exact`` (the float64 formula with the program's roundings,
    before the last) and ``exact`` is within BORDERLINE of their midpoint. A rounding that
    the fused op drops, adds or moves shows as differences away from midpoints."""
    f = np.asarray(fused, np.float64)
    p = np.asarray(program, np.float64)
    exact = np.broadcast_to(np.asarray(exact, np.float64), f.shape)
    differ = ~((f == p) | (np.isnan(f) & np.isnan(p)))
    if not differ.any():
        return
    lo, hi = np.minimum(f, p)[differ], np.maximum(f, p)[differ]
    x = exact[differ]
    step = ulp(np.maximum(np.abs(lo), np.abs(hi)), dtype)
    neighbours = (hi - lo) <= step * (1 + 1e-12)
    mid = (lo + hi) / 2
    near = np.abs(x - mid) <= BORDERLINE * np.maximum(np.abs(x), 1e-300)
    bad = ~(neighbours & near)
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {f.size} elements differ from the program away from a "
        f"rounding midpoint, e.g. fused {lo[bad][:3]} / program {hi[bad][:3]} at exact "
        f"{x[bad][:3]}"
    )


def norm_units(y, r, col, inv, dtype):
    """|y - exact| in the documented unit of norm_out (docs/fusion_pass.md): ``ulp_T(|r|) *
    inv * |col| + ulp_T(|exact|)``, ``exact = r * inv * col`` in float64."""
    r = np.asarray(r, np.float64)
    exact = r * inv * col
    unit = ulp(np.abs(r), dtype) * inv * np.abs(col) + ulp(exact, dtype)
    return np.abs(np.asarray(y, np.float64) - exact) / unit


def scope_operands(
    dtype="bfloat16", gamma_dtype=None, shape=(6, H), seed=0, *, gamma=None, mesh=None
):
    """(x, residual, gamma) of a site in one shard_map over "tp" (``mesh``, default MESH): x
    [8, *shape] split over "tp" (each rank's partial sum), the residual ``shape`` replicated,
    gamma (default near 1) in ``gamma_dtype`` (default ``dtype``)."""
    rng = np.random.default_rng(seed)
    x = jax.device_put(
        jnp.asarray(rng.standard_normal((8,) + shape), dtype), NamedSharding(mesh or MESH, P("tp"))
    )
    res = jnp.asarray(rng.standard_normal(shape), dtype)
    if gamma is None:
        gamma = 1 + 0.1 * rng.standard_normal(shape[-1])
    return x, res, jnp.asarray(gamma, gamma_dtype or dtype)


def smap(body, n_in=3, n_out=2, check_vma=True, mesh=None):
    """shard_map(body) over "tp" (``mesh``, default MESH): its first input split over "tp", the
    rest and the ``n_out`` outputs replicated."""
    return jax.shard_map(
        body,
        mesh=mesh or MESH,
        in_specs=(P("tp"),) + (P(),) * (n_in - 1),
        out_specs=(P(),) * n_out,
        check_vma=check_vma,
    )


def linear_operands(
    mesh,
    dtype=jnp.bfloat16,
    seed=0,
    *,
    w_shape=(F, H),
    w_spec=P("tp"),
    res_spec=P("dp"),
    g_spec=None,
):
    """(x, w, residual, gamma) of a row-parallel linear on ``mesh``: x [T, F] split over
    ("dp", "tp"), w (``w_shape``, scaled by 1/8) over ``w_spec``, the residual [T, H] over
    ``res_spec``, gamma near 1 (placed on the mesh as ``g_spec`` when given)."""
    rng = np.random.default_rng(seed)

    def put(a, spec):
        return jax.device_put(a, NamedSharding(mesh, spec))

    x = put(jnp.asarray(rng.standard_normal((T, F)), dtype), P("dp", "tp"))
    w = put(jnp.asarray(rng.standard_normal(w_shape) / 8, dtype), w_spec)
    res = put(jnp.asarray(rng.standard_normal((T, H)), dtype), res_spec)
    g = jnp.asarray(1 + 0.1 * rng.standard_normal(H), dtype)
    return x, w, res, g if g_spec is None else put(g, g_spec)


def row_parallel(mesh, body=None, n_out=1):
    """The per-linear shard_map: ``body(x, w)`` (default: the psum of x @ w over "tp") with
    x split over ("dp", "tp") and w over "tp", its ``n_out`` outputs over "dp"."""
    return jax.shard_map(
        body or (lambda x, w: jax.lax.psum(x @ w, "tp")),
        mesh=mesh,
        in_specs=(P("dp", "tp"), P("tp")),
        out_specs=P("dp") if n_out == 1 else (P("dp"),) * n_out,
    )
