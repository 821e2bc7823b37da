"""jax_fusedar/common/lost_traps.py: a rank whose failure record is set while its CUDA context
still looks healthy after the grace period ends its process (a trap the driver never
reported), and nothing else does."""

import gc
import subprocess
import sys

import pytest

from jax_fusedar.common import lost_traps
from tests.repo import REPO, run_code


class FakeRank:
    """A native Rank's record, and as it behaves once destroyed: ``alive`` False and its record
    no longer readable (a native rank's record lives in memory its destroy frees)."""

    def __init__(self):
        self.record, self.alive = "", True

    def destroy(self):
        self.alive = False

    def failure(self):
        if not self.alive:
            raise ValueError("this workspace rank was destroyed")
        return self.record


@pytest.fixture
def watched(monkeypatch):
    monkeypatch.setattr(lost_traps, "_watched", [])
    monkeypatch.setattr(lost_traps, "_thread", object())  # no background thread in tests
    return lost_traps._watched


def _pass(now, healthy=True):
    ended = []
    end = lambda text, device: ended.append((text, device))
    lost_traps.check_once(now, probe=lambda device: not healthy, end=end)
    return ended


def _watch(device):
    rank = FakeRank()
    lost_traps.watch(rank, device)
    return rank


def test_a_record_on_a_healthy_context_ends_the_process_after_the_grace(watched):
    rank = _watch(3)
    assert _pass(0.0) == []  # no record: nothing
    rank.record = "jax_fusedar handshake failed on rank 1 of 2 ..."
    assert _pass(1.0) == []  # first seen
    assert _pass(1.0 + lost_traps.GRACE_S - 0.1) == []  # still within the grace
    assert _pass(1.0 + lost_traps.GRACE_S + 0.1) == [(rank.record, 3)]


def test_a_reported_trap_is_left_to_the_process(watched):
    rank = _watch(0)
    rank.record = "jax_fusedar kernel wait timed out on rank 0 of 2 ..."
    assert _pass(0.0, healthy=False) == []
    assert _pass(lost_traps.GRACE_S + 1, healthy=False) == []  # the context failed: fine
    assert watched == []  # and it is watched no more
    assert _pass(10 * lost_traps.GRACE_S, healthy=True) == []


def test_freed_ranks_are_forgotten(watched):
    _watch(0)  # no reference kept
    gc.collect()
    assert _pass(0.0) == [] and watched == []


def test_a_rank_destroyed_after_its_record_was_seen_is_ended_with_that_record(watched):
    rank = _watch(1)
    rank.record = "jax_fusedar kernel wait timed out on rank 1 of 2: rank 0 did not arrive"
    assert _pass(0.0) == []  # seen
    rank.destroy()  # e.g. the workspace's destroy, which then waits on the stream
    assert _pass(lost_traps.GRACE_S - 0.1) == []
    assert _pass(lost_traps.GRACE_S + 0.1) == [(rank.record, 1)]


def test_a_rank_destroyed_before_any_record_is_forgotten(watched):
    rank = _watch(0)
    assert _pass(0.0) == []
    rank.destroy()
    assert _pass(1.0) == [] and watched == []


def test_ending_prints_the_record_and_exits_with_the_code():
    code = (
        "from jax_fusedar.common import lost_traps; "
        "lost_traps._end('jax_fusedar handshake failed on rank 1 of 2: X', 0)"
    )
    r = run_code(code, timeout=120)
    assert r.returncode == lost_traps.EXIT_CODE, r
    assert r.stderr.startswith("jax_fusedar handshake failed on rank 1 of 2: X\n"), r.stderr
    assert "has not reported the trap to this process (CUDA device 0" in r.stderr
    assert f"Ending the process with exit code {lost_traps.EXIT_CODE}." in r.stderr


def test_native_ranks_can_be_watched():
    # The watcher holds native ranks by weak reference (it must not keep their GPU memory
    # alive), so the extension's Rank type must allow them.
    from jax_fusedar.common import native

    if native.ext is None:
        pytest.skip("the native extension is not built (./dev setup)")
    assert native.ext.Rank.__weakrefoffset__ > 0


# The watcher in a process of its own: a record on a healthy context (the probe stands in for
# CUDA), stderr made unusable in one of three ways before the watcher ends the process.
UNUSABLE_STDERR = """
import os, sys, time
from jax_fusedar.common import lost_traps, native
class HealthyContext:  # the probe's CUDA call succeeds: the trap was never reported
    mem_info = staticmethod(lambda device: (1 << 30, 1 << 30))
class Rank:
    failure = lambda self: "jax_fusedar handshake failed on rank 1 of 2: X"
native.ext = HealthyContext
lost_traps.GRACE_S, lost_traps.POLL_S = 0.5, 0.1
mode = sys.argv[1]
if mode == "closed":
    sys.stderr.close()
    os.close(2)
elif mode == "none":  # as in a process started without a console
    sys.stderr = None
rank = Rank()
lost_traps.watch(rank, 0)
time.sleep(120)
sys.exit(0)
"""


@pytest.mark.parametrize("mode", ["usable", "closed", "none", "broken-pipe"])
def test_the_watcher_ends_the_process_whatever_stderr_is(mode):
    p = subprocess.Popen(
        [sys.executable, "-c", UNUSABLE_STDERR, mode],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    if mode == "broken-pipe":
        p.stderr.close()  # the reader is gone: the watcher's write raises BrokenPipeError
    try:
        code = p.wait(timeout=30)  # the end comes lost_traps.GRACE_S_S (0.5 s) after the record
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        pytest.fail(f"stderr {mode}: the watcher never ended the process")
    finally:
        if p.stderr and not p.stderr.closed:
            p.stderr.close()
    assert code == lost_traps.EXIT_CODE
