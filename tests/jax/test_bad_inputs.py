"""Misuse of the JAX API is a clear, early error naming what is wrong (regrouped meshes and
pmap, coerced options, boolean environment variables, argument names); zero tokens, the fp32
sum-of-squares overflow, a workspace as a jit argument. 8 virtual host devices."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_fusedar as jf
from tests.jax.cpu_helpers import DTYPES, jdtype, jit_shard_map, make_mesh, new_rng, pattern_outputs
from tests.jax.cpu_helpers import random_gamma, random_values, require_host_devices, run_sharded
from tests.jax.cpu_helpers import tp_mesh, xla_workspace
from jax_fusedar.common import arguments, backend_choice, handshake
from jax_fusedar.ops import reference
from jax_fusedar.ops.dense import FFI_TARGET
from tests.jax.test_api import abstract, custom_calls, fused_body, plain_allreduce, trace_fused
from tests.jax.test_api import trace_sharded

require_host_devices()

Q = jf.AllReduceFusionPattern


# Environment and once-per-kind logging reset per test (conftest.py); ./dev oldest runs it too.
pytestmark = [pytest.mark.usefixtures("hermetic"), pytest.mark.oldest]


KW = dict(max_token_num=64, hidden_dim=256, dtype=jnp.bfloat16)
SF = {"scale_factor": np.ones(1, np.float32)}
FP4 = dict(pattern=Q.kARResidualRMSNormOutFP4Quant, **SF)
GROUP_FP8 = dict(pattern=Q.kARResidualRMSNormOutPerTokenGroupFP8PackedQuant)
GROUP_INT = "block_quant_group_size must be an int"
PATTERN_MUST = "pattern must be an AllReduceFusionPattern or its int code, not a float"
ONESHOT_MUST = "use_oneshot must be True, False or None, got "
STRICT_MUST = r"strict \(None: \$JAX_FUSEDAR_STRICT\) must be True or False"
NUMPY_OPTIONS = dict(use_oneshot=np.bool_(True), fp32_acc=np.bool_(False), strict=np.bool_(False))
NUMPY_OPTIONS.update(pattern=np.int64(1), rms_eps=np.float32(1e-5), weight_bias=np.int32(1))
CREATE, ABSTRACT = jf.create_allreduce_fusion_workspace, jf.abstract_workspace


DP_TP, TP_DP = jax.make_mesh((2, 4), ("dp", "tp")), jax.make_mesh((4, 2), ("tp", "dp"))
REGROUPED = (
    r"groups the devices along 'tp' as \[\(0, 2, 4, 6\), \(1, 3, 5, 7\)\] but the "
    r"workspace was created for the groups \[\(0, 1, 2, 3\), \(4, 5, 6, 7\)\]"
)
REGROUPED_SPECS = (P(("tp", "dp")), P("dp"), P("dp"))


def regrouped_trace(ws, mesh):
    """Traces a pattern-1 call on ``mesh`` (a ("tp", "dp") mesh) with [4, 256] shards."""
    shapes = [(8 * 4, 256), (2 * 4, 256), (2 * 256,)]
    avals = [abstract(mesh, sp, sh, "bfloat16") for sp, sh in zip(REGROUPED_SPECS, shapes)]
    return jit_shard_map(fused_body(ws), mesh, REGROUPED_SPECS, (P("dp"), P("dp"))).trace(*avals)


def test_regrouped_mesh_is_refused():
    """The same 8 devices, tp groups (0,2,4,6),(1,3,5,7) instead of the workspace's
    (0,1,2,3),(4,5,6,7): refused when lowered for CPU (and so when run), not only on GPUs."""
    ws = xla_workspace(DP_TP)
    assert [g.members for g in ws.groups] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    with pytest.raises(ValueError, match=REGROUPED):
        regrouped_trace(ws, TP_DP).lower()
    rng = new_rng()
    x, r = (random_values(rng, (rows, 256), "bfloat16") for rows in (32, 8))
    args = (x, r, random_gamma(rng, 512, "bfloat16"))
    with pytest.raises(ValueError, match=REGROUPED):
        run_sharded(fused_body(ws), TP_DP, REGROUPED_SPECS, (P("dp"),) * 2, *args)
    with jax.set_mesh(TP_DP):  # under set_mesh, refused at trace time
        with pytest.raises(ValueError, match=REGROUPED):
            regrouped_trace(ws, TP_DP)
    # For cuda no custom call; the kernel workspace's own mesh lowers to it.
    ws = jf.abstract_workspace(DP_TP, "tp", backend="trtllm", **KW)
    with pytest.raises(ValueError, match=REGROUPED):
        regrouped_trace(ws, TP_DP).lower(lowering_platforms=("cuda",))
    text = trace_fused(ws, 4, 256).lower(lowering_platforms=("cuda",)).as_text()
    assert [c["target"] for c in custom_calls(text)].count(FFI_TARGET) == 1


def test_same_groups_in_another_mesh_order_are_accepted():
    """dp rows swapped (or a submesh of one group): every device keeps its group and rank."""
    ws = xla_workspace(DP_TP)
    swapped = make_mesh((2, 4), ("dp", "tp"), device_ids=[4, 5, 6, 7, 0, 1, 2, 3])
    trace_fused(ws, 4, 256, mesh=swapped).lower()
    reversed_tp = make_mesh((2, 4), ("dp", "tp"), device_ids=[3, 2, 1, 0, 7, 6, 5, 4])
    with pytest.raises(ValueError, match=r"as \[\(3, 2, 1, 0\), \(7, 6, 5, 4\)\]"):
        trace_fused(ws, 4, 256, mesh=reversed_tp).lower()
    one_group = make_mesh((4,), ("tp",), device_ids=[4, 5, 6, 7])
    ws4 = jf.create_allreduce_fusion_workspace(make_mesh((2, 4), ("dp", "tp")), "tp", **KW)
    trace_fused(ws4, 4, 256, mesh=one_group).lower()


def pmapped(ws, devices):
    return jax.pmap(plain_allreduce(ws), axis_name="tp", devices=devices)


def test_pmap_is_checked_like_shard_map():
    d = jax.devices()
    x = jnp.asarray(random_values(new_rng(), (4, 2, 256), "bfloat16"))
    ws = xla_workspace(DP_TP)  # groups (0,1,2,3), (4,5,6,7)
    match = r"as \[\(0, 2, 4, 6\)\] but the workspace was created for the groups \[\(0, 1, 2, 3\), "
    with pytest.raises(ValueError, match=match):
        pmapped(ws, [d[0], d[2], d[4], d[6]])(x)
    # A workspace of those very devices serves the pmap, with psum's result.
    out = pmapped(xla_workspace(make_mesh((4,), ("tp",), device_ids=[0, 2, 4, 6])), d[0:8:2])(x)
    want = np.sum(np.asarray(x, np.float64), axis=0)
    np.testing.assert_allclose(np.asarray(out[0], np.float64), want, rtol=2**-8)
    pmapped(ws, d[4:8])(x)  # the second group of the dp x tp workspace, in its order
    # Lowered for cuda the same.
    kernel_ws = jf.abstract_workspace(DP_TP, "tp", backend="trtllm", **KW)
    xs = jax.ShapeDtypeStruct(x.shape, x.dtype)
    cuda = lambda f: jax.jit(f).trace(xs).lower(lowering_platforms=("cuda",)).as_text()
    with pytest.raises(ValueError, match=r"as \[\(0, 2, 4, 6\)\]"):
        cuda(pmapped(kernel_ws, [d[0], d[2], d[4], d[6]]))
    assert FFI_TARGET in cuda(pmapped(kernel_ws, d[:4]))


BF16, FP8 = ((0, 256), "bfloat16"), ((0, 256), "float8_e4m3fn")
NVFP4 = [((0, 128), "uint8"), ((0, 16), "float8_e4m3fn")]  # codes and scales
GROUP8 = Q.kARResidualRMSNormPerTokenGroupFP8PackedQuant


@pytest.mark.parametrize(
    "pattern,kwargs,shapes",
    [
        (Q.kARResidualRMSNorm, {}, [BF16, BF16]),
        (Q.kARResidualRMSNormFP8Quant, dict(SF), [BF16, FP8]),
        (Q.kARResidualRMSNormOutDynamicFP8Quant, {}, [BF16, BF16, FP8, ((0, 1), "float32")]),
        (GROUP8, {"block_quant_group_size": 64}, [BF16, FP8, ((1, 0), "int32")]),
        (Q.kARResidualRMSNormOutFP4Quant, dict(SF), [BF16, BF16, *NVFP4]),
        (Q.kARResidualRMSNormFP4Quant, {**SF, "layout_code": 2}, [BF16, *NVFP4]),
    ],
)
def test_zero_tokens_give_empty_outputs(pattern, kwargs, shapes):
    """0 tokens (the same on every rank) needs no exchange: no custom call, empty results."""
    mesh, ws = tp_mesh(), xla_workspace(tp_mesh())
    kwargs = dict(kwargs)
    sf = kwargs.pop("scale_factor", None)
    with_sf = () if sf is None else (sf,)
    body = lambda x, r, g, *s: pattern_outputs(
        ws, pattern, x, r, g, dict(kwargs, scale_factor=s[0] if s else None)
    )
    empty = np.zeros((0, 256), jdtype("bfloat16"))
    args = (empty, empty, random_gamma(new_rng(), 256, "bfloat16"), *with_sf)
    in_specs = (P("tp"), P(), P()) + (P(),) * len(with_sf)
    outs = run_sharded(body, mesh, in_specs, (P(),) * len(shapes), *args)
    assert [(o.shape, jnp.dtype(o.dtype).name) for o in outs] == shapes
    # No custom call for 0 tokens on a kernel workspace either (nothing to exchange).
    kws = jf.abstract_workspace(mesh, "tp", backend="trtllm", **KW)
    # scale_factor as a closed-over constant: lowering only, nothing runs.
    constant = {} if sf is None else {"scale_factor": jnp.asarray(sf)}
    body = fused_body(kws, pattern, **kwargs, **constant)
    text = trace_sharded(body, mesh, 0, 256, n_outputs=len(shapes))
    assert FFI_TARGET not in text.lower(lowering_platforms=("cuda",)).as_text()


def test_rms_of_huge_rows_is_zero_like_the_kernel():
    """|r| ~ 1e20 (bf16 holds it; its square does not fit fp32): the kernel sums squares in
    fp32, so mean = inf, rsqrt = 0 and norm_out = +-0 (sign of r), as documented in the
    docs/numerics.md. The reference path does exactly that; float64 would give O(1)."""
    mesh, rng = tp_mesh(), new_rng()
    big = rng.uniform(0.5, 1.0, (3, 256))
    big = (big * np.where(rng.random((3, 256)) < 0.5, -1, 1) * 1e20).astype(np.float32)
    small = random_values(rng, (1, 256), "bfloat16").astype(np.float32)
    rows = np.concatenate([big, small]).astype(jdtype("bfloat16"))
    xs = np.concatenate([rows] + [np.zeros_like(rows)] * 7)  # rank 0 holds the rows
    gamma = random_gamma(rng, 256, "bfloat16")
    args = (xs, np.zeros((4, 256), jdtype("bfloat16")), gamma)
    res, norm = run_sharded(
        fused_body(xla_workspace(mesh)), mesh, (P("tp"), P(), P()), (P(), P()), *args
    )
    norm = np.asarray(norm.astype(jnp.float32))
    assert np.array_equal(np.asarray(res.astype(jnp.float32)), rows.astype(np.float32))
    assert np.all(norm[:3] == 0.0)  # +-0 (the kernel's sign is checked on GPUs:
    # tests/gpu/test_jax_misuse.py; XLA may sign a CPU zero otherwise in another program)
    # The ordinary row next to them is normalised as usual.
    r32 = rows[3].astype(np.float64)
    want = r32 / np.sqrt(np.mean(r32**2) + 1e-6) * gamma.astype(np.float64)
    np.testing.assert_allclose(norm[3], want, rtol=2**-6, atol=2**-6)
    # The float64 oracle disagrees (the overflow is fp32's): documented, not hidden.
    f64 = rows[0].astype(np.float64)
    assert np.abs(f64 / np.sqrt(np.mean(f64**2))).max() > 0.1
    # reference.rms_norm itself: 2e19: squares 4e38 > fp32 max 3.4e38; 1e19: 64 squares of
    # 1e38 overflow only when summed.
    for value in (2e19, 1e19):
        r, ones = jnp.full((2, 64), value, jnp.bfloat16), jnp.ones((64,), jnp.bfloat16)
        out = reference.rms_norm(r, ones, rms_eps=1e-6, weight_bias=0.0, out_dtype=jnp.bfloat16)
        assert np.all(np.asarray(out.astype(jnp.float32)) == 0.0), value


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"pattern": 1.9}, ValueError, r"unknown fusion pattern 1\.9: " + PATTERN_MUST),
        ({"pattern": "1"}, ValueError, "unknown fusion pattern '1': pattern must be"),
        ({"pattern": True}, ValueError, "unknown fusion pattern True: pattern must be"),
        ({"pattern": np.float64(1)}, ValueError, "pattern must be"),
        ({"use_oneshot": "false"}, TypeError, ONESHOT_MUST + "'false'"),
        ({"use_oneshot": 0}, TypeError, ONESHOT_MUST + "0"),
        ({"fp32_acc": "no"}, TypeError, "fp32_acc must be True or False, got 'no'"),
        ({"fp32_acc": None}, TypeError, "fp32_acc must be True or False, got None"),
        ({"strict": "no"}, TypeError, STRICT_MUST + ", got 'no'"),
        ({"strict": 1}, TypeError, "strict .* must be True or False"),
        ({**FP4, "layout_code": 2.7}, ValueError, r"layout \(layout_code\) 2\.7"),
        ({**FP4, "layout_code": "2"}, ValueError, r"layout \(layout_code\) '2'"),
        ({**FP4, "layout_code": True}, ValueError, r"layout \(layout_code\) True"),
        ({**FP4, "layout_code": 3}, ValueError, r"layout \(layout_code\) 3"),
        ({**GROUP_FP8, "block_quant_group_size": 64.0}, TypeError, GROUP_INT),
        ({**GROUP_FP8, "block_quant_group_size": True}, TypeError, GROUP_INT),
        ({**GROUP_FP8, "block_quant_group_size": "64"}, TypeError, GROUP_INT),
        # Float options: the message names the option.
        ({"rms_eps": None}, TypeError, "rms_eps must be a real number, got None"),
        ({"rms_eps": "1e-6"}, TypeError, "rms_eps must be a real number, got '1e-6'"),
        ({"rms_eps": -1e-6}, ValueError, "rms_eps must be >= 0.0"),
        ({"rms_eps": float("nan")}, ValueError, "rms_eps must be finite"),
        ({"weight_bias": None}, TypeError, "weight_bias must be a real number, got None"),
        ({"weight_bias": 1j}, TypeError, r"weight_bias must be a real number, got 1j"),
        ({"weight_bias": float("inf")}, ValueError, "weight_bias must be finite"),
        # numpy bools and ints are real options
        (NUMPY_OPTIONS, None, None),
    ],
)
def test_coerced_options_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match) if error else contextlib.nullcontext():
        trace_fused(xla_workspace(tp_mesh()), 4, 256, **kwargs)


STRICT_RAISES = "cannot use the fused kernel.*strict mode"


@pytest.mark.parametrize("var", [backend_choice.STRICT_ENV_VAR, handshake.HANDSHAKE_ENV_VAR])
@pytest.mark.parametrize(
    "raw,value",
    [(w, True) for w in ("on", "ON", " yes ", "1")] + [(w, False) for w in ("off", "No", "0", "")],
)
def test_every_boolean_variable_reads_the_same_words(monkeypatch, var, raw, value):
    monkeypatch.setenv(var, raw)
    assert arguments.env_bool(var) is value
    if var == backend_choice.STRICT_ENV_VAR:
        assert backend_choice.strict_mode(None) is value
        # Strict from the environment: "on" (any true word) means on.
        ws = xla_workspace(tp_mesh(), max_token_num=8)
        with pytest.raises(ValueError, match=STRICT_RAISES) if value else contextlib.nullcontext():
            trace_fused(ws, 9, 256)
    else:
        assert handshake.resolve_handshake(None) is value


@pytest.mark.parametrize("var", [backend_choice.STRICT_ENV_VAR, handshake.HANDSHAKE_ENV_VAR])
def test_garbage_in_a_boolean_variable_is_an_error_naming_it(monkeypatch, var):
    monkeypatch.setenv(var, "garbage")
    match = rf"\${var}='garbage' is not a boolean: use 1/true/yes/on or 0/false/no/off"
    with pytest.raises(ValueError, match=match):
        arguments.env_bool(var)
    if var == backend_choice.STRICT_ENV_VAR:  # read at every call
        ws = xla_workspace(tp_mesh())
        with pytest.raises(ValueError, match=match):
            trace_fused(ws, 4, 256)
        trace_fused(ws, 4, 256, strict=False)  # an explicit argument wins
    else:  # read when a workspace is created
        with pytest.raises(ValueError, match=match):
            jf.create_allreduce_fusion_workspace(tp_mesh(), "tp", **KW)


def test_is_buffer_size_sufficient_agrees_with_what_a_call_accepts_and_refuses_nonsense():
    ws = xla_workspace(tp_mesh(), max_token_num=8, hidden_dim=256)
    shapes = [(0, 256), (8, 256), (16, 128), (9, 256), (4, 100)]
    for tokens, hidden, dtype in [(t, h, None) for t, h in shapes] + [(4, 256, d) for d in DTYPES]:
        answer = ws.is_buffer_size_sufficient(tokens, hidden, dtype)
        try:
            trace_fused(ws, tokens, hidden, dtype or "bfloat16", strict=True)
            accepted = True
        except ValueError:
            accepted = False
        assert answer == accepted, (tokens, hidden, dtype, answer)
    assert not ws.is_buffer_size_sufficient(4, 256, np.int8)
    nonsense = [
        (-1, 256, ValueError, "num_tokens must be >= 0, got -1"),
        (1.5, 256, TypeError, "num_tokens must be an int"),
        (True, 256, TypeError, "num_tokens must be an int"),
        (4, 0, ValueError, "hidden_dim must be >= 1"),
        (4, -256, ValueError, "hidden_dim must be >= 1"),
    ]
    for tokens, hidden, error, match in nonsense:
        with pytest.raises(error, match=match):
            ws.is_buffer_size_sufficient(tokens, hidden)


DTYPE_MUST = r"dtype must be bfloat16, float16 or float32 \(e.g. jnp.bfloat16\), got "
MESH_MUST = "mesh must be a jax.sharding.Mesh"
DT, MESHES = (None, "float64", np.int8, "nope"), (None, "devices", "abstract")


@pytest.mark.parametrize(
    "make,kwargs,error,match",
    [
        *[
            (CREATE, {"max_token_num": 8, "dtype": d}, ValueError, DTYPE_MUST + f"{d!r}")
            for d in DT
        ],
        *[(make, {"mesh": m}, TypeError, MESH_MUST) for m in MESHES for make in (CREATE, ABSTRACT)],
        (CREATE, {"exchange_timeout_s": None}, TypeError, "exchange_timeout_s must be"),
        (CREATE, {"exchange_timeout_s": 0}, ValueError, "exchange_timeout_s must be"),
        (CREATE, {"exchange_timeout_s": -1.0}, ValueError, "exchange_timeout_s must be"),
    ],
)
def test_workspace_arguments_are_named(make, kwargs, error, match):
    kw = {**KW, **kwargs}
    meshes = {"tp": tp_mesh(), "devices": jax.devices(), "abstract": tp_mesh().abstract_mesh}
    mesh = meshes.get(kw.pop("mesh", "tp"))  # None stays None
    with pytest.raises(error, match=match):
        make(mesh, "tp", **kw)


def test_workspace_as_a_jit_argument_is_static_and_a_traced_one_is_refused():
    mesh = tp_mesh()
    ws = xla_workspace(mesh)
    calls = []

    def f(x, ws):
        calls.append(ws)
        return jax.shard_map(plain_allreduce(ws), mesh=mesh, in_specs=P("tp"), out_specs=P())(x)

    xs = random_values(new_rng(), (8 * 2, 256), "bfloat16")
    x = jax.device_put(xs, jax.sharding.NamedSharding(mesh, P("tp")))
    fn = jax.jit(f)
    out = fn(x, ws)
    assert calls == [ws]  # the workspace itself reached the body, not a tracer
    want = xs.astype(np.float64).reshape(8, 2, 256).sum(0)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=2**-7, atol=2**-7)
    fn(x, ws)
    assert len(calls) == 1  # the same workspace hits the cache
    other = xla_workspace(mesh)
    fn(x, other)
    assert calls[-1] is other and len(calls) == 2  # another workspace retraces
    # Inside a pytree (a dict of the user's) it stays itself too.
    out2 = jax.jit(lambda x, d: f(x, d["ws"]))(x, {"ws": ws})
    np.testing.assert_array_equal(np.asarray(out2), np.asarray(out))
    # A traced workspace is refused, saying how to pass it.
    body = lambda x, w: jf.allreduce_fusion(x, axis_name="tp", workspace=w, pattern=Q.kAllReduce)
    match = "workspace is a JAX tracer: pass the workspace itself, closed over or as a static"
    with pytest.raises(TypeError, match=match + " argument"):
        jax.jit(body).trace(jnp.zeros((4, 256)), jnp.zeros(()))
    with pytest.raises(TypeError, match="workspace must come from .*got str"):
        trace_sharded(fused_body("ws", Q.kAllReduce), tp_mesh(), 4, 256, n_inputs=1)


def test_the_handshakes_earlier_argument_names_are_taken():
    # check_calls / check_timeout_s (0.1.0's names) still reach the option; with both names
    # given the call is refused. The xla backend never runs the handshake.
    ws = CREATE(tp_mesh(), "tp", **KW, check_calls=True, check_timeout_s=5)
    assert (ws.handshake, ws.check_calls, ws.handshake_timeout_s) == (False, False, 5.0)
    with pytest.raises(ValueError, match="handshake_timeout_s must be in"):
        CREATE(tp_mesh(), "tp", **KW, check_timeout_s=-1)
    with pytest.raises(TypeError, match="pass handshake or its earlier name check_calls"):
        CREATE(tp_mesh(), "tp", **KW, handshake=True, check_calls=True)
