"""The MoE patterns (6, 7) in JAX on CPU (the reference lowering, with the kernel-exact
fallback where rounding points are checked): bitwise against a numpy emulation of the
kernels' rounding points for the rows before the norm, within stated bounds
of the float64 oracle for everything, the cuda lowering's custom call, vmap, grad, N-D and
every bad input. 8 virtual host devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_fusedar as jf
import tests.oracles.moe_oracle as mo
from tests.jax.cpu_helpers import (
    cuda_text,
    jit_shard_map,
    put,
    require_host_devices,
    run_sharded,
    tp_mesh,
)
from jax_fusedar.ops import moe, moe_reference
from jax_fusedar.ops.plan import CallPlan, choose_moe_kernel

require_host_devices()
# Also in the oldest-versions lane (./dev oldest).
pytestmark = [pytest.mark.usefixtures("hermetic"), pytest.mark.oldest]
EPS = 1e-6
BF = jnp.bfloat16
# finalize_fn's (permuted, idx, residual, gamma, scale): rows and index maps per rank
SPECS = (P("tp"), P("tp"), P(), P(), P())
# three per-rank inputs, then the replicated residual and gamma
RANKED3 = (P("tp"),) * 3 + (P(), P())


def workspace(world, dtype, *, tokens, hidden, backend=None):
    kw = {} if backend is None else {"backend": backend}
    make = jf.abstract_workspace if backend == "trtllm" else jf.create_allreduce_fusion_workspace
    mesh = tp_mesh(world)
    dtype = jnp.dtype(dtype)
    return make(mesh, "tp", max_token_num=max(tokens, 1), hidden_dim=hidden, dtype=dtype, **kw)


def finalize_case(rng, world, dtype, tokens, hidden, top_k, experts, **kw):
    shape = dict(tokens=tokens, hidden=hidden, top_k=top_k, experts=experts)
    return mo.random_finalize_case(rng, world=world, dtype_name=dtype, **shape, **kw)


def stack_padded(buffers):
    """The ranks' buffers stacked, padded to the longest (padding rows are never indexed)."""
    rows = max(p.shape[0] for p in buffers)
    return np.stack([np.pad(p, ((0, rows - p.shape[0]), (0, 0))) for p in buffers])


def check_outputs(outs, case, dtype, rounded, exact, weight_bias=0.0):
    """``outs`` (residual_out, norm_out[, allreduce_out]): residual_out and allreduce_out
    bit for bit at the kernel's rounding points, given each rank's ``rounded`` local rows,
    and all of them within 1 of the float64 oracle's bounds (tests/oracles/moe_oracle.py),
    given each rank's (exact local rows, magnitude, additions) of ``exact``."""
    s, residual_out = mo.epilogue_rounded(rounded, case["residual"], dtype)
    for got, want in zip(outs[::2], (residual_out, s)):
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    oracle = mo.epilogue64(
        [e[0] for e in exact], case["residual"], case["gamma"], rms_eps=EPS, weight_bias=weight_bias
    )
    world = len(exact)
    errs = mo.errors(
        outs,
        **dict(zip(("s64", "r64", "y64", "inv64"), oracle)),
        magnitude=sum(e[1] for e in exact) + np.abs(np.asarray(case["residual"], np.float64)),
        roundings=world * (2 * exact[0][2] + 1) + world,
        gamma=case["gamma"],
        weight_bias=weight_bias,
        dtype_name=dtype,
    )
    assert max(errs) <= 1.0, errs


def finalize_fn(ws, **kw):
    """(permuted, idx, residual, gamma, scale[, shared]) -> (residual_out, norm_out) of one
    finalize call on this rank's inputs; ``kw`` go to the call."""

    def body(permuted, idx, residual, gamma, scale, shared=None):
        out = jf.moe_finalize_allreduce_fusion(
            permuted,
            idx,
            axis_name="tp",
            workspace=ws,
            residual=residual,
            rms_gamma=gamma,
            expert_scale_factor=scale,
            shared_expert_output=shared,
            rms_eps=EPS,
            **kw,
        )
        assert out.allreduce_out is None
        return out.residual_out, out.norm_out

    return body


