"""torch_compat's MoE patterns (6, 7) on CPU: FlashInfer's arguments and return rules, the
native launch, every refused input, the custom ops' fake implementations (the kernels run in
tests/gpu/workers/moe_gpu.py)."""

import functools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_compat
from tests.torch import fakes
from tests.torch.fakes import fuse, refused, registered

P6 = torch_compat.AllReduceFusionPattern.kMoEReductionARResidualRMSNorm
P7 = torch_compat.AllReduceFusionPattern.kMoEFinalizeARResidualRMSNorm
BF, VT = torch.bfloat16, (ValueError, TypeError)
fake_workspace = functools.partial(fakes.fake_workspace, max_tokens=64, hidden=7168)
pytestmark = pytest.mark.usefixtures("cpu_stream")


def finalize_args(t=4, k=8, rows=40, h=7168, dtype=BF):
    idx = torch.randint(-1, rows, (t, k), dtype=torch.int32)
    return dict(
        input=torch.randn(rows, h).to(dtype),
        expanded_idx_to_permuted_idx=idx,
        expert_scale_factor=torch.rand(t, k).to(dtype),
        shared_expert_output=torch.randn(t, h).to(dtype),
        residual_in=torch.randn(t, h).to(dtype),
        rms_gamma=torch.ones(h, dtype=dtype),
    )


def reduction_args(e=3, t=4, h=7168, dtype=BF):
    return dict(
        input=torch.empty(0),
        moe_reduction_device_num_experts=e,
        moe_reduction_scale_input=torch.rand(e, t),
        moe_reduction_active_experts_token_input=torch.randn(e * t, h).to(dtype),
        moe_reduction_token_input=torch.randn(t, h).to(dtype),
        residual_in=torch.randn(t, h).to(dtype),
        rms_gamma=torch.ones(h, dtype=dtype),
    )


def test_finalize_allocates_outputs_returns_norm_out_and_launches_pattern_7():
    ws = fake_workspace()
    a = finalize_args()
    out = fuse(ws, P7, launch_with_pdl=True, **a)
    ((args, kw),) = ws.native_rank().moe_launches
    assert args[:4] == (7, 2, 4, 7168)
    assert kw["permuted_input"] == a["input"].data_ptr() and kw["num_permuted_rows"] == 40
    assert kw["top_k"] == 8 and kw["routed_scaling_factor"] == 1.0
    assert kw["expert_scale_factor"] == a["expert_scale_factor"].data_ptr()
    assert kw["norm_out"] == out.data_ptr() and kw["residual_out"] not in (0, out.data_ptr())
    assert kw["launch_with_pdl"] is True and kw["stream"] == 0xC0FFEE
    assert out.shape == a["residual_in"].shape and out.dtype == BF


def test_finalize_optional_inputs_and_routed_scaling():
    ws = fake_workspace()
    a = finalize_args()
    del a["expert_scale_factor"], a["shared_expert_output"]
    norm = torch.empty_like(a["residual_in"])
    assert fuse(ws, 7, norm_out=norm, routed_scaling_factor=2.5, **a) is norm
    ((_, kw),) = ws.native_rank().moe_launches
    assert kw["expert_scale_factor"] == 0 and kw["shared_expert_output"] == 0
    assert kw["routed_scaling_factor"] == 2.5


def test_reduction_needs_norm_out_writes_output_and_residual_out_when_given():
    ws = fake_workspace()
    a = reduction_args()
    norm, res, out = (torch.empty_like(a["residual_in"]) for _ in range(3))
    assert fuse(ws, P6, norm_out=norm, residual_out=res, output=out, **a) is norm
    ((args, kw),) = ws.native_rank().moe_launches
    assert args[:4] == (6, 2, 4, 7168) and kw["num_experts"] == 3
    got = (kw["allreduce_out"], kw["residual_out"], kw["norm_out"])
    assert got == (out.data_ptr(), res.data_ptr(), norm.data_ptr())
    # Without residual_out / output: null pointers (the kernel's template flags).
    fuse(ws, P6, norm_out=norm, **a)
    kw = ws.native_rank().moe_launches[-1][1]
    assert kw["allreduce_out"] == 0 and kw["residual_out"] == 0
    refused(ws, P6, "needs norm_out", **a)


def _with(base, **changes):
    """``base`` with ``changes``, a key changed to None left out."""
    return {k: v for k, v in (base | changes).items() if v is not None}


F = finalize_args(t=2, k=2, rows=4)
_idx = functools.partial(torch.tensor, dtype=torch.int32)


