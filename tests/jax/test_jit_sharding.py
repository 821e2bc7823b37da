"""``row_parallel_allreduce_fusion`` under plain jit + shardings (no shard_map), 8 CPU devices:
a 4-layer MaxText-style model (Auto axes partitioned by Shardy through custom_partitioning,
and Explicit axes) gives the bits of the same model written with shard_map; the partition
rule's choices; the per-shard program lowered for cuda holds the fused custom call."""

import contextlib
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_fusedar as jf
from tests.jax.cpu_helpers import bits, cuda_text, jdtype, jit_shard_map, mesh_2x4, new_rng
from tests.jax.cpu_helpers import partitioned_shard_text, put, random_gamma, random_values
from tests.jax.cpu_helpers import require_host_devices
from jax_fusedar.ops import partitioning, reference
from jax_fusedar.ops.dense import FFI_TARGET

require_host_devices()

from tests.jax.sharded_model import BATCH, FFN, HIDDEN, LAYERS, SEQ, jit_model  # noqa: E402
from tests.jax.sharded_model import model_params, place, shard_map_model  # noqa: E402


# Environment and once-per-kind logging reset per test (conftest.py); ./dev oldest runs it too.
pytestmark = [pytest.mark.usefixtures("hermetic"), pytest.mark.oldest]


BF = jnp.bfloat16


def residual_and_norm(h, w, r, g, **kwargs):
    """row_parallel_allreduce_fusion's (residual_out, norm_out)."""
    return tuple(jf.row_parallel_allreduce_fusion(h, w, residual=r, rms_gamma=g, **kwargs))[1:3]


def bf16_workspace(mesh, axis="tp", make=jf.abstract_workspace, max_token_num=64):
    return make(mesh, axis, max_token_num=max_token_num, hidden_dim=HIDDEN, dtype=BF)


@pytest.mark.slow
@pytest.mark.parametrize(
    "axis_type,mesh_context",
    [(AxisType.Auto, False), (AxisType.Auto, True), (AxisType.Explicit, True)],
)
@pytest.mark.parametrize("backend", ["xla", "trtllm"])
def test_four_layer_jit_model_equals_the_shard_map_model_bitwise(axis_type, mesh_context, backend):
    """On CPU both run the reference lowering (a trtllm workspace also lowers to it here), so
    equal bits mean the partitioner ran the same per-shard program as shard_map does."""
    rng = new_rng()
    mesh = mesh_2x4(axis_type)
    make = functools.partial(jf.abstract_workspace, backend="trtllm")
    make = jf.create_allreduce_fusion_workspace if backend == "xla" else make
    ws = bf16_workspace(mesh, make=make, max_token_num=BATCH * SEQ)
    x = random_values(rng, (BATCH, SEQ, HIDDEN), "bfloat16")
    params, x = place(mesh, model_params(rng, jdtype("bfloat16")), x)
    want = shard_map_model(mesh, ws)(params, x)
    # MaxText runs under its mesh; Explicit axes need it.
    with jax.set_mesh(mesh) if mesh_context else contextlib.nullcontext():
        got = jax.jit(lambda p, x: jit_model(p, x, workspace=ws))(params, x)
    for g, w, name in zip(got, want, ("norm_out", "residual_out")):
        assert g.shape == w.shape == (BATCH, SEQ, HIDDEN)
        np.testing.assert_array_equal(bits(g), bits(w), err_msg=name)
        assert g.sharding.spec[0] == "dp", g.sharding  # rows stay where h's rows were
    # ... and the model is not trivially equal: the norm changed the residual stream.
    assert not np.array_equal(bits(got[0]), bits(got[1]))


def test_auto_axes_compile_to_one_all_reduce_per_layer_and_no_shard_map():
    rng = new_rng()
    mesh = mesh_2x4(AxisType.Auto)
    ws = bf16_workspace(mesh, make=jf.create_allreduce_fusion_workspace, max_token_num=BATCH * SEQ)
    params, x = place(mesh, model_params(rng), random_values(rng, (BATCH, SEQ, HIDDEN), "bfloat16"))
    hlo = jax.jit(lambda p, x: jit_model(p, x, workspace=ws)).lower(params, x).compile().as_text()
    # One all-reduce per layer (the reference's psum), over groups of 4 ("tp").
    assert hlo.count("all-reduce(") == LAYERS, hlo
    # XLA prints the groups as a list, an iota, or (JAX 0.11) the mesh axes reduced over.
    assert (
        "replica_groups={{0,1,2,3},{4,5,6,7}}" in hlo
        or "[2,4]<=[8]" in hlo
        or "replica_groups=mesh['dp'=2,'tp'=4] {'tp'}" in hlo
    ), hlo


