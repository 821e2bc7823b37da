"""Per-rank body of the native kernel sweep (torch tensors, raw-pointer launch): every rank
runs the same cases in the same order (the protocol needs it), draws the whole group's inputs
from per-case seeds (for the float64 oracle), poisons its outputs with NaN, and reports
per-dtype maxima of the ulp-scaled errors and a digest of its outputs (all ranks' must agree).
"""

import hashlib

import numpy as np

from tests.gpu.workers.common import connect_ipc, keep_max, plain_ulps

DTYPES = ("bfloat16", "float16", "float32")


def cases(tokens, hiddens, world):
    from tests.gpu.harness import shape_cases

    return [(dtype, *case) for dtype in DTYPES for case in shape_cases(tokens, hiddens, world)]


def _inputs(seed, world, m, hidden, tdtype, torch):
    from tests.gpu.harness import draw_case

    xs, residual, gamma = draw_case(seed, world, m, hidden)
    to_t = lambda a: torch.from_numpy(a).to(tdtype)
    return [to_t(x) for x in xs], to_t(residual), to_t(gamma)


def worker(rank, world, chan, *, tokens, hiddens, max_tokens, loop_calls, seed):
    import torch
    from jax_fusedar.common import native
    from tests.gpu.harness import device_for

    ext = native.require()
    device = device_for(rank)
    torch.cuda.set_device(device)
    tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    hmax = max(hiddens)

    # One workspace per dtype width (the Lamport sentinel is -0.0 at that width).
    workspaces = {}
    for dtype in ("bfloat16", "float32"):
        ws = ext.Rank(device, world, rank, max_tokens, hmax, native.DTYPE_CODES[dtype])
        connect_ipc(ws, chan, rank, f"ipc-{dtype}")
        workspaces[dtype] = ws
    chan.barrier("ready")
    ws_for = {d: workspaces["float32" if d == "float32" else "bfloat16"] for d in DTYPES}

    stream = torch.cuda.current_stream(device)
    worst = {d: {"allreduce": 0.0, "residual": 0.0, "norm": 0.0, "cases": 0} for d in DTYPES}
    digest = hashlib.sha256()
    nan_outputs = 0
    for i, (dtype, hidden, m, oneshot) in enumerate(cases(tokens, hiddens, world)):
        xs, residual, gamma = _inputs(seed + i, world, m, hidden, tdt[dtype], torch)
        wb = float(i % 2)  # alternate standard and Gemma-style (1 + gamma) norms
        fp32_acc = i % 3 != 2  # and, every third case, FlashInfer's default rounding
        x = xs[rank].cuda(device)
        res_d, gamma_d = residual.cuda(device), gamma.cuda(device)
        ar_out, res_out, norm_out = (torch.full_like(x, float("nan")) for _ in range(3))
        args = (native.DTYPE_CODES[dtype], m, hidden, x.data_ptr())
        kw = dict(algorithm=int(oneshot), fp32_acc=fp32_acc, stream=stream.cuda_stream)
        ws_for[dtype].launch(0, *args, allreduce_out=ar_out.data_ptr(), **kw)
        ws_for[dtype].launch(
            1, *args, **_fused_ptrs(res_d, gamma_d, res_out, norm_out), weight_bias=wb, **kw
        )
        stream.synchronize()
        outs = [t.float().cpu().numpy() for t in (ar_out, res_out, norm_out)]
        nan_outputs += sum(int(np.isnan(o).sum()) for o in outs)
        xs32 = [t.float().numpy() for t in xs]
        r_np, g_np = residual.float().numpy(), gamma.float().numpy()
        got = dict(allreduce_out=outs[0], residual_out=outs[1], norm_out=outs[2])
        keep_max(worst[dtype], plain_ulps(xs32, r_np, g_np, dtype, **got, wb=wb))
        worst[dtype]["cases"] += 1
        for t in (ar_out, res_out, norm_out):
            digest.update(t.cpu().view(torch.uint8).numpy().tobytes())

    # Many consecutive launches without a host sync: the Lamport triple buffer and the
    # barrier flags rotate through every state; the last result must still be right.
    loop = {}
    if loop_calls:
        m, hidden, dtype = 16, min(4096, hmax), "bfloat16"
        xs, residual, gamma = _inputs(seed - 1, world, m, hidden, tdt[dtype], torch)
        x, res_d, gamma_d = xs[rank].cuda(device), residual.cuda(device), gamma.cuda(device)
        res_out, norm_out = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        args = (native.DTYPE_CODES[dtype], m, hidden, x.data_ptr())
        ptrs = _fused_ptrs(res_d, gamma_d, res_out, norm_out)
        ptrs.pop("rms_eps")  # the launch's default
        for k in range(loop_calls):
            ws_for[dtype].launch(
                1, *args, **ptrs, algorithm=int(k % 5 != 0), stream=stream.cuda_stream
            )
        end.record(stream)
        stream.synchronize()
        f32 = lambda t: t.float().cpu().numpy()
        got = dict(residual_out=f32(res_out), norm_out=f32(norm_out))
        loop = {"calls": loop_calls, "ms_per_call": start.elapsed_time(end) / loop_calls}
        loop.update(plain_ulps([f32(t) for t in xs], f32(residual), f32(gamma), dtype, **got))
    for ws in workspaces.values():
        ws.destroy()
    out = {"device": device, "worst": worst, "digest": digest.hexdigest(), "loop": loop}
    return {**out, "nan_outputs": nan_outputs, "gpu": torch.cuda.get_device_name(device)}


def _fused_ptrs(res, gamma, res_out, norm_out):
    """Pattern 1's pointer arguments (and rms_eps) of a raw launch."""
    ptrs = dict(residual_in=res.data_ptr(), residual_out=res_out.data_ptr(), rms_eps=1e-6)
    return dict(ptrs, norm_out=norm_out.data_ptr(), rms_gamma=gamma.data_ptr())
