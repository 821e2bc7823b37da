"""Per-process body of the GPU test of ``jax_fusedar.fuse`` on the forms whose roundings and
layouts the CPU tests prove (tests/jax/test_fuse_exact.py), with the FlashInfer kernel in
place of each site: one ``jax.distributed`` process per rank, rank r on GPU ``r %
gpu_count`` (ranks may share GPU 0: the kernel's peers meet in its own buffers, and no XLA
collective is left in these programs).

Each case fuses a program (``backend="auto"``, ``strict=True``), counts the fused custom
calls in the compiled HLO, runs it on fresh random inputs (a JAX program writes new arrays:
no stale buffer can pass for an output), and measures every output against the exact
(float64) result of the program's formula with the program's own roundings (gamma rounded
where the program rounds it), in the documented units (docs/fusion_pass.md, "The bound"):
residual_out within 1, norm_out within 3 (bfloat16) or 8 (float32), FP8 codes within what
that norm bound and e4m3's rounding allow (_fp8_check). ``platform="cpu"`` runs the same
steps on CPU processes (gloo collectives, the reference lowering) as a dry run of everything
but the kernel.
"""

from __future__ import annotations

import re

import numpy as np

from tests.gpu.fuse_styles import COLLECTIVES, _global, _setup, captured, fusion_problems

EPS = 1e-6
TOKENS, HIDDEN = 64, 1024
BOUND = {"residual": 1.0, "norm": {"bfloat16": 3.0, "float32": 8.0}}


def _ulp(x, dtype):
    from tests.oracles.oracle import ulp

    return ulp(x, dtype)


def _norm(jnp, jax, r, col32):
    x = r.astype(jnp.float32)
    n = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + EPS)
    return (n * col32).astype(r.dtype)


def _programs(jax, jnp, mesh, world):
    """name -> (fn, dtype, gamma dtype, col(g64) -> the value the program multiplies, what
    the fused program must look like)."""
    from jax.sharding import PartitionSpec as P

    f32 = jnp.float32

    def one_scope(norm):
        def body(x, res, g):
            r = jax.lax.psum(x[0], "tp") + res
            return r, norm(r, g)

        return jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(), P()), out_specs=(P(), P()))

    def gemma_rounded(r, w):
        return _norm(jnp, jax, r, (1.0 + w.astype(f32)).astype(r.dtype).astype(f32))

    def gamma_through_bf16(r, g):
        return _norm(jnp, jax, r, g.astype(jnp.bfloat16).astype(f32))

    def residual_inside(x, res, g):
        s, res2 = jax.shard_map(
            lambda x, res: (jax.lax.psum(x[0], "tp"), -res),
            mesh=mesh,
            in_specs=(P("tp"), P()),
            out_specs=(P(), P()),
        )(x, res)
        r = s + res2
        return r, _norm(jnp, jax, r, g.astype(f32))

    def two_sites(x, res, g):
        s1, s2 = jax.shard_map(
            lambda x: (jax.lax.psum(x[0], "tp"), jax.lax.psum(x[0] * 2, "tp")),
            mesh=mesh,
            in_specs=(P("tp"),),
            out_specs=(P(), P()),
        )(x)
        r1, r2 = s1 + res, s2 + res
        return r1, _norm(jnp, jax, r1, g.astype(f32)), r2, _norm(jnp, jax, r2, g.astype(f32))

    def fp8_without_norm(x, res, g):
        s = jax.shard_map(
            lambda x: jax.lax.psum(x[0], "tp"), mesh=mesh, in_specs=(P("tp"),), out_specs=P()
        )(x)
        r = s + res
        y32 = _norm(jnp, jax, r, g.astype(f32)).astype(f32)
        sc = jnp.maximum(jnp.max(jnp.abs(y32), -1, keepdims=True) / 448, 1 / (512 * 448))
        return r, jnp.clip(y32 / sc, -448, 448).astype(jnp.float8_e4m3fn).astype(f32), sc

    plain = np.float64
    return {
        "gemma_scale_rounded_by_the_program": (
            one_scope(gemma_rounded),
            "bfloat16",
            "bfloat16",
            lambda g: (1.0 + g).astype(jnp.bfloat16).astype(plain),
            {"pattern": 1, "weight_bias": 0.0},
        ),
        "float32_model_gamma_through_bfloat16": (
            one_scope(gamma_through_bf16),
            "float32",
            "float32",
            lambda g: g.astype(jnp.bfloat16).astype(plain),
            {"pattern": 1},
        ),
        "residual_from_the_same_shard_map": (
            residual_inside,
            "bfloat16",
            "bfloat16",
            lambda g: g,
            {"pattern": 1, "negated_residual": True},
        ),
        "two_sites_on_one_shard_map": (
            two_sites,
            "bfloat16",
            "bfloat16",
            lambda g: g,
            {"pattern": 1, "sites": 2},
        ),
        "per_linear_dynamic_fp8_without_the_norm": (
            fp8_without_norm,
            "bfloat16",
            "bfloat16",
            lambda g: g,
            {"pattern": 10},
        ),
    }


def _inputs(rng, world, dtype, gamma_dtype):
    import ml_dtypes

    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    gdt = np.dtype(ml_dtypes.bfloat16) if gamma_dtype == "bfloat16" else np.dtype(gamma_dtype)
    x = rng.standard_normal((world, TOKENS, HIDDEN)).astype(np.float32).astype(dt)
    res = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32).astype(dt)
    g = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32).astype(gdt)
    return x, res, g


