"""jax_fusedar.fuse on the layouts beyond one shard_map scope, on 8 virtual CPU devices: the
per-linear shard_map (add and norm outside), sequence parallelism (psum_scatter + add +
all_gather), a psum inside a custom_vjp / custom_jvp (Megatron's "g"), a float32 psum cast
down before the add, a psum over several axes of which the others have size 1, and plain
jit (row_parallel_allreduce_fusion with any contraction, size-1 extra axes, float32
gammas). Also the adversarial forms that once changed results silently, and the custom
derivative rules that must survive."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from tests.jax import cpu_helpers
from tests.jax.cpu_helpers import mesh_2x4, put
from tests.jax.fuse_checks import EPS, MESH, F, H, T, assert_close, fuse_and_run
from tests.jax.fuse_checks import linear_operands, megatron_g, norm_after, one_scope, rms_norm
from tests.jax.fuse_checks import row_parallel, scope_operands
from tests.jax.fuse_checks import norm_after, one_scope, rms_norm, row_parallel, scope_operands
import jax_fusedar as jf

cpu_helpers.require_host_devices()

f32, bf16 = jnp.float32, jnp.bfloat16
ONE_SITE = "jax_fusedar.fuse: fused 1 of 1 all-reduce + residual + RMSNorm site(s)"


def per_dp_shard(body, mesh, check_vma=True):
    """``body(x, w, res, g)`` in a shard_map: x over ("dp", "tp"), w over "tp", the residual
    and both outputs over "dp", gamma replicated."""
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P("dp", "tp"), P("tp"), P("dp"), P()),
        out_specs=(P("dp"), P("dp")),
        check_vma=check_vma,
    )


def run(fn, args, mesh, **kw):
    """(report, fused outputs, original outputs, fused grads, original grads), fused on the
    xla backend, or on ``workspace=``; jitted."""
    fused, *rest = fuse_and_run(fn, args, mesh, jit=jax.jit, grads=True, **kw)
    return fused.report, *rest


def close(a, b, ulps=4):
    """Per leaf, within ``ulps`` eps of the first leaf's dtype (1e-6 in float32) of max |b|."""
    dtype = np.asarray(a[0]).dtype
    assert_close(a, b, ulps * (1e-6 if dtype == np.float32 else float(jnp.finfo(dtype).eps)))


def run_close(fn, args, mesh, **kw):
    """``run``, then outputs within 4 ulps of the original's and gradients within 8."""
    rep, out, want, g_f, g_o = run(fn, args, mesh, **kw)
    close(out, want)
    close(g_f, g_o, ulps=8)
    return rep, g_f


# --- across the shard_map boundary ----------------------------------------------------------------


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_per_linear_shard_map_moves_the_add_and_the_norm_in(axis_type):
    mesh = mesh_2x4(axis_type)
    rep, _ = run_close(norm_after(row_parallel(mesh)), linear_operands(mesh), mesh)
    assert rep.line() == ONE_SITE
    assert rep.sites[0].kind == "shard_map psum" and rep.sites[0].tokens == T // 2


def test_a_residual_resharded_by_the_program_before_the_add():
    mesh = mesh_2x4(AxisType.Explicit)
    args = linear_operands(mesh, res_spec=P("dp", "tp"))

    def model(x, w, res, g):
        r = row_parallel(mesh)(x, w) + jax.sharding.reshard(res, P("dp"))
        return r, rms_norm(r, g)

    fused = jf.fuse(model, mesh=mesh, axis_name="tp", backend="xla")
    with jax.set_mesh(mesh):
        fused(*args)
        assert fused.report.sites[0].fused  # the reshard is the residual's own eqn
        text = str(jax.make_jaxpr(fused)(*args))
    assert "jax_fusedar_allreduce_fusion" in text and "psum" not in text


