"""The MoE patterns (6, 7) in JAX on CPU (the reference lowering, with the kernel-exact
fallback where rounding points are checked): bitwise against a numpy emulation of the
kernels' rounding points for the rows before the norm, within stated bounds of the float64
oracle for everything, the cuda lowering's custom call, vmap, grad, N-D, every bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_fusedar as jf
import tests.oracles.moe_oracle as mo
from tests.jax.cpu_helpers import cuda_text, jit_shard_map, put, require_host_devices, run_sharded
from tests.jax.cpu_helpers import tp_mesh
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
u16 = lambda a: np.asarray(a).view(np.uint16)
same_bits16 = lambda a, b: np.testing.assert_array_equal(u16(a), u16(b))


def workspace(world, dtype, *, tokens, hidden, kernel=False):
    """An xla workspace, or (``kernel``) an abstract trtllm one, on ``world`` ranks."""
    kw = dict(max_token_num=max(tokens, 1), hidden_dim=hidden, dtype=jnp.dtype(dtype))
    if kernel:
        return jf.abstract_workspace(tp_mesh(world), "tp", backend="trtllm", **kw)
    return jf.create_allreduce_fusion_workspace(tp_mesh(world), "tp", **kw)


def finalize_case(rng, world, dtype, tokens, hidden, top_k, experts, **kw):
    shape = dict(tokens=tokens, hidden=hidden, top_k=top_k, experts=experts)
    return mo.random_finalize_case(rng, world=world, dtype_name=dtype, **shape, **kw)


def stack_padded(buffers):
    """The ranks' buffers stacked, padded to the longest (padding rows are never indexed)."""
    rows = max(p.shape[0] for p in buffers)
    return np.stack([np.pad(p, ((0, rows - p.shape[0]), (0, 0))) for p in buffers])


def check_outputs(outs, case, dtype, rounded, exact, wb=0.0):
    """``outs`` (residual_out, norm_out[, allreduce_out]): residual_out and allreduce_out
    bit for bit at the kernel's rounding points, given each rank's ``rounded`` local rows,
    and all of them within 1 of the float64 oracle's bounds (tests/oracles/moe_oracle.py),
    given each rank's (exact local rows, magnitude, additions) of ``exact``."""
    residual, gamma = case["residual"], case["gamma"]
    s, residual_out = mo.epilogue_rounded(rounded, residual, dtype)
    for got, want in zip(outs[::2], (residual_out, s)):
        same_bits16(got, want)
    oracle = mo.epilogue64([e[0] for e in exact], residual, gamma, rms_eps=EPS, weight_bias=wb)
    magnitude = sum(e[1] for e in exact) + np.abs(np.asarray(residual, np.float64))
    roundings = len(exact) * (2 * exact[0][2] + 1) + len(exact)
    kw = dict(zip(("s64", "r64", "y64", "inv64"), oracle), gamma=gamma, weight_bias=wb)
    errs = mo.errors(outs, magnitude=magnitude, roundings=roundings, dtype_name=dtype, **kw)
    assert max(errs) <= 1.0, errs


def finalize_fn(ws, **kw):
    """(permuted, idx, residual, gamma, scale[, shared]) -> (residual_out, norm_out) of one
    finalize call on this rank's inputs; ``kw`` go to the call."""
    kw = dict(axis_name="tp", workspace=ws, rms_eps=EPS, **kw)

    def body(permuted, idx, residual, gamma, scale, shared=None):
        call = dict(residual=residual, rms_gamma=gamma, expert_scale_factor=scale, **kw)
        out = jf.moe_finalize_allreduce_fusion(permuted, idx, shared_expert_output=shared, **call)
        assert out.allreduce_out is None
        return out.residual_out, out.norm_out

    return body


