"""Runs a lane of the GPU suite as several pytest processes at once, so that a lane fits in
one 10-minute run on one GPU (docs/gpu_testing.md).

    python -m tests.gpu.run_lane quick|slow|worlds|all [--jobs 6] [--timeout-s 540]
        [--out DIR] [-- extra pytest args]

Lanes (``LANES``): ``quick`` = ``-m "gpu and not slow"``, ``slow`` = ``-m "gpu and slow"``,
``worlds`` = the slow lane's tests at 4 and 8 ranks and the MoE demo, ``all`` = ``-m gpu``.
The runner collects the lane's tests (one pytest --collect-only), runs the tests in ``SOLO``
first, alone (they measure the whole GPU), then deals the others to ``--jobs`` pytest
processes by their expected time (``EXPECTED_S``, longest first; the tests of a file share
its estimate; the tests of one module-scoped fixture stay together). Every test starts its
own rank processes, which share the GPUs; the pytest processes themselves stay off the GPU
(JAX_PLATFORMS=cpu), as in tools/gpu_check.sh. ``--timeout-s`` bounds the whole lane: a job
still running then is killed.

``--out`` receives few files (9 with 6 jobs): ``solo.log`` and ``job<i>.log`` (pytest -v -rA
with every test's duration), ``summary.txt`` (each job's exit code and time, every
non-passing test, every test's duration, slowest first) and ``reports.tgz`` (the tests'
JSON reports, $JAX_FUSEDAR_REPORT_DIR). The exit code is 0 only
if every job passed. Needs the native module built (tools/gpu_check.sh builds it).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

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
# (docs/gpu_testing.md). Used only to deal the tests to the jobs; a file's tests share its
# estimate equally.
EXPECTED_S = {
    "quick": {
        "test_anchor.py": 500,
        "test_flashinfer_shim.py": 150,  # an estimate: not yet run there
        "test_torch.py": 390,
        "test_fuse_styles.py": 270,
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
# Tests that measure the whole GPU (free memory is device-wide): run first, alone.
SOLO = ("tests/gpu/test_torch.py::test_torch_create_destroy_cycles_return_all_memory",)
# Files whose tests share a module-scoped fixture per parameter (run together, or the
# fixture runs twice).
SHARED_FIXTURE_FILES = ("test_moe.py",)
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def deal_weighted(weights: dict, jobs: int) -> list:
    """The keys of ``weights`` (seconds) in ``jobs`` groups of about equal total, longest
    first to the least loaded group; empty groups dropped."""
    groups = [[] for _ in range(max(1, jobs))]
    load = [0.0] * len(groups)
    for key in sorted(weights, key=lambda k: (-weights[k], k)):
        i = load.index(min(load))
        groups[i].append(key)
        load[i] += weights[key]
    return [g for g in groups if g]


def deal(files, jobs: int, expected: dict) -> list:
    """The files in ``jobs`` groups of about equal expected time (longest first); a file
    missing from ``expected`` counts 60 s."""
    return deal_weighted({f: expected.get(Path(f).name, 60) for f in files}, jobs)


def units(node_ids, expected: dict) -> dict:
    """{unit: seconds}: each test its own unit (its file's estimate shared among the file's
    tests), except that the tests of a SHARED_FIXTURE_FILES file with one parameter id form
    one unit. A unit is a tuple of node ids."""
    per_file = {}
    for n in node_ids:
        per_file.setdefault(n.split("::")[0], []).append(n)
    out = {}
    for path, ids in per_file.items():
        each = expected.get(Path(path).name, 60) / len(ids)
        if Path(path).name in SHARED_FIXTURE_FILES:
            by_param = {}
            for n in ids:
                by_param.setdefault(re.sub(r"^.*?(\[.*\])?$", r"\1", n), []).append(n)
            for group in by_param.values():
                out[tuple(group)] = each * len(group)
        else:
            out.update({(n,): each for n in ids})
    return out


def collect(marks: str, keyword, extra, env) -> list:
    """The node ids of the lane's tests (pytest --collect-only)."""
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "--collect-only",
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        marks,
        *(["-k", keyword] if keyword else []),
        *extra,
        "tests/gpu",
    ]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    ids = [line for line in r.stdout.splitlines() if "::" in line]
    if r.returncode != 0 or not ids:  # 5: nothing selected, a broken lane
        raise SystemExit(
            f"collecting the lane found no tests (pytest exit {r.returncode}):\n"
            f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        )
    return ids


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
    ap.add_argument("--jobs", type=int, default=6)
    ap.add_argument(
        "--timeout-s", type=float, default=540.0, help="the whole lane is stopped after this long"
    )
    ap.add_argument("--out", default=os.environ.get("JAX_FUSEDAR_REPORT_DIR", "gpu_reports"))
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    a, extra = ap.parse_args(argv[:cut]), argv[cut + 1 :]
    t0 = time.monotonic()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    reports = Path(tempfile.mkdtemp(prefix="jax_fusedar_reports_"))
    marks, keyword = LANES[a.lane]
    expected = EXPECTED_S.get(a.lane) or {
        f: EXPECTED_S["quick"].get(f, 0) + EXPECTED_S["slow"].get(f, 0)
        for f in set(EXPECTED_S["quick"]) | set(EXPECTED_S["slow"])
    }
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PYTHONUNBUFFERED="1",
        JAX_FUSEDAR_REPORT_DIR=str(reports),
        **NO_MULTICAST,
    )
    node_ids = collect(marks, keyword, extra, env)
    solo = [n for n in node_ids if n in SOLO]
    groups = deal_weighted(units([n for n in node_ids if n not in SOLO], expected), a.jobs)
    print(
        f"lane {a.lane}: {len(node_ids)} tests, {len(solo)} alone first, then {len(groups)} jobs",
        flush=True,
    )
    base = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        marks,
        "-v",
        "-rA",
        "-p",
        "no:cacheprovider",
        "--durations=0",
        *extra,
    ]
    logs, codes, seconds = {}, {}, {}

    def start(name, ids):
        logs[name] = out / f"{name}.log"
        log = open(logs[name], "w")
        left = max(1, int(a.timeout_s - (time.monotonic() - t0)))
        print(f"{name}: {len(ids)} tests: {' '.join(ids)}", flush=True)
        return (
            name,
            subprocess.Popen(
                ["timeout", "-s", "KILL", str(left), *base, *ids],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            ),
            log,
            time.monotonic(),
        )

    def wait(run):
        name, proc, log, began = run
        codes[name] = proc.wait()
        log.close()
        seconds[name] = time.monotonic() - began
        print(
            f"{name}: exit {codes[name]} after {seconds[name]:.0f} s (lane at "
            f"{time.monotonic() - t0:.0f} s)",
            flush=True,
        )

    if solo:
        wait(start("solo", solo))
    for run in [
        start(f"job{i}", [n for unit in group for n in unit]) for i, group in enumerate(groups)
    ]:
        wait(run)
    (out / "summary.txt").write_text(summarize(logs, codes, seconds))
    with tarfile.open(out / "reports.tgz", "w:gz") as tar:
        tar.add(reports, arcname="reports")
    shutil.rmtree(reports, ignore_errors=True)
    print((out / "summary.txt").read_text().split("\ndurations")[0], flush=True)
    return 0 if all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
