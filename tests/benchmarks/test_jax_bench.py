"""``python -m benchmarks.jax_bench`` on 8 virtual CPU devices, each run a subprocess from the
repository root as a user runs it: the report (median, p10, p90, count), the timing methods'
programs, the refusals, the baseline's FP8 quantization, the plot, the wait-timeout run."""

import importlib.util
import json
import math
import os
import re
import textwrap

import numpy as np
import pytest

from benchmarks import jax_bench as bench
from benchmarks import report
from jax_fusedar.common import sizing

from tests import cpu_devices
from tests.repo import run_code
from tests.skips import NO_NATIVE

HOST_8 = cpu_devices.xla_flags(8)


def run_bench(*argv, xla_flags=HOST_8, **kw):
    """Runs the JAX benchmark on CPU; xla_flags=None leaves XLA_FLAGS unset for the bench."""
    return cpu_devices.run_module("benchmarks.jax_bench", *argv, xla_flags=xla_flags, **kw)


def run_to_report(out, *argv, **kw):
    """A bench run that succeeds, writing into ``out``: the process and its bench.json."""
    r = run_bench(*argv, "--out", out, **kw)
    assert r.returncode == 0, r.stdout + r.stderr
    return r, json.loads((out / "bench.json").read_text())


def run_small(tmp_path, *argv, **kw):
    """A run of one pattern on small sizes (``argv`` adds the rest) into tmp_path/bench."""
    return run_to_report(tmp_path / "bench", "--repeats", 1, "--patterns", 1, *argv, **kw)


# --- a run and its report ------------------------------------------------------------------------


@pytest.mark.slow
def test_bench_writes_json_and_plot(tmp_path):
    out = tmp_path / "bench"
    r, rep = run_to_report(
        out,
        *"--tokens 1,16 --hidden 256 --chain 3 --repeats 4 --patterns 1,4".split(),
        *"--modes auto,oneshot,twoshot".split(),
        xla_flags=None,  # the bench splits the host into 8 devices itself
    )
    assert "NOT the FlashInfer kernel" in r.stdout

    machine = rep["machine"]
    assert machine["device_count"] == machine["world_size"] == 8
    assert machine["backend"] == "xla" and machine["platform"] == "cpu"
    assert {"jax_version", "jaxlib_version", "device_kind"} <= set(machine)
    config = rep["config"]
    assert config["dtype"] == "bfloat16" and config["method"] == "chain"
    assert (config["chain"], config["repeats"], config["patterns"]) == (3, 4, [1, 4])
    assert config["modes"] == ["auto", "oneshot", "twoshot"]
    assert (config["max_token_num"], config["hidden_dim"]) == (16, 256)
    assert rep["reference_path"] is True
    assert rep["large_message_from"] == {"256": None}  # world 8: never

    cases = {(c["pattern"], c["tokens"], c["hidden"]): c for c in rep["cases"]}
    assert set(cases) == {(p, t, 256) for p in (1, 4) for t in (1, 16)}
    for case in cases.values():
        # Each sample: (wall time of a 3-call program) / 3; the summary is of the samples.
        for detail, samples, us in [
            (case["baseline_detail"], case["baseline_samples_us"], case["baseline_us"])
        ] + [(m["detail"], m["samples_us"], m["us"]) for m in case["fused"].values()]:
            assert len(samples) == 4 and min(samples) > 0 and detail["calls"] == 3
            assert samples == pytest.approx([t / 3 * 1e6 for t in detail["wall_s"]])
            assert us == report.summary(samples)
            assert us["p10"] <= us["median"] <= us["p90"] and us["n"] == 4
        assert set(case["fused"]) | set(case["skipped"]) == {"auto", "oneshot", "twoshot"}
        for mode, m in case["fused"].items():
            assert m["ratio"] == pytest.approx(m["us"]["median"] / case["baseline_us"]["median"])
            assert m["chosen"] == mode if mode != "auto" else m["chosen"] in ("oneshot", "twoshot")
    assert "static FP8" in cases[(4, 1, 256)]["baseline"]
    # Two-shot needs more tokens than the 8 ranks: skipped with the reason for 1 token only.
    for p in (1, 4):
        assert set(cases[(p, 1, 256)]["skipped"]) == {"twoshot"}
        assert "more tokens than ranks" in cases[(p, 1, 256)]["skipped"]["twoshot"]
        assert cases[(p, 16, 256)]["skipped"] == {}
        assert cases[(p, 1, 256)]["fused"]["auto"]["chosen"] == "oneshot"

    # The table: one row per measured mode, median [p10, p90] of both columns and n; the
    # skipped ones as notes.
    number = r"\d+\.\d\d"
    spread = rf"{number} \[{number}, {number}\]"
    rows = re.findall(
        rf"^\s+[14]\s+(1|16)\s+256\s+\S+( \(\w+\))?\s+{spread}\s+{spread}\s+4\s+{number}\d$",
        r.stdout,
        re.MULTILINE,
    )
    assert len(rows) == 10, r.stdout
    assert "skipped pattern 1 1 x 256 twoshot" in r.stdout

    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "bench.png").stat().st_size > 0


