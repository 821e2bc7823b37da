"""SGLang 0.5.23's FlashInfer all-reduce fusion module on torch_compat installed as
flashinfer (check_sglang.py, run in the framework venv, venv.py), on CPU:

- it takes the shim as ``flashinfer.comm``, subclasses the shim's ``TorchDistBackend``, and
  finds the keyword arguments it probes for (``group``, ``comm_backend``,
  ``trigger_completion_at_end``);
- its workspace manager, asked to create a workspace, stops at its own CUDA preflight on
  CPU (torch_compat is not reached there: it needs the CUDA driver bindings) and disables
  the fusion;
- its fused all-reduce + residual + RMSNorm op body, with its workspace manager holding a
  torch_compat workspace over a recording native rank, reaches torch_compat's op with
  SGLang's arguments and is launched.
The kernel behind the calls runs in tests/gpu/test_flashinfer_shim.py."""

import json

import pytest

from tests.torch.frameworks import venv

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def found():
    r = venv.run("check_sglang.py")
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_sglang_takes_the_shim_as_flashinfer_comm(found):
    assert found["module_uses_shim"] and found["backend_subclasses_ours"]
    assert found["sees_group_kwarg"] and found["sees_comm_backend_kwarg"]
    assert found["sees_trigger_completion"]


def test_sglang_creation_stops_at_its_cuda_preflight_on_cpu(found):
    c = found["create"]
    assert c.get("workspace") == "None", c
    assert any("Skipping allreduce fusion" in line for line in c["log"]), c


def test_sglang_fused_call_is_served_by_torch_compat(found):
    s = found["served"]
    assert "error" not in s, s
    assert (s["launches"], s["pattern"], s["tokens"], s["hidden"]) == (1, 1, 16, 1024)
    assert s["input_is_x"] and s["norm_out"] and s["residual_out"] and s["residual_in"]
    assert s["fp32_acc"] is True and s["launch_with_pdl"] is True
    assert s["trigger_completion_at_end"] is False
