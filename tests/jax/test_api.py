"""The public JAX API on CPU: results against the float64 oracle on 1-D and (dp, tp) meshes,
the cuda lowering (custom call, attributes, aliasing) on this GPU-less machine, trace-time
errors, the logged fallback and the workspace object. 8 virtual host devices."""

import contextlib
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_fusedar as jf
from jax_fusedar.common.limits import SUPPORTED_WORLD_SIZES
from tests.jax.cpu_helpers import bits, check_outputs, fusedar_warnings, jdtype, jit_shard_map
from tests.jax.cpu_helpers import kernel_rounding, make_mesh, new_rng, pattern_call, random_gamma
from tests.jax.cpu_helpers import random_partials, random_values, require_host_devices, run_sharded
from tests.jax.cpu_helpers import xla_workspace
from jax_fusedar.common import backend_choice
from jax_fusedar.ops.dense import FFI_TARGET
from jax_fusedar.common.tp_groups import TPGroup

require_host_devices()

Pattern = jf.AllReduceFusionPattern
AR, AR_NORM = Pattern.kAllReduce, Pattern.kARResidualRMSNorm
MESHES = dict(tp8=((8,), ("tp",)), dp2_tp4=((2, 4), ("dp", "tp")), dp4_tp2=((4, 2), ("dp", "tp")))
MLIR_TYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}
SHUFFLED = [5, 2, 7, 0, 3, 6, 1, 4]  # device ids, for meshes not in id order
BF16_KW = dict(max_token_num=8, hidden_dim=256, dtype=jnp.bfloat16)

# Environment and once-per-kind logging reset per test (conftest.py); ./dev oldest runs it too.
pytestmark = [pytest.mark.usefixtures("hermetic"), pytest.mark.oldest]


mesh_of = lambda name: make_mesh(*MESHES[name])
xla8 = lambda dtype="bfloat16", **kw: xla_workspace(mesh_of("tp8"), dtype, **kw)
# (x spec, per-group spec): x is sharded over all mesh axes along dim 0 (dp major), so each
# shard is its [M, H] block; per-group arrays are sharded over "dp" (replicated on 1-D).
specs = lambda mesh: (P("tp"), P()) if mesh.axis_names == ("tp",) else (P(("dp", "tp")), P("dp"))


def fused_body(ws, pattern=AR_NORM, *, seen=None, **kwargs):
    """Per shard: allreduce_fusion(x, residual, gamma) returning the pattern's outputs;
    ``seen`` receives which NamedTuple fields were None."""

    def body(x, residual=None, gamma=None):
        kw = dict(workspace=ws, pattern=pattern, residual=residual, rms_gamma=gamma)
        out = jf.allreduce_fusion(x, axis_name="tp", **kw, **kwargs)
        assert isinstance(out, jf.AllReduceFusionOutputs)
        if seen is not None:
            seen[int(pattern)] = tuple(f for f, v in zip(out._fields, out) if v is None)
        return tuple(v for v in out if v is not None)

    return body


def abstract(mesh, spec, shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jdtype(dtype), sharding=NamedSharding(mesh, spec))


def plain_allreduce(ws, axis_name="tp"):
    """x -> allreduce_out of pattern 0 on ``ws`` over ``axis_name``."""
    return lambda x: jf.allreduce_fusion(x, axis_name=axis_name, workspace=ws, pattern=AR)[0]


def trace_sharded(body, mesh, tokens, hidden, dtype="bfloat16", *, n_inputs=3, n_outputs=1):
    """jit(shard_map(body)).trace on the first ``n_inputs`` of abstract (x, residual, gamma),
    each shard seeing [tokens, hidden], [tokens, hidden], [hidden]; outputs per group."""
    x_spec, group_spec = specs(mesh)
    n = mesh.devices.size
    groups = n // mesh.shape["tp"]
    shapes = [(n * tokens, hidden), (groups * tokens, hidden), (groups * hidden,)]
    in_specs = (x_spec, group_spec, group_spec)[:n_inputs]
    avals = [abstract(mesh, spec, shape, dtype) for spec, shape in zip(in_specs, shapes)]
    return jit_shard_map(body, mesh, in_specs, (group_spec,) * n_outputs).trace(*avals)


def trace_fused(ws, tokens, hidden, dtype=None, *, mesh=None, pattern=AR_NORM, n_in=None, **kwargs):
    """Traces allreduce_fusion on [tokens, hidden] shards (residual and gamma per group, unless
    ``n_in`` says how many of x, residual, gamma to pass)."""
    mesh = ws.mesh if mesh is None else mesh
    n_in, n_out = (n_in or 1, 1) if pattern == AR else (n_in or 3, 2)
    body = fused_body(ws, pattern, **kwargs)
    dtype = ws.dtype.name if dtype is None else dtype
    return trace_sharded(body, mesh, tokens, hidden, dtype, n_inputs=n_in, n_outputs=n_out)