def _units(got_r, got_y, s64, res64, col, dtype):
    """(residual_out, norm_out) errors in the documented units against float64."""
    r64 = s64 + res64
    unit_r = _ulp(np.abs(s64) + np.abs(res64), dtype)
    e_r = float(np.max(np.abs(np.asarray(got_r, np.float64) - r64) / unit_r))
    if got_y is None:
        return e_r, None
    inv = 1.0 / np.sqrt(np.mean(r64 * r64, -1, keepdims=True) + EPS)
    y64 = r64 * inv * col
    unit_y = unit_r * inv * np.abs(col) + _ulp(y64, dtype)
    return e_r, float(np.max(np.abs(np.asarray(got_y, np.float64) - y64) / unit_y))


def _e4m3_step(m):
    """The spacing of e4m3 values at magnitude ``m`` (3 mantissa bits; subnormals below 2^-6)."""
    return np.exp2(np.floor(np.log2(np.maximum(m, 2.0**-6))) - 3)


def _fp8_check(codes, s64, res64, col, dtype, platform):
    """Dynamic FP8 codes of the normalized sum against float64, in units of what the documented
    bounds allow each code: the quantizer reads a normalized value within the norm_out bound
    (BOUND["norm"] units, _units) of the exact one, so the row's scale (its amax / 448) moves
    by at most the largest of those; the quotient is then within ``p`` of the exact code, and
    its rounding to e4m3 adds half a step at that magnitude. 1.0 is the limit. On CPU
    processes a quarter of a unit more: XLA's CPU conversion to float8_e4m3fn (the dry
    run's) gives 0 for some codes up to 0.2, the unfused program's too."""
    r64 = s64 + res64
    inv = 1.0 / np.sqrt(np.mean(r64 * r64, -1, keepdims=True) + EPS)
    y64 = r64 * inv * col
    unit_y = _ulp(np.abs(s64) + np.abs(res64), dtype) * inv * np.abs(col) + _ulp(y64, dtype)
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
    return {
        "fp8_ratio": float(ratio[at]),
        "fp8_worst": {
            "at": [int(i) for i in at],
            "code": float(np.asarray(codes)[at]),
            "exact": float(q64[at]),
            "allowed": float(allowed[at]),
        },
    }


def _args(jax, mesh, x, res, g):
    """x sharded over "tp", res and g replicated."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    return tuple(
        _global(jax, a, NamedSharding(mesh, s)) for a, s in ((x, P("tp")), (res, P()), (g, P()))
    )


def _one(jax, jf, name, spec, mesh, world, seed, platform):
    from jax_fusedar.ops.dense import FFI_TARGET

    fn, dtype, gamma_dtype, col_of, want = spec
    rng = np.random.default_rng(seed)
    x, res, g = _inputs(rng, world, dtype, gamma_dtype)
    args = _args(jax, mesh, x, res, g)
    fused = jf.fuse(
        fn, mesh=mesh, axis_name="tp", backend="auto" if platform == "cuda" else "xla", strict=True
    )
    try:
        with jax.set_mesh(mesh):
            compiled = jax.jit(fused).lower(*args).compile()
        hlo = compiled.as_text()
        rep = fused.report
        out = {
            "report": rep.line(),
            "sites": len(rep.sites),
            "fused": len(rep.fused),
            "patterns": [s.pattern for s in rep.sites],
            "weight_bias": [s.weight_bias for s in rep.sites],
            "custom_calls": len(re.findall(rf'custom_call_target="{FFI_TARGET}"', hlo)),
            "xla_collectives": [c for c in COLLECTIVES if re.search(rf"\b{c}(-start)?\(", hlo)],
        }
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
    """Two live transforms of one program: the second one's workspace takes its own name
    (kernel workspaces of one key are refused), both fuse, both give the same bits."""
    import jax.numpy as jnp

    fn = _programs(jax, jnp, mesh, world)["gemma_scale_rounded_by_the_program"][0]
    x, res, g = _inputs(np.random.default_rng(seed), world, "bfloat16", "bfloat16")
    args = _args(jax, mesh, x, res, g)
    backend = "auto" if platform == "cuda" else "xla"
    first = jf.fuse(fn, mesh=mesh, axis_name="tp", backend=backend, strict=True)
    second = jf.fuse(fn, mesh=mesh, axis_name="tp", backend=backend, strict=True)
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
    for k, (name, spec) in enumerate(_programs(jax, jnp, mesh, world).items()):
        results["cases"][name] = captured(
            lambda: _one(jax, jf, name, spec, mesh, world, seed + k, platform)
        )
        chan.barrier(f"case {name}")  # every rank runs the cases in one order
    results["two_transforms"] = captured(
        lambda: _two_transforms(jax, jf, mesh, world, seed, platform)
    )
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
            dtype = "float32" if name.startswith("float32") else "bfloat16"
            for e_r, e_y in v["errors"]:
                if e_r > BOUND["residual"]:
                    problems.append(f"{where}: residual_out {e_r:.3g} units > {BOUND['residual']}")
                if e_y is not None and e_y > BOUND["norm"][dtype]:
                    problems.append(f"{where}: norm_out {e_y:.3g} units > {BOUND['norm'][dtype]}")
            if v.get("fp8_ratio", 0.0) > 1.0:
                problems.append(f"{where}: FP8 codes {v['fp8_ratio']:.3g} x the bound off")
        t = r.get("two_transforms", {"error": "missing"})
        if "error" in t:
            problems.append(
                f"rank {r['rank']} two transforms: {t['error']}\n{t.get('traceback', '')}"
            )
            continue
        if t["fused"] != [1, 1] or not t["same_bits"]:
            problems.append(f"rank {r['rank']} two transforms: {t}")
        if platform == "cuda" and t["names"] != [[None], ["jax_fusedar.fuse.2"]]:
            problems.append(f"rank {r['rank']} two transforms: workspace names {t['names']}")
    return problems
