"""Runs a lane of the GPU suite as several pytest processes at once, so that a lane fits in
one 10-minute run on one GPU (docs/gpu_testing.md).

    python -m tests.gpu.run_lane quick|slow|all [--jobs 3] [--timeout-s 540] [--out DIR]
        [-- extra pytest args]

Lanes: ``quick`` = ``-m "gpu and not slow"``, ``slow`` = ``-m "gpu and slow"``. The lane's
test files are dealt to ``--jobs`` pytest processes (longest first, by EXPECTED_S, measured
on one H200); every test starts its own rank processes, which share the GPUs, and the
pytest processes themselves stay off the GPU (JAX_PLATFORMS=cpu), as in tools/gpu_check.sh.
Each job's log goes to ``--out`` (job<i>.log) with its durations; the exit code is 0 only
if every job passed. Needs the native module built (tools/gpu_check.sh builds it).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.repo import REPO

LANES = {"quick": "gpu and not slow", "slow": "gpu and slow", "all": "gpu"}
# Seconds per test file and lane on one H200 with the ranks sharing it (estimates where no
# run has measured them; used only to balance the jobs).
EXPECTED_S = {
    "quick": {"test_torch.py": 240, "test_timeout.py": 170, "test_anchor.py": 160,
              "test_moe.py": 150, "test_jax.py": 130, "test_demo.py": 90,
              "test_topology.py": 75, "test_native.py": 45, "test_large_message.py": 40,
              "test_handler_errors.py": 30,
              "test_multinode.py": 40, "test_parity.py": 35, "test_fuse_styles.py": 90},
    "slow": {"test_moe.py": 300, "test_torch.py": 250, "test_timeout.py": 150,
             "test_topology.py": 150, "test_jax.py": 150, "test_parity.py": 80,
             "test_native.py": 60, "test_large_message.py": 60, "test_demo.py": 100},
}
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}


def deal(files, jobs: int, expected: dict) -> list:
    """The files in ``jobs`` groups of about equal expected time (longest first)."""
    groups = [[] for _ in range(max(1, jobs))]
    load = [0.0] * len(groups)
    for f in sorted(files, key=lambda f: -expected.get(Path(f).name, 60)):
        i = load.index(min(load))
        groups[i].append(f)
        load[i] += expected.get(Path(f).name, 60)
    return [g for g in groups if g]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.gpu.run_lane")
    ap.add_argument("lane", choices=sorted(LANES))
    ap.add_argument("--jobs", type=int, default=3)
    ap.add_argument("--timeout-s", type=float, default=540.0,
                    help="each job is stopped after this long")
    ap.add_argument("--out", default=os.environ.get("JAX_FUSEDAR_REPORT_DIR", "gpu_reports"))
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    a, extra = ap.parse_args(argv[:cut]), argv[cut + 1:]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests" / "gpu").glob("test_*.py"))
    expected = EXPECTED_S.get(a.lane) or {
        f: EXPECTED_S["quick"].get(f, 0) + EXPECTED_S["slow"].get(f, 0)
        for f in set(EXPECTED_S["quick"]) | set(EXPECTED_S["slow"])}
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               JAX_FUSEDAR_REPORT_DIR=str(out.resolve()), **NO_MULTICAST)
    procs = []
    t0 = time.monotonic()
    for i, group in enumerate(deal(files, a.jobs, expected)):
        log = open(out / f"job{i}.log", "w")
        cmd = ["timeout", "-s", "KILL", str(int(a.timeout_s)), sys.executable, "-m", "pytest",
               "-m", LANES[a.lane], "-q", "-rA", "-p", "no:cacheprovider", "--durations=0",
               *group, *extra]
        print(f"job {i}: {' '.join(group)}", flush=True)
        procs.append((i, subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log,
                                          stderr=subprocess.STDOUT), log))
    codes = {}
    for i, p, log in procs:
        codes[i] = p.wait()
        log.close()
        tail = (out / f"job{i}.log").read_text(errors="replace").splitlines()[-1:]
        print(f"job {i}: exit {codes[i]} after {time.monotonic() - t0:.0f} s: "
              f"{tail[0] if tail else ''}", flush=True)
    # pytest exits 5 when a job's files hold no test of the lane.
    return 0 if all(c in (0, 5) for c in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
