"""GPU: FlashInfer's legacy TRT-LLM API served by torch_compat under FlashInfer's name
(tests/gpu/workers/flashinfer_shim.py), every pattern on one 16-bit workspace, against
FlashInfer's own build where present, else torch_compat's unified call (as test_anchor.py)."""

import pytest

from jax_fusedar.common.patterns import TRAITS
from tests.gpu.harness import cuda_torch, report, run_ranks_with_port, run_seed
from tests.gpu.workers.anchor_compare import PATTERNS

pytestmark = pytest.mark.gpu


def _outputs(patterns) -> int:
    """How many outputs the patterns write in all (the pattern table's count)."""
    return sum(
        t.has_allreduce_out + t.has_residual + t.has_norm_out + bool(t.quant) + t.writes_scale_out
        for t in (TRAITS[p] for p in patterns)
    )


def test_legacy_api_runs_the_kernel():
    cuda_torch()
    from tests.gpu import anchor
    from tests.gpu.workers import flashinfer_shim

    anchor_path, _ = anchor.prepared()
    seed, world = run_seed(), 2
    res = run_ranks_with_port(
        flashinfer_shim.worker,
        world,
        timeout_s=900,
        seed=seed,
        anchor_path=str(anchor_path) if anchor_path else None,
        tokens=(1, 16, 128),
        hiddens=(4096, 8192),
    )
    report(f"flashinfer_shim_world{world}", {"seed": seed, "ranks": res})
    for r in res:
        anchor.check_rank(r, world, scales=False)
        assert len(r["diffs"]) == _outputs(PATTERNS), sorted(r["diffs"])  # every one compared
        assert r["destroyed"]
