"""Differential harness of jax_fusedar.fuse: many generated programs (norm spellings,
constants, broadcasts, dtypes, shapes including T == H, wrappers, FP8 tails), each run as
written and through fuse, forward and jax.grad.

Every program must come out either fused, and then within the documented bound of the
original (docs/fusion_pass.md, "The bound"), or unfused with a reason from the catalog, and
then the very same program (bit-equal outputs and gradients). Each generated program also
says which of the two it must be, so refusing everything cannot pass. The default run takes
a fixed sample; ``pytest -m sweep`` runs every combination.
"""

import dataclasses
import itertools
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from tests.jax import cpu_helpers
from tests.oracles.oracle import psum_error_bound, ulp
import jax_fusedar as jf

cpu_helpers.require_host_devices()

MESH = jax.make_mesh((8,), ("tp",))
EPS = 1e-6
f32 = jnp.float32

# The documented bound (docs/fusion_pass.md, "The bound"): a fused site is within the fused
# op's own error bound (docs/numerics.md) of the exact (float64) result of the original
# formula, in the oracle's units (tests/oracles/oracle.py): residual_out in
# ulp_T(|s| + |residual|); norm_out in ulp_T(|s| + |residual|) * inv * |wb + gamma| +
# ulp_T(|norm_out|). Forms fused only with allow_rounding_change get one more unit for the
# rounding they move. The original itself is no closer to exact than its own all-reduce
# allows (XLA's float16 psum on CPU and NCCL's rings round after every addition).
RESIDUAL_BOUND = 1.0
NORM_BOUND = {"bfloat16": 3.0, "float16": 3.0, "float32": 8.0}
CHANGED_NORM_BOUND = {"bfloat16": 4.0, "float16": 4.0, "float32": 8.0}
# Gradients: per tensor, max |fused - original| <= GRAD_BOUND * eps_T * max |original|.
GRAD_BOUND = {"bfloat16": 4.0, "float16": 4.0, "float32": 64.0}
# Through a fused FP8 output (a cast to float8_e4m3fn passes tangents on, rounded to
# e4m3's 3 mantissa bits, so one ulp of difference upstream can move a step): relative to
# the largest gradient, two e4m3 steps. A zero derivative would be off by 1.
FP8_GRAD_BOUND = 0.25


# --- norm spellings -------------------------------------------------------------------------------
# Each takes the residual sum r (dtype T) and gamma g, and returns the norm output.


def _f(r):
    return r.astype(f32)


def _ms(x):
    return jnp.mean(x * x, axis=-1, keepdims=True)


def rsqrt_mul(r, g):
    x = _f(r)
    return (x * jax.lax.rsqrt(_ms(x) + EPS) * g.astype(f32)).astype(r.dtype)


def sqrt_div(r, g):  # Hugging Face Flax's and Gemma's spelling
    x = _f(r)
    var = jnp.power(x, 2).mean(-1, keepdims=True)
    return (g.astype(f32) * x / jnp.sqrt(var + EPS)).astype(r.dtype)


def gamma_over_rms(r, g):  # gamma * x / rms
    x = _f(r)
    rms = jnp.sqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + EPS)
    return (g.astype(f32) * x / rms).astype(r.dtype)


def pow_minus_half(r, g):
    x = _f(r)
    return (x * (_ms(x) + EPS) ** -0.5 * g.astype(f32)).astype(r.dtype)


def sum_over_h(r, g):
    x = _f(r)
    return (
        x * jax.lax.rsqrt(jnp.sum(x**2, -1, keepdims=True) / x.shape[-1] + EPS) * g.astype(f32)
    ).astype(r.dtype)


def sum_times_inverse_h(r, g):
    x = _f(r)
    inv = jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) * (1.0 / x.shape[-1]) + EPS)
    return (g.astype(f32) * (inv * x)).astype(r.dtype)


def reciprocal_of_sqrt(r, g):
    x = _f(r)
    inv = jnp.reciprocal(jnp.sqrt(jnp.mean(jnp.square(x), -1) + EPS))[..., None]
    return (inv * x * g.astype(f32)).astype(r.dtype)


