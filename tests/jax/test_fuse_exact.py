"""jax_fusedar.fuse is exact or absent, on 8 virtual CPU devices: programs that once changed
results silently, crashed inside fuse, or were refused with the wrong reason. Both programs
compiled with XLA rounding as written (tests/jax/fuse_checks.py): a fused site rounds like
the program (or, with allow_rounding_change, stays within the bound with the change named);
a site left alone gives the very same outputs, with the reason that names its cause.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from tests.jax import cpu_helpers
from tests.jax.cpu_helpers import mesh_2x4
from tests.jax.fuse_checks import EPS, MESH, H, assert_bit_equal, assert_rounds_like_the_program
from tests.jax.fuse_checks import compiled, fuse_and_run, linear_operands, megatron_g, norm_after
from tests.jax.fuse_checks import norm_units, one_scope, rms_norm, row_parallel, scope_operands
from tests.jax.fuse_checks import smap, statistic
import jax_fusedar as jf
from jax_fusedar import workspace as wsmod

cpu_helpers.require_host_devices()

f32, bf16, f16 = jnp.float32, jnp.bfloat16, jnp.float16
OTHER_USES = "the all-reduce's result has other uses besides the residual"
CAST_DOWN = (
    "all-reduce in float32, cast to bfloat16 before the residual add: the fused op sums "
    "bfloat16 partials (pass allow_rounding_change=True to fuse it)"
)


def gemma(rounded):
    """Gemma's norm, the program rounding (1 + w) to T (``rounded``) or not."""

    def norm(r, w):
        x = r.astype(f32)
        n = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + EPS)
        scale = 1.0 + w.astype(f32)
        if rounded:
            scale = scale.astype(r.dtype).astype(f32)
        return (n * scale).astype(r.dtype)

    return norm


def run(fn, args, mesh=MESH, **kw):
    """(report, fused outputs, original outputs), both compiled rounding as written."""
    fused, out, want = fuse_and_run(fn, args, mesh, **kw)
    return fused.report, out, want


def lin(mesh):
    return linear_operands(mesh, g_spec=P())


def assert_norm_exact(norm_fn, out, g, col=None):
    """The fused norm output against the program's own norm of the fused residual_out."""
    r, y = out[0], out[1]
    c = np.asarray(g, np.float64) if col is None else col
    exact = np.asarray(r, np.float64) * statistic(r, EPS) * c
    assert_rounds_like_the_program(y, compiled(norm_fn)(r, g), exact, np.dtype(r.dtype).name)


def assert_unchanged(fn, args, reason, mesh=MESH, **kw):
    """``fn``'s one site is left alone with ``reason``: the fused program is the original, bit
    for bit. Returns the fused outputs."""
    rep, out, want = run(fn, args, mesh, **kw)
    assert len(rep.sites) == 1 and not rep.fused, rep.line()
    assert rep.sites[0].reason.startswith(reason), rep.sites[0].reason
    assert_bit_equal(out, want)
    return out


# --- gamma's roundings ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rounded, dtype",
    [(True, "bfloat16"), (True, "float16"), (False, "bfloat16")],
    ids=["rounded by the program-bfloat16", "rounded by the program-float16", "in float32"],
)
def test_gemma_one_plus_w_is_fused_with_the_programs_rounding(rounded, dtype):
    """Gemma written with ``(1 + w).astype(T)``: the fused op takes that rounded scale as
    gamma (weight_bias 0), not 1 + w in float32; written in float32, weight_bias 1."""
    args = scope_operands(dtype, gamma=0.1 * np.random.default_rng(3).standard_normal(H))
    rep, out, want = run(smap(one_scope(gemma(rounded))), args)
    site = rep.sites[0]
    assert site.fused and site.rounding_change is None, site
    assert site.weight_bias == (0.0 if rounded else 1.0), site
    col = 1.0 + np.asarray(args[2], np.float64)
    col = np.asarray(col.astype(dtype), np.float64) if rounded else col
    assert_norm_exact(gemma(rounded), out, args[2], col=col)
    if dtype == "bfloat16":  # XLA's bfloat16 psum on CPU rounds once, as the fused op does
        assert_bit_equal(out, want)


