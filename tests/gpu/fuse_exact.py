"""Per-process body of the GPU test of ``jax_fusedar.fuse`` on the forms whose roundings and
layouts tests/jax/test_fuse_exact.py proves on CPU, the kernel in place of each site (ranks
may share a GPU: no XLA collective is left). Every output, on fresh inputs (no stale buffer
can pass for an output), against the float64 result of the program's own roundings, in the
units of docs/fusion_pass.md, "The bound". ``platform="cpu"``: a dry run on CPU processes.
"""

from __future__ import annotations

import numpy as np

from tests.gpu.fuse_styles import _global, _setup, captured, fusion_facts, fusion_problems
from tests.oracles.oracle import ulp

EPS = 1e-6
TOKENS, HIDDEN = 64, 1024
BOUND = {"residual": 1.0, "norm": {"bfloat16": 3.0, "float32": 8.0}}


def _norm(jnp, jax, r, col32):
    x = r.astype(jnp.float32)
    n = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + EPS)
    return (n * col32).astype(r.dtype)


def _programs(jax, jnp, mesh):
    """name -> (fn, input dtype, col(g64): what the program multiplies, fused form wanted)."""
    from jax.sharding import PartitionSpec as P

    f32, tp = jnp.float32, P("tp")

    def smap(body, in_specs, out_specs=(P(), P())):
        return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)

    def psum(x):
        return jax.lax.psum(x[0], "tp")

    def one_scope(col32):
        def body(x, res, g):
            r = psum(x) + res
            return r, _norm(jnp, jax, r, col32(r, g))

        return smap(body, (tp, P(), P()))

    def residual_inside(x, res, g):
        s, res2 = smap(lambda x, res: (psum(x), -res), (tp, P()))(x, res)
        r = s + res2
        return r, _norm(jnp, jax, r, g.astype(f32))

    def two_sites(x, res, g):
        sites = smap(lambda x: (psum(x), jax.lax.psum(x[0] * 2, "tp")), (tp,))(x)
        r1, r2 = (s + res for s in sites)
        return r1, _norm(jnp, jax, r1, g.astype(f32)), r2, _norm(jnp, jax, r2, g.astype(f32))

    def fp8_without_norm(x, res, g):
        r = smap(psum, (tp,), P())(x) + res
        y32 = _norm(jnp, jax, r, g.astype(f32)).astype(f32)
        sc = jnp.maximum(jnp.max(jnp.abs(y32), -1, keepdims=True) / 448, 1 / (512 * 448))
        return r, jnp.clip(y32 / sc, -448, 448).astype(jnp.float8_e4m3fn).astype(f32), sc

    gemma = one_scope(lambda r, w: (1.0 + w.astype(f32)).astype(r.dtype).astype(f32))
    through_bf16 = one_scope(lambda r, g: g.astype(jnp.bfloat16).astype(f32))
    rounded = lambda g: g.astype(jnp.bfloat16).astype(np.float64)
    same = lambda g: g
    return {
        "gemma_scale_rounded_by_the_program": (
            gemma,
            "bfloat16",
            lambda g: rounded(1.0 + g),
            {"pattern": 1, "weight_bias": 0.0},
        ),
        "float32_model_gamma_through_bfloat16": (through_bf16, "float32", rounded, {"pattern": 1}),
        "residual_from_the_same_shard_map": (
            residual_inside,
            "bfloat16",
            same,
            {"pattern": 1, "negated_residual": True},
        ),
        "two_sites_on_one_shard_map": (two_sites, "bfloat16", same, {"pattern": 1, "sites": 2}),
        "per_linear_dynamic_fp8_without_the_norm": (
            fp8_without_norm,
            "bfloat16",
            same,
            {"pattern": 10},
        ),
    }


def _inputs(rng, world, dtype):
    import ml_dtypes

    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    x = rng.standard_normal((world, TOKENS, HIDDEN)).astype(np.float32).astype(dt)
    res = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32).astype(dt)
    g = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32).astype(dt)
    return x, res, g


