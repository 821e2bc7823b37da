"""Differential harness of jax_fusedar.fuse: generated programs (norm spellings, constants,
gamma dtypes and cast chains, shapes, wrappers, FP8 tails, other uses of the site's values,
the per-linear shard_map, pvary, export), each run as written and through fuse, forward and
jax.grad, on 8 CPU devices with XLA rounding as written (tests/jax/fuse_checks.py).

Each program names its outcome from the documented rules (``Program.expected``: a model of
docs/fusion_pass.md written here, not read from the pass): fused rounding like the program;
fused with allow_rounding_change, the change named, within the bound of changed forms; or
unfused with the reason, the very same program. A raw exception from fuse fails it. The
default run takes a sample of every family; ``pytest -m sweep`` runs every combination.
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
from tests.jax.fuse_checks import MESH, BORDERLINE, assert_bit_equal, compiled, norm_units
from tests.jax.fuse_checks import assert_rounds_like_the_program, statistic
from tests.oracles.oracle import ulp
import jax_fusedar as jf

cpu_helpers.require_host_devices()

EPS = 1e-6
f32 = jnp.float32

# The documented bound (docs/fusion_pass.md, "The bound"), in the oracle's units
# (tests/oracles/oracle.py): residual_out in ulp_T(|s| + |residual|); norm_out in
# ulp_T(|s| + |residual|) * inv * |col| + ulp_T(|norm_out|), col the value the program
# multiplies (gamma with its own roundings). Forms fused only with allow_rounding_change get
# one more unit for the rounding they move.
NORM_BOUND = {"bfloat16": 3.0, "float16": 3.0, "float32": 8.0}
CHANGED_NORM_BOUND = {"bfloat16": 4.0, "float16": 4.0, "float32": 8.0}
# Gradients: per tensor, max |fused - original| <= GRAD_BOUND * eps_T * max |original|.
GRAD_BOUND = {"bfloat16": 4.0, "float16": 4.0, "float32": 64.0}
# Through a fused FP8 output (a cast to float8_e4m3fn passes tangents on, rounded to
# e4m3's 3 mantissa bits, so one ulp of difference upstream can move a step): relative to
# the largest gradient, two e4m3 steps. A zero derivative would be off by 1.
FP8_GRAD_BOUND = 0.25
FUSED_OP = "jax_fusedar_allreduce_fusion"  # the fused op's primitive, in a jaxpr


# --- norm spellings -------------------------------------------------------------------------------
# Each takes the residual sum r (dtype T) and gamma g, and returns the norm output; most are
# written on x = r in float32 with the result rounded back to T (in_f32).

rsqrt = jax.lax.rsqrt
in_f32 = lambda body: lambda r, g: body(r.astype(f32), g).astype(r.dtype)
_ms = lambda x: jnp.mean(x * x, axis=-1, keepdims=True)
_inv = lambda x: rsqrt(_ms(x) + EPS)
_sum_sq = lambda x: jnp.sum(x * x, -1, keepdims=True)
_g = lambda g: g.astype(f32)


def linen(r, g):  # flax.linen.RMSNorm's sequence
    x = r.astype(f32)
    ms = jnp.mean(jax.lax.square(x), axis=-1)
    y = r.astype(f32) - jnp.zeros_like(ms)[..., None]
    inv = rsqrt(ms[..., None] + EPS)
    return (y * (inv * g.reshape((1,) * (r.ndim - 1) + (-1,)).astype(f32))).astype(r.dtype)


def gemma_rounded_scale(r, g):  # (1 + w) rounded to T by the program
    x = r.astype(f32)
    scale = (1.0 + g.astype(f32)).astype(r.dtype)
    return (x * _inv(x) * scale.astype(f32)).astype(r.dtype)


def hf_flax_float32_output(r, g):  # FlaxLlamaRMSNorm with a float32 weight
    y = r / jnp.sqrt(jnp.power(r.astype(f32), 2).mean(-1, keepdims=True) + EPS)
    return g.astype(f32) * jnp.asarray(y, dtype=r.dtype)


def kept_in_float32(r, g):
    x = r.astype(f32)
    return x * _inv(x) * g.astype(f32)


def layer_norm(r, g):
    x = r.astype(f32)
    c = x - jnp.mean(x, -1, keepdims=True)
    return (c * rsqrt(_ms(c) + EPS) * g.astype(f32)).astype(r.dtype)


@dataclasses.dataclass(frozen=True)
class Spelling:
    norm: Callable
    expect: str = "fused"  # "fused", "changed" (only with allow_rounding_change), "refused"
    reason: str = ""  # the reason's start when not fused by default
    change: str = ""  # the rounding change reported with allow_rounding_change
    # How the program makes the value it multiplies from gamma g: "f32" g.astype(f32);
    # "one_plus" 1 + g.astype(f32) (in float32); "one_plus_rounded" that, rounded to T;
    # None: no gamma.
    col: Optional[str] = "f32"
    only_square: bool = False  # needs T == H (a [T] vector passes for a [H] one)
    exact_in_f32: bool = False  # in float32 the site is fused (the refusal is about T)
    # What the program does to the norm's output after it: gamma multiplied after the
    # rounding (the fused op's norm output is the program's value before it), or a bias
    # (``bias``: the fused op's output, then the addition).
    after: Optional[Callable] = None
    bias: bool = False
    after_gamma: str = "f32"  # gamma as ``after`` reads it: "f32" or "in_t" (rounded to T)


def refused(reason, norm, **kw):
    return Spelling(norm, "refused", reason, **kw)


def on_f32(body, *args, **kw):  # a spelling written on x = r in float32 (in_f32)
    return Spelling(in_f32(body), *args, **kw)


SPELLINGS = {
    # Fused with default options, gamma read as g.astype(float32).
    "rsqrt_mul": on_f32(lambda x, g: x * _inv(x) * _g(g)),
    "sqrt_div": on_f32(  # Hugging Face Flax's and Gemma's spelling
        lambda x, g: _g(g) * x / jnp.sqrt(jnp.power(x, 2).mean(-1, keepdims=True) + EPS)
    ),
    "gamma_over_rms": on_f32(
        lambda x, g: _g(g) * x / jnp.sqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + EPS)
    ),
    "pow_minus_half": on_f32(lambda x, g: x * (_ms(x) + EPS) ** -0.5 * _g(g)),
    "sum_over_h": on_f32(
        lambda x, g: x * rsqrt(jnp.sum(x**2, -1, keepdims=True) / x.shape[-1] + EPS) * _g(g)
    ),
    "sum_times_inverse_h": on_f32(
        lambda x, g: _g(g) * (rsqrt(_sum_sq(x) * (1.0 / x.shape[-1]) + EPS) * x)
    ),
    # float32 constants H eps, sqrt(H): x * rsqrt(sum + H eps) * sqrt(H), x / (sqrt(sum + H
    # eps) / sqrt(H))
    "sqrt_h_outside": on_f32(
        lambda x, g: x * (rsqrt(_sum_sq(x) + x.shape[-1] * EPS) * np.sqrt(x.shape[-1])) * _g(g)
    ),
    "rms_over_sqrt_h": on_f32(
        lambda x, g: _g(g) * x / (jnp.sqrt(_sum_sq(x) + x.shape[-1] * EPS) / np.sqrt(x.shape[-1]))
    ),
    "reciprocal_of_sqrt": on_f32(
        lambda x, g: (
            jnp.reciprocal(jnp.sqrt(jnp.mean(jnp.square(x), -1) + EPS))[..., None] * x * _g(g)
        )
    ),
    "linen": Spelling(linen),
    "gemma_one_plus": on_f32(lambda x, g: x * _inv(x) * (1.0 + _g(g)), col="one_plus"),
    "gemma_rounded_scale": Spelling(gemma_rounded_scale, col="one_plus_rounded"),
    "no_gamma": on_f32(lambda x, g: x * _inv(x), col=None),
    # rsqrt((sum + 1) / H): RMSNorm with eps = 1/H
    "constant_in_sum": on_f32(lambda x, g: x * rsqrt((_sum_sq(x) + 1.0) / x.shape[-1]) * _g(g)),
    "eps_through_bfloat16": on_f32(  # eps written as a bfloat16 constant
        lambda x, g: x * rsqrt(_ms(x) + jnp.asarray(EPS, jnp.bfloat16).astype(f32)) * _g(g)
    ),
    "stop_gradient_gamma": on_f32(lambda x, g: x * _inv(x) * _g(jax.lax.stop_gradient(g))),
    # gamma multiplied after the rounding: the fused op's norm (gamma of ones) is the
    # program's rounded value, and the program's multiplication by gamma stays after it.
    "hf_gamma_after_cast": Spelling(  # MaxText / Hugging Face: gamma multiplied in T
        lambda r, g: in_f32(lambda x, g: x * _inv(x))(r, g) * g.astype(r.dtype),
        col=None,
        after=lambda y, g: y * g,
        after_gamma="in_t",
    ),
    "hf_flax_float32_output": Spelling(hf_flax_float32_output, col=None, after=lambda y, g: y * g),
    # A bias (Equinox's RMSNorm(use_bias=True), gamma as the bias): added after the fused
    # norm's rounding (in float32 nothing rounds between).
    "bias_before_rounding": on_f32(
        lambda x, g: x * _inv(x) * _g(g) + _g(g),
        "changed",
        "a bias added to the normalized value before its rounding to {T}",
        "bias added after the fused norm's rounding to {T}",
        after=lambda y, g: y + g,
        bias=True,
    ),
    # Not RMSNorm, or not the fused op's rounding: left alone with the reason.
    "times_two_in_mean": refused(
        "the mean divides by 32",
        in_f32(lambda x, g: x * rsqrt(_sum_sq(x) * 2.0 / x.shape[-1] + EPS) * _g(g)),
    ),
    "eps_outside_sqrt": refused(
        "eps added after the square root", in_f32(lambda x, g: x / (jnp.sqrt(_ms(x)) + EPS) * _g(g))
    ),
    "eps_as_max": refused(
        "max of the mean of squares",
        in_f32(lambda x, g: x * rsqrt(jnp.maximum(_ms(x), EPS)) * _g(g)),
    ),
    "layer_norm": refused("LayerNorm (mean subtracted)", layer_norm),
    "over_token_axis": refused(
        "norm over axis 0",
        in_f32(lambda x, g: x * rsqrt(jnp.mean(x * x, axis=0, keepdims=True) + EPS) * _g(g)),
    ),
    "stop_gradient_statistic": refused(
        "lax.stop_gradient inside the norm",
        in_f32(lambda x, g: x * jax.lax.stop_gradient(rsqrt(_ms(x) + EPS)) * _g(g)),
    ),
    # In float32 the norm without gamma is the site, the per-token factor stays after it
    # (T == H: g[:, None] is a per-token value).
    "per_token_factor": refused(
        "a per-token factor",
        in_f32(lambda x, g: x * _inv(x) * _g(g)[:, None]),
        col=None,
        only_square=True,
        exact_in_f32=True,
        after=lambda y, g: y * g[:, None],
    ),
    "computed_in_t": refused(
        "RMSNorm computed in {T}",
        lambda r, g: r * rsqrt(jnp.mean(r * r, -1, keepdims=True) + EPS) * g.astype(r.dtype),
        exact_in_f32=True,
    ),
    "kept_in_float32": refused(
        "the norm output is not cast back", kept_in_float32, exact_in_f32=True
    ),
}
# The spellings docs/fusion_pass.md names as fused, checked at every hidden size below.
DOCUMENTED = [n for n, sp in SPELLINGS.items() if sp.expect != "refused"]
HIDDEN_SIZES = (80, 96, 128, 3072, 4096, 5120, 6144)


def col_value(sp: Spelling, g, T):
    """The value the program multiplies, computed as the program does (float32)."""
    if sp.col == "one_plus":
        return 1.0 + g.astype(f32)
    if sp.col == "one_plus_rounded":
        return (1.0 + g.astype(f32)).astype(T).astype(f32)
    return g.astype(f32)


# The formats holding every value of a dtype (the model's own table): bfloat16 and float16
# values are float32 values, neither 16-bit format holds the other's.
HOLDERS = {
    "bfloat16": {"bfloat16", "float32"},
    "float16": {"float16", "float32"},
    "float32": {"float32"},
}


# --- wrappers around the norm, FP8 tails, other uses of the site's values -------------------------


@jax.custom_vjp
def zero_grad(x):
    return x


zero_grad.defvjp(lambda x: (x, None), lambda _, ct: (jnp.zeros_like(ct),))


def _custom_jvp(norm):
    cn = jax.custom_jvp(norm)
    cn.defjvp(lambda p, t: (cn(*p), jnp.zeros_like(cn(*p))))
    return cn


WRAP = {
    "none": lambda norm: norm,
    "jit": jax.jit,
    "checkpoint": jax.checkpoint,
    "custom_jvp": _custom_jvp,
    "zero_grad_beside": lambda norm: norm,  # the helper is on the residual, beside the norm
}
WRAPPERS = tuple(WRAP)
TAILS = ("none", "static", "literal", "dynamic", "per_channel", "per_tensor")
# Other outputs: the residual sum returned twice, a copy of the norm output, the all-reduce's
# sum returned too (or, per-linear, returned twice by the shard_map, or with a copy), a
# residual that the same shard_map returns, a residual varying over the axis (JAX puts a
# pvary between the psum and the add under check_vma).
EXTRAS = "none r_twice norm_copy sum_twice sum_copy residual_inside varying_residual".split()
OTHER_USES = "the all-reduce's result has other uses besides the residual add"


@dataclasses.dataclass(frozen=True)
class Program:
    spelling: str
    dtype: str = "bfloat16"
    gamma_dtype: Optional[str] = None  # None: T
    shape: tuple = (6, 64)
    wrapper: str = "none"
    allow: bool = False
    tail: str = "none"  # TAILS
    keep_norm: bool = True  # the norm output is returned beside an FP8 tail
    gamma_via: tuple = ()  # dtypes gamma is cast through before the norm
    layout: str = "scope"  # "scope": psum, add and norm in one shard_map; "per_linear"
    extra: str = "none"  # EXTRAS

    @property
    def id(self):
        return "-".join(str(v) for v in dataclasses.astuple(self))

    # The model of the documented rules -----------------------------------------------------
    def gamma_outcome(self):
        """None (the fused op reads the program's value of gamma), or (its narrowest format,
        "rounded" | "range"): the kernel would round it to T, a declared change where T's
        range holds it, refused in float16."""
        sp = SPELLINGS[self.spelling]
        if sp.col is None:
            return None
        T = self.dtype
        held = HOLDERS[self.gamma_dtype or T]
        for d in self.gamma_via:
            held = held if d in held else HOLDERS[d]
        if sp.col == "one_plus":  # weight_bias = 1 when g is a value of T
            held = held if T in held else HOLDERS["float32"]
        elif sp.col == "one_plus_rounded":
            held = held if T in held else HOLDERS[T]
        if T in held:
            return None
        kind = min(held, key=lambda d: (d == "float32", d))
        return kind, "range" if T == "float16" else "rounded"

    def expected(self):
        """("fused", None), ("changed", the reported change) or ("refused", reason start)."""
        sp = SPELLINGS[self.spelling]
        T = self.dtype
        if self.extra in ("sum_twice", "sum_copy"):
            return "refused", OTHER_USES
        if self.wrapper == "custom_jvp":
            return "refused", "the RMSNorm is inside a custom_jvp"
        if sp.expect == "refused" and not (T == "float32" and sp.exact_in_f32):
            return "refused", sp.reason.format(T=T)
        changes = []

        def spelling():  # the spelling's own rounding change
            if sp.expect == "changed" and T != "float32":
                if not self.allow:
                    return "refused", sp.reason.format(T=T)
                changes.append(sp.change.format(T=T))

        def gamma():  # gamma's values against T's
            outcome = self.gamma_outcome()
            if outcome is not None:
                kind, what = outcome
                if what == "range":
                    return "refused", f"{kind} gamma in a float16 model: the kernel reads gamma"
                if not self.allow:
                    return "refused", f"{kind} gamma (the kernel reads gamma in {T})"
                changes.append(f"gamma rounded to {T}")

        # The pass meets a bias after gamma's feed; other changes on the path before it.
        for step in (gamma, spelling) if sp.bias else (spelling, gamma):
            if (refusal := step()) is not None:
                return refusal
        return ("changed", "; ".join(changes)) if changes else ("fused", None)

    def pattern(self):  # the FP8 tail's pattern, with the norm output or without
        with_norm, without = {"static": (4, 2), "literal": (4, 2), "dynamic": (11, 10)}.get(
            self.tail, (1, 1)
        )
        return with_norm if self.keep_norm else without

    # The program ---------------------------------------------------------------------------
    def norm_gamma(self, g):
        """Gamma cast through gamma_via, as the program's norm reads it."""
        for d in self.gamma_via:
            g = g.astype(d)
        return g

    def norm(self):
        """The program's norm of (r, g): the spelling, gamma cast through gamma_via first."""
        sp = SPELLINGS[self.spelling]

        def norm(r, g):  # named: jax.jit and checkpoint wrappers carry its name
            return sp.norm(r, self.norm_gamma(g))

        return norm

    def roles(self):
        """What each output of the program is."""
        out = ["r"] + ["y"] * self.keep_norm
        out += ["scale"] * (self.tail in ("dynamic", "per_channel", "per_tensor"))
        out += ["q"] * (self.tail != "none") + ["zero_grad"] * (self.wrapper == "zero_grad_beside")
        return out + [self.extra] * (
            self.extra in ("r_twice", "norm_copy", "sum_twice", "sum_copy")
        )

    def fn(self):
        """The program: a function of (x, res, g, scale), jitted."""
        norm = WRAP[self.wrapper](self.norm())
        roles, tail, extra = self.roles(), self.tail, self.extra

        def after_sum(s, resid, g, scale, other=None):
            r = s + resid
            y = norm(r, g)
            vals = {"r": r, "y": y, "r_twice": r}
            if "norm_copy" in roles:
                vals["norm_copy"] = jnp.copy(y)
            vals["sum_twice"] = vals["sum_copy"] = other if other is not None else s
            if tail != "none":
                y32 = y.astype(f32)
                sc = {"static": scale, "literal": 0.05}.get(tail)
                if sc is None:
                    axis = {"dynamic": -1, "per_channel": 0, "per_tensor": None}[tail]
                    sc = jnp.maximum(
                        jnp.max(jnp.abs(y32), axis=axis, keepdims=True) / 448, 1 / (512 * 448)
                    )
                    vals["scale"] = sc
                vals["q"] = jnp.clip(y32 / sc, -448, 448).astype(jnp.float8_e4m3fn).astype(f32)
            if "zero_grad" in roles:
                vals["zero_grad"] = zero_grad(r) * 3  # a zero-gradient helper on the residual
            return tuple(vals[k] for k in roles)

        if self.layout == "scope":
            varying = extra == "varying_residual"

            def body(x, res, g, scale):
                s = jax.lax.psum(x[0], "tp")
                return after_sum(s, res + x[0] if varying else res, g, scale)

            spec = P("tp") if varying else P()
            return cpu_helpers.jit_shard_map(
                body, MESH, (P("tp"), P(), P(), P()), (spec,) * len(roles)
            )

        def row_parallel(x, res):
            s = jax.lax.psum(x[0], "tp")
            if extra == "sum_twice":
                return s, s
            if extra == "sum_copy":
                return s, jnp.copy(s)
            return (s, -res) if extra == "residual_inside" else (s,)

        n_sm = 2 if extra in ("sum_twice", "sum_copy", "residual_inside") else 1

        def model(x, res, g, scale):
            outs = jax.shard_map(
                row_parallel, mesh=MESH, in_specs=(P("tp"), P()), out_specs=(P(),) * n_sm
            )(x, res)
            resid = outs[1] if extra == "residual_inside" else res
            return after_sum(outs[0], resid, g, scale, outs[1] if n_sm == 2 else None)

        return jax.jit(model)