def check_finalize(
    ws, case, dtype, *, use_scale=True, use_shared=True, routed=1.0, weight_bias=0.0
):
    """Runs the finalize call on ``ws`` with the kernel's rank-order sum and checks its
    outputs (check_outputs)."""
    scale = case["scale"] if use_scale else None
    shared = [sh if use_shared else None for sh in case["shared"]]
    call = finalize_fn(
        ws, routed_scaling_factor=routed, weight_bias=weight_bias, fallback="kernel_exact"
    )

    def body(permuted, idx, shared, residual, gamma):
        return call(permuted[0], idx[0], residual, gamma, scale, shared[0] if use_shared else None)

    args = [stack_padded(case["permuted"]), *map(np.stack, (case["idx"], case["shared"]))]
    args += [case["residual"], case["gamma"]]
    outs = [np.asarray(o) for o in run_sharded(body, ws.mesh, RANKED3, (P(), P()), *args)]
    ranks = list(zip(case["permuted"], case["idx"], shared))
    rounded = [
        mo.finalize_local_rounded(p, i, dtype, scale=scale, shared=sh, routed=routed)
        for p, i, sh in ranks
    ]
    exact = [mo.finalize_local64(p, i, scale, sh, routed) for p, i, sh in ranks]
    check_outputs(outs, case, dtype, rounded, exact, weight_bias)


FINALIZE_CASES = [
    # (world, dtype, tokens, hidden, top_k, experts, scale, shared, routed)
    (2, "bfloat16", 1, 7168, 8, 256, True, True, 2.5),
    (2, "bfloat16", 16, 7168, 8, 256, True, False, 1.0),
    (2, "float16", 16, 4096, 2, 8, True, True, 1.0),
    (4, "bfloat16", 3, 2880, 4, 32, True, True, 1.0),
    (8, "float16", 5, 2880, 1, 16, False, False, 1.0),
    (2, "bfloat16", 128, 512, 6, 64, False, True, 1.5),
    (2, "float16", 1024, 256, 3, 128, True, True, 1.0),
    (4, "bfloat16", 7, 1024, 5, 20, True, False, 1.0),
    (2, "bfloat16", 9, 256, 7, 7, True, True, 1.0),
]


@pytest.mark.slow
@pytest.mark.parametrize("case_args", FINALIZE_CASES, ids=lambda c: "-".join(map(str, c)))
def test_finalize_matches_rounding_points_and_oracle(case_args):
    world, dtype, tokens, hidden, top_k, experts, use_scale, use_shared, routed = case_args
    rng = np.random.default_rng(tokens * 131 + hidden + top_k)
    case = finalize_case(rng, *case_args[:6], pad=1)
    ws = workspace(world, dtype, tokens=tokens, hidden=hidden)
    check_finalize(ws, case, dtype, use_scale=use_scale, use_shared=use_shared, routed=routed)


def test_finalize_all_slots_dropped_and_gemma_bias():
    case = finalize_case(np.random.default_rng(5), 2, "bfloat16", 4, 256, 2, 4)
    case["idx"][0][1] = -1  # token 1 dropped on every rank: only shared + residual remain
    case["idx"][1][1] = -1
    ws = workspace(2, "bfloat16", tokens=4, hidden=256)
    check_finalize(ws, case, "bfloat16", weight_bias=1.0)


REDUCTION_INPUTS = ("expert_outputs", "expert_scales", "token_input")


def run_reduction(ws, case, *, return_allreduce_out=True, fallback="kernel_exact"):
    """The call's outputs: residual_out, norm_out [, allreduce_out]. The default fallback is
    the kernel's rank-order sum, checked bit for bit."""

    def body(x, s, tok, residual, gamma):
        out = jf.moe_reduction_allreduce_fusion(
            x[0],
            s[0],
            tok[0],
            axis_name="tp",
            workspace=ws,
            residual=residual,
            rms_gamma=gamma,
            rms_eps=EPS,
            return_allreduce_out=return_allreduce_out,
            fallback=fallback,
        )
        assert (out.allreduce_out is None) is not return_allreduce_out
        return out[1:] + out[:1] if return_allreduce_out else out[1:]

    args = [np.stack(case[k]) for k in REDUCTION_INPUTS] + [case["residual"], case["gamma"]]
    outs = (P(),) * (3 if return_allreduce_out else 2)
    return [np.asarray(o) for o in run_sharded(body, ws.mesh, RANKED3, outs, *args)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "world,dtype,tokens,hidden,experts",
    [
        (2, "bfloat16", 1, 7168, 8),
        (2, "float16", 16, 4096, 4),
        (4, "bfloat16", 128, 512, 3),
        (8, "float16", 1024, 256, 1),
        (2, "bfloat16", 5, 2880, 32),
    ],
)
def test_reduction_matches_rounding_points_and_oracle(world, dtype, tokens, hidden, experts):
    rng = np.random.default_rng(tokens + hidden + experts)
    case = mo.random_reduction_case(
        rng, tokens=tokens, experts=experts, world=world, dtype_name=dtype, hidden=hidden
    )
    outs = run_reduction(workspace(world, dtype, tokens=tokens, hidden=hidden), case)
    ranks = list(zip(*(case[k] for k in REDUCTION_INPUTS)))
    rounded = [mo.reduction_local_rounded(*r, dtype) for r in ranks]
    check_outputs(outs, case, dtype, rounded, [mo.reduction_local64(*r) for r in ranks])


