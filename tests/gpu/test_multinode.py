"""GPU: multi-node layouts on one machine, two `jax.distributed` processes made to look like
two hosts (``harness.simulate_host``: own host name per process; needs root), the worker of
tests/jax/test_multinode.py on real GPUs (``create_allreduce_fusion_workspace``, the kernel
or XLA's NCCL all-reduce, each group's outputs against the float64 oracle).

* TP across the two hosts, one GPU per process: ``auto`` takes XLA's all-reduce (no custom
  call) and the result is right (run where each process has a GPU of its own: XLA's NCCL
  refuses two ranks on one GPU; on one GPU the choice and the lowering are checked);
  ``trtllm`` raises naming the group's devices and hosts.
* The same two processes with the same host name: the kernel (CUDA IPC across processes).
* DP across the hosts, TP inside each (2 GPUs per process; on a 2-GPU machine both processes
  drive both GPUs, their kernels time-slice): the kernel for every TP group.
"""

import pytest

from tests.gpu.harness import gpu_count, needs_gpus, report

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _simulated_hosts():
    from tests.gpu.harness import simulated_hosts_problem

    problem = simulated_hosts_problem()
    if problem:
        pytest.skip(f"simulated hosts need private UTS and mount namespaces (root): {problem}")


TWO_HOSTS, ONE_HOST = ("node0", "node1"), ("node0", "node0")
BOUNDS = {"residual": 1.0, "norm": 3.0}  # ulps of bf16 (tests/oracles/oracle.py), as test_gpu_jax


def _run(hosts, layouts, backends, device_ids):
    from tests.gpu.workers import jax_multinode as mn
    from tests.gpu.harness import random_seed, run_ranks_with_port

    return run_ranks_with_port(
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
        run_xla_all_reduces=_own_gpus(device_ids),
    )


def _own_gpus(device_ids) -> bool:
    """Whether no GPU serves both processes (XLA's NCCL all-reduce can run between them)."""
    return not set(device_ids[0]) & set(device_ids[1])


def _one_gpu_each():
    n = max(1, gpu_count())
    return [[0], [1 % n]]


def _numerics_ok(rec):
    w = rec["worst"]
    assert w["shards"] > 0 and all(w[k] <= b for k, b in BOUNDS.items()), rec


def _devices(r):
    """Global device ids of process 0 and of process 1 (as the worker saw them)."""
    ids = [tuple(map(int, d.split("@"))) for d in r["devices"]]
    return [sorted(i for i, p in ids if p == proc) for proc in (0, 1)]


def test_tp_across_hosts_takes_xla_with_auto_and_refuses_trtllm():
    res = _run(TWO_HOSTS, ["tp_across_hosts"], ("auto", "trtllm"), _one_gpu_each())
    report("multinode_tp_across_hosts", res)
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
            f"TP group [{a}, {b}] (devices) spans 2 nodes (node0: [{a}]; "
            f"node1: [{b}]): the 'trtllm' all-reduce backend works only "
            f"within one node"
        ), err
        assert len(r["reasons_logged"]) == 1, r
        assert f"node1: [{b}]" in r["reasons_logged"][0], r


def test_tp_across_processes_of_one_host_keeps_the_kernel():
    res = _run(ONE_HOST, ["tp_across_hosts"], ("auto",), _one_gpu_each())
    report("multinode_one_host", res)
    for r in res:
        auto = r["layouts"]["tp_across_hosts"]["auto"]
        assert auto["backend"] == {"tp": "trtllm"}, auto
        assert auto["custom_calls"] == 1, auto
        _numerics_ok(auto)  # the kernel over CUDA IPC between the two processes
        assert r["reasons_logged"] == [], r


@needs_gpus(
    2,
    "each simulated host drives a TP group of 2 devices, and one process cannot drive a GPU twice",
)
def test_dp_across_hosts_tp_within_keeps_the_kernel():
    # Own GPUs per process where there are 4; else both processes drive GPUs 0 and 1.
    own = gpu_count() >= 4
    layouts = ["dp_across_hosts"] + (["tp_across_hosts"] if own else [])
    res = _run(TWO_HOSTS, layouts, ("auto", "trtllm"), [[0, 1], [2, 3]] if own else [[0, 1]] * 2)
    report("multinode_dp_across_hosts", res)
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
