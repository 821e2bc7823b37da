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
        assert row["compile_ratio"]["median"] > 0 and row["compile_cpu_ratio"]["median"] > 0
        for clock in ("", "_cpu"):
            hand = f"rotated_by_hand_compile{clock}_ratio"
            assert (hand in row) == ("scanned" in row["model"])
    assert "ms/layer" in r.stdout


def test_counts_below_one_are_refused_before_anything_runs():
    for flag, value in [("--layers", "0"), ("--reps", "-1"), ("--integration-layers", "x")]:
        r = cpu_devices.run_module("benchmarks.fuse_cost", flag, value, xla_flags=None)
        assert r.returncode == 2, (flag, r.stdout, r.stderr)
        assert f"argument {flag}: '{value}': a whole number of at least 1" in r.stderr
