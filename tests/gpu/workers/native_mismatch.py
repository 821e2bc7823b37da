"""GPU body of the cross-rank handshake (handshake; ffi/core/handshake.h): two ranks in two
processes (CUDA IPC), one case per run, because a trapped handshake kills the CUDA context of
its process. Every case first makes the MATCHING calls with the check on (outputs NaN-poisoned,
then against the float64 oracle), then:

  ok        the same calls with the check off, a CUDA graph of checked calls replayed
            (the device-resident call counter must advance on replay), and the handshake's
            cost (median ms per call, check on vs off, back-to-back loops);
  tokens    rank 0 calls with 16 tokens, rank 1 with 17        -> both ranks fail
  pattern   rank 0 calls pattern 0, rank 1 pattern 1           -> both ranks fail
  oneshot   rank 0 calls one-shot, rank 1 two-shot (32 tokens) -> both ranks fail
  timeout   rank 1 makes no call; rank 0 times out after TIMEOUT_CASE_S and fails, while
            rank 1's context stays healthy.

"Fail": the stream synchronisation raises (the handshake's __trap) within the timeout, the
failure record (failure(), from pinned host memory) describes the mismatch and the next launch
is refused with it; or, where the driver never reports the trap (ranks sharing a GPU trapping
together), the process ends with lost_traps.EXIT_CODE and the record on stderr: its result is
harness.run_ranks's {"rank", "exitcode", "exited_at", "notes"} (notes: what it had before the
failing call, and when that began). The device printf lands in stdout (test_topology.py).
"ok" and "timeout" also run with more ranks (the last one makes no call).

Run one case by hand:  python -m tests.gpu.workers.native_mismatch tokens [world]
The last stdout line is "RESULT <json>".
"""

import ctypes
import hashlib
import sys
import time

from tests.gpu.workers.common import case_of, connect_ipc, error_text, new_seed, print_result

import numpy as np

HIDDEN = 4096
MAX_TOKENS = 64
DTYPE = "bfloat16"
# (pattern, tokens, one-shot) of the matching calls every case makes first
MATCHING = [(1, 16, True), (1, 17, False), (0, 16, True), (1, 1, True), (1, 33, False)]
MATCHING += [(0, 40, False), (1, 64, True)]
MISMATCH_TIMEOUT_S = 20.0  # a mismatch must be reported long before this
TIMEOUT_CASE_S = 3.0
CASES = ("ok", "tokens", "pattern", "oneshot", "timeout")
# How long a rank waits for its peers after its failing call: a peer whose trap the driver
# lost ends after lost_traps.GRACE_S.
AFTER_FAILURE_WAIT_S = 20.0
BOUNDS = {"allreduce": 1.0, "residual": 1.0, "norm": 3.0}
KEYS = {0: ("allreduce",), 1: ("residual", "norm")}  # the outputs of patterns 0 and 1


def flush_c_stdio():
    """Device printf writes through C stdio, fully buffered on a pipe: flush it now."""
    try:
        ctypes.CDLL(None).fflush(None)
    except Exception:  # noqa: BLE001 - best effort
        pass


def draw_inputs(seed, world, m, hidden, torch):
    """bf16 torch tensors (CPU): every rank's input, the residual and gamma."""
    from tests.gpu.harness import draw_case

    xs, residual, gamma = draw_case(seed, world, m, hidden)
    bf16 = lambda a: torch.from_numpy(a).bfloat16()
    return [bf16(x) for x in xs], bf16(residual), bf16(gamma)


