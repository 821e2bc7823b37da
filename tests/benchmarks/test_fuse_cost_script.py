"""``python -m benchmarks.fuse_cost`` runs and reports what it measures (its times are not
asserted: they are the machine's): every site of its decoders fused, unrolled and scanned
(the loop rotated), both pass times and the compile ratios in the JSON rows."""

import json

from tests import cpu_devices


def test_fuse_cost_measures_every_decoder_with_every_site_fused(tmp_path):
    out = tmp_path / "rows.json"
    r = cpu_devices.run_module(
        "benchmarks.fuse_cost",
        *"--layers 2 --kinds llama minimal --reps 1 --json".split(),
        out,
        xla_flags=None,  # the script splits the host into 8 devices itself
    )
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())
    assert [row["model"] for row in rows] == [
        f"{kind} decoder {mode} 2 layers"
        for kind in ("llama", "minimal")
        for mode in ("unrolled", "scanned")
    ]
    for row in rows:
        # Two sites per layer: in the program as many (unrolled) or the loop's two.
        assert row["fused_sites"] == row["sites"] == (4 if "unrolled" in row["model"] else 2)
        assert row["fused_calls_per_run"] == 4, row
        assert 0 < row["analysis_s"]["median"] < row["pass_s"]["median"], row
        # One process on CPUs: the XLA fallback's workspaces hold no memory to exchange.
        assert 0 <= row["allocate_s"]["median"] < row["pass_s"]["median"], row
        assert 0 < row["pass_less_allocation_ms_per_layer"] <= row["pass_ms_per_layer"]
        assert row["compile_ratio"]["median"] > 0 and row["compile_cpu_ratio"]["median"] > 0
        for clock in ("", "_cpu"):
            hand = f"rotated_by_hand_compile{clock}_ratio"
            assert (hand in row) == ("scanned" in row["model"])
    assert "ms/layer" in r.stdout


def test_counts_below_one_are_refused_before_anything_runs():
    for flag, value in [
        ("--layers", "0"),
        ("--reps", "-1"),
        ("--integration-layers", "x"),
        ("--ranks", "0"),
    ]:
        r = cpu_devices.run_module("benchmarks.fuse_cost", flag, value, xla_flags=None)
        assert r.returncode == 2, (flag, r.stdout, r.stderr)
        assert f"argument {flag}: '{value}': a whole number of at least 1" in r.stderr


def test_ranks_run_one_process_each_and_a_failed_rank_ends_the_run(tmp_path):
    """``--ranks``: one jax.distributed process per rank (CPU here: the XLA fallback, no
    kernel call); rank 0 writes the rows. Hidden 256 does not split over 3 ranks: every
    rank fails, and the run ends with an error instead of waiting for them."""
    out = tmp_path / "rows.json"
    argv = "--layers 1 --kinds minimal --modes scanned --reps 1 --ranks 2 --json".split()
    r = cpu_devices.run_module("benchmarks.fuse_cost", *argv, out, xla_flags=None)
    assert r.returncode == 0, r.stdout + r.stderr
    [row] = json.loads(out.read_text())
    assert (row["ranks"], row["devices"], row["platform"]) == (2, 2, "cpu")
    assert (row["backend"], row["kernel_calls_in_program"]) == ("auto", 0)
    assert row["fused_sites"] == row["sites"] == 2 and row["fused_calls_per_run"] == 2
    assert "2 cpu devices in 2 process(es)" in r.stdout
    argv[argv.index("2")] = "3"
    r = cpu_devices.run_module("benchmarks.fuse_cost", *argv, out, xla_flags=None)
    assert r.returncode != 0 and "divisible" in r.stdout + r.stderr, r.stdout + r.stderr


def test_ranks_refuse_what_they_cannot_run(monkeypatch):
    """--ranks with the integration models (their meshes are 8 host devices of one process),
    and --platform cuda where no GPU is visible (CUDA_VISIBLE_DEVICES names none): usage
    errors, before any process starts."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    cases = [
        ("--integration", "build their meshes of 8 host devices"),
        ("--platform cuda", "--platform cuda: no CUDA GPU is visible"),
    ]
    for extra, message in cases:
        r = cpu_devices.run_module(
            "benchmarks.fuse_cost", "--ranks", "2", *extra.split(), xla_flags=None
        )
        assert r.returncode == 2 and message in r.stderr, (extra, r.stdout, r.stderr)
