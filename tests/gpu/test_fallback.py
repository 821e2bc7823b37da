"""GPU: the "xla" fallback on ``backend="xla"`` (what TP across hosts gets), one
``jax.distributed`` process per rank, ranks sharing GPUs where there are fewer (each rank
then a "host" of its own to NCCL: tests/gpu/workers/jax_fallback.py).

Against plain ``psum`` + residual add + RMSNorm written without jax_fusedar, compiled and run
on the same inputs: both within the fallback's bound of the float64 oracle
(docs/numerics.md, ``oracle.psum_error_bound`` for XLA's all-reduce in any order, the residual
carried through one more rounding, norm_out within an ulp of the exact RMSNorm of its own
residual_out), and the GPU-compiled modules' collectives (``Compiled.as_text()``): the fused
programs hold no fused custom call and exactly the plain one's collectives: one all-reduce
of one rank's [tokens, hidden] (in the input's dtype where XLA keeps it: the CPU dry run
sums 16-bit all-reduces in float32, for the user's psum alike)."""

import pytest

from tests.gpu.harness import report, world_params

pytestmark = pytest.mark.gpu

# (tokens, hidden): one token, a decode-sized batch, a prefill-sized one.
CASES = ((1, 1024), (16, 4096), (129, 7168))


def _run(world, platform="cuda", cases=CASES):
    from tests.gpu.harness import random_seed, run_ranks_with_port
    from tests.gpu.workers import jax_fallback

    return run_ranks_with_port(
        jax_fallback.worker,
        world,
        timeout_s=900,
        seed=random_seed(1 << 30),
        cases=cases,
        platform=platform,
    )


@pytest.mark.parametrize("world", world_params(quick=(2,), worlds=(2, 4)))
def test_xla_backend_fallback_is_the_users_psum_within_the_bound(world):
    from tests.gpu.workers import jax_fallback

    res = _run(world)
    report(f"jax_fallback_world{world}", res)
    assert [r["world"] for r in res] == [world] * world
    problems = jax_fallback.check(res)
    assert not problems, "\n".join(problems)
