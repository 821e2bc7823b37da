"""GPU: the benchmarks of the checkout. On one GPU both refuse, saying why (ranks sharing a GPU
time its scheduling, not the kernel); with a GPU per rank the JAX one times the kernel."""

import json
import re

import pytest

from tests.gpu.case_runs import JAX_VARS, child_env, run_python
from tests.gpu.harness import gpu_count, report

pytestmark = pytest.mark.gpu


def _bench(module, *argv, timeout=900):
    env = child_env(JAX_VARS[:-1])  # the handshake variable stays
    return run_python(["-m", f"benchmarks.{module}", *argv], env=env, timeout=timeout)


@pytest.mark.skipif(gpu_count() != 1, reason="the refusal is for a one-GPU machine")
def test_the_jax_bench_refuses_one_gpu(tmp_path):
    r = _bench("jax_bench", "--out", tmp_path, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "needs one GPU per rank and this machine has 1 GPU" in r.stderr, r.stderr
    assert "not the kernel" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.skipif(gpu_count() != 1, reason="the refusal is for a one-GPU machine")
def test_the_torch_bench_refuses_one_gpu(tmp_path):
    pytest.importorskip("torch")
    r = _bench("torch_bench", "--no-anchor", "--out", tmp_path, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--world 2 needs one GPU per rank and this machine has 1" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


@pytest.mark.skipif(gpu_count() < 2, reason="needs one GPU per rank")
def test_the_jax_bench_times_the_kernel_with_its_spread(tmp_path):
    r = _bench(
        "jax_bench", "--tokens", "16,1024", "--hidden", 4096, "--patterns", "1,4",
        "--repeats", 5, "--out", tmp_path,
    )  # fmt: skip
    report("gpu_jax_bench", {"returncode": r.returncode, "stdout": r.stdout})
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    rep = json.loads((tmp_path / "bench.json").read_text())
    assert rep["machine"]["backend"] == "trtllm" and rep["config"]["method"] == "device"
    for case in rep["cases"]:
        for s in [case["baseline_us"]] + [m["us"] for m in case["fused"].values()]:
            assert s["n"] == 5 and 0 < s["p10"] <= s["median"] <= s["p90"]
    assert len(re.findall(r"\[\d+\.\d\d, \d+\.\d\d\]\s+\d+\.\d\d \[", r.stdout)) == 4, r.stdout
