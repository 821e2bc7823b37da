"""The JAX GPU workers (tests/gpu/workers/jax_multiprocess.py: parity, the long loop, the FP8
patterns) at 4 ranks on CPUs: one `jax.distributed` process per rank over gloo, JAX's
reference path in place of the kernel. The reference path rounds where the kernel rounds
(fp32_acc=False included), so this runs the workers' plumbing and, for real, the checks the
GPU tests apply at world sizes above 2 (harness.bound_problems: the accumulation bounds)
before a GPU does."""

import os

import pytest

from tests.gpu import harness


def _ranks(worker, world, **kw):
    """``worker`` as ``world`` CPU processes with a fresh seed."""
    seed = int.from_bytes(os.urandom(4), "little") % (1 << 30)
    return harness.run_ranks_with_port(
        worker, world, timeout_s=600, seed=seed, platform="cpu", **kw
    )


def _run(task, world, **kw):
    from tests.gpu.workers import jax_multiprocess

    return _ranks(jax_multiprocess.worker, world, xla_flags="", task=task, **kw)


@pytest.mark.slow
def test_parity_worker_at_four_ranks_within_the_bounds():
    from tests.gpu.test_jax import parity_problems

    res = _run("parity", 4, tokens=(1, 9), hiddens=(256,))
    assert [r["world"] for r in res] == [4] * 4
    assert not parity_problems(res, 4)
    w = res[0]["worst"]["bfloat16"]
    # 2 token counts: one-shot, and two-shot for 9 > 4 tokens; fp32_acc=False on 1 of 3.
    assert w["cases"] == 3 and w["ulps_no_fp32_acc"], w
    for key in ("allreduce_bound", "residual_bound", "norm_own"):
        assert 0.0 < w[key], (key, w)
    # Every rank held the same bounds over the same data.
    assert all(r["worst"] == res[0]["worst"] for r in res)


@pytest.mark.slow
def test_batching_worker_at_four_ranks():
    """tests/gpu/workers/jax_batching.py on the reference path: the dense batch forms within
    the oracle's bounds, the MoE vmap equal to one call per element, as the GPU test
    (tests/gpu/test_jax.py::test_jax_batched_calls_fold_into_the_kernel) holds them."""
    from tests.gpu.test_jax import batching_problems

    res = _run("batching", 4)
    assert not batching_problems(res, 4), batching_problems(res, 4)
    assert all(r["batching"]["dense"]["residual_bound"] > 0 for r in res)


@pytest.mark.slow
def test_loop_worker_at_four_ranks():
    (r, *_) = _run("loop", 4, calls=20, m=4, hidden=256)
    assert r["loop"]["calls"] == 20 and r["loop"]["violations"] == 0, r


@pytest.mark.slow
def test_quant_worker_at_four_ranks():
    from tests.gpu.harness import bound_problems

    res = _run("quant", 4, tokens=(1, 9), hiddens=(256,))
    for r in res:
        q = r["quant"]
        assert q["cases"] == 2 * 3 and q["worse"] == 0, q
        assert not bound_problems(q, "bfloat16", 4), q
        assert "residual_bound" in q and "norm_own" in q, q


@pytest.mark.slow
def test_model_worker_at_two_ranks():
    """The 64-layer model task's plumbing (8 layers here): the fused model against the same
    math unfused on one device and a float64 model, as tests/gpu/test_jax.py holds it; no
    kernel on CPU, so no host launches either."""
    res = _run("model", 2, layers=8, m=4, hidden=256, ffn=512)
    for r in res:
        m = r["model"]
        assert m["finite"] and m["fused_vs_f64"] <= 1.25 * m["unfused_vs_f64"] + 1e-3, m
        assert m["host_launches_per_run"] == [0, 0, 0], m


@pytest.mark.slow
def test_fuse_styles_worker_at_two_ranks():
    """tests/gpu/fuse_styles.py's worker as two CPU processes (the reference lowering over
    gloo, so XLA collectives stay and every style runs): every site fused, and the fused
    models as accurate as the unfused ones (fuse_styles.check)."""
    from tests.gpu import fuse_styles
    from tests.gpu.test_fuse_styles import CONFIG

    styles = [
        "per_linear_llama",
        "sequence_parallel_llama",
        "plain_jit_llama_explicit",
        "hf_flax_llama_float32",
        "annotated_llama_per_token",
        "scanned_llama_shard_map",
    ]
    config = dict(CONFIG, hidden=256, ffn=512, seq=16, heads=4)
    res = _ranks(fuse_styles.worker, 2, styles=styles, config=config)
    assert not fuse_styles.check(res, styles, platform="cpu")
    for r in res:
        assert all(v["xla_collectives"] and "skipped" not in v for v in r["styles"].values())


@pytest.mark.slow
def test_fallback_worker_at_two_ranks():
    """tests/gpu/workers/jax_fallback.py as two CPU processes over gloo: the fused call on an
    xla workspace and the user's psum + add + RMSNorm, both within the fallback's bound of
    the float64 oracle, and the compiled modules' collectives compared (the CPU's own)."""
    from tests.gpu.test_fallback import _run
    from tests.gpu.workers import jax_fallback

    res = _run(2, platform="cpu", cases=((1, 256), (9, 512)))
    assert not jax_fallback.check(res), jax_fallback.check(res)
    for r in res:
        assert not r["shared_gpu"] and set(r["results"]) == {"bfloat16", "float16", "float32"}
        assert all(w["cases"] == 2 for w in r["results"].values()), r
