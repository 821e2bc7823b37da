"""GPU: torch_compat (FlashInfer's unified API for torch) on the shared native core, at 2, 4
and 8 ranks over gloo (tests/gpu/workers/torch_workers.py). Bounds: harness.bound_problems."""

import pytest

from jax_fusedar.common.sizing import workspace_bytes
from tests.gpu.harness import bound_problems, cuda_torch, env_int, needs_gpus, report
from tests.gpu.harness import run_ranks_with_port, run_seed, shape_cases, world_params
from tests.gpu.workers import torch_workers

pytestmark = pytest.mark.gpu

RESIDUAL_ULPS, NORM_ULPS = 1.0, 3.0


@pytest.fixture(autouse=True)
def _cuda_torch():
    cuda_torch()


def _run(worker, world, **kw):
    return run_ranks_with_port(getattr(torch_workers, worker), world, timeout_s=900, **kw)


def _seeded(name, worker, world, shown=None, **kw):
    """``worker`` with a run_seed, reported as ``name`` with the seed, ``shown`` and results."""
    seed = run_seed()
    res = _run(worker, world, seed=seed, **kw)
    report(name, {"seed": seed, **(shown or {}), "ranks": res})
    return res


def test_torch_dp_tp_two_groups_concurrently():
    groups, devices = torch_workers.DP_TP_GROUPS, torch_workers.DP_TP_DEVICES
    shown = {"tokens": (1, 16, 128, 1000), "hidden": 4096}
    res = _seeded("torch_dp_tp", "dp_tp_worker", 4, shown, **shown)
    for rank, r in enumerate(res):
        group = groups[rank // 2]
        assert r["global_ranks"] == group and r["tp_rank"] == group.index(rank), r
        # The device is the process's own (torch.cuda.current_device()), not its TP rank.
        assert r["device"] == devices[rank] % r["gpus"], r
        assert r["member_devices"] == [devices[g] % r["gpus"] for g in group], r
        assert r["nan_outputs"] == 0, r
        assert r["worst"]["residual"] <= RESIDUAL_ULPS and r["worst"]["norm"] <= NORM_ULPS, r
    # Members of a group agree bit for bit; the groups reduced different data.
    assert res[0]["digests"] == res[1]["digests"]
    assert res[2]["digests"] == res[3]["digests"]
    assert all(a != b for a, b in zip(res[0]["digests"], res[2]["digests"]))
    assert res[0]["cases"] == res[2]["cases"] and len(res[0]["digests"]) == len(res[0]["cases"])


def test_torch_create_destroy_cycles_return_all_memory():
    cycles = env_int("JAX_FUSEDAR_TORCH_CYCLES", 200)
    res = _seeded("torch_cycles", "cycles_worker", 2, cycles=cycles, tokens=16, hidden=4096)
    for r in res:
        before, after = r["free_before"], r["free_after"]
        print(
            f"rank {r['rank']} (GPU {r['device']}): {r['cycles']} cycles in {r['seconds']:.1f} s;"
            f" free before {before} B, after {after} B (delta {after - before} B)"
        )
        assert r["nan_outputs"] == 0, r
        assert r["worst"]["residual"] <= RESIDUAL_ULPS and r["worst"]["norm"] <= NORM_ULPS, r
        # The repr shows each rank's device memory, by the sizing rule JAX's workspace uses.
        assert f"bytes_per_rank={workspace_bytes(2, 16, 4096, 'bfloat16')} (" in r["repr"], r
        assert after >= before, (
            f"rank {r['rank']}: {before - after} bytes of GPU memory not "
            f"returned after {r['cycles']} create/destroy cycles"
        )


def test_torch_member_that_never_joins_times_out_naming_it():
    r = _run("never_join_worker", 2, create_timeout_s=10)[0]
    report("torch_never_join", r)
    assert r["error_type"] == "TimeoutError" and "TP rank 1" in r["message"], r
    assert 9.0 <= r["seconds"] <= 15.0, r


@pytest.mark.parametrize("world", world_params())
def test_torch_parity_patterns_0_1_sweep(world):
    """Patterns 0 and 1, one- and two-shot, fp32_acc True and False (every third case)."""
    tokens, hiddens = ((1, 16, 128, 1024), (4096, 8192)) if world == 2 else ((1, 16, 128), (4096,))
    res = _seeded(
        f"torch_parity_world{world}",
        "parity_worker",
        world,
        tokens=tokens,
        hiddens=hiddens,
        dtypes=("bfloat16", "float16"),
    )
    problems = []
    for r in res:
        assert r["nans"] == 0, r
        for dtype, w in r["worst"].items():
            assert w["cases"] == len(shape_cases(tokens, hiddens, world)), (dtype, w)
            problems += bound_problems(w, dtype, world, f"rank {r['rank']}")
    assert not problems, "\n".join(problems)
    assert len({r["digest"] for r in res}) == 1, "the ranks' outputs differ"


@pytest.mark.parametrize("world", world_params())
def test_torch_fp8_patterns(world):
    """Patterns 2, 4, 10, 11, 8, 9: codes against tests/oracles/quant_oracle.py on the kernel's
    own norm_out; dynamic FP8 may be one e4m3 step off in a small fraction (fast-math division
    near a midpoint; the JAX test measured 5e-4); twins (2/4, 10/11, 8/9) bit-identical but
    for the known group-quant rarity (docs/numerics.md: 9 codes of 8.4 M once)."""
    shapes = [(1024, 1, True), (1024, 17, True), (1024, 17, False), (4096, 128, True)]
    shapes += [(4096, 128, False)] + ([(8192, 1024, False)] if world == 2 else [])
    res = _seeded(
        f"torch_fp8_world{world}",
        "fp8_worker",
        world,
        {"shapes": shapes},
        shapes=shapes,
        dtypes=("bfloat16", "float16"),
    )
    for r in res:
        q = r["quant"]
        assert q["cases"] == 2 * len(shapes), q
        assert q["poisoned"] == 0, q  # every output element written
        assert q["worse"] == 0, q
        assert q["steps1"]["static"] == 0 and q["steps1"]["group"] == 0, q
        assert q["steps1"]["dynamic"] <= 2e-3 * q["elements"], q
        assert q["dyn_scale_ulps"] <= 1.0 and q["group_scale_mismatch"] == 0, q
        assert not bound_problems(q, "bfloat16", world, f"rank {r['rank']}"), q
        assert all(name == "group q" for name, _, _ in q["twin_diffs"]), q
        assert sum(diff for _, _, diff in q["twin_diffs"]) <= 1e-5 * q["elements"], q
        if q["capability"][0] < 10:
            assert "need an sm100+ GPU" in q["nvfp4_refused"], q


@pytest.mark.parametrize(
    "backend, world",
    [
        pytest.param("aot_eager", 2, id="aot_eager-world2"),
        *world_params(before=("inductor",), id="inductor-{}"),
    ],
)
def test_torch_custom_ops_under_torch_compile(backend, world):
    """torch.compile(fullgraph=True) of the custom ops (patterns 0, 1, 11, 9) on the GPU:
    the same bits and metadata as eager, and the plain outputs within the oracle bounds."""
    res = _seeded(
        f"torch_compile_{backend}_world{world}",
        "compile_worker",
        world,
        m=128,
        hidden=4096,
        backend=backend,
    )
    for r in res:
        assert r["differing"] == {}, r
        e = r["errors"]
        assert e["nans"] == 0 and not bound_problems(e, "bfloat16", world, f"rank {r['rank']}"), r


@pytest.mark.parametrize("world", world_params())
def test_torch_cuda_graph_capture_and_replay(world):
    """Patterns 1 and 11 captured in a CUDA graph each, replayed with fresh inputs, every
    replay checked against the oracle; the replays launch nothing from the host."""
    replays = 100 if world == 2 else 20
    res = _seeded(
        f"torch_cuda_graph_world{world}",
        "cuda_graph_worker",
        world,
        m=128,
        hidden=4096,
        replays=replays,
    )
    for r in res:
        for name, w in r["results"].items():
            assert w["replays"] == replays and w["nans"] == 0, (name, w)
            assert not bound_problems(w, "bfloat16", world, f"rank {r['rank']} {name}"), (name, w)
            assert w["launches_captured"] == 1, (name, w)
            assert w["host_launches_during_replays"] == 0, (name, w)
        q = r["results"]["pattern11"]
        assert q["poisoned"] == 0 and q["code_worse"] == 0 and q["scale_ulps"] <= 1.0, q
        assert q["code_steps1"] <= 2e-3 * q["elements"], q


@needs_gpus(2, "the unfused model's all_reduce runs on NCCL, which refuses two ranks on one GPU")
@pytest.mark.parametrize("mode", ["make_fx", "inductor"])
def test_torch_fusion_pass_on_a_4_layer_tp_model(mode):
    """The pass replaces all 4 blocks of a TP model; the fused model is as accurate as the
    unfused one against float64 (+ 2^-8, half a bf16 ulp of the largest output: inductor's
    unfused graph keeps the residual sum in fp32 where the kernel rounds it to bf16) and
    within 2e-2 (about 5 bf16 ulps of the largest output) of it elementwise."""
    res = _seeded(
        f"torch_fusion_pass_{mode}",
        "fusion_pass_worker",
        2,
        m=64,
        hidden=4096,
        layers=4,
        mode=mode,
    )
    for r in res:
        for form, f in r["forms"].items():
            assert f["replaced"] == 4, (form, f)
            if mode == "make_fx":
                assert f["all_reduces_before"] == 4 and f["all_reduces_after"] == 0, (form, f)
                assert f["fused_ops"] == 4, (form, f)
            assert f["finite"], (form, f)
            assert f["fused_vs_f64"] <= 1.25 * f["unfused_vs_f64"] + 2.0**-8, (form, f)
            assert f["fused_vs_unfused"] <= 2e-2, (form, f)
