"""Multi-node JAX meshes on one CPU machine: two `jax.distributed` processes that look like
two hosts (``harness.simulate_host``: node0 / node1), 4 CPU devices each. The backend is
decided per TP group from its own hosts: TP inside a host keeps the kernel, TP across hosts
takes XLA's all-reduce with ``auto`` and raises with ``trtllm``; every program also runs
against the float64 oracle. The worker (tests/gpu/workers/jax_multinode.py) is the GPU test's."""

import re
import subprocess
import sys

import pytest

from tests.gpu.workers import jax_multinode as mn
from tests.jax.child_process import cpu_env
from tests.gpu.harness import free_port, random_seed, run_ranks, simulated_hosts_problem
from tests.repo import REPO

_PROBLEM = simulated_hosts_problem()
# Its fixtures start simulated hosts (about 12 s of CPU): the quick lane leaves it out.
pytestmark = [
    pytest.mark.skipif(
        _PROBLEM is not None,
        reason=f"simulated hosts need private UTS and mount namespaces (root): {_PROBLEM}",
    ),
    pytest.mark.slow,
]


def _run(hosts, layouts, backends):
    kw = dict(platform="cpu", local_devices=4, hosts=hosts, layouts=layouts, backends=backends)
    return run_ranks(mn.worker, 2, timeout_s=120, port=free_port(), seed=random_seed(), **kw)


@pytest.fixture(scope="module")
def two_hosts():
    return _run(("node0", "node1"), list(mn.LAYOUTS), ("auto", "trtllm"))


@pytest.fixture(scope="module")
def one_host():
    return _run(("node0", "node0"), ["tp_across_hosts", "mixed_groups"], ("auto",))


def _p1(r) -> int:
    """The id of process 1's first device (jax numbers its CPU devices from 2048)."""
    return min(int(d.split("@")[0]) for d in r["devices"] if d.endswith("@1"))


def _ids(r, members):
    """Device ids written as in the layouts' docs: process 1's i-th device as 4 + i."""
    return [m - _p1(r) + 4 if m >= _p1(r) else m for m in members]


def _lowered_and_right(rec, custom_calls, all_reduces=None):
    """The lowering's custom calls (and all-reduces: none, or some) and the numerics; skips the
    rest of a test where the kernel's lowering needs the native module (tests/skips.py)."""
    if custom_calls and "not_lowered" in rec:
        pytest.skip(f"decision checked; lowering not checked: {rec['not_lowered']}")
    assert rec["custom_calls"] == custom_calls, rec
    if all_reduces is not None:
        assert (rec["all_reduces"] >= 1) == all_reduces, rec
    w = rec["worst"]
    assert w["shards"] > 0 and w["residual"] <= 1.0 and w["norm"] <= 3.0, rec


def _across(d, first, more):
    """The start of trtllm's error for TP group [first, d] across the hosts."""
    return f"TP group [{first}, {d}] (devices) spans 2 nodes (node0: [{first}]; node1: [{d}]), " + (
        f"as do {len(more)} more of the workspace's 4 TP groups ({', '.join(more)}): "
    )


def test_processes_look_like_two_hosts(two_hosts, one_host):
    assert [r["host"] for r in two_hosts] == ["node0", "node1"]
    assert [r["host"] for r in one_host] == ["node0", "node0"]
    assert all(len(r["devices"]) == 8 for r in two_hosts)


