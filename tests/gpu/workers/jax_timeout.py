"""Per-process body of the JAX bounded-wait test (tests/gpu/test_timeout.py): two
`jax.distributed` processes (a GPU each, or sharing one), a workspace with timeout_s=TIMEOUT_S.
Both make one good call (against the float64 oracle); then rank 1 stops and rank 0's next call
must raise from the computation (XLA's generic CUDA error, re-raised by
``ws.explain_errors()`` as RuntimeError with the record naming rank 1), the record reaching
host memory within TIMEOUT_S + 1 s (a thread polls it) and the raise within TIMEOUT_S + 2 s;
``ws.failures()`` and ``ws.raise_if_failed()`` give the same text, and the next call raises
too. Rank 0 sends its findings to rank 1 before that call, in case the dead context takes the
process down.

Where the driver never reports rank 0's trap (ranks sharing a GPU; lost_traps.py), the
watcher ends rank 0 (exit code lost_traps.EXIT_CODE, the record on stderr) lost_traps.GRACE_S
after the record appeared; what rank 0 knew before its failing call is noted to the harness
first (``chan.note``), so the test checks it either way. Rank 1 waits PARTIAL_WAIT_S for rank
0's findings, then reports at once, before rank 0's end takes the `jax.distributed` service
(hosted by process 0) down.

Run by hand:  python -m tests.gpu.workers.jax_timeout   (last stdout line: "RESULT <json>")
"""

import sys
import threading
import time

from tests.gpu.workers.common import error_text, jax_workspace, jit_shard_map, new_seed
from tests.gpu.workers.common import plain_ulps, print_result

import numpy as np

TIMEOUT_S = 3.0
TOKENS, HIDDEN = 16, 4096
# How long rank 1 waits for rank 0's findings: past the raise's bound (TIMEOUT_S + 2 s, which
# the test holds a reported trap to), well before a lost trap's end (TIMEOUT_S +
# lost_traps.GRACE_S at the earliest).
PARTIAL_WAIT_S = TIMEOUT_S + 7.0
# How long rank 0 waits for rank 1 at the end (rank 1 does not wait there once it gave up).
VERDICT_WAIT_S = 30.0


def worker(rank, world, chan, *, port, seed):
    from tests.gpu.workers.jax_multiprocess import _global, _local, _setup

    jax = _setup(rank, world, port, "")
    import jax.numpy as jnp
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P
    import jax_fusedar as jf
    from tests.gpu.harness import draw_case

    mesh = Mesh(np.array(jax.devices()), ("tp",))
    ws = jax_workspace(jf, mesh, 64, HIDDEN, jnp.bfloat16, timeout_s=TIMEOUT_S)
    out = {"rank": rank, "backend": ws.backend, "timeout_s": ws.timeout_s}

    def f(x, r, g):
        kw = dict(axis_name="tp", workspace=ws, use_oneshot=True)
        o = jf.allreduce_fusion(x, residual=r, rms_gamma=g, **kw)
        return o.residual_out, o.norm_out

    fn = jit_shard_map(jax, f, mesh, (P("tp"), P(), P()), (P(), P()))
    xs, res, gam = draw_case(seed, world, TOKENS, HIDDEN, jnp.bfloat16)
    args = [_global(jax, mesh, s, a) for s, a in ((P("tp"), xs[rank]), (P(), res), (P(), gam))]
    r_out, n_out = jax.block_until_ready(fn(*args))
    x64 = [x.astype(np.float64) for x in xs]
    r64, g64 = res.astype(np.float64), gam.astype(np.float64)
    got = dict(residual_out=_local(r_out), norm_out=_local(n_out))
    out["good"] = plain_ulps(x64, r64, g64, "bfloat16", **got)
    chan.barrier("good")
    if rank == 0:
        # Kept by the harness if this process ends without a result (a lost trap).
        facts = {k: out[k] for k in ("backend", "timeout_s", "good")}
        chan.note(**facts, failing_call_at=time.monotonic())
        failing = {}
        # Where the time goes: when the call was handed to XLA, when the kernel's record
        # appeared in host memory (polled), when XLA raised.
        seen = {}

        def watch():
            while "raised" not in seen:
                if "record" not in seen and ws.failures():
                    seen["record"] = time.monotonic()
                time.sleep(0.005)

        watcher = threading.Thread(target=watch, daemon=True)
        t0 = time.monotonic()
        watcher.start()
        try:
            with ws.explain_errors():
                result = fn(*args)
                seen["dispatched"] = time.monotonic()
                jax.block_until_ready(result)
            failing["error"] = None
        except Exception as e:  # noqa: BLE001 - the expected outcome
            failing["error"] = f"{type(e).__name__}: {e}"[:1500]
            failing["xla_error"] = f"{type(e.__cause__).__name__}: {e.__cause__}"[:600]
        failing["elapsed_s"] = time.monotonic() - t0
        seen["raised"] = time.monotonic()
        watcher.join()
        failing["timeline_s"] = {k: round(v - t0, 4) for k, v in seen.items()}
        failing["failures"] = ws.failures()
        try:
            ws.raise_if_failed()
            failing["raise_if_failed"] = None
        except RuntimeError as e:
            failing["raise_if_failed"] = str(e)
        chan.all_gather("partial", failing)
        failing["next_call_error"] = error_text(lambda: jax.block_until_ready(fn(*args)), 2000)
        out["failing"] = failing
    else:
        try:
            out["rank0_partial"] = chan.all_gather("partial", None, timeout_s=PARTIAL_WAIT_S)[0]
        except TimeoutError as e:  # rank 0's synchronization did not return
            out["rank0_partial"] = None
            out["rank0_silent"] = str(e)
        out["failures"] = ws.failures()
        if out["rank0_partial"] is None:
            return out  # report before rank 0's end can stop this process
    from tests.gpu.workers.native_mismatch import await_verdict

    await_verdict(chan, out, "verdict", VERDICT_WAIT_S)  # rank 1 may have given up and left
    return out


def main(argv):
    from tests.gpu.harness import free_port
    from tests.gpu.workers.native_timeout import run_ranks_allowing_death

    seed = new_seed()
    run = lambda: run_ranks_allowing_death(worker, 2, timeout_s=150, port=free_port(), seed=seed)
    print_result({"seed": seed, "timeout_s": TIMEOUT_S}, "ranks", run)


if __name__ == "__main__":
    main(sys.argv)
