"""Autodiff of allreduce_fusion on CPU (8 virtual devices): the fused op's gradients, JVPs and
VJPs equal, bit for bit, those of the same math written unfused in plain JAX
(jax_fusedar.ops.reference: psum + residual add + RMSNorm), in a tensor-parallel MLP and under
scan, checkpoint (with and without policies), cond, stop_gradient and check_vma both ways;
quantized outputs have zero derivative; a few SGD steps give the same losses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

import jax_fusedar as jf
from tests.jax.cpu_helpers import assert_same_bits, cuda_text, jdtype, make_mesh, n_outputs, new_rng
from tests.jax.cpu_helpers import pattern_outputs, put, random_gamma, random_values
from tests.jax.cpu_helpers import require_host_devices, tp_mesh, xla_workspace
from jax_fusedar.ops import reference

require_host_devices()

Q = jf.AllReduceFusionPattern
EPS = 1e-5
TOKENS, HIDDEN, FFN, LAYERS = 8, 256, 512, 2
SPECS = (P(None, None, "tp"), P(None, "tp", None), P(), P())
POLICIES = {
    "checkpoint": None,
    "checkpoint_dots": jax.checkpoint_policies.checkpoint_dots,
    "checkpoint_nothing": jax.checkpoint_policies.nothing_saveable,
    "checkpoint_names": jax.checkpoint_policies.save_only_these_names("normed"),
}


def fused_combine(ws, pattern=Q.kARResidualRMSNorm, **kw):
    """(partial, residual, gamma) -> (residual_out, norm_out) through the fused op."""
    kw.update(axis_name="tp", workspace=ws, pattern=pattern, rms_eps=EPS)
    return lambda p, r, g: tuple(jf.allreduce_fusion(p, residual=r, rms_gamma=g, **kw)[1:3])


def unfused_combine(*, weight_bias=0.0, fp32_acc=True, fallback="xla", **_):
    """The same with psum + residual add + RMSNorm in plain JAX (the reference math, with the
    fused call's fallback all-reduce; gamma rounded to the stream's dtype as the fused op
    does with a float32 gamma)."""
    kw = dict(rms_eps=EPS, weight_bias=weight_bias, fp32_acc=fp32_acc, fallback=fallback)
    ref = reference.allreduce_fusion_reference
    return lambda p, r, g: ref(p, r, g.astype(p.dtype), axis_name="tp", pattern=1, **kw)[1:]


def plain_jnp_combine(p, r, g):
    """What a user writes without jax_fusedar, for float32: psum + add + RMSNorm in jnp."""
    r = jax.lax.psum(p, "tp") + r
    return r, r * jax.lax.rsqrt(jnp.mean(r * r, axis=-1, keepdims=True) + EPS) * g


def model_body(combine, variant):
    """shard_map body: LAYERS layers over the residual stream x; returns the last norm."""
    # tanh(y @ w1) is [T, F/tp], varying over "tp"; its @ w2 the partial sums of [T, H].
    layer = lambda w1, w2, g, r, y: combine(jnp.tanh(y @ w1) @ w2, r, g)
    if variant.startswith("checkpoint"):
        plain = layer
        named = lambda *a: (lambda r, y: (r, checkpoint_name(y, "normed")))(*plain(*a))
        layer = jax.checkpoint(named, policy=POLICIES[variant])

    def body(w1, w2, gamma, x):
        r, y = x, x
        if variant == "scan":
            step = lambda carry, ws: (layer(*ws, *carry), None)
            return jax.lax.scan(step, (r, y), (w1, w2, gamma))[0][1]
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
    return (w1, w2, gamma, x), random_values(rng, (TOKENS, HIDDEN), "float32")


placed = lambda mesh, params: tuple(put(mesh, s, a) for s, a in zip(SPECS, params))


def model(mesh, combine, variant="plain", check_vma=True):
    body = model_body(combine, variant)
    return jax.shard_map(body, mesh=mesh, in_specs=SPECS, out_specs=P(), check_vma=check_vma)


def loss_fn(mesh, combine, variant="plain", check_vma=True):
    f = model(mesh, combine, variant, check_vma)
    return lambda params, target: jnp.mean((f(*params).astype(jnp.float32) - target) ** 2)


def some_change(tree):
    """The test can fail: the gradients are not all zero."""
    assert any(np.any(np.asarray(leaf) != 0) for leaf in jax.tree.leaves(tree))


SLOW, OLDEST = pytest.mark.slow, (pytest.mark.slow, pytest.mark.oldest)


def grad_case(transform, shape, dtype, variant="plain", check_vma=True, marks=SLOW, **kw):
    name = "-".join([transform.__name__, dtype, "x".join(map(str, shape)), variant, str(check_vma)])
    name += "".join(f"-{k}={v.__name__ if callable(v) else v}" for k, v in kw.items())
    return pytest.param(transform, shape, dtype, variant, check_vma, kw, marks=marks, id=name)


@pytest.mark.parametrize(
    "transform,mesh_shape,dtype,variant,check_vma,kw",
    [
        *(
            grad_case(jax.value_and_grad, s, d)
            for d in ("bfloat16", "float32")
            for s in ((8,), (2, 4))
        ),
        # In float32 the reference's roundings are identities: the fused op's gradients equal
        # those of the model written with jax.lax.psum and jnp alone, bit for bit.
        grad_case(jax.value_and_grad, (8,), "float32", marks=(), unfused=plain_jnp_combine),
        *(
            grad_case(
                jax.grad, (8,), "bfloat16", v, c, marks=OLDEST if v in ("scan", "cond") else SLOW
            )
            for v in ("scan", *POLICIES, "cond", "stop_gradient")
            for c in (True, False)
        ),
        grad_case(jax.grad, (8,), "bfloat16", weight_bias=1.0),
        grad_case(jax.grad, (8,), "bfloat16", fp32_acc=False, fallback="kernel_exact"),
    ],
)
def test_gradients_equal_the_unfused_model(transform, mesh_shape, dtype, variant, check_vma, kw):
    """jit(transform(loss)) of the fused and the unfused MLP (``kw`` to both combines;
    ``unfused`` replaces unfused_combine) at fresh parameters: the same bits."""
    mesh = make_mesh(mesh_shape, ("tp",) if len(mesh_shape) == 1 else ("dp", "tp"))
    params, target = mlp_params(new_rng(), dtype)
    params = placed(mesh, params)
    kw = dict(kw)
    unfused = kw.pop("unfused", None) or unfused_combine(**kw)
    combines = (fused_combine(xla_workspace(mesh, dtype), **kw), unfused)
    got, want = (
        jax.jit(transform(loss_fn(mesh, c, variant, check_vma)))(params, target) for c in combines
    )
    assert_same_bits(got, want, f"{transform.__name__} {dtype} {mesh_shape} {variant} {check_vma}")
    some_change(got[1] if transform is jax.value_and_grad else got)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["plain", "scan", "checkpoint_dots", "cond"])
@pytest.mark.parametrize("check_vma", [True, False])
def test_jvp_and_vjp(variant, check_vma):
    """Forward mode (not available through custom_vjp) and an explicit VJP with a random
    cotangent."""
    mesh = tp_mesh()
    rng = new_rng()
    params, tangents = (placed(mesh, mlp_params(rng, "bfloat16")[0]) for _ in range(2))
    ct = random_values(rng, (TOKENS, HIDDEN), "bfloat16")
    results = []
    for combine in (fused_combine(xla_workspace(mesh, "bfloat16")), unfused_combine()):
        f = model(mesh, combine, variant, check_vma)
        jvp = jax.jit(lambda p, t, f=f: jax.jvp(lambda *a: f(*a), p, t))(params, tangents)
        vjp = jax.jit(lambda p, c, f=f: jax.vjp(lambda *a: f(*a), *p)[1](c))(params, ct)
        results.append((jvp, vjp))
    assert_same_bits(results[0], results[1], f"jvp/vjp under {variant}, check_vma={check_vma}")
    some_change(results[0][0][1])


@pytest.mark.slow
@pytest.mark.oldest
def test_float32_gamma_with_bfloat16_stream():
    """A float32 gamma (Flax's default param_dtype) is rounded to bfloat16 where the kernel
    reads it: the forward equals the call with the rounded gamma, and gamma's gradient (in
    float32) equals that of the unfused model that rounds it the same way."""
    mesh = tp_mesh()
    ws = xla_workspace(mesh, "bfloat16")
    params, target = mlp_params(new_rng(), "bfloat16", gamma_dtype="float32")
    assert params[2].dtype == np.float32
    rounded = (*params[:2], params[2].astype(jdtype("bfloat16")), params[3])
    assert np.any(params[2] != rounded[2].astype(np.float32))  # the rounding is real
    fwd32, fwd16 = (
        jax.jit(model(mesh, fused_combine(ws)))(*placed(mesh, p)) for p in (params, rounded)
    )
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
    params0, target = mlp_params(new_rng(), dtype)
    curves = []
    for combine in (fused_combine(xla_workspace(mesh, dtype)), unfused_combine()):
        step_loss = jax.value_and_grad(loss_fn(mesh, combine))

        @jax.jit
        def step(params, target):
            loss, grads = step_loss(params, target)
            sgd = (p - (0.5 * g).astype(p.dtype) for p, g in zip(params[:3], grads[:3]))
            return loss, (*sgd, params[3])

        params, losses = placed(mesh, params0), []
        for _ in range(4):
            loss, params = step(params, target)
            losses.append(float(loss))
        curves.append((losses, params))
    assert curves[0][0] == curves[1][0], curves
    assert curves[0][0][-1] < curves[0][0][0]  # it trains
    assert_same_bits(curves[0][1], curves[1][1], "parameters after SGD")


def one_call(ws, pattern, mesh, residual_spec=P(), **kw):
    """shard_map of one call on x [8*T, H] (sharded), residual and gamma: the function of
    (x, residual, gamma) giving the pattern's non-None outputs."""
    body = lambda x, r, g: pattern_outputs(ws, pattern, x, r, g, dict(kw, rms_eps=EPS))
    in_specs, out_specs = (P("tp"), residual_spec, P()), (residual_spec,) * n_outputs(pattern)
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


