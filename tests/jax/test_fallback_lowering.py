"""Where the kernel does not serve a call, the program lowered for GPUs moves no more than
the user's own ``psum(x)`` in x's dtype: on 8 CPU devices, every program is exported for
cuda (``jax.export(..., platforms=("cuda",))`` lowers for GPUs on a CPU machine) at world
2, 4 and 8, and its collectives (count, element types, bytes: tests/collectives.py) are
held to those of the same-shaped ``psum(x)`` program, exported the same way.

Sites ``fuse`` rewrote on the xla backend are held to the program as written. The
kernel-exact fallback, asked for, moves what it is documented to: 2x the bytes with
``fp32_acc=True``, one float32 psum per rank without."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_fusedar as jf
from jax_fusedar.ops import partitioning
from jax_fusedar.common.patterns import MOE_PATTERNS, TRAITS, AllReduceFusionPattern
from jax_fusedar.ops.dense import FFI_TARGET
from tests import collectives
from tests.jax.cpu_helpers import (
    jit_shard_map,
    mesh_2x4,
    moe_body,
    partitioned_shard_text,
    require_host_devices,
    tp_mesh,
)
from tests.jax.fuse_checks import assert_equal_values, megatron_g, rms_norm

require_host_devices()
pytest.importorskip("flatbuffers", reason="jax.export needs flatbuffers (./dev installs it)")

WORLDS = (2, 4, 8)
TOKENS, HIDDEN = 16, 512
DENSE = [p for p in AllReduceFusionPattern if p not in MOE_PATTERNS]
BF16 = jnp.bfloat16
NORM = AllReduceFusionPattern.kARResidualRMSNorm
PER_WORLD = pytest.mark.parametrize("world", WORLDS, ids=[f"world{w}" for w in WORLDS])


def shaped(mesh, shape, spec, dtype=BF16):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def summary(stablehlo):
    return collectives.summary(collectives.stablehlo_collectives(stablehlo))


def cuda_collectives(fn, *args):
    """The collectives' summary of ``fn`` exported for cuda at ``args``."""
    return summary(jf.export.export(fn, platforms=("cuda",))(*args).mlir_module())


def psum_program(mesh, shape=(TOKENS, HIDDEN), dtype=BF16):
    """The user's own all-reduce of a per-rank [tokens, hidden] partial sum."""
    f = jit_shard_map(lambda x: jax.lax.psum(x, "tp"), mesh, P("tp"), P())
    world = mesh.shape["tp"]
    return cuda_collectives(f, shaped(mesh, (world * shape[0], *shape[1:]), P("tp"), dtype))


def xla_workspace(mesh, dtype=BF16, tokens=TOKENS, backend="xla"):
    return jf.abstract_workspace(
        mesh, "tp", max_token_num=tokens, hidden_dim=HIDDEN, dtype=dtype, backend=backend
    )


def dense_program(mesh, ws, pattern, **kwargs):
    """shard_map over tp of one allreduce_fusion call of ``pattern`` on a per-rank partial
    sum [TOKENS, HIDDEN], with what the pattern reads; returns (jitted fn, arg specs)."""
    traits = TRAITS[pattern]
    if traits.quant == "group_fp8":
        kwargs["block_quant_group_size"] = 128

    def body(x, residual, gamma, scale):
        reads = dict(residual=residual, rms_gamma=gamma) if traits.has_residual else {}
        if traits.uses_scale_factor:
            reads["scale_factor"] = scale
        out = jf.allreduce_fusion(
            x, axis_name="tp", workspace=ws, pattern=pattern, **reads, **kwargs
        )
        return tuple(v for v in out if v is not None)

    world = mesh.shape["tp"]
    args = (
        shaped(mesh, (world * TOKENS, HIDDEN), P("tp")),
        shaped(mesh, (TOKENS, HIDDEN), P()),
        shaped(mesh, (HIDDEN,), P()),
        shaped(mesh, (), P(), jnp.float32),
    )
    return jit_shard_map(body, mesh, (P("tp"), P(), P(), P()), P()), args


