"""Where the kernel does not serve a call, the program lowered for GPUs moves no more than
the user's own ``psum(x)`` in x's dtype: every program is exported for cuda on 8 CPU devices
at world 2, 4 and 8, its collectives (count, element types, bytes: tests/collectives.py) held
to those of the same-shaped ``psum(x)`` program's. Sites ``fuse`` rewrote on the xla backend
are held to the program as written; the kernel-exact fallback to what it is documented to."""

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
from tests.jax.cpu_helpers import jit_shard_map, mesh_2x4, moe_body, partitioned_shard_text
from tests.jax.cpu_helpers import require_host_devices, tp_mesh
from tests.jax.fuse_checks import assert_equal_values, megatron_g, rms_norm

require_host_devices()
pytest.importorskip("flatbuffers", reason="jax.export needs flatbuffers (./dev installs it)")

TOKENS, HIDDEN, K = 16, 512, 256
EXPERTS, ROWS, TOP_K = 3, 24, 2
BF16 = jnp.bfloat16
NORM = AllReduceFusionPattern.kARResidualRMSNorm
PER_WORLD = pytest.mark.parametrize("world", (2, 4, 8), ids=lambda w: f"world{w}")
LAYER_SPECS = (P(None, "tp"), P("tp"), P(), P())


shaped = lambda mesh, shape, spec, dtype=BF16: jax.ShapeDtypeStruct(
    shape, dtype, sharding=NamedSharding(mesh, spec)
)
summary = lambda stablehlo: collectives.summary(collectives.stablehlo_collectives(stablehlo))


def cuda_collectives(fn, *args):
    """The collectives' summary of ``fn`` exported for cuda at ``args``."""
    return summary(jf.export.export(fn, platforms=("cuda",))(*args).mlir_module())


def psum_program(mesh, shape=(TOKENS, HIDDEN)):
    """The user's own all-reduce of a per-rank [tokens, hidden] partial sum."""
    f = jit_shard_map(lambda x: jax.lax.psum(x, "tp"), mesh, P("tp"), P())
    return cuda_collectives(f, shaped(mesh, (mesh.shape["tp"] * shape[0], *shape[1:]), P("tp")))


def xla_workspace(mesh, dtype=BF16, tokens=TOKENS, backend="xla"):
    kw = dict(max_token_num=tokens, hidden_dim=HIDDEN, dtype=dtype, backend=backend)
    return jf.abstract_workspace(mesh, "tp", **kw)


def program(mesh, ws, pattern, **kwargs):
    """(jitted fn, arg specs): shard_map over tp of one call of ``pattern`` on a per-rank
    partial sum [TOKENS, HIDDEN] (MoE: the rows it reduces), with what the pattern reads."""
    world = mesh.shape["tp"]
    if pattern in MOE_PATTERNS:
        body, _ = moe_body(ws, pattern, **kwargs)
        if pattern == AllReduceFusionPattern.kMoEReductionARResidualRMSNorm:
            lead = [((EXPERTS, TOKENS, HIDDEN), BF16), ((EXPERTS, TOKENS), jnp.float32)]
            lead += [((TOKENS, HIDDEN), BF16)]
        else:
            lead = [((ROWS, HIDDEN), BF16), ((TOKENS, TOP_K), jnp.int32), ((TOKENS, TOP_K), BF16)]
        args = [shaped(mesh, (world, *s), P("tp"), d) for s, d in lead]
        args += [shaped(mesh, (TOKENS, HIDDEN), P()), shaped(mesh, (HIDDEN,), P())]
        return jit_shard_map(body, mesh, (P("tp"),) * 3 + (P(),) * 2, P()), args
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

    args = (shaped(mesh, (world * TOKENS, HIDDEN), P("tp")), shaped(mesh, (TOKENS, HIDDEN), P()))
    args += (shaped(mesh, (HIDDEN,), P()), shaped(mesh, (), P(), jnp.float32))
    return jit_shard_map(body, mesh, (P("tp"), P(), P(), P()), P()), args


def check_not_costlier(program, baseline, what):
    problems = collectives.costlier(program, baseline)
    assert not problems, f"{what}: {problems}\n program {program}\n psum(x) {baseline}"
    assert program.get("all_reduce", {}).get("count", 0) >= 1, f"{what}: no all-reduce {program}"


