"""Per-process bodies of the torch_compat GPU tests (tests/test_gpu_torch.py).

Each process joins torch.distributed over gloo (never NCCL: the workspace exchange is our
own, over the c10d store, and gloo needs nothing from the GPUs) and drives GPU
``wanted % torch.cuda.device_count()``: on a machine with fewer GPUs than processes,
ranks share a GPU (their kernels time-slice; the protocol still completes).

Inputs are drawn from seeds derived from (seed, group, case, member), so every member can
rebuild its whole group's inputs and the float64 oracle (tests/oracle.py).
"""
from __future__ import annotations

import hashlib
import os
import random
import time

import numpy as np

# What vLLM does on every rank, identically: the exchange must not depend on it.
SHARED_SEED = 1234
RMS_EPS = 1e-6


def _init(rank, world, port, wanted_device):
    # Inherited from tests/conftest.py under pytest; set here too for direct runs.
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                 ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)
    import torch
    import torch.distributed as dist

    device = wanted_device % torch.cuda.device_count()
    torch.cuda.set_device(device)  # the workspace takes torch.cuda.current_device()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    return torch, dist, device


def _group_inputs(seed, group, case, m, hidden, world, torch):
    """bf16 inputs of every member of ``group`` for one case, plus the group's residual and
    gamma (the same on every member, as a replicated residual stream is in TP)."""
    def draw(*shape, member):
        rng = np.random.default_rng([seed, group, case, member])
        return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)).bfloat16()

    xs = [draw(m, hidden, member=r) for r in range(world)]
    residual = draw(m, hidden, member=world)
    rng = np.random.default_rng([seed, group, case, world + 1])
    gamma = torch.from_numpy(rng.uniform(-2.0, 2.0, hidden).astype(np.float32)).bfloat16()
    return xs, residual, gamma


class _Pattern1Case:
    """One pattern-1 call on this member's device, checked against the float64 oracle."""

    def __init__(self, torch, device, tp_rank, xs, residual, gamma):
        from tests import oracle

        self.torch, self.xs, self.residual, self.gamma = torch, xs, residual, gamma
        self.x = xs[tp_rank].to(device)
        self.res_in, self.gamma_d = residual.to(device), gamma.to(device)
        self.res_out = torch.empty_like(self.x)
        self.norm_out = torch.empty_like(self.x)
        self.oracle = oracle.fused_reference([t.float().numpy() for t in xs],
                                             residual.float().numpy(), gamma.float().numpy(),
                                             rms_eps=RMS_EPS, weight_bias=0.0)

    def run(self, ws, **kw):
        """Poisons the outputs, calls, waits; returns (residual ulps, norm ulps, NaN count,
        digest of both outputs)."""
        import torch_compat as tc
        from tests import oracle

        torch = self.torch
        self.res_out.fill_(float("nan"))
        self.norm_out.fill_(float("nan"))
        ret = tc.allreduce_fusion(self.x, ws, tc.AllReduceFusionPattern.kARResidualRMSNorm,
                                  residual_out=self.res_out, norm_out=self.norm_out,
                                  residual_in=self.res_in, rms_gamma=self.gamma_d,
                                  rms_eps=RMS_EPS, **kw)
        assert ret is self.norm_out, "pattern 1 must return norm_out (FlashInfer's rule)"
        torch.cuda.synchronize()
        r, y = (t.float().cpu().numpy() for t in (self.res_out, self.norm_out))
        s64, r64, y64, inv64 = self.oracle
        res_np, g_np = self.residual.float().numpy(), self.gamma.float().numpy()
        digest = hashlib.sha256()
        for t in (self.res_out, self.norm_out):
            digest.update(t.cpu().view(torch.uint8).numpy().tobytes())
        return (oracle.residual_error_ulps(r, s64, r64, res_np, "bfloat16"),
                oracle.norm_error_ulps(y, s64, y64, inv64, res_np, g_np, weight_bias=0.0,
                                       dtype_name="bfloat16"),
                int(np.isnan(r).sum() + np.isnan(y).sum()), digest.hexdigest())


# DP=2 x TP=2 on two GPUs with group B crossed, as in vLLM's DP+TP bug reports: group A =
# {global 0 on GPU 0, global 1 on GPU 1}; group B = {global 2 on GPU 1 as TP rank 0,
# global 3 on GPU 0 as TP rank 1}.
DP_TP_GROUPS = ([0, 1], [2, 3])
DP_TP_DEVICES = (0, 1, 1, 0)


