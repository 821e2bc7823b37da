"""GPU body of the MoE kernels' bounded waits (timeout_s; ffi/core/watchdog.h): two ranks in
two processes, each with a torch_compat workspace (kernel_timeout_s=TIMEOUT_S, the handshake
off), one case per run, because a trapped kernel kills the CUDA context of its process.

  never_finalize   GOOD_FIRST good pattern-7 calls (MoE finalize), checked against the
                   float64 oracle; then rank 1 makes no call and rank 0's pattern-7 call
                   must fail within TIMEOUT_S + 1 s, its record naming rank 1, and the next
                   launch (native and through torch_compat) must be refused with the record.
  never_reduction  the same with pattern 6 (MoE reduction).

Ranks take GPU harness.device_for(rank): with one GPU both ranks share it (the waiting rank
spins, traps and fails alone; the rank that made no call stays healthy). Where the GPU
driver never reports rank 0's trap (jax_fusedar/common/lost_traps.py), the watcher ends
rank 0's process (exit code lost_traps.EXIT_CODE, the record on stderr) lost_traps.GRACE_S
after the record appeared; what rank 0 knew before its failing call is noted to the harness
first (``chan.note``), and rank 1 waits for its verdict AFTER_FAILURE_WAIT_S at most.

Run one case by hand:  python -m tests.gpu.workers.moe_timeout never_finalize
The last stdout line is "RESULT <json>".
"""

from __future__ import annotations

import sys
import time

from tests.gpu.workers.common import case_of, error_text, new_seed, print_result

import numpy as np

TIMEOUT_S = 3.0
GOOD_FIRST = 3  # good calls both ranks make first
MAX_TOKENS = 64
HIDDEN = 4096
TOKENS = 16
CASES = {"never_finalize": 7, "never_reduction": 6}


def moe_case(pattern):
    """A case tuple of tests.gpu.workers.moe_gpu (its inputs and oracle): bf16, TOKENS x HIDDEN;
    pattern 7: top-4 of 16 experts with router weights and a shared expert; pattern 6: 4
    experts per rank."""
    if pattern == 7:
        return (7, "bfloat16", TOKENS, HIDDEN, 4, 16, True, True, 1.0)
    return (6, "bfloat16", TOKENS, HIDDEN, 4, 4, None, None, None)


def _inputs(c, seed):
    """Fresh random inputs of case ``c`` for every rank (the same in every process)."""
    from tests.gpu.workers.moe_gpu import case_inputs

    return case_inputs(c, np.random.default_rng(seed))


class _Call:
    """One MoE call of rank ``rank`` on device ``dev``: its tensors (outputs poisoned with
    NaN), the torch_compat call, and the same call through the native Rank."""

    def __init__(self, c, inputs, rank, dev, torch):
        from tests.gpu.workers.moe_gpu import EPS, to_device

        self.c, self.inputs, self.torch, self.eps = c, inputs, torch, EPS

        def to_t(a):
            return to_device(torch, a, dev)

        self.res_in, self.gamma = to_t(inputs["residual"]), to_t(inputs["gamma"])
        self.norm = torch.full_like(self.res_in, float("nan"))
        self.res_out = torch.full_like(self.res_in, float("nan"))
        if c[0] == 7:
            self.permuted = to_t(inputs["permuted"][rank])
            self.idx = torch.from_numpy(inputs["idx"][rank]).to(dev)
            self.scale = to_t(inputs["scale"])
            self.shared = to_t(inputs["shared"][rank])
        else:
            e, t, h = c[5], c[2], c[3]
            self.expert_scales = torch.from_numpy(inputs["expert_scales"][rank]).to(dev)
            self.expert_outputs = to_t(inputs["expert_outputs"][rank]).reshape(e * t, h)
            self.token_input = to_t(inputs["token_input"][rank])
            self.ar = torch.full_like(self.res_in, float("nan"))

    def torch_compat(self, ws):
        import torch_compat as tc

        if self.c[0] == 7:
            tc.allreduce_fusion(
                workspace=ws,
                pattern=7,
                input=self.permuted,
                expanded_idx_to_permuted_idx=self.idx,
                expert_scale_factor=self.scale,
                shared_expert_output=self.shared,
                residual_in=self.res_in,
                rms_gamma=self.gamma,
                residual_out=self.res_out,
                norm_out=self.norm,
                rms_eps=self.eps,
                launch_with_pdl=True,
            )
        else:
            tc.allreduce_fusion(
                self.res_in,
                ws,
                6,
                moe_reduction_device_num_experts=self.c[5],
                moe_reduction_scale_input=self.expert_scales,
                moe_reduction_active_experts_token_input=self.expert_outputs,
                moe_reduction_token_input=self.token_input,
                residual_in=self.res_in,
                rms_gamma=self.gamma,
                residual_out=self.res_out,
                norm_out=self.norm,
                output=self.ar,
                rms_eps=self.eps,
                launch_with_pdl=True,
            )

    def native(self, ws, stream):
        """The same launch through the native Rank (fusedar_moe_launch), no Python checks."""
        from jax_fusedar.common import native

        common = dict(
            residual_in=self.res_in.data_ptr(),
            residual_out=self.res_out.data_ptr(),
            norm_out=self.norm.data_ptr(),
            rms_gamma=self.gamma.data_ptr(),
            rms_eps=self.eps,
            weight_bias=0.0,
            launch_with_pdl=True,
            stream=stream.cuda_stream,
        )
        code = native.DTYPE_CODES["bfloat16"]
        t, h = self.c[2], self.c[3]
        if self.c[0] == 7:
            ws.native_rank().moe_launch(
                7,
                code,
                t,
                h,
                permuted_input=self.permuted.data_ptr(),
                num_permuted_rows=self.permuted.shape[0],
                expanded_idx_to_permuted_idx=self.idx.data_ptr(),
                top_k=self.idx.shape[1],
                expert_scale_factor=self.scale.data_ptr(),
                shared_expert_output=self.shared.data_ptr(),
                routed_scaling_factor=1.0,
                **common,
            )
        else:
            ws.native_rank().moe_launch(
                6,
                code,
                t,
                h,
                num_experts=self.c[5],
                expert_scales=self.expert_scales.data_ptr(),
                expert_outputs=self.expert_outputs.data_ptr(),
                token_input=self.token_input.data_ptr(),
                allreduce_out=self.ar.data_ptr(),
                **common,
            )

    def oracle_errors(self):
        """Fractions of the float64 oracle's bounds (<= 1 passes; NaN: an unwritten output)."""
        from tests.gpu.workers.moe_gpu import oracle_errors

        dtype = self.inputs["residual"].dtype
        outs = [self.res_out, self.norm] + ([self.ar] if self.c[0] == 6 else [])
        arrays = [o.cpu().view(self.torch.int16).numpy().view(dtype) for o in outs]
        return oracle_errors(self.c, self.inputs, arrays)


