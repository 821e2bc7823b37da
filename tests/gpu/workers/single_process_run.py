"""Runs tests/gpu/workers/jax_single_process.py in a fresh Python process and returns its RESULT."""

import json
import os
import sys

from tests.repo import REPO

DROPPED = ("JAX_FUSEDAR_STRICT", "JAX_FUSEDAR_ALLREDUCE_BACKEND", "XLA_FLAGS", "JAX_PLATFORMS")


def run_task(task: str, platform: str, *, timeout_s: float = 900, **options) -> dict:
    from tests.gpu.case_runs import run_python

    env = {k: v for k, v in os.environ.items() if k not in DROPPED}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    argv = ["-m", "tests.gpu.workers.jax_single_process", task, "--platform", platform]
    for k, v in options.items():
        argv += [f"--{k}", str(v)]
    r = run_python(argv, env=env, timeout=timeout_s)
    cmd = " ".join([sys.executable, *argv])
    assert r.returncode == 0, f"{cmd} failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])