def check_not_costlier(program, baseline, what):
    problems = collectives.costlier(program, baseline)
    assert not problems, f"{what}: {problems}\n program {program}\n psum(x) {baseline}"
    assert program.get("all_reduce", {}).get("count", 0) >= 1, f"{what}: no all-reduce {program}"


# --- the dense op ----------------------------------------------------------------------------


@pytest.mark.parametrize("fp32_acc", [True, False], ids=["fp32_acc", "no_fp32_acc"])
@pytest.mark.parametrize("pattern", DENSE, ids=[p.name for p in DENSE])
@PER_WORLD
def test_dense_fallback_moves_no_more_than_psum(world, pattern, fp32_acc):
    mesh = tp_mesh(world)
    f, args = dense_program(mesh, xla_workspace(mesh), pattern, fp32_acc=fp32_acc)
    got = cuda_collectives(f, *args)
    base = psum_program(mesh)
    check_not_costlier(got, base, f"{pattern.name} world {world} fp32_acc={fp32_acc}")
    # Exactly the user's collective: one all-reduce of x, in x's dtype.
    assert got == base, (got, base)


@PER_WORLD
def test_the_kernel_exact_fallback_moves_what_it_is_documented_to(world):
    """The emulation, asked for: a float32 psum (2x the bytes of the bf16 psum) with
    fp32_acc, one float32 psum per rank (2 x world x the bytes) without."""
    mesh = tp_mesh(world)
    base, ws = psum_program(mesh)["all_reduce"], xla_workspace(mesh)
    for fp32_acc, calls in ((True, 1), (False, world)):
        f, args = dense_program(mesh, ws, NORM, fp32_acc=fp32_acc, fallback="kernel_exact")
        got = cuda_collectives(f, *args)["all_reduce"]
        assert got["count"] == calls and got["element_types"] == ["f32"], got
        assert got["bytes"] == 2 * calls * base["bytes"], (got, base)