def oracle_errors(xs, residual, gamma, outs, pattern, *, weight_bias=0.0, dtype="bfloat16"):
    """Errors of one rank's outputs in units of their bounds' scale (tests/oracles/oracle.py), with
    the fp32 accumulation's own error added to the scale: (N-1) * 2^-24 * sum_r |x_r|
    (exact for 2 ranks of 16-bit values in practice, not for 4). xs: CPU tensors."""
    from tests.oracles import oracle

    x64 = [t.double().numpy() for t in xs]
    r_np, g_np = residual.double().numpy(), gamma.double().numpy()
    s64, r64, y64, inv64 = oracle.fused_reference(
        x64, r_np, g_np, rms_eps=1e-6, weight_bias=weight_bias
    )
    acc = (len(xs) - 1) * 2.0**-24 * np.sum([np.abs(x) for x in x64], axis=0)
    got = {k: outs[k].double().cpu().numpy() for k in KEYS[pattern]}
    if pattern == 0:
        scale = oracle.ulp(np.abs(s64) + acc, dtype) + acc
        return {"allreduce": float(np.max(np.abs(got["allreduce"] - s64) / scale))}
    carried = oracle.ulp(np.abs(s64) + np.abs(r_np) + acc, dtype) + acc
    norm_scale = carried * inv64 * np.abs(weight_bias + g_np) + oracle.ulp(y64, dtype)
    return {
        "residual": float(np.max(np.abs(got["residual"] - r64) / carried)),
        "norm": float(np.max(np.abs(got["norm"] - y64) / norm_scale)),
    }


def fused_call(ws, pattern, m, x, res, gamma, outs, *, oneshot, stream, algorithm=None):
    """One raw-pointer launch of pattern 0 (outs['allreduce']) or 1 (outs['residual'],
    outs['norm']); ``algorithm`` (launch_mode.ALGORITHM_*) overrides ``oneshot``."""
    from jax_fusedar.common import native

    algorithm = int(oneshot) if algorithm is None else algorithm
    if pattern == 0:
        ptrs = {"allreduce_out": outs["allreduce"].data_ptr()}
    else:
        ptrs = dict(residual_in=res.data_ptr(), rms_gamma=gamma.data_ptr(), rms_eps=1e-6)
        ptrs.update(residual_out=outs["residual"].data_ptr(), norm_out=outs["norm"].data_ptr())
    args = (pattern, native.DTYPE_CODES[DTYPE], m, x.shape[1], x.data_ptr())
    ws.launch(*args, **ptrs, algorithm=algorithm, stream=stream.cuda_stream)


def new_outputs(x, torch):
    return {k: torch.full_like(x, float("nan")) for k in ("allreduce", "residual", "norm")}


class Case:
    """One case on this rank: every rank's ``xs``, ``residual`` and ``gamma`` (CPU), this rank's
    ``x``, ``res``, ``gam`` on ``device``, and NaN ``outs``."""

    def __init__(self, seed, world, m, rank, device, torch):
        self.m = m
        xs, residual, gamma = draw_inputs(seed, world, m, HIDDEN, torch)
        self.xs, self.residual, self.gamma = xs, residual, gamma
        self.x, self.res, self.gam = (t.cuda(device) for t in (xs[rank], residual, gamma))
        self.outs = new_outputs(self.x, torch)

    def launch(self, ws, pattern, outs=None, **kw):
        """fused_call of this case into ``outs`` (default: its own)."""
        outs = self.outs if outs is None else outs
        fused_call(ws, pattern, self.m, self.x, self.res, self.gam, outs, **kw)

    def errors(self, pattern, outs=None):
        """oracle_errors of ``outs`` (default: its own)."""
        outs = self.outs if outs is None else outs
        return oracle_errors(self.xs, self.residual, self.gamma, outs, pattern)


def worst_of(errs):
    """Per-key maxima of a list of error dicts (harness.worst_of: a NaN stays NaN)."""
    from tests.gpu import harness

    w = {}
    for e in errs:
        harness.worst_of(w, e)
    return w


def matching_calls(ws, rank, world, device, stream, seed, torch):
    """MATCHING on `ws`; returns (per-call errors, their worst, digest of all outputs)."""
    errs, digest = [], hashlib.sha256()
    for i, (pattern, m, oneshot) in enumerate(MATCHING):
        c = Case(seed + i, world, m, rank, device, torch)
        c.launch(ws, pattern, oneshot=oneshot, stream=stream)
        stream.synchronize()
        errs.append({**c.errors(pattern), "call": [pattern, m, oneshot]})
        for k in KEYS[pattern]:
            digest.update(c.outs[k].cpu().view(torch.uint8).numpy().tobytes())
    worst = worst_of([{k: v for k, v in e.items() if k != "call"} for e in errs])
    return errs, worst, digest.hexdigest()


