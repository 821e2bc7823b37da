"""GPU body of the kernel's bounded waits (timeout_s; ffi/core/watchdog.h): two ranks in two
processes (CUDA IPC, the handshake off), one case per run, because a trapped kernel kills
the CUDA context of its process.

  ok             same_bits_calls() good calls (pattern 0/1 shapes, one- and two-shot) on a
                 workspace with the timeout on and, call for call, one with it off: the same
                 bits (counted on the device), within the float64 oracle's bounds; a CUDA
                 graph of good calls replayed; the per-call time on vs off.
  never_oneshot  after a few good calls rank 1 makes no call; rank 0's one-shot call
  never_twoshot  (Lamport poll) / two-shot call (barrier flags) must fail within
                 TIMEOUT_S + 1 s, its record naming rank 1, the next launch refused with it.
  killed         after a few good calls rank 1 is SIGKILLed; rank 0's next call fails alike.
  tokens         rank 0 calls one-shot with 16 tokens, rank 1 with 17 (no handshake): both
                 ranks must fail within TIMEOUT_S + 1 s, each naming the other.
  never_large    after a good LARGE_TOKENS call (the large-message algorithm) rank 1 makes no
                 call; rank 0's large-message call (its entry flag wait) must fail alike.
  destroy_waits  rank 0 launches a one-shot call no peer joins and destroys the workspace at
                 once, whose cudaDeviceSynchronize waits for the timeout: a Python thread must
                 keep running (destroy releases the GIL), failure() still read the record.

The "never_*" cases also run with more ranks (the last one makes no call). Where the driver
never reports a rank's trap (ranks sharing a GPU timing out together; lost_traps.py), its
process ends with lost_traps.EXIT_CODE and the record on stderr: its result is
harness.run_ranks's {"rank", "exitcode", "exited_at", "notes"} (notes: the good calls' errors
and when the failing call began); the others wait AFTER_FAILURE_WAIT_S for it.

Run one case by hand:  python -m tests.gpu.workers.native_timeout never_oneshot [world]
The last stdout line is "RESULT <json>".
"""

import os
import signal
import sys
import time

from tests.gpu.workers.common import case_of, error_text, new_seed, print_result

from tests.gpu.workers.native_mismatch import DTYPE, HIDDEN, KEYS, MATCHING, Case
from tests.gpu.workers.native_mismatch import await_verdict, check_untouched, failing_launch
from tests.gpu.workers.native_mismatch import finish_ok, flush_c_stdio, make_workspace
from tests.gpu.workers.native_mismatch import new_outputs, worst_of
from tests.gpu.workers.native_mismatch import BOUNDS  # noqa: F401 - the tests read it here

TIMEOUT_S = 3.0


def same_bits_calls(world: int = 2) -> int:
    """How many calls of each workspace the "ok" case compares: $JAX_FUSEDAR_TIMEOUT_CALLS,
    else 10,000 with a GPU per rank and 1,000 where the ranks share GPUs: their kernels take
    turns on a GPU (about 3 ms a call on one H200) and never run at the same time, so a
    longer loop gives no more chance to catch a race."""
    from jax_fusedar.common import native

    default = 10000 if native.gpu_count() >= world else 1000
    return int(os.environ.get("JAX_FUSEDAR_TIMEOUT_CALLS", default))


# (pattern, tokens, one-shot) cycled through by the good calls: the handshake cases'
# matching calls, then a 3-token all-reduce
CYCLE = [*MATCHING, (0, 3, True)]
GOOD_FIRST = 3  # good calls every failure case makes first
CASES = ("ok", "never_oneshot", "never_twoshot", "killed", "tokens", "never_large", "destroy_waits")
TICK_S = 0.01  # the destroy_waits case's Python thread counts these while destroy waits
# Above the auto crossover at 2 ranks (launch_mode.LARGE_MESSAGE_MIN_MIB: 48 MiB per rank):
# 8192 x 4096 bf16 is 64 MiB.
LARGE_TOKENS = 8192