def test_allreduce_pattern_gradient_is_psums():
    mesh = tp_mesh()
    rng = new_rng()
    x = put(mesh, P("tp"), random_values(rng, (8 * TOKENS, HIDDEN), "float32"))
    w = random_values(rng, (TOKENS, HIDDEN), "float32")
    f = one_call(xla_workspace(mesh, "float32"), Q.kAllReduce, mesh)
    g_fused = jax.jit(jax.grad(lambda x: jnp.sum(f(x, None, None)[0] * w)))(x)
    psum = jax.shard_map(
        lambda x: jax.lax.psum(x, "tp"), mesh=mesh, in_specs=P("tp"), out_specs=P()
    )
    g_psum = jax.jit(jax.grad(lambda x: jnp.sum(psum(x) * w)))(x)
    assert_same_bits(g_fused, g_psum, "pattern 0 grad vs psum")
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
    f, ref = one_call(ws, pattern, mesh, **kw), one_call(ws, Q.kARResidualRMSNorm, mesh)
    x, r = (random_values(rng, (n * TOKENS, HIDDEN), "bfloat16") for n in (8, 1))
    args = (put(mesh, P("tp"), x), put(mesh, P(), r))
    args += (put(mesh, P(), random_gamma(rng, HIDDEN, "bfloat16")),)
    w = random_values(rng, (TOKENS, HIDDEN), "float32")

    def loss(outs):
        res, norm = (o.astype(jnp.float32) for o in outs[:2])
        return jnp.sum(res * w) + jnp.sum(jnp.cos(norm))

    grad = lambda fn: jax.jit(jax.grad(fn, argnums=(0, 1, 2)))(*args)
    what = f"pattern {int(pattern)} grad through residual/norm_out"
    assert_same_bits(grad(lambda *a: loss(f(*a))), grad(lambda *a: loss(ref(*a))), what)
    codes = grad(lambda *a: sum(jnp.sum(o.astype(jnp.float32)) for o in f(*a)[2:]))
    assert all(not np.any(np.asarray(v)) for v in codes)
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
    rng = new_rng()
    f = one_call(xla_workspace(mesh, "float32"), Q.kARResidualRMSNorm, mesh, residual_spec=P("tp"))
    value = lambda: put(mesh, P("tp"), random_values(rng, (8 * TOKENS, HIDDEN), "float32"))
    x, r = value(), value()
    g = put(mesh, P(), random_gamma(rng, HIDDEN, "float32"))
    dx = value()
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
