"""Per-rank body of the native kernel sweep (torch tensors, raw-pointer launch).

Every rank runs the same case list in the same order (the kernel's protocol needs it),
draws the *whole group's* inputs from per-case seeds so each can build the float64
oracle, poisons its outputs with NaN before each launch, and reports per-dtype maxima of
the ulp-scaled errors (tests/oracles/oracle.py) plus a digest of its outputs so the test can check
all ranks produced identical bits.
"""

from __future__ import annotations

import hashlib

import numpy as np

DTYPES = ("bfloat16", "float16", "float32")


def cases(tokens, hiddens, world):
    from tests.gpu.harness import shape_cases

    return [(dtype, *case) for dtype in DTYPES for case in shape_cases(tokens, hiddens, world)]


def _inputs(seed, world, m, hidden, tdtype, torch):
    from tests.gpu.harness import draw_case

    xs, residual, gamma = draw_case(seed, world, m, hidden)
    return (
        [torch.from_numpy(x).to(tdtype) for x in xs],
        torch.from_numpy(residual).to(tdtype),
        torch.from_numpy(gamma).to(tdtype),
    )


def worker(rank, world, chan, *, tokens, hiddens, max_tokens, loop_calls, seed):
    import torch

    from jax_fusedar.common import native
    from tests.oracles import oracle
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
        handles = chan.all_gather(f"ipc-{dtype}", ws.export_ipc())
        for peer, h in enumerate(handles):
            if peer != rank:
                ws.open_peer_ipc(peer, h)
        ws.finalize()
        workspaces[dtype] = ws
    chan.barrier("ready")
    ws_for = {
        "bfloat16": workspaces["bfloat16"],
        "float16": workspaces["bfloat16"],
        "float32": workspaces["float32"],
    }

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
        ar_out = torch.full_like(x, float("nan"))
        res_out = torch.full_like(x, float("nan"))
        norm_out = torch.full_like(x, float("nan"))
        ws = ws_for[dtype]
        code = native.DTYPE_CODES[dtype]
        ws.launch(
            0,
            code,
            m,
            hidden,
            x.data_ptr(),
            allreduce_out=ar_out.data_ptr(),
            algorithm=int(oneshot),
            fp32_acc=fp32_acc,
            stream=stream.cuda_stream,
        )
        ws.launch(
            1,
            code,
            m,
            hidden,
            x.data_ptr(),
            residual_in=res_d.data_ptr(),
            residual_out=res_out.data_ptr(),
            norm_out=norm_out.data_ptr(),
            rms_gamma=gamma_d.data_ptr(),
            rms_eps=1e-6,
            weight_bias=wb,
            algorithm=int(oneshot),
            fp32_acc=fp32_acc,
            stream=stream.cuda_stream,
        )
        stream.synchronize()
        outs = [t.float().cpu().numpy() for t in (ar_out, res_out, norm_out)]
        nan_outputs += sum(int(np.isnan(o).sum()) for o in outs)
        xs64 = [t.float().numpy() for t in xs]
        r_np, g_np = residual.float().numpy(), gamma.float().numpy()
        s64, r64, y64, inv64 = oracle.fused_reference(
            xs64, r_np, g_np, rms_eps=1e-6, weight_bias=wb
        )
        w = worst[dtype]
        w["allreduce"] = max(w["allreduce"], oracle.allreduce_error_ulps(outs[0], s64, dtype))
        w["residual"] = max(
            w["residual"], oracle.residual_error_ulps(outs[1], s64, r64, r_np, dtype)
        )
        w["norm"] = max(
            w["norm"],
            oracle.norm_error_ulps(
                outs[2], s64, y64, inv64, r_np, g_np, weight_bias=wb, dtype_name=dtype
            ),
        )
        w["cases"] += 1
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
        for k in range(loop_calls):
            ws_for[dtype].launch(
                1,
                native.DTYPE_CODES[dtype],
                m,
                hidden,
                x.data_ptr(),
                residual_in=res_d.data_ptr(),
                residual_out=res_out.data_ptr(),
                norm_out=norm_out.data_ptr(),
                rms_gamma=gamma_d.data_ptr(),
                algorithm=int(k % 5 != 0),
                stream=stream.cuda_stream,
            )
        end.record(stream)
        stream.synchronize()
        s64, r64, y64, inv64 = oracle.fused_reference(
            [t.float().numpy() for t in xs],
            residual.float().numpy(),
            gamma.float().numpy(),
            rms_eps=1e-6,
            weight_bias=0.0,
        )
        loop = {
            "calls": loop_calls,
            "ms_per_call": start.elapsed_time(end) / loop_calls,
            "residual": oracle.residual_error_ulps(
                res_out.float().cpu().numpy(), s64, r64, residual.float().numpy(), dtype
            ),
            "norm": oracle.norm_error_ulps(
                norm_out.float().cpu().numpy(),
                s64,
                y64,
                inv64,
                residual.float().numpy(),
                gamma.float().numpy(),
                weight_bias=0.0,
                dtype_name=dtype,
            ),
        }
    for ws in workspaces.values():
        ws.destroy()
    return {
        "device": device,
        "worst": worst,
        "digest": digest.hexdigest(),
        "nan_outputs": nan_outputs,
        "loop": loop,
        "gpu": torch.cuda.get_device_name(device),
    }
