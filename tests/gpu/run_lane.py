"""Runs a lane of the GPU suite as several pytest processes at once, so that a lane fits in
one 10-minute run on one GPU (docs/gpu_testing.md, "Lanes"):

    python -m tests.gpu.run_lane quick|slow|worlds|all [--jobs N] [--timeout-s 540]
        [--out DIR] [-- extra pytest args]

The ``SOLO`` tests first, alone (they measure the whole GPU), then the others in ``--jobs``
pytest-xdist workers (tests/gpu/conftest.py orders and groups them). ``--out`` receives
solo.log, jobs.log, summary.txt (exit codes, failures, durations) and reports.tgz. Exit code
0 only if every run passed.
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
# Seconds per test file and lane on one H200 with the ranks sharing it: the sums of the tests'
# durations measured there (2026-12-02; the quick lane with 6 jobs at once, the worlds lane
# with 4); "~" marks an estimate for tests those runs did not finish (docs/gpu_testing.md),
# "-" a lane without the file. Only orders the tests, longest first; a file's tests share
# its estimate equally.
_TIMES = """
file                    quick slow worlds
test_anchor.py          500   -    -
test_flashinfer_shim.py ~150  -    -     not yet run there
test_torch.py           390   400  350
test_fuse_styles.py     ~420  -    -     270 s measured; an estimate for 7 more styles
test_parity.py          200   95   235
test_fuse_exact.py      ~90   -    -     not yet run on a GPU: 6 small programs
test_jax.py             140   300  125
test_timeout.py         135   105  80
test_demo.py            135   110  110
test_moe.py             80    240  130
test_topology.py        55    240  140
test_large_message.py   45    65   -
test_native.py          40    110  -
test_fuse.py            45    -    -
test_jit_export.py      30    -    -
test_handler_errors.py  10    -    -
test_multinode.py       10    -    -
test_jax_misuse.py      5     -    -
test_readme.py          5     -    -
test_benchmarks.py      ~10   -    -     the refusals
test_fallback.py        ~90   ~150 ~150  not run on a GPU yet (27 compiles a rank; 4 ranks on NCCL)
"""
_LANES_TIMED = _TIMES.split()[1:4]
EXPECTED_S = {lane: {} for lane in _LANES_TIMED}
for _row in _TIMES.strip().splitlines()[1:]:
    _file, *_secs = _row.split()[:4]
    for _lane, _s in zip(_LANES_TIMED, _secs):
        if _s != "-":
            EXPECTED_S[_lane][_file] = int(_s.lstrip("~"))
# GPU memory per worker: each test's rank processes (JAX and torch, 2 to 8 of them) share
# the GPUs with the other workers' tests. Measured with the quick lane: 6 workers ran on one
# 141 GB H200 (2026-12-02); on one 80 GB H100 (2026-12-07) 6 ran 12 tests out of memory and
# 3 ran them all.
GIB_PER_JOB = 23
MAX_JOBS = 6


def default_jobs(gpu_memory_mib) -> int:
    """One worker per GIB_PER_JOB of the GPUs' memory (MiB each), 1 to MAX_JOBS."""
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
# Files whose tests share a module-scoped fixture per parameter (run apart, it runs twice).
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
    """(node ids longest first, {node id: xdist group}): a test's time is its file's estimate
    (60 s without one) shared among its tests; the tests of a SHARED_FIXTURE_FILES file with
    one parameter id form one group (``loadgroup`` runs it in one worker)."""
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
    """Per job its exit code and time, every test that did not pass, every test's time."""
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
            details += [f"---- {node} ({when}), last {FAILURE_LINES} lines:"]
            details += body.rstrip().splitlines()[-FAILURE_LINES:]
    lines += ["", "not passed:", *(failing or ["(none)"]), ""]
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
    ap.add_argument("--jobs", type=int, help="pytest-xdist workers (default: by GPU memory)")
    ap.add_argument("--timeout-s", type=float, default=540.0, help="stop the lane after this long")
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
    # $JAX_FUSEDAR_LANE: tests/gpu/conftest.py orders and groups the lane's tests
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **NO_MULTICAST)
    env.update(JAX_FUSEDAR_REPORT_DIR=str(reports), JAX_FUSEDAR_LANE=a.lane)
    base = [sys.executable, "-m", "pytest", "-m", marks, *(["-k", keyword] if keyword else [])]
    base += ["-v", "-rA", "-p", "no:cacheprovider", "--durations=0", *extra]
    logs, codes, seconds = {}, {}, {}

    def run(name, args):
        """One pytest run (one process group), killed when the lane's time is up; pytest's 5
        (no SOLO test in this lane) counts as a pass."""
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
        lane_s = time.monotonic() - t0
        print(
            f"{name}: exit {codes[name]} after {seconds[name]:.0f} s (lane at {lane_s:.0f} s)",
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
