"""The group exchange (jax_fusedar/common/exchange.py) against an in-memory channel: processes
are threads, ranks are fakes that record what they were given."""

import time

import pytest

from jax_fusedar.common import exchange, tp_groups
from tests.common.fakes import FakeStore, run_in_threads

M = exchange.Member


class FakeRank:
    """Stands in for the native Rank: its 'IPC handle' names its process/device/TP rank."""

    def __init__(self, process, device, tp_rank):
        self.process, self.device, self.tp_rank = process, device, tp_rank
        self.peers, self.finalized = {}, False

    def export_ipc(self):
        return f"ipc:{self.process}:{self.device}:{self.tp_rank}".encode()

    def local_pointers(self):
        return [hash((self.process, self.device, self.tp_rank, b)) for b in range(3)]

    def set_peer_pointers(self, peer, peer_device, ptrs):
        self.peers[peer] = ("ptr", peer_device, tuple(ptrs))

    def open_peer_ipc(self, peer, handles):
        self.peers[peer] = ("ipc", handles.decode())

    def finalize(self):
        assert not self.finalized
        self.finalized = True


def _plan(group, members, me, chan, namespace="test", serial=7):
    make = lambda dev, tp: FakeRank(me, dev, tp)
    return exchange.create_and_publish(
        group, members, me, make, chan, namespace=namespace, serial=serial
    )


def _run_processes(groups_members, processes, timeout_s=5.0, skip=()):
    """Runs create/connect in one thread per process; returns {process: [plans]} and errors."""
    store = FakeStore()
    groups = [
        tp_groups.TPGroup(tuple(range(i * 100, i * 100 + len(ms))), i)
        for i, ms in enumerate(groups_members)
    ]

    def proc(me):
        chan = store.channel(timeout_s)
        plans = [_plan(g, ms, me, chan) for g, ms in zip(groups, groups_members)]
        for p in plans:
            exchange.connect_and_finalize(p, me, chan, namespace="test", serial=7)
        return plans

    out, errors = run_in_threads(proc, [p for p in processes if p not in skip], timeout_s * 4)
    return out, errors, store


def _local_plan(members, group_members):
    """create_and_publish of one process (0) without a channel."""
    return _plan(tp_groups.TPGroup(group_members, 0), members, 0, None, namespace="t", serial=1)


def test_dp_tp_four_processes_two_devices_each_group_only_sees_its_own():
    # A DP x TP layout with crossed TP ranks: group A = {rank 0 on GPU 0, rank 1 on GPU 1};
    # group B = {rank 2 on GPU 1 as TP rank 0, rank 3 on GPU 0 as TP rank 1}.
    out, errors, store = _run_processes(
        [[M(0, 0), M(1, 1)], [M(2, 1), M(3, 0)]], processes=[0, 1, 2, 3]
    )
    assert not errors, errors
    ranks = {p: [r for plan in plans for r in plan.local.values()] for p, plans in out.items()}
    assert all(len(rs) == 1 and rs[0].finalized for rs in ranks.values())
    # TP rank follows the position in the group, the device is the process's own.
    assert (ranks[2][0].tp_rank, ranks[2][0].device) == (0, 1)
    assert (ranks[3][0].tp_rank, ranks[3][0].device) == (1, 0)
    peers = {p: rs[0].peers for p, rs in ranks.items()}
    assert peers == {
        0: {1: ("ipc", "ipc:1:1:1")},
        1: {0: ("ipc", "ipc:0:0:0")},
        2: {1: ("ipc", "ipc:3:0:1")},
        3: {0: ("ipc", "ipc:2:1:0")},
    }
    # Keys differ between the groups although both have TP ranks 0 and 1.
    assert len(set(store.keys_written)) == len(store.keys_written) == 4


def test_single_process_uses_pointers_and_no_channel():
    plan = _local_plan([M(0, d) for d in range(4)], (0, 1, 2, 3))
    exchange.connect_and_finalize(plan, 0, None, namespace="t", serial=1)
    for tp, r in plan.local.items():
        assert r.finalized and sorted(r.peers) == [p for p in range(4) if p != tp]
        assert all(v[0] == "ptr" and v[1] == p for p, v in r.peers.items())


def test_mixed_local_pointers_and_remote_ipc():
    # Process 0 drives two GPUs, process 1 the other two, all in one group of four.
    out, errors, _ = _run_processes([[M(0, 0), M(0, 1), M(1, 0), M(1, 1)]], processes=[0, 1])
    assert not errors, errors
    r0 = out[0][0].local[0]
    assert r0.peers[1][0] == "ptr" and r0.peers[1][1] == 1
    assert r0.peers[2] == ("ipc", "ipc:1:0:2") and r0.peers[3] == ("ipc", "ipc:1:1:3")


def test_member_that_never_arrives_is_named_within_the_timeout():
    t0 = time.monotonic()
    out, errors, _ = _run_processes(
        [[M(0, 0), M(1, 1)]], processes=[0, 1], timeout_s=0.5, skip=(1,)
    )
    assert time.monotonic() - t0 < 5
    assert isinstance(errors[0], TimeoutError)
    assert "TP rank 1" in str(errors[0]) and "process 1" in str(errors[0])


@pytest.mark.parametrize(
    "members, error, match",
    [
        ([M(0, 0), M(1, 0)], RuntimeError, "spans several processes"),  # without a channel
        ([M(0, 0)], ValueError, "members given"),  # the member count must match the group
    ],
)
def test_a_group_that_cannot_be_planned_is_refused(members, error, match):
    with pytest.raises(error, match=match):
        _local_plan(members, (0, 1))