def linen(r, g):  # flax.linen.RMSNorm's sequence
    x = _f(r)
    ms = jnp.mean(jax.lax.square(x), axis=-1)
    y = _f(r) - jnp.zeros_like(ms)[..., None]
    inv = jax.lax.rsqrt(ms[..., None] + EPS)
    return (y * (inv * g.reshape((1,) * (r.ndim - 1) + (-1,)).astype(f32))).astype(r.dtype)


def gemma_one_plus(r, g):
    x = _f(r)
    return (x * jax.lax.rsqrt(_ms(x) + EPS) * (1.0 + g.astype(f32))).astype(r.dtype)


def no_gamma(r, g):
    x = _f(r)
    return (x * jax.lax.rsqrt(_ms(x) + EPS)).astype(r.dtype)


def constant_in_sum(r, g):  # rsqrt((sum + 1) / H): RMSNorm with eps = 1/H
    x = _f(r)
    return (
        x * jax.lax.rsqrt((jnp.sum(x * x, -1, keepdims=True) + 1.0) / x.shape[-1]) * g.astype(f32)
    ).astype(r.dtype)


def hf_gamma_after_cast(r, g):  # MaxText / Hugging Face: gamma multiplied in T
    x = _f(r)
    return (x * jax.lax.rsqrt(_ms(x) + EPS)).astype(r.dtype) * g.astype(r.dtype)


def hf_flax_float32_output(r, g):  # FlaxLlamaRMSNorm with a float32 weight
    x = _f(r)
    y = r / jnp.sqrt(jnp.power(x, 2).mean(-1, keepdims=True) + EPS)
    return g.astype(f32) * jnp.asarray(y, dtype=r.dtype)


# Not RMSNorm, or not the fused op's rounding: left alone with the reason.


def times_two_in_mean(r, g):
    x = _f(r)
    return (
        x
        * jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) * 2.0 / x.shape[-1] + EPS)
        * g.astype(f32)
    ).astype(r.dtype)


def rsqrt_mul_f32(r, g):
    x = _f(r)
    return x * jax.lax.rsqrt(_ms(x) + EPS) * g.astype(f32)


def eps_outside_sqrt(r, g):
    x = _f(r)
    return (x / (jnp.sqrt(_ms(x)) + EPS) * g.astype(f32)).astype(r.dtype)


def eps_as_max(r, g):
    x = _f(r)
    return (x * jax.lax.rsqrt(jnp.maximum(_ms(x), EPS)) * g.astype(f32)).astype(r.dtype)


def layer_norm(r, g):
    x = _f(r)
    c = x - jnp.mean(x, -1, keepdims=True)
    return (c * jax.lax.rsqrt(_ms(c) + EPS) * g.astype(f32)).astype(r.dtype)


def over_token_axis(r, g):
    x = _f(r)
    return (x * jax.lax.rsqrt(jnp.mean(x * x, axis=0, keepdims=True) + EPS) * g.astype(f32)).astype(
        r.dtype
    )


def per_token_factor(r, g):  # T == H: g[:, None] is a per-token value
    x = _f(r)
    return (x * jax.lax.rsqrt(_ms(x) + EPS) * g.astype(f32)[:, None]).astype(r.dtype)


def computed_in_t(r, g):
    return r * jax.lax.rsqrt(jnp.mean(r * r, -1, keepdims=True) + EPS) * g.astype(r.dtype)


def kept_in_float32(r, g):
    return rsqrt_mul_f32(r, g)


@dataclasses.dataclass(frozen=True)
class Spelling:
    norm: Callable
    expect: str  # "fused", "changed" (fused only with allow_rounding_change), or
    reason: str = ""  # the reason's start when not fused by default
    bias: float = 0.0
    gamma: bool = True
    only_square: bool = False  # needs T == H (a [T] vector passes for a [H] one)
    exact_in_f32: bool = False  # in float32 the site is fused (the refusal is about T)
    after: Optional[Callable] = None  # what the program does to the norm's output after it


