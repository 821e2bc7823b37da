"""The fusion pass on Hugging Face's norm classes (``LlamaRMSNorm``, ``Qwen2RMSNorm``), which
round the normalized value to the activation dtype before the gamma multiply, unlike the
fused op: left as written by default (bit-identical, the reason per block); fused with
``allow_rounding_change=True``, naming the change, within docs/torch.md's bound against
float64. vLLM's classes: tests/torch/frameworks/."""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from tests.torch import rounding_check as rc
from tests.torch.test_library import fake_workspace

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm  # noqa: E402

M, H, EPS = 64, 1024, 1e-6
CLASSES = {"LlamaRMSNorm": LlamaRMSNorm, "Qwen2RMSNorm": Qwen2RMSNorm}
workspace = functools.partial(fake_workspace, max_tokens=M, hidden=H)  # takes the dtype


def _module_norm(cls, dtype):
    mod = cls(H, eps=EPS).to(dtype)

    def norm(r, gamma):  # the module's forward with gamma as a graph input (as dynamo has it)
        return functional_call(mod, {"weight": gamma}, (r,))

    return norm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cls", list(CLASSES), ids=list(CLASSES))
def test_hf_norm_is_left_alone_by_default_and_keeps_the_bound_opted_in(gloo_world1, cls, dtype):
    fn = rc.block_fn(gloo_world1, _module_norm(CLASSES[cls], dtype))
    name = rc.NAMES[dtype]
    change = f"gamma multiplied in {name} after the norm is rounded to {name}"
    args = rc.inputs(M, H, dtype, seed=1)
    blocks, unfused, after = rc.run_block(fn, workspace(dtype=dtype), args, allow=False)
    assert len(blocks) == 1 and not blocks[0].fused and change in blocks[0].reason
    for a, b in zip(unfused, after):
        assert torch.equal(a, b)
    ws = workspace(dtype=dtype)
    worst = 0.0
    for seed in range(3):  # fresh inputs each time
        args = rc.inputs(M, H, dtype, seed=10 + seed)
        blocks, unfused, fused = rc.run_block(fn, ws, args, allow=True)
        assert [b.fused for b in blocks] == [True] and blocks[0].rounding_change == change
        m = rc.measure(unfused, fused, args, EPS, dtype)
        rc.assert_within_bound(m, changes=1)
        worst = max(worst, m["fused_vs_unfused_units"])
        # The change is real: a tenth or more of the elements move (12-23% measured).
        assert m["differing"] > 0.05, m
    assert worst > 0.0


def _f32_gamma_norm(r, gamma):  # gamma kept in float32: the kernel reads it in T
    rf = r.float()
    return (rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + EPS) * gamma.float()).to(r.dtype)


def test_exact_forms_next_to_hf_forms_are_bit_exact(gloo_world1):
    # The one-rounding forms are fused by default and give the original's bits, including
    # gamma's float32 cast of a bf16 gamma (the cast keeps its value).
    dtype = torch.bfloat16
    args = rc.inputs(M, H, dtype, seed=3)
    for norm in (lambda r, g: F.rms_norm(r, (H,), g, EPS), _f32_gamma_norm):
        fn = rc.block_fn(gloo_world1, norm)
        blocks, unfused, fused = rc.run_block(fn, workspace(dtype=dtype), args, allow=False)
        assert [(b.fused, b.rounding_change) for b in blocks] == [(True, None)]
        for a, b in zip(unfused, fused):
            assert torch.equal(a, b)


def _fused_add_form(t, residual, gamma):  # the form of vLLM's fused_add_rms_norm, by hand
    x = t.to(torch.float32) + residual.to(torch.float32)
    residual_out = x.to(t.dtype)
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + EPS)
    return (x.to(gamma.dtype) * gamma).to(t.dtype), residual_out


def test_float32_residual_add_is_two_changes(gloo_world1):
    dtype = torch.bfloat16
    fn = rc.block_fn(gloo_world1, _fused_add_form, residual_arg=True)
    ws = workspace(dtype=dtype)
    args = rc.inputs(M, H, dtype, seed=7)
    blocks, unfused, after = rc.run_block(fn, ws, args, allow=False)
    assert not blocks[0].fused and "residual added in float32" in blocks[0].reason
    assert "gamma multiplied in bfloat16" in blocks[0].reason
    assert all(torch.equal(a, b) for a, b in zip(unfused, after))
    blocks, unfused, fused = rc.run_block(fn, ws, args, allow=True)
    assert blocks[0].fused
    assert blocks[0].rounding_change == (
        "the norm reads the residual sum rounded to bfloat16; gamma multiplied in bfloat16 "
        "after the norm is rounded to bfloat16"
    )
    rc.assert_within_bound(rc.measure(unfused, fused, args, EPS, dtype), changes=2)