def _sp(norm_on_shard_gathered=True, gather=True):
    mesh = mesh_2x4()

    def body(x, w, res, g):
        s = jax.lax.psum_scatter(x @ w, "tp", scatter_dimension=0, tiled=True)
        r = s + res
        if norm_on_shard_gathered:
            y = rms_norm(r, g)
            return r, jax.lax.all_gather(y, "tp", axis=0, tiled=True) if gather else y
        return r, rms_norm(jax.lax.all_gather(r, "tp", axis=0, tiled=True), g)

    f = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P("dp", "tp"), P("tp"), P(("dp", "tp")), P()),
        out_specs=(P(("dp", "tp")), P("dp") if gather else P(("dp", "tp"))),
        check_vma=False,
    )
    x, w, _, g = linear_operands(mesh)
    res = jnp.asarray(np.random.default_rng(2).standard_normal((T, H)), bf16)
    return f, (x, w, put(mesh, P(("dp", "tp")), res), g), mesh


@pytest.mark.parametrize("on_shard", [True, False], ids=["norm_on_shard", "norm_after_gather"])
def test_sequence_parallel_site_is_one_fused_all_reduce(on_shard):
    """On a kernel workspace (allocating nothing: what fuse meets on GPUs; on CPU its calls run
    the reference, so the rewrite the GPUs would run is checked here)."""
    f, args, mesh = _sp(norm_on_shard_gathered=on_shard)
    ws = jf.abstract_workspace(
        mesh, "tp", max_token_num=T // 2, hidden_dim=H, dtype=bf16, backend="trtllm"
    )
    rep, _ = run_close(f, args, mesh, workspace=ws)
    assert len(rep.fused) == 1 and rep.sites[0].kind == "reduce_scatter", rep.line()
    assert rep.sites[0].tokens == T // 2  # every token of the dp shard
    with jax.set_mesh(mesh):
        text = str(jax.make_jaxpr(jf.fuse(f, workspace=ws))(*args))
    assert "reduce_scatter" not in text and "jax_fusedar_allreduce_fusion" in text


@pytest.mark.parametrize("on_shard", [True, False], ids=["norm_on_shard", "norm_after_gather"])
def test_sequence_parallel_site_without_a_kernel_is_left_as_is(on_shard):
    """On the xla backend the fused call would psum every token and gather the residual: more
    than the original's reduce-scatter and all-gather. The program stays the original."""
    f, args, mesh = _sp(norm_on_shard_gathered=on_shard)
    rep, out, want, g_f, g_o = run(f, args, mesh)
    (site,) = rep.sites
    assert site.kind == "reduce_scatter" and not site.fused, rep.line()
    assert site.reason.startswith(
        "left as is: no kernel here (the workspace is on the xla backend): without the "
        "kernel the fused form would gather the residual"
    ), site.reason
    for a, b in zip(jax.tree.leaves((out, g_f)), jax.tree.leaves((want, g_o))):
        np.testing.assert_array_equal(cpu_helpers.bits(a), cpu_helpers.bits(b))
    with jax.set_mesh(mesh):
        text = str(jax.make_jaxpr(jf.fuse(f, mesh=mesh, backend="xla", axis_name="tp"))(*args))
    assert "reduce_scatter" in text and "jax_fusedar_allreduce_fusion" not in text


def test_sequence_parallel_norm_left_on_the_shard_is_reported():
    f, args, mesh = _sp(gather=False)
    fused = jf.fuse(f, mesh=mesh, axis_name="tp", backend="xla")
    with jax.set_mesh(mesh):
        fused(*args)
    site = fused.report.sites[0]
    assert site.kind == "reduce_scatter" and not site.fused
    assert site.reason.startswith(
        "psum_scatter + add + RMSNorm on the token shard whose output is not all-gathered"
    ), site.reason


