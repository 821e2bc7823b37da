"""``python -m jax_fusedar.cli.rank_process``: one rank of ``python -m jax_fusedar demo`` run
as one process per rank. The demo starts these itself (jax_fusedar/cli/ranks.py); this
process joins ``jax.distributed`` on its device (GPU rank % G, or one CPU device over gloo),
runs its part of the demo (jax_fusedar/cli/shared_demo.py) and writes its result where the
launcher reads it. Exit code: 0 PASS, 1 FAIL, 2 a configuration it cannot run."""

from __future__ import annotations

import argparse
import json
import sys
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
    shutdown_in_order()
    return code


def shutdown_in_order() -> list:
    """Ends this rank's part of ``jax.distributed`` in order: first JAX's backends (the PJRT
    clients, which hold the distributed client and, on GPUs, watch the other tasks through
    it with a long-polling WatchTasks call), then the distributed client (with the other
    ranks, at its shutdown barrier), and on rank 0 the coordination service last. Shut down
    the other way round, as ``jax.distributed.shutdown()`` alone does when the clients live
    on until the process exits, the pending watch fails as its service goes away, and JAX
    prints a "WatchTasksAsync failed ... CANCELLED / UNAVAILABLE" trace after PASS.
    Returns the backends (by platform) whose client was still alive when the distributed
    client shut down: unregistered, a client lives on only while something holds it (after
    the CPU demo, JAX 0.10.2 still holds the CPU client through no Python reference the
    collector sees; tests/cli/test_ranks.py checks a plain psum frees it)."""
    import gc
    import weakref

    import jax
    from jax.extend import backend

    clients = {name: weakref.ref(c) for name, c in backend.backends().items()}
    backend.clear_backends()  # also drops the compiled programs, which hold the clients
    gc.collect()
    alive = sorted(name for name, ref in clients.items() if ref() is not None)
    jax.distributed.shutdown()
    return alive


if __name__ == "__main__":
    sys.exit(main())