def inputs(prog: Program, seed=0):
    rng = np.random.default_rng(seed)
    T, shape, sp = jnp.dtype(prog.dtype), prog.shape, SPELLINGS[prog.spelling]
    x = rng.standard_normal((8,) + shape).astype(np.float32)
    res = rng.standard_normal(shape).astype(np.float32).astype(T)
    # Rows of different scales: eps and every constant matter somewhere.
    scales = np.exp2(np.arange(int(np.prod(shape[:-1]))) % 7 - 3.0).reshape(shape[:-1] + (1,))
    x = (x * scales).astype(T)
    n = shape[0] if sp.only_square else shape[-1]
    around = 0.0 if sp.col in ("one_plus", "one_plus_rounded") else 1.0
    g = (around + 0.1 * rng.standard_normal(n)).astype(np.float32)
    g = g.astype(jnp.dtype(prog.gamma_dtype or T))
    xs = jax.device_put(jnp.asarray(x), NamedSharding(MESH, P("tp")))
    return xs, jnp.asarray(res), jnp.asarray(g), jnp.float32(0.05)


def grads(fn, args, which, seed=1):
    """Gradients of sum(out * ct) over the outputs ``which`` (fixed random cotangents),
    w.r.t. x, residual, gamma."""
    rng = np.random.default_rng(seed)
    with jax.set_mesh(MESH):
        outs = jax.eval_shape(fn, *args)
    cts = [
        jnp.asarray(rng.standard_normal(o.shape), f32) * (k in which) for k, o in enumerate(outs)
    ]

    def loss(x, res, g):
        return sum(jnp.sum(o.astype(f32) * c) for o, c in zip(fn(x, res, g, args[3]), cts))

    with jax.set_mesh(MESH):
        return compiled(jax.grad(loss, argnums=(0, 1, 2)))(*args[:3])


