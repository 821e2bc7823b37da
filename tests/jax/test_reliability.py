"""Misuse that must not pass silently or fail with an error naming nothing, on 8 CPU devices:
``row_parallel_allreduce_fusion``'s options validated up front (Auto axes too, where its
per-shard program runs inside XLA's compilation), ``residual=None`` as zeros; nested
shard_maps; options checked in float32, as the kernel reads them; xla workspaces for cuda."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_fusedar as jf
from tests.jax.cpu_helpers import assert_same_bits, bits, jit_shard_map, make_mesh, mesh_2x4
from tests.jax.cpu_helpers import new_rng, put, random_gamma, random_partials, random_values
from tests.jax.cpu_helpers import require_host_devices, tp_mesh, xla_workspace
from jax_fusedar.ops import reference
from jax_fusedar.common import backend_choice
from jax_fusedar.ops.dense import FFI_TARGET

require_host_devices()

# Also in the oldest-versions lane (./dev oldest).
pytestmark = [pytest.mark.usefixtures("hermetic"), pytest.mark.oldest]

TOKENS, K, N = 16, 64, 128
AXIS_TYPES = pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])


def row_parallel_args(mesh, *, k_sharded=True, n=N):
    rng, k = new_rng(), "tp" if k_sharded else None
    h = random_values(rng, (TOKENS, K), "bfloat16")
    w = (random_values(rng, (K, n), "bfloat16") / 8).astype(jnp.bfloat16)
    r, g = random_values(rng, (TOKENS, n), "bfloat16"), random_gamma(rng, n, "bfloat16")
    specs = (P("dp", k), P(k, None), P("dp", None), P())
    return tuple(put(mesh, spec, a) for spec, a in zip(specs, (h, w, r, g)))


def fused(ws, **options):
    """A shard_map body: allreduce_fusion(x, residual, gamma) -> (residual_out, norm_out)."""
    kw = dict(axis_name="tp", workspace=ws, **options)
    return lambda x, r, g: jf.allreduce_fusion(x, residual=r, rms_gamma=g, **kw)[1:3]


def call_row_parallel(mesh, args, **options):
    """The op under jit on Auto axes (the partition rule runs when XLA compiles), or under
    the mesh on Explicit axes; returns (residual_out, norm_out)."""

    f = lambda h, w, r, g: jf.row_parallel_allreduce_fusion(
        h, w, residual=r, rms_gamma=g, **options
    )
    with jax.set_mesh(mesh):
        return jax.jit(f)(*args)[1:3]


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


@AXIS_TYPES
@pytest.mark.parametrize("k_sharded", [True, False])
@pytest.mark.parametrize("over,error,match", BAD_OPTIONS)
def test_row_parallel_refuses_bad_options_by_name_up_front(
    axis_type, k_sharded, over, error, match
):
    """allreduce_fusion's error, raised while tracing: not coerced (fp32_acc="false" gave True's
    bits), not skipped (k not sharded: rms_eps=-10 gave NaN), not an INTERNAL XLA traceback."""
    mesh = mesh_2x4(axis_type)
    ws = xla_workspace(mesh, max_token_num=TOKENS, hidden_dim=N)
    args = row_parallel_args(mesh, k_sharded=k_sharded)
    with pytest.raises(error, match=match):
        call_row_parallel(mesh, args, workspace=ws, **over)


@AXIS_TYPES
@pytest.mark.parametrize("contraction", ["matmul", "bhtq,hqd->btd"])
def test_row_parallel_hidden_size_the_kernel_cannot_take_is_refused_while_tracing(
    axis_type, contraction
):
    """n = 60 is not whole 16-byte vectors of bfloat16: refused while tracing, naming w's n, for
    any contraction, not inside XLA's compilation (Auto axes: an INTERNAL error)."""
    mesh = mesh_2x4(axis_type)
    ws = xla_workspace(mesh, max_token_num=TOKENS, hidden_dim=64)
    if contraction == "matmul":
        args, kw, shape = row_parallel_args(mesh, n=60), {}, (TOKENS, 60)
    else:
        rng = new_rng()
        a = random_values(rng, (2, 4, TOKENS // 2, 16), "bfloat16")
        wo = (random_values(rng, (4, 16, 60), "bfloat16") / 8).astype(jnp.bfloat16)
        r = random_values(rng, (2, TOKENS // 2, 60), "bfloat16")
        specs = (P("dp", "tp"), P("tp"), P("dp"), P())
        args = [put(mesh, *sa) for sa in zip(specs, (a, wo, r, random_gamma(rng, 60, "bfloat16")))]
        kw, shape = dict(contracting_dims=((1, 3), (0, 1))), (2, TOKENS // 2, 60)
    with pytest.raises(ValueError, match="n = 60, .* not a multiple of 8"):
        call_row_parallel(mesh, args, workspace=ws, **kw)
    # Without a workspace there is no kernel, and the XLA path serves any n.
    res, norm = call_row_parallel(mesh, args, **kw)
    assert res.shape == norm.shape == shape


@AXIS_TYPES
@pytest.mark.parametrize("k_sharded", [True, False])
def test_row_parallel_residual_none_is_zeros(axis_type, k_sharded):
    """As allreduce_fusion takes it: residual_out = h @ w."""
    mesh = mesh_2x4(axis_type)
    ws = xla_workspace(mesh, max_token_num=TOKENS, hidden_dim=N)
    h, w, r, g = row_parallel_args(mesh, k_sharded=k_sharded)
    zeros = jax.device_put(jnp.zeros(r.shape, r.dtype), r.sharding)
    want = call_row_parallel(mesh, (h, w, zeros, g), workspace=ws)
    assert_same_bits(call_row_parallel(mesh, (h, w, None, g), workspace=ws), want, "residual=None")


def test_row_parallel_options_on_auto_axes(monkeypatch):
    """Good options reach the per-shard program unchanged: each fp32_acc (it differs on the
    kernel-exact fallback) equals shard_map + allreduce_fusion with the same options. A bad
    precision, a missing gamma and a bad $JAX_FUSEDAR_STRICT are each refused by name."""
    mesh = mesh_2x4(AxisType.Auto)
    ws = xla_workspace(mesh, max_token_num=TOKENS, hidden_dim=N)
    args, outs = row_parallel_args(mesh), {}
    for acc in (True, False):
        numpy_options = dict(fp32_acc=np.bool_(acc), rms_eps=np.float32(1e-5), weight_bias=1)
        got = call_row_parallel(mesh, args, workspace=ws, fallback="kernel_exact", **numpy_options)
        per_shard = fused(ws, fp32_acc=acc, rms_eps=1e-5, weight_bias=1.0, fallback="kernel_exact")
        body = lambda h, w, r, g: per_shard(jnp.dot(h, w), r, g)
        specs = (P("dp", "tp"), P("tp", None), P("dp"), P())
        assert_same_bits(
            got, jit_shard_map(body, mesh, specs, (P("dp"), P("dp")))(*args), f"fp32_acc={acc}"
        )
        outs[acc] = got
    assert not np.array_equal(bits(outs[True][1]), bits(outs[False][1]))
    with pytest.raises(ValueError, match="[Pp]recision"):
        call_row_parallel(mesh, args, precision="fastest-please")
    with pytest.raises(ValueError, match="rms_gamma is required"):
        jf.row_parallel_allreduce_fusion(*args[:2], residual=args[2], rms_gamma=None)
    monkeypatch.setenv(backend_choice.STRICT_ENV_VAR, "maybe")
    with pytest.raises(ValueError, match=r"\$JAX_FUSEDAR_STRICT='maybe' is not a boolean"):
        call_row_parallel(mesh, row_parallel_args(mesh, k_sharded=False))


def test_allreduce_fusion_in_an_inner_shard_map_over_tp_within_an_outer_over_dp():
    """The inner shard_map's lowering sees an abstract mesh (no devices to compare): no failure,
    the bits of one shard_map over both axes and of psum + the reference epilogue."""
    mesh = make_mesh((2, 4), ("dp", "tp"))
    ws = xla_workspace(mesh, max_token_num=4, hidden_dim=256)
    rng = new_rng()
    x = jnp.asarray(random_partials(rng, (8 * 4, 256), "bfloat16"))
    r = jnp.asarray(random_values(rng, (2 * 4, 256), "bfloat16"))
    g = jnp.asarray(random_gamma(rng, 256, "bfloat16"))

    def plain(x, r, g):
        kw = dict(axis_name="tp", pattern=1, rms_eps=1e-6, weight_bias=0.0, fp32_acc=True)
        return reference.allreduce_fusion_reference(x, r, g, **kw)[1:]

    def nested(body):  # the inner one over "tp", on the mesh of the outer one
        specs = dict(in_specs=(P("tp"), P(), P()), out_specs=(P(), P()))
        inner = jax.shard_map(body, axis_names={"tp"}, **specs)
        return jit_shard_map(
            inner, mesh, (P("dp"), P("dp"), P()), (P("dp"), P("dp")), axis_names={"dp"}
        )

    flat = jit_shard_map(fused(ws), mesh, (P(("dp", "tp")), P("dp"), P()), (P("dp"), P("dp")))
    got = nested(fused(ws))(x, r, g)
    assert_same_bits(got, flat(x, r, g), "nested vs one shard_map")
    assert_same_bits(got, nested(plain)(x, r, g), "nested vs psum + reference")


OVERFLOWING = [("dense", "rms_eps"), ("dense", "weight_bias"), ("moe", "rms_eps")]
OVERFLOWING += [("moe", "weight_bias"), ("moe", "routed_scaling_factor")]


@pytest.mark.parametrize("op, option", OVERFLOWING)
def test_options_that_overflow_float32_are_refused(op, option):
    mesh = tp_mesh()
    ws = xla_workspace(mesh, max_token_num=4, hidden_dim=256)
    x, idx = jnp.ones((8 * 4, 256), jnp.bfloat16), jnp.zeros((8 * 4, 1), jnp.int32)
    g = jnp.ones((256,), jnp.bfloat16)

    def run(value):
        if op == "dense":
            body = fused(ws, **{option: value})
            return jit_shard_map(lambda x: body(x, None, g)[1], mesh, P("tp"), P())(x)
        kw = dict(axis_name="tp", workspace=ws, rms_gamma=g, **{option: value})
        body = lambda rows, idx: jf.moe_finalize_allreduce_fusion(rows, idx, **kw).norm_out
        return jit_shard_map(body, mesh, (P("tp"), P("tp")), P())(x, idx)

    with pytest.raises(ValueError, match=f"{option}=1e[+]?39 overflows float32"):
        run(1e39)
    if op == "dense":
        run(3.4028234e38)  # the largest finite float32 is taken: the overflow check is exact


def export_norm_for_cuda(ws):
    """Exports pattern 1 on [4, 256] bfloat16 shards of an 8-device mesh for cuda."""
    pytest.importorskip("flatbuffers", reason="jax.export serialization needs flatbuffers")
    spec = jax.ShapeDtypeStruct((32, 256), jnp.bfloat16, sharding=NamedSharding(ws.mesh, P("tp")))
    f = jit_shard_map(
        lambda x: fused(ws)(x, None, jnp.ones(256, jnp.bfloat16))[1], ws.mesh, P("tp"), P()
    )
    return jf.export.export(f, platforms=("cuda",))(spec).mlir_module()


def test_xla_workspaces_exported_for_cuda():
    """backend="xla" workspaces (abstract or not) export psum + RMSNorm for cuda, as asked; "auto"
    without GPUs is refused for cuda (the kernel would be lost silently), advising both ways."""
    mesh = tp_mesh()
    kw = dict(max_token_num=4, hidden_dim=256, dtype=jnp.bfloat16, backend="xla")
    abstract = jf.abstract_workspace(mesh, "tp", **kw)
    for ws in (abstract, jf.create_allreduce_fusion_workspace(mesh, "tp", name="explicit", **kw)):
        text = export_norm_for_cuda(ws)
        assert "stablehlo.all_reduce" in text and FFI_TARGET not in text
    with pytest.raises(ValueError, match="backend='trtllm'.*on purpose.*backend='xla'"):
        export_norm_for_cuda(xla_workspace(mesh, max_token_num=4, hidden_dim=256))


def test_residual_none_keeps_the_outputs_invariant_over_the_axis():
    """The zeros must not take x's variance over the axis (jnp.zeros_like would): out_specs=P()
    holds under check_vma, and the outputs equal an explicit zero residual's."""
    mesh = tp_mesh()
    ws = xla_workspace(mesh, max_token_num=4, hidden_dim=256)
    rng = new_rng()
    x = jnp.asarray(random_partials(rng, (8 * 4, 256), "bfloat16"))
    g = jnp.asarray(random_gamma(rng, 256, "bfloat16"))
    smap = lambda f: jit_shard_map(f, mesh, (P("tp"), P()), (P(), P()))
    run = lambda res: smap(lambda x, g: fused(ws)(x, res, g))(x, g)
    assert_same_bits(run(None), run(jnp.zeros((4, 256), jnp.bfloat16)), "residual=None")

    def moe_body(outputs, scales, tokens, g):
        kw = dict(axis_name="tp", workspace=ws, rms_gamma=g)
        return jf.moe_reduction_allreduce_fusion(outputs, scales, tokens, **kw).norm_out

    outputs = jnp.asarray(random_partials(rng, (2, 8 * 4, 256), "bfloat16"))
    moe_specs = (P(None, "tp"), P(None, "tp"), P("tp"), P())
    norm = jit_shard_map(moe_body, mesh, moe_specs, P())(
        outputs, jnp.ones((2, 8 * 4), jnp.float32), x, g
    )
    assert norm.shape == (4, 256)