def test_a_float16_gamma_in_a_bfloat16_model_is_a_declared_rounding():
    args = scope_operands("bfloat16", gamma_dtype="float16")
    fn = smap(one_scope(rms_norm))
    assert_unchanged(fn, args, "float16 gamma (the kernel reads gamma in bfloat16)")
    rep, out, _ = run(fn, args, allow_rounding_change=True)
    assert rep.sites[0].fused and rep.sites[0].rounding_change == "gamma rounded to bfloat16"
    col = np.asarray(args[2], np.float64)
    units = norm_units(out[1], out[0], col, statistic(out[0], EPS), "bfloat16")
    assert units.max() <= 4.0, units.max()  # the bound, one more unit for the change


@pytest.mark.parametrize("allow", [False, True])
def test_a_bfloat16_gamma_beyond_float16_range_in_a_float16_model_stays_unfused(allow):
    gamma = np.full(H, 1.0)
    gamma[::4] = 1e5  # beyond 65504: the kernel, reading gamma in float16, would see inf
    small = jnp.asarray(np.where(np.arange(H) % 4 == 0, 1e-6, 1.0), f16)  # finite outputs there
    x, res, _ = scope_operands("float16")
    reason = "bfloat16 gamma in a float16 model: the kernel reads gamma"
    args = (x * small, res * small, jnp.asarray(gamma, bf16))
    out = assert_unchanged(smap(one_scope(rms_norm)), args, reason, allow_rounding_change=allow)
    assert np.all(np.isfinite(np.asarray(out[1], np.float32)))


@pytest.mark.parametrize("through", ["bfloat16", "float16"])
def test_a_float32_model_rounding_gamma_through_16_bits_keeps_that_rounding(through):
    norm = lambda r, g: rms_norm(r, g.astype(through).astype(f32))
    args = scope_operands("float32", gamma=1 + 0.3 * np.random.default_rng(1).standard_normal(H))
    rep, out, want = run(smap(one_scope(norm)), args)
    assert rep.sites[0].fused and rep.sites[0].rounding_change is None, rep.sites[0]
    col = np.asarray(np.asarray(args[2]).astype(through), np.float64)
    units = norm_units(out[1], out[0], col, statistic(out[0], EPS), "float32")
    assert units.max() <= 8.0, units.max()  # float32's bound (docs/fusion_pass.md)
    np.testing.assert_allclose(np.asarray(out[1]), np.asarray(want[1]), rtol=2e-6, atol=0)


# --- what the rewrite replaces, and nothing else --------------------------------------------------


@pytest.mark.parametrize("second", ["the sum again", "a copy"])
def test_a_shard_map_returning_its_sum_twice_stays_unfused(second):
    mesh = mesh_2x4()

    def body(x, w):
        s = jax.lax.psum(x @ w, "tp")
        return s, (s if second == "the sum again" else jnp.copy(s))

    def model(x, w, res, g):
        s, s2 = row_parallel(mesh, body, 2)(x, w)
        r = s + res
        return r, rms_norm(r, g), s2

    assert_unchanged(model, lin(mesh), OTHER_USES, mesh)


@pytest.mark.parametrize("inside", [True, False], ids=["over dp", "replicated"])
def test_a_residual_returned_by_the_same_shard_map_is_read_inside_it(inside):
    """Fused when the residual is laid out as the sum; otherwise left alone, naming it."""
    mesh = mesh_2x4()
    spec = P("dp") if inside else P()

    def model(x, w, res, g):
        s, res2 = jax.shard_map(
            lambda x, w, res: (jax.lax.psum(x @ w, "tp"), res * 2),
            mesh=mesh,
            in_specs=(P("dp", "tp"), P("tp"), spec),
            out_specs=(P("dp"), spec),
        )(x, w, res if inside else jax.device_put(res, NamedSharding(mesh, P())))
        r = s + res2
        return (r, rms_norm(r, g), res2) if inside else (r, rms_norm(r, g))

    if not inside:
        assert_unchanged(model, lin(mesh), "the residual is output 1 of the shard_map", mesh)
        return
    rep, out, want = run(model, lin(mesh), mesh)
    assert rep.sites[0].fused and rep.sites[0].kind == "shard_map psum", rep.line()
    assert_bit_equal(out, want)  # bfloat16: the psum rounds once, as the fused op does