def cuda_text(ws, tokens, hidden, **kwargs) -> str:
    return trace_fused(ws, tokens, hidden, **kwargs).lower(lowering_platforms=("cuda",)).as_text()


def run_and_check_groups(ws, tokens, hidden, what, **kwargs):
    """Runs patterns 1 and 0 on ws.mesh over data that differs per TP group; checks each group
    against its own members' data: allreduce_out and residual_out bit for bit where the kernel
    rounds (kernel_rounding; so ``fallback="kernel_exact"`` unless ``kwargs`` say otherwise),
    all three against the float64 oracle (with fp32_acc; without it the error grows per rank).
    Also checks which fields each pattern left None, and that the groups' sums differ."""
    kwargs.setdefault("fallback", "kernel_exact")
    mesh, dtype, fp32_acc = ws.mesh, ws.dtype.name, kwargs.get("fp32_acc", True)
    # fp32 sums in fp32 either way, in an unspecified order: only exact sums compare.
    one_rounding = fp32_acc or dtype == "float32"
    world = mesh.shape["tp"]
    groups = mesh.devices.size // world
    rng = new_rng()
    # Full-precision 16-bit partials without fp32_acc, so that the order of the roundings shows.
    draw = random_partials if one_rounding else random_values
    xs = draw(rng, (groups, world, tokens, hidden), dtype)
    residual = random_values(rng, (groups, tokens, hidden), dtype)
    gamma = random_gamma(rng, hidden, dtype, leading=(groups,))
    seen = {}
    body1, body0 = (fused_body(ws, p, seen=seen, **kwargs) for p in (AR_NORM, AR))
    x_spec, g_spec = specs(mesh)
    args = (xs.reshape(-1, hidden), residual.reshape(-1, hidden), gamma.reshape(-1))
    body = lambda x, r, g: (*body1(x, r, g), *body0(x))
    outs = run_sharded(body, mesh, (x_spec, g_spec, g_spec), (g_spec,) * 3, *args)
    res_out, norm_out, ar_out = (np.asarray(o).reshape(groups, tokens, hidden) for o in outs)
    options = {k: kwargs[k] for k in ("weight_bias", "rms_eps") if k in kwargs}
    for g in range(groups):
        where = f"{what}: TP group {g} (devices {ws.groups[g].members})"
        s, r = kernel_rounding(xs[g], residual[g], dtype, fp32_acc=fp32_acc)
        assert np.array_equal(bits(ar_out[g]), bits(s)), f"{where}: allreduce_out"
        assert np.array_equal(bits(res_out[g]), bits(r)), f"{where}: residual_out"
        if one_rounding:
            outs = dict(allreduce_out=ar_out[g], residual_out=res_out[g], norm_out=norm_out[g])
            kw = dict(residual=residual[g], gamma=gamma[g], what=where, **outs, **options)
            check_outputs(dtype, xs[g], **kw)
    none = ("quant_out", "scale_out")
    assert seen == {1: ("allreduce_out", *none), 0: ("residual_out", "norm_out", *none)}
    if groups > 1:  # the groups really saw different data
        assert not np.array_equal(ar_out[0], ar_out[1])


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("weight_bias", [0.0, 1.0])
def test_each_tp_group_reduces_its_own_members(mesh_name, dtype, weight_bias):
    kw = dict(weight_bias=weight_bias, rms_eps=1e-5)
    run_and_check_groups(xla_workspace(mesh_of(mesh_name), dtype), 7, 256, mesh_name, **kw)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_per_rank_residual_and_gamma_make_outputs_vary(dtype):
    """The VMA rule: the sum is invariant over "tp", but a per-rank residual makes residual_out
    and norm_out per-rank, and a per-rank gamma makes norm_out (only) per-rank."""
    mesh, tokens, hidden = mesh_of("tp8"), 5, 256
    body = fused_body(xla_workspace(mesh, dtype), weight_bias=1.0)
    rng = new_rng()
    xs = random_partials(rng, (8, tokens, hidden), dtype)
    residuals = random_values(rng, (8, tokens, hidden), dtype)
    gammas = random_gamma(rng, hidden, dtype, leading=(8,))
    # The output that a per-rank residual (gamma) makes per-rank: residual_out (norm_out).
    for varying, index in [("residual", 0), ("gamma", 1)]:
        r, r_spec = (residuals.reshape(-1, hidden), P("tp")) if index == 0 else (residuals[0], P())
        g, g_spec = (gammas.reshape(-1), P("tp")) if index == 1 else (gammas[0], P())
        in_specs, args = (P("tp"), r_spec, g_spec), (xs.reshape(-1, hidden), r, g)
        out_specs = (r_spec, P("tp"))
        res_out, norm_out = run_sharded(body, mesh, in_specs, out_specs, *args)
        # A replicated residual_out is every rank's.
        res_out = np.broadcast_to(np.asarray(res_out).reshape(-1, tokens, hidden), xs.shape)
        norm_out = np.asarray(norm_out).reshape(xs.shape)
        for rank in range(8):
            ri, gi = (rank, 0) if index == 0 else (0, rank)
            kw = dict(residual=residuals[ri], gamma=gammas[gi], weight_bias=1.0)
            outs = dict(residual_out=res_out[rank], norm_out=norm_out[rank])
            check_outputs(dtype, xs, what=f"per-rank {varying}, rank {rank}", **kw, **outs)
        if index == 0:
            assert not np.array_equal(res_out[0], res_out[1])
        # What varies cannot be declared replicated: residual_out with a per-rank residual,
        # norm_out with a per-rank gamma. Newer JAX writes the spec as P(), 0.8 as
        # PartitionSpec().
        wrong = tuple(P() if i == index else s for i, s in enumerate(out_specs))
        match = rf"out_specs\[{index}\] is (P|PartitionSpec)\(\) which implies .* could not infer"
        avals = (abstract(mesh, s, a.shape, dtype) for s, a in zip(in_specs, args))
        with pytest.raises(ValueError, match=match + " replication"):
            jit_shard_map(body, mesh, in_specs, wrong).trace(*avals)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_without_fp32_acc_ranks_add_in_tp_order(dtype):
    """fp32_acc=False rounds after every addition, ranks in TP order (their position on the
    mesh's "tp" axis, not their device ids: the mesh is built from shuffled devices)."""
    ws = xla_workspace(make_mesh((2, 4), ("dp", "tp"), device_ids=SHUFFLED), dtype)
    run_and_check_groups(ws, 16, 256, "fp32_acc=False", fp32_acc=False, weight_bias=1.0)


