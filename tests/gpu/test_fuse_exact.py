"""GPU: jax_fusedar.fuse on the forms whose roundings and layouts tests/jax/test_fuse_exact.py
proves on CPU, with the FlashInfer kernel in place of each site: Gemma's scale rounded by the
program, a float32 model rounding gamma through bfloat16, a residual returned by the same
per-linear shard_map, two sites on one shard_map, a per-linear dynamic FP8 tail without the
norm output, and two live transforms of one program (the second workspace named apart).
Two ranks as two ``jax.distributed`` processes (sharing GPU 0 on a one-GPU machine); every
output against float64 in the documented units (tests/gpu/fuse_exact.py)."""

import pytest

from tests.gpu.harness import report

pytestmark = pytest.mark.gpu


def test_exact_forms_fused_on_gpus():
    from tests.gpu import fuse_exact
    from tests.gpu.harness import random_seed, run_ranks_with_port

    res = run_ranks_with_port(fuse_exact.worker, 2, timeout_s=900, seed=random_seed(1 << 30))
    report("gpu_fuse_exact", res)
    problems = fuse_exact.check(res)
    assert not problems, "\n".join(problems)