def grad_errors(prog, g_orig, g_fused, eps=None):
    eps = float(jnp.finfo(prog.dtype).eps) if eps is None else eps
    out = []
    for a, b in zip(g_orig, g_fused):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        out.append(float(np.max(np.abs(a - b)) / (eps * max(np.max(np.abs(a)), 1e-30))))
    return out


def exact_norm(prog, site, r, g):
    """(exact, inv, col): the program's formula in float64 at the residual ``r``, before its
    last rounding, with gamma's own roundings (``col``) and ``inv`` from float64."""
    sp = SPELLINGS[prog.spelling]
    r64 = np.asarray(r, np.float64)
    inv = 1.0 / np.sqrt(np.mean(r64 * r64, -1, keepdims=True) + site.rms_eps)
    col = np.ones(r64.shape[-1])
    if sp.col is not None:
        col = compiled(lambda g: col_value(sp, prog.norm_gamma(g), prog.dtype))(g)
        col = np.asarray(col).astype(np.float64)
    exact = r64 * inv * col
    if sp.after is not None:  # gamma as the program reads it there (its cast chain)
        T, in_t = prog.dtype, sp.after_gamma == "in_t"
        g_after = compiled(
            lambda g: (prog.norm_gamma(g).astype(T) if in_t else prog.norm_gamma(g)).astype(f32)
        )(g)
        exact = sp.after(exact, np.asarray(g_after, np.float64))
    return exact, inv, col


