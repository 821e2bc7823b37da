"""The reference math (jax_fusedar/ops/reference.py) against the float64 oracle
(tests/oracles/oracle.py), and its rounding points bit for bit, on 8 CPU devices."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from tests.oracles import oracle
from tests.jax.cpu_helpers import DTYPES, RMS_EPS, bits, check_outputs, jdtype, kernel_rounding
from tests.jax.cpu_helpers import make_mesh, new_rng, random_gamma, random_partials, random_values
from tests.jax.cpu_helpers import require_host_devices, run_sharded
from jax_fusedar.ops import reference

# Also in the oldest-versions lane (./dev oldest).
pytestmark = pytest.mark.oldest

require_host_devices()

WORLD = 8
# rms_norm of exact inputs rounds once: half an ulp plus fp32 noise (16-bit); fp32 carries
# the rsqrt's and the mean's own rounding.
RMS_NORM_ULPS = {"bfloat16": 0.51, "float16": 0.51, "float32": 8.0}

dtypes = pytest.mark.parametrize("dtype", DTYPES)


def assert_rms_norm_of(r, gamma, weight_bias, y, dtype, rms_eps=RMS_EPS):
    """y is RMSNorm(r) rounded once: measured in ulps of the float64 norm of r as given."""
    r64, g64 = np.asarray(r).astype(np.float64), np.asarray(gamma).astype(np.float64)
    y64 = r64 / np.sqrt(np.mean(r64 * r64, axis=-1, keepdims=True) + rms_eps) * (weight_bias + g64)
    err = oracle.allreduce_error_ulps(y, y64, dtype)
    assert err <= RMS_NORM_ULPS[dtype], f"not RMSNorm(r) rounded once: off by {err} ulps"


def assert_rounds_like_the_kernel(ar, res_out, partials, residual, dtype, fp32_acc=True):
    """allreduce_out and residual_out bit for bit cpu_helpers.kernel_rounding's (s, r)."""
    s, r = kernel_rounding(partials, residual, dtype, fp32_acc=fp32_acc)
    np.testing.assert_array_equal(bits(ar), bits(s))
    np.testing.assert_array_equal(bits(res_out), bits(r))
    return s, r


@jax.jit
def _rms_norm(r, gamma, weight_bias, rms_eps):
    return reference.rms_norm(r, gamma, rms_eps=rms_eps, weight_bias=weight_bias, out_dtype=r.dtype)


@dtypes
def test_rms_norm_eps_is_inside_the_root(dtype):
    # Values ~1e-2 and eps 1e-3: eps is a tenth of the mean square, so misplacing it (outside
    # the root, or dropping it) moves every output by far more than an ulp.
    rng = new_rng()
    r = (random_values(rng, (7, 256), "float32") * 1e-2).astype(jdtype(dtype))
    gamma = random_gamma(rng, 256, dtype)
    assert_rms_norm_of(r, gamma, 0.0, np.asarray(_rms_norm(r, gamma, 0.0, 1e-3)), dtype, 1e-3)


def _run_reference(partials, residual, gamma, weight_bias, **kwargs):
    """Numpy (allreduce, residual, norm) of patterns 0 and 1 on the per-rank partials
    [WORLD, M, H] over a WORLD-device mesh, every rank's the same bits. (Gathered per rank:
    without fp32_acc the reference all-gathers, which leaves them varying for check_vma.)"""
    kwargs.update(axis_name="tp", rms_eps=RMS_EPS, weight_bias=weight_bias)

    def f(x, res, g):
        ar = reference.allreduce_fusion_reference(x[0], None, None, pattern=0, **kwargs)[0]
        _, res_out, norm_out = reference.allreduce_fusion_reference(
            x[0], res, g, pattern=1, **kwargs
        )
        return ar[None], res_out[None], norm_out[None]

    mesh = make_mesh((WORLD,), ("tp",))
    outs = run_sharded(f, mesh, (P("tp"), P(), P()), (P("tp"),) * 3, partials, residual, gamma)
    outs = [np.asarray(o) for o in outs]
    for o in outs:
        assert o.shape[0] == WORLD and (bits(o) == bits(o[:1])).all(), "the ranks disagree"
    return [o[0] for o in outs]