def test_reduction_without_allreduce_out():
    rng = np.random.default_rng(1)
    case = mo.random_reduction_case(
        rng, tokens=2, experts=2, world=2, dtype_name="bfloat16", hidden=256
    )
    ws = workspace(2, "bfloat16", tokens=2, hidden=256)
    with_ar = run_reduction(ws, case)
    # The default fallback (the psum in the rows' dtype) is exact for 2 ranks too.
    outs = run_reduction(ws, case, return_allreduce_out=False, fallback="xla")
    assert len(outs) == 2
    for a, b in zip(outs, with_ar[:2]):
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))


# --- transformations ---------------------------------------------------------------------------


def test_vmap_and_nd_equal_per_element_calls():
    world, dtype, hidden, tokens, top_k = 2, "bfloat16", 256, 3, 2
    rng = np.random.default_rng(7)
    cases = [finalize_case(rng, world, dtype, tokens, hidden, top_k, 4) for _ in range(3)]
    # [world, case, rows, hidden], every buffer padded to the longest of all
    flat = stack_padded([c["permuted"][r] for r in range(world) for c in cases])
    permuted = flat.reshape(world, len(cases), *flat.shape[1:])
    idx = np.stack([np.stack([c["idx"][r] for c in cases]) for r in range(world)])
    residual = np.stack([c["residual"] for c in cases])
    scale = np.stack([c["scale"] for c in cases])
    gamma = cases[0]["gamma"]
    ws = workspace(world, dtype, tokens=3 * tokens, hidden=hidden)
    body = finalize_fn(ws)
    mesh = ws.mesh

    def batched(permuted, idx, residual, gamma, scale):
        return jax.vmap(body, in_axes=(0, 0, 0, None, 0))(
            permuted[0], idx[0], residual, gamma, scale
        )

    def looped(permuted, idx, residual, gamma, scale):
        outs = [body(permuted[0, b], idx[0, b], residual[b], gamma, scale[b]) for b in range(3)]
        return tuple(jnp.stack(o) for o in zip(*outs))

    args = [put(mesh, s, a) for s, a in zip(SPECS, (permuted, idx, residual, gamma, scale))]
    run = lambda f: jit_shard_map(f, mesh, SPECS, (P(), P()))(*args)  # noqa: E731
    for a, b in zip(run(batched), run(looped)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))


@pytest.mark.slow
def test_grad_equals_grad_of_the_reference():
    world, dtype, hidden = 2, "float16", 256
    case = finalize_case(np.random.default_rng(11), world, dtype, 4, hidden, 2, 4)
    permuted = stack_padded(case["permuted"])
    idx = np.stack(case["idx"])
    ws = workspace(world, dtype, tokens=4, hidden=hidden)
    mesh = ws.mesh

    def loss_fused(permuted, idx, residual, gamma, scale):
        r, n = finalize_fn(ws)(permuted[0], idx[0], residual, gamma, scale)
        return r.astype(jnp.float32).sum() + (n.astype(jnp.float32) ** 2).sum()

    def loss_ref(permuted, idx, residual, gamma, scale):
        r, n = moe_reference.moe_finalize_reference(
            permuted[0],
            idx[0],
            residual,
            gamma,
            axis_name="tp",
            expert_scale_factor=scale,
            rms_eps=EPS,
        )
        return r.astype(jnp.float32).sum() + (n.astype(jnp.float32) ** 2).sum()

    args = [
        put(mesh, s, a)
        for s, a in zip(SPECS, (permuted, idx, case["residual"], case["gamma"], case["scale"]))
    ]

    def grads(loss):  # of permuted (per rank), residual, gamma and scale (summed over ranks)
        g = jax.grad(loss, argnums=(0, 2, 3, 4))
        f = lambda *a: tuple(x if k == 0 else jax.lax.psum(x, "tp") for k, x in enumerate(g(*a)))  # noqa: E731
        return jit_shard_map(f, mesh, SPECS, (P("tp"), P(), P(), P()))(*args)

    for a, b in zip(grads(loss_fused), grads(loss_ref)):
        assert np.isfinite(np.asarray(a, np.float32)).all()
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))


