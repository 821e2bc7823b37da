"""GPU: JAX vs torch bitwise parity of the fused op on the same native core
(tests/gpu/workers/parity_jax_torch.py): JAX writes the inputs and every rank's outputs, torch
ranks run torch_compat on the same inputs and compare bytes per output; both sides also within
the float64 oracle's bounds (harness.bound_problems, tests/oracles/quant_oracle.py)."""

import tempfile

import pytest

from tests.gpu.harness import bound_problems, gpu_count, report, run_ranks, run_ranks_with_port
from tests.gpu.harness import run_seed, world_params
from tests.gpu.workers import parity_jax_torch as par

pytestmark = pytest.mark.gpu

TOKENS = (1, 17, 128, 512)
HIDDENS = (1024, 4096)


@pytest.mark.parametrize("world", world_params())
def test_jax_and_torch_outputs_are_bitwise_identical(world):
    pytest.importorskip("torch")
    seed = run_seed()
    tokens, hiddens = (TOKENS, HIDDENS) if world == 2 else (TOKENS[:3], HIDDENS[1:])
    kw = dict(seed=seed, tokens=tokens, hiddens=hiddens, dtypes=("bfloat16", "float16"))
    with tempfile.TemporaryDirectory(prefix="parity_") as d:
        if gpu_count() >= world:  # one process driving the N GPUs
            (jax_res,) = run_ranks(par.jax_phase, 1, timeout_s=600, out_dir=d, tp=world, **kw)
        else:  # one process per rank, sharing the GPUs
            jax_res = run_ranks_with_port(par.jax_rank_phase, world, timeout_s=600, out_dir=d, **kw)
            jax_res = jax_res[0]
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
            group = key in ("p8/quant_out", "p9/quant_out")
            if not (group and n <= 1e-5 * r["quant"]["torch"]["elements"]):
                problems.append(f"rank {r['rank']}: {key}: {n} elements differ from JAX")
        for side in ("torch", "jax"):
            w, q, where = r["worst"][side], r["quant"][side], f"rank {r['rank']} {side}"
            if w["nans"]:
                problems.append(f"{where}: {w['nans']} NaN outputs")
            problems += bound_problems(w, "bfloat16", world, where)
            problems += bound_problems(q, "bfloat16", world, f"{where} FP8")
            # At most one e4m3 step from the oracle, a few in the dynamic kind only; every
            # element written; scales within 1 fp32 ulp (dynamic) or equal (group).
            steps = q["steps1"]
            if (
                q["worse"]
                or q["poisoned"]
                or q["group_scale_mismatch"]
                or q["dyn_scale_ulps"] > 1.0
                or steps["static"]
                or steps["group"]
                or steps["dynamic"] > 2e-3 * q["elements"]
            ):
                problems.append(f"{where} FP8 outside the oracle bounds: {q}")
    assert not problems, "\n".join(problems)
