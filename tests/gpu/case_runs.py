"""Runs one case of a GPU worker in a fresh child (``python -m MODULE ARGS``): a trapped kernel
kills its process's CUDA context, the device printf goes to its stdout, and a rank whose trap
the driver never reported ends with jax_fusedar/common/lost_traps.py's record on stderr.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.gpu.harness import report
from tests.repo import REPO

PRINTF_MARK = "jax_fusedar handshake FAILED on rank"
# The first words of every failure record (ffi/core/handshake.cu).
RECORD_HEADS = (
    "jax_fusedar handshake failed on rank",
    "jax_fusedar kernel wait timed out on rank",
)
# From the moment a lost trap's record could appear to the moment harness.run_ranks sees the
# process gone, beyond lost_traps.GRACE_S: the watcher's poll to see the record and its poll
# to act after the grace (lost_traps.POLL_S each), run_ranks's poll, and scheduling on a
# machine busy with other tests.
LOST_TRAP_SLACK_S = 3.0
# Where ranks share a GPU (fewer GPUs than ranks, and the lane runner's other jobs on it too),
# a trapped kernel's host call returns later than the kernel's own record says it gave up:
# each context waits its turn on the time-sliced GPU before the driver reports its trap. The
# kernel's measured wait stays within its bound; the host's return came up to about 1 s per
# rank sharing the GPU later (one H200, 4 lane jobs, 2026-12-02, timeout_s=3: at 2 ranks
# 4.6-6.1 s, at 8 ranks 9.7 s and, for the handshake's timeout, 15.9 s). The slack doubles
# that: 2 s per rank on the busiest GPU; with one GPU per rank it is 0.
SHARED_GPU_HOST_SLACK_PER_RANK_S = 2.0


def host_slack_s(world: int) -> float:
    """Extra seconds a trapped call may take to return on the host at this world size."""
    from jax_fusedar.common import native

    gpus = max(1, native.gpu_count())
    return 0.0 if gpus >= world else SHARED_GPU_HOST_SLACK_PER_RANK_S * -(-world // gpus)


# What a JAX child must not inherit from the test's process: the lane runner keeps pytest
# itself on CPU, and the rest would change what the child computes.
JAX_VARS = (
    "JAX_PLATFORMS",
    "XLA_FLAGS",
    "JAX_FUSEDAR_STRICT",
    "JAX_FUSEDAR_ALLREDUCE_BACKEND",
    "JAX_FUSEDAR_HANDSHAKE",
)


def child_env(drop, **extra):
    """os.environ with no multicast (NCCL, torch, NVSHMEM), unbuffered Python and ``extra``,
    less the variables in ``drop``."""
    from tests.gpu.workers.common import NO_MULTICAST

    env = dict(os.environ, **NO_MULTICAST, PYTHONUNBUFFERED="1", **extra)
    for var in drop:
        env.pop(var, None)
    return env


def run_python(argv, *, env, timeout):
    """``python ARGV`` in the repository's root, its output captured as text."""
    cmd = [sys.executable, *map(str, argv)]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def _last_result(stdout):
    """The object of the last ``RESULT <json>`` line, or None."""
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(lines[-1][len("RESULT ") :]) if lines else None


def result_of(proc) -> dict:
    """The object of a finished child's last ``RESULT <json>`` line; fails unless the child
    exited with 0 and printed one."""
    result = _last_result(proc.stdout)
    assert proc.returncode == 0 and result is not None, proc.stdout[-4000:] + proc.stderr[-4000:]
    return result


def run_case(module, *args, timeout_s):
    """``python -m module *args``'s ``RESULT <json>`` object (no multicast, no handshake
    variables), with ``rc``, ``output_tail``, ``printf_lines`` (the device printf) and
    ``lost_trap_lines``; fails if the child hangs past ``timeout_s`` or prints no result."""
    import pytest

    env = child_env(
        (
            "JAX_FUSEDAR_HANDSHAKE",
            "JAX_FUSEDAR_HANDSHAKE_TIMEOUT_S",
            "JAX_FUSEDAR_CHECK_CALLS",  # the names until 0.1.0, still read
            "JAX_FUSEDAR_CHECK_TIMEOUT_S",
            "JAX_PLATFORMS",  # the lane runner keeps pytest itself on CPU
        )
    )
    try:
        proc = run_python(["-m", module, *args], env=env, timeout=timeout_s)
        out, err, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
        pytest.fail(
            f"{module} {args} did not finish within {timeout_s} s (a hang?)\n"
            f"stdout tail:\n{text(e.stdout)[-4000:]}\nstderr tail:\n{text(e.stderr)[-4000:]}"
        )
    result = _last_result(out)
    assert result is not None, (
        f"{module} {args} printed no RESULT line (rc {rc})\nstdout tail:\n"
        f"{out[-4000:]}\nstderr tail:\n{err[-4000:]}"
    )
    result["rc"] = rc
    result["output_tail"] = (out + "\n--- stderr ---\n" + err)[-8000:]
    result["printf_lines"] = [line for line in (out + err).splitlines() if PRINTF_MARK in line]
    result["lost_trap_lines"] = lost_trap_lines(err)
    return result


def checked_case(name, worker, *args, timeout_s):
    """run_case of tests.gpu.workers.<worker> ARGS, reported as ``name``; fails on the error
    the worker reports instead of ranks."""
    res = run_case(f"tests.gpu.workers.{worker}", *args, timeout_s=timeout_s)
    report(name, res)
    assert "error" not in res, res["error"] + "\n" + res["output_tail"]
    return res


def lost_trap_lines(stderr: str) -> list:
    """The lines of ``stderr`` that lost_traps writes (together) when it ends a process: the
    record and why."""
    return [
        line
        for line in stderr.splitlines()
        if line.startswith(RECORD_HEADS) or "Ending the process with exit code" in line
    ]


def lost_trap_record(res, r, head, *, record_within_s) -> str:
    """Rank result ``r`` (run_ranks's allowed exit) is of a process lost_traps ended: its exit
    code and reason, the end GRACE_S after the record, which came at most ``record_within_s``
    after the noted ``failing_call_at``. Returns the one stderr record beginning with ``head``."""
    from jax_fusedar.common import lost_traps

    assert r["exitcode"] == lost_traps.EXIT_CODE, r
    lines = res["lost_trap_lines"]
    records = [line for line in lines if line.startswith(head)]
    assert len(records) == 1, (head, lines)
    why = f"Ending the process with exit code {lost_traps.EXIT_CODE}."
    assert any(why in line for line in lines), lines
    ended = r["exited_at"] - r["notes"]["failing_call_at"]
    limit = record_within_s + lost_traps.GRACE_S + LOST_TRAP_SLACK_S
    assert lost_traps.GRACE_S <= ended <= limit, (ended, r)
    return records[0]
