"""``python -m jax_fusedar.cli.rank_process``: one rank of ``python -m jax_fusedar demo`` run
as one process per rank. The demo starts these itself (jax_fusedar/cli/ranks.py); this
process joins ``jax.distributed`` on its device (GPU rank % G, or one CPU device over gloo),
runs its part of the demo (jax_fusedar/cli/shared_demo.py) and writes its result where the
launcher reads it. Exit code: 0 PASS, 1 FAIL, 2 a configuration it cannot run."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from .ranks import RESULT_FILE, Plan


def parser():
    p = argparse.ArgumentParser(
        prog="python -m jax_fusedar.cli.rank_process",
        description="One rank of 'python -m jax_fusedar demo' run as "
        "one process per rank (started by the demo itself).",
    )
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--result-dir", required=True)
    p.add_argument("demo_argv", nargs=argparse.REMAINDER)
    return p


def main(argv=None) -> int:
    opts = parser().parse_args(sys.argv[1:] if argv is None else argv)
    demo_argv = opts.demo_argv[1:] if opts.demo_argv[:1] == ["--"] else opts.demo_argv
    p = Plan(world=opts.world, gpus=opts.gpus, per_rank=True)
    from .main import build_parser  # imports no JAX

    demo_parser, _ = build_parser()
    args = demo_parser.parse_args(["demo", *demo_argv])
    import jax

    if p.platform == "cpu":  # the reference path's psum crosses processes
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{opts.port}",
        num_processes=p.world,
        process_id=opts.rank,
        local_device_ids=[p.device_of(opts.rank)] if p.gpus else None,
    )
    from . import shared_demo
    from .setup import SetupError

    try:
        code, result = shared_demo.run(args, p, opts.rank)
    except SetupError as e:
        print(
            f"python -m jax_fusedar demo: error (rank {opts.rank}): {e}",
            file=sys.stderr,
            flush=True,
        )
        return 2
    Path(opts.result_dir, RESULT_FILE.format(opts.rank)).write_text(json.dumps(result))
    end_in_order(opts.rank, p.world, code)


# How long rank 0 waits for the other ranks to end after the last barrier (they exit at once).
END_WAIT_S = 30.0


def end_in_order(rank: int, world: int, code: int):
    """Ends this rank's process once every rank has its result, without a word from JAX's
    distributed runtime. The PJRT client keeps a long-polling WatchTasks call open to the
    coordination service, which rank 0 hosts; JAX's own shutdown (its exit handler) ends the
    distributed client while that call is pending, or rank 0's service while the other
    ranks' calls are, and JAX prints a "WatchTasksAsync failed ... CANCELLED / UNAVAILABLE"
    trace after PASS. So: every rank meets at a last barrier (its result is written), the
    other ranks end, and rank 0 ends last, once their processes are gone, so no call ever
    sees its service go away. The processes end with os._exit, past the exit handler:
    nothing is left for it to do (the workspaces are destroyed, the results written)."""
    from jax._src import distributed

    client = distributed.global_state.client
    if rank:
        client.key_value_set(f"jax_fusedar_demo_pid_{rank}", str(os.getpid()))
    client.wait_at_barrier("jax_fusedar_demo_end", int(END_WAIT_S * 1000))
    if rank == 0:
        pids = [
            int(client.blocking_key_value_get(f"jax_fusedar_demo_pid_{r}", 1000))
            for r in range(1, world)
        ]
        wait_gone(pids, END_WAIT_S)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def wait_gone(pids, timeout_s: float) -> bool:
    """Waits until each process of ``pids`` has ended (gone, or a zombie its parent has not
    reaped yet: either way it runs no more); False if one still runs after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        if not [pid for pid in pids if _runs(pid)]:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


def _runs(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"  # the state follows the command's name


if __name__ == "__main__":
    sys.exit(main())
