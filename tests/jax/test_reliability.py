"""Misuse that must not pass silently or fail with an error naming nothing, on 8 CPU devices:
``row_parallel_allreduce_fusion``'s options validated up front with ``allreduce_fusion``'s
validators (Auto axes included, where its per-shard program only runs inside XLA's
compilation), ``residual=None`` as zeros; ``allreduce_fusion`` in an inner shard_map nested
in an outer one; options checked in float32, the dtype the kernel reads them in; an
``abstract_workspace(backend="xla")`` exported for cuda."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_fusedar as jf
from tests.jax.cpu_helpers import (
    assert_same_bits,
    bits,
    jit_shard_map,
    make_mesh,
    mesh_2x4,
    new_rng,
    put,
    random_gamma,
    random_partials,
    random_values,
    require_host_devices,
    tp_mesh,
)
from jax_fusedar.ops import reference
from jax_fusedar.common import backend_choice
from jax_fusedar.ops.dense import FFI_TARGET

require_host_devices()

# Also in the oldest-versions lane (./dev oldest).
pytestmark = [pytest.mark.usefixtures("hermetic"), pytest.mark.oldest]

TOKENS, K, N = 16, 64, 128


def bf16_workspace(mesh, max_token_num, hidden_dim, **kwargs):
    kwargs.update(max_token_num=max_token_num, hidden_dim=hidden_dim, dtype=jnp.bfloat16)
    return jf.create_allreduce_fusion_workspace(mesh, "tp", **kwargs)


def row_parallel_args(mesh, *, k_sharded=True, n=N, dtype=jnp.bfloat16):
    rng = new_rng()
    name = np.dtype(dtype).name
    h = random_values(rng, (TOKENS, K), name)
    w = (random_values(rng, (K, n), name) / 8).astype(dtype)
    r = random_values(rng, (TOKENS, n), name)
    g = random_gamma(rng, n, name)
    k = "tp" if k_sharded else None
    return (
        put(mesh, P("dp", k), h),
        put(mesh, P(k, None), w),
        put(mesh, P("dp", None), r),
        put(mesh, P(), g),
    )


def fused(ws, **options):
    """A shard_map body: allreduce_fusion(x, residual, gamma) -> (residual_out, norm_out)."""

    def body(x, r, g):
        out = jf.allreduce_fusion(
            x, axis_name="tp", workspace=ws, residual=r, rms_gamma=g, **options
        )
        return out.residual_out, out.norm_out

    return body


def call_row_parallel(mesh, args, **options):
    """The op under jit on Auto axes (the partition rule runs when XLA compiles), or under
    the mesh on Explicit axes; returns (residual_out, norm_out)."""

    def f(h, w, r, g):
        out = jf.row_parallel_allreduce_fusion(h, w, residual=r, rms_gamma=g, **options)
        return out.residual_out, out.norm_out

    with jax.set_mesh(mesh):
        return jax.jit(f)(*args)


BAD_OPTIONS = [
    (dict(fp32_acc="false"), TypeError, "fp32_acc must be True or False, got 'false'"),
    (dict(use_oneshot="false"), TypeError, "use_oneshot must be True, False or None"),
    (dict(rms_eps="1e-6"), TypeError, "rms_eps must be a real number, got '1e-6'"),
    (dict(weight_bias="1"), TypeError, "weight_bias must be a real number, got '1'"),
    (dict(rms_eps=-10.0), ValueError, "rms_eps must be >= 0.0"),
    (dict(rms_eps=-1.0), ValueError, "rms_eps must be >= 0.0"),
    (dict(rms_eps=float("nan")), ValueError, "rms_eps must be finite"),
    (dict(rms_eps=1e39), ValueError, "rms_eps=1e[+]?39 overflows float32"),
    (dict(weight_bias=1e39), ValueError, "weight_bias=1e[+]?39 overflows float32"),
    (dict(strict="no"), TypeError, "strict .* must be True or False, got 'no'"),
]


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize("k_sharded", [True, False])
@pytest.mark.parametrize("over,error,match", BAD_OPTIONS)
def test_row_parallel_refuses_bad_options_by_name_up_front(
    axis_type, k_sharded, over, error, match
):
    """Every misuse is the same TypeError/ValueError as allreduce_fusion's, raised while
    tracing: not coerced (fp32_acc="false" gave fp32_acc=True's bits), not skipped (k not
    sharded never reached allreduce_fusion: rms_eps=-10 gave NaN), and not an INTERNAL
    custom_partitioner traceback from XLA's compilation (Auto axes)."""
    mesh = mesh_2x4(axis_type)
    ws = bf16_workspace(mesh, TOKENS, N)
    args = row_parallel_args(mesh, k_sharded=k_sharded)
    with pytest.raises(error, match=match):
        call_row_parallel(mesh, args, workspace=ws, **over)


