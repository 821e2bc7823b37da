"""GPU: torch_compat (FlashInfer's unified API for torch) on the shared native core.

Spawned processes join torch.distributed over gloo (tests/gpu/torch_workers.py); ranks
share a GPU when there are fewer GPUs than processes. Bounds as in test_gpu_native.py:
residual_out within 1 ulp and norm_out within 3 ulps (bf16) of the intermediate
magnitudes (tests/oracle.py). Results go to $JAX_FUSEDAR_REPORT_DIR/torch_*.json when set.
"""
import os

import pytest

from tests.gpu.harness import report

pytestmark = pytest.mark.gpu

RESIDUAL_ULPS, NORM_ULPS = 1.0, 3.0


@pytest.fixture(autouse=True)
def _cuda_torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here (CPU build or no GPU)")


def _seed():
    env = os.environ.get("JAX_FUSEDAR_TEST_SEED")
    return int(env) if env else int.from_bytes(os.urandom(4), "little")




def _run(worker, world, **kw):
    from tests.gpu import torch_workers
    from tests.gpu.harness import free_port, run_ranks

    return run_ranks(getattr(torch_workers, worker), world, timeout_s=900,
                     port=free_port(), **kw)


def test_torch_dp_tp_two_groups_concurrently():
    from tests.gpu.torch_workers import DP_TP_DEVICES, DP_TP_GROUPS

    seed = _seed()
    tokens = (1, 16, 128, 1000)
    res = _run("dp_tp_worker", 4, seed=seed, tokens=tokens, hidden=4096)
    report("torch_dp_tp", {"seed": seed, "tokens": tokens, "hidden": 4096, "ranks": res})
    for rank, r in enumerate(res):
        group = DP_TP_GROUPS[rank // 2]
        assert r["global_ranks"] == group and r["tp_rank"] == group.index(rank), r
        # The device is the process's own (torch.cuda.current_device()), not its TP rank.
        assert r["device"] == DP_TP_DEVICES[rank] % r["gpus"], r
        assert r["member_devices"] == [DP_TP_DEVICES[g] % r["gpus"] for g in group], r
        assert r["nan_outputs"] == 0, r
        assert r["worst"]["residual"] <= RESIDUAL_ULPS, r["worst"]
        assert r["worst"]["norm"] <= NORM_ULPS, r["worst"]
    # Members of a group agree bit for bit; the groups reduced different data.
    assert res[0]["digests"] == res[1]["digests"]
    assert res[2]["digests"] == res[3]["digests"]
    assert all(a != b for a, b in zip(res[0]["digests"], res[2]["digests"]))
    assert res[0]["cases"] == res[2]["cases"] and len(res[0]["digests"]) == len(res[0]["cases"])


def test_torch_create_destroy_cycles_return_all_memory():
    from tests.gpu.harness import env_int

    seed, cycles = _seed(), env_int("JAX_FUSEDAR_TORCH_CYCLES", 200)
    res = _run("cycles_worker", 2, seed=seed, cycles=cycles, tokens=16, hidden=4096)
    report("torch_cycles", {"seed": seed, "ranks": res})
    for r in res:
        print(f"rank {r['rank']} (GPU {r['device']}): {r['cycles']} cycles in "
              f"{r['seconds']:.1f} s; free before {r['free_before']} B, after "
              f"{r['free_after']} B (delta {r['free_after'] - r['free_before']} B)")
        assert r["nan_outputs"] == 0, r
        assert r["worst"]["residual"] <= RESIDUAL_ULPS and r["worst"]["norm"] <= NORM_ULPS, r
        assert r["free_after"] >= r["free_before"], (
            f"rank {r['rank']}: {r['free_before'] - r['free_after']} bytes of GPU memory not "
            f"returned after {r['cycles']} create/destroy cycles")


def test_torch_member_that_never_joins_times_out_naming_it():
    res = _run("never_join_worker", 2, create_timeout_s=10)
    r = res[0]
    report("torch_never_join", r)
    assert r["error_type"] == "TimeoutError", r
    assert "TP rank 1" in r["message"], r
    assert 9.0 <= r["seconds"] <= 15.0, r