@pytest.mark.slow  # every dtype, weight_bias, token count and hidden size
@dtypes
@pytest.mark.parametrize("weight_bias", [0.0, 1.0])
@pytest.mark.parametrize("tokens,hidden", [(m, h) for m in (1, 7, 64) for h in (8, 256, 1024)])
def test_reference_against_oracle(dtype, weight_bias, tokens, hidden):
    """RMSNorm alone, the epilogue after a rounded sum, and the whole op over WORLD ranks."""
    rng = new_rng()
    summed = random_values(rng, (tokens, hidden), dtype)  # an all-reduce already rounded to T
    residual = random_values(rng, (tokens, hidden), dtype)
    gamma = random_gamma(rng, hidden, dtype)
    y = np.asarray(_rms_norm(residual, gamma, weight_bias, RMS_EPS))
    assert y.dtype == jdtype(dtype) and y.shape == residual.shape
    assert_rms_norm_of(residual, gamma, weight_bias, y, dtype)
    kw = dict(rms_eps=RMS_EPS, weight_bias=weight_bias)
    epilogues = lambda s, res, g: (
        reference.epilogue(s, None, None, pattern=0, **kw),
        reference.epilogue(s, res, g, pattern=1, **kw),
    )
    (ar, none_r, none_n), (none_a, res_out, norm_out) = jax.jit(epilogues)(summed, residual, gamma)
    assert none_r is None and none_n is None and none_a is None
    # Pattern 0 has nothing after the all-reduce: the sum comes back unchanged.
    np.testing.assert_array_equal(bits(ar), bits(summed))
    outs = dict(residual_out=res_out, norm_out=norm_out, what="epilogue")
    check_outputs(dtype, [summed], residual=residual, gamma=gamma, weight_bias=weight_bias, **outs)
    # The residual add rounds exactly once, from fp32.
    assert_rounds_like_the_kernel(ar, res_out, [summed], residual, dtype)
    partials = random_partials(rng, (WORLD, tokens, hidden), dtype)
    ar, res_out, norm_out = _run_reference(partials, residual, gamma, weight_bias)
    outs = dict(allreduce_out=ar, residual_out=res_out, norm_out=norm_out, what="reference")
    check_outputs(dtype, partials, residual=residual, gamma=gamma, weight_bias=weight_bias, **outs)
    assert_rounds_like_the_kernel(ar, res_out, partials, residual, dtype)
    # The norm reads the residual as rounded to T, not the fp32 sum before that rounding.
    assert_rms_norm_of(res_out, gamma, weight_bias, norm_out, dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_residual_add_sees_the_rounded_sum(dtype):
    """The all-reduce is rounded to T *before* the residual is added (two roundings). With h
    half an ulp at 1, a a signed power of two: rank 0 holds a (even mantissa) or a(1+2h) (odd),
    rank 1 a*h, the others cancel in pairs. The sums a(1+h), a(1+3h) are ties, rounded to even:
    a, a(1+4h); the residual +-a*h makes another tie, back to a, a(1+4h). Added to the unrounded
    sum it gives a(1+2h) exactly, in every element. Every fp32 partial sum is exact."""
    rng = new_rng()
    h = 2.0 ** -({"bfloat16": 7, "float16": 10}[dtype] + 1)
    shape = (7, 256)
    a = rng.choice([-1.0, 1.0], shape) * 2.0 ** rng.integers(-4, 4, shape)
    odd = rng.integers(0, 2, shape).astype(bool)
    n_pairs = (WORLD - 2) // 2
    pairs = rng.choice([-1.0, 1.0], (n_pairs, *shape)) * rng.uniform(0.25, 4, (n_pairs, *shape))
    x64 = np.empty((WORLD, *shape))
    x64[0] = np.where(odd, a * (1 + 2 * h), a)
    x64[1] = a * h
    x64[2::2] = pairs.astype(np.float32).astype(jdtype(dtype))
    x64[3::2] = -x64[2::2]
    r64 = np.where(odd, -a * h, a * h)
    partials, residual = x64.astype(jdtype(dtype)), r64.astype(jdtype(dtype))
    assert np.array_equal(partials.astype(np.float64), x64)  # the construction is exact in T
    assert np.array_equal(residual.astype(np.float64), r64)

    ar, res_out, _ = _run_reference(partials, residual, random_gamma(rng, 256, dtype), 0.0)
    rounded_twice = np.where(odd, a * (1 + 4 * h), a)
    np.testing.assert_array_equal(ar.astype(np.float64), rounded_twice)
    np.testing.assert_array_equal(res_out.astype(np.float64), rounded_twice)
    assert_rounds_like_the_kernel(ar, res_out, partials, residual, dtype)
    # Without the intermediate rounding: a(1+2h), different in every element.
    one_rounding = (x64.sum(axis=0) + r64).astype(np.float32).astype(jdtype(dtype))
    np.testing.assert_array_equal(one_rounding.astype(np.float64), a * (1 + 2 * h))
    assert np.all(bits(one_rounding) != bits(res_out))


def test_fp32_partials_with_cancellation_stay_within_the_summation_bound():
    """fp32 partials: with cancellation the fp32 psum (any order) is not within an ulp of |sum|,
    but within recursive summation's (N - 1) u sum|x_r|; residual_out plus its own ulp."""
    rng = new_rng()
    partials = rng.standard_normal((WORLD, 64, 256)).astype(np.float32)
    residual = random_values(rng, (64, 256), "float32")
    gamma = random_gamma(rng, 256, "float32")
    ar, res_out, _ = _run_reference(partials, residual, gamma, 0.0)
    x64 = partials.astype(np.float64)
    s64, bound = x64.sum(axis=0), 1.01 * (WORLD - 1) * 2.0**-24 * np.abs(x64).sum(axis=0)
    assert np.all(np.abs(ar - s64) <= bound)
    r64 = s64 + residual.astype(np.float64)
    assert np.all(
        np.abs(res_out - r64) <= bound + oracle.ulp(np.abs(s64) + np.abs(residual), "float32")
    )


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_without_fp32_acc_every_addition_rounds_in_rank_order(dtype):
    """fp32_acc=False: FlashInfer's default, a rounding to T after every addition, ranks in
    order 0..N-1. Full-precision partials, so the roundings really differ from fp32_acc."""
    rng = new_rng()
    partials = random_values(rng, (WORLD, 64, 256), dtype)
    residual = random_values(rng, (64, 256), dtype)
    gamma = random_gamma(rng, 256, dtype)
    ar, res_out, norm_out = _run_reference(partials, residual, gamma, 1.0, fp32_acc=False)
    s, _ = assert_rounds_like_the_kernel(ar, res_out, partials, residual, dtype, fp32_acc=False)
    assert_rms_norm_of(res_out, gamma, 1.0, norm_out, dtype)
    # Another order, or a single rounding, gives other answers: the test can tell them apart.
    reversed_s, _ = kernel_rounding(partials[::-1], residual, dtype, fp32_acc=False)
    assert np.any(bits(reversed_s) != bits(s))
    once = np.sum(partials.astype(np.float64), axis=0).astype(np.float32).astype(jdtype(dtype))
    assert np.any(bits(once) != bits(s))


def test_float16_subnormal_results_are_kept():
    """Below float16's smallest normal (2**-14), the all-reduce, residual add and norm give
    subnormals, as the kernel's fp32 -> half conversion does, not zeros."""
    rng = new_rng()
    # Multiples of the subnormal step 2**-24, exact in float16 and in every sum here:
    # |sum| <= 8 * 100 steps and |sum + residual| <= 1000 steps, below 2**-14 = 1024 steps.
    step = 2.0**-24
    partials = step * rng.integers(1, 101, (WORLD, 3, 8)) * rng.choice([-1, 1], (WORLD, 3, 8))
    partials = partials.astype(np.float16)
    residual = (step * rng.integers(-200, 201, (3, 8))).astype(np.float16)
    gamma = rng.uniform(1e-5, 4e-5, 8).astype(np.float16)
    ar, res_out, norm_out = _run_reference(partials, residual, gamma, 0.0)
    s, r = assert_rounds_like_the_kernel(ar, res_out, partials, residual, "float16")
    assert np.all(np.abs(r.astype(np.float64)) < 2.0**-14) and np.count_nonzero(s) > 12
    assert np.count_nonzero(norm_out) > 12
    assert_rms_norm_of(res_out, gamma, 0.0, norm_out, "float16")
