"""tests/gpu/run_lane.py, the GPU suite's lane runner: how it orders and groups the tests for
its pytest-xdist workers, and a CPU run of the quick lane (every GPU test skips here)."""

import os
import subprocess
import sys
import time

from tests.gpu import run_lane
from tests.repo import REPO


def _run_module(*args):
    """python -m ARGS in the repository's root, output captured."""
    cmd = [sys.executable, "-m", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)


def test_tests_are_ordered_longest_first_and_a_module_fixtures_tests_grouped():
    ids = [
        "tests/gpu/test_moe.py::test_a[world2]",
        "tests/gpu/test_moe.py::test_b[world2]",
        "tests/gpu/test_moe.py::test_a[world4]",
        "tests/gpu/test_jax.py::test_x[world4]",
        "tests/gpu/test_jax.py::test_y",
        "tests/gpu/test_new.py::test_z",
    ]
    order, groups = run_lane.schedule(ids, {"test_moe.py": 300, "test_jax.py": 40})
    # test_moe: 100 s each; a file without an estimate: 60 s; test_jax: 20 s each.
    assert order == [ids[0], ids[2], ids[1], ids[5], ids[3], ids[4]]  # ties by node id
    assert groups == {
        ids[0]: "test_moe.py[world2]",
        ids[1]: "test_moe.py[world2]",
        ids[2]: "test_moe.py[world4]",
    }
    assert run_lane.expected_times("all")["test_torch.py"] == (
        run_lane.EXPECTED_S["quick"]["test_torch.py"] + run_lane.EXPECTED_S["slow"]["test_torch.py"]
    )


def test_every_gpu_test_file_has_an_expected_time():
    files = {p.name for p in (REPO / "tests" / "gpu").glob("test_*.py")}
    assert files <= set(run_lane.EXPECTED_S["quick"]), files - set(run_lane.EXPECTED_S["quick"])
    for lane in ("slow", "worlds"):
        assert set(run_lane.EXPECTED_S[lane]) <= files, lane


def test_quick_lane_runs_on_cpu(tmp_path):
    r = _run_module("tests.gpu.run_lane", "quick", "--jobs", "2", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "alone first, then 2 workers" in r.stdout, r.stdout
    # Every file it writes: a few, whatever the number of tests.
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == ["jobs.log", "reports.tgz", "solo.log", "summary.txt"]
    solo, jobs = (tmp_path / n for n in ("solo.log", "jobs.log"))
    assert "SKIPPED" in solo.read_text() and "SKIPPED" in jobs.read_text()
    assert "test_torch_create_destroy_cycles_return_all_memory" in solo.read_text()
    ran = jobs.read_text()
    assert "[gw0]" in ran and "[gw1]" in ran, ran  # two xdist workers took the tests
    assert "test_torch_create_destroy_cycles_return_all_memory" not in ran
    quick = _run_module("pytest", "--co", "-q", "-m", "gpu and not slow", "tests/gpu").stdout
    nodes = [line for line in quick.splitlines() if "::" in line]
    for node in nodes:
        if node not in run_lane.SOLO:
            assert node in ran, node  # each test ran in some worker
    # ... the longest first: the first result is one of the first test of each worker.
    order, _ = run_lane.schedule([n for n in nodes if n not in run_lane.SOLO],
                                 run_lane.expected_times("quick"))  # fmt: skip
    first = next(line for line in ran.splitlines() if " SKIPPED " in line or " PASSED " in line)
    assert first.split()[-1] in order[:2], (first, order[:2])
    summary = (tmp_path / "summary.txt").read_text()
    assert "jobs: exit 0" in summary and "not passed:\n(none)" in summary, summary


def test_a_job_cut_short_still_shows_why_its_tests_failed(tmp_path):
    """tests/gpu/conftest.py writes a failure when it happens, and summarize lists it with its
    report, though the job was killed before pytest's own summary (a real pytest run with
    that conftest as its plugin, killed while its second test sleeps)."""
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
        env = dict(os.environ, PYTHONPATH=str(REPO))
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=f, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while "test_then_hangs" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        proc.kill()
        proc.wait()
    text = run_lane.summarize({"job0": log}, {"job0": -9}, {"job0": 1.0})
    node = "test_cut_short.py::test_fails_first"
    assert f"FAILED {node} (call; job0 was cut short)" in text, text
    assert "the answer moved" in text.split("failures:")[1], text
    assert "test_then_hangs" not in text.split("not passed:")[1].split("failures:")[0], text


def test_the_default_workers_follow_the_gpus_memory():
    h200, h100 = 143771.0, 81559.0  # nvidia-smi's memory.total, MiB
    assert run_lane.default_jobs([h200]) == 6  # as measured there
    assert run_lane.default_jobs([h100]) == 3  # 6 ran out of memory there, 3 did not
    assert [run_lane.default_jobs(m) for m in ([h100] * 8, [8192.0], [])] == [6, 1, 6]
