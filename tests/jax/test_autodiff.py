"""Autodiff of allreduce_fusion on CPU (8 virtual devices): the fused op's gradients, JVPs and
VJPs equal, bit for bit, those of the same math written unfused in plain JAX
(jax_fusedar.ops.reference: psum + residual add + RMSNorm), in a tensor-parallel MLP and under
scan, checkpoint (with and without policies), cond, stop_gradient and check_vma both ways;
quantized outputs have zero derivative; a few SGD steps give the same losses."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

import jax_fusedar as jf
from tests.jax.cpu_helpers import (
    assert_same_bits,
    cuda_text,
    jdtype,
    make_mesh,
    n_outputs,
    new_rng,
    pattern_outputs,
    put,
    random_gamma,
    random_values,
    require_host_devices,
    tp_mesh,
    xla_workspace,
)
from jax_fusedar.ops import reference

require_host_devices()

Q = jf.AllReduceFusionPattern
EPS = 1e-5
TOKENS, HIDDEN, FFN, LAYERS = 8, 256, 512, 2


def fused_combine(ws, pattern=Q.kARResidualRMSNorm, **kw):
    """(partial, residual, gamma) -> (residual_out, norm_out) through the fused op."""

    kw.update(axis_name="tp", workspace=ws, pattern=pattern, rms_eps=EPS)

    def combine(p, r, g):
        o = jf.allreduce_fusion(p, residual=r, rms_gamma=g, **kw)
        return o.residual_out, o.norm_out

    return combine


def unfused_combine(*, weight_bias=0.0, fp32_acc=True, fallback="xla", **_):
    """The same with psum + residual add + RMSNorm in plain JAX (the reference math, with the
    fused call's fallback all-reduce; gamma rounded to the stream's dtype as the fused op
    does with a float32 gamma)."""

    kw = dict(rms_eps=EPS, weight_bias=weight_bias, fp32_acc=fp32_acc, fallback=fallback)

    def combine(p, r, g):
        _, r_out, y = reference.allreduce_fusion_reference(
            p, r, g.astype(p.dtype), axis_name="tp", pattern=1, **kw
        )
        return r_out, y

    return combine


def plain_jnp_combine():
    """What a user writes without jax_fusedar, for float32: psum + add + RMSNorm in jnp."""

    def combine(p, r, g):
        r = jax.lax.psum(p, "tp") + r
        y = r * jax.lax.rsqrt(jnp.mean(r * r, axis=-1, keepdims=True) + EPS) * g
        return r, y

    return combine


def mlp_layer(combine, w1, w2, g, r, y):
    h = jnp.tanh(y @ w1)  # [T, F/tp], varying over "tp"
    return combine(h @ w2, r, g)  # partial sums of [T, H] -> (residual, normed)


def model_body(combine, variant):
    """shard_map body: LAYERS layers over the residual stream x; returns the last norm."""
    layer = functools.partial(mlp_layer, combine)
    if variant.startswith("checkpoint"):
        policy = {
            "checkpoint": None,
            "checkpoint_dots": jax.checkpoint_policies.checkpoint_dots,
            "checkpoint_nothing": jax.checkpoint_policies.nothing_saveable,
            "checkpoint_names": jax.checkpoint_policies.save_only_these_names("normed"),
        }[variant]

        plain = layer

        def named(*a):
            r, y = plain(*a)
            return r, checkpoint_name(y, "normed")

        layer = jax.checkpoint(named, policy=policy)

    def body(w1, w2, gamma, x):
        r, y = x, x
        if variant == "scan":

            def step(carry, ws):
                return layer(*ws, *carry), None

            (r, y), _ = jax.lax.scan(step, (r, y), (w1, w2, gamma))
            return y
        for i in range(LAYERS):
            if variant == "cond":
                # The fused layer on one branch, a local op on the other (predicate invariant).
                local = lambda w1, w2, g, r, y: (r, y * 2)
                r, y = jax.lax.cond(i % 2 == 0, layer, local, w1[i], w2[i], gamma[i], r, y)
            else:
                r, y = layer(w1[i], w2[i], gamma[i], r, y)
            if variant == "stop_gradient" and i == 0:
                r = jax.lax.stop_gradient(r)  # inputs still carry tangents into the op
        return y

    return body


def mlp_params(rng, dtype, gamma_dtype=None):
    w1 = (random_values(rng, (LAYERS, HIDDEN, FFN), "float32") / np.sqrt(HIDDEN)).astype(dtype)
    w2 = (random_values(rng, (LAYERS, FFN, HIDDEN), "float32") / np.sqrt(FFN)).astype(dtype)
    gamma = random_gamma(rng, HIDDEN, gamma_dtype or dtype, leading=(LAYERS,))
    x = random_values(rng, (TOKENS, HIDDEN), dtype)
    target = random_values(rng, (TOKENS, HIDDEN), "float32")
    return (w1, w2, gamma, x), target


SPECS = (P(None, None, "tp"), P(None, "tp", None), P(), P())


def placed(mesh, params):
    return tuple(put(mesh, s, a) for s, a in zip(SPECS, params))


def model(mesh, combine, variant="plain", check_vma=True):
    return jax.shard_map(
        model_body(combine, variant), mesh=mesh, in_specs=SPECS, out_specs=P(), check_vma=check_vma
    )


def loss_fn(mesh, combine, variant="plain", check_vma=True):
    f = model(mesh, combine, variant, check_vma)

    def loss(params, target):
        y = f(*params)
        return jnp.mean((y.astype(jnp.float32) - target) ** 2)

    return loss


def fused_and_unfused(transform, mesh, dtype, variant="plain", check_vma=True, unfused=None, **kw):
    """``jit(transform(loss))`` of the fused and the unfused MLP (``kw`` to both combines;
    ``unfused`` replaces unfused_combine) at fresh parameters: (fused result, unfused one)."""
    params, target = mlp_params(new_rng(), dtype)
    params = placed(mesh, params)
    unfused = unfused or unfused_combine(**kw)
    return tuple(
        jax.jit(transform(loss_fn(mesh, combine, variant, check_vma)))(params, target)
        for combine in (fused_combine(xla_workspace(mesh, dtype), **kw), unfused)
    )


def some_change(tree):
    """The test can fail: the gradients are not all zero."""
    assert any(np.any(np.asarray(leaf) != 0) for leaf in jax.tree.leaves(tree))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("mesh_shape", [(8,), (2, 4)], ids=["tp8", "dp2_tp4"])
def test_mlp_gradients_equal_the_unfused_model(dtype, mesh_shape):
    names = ("tp",) if len(mesh_shape) == 1 else ("dp", "tp")
    got, want = fused_and_unfused(jax.value_and_grad, make_mesh(mesh_shape, names), dtype)
    assert_same_bits(got, want, f"grad {dtype} {mesh_shape}")
    some_change(got[1])


def test_float32_gradients_equal_plain_jnp_psum_and_rmsnorm():
    """In float32 the reference's roundings are identities: the fused op's gradients equal
    those of the model written with jax.lax.psum and jnp alone, bit for bit."""
    plain = plain_jnp_combine()
    got, want = fused_and_unfused(jax.value_and_grad, tp_mesh(), "float32", unfused=plain)
    assert_same_bits(got, want, "float32 grad vs plain jnp")


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant",
    [
        pytest.param("scan", marks=pytest.mark.oldest),
        "checkpoint",
        "checkpoint_dots",
        "checkpoint_nothing",
        "checkpoint_names",
        pytest.param("cond", marks=pytest.mark.oldest),
        "stop_gradient",
    ],
)
@pytest.mark.parametrize("check_vma", [True, False])
def test_grad_under_transformations(variant, check_vma):
    got, want = fused_and_unfused(jax.grad, tp_mesh(), "bfloat16", variant, check_vma)
    assert_same_bits(got, want, f"grad under {variant}, check_vma={check_vma}")
    some_change(got)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["plain", "scan", "checkpoint_dots", "cond"])
@pytest.mark.parametrize("check_vma", [True, False])
def test_jvp_and_vjp(variant, check_vma):
    """Forward mode (not available through custom_vjp) and an explicit VJP with a random
    cotangent."""
    mesh = tp_mesh()
    ws = xla_workspace(mesh, "bfloat16")
    rng = new_rng()
    params, tangents = (placed(mesh, mlp_params(rng, "bfloat16")[0]) for _ in range(2))
    ct = random_values(rng, (TOKENS, HIDDEN), "bfloat16")
    results = []
    for combine in (fused_combine(ws), unfused_combine()):
        f = model(mesh, combine, variant, check_vma)
        jvp = jax.jit(lambda p, t, f=f: jax.jvp(lambda *a: f(*a), p, t))(params, tangents)
        vjp = jax.jit(lambda p, c, f=f: jax.vjp(lambda *a: f(*a), *p)[1](c))(params, ct)
        results.append((jvp, vjp))
    assert_same_bits(results[0], results[1], f"jvp/vjp under {variant}, check_vma={check_vma}")
    some_change(results[0][0][1])


@pytest.mark.slow
@pytest.mark.parametrize(
    "kw",
    [{"weight_bias": 1.0}, {"fp32_acc": False, "fallback": "kernel_exact"}],
    ids=["weight_bias", "no_fp32_acc"],
)
def test_gradients_with_weight_bias_and_without_fp32_acc(kw):
    got, want = fused_and_unfused(jax.grad, tp_mesh(), "bfloat16", **kw)
    assert_same_bits(got, want, f"grad with {kw}")


@pytest.mark.slow
@pytest.mark.oldest
def test_float32_gamma_with_bfloat16_stream():
    """A float32 gamma (Flax's default param_dtype) is rounded to bfloat16 where the kernel
    reads it: the forward equals the call with the rounded gamma, and gamma's gradient (in
    float32) equals that of the unfused model that rounds it the same way."""
    mesh = tp_mesh()
    ws = xla_workspace(mesh, "bfloat16")
    rng = new_rng()
    params, target = mlp_params(rng, "bfloat16", gamma_dtype="float32")
    assert params[2].dtype == np.float32
    rounded = (*params[:2], params[2].astype(jdtype("bfloat16")), params[3])
    assert np.any(params[2] != rounded[2].astype(np.float32))  # the rounding is real
    fwd32 = jax.jit(model(mesh, fused_combine(ws)))(*placed(mesh, params))
    fwd16 = jax.jit(model(mesh, fused_combine(ws)))(*placed(mesh, rounded))
    assert_same_bits(fwd32, fwd16, "float32 gamma vs gamma rounded to bfloat16")
    params = placed(mesh, params)
    got = jax.jit(jax.grad(loss_fn(mesh, fused_combine(ws))))(params, target)
    want = jax.jit(jax.grad(loss_fn(mesh, unfused_combine())))(params, target)
    assert got[2].dtype == np.float32
    assert_same_bits(got, want, "grad with a float32 gamma")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_sgd_steps_give_equal_losses(dtype):
    mesh = tp_mesh()
    ws = xla_workspace(mesh, dtype)
    params0, target = mlp_params(new_rng(), dtype)
    curves = []
    for combine in (fused_combine(ws), unfused_combine()):
        step_loss = jax.value_and_grad(loss_fn(mesh, combine))

        @jax.jit
        def step(params, target):
            loss, grads = step_loss(params, target)
            params = (
                *(p - (0.5 * g).astype(p.dtype) for p, g in zip(params[:3], grads[:3])),
                params[3],
            )
            return loss, params

        params, losses = placed(mesh, params0), []
        for _ in range(4):
            loss, params = step(params, target)
            losses.append(float(loss))
        curves.append((losses, params))
    assert curves[0][0] == curves[1][0], curves
    assert curves[0][0][-1] < curves[0][0][0]  # it trains
    assert_same_bits(curves[0][1], curves[1][1], "parameters after SGD")


def _one_call(ws, pattern, mesh, dtype, residual_spec=P(), **kw):
    """jit(shard_map) of one call on x [8*T, H] (sharded), residual and gamma; returns the
    function of (x, residual, gamma) giving the pattern's non-None outputs."""

    def body(x, r, g):
        return pattern_outputs(ws, pattern, x, r, g, dict(kw, rms_eps=EPS))

    out_specs = (residual_spec,) * n_outputs(pattern)
    return jax.shard_map(
        body, mesh=mesh, in_specs=(P("tp"), residual_spec, P()), out_specs=out_specs
    )