def _exact(s64, res64, col, dtype):
    """The exact (float64) residual_out, its unit, norm_out and its unit (docs/fusion_pass.md)."""
    r64 = s64 + res64
    unit_r = ulp(np.abs(s64) + np.abs(res64), dtype)
    inv = 1.0 / np.sqrt(np.mean(r64 * r64, -1, keepdims=True) + EPS)
    y64 = r64 * inv * col
    return r64, unit_r, y64, unit_r * inv * np.abs(col) + ulp(y64, dtype)


def _units(got_r, got_y, s64, res64, col, dtype):
    """(residual_out, norm_out) errors in the documented units against float64."""
    r64, unit_r, y64, unit_y = _exact(s64, res64, col, dtype)
    e_r = float(np.max(np.abs(np.asarray(got_r, np.float64) - r64) / unit_r))
    if got_y is None:
        return e_r, None
    return e_r, float(np.max(np.abs(np.asarray(got_y, np.float64) - y64) / unit_y))


def _e4m3_step(m):
    """The spacing of e4m3 values at magnitude ``m`` (3 mantissa bits; subnormals below 2^-6)."""
    return np.exp2(np.floor(np.log2(np.maximum(m, 2.0**-6))) - 3)


def _fp8_check(codes, s64, res64, col, dtype, platform):
    """Dynamic FP8 codes against float64, in units of what the bounds allow each (limit 1.0):
    the quantizer reads a value within the norm_out bound, so the row's scale (amax / 448)
    moves by at most the largest such error, the quotient lands within ``p`` of the exact code,
    and e4m3 rounding adds half a step. On CPU a quarter unit more: XLA's CPU conversion to
    float8_e4m3fn gives 0 for some codes up to 0.2 (the unfused program's too)."""
    _, _, y64, unit_y = _exact(s64, res64, col, dtype)
    err = BOUND["norm"][dtype] * unit_y
    amax = np.max(np.abs(y64), -1, keepdims=True)
    room = np.max(err, -1, keepdims=True)
    floor = 1 / (512 * 448)
    s_exact = np.maximum(amax / 448, floor)
    s_lo, s_hi = np.maximum((amax - room) / 448, floor), np.maximum((amax + room) / 448, floor)
    q64 = y64 / s_exact
    p = err / s_lo + np.abs(y64) * (1 / s_lo - 1 / s_hi) + 1e-6 * np.abs(q64)
    allowed = p + 0.5 * _e4m3_step(np.abs(q64) + p) + (0.25 if platform == "cpu" else 0.0)
    ratio = np.abs(np.asarray(codes, np.float64) - q64) / allowed
    at = np.unravel_index(int(np.argmax(ratio)), ratio.shape)  # the worst code, to read
    worst = {"at": [int(i) for i in at], "code": float(np.asarray(codes)[at])}
    worst.update(exact=float(q64[at]), allowed=float(allowed[at]))
    return {"fp8_ratio": float(ratio[at]), "fp8_worst": worst}


