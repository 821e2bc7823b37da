"""GPU: torch_compat against FlashInfer's own build of the kernel (the "anchor").

2, 4 or 8 spawned processes (one GPU each where there are enough, else sharing them, rank r
on GPU r % G) run the same inputs through ``torch_compat.allreduce_fusion`` and FlashInfer
0.7.2.post1's ``flashinfer.comm.allreduce_fusion`` (tests/gpu/workers/anchor_compare.py):
patterns 0, 1, 2, 4, 8, 9 (group 128), 10, 11, bf16 and fp16, tokens {1, 16, 128, 1024} x
hidden {4096, 8192} (at 4 and 8 ranks {1, 16, 128} x {4096, 8192}), one-shot and two-shot
forced identically, fp32_acc both ways. Same kernel, same inputs: every output byte must
agree. Both are also held to the float64 oracle's bounds (harness.bound_problems: the
accumulation bounds for both fp32_acc settings, and at 2 ranks all-reduce and residual_out
within 1 ulp, norm_out within 3 ulps of the intermediate magnitudes; quantized codes at most
one e4m3 step from the oracle applied to the build's own norm_out, dynamic scales within 2
fp32 ulps, group scale bytes equal).

Skipped unless the anchor folder exists: ``$JAX_FUSEDAR_ANCHOR``, else
``<repo>/.anchor/anchor-flashinfer``. Results go to
$JAX_FUSEDAR_REPORT_DIR/torch_anchor_world<N>.json.
"""

import pytest

from tests.gpu.harness import bound_problems, cuda_torch, report, run_seed, world_params

pytestmark = pytest.mark.gpu

TOKENS = (1, 16, 128, 1024)
HIDDENS = (4096, 8192)


@pytest.fixture
def anchor_path():
    cuda_torch()
    from tests.gpu import anchor

    path = anchor.path()
    problem = anchor.problem(path)
    if problem:
        pytest.skip(f"FlashInfer anchor unavailable: {problem} (set ${anchor.ANCHOR_ENV_VAR})")
    anchor.prepare_parent(path)  # the ranks inherit LD_LIBRARY_PATH etc.
    return path


@pytest.mark.parametrize("world", world_params(quick=(2, 4, 8)))
def test_torch_compat_matches_flashinfer_bitwise(anchor_path, world):
    from tests.gpu.workers import anchor_compare
    from tests.gpu.harness import run_ranks_with_port

    seed = run_seed()
    tokens = TOKENS if world == 2 else TOKENS[:3]
    res = run_ranks_with_port(
        anchor_compare.worker,
        world,
        timeout_s=900,
        seed=seed,
        anchor_path=str(anchor_path),
        tokens=tokens,
        hiddens=HIDDENS,
    )
    report(
        f"torch_anchor_world{world}",
        {
            "seed": seed,
            "tokens": tokens,
            "hiddens": HIDDENS,
            "patterns": anchor_compare.PATTERNS,
            "ranks": res,
        },
    )
    for r in res:
        print(
            f"rank {r['rank']} (GPU {r['device']}): {r['cases']} cases, {r['calls']} calls in "
            f"{r['seconds']:.1f} s; anchor {r['anchor_module']}"
        )
        assert not r["refused"], f"rank {r['rank']} calls refused: {r['refused']}"
        assert r["cases"] > 0 and r["calls"] > 0, r
        assert not r["return_mismatch"], r["return_mismatch"]
        differing = {k: d for k, d in r["diffs"].items() if d["differing"]}
        assert not differing, f"rank {r['rank']}: outputs differ from FlashInfer's: {differing}"
        expected = {
            f"p{p}:{n}"
            for p, ns in (
                (0, ["output"]),
                (1, ["residual_out", "norm_out"]),
                (2, ["residual_out", "quant_out"]),
                (4, ["residual_out", "norm_out", "quant_out"]),
                (8, ["residual_out", "quant_out", "scale_out"]),
                (9, ["residual_out", "norm_out", "quant_out", "scale_out"]),
                (10, ["residual_out", "quant_out", "scale_out"]),
                (11, ["residual_out", "norm_out", "quant_out", "scale_out"]),
            )
            for n in ns
        }
        assert set(r["diffs"]) == expected, sorted(r["diffs"])
        assert r["unwritten"] == {"ours": 0, "anchor": 0}, r["unwritten"]
        for dtype, per_impl in r["oracle"].items():
            for impl, st in per_impl.items():
                where = f"rank {r['rank']} {dtype} {impl}: {st}"
                assert not bound_problems(st, dtype, world), where
                assert st["allreduce_bound"] > 0 and st["norm_own"] > 0, where  # measured
                assert st["elements"] > 0 and st["worse"] == 0, where
                assert st["dyn_scale_ulps"] <= 2.0, where
                assert st["group_scale_mismatch"] == 0, where