@pytest.mark.parametrize("tail", ["static", "dynamic"])
def test_a_per_linear_fp8_tail_without_the_norm_output(tail):
    mesh = mesh_2x4()

    def model(x, w, res, g, scale):
        r = row_parallel(mesh)(x, w) + res
        y32 = rms_norm(r, g).astype(f32)
        if tail == "dynamic":
            scale = jnp.maximum(jnp.max(jnp.abs(y32), -1, keepdims=True) / 448, 1 / (512 * 448))
        return r, jnp.clip(y32 / scale, -448, 448).astype(jnp.float8_e4m3fn).astype(f32)

    rep, out, want = run(model, lin(mesh) + (jnp.float32(0.02),), mesh)
    assert rep.sites[0].fused and rep.sites[0].pattern == (2 if tail == "static" else 10)
    assert_bit_equal(out[0], want[0])
    q_f, q_o = np.asarray(out[1], np.float64), np.asarray(want[1], np.float64)
    assert np.max(np.abs(q_f - q_o)) <= np.max(np.abs(q_o)) / 8  # one e4m3 step


@pytest.mark.parametrize("layout", ["one shard_map", "per-linear shard_map"])
def test_a_workspace_of_another_world_size_leaves_the_site_alone(layout):
    mesh42 = jax.make_mesh((4, 2), ("dp", "tp"))
    ws = jf.create_allreduce_fusion_workspace(
        mesh42, "tp", max_token_num=64, hidden_dim=H, dtype=bf16, backend="xla"
    )
    if layout == "one shard_map":
        fn, args, mesh, world = smap(one_scope(rms_norm)), scope_operands("bfloat16"), MESH, 8
    else:
        mesh, world = mesh_2x4(), 4
        fn, args = norm_after(row_parallel(mesh)), lin(mesh)
    reason = f"the workspace is for 2 ranks over 'tp', the site's all-reduce over it has {world}"
    assert_unchanged(fn, args, reason, mesh, workspace=ws)
    ws.destroy()


def test_export_with_a_symbolic_token_count_leaves_the_site_alone():
    (t,) = jax.export.symbolic_shape("t")
    fn = smap(one_scope(rms_norm))
    specs = [
        jax.ShapeDtypeStruct(s, bf16, sharding=NamedSharding(MESH, p))
        for s, p in (((8, 8 * t, H), P("tp")), ((8 * t, H), P()), ((H,), P()))
    ]
    fused = jf.fuse(fn, mesh=MESH, backend="xla")
    exported = jax.export.export(jax.jit(fused))(*specs)
    site = fused.report.sites[0]
    assert not site.fused and site.reason.startswith(
        "the residual sum has a symbolic shape (8*t, 64): the fused op needs concrete token"
    ), site.reason
    # The program exported is the original: its all-reduce, no fused op. (Calling a
    # shape-polymorphic shard_map export on CPU crashes XLA in JAX 0.10.2, unfused or not.)
    with jax.set_mesh(MESH):
        text = str(jax.make_jaxpr(fused)(*specs))
    assert "psum" in text and "jax_fusedar_allreduce_fusion" not in text
    assert exported.out_avals == jax.export.export(jax.jit(fn))(*specs).out_avals


@pytest.mark.parametrize("layout", ["plain jit", "per-linear shard_map"])
def test_explicit_axes_called_without_a_mesh_set(layout):
    mesh = mesh_2x4(AxisType.Explicit)
    out_sharding = NamedSharding(mesh, P("dp"))
    einsum = lambda x, w: jnp.einsum("tf,fd->td", x, w, out_sharding=out_sharding)
    model = norm_after(einsum if layout == "plain jit" else row_parallel(mesh))
    args = lin(mesh)
    fused = jf.fuse(model, mesh=mesh, axis_name="tp", backend="xla")
    out, want = compiled(fused)(*args), compiled(model)(*args)  # no jax.set_mesh
    assert fused.report.sites[0].fused, fused.report.line()
    assert_bit_equal(out[0], want[0])
    assert_norm_exact(rms_norm, out, args[3])


# --- reasons --------------------------------------------------------------------------------------


SPELLED_WITH_FLOAT32_CONSTANTS = {
    "sum times 1/H": lambda x, h: jax.lax.rsqrt(
        jnp.sum(x * x, -1, keepdims=True) * (1.0 / h) + EPS
    ),
    "sqrt(H) outside": lambda x, h: (
        jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) + h * EPS) * np.sqrt(h)
    ),
    "divided by rms over sqrt(H)": lambda x, h: (
        1.0 / (jnp.sqrt(jnp.sum(x * x, -1, keepdims=True) + h * EPS) / np.sqrt(h))
    ),
}


