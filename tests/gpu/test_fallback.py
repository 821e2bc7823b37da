"""GPU: the "xla" fallback on ``backend="xla"`` (what TP across hosts gets) against plain psum
+ residual add + RMSNorm written without jax_fusedar: both within the fallback's bound, the
same collectives (tests/gpu/workers/jax_fallback.py)."""

import pytest

from tests.gpu.harness import random_seed, report, run_ranks_with_port, world_params
from tests.gpu.workers import jax_fallback

pytestmark = pytest.mark.gpu

# (tokens, hidden): one token, a decode-sized batch, a prefill-sized one.
CASES = ((1, 1024), (16, 4096), (129, 7168))


def _run(world, platform="cuda", cases=CASES):
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
    res = _run(world)
    report(f"jax_fallback_world{world}", res)
    assert [r["world"] for r in res] == [world] * world
    problems = jax_fallback.check(res)
    assert not problems, "\n".join(problems)