def psum_tp(x):
    return jax.lax.psum(x, "tp")


def test_allreduce_pattern_gradient_is_psums():
    mesh = tp_mesh()
    ws = xla_workspace(mesh, "float32")
    rng = new_rng()
    x = put(mesh, P("tp"), random_values(rng, (8 * TOKENS, HIDDEN), "float32"))
    w = random_values(rng, (TOKENS, HIDDEN), "float32")
    f = _one_call(ws, Q.kAllReduce, mesh, "float32")
    g_fused = jax.jit(jax.grad(lambda x: jnp.sum(f(x, None, None)[0] * w)))(x)

    def unfused(x):
        return jnp.sum(jax.shard_map(psum_tp, mesh=mesh, in_specs=P("tp"), out_specs=P())(x) * w)

    assert_same_bits(g_fused, jax.jit(jax.grad(unfused))(x), "pattern 0 grad vs psum")
    # psum's transpose under check_vma=True: every rank's x gets the output's cotangent.
    np.testing.assert_array_equal(np.asarray(g_fused), np.tile(w, (8, 1)))


@pytest.mark.slow
@pytest.mark.parametrize(
    "pattern,kw",
    [
        (Q.kARResidualRMSNormOutFP8Quant, {"scale_factor": np.full(1, 0.05, np.float32)}),
        (Q.kARResidualRMSNormOutDynamicFP8Quant, {}),
        (Q.kARResidualRMSNormOutPerTokenGroupFP8PackedQuant, {"block_quant_group_size": 64}),
        (Q.kARResidualRMSNormOutFP4Quant, {"scale_factor": np.full(1, 40.0, np.float32)}),
    ],
)
def test_quantized_patterns_differentiate_norm_out_and_not_the_codes(pattern, kw):
    """residual_out and norm_out have the unfused gradient; quant_out and scale_out have
    zero derivative (forward-mode tangents are zeros, reverse mode gives them no
    contribution), like jnp.round."""
    mesh = tp_mesh()
    ws = xla_workspace(mesh, "bfloat16")
    rng = new_rng()
    f = _one_call(ws, pattern, mesh, "bfloat16", **kw)
    ref = _one_call(ws, Q.kARResidualRMSNorm, mesh, "bfloat16")
    x, r = (random_values(rng, (n * TOKENS, HIDDEN), "bfloat16") for n in (8, 1))
    args = (
        put(mesh, P("tp"), x),
        put(mesh, P(), r),
        put(mesh, P(), random_gamma(rng, HIDDEN, "bfloat16")),
    )
    w = random_values(rng, (TOKENS, HIDDEN), "float32")

    def loss(outs):
        res, norm = (o.astype(jnp.float32) for o in outs[:2])
        return jnp.sum(res * w) + jnp.sum(jnp.cos(norm))

    grad = lambda fn: jax.jit(jax.grad(lambda *a: loss(fn(*a)), argnums=(0, 1, 2)))(*args)
    assert_same_bits(grad(f), grad(ref), f"pattern {int(pattern)} grad through residual/norm_out")

    def through_codes(*a):
        return sum(jnp.sum(o.astype(jnp.float32)) for o in f(*a)[2:])

    g_codes = jax.jit(jax.grad(through_codes, argnums=(0, 1, 2)))(*args)
    assert all(not np.any(np.asarray(v)) for v in g_codes)
    tangents = tuple(jnp.ones_like(a) for a in args)
    outs, touts = jax.jit(lambda a, t: jax.jvp(f, a, t))(args, tangents)
    for o, t in zip(outs[2:], touts[2:]):
        t = np.asarray(t)
        values = t.astype(np.float32) if t.dtype != jax.dtypes.float0 else np.zeros(1)
        assert t.shape == o.shape and not np.any(values), (t.dtype, o.dtype)
    assert np.any(np.asarray(touts[1]).astype(np.float32))