def fused_or_raise(prog, run):
    """``run()``'s value: a raw exception from fuse fails the program (the property)."""
    try:
        return run()
    except Exception as e:  # noqa: BLE001 - the property: never a raw exception
        raise AssertionError(f"{prog.id}: fuse raised {type(e).__name__}: {e}") from e


def check(prog: Program):
    """The program's outcome is the one it expects; returns what was measured.

    Fused, rounding like the program: the norm output bit for bit but where float32
    arithmetic may tip its last rounding, residual_out bit for bit, float32 outputs within
    the float32 bound, gradients within theirs."""
    args = inputs(prog)
    f = prog.fn()
    with jax.set_mesh(MESH):
        out_o = compiled(f)(*args)
    fused = fused_or_raise(
        prog, lambda: jf.fuse(f, mesh=MESH, backend="xla", allow_rounding_change=prog.allow)
    )
    with jax.set_mesh(MESH):
        out_f = fused_or_raise(prog, lambda: compiled(fused)(*args))
    rep = fused.report
    assert len(rep.sites) == 1, (prog.id, rep.line())
    site, (want, text), roles = rep.sites[0], prog.expected(), prog.roles()
    tail = [k for k, role in enumerate(roles) if role in ("q", "scale")]
    plain = [k for k in range(len(roles)) if k not in tail]
    g_o, g_f = grads(f, args, plain), grads(fused, args, plain)
    if want == "refused":
        assert not site.fused, (prog.id, rep.line())
        assert site.reason.startswith(text), (prog.id, site.reason, text)
        assert_bit_equal(out_o, out_f, prog.id)  # the very same program
        assert_bit_equal(g_o, g_f, prog.id)
        return {"program": prog.id, "fused": False, "reason": site.reason}
    assert site.fused, (prog.id, site.reason)
    assert site.rounding_change == text, (prog.id, site.rounding_change, text)
    assert site.pattern == prog.pattern(), (prog.id, site.pattern)
    with jax.set_mesh(MESH):
        jaxpr = str(jax.make_jaxpr(fused)(*args))
    assert FUSED_OP in jaxpr and "psum" not in jaxpr, prog.id
    T, sp = prog.dtype, SPELLINGS[prog.spelling]
    r_f = out_f[0]
    # The fused call's all-reduce on the xla backend is the program's own psum (in its
    # dtype), and the kernel's float32 add of two T values rounds once to T as T's add does:
    # residual_out is the program's, bit for bit, in every dtype.
    assert_bit_equal(r_f, out_o[0], f"{prog.id}: residual_out")
    for k, role in enumerate(roles):
        if role in ("r_twice", "norm_copy"):
            assert_bit_equal(out_f[k], out_f[0 if role == "r_twice" else 1], prog.id)
    e_norm = None
    if prog.keep_norm:
        y_f, y64 = out_f[1], np.asarray(out_f[1], np.float64)
        exact, inv, col = exact_norm(prog, site, r_f, args[2])
        units = norm_units(y_f, r_f, col, inv, T)
        if sp.bias:  # added to the fused norm: an ulp of the norm (before the bias) more
            normed = np.asarray(r_f, np.float64) * inv * col
            units = np.abs(y64 - exact) / (ulp(normed, T) + ulp(exact, T))
        elif sp.after is not None:  # a factor after the fused norm
            units = np.abs(y64 - exact) / ulp(exact, T)
        e_norm = float(units.max())
        if want == "fused" and T != "float32" and sp.after and not sp.bias:
            # gamma after the rounding: the fused norm output is the program's value before
            # its own factor: the outputs are the program's bit for bit but where that
            # value's exact result lies at a rounding midpoint of T (float32 arithmetic may
            # tip it either way).
            near = np.asarray(r_f, np.float64) * statistic(r_f, site.rms_eps)
            differ = y64 != np.asarray(out_o[1], np.float64)
            step = ulp(np.abs(near), T)
            off = np.abs(np.abs(near - np.asarray(jnp.asarray(near, T), np.float64)) - step / 2)
            assert np.all(off[differ] <= BORDERLINE * np.abs(near[differ])), prog.id
        elif want == "fused" and T != "float32":
            program = compiled(prog.norm())(r_f, args[2])
            near = np.asarray(r_f, np.float64) * statistic(r_f, site.rms_eps) * col
            assert_rounds_like_the_program(y_f, program, near, T, prog.id)
        bound = (CHANGED_NORM_BOUND if want == "changed" else NORM_BOUND)[T]
        assert e_norm <= bound, (prog.id, e_norm, site.rounding_change)
    if "q" in roles:
        k = roles.index("q")
        q_o, q_f = (np.asarray(o[k], np.float64) for o in (out_o, out_f))
        # One e4m3 step (the kernel divides through a reciprocal), at most.
        assert np.max(np.abs(q_o - q_f)) <= np.max(np.abs(q_o)) / 8, prog.id
    if prog.tail in ("per_channel", "per_tensor"):
        assert site.note and "FP8 tail not fused" in site.note, site
    g_err = grad_errors(prog, g_o, g_f)
    assert max(g_err) <= GRAD_BOUND[T], (prog.id, g_err)
    if tail and site.pattern != 1:
        # The fused tail keeps the program's derivative (not the fused op's zero).
        q_err = grad_errors(prog, grads(f, args, tail), grads(fused, args, tail), eps=1.0)
        assert max(q_err) <= FP8_GRAD_BOUND, (prog.id, q_err)
    change = site.rounding_change
    return {
        "program": prog.id,
        "fused": True,
        "e_norm": e_norm,
        "grad": max(g_err),
        "change": change,
    }


