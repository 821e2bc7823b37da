"""The group exchange (jax_fusedar/common/exchange.py) against an in-memory channel: processes are
threads, ranks are fakes that record what they were given."""

import time

import pytest

from jax_fusedar.common import exchange, tp_groups
from tests.common.fakes import FakeStore, run_in_threads


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


def _run_processes(groups_members, processes, timeout_s=5.0, skip=()):
    """Runs create/connect in one thread per process; returns {process: [plans]} and errors."""
    store = FakeStore()
    groups = [
        tp_groups.TPGroup(tuple(range(i * 100, i * 100 + len(ms))), i)
        for i, ms in enumerate(groups_members)
    ]

    def proc(me):
        chan = store.channel(timeout_s)
        plans = [
            exchange.create_and_publish(
                g,
                ms,
                me,
                lambda dev, tp, me=me: FakeRank(me, dev, tp),
                chan,
                namespace="test",
                serial=7,
            )
            for g, ms in zip(groups, groups_members)
        ]
        for p in plans:
            exchange.connect_and_finalize(p, me, chan, namespace="test", serial=7)
        return plans

    out, errors = run_in_threads(proc, [p for p in processes if p not in skip], timeout_s * 4)
    return out, errors, store


def _local_plan(members, group_members):
    """create_and_publish of one process (0) without a channel."""
    return exchange.create_and_publish(
        tp_groups.TPGroup(group_members, 0),
        members,
        0,
        lambda dev, tp: FakeRank(0, dev, tp),
        None,
        namespace="t",
        serial=1,
    )


M = exchange.Member


def test_dp_tp_four_processes_two_devices_each_group_only_sees_its_own():
    # A DP x TP layout with crossed TP ranks: group A = {rank 0 on GPU 0, rank 1 on GPU 1};
    # group B = {rank 2 on GPU 1 as TP rank 0, rank 3 on GPU 0 as TP rank 1}.
    a = [M(0, 0), M(1, 1)]
    b = [M(2, 1), M(3, 0)]
    out, errors, store = _run_processes([a, b], processes=[0, 1, 2, 3])
    assert not errors, errors
    ranks = {p: [r for plan in plans for r in plan.local.values()] for p, plans in out.items()}
    for p, rs in ranks.items():
        assert len(rs) == 1 and rs[0].finalized
    # TP rank follows the position in the group, the device is the process's own.
    assert (ranks[2][0].tp_rank, ranks[2][0].device) == (0, 1)
    assert (ranks[3][0].tp_rank, ranks[3][0].device) == (1, 0)
    assert ranks[0][0].peers == {1: ("ipc", "ipc:1:1:1")}
    assert ranks[1][0].peers == {0: ("ipc", "ipc:0:0:0")}
    assert ranks[2][0].peers == {1: ("ipc", "ipc:3:0:1")}
    assert ranks[3][0].peers == {0: ("ipc", "ipc:2:1:0")}
    # Keys differ between the groups although both have TP ranks 0 and 1.
    assert len(set(store.keys_written)) == len(store.keys_written) == 4


def test_single_process_uses_pointers_and_no_channel():
    members = [M(0, d) for d in range(4)]
    plan = _local_plan(members, (0, 1, 2, 3))
    exchange.connect_and_finalize(plan, 0, None, namespace="t", serial=1)
    for tp, r in plan.local.items():
        assert r.finalized and sorted(r.peers) == [p for p in range(4) if p != tp]
        assert all(v[0] == "ptr" and v[1] == p for p, v in r.peers.items())


def test_mixed_local_pointers_and_remote_ipc():
    # Process 0 drives two GPUs, process 1 the other two, all in one group of four.
    members = [M(0, 0), M(0, 1), M(1, 0), M(1, 1)]
    out, errors, _ = _run_processes([members], processes=[0, 1])
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


def test_group_spanning_processes_without_a_channel_is_refused():
    with pytest.raises(RuntimeError, match="spans several processes"):
        _local_plan([M(0, 0), M(1, 0)], (0, 1))


def test_member_count_must_match_the_group():
    with pytest.raises(ValueError, match="members given"):
        _local_plan([M(0, 0)], (0, 1))
