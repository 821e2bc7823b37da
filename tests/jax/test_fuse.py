"""jax_fusedar.fuse on 8 virtual CPU devices: every form and wrapper of docs/fusion_pass.md.

A fused program must equal, bit for bit, the same program written by hand with
``jax_fusedar.allreduce_fusion`` (the pass only swaps the equations of a site for the fused
op); against the original it must agree within the fused op's documented rounding (the
oracle bounds of tests/jax/cpu_helpers.py). Forms whose rounding differs stay unfused with their
reason, unless allow_rounding_change is set.
"""

import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from tests.jax import cpu_helpers, fuse_checks
from tests.jax.fuse_checks import MESH, H, assert_close, assert_equal_values, one_scope, rms_norm
from tests.jax.fuse_checks import scope_operands
import jax_fusedar as jf

cpu_helpers.require_host_devices()

EPS = 1e-6
T = 6  # scope_operands' tokens
f32 = jnp.float32
ONE_SITE = "jax_fusedar.fuse: fused 1 of 1 all-reduce + residual + RMSNorm site(s)"


# --- the norms as users write them (plain jnp: fuse_checks.rms_norm) ------------------------------


def normalized(r):  # float32 inside, no gamma, not cast back
    f = r.astype(f32)
    return f * jax.lax.rsqrt(jnp.mean(f * f, axis=-1, keepdims=True) + EPS)


def gemma(r, g):  # 1 + gamma
    return (normalized(r) * (1.0 + g.astype(f32))).astype(r.dtype)


def no_gamma(r, g):
    return normalized(r).astype(r.dtype)


def f32_norm(r, axis):  # no gamma, not cast back, x ** 2
    return r.astype(f32) * jax.lax.rsqrt(
        jnp.mean(r.astype(f32) ** 2, axis=axis, keepdims=True) + EPS
    )


def norm_pow(r, g, eps=EPS):  # x ** 2 (integer_pow), 1/sqrt
    f = r.astype(f32)
    n = f * jax.lax.rsqrt(jnp.mean(f**2, axis=-1, keepdims=True) + eps)
    return (g.astype(f32) * n).astype(r.dtype)


def norm_maxtext(r, g, eps=EPS):  # cast to T, then gamma in T
    f = r.astype(f32)
    n = f * jax.lax.rsqrt(jnp.mean(jnp.square(f), axis=-1, keepdims=True) + eps)
    return n.astype(r.dtype) * g.astype(r.dtype)


def norm_linen(r, g, eps=EPS):  # flax.linen.RMSNorm's sequence
    f = r.astype(f32)
    ms = jnp.mean(jax.lax.square(f), axis=-1)
    mean = jnp.zeros_like(ms)
    y = r.astype(f32) - mean[..., None]
    inv = jax.lax.rsqrt(ms[..., None] + eps)
    return (y * (inv * g.reshape(1, -1).astype(f32))).astype(r.dtype)


def norm_nnx(r, g, eps=EPS):  # f32 param cast to T, then to f32
    gb = g.astype(r.dtype)
    f = r.astype(f32)
    ms = jnp.mean(jax.lax.square(f), axis=-1)
    inv = jax.lax.rsqrt(ms.reshape(ms.shape + (1,)) + eps)
    scale = gb.reshape(1, -1).astype(f32)
    return (r.astype(f32) * (inv * scale)).astype(r.dtype)


def smap(body, n_out=2, n_in=3, check_vma=True):
    return jax.jit(fuse_checks.smap(body, n_in, n_out, check_vma))


def hand_body(ws, **kw):
    """The same site written with the fused op directly (what fuse must produce)."""

    def body(x, res, g):
        h = res.shape[-1]
        out = jf.allreduce_fusion(
            x[0].reshape(-1, h),
            axis_name="tp",
            workspace=ws,
            residual=res.reshape(-1, h),
            rms_gamma=g.astype(res.dtype),
            rms_eps=float(np.float32(EPS)),
            **kw,
        )
        return out.residual_out.reshape(res.shape), out.norm_out.reshape(res.shape)

    return body


