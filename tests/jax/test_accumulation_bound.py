"""The all-reduce's error bound at every world size (docs/numerics.md, "Accumulation across
N ranks"; oracle.sum_error_bound, residual_error_bound), for fp32_acc=True and False: on an
exact numpy emulation of the kernel's additions (rank order, float32 sums, rounded to the call
dtype without fp32_acc), never exceeded and not loose (cancelling partial sums come within a
factor 2.5); on the reference path (4 and 8 CPU devices), which rounds where the kernel rounds:
within the bound, bit for bit the emulation, norm_out within an ulp of the RMSNorm of its own
residual_out. The GPU tests (tests/gpu/test_jax.py, ...) hold the kernel to the same bounds."""

import numpy as np
import pytest

from jax_fusedar.common.limits import SUPPORTED_WORLD_SIZES
from tests.jax.test_fallback_numerics import add, chain, op_and_users_program
from tests.jax.cpu_helpers import DTYPES, RMS_EPS, bits, new_rng, partials_of_kind, random_gamma
from tests.jax.cpu_helpers import random_values, require_host_devices
from tests.oracles import oracle

require_host_devices()

# Also in the oldest-versions lane (./dev oldest).
pytestmark = [pytest.mark.usefixtures("hermetic"), pytest.mark.oldest]
FP32_ACC = pytest.mark.parametrize("fp32_acc", [True, False], ids=["fp32_acc", "no_fp32_acc"])


def emulate_kernel_sum(xs, dtype_name, *, fp32_acc):
    """allreduce_out as the kernel (FlashInfer's allreduce_sum) computes it: ranks in order, a
    float32 running sum rounded once (fp32_acc) or every addition rounded to the call dtype."""
    if not fp32_acc:
        return chain(list(xs), dtype_name)
    return chain([np.asarray(x, np.float32) for x in xs], "float32").astype(xs[0].dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@FP32_ACC
@pytest.mark.parametrize("world", SUPPORTED_WORLD_SIZES)
def test_bound_holds_on_the_kernels_additions(world, fp32_acc, dtype):
    rng = new_rng()
    for kind in ("normal", "cancelling", "growing", "tiny"):
        xs = partials_of_kind(kind, rng, world, (64, 512), dtype)
        residual = random_values(rng, (64, 512), dtype)
        s = emulate_kernel_sum(xs, dtype, fp32_acc=fp32_acc)
        r = add(s, residual, dtype)
        errs = oracle.accumulation_errors(
            xs, residual, allreduce_out=s, residual_out=r, fp32_acc=fp32_acc, dtype_name=dtype
        )
        assert errs["allreduce_bound"] <= 1.0 and errs["residual_bound"] <= 1.0, (kind, errs)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("world", [4, 8, 16])
def test_without_fp32_acc_the_bound_is_reached_and_the_two_rank_bound_is_not_enough(world, dtype):
    """Where partial sums cancel, fp32_acc=False errs by about the bound (within 2.5x), far
    beyond the two-rank bound of one ulp of |s|; fp32_acc=True stays within that ulp."""
    xs = partials_of_kind("cancelling", new_rng(), world, (256, 512), dtype)
    s64 = np.sum(xs.astype(np.float64), axis=0)
    s = emulate_kernel_sum(xs, dtype, fp32_acc=False)
    ratio = oracle.bound_ratio(s, s64, oracle.sum_error_bound(xs, dtype, fp32_acc=False))
    assert 0.4 <= ratio <= 1.0, ratio
    assert oracle.allreduce_error_ulps(s, s64, dtype) > 8.0
    s_acc = emulate_kernel_sum(xs, dtype, fp32_acc=True)
    assert oracle.allreduce_error_ulps(s_acc, s64, dtype) <= 1.0
    if (world, dtype) == (8, "bfloat16"):
        # The bound counts every rounding: over one rank fewer (one rounding fewer) it is
        # exceeded.
        short = oracle.sum_error_bound(xs[1:], dtype, fp32_acc=False)
        assert oracle.bound_ratio(s, s64, short) > 1.0


@pytest.mark.parametrize("dtype", DTYPES)
@FP32_ACC
@pytest.mark.parametrize("world", [4, 8])
def test_reference_path_within_the_bound(world, fp32_acc, dtype):
    rng = new_rng()
    opts = dict(fp32_acc=fp32_acc, rms_eps=RMS_EPS, weight_bias=1.0, dtype_name=dtype)
    for kind in ("normal", "cancelling"):
        xs = partials_of_kind(kind, rng, world, (16, 256), dtype)
        residual = random_values(rng, (16, 256), dtype)
        gamma = random_gamma(rng, 256, dtype)
        kw = dict(fp32_acc=fp32_acc, fallback="kernel_exact")
        ar, res, norm = op_and_users_program(world, dtype, xs, residual, gamma, 1.0, **kw)[:3]
        errs = oracle.accumulation_errors(
            xs, residual, gamma, allreduce_out=ar, residual_out=res, norm_out=norm, **opts
        )
        where = (kind, world, dtype, fp32_acc, errs)
        assert errs["allreduce_bound"] <= 1.0 and errs["residual_bound"] <= 1.0, where
        assert errs["norm_own"] <= oracle.NORM_GIVEN_RESIDUAL_ULPS[dtype], where
        if not fp32_acc and dtype != "float32":
            # Every rounding where the kernel rounds (fp32_acc=True and float32 sum in psum's
            # order, which the API leaves open).
            s = emulate_kernel_sum(xs, dtype, fp32_acc=False)
            assert np.array_equal(bits(ar), bits(s)), where
            assert np.array_equal(bits(res), bits(add(s, residual, dtype))), where