_CALL = re.compile(
    r"stablehlo\.custom_call @(\w+)\(([^)]*)\) \{(.*)\} : \(([^)]*)\) -> (.*)$", re.MULTILINE
)
_ALIAS = re.compile(r"output_tuple_indices = \[(\d*)\], operand_index = (\d+)")


def _attr(text):
    value, _, mlir_type = text.strip().partition(" : ")
    if value in ("true", "false"):
        return value == "true"
    return float(value) if mlir_type.startswith("f") else int(value)


def custom_calls(text):
    """Every stablehlo.custom_call of a lowered module, parsed."""
    split = lambda text: [t.strip() for t in text.split(",")]
    calls = []
    for target, operands, attrs, operand_types, result_types in _CALL.findall(text):
        config = re.search(r"mhlo\.backend_config = \{([^{}]*)\}", attrs).group(1)
        call = dict(target=target, operands=split(operands), operand_types=split(operand_types))
        call.update(
            result_types=split(result_types.strip("()")),
            attrs={k: _attr(v) for k, v in re.findall(r"(\w+) = ([^,]+)", config)},
            aliases=[(int(o or -1), int(i)) for o, i in _ALIAS.findall(attrs)],
        )
        calls.append(call)
    return calls


def only_fused_call(text):
    calls = [c for c in custom_calls(text) if c["target"] == FFI_TARGET]
    assert len(calls) == 1, text
    return calls[0]


def trtllm_workspace(mesh_name="tp8", dtype="bfloat16", *, max_token_num=64, hidden_dim=1024):
    kw = dict(max_token_num=max_token_num, hidden_dim=hidden_dim, dtype=jdtype(dtype))
    return jf.abstract_workspace(mesh_of(mesh_name), "tp", backend="trtllm", **kw)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("mesh_name", ["tp8", "dp2_tp4"])
def test_cuda_lowering_of_residual_rmsnorm(dtype, mesh_name):
    ws = trtllm_workspace(mesh_name, dtype)
    call = only_fused_call(cuda_text(ws, 3, 1024, rms_eps=1e-5, weight_bias=1.0))
    t = MLIR_TYPES[dtype]
    assert len(call["operands"]) == 3  # x, residual, gamma
    assert call["operand_types"] == [f"tensor<3x1024x{t}>"] * 2 + [f"tensor<1024x{t}>"]
    assert call["result_types"] == [f"tensor<3x1024x{t}>"] * 2  # residual_out, norm_out
    eps = pytest.approx(float(np.float32(1e-5)), rel=1e-7)
    want = dict(workspace_id=ws.id, pattern=1, algorithm=1, fp32_acc=True, rms_eps=eps)
    assert call["attrs"] == dict(want, weight_bias=1.0, layout=0, block_quant_group_size=0)
    assert call["aliases"] == [(0, 1)]  # residual_out is written in place of residual_in
    for acc in (False, True):  # fp32_acc is passed as given
        assert only_fused_call(cuda_text(ws, 3, 1024, fp32_acc=acc))["attrs"]["fp32_acc"] is acc