# --- a psum with a custom derivative (Megatron's g) -----------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("check_vma", [True, False])
def test_psum_in_a_custom_vjp_is_fused_and_its_backward_kept(check_vma):
    mesh = mesh_2x4()
    g_op = megatron_g(varying=check_vma)
    f = per_dp_shard(norm_after(lambda x, w: g_op(x @ w)), mesh, check_vma=check_vma)
    rep, g_f = run_close(f, linear_operands(mesh), mesh)
    assert len(rep.fused) == 1 and rep.sites[0].kind == "custom_vjp psum", rep.line()
    # Under check_vma=False the rule's identity differs from psum's own transpose (a
    # psum): the fused gradient is the rule's, not psum's.
    if not check_vma:
        plain = norm_after(lambda x, w: jax.lax.psum(x @ w, "tp"))
        _, _, _, g_plain, _ = run(
            per_dp_shard(plain, mesh, check_vma=False), linear_operands(mesh), mesh
        )
        assert not np.allclose(np.asarray(g_plain[0], f32), np.asarray(g_f[0], f32))


def test_psum_in_a_custom_jvp_whose_rule_is_psums_own_is_fused():
    mesh = mesh_2x4()

    @jax.custom_jvp
    def g_bad(v):
        return jax.lax.psum(v, "tp")

    g_bad.defjvp(lambda p, t: (g_bad(*p), 2 * jax.lax.psum(t[0], "tp")))

    for op, fused_ in ((megatron_g("custom_jvp"), True), (g_bad, False)):
        body = norm_after(lambda x, w, op=op: op(x @ w))
        rep, out, want, g_f, g_o = run(per_dp_shard(body, mesh), linear_operands(mesh), mesh)
        assert rep.sites[0].fused == fused_, rep.line()
        close(g_f, g_o, ulps=8)
        if not fused_:
            assert rep.sites[0].reason.startswith("psum inside a custom_jvp whose tangent rule")


# --- float32 psums and axis tuples ----------------------------------------------------------------


def test_float32_psum_cast_down_before_the_add_needs_the_flag():
    mesh = mesh_2x4()

    def f32_sum(x, w):
        return jax.lax.psum(jnp.dot(x, w, preferred_element_type=f32), "tp").astype(bf16)

    f = per_dp_shard(norm_after(f32_sum), mesh)
    args = linear_operands(mesh)
    rep, out, want, _, _ = run(f, args, mesh)
    assert rep.sites[0].reason == (
        "all-reduce in float32, cast to bfloat16 before the residual add: the fused op sums "
        "bfloat16 partials (pass allow_rounding_change=True to fuse it)"
    )
    rep, out, want, g_f, g_o = run(f, args, mesh, allow_rounding_change=True)
    change = rep.sites[0].rounding_change
    assert change == "each rank's float32 partial sum rounded to bfloat16 before the sum"
    close(out, want, ulps=8)


def test_psum_over_an_axis_tuple_whose_other_axes_have_size_one():
    mesh = jax.make_mesh((1, 8), ("z", "tp"), axis_types=(AxisType.Auto,) * 2)
    rng = np.random.default_rng(0)
    x = put(mesh, P(None, ("z", "tp")), jnp.asarray(rng.standard_normal((T, F)), bf16))
    w = put(mesh, P(("z", "tp")), jnp.asarray(rng.standard_normal((F, H)) / 8, bf16))
    args = (x, w, jnp.asarray(rng.standard_normal((T, H)), bf16), jnp.ones((H,), bf16))
    for axes in (("z", "tp"), ("tp", "z")):
        f = jax.shard_map(
            norm_after(lambda x, w, axes=axes: jax.lax.psum(x @ w, axes)),
            mesh=mesh,
            in_specs=(P(None, ("z", "tp")), P(("z", "tp")), P(), P()),
            out_specs=(P(), P()),
        )
        rep, _ = run_close(f, args, mesh)
        assert rep.sites[0].fused, rep.line()
    mesh2 = mesh_2x4()
    f = jax.shard_map(
        norm_after(lambda x, w: jax.lax.psum(x @ w, ("dp", "tp"))),
        mesh=mesh2,
        in_specs=(P(None, ("dp", "tp")), P(("dp", "tp")), P(), P()),
        out_specs=(P(), P()),
    )
    fused = jf.fuse(f, mesh=mesh2, axis_name="tp", backend="xla")
    shapes = (((T, F), bf16), ((F, H), bf16), ((T, H), bf16), ((H,), f32))
    fused.analyze(*(jax.ShapeDtypeStruct(s, d) for s, d in shapes))
    assert fused.report.sites[0].reason == (
        "all-reduce over ('dp', 'tp'): the fused op reduces over one mesh axis ('tp') and "
        "['dp'] have size > 1"
    )


