"""GPU: ``python -m jax_fusedar demo`` on whatever GPUs there are: with fewer GPUs than the TP
size one process per rank shares them (jax_fusedar/cli/ranks.py), else one drives them all."""

import re

import pytest

from tests.gpu.case_runs import JAX_VARS, child_env, run_python
from tests.gpu.harness import gpu_count, report

pytestmark = pytest.mark.gpu


def _cli(*argv, timeout=900):
    return run_python(["-m", "jax_fusedar", *argv], env=child_env(JAX_VARS), timeout=timeout)


def _check_demo(r, tp, name, modes):
    report(name, {"returncode": r.returncode, "stdout": r.stdout, "stderr_tail": r.stderr[-4000:]})
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    out, gpus = r.stdout, gpu_count()
    assert "backend trtllm" in out, out
    if gpus < tp:
        assert f"over {tp} ranks, one process per rank sharing {gpus} GPU" in out, out
        assert "timings: none; " in out and "tok/s" not in out, out
        # The header counts ranks and GPUs apart ("2 ranks on 1 x NVIDIA H200").
        header = rf"^devices: {tp} ranks on {gpus} x \S.*\(platform gpu; the ranks share"
        assert re.search(header, out, re.M) and not re.search(r"^speedup", out, re.M), out
    # A successful run ends clean: no trace of JAX's distributed client at shutdown.
    assert "WatchTasksAsync" not in out + r.stderr, r.stderr[-4000:]
    assert "compiling the fused prefill and decode programs" in r.stderr, r.stderr[-4000:]
    rels = re.findall(r"\(relative to max \|logits\| \S+: (\S+); tolerance (\S+) ", out)
    assert len(rels) == len(modes), out
    assert all(float(rel) <= float(tol) for rel, tol in rels), rels
    for mode in modes:
        assert f"PASS ({mode})" in out, out


@pytest.mark.parametrize("tp", [None, 8], ids=["default", "tp8"])
def test_demo(tp):
    world = tp or (2 if gpu_count() == 1 else gpu_count())
    r = _cli("demo", *([] if tp is None else ["--tp", tp]))
    _check_demo(r, world, f"gpu_demo_{tp or 'default'}", ["unrolled", "scan"])
    if gpu_count() < world:
        assert "fused 8 of 8 all-reduce + residual + RMSNorm" in r.stdout, r.stdout


@pytest.mark.slow
def test_demo_moe():
    world = 2 if gpu_count() == 1 else gpu_count()
    r = _cli("demo", "--moe")
    _check_demo(r, world, "gpu_demo_moe", ["moe"] if gpu_count() < world else [])
    assert "PASS" in r.stdout


def test_doctor_on_gpus():
    """``python -m jax_fusedar doctor`` on a GPU machine: the GPUs, their peer access and
    links, the native build with its architectures (the build record), the kernel for TP 2."""
    r = _cli("doctor", timeout=120)
    report("gpu_doctor", {"returncode": r.returncode, "stdout": r.stdout, "stderr": r.stderr})
    assert r.returncode == 0, r.stdout + r.stderr
    out, gpus = r.stdout, gpu_count()
    assert f"GPUs: {gpus}\n  GPU0: NVIDIA " in out, out
    assert re.search(r"^CUDA driver: \S+ \(CUDA \d+\.\d+\)$", out, re.M), out
    assert re.search(r"^native build: loaded from .*; CUDA architectures sm_\d+a?", out, re.M), out
    assert "FlashInfer headers 0.7.2.post1" in out, out
    if gpus >= 2:
        assert "peer access (the kernel needs it" in out and "links (nvidia-smi topo -m" in out
    assert "  2 ranks: trtllm (the kernel)" in out and len(out.splitlines()) <= 40, out