def check_finalize(ws, case, dtype, *, use_scale=True, use_shared=True, routed=1.0, wb=0.0):
    """Runs the finalize call on ``ws`` with the kernel's rank-order sum and checks its
    outputs (check_outputs)."""
    scale = case["scale"] if use_scale else None
    shared = [sh if use_shared else None for sh in case["shared"]]
    kw = dict(routed_scaling_factor=routed, weight_bias=wb, fallback="kernel_exact")
    call = finalize_fn(ws, **kw)
    body = lambda p, i, sh, r, g: call(p[0], i[0], r, g, scale, sh[0] if use_shared else None)
    args = [stack_padded(case["permuted"]), *map(np.stack, (case["idx"], case["shared"]))]
    args += [case["residual"], case["gamma"]]
    outs = [np.asarray(o) for o in run_sharded(body, ws.mesh, RANKED3, (P(), P()), *args)]
    ranks = list(zip(case["permuted"], case["idx"], shared))
    kw = dict(scale=scale, routed=routed)
    rounded = [mo.finalize_local_rounded(p, i, dtype, shared=sh, **kw) for p, i, sh in ranks]
    exact = [mo.finalize_local64(p, i, scale, sh, routed) for p, i, sh in ranks]
    check_outputs(outs, case, dtype, rounded, exact, wb)


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
    case = finalize_case(
        np.random.default_rng(tokens * 131 + hidden + top_k), *case_args[:6], pad=1
    )
    ws = workspace(world, dtype, tokens=tokens, hidden=hidden)
    check_finalize(ws, case, dtype, use_scale=use_scale, use_shared=use_shared, routed=routed)


def test_finalize_all_slots_dropped_and_gemma_bias():
    case = finalize_case(np.random.default_rng(5), 2, "bfloat16", 4, 256, 2, 4)
    case["idx"][0][1] = case["idx"][1][1] = -1  # token 1 dropped on every rank
    ws = workspace(2, "bfloat16", tokens=4, hidden=256)  # only shared + residual remain
    check_finalize(ws, case, "bfloat16", wb=1.0)


REDUCTION_INPUTS = ("expert_outputs", "expert_scales", "token_input")


def run_reduction(ws, case, *, return_allreduce_out=True, fallback="kernel_exact"):
    """The call's outputs: residual_out, norm_out [, allreduce_out]. The default fallback is
    the kernel's rank-order sum, checked bit for bit."""
    kw = dict(axis_name="tp", workspace=ws, rms_eps=EPS, fallback=fallback)
    kw.update(return_allreduce_out=return_allreduce_out)

    def body(x, s, tok, r, g):
        out = jf.moe_reduction_allreduce_fusion(x[0], s[0], tok[0], residual=r, rms_gamma=g, **kw)
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
    shape = dict(tokens=tokens, experts=experts, world=world, hidden=hidden)
    case = mo.random_reduction_case(rng, dtype_name=dtype, **shape)
    outs = run_reduction(workspace(world, dtype, tokens=tokens, hidden=hidden), case)
    ranks = list(zip(*(case[k] for k in REDUCTION_INPUTS)))
    rounded = [mo.reduction_local_rounded(*r, dtype) for r in ranks]
    check_outputs(outs, case, dtype, rounded, [mo.reduction_local64(*r) for r in ranks])


def test_reduction_without_allreduce_out():
    shape = dict(tokens=2, experts=2, world=2, hidden=256)
    case = mo.random_reduction_case(np.random.default_rng(1), dtype_name="bfloat16", **shape)
    ws = workspace(2, "bfloat16", tokens=2, hidden=256)
    with_ar = run_reduction(ws, case)
    # The default fallback (the psum in the rows' dtype) is exact for 2 ranks too.
    outs = run_reduction(ws, case, return_allreduce_out=False, fallback="xla")
    assert len(outs) == 2
    for a, b in zip(outs, with_ar[:2]):
        same_bits16(a, b)


# --- transformations ---------------------------------------------------------------------------


