"""GPU: jax_fusedar.fuse on the demo's Llama (Llama-3-8B layer shapes), one process driving
every GPU; the demo checks fused against unfused itself (exit 1 otherwise)."""

import os

import pytest

from tests.gpu.case_runs import run_python
from tests.gpu.harness import needs_gpus, report

pytestmark = pytest.mark.gpu


@needs_gpus(2, "the demo drives a TP group of 2 devices from one process")
def test_llama_demo_fused_by_fuse_on_gpus():
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")
    env.pop("JAX_PLATFORMS", None)
    env.pop("XLA_FLAGS", None)
    argv = "demo --preset llama3-8b --layers 4 --batch 4 --prompt 32 --steps 16 --iters 3".split()
    r = run_python(["-m", "jax_fusedar", *argv], env=env, timeout=900)
    shown = {"argv": argv, "returncode": r.returncode, "stdout": r.stdout}
    report("gpu_fuse_demo", {**shown, "stderr_tail": r.stderr[-4000:]})
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    out = r.stdout
    assert "backend trtllm: FlashInfer kernel" in out
    assert "decode: jax_fusedar.fuse: fused 8 of 8 all-reduce + residual + RMSNorm" in out
    assert "prefill: jax_fusedar.fuse: fused 8 of 8" in out
    assert "decode: jax_fusedar.fuse: fused 2 of 2" in out  # the scan body, run 4 times
    assert "PASS (unrolled)" in out and "PASS (scan)" in out