@PER_WORLD
def test_a_call_beyond_a_kernel_workspace_falls_back_to_psum_on_cuda(world):
    """On a kernel workspace too small for the call, the cuda lowering holds no custom call
    and the fallback's psum, like the xla backend's."""
    mesh = tp_mesh(world)
    ws = xla_workspace(mesh, tokens=TOKENS // 2, backend="trtllm")
    f, args = dense_program(mesh, ws, NORM, strict=False)
    text = jf.export.export(f, platforms=("cuda",))(*args).mlir_module()
    assert f"@{FFI_TARGET}" not in text
    assert summary(text) == psum_program(mesh), summary(text)


@PER_WORLD
def test_forward_mode_tangents_and_vmap_move_no_more_than_psum(world):
    mesh = tp_mesh(world)
    ws = xla_workspace(mesh, tokens=2 * TOKENS)
    f, args = dense_program(mesh, ws, NORM)

    def user(x, residual, gamma):
        return jax.lax.psum(x, "tp") + residual

    def jvp_of(fn):
        return lambda *a: jax.jvp(fn, a, tuple(jnp.ones_like(v) for v in a))

    def fused_call(x, r, g):
        return jf.allreduce_fusion(x, axis_name="tp", workspace=ws, residual=r, rms_gamma=g)[1:3]

    specs = (P("tp"), P(), P())
    fused = jit_shard_map(jvp_of(fused_call), mesh, specs, P())
    plain = jit_shard_map(jvp_of(user), mesh, specs, P())
    got, base = cuda_collectives(fused, *args[:3]), cuda_collectives(plain, *args[:3])
    assert base["all_reduce"]["count"] == 2  # the primal's and the tangent's
    check_not_costlier(got, base, f"jvp world {world}")

    def batched(x, r, g):
        return jax.vmap(lambda x, r: fused_call(x, r, g)[1])(x, r)

    vm = jit_shard_map(batched, mesh, (P(None, "tp"), P(), P()), P())
    vargs = (
        shaped(mesh, (2, world * TOKENS, HIDDEN), P(None, "tp")),
        shaped(mesh, (2, TOKENS, HIDDEN), P()),
        args[2],
    )
    check_not_costlier(
        cuda_collectives(vm, *vargs), psum_program(mesh, (2 * TOKENS, HIDDEN)), "vmap"
    )


# --- the MoE ops ------------------------------------------------------------------------------

EXPERTS, ROWS, TOP_K = 3, 24, 2


def moe_program(mesh, ws, pattern, **kwargs):
    world = mesh.shape["tp"]

    body, _ = moe_body(ws, pattern, **kwargs)
    if pattern == AllReduceFusionPattern.kMoEReductionARResidualRMSNorm:
        shapes = [
            ((world, EXPERTS, TOKENS, HIDDEN), BF16),
            ((world, EXPERTS, TOKENS), jnp.float32),
            ((world, TOKENS, HIDDEN), BF16),
        ]
    else:
        shapes = [
            ((world, ROWS, HIDDEN), BF16),
            ((world, TOKENS, TOP_K), jnp.int32),
            ((world, TOKENS, TOP_K), BF16),
        ]
    shapes += [((TOKENS, HIDDEN), BF16), ((HIDDEN,), BF16)]
    specs = [P("tp")] * 3 + [P()] * 2
    args = [shaped(mesh, s, sp, d) for (s, d), sp in zip(shapes, specs)]
    return jit_shard_map(body, mesh, tuple(specs), P()), args


@pytest.mark.parametrize("pattern", MOE_PATTERNS, ids=[p.name for p in MOE_PATTERNS])
@PER_WORLD
def test_moe_fallback_moves_no_more_than_psum(world, pattern):
    mesh = tp_mesh(world)
    f, args = moe_program(mesh, xla_workspace(mesh), pattern)
    got = cuda_collectives(f, *args)
    base = psum_program(mesh)
    check_not_costlier(got, base, f"{pattern.name} world {world}")
    assert got == base, (got, base)
    # The emulation of the kernel's rank-order sum, asked for: one float32 psum per rank.
    f, args = moe_program(mesh, xla_workspace(mesh), pattern, fallback="kernel_exact")
    exact = cuda_collectives(f, *args)["all_reduce"]
    assert exact["count"] == world and exact["bytes"] == 2 * world * base["all_reduce"]["bytes"]


# --- plain jit --------------------------------------------------------------------------------

K = 256
LAYER_SPECS = (P(None, "tp"), P("tp"), P(), P())


def explicit_mesh(world):
    return jax.make_mesh(
        (world,), ("tp",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:world]
    )


def row_parallel_args(mesh):
    return (
        shaped(mesh, (TOKENS, K), P(None, "tp")),
        shaped(mesh, (K, HIDDEN), P("tp", None)),
        shaped(mesh, (TOKENS, HIDDEN), P()),
        shaped(mesh, (HIDDEN,), P()),
    )


@pytest.mark.parametrize("with_workspace", [True, False], ids=["xla_workspace", "no_workspace"])
@PER_WORLD
def test_row_parallel_on_explicit_axes_moves_no_more_than_the_partitioners_psum(
    world, with_workspace
):
    mesh = explicit_mesh(world)
    ws = xla_workspace(mesh) if with_workspace else None

    def fused(h, w, r, g):
        out = jf.row_parallel_allreduce_fusion(h, w, residual=r, rms_gamma=g, workspace=ws)
        return out.residual_out, out.norm_out

    def plain(h, w, r, g):
        partial = jax.shard_map(
            lambda h, w: jax.lax.psum(h @ w, "tp"),
            mesh=mesh,
            in_specs=(P(None, "tp"), P("tp", None)),
            out_specs=P(),
        )(h, w)
        return partial + r

    args = row_parallel_args(mesh)
    with jax.set_mesh(mesh):
        got = cuda_collectives(fused, *args)
        base = cuda_collectives(jax.jit(plain), *args)
    check_not_costlier(got, base, f"row_parallel world {world}")
    assert got["all_reduce"] == base["all_reduce"] == psum_program(tp_mesh(world))["all_reduce"]


@PER_WORLD
def test_row_parallel_partition_rule_on_auto_axes_moves_no_more_than_psum(world):
    """Auto axes: the partition rule runs when XLA compiles (jax.export cannot carry it),
    so its per-shard program, what every GPU runs, is lowered for cuda here."""
    mesh = tp_mesh(world)
    for ws in (xla_workspace(mesh), None):
        cfg = partitioning._checked_config(
            partitioning._Contraction.matmul(2), ws, 1e-6, 0.0, True, None, None, None, "xla"
        )
        text = partitioned_shard_text(cfg, mesh, row_parallel_args(mesh), check_vma=True)
        assert summary(text) == psum_program(mesh), (ws, summary(text))


# --- fuse -------------------------------------------------------------------------------------


def fused_collectives(model, mesh, args):
    """(fused, its collectives, the original's): ``model`` fused on the xla backend, its one
    site fused, both exported for cuda at ``args``."""
    fused = jf.fuse(model, mesh=mesh, axis_name="tp", backend="xla")
    with jax.set_mesh(mesh):
        fused.analyze(*args)
        assert len(fused.report.fused) == 1, fused.report.line()
        return fused, cuda_collectives(fused, *args), cuda_collectives(jax.jit(model), *args)


def add_norm(s, r, g):
    """The layer's tail after its all-reduced ``s``: the residual add and its norm."""
    r = s + r
    return r, rms_norm(r, g)


def _layer_in_one_shard_map(mesh):
    def body(x, w, r, g):
        return add_norm(jax.lax.psum(x @ w, "tp"), r, g)

    return jit_shard_map(body, mesh, LAYER_SPECS, P())


def _megatron_g(mesh):
    g_op = megatron_g(varying=False)

    def body(x, w, r, g):
        return add_norm(g_op(x @ w), r, g)

    return jit_shard_map(body, mesh, LAYER_SPECS, P(), check_vma=False)


def _per_linear(mesh):
    def model(x, w, r, g):
        s = jax.shard_map(
            lambda x, w: jax.lax.psum(x @ w, "tp"),
            mesh=mesh,
            in_specs=(P(None, "tp"), P("tp")),
            out_specs=P(),
        )(x, w)
        return add_norm(s, r, g)

    return model


def _plain_jit(mesh):
    def model(h, w, r, g):
        # the partitioner all-reduces when compiling
        return add_norm(jnp.matmul(h, w, out_sharding=P()), r, g)

    return model


@pytest.mark.parametrize(
    "form", [_layer_in_one_shard_map, _megatron_g, _per_linear], ids=lambda f: f.__name__[1:]
)
@PER_WORLD
def test_fused_sites_on_the_xla_backend_keep_the_originals_collectives(world, form):
    mesh = tp_mesh(world)
    _, got, base = fused_collectives(form(mesh), mesh, row_parallel_args(mesh))
    assert got == base, (got, base)


@PER_WORLD
def test_a_fused_plain_jit_site_on_the_xla_backend_keeps_the_partitioners_psum(world):
    mesh = explicit_mesh(world)
    model = _plain_jit(mesh)
    args = row_parallel_args(mesh)
    fused, got, base = fused_collectives(model, mesh, args)
    with jax.set_mesh(mesh):
        compiled = [
            collectives.summary(collectives.hlo_collectives(f.lower(*args).compile().as_text()))
            for f in (jax.jit(fused), jax.jit(model))
        ]
    # No kernel here: the site is rewritten into the model's own dot_general, whose
    # all-reduce the partitioner inserts when XLA compiles it (none in the exported module,
    # as in the model's), so no custom_partitioning op is compiled either. Compiled, both
    # hold the same one all-reduce (XLA's CPU backend widens a bfloat16 one to float32,
    # in both alike).
    assert got == base, (got, base)
    assert compiled[0] == compiled[1], compiled
    assert compiled[0]["all_reduce"]["count"] == 1, compiled


def test_a_fused_plain_jit_program_on_auto_axes_without_a_kernel_exports():
    """No custom_partitioning where no kernel serves the site: the fused program exports on
    Auto axes too, and the artifact gives the original's bits."""
    mesh = mesh_2x4()

    def model(h, w, r, g):
        r = h @ w + r
        return r, rms_norm(r, g)

    rng = np.random.default_rng(5)

    def put(shape, spec, scale=1.0):
        a = jnp.asarray(rng.standard_normal(shape) * scale, BF16)
        return jax.device_put(a, NamedSharding(mesh, spec))

    args = (
        put((TOKENS, K), P("dp", "tp")),
        put((K, HIDDEN), P("tp"), 1 / 16),
        put((TOKENS, HIDDEN), P("dp")),
        jax.device_put(jnp.asarray(1 + 0.1 * rng.standard_normal(HIDDEN), BF16)),
    )
    fused = jf.fuse(model, mesh=mesh, axis_name="tp", backend="xla")
    exported = jf.export.export(jax.jit(fused))(*args)
    assert len(fused.report.fused) == 1, fused.report.line()
    assert "CustomSPMDPartitioning" not in exported.mlir_module()
    assert_equal_values(exported.call(*args), jax.jit(model)(*args))


def _fp8_tail_in_one_shard_map(mesh):
    def body(x, w, r, g):
        r = jax.lax.psum(x @ w, "tp") + r
        y = rms_norm(r, g)
        q = jnp.clip(y.astype(jnp.float32) / 0.05, -448.0, 448.0).astype(jnp.float8_e4m3fn)
        return r, y, q

    return jit_shard_map(body, mesh, LAYER_SPECS, (P(),) * 3)


@PER_WORLD
def test_forward_mode_of_a_fused_fp8_tail_moves_what_the_original_does(world):
    """The fused FP8 tail keeps the program's derivative (its equations differentiated at
    the norm's value); its tangents come from the fused op's own, whose all-reduce on the xla
    backend is the program's psum in T: jax.jvp of the fused program moves what jax.jvp of
    the original does."""
    mesh = tp_mesh(world)
    model = _fp8_tail_in_one_shard_map(mesh)
    args = row_parallel_args(mesh)
    fused = jf.fuse(model, mesh=mesh, axis_name="tp", backend="xla")

    def forward_mode(fn):
        return jax.jit(lambda *a: jax.jvp(fn, a, a))

    with jax.set_mesh(mesh):
        fused.analyze(*args)
        assert [s.pattern for s in fused.report.fused] == [4], fused.report.line()
        got = cuda_collectives(forward_mode(fused), *args)
        base = cuda_collectives(forward_mode(model), *args)
    assert got == base, (got, base)


# --- the fallback's roundings -------------------------------------------------------------------


@pytest.mark.parametrize(
    "form",
    [_layer_in_one_shard_map, _megatron_g, _per_linear, _plain_jit],
    ids=lambda f: f.__name__[1:],
)
def test_fused_sites_without_a_kernel_round_by_conversions_like_the_program(form):
    """fuse's sites on the xla backend run the "xla_plain" fallback: their residual add and
    norm round by plain conversions, as the code they replaced does, not by the explicit
    ``reduce_precision`` of a direct call's default (which XLA would compile in addition)."""
    mesh = explicit_mesh(4) if form is _plain_jit else tp_mesh(4)
    model = form(mesh)
    args = row_parallel_args(mesh)
    fused = jf.fuse(model, mesh=mesh, axis_name="tp", backend="xla")
    with jax.set_mesh(mesh):
        text = jax.jit(fused).lower(*args).as_text()
    assert len(fused.report.fused) == 1, fused.report.line()
    assert "reduce_precision" not in text


@pytest.mark.parametrize("dtype", [BF16, jnp.float16], ids=["bf16", "fp16"])
def test_plain_conversions_give_the_explicit_roundings_bits_where_xla_keeps_them(dtype):
    """With every rounding kept (the suite's --xla_allow_excess_precision=false), "xla_plain"
    gives "xla"'s bits: the outputs (float16 subnormal sums included, round_to's own branch)
    and the gradients (float16 tangents kept in the normal range, below); only "xla" lowers
    its roundings as reduce_precision."""
    mesh = tp_mesh(4)
    ws = xla_workspace(mesh, dtype)
    rng = np.random.default_rng()
    gamma = jnp.asarray(1 + 0.1 * rng.standard_normal(HIDDEN), dtype)
    # Cotangents of magnitude ~2^12 keep float16 tangents out of the subnormal range (a
    # chance of ~1e-3 per run), where "xla"'s explicit tangent rounding flushes them to zero
    # and "xla_plain" keeps them, as the unfused conversion does (masked below, for the
    # gradients' own elements; one flushed upstream would move a sum by an ulp).
    ct = jnp.asarray(rng.standard_normal((TOKENS, HIDDEN)) * 2**12, jnp.float32)

    def inputs(tiny_rows):
        scale = np.where(np.arange(TOKENS) % 4 == 0, 1e-6 if tiny_rows else 1.0, 1.0)[:, None]
        x = rng.standard_normal((4 * TOKENS, HIDDEN)) * np.tile(scale, (4, 1))
        r = rng.standard_normal((TOKENS, HIDDEN)) * scale
        return jnp.asarray(x, dtype), jnp.asarray(r, dtype)

    def program(fallback):
        def body(x, r, g):
            out = jf.allreduce_fusion(
                x, axis_name="tp", workspace=ws, residual=r, rms_gamma=g, fallback=fallback
            )
            return out.residual_out, out.norm_out

        f = jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(), P()), out_specs=(P(), P()))

        def loss(x, r, g):
            return jnp.sum(f(x, r, g)[1].astype(jnp.float32) * ct)

        return jax.jit(f), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    tiny, normal = inputs(True), inputs(False)
    results, texts = {}, {}
    for fallback in ("xla", "xla_plain"):
        forward, grad = program(fallback)
        texts[fallback] = forward.lower(*tiny, gamma).as_text()
        results[fallback] = [*forward(*tiny, gamma), *grad(*normal, gamma)]
    if dtype == jnp.float16:
        r = np.abs(np.asarray(results["xla"][0], np.float32))
        assert np.any((r > 0) & (r < 2**-14))
    for i, (a, b) in enumerate(zip(results["xla"], results["xla_plain"])):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if i >= 2 and dtype == jnp.float16:
            flushed = (a == 0) & (np.abs(b) < 2**-14)
            a, b = np.where(flushed, 0, a), np.where(flushed, 0, b)
        np.testing.assert_array_equal(a, b)
    assert "reduce_precision" in texts["xla"] and "reduce_precision" not in texts["xla_plain"]