def test_cuda_lowering_of_plain_allreduce_and_refusal_of_another_device_order():
    ws = trtllm_workspace()
    text = cuda_text(ws, 2, 1024, pattern=AR)
    call = only_fused_call(text)
    assert call["operand_types"] == call["result_types"] == ["tensor<2x1024xbf16>"]
    assert call["attrs"]["pattern"] == 0 and call["attrs"]["workspace_id"] == ws.id
    assert call["aliases"] == [] and "output_operand_alias" not in text
    assert "all_reduce" not in text  # the kernel does the reduction
    reversed_mesh = make_mesh((8,), ("tp",), device_ids=range(7, -1, -1))
    match = r"groups the devices along 'tp' as \[\(7, 6, 5, 4, 3, 2, 1, 0\)\] but the workspace "
    match += r"was created for the groups \[\(0, 1, 2, 3, 4, 5, 6, 7\)\]"
    with pytest.raises(ValueError, match=match):
        cuda_text(ws, 3, 1024, mesh=reversed_mesh)


@pytest.mark.parametrize(
    "mesh_name,tokens,kwargs,algorithm",
    [
        ("tp8", 1, {}, 1),  # small: one-shot
        ("tp8", 16, {"use_oneshot": False}, 0),  # forced two-shot, 16 tokens > 8 ranks
        ("tp8", 16, {"use_oneshot": True}, 1),
        ("tp8", 2048, {}, 0),  # 2048*1024*2*8*2 bytes = 64 MiB > 42 MiB: two-shot
        ("dp4_tp2", 2048, {}, 1),  # the same call at world size 2 (limit 512 MiB): one-shot
        # 48 MiB per rank at world size 2: the large-message algorithm
        # (launch_mode.LARGE_MESSAGE_MIN_MIB)
        ("dp4_tp2", 24576, {}, 2),
        ("dp4_tp2", 24575, {}, 1),
        ("dp4_tp2", 24576, {"use_oneshot": False}, 0),  # forced: FlashInfer's two-shot kernel
        ("tp8", 24576, {}, 0),  # not measured at world size 8: FlashInfer's choice
    ],
)
def test_cuda_lowering_algorithm_choice(mesh_name, tokens, kwargs, algorithm):
    ws = trtllm_workspace(mesh_name, max_token_num=max(2048, tokens))
    call = only_fused_call(cuda_text(ws, tokens, 1024, **kwargs))
    assert call["attrs"]["algorithm"] == algorithm


@pytest.mark.parametrize("mesh_name", ["tp8", "dp2_tp4"])
def test_cpu_lowering_of_a_trtllm_workspace_uses_the_reference(mesh_name):
    ws = trtllm_workspace(mesh_name, max_token_num=8, hidden_dim=256)
    text = trace_fused(ws, 4, 256, weight_bias=1.0).lower().as_text()
    assert "custom_call" not in text and "all_reduce" in text
    # ... and it runs, with the reference's results.
    run_and_check_groups(ws, 4, 256, "trtllm workspace on cpu", weight_bias=1.0)


def test_cuda_lowering_of_a_call_exceeding_the_workspace():
    ws = trtllm_workspace(max_token_num=4, hidden_dim=1024)
    text = cuda_text(ws, 5, 1024, strict=False)
    assert "custom_call" not in text and "all_reduce" in text
    with pytest.raises(ValueError, match=r"cannot use the fused kernel: 5x1024 tokens exceed"):
        cuda_text(ws, 5, 1024, strict=True)
    # Fewer tokens of a larger hidden size fit: the rule counts elements.
    only_fused_call(cuda_text(ws, 2, 2048, strict=True))


GAMMA_MUST = (
    r"rms_gamma must have shape \(256,\) and dtype bfloat16 \(or float32, rounded to it\), "
)
RESIDUAL_MUST = r"residual must have shape \(4, 256\) and dtype bfloat16, "


