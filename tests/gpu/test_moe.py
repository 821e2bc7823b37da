"""The MoE patterns (6, 7) at 2, 4 and 8 ranks (tests/gpu/workers/moe_gpu.py's torch and JAX
stages): every output within the float64 oracle's bound, torch_compat equal to FlashInfer's own
build (when present), JAX equal to torch through the custom call, at 2 ranks also CUDA-graph
replays and 64 back-to-back calls with the same bits."""

import json
import os
import subprocess
import sys

import pytest

from tests.gpu.harness import world_params
from tests.repo import REPO

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=world_params())
def reports(request, tmp_path_factory):
    from jax_fusedar.common import native

    if native.gpu_count() < 1:
        pytest.skip("needs a GPU (with one, the ranks share it)")
    world = request.param
    out = os.path.join(
        os.environ.get("JAX_FUSEDAR_REPORT_DIR") or str(tmp_path_factory.mktemp("moe")),
        f"moe_world{world}",
    )
    os.makedirs(out, exist_ok=True)
    # In a child, whose stages spawn the rank processes: the pytest process stays off the GPUs
    # (tools/gpu_check.sh runs it with JAX_PLATFORMS=cpu), and a hang is cut by the timeout
    # instead of stopping the run.
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    if world != 2:
        env["MOE_GPU_CASES_ONLY"] = "1"
    args = ["--out", out, "--stages", "torch,jax", "--world", str(world)]
    try:  # its output not captured: the stages' progress goes to the test's log
        cmd = [sys.executable, "-m", "tests.gpu.workers.moe_gpu", *args]
        subprocess.run(cmd, cwd=REPO, env=env, timeout=600)
    except subprocess.TimeoutExpired:
        pytest.fail("tests.gpu.workers.moe_gpu did not finish within 600 s (a hang?)")
    return world, {
        s: json.loads(open(os.path.join(out, f"moe_{s}.json")).read())["result"]
        for s in ("torch", "jax")
    }


def test_torch_within_oracle_bounds_and_equal_to_flashinfer(reports):
    from tests.gpu import anchor

    world, reports = reports
    ranks = reports["torch"]
    assert "error" not in ranks and len(ranks) == world, ranks
    # Where the anchor folder looks complete, the byte-for-byte comparison must have run: a
    # load failure fails the test instead of skipping the comparison.
    anchor_present = anchor.problem(anchor.path()) is None
    for name, entry in ranks[0]["cases"].items():
        assert max(entry["oracle_error_fraction_of_bound"]) <= 1.0, (name, entry)
    for rank in ranks:
        if world == 2:
            assert rank["cuda_graph_replays_vs_eager_differing_elements"] == 0
            b2b = rank["back_to_back"]  # same inputs every call: the same bits every call
            assert b2b["calls"] >= 64 and b2b["calls_differing_from_the_first"] == 0, b2b
        for name, entry in rank["cases"].items():
            assert entry["ranks_identical"], name
            if anchor_present:
                assert rank["anchor_error"] is None, rank["anchor_error"]
            if rank["anchor_error"] is None:
                differing = entry["bytes_differing_vs_anchor"]
                assert differing == [0] * len(differing), (name, entry)


def test_jax_equals_torch_bitwise_through_the_custom_call(reports):
    from tests.gpu.workers.moe_gpu import JAX_CASES

    world, reports = reports
    ranks = reports["jax"]
    assert len(ranks) == world and "error" not in ranks, ranks
    for rank in ranks:
        assert len(rank["cases"]) == len(JAX_CASES), rank
        for name, entry in rank["cases"].items():
            assert entry["custom_call_in_hlo"], name
            assert set(entry["elements_differing_vs_torch"]) == {0}, (rank["rank"], name, entry)
            assert max(entry["oracle_error_fraction_of_bound"]) <= 1.0, (name, entry)
