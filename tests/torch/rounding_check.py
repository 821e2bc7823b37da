"""The fusion pass's rounding rule on a norm module (tests/torch/test_fusion_rounding.py;
vLLM's in tests/torch/frameworks/check.py): ``all_reduce -> + residual -> norm`` traced
with make_fx, run before and after the pass on the fused op's world-size-1 CPU stand-in, and
measured against float64. The bound is docs/torch.md's: per element ``|fused - original| <=
k * U``, ``U = ulp_T(|r|) * inv * |gamma| + ulp_T(|y|)`` (r the residual sum in T, inv and y
the float64 rsqrt and norm of r), k the block's rounding changes; and the fused output is
within half an ulp of y (one rounding of float32 math)."""

from __future__ import annotations

import numpy as np
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from tests.oracles.oracle import ulp

NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def ref_fused(input, residual, gamma, eps, weight_bias, use_oneshot, fp32_acc, handle):
    """The fused op's formula in torch's own float32 ops on CPU, world size 1."""
    from torch_compat import library

    library.lookup_workspace(handle)  # the handle must be live, as in the real kernel
    r = input + residual
    return r.clone(), rms_norm_f32(r, gamma, eps, weight_bias).to(input.dtype)


def rms_norm_f32(r, gamma, eps, weight_bias):
    """The fused op's RMSNorm of ``r`` in float32 math, before its one rounding."""
    rf = r.float()
    return rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps) * (weight_bias + gamma.float())


def oracle_quantize(pattern, y, scale_factor=None, group=None):
    """(codes as a uint8 tensor, the scale_out tensor or None): tests/oracles/quant_oracle.py's
    quantization of ``y`` (float32 numpy) for FP8 ``pattern``."""
    from jax_fusedar.common.patterns import TRAITS, AllReduceFusionPattern
    from tests.oracles import quant_oracle

    quant, s = TRAITS[AllReduceFusionPattern(pattern)].quant, None
    if quant == "fp8":
        q = quant_oracle.fp8_static(y, float(scale_factor.reshape(())))
    elif quant == "dynamic_fp8":
        q, s = quant_oracle.fp8_dynamic(y)
        s = torch.from_numpy(s)
    else:
        q, buf = quant_oracle.fp8_group(y, group)
        s = torch.from_numpy(buf)[:, : y.shape[0]].t()
    return torch.from_numpy(np.asarray(q)), s


def block_fn(group, norm, *, residual_arg: bool = False):
    """``(x, residual, gamma) -> (norm_out, residual_out)``: the all-reduce over ``group``,
    + residual, ``norm(r, gamma)``; with ``residual_arg`` ``norm(t, residual, gamma)`` adds
    the residual itself (vLLM's fused_add form)."""
    from torch.distributed import _functional_collectives as funcol

    def f(x, residual, gamma):
        t = funcol.all_reduce(x, "sum", group)
        if residual_arg:
            return norm(t, residual, gamma)
        r = t + residual
        return norm(r, gamma), r

    return f


def inputs(m, hidden, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, hidden, generator=g).to(dtype)
    res = torch.randn(m, hidden, generator=g).to(dtype)
    gamma = (0.5 + torch.rand(hidden, generator=g)).to(dtype)
    return x, res, gamma


def run_block(fn, ws, args, *, allow: bool):
    """(blocks, unfused outputs, outputs after the pass) for one fresh trace of ``fn``."""
    import torch_compat

    gm = make_fx(fn, tracing_mode="fake")(*args)
    code = gm.code
    unfused = gm(*args)
    blocks = []
    torch_compat.fuse_allreduce_rmsnorm(gm, ws, allow_rounding_change=allow, report=blocks)
    if not any(b.fused for b in blocks):
        assert gm.code == code  # left as written
    with torch.library._scoped_library("torch_compat", "IMPL") as lib:
        lib.impl("allreduce_residual_rmsnorm", ref_fused, "CPU")
        fused = gm(*args)
    return blocks, unfused, fused


def measure(unfused, fused, args, eps: float, dtype) -> dict:
    """The float64 measures of the bound (docs/torch.md) for one block's outputs."""
    name = NAMES[dtype]
    x, res, gamma = args
    r = (x + res).double().numpy()  # world size 1: the sum is x; the add in T, as the graph's
    g = gamma.double().numpy()
    inv = 1.0 / np.sqrt(np.mean(r * r, axis=-1, keepdims=True) + eps)
    y = r * inv * g
    unit = ulp(r, name) * inv * np.abs(g) + ulp(y, name)
    o, f = unfused[0].double().numpy(), fused[0].double().numpy()
    half = 0.5 * ulp(np.maximum(np.abs(y), np.abs(f)), name)
    return {
        "differing": float(np.mean(o != f)),
        "fused_vs_unfused_units": float(np.max(np.abs(f - o) / unit)),
        "fused_vs_f64_half_ulps": float(np.max(np.abs(f - y) / half)),
        "unfused_vs_f64_units": float(np.max(np.abs(o - y) / unit)),
        "residual_equal": bool(torch.equal(unfused[1], fused[1])),
    }


def assert_within_bound(m, changes):
    """``measure``'s ``m`` keeps the bound for ``changes`` rounding changes (above)."""
    assert m["residual_equal"], m
    assert m["fused_vs_f64_half_ulps"] <= 1.0 + 2.0**-6, m
    assert m["fused_vs_unfused_units"] <= changes, m
