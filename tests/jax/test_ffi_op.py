"""The one machinery every FFI op is declared through (``ffi_op.FfiOp``): the registry that
``jax_fusedar.export`` reads, and an op declared here in a page (a scaled all-reduce) that is
a JAX citizen by its declaration alone: jit + shard_map, check_vma, grad, vmap, cuda lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_fusedar as jf
from jax_fusedar.ops import family as ffi_op, reference
from jax_fusedar.ops.plan import CallPlan
from jax_fusedar.common import native
from tests.jax.cpu_helpers import cuda_text, jit_shard_map, require_host_devices, tp_mesh

require_host_devices()

# Also in the oldest-versions lane (./dev oldest).
pytestmark = pytest.mark.oldest


def _abstract_eval(x, *, axis_name, **_):
    return [ffi_op.with_varying(x, ffi_op.varying(x) - frozenset(axis_name))]


def _reference(x, *, axis_name, scale, fallback):
    # The machinery hands every op's reference the call's fallback (its all-reduce).
    summed = reference.fallback_allreduce(x, axis_name, fallback=fallback, fp32_acc=True)
    return [summed * scale]


def _batch(op, args, dims, **params):
    x = jnp.moveaxis(args[0], dims[0], 0)
    return [jax.lax.map(lambda row: op.primitive.bind(row, **params)[0], x)], [0]


DECLARATION = dict(
    target="allreduce_fusion",
    public_name="tests.scaled_allreduce",
    operands=("x",),  # outside the pattern table: its own rules
    abstract_eval=_abstract_eval,
    reference=_reference,
    attributes=lambda *, scale: {"scale": np.float32(scale)},
    aliases=lambda **_: {},
    batch=_batch,
)
SCALED_SUM = ffi_op.FfiOp("tests_scaled_allreduce", **DECLARATION)


def scaled_sum(x, ws, scale=2.0, use_kernel=False):
    plan = CallPlan(ws.backend, ws.sizes, False, None)
    return SCALED_SUM.bind(
        x, workspace=ws, axis_name="tp", use_kernel=use_kernel, plan=plan, scale=float(scale)
    )[0]


KW = dict(max_token_num=4, hidden_dim=128, dtype=jnp.float32)
MESH = tp_mesh()
WS = jf.create_allreduce_fusion_workspace(MESH, "tp", **KW)


def test_every_op_of_the_package_is_declared_in_the_registry():
    from jax_fusedar.ops import dense, moe

    ops = {op.name: op for op in ffi_op.declared_ops()}
    assert ops["jax_fusedar_allreduce_fusion"] is dense.allreduce_fusion_op
    assert ops["jax_fusedar_moe_reduction_allreduce_fusion"] is moe.moe_reduction_op
    assert ops["jax_fusedar_moe_finalize_allreduce_fusion"] is moe.moe_finalize_op
    # Every handler of an op is exempt from jax.export's check: the dense op's and the one
    # both MoE ops call; the benchmarks' device timestamp (no op, no host twin) is not.
    want = tuple(t for role, t in native.FFI_TARGETS.items() if role != "device_timestamp")
    assert ffi_op.export_safe_targets() == want
    check = jax.export.DisabledSafetyCheck.custom_call
    assert list(jf.export.DISABLED_CHECKS) == [check(t) for t in ffi_op.export_safe_targets()]
    targets = (dense.FFI_TARGET, native.FFI_TARGETS["moe_allreduce_fusion"])
    assert jf.export.DISABLED_CHECKS == tuple(check(t) for t in targets)


def test_a_declared_op_runs_under_jit_and_shard_map_with_its_vma_rule():
    x = np.arange(8 * 4 * 128, dtype=np.float32).reshape(8, 4, 128) / 1024
    # out_specs=P() needs the invariant result
    f = jit_shard_map(lambda x: scaled_sum(x[0], WS), MESH, P("tp"), P())
    np.testing.assert_allclose(np.asarray(f(x)), 2 * x.astype(np.float64).sum(0), rtol=1e-6)
    match = "tests.scaled_allreduce must be called inside jax.shard_map"
    with pytest.raises(ValueError, match=match):
        scaled_sum(np.ones((4, 128), np.float32), WS)


def test_a_declared_op_differentiates_and_vmaps_through_the_machinery():
    x = np.random.default_rng(0).standard_normal((8, 3, 4, 128)).astype(np.float32)
    loss = lambda x: jnp.sum(scaled_sum(x, WS, scale=3.0) ** 2)
    body = lambda x: (jax.grad(loss)(x[0])[None], jax.vmap(lambda r: scaled_sum(r, WS))(x[0]))
    g, batched = jit_shard_map(body, MESH, P("tp"), (P("tp"), P()))(x)
    total = x.astype(np.float64).sum(0)
    # A float32 sum of 8 standard normals is within 8 * 2**-24 * sum|x| of the exact one.
    bound = 8 * 2.0**-24 * np.abs(x.astype(np.float64)).sum(0).max()
    # d/dx_r sum((3 * sum_r x_r)^2) = 18 * sum_r x_r for every rank r.
    np.testing.assert_allclose(
        np.asarray(g), np.broadcast_to(18 * total, g.shape), rtol=0, atol=18 * 2 * bound
    )
    np.testing.assert_allclose(np.asarray(batched), 2 * total, rtol=0, atol=2 * 2 * bound)


def test_a_declared_op_lowers_to_its_custom_call_on_cuda():
    ws = jf.abstract_workspace(MESH, "tp", **KW)
    f = jit_shard_map(
        lambda x: scaled_sum(x[0], ws, scale=0.5, use_kernel=True), MESH, P("tp"), P()
    )
    text = cuda_text(f, jax.ShapeDtypeStruct((8, 4, 128), jnp.float32))
    call = [line for line in text.splitlines() if f"@{SCALED_SUM.target}" in line]
    assert len(call) == 1, text
    assert f"workspace_id = {ws.id} : i64" in call[0] and "scale = 5.000000e-01" in call[0]
    assert "all_reduce" not in text  # the handler reduces, not XLA


def test_an_op_is_declared_once_and_outside_the_pattern_table_declares_its_own_rules():
    with pytest.raises(ValueError, match="declared twice"):
        ffi_op.FfiOp("tests_scaled_allreduce", **DECLARATION)
    # Its operands alone are not enough: the table's rules read the pattern's results.
    incomplete = dict(target="allreduce_fusion", public_name="x", operands=lambda **_: ("x",))
    incomplete.update(reference=_reference, attributes=lambda **_: {})
    with pytest.raises(ValueError, match="outside the pattern table: declare its abstract_eval"):
        ffi_op.FfiOp("tests_incomplete", **incomplete)
    assert SCALED_SUM.operand_names({"scale": 2.0}) == ("x",)
    want = "FfiOp('tests_scaled_allreduce', target='jax_fusedar_allreduce_fusion_v2')"
    assert repr(SCALED_SUM) == want


def test_the_tables_ops_take_their_operands_by_the_tables_names():
    from jax_fusedar.common import results
    from jax_fusedar.ops.moe import moe_finalize_op

    params = {"has_expert_scale": True, "has_shared_expert": False}
    want = ("permuted_input", "expanded_idx_to_permuted_idx", "residual", "rms_gamma")
    assert moe_finalize_op.operand_names(params) == (*want, "expert_scale_factor")
    call = dict(workspace=None, axis_name="tp", plan=None, decided=None, **params)
    with pytest.raises(AssertionError, match="the table's"):
        moe_finalize_op.call({"permuted_input": None}, **call)
    with pytest.raises(ValueError, match="writes no optional all-reduce output"):
        results.result_specs(1, 4, 256, "bfloat16", allreduce_out=True)
