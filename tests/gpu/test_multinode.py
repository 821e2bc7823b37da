"""GPU: multi-node layouts on one machine, two processes made to look like two hosts
(``harness.simulate_host``; needs root), the worker of tests/jax/test_multinode.py on real
GPUs: TP across hosts takes XLA's all-reduce (``auto``) or is refused (``trtllm``); TP across
processes of one host, and DP across hosts with TP inside each, keep the kernel."""

import pytest

from tests.gpu.harness import gpu_count, needs_gpus, random_seed, report, run_ranks_with_port
from tests.gpu.harness import simulated_hosts_problem
from tests.gpu.workers import jax_multinode as mn

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _simulated_hosts():
    problem = simulated_hosts_problem()
    if problem:
        pytest.skip(f"simulated hosts need private UTS and mount namespaces (root): {problem}")


TWO_HOSTS, ONE_HOST = ("node0", "node1"), ("node0", "node0")
BOUNDS = {"residual": 1.0, "norm": 3.0}  # ulps of bf16 (tests/oracles/oracle.py), as test_gpu_jax


def _run(name, hosts, layouts, backends, device_ids):
    # XLA's NCCL all-reduce can run between the processes where no GPU serves both.
    own_gpus = not set(device_ids[0]) & set(device_ids[1])
    res = run_ranks_with_port(
        mn.worker,
        2,
        timeout_s=300,
        platform="cuda",
        local_devices=len(device_ids[0]),
        hosts=hosts,
        layouts=layouts,
        backends=backends,
        device_ids=device_ids,
        seed=random_seed(),
        run_xla_all_reduces=own_gpus,
    )
    report(name, res)
    return res


def _one_gpu_each():
    return [[0], [1 % max(1, gpu_count())]]


def _numerics_ok(rec):
    w = rec["worst"]
    assert w["shards"] > 0 and all(w[k] <= b for k, b in BOUNDS.items()), rec


def _devices(r):
    """Global device ids of process 0 and of process 1 (as the worker saw them)."""
    ids = [tuple(map(int, d.split("@"))) for d in r["devices"]]
    return [sorted(i for i, p in ids if p == proc) for proc in (0, 1)]


def test_tp_across_hosts_takes_xla_with_auto_and_refuses_trtllm():
    res = _run(
        "multinode_tp_across_hosts",
        TWO_HOSTS,
        ["tp_across_hosts"],
        ("auto", "trtllm"),
        _one_gpu_each(),
    )
    for r in res:
        (a,), (b,) = _devices(r)
        auto = r["layouts"]["tp_across_hosts"]["auto"]
        assert auto["backend"] == {"tp": "xla"} and auto["groups"] == {"tp": [[a, b]]}, auto
        assert auto["custom_calls"] == 0 and auto["all_reduces"] >= 1, auto
        if gpu_count() >= 2:
            _numerics_ok(auto)  # XLA's all-reduce (NCCL) between the two "hosts" ran
        else:
            assert "NCCL refuses two ranks on one GPU" in auto["not_run"], auto
        err = r["layouts"]["tp_across_hosts"]["trtllm"]["error"]
        assert err.startswith(
            f"TP group [{a}, {b}] (devices) spans 2 nodes (node0: [{a}]; node1: [{b}]): the "
            f"'trtllm' all-reduce backend works only within one node"
        ), err
        assert len(r["reasons_logged"]) == 1 and f"node1: [{b}]" in r["reasons_logged"][0], r


def test_tp_across_processes_of_one_host_keeps_the_kernel():
    res = _run("multinode_one_host", ONE_HOST, ["tp_across_hosts"], ("auto",), _one_gpu_each())
    for r in res:
        auto = r["layouts"]["tp_across_hosts"]["auto"]
        assert auto["backend"] == {"tp": "trtllm"} and auto["custom_calls"] == 1, auto
        _numerics_ok(auto)  # the kernel over CUDA IPC between the two processes
        assert r["reasons_logged"] == [], r


@needs_gpus(2, "each simulated host drives a TP group of 2 devices (a process drives a GPU once)")
def test_dp_across_hosts_tp_within_keeps_the_kernel():
    # Own GPUs per process where there are 4; else both processes drive GPUs 0 and 1.
    own = gpu_count() >= 4
    layouts = ["dp_across_hosts"] + (["tp_across_hosts"] if own else [])
    device_ids = [[0, 1], [2, 3]] if own else [[0, 1]] * 2
    res = _run("multinode_dp_across_hosts", TWO_HOSTS, layouts, ("auto", "trtllm"), device_ids)
    for r in res:
        p0, p1 = _devices(r)
        for backend in ("auto", "trtllm"):
            rec = r["layouts"]["dp_across_hosts"][backend]
            assert rec["backend"] == {"tp": "trtllm"}, rec
            assert rec["groups"] == {"tp": [p0, p1]}, rec  # each group inside one host
            assert rec["custom_calls"] == 1 and rec["all_reduces"] == 0, rec
            _numerics_ok(rec)
        if own:  # TP groups [p0[0], p1[0]] and [p0[1], p1[1]], across the hosts
            auto = r["layouts"]["tp_across_hosts"]["auto"]
            assert auto["backend"] == {"tp": "xla"} and auto["custom_calls"] == 0, auto
            _numerics_ok(auto)
            assert (
                f"TP group [{p0[0]}, {p1[0]}] (devices) spans 2 nodes"
                in r["layouts"]["tp_across_hosts"]["trtllm"]["error"]
            )