def run(body, ws, args=None, n_out=2, n_in=3, check_vma=True, **kw):
    """(unfused program, fused program, its outputs): ``body`` in smap, fused on ``ws``, run
    on ``args`` (default scope_operands())."""
    f = smap(body, n_out, n_in, check_vma)
    fused = jf.fuse(f, workspace=ws, **kw)
    return f, fused, fused(*(args or scope_operands()))


@pytest.fixture(scope="module")
def ws():
    with jf.create_allreduce_fusion_workspace(
        MESH, "tp", max_token_num=64, hidden_dim=H, dtype=jnp.bfloat16, backend="xla"
    ) as w:
        yield w


def assert_close_to_unfused(unfused, fused, dtype="bfloat16"):
    """Within the fused op's rounding of the unfused twin: psum in T vs the fp32 sum rounded
    once, an ulp of the residual sum carried through the norm (cpu_helpers.py's bounds)."""
    assert_close(fused, unfused, 4 * float(jnp.finfo(dtype).eps), floor=0.0)


# --- forms that fuse ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "norm", [rms_norm, norm_pow, norm_linen, norm_nnx], ids=lambda n: n.__name__
)
def test_exact_forms_are_fused_and_equal_the_hand_written_op(norm, ws):
    # nnx rounds its f32 param to T
    args = scope_operands(gamma_dtype="float32" if norm is norm_nnx else None)
    f, fused, out = run(one_scope(norm), ws, args)
    assert fused.report.line() == ONE_SITE
    site = fused.report.sites[0]
    assert (site.pattern, site.tokens, site.hidden, site.dtype) == (1, T, H, "bfloat16")
    assert site.rms_eps == pytest.approx(EPS) and site.rounding_change is None
    assert_equal_values(out, smap(hand_body(ws))(*args))
    assert_close_to_unfused(f(*args), out)
    text = str(jax.make_jaxpr(fused)(*args))
    assert "jax_fusedar_allreduce_fusion" in text and "psum" not in text


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_other_dtypes(dtype):
    args = scope_operands(dtype)
    with jf.fuse(smap(one_scope(rms_norm)), mesh=MESH, axis_name="tp", backend="xla") as fused:
        out = fused(*args)
        assert len(fused.report.fused) == 1
        ws = fused.workspaces[0]
        assert (ws.dtype.name, ws.max_token_num, ws.hidden_dim) == (dtype, T, H)
        assert_equal_values(out, smap(hand_body(ws))(*args))
    assert ws.destroyed  # the transform's own workspaces go with it


def test_3d_activations_and_check_vma_off(ws):
    args = scope_operands(shape=(2, 3, H))
    f, fused, out = run(one_scope(rms_norm), ws, args, check_vma=False)
    assert "psum[" in str(jax.make_jaxpr(f)(*args))  # plain psum without check_vma
    assert fused.report.sites[0].tokens == 6 and fused.report.sites[0].fused
    assert_equal_values(out, smap(hand_body(ws))(*args))