def check_analysis(prog: Program):
    """The outcome the model names, from the analysis alone (no program runs)."""
    args = inputs(prog)
    fused = jf.fuse(prog.fn(), mesh=MESH, backend="xla", allow_rounding_change=prog.allow)
    with jax.set_mesh(MESH):
        site = fused_or_raise(prog, lambda: fused.analyze(*args).sites[0])
    want, text = prog.expected()
    if want == "refused":
        assert not site.fused and site.reason.startswith(text), (prog.id, site.reason)
    else:
        assert site.fused and site.rounding_change == text, (prog.id, site)


def check_export(prog: Program):
    """jax.export of the fused program with a symbolic token count: the site is left alone
    with the fused op's reason, and the export is the original program."""
    (t,) = jax.export.symbolic_shape("t")
    shape = (8 * t,) + prog.shape[1:]
    x, res, g, scale = inputs(prog)
    specs = [
        jax.ShapeDtypeStruct(s, a.dtype, sharding=NamedSharding(MESH, p))
        for s, a, p in (((8,) + shape, x, P("tp")), (shape, res, P()), (g.shape, g, P()))
    ] + [jax.ShapeDtypeStruct((), scale.dtype, sharding=NamedSharding(MESH, P()))]
    f = prog.fn()
    fused = jf.fuse(f, mesh=MESH, backend="xla", allow_rounding_change=prog.allow)
    exported = fused_or_raise(prog, lambda: jax.export.export(jax.jit(fused))(*specs))
    site = fused.report.sites[0]
    assert not site.fused and "has a symbolic shape" in site.reason, (prog.id, site.reason)
    assert exported.out_avals == jax.export.export(f)(*specs).out_avals
    with jax.set_mesh(MESH):
        assert FUSED_OP not in str(jax.make_jaxpr(fused)(*specs))