@pytest.mark.parametrize(
    "kw,match",
    [
        (_with(F, expanded_idx_to_permuted_idx=_idx([[0, 4], [1, -1]])), "holds 4.*4 rows"),
        (_with(F, expanded_idx_to_permuted_idx=_idx([[0, -3], [1, -1]])), "holds -3"),
        (_with(F, expanded_idx_to_permuted_idx=torch.zeros(2, 2, dtype=torch.int64)), "int32"),
        (_with(F, expanded_idx_to_permuted_idx=torch.zeros(3, 2, dtype=torch.int32)), "token_num"),
        (_with(F, expert_scale_factor=torch.rand(2, 2)), "expert_scale_factor"),
        (_with(F, shared_expert_output=torch.randn(2, 7168)), "shared_expert_output"),
        (_with(F, expanded_idx_to_permuted_idx=None), "needs expanded_idx_to_permuted_idx"),
        (_with(F, rms_gamma=None), "needs rms_gamma"),
        (_with(F, fp32_acc=True), "fp32_acc"),
        (_with(F, use_oneshot=False), "one-shot only"),
        (_with(F, use_oneshot="false"), "use_oneshot"),
        (_with(F, trigger_completion_at_end=False), "trigger_completion_at_end"),
        (_with(F, output=torch.empty(2, 7168, dtype=BF)), "does not write output"),
        (_with(F, quant_out=torch.empty(2, 3584, dtype=torch.uint8)), "FP4"),
        (_with(F, moe_finalize_backend="cake"), "moe_finalize_backend"),
        (_with(F, moe_reduction_device_num_experts=2), "does not take"),
        (_with(F, routed_scaling_factor=float("inf")), "routed_scaling_factor"),
    ],
)
def test_finalize_refuses(kw, match):
    refused(fake_workspace(), P7, match, VT, **kw)


def test_finalize_refuses_hidden_sizes_with_a_partial_warp_float32_and_big_calls():
    refused(fake_workspace(hidden=2880), 7, "multiple of 256", **finalize_args(h=2880))
    a = finalize_args(h=256)
    a = {k: (v.float() if torch.is_tensor(v) and v.dtype == BF else v) for k, v in a.items()}
    refused(fake_workspace(hidden=256), 7, "bfloat16 or float16", **a)
    refused(fake_workspace(max_tokens=2), 7, "does not fit the workspace", **finalize_args(t=4))


R = reduction_args(e=3, t=4)


@pytest.mark.parametrize(
    "kw,match",
    [
        (_with(R, moe_reduction_scale_input=torch.rand(4, 3)), r"\[num_experts, token_num\]"),
        (_with(R, moe_reduction_scale_input=torch.rand(3, 4).to(BF)), "float32"),
        (_with(R, moe_reduction_device_num_experts=0), ">= 1"),
        (_with(R, moe_reduction_device_num_experts=2.0), "moe_reduction_device_num_experts"),
        (
            _with(R, moe_reduction_active_experts_token_input=torch.randn(11, 7168).to(BF)),
            "active_experts",
        ),
        (_with(R, moe_reduction_token_input=torch.randn(4, 7168)), "moe_reduction_token_input"),
        (_with(R, moe_reduction_token_input=None), "needs moe_reduction_token_input"),
        (
            _with(R, expanded_idx_to_permuted_idx=torch.zeros(4, 1, dtype=torch.int32)),
            "does not take",
        ),
    ],
)
def test_reduction_refuses(kw, match):
    norm_out = torch.empty(4, 7168, dtype=BF)
    refused(fake_workspace(), P6, match, VT, norm_out=norm_out, **kw)


def test_dense_patterns_refuse_moe_arguments():
    x = torch.randn(4, 7168).to(BF)
    with pytest.raises(ValueError, match="apply to the MoE patterns"):
        torch_compat.allreduce_fusion(
            x, fake_workspace(), 0, expanded_idx_to_permuted_idx=torch.zeros(4, 1)
        )


def _finalize_op(a, handle, scale=None):
    """The pattern-7 custom op on finalize_args ``a`` (``scale``: its expert_scale_factor)."""
    scale = a["expert_scale_factor"] if scale is None else scale
    keys = ("input", "expanded_idx_to_permuted_idx", "residual_in", "rms_gamma")
    return torch.ops.torch_compat.moe_finalize_allreduce_residual_rmsnorm(
        *(a[k] for k in keys), scale, None, 1.0, 1e-6, 0.0, handle
    )


def test_custom_ops_fake_implementations_trace_and_refuse():
    with registered(fake_workspace()) as handle, FakeTensorMode():
        a = finalize_args()
        r, n = _finalize_op(a, handle)
        assert r.shape == n.shape == a["residual_in"].shape and n.dtype == BF
        b = reduction_args()
        keys = "moe_reduction_scale_input moe_reduction_token_input residual_in rms_gamma"
        outs = torch.ops.torch_compat.moe_reduction_allreduce_residual_rmsnorm(
            b["moe_reduction_active_experts_token_input"].view(3, 4, 7168),
            *(b[k] for k in keys.split()),
            1e-6,
            0.0,
            handle,
        )
        assert len(outs) == 3 and all(o.shape == (4, 7168) for o in outs)
        with pytest.raises(ValueError, match="expert_scale_factor"):
            _finalize_op(a, handle, scale=a["expert_scale_factor"].float())


def test_one_moe_rule_refuses_what_flashinfers_launcher_cannot_place():
    """Hidden 8448 is 33 warps per token: no cluster of 2, 4 or 8 CTAs divides them, so one
    CTA would need 1056 threads, which FlashInfer's launcher refuses inside the launch; JAX's
    trace-time rule (common.moe_limits) refuses it here, eagerly and in the fake impls."""
    ws = fake_workspace(hidden=8448)
    refused(ws, P7, "1056 threads per block", **finalize_args(h=8448))
    norm_out = torch.empty(4, 8448, dtype=BF)
    refused(ws, P6, "1056 threads per block", norm_out=norm_out, **reduction_args(h=8448))
    assert not ws.native_rank().moe_launches
    with registered(ws) as handle, FakeTensorMode():
        a = finalize_args(h=8448)
        with pytest.raises(ValueError, match="1056 threads per block"):
            _finalize_op(a, handle)
