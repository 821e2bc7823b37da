"""Per-rank body of the large-message sweep (torch tensors, raw-pointer launch). Per case (dtype,
hidden, tokens, pattern) each rank draws the whole group's inputs, poisons every output with
0xff bytes, and runs the call with the large-message algorithm and with FlashInfer's two-shot
kernel; it reports:

* bit differences between the two (the large-message path reuses the two-shot math and launch
  shape, so there must be none, quantized outputs and scales included),
* for pattern 1 the ulps against the float64 oracle, and NaNs left (unwritten elements),
* a digest of its outputs (all ranks must hold the same bits),
* a CUDA graph of the call replayed on fresh inputs against an eager call,
* a loop mixing the algorithms (one-shot, two-shot, large-message) without host syncs.
"""

import functools
import hashlib

from jax_fusedar.common import launch_mode
from tests.gpu.workers.common import connect_ipc, keep_max, plain_ulps

LARGE = launch_mode.ALGORITHM_LARGE_MESSAGE
TWOSHOT = launch_mode.ALGORITHM_TWOSHOT
ONESHOT = launch_mode.ALGORITHM_ONESHOT
GROUP = 128
OUTPUTS = ("residual_out", "norm_out", "quant_out", "scale_out")


def _outputs(torch, pattern, m, hidden, dtype, device):
    """Output tensors of one call, poisoned (0xff bytes)."""

    def poisoned(shape, dt):
        t = torch.empty(shape, dtype=dt, device=device)
        t.view(torch.uint8).fill_(0xFF)
        return t

    outs = {"residual_out": poisoned((m, hidden), dtype), "norm_out": poisoned((m, hidden), dtype)}
    if pattern in (4, 9, 11):
        outs["quant_out"] = poisoned((m, hidden), torch.uint8)
    if pattern == 11:
        outs["scale_out"] = poisoned((m,), torch.float32)
    if pattern == 9:
        # UE8M0 packed scales, TMA-aligned rows: generously sized; both algorithms see the same
        # poisoned bytes, so the comparison also covers what neither writes.
        outs["scale_out"] = poisoned((hidden // GROUP // 4 + 1, (m + 3) // 4 * 4), torch.int32)
    return outs


def _launch(ws, native, pattern, dtype, m, hidden, inputs, outs, algorithm, fp32_acc, stream):
    """One raw-pointer launch; ``inputs``: (x, residual, gamma, static scale) on the device."""
    x, res, gamma, scale = inputs
    ptrs = {k: outs[k].data_ptr() if k in outs else 0 for k in OUTPUTS}
    kw = dict(residual_in=res.data_ptr(), rms_gamma=gamma.data_ptr(), rms_eps=1e-6, weight_bias=0.0)
    kw.update(scale_factor=scale.data_ptr() if pattern == 4 else 0, algorithm=algorithm)
    kw.update(fp32_acc=fp32_acc, block_quant_group_size=GROUP if pattern == 9 else 0)
    args = (pattern, native.DTYPE_CODES[dtype], m, hidden, x.data_ptr())
    ws.launch(*args, **ptrs, **kw, stream=stream)


def _on_device(torch, draw, rank, device):
    """This rank's x, the residual and gamma of one harness.draw_case, bf16 on ``device``."""
    xs, residual, gamma = draw
    return [
        torch.from_numpy(a).to(torch.bfloat16).cuda(device) for a in (xs[rank], residual, gamma)
    ]


def worker(rank, world, chan, *, cases, max_tokens, hidden_max, loop_calls, seed):
    import torch
    from jax_fusedar.common import native
    from tests.gpu.harness import device_for, draw_case

    ext = native.require()
    device = device_for(rank)
    torch.cuda.set_device(device)
    tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16}
    ws = ext.Rank(device, world, rank, max_tokens, hidden_max, native.DTYPE_CODES["bfloat16"])
    connect_ipc(ws, chan, rank, "ipc")
    chan.barrier("ready")
    stream = torch.cuda.current_stream(device)
    s = stream.cuda_stream
    launch = functools.partial(_launch, ws, native)

    digest = hashlib.sha256()
    mismatches = []
    nan_outputs = 0
    worst = {"residual": 0.0, "norm": 0.0, "cases": 0}
    for i, (dtype, hidden, m, pattern) in enumerate(cases):
        xs, residual, gamma = draw_case(seed + i, world, m, hidden)
        to_t = lambda a: torch.from_numpy(a).to(tdt[dtype])
        xs, residual, gamma = [to_t(x) for x in xs], to_t(residual), to_t(gamma)
        x, res, gam = xs[rank].cuda(device), residual.cuda(device), gamma.cuda(device)
        scale = torch.tensor([0.37], dtype=torch.float32, device=device)
        fp32_acc = i % 3 != 2
        got = {}
        for algorithm in (LARGE, TWOSHOT):
            outs = _outputs(torch, pattern, m, hidden, tdt[dtype], device)
            launch(pattern, dtype, m, hidden, (x, res, gam, scale), outs, algorithm, fp32_acc, s)
            got[algorithm] = outs
        stream.synchronize()
        for name in got[LARGE]:
            a = got[LARGE][name].view(torch.uint8)
            b = got[TWOSHOT][name].view(torch.uint8)
            diff = int((a != b).sum())
            if diff:
                mismatches.append((dtype, hidden, m, pattern, name, diff))
            digest.update(got[LARGE][name].cpu().view(torch.uint8).numpy().tobytes())
        for name in ("residual_out", "norm_out"):
            nan_outputs += int(torch.isnan(got[LARGE][name].float()).sum())
        if pattern == 1:
            r_np, g_np = residual.float().numpy(), gamma.float().numpy()
            outs = {k: got[LARGE][k].float().cpu().numpy() for k in ("residual_out", "norm_out")}
            keep_max(worst, plain_ulps([t.float().numpy() for t in xs], r_np, g_np, dtype, **outs))
            worst["cases"] += 1

    # CUDA graph: capture one large-message call, replay it on fresh inputs copied into the
    # captured buffers; it must match an eager call on the same inputs, bit for bit.
    m, hidden, dtype = max_tokens, hidden_max, "bfloat16"
    x, res, gam = _on_device(torch, draw_case(seed - 1, world, m, hidden), rank, device)
    scale = torch.zeros(1, device=device)
    graph_outs = _outputs(torch, 1, m, hidden, torch.bfloat16, device)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream(device)
    side.wait_stream(stream)
    with torch.cuda.graph(graph, stream=side):
        launch(1, dtype, m, hidden, (x, res, gam, scale), graph_outs, LARGE, True, side.cuda_stream)
    stream.wait_stream(side)
    graph_diffs = 0
    for replay in range(3):
        xs2, _, _ = draw_case(seed + 1000 + replay, world, m, hidden)
        x.copy_(torch.from_numpy(xs2[rank]).to(torch.bfloat16))
        for t in graph_outs.values():
            t.view(torch.uint8).fill_(0xFF)
        graph.replay()
        eager = _outputs(torch, 1, m, hidden, torch.bfloat16, device)
        launch(1, dtype, m, hidden, (x, res, gam, scale), eager, TWOSHOT, True, s)
        stream.synchronize()
        graph_diffs += sum(
            int((graph_outs[k].view(torch.uint8) != eager[k].view(torch.uint8)).sum())
            for k in eager
        )

    # Many launches without a host sync, the algorithms interleaved: each one's buffers and
    # flags must survive the others'. The last result is checked against the two-shot kernel.
    m, hidden = 1024, min(4096, hidden_max)
    x, res, gam = _on_device(torch, draw_case(seed - 2, world, m, hidden), rank, device)
    loop_outs = _outputs(torch, 1, m, hidden, torch.bfloat16, device)
    order = (LARGE, ONESHOT, LARGE, TWOSHOT, LARGE)
    ins = (x, res, gam, scale)
    for k in range(loop_calls):
        launch(1, "bfloat16", m, hidden, ins, loop_outs, order[k % len(order)], True, s)
    last = _outputs(torch, 1, m, hidden, torch.bfloat16, device)
    launch(1, "bfloat16", m, hidden, ins, last, TWOSHOT, True, s)
    stream.synchronize()
    loop_diffs = sum(
        int((loop_outs[k].view(torch.uint8) != last[k].view(torch.uint8)).sum()) for k in last
    )
    ws.destroy() if hasattr(ws, "destroy") else None
    out = {"device": device, "digest": digest.hexdigest(), "mismatches": mismatches}
    out.update(nan_outputs=nan_outputs, worst=worst, graph_diffs=graph_diffs)
    return {**out, "loop_diffs": loop_diffs, "cases": len(cases)}
