"""GPU: jax_fusedar.fuse on the demo's Llama (Llama-3-8B layer shapes, 4 layers, bf16), one
process driving every GPU, the FlashInfer kernel in place of each psum + residual + RMSNorm.

The demo itself checks fused against unfused: greedy tokens identical over the steps (or a
divergence only at a near tie: the unfused top-2 margin within twice the largest logits
difference) and the logits within its stated tolerance; it exits 1 otherwise. Run by
tools/gpu_check.sh (the parent pytest stays on CPU; the demo is a subprocess
that sees the GPUs).
"""

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
    report(
        "gpu_fuse_demo",
        {
            "argv": argv,
            "returncode": r.returncode,
            "stdout": r.stdout,
            "stderr_tail": r.stderr[-4000:],
        },
    )
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    out = r.stdout
    assert "backend trtllm: FlashInfer kernel" in out
    assert "decode: jax_fusedar.fuse: fused 8 of 8 all-reduce + residual + RMSNorm" in out
    assert "prefill: jax_fusedar.fuse: fused 8 of 8" in out
    assert "decode: jax_fusedar.fuse: fused 2 of 2" in out  # the scan body, run 4 times
    assert "PASS (unrolled)" in out and "PASS (scan)" in out