ANALYSED = [
    Program(n, shape=(2, h), allow=SPELLINGS[n].expect == "changed")
    for n, h in itertools.product(DOCUMENTED, HIDDEN_SIZES)
]


def all_programs():
    """Every spelling in every dtype (float32 gammas too, with and without the flag where
    it matters), on three shapes in bfloat16 and on T == H in the others; every gamma dtype
    and cast chain against every activation dtype; every wrapper, tail and other use on a
    few spellings, in both layouts; every documented spelling at every hidden size."""
    out = []
    dtypes = ("bfloat16", "float16", "float32")
    for name, sp in SPELLINGS.items():
        for dtype in dtypes:
            shapes = ((6, 64), (64, 64), (2, 3, 64)) if dtype == "bfloat16" else ((64, 64),)
            for shape, gdt in itertools.product(shapes, (None, "float32")):
                if (sp.only_square and shape != (64, 64)) or gdt == dtype:
                    continue
                flags = (False, True) if gdt or sp.expect == "changed" else (False,)
                out += [Program(name, dtype, gdt, shape, allow=allow) for allow in flags]
    for name, dtype, gdt, via, allow in itertools.product(
        ("rsqrt_mul", "gemma_one_plus", "gemma_rounded_scale", "hf_gamma_after_cast"),
        dtypes,
        dtypes,
        ((), ("bfloat16",), ("float16",), ("float32", "bfloat16")),
        (False, True),
    ):
        out.append(Program(name, dtype, gdt, gamma_via=via, allow=allow))
    for wrapper in WRAPPERS[1:]:
        for name in ("rsqrt_mul", "sqrt_div", "linen", "hf_gamma_after_cast"):
            out.append(Program(name, wrapper=wrapper, allow=name.startswith("hf")))
    for layout, tail, keep, shape in itertools.product(
        ("scope", "per_linear"), TAILS[1:], (True, False), ((6, 64), (64, 64))
    ):
        if keep or tail in ("static", "literal", "dynamic"):
            out.append(Program("rsqrt_mul", shape=shape, tail=tail, keep_norm=keep, layout=layout))
    for layout, extra, dtype in itertools.product(("scope", "per_linear"), EXTRAS[1:], dtypes):
        if (layout == "scope") == (extra in ("sum_copy", "residual_inside")):
            continue
        if extra == "varying_residual" and dtype != "bfloat16":
            continue
        out.append(Program("rsqrt_mul", dtype, layout=layout, extra=extra))
    return out + ANALYSED


