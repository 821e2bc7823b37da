"""Float64 oracles for the MoE patterns (6, 7), a numpy emulation of the kernels' rounding
points, and random MoE inputs (numpy and ml_dtypes only). Bound: each rounding to T before
the norm errs by at most half an ulp of its result, and every partial result is at most
M = sum over ranks of |terms| + |residual|, so |residual_out - r64| <= roundings / 2 *
ulp_T(M) (the "budget"), roundings = N * (2 * terms + 1) + (N - 1) + 1 (a product and an
addition per term, the last addition, the all-reduce's, the residual add); norm_out
inherits it twice through inv * |weight_bias + gamma| (through r and inv) plus its own
rounding: |norm_out - y64| <= 2 * budget_abs * inv64 * |wb + g| + ulp_T(|y64|).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from tests.oracles.oracle import fused_reference, ulp

DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def to_t(x, dtype_name):
    """float32 -> T, round to nearest even (the kernel's conversions)."""
    return np.asarray(x, np.float32).astype(DTYPES[dtype_name])


def f32(x):
    return np.asarray(x, np.float32)


def reduction_local64(expert_outputs, expert_scales, token_input):
    """Pattern 6, one rank: sum_e scale[e, t] * x[e, t] + token_input, and its magnitude."""
    x = np.asarray(expert_outputs, np.float64)
    s = np.asarray(expert_scales, np.float64)[..., None]
    tok = np.asarray(token_input, np.float64)
    return (s * x).sum(0) + tok, np.abs(s * x).sum(0) + np.abs(tok), x.shape[0] + 1


def finalize_local64(permuted, idx, scale=None, shared=None, routed=1.0):
    """Pattern 7, one rank: routed * sum_k w[t, k] * permuted[idx[t, k]] + shared."""
    p = np.asarray(permuted, np.float64)
    idx = np.asarray(idx)
    t, k = idx.shape
    w = np.ones((t, k)) if scale is None else np.asarray(scale, np.float64)
    valid = (idx >= 0)[..., None]
    rows = p[np.where(idx >= 0, idx, 0)] * valid * w[..., None]
    val = routed * rows.sum(1)
    mag = abs(routed) * np.abs(rows).sum(1)
    terms = k + (1 if routed != 1.0 else 0)
    if shared is not None:
        sh = np.asarray(shared, np.float64)
        val, mag, terms = val + sh, mag + np.abs(sh), terms + 1
    return val, mag, terms


def epilogue64(locals_, residual, gamma, *, rms_eps, weight_bias):
    """(sum, residual_out, norm_out, inv) in float64 from the ranks' exact local rows."""
    return fused_reference(locals_, residual, gamma, rms_eps=rms_eps, weight_bias=weight_bias)


def errors(outs, *, s64, r64, y64, inv64, magnitude, roundings, gamma, weight_bias, dtype_name):
    """(residual_out error, norm_out error[, allreduce_out error]) as fractions of their
    bounds (<= 1 passes). ``outs``: (residual_out, norm_out[, allreduce_out])."""
    budget = roundings / 2 * ulp(magnitude, dtype_name)
    res = np.abs(np.asarray(outs[0], np.float64) - r64) / budget
    g = np.abs(weight_bias + np.asarray(gamma, np.float64))
    norm = np.abs(np.asarray(outs[1], np.float64) - y64) / (
        2 * budget * inv64 * g + ulp(y64, dtype_name)
    )
    result = [float(res.max()), float(norm.max())]
    if len(outs) > 2:
        result.append(float((np.abs(np.asarray(outs[2], np.float64) - s64) / budget).max()))
    return result


# --- the kernels' rounding points, emulated (bitwise for the rows before the norm) ------------


def _add(a, b, dtype_name):
    return to_t(f32(a) + f32(b), dtype_name)


def reduction_local_rounded(expert_outputs, expert_scales, token_input, dtype_name):
    acc = np.zeros(np.shape(token_input), DTYPES[dtype_name])
    for e in range(np.shape(expert_outputs)[0]):
        term = to_t(f32(expert_outputs[e]) * f32(expert_scales[e])[:, None], dtype_name)
        acc = _add(acc, term, dtype_name)
    return _add(acc, token_input, dtype_name)


def finalize_local_rounded(permuted, idx, dtype_name, scale=None, shared=None, routed=1.0):
    idx = np.asarray(idx)
    acc = np.zeros((idx.shape[0], np.shape(permuted)[1]), DTYPES[dtype_name])
    for k in range(idx.shape[1]):
        valid = idx[:, k] >= 0
        rows = np.asarray(permuted)[np.where(valid, idx[:, k], 0)]
        if scale is not None:
            rows = to_t(f32(rows) * f32(np.asarray(scale)[:, k])[:, None], dtype_name)
        acc = np.where(valid[:, None], _add(acc, rows, dtype_name), acc)
    if routed != 1.0:
        acc = to_t(f32(acc) * np.float32(routed), dtype_name)
    if shared is not None:
        acc = _add(acc, shared, dtype_name)
    return acc


def epilogue_rounded(locals_, residual, dtype_name):
    """(allreduce_out, residual_out) exactly as the kernel rounds them (rank order)."""
    s = locals_[0]
    for x in locals_[1:]:
        s = _add(s, x, dtype_name)
    return s, _add(s, residual, dtype_name)


# --- random inputs ----------------------------------------------------------------------------


def random_finalize_case(
    rng, *, tokens, top_k, experts, world, dtype_name, drop=0.1, pad=0, hidden
):
    """Per-rank pattern 7 inputs of an expert-parallel layer (``experts`` over ``world``
    ranks, ``top_k`` distinct experts a token): a rank's index map points at its experts'
    rows (expert-sorted, each padded by ``pad`` rows), -1 for slots routed elsewhere, and
    ``drop`` of the slots dropped everywhere (over capacity)."""
    t_ = DTYPES[dtype_name]
    choice = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)])
    dropped = rng.random((tokens, top_k)) < drop
    owner = choice % world
    permuted, idx = [], []
    for r in range(world):
        mine = (owner == r) & ~dropped
        order = []  # (expert, token, slot) in expert-sorted order
        for e in range(experts):
            if e % world != r:
                continue
            slots = np.argwhere(mine & (choice == e))
            order += [(e, int(t), int(k)) for t, k in slots] + [None] * pad
        rows = max(len(order), 1)
        m = np.full((tokens, top_k), -1, np.int32)
        for row, o in enumerate(order):
            if o is not None:
                m[o[1], o[2]] = row
        idx.append(m)
        permuted.append(to_t(rng.standard_normal((rows, hidden)), dtype_name))
    weights = rng.random((tokens, top_k)).astype(np.float32)
    weights /= weights.sum(1, keepdims=True)
    return dict(
        permuted=permuted,
        idx=idx,
        scale=weights.astype(t_),
        shared=[to_t(rng.standard_normal((tokens, hidden)), dtype_name) for _ in range(world)],
        residual=to_t(rng.standard_normal((tokens, hidden)), dtype_name),
        gamma=to_t(1 + 0.1 * rng.standard_normal(hidden), dtype_name),
    )


def random_reduction_case(rng, *, tokens, experts, world, dtype_name, hidden):
    """Per-rank pattern 6 inputs: [E, T, H] expert outputs, [E, T] float32 scales, [T, H]
    token input; residual and gamma shared by the ranks."""
    return dict(
        expert_outputs=[
            to_t(rng.standard_normal((experts, tokens, hidden)), dtype_name) for _ in range(world)
        ],
        expert_scales=[rng.random((experts, tokens)).astype(np.float32) for _ in range(world)],
        token_input=[to_t(rng.standard_normal((tokens, hidden)), dtype_name) for _ in range(world)],
        residual=to_t(rng.standard_normal((tokens, hidden)), dtype_name),
        gamma=to_t(1 + 0.1 * rng.standard_normal(hidden), dtype_name),
    )
