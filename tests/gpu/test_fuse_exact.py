"""GPU: jax_fusedar.fuse on the forms tests/jax/test_fuse_exact.py proves on CPU, the kernel in
place of each site, every output against float64 (tests/gpu/fuse_exact.py)."""

import pytest

from tests.gpu import fuse_exact
from tests.gpu.harness import random_seed, report, run_ranks_with_port

pytestmark = pytest.mark.gpu


def test_exact_forms_fused_on_gpus():
    res = run_ranks_with_port(fuse_exact.worker, 2, timeout_s=900, seed=random_seed(1 << 30))
    report("gpu_fuse_exact", res)
    problems = fuse_exact.check(res)
    assert not problems, "\n".join(problems)
