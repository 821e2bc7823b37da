"""tests/gpu/run_lane.py, the GPU suite's lane runner: how it deals the test files to its
jobs, and a CPU run of the quick lane (every GPU test skips here, every job passes)."""

import subprocess
import sys

from tests.gpu import run_lane
from tests.repo import REPO


def test_files_are_dealt_longest_first_to_the_least_loaded_job():
    expected = {"a.py": 100, "b.py": 60, "c.py": 50, "d.py": 40}
    groups = run_lane.deal(
        ["tests/gpu/d.py", "tests/gpu/a.py", "tests/gpu/c.py", "tests/gpu/b.py"], 2, expected
    )
    assert groups == [["tests/gpu/a.py", "tests/gpu/d.py"], ["tests/gpu/b.py", "tests/gpu/c.py"]]
    assert run_lane.deal(["tests/gpu/a.py"], 3, expected) == [["tests/gpu/a.py"]]


def test_every_gpu_test_file_has_an_expected_time():
    files = {p.name for p in (REPO / "tests" / "gpu").glob("test_*.py")}
    assert files <= set(run_lane.EXPECTED_S["quick"]), files - set(run_lane.EXPECTED_S["quick"])
    for lane in ("slow", "worlds"):
        assert set(run_lane.EXPECTED_S[lane]) <= files, lane


def test_tests_are_dealt_one_by_one_except_those_of_one_module_fixture():
    ids = [
        "tests/gpu/test_moe.py::test_a[world2]",
        "tests/gpu/test_moe.py::test_b[world2]",
        "tests/gpu/test_moe.py::test_a[world4]",
        "tests/gpu/test_moe.py::test_b[world4]",
        "tests/gpu/test_jax.py::test_x[world4]",
        "tests/gpu/test_jax.py::test_y",
    ]
    got = run_lane.units(ids, {"test_moe.py": 200, "test_jax.py": 100})
    assert got == {tuple(ids[0:2]): 100, tuple(ids[2:4]): 100, (ids[4],): 50, (ids[5],): 50}
    groups = run_lane.deal_weighted(got, 2)
    assert sorted(map(len, groups)) == [2, 2]
    assert {u for g in groups for u in g} == set(got)


def test_quick_lane_runs_on_cpu(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.gpu.run_lane",
            "quick",
            "--jobs",
            "2",
            "--out",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "alone first, then 2 jobs" in r.stdout, r.stdout
    # Every file it writes: a few, whatever the number of tests.
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == ["job0.log", "job1.log", "reports.tgz", "solo.log", "summary.txt"]
    logs = [tmp_path / n for n in ("solo.log", "job0.log", "job1.log")]
    assert all("SKIPPED" in p.read_text() for p in logs)
    assert "test_torch_create_destroy_cycles_return_all_memory" in logs[0].read_text()
    ran = " ".join(p.read_text() for p in logs)
    quick = subprocess.run(
        [sys.executable, "-m", "pytest", "--co", "-q", "-m", "gpu and not slow", "tests/gpu"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    ).stdout
    for node in (line for line in quick.splitlines() if "::" in line):
        assert ran.count(node + " ") >= 1, node  # each test ran in some job
    summary = (tmp_path / "summary.txt").read_text()
    assert "job0: exit 0" in summary and "not passed:\n(none)" in summary, summary


def test_a_job_cut_short_still_shows_why_its_tests_failed(tmp_path):
    """tests/gpu/conftest.py writes a failure when it happens, and summarize lists it with its
    report, though the job was killed before pytest's own summary (a real pytest run with
    that conftest as its plugin, killed while its second test sleeps)."""
    import os
    import time
    from pathlib import Path

    module = tmp_path / "test_cut_short.py"
    module.write_text(
        "import time\n\n"
        "def test_fails_first():\n"
        "    assert 6 * 7 == 41, 'the answer moved'\n\n"
        "def test_then_hangs():\n"
        "    time.sleep(60)\n"
    )
    log = tmp_path / "job0.log"
    cmd = [sys.executable, "-m", "pytest", "-v", "-rA", "-p", "no:cacheprovider"]
    cmd += ["-p", "tests.gpu.conftest", "test_cut_short.py"]
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd,
            cwd=tmp_path,
            env=dict(os.environ, PYTHONPATH=str(REPO)),
            stdout=f,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while "test_then_hangs" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        proc.kill()
        proc.wait()
    text = run_lane.summarize({"job0": Path(log)}, {"job0": -9}, {"job0": 1.0})
    node = "test_cut_short.py::test_fails_first"
    assert f"FAILED {node} (call; job0 was cut short)" in text, text
    assert "the answer moved" in text.split("failures:")[1], text
    assert "test_then_hangs" not in text.split("not passed:")[1].split("failures:")[0], text
