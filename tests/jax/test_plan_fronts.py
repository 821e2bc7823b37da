"""One plan per call: the JAX front and torch_compat reach identical plans (``common.plan``)
for every call of a grid of token counts, hidden sizes, modes, patterns and layouts, each
front asked through the function its op calls (JAX's ``call_plan.plan_dense`` / ``plan_moe``,
torch's ``ops.check_call`` / ``moe.check_moe_call`` on meta tensors). Where the kernel does not
serve, JAX plans its fallback and torch raises the plan's reason. Then each front's op is
checked to act on that plan."""

import functools
import itertools

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install '.[torch]')")

import jax  # noqa: E402
import jax.extend.core as jax_core  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_fusedar as jf  # noqa: E402
import torch_compat  # noqa: E402
from jax_fusedar.ops import plan as call_plan  # noqa: E402
from jax_fusedar.common import native, plan as rules  # noqa: E402
from jax_fusedar.common.patterns import DENSE_PATTERNS, MOE_PATTERNS, TRAITS  # noqa: E402
from jax_fusedar.common.patterns import AllReduceFusionPattern as Pattern  # noqa: E402
from torch_compat import cuda_state, moe, ops  # noqa: E402
from torch_compat.tensors import refusal  # noqa: E402

from tests.torch.test_torch_compat import fake_workspace  # noqa: E402

from tests.jax.test_api import trace_fused  # noqa: E402

MAX_TOKENS = 32768  # with hidden 1024 at world 2: 64 MiB per rank reaches the large-message path
WS_HIDDEN = 1024
# 1024 serves; 8200 and 16400 have an odd vector count per CTA above the launch limit
# (8200 is also no NVFP4 width); 4100 is no multiple of the MoE kernels' 256.
DENSE_HIDDEN = (1024, 8200, 16400)
MOE_HIDDEN = (1024, 4100, 8448)
GROUP = 8  # a per-token-group size every hidden size above divides, valid for both dtypes
MODES = (None, True, False)


def torch_workspace(world, dtype_name):
    """torch_compat's workspace on CPU, its native rank a fake that records the launches."""
    return fake_workspace(world, MAX_TOKENS, WS_HIDDEN, getattr(torch, dtype_name))


@functools.cache
def jax_workspace(world, dtype_name):
    mesh = jax.make_mesh((world,), ("tp",), devices=jax.devices()[:world])
    kw = dict(max_token_num=MAX_TOKENS, hidden_dim=WS_HIDDEN, dtype=jnp.dtype(dtype_name))
    return jf.abstract_workspace(mesh, "tp", backend="trtllm", **kw)


def _outcome(fn):
    """The plan ``fn`` returns, or the message of the ValueError it raises."""
    try:
        return fn()
    except ValueError as e:
        return f"ValueError: {e}"


def _meta(shape, dtype):
    return torch.empty(shape, dtype=dtype, device="meta")


def _torch_dense(ws, dtype_name, pattern, tokens, hidden, mode, layout):
    dtype, traits, kw = getattr(torch, dtype_name), TRAITS[pattern], {}
    if traits.has_residual:
        kw.update(residual_in=_meta((tokens, hidden), dtype), rms_gamma=_meta((hidden,), dtype))
    if traits.uses_scale_factor:
        kw["scale_factor"] = _meta((1,), torch.float32)
    if traits.quant == "fp4":
        kw["layout_code"] = layout
    if traits.quant == "group_fp8":
        kw["block_quant_group_size"] = GROUP
    return ops.check_call(_meta((tokens, hidden), dtype), ws, pattern, use_oneshot=mode, **kw).plan


def _jax_dense(ws, dtype_name, pattern, tokens, hidden, mode, layout, strict=False):
    group = GROUP * (TRAITS[pattern].quant == "group_fp8")
    kw = dict(strict=strict, layout=layout, group_size=group, use_oneshot=mode)
    return call_plan.plan_dense(ws, pattern, (tokens, hidden), dtype_name, **kw)[1]


def _check_agree(jax_outcome, torch_outcome, seen, prefix=""):
    """The outcomes agree (where JAX falls back, torch refuses with the plan's reason); adds
    what kind of outcome it was to ``seen``."""
    if isinstance(jax_outcome, rules.Plan) and not jax_outcome.kernel:
        assert torch_outcome == f"ValueError: {prefix}{refusal(jax_outcome)}"
    else:
        assert jax_outcome == torch_outcome
    seen.add(jax_outcome.kind if isinstance(jax_outcome, rules.Plan) else "error")


@pytest.mark.parametrize("world", [2, 4])
def test_both_fronts_plan_every_dense_call_alike(world):
    seen = set()
    counts = (0, 1, world, world + 1, 24576, MAX_TOKENS, MAX_TOKENS + 1)
    dtypes = ("bfloat16", "float32")
    grid = itertools.product(dtypes, DENSE_PATTERNS, counts, DENSE_HIDDEN, MODES, (0, 2))
    for dtype, pattern, tokens, hidden, mode, layout in grid:
        fp4 = TRAITS[pattern].quant == "fp4"
        if layout and not fp4 or fp4 and (dtype == "float32" or hidden % 16):
            continue  # layout 2 is NVFP4's; the rest is an argument error of both fronts
        args = (dtype, pattern, tokens, hidden, mode, layout)
        j = _outcome(lambda: _jax_dense(jax_workspace(world, dtype), *args))
        t = _outcome(lambda: _torch_dense(torch_workspace(world, dtype), *args))
        _check_agree(j, t, seen)
        if isinstance(j, rules.Plan) and j.kernel:
            seen.add(j.algorithm)
    # The grid reaches every outcome (the large-message path at world 2 only, where it is
    # measured faster).
    want = {None, "oneshot", "twoshot", "error", rules.EMPTY, rules.UNSUPPORTED_SHAPE}
    want |= {rules.TOO_SMALL} | ({"large"} if world == 2 else set())
    assert want <= seen, want - seen