@pytest.mark.parametrize(
    "residual,gamma,match",
    [
        (((4, 256), "bfloat16"), ((128,), "bfloat16"), GAMMA_MUST + r"got \(128,\) bfloat16"),
        (((4, 256), "bfloat16"), ((256,), "float16"), GAMMA_MUST + r"got \(256,\) float16"),
        (((4, 256), "bfloat16"), ((128,), "float32"), GAMMA_MUST + r"got \(128,\) float32"),
        (((4, 128), "bfloat16"), ((256,), "bfloat16"), RESIDUAL_MUST + r"got \(4, 128\) bfloat16"),
        (((4, 256), "float16"), ((256,), "bfloat16"), RESIDUAL_MUST + r"got \(4, 256\) float16"),
        (((4, 256), "bfloat16"), None, r"needs rms_gamma of shape \(256,\)"),
    ],
)
def test_residual_and_gamma_checks(residual, gamma, match):
    ws = xla8()

    def body(x, res, g):  # cut and cast the well-formed operands into the case's ones
        (r_rows, r_cols), r_dtype = residual
        r = res.astype(r_dtype)[:r_rows, :r_cols]
        g = None if gamma is None else g.astype(gamma[1])[: gamma[0][0]]
        return jf.allreduce_fusion(x, axis_name="tp", workspace=ws, residual=r, rms_gamma=g)[1]

    with pytest.raises(ValueError, match=match):
        trace_sharded(body, ws.mesh, 4, 256)


FP8 = Pattern.kARResidualRMSNormFP8Quant
GROUP_FP8 = Pattern.kARResidualRMSNormPerTokenGroupFP8PackedQuant
G = "block_quant_group_size"
SF, SF40 = {"scale_factor": np.ones(1, np.float32)}, {"scale_factor": np.full(1, 40.0, np.float32)}
LINEAR = jf.QuantizationSFLayout.LINEAR
STATIC_ONLY = "scale_factor applies to static FP8 and NVFP4"
# Quantization arguments given to pattern 1 are refused naming the pattern.
NOT_FOR_1 = ".*kARResidualRMSNorm"
POW2, NVFP4_16 = "power of two from 8 to 256", "NVFP4 patterns need bfloat16 or float16"
TWO_SHOT = "use_oneshot=False is not possible: two-shot needs more tokens than ranks, got {} tokens"


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"pattern": FP8}, "scale_factor is required"),
        ({"pattern": FP8, "scale_factor": 0.5}, "not a Python constant"),
        ({"pattern": FP8, "scale_factor": np.ones(1, np.float16)}, "dtype float32"),
        ({"pattern": FP8, "scale_factor": np.ones(2, np.float32)}, r"shape \(\) or \(1,\)"),
        (
            {"pattern": Pattern.kARResidualRMSNormOutFP4Quant, **SF, "layout_code": 1},
            "SWIZZLED_8x4",
        ),
        ({"pattern": GROUP_FP8}, "needs block_quant_group_size"),
        ({"pattern": GROUP_FP8, G: 96}, "divisible by group_size"),
        ({"pattern": Pattern.kARResidualRMSNormDynamicFP8Quant, **SF}, STATIC_ONLY),
        (SF, STATIC_ONLY + NOT_FOR_1),
        ({"layout_code": 0}, "layout_code applies to NVFP4 patterns only" + NOT_FOR_1),
        ({G: 64}, "block_quant_group_size applies to per-token-group" + NOT_FOR_1),
        # 48 divides 768 but is no power of two; 512 is above 32 vectors of 8 bf16 elements.
        ({"ws_hidden": 1024, "hidden": 768, "pattern": GROUP_FP8, G: 48}, POW2),
        ({"ws_hidden": 1024, "hidden": 1024, "pattern": GROUP_FP8, G: 512}, POW2),
        ({"ws": "float32", "pattern": Pattern.kARResidualRMSNormFP4Quant, **SF}, NVFP4_16),
        ({"tokens": 1, "use_oneshot": False}, TWO_SHOT.format(1) + " for 8"),
        ({"tokens": 8, "use_oneshot": False}, TWO_SHOT.format(8) + " for 8"),
        ({"tokens": 9, "use_oneshot": False}, None),
        ({"hidden": 100}, "hidden size 100 is not a multiple of 8"),
        ({"ws": "float32", "hidden": 6}, "hidden size 6 is not a multiple of 4"),
        ({"dtype": "float16"}, "x has dtype float16 but the workspace was created for bfloat16"),
        ({"dtype": "int32", "pattern": AR}, "x has dtype int32; supported"),
        # pattern codes
        ({"pattern": AR, "n_in": 2}, "kAllReduce takes no residual or rms_gamma"),
        (
            {"pattern": 6, "n_in": 1},
            r"pattern 6 \(kMoEReductionARResidualRMSNorm\) has its own inputs",
        ),
        ({"pattern": 12, "n_in": 1}, r"unknown fusion pattern 12; valid codes: 0 \(kAllReduce\)"),
        ({"pattern": 99, "n_in": 1}, "unknown fusion pattern 99"),
        ({"pattern": "bogus", "n_in": 1}, "unknown fusion pattern 'bogus'"),
    ],
)
def test_call_arguments(kwargs, match):
    """Refused at trace time naming what is wrong (``match``), or accepted (None): tp8,
    [4, 256] bfloat16 unless ws/ws_hidden (the workspace) or tokens/hidden/dtype say."""
    kw = dict(kwargs)
    ws = xla8(kw.pop("ws", "bfloat16"), hidden_dim=kw.pop("ws_hidden", 256))
    args = (ws, kw.pop("tokens", 4), kw.pop("hidden", 256), kw.pop("dtype", None))
    with pytest.raises(ValueError, match=match) if match else contextlib.nullcontext():
        trace_fused(*args, **kw)