def _spelled_site(inv, h):
    """The site of the norm ``x * inv(x, H) * gamma`` at hidden size ``h``, analysed."""

    def spelled(r, g):
        x = r.astype(f32)
        return (x * inv(x, x.shape[-1]) * g.astype(f32)).astype(r.dtype)

    fused = jf.fuse(smap(one_scope(spelled)), mesh=MESH, backend="xla")
    return fused.analyze(*scope_operands("bfloat16", shape=(2, h))).sites[0]


@pytest.mark.parametrize("h", [80, 96, 128, 3072])
@pytest.mark.parametrize("spelling", list(SPELLED_WITH_FLOAT32_CONSTANTS))
def test_constants_written_in_float32_are_within_their_rounding(spelling, h):
    site = _spelled_site(SPELLED_WITH_FLOAT32_CONSTANTS[spelling], h)
    assert site.fused, site.reason
    assert site.rms_eps == pytest.approx(EPS, rel=1e-6)


def test_a_constant_rounded_to_bfloat16_is_another_mean():
    site = _spelled_site(
        lambda x, h: jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) * jnp.bfloat16(1 / 80) + EPS),
        80,
    )
    divisor = 1 / float(jnp.bfloat16(1 / 80))  # 79.92...: another mean than over 80
    assert site.reason == f"the mean divides by {divisor:.9g}, not the hidden size 80"


@pytest.mark.parametrize("where", ["statistic", "output", "gamma"])
def test_stop_gradient(where):
    def spelled(r, g):
        x = r.astype(f32)
        inv = jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + EPS)
        if where == "statistic":
            inv = jax.lax.stop_gradient(inv)
        if where == "gamma":
            g = jax.lax.stop_gradient(g)
        y = (x * inv * g.astype(f32)).astype(r.dtype)
        return jax.lax.stop_gradient(y) if where == "output" else y

    args, fn = scope_operands("bfloat16"), smap(one_scope(spelled))
    if where == "statistic":
        assert_unchanged(fn, args, "lax.stop_gradient inside the norm (the fused op")
        return
    rep, out, want = run(fn, args)
    assert rep.sites[0].fused, rep.sites[0].reason
    assert_bit_equal(out, want)
    if where == "gamma":  # the gradient to gamma stays stopped
        fused = jf.fuse(fn, mesh=MESH, backend="xla")
        with jax.set_mesh(MESH):
            dg = compiled(jax.grad(lambda *a: jnp.sum(fused(*a)[1].astype(f32)), argnums=2))(*args)
        assert not np.any(np.asarray(dg, np.float32))


def _two_sites(mesh):
    def model(x, w, res, g):
        two_sums = lambda x, w: (jax.lax.psum(x @ w, "tp"), jax.lax.psum(x @ (w * 2), "tp"))
        s1, s2 = row_parallel(mesh, two_sums, 2)(x, w)
        r1 = s1 + res
        r2 = s2 + res
        return r1, rms_norm(r1, g), r2, rms_norm(r2, g)

    return model


@pytest.mark.parametrize(
    "model, sites",
    [(lambda mesh: norm_after(jax.jit(row_parallel(mesh))), 1), (_two_sites, 2)],
    ids=["a jitted per-linear shard_map", "two sites on the outputs of one shard_map"],
)
def test_per_linear_shard_map_fuses_bit_for_bit(model, sites):
    mesh = mesh_2x4()
    rep, out, want = run(model(mesh), lin(mesh), mesh)
    assert len(rep.sites) == sites and len(rep.fused) == sites, rep.line()
    assert {s.kind for s in rep.sites} == {"shard_map psum"}, rep.line()
    assert_bit_equal(out, want)


@pytest.mark.parametrize("cast_inside", [False, True], ids=["cast outside", "cast inside"])
def test_a_float32_sum_of_a_per_linear_shard_map_cast_down(cast_inside):
    mesh = mesh_2x4()

    def body(x, w):
        s = jax.lax.psum(jnp.dot(x, w, preferred_element_type=f32), "tp")
        return s.astype(bf16) if cast_inside else s

    model = norm_after(lambda x, w: row_parallel(mesh, body)(x, w).astype(bf16))
    args = lin(mesh)
    assert_unchanged(model, args, CAST_DOWN, mesh)
    rep, out, want = run(model, args, mesh, allow_rounding_change=True)  # the advice works
    site = rep.sites[0]
    assert site.fused, site.reason
    assert (
        site.rounding_change == "each rank's float32 partial sum rounded to bfloat16 before the sum"
    )
    assert_norm_exact(rms_norm, out, args[3])