# --- the cuda lowering (kernel decision, custom call) on this GPU-less machine -----------------


def abstract_finalize_args(hidden, tokens=16, batch=()):
    """finalize_fn's arguments on 2 ranks as shapes; ``batch`` leading dims on all but gamma."""
    sds = jax.ShapeDtypeStruct
    return (
        sds((2, *batch, 40, hidden), BF),
        sds((2, *batch, tokens, 8), jnp.int32),
        sds((*batch, tokens, hidden), BF),
        sds((hidden,), BF),
        sds((*batch, tokens, 8), BF),
    )


@pytest.mark.parametrize("hidden,kernel", [(7168, True), (4096, True), (2880, False)])
def test_cuda_lowering_uses_the_moe_custom_call(hidden, kernel):
    ws = workspace(2, "bfloat16", tokens=16, hidden=hidden, backend="trtllm")
    args = abstract_finalize_args(hidden)

    def body(permuted, idx, residual, gamma, scale):
        return finalize_fn(ws, strict=False)(permuted[0], idx[0], residual, gamma, scale)

    f = jit_shard_map(body, ws.mesh, SPECS, (P(), P()))
    text = cuda_text(f, *args)
    assert (moe.FFI_TARGET in text) == kernel
    if kernel:
        assert "has_expert_scale = true" in text and "has_shared_expert = false" in text
    else:
        strict = lambda *a: finalize_fn(ws, strict=True)(a[0][0], a[1][0], *a[2:])  # noqa: E731
        with pytest.raises(ValueError, match="multiple of 256"):
            jit_shard_map(strict, ws.mesh, SPECS, (P(), P())).trace(*args)


def test_vmap_beyond_the_workspace_maps_onto_the_kernel():
    # The op family's one batching rule: a batch the workspace cannot hold folded, where one
    # element fits, runs one kernel call per element (strict: a fallback would raise), as
    # for the dense op; the fold would leave the kernel for psum + RMSNorm.
    tokens, hidden, batch = 16, 256, 3
    ws = workspace(2, "bfloat16", tokens=tokens, hidden=hidden, backend="trtllm")

    def body(permuted, idx, residual, gamma, scale):
        one = finalize_fn(ws, strict=True)
        return jax.vmap(one, in_axes=(0, 0, 0, None, 0))(
            permuted[0], idx[0], residual, gamma, scale
        )

    f = jit_shard_map(body, ws.mesh, SPECS, (P(), P()))
    text = cuda_text(f, *abstract_finalize_args(hidden, tokens, (batch,)))
    assert moe.FFI_TARGET in text and "while" in text  # the kernel, in a loop over elements


# --- bad inputs --------------------------------------------------------------------------------


def call_finalize(ws, permuted, idx, *, gamma=None, **kw):
    """The op on every rank with the same (concrete, closed-over) index map."""
    gamma = np.ones(permuted.shape[-1], BF) if gamma is None else gamma

    def body(p):
        out = jf.moe_finalize_allreduce_fusion(
            p[0], idx, axis_name="tp", workspace=ws, rms_gamma=gamma, rms_eps=EPS, **kw
        )
        return out.residual_out, out.norm_out

    return jit_shard_map(body, ws.mesh, P("tp"), (P(), P()))(np.stack([permuted] * ws.world_size))