SPELLINGS = {
    "rsqrt_mul": Spelling(rsqrt_mul, "fused"),
    "sqrt_div": Spelling(sqrt_div, "fused"),
    "gamma_over_rms": Spelling(gamma_over_rms, "fused"),
    "pow_minus_half": Spelling(pow_minus_half, "fused"),
    "sum_over_h": Spelling(sum_over_h, "fused"),
    "sum_times_inverse_h": Spelling(sum_times_inverse_h, "fused"),
    "reciprocal_of_sqrt": Spelling(reciprocal_of_sqrt, "fused"),
    "linen": Spelling(linen, "fused"),
    "gemma_one_plus": Spelling(gemma_one_plus, "fused", bias=1.0),
    "no_gamma": Spelling(no_gamma, "fused", gamma=False),
    "constant_in_sum": Spelling(constant_in_sum, "fused"),
    "hf_gamma_after_cast": Spelling(
        hf_gamma_after_cast, "changed", "gamma multiplied in {T} after the norm is rounded"
    ),
    "hf_flax_float32_output": Spelling(
        hf_flax_float32_output, "changed", "gamma multiplied in float32 after the norm is rounded"
    ),
    "times_two_in_mean": Spelling(times_two_in_mean, "refused", "the mean divides by 32"),
    "eps_outside_sqrt": Spelling(eps_outside_sqrt, "refused", "eps added after the square root"),
    "eps_as_max": Spelling(eps_as_max, "refused", "max of the mean of squares"),
    "layer_norm": Spelling(layer_norm, "refused", "LayerNorm (mean subtracted)"),
    "over_token_axis": Spelling(over_token_axis, "refused", "norm over axis 0"),
    # In float32 the norm without gamma is the site, the per-token factor stays after it.
    "per_token_factor": Spelling(
        per_token_factor,
        "refused",
        "a per-token factor",
        only_square=True,
        exact_in_f32=True,
        gamma=False,
        after=lambda y, g: y * g[:, None],
    ),
    "computed_in_t": Spelling(
        computed_in_t, "refused", "RMSNorm computed in {T}", exact_in_f32=True
    ),
    "kept_in_float32": Spelling(
        kept_in_float32, "refused", "the norm output is not cast back", exact_in_f32=True
    ),
}


# --- wrappers around the norm ---------------------------------------------------------------------


@jax.custom_vjp
def zero_grad(x):
    return x


zero_grad.defvjp(lambda x: (x, None), lambda _, ct: (jnp.zeros_like(ct),))


def wrap(kind, norm):
    if kind == "none":
        return norm
    if kind == "jit":
        return jax.jit(norm)
    if kind == "checkpoint":
        return jax.checkpoint(norm)
    if kind == "custom_jvp":
        cn = jax.custom_jvp(norm)
        cn.defjvp(lambda p, t: (cn(*p), jnp.zeros_like(cn(*p))))
        return cn
    raise ValueError(kind)


WRAPPERS = ("none", "jit", "checkpoint", "custom_jvp", "zero_grad_beside")