def _wrapped_models():
    """name -> (per-rank body with the site inside a wrapper the pass must see through, sites,
    fused runs)."""

    def layer(x, r, g):
        r = jax.lax.psum(x, "tp") + r
        return r, rms_norm(r, g)

    def scanned(block, second):  # over the gammas (g, second(g)); scan_remat: nn.scan(nn.remat)
        def fn(x, res, g):
            def step(carry, gi):
                return block(x[0] + carry[1], carry[0], gi), None

            (r, h), _ = jax.lax.scan(step, (res, jnp.zeros_like(res)), jnp.stack([g, second(g)]))
            return r, h

        return fn

    def in_fori(x, res, g):
        return jax.lax.fori_loop(
            0, 3, lambda i, c: layer(x[0] + c[1], c[0], g), (res, jnp.zeros_like(res))
        )

    def in_while(x, res, g):
        def body(c):
            i, r, h = c
            r, h = layer(x[0] + h, r, g)
            return i + 1, r, h

        _, r, h = jax.lax.while_loop(lambda c: c[0] < 2, body, (0, res, jnp.zeros_like(res)))
        return r, h

    def in_cond(x, res, g):
        return jax.lax.cond(
            x[0, 0, 0] > 0, lambda: layer(x[0], res, g), lambda: layer(-x[0], res, g)
        )

    @jax.custom_jvp
    def cnorm(r, g):
        return rms_norm(r, g)

    cnorm.defjvp(lambda p, t: (cnorm(*p), t[0]))

    @jax.custom_vjp
    def vlayer(x, r, g):
        return layer(x, r, g)

    vlayer.defvjp(lambda x, r, g: (layer(x, r, g), None), lambda _, ct: (ct[0], ct[0], None))
    return {
        "scan": (scanned(layer, lambda g: g * 1.5), 1, 2),
        "fori_loop": (in_fori, 1, 3),
        "while": (in_while, 1, None),
        "cond": (in_cond, 2, 2),
        "jit": (lambda x, res, g: jax.jit(layer)(x[0], res, g), 1, 1),
        "norm_in_jit": (one_scope(jax.jit(rms_norm)), 1, 1),  # only the norm is jitted
        "norm_in_remat": (one_scope(jax.checkpoint(rms_norm)), 1, 1),  # only the norm
        "remat": (lambda x, res, g: jax.checkpoint(layer)(x[0], res, g), 1, 1),
        "custom_vjp": (lambda x, res, g: vlayer(x[0], res, g), 1, 1),
        "scan_remat": (scanned(jax.checkpoint(layer), lambda g: g), 1, 2),
        "norm_in_custom_jvp": (one_scope(cnorm), 1, 0),
    }


MODELS = _wrapped_models()


@pytest.mark.parametrize("name", list(MODELS))
def test_sites_inside_wrappers_are_fused(name, ws):
    body, n_sites, runs = MODELS[name]
    args = scope_operands()
    f, fused, out = run(body, ws, args)
    rep = fused.report
    if runs == 0:  # a norm with its own derivative rule: fusing would drop the rule
        assert rep.sites[0].reason.startswith(
            "the RMSNorm is inside a custom_jvp (fusing would drop its derivative rule)"
        ), rep.line()
        assert_equal_values(out, f(*args))
        return
    assert len(rep.sites) == n_sites and len(rep.fused) == n_sites, rep.line()
    assert rep.fused_runs() == runs  # scan/fori lengths counted; cond: each branch counts
    text = str(jax.make_jaxpr(fused)(*args))
    assert text.count("jax_fusedar_allreduce_fusion") == n_sites
    assert "psum" not in text
    assert_close_to_unfused(f(*args), out)


def test_fuse_of_jit_and_jit_of_fuse_agree(ws):
    args = scope_operands()
    sm = fuse_checks.smap(one_scope(rms_norm))
    a = jf.fuse(jax.jit(sm), workspace=ws)(*args)
    b = jax.jit(jf.fuse(sm, workspace=ws))(*args)
    c = jf.fuse(sm, workspace=ws)(*args)  # eager shard_map inside
    for other in (b, c, smap(hand_body(ws))(*args)):
        assert_equal_values(a, other)


def test_the_equations_fuse_keeps_keep_the_models_names(ws):
    """What fuse leaves as it is is recorded as the model traced it, not bound again: the
    model's named scopes stay in the fused program (its profiles and HLO dumps)."""

    def body(x, res, g):
        with jax.named_scope("before_the_site"):
            y = jnp.tanh(x[0])
        r = jax.lax.psum(y, "tp") + res
        n = rms_norm(r, g)
        with jax.named_scope("after_the_site"):
            return r, jnp.sin(n)

    args = scope_operands()
    fused = jf.fuse(smap(body), workspace=ws)
    text = jax.jit(fused).lower(*args).as_text(debug_info=True)
    assert len(fused.report.fused) == 1
    for name in ("before_the_site/tanh", "after_the_site/sin"):
        assert name in text, name
    assert_equal_values(fused(*args), smap(body)(*args))


