"""GPU body of the MoE kernels' bounded waits (timeout_s; ffi/core/watchdog.h): two ranks in
two processes, each with a torch_compat workspace (kernel_timeout_s=TIMEOUT_S, the handshake
off), one case per run, because a trapped kernel kills the CUDA context of its process.

  never_finalize   GOOD_FIRST good pattern-7 calls (MoE finalize) against the float64 oracle;
                   then rank 1 makes no call and rank 0's pattern-7 call must fail within
                   TIMEOUT_S + 1 s, its record naming rank 1, the next launch (native and
                   through torch_compat) refused with the record.
  never_reduction  the same with pattern 6 (MoE reduction).

Ranks take GPU harness.device_for(rank): with one GPU both share it (the waiting rank traps
alone; the other stays healthy). Where the driver never reports rank 0's trap (lost_traps.py),
the watcher ends rank 0 (exit code lost_traps.EXIT_CODE, the record on stderr), having noted
what it knew before the failing call (``chan.note``); rank 1 waits AFTER_FAILURE_WAIT_S.

Run one case by hand:  python -m tests.gpu.workers.moe_timeout never_finalize
The last stdout line is "RESULT <json>".
"""

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
    """A moe_gpu case, bf16, TOKENS x HIDDEN: pattern 7 top-4 of 16 experts with router weights
    and a shared expert; pattern 6 with 4 experts per rank."""
    if pattern == 7:
        return (7, "bfloat16", TOKENS, HIDDEN, 4, 16, True, True, 1.0)
    return (6, "bfloat16", TOKENS, HIDDEN, 4, 4, None, None, None)


def _inputs(c, seed):
    """Fresh random inputs of case ``c`` for every rank (the same in every process)."""
    from tests.gpu.workers.moe_gpu import case_inputs

    return case_inputs(c, np.random.default_rng(seed))


class _Call:
    """One MoE call of rank ``rank``: its tensors (moe_gpu.case_tensors), through torch_compat
    and through the native Rank."""

    def __init__(self, c, inputs, rank, dev, torch):
        from tests.gpu.workers.moe_gpu import case_tensors

        self.c, self.inputs, self.torch = c, inputs, torch
        self.t = case_tensors(torch, c, inputs, rank, dev)

    def torch_compat(self, ws):
        import torch_compat as tc
        from tests.gpu.workers.moe_gpu import moe_call

        x, kw = moe_call(self.c, self.t, launch_with_pdl=True)
        tc.allreduce_fusion(x, ws, self.c[0], **kw)

    def native(self, ws, stream):
        """The same launch through the native Rank (fusedar_moe_launch), no Python checks."""
        from jax_fusedar.common import native
        from tests.gpu.workers.moe_gpu import EPS

        t, c = {k: v.data_ptr() for k, v in self.t.items() if v is not None}, self.c
        common = dict(residual_in=t["res"], residual_out=t["res_out"], norm_out=t["norm"])
        common.update(rms_gamma=t["g"], rms_eps=EPS, weight_bias=0.0, launch_with_pdl=True)
        args = (c[0], native.DTYPE_CODES["bfloat16"], c[2], c[3])
        if c[0] == 7:
            p, idx = self.t["p"], self.t["idx"]
            kw = dict(permuted_input=t["p"], num_permuted_rows=p.shape[0], top_k=idx.shape[1])
            kw.update(expanded_idx_to_permuted_idx=t["idx"], routed_scaling_factor=1.0)
            kw.update(expert_scale_factor=t["s"], shared_expert_output=t["sh"])
        else:
            kw = dict(num_experts=c[5], expert_scales=t["es"], expert_outputs=t["eo"])
            kw.update(token_input=t["ti"], allreduce_out=t["ar"])
        ws.native_rank().moe_launch(*args, **kw, **common, stream=stream.cuda_stream)

    def oracle_errors(self):
        """Fractions of the float64 oracle's bounds (<= 1 passes; NaN: an unwritten output)."""
        from tests.gpu.workers.moe_gpu import host_outputs, oracle_errors

        outs = host_outputs(self.torch, self.c, self.t, self.inputs["residual"].dtype)
        return oracle_errors(self.c, self.inputs, outs)


def worker(rank, world, chan, *, case, seed, port):
    from tests.gpu.harness import device_for
    from tests.gpu.workers.common import init_gloo
    from tests.gpu.workers.native_mismatch import await_verdict, check_untouched, failing_launch
    from tests.gpu.workers.native_mismatch import flush_c_stdio

    device = device_for(rank)
    torch, dist = init_gloo(rank, world, port, device)
    import torch_compat as tc

    pattern = CASES[case]
    c = moe_case(pattern)
    result = {"rank": rank, "device": device, "case": case, "pattern": pattern}
    result["gpu"] = torch.cuda.get_device_name(device)
    kw = dict(group=dist.group.WORLD, handshake=False, kernel_timeout_s=TIMEOUT_S)
    ws = tc.create_allreduce_fusion_workspace(
        "trtllm", world, rank, MAX_TOKENS, HIDDEN, torch.bfloat16, **kw
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
        # The next launch must be refused with the recorded text: by the core (the raw
        # entry, no Python check before it) and through torch_compat.
        native = lambda: call.native(ws, stream)
        f = failing_launch(ws, lambda: call.torch_compat(ws), stream, {}, relaunch=native)
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
    kw = dict(timeout_s=120, case=case, seed=seed, port=free_port())
    head = {"case": case, "seed": seed, "timeout_s": TIMEOUT_S}
    print_result(head, "ranks", lambda: run_ranks_allowing_death(worker, 2, **kw))


if __name__ == "__main__":
    main(sys.argv)