def make_workspace(
    ext,
    chan,
    tag,
    device,
    world,
    rank,
    *,
    handshake,
    timeout_s,
    kernel_timeout_s=None,
    max_tokens=MAX_TOKENS,
):
    """A workspace over CUDA IPC; ``timeout_s`` is the handshake's, ``kernel_timeout_s``
    the kernel's bounded waits' (None: the default)."""
    from jax_fusedar.common import lost_traps, native

    kw = {} if kernel_timeout_s is None else {"timeout_s": kernel_timeout_s}
    kw.update(handshake=handshake, handshake_timeout_s=timeout_s)
    code = native.DTYPE_CODES[DTYPE]
    ws = ext.Rank(device, world, rank, max_tokens, HIDDEN, code, **kw)
    connect_ipc(ws, chan, rank, f"ipc-{tag}")
    chan.barrier(f"ready-{tag}")
    lost_traps.watch(ws, device)  # as the JAX and torch workspaces do
    return ws


def graph_replays(ws, rank, world, device, seed, torch, chan):
    """3 checked pattern-1 calls captured in a CUDA graph and replayed 3 times (poisoned, then
    checked), then one eager call: the device call counter must have advanced in step."""
    c = Case(seed, world, 16, rank, device, torch)
    g = torch.cuda.CUDAGraph()
    capture_error = None
    try:
        # relaxed: the point is the call counter under replay, not capture strictness
        with torch.cuda.graph(g, capture_error_mode="relaxed"):
            s = torch.cuda.current_stream(device)
            for k in range(3):
                c.launch(ws, 1, oneshot=(k != 1), stream=s)
    except Exception as e:  # noqa: BLE001 - reported, and both ranks skip the replays
        capture_error = f"{type(e).__name__}: {e}"
    errors = chan.all_gather("graph-captured", capture_error)
    if any(errors):
        return {"capture_errors": errors}
    stream = torch.cuda.current_stream(device)
    errs = []
    for replay in (True, True, True, False):  # the last one an eager call
        for t in c.outs.values():
            t.fill_(float("nan"))
        if replay:
            g.replay()
        else:
            c.launch(ws, 1, oneshot=True, stream=stream)
        stream.synchronize()
        errs.append(c.errors(1))
    del g
    return {"capture_errors": None, "worst": worst_of(errs), "replays": 3}


def timing(ws, rank, world, device, seed, torch, *, calls=100, reps=5):
    """Median over `reps` of (ms for `calls` back-to-back pattern-1 one-shot calls)/calls;
    the last call's outputs are checked."""
    c = Case(seed, world, 16, rank, device, torch)
    stream = torch.cuda.current_stream(device)
    per_call = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(calls):
            c.launch(ws, 1, oneshot=True, stream=stream)
        end.record(stream)
        stream.synchronize()
        per_call.append(start.elapsed_time(end) / calls)
    out = {"ms_per_call_median": float(np.median(per_call)), "ms_per_call": per_call}
    return {**out, "last_call": c.errors(1)}


def await_verdict(chan, result, tag, timeout_s=AFTER_FAILURE_WAIT_S):
    """Waits at most ``timeout_s`` for every rank at barrier ``tag``; a rank that never comes
    (a peer whose lost trap ended its process) is noted as ``peer_gone``."""
    try:
        chan.barrier(tag, timeout_s=timeout_s)
    except TimeoutError as e:
        result["peer_gone"] = str(e)


def check_untouched(result, ws, device, torch):
    """For the rank that made no failing call: its CUDA context still computes, its record
    is empty; then frees ``ws``."""
    t = torch.arange(1000, device=device, dtype=torch.float32)
    result["healthy_after"] = float(t.sum().item()) == 499500.0
    result["failure_record"] = ws.failure()
    ws.destroy()


def failing_launch(ws, launch, stream, out, *, relaunch=None, launch_returned=False):
    """Into ``out``: ``launch()``, a call that must fail (``launch_returned``: its seconds), its
    stream's error and seconds, the failure record, and the refused ``relaunch()`` (or launch)."""
    t0 = time.monotonic()
    launch()
    if launch_returned:
        out["launch_returned_s"] = time.monotonic() - t0
    out["sync_error"] = error_text(stream.synchronize, 600)
    out["elapsed_s"] = time.monotonic() - t0
    flush_c_stdio()
    out["failure_record"] = ws.failure()
    out["relaunch_error"] = error_text(relaunch or launch, 1500)
    return out


