"""tests/gpu/run_lane.py, the GPU suite's lane runner: how it deals the test files to its
jobs, and a CPU run of the quick lane (every GPU test skips here, every job passes)."""
import subprocess
import sys

from tests.gpu import run_lane
from tests.repo import REPO


def test_files_are_dealt_longest_first_to_the_least_loaded_job():
    expected = {"a.py": 100, "b.py": 60, "c.py": 50, "d.py": 40}
    groups = run_lane.deal(["tests/gpu/d.py", "tests/gpu/a.py", "tests/gpu/c.py",
                            "tests/gpu/b.py"], 2, expected)
    assert groups == [["tests/gpu/a.py", "tests/gpu/d.py"], ["tests/gpu/b.py",
                                                            "tests/gpu/c.py"]]
    assert run_lane.deal(["tests/gpu/a.py"], 3, expected) == [["tests/gpu/a.py"]]


def test_every_gpu_test_file_has_an_expected_time():
    files = {p.name for p in (REPO / "tests" / "gpu").glob("test_*.py")}
    known = set(run_lane.EXPECTED_S["quick"]) | set(run_lane.EXPECTED_S["slow"])
    # Files whose tests all need 2 or more GPUs default to 60 s.
    assert files - known <= {"test_fuse.py", "test_jit_export.py", "test_readme.py",
                             "test_jax_misuse.py"}, files - known


def test_quick_lane_runs_on_cpu(tmp_path):
    r = subprocess.run([sys.executable, "-m", "tests.gpu.run_lane", "quick", "--jobs", "2",
                        "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("job ") >= 4  # 2 jobs started, 2 finished
    logs = sorted(tmp_path.glob("job*.log"))
    assert len(logs) == 2 and all("skipped" in p.read_text() for p in logs)