@pytest.mark.slow
def test_bench_loop_method(tmp_path):
    _, rep = run_small(tmp_path, *"--tokens 16 --hidden 64 --method loop --iters 3".split())
    assert rep["config"]["method"] == "loop" and "fori_loop" in rep["method"]
    fused = rep["cases"][0]["fused"]["auto"]
    assert fused["us"]["median"] > 0 and fused["us"]["n"] == 1
    assert len(fused["detail"]["wall_s"]) == 1 and fused["detail"]["calls"] == 3


@pytest.mark.slow
def test_bench_without_matplotlib_and_tqdm(tmp_path):
    # Packages that fail to import shadow the real ones, if installed.
    blocker = tmp_path / "blocked"
    for name in ("matplotlib", "tqdm"):
        (blocker / name).mkdir(parents=True)
        (blocker / name / "__init__.py").write_text(f"raise ImportError('{name} blocked')\n")
    argv = "--tokens 4 --hidden 64 --chain 2 --modes auto".split()
    r, rep = run_small(tmp_path, *argv, pythonpath=[blocker])
    assert "matplotlib is not installed" in r.stdout
    assert not (tmp_path / "bench" / "bench.png").exists()
    assert rep["cases"][0]["fused"]["auto"]["us"]["median"] > 0
    assert "2/2" in r.stderr  # the fallback progress bar: baseline + auto


@pytest.mark.slow
def test_bench_times_the_wait_timeout_on_and_off_in_one_run(tmp_path):
    """--timeout-compare on CPU (no kernel): both figures per fused case and the on/off
    table; the GPU figures come from the same command on a machine with GPUs."""
    argv = "--tokens 1,16 --hidden 256 --chain 2 --timeout-compare".split()
    r, rep = run_small(tmp_path, *argv)
    assert rep["config"]["timeout_compare"] is True
    for case in rep["cases"]:
        m = case["fused"]["auto"]
        assert m["timeout_s"] == 30.0 and m["no_timeout_us"] > 0 and m["timeout_on_us"] > 0
        assert m["timeout_ratio"] == pytest.approx(m["timeout_on_us"] / m["no_timeout_us"])
        assert isinstance(m["timeout_within_budget"], bool)
    assert "wait timeout on vs off" in r.stdout
    row = r"^\s+1\s+(1|16)\s+256\s+auto \(\w+\)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+(yes|NO)$"
    assert len(re.findall(row, r.stdout, re.MULTILINE)) == 2, r.stdout


def test_timeout_budget():
    ok = bench.timeout_compare(10.05, 10.0, 30.0)  # 0.5%: within 1%
    assert ok["timeout_within_budget"] and ok["timeout_ratio"] == pytest.approx(1.005)
    assert ok["no_timeout_us"] == 10.0 and ok["timeout_on_us"] == 10.05
    assert ok["timeout_s"] == 30.0
    assert bench.timeout_compare(5.09, 5.0, 30.0)["timeout_within_budget"]  # 0.09 us < 0.1
    assert not bench.timeout_compare(5.2, 5.0, 30.0)["timeout_within_budget"]  # 4%, 0.2 us
    assert not bench.timeout_compare(102.0, 100.0, 30.0)["timeout_within_budget"]  # 2%
    assert math.isnan(bench.timeout_compare(1.0, 0.0, 30.0)["timeout_ratio"])


# --- statistics, plan, plot ----------------------------------------------------------------------


def test_summary_is_median_p10_p90_and_count():
    s = report.summary([float(v) for v in range(11, 0, -1)])  # 1..11, in any order
    assert s == {"median": 6.0, "p10": 2.0, "p90": 10.0, "n": 11}
    assert report.summary([3.0]) == {"median": 3.0, "p10": 3.0, "p90": 3.0, "n": 1}
    assert report.spread(s) == "6.00 [2.00, 10.00]"
    with pytest.raises(ValueError, match="no samples"):
        report.summary([])