def dp_tp_worker(rank, world, chan, *, port, seed, tokens, hidden):
    torch, dist, device = _init(rank, world, port, DP_TP_DEVICES[rank])
    import torch_compat as tc

    try:
        groups = [dist.new_group(g) for g in DP_TP_GROUPS]  # every process, same order
        g, tp_rank = rank // 2, rank % 2
        random.seed(SHARED_SEED)
        np.random.seed(SHARED_SEED)
        torch.manual_seed(SHARED_SEED)
        ws = tc.create_allreduce_fusion_workspace(
            "trtllm", world_size=2, rank=tp_rank, max_token_num=max(tokens), hidden_dim=hidden,
            dtype=torch.bfloat16, group=groups[g], timeout_s=120)
        placement = {"rank": rank, "group": g, "tp_rank": ws.rank, "device": ws.device,
                     "global_ranks": list(ws.global_ranks),
                     "member_devices": [m.device for m in ws.members],
                     "gpus": torch.cuda.device_count()}
        dist.barrier()  # both groups start together, so their calls overlap
        worst = {"residual": 0.0, "norm": 0.0}
        nan_outputs, digests, cases = 0, [], []
        for i, m in enumerate(tokens):
            xs, residual, gamma = _group_inputs(seed, g, i, m, hidden, 2, torch)
            case = _Pattern1Case(torch, device, tp_rank, xs, residual, gamma)
            # The heuristic's choice, and two-shot wherever it can run (more tokens than ranks).
            for use_oneshot in (None, False) if m > 2 else (None,):
                r_ulps, n_ulps, nans, digest = case.run(ws, use_oneshot=use_oneshot,
                                                        launch_with_pdl=True, fp32_acc=True)
                worst["residual"] = max(worst["residual"], r_ulps)
                worst["norm"] = max(worst["norm"], n_ulps)
                nan_outputs += nans
                digests.append(digest)
                cases.append((m, use_oneshot))
        dist.barrier(group=groups[g])  # no member frees while its peer may still launch
        ws.destroy()
        return {**placement, "worst": worst, "nan_outputs": nan_outputs, "digests": digests,
                "cases": cases}
    finally:
        dist.destroy_process_group()


def cycles_worker(rank, world, chan, *, port, seed, cycles, tokens, hidden):
    """``cycles`` x (create, one checked pattern-1 call, destroy), with the device's free
    memory before the first and after the last. Destroy is local, as FlashInfer's is: no
    barrier between the call and the destroy."""
    torch, dist, device = _init(rank, world, port, rank)
    import torch_compat as tc

    try:
        xs, residual, gamma = _group_inputs(seed, 0, 0, tokens, hidden, world, torch)
        case = _Pattern1Case(torch, device, rank, xs, residual, gamma)
        worst = {"residual": 0.0, "norm": 0.0}
        nan_outputs = 0

        def cycle():
            nonlocal nan_outputs
            ws = tc.create_allreduce_fusion_workspace(
                "trtllm", world, rank, tokens, hidden, torch.bfloat16, timeout_s=120)
            r_ulps, n_ulps, nans, _ = case.run(ws)
            worst["residual"] = max(worst["residual"], r_ulps)
            worst["norm"] = max(worst["norm"], n_ulps)
            nan_outputs += nans
            ws.destroy()

        def free_bytes():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            return torch.cuda.mem_get_info(device)[0]

        cycle()  # warm-up: CUDA context, lazy kernel loading, allocator pools
        # Measured between barriers: ranks may share a GPU, and free memory is device-wide.
        dist.barrier()
        before = free_bytes()
        dist.barrier()
        t0 = time.monotonic()
        for _ in range(cycles):
            cycle()
        seconds = time.monotonic() - t0
        dist.barrier()
        after = free_bytes()
        dist.barrier()
        return {"rank": rank, "device": device, "cycles": cycles, "seconds": seconds,
                "free_before": before, "free_after": after, "worst": worst,
                "nan_outputs": nan_outputs}
    finally:
        dist.destroy_process_group()


def never_join_worker(rank, world, chan, *, port, create_timeout_s):
    """Rank 1 never creates its workspace; rank 0 must get a TimeoutError naming it."""
    torch, dist, device = _init(rank, world, port, rank)
    import torch_compat as tc

    try:
        if rank == 1:
            chan.barrier("attempted")  # just waits until rank 0 gave up, then exits
            return {"rank": 1}
        t0 = time.monotonic()
        try:
            tc.create_allreduce_fusion_workspace("trtllm", 2, 0, 16, 4096, torch.bfloat16,
                                                 timeout_s=create_timeout_s)
            error_type, message = None, "created"
        except Exception as e:
            error_type, message = type(e).__name__, str(e)
        elapsed = time.monotonic() - t0
        chan.barrier("attempted")
        return {"rank": 0, "error_type": error_type, "message": message, "seconds": elapsed}
    finally:
        dist.destroy_process_group()