def test_the_empty_call_is_one_answer_for_both_fronts():
    """0 tokens: the kernel has no launch for it (FlashInfer's launcher fails, the native
    core refuses an empty input), so the plan is "not served, empty"; torch refuses, as
    FlashInfer does, and JAX returns the empty result without a word, in strict mode too
    (it is exact and costs nothing: call_plan.SILENT)."""
    call = ("bfloat16", Pattern(1), 0, 1024, None, 0)
    j = _jax_dense(jax_workspace(2, "bfloat16"), *call)
    assert (j.kernel, j.kind) == (False, rules.EMPTY)
    assert [s.shape for s in j.outputs] == [(0, 1024), (0, 1024)]
    with pytest.raises(ValueError, match="empty"):
        _torch_dense(torch_workspace(2, "bfloat16"), *call)
    assert _jax_dense(jax_workspace(2, "bfloat16"), *call, strict=True) == j


def _torch_moe(ws, pattern, tokens, hidden, mode, allreduce_out):
    rows = lambda n: _meta((n, hidden), torch.bfloat16)
    kw = dict(residual_in=rows(tokens), rms_gamma=_meta((hidden,), torch.bfloat16))
    if pattern == Pattern.kMoEReductionARResidualRMSNorm:  # 2 experts
        kw.update(moe_reduction_device_num_experts=2, moe_reduction_token_input=rows(tokens))
        kw.update(moe_reduction_scale_input=_meta((2, tokens), torch.float32))
        kw.update(moe_reduction_active_experts_token_input=rows(2 * tokens))
        kw["output"] = rows(tokens) if allreduce_out else None
    else:
        kw.update(input=rows(2 * tokens + 1))
        kw["expanded_idx_to_permuted_idx"] = _meta((tokens, 2), torch.int32)
    return moe.check_moe_call(pattern, ws, use_oneshot=mode, **kw).plan


def _jax_moe(ws, pattern, tokens, hidden, mode, allreduce_out):
    if mode is False:  # JAX's MoE ops have no mode argument
        return rules.check_moe_mode(pattern, mode)
    kw = dict(strict=False, allreduce_out=allreduce_out)
    return call_plan.plan_moe(ws, pattern, (tokens, hidden), **kw)[1]


@pytest.mark.parametrize("world", [2, 4])
def test_both_fronts_plan_every_moe_call_alike(world):
    seen = set()
    counts = (0, 1, world + 1, MAX_TOKENS // 8, MAX_TOKENS + 1)
    grid = itertools.product(MOE_PATTERNS, counts, MOE_HIDDEN, MODES, (False, True))
    for pattern, tokens, hidden, mode, allreduce_out in grid:
        if allreduce_out and pattern != MOE_PATTERNS[0]:
            continue  # only the reduction (pattern 6) writes an optional allreduce_out
        args = (pattern, tokens, hidden, mode, allreduce_out)
        j = _outcome(lambda: _jax_moe(jax_workspace(world, "bfloat16"), *args))
        t = _outcome(lambda: _torch_moe(torch_workspace(world, "bfloat16"), *args))
        _check_agree(j, t, seen, prefix=f"{pattern.name}: ")
        if isinstance(j, rules.Plan):
            names = [s.name for s in j.outputs]
            assert names == ["residual_out", "norm_out"] + ["allreduce_out"] * allreduce_out
    assert {None, "error", rules.EMPTY, rules.UNSUPPORTED_SHAPE, rules.TOO_SMALL} <= seen


# --- each front acts on its plan ---------------------------------------------------------------


@pytest.fixture
def cpu_stream(monkeypatch):
    monkeypatch.setattr(cuda_state, "current_stream", lambda device: 0xC0FFEE)


@pytest.mark.parametrize("tokens, mode", [(1, None), (64, False), (64, True), (3, None)])
def test_torch_launches_the_plans_algorithm(cpu_stream, tokens, mode):
    ws = torch_workspace(2, "bfloat16")
    x, r = torch.randn(tokens, 1024).bfloat16(), torch.randn(tokens, 1024).bfloat16()
    kw = dict(residual_in=r, rms_gamma=torch.ones(1024).bfloat16(), use_oneshot=mode)
    decided = ops.check_call(x, ws, 1, **kw).plan
    outs = dict(residual_out=torch.empty_like(x), norm_out=torch.empty_like(x))
    torch_compat.allreduce_fusion(x, ws, 1, **outs, **kw)
    ((_, launch),) = ws.native_rank().launches
    assert decided.kernel and launch["algorithm"] == decided.algorithm_code


@pytest.mark.skipif(not native.available(), reason="binding a kernel call needs the native module")
@pytest.mark.parametrize("tokens, mode", [(1, None), (64, False), (24576, None), (0, None)])
def test_jax_binds_the_plans_decision(tokens, mode):
    ws = jax_workspace(2, "bfloat16")
    decided = _jax_dense(ws, "bfloat16", Pattern(1), tokens, 1024, mode, 0)
    jaxpr = trace_fused(ws, tokens, 1024, use_oneshot=mode).jaxpr
    (eqn,) = [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "jax_fusedar_allreduce_fusion"]
    assert eqn.params["use_kernel"] == decided.kernel
    assert eqn.params["algorithm"] == decided.algorithm_code
    assert [tuple(v.aval.shape) for v in eqn.outvars] == [s.storage_shape for s in decided.outputs]


def _eqns(jaxpr):
    for e in jaxpr.eqns:
        yield e
        for sub in jax_core.jaxprs_in_params(e.params):
            yield from _eqns(sub)