@pytest.mark.oldest
def test_per_rank_residual_tangents_stay_per_rank():
    """check_vma=True with a residual that varies over "tp" and no tangent for it: the
    residual_out tangent (invariant sum) is marked varying like residual_out itself."""
    mesh = tp_mesh()
    ws = xla_workspace(mesh, "float32")
    rng = new_rng()
    f = _one_call(ws, Q.kARResidualRMSNorm, mesh, "float32", residual_spec=P("tp"))
    x, r = (
        put(mesh, P("tp"), random_values(rng, (8 * TOKENS, HIDDEN), "float32")) for _ in range(2)
    )
    g = put(mesh, P(), random_gamma(rng, HIDDEN, "float32"))
    dx = put(mesh, P("tp"), random_values(rng, (8 * TOKENS, HIDDEN), "float32"))
    specs = dict(in_specs=(P("tp"), P("tp"), P()), out_specs=(P("tp"),) * 2)
    ref = jax.shard_map(unfused_combine(), mesh=mesh, **specs)

    def jvp_and_grad(fn):
        """The jvp in x, and reverse mode through both outputs."""
        jvp = jax.jit(lambda x, dx: jax.jvp(lambda x: fn(x, r, g), (x,), (dx,)))(x, dx)
        loss = lambda x, r: sum(jnp.sum(jnp.sin(o)) for o in fn(x, r, g))
        return jvp, jax.jit(jax.grad(loss, argnums=(0, 1)))(x, r)

    assert_same_bits(jvp_and_grad(f), jvp_and_grad(ref), "per-rank residual jvp and grad")


