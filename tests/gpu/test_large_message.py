"""GPU: the large-message algorithm (ffi/kernels/large_message.h). It reuses FlashInfer's
two-shot math and launch shape, so every output must equal the two-shot kernel's bit for bit
on both sides of the auto crossover, on every rank, in CUDA-graph replays and in a loop that
interleaves it with the one-shot and two-shot calls without host syncs."""

import os

import pytest

from jax_fusedar.common import launch_mode, sizing
from tests.gpu.harness import env_int, needs_gpus, random_seed, report, run_ranks, sweep_params

pytestmark = pytest.mark.gpu


def _cases(quick):
    """(dtype, hidden, tokens, pattern): per hidden size, token counts just below and above the
    auto crossover (48 MiB per rank at world size 2), a mid size, an odd count (uneven
    slices) and a tiny one; the two 16-bit dtypes alternate."""
    tokens_for = {4096: (37, 5000, 6144), 7168: (1000, 3600), 8192: (5, 2900, 3100)}
    if quick:
        tokens_for = {4096: (37,), 7168: (1000,), 8192: (3100,)}
    shapes = [(h, m) for h, ms in tokens_for.items() for m in ms]
    cases = [
        (("bfloat16", "float16")[(i + pattern) % 2], hidden, m, pattern)
        for i, (hidden, m) in enumerate(shapes)
        for pattern in (1, 4, 11, 9)
        if m > 2  # more tokens than ranks
    ]
    return cases, max(m * h for h, m in shapes) // 8192, 8192


@pytest.mark.parametrize("sweep", sweep_params())
def test_large_message_two_ranks(sweep):
    pytest.importorskip("torch")
    from tests.gpu.workers import large_message_sweep

    cases, max_tokens, hidden_max = _cases(sweep == "quick")
    sizes = sizing.workspace_sizes(2, max_tokens, hidden_max, "bfloat16")
    assert any(launch_mode.prefers_large_message(m, h, sizes) for _, h, m, _ in cases)
    assert any(not launch_mode.prefers_large_message(m, h, sizes) for _, h, m, _ in cases)
    results = run_ranks(
        large_message_sweep.worker,
        2,
        timeout_s=1200,
        cases=cases,
        max_tokens=max_tokens,
        hidden_max=hidden_max,
        loop_calls=env_int("JAX_FUSEDAR_LOOP_CALLS", 500),
        seed=random_seed(),
    )
    report("large_message", results)
    assert results[0]["digest"] == results[1]["digest"], "ranks disagree bitwise"
    for r in results:
        assert r["cases"] == len(cases) and r["mismatches"] == [], r["mismatches"]
        assert r["nan_outputs"] == 0 and r["graph_diffs"] == 0 and r["loop_diffs"] == 0
        assert r["worst"]["cases"] > 0
        assert r["worst"]["residual"] <= 1.0 and r["worst"]["norm"] <= 3.0, r["worst"]


@needs_gpus(2, "one process drives both devices")
def test_large_message_through_jax_with_command_buffers():
    """jit + shard_map, XLA command buffers on: auto picks the large-message algorithm at
    4096 x 8192 and its outputs equal the forced two-shot kernel's, replay after replay.
    Worker: tests/gpu/workers/jax_large_message.py, one process driving both GPUs."""
    from tests.gpu.case_runs import JAX_VARS, result_of, run_python

    env = {k: v for k, v in os.environ.items() if k not in JAX_VARS}
    r = result_of(run_python(["-m", "tests.gpu.workers.jax_large_message"], env=env, timeout=600))
    print(r)
    assert r["backend"] == "trtllm" and r["chosen"] == "large", r
    assert r["auto_attr"] and r["twoshot_attr"], r
    for replay in r["replays"]:
        assert replay["same_bits"] == [True, True] and replay["nans"] == 0, r
