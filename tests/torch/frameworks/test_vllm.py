"""vLLM 0.33.0's own modules on torch_compat installed as flashinfer (check_vllm.py, run in
the framework venv, venv.py), on CPU:

- its all-reduce fusion pass module and its FlashInfer all-reduce communicator take the
  shim as ``flashinfer.comm`` (they probe it with hasattr), and its ``TorchDistBackend`` is
  the shim's;
- its workspace creation reaches torch_compat, which refuses here (one rank: no kernel for
  it) and vLLM logs torch_compat's reason and goes on without the workspace;
- its fused all-reduce + RMSNorm call (the op its pass emits) reaches torch_compat's op with
  vLLM's arguments (in place: norm_out over the input, residual_out over the residual) and
  is launched on a recording stand-in of the native rank;
- its ``RMSNorm.forward_native`` (both forms) through make_fx and torch_compat's fusion
  pass: left alone by default, bit-identical; fused when opted in, within docs/torch.md's
  bound against float64.
The kernel behind the calls runs in tests/gpu/test_flashinfer_shim.py."""

import json

import pytest

from tests.torch import rounding_check as rc
from tests.torch.frameworks import venv

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def found():
    r = venv.run("check_vllm.py", "--norms")
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_vllm_takes_the_shim_as_flashinfer_comm(found):
    assert found["pass_uses_shim"] and found["communicator_available"]
    assert found["fused_op_registered"] and found["torch_dist_backend_is_ours"]


def test_vllm_workspace_creation_reaches_torch_compat(found):
    assert found["create_returned"] is None
    assert "world size 1 is not supported" in found["create_log"], found["create_log"]


def test_vllm_fused_call_is_served_by_torch_compat(found):
    s = found["served"]
    assert "error" not in s, s
    assert (s["pattern"], s["tokens"], s["hidden"]) == (1, 16, 1024)
    assert s["input_is_x"] and s["norm_out_is_x"] and s["residual_out_is_res"]
    assert s["fp32_acc"] is True and s["launch_with_pdl"] is True


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("form, changes", [("rms_norm", 1), ("fused_add", 2)])
def test_vllm_rmsnorm_through_the_fusion_pass(found, form, changes, dtype):
    rows = found["norms"][f"{form}/{dtype}"]
    assert len(rows) == 3
    for m in rows:
        assert m["default_fused"] == [False] and m["default_bit_equal"], m
        assert "allow_rounding_change=True" in m["default_reason"]
        assert m["opted_fused"] == [True] and len(m["change"].split("; ")) == changes, m
        rc.assert_within_bound(m, changes)
        assert m["differing"] > 0.05, m