def quick_programs():
    """The default sample: every spelling once (bf16, T == H where it matters), the other
    dtypes, gamma dtypes and cast chains, every wrapper and tail, other uses of the site's
    values, the per-linear layout, every documented spelling at one of the hidden sizes (all
    are analysed at all)."""
    out = [Program(n, shape=(64, 64) if sp.only_square else (6, 64)) for n, sp in SPELLINGS.items()]
    return out + [
        Program("hf_gamma_after_cast", allow=True),
        Program("bias_before_rounding", allow=True),
        Program("bias_before_rounding", "float16", shape=(2, 3, 64), allow=True),
        Program("bias_before_rounding", "float32"),
        Program("hf_flax_float32_output", gamma_dtype="float32", allow=True),
        Program("sqrt_div", "float16", shape=(2, 3, 64)),
        Program("gamma_over_rms", "float32", shape=(64, 64)),
        Program("rsqrt_mul", shape=(64, 64)),
        # gamma: dtypes and cast chains
        *(Program("rsqrt_mul", "bfloat16", "float32", allow=allow) for allow in (False, True)),
        Program("rsqrt_mul", "bfloat16", "float32", gamma_via=("bfloat16",)),
        *(Program("rsqrt_mul", "bfloat16", "float16", allow=allow) for allow in (False, True)),
        Program("rsqrt_mul", "float16", "bfloat16", allow=True),
        Program("rsqrt_mul", "float16", "float32", allow=True),
        Program("rsqrt_mul", "float16", "bfloat16", gamma_via=("float16",)),
        Program("rsqrt_mul", "float32", gamma_via=("bfloat16",)),
        Program("rsqrt_mul", "float32", "float16"),
        Program("gemma_one_plus", "float16"),
        Program("gemma_one_plus", "bfloat16", "float32", allow=True),
        Program("gemma_rounded_scale", "float16"),
        Program("gemma_rounded_scale", "float32", gamma_via=("bfloat16",)),
        Program("hf_gamma_after_cast", "bfloat16", "float16", allow=True),
        *(Program("rsqrt_mul", wrapper=w) for w in WRAPPERS[1:]),
        *(
            Program("rsqrt_mul", tail=t, shape=(64, 64) if t == "per_channel" else (6, 64))
            for t in TAILS[1:]
        ),
        *(Program("rsqrt_mul", tail=t, keep_norm=False) for t in ("literal", "dynamic")),
        *(
            Program("rsqrt_mul", extra=e)
            for e in ("r_twice", "norm_copy", "sum_twice", "varying_residual")
        ),
        Program("rsqrt_mul", layout="per_linear"),
        Program("rsqrt_mul", "float16", layout="per_linear", extra="residual_inside"),
        *(Program("rsqrt_mul", layout="per_linear", extra=e) for e in ("sum_twice", "sum_copy")),
        *(
            Program("rsqrt_mul", layout="per_linear", tail=t, keep_norm=False)
            for t in ("static", "dynamic")
        ),
        Program("gemma_rounded_scale", layout="per_linear", tail="literal"),
        *(Program(n, shape=(2, HIDDEN_SIZES[k % 7]), allow=True) for k, n in enumerate(DOCUMENTED)),
    ]


