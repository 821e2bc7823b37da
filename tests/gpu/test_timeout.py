"""GPU: the kernel's bounded waits (timeout_s, always on; ffi/core/watchdog.h), each case in a
fresh child (tests/gpu/case_runs.py): a trapped kernel kills its process's CUDA context. A
failing rank raises with the record, or, where the driver never reports its trap (ranks
sharing a GPU), lost_traps ends it with the record on stderr: both held to the same checks.
"""

import re

import pytest

from jax_fusedar.common import launch_mode
from tests.gpu.case_runs import checked_case, host_slack_s, lost_trap_record
from tests.gpu.harness import world_params
from tests.gpu.workers import jax_timeout, moe_timeout as mt, native_timeout as nt

pytestmark = pytest.mark.gpu


# A dense call's signature in a record: tokens, then the algorithm (one-shot, two-shot or
# large-message).
SIG = (
    "{{pattern=1 dtype=bfloat16 num_tokens={} hidden_dim=4096 {} fp32_acc=1 layout=0 "
    "block_quant_group_size=0}}"
)
MOE_SIG = (
    "{{pattern={} dtype=bfloat16 num_tokens={} hidden_dim={} one-shot fp32_acc=0 "
    "layout=0 block_quant_group_size=0}}"
)
LAMPORT_WAIT = "its one-shot data in this rank's Lamport buffer (token "


def test_timeout_on_gives_the_same_bits_graph_replay_and_cost():
    res = checked_case("timeout_ok", "native_timeout", "ok", timeout_s=400)
    for r in res["ranks"]:
        assert r["timeout_s"] == pytest.approx(3.0) and r["off_timeout_s"] == 0.0
        b = r["bits"]
        assert b["calls"] == nt.same_bits_calls() and b["differing_bytes"] == 0, b
        _check_good(b["worst"], nt.BOUNDS, r["rank"])
        g = r["graph"]
        assert g["capture_errors"] is None, g
        assert g["worst"]["residual"] <= 1.0 and g["worst"]["norm"] <= 3.0, g
        assert r["failure_record"] == ""
    ms = {k: [r[f"timing_{k}"]["ms_per_call_median"] for r in res["ranks"]] for k in ("on", "off")}
    print("per-call ms (median), timeout on:", ms["on"], "off:", ms["off"])


def _record_head(me, world):
    return f"jax_fusedar kernel wait timed out on rank {me} of {world} (device "


def _check_record(record, me, peer, seq, sig, timeout_s, where, world=2):
    """A wait-timeout record (ffi/core/handshake.cu) of rank `me`'s call #seq (`sig`; None:
    not checked) that waited about `timeout_s` for `peer` to deliver `where`."""
    assert record.startswith(_record_head(me, world)), record
    if sig is not None:
        assert f"call #{seq} {sig}: waited " in record, record
    assert f"for rank {peer} to deliver {where}" in record, record
    assert f"Rank {peer} did not arrive" in record, record
    waited, limit = map(
        float, re.search(r": waited (\S+) s \(timeout (\S+) s\) for ", record).groups()
    )
    assert limit == timeout_s and timeout_s * 0.9 <= waited <= timeout_s + 1.0, record


def _check_failed(res, r, peer, seq, sig, timeout_s, where, world=2):
    """Rank result `r`'s call #seq timed out waiting for `peer`, with the record raised (the
    next launch refused with it) or on stderr; returns the failing call (None: ended)."""
    me = r["rank"]
    if "exitcode" in r:
        record = lost_trap_record(res, r, _record_head(me, world), record_within_s=timeout_s + 1.0)
        _check_record(record, me, peer, seq, sig, timeout_s, where, world)
        return None
    f = r["failing"]
    assert f["sync_error"], f"rank {me}: the call did not fail: {f}"
    # within timeout + 1 s (later on a GPU time-sliced with other work: case_runs.host_slack_s),
    # and not before the timeout (not for another reason)
    assert timeout_s * 0.9 <= f["elapsed_s"] <= timeout_s + 1.0 + host_slack_s(world), f
    _check_record(f["failure_record"], me, peer, seq, sig, timeout_s, where, world)
    assert f["relaunch_error"] and f["failure_record"] in f["relaunch_error"], f
    return f


def _seen(r):
    """What rank result `r` checked before its failing call (noted, where the process ended)."""
    return r["notes"] if "exitcode" in r else r


def _check_good(errors, bounds, rank):
    for k, v in errors.items():
        assert v <= bounds[k], (rank, k, v)  # NaN fails too


