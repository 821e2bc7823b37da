"""The MoE patterns (6, 7) on 2 ranks (one GPU each, or sharing one): tests/gpu/moe_gpu.py's three stages, with their
thresholds: every output within the float64 oracle's bound, torch_compat == FlashInfer's own
build byte for byte (when the anchor is present), JAX == torch bit for bit with the custom
call in the compiled program, CUDA-graph replays == eager calls."""
import json
import os
import subprocess
import sys

import pytest

from tests.repo import REPO

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    from jax_fusedar.common import native
    if native.gpu_count() < 1:
        pytest.skip("needs a GPU (with one, both ranks share it)")
    out = os.environ.get("JAX_FUSEDAR_REPORT_DIR") or str(tmp_path_factory.mktemp("moe"))
    # In a child, whose stages spawn the rank processes: the pytest process stays off the GPUs
    # (tools/gpu_check.sh runs it with JAX_PLATFORMS=cpu), and a hang is cut by the timeout
    # instead of stopping the run.
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    try:
        subprocess.run([sys.executable, "-m", "tests.gpu.moe_gpu", "--out", out,
                        "--stages", "torch,jax"], cwd=REPO, env=env, timeout=600)
    except subprocess.TimeoutExpired:
        pytest.fail("tests.gpu.moe_gpu did not finish within 600 s (a hang?)")
    return {s: json.loads(open(os.path.join(out, f"moe_{s}.json")).read())["result"]
            for s in ("torch", "jax")}


def test_torch_within_oracle_bounds_and_equal_to_flashinfer(reports):
    ranks = reports["torch"]
    assert "error" not in ranks, ranks
    for name, entry in ranks[0]["cases"].items():
        assert max(entry["oracle_error_fraction_of_bound"]) <= 1.0, (name, entry)
    for rank in ranks:
        assert rank["cuda_graph_replays_vs_eager_differing_elements"] == 0
        b2b = rank["back_to_back"]  # same inputs every call: the same bits every call
        assert b2b["calls"] >= 64 and b2b["calls_differing_from_the_first"] == 0, b2b
        for name, entry in rank["cases"].items():
            assert entry["ranks_identical"], name
            if rank["anchor_error"] is None:
                assert entry["bytes_differing_vs_anchor"] == [0] * len(
                    entry["bytes_differing_vs_anchor"]), (name, entry)


def test_jax_equals_torch_bitwise_through_the_custom_call(reports):
    from tests.gpu.moe_gpu import JAX_CASES
    ranks = reports["jax"]
    assert "error" not in ranks, ranks
    for rank in ranks:
        assert len(rank["cases"]) == len(JAX_CASES), rank
        for name, entry in rank["cases"].items():
            assert entry["custom_call_in_hlo"], name
            assert set(entry["elements_differing_vs_torch"]) == {0}, (rank["rank"], name, entry)
            assert max(entry["oracle_error_fraction_of_bound"]) <= 1.0, (name, entry)