# --- precision: forms that once changed results silently ------------------------------------------


def _one_site(body, *, shape=(T, H), extra=()):
    args = scope_operands(shape=shape, seed=4) + tuple(extra)
    f = cpu_helpers.jit_shard_map(body, MESH, (P("tp"),) + (P(),) * (len(args) - 1), P())
    fused = jf.fuse(f, mesh=MESH, backend="xla")
    out = fused(*args)
    return fused.report, out, f(*args)


def test_constants_around_the_mean_are_accounted_for():
    def plus_one(r, g):  # rsqrt((sum + 1) / H) is RMSNorm with eps = 1/H
        f = r.astype(f32)
        y = f * jax.lax.rsqrt((jnp.sum(f * f, -1, keepdims=True) + 1.0) / H)
        return (y * g.astype(f32)).astype(r.dtype)

    rep, out, want = _one_site(one_scope(plus_one))
    assert rep.sites[0].fused and rep.sites[0].rms_eps == pytest.approx(1 / H)
    close(out, want, ulps=2)

    def times_two(r, g):  # rsqrt(sum * 2 / H + eps): not RMSNorm
        f = r.astype(f32)
        y = f * jax.lax.rsqrt(jnp.sum(f * f, -1, keepdims=True) * 2.0 / H + EPS)
        return (y * g.astype(f32)).astype(r.dtype)

    rep, out, want = _one_site(one_scope(times_two))
    assert rep.sites[0].reason == "the mean divides by 32, not the hidden size 64"
    np.testing.assert_array_equal(np.asarray(out[1], f32), np.asarray(want[1], f32))


def test_a_per_token_scale_is_not_taken_for_gamma_when_tokens_equal_hidden():
    def per_token(x, res, g, s):
        r = jax.lax.psum(x[0], "tp") + res
        f = r.astype(f32)
        n = f * jax.lax.rsqrt(jnp.mean(f * f, -1, keepdims=True) + EPS)
        return r, (n * s[:, None].astype(f32)).astype(r.dtype)

    s = jnp.linspace(0.5, 2.0, H).astype(bf16)
    rep, out, want = _one_site(per_token, shape=(H, H), extra=(s,))
    assert not rep.sites[0].fused
    assert rep.sites[0].reason.startswith("a per-token factor of shape (64,)"), rep.sites[0]
    np.testing.assert_array_equal(np.asarray(out[1], f32), np.asarray(want[1], f32))


@pytest.mark.parametrize(
    "tokens, axis, kind", [(H, 0, "per-channel"), (T, None, "per-tensor"), (T, -1, None)]
)
def test_the_fp8_amax_axis_decides_the_tail(tokens, axis, kind):
    def tail(r, y):
        y32 = y.astype(f32)
        s = jnp.maximum(jnp.max(jnp.abs(y32), axis=axis, keepdims=True) / 448, 1 / (512 * 448))
        return r, jnp.clip(y32 / s, -448, 448).astype(jnp.float8_e4m3fn).astype(f32), s

    rep, out, want = _one_site(one_scope(rms_norm, tail), shape=(tokens, H))
    site = rep.sites[0]
    assert site.fused
    if kind is None:
        assert site.pattern == 10 and site.note is None
        assert np.max(np.abs(np.asarray(out[1]) - np.asarray(want[1]))) <= 448 / 8
    else:  # the norm is fused, the tail stays as written (on the fused norm's output)
        assert site.pattern == 1 and kind in site.note, site
        np.testing.assert_allclose(np.asarray(out[2]), np.asarray(want[2]), rtol=2**-7)