def test_plain_math_when_the_contracting_dim_is_not_sharded(caplog):
    """w replicated: no reduction, the plain math (one matmul, add, norm), no fallback log."""
    rng = new_rng()
    mesh = mesh_2x4(AxisType.Auto)
    ws = bf16_workspace(mesh)
    h = random_values(rng, (BATCH * SEQ, FFN), "bfloat16")
    w = (random_values(rng, (FFN, HIDDEN), "bfloat16") / 16).astype(jnp.bfloat16)
    r = random_values(rng, (BATCH * SEQ, HIDDEN), "bfloat16")
    g = random_gamma(rng, HIDDEN, "bfloat16")
    placed = (put(mesh, P("dp", None), h), put(mesh, P(), w), r, g)
    f = jax.jit(functools.partial(residual_and_norm, workspace=ws))
    with caplog.at_level(logging.WARNING, logger="jax_fusedar"):
        res, norm = f(*placed)
        hlo = f.lower(*placed).compile().as_text()
    assert "all-reduce" not in hlo
    assert not caplog.records
    epilogue = lambda h, w, r, g: reference.epilogue(
        jnp.dot(h, w), r, g, pattern=1, rms_eps=1e-6, weight_bias=0.0
    )
    _, want_r, want_n = jax.jit(epilogue)(h, w, r, g)
    np.testing.assert_array_equal(bits(res), bits(want_r))
    np.testing.assert_array_equal(bits(norm), bits(want_n))


def partition_args(mesh, h_spec, w_spec, r_spec=P()):
    """Abstract (h [32, FFN], w [FFN, HIDDEN], residual, gamma) placed as the specs say."""
    shapes = [(32, FFN), (FFN, HIDDEN), (32, HIDDEN), (HIDDEN,)]
    sds = lambda shape, spec: jax.ShapeDtypeStruct(shape, BF, sharding=NamedSharding(mesh, spec))
    return tuple(sds(shape, spec) for shape, spec in zip(shapes, (h_spec, w_spec, r_spec, P())))


def cfg(workspaces=(), strict=None, h_ndim=2):
    contraction = partitioning._Contraction.matmul(h_ndim)
    return partitioning._Config(tuple(workspaces), 1e-6, 0.0, True, None, strict, None, contraction)


@pytest.mark.parametrize(
    "h_spec,w_spec,want_h,want_w,want_out",
    [
        (P("dp", "tp"), P("tp", None), P("dp", "tp"), P("tp", None), P("dp", None)),
        # h's k replicated but w's sharded: w decides, h is resharded to match.
        (P("dp", None), P("tp", None), P("dp", "tp"), P("tp", None), P("dp", None)),
        # w's n sharded (column-parallel layout): n is gathered, RMSNorm needs whole rows.
        (P(None, "tp"), P("tp", "dp"), P(None, "tp"), P("tp", None), P(None, None)),
        # tokens sharded over the k axis too: that axis goes to k only.
        (P(("dp", "tp"), None), P("tp", None), P("dp", "tp"), P("tp", None), P("dp", None)),
        (P("dp", None), P(None, None), P("dp", None), P(None, None), P("dp", None)),
    ],
)
def test_partition_rule_shardings(h_spec, w_spec, want_h, want_w, want_out):
    mesh = mesh_2x4(AxisType.Auto)
    args = partition_args(mesh, h_spec, w_spec)
    _, _, outs, ins = partitioning.partition(cfg(), mesh, args, None)
    assert [s.spec for s in ins] == [want_h, want_w, want_out, P(None)]
    assert [s.spec for s in outs] == [want_out, want_out]


def lower_partitioned_shard_for_cuda(workspaces, h_spec=P("dp", "tp"), w_spec=P("tp", None), **kw):
    """partitioned_shard_text of a site on the 2 x 4 mesh."""
    mesh = mesh_2x4(AxisType.Auto)
    return partitioned_shard_text(cfg(workspaces, **kw), mesh, partition_args(mesh, h_spec, w_spec))


@pytest.mark.parametrize(
    "h_spec,w_spec",
    [(P("dp", "tp"), P("tp", None)), (P(None, ("dp", "tp")), P(("dp", "tp"), None))],
    ids=["k_over_tp", "k_over_dp_and_tp"],
)
def test_partitioned_shard_lowering_for_cuda(h_spec, w_spec):
    """k sharded over "tp": the fused custom call; over two axes: the reference over both."""
    text = lower_partitioned_shard_for_cuda(
        [bf16_workspace(mesh_2x4(AxisType.Auto))], h_spec, w_spec
    )
    if w_spec == P("tp", None):
        assert text.count(f"@{FFI_TARGET}") == 1 and "all_reduce" not in text
    else:
        assert FFI_TARGET not in text and "all_reduce" in text


def test_explicit_axes_lower_to_the_fused_custom_call_for_cuda():
    mesh = mesh_2x4(AxisType.Explicit)
    ws = bf16_workspace(mesh)
    args = partition_args(mesh, P("dp", "tp"), P("tp"), P("dp"))
    with jax.set_mesh(mesh):
        text = cuda_text(jax.jit(functools.partial(residual_and_norm, workspace=ws)), *args)
    assert text.count(f"@{FFI_TARGET}") == 1 and "all_reduce" not in text