DENSE = [p for p in AllReduceFusionPattern if p not in MOE_PATTERNS]
OP_CASES = [(p, acc) for p in DENSE for acc in (True, False)] + [(p, None) for p in MOE_PATTERNS]


@pytest.mark.parametrize(
    "pattern, fp32_acc",
    OP_CASES,
    ids=[p.name + {True: "-fp32_acc", False: "-no_fp32_acc", None: ""}[a] for p, a in OP_CASES],
)
@PER_WORLD
def test_fallback_moves_no_more_than_psum(world, pattern, fp32_acc):
    """Exactly the user's collective. The kernel-exact fallback, asked for (pattern 1, MoE): a
    float32 psum (2x the bf16 bytes) with fp32_acc, one per rank (2 x world x the bytes) without."""
    mesh, acc = tp_mesh(world), {} if fp32_acc is None else dict(fp32_acc=fp32_acc)
    f, args = program(mesh, xla_workspace(mesh), pattern, **acc)
    got = cuda_collectives(f, *args)
    base = psum_program(mesh)
    check_not_costlier(got, base, f"{pattern.name} world {world} fp32_acc={fp32_acc}")
    assert got == base, (got, base)
    if pattern == NORM or pattern in MOE_PATTERNS:
        f, args = program(mesh, xla_workspace(mesh), pattern, fallback="kernel_exact", **acc)
        exact, calls = cuda_collectives(f, *args)["all_reduce"], 1 if fp32_acc else world
        assert exact["count"] == calls and exact["element_types"] == ["f32"], exact
        assert exact["bytes"] == 2 * calls * base["all_reduce"]["bytes"], (exact, base)


