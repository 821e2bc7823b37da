"""The JAX GPU workers (tests/gpu/workers/) as CPU processes over gloo, the reference path in
place of the kernel. It rounds where the kernel rounds, so this runs the workers' plumbing
and, for real, the GPU tests' checks above 2 ranks (harness.bound_problems) before a GPU does."""

import pytest

from tests.gpu import harness

pytestmark = pytest.mark.slow


def _ranks(worker, world, **kw):
    """``worker`` as ``world`` CPU processes with a fresh seed."""
    seed = harness.random_seed(1 << 30)
    return harness.run_ranks_with_port(
        worker, world, timeout_s=600, seed=seed, platform="cpu", **kw
    )


def _run(task, world, **kw):
    from tests.gpu.workers import jax_multiprocess

    return _ranks(jax_multiprocess.worker, world, xla_flags="", task=task, **kw)


def test_parity_worker_at_four_ranks_within_the_bounds():
    from tests.gpu.test_jax import parity_problems

    res = _run("parity", 4, tokens=(1, 9), hiddens=(256,))
    assert [r["world"] for r in res] == [4] * 4
    assert not parity_problems(res, 4)
    w = res[0]["worst"]["bfloat16"]
    # 2 token counts: one-shot, and two-shot for 9 > 4 tokens; fp32_acc=False on 1 of 3.
    assert w["cases"] == 3 and w["ulps_no_fp32_acc"], w
    assert all(0.0 < w[key] for key in ("allreduce_bound", "residual_bound", "norm_own")), w
    # Every rank held the same bounds over the same data.
    assert all(r["worst"] == res[0]["worst"] for r in res)


def test_batching_worker_at_four_ranks():
    """jax_batching.py: the dense batch forms within the oracle's bounds, the MoE vmap equal to
    one call per element, as tests/gpu/test_jax.py::test_jax_batched_calls_fold_into_the_kernel."""
    from tests.gpu.test_jax import batching_problems

    res = _run("batching", 4)
    assert not batching_problems(res, 4), batching_problems(res, 4)
    assert all(r["batching"]["dense"]["residual_bound"] > 0 for r in res)


def test_loop_worker_at_four_ranks():
    (r, *_) = _run("loop", 4, calls=20, m=4, hidden=256)
    assert r["loop"]["calls"] == 20 and r["loop"]["violations"] == 0, r


def test_quant_worker_at_four_ranks():
    for q in (r["quant"] for r in _run("quant", 4, tokens=(1, 9), hiddens=(256,))):
        assert q["cases"] == 2 * 3 and q["worse"] == 0, q
        assert not harness.bound_problems(q, "bfloat16", 4), q
        assert "residual_bound" in q and "norm_own" in q, q


def test_model_worker_at_two_ranks():
    """The 64-layer model task (8 layers here) against the same math unfused and a float64
    model, as tests/gpu/test_jax.py holds it; no kernel on CPU, so no host launches."""
    for m in (r["model"] for r in _run("model", 2, layers=8, m=4, hidden=256, ffn=512)):
        assert m["finite"] and m["fused_vs_f64"] <= 1.25 * m["unfused_vs_f64"] + 1e-3, m
        assert m["host_launches_per_run"] == [0, 0, 0], m


def test_fuse_styles_worker_at_two_ranks():
    """tests/gpu/fuse_styles.py's worker (XLA collectives stay, every style runs): every site
    fused, the fused models as accurate as the unfused ones (fuse_styles.check)."""
    from tests.gpu import fuse_styles
    from tests.gpu.test_fuse_styles import CONFIG

    styles = ["per_linear_llama", "sequence_parallel_llama", "plain_jit_llama_explicit"]
    styles += ["hf_flax_llama_float32", "annotated_llama_per_token", "scanned_llama_shard_map"]
    config = dict(CONFIG, hidden=256, ffn=512, seq=16, heads=4)
    res = _ranks(fuse_styles.worker, 2, styles=styles, config=config)
    assert not fuse_styles.check(res, styles, platform="cpu")
    for r in res:
        assert all(v["xla_collectives"] and "skipped" not in v for v in r["styles"].values())


def test_fallback_worker_at_two_ranks():
    """jax_fallback.py: the fused call on an xla workspace and the user's psum + add + RMSNorm
    within the fallback's bound of the oracle; the compiled collectives compared."""
    from tests.gpu.test_fallback import _run
    from tests.gpu.workers import jax_fallback

    res = _run(2, platform="cpu", cases=((1, 256), (9, 512)))
    assert not jax_fallback.check(res), jax_fallback.check(res)
    for r in res:
        assert not r["shared_gpu"] and set(r["results"]) == {"bfloat16", "float16", "float32"}
        assert all(w["cases"] == 2 for w in r["results"].values()), r
