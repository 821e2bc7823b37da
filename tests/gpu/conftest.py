"""Each GPU test's failure is written out the moment the test fails, not only in pytest's
summary at the end: a lane job that its time limit cuts short (python -m tests.gpu.run_lane)
still shows why its finished tests failed. Under the lane runner, the tests are ordered and
grouped for its xdist workers."""

import pytest


# Under xdist the controller gets every worker's reports and writes them to the log; a worker
# (its config has workerinput) writes none. Read from the config, not from
# $PYTEST_XDIST_WORKER, which a pytest started inside a worker inherits.
_IS_XDIST_WORKER = False


def pytest_configure(config):
    global _IS_XDIST_WORKER
    _IS_XDIST_WORKER = hasattr(config, "workerinput")


def pytest_runtest_logreport(report):
    import sys

    if not report.failed or _IS_XDIST_WORKER:
        return

    sys.stdout.write(
        f"\n==== failed now: {report.nodeid} ({report.when})\n{report.longreprtext}\n"
        f"==== end of {report.nodeid}\n"
    )
    sys.stdout.flush()


@pytest.hookimpl(trylast=True)  # after -m / -k have deselected what the lane leaves out
def pytest_collection_modifyitems(config, items):
    """Under python -m tests.gpu.run_lane ($JAX_FUSEDAR_LANE names the lane): the lane's tests
    longest first by their expected time, so that xdist's idle workers take the long ones
    first, and the tests of one module-scoped fixture in one xdist group (run_lane.schedule)."""
    import os

    lane = os.environ.get("JAX_FUSEDAR_LANE")
    if not lane:
        return
    from tests.gpu import run_lane

    by_id = {item.nodeid: item for item in items}
    order, groups = run_lane.schedule(list(by_id), run_lane.expected_times(lane))
    items[:] = [by_id[n] for n in order]
    for node, group in groups.items():
        by_id[node].add_marker(pytest.mark.xdist_group(group))