def test_reference_round_to_derivative_is_the_rounding():
    """round_to's derivative is the (linear) rounding of the tangent, even where the value
    is a float16 subnormal (whose own rounding uses jnp.round, of derivative zero)."""
    v = jnp.asarray([1e-6, 3.0001, -2e-5], jnp.float32)
    t = jnp.asarray([0.5, 1.0001, 2.0], jnp.float32)
    _, dt = jax.jvp(lambda a: reference.round_to(a, jnp.dtype(jnp.float16)), (v,), (t,))
    np.testing.assert_array_equal(np.asarray(dt), np.asarray(t).astype(np.float16))
    lin = jax.linear_transpose(lambda a: reference.round_tangent(a, jnp.dtype(jnp.float16)), t)
    (ct,) = lin(jnp.ones(3, jnp.float16))
    assert ct.dtype == np.float32 and np.all(np.asarray(ct) == 1)


@pytest.mark.parametrize("variant", ["plain", "checkpoint"])
def test_cuda_gradient_keeps_the_kernel_and_adds_no_all_reduce(variant):
    """Lowered for cuda: the forward runs the kernel (one custom call per layer, again per
    layer where checkpoint recomputes the forward), the tangent rule adds no collective to
    the forward (the fused program has exactly one all-reduce per layer fewer than the
    unfused one: the forward's psums), and the backward's collectives are JAX's own."""
    mesh = tp_mesh()
    kw = dict(max_token_num=64, hidden_dim=HIDDEN, dtype=jnp.bfloat16, backend="trtllm")
    ws = jf.abstract_workspace(mesh, "tp", **kw)
    params, target = mlp_params(new_rng(), "bfloat16")
    params = placed(mesh, params)
    counts = []
    for combine in (fused_combine(ws), unfused_combine()):
        text = cuda_text(jax.jit(jax.grad(loss_fn(mesh, combine, variant))), params, target)
        counts.append((text.count("@jax_fusedar_allreduce_fusion_v2("), text.count("all_reduce")))
    (fused_calls, fused_ar), (unfused_calls, unfused_ar) = counts
    runs = 2 if variant == "checkpoint" else 1
    assert fused_calls == runs * LAYERS and unfused_calls == 0, counts
    assert fused_ar == unfused_ar - runs * LAYERS, counts
