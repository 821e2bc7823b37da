"""GPU: the cross-rank handshake and the "mixed" topology, each case in a fresh child
(tests/gpu/case_runs.py): a trapped handshake kills its process's CUDA context."""

import pytest

from tests.gpu.case_runs import checked_case, host_slack_s, lost_trap_record
from tests.gpu.harness import gpu_count, world_params
from tests.gpu.workers import native_mismatch as nm

pytestmark = pytest.mark.gpu


SIG = (
    "{{pattern={} dtype=bfloat16 num_tokens={} hidden_dim=4096 {} fp32_acc=1 layout=0 "
    "block_quant_group_size=0}}"
)


def _check_matching(r):
    """The matching calls each case makes first (check on) stayed within the bounds."""
    assert r["handshake"] is True, r
    assert len(r["matching"]) == len(nm.MATCHING)
    for e in r["matching"]:
        for k, bound in nm.BOUNDS.items():
            if k in e:
                assert e[k] <= bound, (r["rank"], e)  # NaN fails too


def _plain_ok(w):
    return w["residual"] <= 1.0 and w["norm"] <= 3.0


@pytest.mark.parametrize("world", world_params())
def test_handshake_matching_calls_graph_replay_and_cost(world):
    res = checked_case(
        f"handshake_ok_world{world}", "native_mismatch", "ok", str(world), timeout_s=170
    )
    ranks = res["ranks"]
    assert not res["printf_lines"], res["printf_lines"]
    for r in ranks:
        _check_matching(r)
        assert r["off_handshake"] is False
        for k, v in r["off_worst"].items():
            assert v <= nm.BOUNDS[k], ("check off", r["rank"], k, v)
        g = r["graph"]
        assert g["capture_errors"] is None and _plain_ok(g["worst"]), g
        for t in ("timing_on", "timing_off"):
            assert _plain_ok(r[t]["last_call"]), r[t]
        assert r["failure_record"] == ""
    # Same bits on every rank, and with the check on or off.
    assert {r["digest"] for r in ranks} == {ranks[0]["off_digest"]}
    ms = {k: [r[f"timing_{k}"]["ms_per_call_median"] for r in ranks] for k in ("on", "off")}
    print("handshake cost (ms per call, median): on", ms["on"], "off", ms["off"])


def _sig(pattern, tokens, oneshot):
    return SIG.format(pattern, tokens, "one-shot" if oneshot else "two-shot")


@pytest.mark.parametrize(
    "case", ["tokens", *(pytest.param(c, marks=pytest.mark.slow) for c in ("pattern", "oneshot"))]
)
def test_mismatched_calls_fail_instead_of_hanging(case):
    """Both ranks detect the mismatch and trap (raising the record, or ended by lost_traps
    with it on stderr), well before any timeout."""
    res = checked_case(f"handshake_{case}", "native_mismatch", case, timeout_s=170)
    assert res["wall_s"] < 90, res["wall_s"]  # bounded: no rank waits for a timeout
    seq = len(nm.MATCHING) + 1
    for r in res["ranks"]:
        me, peer = r["rank"], 1 - r["rank"]
        seen = r["notes"] if "exitcode" in r else r  # noted, where the watcher ended it
        mine, theirs = _sig(*nm.failing_call_of(case, me)), _sig(*nm.failing_call_of(case, peer))
        expected = (
            f"jax_fusedar handshake failed on rank {me} of 2 (device {seen['device']}), "
            f"call #{seq}: rank {peer} called {theirs} but rank {me} called {mine}"
        )
        _check_matching(seen)
        # Either way detected as a mismatch, well before the timeout would have fired.
        if "exitcode" in r:
            lost_trap_record(res, r, expected, record_within_s=nm.MISMATCH_TIMEOUT_S / 2)
            continue
        f = r["failing"]
        assert f["sync_error"], f"rank {me}: the mismatched call did not fail: {f}"
        assert f["elapsed_s"] < nm.MISMATCH_TIMEOUT_S / 2, f
        assert f["failure_record"].startswith(expected), (expected, f["failure_record"])
        assert f["relaunch_error"] and expected in f["relaunch_error"], f
    # The device's own message reached stdout (one per rank; output buffered in the child).
    assert res["printf_lines"], "no device printf output captured\n" + res["output_tail"]
    joined = "\n".join(res["printf_lines"])
    for r in res["ranks"]:
        assert f"FAILED on rank {r['rank']} of 2" in joined, joined