# --- custom derivative rules survive --------------------------------------------------------------


def test_custom_rules_beside_the_norm_and_at_unfused_sites_are_kept():
    @jax.custom_vjp
    def no_grad(v):
        return v

    no_grad.defvjp(lambda v: (v, None), lambda _, ct: (jnp.zeros_like(ct),))

    @jax.custom_vjp
    def half_grad_norm(r, g):  # a norm with its own (deliberately different) rule
        return rms_norm(r, g)

    half_grad_norm.defvjp(
        lambda r, g: (rms_norm(r, g), (r, g)),
        lambda res, ct: tuple(0.5 * v for v in jax.vjp(rms_norm, *res)[1](ct)),
    )
    beside = one_scope(rms_norm, lambda r, y: (r, y, no_grad(r) * 3))
    args = scope_operands("float32", shape=(T, H), seed=5)
    for body, fused_, n_out in ((beside, True, 3), (one_scope(half_grad_norm), False, 2)):
        f = cpu_helpers.jit_shard_map(body, MESH, (P("tp"), P(), P()), (P(),) * n_out)
        rep, out, want, g_f, g_o = run(f, args, MESH)
        assert rep.sites[0].fused == fused_, rep.line()
        for a, b in zip(g_f, g_o):  # the rules' gradients, not the plain derivative
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
        if not fused_:
            assert rep.sites[0].reason.startswith("the RMSNorm is inside a custom_vjp")


def test_plain_jit_program_without_sites_says_what_to_do():
    fused = jf.fuse(lambda a, b: a @ b + 1, mesh=mesh_2x4(), axis_name="tp", backend="xla")
    rep = fused.analyze(jax.ShapeDtypeStruct((T, F), f32), jax.ShapeDtypeStruct((F, H), f32))
    assert rep.line().startswith(
        "jax_fusedar.fuse: fused 0 of 0 all-reduce + residual + RMSNorm site(s): no all-reduce"
    )
    assert "under plain jax.jit with shardings, dot_general + add + RMSNorm" in rep.line()


@pytest.mark.slow
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_plain_jit_size_one_axes_and_float32_gamma(axis_type):
    """A contraction sharded over ('tp', 'z') with z of size 1, and a float32 gamma (a
    rounding change: fused with the flag, the kernel reading it in bfloat16)."""
    mesh = jax.make_mesh((8, 1), ("tp", "z"), axis_types=(axis_type,) * 2)
    rng = np.random.default_rng(6)
    h = put(mesh, P(None, None, ("tp", "z")), jnp.asarray(rng.standard_normal((2, 4, F)), bf16))
    w = put(mesh, P(("tp", "z")), jnp.asarray(rng.standard_normal((F, H)) / 8, bf16))
    res = jnp.asarray(rng.standard_normal((2, 4, H)), bf16)
    g = jnp.asarray(1 + 0.1 * rng.standard_normal(H), f32)
    spec = P() if axis_type == AxisType.Explicit else None
    model = norm_after(lambda h, w: jnp.einsum("btf,fd->btd", h, w, out_sharding=spec))
    rep, out, want, g_f, g_o = run(model, (h, w, res, g), mesh, allow_rounding_change=True)
    assert rep.sites[0].fused and rep.sites[0].rounding_change == "gamma rounded to bfloat16"
    close(out, want, ulps=4)
    ws = jf.create_allreduce_fusion_workspace(
        mesh, "tp", max_token_num=8, hidden_dim=H, dtype=bf16, backend="xla"
    )
    # The entry itself, without the flag's help: the size-1 axis is no second reduction
    # axis (the workspace serves it: no fallback, so strict mode is fine).
    kw = dict(workspace=ws, strict=True, contracting_dims=((2,), (0,)))
    with jax.set_mesh(mesh):
        direct = jax.jit(
            lambda *a: jf.row_parallel_allreduce_fusion(
                a[0], a[1], residual=a[2], rms_gamma=a[3], **kw
            )
        )(h, w, res, g)
    close((direct.residual_out, direct.norm_out), want, ulps=4)
    ws.destroy()


