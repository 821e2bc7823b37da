"""Run in the framework venv (venv.py) by test_vllm.py and test_sglang.py: vLLM 0.33.0's or
SGLang 0.5.23's own modules (``check.py vllm|sglang``) on torch_compat installed as
flashinfer, on CPU; prints one JSON object of what it found. Stand-ins (no engine or server):
vLLM's compiled ops; SGLang's is_flashinfer_available (which also asks for CUDA); for the
served call, the workspace in the framework's lookup, and its TP-rank/group lookups (no
parallel state here). Importing this file runs nothing."""

import json
import logging
import sys
import types

import torch
import torch.distributed as dist

import torch_compat
from torch_compat import cuda_state


def setup():
    """(the shim's flashinfer.comm, the one-rank gloo WORLD group)."""
    comm = torch_compat.install_as_flashinfer()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cuda_state.current_stream = lambda device: 0xC0FFEE
    return comm, dist.group.WORLD


def recorded(logger):
    """The list of every message ``logger`` logs from now on."""
    records = []
    keep = logging.Handler()
    keep.emit = lambda record: records.append(record.getMessage())
    logger.addHandler(keep)
    return records


def served_inputs():
    """(a 2-rank workspace over a recording FakeRank, (x, residual, gamma) of 16 tokens)."""
    from tests.torch import rounding_check as rc
    from tests.torch.fakes import fake_workspace

    ws = fake_workspace(world=2, max_tokens=64, hidden=1024)
    return ws, rc.inputs(16, 1024, torch.bfloat16, seed=0)


def served(call, ws, x, flags):
    """The last launch on ``ws`` after ``call()`` (which returns {key: (launch argument,
    tensor)}): whether each such argument is its tensor, the ``flags`` arguments; or the error."""
    try:
        pointers = call()
        args, kw = ws._rank_obj.launches[-1]
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {"error": f"{type(e).__name__}: {e}"}
    out = dict(launches=len(ws._rank_obj.launches), pattern=args[0], tokens=args[2])
    out.update(hidden=args[3], input_is_x=args[4] == x.data_ptr())
    out.update({key: kw[name] == t.data_ptr() for key, (name, t) in pointers.items()})
    return out | {f: kw[f] for f in flags}


# vLLM's compiled ops (its CUDA extension, which does not load on CPU): the fusion modules
# only name them at import (pattern tables), so stand-ins with a schema and no kernel do.
STAND_IN_OPS = """
    rotary_embedding static_scaled_fp8_quant dynamic_scaled_fp8_quant
    dynamic_per_token_scaled_fp8_quant fused_add_rms_norm rms_norm rms_norm_static_fp8_quant
    fused_add_rms_norm_static_fp8_quant rms_norm_dynamic_per_token_quant silu_and_mul
""".split()


def vllm(comm, group):
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
    records = recorded(far.logger)
    created = far._create_workspace("trtllm", 1, 0, 64, 1024, torch.bfloat16, group)
    out["create_returned"] = None if created is None else type(created).__name__
    out["create_log"] = records[-1] if records else None

    # 2. vLLM's fused all-reduce + RMSNorm call (the op its pass emits), served by torch_compat.
    ws, (x, res, gamma) = served_inputs()
    arf.get_fi_ar_workspace = lambda **kw: ws
    arf.get_fi_ar_quant_workspace = lambda **kw: ws
    arf.get_tensor_model_parallel_rank = lambda: 0
    arf.get_tp_group = lambda: types.SimpleNamespace(cpu_group=group)

    def call():
        kw = dict(allreduce_in=x, residual=res, rms_gamma=gamma, rms_eps=1e-6, world_size=2)
        kw.update(launch_with_pdl=True, fp32_acc=True, max_token_num=64)
        pattern = comm.AllReduceFusionPattern.kARResidualRMSNorm
        arf.call_trtllm_fused_allreduce_norm(**kw, pattern_code=pattern)
        # vLLM writes in place: norm_out over the input, residual_out over the residual.
        return {"norm_out_is_x": ("norm_out", x), "residual_out_is_res": ("residual_out", res)}

    out["served"] = served(call, ws, x, ("fp32_acc", "launch_with_pdl"))
    if "--norms" in sys.argv[1:]:
        out["norms"] = norms(group)
    return out


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


def sglang(comm, group):
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
    records = recorded(m.logger)
    mgr = m.FlashInferWorkspaceManager()
    try:
        kw = dict(world_size=2, rank=0, max_token_num=64, hidden_dim=1024, backend="trtllm")
        mgr.initialize(**kw, group=group, dtype=torch.bfloat16, device_group=group, cpu_group=group)
        out["create"] = {"workspace": repr(mgr.workspace), "log": records[-3:]}
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["create"] = {"error": f"{type(e).__name__}: {e}", "log": records[-3:]}

    # 2. SGLang's fused all-reduce + residual + RMSNorm op, served by torch_compat.
    ws, (x, res, gamma) = served_inputs()
    served_mgr = m._get_workspace_manager(True)
    served_mgr.workspace, served_mgr.initialized, served_mgr.world_size = ws, True, 2
    served_mgr.rank, served_mgr.backend, served_mgr.group = 0, "trtllm", (group, group)
    served_mgr.max_token_num, served_mgr.hidden_dim, served_mgr.dtype = 64, 1024, torch.bfloat16
    served_mgr._configure_workspace_size_check()
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
    out["served"] = served(call, ws, x, flags)
    return out


if __name__ == "__main__":
    print(json.dumps({"vllm": vllm, "sglang": sglang}[sys.argv[1]](*setup())))
