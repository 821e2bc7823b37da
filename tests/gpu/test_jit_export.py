"""GPU: the plain-jit (Shardy) model and an exported artifact, one process driving both GPUs
(tests/gpu/workers/jax_single_process.py): one fused custom call per layer, bitwise equal to
the shard_map model; a layer exported with abstract_workspace runs in a fresh process once a
workspace of its key exists (before that: the handler's error naming the missing id)."""

import pytest

from tests.gpu.harness import needs_gpus, report, run_seed
from tests.gpu.workers.single_process_run import run_task

pytestmark = [pytest.mark.gpu, needs_gpus(2, "one process drives both devices")]
LAYERS = 4


def test_jit_only_model_uses_the_kernel_and_matches_shard_map_bitwise():
    res = run_task("jit", "cuda", seed=run_seed())
    report("jax_jit_sharding", res)
    for axes in ("Auto", "Explicit"):
        r = res[axes]
        assert r["backend"] == "trtllm", r
        assert r["fused_calls_in_hlo"] == LAYERS and r["all_reduces_in_hlo"] == 0, (axes, r)
        assert r["bitwise_equal"] and r["finite"], (axes, r)


def test_exported_artifact_runs_in_a_fresh_process_on_both_gpus(tmp_path):
    path = str(tmp_path / "layer")
    made = run_task("export", "cuda", path=path, seed=run_seed())
    served = run_task("serve", "cuda", path=path)
    report("jax_export_serve", {"export": made, "serve": served})
    assert made["ids_in_artifact"] == [made["workspace_id"]]
    assert served["workspace_id"] == made["workspace_id"] and served["backend"] == "trtllm"
    assert len(served["devices"]) >= 2
    assert f"no workspace with id {made['workspace_id']}" in served["missing_workspace_error"]
    assert served["fused_calls_in_hlo"] == 1 and served["kernel_launches"] >= 2, served
    assert served["bitwise_equal"] and served["finite"], served
