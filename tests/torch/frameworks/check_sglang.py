"""Run in the framework venv (venv.py) by test_sglang.py: SGLang 0.5.23's FlashInfer
all-reduce fusion module on torch_compat installed as flashinfer, on CPU. Prints one JSON
object of what it found.

Stand-ins (CPU, no SGLang server; stand_ins.py): SGLang's is_flashinfer_available (which also
asks for CUDA) answers yes; for the served call, the workspace in SGLang's own workspace
manager, and SGLang's TP-size lookup (no parallel state here)."""

import json

import torch

from tests.torch.frameworks import stand_ins


def main():
    comm, group = stand_ins.setup()
    import sglang.srt.utils as sglang_utils

    sglang_utils.is_flashinfer_available = lambda: True
    import sglang.srt.layers.flashinfer_comm_fusion as m

    out = {
        "module_uses_shim": m._flashinfer_comm is comm,
        "backend_subclasses_ours": issubclass(m._TorchDistBackend, comm.mnnvl.TorchDistBackend),
        "sees_group_kwarg": m._flashinfer_create_workspace_supports_group,
        "sees_comm_backend_kwarg": m._flashinfer_create_workspace_supports_comm_backend,
        "sees_trigger_completion": m._flashinfer_allreduce_supports_trigger_completion,
    }

    # 1. SGLang's workspace manager creating through the shim, on CPU.
    records = stand_ins.recorded(m.logger)
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
    ws, (x, res, gamma) = stand_ins.served_inputs()
    served = m._get_workspace_manager(True)
    served.workspace, served.initialized, served.world_size, served.rank = ws, True, 2, 0
    served.backend, served.group = "trtllm", (group, group)
    served.max_token_num, served.hidden_dim, served.dtype = 64, 1024, torch.bfloat16
    served._configure_workspace_size_check()
    m.resolve_fusion_world_size = lambda **kw: 2
    groups = type("C", (), {"device_group": group, "cpu_group": group})()
    m.resolve_fusion_group = lambda **kw: (2, 0, groups)
    # The server's --flashinfer-allreduce-fusion-backend: trtllm.
    m.resolve_flashinfer_allreduce_fusion_backend = lambda: "trtllm"
    m.uses_cutedsl_ar_fusion = lambda: False
    m._flashinfer_allreduce_unavailable = False

    def call():
        # The op's own Python body: SGLang registers the op for CUDA tensors only.
        body = m.flashinfer_allreduce_residual_rmsnorm.__wrapped__
        norm_out, residual_out = body(x, res, gamma, eps=1e-6, max_token_num=64)
        names = ("norm_out", norm_out), ("residual_out", residual_out), ("residual_in", res)
        return {name: (name, t) for name, t in names}

    flags = ("fp32_acc", "launch_with_pdl", "trigger_completion_at_end")
    out["served"] = stand_ins.served(call, ws, x, flags)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