def _check_untouched(r):
    """The rank that made no call did not end and stays healthy."""
    assert "exitcode" not in r, f"the rank that made no call ended: {r}"
    assert r["healthy_after"] is True and r["failure_record"] == "", r


def _check_timed_out(res, r, peer, seq, sig, where, world=2):
    """Rank result `r` of tests.gpu.workers.native_timeout: its good calls within the bounds,
    then its call #seq's wait for `peer` timed out (_check_failed)."""
    _check_good(_seen(r)["good"], nt.BOUNDS, r["rank"])
    return _check_failed(res, r, peer, seq, sig, nt.TIMEOUT_S, where, world)


# (case, tokens, one-shot, the wait that times out) of the missing-rank cases
NEVER_ONESHOT = ("never_oneshot", 16, True, LAMPORT_WAIT)
MISSING_CASES = (
    NEVER_ONESHOT,
    ("never_twoshot", 32, False, "its two-shot barrier flag (thread block "),
    ("killed", 16, True, LAMPORT_WAIT),
)


@pytest.mark.parametrize(
    "case, tokens, oneshot, where, world",
    [
        *[pytest.param(*c, 2, id=f"{c[0]}-world2") for c in MISSING_CASES],
        *world_params(worlds=(4, 8), before=NEVER_ONESHOT, id="never_oneshot-{}"),
    ],
)
def test_a_missing_rank_makes_the_other_fail_with_the_record(case, tokens, oneshot, where, world):
    """The last rank makes no call (or is killed): every other rank fails naming it."""
    res = checked_case(
        f"timeout_{case}_world{world}", "native_timeout", case, str(world), timeout_s=200
    )
    *callers, missing = res["ranks"]
    assert len(callers) == world - 1
    sig = SIG.format(tokens, "one-shot" if oneshot else "two-shot")
    for r in callers:
        _check_timed_out(res, r, world - 1, nt.GOOD_FIRST + 1, sig, where, world)
    if case == "killed":
        assert missing["exitcode"] == -9, missing  # SIGKILL, no result
    else:
        _check_untouched(missing)


def test_a_rank_missing_from_a_large_message_call_makes_the_other_fail_with_the_record():
    """Above the auto crossover (the large-message algorithm): after one good large-message
    call rank 1 makes no call; rank 0's entry-flag wait must time out naming rank 1."""
    res = checked_case("timeout_never_large", "native_timeout", "never_large", timeout_s=300)
    r0, r1 = res["ranks"]
    _check_untouched(r1)
    for r in (_seen(r0), r1):
        assert r["algorithm"] == launch_mode.ALGORITHM_LARGE_MESSAGE, r["algorithm"]
        _check_good({**r["good"], **r["good_large"]}, nt.BOUNDS, r["rank"])
    assert r1["expected_call"] == nt.GOOD_FIRST + 2
    # The record's call number counts every fused call (3 good, 1 good large, this one);
    # the detail is the large-message call number (the good one was 1).
    sig = SIG.format(nt.LARGE_TOKENS, "large-message")
    where = "its large-message entry flag (large-message call 2 of this rank)"
    f = _check_failed(res, r0, 1, nt.GOOD_FIRST + 2, sig, nt.TIMEOUT_S, where)
    if f is not None:
        assert r0["expected_call"] == nt.GOOD_FIRST + 2
        assert f["algorithm"] == launch_mode.ALGORITHM_LARGE_MESSAGE, f


def test_mismatched_token_counts_without_the_handshake_fail_on_both_ranks():
    """Both ranks time out at the same moment, each naming the other."""
    res = checked_case("timeout_tokens", "native_timeout", "tokens", timeout_s=200)
    for r in res["ranks"]:
        me = r["rank"]
        _check_timed_out(
            res, r, 1 - me, nt.GOOD_FIRST + 1, SIG.format(16 + me, "one-shot"), LAMPORT_WAIT
        )


