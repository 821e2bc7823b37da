"""GPU: the XLA FFI handler checks every result and reports the core's status as its own error
code (ffi/xla/result_check.h; the rules are tested on CPU in tests/native/test_contract.py)."""

import pytest

from tests.gpu.harness import random_seed, report, run_ranks_with_port
from tests.gpu.workers import jax_multiprocess

pytestmark = pytest.mark.gpu


def test_handler_errors_name_the_result_and_keep_the_code():
    res = run_ranks_with_port(
        jax_multiprocess.worker,
        2,
        timeout_s=600,
        xla_flags="",
        task="handler_errors",
        seed=random_seed(),
    )
    report("jax_handler_errors", res)
    for r in res:
        e = r["handler_errors"]
        assert "INVALID_ARGUMENT" in e["wrong_norm_out"], e
        assert "result 1 (norm_out) must be 16384 elements of bfloat16" in e["wrong_norm_out"], e
        assert "INVALID_ARGUMENT" in e["wrong_scale_out"], e
        assert "result 3 (scale_out) must be 16 elements of float32" in e["wrong_scale_out"], e
        assert "INVALID_ARGUMENT" in e["unknown_algorithm"], e
        assert "unknown algorithm code 7" in e["unknown_algorithm"], e
        assert "INTERNAL" not in e["unknown_algorithm"], e
        assert e["good"] == "no error", e