def bad(idx=((0, 1),), idx_dtype=np.int32, dtype=BF, **kw):
    """(permuted rows [4, 256], index map, options) of a finalize call, one of them bad."""
    return np.zeros((4, 256), dtype), np.array(idx, idx_dtype), kw


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: bad(idx=[[0, 4]]), "not -1 .* 4 rows"),
        (lambda: bad(idx=[[-2, 0]]), "-2"),
        (lambda: bad(idx_dtype=np.int64), "int32"),
        (lambda: bad(dtype=np.float32), "bfloat16 or float16"),
        (lambda: bad(expert_scale_factor=np.ones((1, 2), np.float32)), "expert_scale_factor"),
        (lambda: bad(shared_expert_output=np.ones((1, 128), BF)), "shared_expert_output"),
        (lambda: bad(residual=np.ones((2, 256), BF)), "residual"),
        (lambda: bad(routed_scaling_factor=float("nan")), "routed_scaling_factor"),
        (lambda: bad(gamma=np.ones(8, BF)), "rms_gamma"),
    ],
)
def test_finalize_bad_inputs(make, match):
    permuted, idx, kw = make()
    ws = workspace(2, permuted.dtype, tokens=4, hidden=256)  # the rows' own dtype
    with pytest.raises((ValueError, TypeError), match=match):
        call_finalize(ws, permuted, idx, **kw)


def test_reduction_bad_inputs_and_dense_entry_point_refuses_moe_codes():
    ws = workspace(2, "bfloat16", tokens=4, hidden=256)
    x, s32, tok = np.zeros((2, 3, 256), BF), np.zeros((2, 3), np.float32), np.zeros((3, 256), BF)
    kw = dict(axis_name="tp", workspace=ws, rms_gamma=np.ones(256, BF))

    def call(*args):  # every rank the same inputs
        body = lambda x, s, t: jf.moe_reduction_allreduce_fusion(x[0], s[0], t[0], **kw).norm_out  # noqa: E731
        f = jit_shard_map(body, ws.mesh, (P("tp"),) * 3, P())
        return f(*(np.stack([a] * 2) for a in args))

    with pytest.raises(ValueError, match="expert_scales .*float32"):
        call(x, s32.astype(BF), tok)
    with pytest.raises(ValueError, match="expert_scales"):
        call(x, s32.T, tok)  # token-major: refused
    with pytest.raises(ValueError, match="expert_outputs"):
        call(np.zeros((2, 4, 256), BF), s32, tok)
    with pytest.raises(ValueError, match="has its own inputs"):
        dense = lambda x: jf.allreduce_fusion(x, axis_name="tp", workspace=ws, pattern=7)  # noqa
        jit_shard_map(lambda x: dense(x).norm_out, ws.mesh, P("tp"), P())(np.zeros((2, 256), BF))
    with pytest.raises(ValueError, match="inside jax.shard_map"):
        jf.moe_reduction_allreduce_fusion(x, s32, tok, **kw)


@pytest.mark.parametrize(
    "tokens,hidden,world,problem",
    [
        (4, 7168, 2, None),
        (4, 2880, 2, "multiple of 256"),
        (200, 7168, 2, "exceed"),
        (4, 33 * 256, 2, "1024"),
        (4, 7168, 3, "world size"),
    ],
)
def test_kernel_problem_rules(tokens, hidden, world, problem):
    from jax_fusedar.common import sizing as topology

    if world == 3:
        with pytest.raises(ValueError, match="world size"):
            topology.workspace_sizes(world, 128, 7168, "bfloat16")
        return
    sizes = topology.workspace_sizes(world, 128, max(hidden, 7168), "bfloat16")
    got = moe.kernel_problem(tokens, hidden, "bfloat16", sizes)
    assert got is None if problem is None else problem in got[1], got


def test_hidden_sizes_flashinfers_launcher_cannot_place_fall_back_or_raise():
    """hidden 8448 (33 warps per token, 1056 threads per CTA): the one MoE rule
    (common.moe_limits, also torch's and the native launch's) keeps it off the kernel."""
    ws = workspace(2, "bfloat16", tokens=4, hidden=8448, backend="trtllm")
    plan = CallPlan(ws.backend, ws.sizes, True, True)
    with pytest.raises(ValueError, match="1056 threads per block"):
        choose_moe_kernel(plan, 4, 8448, "bfloat16")
    assert not choose_moe_kernel(CallPlan(ws.backend, ws.sizes, False, True), 4, 8448, "bfloat16")
    assert choose_moe_kernel(CallPlan(ws.backend, ws.sizes, True, True), 4, 8192, "bfloat16")
