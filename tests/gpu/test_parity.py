"""GPU: JAX vs torch bitwise parity of the fused op on the same native core, at 2, 4 and 8
ranks.

Phase 1: JAX runs the cases and writes inputs and every rank's outputs (one process driving
N GPUs where there are N, else one `jax.distributed` process per rank sharing the GPUs);
phase 2: N torch processes run torch_compat.allreduce_fusion on the same inputs with the
same use_oneshot / fp32_acc and compare bytes per output (tests/gpu/workers/parity_jax_torch.py).
Every pattern available on sm90 (0, 1, 2, 4, 8, 9, 10, 11), bf16 and fp16, one- and two-shot.
Both sides are also held to the float64 oracle's bounds (harness.bound_problems; FP8 codes
within one e4m3 step of tests/oracles/quant_oracle.py on the kernel's own norm_out).
Results: $JAX_FUSEDAR_REPORT_DIR/parity_jax_torch_world<N>.json.
"""

import tempfile

import pytest

from tests.gpu.harness import bound_problems, report, run_seed, world_params

pytestmark = pytest.mark.gpu

TOKENS = (1, 17, 128, 512)
HIDDENS = (1024, 4096)


@pytest.mark.parametrize("world", world_params())
def test_jax_and_torch_outputs_are_bitwise_identical(world):
    from jax_fusedar.common import native
    from tests.gpu.workers import parity_jax_torch as par
    from tests.gpu.harness import run_ranks, run_ranks_with_port

    pytest.importorskip("torch")
    seed = run_seed()
    tokens = TOKENS if world == 2 else TOKENS[:3]
    hiddens = HIDDENS if world == 2 else HIDDENS[1:]
    kw = dict(seed=seed, tokens=tokens, hiddens=hiddens, dtypes=("bfloat16", "float16"))
    with tempfile.TemporaryDirectory(prefix="parity_") as d:
        if native.gpu_count() >= world:  # one process driving the N GPUs
            (jax_res,) = run_ranks(par.jax_phase, 1, timeout_s=600, out_dir=d, tp=world, **kw)
        else:  # one process per rank, sharing the GPUs
            jax_res = run_ranks_with_port(
                par.jax_rank_phase, world, timeout_s=600, out_dir=d, **kw
            )[0]
        assert set(jax_res["backends"].values()) == {"trtllm"}, jax_res
        res = run_ranks_with_port(par.torch_phase, world, timeout_s=900, out_dir=d)
    report(
        f"parity_jax_torch_world{world}",
        {
            "seed": seed,
            "jax": jax_res,
            "ranks": [{k: v for k, v in r.items() if k != "per_case"} for r in res],
            "per_case": [r["per_case"] for r in res],
        },
    )
    problems = []
    for r in res:
        assert r["cases"] == jax_res["cases"] > 0
        for key, n in r["differing_elements"].items():
            # Known open result (docs/numerics.md): the per-token-group codes, once 9 of 8.4 M
            # apart between twin patterns on identical inputs; here a one-step e4m3
            # difference in at most 1e-5 of the codes is reported, not failed. Everything
            # else bitwise.
            if (
                key in ("p8/quant_out", "p9/quant_out")
                and n <= 1e-5 * r["quant"]["torch"]["elements"]
            ):
                continue
            problems.append(f"rank {r['rank']}: {key}: {n} elements differ from JAX")
        for side in ("torch", "jax"):
            w = r["worst"][side]
            if w["nans"]:
                problems.append(f"rank {r['rank']} {side}: {w['nans']} NaN outputs")
            problems += bound_problems(w, "bfloat16", world, f"rank {r['rank']} {side}")
            q = r["quant"][side]
            problems += bound_problems(q, "bfloat16", world, f"rank {r['rank']} {side} FP8")
            if (
                q["worse"]
                or q["poisoned"]
                or q["group_scale_mismatch"]
                or q["dyn_scale_ulps"] > 1.0
                or q["steps1"]["static"]
                or q["steps1"]["group"]
                or q["steps1"]["dynamic"] > 2e-3 * q["elements"]
            ):
                problems.append(f"rank {r['rank']} {side} FP8 outside the oracle bounds: {q}")
    assert not problems, "\n".join(problems)
