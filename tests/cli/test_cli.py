"""``python -m jax_fusedar demo`` on 8 virtual CPU devices, each run a subprocess: XLA reads the
device count only when JAX starts, and the CLI's own setup of XLA_FLAGS is tested too."""

import json
import re

import pytest

from jax_fusedar.common import native

from tests import cpu_devices

HOST_8 = cpu_devices.xla_flags(8)


def run_cli(*argv, xla_flags=HOST_8, **kw):
    """Runs the CLI on CPU; xla_flags=None leaves XLA_FLAGS unset for the CLI to decide."""
    return cpu_devices.run_module("jax_fusedar", *argv, xla_flags=xla_flags, **kw)


def refused(r, message):
    """``r`` exited 2 with ``message`` on stderr, no traceback and nothing on stdout."""
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and r.stdout == "", r.stdout + r.stderr


@pytest.mark.slow
def test_demo_llama_fused_by_fuse_matches_unfused():
    # The main job as ./dev demo runs it, trimmed: both layer modes, the tiny preset. Without
    # GPUs XLA_FLAGS stays unset, as for a user: the CLI splits the host into 8 devices itself
    # ("world size 8" below); with GPUs it would use them, so the test sets the flags.
    flags = None if native.gpu_count() == 0 else HOST_8
    r = run_cli(*"demo --steps 4 --prompt 8 --iters 1".split(), xla_flags=flags)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "world size 8" in out and "backend xla" in out
    assert "the model calls no jax_fusedar function" in out
    assert "== layers unrolled ==" in out and "== layers scan ==" in out
    # 2 layers x 2 all-reduces: 4 sites unrolled, 2 in the scan body run twice each.
    fused = "decode: jax_fusedar.fuse: fused {0} of {0} all-reduce + residual + RMSNorm site(s)"
    assert out.count(fused.format(4)) == 1
    assert fused.format(2) + " (4 fused calls per run, loops counted)" in out
    # The demo's own criterion, not identical tokens: rounding differs between CPUs (AVX-512
    # or not), so a near tie may break either way; the demo then prints the divergence and
    # its margins and passes only if the tie was near (checked by its PASS below).
    verdicts = re.findall(
        r"^greedy tokens: (identical over 4 steps x 2 sequences|first "
        r"divergence at step \d+, sequence \d+ \(unfused top-2 margin .*\))$",
        out,
        re.MULTILINE,
    )
    assert len(verdicts) == 2, out
    rows = re.findall(r"^(unfused|fused)\s+(\d+\.\d)\s+(\d+\.\d)$", out, re.MULTILINE)
    assert len(rows) == 4 and all(float(p) > 0 and float(d) > 0 for _, p, d in rows)
    # Virtual CPU devices time XLA on this CPU: labelled so, and no speedup row.
    assert out.count("timings (CPU): virtual devices sharing this host's cores") == 2, out
    assert not re.search(r"^speedup|\(speedup", out, re.M), out
    # A line of progress on stderr for each compile phase: 2 programs x 2 layer modes.
    for mode in ("unrolled", "scan"):
        for name in ("unfused", "fused"):
            assert re.search(
                rf"^jax_fusedar demo: compiling the {name} prefill and decode programs "
                rf"\(layers {mode}\) \.\.\. \d+\.\d s$",
                r.stderr,
                re.MULTILINE,
            ), r.stderr
    errs = re.findall(
        r"max logits error (\S+) \(relative to max \|logits\| (\S+): (\S+); "
        r"tolerance (\S+) ",
        out,
    )
    assert len(errs) == 2
    for abs_err, scale, rel, tol in errs:
        assert 0 <= float(rel) <= float(tol) and float(scale) > 0
    assert "PASS (unrolled)" in out and "PASS (scan)" in out


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv, xla_flags, world",
    [
        # --tp in one process, with the user's own XLA_FLAGS asking for 8 host devices: the
        # TP group is --tp ranks, not every device (before, 8 of 8 and PASS).
        (["--tp", 2], HOST_8, 2),
        (["--tp", 4], HOST_8, 4),
        # The user's XLA_FLAGS without a device count: the CLI adds the count (before,
        # "world size 1 is not supported").
        ([], cpu_devices.FAST_COMPILE_FLAG, 8),
        # A count in the user's XLA_FLAGS is the default TP size.
        ([], cpu_devices.xla_flags(4), 4),
        # Hugging Face's norm: gamma multiplied after the norm's rounding stays after the
        # fused norm (tests/jax/test_fuse.py).
        (["--norm", "hf"], HOST_8, 8),
    ],
    ids=["tp2", "tp4", "flags-without-count", "flags-count-4", "hf-norm"],
)
def test_demo_runs_at_the_tp_size_asked_for(argv, xla_flags, world):
    argv = ["demo", *argv, *"--layer-mode scan --steps 2 --prompt 4 --iters 1".split()]
    r = run_cli(*argv, xla_flags=xla_flags)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"tensor parallel over {world} devices" in r.stdout, r.stdout
    assert f"devices: {world} x cpu (platform cpu), world size {world}," in r.stdout, r.stdout
    assert "fused 2 of 2 all-reduce + residual + RMSNorm site(s)" in r.stdout
    assert re.search(r"^greedy tokens: (identical|first divergence)", r.stdout, re.MULTILINE)
    assert "PASS (scan)" in r.stdout


