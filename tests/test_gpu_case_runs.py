"""On CPU: what the GPU suite does when a rank's trap is never reported (ranks sharing a GPU;
jax_fusedar/common/lost_traps.py ends that process): harness.run_ranks keeps what the rank
noted and when it ended, case_runs finds its record and holds the end to the watcher's
timing, and the GPU timeout and handshake tests take either outcome, fed their workers'
results (records in ffi/core/handshake.cu's format, the watcher's lines from lost_traps
itself). Those branches run on a GPU only when the driver loses a trap, so a mistake in
them would otherwise show only there."""

import os
import sys
import time

import pytest

from jax_fusedar.common import lost_traps
from tests.gpu import case_runs, harness

REST = (
    ". Rank {peer} did not arrive: it skipped or added a call, stopped or died, or called "
    "with another pattern, shape or algorithm (one-shot, two-shot, large-message). The "
    "kernel trapped, so this device's CUDA context is unusable: restart the process. "
    "(timeout_s on the workspace or $JAX_FUSEDAR_TIMEOUT_S sets the limit; 0 waits "
    "forever.)"
)
LAMPORT = "its one-shot data in this rank's Lamport buffer (token "
GOOD = {"residual": 0.9, "norm": 1.5}
ENDED_S = lost_traps.GRACE_S + 3.5  # when the watcher ends a rank whose wait timed out at 3 s


def _ending_worker(rank, world, chan, *, linger_s):
    if rank == 0:
        chan.note(good={"residual": 0.5}, failing_call_at=time.monotonic())
        chan.note(device=3)
        time.sleep(linger_s)
        os._exit(lost_traps.EXIT_CODE)
    return {"rank": rank}


def test_run_ranks_keeps_what_an_ended_rank_noted_and_when_it_ended():
    res = harness.run_ranks(
        _ending_worker, 2, timeout_s=120, linger_s=1.0, allow_exit=(lost_traps.EXIT_CODE,)
    )
    r0, r1 = res
    assert r1 == {"rank": 1}
    assert r0["rank"] == 0 and r0["exitcode"] == lost_traps.EXIT_CODE, r0
    notes = r0["notes"]
    assert notes["good"] == {"residual": 0.5} and notes["device"] == 3, notes
    assert 1.0 <= r0["exited_at"] - notes["failing_call_at"] <= 2.5, r0


def test_run_ranks_still_fails_on_an_exit_it_does_not_allow():
    # (The pause lets the note leave first: a process that ends while its queue's feeder
    # thread writes could leave the queue's lock taken.)
    with pytest.raises(RuntimeError, match="rank 0 exited with 70 without a result"):
        harness.run_ranks(_ending_worker, 2, timeout_s=120, linger_s=0.5)


def _watcher_lines(monkeypatch, capsys, record, device=0):
    """What lost_traps writes on stderr when it ends a process over ``record`` (its
    os._exit raising SystemExit here instead)."""
    monkeypatch.setattr(lost_traps.os, "_exit", sys.exit)
    with pytest.raises(SystemExit):
        lost_traps._end(record, device)
    monkeypatch.undo()
    return capsys.readouterr().err


def _wait_record(me, world, seq, sig, peer, where=LAMPORT, waited=3.0):
    return (
        f"jax_fusedar kernel wait timed out on rank {me} of {world} (device 0), call "
        f"#{seq} {sig}: waited {waited:.1f} s (timeout 3.0 s) for rank {peer} to deliver "
        f"{where}5)" + REST.format(peer=peer)
    )


def _lost(rank, notes, after_s=ENDED_S):
    now = time.monotonic()
    notes = {**notes, "failing_call_at": now}
    return dict(rank=rank, exitcode=lost_traps.EXIT_CODE, exited_at=now + after_s, notes=notes)


def _failing(record, elapsed_s=3.3):
    return {
        "sync_error": "RuntimeError: CUDA error: unspecified launch failure",
        "elapsed_s": elapsed_s,
        "failure_record": record,
        "relaunch_error": "RuntimeError: " + record,
        "algorithm": None,
    }


def _result(ranks, stderr):
    lines = case_runs.lost_trap_lines(stderr)
    return dict(
        ranks=ranks, lost_trap_lines=lines, output_tail=stderr, printf_lines=[], wall_s=40.0
    )