def test_tp_within_a_host_keeps_the_kernel(two_hosts):
    """DP across the hosts, and TP inside a host next to PP across them in one program; the
    lowerings checked last (a skip there leaves every decision checked)."""
    lowered = []
    for r in two_hosts:
        for backend in ("auto", "trtllm"):
            rec = r["layouts"]["dp_across_hosts"][backend]
            assert rec["backend"] == {"tp": "trtllm"}, rec
            assert [_ids(r, g) for g in rec["groups"]["tp"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
            lowered.append((rec, False))
        auto = r["layouts"]["tp_and_pp"]["auto"]
        assert f"TP group [0, {_p1(r)}] (devices)" in r["layouts"]["tp_and_pp"]["trtllm"]["error"]
        assert auto["backend"] == {"tp": "trtllm", "pp": "xla"}, auto
        lowered.append((auto, True))
    for rec, all_reduces in lowered:
        _lowered_and_right(rec, 1, all_reduces=all_reduces)


def test_tp_across_hosts_takes_xla_with_auto_and_is_refused_with_trtllm(two_hosts):
    """``auto`` takes XLA's all-reduce, for the whole workspace where some of its groups span
    the hosts (one program), and says why once per layout; ``trtllm`` names the group."""
    for r in two_hosts:
        d, msgs, rec = _p1(r), r["reasons_logged"], r["layouts"]["tp_across_hosts"]
        assert rec["auto"]["backend"] == {"tp": "xla"}, rec
        _lowered_and_right(rec["auto"], 0, all_reduces=True)
        err = rec["trtllm"]["error"]
        assert err.startswith(_across(d, 0, [f"[{i}, {d + i}]" for i in (1, 2, 3)])), err
        assert "the 'trtllm' all-reduce backend works only within one node" in err
        # Groups [0, 1] and [6, 7] inside a host, [2, 4] and [3, 5] across.
        rec = r["layouts"]["mixed_groups"]
        assert [_ids(r, g) for g in rec["auto"]["groups"]["tp"]] == [[0, 1], [2, 4], [3, 5], [6, 7]]
        assert rec["auto"]["backend"] == {"tp": "xla"}
        _lowered_and_right(rec["auto"], 0)
        assert rec["trtllm"]["error"].startswith(_across(d, 2, [f"[3, {d + 1}]"]))
        # tp_across, mixed_groups, and tp_and_pp's "pp": each workspace was created twice.
        assert len(msgs) == 3, msgs
        for m in msgs:
            assert "uses XLA's all-reduce (psum + RMSNorm) for all its" in m, msgs
            assert "since one program runs on every rank" in m, msgs
        first = "axis 'tp' uses XLA's all-reduce (psum + RMSNorm) for all its 4 TP groups"
        assert first in msgs[0] and f"TP group [0, {d}]" in msgs[0], msgs


def test_same_host_keeps_the_kernel_across_processes(one_host):
    recs = [
        r["layouts"][layout]["auto"]
        for r in one_host
        for layout in ("tp_across_hosts", "mixed_groups")
    ]
    assert [r["reasons_logged"] for r in one_host] == [[], []]
    assert all(rec["backend"] == {"tp": "trtllm"} for rec in recs), recs
    for rec in recs:
        _lowered_and_right(rec, 1)


# docs/multinode.md's two-node script, as two simulated hosts on CPU.
# python -c _LAUNCH SCRIPT PROCESS_ID NUM_PROCESSES HOST: SCRIPT as PROCESS_ID on "host" HOST.
_LAUNCH = (
    "import runpy, sys; from tests.gpu.harness import simulate_host; "
    "simulate_host(sys.argv[4]); sys.argv = sys.argv[1:4]; "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)


def test_docs_two_node_script_runs(tmp_path):
    text = (REPO / "docs" / "multinode.md").read_text()
    start = text.index("# two_node.py PROCESS_ID NUM_PROCESSES")
    script = tmp_path / "two_node.py"
    script.write_text(text[start : text.index("```", start)])
    env = cpu_env(4, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}")
    # stdout and stderr apart: gloo writes to stderr from its own threads, and merged into
    # stdout its words could split the script's lines.
    pipes = dict(cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    argv = [sys.executable, "-c", _LAUNCH, str(script)]
    procs = [subprocess.Popen([*argv, str(rank), "2", f"node{rank}"], **pipes) for rank in (0, 1)]
    try:
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in (p for p in procs if p.poll() is None):
            p.kill()
            p.wait()
    for rank, (p, (stdout, stderr)) in enumerate(zip(procs, results)):
        out = (stdout + stderr)[-3000:]
        assert p.returncode == 0, out
        # gloo's own threads may write "[Gloo] Rank N is connected to ..." into stdout too,
        # at times split after "Rank ", which leaves a line starting with the rank.
        lines = [
            x for x in stdout.splitlines() if x.startswith(f"{rank} ") and "connected" not in x
        ]
        # On CPU the workspace is the reference path; 4 TP ranks per process, 2 groups.
        assert "backend='xla', axis='tp', world_size=4, groups=2" in lines[0], out
        assert len(lines) == 2, out
        # One norm_out shard per local device; RMSNorm * gamma ~ N(0, 1): a std near 1.
        stds = [float(v) for v in re.findall(r"[-+]?\d*\.\d+(?:e[-+]?\d+)?", lines[1])]
        assert len(stds) == 4 and all(0.5 < v < 2.0 for v in stds), lines[1]
