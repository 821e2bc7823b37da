"""GPU: FlashInfer's legacy TRT-LLM API served by torch_compat under FlashInfer's name
(tests/gpu/workers/flashinfer_shim.py): 2 processes (one GPU each, or sharing one), gloo
group; ``trtllm_create_ipc_workspace_for_all_reduce_fusion`` then ``trtllm_allreduce_fusion``
for patterns 0, 1, 4, 2, 11, 10, 9, 8, bf16 and fp16 on one 16-bit workspace, tokens
{1, 16, 128} x hidden {4096, 8192}, one- and two-shot, fp32_acc both ways. The reference is
FlashInfer's own build (its unified ``allreduce_fusion``; ``$JAX_FUSEDAR_ANCHOR`` or
``.anchor/anchor-flashinfer``) where present, else torch_compat's unified call: every output
byte must agree, every output be written, and both meet the float64 oracle's bounds (as in
test_anchor.py). Results: $JAX_FUSEDAR_REPORT_DIR/flashinfer_shim_world2.json."""

import pytest

from jax_fusedar.common.patterns import TRAITS
from tests.gpu.harness import bound_problems, cuda_torch, report, run_ranks_with_port, run_seed
from tests.gpu.workers.anchor_compare import PATTERNS

pytestmark = pytest.mark.gpu

TOKENS = (1, 16, 128)
HIDDENS = (4096, 8192)


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

    where = anchor.path()
    anchor_path = None if anchor.problem(where) else where
    if anchor_path is not None:
        anchor.prepare_parent(anchor_path)
    seed = run_seed()
    world = 2
    res = run_ranks_with_port(
        flashinfer_shim.worker,
        world,
        timeout_s=900,
        seed=seed,
        anchor_path=str(anchor_path) if anchor_path else None,
        tokens=TOKENS,
        hiddens=HIDDENS,
    )
    report(f"flashinfer_shim_world{world}", {"seed": seed, "ranks": res})
    for r in res:
        print(
            f"rank {r['rank']}: {r['cases']} cases, {r['calls']} calls in "
            f"{r['seconds']:.1f} s against {r['anchor_module']}"
        )
        assert not r["refused"], r["refused"]
        assert r["cases"] > 0 and r["calls"] > 0 and not r["return_mismatch"], r
        differing = {k: d for k, d in r["diffs"].items() if d["differing"]}
        assert not differing, f"rank {r['rank']}: legacy outputs differ: {differing}"
        assert len(r["diffs"]) == _outputs(PATTERNS), sorted(r["diffs"])  # every one compared
        assert r["unwritten"] == {"ours": 0, "anchor": 0}, r["unwritten"]
        assert r["destroyed"]
        for dtype, per_impl in r["oracle"].items():
            for impl, st in per_impl.items():
                where = f"rank {r['rank']} {dtype} {impl}: {st}"
                assert not bound_problems(st, dtype, world), where
                assert st["allreduce_bound"] > 0 and st["norm_own"] > 0, where
                assert st["elements"] > 0 and st["worse"] == 0, where
