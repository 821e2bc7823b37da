"""Tests for ``python -m jax_fusedar {demo,bench}`` on 8 virtual CPU devices.

Every run is a subprocess: XLA reads the virtual device count only when JAX starts, and the
CLI's own setup of XLA_FLAGS is part of what is tested.
"""

import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import textwrap

import pytest

from jax_fusedar.common import native

from tests import cpu_devices
from tests.repo import REPO
from tests.skips import NO_NATIVE


HOST_8 = cpu_devices.xla_flags(8)


def run_cli(*argv, xla_flags=HOST_8, pythonpath=(), timeout=600):
    """Runs the CLI on CPU; xla_flags=None leaves XLA_FLAGS unset for the CLI to decide."""
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join(
            [*map(str, pythonpath), str(REPO), os.environ.get("PYTHONPATH", "")]
        ),
    )
    env.pop("XLA_FLAGS", None)
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    return subprocess.run(
        [sys.executable, "-m", "jax_fusedar", *map(str, argv)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# --- demo ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_demo_llama_fused_by_fuse_matches_unfused():
    # The main job as ./dev demo runs it, trimmed: both layer modes, the tiny preset. Without
    # GPUs XLA_FLAGS stays unset, as for a user: the CLI splits the host into 8 devices itself
    # ("world size 8" below); with GPUs it would use them, so the test sets the flags.
    r = run_cli(
        "demo",
        "--steps",
        4,
        "--prompt",
        8,
        "--iters",
        1,
        xla_flags=None if native.gpu_count() == 0 else HOST_8,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "world size 8" in out and "backend xla" in out
    assert "the model calls no jax_fusedar function" in out
    assert "== layers unrolled ==" in out and "== layers scan ==" in out
    # 2 layers x 2 all-reduces: 4 sites unrolled, 2 in the scan body run twice each.
    assert (
        out.count("decode: jax_fusedar.fuse: fused 4 of 4 all-reduce + residual + RMSNorm site(s)")
        == 1
    )
    assert (
        "decode: jax_fusedar.fuse: fused 2 of 2 all-reduce + residual + RMSNorm site(s) "
        "(4 fused calls per run, loops counted)" in out
    )
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
    ],
    ids=["tp2", "tp4", "flags-without-count", "flags-count-4"],
)
def test_demo_runs_at_the_tp_size_asked_for(argv, xla_flags, world):
    r = run_cli(
        "demo",
        *argv,
        "--layer-mode",
        "scan",
        "--steps",
        2,
        "--prompt",
        4,
        "--iters",
        1,
        xla_flags=xla_flags,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"tensor parallel over {world} devices" in r.stdout, r.stdout
    assert f"devices: {world} x cpu (platform cpu), world size {world}," in r.stdout, r.stdout
    assert "PASS (scan)" in r.stdout


@pytest.mark.slow
def test_demo_hf_norm_is_fused_exactly():
    # gamma multiplied after the norm's rounding stays after the fused norm
    # (tests/jax/test_fuse.py)
    r = run_cli(
        "demo", "--layer-mode", "scan", "--norm", "hf", "--steps", 2, "--prompt", 4, "--iters", 1
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "fused 2 of 2 all-reduce + residual + RMSNorm site(s)" in r.stdout
    assert re.search(r"^greedy tokens: (identical|first divergence)", r.stdout, re.MULTILINE)
    assert "PASS (scan)" in r.stdout


@pytest.mark.slow
def test_demo_bench_writes_json(tmp_path):
    out = tmp_path / "b"
    r = run_cli(
        "demo",
        "--bench",
        "--layer-mode",
        "scan",
        "--bench-batches",
        "1,2",
        "--bench-kv",
        16,
        "--bench-prefill",
        8,
        "--bench-steps",
        2,
        "--iters",
        1,
        "--out",
        out,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((out / "bench_llama.json").read_text())
    assert report["machine"]["world_size"] == 8 and report["machine"]["backend"] == "xla"
    assert report["config"]["preset"] == "tiny" and report["config"]["workspace_max_tokens"] == 8
    cases = report["cases"]
    assert [(c["kind"], c["batch"], c.get("kv_length", c.get("tokens"))) for c in cases] == [
        ("decode", 1, 16),
        ("decode", 2, 16),
        ("prefill", 1, 8),
    ]
    for c in cases:
        assert c["layers"] == "scan" and c["fused_sites"] == c["sites"] == 2
        assert c["speedup"] == pytest.approx(c["unfused_ms"] / c["fused_ms"])
        assert c["unfused_compile_s"] > 0 and c["fused_ms"] > 0
    assert "decode batch 1 speedup" in r.stdout and "NOTE: backend 'xla'" in r.stdout
    assert report["skipped"] == [] and report["total_s"] > 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv, xla_flags, message",
    [
        (
            ["demo"],
            cpu_devices.xla_flags(3),
            "XLA_FLAGS sets --xla_force_host_platform_device_count=3, which the demo takes "
            "as its TP size on CPUs: world size 3 is not supported",
        ),
        (
            ["demo", "--tp", 16],
            HOST_8,
            "preset tiny: kv_heads 8 does not split over 16 tensor-parallel ranks",
        ),
        (["bench", "--hidden", 64], cpu_devices.xla_flags(1), "world size 1 is not supported"),
        (
            ["demo"],
            cpu_devices.xla_flags(16),
            "preset tiny: kv_heads 8 does not split over 16 tensor-parallel ranks",
        ),
        (
            ["demo", "--backend", "trtllm"],
            HOST_8,
            "the 'trtllm' all-reduce backend needs a CUDA GPU",
        ),
        (
            ["bench", "--hidden", 64, "--patterns", "1,7"],
            HOST_8,
            "argument --patterns: the bench times patterns 1, 4, 9, 11: 7 "
            "(kMoEFinalizeARResidualRMSNorm) is a fusion pattern the bench does not time",
        ),
        (
            ["bench", "--hidden", "128,64", "--patterns", "1,9"],
            HOST_8,
            "pattern 9 quantizes groups of 128: --hidden 64 is not a multiple of 128",
        ),
        (
            ["bench", "--hidden", 128, "--method", "device"],
            HOST_8,
            "--method device needs GPUs and the native module",
        ),
        (
            ["bench", "--hidden", 64, "--method", "loop", "--patterns", "1,4"],
            HOST_8,
            "--method loop times pattern 1 only",
        ),
    ],
)
def test_unrunnable_setups_exit_with_a_message(argv, xla_flags, message):
    r = run_cli(*argv, xla_flags=xla_flags)
    assert r.returncode == 2
    assert f"error: {message}" in r.stderr
    assert "Traceback" not in r.stderr


# --- bench ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_bench_writes_json_and_plot(tmp_path):
    out = tmp_path / "bench"
    r = run_cli(
        "bench",
        "--tokens",
        "1,16",
        "--hidden",
        256,
        "--chain",
        3,
        "--repeats",
        2,
        "--patterns",
        "1,4",
        "--modes",
        "auto,oneshot,twoshot",
        "--out",
        out,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "NOT the FlashInfer kernel" in r.stdout

    report = json.loads((out / "bench.json").read_text())
    machine = report["machine"]
    assert machine["device_count"] == machine["world_size"] == 8
    assert machine["backend"] == "xla" and machine["platform"] == "cpu"
    assert {"jax_version", "jaxlib_version", "device_kind"} <= set(machine)
    config = report["config"]
    assert config["dtype"] == "bfloat16" and config["method"] == "chain"
    assert (config["chain"], config["repeats"], config["patterns"]) == (3, 2, [1, 4])
    assert config["modes"] == ["auto", "oneshot", "twoshot"]
    assert (config["max_token_num"], config["hidden_dim"]) == (16, 256)
    assert report["reference_path"] is True

    cases = {(c["pattern"], c["tokens"], c["hidden"]): c for c in report["cases"]}
    assert set(cases) == {(p, t, 256) for p in (1, 4) for t in (1, 16)}
    for case in cases.values():
        # Per-call time = median over 2 repeats of (wall time of a 3-call program) / 3.
        for detail, us in [(case["baseline_detail"], case["baseline_us"])] + [
            (m["detail"], m["us"]) for m in case["fused"].values()
        ]:
            assert len(detail["us_repeats"]) == 2 and min(detail["us_repeats"]) > 0
            assert us == pytest.approx(statistics.median(detail["us_repeats"]))
        assert set(case["fused"]) | set(case["skipped"]) == {"auto", "oneshot", "twoshot"}
        for mode, m in case["fused"].items():
            assert m["ratio"] == pytest.approx(m["us"] / case["baseline_us"])
            assert m["chosen"] == mode if mode != "auto" else m["chosen"] in ("oneshot", "twoshot")
    assert "static FP8" in cases[(4, 1, 256)]["baseline"]
    # Two-shot needs more tokens than the 8 ranks: skipped with the reason for 1 token only.
    for p in (1, 4):
        assert set(cases[(p, 1, 256)]["skipped"]) == {"twoshot"}
        assert "more tokens than ranks" in cases[(p, 1, 256)]["skipped"]["twoshot"]
        assert cases[(p, 16, 256)]["skipped"] == {}
        assert cases[(p, 1, 256)]["fused"]["auto"]["chosen"] == "oneshot"

    # The table: one row per measured mode, the skipped ones as notes.
    assert len(re.findall(r"^\s+[14]\s+(1|16)\s+256\s+", r.stdout, re.MULTILINE)) == 10
    assert "skipped pattern 1 1 x 256 twoshot" in r.stdout

    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "bench.png").stat().st_size > 0


@pytest.mark.slow
def test_bench_loop_method(tmp_path):
    out = tmp_path / "bench"
    r = run_cli(
        "bench",
        "--tokens",
        16,
        "--hidden",
        64,
        "--method",
        "loop",
        "--iters",
        3,
        "--repeats",
        1,
        "--patterns",
        1,
        "--out",
        out,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((out / "bench.json").read_text())
    assert report["config"]["method"] == "loop" and "fori_loop" in report["method"]
    assert report["cases"][0]["fused"]["auto"]["us"] > 0
    assert len(report["cases"][0]["fused"]["auto"]["detail"]["us_repeats"]) == 1


@pytest.mark.slow
def test_bench_without_matplotlib_and_tqdm(tmp_path):
    # Packages that fail to import shadow the real ones, if installed.
    blocker = tmp_path / "blocked"
    for name in ("matplotlib", "tqdm"):
        (blocker / name).mkdir(parents=True)
        (blocker / name / "__init__.py").write_text(f"raise ImportError('{name} blocked')\n")
    out = tmp_path / "bench"
    r = run_cli(
        "bench",
        "--tokens",
        4,
        "--hidden",
        64,
        "--chain",
        2,
        "--repeats",
        1,
        "--patterns",
        1,
        "--modes",
        "auto",
        "--out",
        out,
        pythonpath=[blocker],
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "matplotlib is not installed" in r.stdout
    assert not (out / "bench.png").exists()
    assert json.loads((out / "bench.json").read_text())["cases"][0]["fused"]["auto"]["us"] > 0
    assert "2/2" in r.stderr  # the fallback progress bar: baseline + auto


def _compiled_hlo(body_expr: str) -> str:
    """Compiled CPU HLO of a bench program (8 virtual devices, bf16 16 x 128 inputs)."""
    script = textwrap.dedent(f"""
        import jax, jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec as P
        from jax_fusedar.cli import bench as bench
        from jax_fusedar.cli import setup
        mesh = setup.tp_mesh()
        prog = jax.jit(jax.shard_map({body_expr}, mesh=mesh,
                                     in_specs=(P("tp"), P(), P(), P()), out_specs=P()))
        x = jax.device_put(jnp.ones((8, 16, 128), jnp.bfloat16), NamedSharding(mesh, P("tp")))
        print(prog.lower(x, jnp.ones((16, 128), jnp.bfloat16), jnp.ones((128,), jnp.bfloat16),
                         jnp.ones((1,), jnp.float32)).compile().as_text())
    """)
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=HOST_8,
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    )
    r = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.slow
def test_bench_loop_keeps_the_all_reduce_inside_the_loop():
    # Without the optimization barrier XLA hoists the baseline's psum(x) out of the
    # fori_loop and the baseline would time one all-reduce for all iterations.
    hlo = _compiled_hlo("bench.looped(bench.baseline_combine(1), 4)")
    assert "all-reduce" in hlo
    assert "all-reduce" not in hlo[hlo.index("ENTRY") :]  # ENTRY is last: only in the body


@pytest.mark.slow
@pytest.mark.parametrize("pattern", [1, 4, 11, 9])
def test_bench_chain_keeps_every_baseline_call(pattern):
    # Each call's input is the previous norm output, so XLA can neither combine the baseline's
    # all-reduces nor drop a call's quantization: 5 calls, 5 all-reduces, 5 FP8 conversions.
    hlo = _compiled_hlo(f"bench.chained(bench.baseline_combine({pattern}), 5)")
    assert len(re.findall(r"= \S+ all-reduce\(", hlo)) == 5, hlo
    if pattern != 1:
        root = hlo[hlo.index("ENTRY") :]
        assert len(re.findall(r"f8e4m3fn\[16,128\]", root.split("ROOT", 1)[1])) == 5


@pytest.mark.slow
def test_bench_device_method_brackets_the_chain_with_device_stamps():
    # Lowered for CUDA on this CPU machine: one stamp before the first call (its x aliased
    # through), one after the last norm; the calls in between untouched.
    script = textwrap.dedent("""
        import jax, jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec as P
        from jax_fusedar.cli import bench as bench
        from jax_fusedar.cli import setup
        mesh = setup.tp_mesh()
        body = bench.stamped(bench.chained(bench.baseline_combine(4), 3))
        prog = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(), P(), P()),
                                     out_specs=(P("tp"), P("tp"), P(), P(), P())))
        x = jax.ShapeDtypeStruct((8, 16, 128), jnp.bfloat16,
                                 sharding=NamedSharding(mesh, P("tp")))
        args = (x, jax.ShapeDtypeStruct((16, 128), jnp.bfloat16),
                jax.ShapeDtypeStruct((128,), jnp.bfloat16),
                jax.ShapeDtypeStruct((1,), jnp.float32))
        print(prog.trace(*args).lower(lowering_platforms=("cuda",)).as_text())
    """)
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=HOST_8,
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    )
    r = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    if r.returncode and "native" in r.stderr:
        pytest.skip(NO_NATIVE)
    assert r.returncode == 0, r.stderr
    stamps = [
        line
        for line in r.stdout.splitlines()
        if "custom_call @jax_fusedar_device_timestamp_v1" in line
    ]
    assert len(stamps) == 2, r.stdout
    assert all("output_operand_aliases" in line for line in stamps)
    assert len(re.findall(r"all_reduce", r.stdout)) >= 3


# --- flags ---------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--dtype", "int8"], "invalid choice: 'int8'"),
        (["demo", "--layers", "0"], "0 is not positive"),
        (["demo", "--bench-batches", "1,x"], "'x' is not an integer"),
        (["demo", "--preset", "llama2"], "invalid choice: 'llama2'"),
        (["demo", "--norm", "layer"], "invalid choice: 'layer'"),
        (["demo", "--bench-prefill-layers", "all"], "invalid choice: 'all'"),
        (["demo", "--steps", "-1"], "-1 is not positive"),
        (["bench", "--hidden", "256,100"], "--hidden 100 is not a multiple of 8"),
        (["bench", "--tokens", "1,x"], "'x' is not an integer"),
        (["bench", "--modes", "auto,fast"], "subset of auto,oneshot,twoshot"),
        (["bench", "--method", "fast"], "invalid choice: 'fast'"),
        ([], "required: {demo,bench,doctor}"),
    ],
)
def test_bad_flags_exit_with_a_message(argv, message):
    r = run_cli(*argv)
    assert r.returncode == 2
    assert message in r.stderr
    assert "error:" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_help_explains_the_subcommands():
    r = run_cli("--help")
    assert r.returncode == 0
    assert "demo" in r.stdout and "bench" in r.stdout and "reference path" in r.stdout
    r = run_cli("bench", "--help")
    assert r.returncode == 0 and "--tokens" in r.stdout and "--hidden" in r.stdout
    r = run_cli("demo", "--help")
    assert r.returncode == 0 and "--preset" in r.stdout and "--bench-batches" in r.stdout
