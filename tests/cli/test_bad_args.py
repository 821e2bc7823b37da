"""``python -m jax_fusedar``: bad arguments give a one-line message (exit 2) before anything
runs; ``bench`` says where the benchmarks are (tests/benchmarks/ checks theirs)."""

import os
import subprocess
import sys

import pytest

from tests.cli.test_cli import refused, run_cli
from tests.repo import REPO

BENCH = "demo --bench --out "  # the command that writes results (bench_llama.json)
PROC = "/proc/forbidden"
IS_A_FILE = "--out {t}/results: {t}/results exists and is not a folder"
RESULT_DIR = "{t}/bench_llama.json is a folder, so bench_llama.json cannot be written there"


@pytest.mark.slow
@pytest.mark.parametrize(
    "prepare, argv, message",
    [
        ("file", BENCH + "{t}/results", IS_A_FILE),
        (None, BENCH + PROC, f"--out {PROC}: cannot create the folder {PROC}:"),
        # Checked before the first case: the bench would otherwise time every case and then
        # lose the results to IsADirectoryError.
        ("folder", BENCH + "{t}", RESULT_DIR),
        (None, "demo --seed -1", "argument --seed: -1 is not in [0, 2**32)"),
        (None, f"demo --seed {2**32}", f"argument --seed: {2**32} is not in [0, 2**32)"),
        (None, "demo --seed x", "argument --seed: 'x' is not an integer"),
    ],
    ids=["out_is_a_file", "out_cannot_be_created", "result_file_is_a_folder"]
    + ["seed_-1", "seed_2**32", "seed_x"],
)
def test_bad_values_name_the_flag(tmp_path, prepare, argv, message):
    if prepare == "file":
        (tmp_path / "results").write_text("not a folder")
    elif prepare == "folder":
        (tmp_path / "bench_llama.json").mkdir()
    refused(run_cli(*argv.format(t=tmp_path).split()), message.format(t=tmp_path))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in read-only folders")
def test_out_that_is_not_writable(tmp_path):
    tmp_path.chmod(0o500)
    try:
        r = run_cli(*BENCH.split(), tmp_path)
    finally:
        tmp_path.chmod(0o700)
    refused(r, f"cannot write in the folder {tmp_path}")


def test_bench_says_where_the_benchmarks_are(capsys):
    """The benchmarks are the checkout's (benchmarks/), not the package's: ``bench`` names
    them and exits 2, whatever else is on the line and without JAX."""
    from jax_fusedar.cli.main import main

    assert main(["bench", "--framework", "torch", "--tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert "the benchmarks are not part of the package" in err
    assert "python -m benchmarks.jax_bench" in err and "python -m benchmarks.torch_bench" in err


def test_seed_zero_and_a_fresh_out_folder_are_fine(tmp_path):
    from jax_fusedar.cli.main import build_parser, check_out_dir

    assert build_parser()[0].parse_args(["demo", "--seed", "0"]).seed == 0
    out = tmp_path / "a" / "b"
    assert check_out_dir(out, ("bench.json",)) is None and out.is_dir()
    assert list(out.iterdir()) == []  # the write probe leaves nothing behind


@pytest.mark.parametrize("command", [["demo"], ["demo", "--bench"]])
def test_without_jax_the_cli_names_the_extra(tmp_path, command):
    """JAX is an extra: without it the JAX commands say how to install it (exit 2), not a
    traceback. A blocked import (None in sys.modules) stands in for a venv without jax."""
    code = (
        "import sys; sys.modules['jax'] = None; "
        "from jax_fusedar.cli.main import main; sys.exit(main(sys.argv[1:]))"
    )
    argv = [sys.executable, "-c", code, *command, "--out", str(tmp_path)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO)
    refused(r, "pip install 'jax_fusedar[jax]'")


@pytest.mark.oldest
@pytest.mark.parametrize("processes", ["one", pytest.param("per-rank", marks=pytest.mark.slow)])
def test_demo_on_a_jax_older_than_fuse_needs_names_the_jax(tmp_path, processes):
    """The demo's fused model is jax_fusedar.fuse's, which needs JAX 0.10: on an older JAX
    (made to read 0.9.3 here, through a sitecustomize on PYTHONPATH that each rank process
    also runs; the oldest lane's 0.8.2 also reads that way) the demo says which JAX it
    needs, in one line per process and exit 2, before any model is built."""
    (tmp_path / "sitecustomize.py").write_text(
        "import jax\njax.__version_info__ = (0, 9, 3)\njax.__version__ = '0.9.3'\n"
    )
    argv = ["demo", "--processes", processes, "--tp", 2]
    r = run_cli(*argv, xla_flags=None, pythonpath=[tmp_path], timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert (
        "error"
        + (" (rank 0)" if processes == "per-rank" else "")
        + ": jax_fusedar.fuse needs JAX >= 0.10, found jax 0.9.3: pip install -U "
        "'jax>=0.10', or call jax_fusedar.allreduce_fusion in the model directly"
    ) in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "jax_fusedar demo: Llama" not in r.stdout, (
        r.stdout + r.stderr
    )