def test_kwargs_and_pytrees_pass_through(ws):
    x, res, g = scope_operands()

    def fn(x, *, state):
        def body(x, res, g):
            r = jax.lax.psum(x[0], "tp") + res
            return {"r": r, "h": rms_norm(r, g)}

        return jax.shard_map(
            body, mesh=MESH, in_specs=(P("tp"), P(), P()), out_specs={"r": P(), "h": P()}
        )(x, state["res"], state["g"])

    out = jf.fuse(fn, workspace=ws)(x, state={"res": res, "g": g})
    assert set(out) == {"r", "h"}
    assert_equal_values((out["r"], out["h"]), smap(hand_body(ws))(x, res, g))


@pytest.mark.parametrize("norm, bias", [(gemma, 1.0), (no_gamma, 0.0)], ids=["gemma", "no_gamma"])
def test_gemma_one_plus_gamma_and_no_gamma(norm, bias, ws):
    x, res, g = args = scope_operands()
    _, fused, out = run(one_scope(norm), ws, args)
    site = fused.report.sites[0]
    assert site.fused and site.weight_bias == bias, site
    hand = smap(hand_body(ws, weight_bias=bias))(x, res, g if bias else jnp.ones_like(g))
    assert_equal_values(out, hand)


@pytest.mark.parametrize("keep, pattern", [(True, 4), (False, 2)], ids=["pattern_4", "pattern_2"])
def test_static_fp8_tail_becomes_pattern_4_or_2(keep, pattern, ws):
    args = scope_operands() + (f32(0.05),)

    def tail(r, y, s):
        q = jnp.clip(y.astype(f32) / s, -448, 448).astype(jnp.float8_e4m3fn)
        return (r, q, y) if keep else (r, q)

    f, fused, out = run(one_scope(rms_norm, tail), ws, args, n_out=3 if keep else 2, n_in=4)
    assert fused.report.sites[0].pattern == pattern, fused.report
    # FP8 codes: within one e4m3 step of the unfused program's (rounding of the norm
    # and the kernel's reciprocal multiply, quant_reference's documented modes).
    qa, qb = (np.asarray(o[1], f32) for o in (out, f(*args)))
    assert np.max(np.abs(qa - qb)) <= np.max(np.abs(qb)) / 8


def test_dynamic_fp8_tail_becomes_pattern_11(ws):
    def tail(r, y):
        y32 = y.astype(f32)
        s = jnp.maximum(jnp.max(jnp.abs(y32), axis=-1, keepdims=True) / 448, 1 / (512 * 448))
        return r, y, jnp.clip(y32 / s, -448, 448).astype(jnp.float8_e4m3fn), s

    args = scope_operands()
    f, fused, out = run(one_scope(rms_norm, tail), ws, args, n_out=4)
    assert fused.report.sites[0].pattern == 11, fused.report
    ref = f(*args)
    np.testing.assert_allclose(np.asarray(out[3]), np.asarray(ref[3]), rtol=2e-2)
    qa, qb = np.asarray(out[2], f32), np.asarray(ref[2], f32)
    assert np.max(np.abs(qa - qb)) <= 448 / 8


# --- forms left alone, with reasons ---------------------------------------------------------------


def _reason(body, ws, *, gamma_dtype=None, allow=False):
    args = scope_operands(gamma_dtype=gamma_dtype)
    f, fused, out = run(body, ws, args, allow_rounding_change=allow)
    return fused.report, f(*args), out


