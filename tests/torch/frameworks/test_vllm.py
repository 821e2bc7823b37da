"""vLLM 0.33.0's own modules on torch_compat installed as flashinfer (check.py in the
framework venv), on CPU: its fusion pass and communicator take the shim, its workspace
creation logs torch_compat's refusal (one rank) and goes on without, its fused call reaches
torch_compat's op in place, and its ``RMSNorm.forward_native`` meets the pass's rounding rule.
The kernel behind the calls runs in tests/gpu/test_flashinfer_shim.py."""

import json

import pytest

from tests.torch import rounding_check as rc
from tests.torch.frameworks import venv

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def found():
    r = venv.run("check.py", "vllm", "--norms")
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_vllm_on_the_shim(found):
    # Its pass and communicator probe flashinfer.comm with hasattr and take the shim; its
    # TorchDistBackend is the shim's.
    assert found["pass_uses_shim"] and found["communicator_available"]
    assert found["fused_op_registered"] and found["torch_dist_backend_is_ours"]
    # Its workspace creation reaches torch_compat, which refuses one rank.
    assert found["create_returned"] is None
    assert "world size 1 is not supported" in found["create_log"], found["create_log"]
    # Its fused call, served in place: norm_out over the input, residual_out over the residual.
    s = found["served"]
    assert "error" not in s, s
    assert (s["pattern"], s["tokens"], s["hidden"]) == (1, 16, 1024)
    assert s["input_is_x"] and s["norm_out_is_x"] and s["residual_out_is_res"]
    assert s["fp32_acc"] is True and s["launch_with_pdl"] is True


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("form, changes", [("rms_norm", 1), ("fused_add", 2)])
def test_vllm_rmsnorm_through_the_fusion_pass(found, form, changes, dtype):
    """Left alone by default, bit-identical; fused when opted in, within docs/torch.md's
    bound against float64."""
    rows = found["norms"][f"{form}/{dtype}"]
    assert len(rows) == 3
    for m in rows:
        assert m["default_fused"] == [False] and m["default_bit_equal"], m
        assert "allow_rounding_change=True" in m["default_reason"]
        assert m["opted_fused"] == [True] and len(m["change"].split("; ")) == changes, m
        rc.assert_within_bound(m, changes)
        assert m["differing"] > 0.05, m
