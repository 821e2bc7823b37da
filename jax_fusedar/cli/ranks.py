"""How the demo's TP group runs: one process driving a device per rank, or one process per
rank when there are fewer GPUs than ranks (they share the GPUs).

``python -m jax_fusedar demo`` on a machine with fewer GPUs than the TP size (``--tp``,
default: every GPU, or 2 on a one-GPU machine) starts one process per rank
(``python -m jax_fusedar.cli.rank_process``): rank r drives GPU r % G through ``jax.distributed``,
with on-demand GPU memory (XLA_PYTHON_CLIENT_PREALLOCATE=false, so that 8 ranks fit on one
GPU). XLA's NCCL refuses two ranks on one GPU, so in that program every cross-process
collective is the fused kernel (``jax_fusedar/cli/shared_demo.py`` says how), and the
reference it is checked against is the same model unsharded on one device of rank 0 (no
collective). Ranks sharing a GPU take turns on it, so timings there measure the GPU's time
slicing, not the kernel: the demo shows none and ``--bench`` refuses to run
(``shared_gpu_timing``; so do the benchmarks of the checkout, ``benchmarks/``). With one
GPU per rank nothing changes: one process drives them all.

``--processes per-rank`` forces one process per rank anywhere; on CPUs the ranks run the
reference path (XLA's all-reduce over gloo), which is how the CPU tests exercise this.

This module imports no JAX (the CLI calls it before JAX starts); a rank process runs
``jax_fusedar/cli/rank_process.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from ..common import limits

PROCESS_MODES = ("auto", "one", "per-rank")
# What every process we start inherits: never NVLink multicast (docs/decisions.md).
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
# After one rank fails, the others get this long to fail or finish on their own (a rank
# waiting for it in the kernel fails after the kernel's timeout_s, 30 s by default) before
# they are stopped.
GRACE_S = 45.0
STOP_WAIT_S = 10.0  # SIGTERM, then SIGKILL after this; then give up on the process
RESULT_FILE = "rank{}.json"
# The XLA flag that splits the host into virtual CPU devices. A count set there is the demo's
# default TP size on CPUs; without one the demo runs DEFAULT_CPU_WORLD ranks.
HOST_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
DEFAULT_CPU_WORLD = 8


def shared_gpu_timing(gpus: int, world: int) -> str:
    """Why nothing is timed when ranks share GPUs (the demo prints it; --bench refuses with
    it)."""
    return (
        f"{world} ranks would share {gpus} GPU{'s' if gpus != 1 else ''}: ranks sharing "
        f"a GPU take turns on it (the GPU time-slices their kernels, and each all-reduce "
        f"waits for every rank's turn), so a timing measures that scheduling, not the "
        f"kernel"
    )


def _tp(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    problem = limits.kernel_support_problem(value, 16, "bfloat16")
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return value


def add_arguments(parser) -> None:
    """The demo's flags for the TP size and how its ranks run."""
    parser.add_argument(
        "--tp",
        type=_tp,
        default=None,
        help="tensor-parallel size: 2, 4, 8 or 16 (default: every GPU; 2 on "
        "a one-GPU machine; on CPUs the device count in XLA_FLAGS, else 8: the "
        "CLI makes that many virtual CPU devices). With fewer GPUs than ranks, "
        "one process per rank shares the GPUs",
    )
    parser.add_argument(
        "--processes",
        choices=PROCESS_MODES,
        default="auto",
        help="auto: one process driving a device per rank, or one process "
        "per rank when there are fewer GPUs than ranks; one: always one "
        "process; per-rank: always one process per rank (on CPUs over gloo)",
    )


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a demo's TP group runs. ``gpus`` 0 means CPUs (virtual devices, or one CPU device
    per rank process)."""

    world: int
    gpus: int
    per_rank: bool

    @property
    def platform(self) -> str:
        return "cuda" if self.gpus else "cpu"

    @property
    def shared_gpus(self) -> bool:
        return 0 < self.gpus < self.world

    def device_of(self, rank: int) -> int:
        """The local device rank ``rank``'s process drives (GPU rank % gpus)."""
        return rank % self.gpus if self.gpus else 0


