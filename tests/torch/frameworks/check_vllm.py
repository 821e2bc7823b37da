"""Run in the framework venv (venv.py) by test_vllm.py: vLLM 0.33.0's own modules on
torch_compat installed as flashinfer, on CPU. Prints one JSON object of what it found.

Stand-ins (CPU, no vLLM engine; stand_ins.py): vLLM's compiled ops; for the served call, the
workspace returned by vLLM's get_fi_ar_workspace, and vLLM's TP-rank/group lookups (no
parallel state here)."""

import json
import sys
import types

import torch

from tests.torch.frameworks import stand_ins

# vLLM's compiled ops (its CUDA extension, which does not load on CPU): the fusion modules
# only name them at import (pattern tables), so stand-ins with a schema and no kernel do.
STAND_IN_OPS = """
    rotary_embedding static_scaled_fp8_quant dynamic_scaled_fp8_quant
    dynamic_per_token_scaled_fp8_quant fused_add_rms_norm rms_norm rms_norm_static_fp8_quant
    fused_add_rms_norm_static_fp8_quant rms_norm_dynamic_per_token_quant silu_and_mul
""".split()


def main():
    comm, group = stand_ins.setup()
    lib = torch.library.Library("_C", "FRAGMENT")
    for name in STAND_IN_OPS:
        if not hasattr(torch.ops._C, name):
            lib.define(f"{name}(Tensor x) -> Tensor")

    from vllm.compilation.passes.fusion import allreduce_rms_fusion as arf
    from vllm.distributed.device_communicators import flashinfer_all_reduce as far

    out = {
        "pass_uses_shim": arf.flashinfer_comm is comm,
        "fused_op_registered": hasattr(torch.ops.vllm, "flashinfer_trtllm_fused_allreduce_norm"),
        "communicator_available": bool(far.fi_ar_available),
        "torch_dist_backend_is_ours": far.TorchDistBackend is comm.mnnvl.TorchDistBackend,
    }

    # 1. vLLM's own workspace creation, through the shim, on CPU: torch_compat's refusal.
    records = stand_ins.recorded(far.logger)
    created = far._create_workspace("trtllm", 1, 0, 64, 1024, torch.bfloat16, group)
    out["create_returned"] = None if created is None else type(created).__name__
    out["create_log"] = records[-1] if records else None

    # 2. vLLM's fused all-reduce + RMSNorm call (the op its pass emits), served by torch_compat.
    ws, (x, res, gamma) = stand_ins.served_inputs()
    arf.get_fi_ar_workspace = lambda **kw: ws
    arf.get_fi_ar_quant_workspace = lambda **kw: ws
    arf.get_tensor_model_parallel_rank = lambda: 0
    arf.get_tp_group = lambda: types.SimpleNamespace(cpu_group=group)

    def call():
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
        # vLLM writes in place: norm_out over the input, residual_out over the residual.
        return {"norm_out_is_x": ("norm_out", x), "residual_out_is_res": ("residual_out", res)}

    out["served"] = stand_ins.served(call, ws, x, ("fp32_acc", "launch_with_pdl"))
    if "--norms" in sys.argv[1:]:
        out["norms"] = norms(group)
    print(json.dumps(out))


def norms(group):
    """vLLM's RMSNorm class through make_fx and torch_compat's fusion pass (docs/torch.md)."""
    from vllm import ir
    from vllm.model_executor.layers.layernorm import RMSNorm

    from tests.torch import rounding_check as rc
    from tests.torch.test_library import fake_workspace as world1_workspace

    M, H, EPS = 64, 1024, 1e-6

    # RMSNorm.forward_native, vLLM's reference path, on the attributes RMSNorm.__init__ sets
    # (an instance needs a whole engine config to dispatch), the weight a graph input.
    def _self(w):
        flags = dict(pass_weight=True, pass_weight_add=True, has_weight=True)
        return types.SimpleNamespace(
            weight=w, variance_epsilon=EPS, variance_size_override=None, **flags
        )

    forms = {
        "rms_norm": (lambda r, w: RMSNorm.forward_native(_self(w), r), False),
        "fused_add": (lambda t, res, w: RMSNorm.forward_native(_self(w), t, res), True),
    }
    found = {}
    for dtype in (torch.bfloat16, torch.float16):
        for form, (norm, resid) in forms.items():
            fn = rc.block_fn(group, norm, residual_arg=resid)
            wsd = world1_workspace(max_tokens=M, hidden=H, dtype=dtype)
            rows = []
            # The IR ops' native forms, as vLLM lowers them (not its custom-op wrappers).
            with ir.enable_torch_wrap(False):
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
            found[f"{form}/{rc.NAMES[dtype]}"] = rows
    return found


if __name__ == "__main__":
    main()
