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

import json
import os
import sys
import time

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
    import tests.oracles.moe_oracle as mo
    from tests.gpu.workers.moe_gpu import WORLD

    pattern, dtype, tokens, hidden, k, experts = c[:6]
    rng = np.random.default_rng(seed)
    if pattern == 7:
        return mo.random_finalize_case(
            rng,
            tokens=tokens,
            top_k=k,
            experts=experts,
            world=WORLD,
            dtype_name=dtype,
            hidden=hidden,
            pad=2,
        )
    return mo.random_reduction_case(
        rng, tokens=tokens, experts=experts, world=WORLD, dtype_name=dtype, hidden=hidden
    )


class _Call:
    """One MoE call of rank ``rank`` on device ``dev``: its tensors (outputs poisoned with
    NaN), the torch_compat call, and the same call through the native Rank."""

    def __init__(self, c, inputs, rank, dev, torch):
        from tests.gpu.workers.moe_gpu import EPS

        self.c, self.inputs, self.torch, self.eps = c, inputs, torch, EPS

        def to_t(a):
            return (
                torch.from_numpy(np.ascontiguousarray(a).view(np.int16))
                .to(dev)
                .view(torch.bfloat16)
            )

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
    import torch
    import torch.distributed as dist

    import torch_compat as tc
    from tests.gpu.harness import device_for
    from tests.gpu.workers.native_mismatch import AFTER_FAILURE_WAIT_S, flush_c_stdio

    device = device_for(rank)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
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
        try:
            stream.synchronize()
            f["sync_error"] = None
        except Exception as e:  # noqa: BLE001 - the expected outcome
            f["sync_error"] = f"{type(e).__name__}: {e}"[:600]
        f["elapsed_s"] = time.monotonic() - t0
        flush_c_stdio()
        f["failure_record"] = ws.failure()
        # The next launch must be refused with the recorded text: by the core (the raw
        # entry, no Python check before it) and through torch_compat.
        for name, launch in (
            ("relaunch_error", lambda: call.native(ws, stream)),
            ("torch_compat_error", lambda: call.torch_compat(ws)),
        ):
            try:
                launch()
                f[name] = None
            except Exception as e:  # noqa: BLE001
                f[name] = f"{type(e).__name__}: {e}"[:1500]
        result["failing"] = f
    try:  # rank 1 makes no call until rank 0 has its verdict
        chan.barrier("verdict", timeout_s=AFTER_FAILURE_WAIT_S)
    except TimeoutError as e:  # rank 0's lost trap ended (or is ending) its process
        result["peer_gone"] = str(e)
    if rank == 1:
        t = torch.arange(1000, device=device, dtype=torch.float32)
        result["healthy_after"] = float(t.sum().item()) == 499500.0
        result["failure_record"] = ws.failure()
        ws.destroy()
    flush_c_stdio()
    if "peer_gone" not in result:  # rank 0 hosts the store: leave a gone peer's group be
        dist.destroy_process_group()
    return result


def main(argv):
    from tests.gpu.harness import free_port
    from tests.gpu.workers.native_timeout import run_ranks_allowing_death

    case = argv[1] if len(argv) > 1 else "never_finalize"
    if case not in CASES:
        raise SystemExit(f"unknown case {case!r}; one of {tuple(CASES)}")
    seed = int.from_bytes(os.urandom(4), "little")
    t0 = time.monotonic()
    try:
        out = {
            "case": case,
            "seed": seed,
            "timeout_s": TIMEOUT_S,
            "ranks": run_ranks_allowing_death(
                worker, 2, timeout_s=120, case=case, seed=seed, port=free_port()
            ),
        }
    except Exception as e:  # noqa: BLE001 - reported as JSON for the test to show
        out = {"case": case, "seed": seed, "error": str(e)[-6000:]}
    out["wall_s"] = time.monotonic() - t0
    sys.stdout.flush()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv)