def _args(jax, mesh, x, res, g):
    """x sharded over "tp", res and g replicated."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    return tuple(
        _global(jax, a, NamedSharding(mesh, s)) for a, s in ((x, P("tp")), (res, P()), (g, P()))
    )


def _fuse(jf, fn, mesh, platform):
    return jf.fuse(
        fn, mesh=mesh, axis_name="tp", backend="auto" if platform == "cuda" else "xla", strict=True
    )


def _one(jax, jf, name, spec, mesh, world, seed, platform):
    fn, dtype, col_of, want = spec
    x, res, g = _inputs(np.random.default_rng(seed), world, dtype)
    args = _args(jax, mesh, x, res, g)
    fused = _fuse(jf, fn, mesh, platform)
    try:
        with jax.set_mesh(mesh):
            compiled = jax.jit(fused).lower(*args).compile()
        out = fusion_facts(fused, compiled.as_text())
        out["patterns"] = [s.pattern for s in fused.report.sites]
        out["weight_bias"] = [s.weight_bias for s in fused.report.sites]
        with jax.set_mesh(mesh):
            got = [np.asarray(o.addressable_data(0), np.float64) for o in compiled(*args)]
    finally:
        fused.close()
    x64, res64 = np.asarray(x, np.float64), np.asarray(res, np.float64)
    col = col_of(np.asarray(g, np.float64))
    if want.get("negated_residual"):
        res64 = -res64
    s64 = np.sum(x64, axis=0)
    errors = [_units(got[0], got[1] if want["pattern"] == 1 else None, s64, res64, col, dtype)]
    if want.get("sites") == 2:
        errors.append(_units(got[2], got[3], 2 * s64, res64, col, dtype))
    out["errors"] = errors
    if want["pattern"] == 10:
        out.update(_fp8_check(got[1], s64, res64, col, dtype, platform))
    out["finite"] = bool(all(np.isfinite(o).all() for o in got))
    return out


def _two_transforms(jax, jf, mesh, world, seed, platform):
    """Two live transforms of one program: both fuse to the same bits, the second workspace
    named apart (kernel workspaces of one key are refused)."""
    import jax.numpy as jnp

    fn = _programs(jax, jnp, mesh)["gemma_scale_rounded_by_the_program"][0]
    args = _args(jax, mesh, *_inputs(np.random.default_rng(seed), world, "bfloat16"))
    first, second = _fuse(jf, fn, mesh, platform), _fuse(jf, fn, mesh, platform)
    try:
        with jax.set_mesh(mesh):
            a = [np.asarray(o.addressable_data(0)) for o in jax.jit(first)(*args)]
            b = [np.asarray(o.addressable_data(0)) for o in jax.jit(second)(*args)]
        return {
            "fused": [len(first.report.fused), len(second.report.fused)],
            "names": [[w.name for w in first.workspaces], [w.name for w in second.workspaces]],
            "backends": [w.backend for w in first.workspaces + second.workspaces],
            "same_bits": all(
                np.array_equal(u.view(np.uint8), v.view(np.uint8)) for u, v in zip(a, b)
            ),
        }
    finally:
        first.close()
        second.close()


def worker(rank, world, chan, *, port, seed, platform="cuda"):
    jax = _setup(rank, world, port, platform)
    import jax.numpy as jnp
    import jax_fusedar as jf

    mesh = jax.make_mesh((world,), ("tp",))
    results = {"rank": rank, "jax": jax.__version__, "cases": {}}
    for k, (name, spec) in enumerate(_programs(jax, jnp, mesh).items()):
        run = lambda: _one(jax, jf, name, spec, mesh, world, seed + k, platform)
        results["cases"][name] = captured(run)
        chan.barrier(f"case {name}")  # every rank runs the cases in one order
    run = lambda: _two_transforms(jax, jf, mesh, world, seed, platform)
    results["two_transforms"] = captured(run)
    chan.barrier("two transforms")
    jax.distributed.shutdown()
    return results


def check(results, *, platform="cuda"):
    """The problems found in the ranks' results (empty: pass)."""
    problems = []
    for r in results:
        for name, v in r["cases"].items():
            where = f"rank {r['rank']} {name}"
            problems += fusion_problems(where, v, platform)
            if "error" in v:
                continue
            if v["xla_collectives"] and platform == "cuda":
                problems.append(f"{where}: XLA collectives left: {v['xla_collectives']}")
            if not v["finite"]:
                problems.append(f"{where}: non-finite outputs")
            norm_bound = BOUND["norm"]["float32" if name.startswith("float32") else "bfloat16"]
            for e_r, e_y in v["errors"]:
                if e_r > BOUND["residual"]:
                    problems.append(f"{where}: residual_out {e_r:.3g} units > {BOUND['residual']}")
                if e_y is not None and e_y > norm_bound:
                    problems.append(f"{where}: norm_out {e_y:.3g} units > {norm_bound}")
            if v.get("fp8_ratio", 0.0) > 1.0:
                problems.append(f"{where}: FP8 codes {v['fp8_ratio']:.3g} x the bound off")
        t = r.get("two_transforms", {"error": "missing"})
        if "error" in t:
            problems += fusion_problems(f"rank {r['rank']} two transforms", t, platform)
            continue
        if t["fused"] != [1, 1] or not t["same_bits"]:
            problems.append(f"rank {r['rank']} two transforms: {t}")
        if platform == "cuda" and t["names"] != [[None], ["jax_fusedar.fuse.2"]]:
            problems.append(f"rank {r['rank']} two transforms: workspace names {t['names']}")
    return problems