def test_not_a_workspace_or_not_an_array_or_outside_shard_map():
    with pytest.raises(TypeError, match="workspace must come from"):
        trace_sharded(plain_allreduce(object()), mesh_of("tp8"), 4, 256, n_inputs=1)
    # [..., hidden] inputs of any rank >= 1 are served (tests/jax/test_batching.py).
    ws = xla8()
    x = abstract(ws.mesh, P(), (), "bfloat16")
    match = r"x must be \[\.\.\., hidden\] \(at least 1-D\), got shape \(\)"
    with pytest.raises(ValueError, match=match):
        jit_shard_map(fused_body(ws, AR), ws.mesh, P(), P()).trace(x)
    x = jnp.asarray(random_values(new_rng(), (4, 256), "bfloat16"))
    match = "must be called inside jax.shard_map over an axis named 'tp'"
    for f in (plain_allreduce(ws), jax.jit(plain_allreduce(ws))):
        with pytest.raises(ValueError, match=match):
            f(x)


def test_too_many_tokens_in_strict_mode(monkeypatch):
    ws = xla8(max_token_num=8, hidden_dim=256)
    match = r"cannot use the fused kernel: 9x256 tokens exceed the workspace.*strict mode"
    with pytest.raises(ValueError, match=match):
        trace_fused(ws, 9, 256, strict=True)
    monkeypatch.setenv(backend_choice.STRICT_ENV_VAR, "1")
    with pytest.raises(ValueError, match=match):
        trace_fused(ws, 9, 256)
    trace_fused(ws, 9, 256, strict=False)  # the explicit argument wins over the variable
    trace_fused(ws, 16, 128)  # same element count as 8 x 256: fits


def test_workspace_creation_and_axis_errors():
    sizes = ", ".join(map(str, SUPPORTED_WORLD_SIZES))
    for shape, names in [
        ((3,), ("tp",)),
        ((6,), ("tp",)),
        ((2, 3), ("dp", "tp")),
        ((3, 2), ("tp", "dp")),
    ]:
        mesh = make_mesh(shape, names)
        match = f"world size {mesh.shape['tp']} is not supported"
        with pytest.raises(ValueError, match=f"{match}.*{sizes}"):
            jf.create_allreduce_fusion_workspace(mesh, "tp", **BF16_KW)
        with pytest.raises(ValueError, match=match):
            jf.abstract_workspace(mesh, "tp", **BF16_KW)
    mesh = mesh_of("dp2_tp4")
    ws = xla_workspace(mesh)
    with pytest.raises(ValueError, match="created for axis 'tp', not 'dp'"):
        trace_sharded(plain_allreduce(ws, "dp"), mesh, 4, 256, n_inputs=1)
    # A "tp" axis of another size: the workspace (world size 4) used on an 8-device mesh.
    match = "axis 'tp' has size 8 but the workspace was created for world size 4"
    with pytest.raises(ValueError, match=match):
        trace_fused(ws, 4, 256, mesh=mesh_of("tp8"))
    with pytest.raises(ValueError, match="axis 'nope' is not an axis of the mesh"):
        jf.create_allreduce_fusion_workspace(mesh, "nope", **BF16_KW)
    with pytest.raises(ValueError, match="not an axis of the mesh"):
        jf.abstract_workspace(mesh_of("tp8"), "nope", **BF16_KW)
    with pytest.raises(ValueError, match="hidden_dim=100 is not supported for bfloat16"):
        xla8(hidden_dim=100)


