"""``python -m jax_fusedar demo --moe`` on 8 virtual CPU devices (the reference lowering):
the MoE decoder's greedy tokens agree between the plain model and the fused op."""

import re

import pytest

from tests.cli.test_cli import run_cli


@pytest.mark.slow
def test_moe_demo_passes_on_cpu():
    run = run_cli(*"demo --moe --layers 1 --prompt 4 --steps 3 --iters 1".split())
    assert run.returncode == 0, run.stdout + run.stderr
    # Identical tokens, or a divergence the demo accepts only at a near tie (its PASS):
    # rounding differs between CPUs, so a near tie may break either way.
    assert re.search(r"^greedy tokens: (identical|first divergence)", run.stdout, re.MULTILINE)
    assert run.stdout.rstrip().endswith("PASS")
    # CPU timings are labelled, with no speedup; each compile phase has its line on stderr.
    assert "timings (CPU): virtual devices sharing this host's cores" in run.stdout
    assert not re.search(r"^speedup|\(speedup", run.stdout, re.M)
    for label in ("plain", "fused"):
        line = f"jax_fusedar demo: compiling the {label} prefill and decode programs ..."
        assert line in run.stderr, run.stderr