NOT_EXACT = {  # reason -> per-rank body (gamma in bfloat16 but for the first)
    "float32 gamma (the kernel reads gamma in bfloat16)": one_scope(rms_norm),
    "eps traced (not a constant)": one_scope(
        lambda r, g: rms_norm(r, g, eps=g[0].astype(f32) * 0 + 1e-6)
    ),
    "norm over axis 0, not the last": one_scope(lambda r, g: f32_norm(r, 0).astype(r.dtype)),
    "RMSNorm computed in bfloat16, not float32": one_scope(
        lambda r, g: (r * jax.lax.rsqrt(jnp.mean(r * r, axis=-1, keepdims=True) + EPS)) * g
    ),
    "the norm output is not cast back to bfloat16": one_scope(lambda r, g: f32_norm(r, -1)),
    "the all-reduce is not followed by a residual add": lambda x, res, g: (
        jax.lax.psum(x[0], "tp"),
        rms_norm(res, g),
    ),
    "all-reduce in float32 of bfloat16 values": lambda x, res, g: (
        (jax.lax.psum(x[0].astype(f32), "tp") + res.astype(f32)).astype(res.dtype),
        rms_norm(res, g),
    ),
    "no RMSNorm of the residual sum in the same scope": lambda x, res, g: (
        jax.lax.psum(x[0], "tp") + res,
        res,
    ),
}


@pytest.mark.parametrize("reason", list(NOT_EXACT))
def test_non_exact_forms_stay_unfused_with_the_reason(reason, ws):
    gamma_dtype = "float32" if reason.startswith("float32 gamma") else None
    rep, unfused, out = _reason(NOT_EXACT[reason], ws, gamma_dtype=gamma_dtype)
    assert len(rep.sites) == 1 and not rep.fused
    assert rep.sites[0].reason.startswith(reason), rep.sites[0].reason
    assert reason in rep.line()
    assert_equal_values(unfused, out)  # left alone: the very same program


def test_allow_rounding_change_fuses_and_reports_it(ws):
    rep, unfused, out = _reason(one_scope(rms_norm), ws, gamma_dtype="float32", allow=True)
    assert len(rep.fused) == 1 and rep.sites[0].rounding_change == "gamma rounded to bfloat16"
    assert_equal_values(out, smap(hand_body(ws))(*scope_operands(gamma_dtype="float32")))
    assert_close_to_unfused(unfused, out)


def test_all_reduce_over_another_axis_is_reported():
    mesh2 = jax.make_mesh((2, 4), ("dp", "tp"))
    x = jax.device_put(jnp.ones((8, T, H), jnp.bfloat16), NamedSharding(mesh2, P(("dp", "tp"))))
    res = jax.device_put(jnp.ones((2 * T, H), jnp.bfloat16), NamedSharding(mesh2, P("dp")))

    def body(x, res, g):
        r = jax.lax.psum(x[0], "dp") + res  # over dp: not the fused axis
        return r, rms_norm(r, g)

    in_specs = (P(("dp", "tp")), P("dp"), P())
    f = cpu_helpers.jit_shard_map(body, mesh2, in_specs, (P("dp"), P("dp")), check_vma=False)
    fused = jf.fuse(f, mesh=mesh2, axis_name="tp", backend="xla")
    fused(x, res, jnp.ones((H,), jnp.bfloat16))
    assert fused.report.sites[0].reason == "all-reduce over ('dp',), not the fused axis 'tp'"


def test_sites_above_the_workspace_stay_unfused(ws):
    args = scope_operands(shape=(2 * 64, H))  # 128 tokens > the workspace's 64
    f, fused, _ = run(one_scope(rms_norm), ws, args)
    assert fused.report.sites[0].reason == "tokens 128 x hidden 64 > workspace max 64 x 64"
    capped = jf.fuse(f, mesh=MESH, axis_name="tp", backend="xla", max_tokens=100)
    capped(*args)
    assert capped.report.sites[0].reason == "tokens 128 > max_tokens 100"
    assert not capped.workspaces