def test_what_each_mode_runs_is_the_ops_plan():
    sizes = sizing.workspace_sizes(2, 16384, 8192, "bfloat16")
    assert bench.plan_mode(1, 8192, sizes, "bfloat16", "auto") == ("oneshot", None)
    assert bench.plan_mode(8192, 8192, sizes, "bfloat16", "auto") == ("large", None)
    assert bench.plan_mode(8192, 8192, sizes, "bfloat16", "oneshot") == ("oneshot", None)
    algorithm, why = bench.plan_mode(1, 8192, sizes, "bfloat16", "twoshot")
    assert algorithm is None and "more tokens than ranks" in why
    # The large-message path from 48 MiB per rank at world 2 (3072 rows of 8192 bf16), as the
    # plan decides it; never at world 8 or in float32.
    assert bench.large_message_crossover(8192, sizes, "bfloat16") == 3072
    assert bench.large_message_crossover(4096, sizes, "bfloat16") == 6144
    big8 = sizing.workspace_sizes(8, 16384, 8192, "bfloat16")
    assert bench.large_message_crossover(8192, big8, "bfloat16") is None
    f32 = sizing.workspace_sizes(2, 16384, 8192, "float32")
    assert bench.large_message_crossover(8192, f32, "float32") is None


def _report_for_plot():
    def case(pattern, tokens, hidden):
        us = report.summary([10.0 + tokens, 11.0 + tokens])
        fused = {"chosen": "oneshot", "us": us, "ratio": 0.5}
        return {
            "pattern": pattern, "tokens": tokens, "hidden": hidden,
            "baseline_us": report.summary([20.0 + tokens]), "fused": {"auto": fused},
            "skipped": {},
        }  # fmt: skip

    return {
        "machine": {"device_count": 2, "device_kind": "fake", "backend": "trtllm"},
        "config": {"patterns": [1, 4], "hidden": [4096, 8192], "modes": ["auto"],
                   "dtype": "bfloat16", "method": "device"},
        "large_message_from": {"4096": 6144, "8192": None},
        "cases": [case(p, t, h) for p in (1, 4) for h in (4096, 8192) for t in (1, 16)],
    }  # fmt: skip


def test_the_plot_pairs_fused_and_baseline_by_colour(monkeypatch, tmp_path):
    if report.pyplot() is None:
        pytest.skip("matplotlib is not installed")
    figures = []
    monkeypatch.setattr(report, "save_figure", lambda plt, fig, path: figures.append(fig))
    assert bench.plot(_report_for_plot(), tmp_path / "bench.png")
    (fig,) = figures
    axes = fig.axes[:2]  # one panel per pattern
    assert [ax.get_title().split(":")[0] for ax in axes] == ["pattern 1", "pattern 4"]
    for ax in axes:
        lines = {line.get_label(): line for line in ax.get_lines()}
        colours = set()
        for hidden in (4096, 8192):
            fused, base = lines[f"fused (auto), hidden {hidden}"], lines[f"XLA, hidden {hidden}"]
            assert fused.get_color() == base.get_color()  # one colour per size
            assert (fused.get_linestyle(), base.get_linestyle()) == ("-", "--")
            colours.add(fused.get_color())
        assert len(colours) == 2  # and the sizes apart
        cross = lines["auto: large-message from 6144 tokens (hidden 4096)"]
        assert cross.get_color() == lines["XLA, hidden 4096"].get_color()


# --- the baseline computes what the fused op writes ----------------------------------------------


@pytest.mark.parametrize("pattern", [4, 11, 9])
def test_the_baselines_quantization_writes_the_ops_outputs(pattern):
    """The XLA twin's FP8 quantization gives the fused op's documented outputs
    (quant_reference), so both columns time the same outputs: the same bytes where the
    roundings are the baseline's own (static FP8 multiplies by the reciprocal as the kernel
    does; group scales are powers of two). XLA may turn the dynamic scale's division into a
    product with the reciprocal: there one float32 ulp for the scales, one e4m3 step for the
    codes."""
    import jax.numpy as jnp

    from jax_fusedar.ops import quant_reference

    rng = np.random.default_rng(7)
    y = jnp.asarray(rng.standard_normal((13, 512)).astype(np.float32) * 3, jnp.bfloat16)
    scale = jnp.asarray([1.0 / 32.0], jnp.float32)
    ours = bench.quantize(y, pattern, scale)
    q, s = quant_reference.quantize_for_pattern(
        y, pattern, scale_factor=scale, group_size=bench.GROUP_SIZE
    )
    want = tuple(v for v in (q, s) if v is not None)
    assert [(a.shape, a.dtype) for a in ours] == [(b.shape, b.dtype) for b in want]
    codes = [np.asarray(a).view(np.uint8).astype(int) for a in (ours[0], want[0])]
    if pattern == 11:
        np.testing.assert_allclose(np.asarray(ours[1]), np.asarray(want[1]), rtol=2**-23)
        assert np.abs(codes[0] - codes[1]).max() <= 1  # one code: one step of the same sign
    else:
        np.testing.assert_array_equal(codes[0], codes[1])
        if pattern == 9:
            np.testing.assert_array_equal(np.asarray(ours[1]), np.asarray(want[1]))
    assert bench.quantize(y, 1, scale) == ()