def test_a_fused_decoder_without_a_kernel_gives_the_originals_bits_under_xlas_defaults():
    """Written as the program writes it ("xla_plain": the add in T, the norm converted to T),
    a fused site is compiled like the original even where XLA may keep excess precision (its
    default, which the rest of this suite turns off): two unrolled pre-norm layers, every
    site fused, the same bits."""
    mesh = tp_mesh(4)
    rng = np.random.default_rng()

    def w(*shape):
        return jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[0]), BF16)

    layers = [dict(g1=w(HIDDEN) + 1, wo=w(K, HIDDEN), g2=w(HIDDEN) + 1) for _ in range(2)]

    def body(x, wi, layers):
        for p in layers:
            x = x + jax.lax.psum(jnp.tanh(rms_norm(x, p["g1"]) @ wi) @ p["wo"], "tp")
            x = rms_norm(x, p["g2"])  # the next layer's input norm (post-norm residual stream)
        return x

    specs = (P(), P(None, "tp"), [dict(g1=P(), wo=P("tp"), g2=P())] * 2)
    model = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)
    args = (jnp.asarray(rng.standard_normal((TOKENS, HIDDEN)), BF16), w(HIDDEN, K), layers)
    fused = jf.fuse(model, mesh=mesh, axis_name="tp", backend="xla")
    defaults = {"xla_allow_excess_precision": True}
    got = jax.jit(fused, compiler_options=defaults)(*args)
    assert len(fused.report.fused) == 2, fused.report.line()
    want = jax.jit(model, compiler_options=defaults)(*args)
    assert_equal_values(got, want)