def test_created_workspaces_are_reused_and_grown():
    with jf.fuse(smap(one_scope(rms_norm)), mesh=MESH, backend="xla") as fused:  # axis implied
        fused(*scope_operands(shape=(4, H)))
        fused(*scope_operands(shape=(2, H)))
        assert [w.max_token_num for w in fused.workspaces] == [4]
        fused(*scope_operands(shape=(16, H)))
        assert [w.max_token_num for w in fused.workspaces] == [4, 16]
        assert fused.report.sites[0].fused


@pytest.mark.parametrize("allow", [False, True])
def test_gamma_after_the_rounding_fuses_exactly(allow, ws):
    """MaxText's and Hugging Face's order (normalized, rounded to T, then gamma in T): the fused
    op computes the rounded value, gamma's multiplication stays after it: exact either way."""
    rep, unfused, out = _reason(one_scope(norm_maxtext), ws, allow=allow)
    assert len(rep.fused) == 1, rep.line()
    assert rep.sites[0].rounding_change is None

    def by_hand(x, res, g):
        r, y = hand_body(ws)(x, res, jnp.ones_like(g))
        return r, y * g.astype(y.dtype)

    assert_equal_values(out, smap(by_hand)(*scope_operands()))
    assert_equal_values(out, unfused)


def test_report_is_logged_as_one_line(ws, caplog):
    with caplog.at_level(logging.INFO, logger="jax_fusedar"):
        run(one_scope(rms_norm), ws, scope_operands(gamma_dtype="float32"))
    lines = [r.getMessage() for r in caplog.records if "jax_fusedar.fuse:" in r.getMessage()]
    assert lines == [
        "jax_fusedar.fuse: fused 0 of 1 all-reduce + residual + RMSNorm site(s); "
        "not fused: 1 x float32 gamma (the kernel reads gamma in bfloat16); near misses: "
        "psum_invariant [6, 64] at jit(body)/shard_map, then add, (output), "
        "convert_element_type, mul, mul: float32 gamma (the kernel reads gamma in bfloat16)"
    ]


def test_report_as_data(ws):
    args = scope_operands()
    d = jf.fuse(smap(one_scope(rms_norm)), workspace=ws).analyze(*args).as_dict()
    assert d["fused"] == 1 and d["sites"][0]["pattern"] == 1 and d["sites"][0]["runs"] == 1
    assert d["sites"][0]["where"].startswith("jit(")
    # The pass's own time, measured inside the trace: more than nothing, less than it all.
    start = time.perf_counter()
    rep = jf.fuse(smap(one_scope(rms_norm)), workspace=ws).analyze(*args)
    assert 0 < rep.as_dict()["pass_s"] == rep.pass_s < time.perf_counter() - start
    assert 0 < rep.as_dict()["analysis_s"] == rep.analysis_s < rep.pass_s


def test_grad_of_fused_equals_grad_of_original():
    x, res, g = scope_operands("float32")
    with jf.create_allreduce_fusion_workspace(
        MESH, "tp", max_token_num=T, hidden_dim=H, dtype=f32, backend="xla"
    ) as w32:
        f = smap(one_scope(rms_norm))

        def loss(fn):
            return lambda x, res, g: sum(jnp.sum(o**2) for o in fn(x, res, g))

        # MESH has Explicit axes: the loss's scalar sum needs the mesh in context.
        with jax.set_mesh(MESH):
            want = jax.grad(loss(f), argnums=(0, 1, 2))(x, res, g)
            got = jax.grad(loss(jf.fuse(f, workspace=w32)), argnums=(0, 1, 2))(x, res, g)
    for a, b in zip(want, got):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-4)


