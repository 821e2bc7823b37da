"""SGLang 0.5.23's FlashInfer all-reduce fusion module on torch_compat installed as flashinfer
(check.py in the framework venv), on CPU. Its workspace creation stops at its own CUDA
preflight (torch_compat needs the CUDA driver bindings there) and disables the fusion. The
kernel behind the calls runs in tests/gpu/test_flashinfer_shim.py."""

import json

import pytest

from tests.torch.frameworks import venv

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def found():
    r = venv.run("check.py", "sglang")
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_sglang_on_the_shim(found):
    # It takes the shim as flashinfer.comm, subclasses its TorchDistBackend and finds the
    # keywords it probes for.
    assert found["module_uses_shim"] and found["backend_subclasses_ours"]
    assert found["sees_group_kwarg"] and found["sees_comm_backend_kwarg"]
    assert found["sees_trigger_completion"]
    c = found["create"]  # stopped at its CUDA preflight on CPU
    assert c.get("workspace") == "None", c
    assert any("Skipping allreduce fusion" in line for line in c["log"]), c
    # Its fused op body, its workspace manager holding a workspace over a recording native
    # rank, served by torch_compat.
    s = found["served"]
    assert "error" not in s, s
    assert (s["launches"], s["pattern"], s["tokens"], s["hidden"]) == (1, 1, 16, 1024)
    assert s["input_is_x"] and s["norm_out"] and s["residual_out"] and s["residual_in"]
    assert s["fp32_acc"] is True and s["launch_with_pdl"] is True
    assert s["trigger_completion_at_end"] is False
