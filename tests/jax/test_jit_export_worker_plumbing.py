"""CPU run of the workers of tests/gpu/test_jit_export.py (8 CPU devices, XLA workspaces): the
op lowers to the reference (all-reduces in the HLO), the ("cpu", "cuda") artifact its CPU branch."""

import pytest

from tests.gpu.workers.single_process_run import run_task

pytest.importorskip("flatbuffers", reason="jax.export serialization needs flatbuffers")


@pytest.mark.slow
def test_jit_worker_on_cpu():
    res = run_task("jit", "cpu", seed=7)
    for r in (res["Auto"], res["Explicit"]):
        assert r["backend"] == "xla" and r["fused_calls_in_hlo"] == 0, r
        assert r["all_reduces_in_hlo"] == 4 and r["bitwise_equal"] and r["finite"], r


def test_export_and_serve_workers_on_cpu(tmp_path):
    from jax_fusedar.common import native

    if not native.available():
        pytest.skip(
            "serving the (cpu, cuda) artifact compiles its cuda branch against the host twin "
            "of the FFI target, which is in the native extension (exporting needs none)"
        )
    made = run_task("export", "cpu", path=str(tmp_path / "layer"), seed=7)
    served = run_task("serve", "cpu", path=str(tmp_path / "layer"))
    assert made["ids_in_artifact"] == [made["workspace_id"]]
    # CPU workspaces are XLA ones (another key): the artifact's CPU branch needs none.
    assert served["backend"] == "xla" and served["missing_workspace_error"] == "no error"
    # XLA:CPU keeps the unreachable cuda branch (hence the host twin of the FFI target,
    # without which this compile fails); the kernel never launches.
    assert served["fused_calls_in_hlo"] == 1 and served["kernel_launches"] == 0
    assert served["bitwise_equal"] and served["finite"], served
    assert served["shapes"] == [[16, 4096], [16, 4096]]