@PER_WORLD
def test_a_call_beyond_a_kernel_workspace_falls_back_to_psum_on_cuda(world):
    """On a kernel workspace too small for the call, the cuda lowering holds no custom call
    and the fallback's psum, like the xla backend's."""
    mesh = tp_mesh(world)
    ws = xla_workspace(mesh, tokens=TOKENS // 2, backend="trtllm")
    f, args = program(mesh, ws, NORM, strict=False)
    text = jf.export.export(f, platforms=("cuda",))(*args).mlir_module()
    assert f"@{FFI_TARGET}" not in text
    assert summary(text) == psum_program(mesh), summary(text)


@PER_WORLD
def test_forward_mode_tangents_and_vmap_move_no_more_than_psum(world):
    mesh = tp_mesh(world)
    ws = xla_workspace(mesh, tokens=2 * TOKENS)
    args = program(mesh, ws, NORM)[1][:3]

    def fused_call(x, r, g):
        return jf.allreduce_fusion(x, axis_name="tp", workspace=ws, residual=r, rms_gamma=g)[1:3]

    def jvp_of(fn):
        f = lambda *a: jax.jvp(fn, a, tuple(jnp.ones_like(v) for v in a))
        return jit_shard_map(f, mesh, (P("tp"), P(), P()), P())

    got = cuda_collectives(jvp_of(fused_call), *args)
    base = cuda_collectives(jvp_of(lambda x, r, g: jax.lax.psum(x, "tp") + r), *args)
    assert base["all_reduce"]["count"] == 2  # the primal's and the tangent's
    check_not_costlier(got, base, f"jvp world {world}")

    batched = lambda x, r, g: jax.vmap(lambda x, r: fused_call(x, r, g)[1])(x, r)
    vm = jit_shard_map(batched, mesh, (P(None, "tp"), P(), P()), P())
    vargs = (
        shaped(mesh, (2, world * TOKENS, HIDDEN), P(None, "tp")),
        shaped(mesh, (2, TOKENS, HIDDEN), P()),
        args[2],
    )
    check_not_costlier(
        cuda_collectives(vm, *vargs), psum_program(mesh, (2 * TOKENS, HIDDEN)), "vmap"
    )


def explicit_mesh(world):
    devices = jax.devices()[:world]
    return jax.make_mesh((world,), ("tp",), axis_types=(AxisType.Explicit,), devices=devices)


def row_parallel_args(mesh):
    specs = [((TOKENS, K), P(None, "tp")), ((K, HIDDEN), P("tp", None))]
    specs += [((TOKENS, HIDDEN), P()), ((HIDDEN,), P())]
    return tuple(shaped(mesh, shape, spec) for shape, spec in specs)


@pytest.mark.parametrize("axes", ["explicit", "auto"])
@pytest.mark.parametrize("with_workspace", [True, False], ids=["xla_workspace", "no_workspace"])
@PER_WORLD
def test_row_parallel_moves_no_more_than_the_partitioners_psum(world, with_workspace, axes):
    """Auto axes: the partition rule runs when XLA compiles (jax.export cannot carry it), so
    its per-shard program, what every GPU runs, is lowered for cuda here."""
    mesh = explicit_mesh(world) if axes == "explicit" else tp_mesh(world)
    ws, args = xla_workspace(mesh) if with_workspace else None, row_parallel_args(mesh)
    if axes == "auto":
        dims = partitioning._Contraction.matmul(2)
        cfg = partitioning._checked_config(dims, ws, 1e-6, 0.0, True, None, None, None, "xla")
        text = partitioned_shard_text(cfg, mesh, args, check_vma=True)
        assert summary(text) == psum_program(mesh), (ws, summary(text))
        return
    kw = dict(in_specs=(P(None, "tp"), P("tp", None)), out_specs=P())
    psum = jax.shard_map(lambda h, w: jax.lax.psum(h @ w, "tp"), mesh=mesh, **kw)
    with jax.set_mesh(mesh):
        fused = lambda h, w, r, g: jf.row_parallel_allreduce_fusion(
            h, w, residual=r, rms_gamma=g, workspace=ws
        )[1:3]
        got = cuda_collectives(fused, *args)
        base = cuda_collectives(jax.jit(lambda h, w, r, g: psum(h, w) + r), *args)
    check_not_costlier(got, base, f"row_parallel world {world}")
    assert got["all_reduce"] == base["all_reduce"] == psum_program(tp_mesh(world))["all_reduce"]


def norm_after(sum_fn):
    """The layer (x, w, r, g) -> (r + sum_fn(x, w), its norm): in one of the forms fuse
    rewrites (``layer``), x @ w all-reduced over tp."""

    def model(x, w, r, g):
        r = sum_fn(x, w) + r
        return r, rms_norm(r, g)

    return model


def layer(form, mesh):
    if form == "plain_jit":  # the partitioner all-reduces when compiling
        return norm_after(lambda h, w: jnp.matmul(h, w, out_sharding=P()))
    psum = lambda x, w: jax.lax.psum(x @ w, "tp")
    if form == "per_linear":
        specs = dict(in_specs=(P(None, "tp"), P("tp")), out_specs=P())
        return norm_after(jax.shard_map(psum, mesh=mesh, **specs))
    if form == "megatron_g":
        g_op = megatron_g(varying=False)
        return jit_shard_map(
            norm_after(lambda x, w: g_op(x @ w)), mesh, LAYER_SPECS, P(), check_vma=False
        )
    return jit_shard_map(norm_after(psum), mesh, LAYER_SPECS, P())


@pytest.mark.parametrize(
    "form", ["layer_in_one_shard_map", "megatron_g", "per_linear", "plain_jit"]
)
@PER_WORLD
def test_fused_sites_on_the_xla_backend_keep_the_originals_collectives(world, form):
    """A site fused on the xla backend exports the original's collectives and rounds as the code
    it replaced ("xla_plain"), not by a direct call's ``reduce_precision`` (XLA would add it)."""
    mesh = explicit_mesh(world) if form == "plain_jit" else tp_mesh(world)
    model, args = layer(form, mesh), row_parallel_args(mesh)
    fused = jf.fuse(model, mesh=mesh, axis_name="tp", backend="xla")
    with jax.set_mesh(mesh):
        fused.analyze(*args)
        assert len(fused.report.fused) == 1, fused.report.line()
        got, base = cuda_collectives(fused, *args), cuda_collectives(jax.jit(model), *args)
        assert got == base, (got, base)
        assert "reduce_precision" not in jax.jit(fused).lower(*args).as_text()
        if form != "plain_jit":
            return
        hlo = [jax.jit(f).lower(*args).compile().as_text() for f in (fused, model)]
    # No kernel here: the site is rewritten into the model's own dot_general, whose all-reduce
    # the partitioner inserts when XLA compiles it (none in the exported module, as in the
    # model's), so no custom_partitioning op is compiled either. Compiled, both hold the same
    # one all-reduce (XLA's CPU backend widens a bfloat16 one to float32, in both alike).
    compiled = [collectives.summary(collectives.hlo_collectives(t)) for t in hlo]
    assert compiled[0] == compiled[1], compiled
    assert compiled[0]["all_reduce"]["count"] == 1, compiled


def test_a_fused_plain_jit_program_on_auto_axes_without_a_kernel_exports():
    """No custom_partitioning where no kernel serves the site: the fused program exports on
    Auto axes too, and the artifact gives the original's bits."""
    mesh, rng = mesh_2x4(), np.random.default_rng(5)
    model = norm_after(lambda h, w: h @ w)
    draw = lambda shape, scale=1.0: jnp.asarray(rng.standard_normal(shape) * scale, BF16)
    put = lambda shape, spec, scale=1.0: jax.device_put(
        draw(shape, scale), NamedSharding(mesh, spec)
    )
    args = (put((TOKENS, K), P("dp", "tp")), put((K, HIDDEN), P("tp"), 1 / 16))
    args += (
        put((TOKENS, HIDDEN), P("dp")),
        jax.device_put(jnp.asarray(1 + 0.1 * rng.standard_normal(HIDDEN), BF16)),
    )
    fused = jf.fuse(model, mesh=mesh, axis_name="tp", backend="xla")
    exported = jf.export.export(jax.jit(fused))(*args)
    assert len(fused.report.fused) == 1, fused.report.line()
    assert "CustomSPMDPartitioning" not in exported.mlir_module()
    assert_equal_values(exported.call(*args), jax.jit(model)(*args))


@PER_WORLD
def test_forward_mode_of_a_fused_fp8_tail_moves_what_the_original_does(world):
    """The fused FP8 tail's tangents come from the fused op's own, whose all-reduce on the xla
    backend is the program's psum in T: jax.jvp of it moves what jax.jvp of the original does."""
    mesh = tp_mesh(world)
    args = row_parallel_args(mesh)

    def body(x, w, r, g):
        r = jax.lax.psum(x @ w, "tp") + r
        y = rms_norm(r, g)
        return r, y, jnp.clip(y.astype(jnp.float32) / 0.05, -448.0, 448.0).astype(jnp.float8_e4m3fn)

    model = jit_shard_map(body, mesh, LAYER_SPECS, (P(),) * 3)
    fused = jf.fuse(model, mesh=mesh, axis_name="tp", backend="xla")
    forward_mode = lambda fn: jax.jit(lambda *a: jax.jvp(fn, a, a))
    with jax.set_mesh(mesh):
        fused.analyze(*args)
        assert [s.pattern for s in fused.report.fused] == [4], fused.report.line()
        got = cuda_collectives(forward_mode(fused), *args)
        base = cuda_collectives(forward_mode(model), *args)
    assert got == base, (got, base)


@pytest.mark.parametrize("dtype", [BF16, jnp.float16], ids=["bf16", "fp16"])
def test_plain_conversions_give_the_explicit_roundings_bits_where_xla_keeps_them(dtype):
    """With every rounding kept (--xla_allow_excess_precision=false), "xla_plain" gives "xla"'s
    bits, outputs (float16 subnormal sums too) and gradients; only "xla" has reduce_precision."""
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

    tiny, normal = inputs(True), inputs(False)
    results, texts = {}, {}
    for fallback in ("xla", "xla_plain"):
        kw = dict(axis_name="tp", workspace=ws, fallback=fallback)
        body = lambda x, r, g: jf.allreduce_fusion(x, residual=r, rms_gamma=g, **kw)[1:3]
        f = jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(), P()), out_specs=(P(), P()))
        loss = lambda x, r, g: jnp.sum(f(x, r, g)[1].astype(jnp.float32) * ct)
        texts[fallback] = jax.jit(f).lower(*tiny, gamma).as_text()
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*normal, gamma)
        results[fallback] = [*jax.jit(f)(*tiny, gamma), *grads]
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
    """With "xla_plain" (the add in T, the norm converted to T) a fused site compiles like the
    original under XLA's default excess precision: two pre-norm layers, all fused, same bits."""
    mesh = tp_mesh(4)
    rng = np.random.default_rng()
    w = lambda *shape: jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[0]), BF16)
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
    assert_equal_values(got, jax.jit(model, compiler_options=defaults)(*args))