@pytest.mark.parametrize("rule", ["custom_vjp", "custom_jvp"])
def test_a_psum_with_its_own_rule_is_one_site(rule):
    g_op = megatron_g(rule)
    fused = jf.fuse(smap(lambda x, res, g: (g_op(x[0]) * 2, res)), mesh=MESH, backend="xla")
    rep = fused.analyze(*scope_operands("bfloat16"))
    assert [s.reason for s in rep.sites] == ["the all-reduce is not followed by a residual add"]


@pytest.mark.parametrize("literal", [True, False], ids=["literal scale", "scale argument"])
def test_a_static_fp8_tail_with_a_literal_scale(literal):
    def extra_outs(r, y, scale):
        q = jnp.clip(y.astype(f32) / (0.05 if literal else scale), -448, 448)
        return r, y, q.astype(jnp.float8_e4m3fn).astype(f32)

    args = scope_operands("bfloat16") + (jnp.float32(0.05),)
    rep, out, want = run(smap(one_scope(rms_norm, extra_outs=extra_outs), n_in=4, n_out=3), args)
    site = rep.sites[0]
    assert site.fused and site.pattern == 4 and site.note is None, site
    assert_bit_equal(out[:2], want[:2])


@pytest.mark.parametrize("check_vma", [True, False])
def test_a_psum_added_to_a_varying_residual(check_vma):
    def body(x, res, g):
        r = jax.lax.psum(x[0], "tp") + x[1]  # under check_vma JAX puts a pvary between
        return r, rms_norm(r, g)

    specs = dict(in_specs=(P("tp"), P(), P()), out_specs=(P("tp"), P("tp")))
    rep, out, want = run(
        jax.shard_map(body, mesh=MESH, check_vma=check_vma, **specs), scope_operands()
    )
    assert rep.sites[0].fused, rep.sites[0].reason
    assert_bit_equal(out, want)


def test_a_site_of_no_tokens_is_served():
    rep, out, want = run(smap(one_scope(rms_norm)), scope_operands("bfloat16", shape=(0, H)))
    assert rep.sites[0].fused and rep.sites[0].tokens == 0, rep.line()
    assert [o.shape for o in out] == [(0, H), (0, H)]


class _NativeRankStandIn:
    """What a kernel workspace's native rank looks like to the registry."""

    alive = True

    def failure(self):
        return None

    def destroy(self):
        self.alive = False


def test_two_transforms_alive_with_one_site_shape_get_distinct_workspaces(monkeypatch):
    """Two live kernel workspaces of one key are refused: the second transform's gets a name
    of its own. XLA workspaces stand in for kernel ones (registered as allocating)."""
    claim = wsmod._claim_id
    monkeypatch.setattr(wsmod, "_claim_id", lambda ws, allocates: claim(ws, allocates=True))
    fn, args = smap(one_scope(rms_norm)), scope_operands("bfloat16")
    first, second = (jf.fuse(fn, mesh=MESH, backend="xla") for _ in range(2))
    try:
        assert first.analyze(*args).sites[0].fused
        first.workspaces[0]._ranks.append(_NativeRankStandIn())
        out = compiled(second)(*args)
        site = second.report.sites[0]
        assert site.fused, site.reason
        assert [w.name for w in first.workspaces] == [None]
        assert [w.name for w in second.workspaces] == ["jax_fusedar.fuse.2"]
        assert_bit_equal(out, compiled(fn)(*args))
    finally:
        first.close()
        second.close()


@pytest.mark.slow
def test_the_gpu_worker_on_cpu_processes():
    """tests/gpu/fuse_exact.py's worker as two CPU processes (gloo, the reference lowering):
    every step but the kernel, held to the same checks."""
    from tests.gpu import fuse_exact, harness

    res = harness.run_ranks(
        fuse_exact.worker, 2, timeout_s=600, port=harness.free_port(), seed=0, platform="cpu"
    )
    problems = fuse_exact.check(res, platform="cpu")
    assert not problems, "\n".join(problems)
