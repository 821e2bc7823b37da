"""Runs a lane of the GPU suite as several pytest processes at once, so that a lane fits in
one 10-minute run on one GPU (docs/gpu_testing.md).

    python -m tests.gpu.run_lane quick|slow|worlds|all [--jobs N] [--timeout-s 540]
        [--out DIR] [-- extra pytest args]

Lanes (``LANES``): ``quick`` = ``-m "gpu and not slow"``, ``slow`` = ``-m "gpu and slow"``,
``worlds`` = the slow lane's tests at 4 and 8 ranks and the MoE demo, ``all`` = ``-m gpu``.
The runner runs the tests in ``SOLO`` first, alone (they measure the whole GPU), then the
others in ``--jobs`` pytest-xdist workers (``--dist loadgroup``; by default one per
``GIB_PER_JOB`` of the GPUs' memory, at most 6: ``default_jobs``): an idle worker takes the
next test, the lane's tests ordered by their expected time (``EXPECTED_S``, longest first; the
tests of a file share its estimate), the tests of one module-scoped fixture in one
``xdist_group`` (tests/gpu/conftest.py does both when ``$JAX_FUSEDAR_LANE`` names the lane).
Every test starts its own rank processes, which share the GPUs, and bounds them itself
(tests/gpu/harness.py); the pytest processes stay off the GPU (JAX_PLATFORMS=cpu), as in
tools/gpu_check.sh. ``--timeout-s`` bounds the whole lane: a run still going then is killed
with its workers.

``--out`` receives four files: ``solo.log`` and ``jobs.log`` (pytest -v -rA with every
test's duration), ``summary.txt`` (each run's exit code and time, every non-passing test,
with the report of each failure tests/gpu/conftest.py wrote when it happened, so a run cut
short still says why its finished tests failed, and every test's duration, slowest first)
and ``reports.tgz`` (the tests' JSON reports, $JAX_FUSEDAR_REPORT_DIR). The exit code is 0
only if every run passed. Needs the native module built (tools/gpu_check.sh builds it).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from tests.gpu.workers.common import NO_MULTICAST
from tests.repo import REPO

# lane: (marker expression, -k expression or None)
LANES = {
    "quick": ("gpu and not slow", None),
    "slow": ("gpu and slow", None),
    "worlds": ("gpu and slow", "world4 or world8 or demo_moe"),
    "all": ("gpu", None),
}
# Seconds per test file and lane on one H200 with the ranks sharing it: the sums of the
# tests' durations measured there (2026-12-02; the quick lane with 6 jobs at once, the
# worlds lane with 4), estimates for the tests those runs did not finish
# (docs/gpu_testing.md; test_benchmarks.py's refusals: an estimate). Used only to order the
# tests for the workers, longest first; a file's tests share its estimate equally.
EXPECTED_S = {
    "quick": {
        "test_anchor.py": 500,
        "test_flashinfer_shim.py": 150,  # an estimate: not yet run there
        "test_torch.py": 390,
        "test_fuse_styles.py": 420,  # 270 s measured; an estimate for 7 more styles
        "test_parity.py": 200,
        "test_fuse_exact.py": 90,  # an estimate (not yet run on a GPU): 6 small programs
        "test_jax.py": 140,
        "test_timeout.py": 135,
        "test_demo.py": 135,
        "test_moe.py": 80,
        "test_topology.py": 55,
        "test_large_message.py": 45,
        "test_native.py": 40,
        "test_fuse.py": 45,
        "test_jit_export.py": 30,
        "test_handler_errors.py": 10,
        "test_multinode.py": 10,
        "test_jax_misuse.py": 5,
        "test_readme.py": 5,
        "test_benchmarks.py": 10,
        "test_fallback.py": 90,  # estimate: not yet run on a GPU (27 compiles per rank)
    },
    "slow": {
        "test_torch.py": 400,
        "test_moe.py": 240,
        "test_jax.py": 300,
        "test_topology.py": 240,
        "test_timeout.py": 105,
        "test_parity.py": 95,
        "test_native.py": 110,
        "test_large_message.py": 65,
        "test_demo.py": 110,
        "test_fallback.py": 150,  # estimate: not yet run on a GPU (4 ranks over NCCL sockets)
    },
    "worlds": {
        "test_torch.py": 350,
        "test_parity.py": 235,
        "test_topology.py": 140,
        "test_moe.py": 130,
        "test_jax.py": 125,
        "test_demo.py": 110,
        "test_timeout.py": 80,
        "test_fallback.py": 150,  # estimate, as in "slow"
    },
}
# GPU memory per worker: each test's rank processes (JAX and torch, 2 to 8 of them) share
# the GPUs with the other workers' tests. Measured with the quick lane: 6 workers ran on one
# 141 GB H200 (2026-12-02); on one 80 GB H100 (2026-12-07) 6 ran 12 tests out of memory and
# 3 ran them all.
GIB_PER_JOB = 23
MAX_JOBS = 6


def default_jobs(gpu_memory_mib) -> int:
    """Workers for GPUs of these total memories (MiB, one per GPU): one per GIB_PER_JOB of
    their sum, at least 1, at most MAX_JOBS (MAX_JOBS where no GPU is seen)."""
    if not gpu_memory_mib:
        return MAX_JOBS
    return max(1, min(MAX_JOBS, int(sum(gpu_memory_mib) / 1024 // GIB_PER_JOB)))


def gpu_memory_mib() -> list:
    """Each visible GPU's total memory in MiB (nvidia-smi), or [] where it cannot say."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
        return [float(line) for line in out.split() if line.strip()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return []


# Tests that measure the whole GPU (free memory is device-wide): run first, alone.
SOLO = ("tests/gpu/test_torch.py::test_torch_create_destroy_cycles_return_all_memory",)
# Files whose tests share a module-scoped fixture per parameter (run together, or the
# fixture runs twice).
SHARED_FIXTURE_FILES = ("test_moe.py",)


def expected_times(lane: str) -> dict:
    """Seconds per test file for ``lane`` (``all``: the quick and slow lanes' sums)."""
    if lane in EXPECTED_S:
        return EXPECTED_S[lane]
    return {
        f: EXPECTED_S["quick"].get(f, 0) + EXPECTED_S["slow"].get(f, 0)
        for f in set(EXPECTED_S["quick"]) | set(EXPECTED_S["slow"])
    }


def schedule(node_ids, expected: dict):
    """(the node ids longest first, {node id: xdist group}): each test's expected time is its
    file's estimate (60 s when the file has none) shared among the file's tests; the tests of
    a SHARED_FIXTURE_FILES file with one parameter id form one group, which xdist's
    ``loadgroup`` runs in one worker (the module fixture is built once)."""
    per_file = {}
    for n in node_ids:
        per_file.setdefault(n.split("::")[0], []).append(n)
    each, groups = {}, {}
    for path, ids in per_file.items():
        name = Path(path).name
        for n in ids:
            each[n] = expected.get(name, 60) / len(ids)
            if name in SHARED_FIXTURE_FILES:
                groups[n] = name + re.sub(r"^.*?(\[.*\])?$", r"\1", n)
    return sorted(node_ids, key=lambda n: (-each[n], n)), groups


# Lines of each failure's report kept in the summary (the whole report is in the job's log).
FAILURE_LINES = 40


def summarize(logs: dict, codes: dict, seconds: dict) -> str:
    """The summary: per job its exit code and time, every test that did not pass, and every
    test's call time (pytest --durations=0), slowest first."""
    lines, failing, durations, details = [], [], [], []
    for name, path in logs.items():
        text = path.read_text(errors="replace") if path.exists() else ""
        last = text.rstrip().splitlines()[-1:] or [""]
        lines.append(
            f"{name}: exit {codes.get(name)} after {seconds.get(name, 0):.0f} s: {last[0]}"
        )
        failing += [line for line in text.splitlines() if line.startswith(("FAILED ", "ERROR "))]
        durations += re.findall(r"^(\d+\.\d+)s (call|setup|teardown) +(\S.*)$", text, re.M)
        # tests/gpu/conftest.py writes each failure when it happens: a job cut short by the
        # time limit never prints pytest's summary, but these blocks are in its log.
        for node, when, body in re.findall(
            r"^==== failed now: (\S+) \((\w+)\)\n(.*?)^==== end of \1$", text, re.M | re.S
        ):
            if not any(node in line for line in failing):
                failing.append(f"FAILED {node} ({when}; {name} was cut short)")
            body_lines = body.rstrip().splitlines()
            details += [f"---- {node} ({when}), last {FAILURE_LINES} lines:"]
            details += body_lines[-FAILURE_LINES:]
    lines.append("")
    lines += ["not passed:", *(failing or ["(none)"]), ""]
    if details:
        lines += ["failures:", *details, ""]
    lines.append("durations (s, slowest first):")
    lines += [
        f"{float(s):8.2f} {kind:8} {node}"
        for s, kind, node in sorted(durations, key=lambda d: -float(d[0]))
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.gpu.run_lane")
    ap.add_argument("lane", choices=sorted(LANES))
    ap.add_argument(
        "--jobs", type=int, default=None, help="pytest-xdist workers (default: by GPU memory)"
    )
    ap.add_argument(
        "--timeout-s", type=float, default=540.0, help="the whole lane is stopped after this long"
    )
    ap.add_argument("--out", default=os.environ.get("JAX_FUSEDAR_REPORT_DIR", "gpu_reports"))
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    a, extra = ap.parse_args(argv[:cut]), argv[cut + 1 :]
    if importlib.util.find_spec("xdist") is None:
        ap.error("the workers are pytest-xdist's: pip install 'pytest-xdist>=3' (the [test] extra)")
    if a.jobs is None:
        a.jobs = default_jobs(gpu_memory_mib())
    t0 = time.monotonic()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    reports = Path(tempfile.mkdtemp(prefix="jax_fusedar_reports_"))
    marks, keyword = LANES[a.lane]
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PYTHONUNBUFFERED="1",
        JAX_FUSEDAR_REPORT_DIR=str(reports),
        JAX_FUSEDAR_LANE=a.lane,  # tests/gpu/conftest.py orders and groups the lane's tests
        **NO_MULTICAST,
    )
    base = [sys.executable, "-m", "pytest", "-m", marks, *(["-k", keyword] if keyword else [])]
    base += ["-v", "-rA", "-p", "no:cacheprovider", "--durations=0", *extra]
    logs, codes, seconds = {}, {}, {}

    def run(name, args):
        """One pytest run (and its workers, one process group), killed when the lane's time
        is up; pytest's 5 (nothing selected: no SOLO test in this lane) counts as a pass."""
        logs[name] = out / f"{name}.log"
        left = max(1.0, a.timeout_s - (time.monotonic() - t0))
        began = time.monotonic()
        with open(logs[name], "w") as log:
            proc = subprocess.Popen(
                [*base, *args], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
            try:
                code = proc.wait(timeout=left)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                code = proc.wait()
        codes[name] = 0 if code == 5 and name == "solo" else code
        seconds[name] = time.monotonic() - began
        print(
            f"{name}: exit {codes[name]} after {seconds[name]:.0f} s (lane at "
            f"{time.monotonic() - t0:.0f} s)",
            flush=True,
        )

    print(f"lane {a.lane}: {len(SOLO)} test(s) alone first, then {a.jobs} workers", flush=True)
    run("solo", list(SOLO))
    deselect = [arg for s in SOLO for arg in ("--deselect", s)]
    run("jobs", ["-n", str(a.jobs), "--dist", "loadgroup", *deselect, "tests/gpu"])
    (out / "summary.txt").write_text(summarize(logs, codes, seconds))
    with tarfile.open(out / "reports.tgz", "w:gz") as tar:
        tar.add(reports, arcname="reports")
    shutil.rmtree(reports, ignore_errors=True)
    print((out / "summary.txt").read_text().split("\ndurations")[0], flush=True)
    return 0 if all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
