"""How the demos (dense and MoE) compare the fused op with the unfused math: timed runs, the
greedy tokens and logits of two decodes (first divergence, top-2 margins, the near-tie rule)
and the rounding tolerance of the logits."""

from __future__ import annotations

import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

TOLERANCE_FORMULA = "eps + sites * (eps + sqrt(world - 1) * eps / 2)"


def timed_runs(fn, args, runs: int) -> list:
    """Seconds of each of ``runs`` calls, each waited for; after a warm-up call, which also
    compiles, so that neither is timed."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return times


def median_seconds(fn, fn_args, iters: int) -> float:
    return statistics.median(timed_runs(fn, fn_args, iters))


def tolerance(dtype: str, world: int, sites: int) -> float:
    """Bound on max|fused - unfused| / max|unfused| of the logits.

    At each site the two programs round differently: the fused op sums in float32 and rounds
    once; a psum in the model dtype rounds after each of its world - 1 additions (about
    sqrt(world - 1) * eps / 2 together), and the residual add rounds that differing sum, which
    can land one ulp (eps) apart. The residual stream carries every site's difference forward
    (the blocks' gain is about 1 at this init) and the final norm maps the stream's relative
    error to the logits', plus one rounding of the norm output."""
    eps = float(jnp.finfo(dtype).eps)
    return eps + sites * (eps + math.sqrt(world - 1) * eps / 2)


MOE_SITE_FORMULA = "eps + sqrt(n) * eps / 2 * m"


def moe_kernel_roundings(top_k: int, world: int) -> int:
    """Roundings of the MoE finalize kernel before its residual add, per token element, over
    a TP group (jax_fusedar/ops/moe_reference.py lists them): a product and an addition for each
    of the token's top_k routed rows, each rank's addition of its shared-expert partial sum,
    and the all-reduce's world - 1 additions in the model dtype."""
    return 2 * top_k + world + (world - 1)


def moe_tolerance(
    dtype: str, ratios, roundings: int, *, dense_sites: int = 0, world: int = 1
) -> float:
    """Bound on max|fused - other| / max|other| of the logits of the MoE decoder, the other
    program summing the MoE terms differently (``roundings``: both programs' roundings of
    them before the residual add).

    Each MoE layer is one site of the dense tolerance's kind, scaled by what flows through
    it: ``ratios`` holds, per layer, m = the largest magnitude of the terms the kernel adds
    (summed over the ranks: every value it rounds is within it) over the largest magnitude of
    the residual stream after the block; each rounding errs by at most eps / 2 of the value,
    and n of them add up to about sqrt(n) times that (as the dense formula counts a psum's
    roundings), plus the residual add's ulp (eps). ``dense_sites`` more sites (the
    attention's fused all-reduces) count as in ``tolerance``'s terms over ``world`` partial
    sums. The residual stream carries every site's difference to the final norm, plus one
    rounding of its output (eps)."""
    eps = float(jnp.finfo(dtype).eps)
    dense = dense_sites * (eps + math.sqrt(world) * eps / 2)
    return eps + dense + sum(eps + math.sqrt(roundings) * eps / 2 * m for m in ratios)


def compare_greedy(tok_u, log_u, tok_f, log_f):
    """(first divergence (step, seq) or None, max abs logits error over the steps before it,
    max |logits|, margins text) of two greedy decodes: tokens [seq, step] and logits [step,
    seq, vocab] of the unfused and the fused program."""
    diff = np.argwhere(tok_u != tok_f)
    first = None
    upto = tok_u.shape[1]
    if len(diff):
        step = int(diff[:, 1].min())
        seq = int(diff[diff[:, 1] == step][0, 0])
        first = (step, seq)
        upto = step + 1  # the logits of the diverging step still share their inputs
    err = float(np.max(np.abs(log_u[:upto] - log_f[:upto])))
    scale = float(np.max(np.abs(log_u[:upto])))
    margins = ""
    if first is not None:
        margins = (
            f"unfused top-2 margin {top2_margin(log_u, *first):.4g}, fused top-2 margin "
            f"{top2_margin(log_f, *first):.4g}"
        )
    return first, err, scale, margins


def top2_margin(logits, step: int, seq: int) -> float:
    """Top-1 minus top-2 logit of one sequence at one step."""
    top = np.sort(logits[step, seq])[-2:]
    return float(top[1] - top[0])


def near_tie(logits, first, err: float) -> bool:
    """Whether a divergence at ``first`` (step, seq) is a near tie, the only divergence the
    demos accept: the unfused program's top-2 margin there within twice the largest logits
    difference seen."""
    return first is not None and top2_margin(logits, *first) <= 2 * err