# --- one program ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Program:
    spelling: str
    dtype: str = "bfloat16"
    gamma_dtype: Optional[str] = None  # None: T
    shape: tuple = (6, 64)
    wrapper: str = "none"
    allow: bool = False
    tail: str = "none"  # FP8 tail: none, static, dynamic, per_channel

    @property
    def id(self):
        return "-".join(str(v) for v in dataclasses.astuple(self))

    def expected(self):
        """("fused", None) or ("refused", reason start)."""
        sp = SPELLINGS[self.spelling]
        T = self.dtype
        if self.wrapper == "custom_jvp":
            return "refused", "the RMSNorm is inside a custom_jvp"
        if sp.expect == "refused" and not (T == "float32" and sp.exact_in_f32):
            return "refused", sp.reason.format(T=T)
        if T == "float32":
            return "fused", None
        if sp.expect == "changed" and not self.allow:
            return "refused", sp.reason.format(T=T)
        gamma_f32 = (self.gamma_dtype or T) == "float32" and sp.gamma and sp.expect == "fused"
        if gamma_f32 and not self.allow and self.spelling != "hf_flax_float32_output":
            return "refused", f"float32 gamma (the kernel reads gamma in {T})"
        return "fused", None

    def body(self):
        sp = SPELLINGS[self.spelling]
        norm = wrap(self.wrapper if self.wrapper != "zero_grad_beside" else "none", sp.norm)
        tail = self.tail

        def body(x, res, g, scale):
            r = jax.lax.psum(x[0], "tp") + res
            y = norm(r, g)
            outs = [r, y]
            if tail != "none":
                y32 = y.astype(f32)
                if tail == "static":
                    s = scale
                else:
                    axis = {"dynamic": -1, "per_channel": 0, "per_tensor": None}[tail]
                    s = jnp.maximum(
                        jnp.max(jnp.abs(y32), axis=axis, keepdims=True) / 448, 1 / (512 * 448)
                    )
                    outs.append(s)
                q = jnp.clip(y32 / s, -448, 448).astype(jnp.float8_e4m3fn)
                outs.append(q.astype(f32))
            if self.wrapper == "zero_grad_beside":
                outs.append(zero_grad(r) * 3)  # a zero-gradient helper on the residual
            return tuple(outs)

        return body

    def n_out(self):
        return 2 + {"none": 0, "static": 1}.get(self.tail, 2) + (self.wrapper == "zero_grad_beside")


def inputs(prog: Program, seed=0):
    rng = np.random.default_rng(seed)
    T = prog.dtype
    shape = prog.shape
    x = rng.standard_normal((8,) + shape).astype(np.float32).astype(jnp.dtype(T))
    res = rng.standard_normal(shape).astype(np.float32).astype(jnp.dtype(T))
    # Rows of different scales: eps and every constant matter somewhere.
    scales = np.exp2(np.arange(int(np.prod(shape[:-1]))) % 7 - 3.0).reshape(shape[:-1] + (1,))
    x = (x.astype(np.float32) * scales).astype(jnp.dtype(T))
    n = shape[-1] if not SPELLINGS[prog.spelling].only_square else shape[0]
    g = (
        (1 + 0.1 * rng.standard_normal(n))
        .astype(np.float32)
        .astype(jnp.dtype(prog.gamma_dtype or T))
    )
    xs = jax.device_put(jnp.asarray(x), NamedSharding(MESH, P("tp")))
    return xs, jnp.asarray(res), jnp.asarray(g), jnp.float32(0.05)


def program_fn(prog: Program):
    return jax.jit(
        jax.shard_map(
            prog.body(),
            mesh=MESH,
            in_specs=(P("tp"), P(), P(), P()),
            out_specs=(P(),) * prog.n_out(),
        )
    )


def _bits(a):
    return np.asarray(a).view(np.uint8) if np.asarray(a).dtype.itemsize else np.asarray(a)


def grads(fn, args, which, seed=1):
    """Gradients of sum(out * ct) over the outputs ``which`` (fixed random cotangents),
    w.r.t. x, residual, gamma."""
    rng = np.random.default_rng(seed)
    outs = jax.eval_shape(fn, *args)
    cts = [
        jnp.asarray(rng.standard_normal(o.shape), f32) * (k in which) for k, o in enumerate(outs)
    ]

    def loss(x, res, g):
        return sum(jnp.sum(o.astype(f32) * c) for o, c in zip(fn(x, res, g, args[3]), cts))

    with jax.set_mesh(MESH):
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args[:3])