def test_jax_surfaces_the_timeout_with_the_record():
    """Rank 1 stops calling; rank 0's jitted call raises with the record naming rank 1."""
    timeout_s = jax_timeout.TIMEOUT_S
    res = checked_case("timeout_jax", "jax_timeout", timeout_s=240)
    r0, r1 = res["ranks"]
    for r in (_seen(r0), r1):
        assert r["backend"] == "trtllm" and r["timeout_s"] == timeout_s, r
        assert r["good"]["residual"] <= 1.0 and r["good"]["norm"] <= 3.0, r
    assert r1["failures"] == [], r1  # rank 1 made no failing call
    if "exitcode" in r0:  # rank 0's trap was never reported: the watcher ended it
        # Rank 1 heard nothing from rank 0 and reported before rank 0 ended.
        assert r1["rank0_partial"] is None and "rank0_silent" in r1, r1
        _check_failed(res, r0, 1, None, None, timeout_s, LAMPORT_WAIT)
        return
    f = r0["failing"]
    assert r1["rank0_partial"] is not None, r1
    assert len(f["failures"]) == 1 and "Rank 1 did not arrive" in f["failures"][0], f
    _check_record(f["failures"][0], 0, 1, None, None, timeout_s, LAMPORT_WAIT)
    # The computation raised XLA's generic CUDA error, re-raised with the record's text.
    assert f["error"] == "RuntimeError: " + f["failures"][0][: 1500 - 14], f
    assert "CUDA" in f["xla_error"], f
    assert "waited 3.0 s (timeout 3.0 s) for rank 1" in f["failures"][0], f
    # The kernel traps at the timeout: its record is in host memory (ws.failures()) within
    # timeout + 1 s. XLA then takes longer than torch to report the dead stream: the raise came
    # 1.41 s after the record on one H200 (record 3.004 s, raise 4.414 s), 4.3 s in all on
    # 2 x H200; torch raises at 3.4-3.6 s.
    t = f["timeline_s"]
    assert t["dispatched"] < 1.0 and t["record"] <= timeout_s + 1.0, f
    assert f["elapsed_s"] <= timeout_s + 2.0 + host_slack_s(2), f
    assert f["raise_if_failed"] == f["failures"][0], f
    assert f["next_call_error"], f  # XLA refuses the dead context before our handler runs


# Both MoE kernels poll this rank's Lamport buffer (pattern 7 after the build's fix of
# FlashInfer's peer-buffer race, docs/moe.md): both cases fail in LAMPORT_WAIT.
@pytest.mark.parametrize("case", ["never_finalize", "never_reduction"])
def test_a_rank_that_skips_an_moe_call_makes_the_other_fail_with_the_record(case):
    """Rank 1 skips an MoE call: rank 0 fails with the record naming rank 1."""
    res = checked_case(f"timeout_moe_{case}", "moe_timeout", case, timeout_s=200)
    r0, r1 = res["ranks"]
    for r in (_seen(r0), r1):
        assert r["timeout_s"] == pytest.approx(mt.TIMEOUT_S), r
        for errors in r["good"]:  # fractions of the float64 oracle's bounds (NaN fails)
            assert all(e <= 1.0 for e in errors), (r["rank"], r["good"])
    sig = MOE_SIG.format(mt.CASES[case], mt.TOKENS, mt.HIDDEN)
    f = _check_failed(res, r0, 1, mt.GOOD_FIRST + 1, sig, mt.TIMEOUT_S, LAMPORT_WAIT)
    if f is not None:
        # torch_compat refuses the next call with the record too (not CUDA's generic error).
        assert f["torch_compat_error"] and f["failure_record"] in f["torch_compat_error"], f
    _check_untouched(r1)


def test_destroy_waits_without_the_gil_and_keeps_the_record():
    """Rank 0 destroys its workspace during a call rank 1 never joins: the destroy waits for
    the timeout with the GIL released (a Python thread, and the lost-trap watcher, keep
    running), and the record stays readable after it."""
    res = checked_case("timeout_destroy_waits", "native_timeout", "destroy_waits", timeout_s=200)
    r0, r1 = res["ranks"]
    _check_untouched(r1)
    sig = SIG.format(16, "one-shot")
    if "exitcode" in r0:  # the trap was never reported: the watcher ended the destroy's wait
        _check_timed_out(res, r0, 1, nt.GOOD_FIRST + 1, sig, LAMPORT_WAIT)
        return
    _check_good(r0["good"], nt.BOUNDS, 0)
    d = r0["destroy"]
    # The destroy waited for the timeout, and the thread ran through at least half of it.
    assert nt.TIMEOUT_S * 0.9 <= d["destroy_s"] <= nt.TIMEOUT_S + 1.0 + host_slack_s(2), d
    assert d["ticks"] >= 0.5 * d["destroy_s"] / nt.TICK_S, d
    assert d["destroy_error"], d  # the trapped call's CUDA error, reported by destroy
    assert d["alive_after"] is False
    _check_record(
        d["failure_after_destroy"], 0, 1, nt.GOOD_FIRST + 1, sig, nt.TIMEOUT_S, LAMPORT_WAIT
    )