def worker(rank, world, chan, *, case, seed, port):
    from tests.gpu.harness import device_for
    from tests.gpu.workers.common import init_gloo
    from tests.gpu.workers.native_mismatch import await_verdict, check_untouched, flush_c_stdio

    device = device_for(rank)
    torch, dist = init_gloo(rank, world, port, device)
    import torch_compat as tc

    pattern = CASES[case]
    c = moe_case(pattern)
    result = {
        "rank": rank,
        "device": device,
        "case": case,
        "pattern": pattern,
        "gpu": torch.cuda.get_device_name(device),
    }
    ws = tc.create_allreduce_fusion_workspace(
        "trtllm",
        world,
        rank,
        MAX_TOKENS,
        HIDDEN,
        torch.bfloat16,
        group=dist.group.WORLD,
        handshake=False,
        kernel_timeout_s=TIMEOUT_S,
    )
    result["timeout_s"] = ws.timeout_s
    stream = torch.cuda.current_stream(device)
    good = []
    for i in range(GOOD_FIRST):
        call = _Call(c, _inputs(c, seed + i), rank, device, torch)
        call.torch_compat(ws)
        stream.synchronize()
        good.append(call.oracle_errors())
    result["good"] = good
    chan.barrier("good")
    if rank == 0:
        # Kept by the harness if this process ends without a result (a lost trap).
        chan.note(timeout_s=result["timeout_s"], good=good, failing_call_at=time.monotonic())
        call = _Call(c, _inputs(c, seed + 999), rank, device, torch)
        f = {}
        t0 = time.monotonic()
        call.torch_compat(ws)
        f["sync_error"] = error_text(stream.synchronize, 600)
        f["elapsed_s"] = time.monotonic() - t0
        flush_c_stdio()
        f["failure_record"] = ws.failure()
        # The next launch must be refused with the recorded text: by the core (the raw
        # entry, no Python check before it) and through torch_compat.
        f["relaunch_error"] = error_text(lambda: call.native(ws, stream), 1500)
        f["torch_compat_error"] = error_text(lambda: call.torch_compat(ws), 1500)
        result["failing"] = f
    await_verdict(chan, result, "verdict")  # rank 1 makes no call until rank 0 has its verdict
    if rank == 1:
        check_untouched(result, ws, device, torch)
    flush_c_stdio()
    if "peer_gone" not in result:  # rank 0 hosts the store: leave a gone peer's group be
        dist.destroy_process_group()
    return result


def main(argv):
    from tests.gpu.harness import free_port
    from tests.gpu.workers.native_timeout import run_ranks_allowing_death

    case, _ = case_of(argv[:2], CASES, "never_finalize")
    seed = new_seed()
    print_result(
        {"case": case, "seed": seed, "timeout_s": TIMEOUT_S},
        "ranks",
        lambda: run_ranks_allowing_death(
            worker, 2, timeout_s=120, case=case, seed=seed, port=free_port()
        ),
    )


if __name__ == "__main__":
    main(sys.argv)
