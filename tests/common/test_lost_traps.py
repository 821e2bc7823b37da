"""jax_fusedar/common/lost_traps.py: a rank whose failure record is set while its CUDA context
still looks healthy after the grace period ends its process (a trap the driver never
reported), and nothing else does."""

import gc
import subprocess
import sys

import pytest

from jax_fusedar.common import lost_traps
from tests.repo import REPO


class FakeRank:
    def __init__(self):
        self.record = ""

    def failure(self):
        return self.record


@pytest.fixture
def watched(monkeypatch):
    monkeypatch.setattr(lost_traps, "_watched", [])
    monkeypatch.setattr(lost_traps, "_thread", object())  # no background thread in tests
    return lost_traps._watched


def _pass(now, healthy=True):
    ended = []
    lost_traps.check_once(
        now, probe=lambda device: not healthy, end=lambda text, device: ended.append((text, device))
    )
    return ended


def test_a_record_on_a_healthy_context_ends_the_process_after_the_grace(watched):
    rank = FakeRank()
    lost_traps.watch(rank, 3)
    assert _pass(0.0) == []  # no record: nothing
    rank.record = "jax_fusedar call check failed on rank 1 of 2 ..."
    assert _pass(1.0) == []  # first seen
    assert _pass(1.0 + lost_traps.GRACE_S - 0.1) == []  # still within the grace
    assert _pass(1.0 + lost_traps.GRACE_S + 0.1) == [(rank.record, 3)]


def test_a_reported_trap_is_left_to_the_process(watched):
    rank = FakeRank()
    lost_traps.watch(rank, 0)
    rank.record = "jax_fusedar kernel wait timed out on rank 0 of 2 ..."
    assert _pass(0.0, healthy=False) == []
    assert _pass(lost_traps.GRACE_S + 1, healthy=False) == []  # the context failed: fine
    assert watched == []  # and it is watched no more
    assert _pass(10 * lost_traps.GRACE_S, healthy=True) == []


def test_freed_ranks_are_forgotten(watched):
    rank = FakeRank()
    lost_traps.watch(rank, 0)
    del rank
    gc.collect()
    assert _pass(0.0) == [] and watched == []


def test_ending_prints_the_record_and_exits_with_the_code():
    code = (
        "from jax_fusedar.common import lost_traps; "
        "lost_traps._end('jax_fusedar call check failed on rank 1 of 2: X', 0)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == lost_traps.EXIT_CODE, r
    assert r.stderr.startswith("jax_fusedar call check failed on rank 1 of 2: X\n"), r.stderr
    assert "has not reported the trap to this process (CUDA device 0" in r.stderr
    assert f"Ending the process with exit code {lost_traps.EXIT_CODE}." in r.stderr


def test_native_ranks_can_be_watched():
    """The watcher holds native ranks by weak reference (it must not keep their GPU memory
    alive), so the extension's Rank type must allow them."""
    from jax_fusedar.common import native

    if native.ext is None:
        pytest.skip("the native extension is not built (./dev setup)")
    assert native.ext.Rank.__weakrefoffset__ > 0