def test_lost_trap_record_holds_the_exit_the_record_and_the_timing(monkeypatch, capsys):
    record = _wait_record(0, 2, 4, "{sig}", 1)
    err = "W1201 some log line\n" + _watcher_lines(monkeypatch, capsys, record)
    head = "jax_fusedar kernel wait timed out on rank {} of 2 "
    good = _lost(0, {})

    def found(rank, rank_of_head=0):
        res = _result([rank], err)
        return case_runs.lost_trap_record(res, rank, head.format(rank_of_head), record_within_s=4.0)

    assert found(good) == record
    for bad in (
        _lost(0, {}, lost_traps.GRACE_S - 1.0),  # ended before the watcher could
        _lost(0, {}, 4.0 + lost_traps.GRACE_S + case_runs.LOST_TRAP_SLACK_S + 1),
        {**good, "exitcode": 1},
    ):
        with pytest.raises(AssertionError):
            found(bad)
    with pytest.raises(AssertionError):  # another rank's record only
        found(good, rank_of_head=1)


def _check(monkeypatch, res, test, holds=True):
    """Runs the GPU test ``test`` on ``res`` as its workers' results (case_runs.checked_case
    reads them): it passes, or with ``holds`` False it fails."""
    monkeypatch.setattr(case_runs, "run_case", lambda *a, **k: res)
    monkeypatch.setattr(case_runs, "report", lambda name, obj: None)
    if holds:
        test()
    else:
        with pytest.raises(AssertionError):
            test()


@pytest.mark.parametrize("lost_ranks", [(), (0,), (0, 2)])
def test_the_missing_rank_test_at_four_ranks_takes_either_outcome(monkeypatch, capsys, lost_ranks):
    from tests.gpu import test_timeout as tt
    from tests.gpu.workers.native_timeout import GOOD_FIRST

    sig = tt.SIG.format(16, "one-shot")
    ranks, err = [], ""
    for me in range(3):
        record = _wait_record(me, 4, GOOD_FIRST + 1, sig, 3)
        if me in lost_ranks:
            err += _watcher_lines(monkeypatch, capsys, record)
            ranks.append(_lost(me, {"good": GOOD}))
        else:
            gone = "rank 1: ranks [0] never sent 'verdict'"
            ranks.append(dict(rank=me, good=GOOD, failing=_failing(record), peer_gone=gone))
    ranks.append({"rank": 3, "good": GOOD, "healthy_after": True, "failure_record": ""})
    test = lambda: tt.test_a_missing_rank_makes_the_other_fail_with_the_record(
        "never_oneshot", 16, True, LAMPORT, 4
    )
    _check(monkeypatch, _result(ranks, err), test)
    # What the test holds either outcome to: the record naming the missing rank...
    bad = [dict(r) for r in ranks]
    if 1 not in lost_ranks:
        bad[1]["failing"] = _failing(_wait_record(1, 4, GOOD_FIRST + 1, sig, 2))
    _check(monkeypatch, _result(bad, err.replace("for rank 3", "for rank 2")), test, False)
    # ... and the good calls before it (noted by a rank that then ended).
    bad, worse = [dict(r) for r in ranks], {"residual": 1.5, "norm": 1.0}
    bad[0] = _lost(0, {"good": worse}) if 0 in lost_ranks else {**bad[0], "good": worse}
    _check(monkeypatch, _result(bad, err), test, holds=False)


@pytest.mark.parametrize("lost", [False, True])
def test_the_jax_timeout_test_takes_either_outcome(monkeypatch, capsys, lost):
    from tests.gpu import test_timeout as tt
    from tests.gpu.workers import jax_timeout

    record = _wait_record(0, 2, 2, "{sig}", 1)
    before = {"backend": "trtllm", "timeout_s": jax_timeout.TIMEOUT_S, "good": GOOD}
    r1 = {"rank": 1, **before, "failures": []}
    if lost:
        err = _watcher_lines(monkeypatch, capsys, record)
        r0 = _lost(0, before)
        r1.update(rank0_partial=None, rank0_silent="rank 1: ranks [0] never sent 'partial'")
    else:
        err = ""
        failing = {
            "error": "RuntimeError: " + record,
            "xla_error": "XlaRuntimeError: CUDA",
            "elapsed_s": 4.4,
            "timeline_s": {"dispatched": 0.01, "record": 3.0, "raised": 4.4},
            "failures": [record],
            "raise_if_failed": record,
            "next_call_error": "XlaRuntimeError: CUDA error",
        }
        r0 = {"rank": 0, **before, "failing": failing}
        r1["rank0_partial"] = failing
    test = tt.test_jax_surfaces_the_timeout_with_the_record
    _check(monkeypatch, _result([r0, r1], err), test)
    # Rank 1 reports a record of its own: wrong either way.
    _check(monkeypatch, _result([r0, {**r1, "failures": [record]}], err), test, holds=False)


