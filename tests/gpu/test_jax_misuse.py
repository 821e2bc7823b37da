"""A workspace under a mesh or pmap that orders its devices otherwise is refused before anything
runs, on 2 GPUs as on 2 CPU devices; rows whose fp32 sum of squares overflows give norm_out
= +-0 on both (README, Numerics). Worker: tests/gpu/workers/jax_misuse.py."""

import os

import pytest

from tests.gpu.case_runs import JAX_VARS, child_env, result_of, run_python
from tests.gpu.harness import needs_gpus, report
from tests.repo import REPO

# Both orders of the two devices, named in the message (TP-rank order of the ids).
FLIPPED = (
    "groups the devices along 'tp' as [(1, 0)] but the workspace was created for the "
    "groups [(0, 1)]"
)


def _run(platform: str, *, bits: bool) -> dict:
    """The worker's result, checked; ``bits``: the kernel's results are compared bit for bit,
    zeros' signs included (XLA's CPU reference may sign a zero differently in two differently
    fused programs)."""
    pythonpath = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = child_env(JAX_VARS[1:], PYTHONPATH=pythonpath)  # all but JAX_PLATFORMS
    argv = ["-m", "tests.gpu.workers.jax_misuse", platform]
    r = result_of(run_python(argv, env=env, timeout=600))
    report(f"jax_misuse_{'gpu' if bits else 'cpu'}", r)
    good = r["good"]
    assert good["residual_ulps"] <= 1.0 and good["norm_ulps"] <= 3.0, r  # as test_gpu_jax
    assert good["pmap_equals_shard_map_bits" if bits else "pmap_equals_shard_map_values"], r
    for key in ("flipped_shard_map", "flipped_shard_map_lower", "flipped_pmap"):
        assert FLIPPED in r[key], (key, r[key])
    o = r["overflow"]
    assert o["residual_exact"] and o["zero_rows"], r
    assert o["signs_of_r_times_gamma"] or not bits, r
    assert o["ordinary_row_norm_ulps"] <= 3.0, r
    return r


def test_misuse_worker_on_two_cpu_devices():
    r = _run("cpu", bits=False)
    assert r["backend"] == "xla" and not r["good"]["custom_call"], r


@pytest.mark.gpu
@needs_gpus(2, "one process drives both devices")
def test_regrouped_devices_are_refused_on_two_gpus():
    r = _run("cuda", bits=True)
    assert r["backend"] == "trtllm" and r["good"]["custom_call"], r
