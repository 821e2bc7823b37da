"""Runs tests/gpu/workers/jax_single_process.py in a fresh Python process and returns its RESULT."""

import json
import os
import subprocess
import sys

from tests.repo import REPO


def run_task(task: str, platform: str, *, timeout_s: float = 900, **options) -> dict:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    for var in (
        "JAX_FUSEDAR_STRICT",
        "JAX_FUSEDAR_ALLREDUCE_BACKEND",
        "XLA_FLAGS",
        "JAX_PLATFORMS",
    ):
        env.pop(var, None)
    cmd = [
        sys.executable,
        "-m",
        "tests.gpu.workers.jax_single_process",
        task,
        "--platform",
        platform,
    ]
    for k, v in options.items():
        cmd += [f"--{k}", str(v)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
    assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])