@pytest.mark.parametrize("lost", [False, True])
def test_the_moe_timeout_test_takes_either_outcome(monkeypatch, capsys, lost):
    from tests.gpu import test_timeout as tt
    from tests.gpu.workers import moe_timeout as mt

    case = "never_finalize"
    sig = tt.MOE_SIG.format(mt.CASES[case], mt.TOKENS, mt.HIDDEN)
    record = _wait_record(0, 2, mt.GOOD_FIRST + 1, sig, 1)
    before = {"timeout_s": mt.TIMEOUT_S, "good": [[0.5, 0.7]] * mt.GOOD_FIRST}
    r1 = {"rank": 1, **before, "healthy_after": True, "failure_record": ""}
    if lost:
        err = _watcher_lines(monkeypatch, capsys, record)
        r0 = _lost(0, before)
        r1["peer_gone"] = "rank 1: ranks [0] never sent 'verdict'"
    else:
        err = ""
        failing = {**_failing(record), "torch_compat_error": "RuntimeError: " + record}
        r0 = {"rank": 0, **before, "failing": failing}
    test = lambda: tt.test_a_rank_that_skips_an_moe_call_makes_the_other_fail_with_the_record(case)
    _check(monkeypatch, _result([r0, r1], err), test)
    # The record of a slower wait than the bound: wrong either way.
    slow = _wait_record(0, 2, mt.GOOD_FIRST + 1, sig, 1, waited=4.5)
    err = err.replace(record, slow)
    if not lost:
        r0 = {**r0, "failing": {**r0["failing"], "failure_record": slow}}
    _check(monkeypatch, _result([r0, r1], err), test, holds=False)


@pytest.mark.parametrize("lost", [False, True])
def test_the_handshake_timeout_test_at_eight_ranks_takes_either_outcome(monkeypatch, capsys, lost):
    from tests.gpu import test_topology as tp
    from tests.gpu.workers.native_mismatch import MATCHING, TIMEOUT_CASE_S

    seq = len(MATCHING) + 1
    matching = [dict(GOOD) for _ in MATCHING]
    before = {"handshake": True, "handshake_timeout_s": TIMEOUT_CASE_S, "matching": matching}
    before["device"] = 0
    ranks, err, printf = [], "", []
    for me in range(7):
        record = (
            f"jax_fusedar handshake failed on rank {me} of 8 (device 0), call #{seq}: "
            f"rank 7 did not make its call #{seq} {tp.SIG.format(1, 16, 'one-shot')} "
            f"within {TIMEOUT_CASE_S:.1f} s (the last call seen from it is #{seq - 1}); "
            f"a rank skipped or added a call, stopped, or created the workspace without "
            f"handshake. The handshake trapped, so this device's CUDA context is "
            f"unusable: restart the process."
        )
        printf.append(
            f"jax_fusedar handshake FAILED on rank {me} of 8 (device 0), call "
            f"#{seq}: rank 7 did not make its call"
        )
        if lost and me % 3 == 0:
            err += _watcher_lines(monkeypatch, capsys, record)
            ranks.append(_lost(me, before, lost_traps.GRACE_S + TIMEOUT_CASE_S + 0.5))
        else:
            ranks.append({"rank": me, **before, "failing": _failing(record)})
    healthy = {"failing": None, "healthy_after": True, "failure_record": ""}
    ranks.append({"rank": 7, **before, **healthy})
    res = {**_result(ranks, err), "printf_lines": printf}
    test = lambda: tp.test_a_rank_that_never_calls_times_out(8)
    _check(monkeypatch, res, test)
    # The rank that made no call must not have ended.
    ranks[7] = _lost(7, before, 20.0)
    _check(monkeypatch, {**res, "ranks": ranks}, test, holds=False)
