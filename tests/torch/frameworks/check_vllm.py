"""Run in the framework venv (venv.py) by test_vllm.py: vLLM 0.33.0's own modules on
torch_compat installed as flashinfer, on CPU. Prints one JSON object of what it found.

Stand-ins (CPU, no vLLM engine): a one-rank gloo group; the CUDA stream torch_compat reads
(cuda_state.current_stream); for the served call, a torch_compat workspace over a recording
native rank (tests/torch/test_torch_compat.py's FakeRank) returned by vLLM's
get_fi_ar_workspace, and vLLM's TP-rank/group lookups (no parallel state here)."""

import json
import logging
import sys
import types

import torch
import torch.distributed as dist

import torch_compat
from torch_compat import cuda_state

out = {}
comm = torch_compat.install_as_flashinfer()
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
group = dist.group.WORLD
cuda_state.current_stream = lambda device: 0xC0FFEE

# vLLM's compiled ops (its CUDA extension, which does not load on CPU): the fusion modules
# only name them at import (pattern tables), so stand-ins with a schema and no kernel do.
STAND_IN_OPS = """
    rotary_embedding static_scaled_fp8_quant dynamic_scaled_fp8_quant
    dynamic_per_token_scaled_fp8_quant fused_add_rms_norm rms_norm rms_norm_static_fp8_quant
    fused_add_rms_norm_static_fp8_quant rms_norm_dynamic_per_token_quant silu_and_mul
""".split()
_lib = torch.library.Library("_C", "FRAGMENT")
for _name in STAND_IN_OPS:
    if not hasattr(torch.ops._C, _name):
        _lib.define(f"{_name}(Tensor x) -> Tensor")

from vllm.compilation.passes.fusion import allreduce_rms_fusion as arf  # noqa: E402
from vllm.distributed.device_communicators import flashinfer_all_reduce as far  # noqa: E402

out["pass_uses_shim"] = arf.flashinfer_comm is comm
out["fused_op_registered"] = hasattr(torch.ops.vllm, "flashinfer_trtllm_fused_allreduce_norm")
out["communicator_available"] = bool(far.fi_ar_available)
out["torch_dist_backend_is_ours"] = far.TorchDistBackend is comm.mnnvl.TorchDistBackend

# 1. vLLM's own workspace creation, through the shim, on CPU: torch_compat's refusal.
records = []


class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())


far.logger.addHandler(Keep())
created = far._create_workspace("trtllm", 1, 0, 64, 1024, torch.bfloat16, group)
out["create_returned"] = None if created is None else type(created).__name__
out["create_log"] = records[-1] if records else None

# 2. vLLM's fused all-reduce + RMSNorm call (the op its pass emits), served by torch_compat.
from tests.torch import rounding_check as rc  # noqa: E402
from tests.torch.test_torch_compat import fake_workspace  # noqa: E402

ws = fake_workspace(world=2, max_tokens=64, hidden=1024)
arf.get_fi_ar_workspace = lambda **kw: ws
arf.get_fi_ar_quant_workspace = lambda **kw: ws
arf.get_tensor_model_parallel_rank = lambda: 0
arf.get_tp_group = lambda: types.SimpleNamespace(cpu_group=group)
x, res, gamma = rc.inputs(16, 1024, torch.bfloat16, seed=0)
try:
    arf.call_trtllm_fused_allreduce_norm(
        allreduce_in=x,
        residual=res,
        rms_gamma=gamma,
        rms_eps=1e-6,
        world_size=2,
        launch_with_pdl=True,
        fp32_acc=True,
        max_token_num=64,
        pattern_code=comm.AllReduceFusionPattern.kARResidualRMSNorm,
    )
    args, kw = ws._rank_obj.launches[-1]
    out["served"] = {
        "pattern": args[0],
        "tokens": args[2],
        "hidden": args[3],
        "input_is_x": args[4] == x.data_ptr(),
        # vLLM writes in place: norm_out over the input, residual_out over the residual.
        "norm_out_is_x": kw["norm_out"] == x.data_ptr(),
        "residual_out_is_res": kw["residual_out"] == res.data_ptr(),
        "fp32_acc": kw["fp32_acc"],
        "launch_with_pdl": kw["launch_with_pdl"],
    }
except Exception as e:  # noqa: BLE001 - reported to the test
    out["served"] = {"error": f"{type(e).__name__}: {e}"}

# 3. vLLM's RMSNorm class through make_fx and torch_compat's fusion pass (docs/torch.md).
if len(sys.argv) > 1 and sys.argv[1] == "--norms":
    from tests.torch.test_library import fake_workspace as world1_workspace
    from vllm import ir
    from vllm.model_executor.layers.layernorm import RMSNorm

    M, H, EPS = 64, 1024, 1e-6
    norms = {}
    for dtype in (torch.bfloat16, torch.float16):
        # RMSNorm.forward_native, vLLM's reference path, on the attributes RMSNorm.__init__
        # sets (an instance needs a whole engine config to dispatch), the weight a graph input.
        def _self(w):
            return types.SimpleNamespace(
                weight=w,
                variance_epsilon=EPS,
                variance_size_override=None,
                pass_weight=True,
                pass_weight_add=True,
                has_weight=True,
            )

        def plain(r, w):
            return RMSNorm.forward_native(_self(w), r)

        def with_residual(t, residual, w):
            return RMSNorm.forward_native(_self(w), t, residual)

        for form, norm, resid in (("rms_norm", plain, False), ("fused_add", with_residual, True)):
            key = f"{form}/{rc.NAMES[dtype]}"
            fn = rc.block_fn(group, norm, residual_arg=resid)
            wsd = world1_workspace(max_tokens=M, hidden=H, dtype=dtype)
            # The IR ops' native forms, as vLLM lowers them (not its custom-op wrappers).
            with ir.enable_torch_wrap(False):
                rows = []
                for seed in range(3):
                    args = rc.inputs(M, H, dtype, seed=20 + seed)
                    b0, u0, a0 = rc.run_block(fn, wsd, args, allow=False)
                    b1, u1, f1 = rc.run_block(fn, wsd, args, allow=True)
                    m = rc.measure(u1, f1, args, EPS, dtype)
                    m.update(
                        default_fused=[b.fused for b in b0],
                        default_reason=b0[0].reason,
                        default_bit_equal=all(torch.equal(p, q) for p, q in zip(u0, a0)),
                        opted_fused=[b.fused for b in b1],
                        change=b1[0].rounding_change,
                    )
                    rows.append(m)
            norms[key] = rows
    out["norms"] = norms

print(json.dumps(out))