def test_no_matching_workspace_falls_back_with_a_logged_reason_or_raises_in_strict_mode(caplog):
    mesh = mesh_2x4(AxisType.Auto)
    other = bf16_workspace(mesh, "dp")  # the wrong axis
    with caplog.at_level(logging.WARNING, logger="jax_fusedar"):
        text = lower_partitioned_shard_for_cuda([other])
    assert FFI_TARGET not in text and "all_reduce" in text
    assert "no workspace was given for mesh axis 'tp'" in caplog.text
    with pytest.raises(ValueError, match="no workspace was given for mesh axis 'tp'"):
        lower_partitioned_shard_for_cuda([other], strict=True)
    # The partition rule runs inside XLA's compilation: its ValueError comes back as XLA's
    # runtime error carrying the same message.
    wrong_axis = bf16_workspace(mesh, "dp", jf.create_allreduce_fusion_workspace)
    h = put(mesh, P(None, "tp"), jnp.ones((8, FFN), BF))
    w = put(mesh, P("tp"), jnp.ones((FFN, HIDDEN), BF))
    r, g = jnp.ones((8, HIDDEN), BF), jnp.ones(HIDDEN, BF)
    f = jax.jit(lambda h, w: residual_and_norm(h, w, r, g, workspace=wrong_axis, strict=True)[1])
    with pytest.raises(Exception, match="no workspace was given for mesh axis 'tp'.*strict"):
        f(h, w)


def test_argument_errors():
    h, w, r, g = (jnp.zeros(shape, BF) for shape in ((4, 16), (16, 32), (4, 32), (32,)))
    call = jf.row_parallel_allreduce_fusion
    with pytest.raises(ValueError, match="h must be"):
        call(h[0], w, residual=r, rms_gamma=g)
    with pytest.raises(ValueError, match="w must be"):
        call(h, w[:8], residual=r, rms_gamma=g)
    with pytest.raises(ValueError, match="residual must have shape"):
        call(h, w, residual=r[:, :16], rms_gamma=g)
    with pytest.raises(ValueError, match="rms_gamma must have shape"):
        call(h, w, residual=r, rms_gamma=g[:16])
    with pytest.raises(ValueError, match="w has dtype float32"):
        call(h, w.astype(jnp.float32), residual=r, rms_gamma=g)
    with pytest.raises(TypeError, match="workspace must be"):
        call(h, w, residual=r, rms_gamma=g, workspace="tp")
    inner = lambda h, w: call(h, w, residual=r, rms_gamma=g).norm_out
    for axis_type in (AxisType.Auto, AxisType.Explicit):  # inside shard_map: refused
        with pytest.raises(ValueError, match="outside shard_map"):
            jit_shard_map(inner, mesh_2x4(axis_type), (P(), P()), P())(h, w)
    kw = dict(max_token_num=8, hidden_dim=32, dtype=BF)
    ws = jf.create_allreduce_fusion_workspace(mesh_2x4(AxisType.Auto), "tp", **kw)
    ws.destroy()
    with pytest.raises(ValueError, match="was destroyed"):
        call(h, w, residual=r, rms_gamma=g, workspace=[ws])


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_gradients_equal_the_unsharded_plain_math(axis_type):
    """Auto axes: a custom_vjp around the partitioned op, whose backward is the plain math's
    gradient; Explicit axes: allreduce_fusion's own rules (the reference here, no workspace).
    Against jax.grad of the plain math on one device: equal up to the partitioner's summation
    order of the weight gradient over the dp shards (float32, so the bound is tight)."""
    rng = new_rng()
    mesh = mesh_2x4(axis_type)
    f32 = np.float32
    h = rng.standard_normal((BATCH, SEQ, FFN)).astype(f32)
    w = (rng.standard_normal((FFN, HIDDEN)) / 16).astype(f32)
    r = rng.standard_normal((BATCH, SEQ, HIDDEN)).astype(f32)
    g = rng.uniform(-2, 2, HIDDEN).astype(f32)
    ct = rng.standard_normal((2, BATCH, SEQ, HIDDEN)).astype(f32)

    def loss(fn, h, w, r, g):
        res, norm = fn(h, w, r, g)
        return jnp.sum(res * ct[0]) + jnp.sum(norm * ct[1])

    grad = lambda fn: jax.jit(jax.grad(lambda *a: loss(fn, *a), argnums=(0, 1, 2, 3)))
    cfg_ = cfg(h_ndim=3)
    want = grad(lambda *b: partitioning._plain(*b, cfg_))(h, w, r, g)
    specs = (P("dp", None, "tp"), P("tp", None), P("dp"), P())
    placed = [put(mesh, s, a) for a, s in zip((h, w, r, g), specs)]
    with jax.set_mesh(mesh):
        got = grad(residual_and_norm)(*placed)
    for name, a, b in zip(("h", "w", "residual", "gamma"), got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5, err_msg=name)
        assert np.abs(np.asarray(b)).max() > 1e-2, name  # not trivially zero