def test_vmap_and_nd_equal_per_element_calls():
    world, dtype, hidden, tokens, top_k = 2, "bfloat16", 256, 3, 2
    rng = np.random.default_rng(7)
    cases = [finalize_case(rng, world, dtype, tokens, hidden, top_k, 4) for _ in range(3)]
    # [world, case, rows, hidden], every buffer padded to the longest of all
    flat = stack_padded([c["permuted"][r] for r in range(world) for c in cases])
    permuted = flat.reshape(world, len(cases), *flat.shape[1:])
    idx = np.stack([np.stack([c["idx"][r] for c in cases]) for r in range(world)])
    residual, scale = (np.stack([c[k] for c in cases]) for k in ("residual", "scale"))
    ws = workspace(world, dtype, tokens=3 * tokens, hidden=hidden)
    body = finalize_fn(ws)
    batched = lambda p, i, r, g, s: jax.vmap(body, in_axes=(0, 0, 0, None, 0))(p[0], i[0], r, g, s)

    def looped(p, i, r, g, s):
        outs = [body(p[0, b], i[0, b], r[b], g, s[b]) for b in range(3)]
        return tuple(jnp.stack(o) for o in zip(*outs))

    args = (permuted, idx, residual, cases[0]["gamma"], scale)
    args = [put(ws.mesh, s, a) for s, a in zip(SPECS, args)]
    run = lambda f: jit_shard_map(f, ws.mesh, SPECS, (P(), P()))(*args)
    for a, b in zip(run(batched), run(looped)):
        same_bits16(a, b)


@pytest.mark.slow
def test_grad_equals_grad_of_the_reference():
    case = finalize_case(np.random.default_rng(11), 2, "float16", 4, 256, 2, 4)
    ws = workspace(2, "float16", tokens=4, hidden=256)
    ref = lambda p, i, r, g, s: moe_reference.moe_finalize_reference(
        p, i, r, g, axis_name="tp", expert_scale_factor=s, rms_eps=EPS
    )
    args = [stack_padded(case["permuted"]), np.stack(case["idx"])]
    args += [case[k] for k in ("residual", "gamma", "scale")]
    args = [put(ws.mesh, s, a) for s, a in zip(SPECS, args)]

    def grads(call):  # of permuted (per rank), residual, gamma and scale (summed over ranks)
        def loss(permuted, idx, residual, gamma, scale):
            r, n = call(permuted[0], idx[0], residual, gamma, scale)
            return r.astype(jnp.float32).sum() + (n.astype(jnp.float32) ** 2).sum()

        g = jax.grad(loss, argnums=(0, 2, 3, 4))
        f = lambda *a: tuple(x if k == 0 else jax.lax.psum(x, "tp") for k, x in enumerate(g(*a)))
        return jit_shard_map(f, ws.mesh, SPECS, (P("tp"), P(), P(), P()))(*args)

    for a, b in zip(grads(finalize_fn(ws)), grads(ref)):
        assert np.isfinite(np.asarray(a, np.float32)).all()
        same_bits16(a, b)


# --- the cuda lowering (kernel decision, custom call) on this GPU-less machine -----------------


def abstract_finalize_args(hidden, tokens=16, batch=()):
    """finalize_fn's arguments on 2 ranks as shapes; ``batch`` leading dims on all but gamma."""
    sds = jax.ShapeDtypeStruct
    permuted, idx = sds((2, *batch, 40, hidden), BF), sds((2, *batch, tokens, 8), jnp.int32)
    rows, scale = sds((*batch, tokens, hidden), BF), sds((*batch, tokens, 8), BF)
    return permuted, idx, rows, sds((hidden,), BF), scale


@pytest.mark.parametrize("hidden,kernel", [(7168, True), (4096, True), (2880, False)])
def test_cuda_lowering_uses_the_moe_custom_call(hidden, kernel):
    ws = workspace(2, "bfloat16", tokens=16, hidden=hidden, kernel=True)
    args = abstract_finalize_args(hidden)
    sharded = lambda **kw: jit_shard_map(
        lambda p, i, *a: finalize_fn(ws, **kw)(p[0], i[0], *a), ws.mesh, SPECS, (P(), P())
    )
    text = cuda_text(sharded(strict=False), *args)
    assert (moe.FFI_TARGET in text) == kernel
    if kernel:
        assert "has_expert_scale = true" in text and "has_shared_expert = false" in text
    else:
        with pytest.raises(ValueError, match="multiple of 256"):
            sharded(strict=True).trace(*args)