def plan(tp: Optional[int], processes: str, gpus: int, host_devices: Optional[int] = None) -> Plan:
    """The TP size and process layout for ``--tp``/``--processes`` on a machine with ``gpus``
    GPUs: every GPU by default (2 ranks on one GPU); on CPUs the count the user's XLA_FLAGS
    sets (``host_devices``), else ``DEFAULT_CPU_WORLD`` virtual devices; one process per
    rank when the GPUs are fewer than the ranks (or when asked). ValueError names the flag
    when a layout cannot run."""
    if tp is not None:
        world = tp
    elif gpus:
        world = gpus if gpus >= 2 else 2
    else:
        world = DEFAULT_CPU_WORLD if host_devices is None else host_devices
        problem = limits.kernel_support_problem(world, 16, "bfloat16")
        if problem:
            raise ValueError(
                f"XLA_FLAGS sets {HOST_DEVICE_COUNT_FLAG}={world}, which the demo takes as "
                f"its TP size on CPUs: {problem}; pass --tp 2, 4, 8 or 16 (the demo then "
                f"makes that many CPU devices itself, whatever XLA_FLAGS says)"
            )
    fewer = 0 < gpus < world
    if processes == "one" and fewer:
        raise ValueError(
            f"--processes one: a process drives each device once, and --tp "
            f"{world} needs {world} GPUs where this machine has {gpus}; use "
            f"--processes auto (one process per rank, sharing the GPUs)"
        )
    return Plan(world=world, gpus=gpus, per_rank=processes == "per-rank" or fewer)


def host_devices(env) -> Optional[int]:
    """The CPU device count that ``XLA_FLAGS`` in ``env`` sets, or None (the last occurrence
    counts, as when XLA parses the flags)."""
    found = re.findall(rf"{HOST_DEVICE_COUNT_FLAG}=(\d+)(?!\S)", env.get("XLA_FLAGS", ""))
    return int(found[-1]) if found else None