# --- what a program runs -------------------------------------------------------------------------


def _program_text(body_expr: str, *, compiled: bool) -> str:
    """A bench program on 8 virtual devices (bf16 16 x 128 inputs): its compiled CPU HLO, or
    its lowering for CUDA (``compiled=False``)."""
    script = textwrap.dedent(f"""
        import jax, jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec as P
        from benchmarks import jax_bench as bench
        mesh = jax.make_mesh((8,), ("tp",))
        body = {body_expr}
        outs = P() if {compiled} else (P("tp"), P("tp"), P(), P(), P())
        prog = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(), P(), P()),
                                     out_specs=outs))
        x = jax.ShapeDtypeStruct((8, 16, 128), jnp.bfloat16,
                                 sharding=NamedSharding(mesh, P("tp")))
        args = (x, jax.ShapeDtypeStruct((16, 128), jnp.bfloat16),
                jax.ShapeDtypeStruct((128,), jnp.bfloat16),
                jax.ShapeDtypeStruct((1,), jnp.float32))
        traced = prog.trace(*args)
        print(traced.lower().compile().as_text() if {compiled}
              else traced.lower(lowering_platforms=("cuda",)).as_text())
    """)
    r = run_code(script, JAX_PLATFORMS="cpu", XLA_FLAGS=HOST_8)
    if r.returncode and not compiled and "native" in r.stderr:
        pytest.skip(NO_NATIVE)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.slow
def test_the_loop_keeps_the_all_reduce_inside_the_loop():
    # Without the optimization barrier XLA hoists the baseline's psum(x) out of the
    # fori_loop and the baseline would time one all-reduce for all iterations.
    hlo = _program_text("bench.looped(bench.baseline_combine(1), 4)", compiled=True)
    assert "all-reduce" in hlo
    assert "all-reduce" not in hlo[hlo.index("ENTRY") :]  # ENTRY is last: only in the body


@pytest.mark.slow
@pytest.mark.parametrize("pattern", [1, 4, 11, 9])
def test_the_chain_keeps_every_baseline_call(pattern):
    # Each call's input is the previous norm output, so XLA can neither combine the baseline's
    # all-reduces nor drop a call's quantization: 5 calls, 5 all-reduces, 5 FP8 conversions.
    hlo = _program_text(f"bench.chained(bench.baseline_combine({pattern}), 5)", compiled=True)
    assert len(re.findall(r"= \S+ all-reduce\(", hlo)) == 5, hlo
    if pattern != 1:
        root = hlo[hlo.index("ENTRY") :]
        assert len(re.findall(r"f8e4m3fn\[16,128\]", root.split("ROOT", 1)[1])) == 5


@pytest.mark.slow
def test_the_device_method_brackets_the_chain_with_device_stamps():
    # Lowered for CUDA on this CPU machine: one stamp before the first call (its x aliased
    # through), one after the last norm; the calls in between untouched.
    text = _program_text(
        "bench.stamped(bench.chained(bench.baseline_combine(4), 3))", compiled=False
    )
    stamps = [
        ln for ln in text.splitlines() if "custom_call @jax_fusedar_device_timestamp_v1" in ln
    ]
    assert len(stamps) == 2, text
    assert all("output_operand_aliases" in line for line in stamps)
    assert len(re.findall(r"all_reduce", text)) >= 3