def test_backend_choices(monkeypatch):
    mesh = mesh_of("tp8")
    create = lambda **more: jf.create_allreduce_fusion_workspace(mesh, "tp", **BF16_KW, **more)
    abstract_ws = lambda **more: jf.abstract_workspace(mesh, "tp", **BF16_KW, **more)
    no_mnnvl = "'mnnvl' all-reduce backend needs NVLink multicast"
    with pytest.raises(ValueError, match=no_mnnvl):
        create(backend="mnnvl")
    with pytest.raises(ValueError, match="backend must be 'auto', 'trtllm' or 'xla', not 'mnnvl'"):
        abstract_ws(backend="mnnvl")
    # abstract_workspace decides as on CUDA GPUs: auto is the kernel within one host.
    assert abstract_ws(backend="auto").backend == "trtllm"
    no_gpu = "'trtllm' all-reduce backend needs a CUDA GPU, but the platform is 'cpu'"
    with pytest.raises(ValueError, match=no_gpu):
        create(backend="trtllm")
    monkeypatch.setenv(backend_choice.BACKEND_ENV_VAR, "bogus")
    match = r"unknown all-reduce backend 'bogus' \(from the \$JAX_FUSEDAR_ALLREDUCE_BACKEND\)"
    with pytest.raises(ValueError, match=match):
        create()
    # An explicit backend wins over the variable.
    assert create(backend="xla").backend == "xla"
    monkeypatch.setenv(backend_choice.BACKEND_ENV_VAR, "xla")
    assert abstract_ws(backend="auto").backend == "xla"
    monkeypatch.setenv(backend_choice.BACKEND_ENV_VAR, "mnnvl")
    with pytest.raises(ValueError, match=no_mnnvl):
        create()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fallback_logs_once_per_kind_and_stays_correct(dtype, caplog):
    """A kernel workspace (traced here, where it runs the reference) logs a fallback once per
    kind of reason, not per shape; an xla workspace, which never uses the kernel, never
    logs one."""
    caplog.set_level(logging.WARNING, logger="jax_fusedar")
    mesh = mesh_of("dp2_tp4")
    kw = dict(max_token_num=4, hidden_dim=256, dtype=jdtype(dtype))
    ws = jf.abstract_workspace(mesh, "tp", backend="trtllm", **kw)
    # Too-large calls of two shapes (patterns 1 and 0 each), strict off explicitly or by default.
    for call, (strict, tokens) in enumerate([(False, 6), (None, 6), (False, 7)]):
        run_and_check_groups(ws, tokens, 256, f"fallback call {call}", strict=strict)
    warnings = fusedar_warnings(caplog)
    assert len(warnings) == 1, warnings
    want = r"falling back to psum \+ RMSNorm: 6x256 tokens exceed the workspace "
    assert re.search(want + r"\(max_token_num=4 x hidden 256\); every row", warnings[0])
    assert "logged once per kind of reason" in warnings[0]
    caplog.clear()
    run_and_check_groups(xla_workspace(mesh, dtype, max_token_num=4), 6, 256, "xla backend")
    assert not fusedar_warnings(caplog)


def test_is_buffer_size_sufficient():
    ws = xla8(max_token_num=64, hidden_dim=256)
    assert ws.is_buffer_size_sufficient(64, 256)
    assert not ws.is_buffer_size_sufficient(65, 256)
    # An element count: other shapes with no more elements fit.
    assert ws.is_buffer_size_sufficient(128, 128) and ws.is_buffer_size_sufficient(16, 1024)
    assert not ws.is_buffer_size_sufficient(129, 128)
    assert not ws.is_buffer_size_sufficient(17, 1024)
    # The workspace's own dtype only, as allreduce_fusion accepts (fp16 on a bf16 workspace
    # is refused by the call, so it does not fit here either); unsupported dtypes never fit.
    assert not ws.is_buffer_size_sufficient(64, 256, jnp.float16)
    assert ws.is_buffer_size_sufficient(64, 256, "bfloat16")
    for dtype in (jnp.float32, np.int32, np.float64, np.int8):
        assert not ws.is_buffer_size_sufficient(1, 256, dtype), dtype
    ws32 = xla8("float32", max_token_num=64, hidden_dim=256)
    assert ws32.is_buffer_size_sufficient(64, 256, np.float32)
    assert not ws32.is_buffer_size_sufficient(1, 256, jnp.bfloat16)
    assert not ws32.is_buffer_size_sufficient(1, 256, np.float16)
    assert not ws32.is_buffer_size_sufficient(65, 256, np.float32)


def test_context_manager_and_destroy():
    ws = xla8()
    trace_fused(ws, 4, 256)
    ws.destroy()  # a destroyed workspace is refused by the call
    match = r"AllReduceFusionWorkspace\(id=\d+.*destroyed\) was destroyed"
    with pytest.raises(ValueError, match=match):
        trace_fused(ws, 4, 256)
    with xla8() as ws:
        assert not ws.destroyed
        assert "backend='xla'" in repr(ws) and "destroyed" not in repr(ws)
    assert ws.destroyed and repr(ws).endswith(", destroyed)")
    ws.destroy()  # idempotent
    assert ws.destroyed
    with pytest.raises(RuntimeError, match="boom"):
        with xla8() as ws2:
            raise RuntimeError("boom")
    assert ws2.destroyed
    abstract = trtllm_workspace()
    assert "backend='trtllm'" in repr(abstract) and "world_size=8" in repr(abstract)
    # Each rank's device memory (what a kernel workspace allocates on every GPU), by the
    # sizing rule torch_compat's workspace shows too; XLA's collectives allocate none.
    want = jf.workspace_bytes(8, abstract.max_token_num, abstract.hidden_dim, abstract.dtype)
    assert abstract.bytes_per_rank == want > 0
    assert f"bytes_per_rank={want} (" in repr(abstract)
    assert "bytes_per_rank=0" in repr(xla8())