def oracle_errors(prog, args, out, site):
    """(residual_out error, norm_out error) of ``out`` against the exact result of the
    site's formula, in the documented units."""
    T = prog.dtype
    x, res, g, _ = args
    xs = np.asarray(x, np.float64)
    s = np.sum(xs, axis=0)
    res64 = np.asarray(res, np.float64)
    r64 = s + res64
    # The float32 accumulation of N ranks is exact for 16-bit inputs of similar scale only:
    # it adds up to (N - 1) * 2^-24 * sum(|x_r|) (docs/numerics.md). On the xla backend the
    # fused call's all-reduce is the program's own psum (the "xla" fallback), whose sum errs
    # by up to psum_error_bound (XLA's float16 psum on CPU rounds after every addition).
    accumulation = (xs.shape[0] - 1) * 2.0**-24 * np.sum(np.abs(xs), axis=0)
    accumulation = accumulation + psum_error_bound(xs, T)
    inv = 1.0 / np.sqrt(np.mean(r64 * r64, -1, keepdims=True) + site.rms_eps)
    gam = (
        site.weight_bias + np.asarray(g, np.float64)
        if SPELLINGS[prog.spelling].gamma
        else np.ones(r64.shape[-1])
    )
    y64 = r64 * inv * gam
    if SPELLINGS[prog.spelling].after is not None:
        y64 = SPELLINGS[prog.spelling].after(y64, np.asarray(g, np.float64))
    unit_r = ulp(np.abs(s) + np.abs(res64), T) + accumulation
    unit_y = unit_r * inv * np.abs(gam) + ulp(y64, T)
    e_res = float(np.max(np.abs(np.asarray(out[0], np.float64) - r64) / unit_r))
    e_norm = float(np.max(np.abs(np.asarray(out[1], np.float64) - y64) / unit_y))
    return e_res, e_norm


def grad_errors(prog, g_orig, g_fused, eps=None):
    eps = float(jnp.finfo(prog.dtype).eps) if eps is None else eps
    out = []
    for a, b in zip(g_orig, g_fused):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        out.append(float(np.max(np.abs(a - b)) / (eps * max(np.max(np.abs(a)), 1e-30))))
    return out


def check(prog: Program):
    args = inputs(prog)
    f = program_fn(prog)
    fused = jf.fuse(f, mesh=MESH, backend="xla", allow_rounding_change=prog.allow)
    out_f = fused(*args)
    out_o = f(*args)
    rep = fused.report
    assert len(rep.sites) == 1, rep.line()
    site = rep.sites[0]
    want, reason = prog.expected()
    n_tail = prog.n_out() - 2 - (prog.wrapper == "zero_grad_beside")
    plain = [k for k in range(prog.n_out()) if not 2 <= k < 2 + n_tail]
    g_o = grads(f, args, plain)
    g_f = grads(fused, args, plain)
    if want == "refused":
        assert not site.fused, (prog.id, rep.line())
        assert site.reason.startswith(reason), (prog.id, site.reason)
        for a, b in zip(out_o, out_f):  # the very same program
            np.testing.assert_array_equal(_bits(a), _bits(b))
        for a, b in zip(g_o, g_f):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        return {"program": prog.id, "fused": False, "reason": site.reason}
    assert site.fused, (prog.id, site.reason)
    jaxpr = str(jax.make_jaxpr(fused)(*args))
    assert "jax_fusedar_allreduce_fusion" in jaxpr and "psum" not in jaxpr, prog.id
    e_res, e_norm = oracle_errors(prog, args, out_f, site)
    o_res, o_norm = oracle_errors(prog, args, out_o, site)
    bound = (CHANGED_NORM_BOUND if site.rounding_change else NORM_BOUND)[prog.dtype]
    assert e_res <= RESIDUAL_BOUND, (prog.id, e_res, o_res)
    assert e_norm <= bound, (prog.id, e_norm, o_norm, site.rounding_change)
    if prog.tail in ("static", "dynamic"):
        assert site.pattern in (4, 11), (prog.id, site.pattern)
        q_o, q_f = (np.asarray(o[-1], np.float64) for o in (out_o, out_f))
        # One e4m3 step (the kernel divides through a reciprocal), at most.
        assert np.max(np.abs(q_o - q_f)) <= np.max(np.abs(q_o)) / 8, prog.id
    elif prog.tail in ("per_channel", "per_tensor"):
        assert site.pattern == 1 and site.note and "FP8 tail not fused" in site.note, site
    g_err = grad_errors(prog, g_o, g_f)
    assert max(g_err) <= GRAD_BOUND[prog.dtype], (prog.id, g_err)
    if n_tail and site.pattern != 1:
        # The fused tail keeps the program's derivative (not the fused op's zero); an amax
        # the tail leaves alone routes its derivative by argmax, which one ulp can move.
        tail = list(range(2, 2 + n_tail))
        q_err = grad_errors(prog, grads(f, args, tail), grads(fused, args, tail), eps=1.0)
        assert max(q_err) <= FP8_GRAD_BOUND, (prog.id, q_err)
    return {
        "program": prog.id,
        "fused": True,
        "e_res": e_res,
        "e_norm": e_norm,
        "original_res": o_res,
        "original_norm": o_norm,
        "grad": max(g_err),
        "change": site.rounding_change,
    }


