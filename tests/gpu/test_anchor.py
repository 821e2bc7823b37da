"""GPU: torch_compat against FlashInfer 0.7.2.post1's own build of the kernel (the "anchor",
tests/gpu/anchor.py; skipped without it) on the same inputs, every pattern, dtype, one- and
two-shot (tests/gpu/workers/anchor_compare.py): same kernel, so every output byte agrees."""

import pytest

from tests.gpu.harness import cuda_torch, report, run_seed, world_params

pytestmark = pytest.mark.gpu

TOKENS = (1, 16, 128, 1024)
HIDDENS = (4096, 8192)
# The outputs each pattern writes: every one compared.
R, N, Q, S = "residual_out", "norm_out", "quant_out", "scale_out"
OUTPUTS = {0: ["output"], 1: [R, N], 2: [R, Q], 4: [R, N, Q], 8: [R, Q, S], 9: [R, N, Q, S]}
OUTPUTS.update({10: [R, Q, S], 11: [R, N, Q, S]})


@pytest.fixture
def anchor_path():
    cuda_torch()
    from tests.gpu import anchor

    path, problem = anchor.prepared()  # the ranks inherit LD_LIBRARY_PATH etc.
    if problem:
        pytest.skip(f"FlashInfer anchor unavailable: {problem} (set ${anchor.ANCHOR_ENV_VAR})")
    return path


@pytest.mark.parametrize("world", world_params(quick=(2, 4, 8)))
def test_torch_compat_matches_flashinfer_bitwise(anchor_path, world):
    from tests.gpu import anchor
    from tests.gpu.harness import run_ranks_with_port
    from tests.gpu.workers import anchor_compare

    seed = run_seed()
    shown = dict(tokens=TOKENS if world == 2 else TOKENS[:3], hiddens=HIDDENS)
    res = run_ranks_with_port(
        anchor_compare.worker,
        world,
        timeout_s=900,
        seed=seed,
        anchor_path=str(anchor_path),
        **shown,
    )
    report(
        f"torch_anchor_world{world}",
        {"seed": seed, **shown, "patterns": anchor_compare.PATTERNS, "ranks": res},
    )
    expected = {f"p{p}:{n}" for p, ns in OUTPUTS.items() for n in ns}
    for r in res:
        anchor.check_rank(r, world)
        assert set(r["diffs"]) == expected, sorted(r["diffs"])