QUICK = quick_programs()
EXPORTED = [Program("rsqrt_mul"), Program("gemma_one_plus", layout="per_linear")]


# About 2 s of CPU per program: in the full suite (and CI), not the quick lane.
@pytest.mark.slow
@pytest.mark.parametrize("prog", QUICK, ids=lambda p: p.id)
def test_generated_program(prog):
    check(prog)


@pytest.mark.slow
@pytest.mark.parametrize("prog", ANALYSED, ids=lambda p: p.id)
def test_documented_spelling_at_every_hidden_size(prog):
    check_analysis(prog)


@pytest.mark.parametrize("prog", EXPORTED, ids=lambda p: p.id)
def test_export_with_a_symbolic_token_count(prog):
    check_export(prog)


@pytest.mark.sweep
def test_every_generated_program():
    failures, results = [], []
    for prog in all_programs():
        try:
            results.append(check(prog))
        except AssertionError as e:
            failures.append(f"{prog.id}: {e}")
    fused = [r for r in results if r["fused"]]
    worst = {
        k: max((r[k] for r in fused if r[k] is not None), default=0.0) for k in ("e_norm", "grad")
    }
    print(
        f"{len(results) + len(failures)} programs, {len(fused)} fused "
        f"({sum(1 for r in fused if r['change'])} with a rounding change), "
        f"{len(failures)} failed; residual_out bit-identical in every fused one; worst norm "
        f"{worst['e_norm']:.3g}, grad {worst['grad']:.3g}"
    )
    assert not failures, "\n".join(failures)