TYPE_ERRORS = [  # fuse(lambda x: x, **kwargs) raises TypeError("fuse: " + message ...)
    (dict(mesh="tp"), "mesh must be a jax.sharding.Mesh, got str"),
    (
        dict(mesh=MESH, allow_rounding_change="yes"),
        "allow_rounding_change must be True or False, got 'yes'",
    ),
    (dict(workspace=object()), "workspace must come from"),
    (dict(mesh=MESH, use_oneshot=1), "use_oneshot must be None, True or False, got 1"),
    (dict(mesh=MESH, strict="on"), "strict must be None, True or False"),
    (dict(mesh=MESH, log_level="INFO"), "log_level must be a logging level (int), got 'INFO'"),
]
VALUE_ERRORS = [
    (dict(mesh=MESH, axis_name="dp"), "axis_name 'dp' is not an axis of the mesh ('tp',)"),
    (dict(mesh=MESH, max_tokens=0), "max_tokens must be a positive integer, got 0"),
    (dict(mesh=MESH, backend="nccl"), "backend must be 'auto', 'trtllm' or 'xla', got 'nccl'"),
]


@pytest.mark.parametrize(
    "error, kwargs, message",
    [(TypeError, *row) for row in TYPE_ERRORS] + [(ValueError, *row) for row in VALUE_ERRORS],
    ids=[message for _, message in TYPE_ERRORS + VALUE_ERRORS],
)
def test_bad_arguments_are_refused_by_name(error, kwargs, message):
    with pytest.raises(error) as e:
        jf.fuse(lambda x: x, **kwargs)
    assert "fuse: " + message in str(e.value)


@pytest.mark.oldest
def test_a_jax_older_than_the_pass_needs_is_named(monkeypatch):
    """The pass reads jaxprs through JAX 0.10's APIs: on an older JAX (the oldest lane's, or
    0.9.3 faked) fuse refuses before any trace, naming what it needs, not an AttributeError."""
    if jax.__version_info__ >= (0, 10):
        monkeypatch.setattr(jax, "__version_info__", (0, 9, 3))
        monkeypatch.setattr(jax, "__version__", "0.9.3")
    needs = (
        rf"jax_fusedar\.fuse needs JAX >= 0\.10, found jax {jax.__version__}: pip install "
        rf"-U 'jax>=0\.10', or call jax_fusedar\.allreduce_fusion in the model directly "
        rf"\(it runs on JAX >= {jf.MIN_JAX}\)"
    )
    with pytest.raises(RuntimeError, match=needs):
        jf.fuse(lambda x: x, mesh=MESH)
    with pytest.raises(RuntimeError, match=needs):
        jf.fuse(mesh=MESH)(lambda x: x)  # the decorator form
    with pytest.raises(ValueError, match="fuse: max_tokens must be a positive integer"):
        jf.fuse(lambda x: x, mesh=MESH, max_tokens=0)  # the arguments are checked first


def test_a_missing_or_mismatched_mesh_or_fn_is_refused(ws):
    with pytest.raises(ValueError) as e:
        jf.fuse(lambda x: x)
    assert "fuse needs mesh= (and axis_name=) to create workspaces, or workspace=" in str(e.value)
    with pytest.raises(
        ValueError, match="fuse: axis_name 'dp' differs from the workspace's axis 'tp'"
    ):
        jf.fuse(lambda x: x, workspace=ws, axis_name="dp")
    with pytest.raises(TypeError, match="fuse: fn must be callable"):
        jf.fuse(3, workspace=ws)
    mesh2 = jax.make_mesh((2, 4), ("dp", "tp"))
    with pytest.raises(ValueError, match=r"pass axis_name= \(the tensor-parallel axis\)"):
        jf.fuse(lambda x: x, mesh=mesh2)


def test_two_all_reduces_into_one_add_fuse_once(ws):
    # r = psum(a) + psum(b): the first becomes the fused op with psum(b) as its residual; the
    # second cannot claim the same add.
    def body(x, res, g):
        r = jax.lax.psum(x[0], "tp") + jax.lax.psum(x[0] * 2, "tp")
        return r, rms_norm(r, g)

    args = scope_operands()
    f, fused, out = run(body, ws, args)
    assert [s.reason for s in fused.report.sites] == [None, "overlaps another fused site"]
    assert_close_to_unfused(f(*args), out)