def test_workspace_metadata_and_groups():
    ws = xla_workspace(mesh_of("dp2_tp4"), "float16", max_token_num=32, hidden_dim=512)
    assert (ws.world_size, ws.axis_name, ws.max_token_num, ws.hidden_dim) == (4, "tp", 32, 512)
    assert ws.dtype == np.dtype(jnp.float16)
    assert ws.groups == [TPGroup((0, 1, 2, 3), 0), TPGroup((4, 5, 6, 7), 1)]
    assert "groups=2" in repr(ws)
    assert xla8().serial > ws.serial  # serials are never reused
    # Groups follow the tp axis and the mesh's device order, not the device ids.
    ws = xla_workspace(make_mesh((2, 4), ("dp", "tp"), device_ids=SHUFFLED))
    assert [g.members for g in ws.groups] == [(5, 2, 7, 0), (3, 6, 1, 4)]
    ws = xla_workspace(make_mesh((4, 2), ("tp", "dp"), device_ids=SHUFFLED))
    assert [g.members for g in ws.groups] == [(5, 7, 3, 1), (2, 0, 6, 4)]
    assert [g.index for g in ws.groups] == [0, 1] and ws.world_size == 4


def test_reference_without_fp32_acc_is_invariant_over_the_axis():
    """The rank-ordered sum (fp32_acc=False) called directly under check_vma=True: its
    outputs are invariant over "tp", so out_specs=P() is accepted."""
    from jax_fusedar.ops import reference

    xs = random_partials(new_rng(), (8, 4, 256), "bfloat16")
    body = lambda x: reference.allreduce_sum(x, "tp", fp32_acc=False)
    out = run_sharded(body, mesh_of("tp8"), (P("tp"),), P(), xs.reshape(32, 256))
    zeros = np.zeros((4, 256), jdtype("bfloat16"))
    want, _ = kernel_rounding(xs, zeros, "bfloat16", fp32_acc=False)
    np.testing.assert_array_equal(bits(out), bits(want))


@pytest.mark.slow
@pytest.mark.parametrize(
    "pattern,kwargs",
    [
        (Pattern.kARResidualRMSNormOutFP8Quant, {"scale_factor": np.full(1, 0.02, np.float32)}),
        (Pattern.kARResidualRMSNormOutDynamicFP8Quant, {}),
        (Pattern.kARResidualRMSNormOutPerTokenGroupFP8PackedQuant, {G: 64}),
        (Pattern.kARResidualRMSNormOutFP4Quant, {**SF40, "layout_code": LINEAR}),
    ],
)
def test_quantized_outputs_are_the_quantized_norm(pattern, kwargs):
    """Through the public API on CPU: quant_out/scale_out equal the reference quantization of
    the op's own norm_out, bit for bit, with the documented shapes and dtypes."""
    from jax_fusedar.ops import quant_reference

    mesh, rng = mesh_of("dp2_tp4"), new_rng()
    ws = xla_workspace(mesh)
    xs, res = (random_values(rng, (n * 5, 256), "bfloat16") for n in (8, 2))  # 5 tokens
    gam = random_gamma(rng, 256, "bfloat16", leading=(2,)).reshape(2 * 256)
    sf = kwargs.get("scale_factor")
    with_sf = () if sf is None else (sf,)

    def body(x, r, g, *s):
        o = pattern_call(ws, pattern, x, r, g, dict(kwargs, scale_factor=s[0] if s else None))
        return o.norm_out, o.quant_out, o.scale_out

    in_specs = (P(("dp", "tp")), P("dp"), P("dp")) + (P(),) * len(with_sf)
    norm, quant, scale = run_sharded(body, mesh, in_specs, (P("dp"),) * 3, xs, res, gam, *with_sf)
    norm, quant = (np.split(np.asarray(a), 2) for a in (norm, quant))  # each dp group's rows
    for grp in range(2):
        kw = dict(scale_factor=None if sf is None else jnp.asarray(sf), group_size=kwargs.get(G))
        want_q, want_s = quant_reference.quantize_for_pattern(
            jnp.asarray(norm[grp]), pattern, layout=kwargs.get("layout_code", 0), **kw
        )
        np.testing.assert_array_equal(bits(quant[grp]), bits(want_q))
        assert quant[grp].dtype == np.asarray(want_q).dtype
        if want_s is not None:
            np.testing.assert_array_equal(bits(np.split(np.asarray(scale), 2)[grp]), bits(want_s))