# --- the programs ---------------------------------------------------------------------------------


def all_programs():
    """Every spelling in every dtype (float32 gammas too, with and without the flag where
    it matters), on three shapes in bfloat16 and on T == H in the others; every wrapper
    and tail on a few spellings."""
    out = []
    for name, sp in SPELLINGS.items():
        for dtype in ("bfloat16", "float16", "float32"):
            shapes = ((6, 64), (64, 64), (2, 3, 64)) if dtype == "bfloat16" else ((64, 64),)
            for shape, gdt in itertools.product(shapes, (None, "float32")):
                if (sp.only_square and shape != (64, 64)) or gdt == dtype:
                    continue
                flags = (False, True) if gdt or sp.expect == "changed" else (False,)
                out += [Program(name, dtype, gdt, shape, "none", allow) for allow in flags]
    for wrapper in WRAPPERS[1:]:
        for name in ("rsqrt_mul", "sqrt_div", "linen", "hf_gamma_after_cast"):
            out.append(Program(name, "bfloat16", None, (6, 64), wrapper, name.startswith("hf")))
    for tail in ("static", "dynamic", "per_channel", "per_tensor"):
        for shape in ((6, 64), (64, 64)):
            out.append(Program("rsqrt_mul", "bfloat16", None, shape, "none", False, tail))
    return out


def quick_programs():
    """The default sample: every spelling once (bf16, T == H where it matters), the other
    dtypes, float32 gammas with and without the flag, every wrapper and tail."""
    out = [
        Program(n, "bfloat16", None, (64, 64) if sp.only_square else (6, 64))
        for n, sp in SPELLINGS.items()
    ]
    out += [
        Program("hf_gamma_after_cast", allow=True),
        Program("hf_flax_float32_output", gamma_dtype="float32", allow=True),
    ]
    out += [
        Program("sqrt_div", "float16", shape=(2, 3, 64)),
        Program("gamma_over_rms", "float32", shape=(64, 64)),
        Program("rsqrt_mul", "bfloat16", "float32"),
        Program("rsqrt_mul", "bfloat16", "float32", allow=True),
        Program("rsqrt_mul", shape=(64, 64)),
    ]
    out += [Program("rsqrt_mul", wrapper=w) for w in WRAPPERS[1:]]
    out += [
        Program("rsqrt_mul", tail=t, shape=(64, 64) if t == "per_channel" else (6, 64))
        for t in ("static", "dynamic", "per_channel", "per_tensor")
    ]
    return out


QUICK = quick_programs()


# About 60 s of CPU for the 37 programs: in the full suite (and CI), not the quick lane.
@pytest.mark.slow
@pytest.mark.parametrize("prog", QUICK, ids=[p.id for p in QUICK])
def test_generated_program(prog):
    check(prog)


@pytest.mark.sweep
def test_every_generated_program():
    failures = []
    results = []
    for prog in all_programs():
        try:
            results.append(check(prog))
        except AssertionError as e:
            failures.append(f"{prog.id}: {e}")
    fused = [r for r in results if r["fused"]]
    print(
        f"{len(results)} programs, {len(fused)} fused; worst residual "
        f"{max(r['e_res'] for r in fused):.3g}, norm {max(r['e_norm'] for r in fused):.3g}, "
        f"grad {max(r['grad'] for r in fused):.3g}"
    )
    assert not failures, "\n".join(failures)