def test_vmap_beyond_the_workspace_maps_onto_the_kernel():
    # The op family's one batching rule: a batch the workspace cannot hold folded, where one
    # element fits, runs one kernel call per element (strict: a fallback would raise), as
    # for the dense op; the fold would leave the kernel for psum + RMSNorm.
    ws = workspace(2, "bfloat16", tokens=16, hidden=256, kernel=True)
    one = finalize_fn(ws, strict=True)
    body = lambda p, i, r, g, s: jax.vmap(one, in_axes=(0, 0, 0, None, 0))(p[0], i[0], r, g, s)
    f = jit_shard_map(body, ws.mesh, SPECS, (P(), P()))
    text = cuda_text(f, *abstract_finalize_args(256, 16, (3,)))
    assert moe.FFI_TARGET in text and "while" in text  # the kernel, in a loop over elements


# --- bad inputs --------------------------------------------------------------------------------


def bad(idx=((0, 1),), idx_dtype=np.int32, dtype=BF, gamma=np.ones(256, BF), **kw):
    """(permuted rows [4, 256], index map, options) of a finalize call, one of them bad."""
    return np.zeros((4, 256), dtype), np.array(idx, idx_dtype), dict(rms_gamma=gamma, **kw)


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
    """The op on every rank with the same (concrete, closed-over) index map."""
    permuted, idx, kw = make()
    ws = workspace(2, permuted.dtype, tokens=4, hidden=256)  # the rows' own dtype
    kw.update(axis_name="tp", workspace=ws, rms_eps=EPS)

    def body(p):
        out = jf.moe_finalize_allreduce_fusion(p[0], idx, **kw)
        return out.residual_out, out.norm_out

    with pytest.raises((ValueError, TypeError), match=match):
        jit_shard_map(body, ws.mesh, P("tp"), (P(), P()))(np.stack([permuted] * ws.world_size))


def test_reduction_bad_inputs_and_dense_entry_point_refuses_moe_codes():
    ws = workspace(2, "bfloat16", tokens=4, hidden=256)
    x, s32, tok = np.zeros((2, 3, 256), BF), np.zeros((2, 3), np.float32), np.zeros((3, 256), BF)
    kw = dict(axis_name="tp", workspace=ws, rms_gamma=np.ones(256, BF))
    body = lambda x, s, t: jf.moe_reduction_allreduce_fusion(x[0], s[0], t[0], **kw).norm_out
    f = jit_shard_map(body, ws.mesh, (P("tp"),) * 3, P())
    call = lambda *args: f(*(np.stack([a] * 2) for a in args))  # every rank the same inputs
    with pytest.raises(ValueError, match="expert_scales .*float32"):
        call(x, s32.astype(BF), tok)
    with pytest.raises(ValueError, match="expert_scales"):
        call(x, s32.T, tok)  # token-major: refused
    with pytest.raises(ValueError, match="expert_outputs"):
        call(np.zeros((2, 4, 256), BF), s32, tok)
    with pytest.raises(ValueError, match="has its own inputs"):
        dense = lambda x: jf.allreduce_fusion(x, axis_name="tp", workspace=ws, pattern=7)
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
    ws = workspace(2, "bfloat16", tokens=4, hidden=8448, kernel=True)
    plan = lambda strict: CallPlan(ws.backend, ws.sizes, strict, True)
    with pytest.raises(ValueError, match="1056 threads per block"):
        choose_moe_kernel(plan(True), 4, 8448, "bfloat16")
    assert not choose_moe_kernel(plan(False), 4, 8448, "bfloat16")
    assert choose_moe_kernel(plan(True), 4, 8192, "bfloat16")