def test_two_contracted_dims_in_the_entry():
    mesh = mesh_2x4()
    rng = np.random.default_rng(7)
    a = put(mesh, P("dp", "tp"), jnp.asarray(rng.standard_normal((2, 8, 4, 16)), f32))
    wo = put(mesh, P("tp"), jnp.asarray(rng.standard_normal((8, 16, H)) / 8, f32))
    res = jnp.asarray(rng.standard_normal((2, 4, H)), f32)
    g = jnp.asarray(1 + 0.1 * rng.standard_normal(H), f32)
    out = jax.jit(
        lambda *a: jf.row_parallel_allreduce_fusion(
            a[0], a[1], residual=a[2], rms_gamma=a[3], contracting_dims=((1, 3), (0, 1))
        )
    )(a, wo, res, g)
    a64, wo64, res64 = (np.asarray(v, np.float64) for v in (a, wo, res))
    r = np.einsum("bhtq,hqd->btd", a64, wo64) + res64
    y = r / np.sqrt(np.mean(r * r, -1, keepdims=True) + EPS) * np.asarray(g, np.float64)
    np.testing.assert_allclose(np.asarray(out.residual_out), r, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out.norm_out), y, rtol=1e-5, atol=1e-5)
    for bad, message in (
        (((1,), (0, 1)), "pairs h's and w's dims one to one"),
        (((3,), (1,)), "w (8, 16, 64) must keep exactly one dim"),
        (((0, 3), (0, 1)), "pairs h's dim 0 (2) with w's dim 0 (8)"),
    ):
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            jf.row_parallel_allreduce_fusion(a, wo, residual=res, rms_gamma=g, contracting_dims=bad)


def test_probe_validation_catches_a_proof_that_misreads_the_equations():
    """The safety net: the proven equations, run in float64 on probes, must give the
    formula the proof claims; a proof claiming another eps or weight_bias is refused."""
    from jax_fusedar.fusion import graph, norm_proof, validation
    from jax_fusedar.fusion.report import Reject

    def site(r, g):
        f = r.astype(f32)
        return (
            f / jnp.sqrt(jnp.mean(f**2, -1, keepdims=True) + EPS) * (1.0 + g.astype(f32))
        ).astype(r.dtype)

    for shape in ((T, H), (H, H), (2, 3, H)):
        jaxpr = jax.make_jaxpr(site)(jnp.ones(shape, bf16), jnp.ones((H,), bf16)).jaxpr
        g, r = graph.Graph(jaxpr), jaxpr.invars[0]
        proof = norm_proof.prove_rms_norm(g, r, allow=False)
        assert proof.weight_bias == 1.0 and proof.eps == pytest.approx(EPS)
        validation.check(g, proof, r)  # the right formula passes
        for field, wrong in (("eps", 1e-2), ("weight_bias", 0.0)):
            bad = norm_proof.NormProof(**{**proof.__dict__, field: wrong})
            with pytest.raises(Reject, match="differs from the fused op's by"):
                validation.check(g, bad, r)


def test_a_missing_jax_internal_names_the_jax_needed():
    from jax_fusedar.fusion import jax_internals

    with pytest.raises(
        jax_internals.MissingJaxInternal,
        match=r"jax_fusedar.fuse needs jax._src.core.no_such_helper, which JAX "
        r"\S+ does not have; the fusion pass was written for JAX 0.10 "
        r"\(tested on 0.10.2 and 0.11.2\): install jax==0.10.\*",
    ):
        jax_internals.internal("jax._src.core", "no_such_helper")