def finish_ok(result, ws, off, rank, world, device, seed, torch, chan):
    """The "ok" case's end: a CUDA graph on ``ws``, the per-call time on ``ws`` and on
    ``off`` (the check or the timeout off), ``ws``'s record; both workspaces freed."""
    result["graph"] = graph_replays(ws, rank, world, device, seed + 100, torch, chan)
    chan.barrier("timing")
    result["timing_on"] = timing(ws, rank, world, device, seed + 200, torch)
    result["timing_off"] = timing(off, rank, world, device, seed + 200, torch)
    result["failure_record"] = ws.failure()
    chan.barrier("done")
    for w in (ws, off):
        w.destroy()
    return result


def failing_call_of(case, rank, world=2):
    """(pattern, tokens, one-shot) of `case`'s failing call on `rank` (None: no call)."""
    if case == "tokens":
        return 1, (16 if rank == 0 else 17), True
    if case == "pattern":
        return (0 if rank == 0 else 1), 16, True
    if case == "oneshot":
        return 1, 32, rank == 0
    if case == "timeout":
        return None if rank == world - 1 else (1, 16, True)
    raise ValueError(case)


def _failing_call(ws, rank, case, device, seed, world, torch):
    """The mismatching call of `case` on this rank (None: this rank makes no call)."""
    call = failing_call_of(case, rank, world)
    if call is None:
        return None
    pattern, m, oneshot = call
    c = Case(seed, world, m, rank, device, torch)
    stream = torch.cuda.current_stream(device)
    launch = lambda: c.launch(ws, pattern, oneshot=oneshot, stream=stream)
    return failing_launch(ws, launch, stream, {"call": [pattern, m, oneshot]}, launch_returned=True)


def worker(rank, world, chan, *, case, seed):
    import torch
    from jax_fusedar.common import native

    ext = native.require()
    device = rank % max(1, torch.cuda.device_count())
    torch.cuda.set_device(device)
    stream = torch.cuda.current_stream(device)
    timeout_s = TIMEOUT_CASE_S if case == "timeout" else MISMATCH_TIMEOUT_S
    result = {"rank": rank, "device": device, "case": case}
    result["gpu"] = torch.cuda.get_device_name(device)
    ws = make_workspace(
        ext, chan, "checked", device, world, rank, handshake=True, timeout_s=timeout_s
    )
    result["handshake"], result["handshake_timeout_s"] = ws.handshake, ws.handshake_timeout_s
    calls = (rank, world, device, stream, seed, torch)
    result["matching"], result["worst"], result["digest"] = matching_calls(ws, *calls)
    if case == "ok":
        off = make_workspace(
            ext, chan, "unchecked", device, world, rank, handshake=False, timeout_s=30.0
        )
        result["off_handshake"] = off.handshake
        _, result["off_worst"], result["off_digest"] = matching_calls(off, *calls)
        return finish_ok(result, ws, off, rank, world, device, seed, torch, chan)
    chan.barrier("before-mismatch")
    if failing_call_of(case, rank, world) is not None:
        # Kept by the harness if this process ends without a result (a lost trap).
        chan.note(**result, failing_call_at=time.monotonic())
    result["failing"] = _failing_call(ws, rank, case, device, seed + 999, world, torch)
    await_verdict(chan, result, "after-mismatch")  # the last rank of "timeout" waits here
    if result["failing"] is None:  # this rank made no call: its context must be healthy
        check_untouched(result, ws, device, torch)
    flush_c_stdio()
    return result


def main(argv):
    from jax_fusedar.common import lost_traps
    from tests.gpu.harness import run_ranks

    case, world = case_of(argv, CASES, "ok", any_world=lambda c: c in ("ok", "timeout"))
    seed = new_seed()
    kw = dict(timeout_s=120, case=case, seed=seed, allow_exit=(lost_traps.EXIT_CODE,))
    print_result({"case": case, "seed": seed}, "ranks", lambda: run_ranks(worker, world, **kw))


if __name__ == "__main__":
    main(sys.argv)