def _good_calls(ws, rank, world, device, seed, torch, n=GOOD_FIRST):
    stream = torch.cuda.current_stream(device)
    errs = []
    for i in range(n):
        pattern, m, oneshot = CYCLE[i % len(CYCLE)]
        c = Case(seed + i, world, m, rank, device, torch)
        c.launch(ws, pattern, oneshot=oneshot, stream=stream)
        stream.synchronize()
        errs.append(c.errors(pattern))
    return worst_of(errs)


def _same_bits(on, off, rank, world, device, seed, torch):
    """same_bits_calls() interleaved calls on each workspace, same inputs: the differing output
    bytes (counted on the device) and the oracle errors of each cycle entry's last call."""
    stream = torch.cuda.current_stream(device)
    # (pattern, case, the timeout-off call's outputs) per cycle entry
    cases = []
    for i, (pattern, m, oneshot) in enumerate(CYCLE):
        c = Case(seed + i, world, m, rank, device, torch)
        cases.append((pattern, oneshot, c, new_outputs(c.x, torch)))
    differing = torch.zeros((), dtype=torch.int64, device=device)
    t0 = time.monotonic()
    calls = same_bits_calls(world)
    for i in range(calls):
        pattern, oneshot, c, out_off = cases[i % len(cases)]
        for k in KEYS[pattern]:  # different poisons: an unwritten output differs
            c.outs[k].fill_(float("nan"))
            out_off[k].fill_(float("inf"))
        c.launch(on, pattern, oneshot=oneshot, stream=stream)
        c.launch(off, pattern, out_off, oneshot=oneshot, stream=stream)
        for k in KEYS[pattern]:
            differing += (c.outs[k].view(torch.uint8) != out_off[k].view(torch.uint8)).sum()
    stream.synchronize()
    errs = []
    for pattern, _, c, out_off in cases:
        errs += [c.errors(pattern), c.errors(pattern, out_off)]
    out = {"calls": calls, "differing_bytes": int(differing.item()), "worst": worst_of(errs)}
    return {**out, "seconds": time.monotonic() - t0}


def large_algorithm(world):
    """The algorithm auto picks for LARGE_TOKENS x HIDDEN on a workspace of that size (the
    pure policy, as every front end calls it)."""
    from jax_fusedar.common import launch_mode, sizing

    sizes = sizing.workspace_sizes(world, LARGE_TOKENS, HIDDEN, DTYPE)
    return launch_mode.choose_algorithm(LARGE_TOKENS, HIDDEN, sizes, None)


def _good_large_call(ws, rank, world, device, seed, torch, algorithm):
    """One pattern-1 call of LARGE_TOKENS with `algorithm`: its errors against the oracle."""
    c = Case(seed, world, LARGE_TOKENS, rank, device, torch)
    stream = torch.cuda.current_stream(device)
    c.launch(ws, 1, oneshot=False, stream=stream, algorithm=algorithm)
    stream.synchronize()
    return c.errors(1)


def _failing_call(ws, pattern, m, oneshot, rank, device, seed, world, torch, algorithm=None):
    c = Case(seed, world, m, rank, device, torch)
    stream = torch.cuda.current_stream(device)
    out = {"call": [pattern, m, oneshot], "algorithm": algorithm}
    launch = lambda: c.launch(ws, pattern, oneshot=oneshot, stream=stream, algorithm=algorithm)
    return failing_launch(ws, launch, stream, out)


def _destroy_during_a_failing_call(ws, rank, device, seed, world, torch, note):
    """Launches a one-shot call that no peer joins and destroys ``ws`` at once: the destroy
    waits for the call's timeout (TIMEOUT_S) in cudaDeviceSynchronize. A thread ticks every
    TICK_S meanwhile; the ticks show whether the GIL was free during the wait."""
    import threading

    c = Case(seed, world, 16, rank, device, torch)
    stream = torch.cuda.current_stream(device)
    ticks, stop = [0], threading.Event()

    def tick():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(TICK_S)

    thread = threading.Thread(target=tick, daemon=True)
    c.launch(ws, 1, oneshot=True, stream=stream)
    note()
    thread.start()
    t0 = time.monotonic()
    error = error_text(ws.destroy, 600)  # the trapped call's CUDA error
    out = {"destroy_s": time.monotonic() - t0, "ticks": ticks[0], "destroy_error": error}
    stop.set()
    thread.join()
    flush_c_stdio()
    out["alive_after"] = ws.alive
    out["failure_after_destroy"] = ws.failure()
    return out