def test_row_parallel_strict_from_the_environment_is_read_up_front(monkeypatch):
    mesh = mesh_2x4(AxisType.Auto)
    monkeypatch.setenv(backend_choice.STRICT_ENV_VAR, "maybe")
    with pytest.raises(ValueError, match=r"\$JAX_FUSEDAR_STRICT='maybe' is not a boolean"):
        call_row_parallel(mesh, row_parallel_args(mesh, k_sharded=False))


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_row_parallel_hidden_size_the_kernel_cannot_take_is_refused_while_tracing(axis_type):
    """n = 60 is not whole 16-byte vectors of bfloat16: allreduce_fusion refuses it inside the
    per-shard program, which on Auto axes runs inside XLA's compilation (an INTERNAL error);
    refused while tracing instead, naming w's n."""
    mesh = mesh_2x4(axis_type)
    ws = bf16_workspace(mesh, TOKENS, 64)
    args = row_parallel_args(mesh, n=60)
    with pytest.raises(ValueError, match="n = 60, .* not a multiple of 8"):
        call_row_parallel(mesh, args, workspace=ws)
    # Without a workspace there is no kernel, and the XLA path serves any n.
    res, norm = call_row_parallel(mesh, args)
    assert res.shape == norm.shape == (TOKENS, 60)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_row_parallel_any_contraction_meets_the_same_up_front_checks(axis_type):
    """contracting_dims (bhtq,hqd->btd) is the same op: its n = 60 is refused while tracing
    too, naming n, where on Auto axes it failed inside XLA's compilation."""
    mesh = mesh_2x4(axis_type)
    ws = bf16_workspace(mesh, TOKENS, 64)
    rng = new_rng()
    a = random_values(rng, (2, 4, TOKENS // 2, 16), "bfloat16")
    wo = (random_values(rng, (4, 16, 60), "bfloat16") / 8).astype(jnp.bfloat16)
    r = random_values(rng, (2, TOKENS // 2, 60), "bfloat16")
    specs = (P("dp", "tp"), P("tp"), P("dp"), P())
    args = [put(mesh, *sa) for sa in zip(specs, (a, wo, r, random_gamma(rng, 60, "bfloat16")))]
    dims = ((1, 3), (0, 1))
    with pytest.raises(ValueError, match="n = 60, .* not a multiple of 8"):
        call_row_parallel(mesh, args, workspace=ws, contracting_dims=dims)
    res, norm = call_row_parallel(mesh, args, contracting_dims=dims)
    assert norm.shape == (2, TOKENS // 2, 60)  # no workspace: the XLA path serves any n


def test_row_parallel_bad_precision_is_refused_while_tracing():
    mesh = mesh_2x4(AxisType.Auto)
    with pytest.raises(ValueError, match="[Pp]recision"):
        call_row_parallel(mesh, row_parallel_args(mesh), precision="fastest-please")


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize("k_sharded", [True, False])
def test_row_parallel_residual_none_is_zeros(axis_type, k_sharded):
    """As allreduce_fusion takes it: residual_out = h @ w."""
    mesh = mesh_2x4(axis_type)
    ws = bf16_workspace(mesh, TOKENS, N)
    h, w, r, g = row_parallel_args(mesh, k_sharded=k_sharded)
    zeros = jax.device_put(jnp.zeros(r.shape, r.dtype), r.sharding)
    want = call_row_parallel(mesh, (h, w, zeros, g), workspace=ws)
    got = call_row_parallel(mesh, (h, w, None, g), workspace=ws)
    assert_same_bits(got, want, "residual=None")


def test_row_parallel_missing_gamma_is_named():
    mesh = mesh_2x4(AxisType.Auto)
    h, w, r, _ = row_parallel_args(mesh)
    with pytest.raises(ValueError, match="rms_gamma is required"):
        jf.row_parallel_allreduce_fusion(h, w, residual=r, rms_gamma=None)


def test_row_parallel_good_options_still_give_allreduce_fusions_bits():
    """The validated options reach the per-shard program unchanged: fp32_acc=False differs
    from True (on the kernel-exact fallback, where fp32_acc applies), and each equals
    shard_map + allreduce_fusion with the same options."""
    mesh = mesh_2x4(AxisType.Auto)
    ws = bf16_workspace(mesh, TOKENS, N)
    args = row_parallel_args(mesh)
    outs = {}
    specs = (P("dp", "tp"), P("tp", None), P("dp"), P())
    for acc in (True, False):
        numpy_options = dict(fp32_acc=np.bool_(acc), rms_eps=np.float32(1e-5), weight_bias=1)
        got = call_row_parallel(mesh, args, workspace=ws, fallback="kernel_exact", **numpy_options)
        per_shard = fused(ws, fp32_acc=acc, rms_eps=1e-5, weight_bias=1.0, fallback="kernel_exact")
        body = lambda h, w, r, g: per_shard(jnp.dot(h, w), r, g)
        want = jit_shard_map(body, mesh, specs, (P("dp"), P("dp")))(*args)
        assert_same_bits(got, want, f"fp32_acc={acc}")
        outs[acc] = got
    assert not np.array_equal(bits(outs[True][1]), bits(outs[False][1]))


def test_allreduce_fusion_in_an_inner_shard_map_over_tp_within_an_outer_over_dp():
    """The inner shard_map's lowering sees an abstract mesh (no devices); that has nothing
    to compare (ops.checks.check_call_groups) and must not fail. Equal bits to the same
    program written as one shard_map over both axes, and to psum + the reference epilogue."""
    mesh = make_mesh((2, 4), ("dp", "tp"))
    ws = bf16_workspace(mesh, 4, 256)
    rng = new_rng()
    x = jnp.asarray(random_partials(rng, (8 * 4, 256), "bfloat16"))
    r = jnp.asarray(random_values(rng, (2 * 4, 256), "bfloat16"))
    g = jnp.asarray(random_gamma(rng, 256, "bfloat16"))

    def plain(x, r, g):
        _, res, norm = reference.allreduce_fusion_reference(
            x, r, g, axis_name="tp", pattern=1, rms_eps=1e-6, weight_bias=0.0, fp32_acc=True
        )
        return res, norm

    def nested(body):
        # The inner one over "tp", on the mesh of the outer one.
        inner = jax.shard_map(
            body, axis_names={"tp"}, in_specs=(P("tp"), P(), P()), out_specs=(P(), P())
        )
        dp_specs = (P("dp"), P("dp"), P())
        return jit_shard_map(inner, mesh, dp_specs, (P("dp"), P("dp")), axis_names={"dp"})

    flat = jit_shard_map(fused(ws), mesh, (P(("dp", "tp")), P("dp"), P()), (P("dp"), P("dp")))
    got = nested(fused(ws))(x, r, g)
    assert_same_bits(got, flat(x, r, g), "nested vs one shard_map")
    assert_same_bits(got, nested(plain)(x, r, g), "nested vs psum + reference")


@pytest.mark.parametrize("option", ["rms_eps", "weight_bias"])
def test_allreduce_fusion_refuses_options_that_overflow_float32(option):
    mesh = tp_mesh()
    ws = bf16_workspace(mesh, 4, 256)
    x = jnp.ones((8 * 4, 256), jnp.bfloat16)
    g = jnp.ones((256,), jnp.bfloat16)

    def run(value):
        body = fused(ws, **{option: value})
        return jit_shard_map(lambda x: body(x, None, g)[1], mesh, P("tp"), P())(x)

    with pytest.raises(ValueError, match=f"{option}=1e[+]?39 overflows float32"):
        run(1e39)
    run(3.4028234e38)  # the largest finite float32 is taken: the overflow check is exact


def test_moe_refuses_options_that_overflow_float32():
    mesh = tp_mesh()
    ws = bf16_workspace(mesh, 4, 256)
    rows = jnp.ones((8 * 4, 256), jnp.bfloat16)
    idx = jnp.zeros((8 * 4, 1), jnp.int32)
    g = jnp.ones((256,), jnp.bfloat16)
    for option in ("rms_eps", "weight_bias", "routed_scaling_factor"):

        def body(rows, idx):
            return jf.moe_finalize_allreduce_fusion(
                rows, idx, axis_name="tp", workspace=ws, rms_gamma=g, **{option: 1e39}
            ).norm_out

        with pytest.raises(ValueError, match=f"{option}=1e[+]?39 overflows float32"):
            jit_shard_map(body, mesh, (P("tp"), P("tp")), P())(rows, idx)


def export_norm_for_cuda(ws):
    """Exports pattern 1 on [4, 256] bfloat16 shards of an 8-device mesh for cuda."""
    pytest.importorskip("flatbuffers", reason="jax.export serialization needs flatbuffers")
    spec = jax.ShapeDtypeStruct(
        (8 * 4, 256), jnp.bfloat16, sharding=NamedSharding(ws.mesh, P("tp"))
    )
    body = lambda x: fused(ws)(x, None, jnp.ones(256, jnp.bfloat16))[1]
    f = jit_shard_map(body, ws.mesh, P("tp"), P())
    return jf.export.export(f, platforms=("cuda",))(spec).mlir_module()


def test_abstract_xla_workspace_exports_psum_and_rmsnorm_for_cuda():
    """abstract_workspace(backend="xla") describes GPU processes that asked for XLA's
    collectives: exported for cuda as asked (psum + RMSNorm, no custom call), not refused
    with advice to use 'trtllm'. The same for an explicit backend="xla" workspace."""
    mesh = tp_mesh()
    kw = dict(max_token_num=4, hidden_dim=256, dtype=jnp.bfloat16, backend="xla")
    for ws in (
        jf.abstract_workspace(mesh, "tp", **kw),
        jf.create_allreduce_fusion_workspace(mesh, "tp", name="explicit", **kw),
    ):
        text = export_norm_for_cuda(ws)
        assert "stablehlo.all_reduce" in text and FFI_TARGET not in text


def test_auto_chosen_xla_workspace_advice_names_both_ways():
    """backend "auto" on a machine without GPUs: still refused for cuda (the user would
    silently lose the kernel), with advice for either intent."""
    ws = bf16_workspace(tp_mesh(), 4, 256)
    with pytest.raises(ValueError, match="backend='trtllm'.*on purpose.*backend='xla'"):
        export_norm_for_cuda(ws)


def test_residual_none_keeps_the_outputs_invariant_over_the_axis():
    """The zeros must not take x's variance over the axis (jnp.zeros_like would): the outputs
    are sums over the axis, so out_specs=P() holds under shard_map's default check_vma, and
    they equal an explicit zero residual's."""
    mesh = tp_mesh()
    ws = bf16_workspace(mesh, 4, 256)
    rng = new_rng()
    x = jnp.asarray(random_partials(rng, (8 * 4, 256), "bfloat16"))
    g = jnp.asarray(random_gamma(rng, 256, "bfloat16"))

    def run(residual):
        body = lambda x, g: fused(ws)(x, residual, g)
        return jit_shard_map(body, mesh, (P("tp"), P()), (P(), P()))(x, g)

    assert_same_bits(run(None), run(jnp.zeros((4, 256), jnp.bfloat16)), "residual=None")

    def moe_body(outputs, scales, tokens, g):
        return jf.moe_reduction_allreduce_fusion(
            outputs, scales, tokens, axis_name="tp", workspace=ws, rms_gamma=g
        ).norm_out

    outputs = jnp.asarray(random_partials(rng, (2, 8 * 4, 256), "bfloat16"))
    scales = jnp.ones((2, 8 * 4), jnp.float32)
    moe_specs = (P(None, "tp"), P(None, "tp"), P("tp"), P())
    norm = jit_shard_map(moe_body, mesh, moe_specs, P())(outputs, scales, x, g)
    assert norm.shape == (4, 256)