def jax_sees_gpus(env) -> bool:
    """Whether JAX may start a GPU backend: not when ``JAX_PLATFORMS`` lists no GPU platform
    (``JAX_PLATFORMS=cpu`` on a GPU machine runs the demo on CPU devices)."""
    platforms = [p.strip() for p in env.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    return not platforms or any(p in ("cuda", "gpu", "rocm") for p in platforms)


def single_process_config(p: Plan) -> dict:
    """The JAX configuration (``jax.config.update`` names and values) that makes one process
    see exactly the TP group's devices: on CPUs ``p.world`` virtual devices, whatever the
    user's XLA_FLAGS say (``jax_num_cpu_devices`` takes precedence over
    ``--xla_force_host_platform_device_count``); on a machine with more GPUs than ranks the
    first ``p.world``. JAX reads both only when it creates its backends, so set through
    ``jax.config`` before anything runs they hold even where JAX was imported earlier (its
    environment variables, ``JAX_NUM_CPU_DEVICES`` included, are read at import)."""
    if p.per_rank:
        return {}
    if not p.gpus:
        return {"jax_num_cpu_devices": p.world}
    if p.gpus > p.world:
        return {"jax_cuda_visible_devices": ",".join(map(str, range(p.world)))}
    return {}


def rank_env(p: Plan, env) -> dict:
    """A rank process's environment: JAX on the plan's platform with one device, GPU memory
    taken on demand (ranks sharing a GPU must fit together), no NVLink multicast. A GPU rank
    keeps the CPU platform too, second (the default backend is the first listed): host
    callbacks (jax.debug.callback, which the MoE demo's tolerance uses) run on a CPU device."""
    out = {k: v for k, v in env.items() if k not in ("JAX_CUDA_VISIBLE_DEVICES",)}
    out.update(NO_MULTICAST)
    platforms = p.platform if p.platform == "cpu" else f"{p.platform},cpu"
    out.update(JAX_PLATFORMS=platforms, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1")
    if not p.gpus:
        out["JAX_NUM_CPU_DEVICES"] = "1"
    return out


def rank_command(p: Plan, rank: int, port: int, result_dir: str, demo_argv) -> list:
    return [
        sys.executable,
        "-m",
        "jax_fusedar.cli.rank_process",
        "--rank",
        str(rank),
        "--world",
        str(p.world),
        "--gpus",
        str(p.gpus),
        "--port",
        str(port),
        "--result-dir",
        result_dir,
        "--",
        *demo_argv,
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _stop(procs, ranks, say) -> None:
    """SIGTERM, then SIGKILL: each rank gets STOP_WAIT_S after each. A process that outlives
    SIGKILL (stuck in the GPU driver) is named and left behind, so this returns anyway."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [r for r in ranks if procs[r].poll() is None]
        for r in alive:
            try:
                procs[r].send_signal(sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + STOP_WAIT_S
        while time.monotonic() < deadline and any(procs[r].poll() is None for r in alive):
            time.sleep(0.1)
    stuck = [r for r in ranks if procs[r].poll() is None]
    if stuck:
        say(
            f"ranks {stuck} did not exit after SIGKILL (a process stuck in the GPU driver); "
            f"pids {[procs[r].pid for r in stuck]}"
        )


def launch(
    p: Plan, demo_argv, *, prog: str = "python -m jax_fusedar demo", env=None, out=None
) -> int:
    """Runs the demo as ``p.world`` rank processes and returns the exit code: rank 0's
    verdict (0 PASS, 1 FAIL, 2 a configuration it cannot run), 1 when another rank failed
    or the ranks disagree. Rank 0 prints the report; the others' output goes to logs, whose
    tails are printed when a rank fails."""
    env = dict(os.environ if env is None else env)
    out = sys.stdout if out is None else out

    def say(text):
        print(f"{prog}: {text}", file=out, flush=True)

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="jax_fusedar_ranks_") as tmp:
        logs = [Path(tmp, f"rank{r}.log") for r in range(p.world)]
        procs = []
        try:
            for r in range(p.world):
                log = None if r == 0 else open(logs[r], "w")
                procs.append(
                    subprocess.Popen(
                        rank_command(p, r, port, tmp, demo_argv),
                        env=rank_env(p, env),
                        stdout=log,
                        stderr=subprocess.STDOUT if log else None,
                    )
                )
                if log:
                    log.close()  # the child holds its own descriptor
            failed_at = None
            while any(q.poll() is None for q in procs):
                codes = [q.poll() for q in procs]
                if failed_at is None and any(c not in (None, 0) for c in codes):
                    failed_at = time.monotonic()
                if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
                    running = [r for r, c in enumerate(codes) if c is None]
                    say(f"stopping ranks {running}: another rank failed {GRACE_S:.0f} s ago")
                    _stop(procs, running, say)
                    break
                time.sleep(0.2)
        except KeyboardInterrupt:
            _stop(procs, range(len(procs)), say)
            raise
        codes = [q.poll() for q in procs]
        for r, c in enumerate(codes):
            if r and c != 0:
                say(f"rank {r} exited with {c}; the end of its output:\n{_tail(logs[r])}")
        if codes[0] is None or codes[0] < 0:
            say(f"rank 0 did not finish (exit {codes[0]})")
            return 1
        if codes[0] != 0:
            return codes[0]
        if any(c != 0 for c in codes):
            return 1
        results = [json.loads(Path(tmp, RESULT_FILE.format(r)).read_text()) for r in range(p.world)]
        digests = {json.dumps(r["tokens"], sort_keys=True) for r in results}
        if len(digests) != 1:
            say(
                "FAIL: the ranks decoded different tokens: "
                + "; ".join(f"rank {r['rank']}: {r['tokens']}" for r in results)
            )
            return 1
        return 0


def dispatch(args, argv, parser, gpus: Optional[int] = None) -> Optional[int]:
    """The CLI's step before JAX starts: a demo whose ranks need processes of their own is
    run here (its exit code is returned); else ``args.plan`` says which devices the one
    process sets up (``single_process_config``; ``args.tp`` becomes its TP size), and None
    says: go on in this process."""
    if gpus is None:
        from ..common import native

        gpus = native.gpu_count() if jax_sees_gpus(os.environ) else 0
    try:
        p = plan(args.tp, args.processes, gpus, host_devices(os.environ))
    except ValueError as e:
        parser.error(str(e))
    if not p.per_rank:
        args.tp, args.plan = p.world, p
        return None
    if args.bench:
        why = (
            shared_gpu_timing(p.gpus, p.world)
            if p.shared_gpus
            else "one process per rank times nothing that one process driving every "
            "device would not time better"
        )
        parser.error(f"--bench: {why}; --bench needs one GPU per rank")
    return launch(p, list(argv)[1:], prog=parser.prog)