@pytest.mark.slow
def test_demo_bench_writes_json(tmp_path):
    out = tmp_path / "b"
    argv = "demo --bench --layer-mode scan --bench-batches 1,2 --bench-kv 16 --bench-prefill 8"
    r = run_cli(*argv.split(), *"--bench-steps 2 --iters 1 --out".split(), out)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((out / "bench_llama.json").read_text())
    assert report["machine"]["world_size"] == 8 and report["machine"]["backend"] == "xla"
    assert report["config"]["preset"] == "tiny" and report["config"]["workspace_max_tokens"] == 8
    cases = report["cases"]
    got = [(c["kind"], c["batch"], c.get("kv_length", c.get("tokens"))) for c in cases]
    assert got == [("decode", 1, 16), ("decode", 2, 16), ("prefill", 1, 8)]
    for c in cases:
        assert c["layers"] == "scan" and c["fused_sites"] == c["sites"] == 2
        assert c["speedup"] == pytest.approx(c["unfused_ms"] / c["fused_ms"])
        assert c["unfused_compile_s"] > 0 and c["fused_ms"] > 0
    assert "decode batch 1 speedup" in r.stdout and "NOTE: backend 'xla'" in r.stdout
    assert report["skipped"] == [] and report["total_s"] > 0


TRTLLM_CPU = "the 'trtllm' all-reduce backend needs a CUDA GPU"
KV_16 = "error: preset tiny: kv_heads 8 does not split over 16 tensor-parallel ranks"


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv, xla_flags, message",
    [
        # setups that cannot run
        (
            ["demo"],
            cpu_devices.xla_flags(3),
            "error: XLA_FLAGS sets --xla_force_host_platform_device_count=3, which the demo "
            "takes as its TP size on CPUs: world size 3 is not supported",
        ),
        (["demo", "--tp", 16], HOST_8, KV_16),
        (["demo"], cpu_devices.xla_flags(16), KV_16),
        (["demo", "--backend", "trtllm"], HOST_8, "error: " + TRTLLM_CPU),
        # bad flags
        (["demo", "--dtype", "int8"], HOST_8, "invalid choice: 'int8'"),
        (["demo", "--layers", "0"], HOST_8, "0 is not positive"),
        (["demo", "--bench-batches", "1,x"], HOST_8, "'x' is not an integer"),
        (["demo", "--preset", "llama2"], HOST_8, "invalid choice: 'llama2'"),
        (["demo", "--norm", "layer"], HOST_8, "invalid choice: 'layer'"),
        (["demo", "--bench-prefill-layers", "all"], HOST_8, "invalid choice: 'all'"),
        (["demo", "--steps", "-1"], HOST_8, "-1 is not positive"),
        ([], HOST_8, "required: {demo,doctor}"),
    ],
)
def test_bad_flags_and_unrunnable_setups_exit_with_a_message(argv, xla_flags, message):
    r = run_cli(*argv, xla_flags=xla_flags)
    assert r.returncode == 2
    assert message in r.stderr
    assert "error:" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_help_explains_the_subcommands():
    r = run_cli("--help")
    assert r.returncode == 0
    assert "demo" in r.stdout and "reference path" in r.stdout
    assert "python -m benchmarks.jax_bench" in r.stdout  # where the benchmarks are
    r = run_cli("demo", "--help")
    assert r.returncode == 0 and "--preset" in r.stdout and "--bench-batches" in r.stdout
