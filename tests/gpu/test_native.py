"""GPU: FlashInfer's kernel through the native core, two ranks in two processes (CUDA IPC).
Errors in ulps of the intermediate magnitudes (tests/oracles/oracle.py): <= 1 for each of the
kernel's two roundings; the norm carries that error through rsqrt * gamma plus one rounding
(3 for 16-bit types; float32 gets 8: fast-math rsqrtf is itself good to about 2 ulps)."""

import json

import pytest

from tests.gpu.harness import env_int, random_seed, report, run_ranks, sweep_params

pytestmark = pytest.mark.gpu

BOUNDS = {
    "bfloat16": {"allreduce": 1.0, "residual": 1.0, "norm": 3.0},
    "float16": {"allreduce": 1.0, "residual": 1.0, "norm": 3.0},
    "float32": {"allreduce": 1.0, "residual": 1.0, "norm": 8.0},
}


@pytest.mark.parametrize("sweep", sweep_params())
def test_native_sweep_two_ranks(sweep):
    pytest.importorskip("torch")
    from tests.gpu.workers import native_sweep

    quick = sweep == "quick"
    tokens = (1, 16, 17, 129) if quick else (1, 2, 15, 16, 17, 64, 128, 129, 1000, 2048)
    hiddens = (1024, 7168) if quick else (1024, 4096, 7168, 8192)
    results = run_ranks(
        native_sweep.worker,
        2,
        timeout_s=1500,
        tokens=tokens,
        hiddens=hiddens,
        max_tokens=max(tokens),
        loop_calls=env_int("JAX_FUSEDAR_LOOP_CALLS", 2000),
        seed=random_seed(),
    )
    shown = {"ranks": results, "bounds": BOUNDS, "tokens": tokens, "hiddens": hiddens}
    report("native_sweep", shown)
    print(json.dumps({r["device"]: r["worst"] for r in results}, indent=1))
    print("loop:", [r["loop"] for r in results])
    assert results[0]["digest"] == results[1]["digest"], "ranks disagree bitwise"
    for r in results:
        assert r["nan_outputs"] == 0
        for dtype, w in r["worst"].items():
            assert w["cases"] > 0
            for k in ("allreduce", "residual", "norm"):
                assert w[k] <= BOUNDS[dtype][k], (dtype, k, w[k])
        if r["loop"]:
            assert r["loop"]["residual"] <= 1.0 and r["loop"]["norm"] <= 3.0, r["loop"]


def test_native_single_process_peer_pointers():
    """Both ranks in one process (the single-process path), in a child process so that a hang
    cannot take the test run with it."""
    pytest.importorskip("torch")
    from tests.gpu.case_runs import run_python

    # env None: the child inherits this process's environment
    argv = ["-m", "tests.gpu.workers.native_single_process", "4096"]
    proc = run_python(argv, env=None, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(result)
    assert result["worst"]["cases"] == 3
    assert result["worst"]["residual"] <= 1.0 and result["worst"]["norm"] <= 3.0, result