@pytest.mark.parametrize("world", world_params())
def test_a_rank_that_never_calls_times_out(world):
    """The last rank makes no call: every other rank's handshake times out naming it."""
    res = checked_case(
        f"handshake_timeout_world{world}", "native_mismatch", "timeout", str(world), timeout_s=170
    )
    *callers, missing = res["ranks"]
    seq = len(nm.MATCHING) + 1
    expected = (
        f"rank {world - 1} did not make its call #{seq} "
        f"{SIG.format(1, 16, 'one-shot')} within {nm.TIMEOUT_CASE_S:.1f} s (the last call "
        f"seen from it is #{seq - 1})"
    )
    for r in callers:
        seen = r["notes"] if "exitcode" in r else r
        _check_matching(seen)
        assert seen["handshake_timeout_s"] == pytest.approx(nm.TIMEOUT_CASE_S), r
        if "exitcode" in r:  # its trap was never reported: the watcher ended the process
            head = f"jax_fusedar handshake failed on rank {r['rank']} of {world} "
            record = lost_trap_record(res, r, head, record_within_s=nm.TIMEOUT_CASE_S + 12)
            assert expected in record, (expected, record)
        else:
            f = r["failing"]
            assert f["sync_error"], f
            slack = host_slack_s(world)
            assert nm.TIMEOUT_CASE_S * 0.9 <= f["elapsed_s"] <= nm.TIMEOUT_CASE_S + 12 + slack, f
            assert expected in f["failure_record"], f["failure_record"]
            assert f["relaunch_error"] and "did not make its call" in f["relaunch_error"], f
        assert any(
            f"on rank {r['rank']} of {world}" in line and "did not make its call" in line
            for line in res["printf_lines"]
        ), res["output_tail"]
    # The rank that made no call is untouched.
    assert "exitcode" not in missing, f"the rank that made no call ended: {missing}"
    _check_matching(missing)
    assert missing["failing"] is None and missing["healthy_after"] is True
    assert missing["failure_record"] == ""


def test_mixed_topology_four_ranks_two_processes_two_gpus():
    if gpu_count() < 2:
        pytest.skip("needs 2 GPUs")
    res = checked_case("mixed_topology", "native_mixed", timeout_s=170)
    procs = res["processes"]
    assert [p["local_tp_ranks"] for p in procs] == [[0, 1], [2, 3]]
    assert procs[0]["paths"]["0"] == {"1": "pointers", "2": "ipc", "3": "ipc"}
    assert procs[1]["paths"]["3"] == {"0": "ipc", "1": "ipc", "2": "pointers"}
    for mode in ("off", "on"):
        for p in procs:
            assert _plain_ok(p["calls"][mode]["worst"]), (mode, p["process"], p["calls"][mode])
        # All four ranks hold the same bits, call by call.
        digests = [p["calls"][mode]["digests"] for p in procs]
        for i, (d0, d1) in enumerate(zip(*digests)):
            assert len(set(d0.values()) | set(d1.values())) == 1, (mode, i, d0, d1)
    for p in procs:
        assert p["failure_records"] == ["", ""]
        for d in ("0", "1"):
            # The workspaces took the memory they should, and gave it back.
            assert p["drop_mib"][d] >= 0.9 * p["expected_drop_mib"], p
            assert abs(p["leak_mib"][d]) <= 64, p
    assert not res["printf_lines"], res["printf_lines"]