def worker(rank, world, chan, *, case, seed):
    import torch
    from jax_fusedar.common import native
    from tests.gpu.harness import device_for

    ext = native.require()
    device = device_for(rank)  # ranks share the GPU when there is one
    torch.cuda.set_device(device)
    result = {"rank": rank, "device": device, "case": case}
    result["gpu"] = torch.cuda.get_device_name(device)
    size = {"max_tokens": LARGE_TOKENS} if case == "never_large" else {}
    kw = dict(handshake=False, timeout_s=30.0)
    ws = make_workspace(
        ext, chan, "on", device, world, rank, **kw, kernel_timeout_s=TIMEOUT_S, **size
    )
    result["timeout_s"] = ws.timeout_s
    if case == "ok":
        off = make_workspace(ext, chan, "off", device, world, rank, **kw, kernel_timeout_s=0.0)
        result["off_timeout_s"] = off.timeout_s
        result["bits"] = _same_bits(ws, off, rank, world, device, seed, torch)
        return finish_ok(result, ws, off, rank, world, device, seed, torch, chan)
    result["good"] = _good_calls(ws, rank, world, device, seed, torch)
    seq = GOOD_FIRST + 1
    missing = world - 1  # the rank that makes no call (never_*), or is killed
    if case == "never_large":
        result["algorithm"] = algorithm = large_algorithm(world)
        result["good_large"] = _good_large_call(
            ws, rank, world, device, seed + 500, torch, algorithm
        )
        seq += 1
    chan.barrier("good")

    def note_before_failing():  # kept by the harness if the process ends without a result
        chan.note(**result, failing_call_at=time.monotonic())

    if case == "tokens":
        note_before_failing()
        result["failing"] = _failing_call(
            ws, 1, 16 + rank, True, rank, device, seed + 999, world, torch
        )
    elif case == "destroy_waits" and rank != missing:
        result["destroy"] = _destroy_during_a_failing_call(
            ws, rank, device, seed + 999, world, torch, note_before_failing
        )
    elif rank != missing:
        if case == "killed":
            chan.all_gather("dying", None)  # rank 1 kills itself right after this
            time.sleep(1.0)
        note_before_failing()
        if case == "never_large":
            call, extra = (1, LARGE_TOKENS, False), {"algorithm": algorithm}
        else:
            call, extra = ((1, 32, False) if case == "never_twoshot" else (1, 16, True)), {}
        result["failing"] = _failing_call(
            ws, *call, rank, device, seed + 999, world, torch, **extra
        )
    elif case == "killed":
        chan.all_gather("dying", None)
        chan.close()  # rank 0 must get "dying" whole before this process disappears
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    result["expected_call"] = seq
    if case != "killed":
        await_verdict(chan, result, "verdict")  # the missing rank waits here
    if rank == missing and (case.startswith("never") or case == "destroy_waits"):
        check_untouched(result, ws, device, torch)
    flush_c_stdio()
    return result


def run_ranks_allowing_death(fn, world, *, timeout_s, killed=(), **kwargs):
    """harness.run_ranks, but the ranks in `killed` may die by SIGKILL and a rank whose trap
    the driver lost may exit with lost_traps.EXIT_CODE: {"rank": r, "exitcode": code}."""
    from jax_fusedar.common import lost_traps
    from tests.gpu.harness import run_ranks

    res = run_ranks(fn, world, timeout_s=timeout_s, allow_exit=(-9, lost_traps.EXIT_CODE), **kwargs)
    unexpected = [r for r in res if r.get("exitcode") == -9 and r["rank"] not in killed]
    if unexpected:
        raise RuntimeError(f"ranks killed unexpectedly: {unexpected}")
    return res


def main(argv):
    case, world = case_of(argv, CASES, "ok", any_world=lambda c: c.startswith("never"))
    seed = new_seed()
    kw = dict(timeout_s=120, killed=(1,) if case == "killed" else (), case=case, seed=seed)
    print_result(
        {"case": case, "seed": seed, "timeout_s": TIMEOUT_S},
        "ranks",
        lambda: run_ranks_allowing_death(worker, world, **kw),
    )


if __name__ == "__main__":
    main(sys.argv)
