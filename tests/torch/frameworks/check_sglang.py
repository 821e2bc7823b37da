"""Run in the framework venv (venv.py) by test_sglang.py: SGLang 0.5.23's FlashInfer
all-reduce fusion module on torch_compat installed as flashinfer, on CPU. Prints one JSON
object of what it found.

Stand-ins (CPU, no SGLang server): SGLang's is_flashinfer_available (which also asks for
CUDA) answers yes; a one-rank gloo group; the CUDA stream torch_compat reads; for the served
call, a torch_compat workspace over a recording native rank (FakeRank) in SGLang's own
workspace manager, and SGLang's TP-size lookup (no parallel state here)."""

import json
import logging

import torch
import torch.distributed as dist

import torch_compat
from torch_compat import cuda_state

out = {}
comm = torch_compat.install_as_flashinfer()
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
group = dist.group.WORLD
cuda_state.current_stream = lambda device: 0xC0FFEE

import sglang.srt.utils as sglang_utils  # noqa: E402

sglang_utils.is_flashinfer_available = lambda: True
import sglang.srt.layers.flashinfer_comm_fusion as m  # noqa: E402

out["module_uses_shim"] = m._flashinfer_comm is comm
out["backend_subclasses_ours"] = issubclass(m._TorchDistBackend, comm.mnnvl.TorchDistBackend)
out["sees_group_kwarg"] = m._flashinfer_create_workspace_supports_group
out["sees_comm_backend_kwarg"] = m._flashinfer_create_workspace_supports_comm_backend
out["sees_trigger_completion"] = m._flashinfer_allreduce_supports_trigger_completion

# 1. SGLang's workspace manager creating through the shim, on CPU.
records = []


class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())


m.logger.addHandler(Keep())
mgr = m.FlashInferWorkspaceManager()
try:
    mgr.initialize(
        world_size=2,
        rank=0,
        max_token_num=64,
        hidden_dim=1024,
        backend="trtllm",
        group=group,
        dtype=torch.bfloat16,
        device_group=group,
        cpu_group=group,
    )
    out["create"] = {"workspace": repr(mgr.workspace), "log": records[-3:]}
except Exception as e:  # noqa: BLE001 - reported to the test
    out["create"] = {"error": f"{type(e).__name__}: {e}", "log": records[-3:]}

# 2. SGLang's fused all-reduce + residual + RMSNorm op, served by torch_compat.
from tests.torch import rounding_check as rc  # noqa: E402
from tests.torch.test_torch_compat import fake_workspace  # noqa: E402

ws = fake_workspace(world=2, max_tokens=64, hidden=1024)
served = m._get_workspace_manager(True)
served.workspace, served.initialized, served.world_size, served.rank = ws, True, 2, 0
served.backend, served.group = "trtllm", (group, group)
served.max_token_num, served.hidden_dim, served.dtype = 64, 1024, torch.bfloat16
served._configure_workspace_size_check()
m.resolve_fusion_world_size = lambda **kw: 2
m.resolve_fusion_group = lambda **kw: (
    2,
    0,
    type("C", (), {"device_group": group, "cpu_group": group})(),
)
# The server's --flashinfer-allreduce-fusion-backend: trtllm.
m.resolve_flashinfer_allreduce_fusion_backend = lambda: "trtllm"
m.uses_cutedsl_ar_fusion = lambda: False
m._flashinfer_allreduce_unavailable = False
x, res, gamma = rc.inputs(16, 1024, torch.bfloat16, seed=0)
try:
    # The op's own Python body: SGLang registers the op for CUDA tensors only.
    body = m.flashinfer_allreduce_residual_rmsnorm.__wrapped__
    norm_out, residual_out = body(x, res, gamma, eps=1e-6, max_token_num=64)
    args, kw = ws._rank_obj.launches[-1]
    out["served"] = {
        "launches": len(ws._rank_obj.launches),
        "pattern": args[0],
        "tokens": args[2],
        "hidden": args[3],
        "input_is_x": args[4] == x.data_ptr(),
        "norm_out": kw["norm_out"] == norm_out.data_ptr(),
        "residual_out": kw["residual_out"] == residual_out.data_ptr(),
        "residual_in": kw["residual_in"] == res.data_ptr(),
        "fp32_acc": kw["fp32_acc"],
        "launch_with_pdl": kw["launch_with_pdl"],
        "trigger_completion_at_end": kw["trigger_completion_at_end"],
    }
except Exception as e:  # noqa: BLE001 - reported to the test
    out["served"] = {"error": f"{type(e).__name__}: {e}"}

print(json.dumps(out))