# --- refusals ------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv, xla_flags, message",
    [
        (["--hidden", 64, "--patterns", 1], cpu_devices.xla_flags(1), "world size 1 is not"),
        (
            ["--hidden", 64, "--patterns", "1,7"],
            HOST_8,
            "argument --patterns: the bench times patterns 1, 4, 9, 11: 7 "
            "(kMoEFinalizeARResidualRMSNorm) is a fusion pattern the bench does not time",
        ),
        (
            ["--hidden", "128,64", "--patterns", "1,9"],
            HOST_8,
            "pattern 9 quantizes groups of 128: --hidden 64 is not a multiple of 128",
        ),
        (["--hidden", 128, "--method", "device"], HOST_8, "--method device needs GPUs"),
        (
            ["--hidden", 64, "--method", "loop", "--patterns", "1,4"],
            HOST_8,
            "--method loop times pattern 1 only",
        ),
        (["--hidden", "256,100"], HOST_8, "--hidden 100 is not a multiple of 8"),
        (["--hidden", 8200, "--patterns", 1], HOST_8, "hidden_dim=8200 cannot be launched"),
    ],
)
def test_unrunnable_setups_exit_with_a_message(argv, xla_flags, message, tmp_path):
    r = run_bench(*argv, "--out", tmp_path, xla_flags=xla_flags)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"error: {message}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tokens", "1.5"], "argument --tokens: '1.5' is not an integer"),
        (["--tokens", "1,x"], "'x' is not an integer"),
        (["--hidden", "4k"], "argument --hidden"),
        (["--chain", "2.0"], "argument --chain"),
        (["--iters", "true"], "argument --iters"),
        (["--repeats", "-1"], "argument --repeats: -1 is not positive"),
        (["--modes", "auto,fast"], "subset of auto,oneshot,twoshot"),
        (["--dtype", "fp8"], "argument --dtype: invalid choice"),
        (["--method", "fast"], "argument --method: invalid choice: 'fast'"),
        (["--backend", "nccl"], "argument --backend"),
        (["--patterns", "1.0"], "argument --patterns: '1.0' is not an integer"),
        (
            ["--patterns", "0"],
            "argument --patterns: the bench times patterns 1, 4, 9, 11: "
            "0 (kAllReduce) is a fusion pattern the bench does not time",
        ),
        (
            ["--patterns", "1,2,12"],
            "2 (kARResidualRMSNormFP8Quant) is a fusion pattern the "
            "bench does not time; 12 is not a fusion pattern",
        ),
    ],
)
def test_bad_flags_are_refused_before_anything_runs(capsys, tmp_path, argv, message):
    with pytest.raises(SystemExit) as e:
        bench.parse_args([*argv, "--out", str(tmp_path)])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_the_patterns_parse_sorted(tmp_path):
    args = bench.parse_args(["--patterns", "11,1", "--out", str(tmp_path)])
    assert args.patterns == [1, 11] and set(args.patterns) <= set(bench.PATTERN_LABELS)


def _out_refused(capsys, out):
    """What parse_args says as it exits on ``--out out``."""
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", str(out)])
    return capsys.readouterr().err


@pytest.mark.parametrize("name", bench.OUT_FILES)
def test_out_whose_result_file_is_a_folder(capsys, tmp_path, name):
    """Checked before the first case: the bench would otherwise time every case and then
    lose the results to IsADirectoryError."""
    (tmp_path / name).mkdir()
    message = f"{tmp_path / name} is a folder, so {name} cannot be written there"
    assert message in _out_refused(capsys, tmp_path)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda t: (t / "f").write_text("x") and t / "f", "exists and is not a folder"),
        (lambda t: "/proc/forbidden", "cannot create the folder /proc/forbidden"),
    ],
)
def test_out_that_cannot_hold_the_results(capsys, tmp_path, make, message):
    assert message in _out_refused(capsys, make(tmp_path))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in read-only folders")
def test_out_that_is_not_writable(capsys, tmp_path):
    tmp_path.chmod(0o500)
    try:
        assert f"cannot write in the folder {tmp_path}" in _out_refused(capsys, tmp_path)
    finally:
        tmp_path.chmod(0o700)


def test_a_fresh_out_folder_is_made_and_left_empty(tmp_path):
    out = tmp_path / "a" / "b"
    assert report.check_out_dir(out, bench.OUT_FILES) is None and out.is_dir()
    assert list(out.iterdir()) == []  # the write probe leaves nothing behind


@pytest.mark.slow
def test_help_runs_without_jax_starting():
    r = run_bench("--help")
    assert r.returncode == 0 and "--tokens" in r.stdout and "--hidden" in r.stdout
    code = "import sys; from benchmarks import jax_bench; print('jax' in sys.modules)"
    r = run_code(code)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr
