"""Each GPU test's failure is written out the moment it fails, not only in pytest's summary: a
lane job cut short by its time limit (python -m tests.gpu.run_lane) still shows why its
finished tests failed. Under the lane runner the tests are ordered and grouped for xdist."""

import pytest

# Under xdist the controller writes every worker's reports to the log; a worker (its config has
# workerinput) writes none. Not $PYTEST_XDIST_WORKER: a pytest started in a worker inherits it.
_IS_XDIST_WORKER = False


def pytest_configure(config):
    global _IS_XDIST_WORKER
    _IS_XDIST_WORKER = hasattr(config, "workerinput")


def pytest_runtest_logreport(report):
    import sys

    if report.failed and not _IS_XDIST_WORKER:
        sys.stdout.write(
            f"\n==== failed now: {report.nodeid} ({report.when})\n{report.longreprtext}\n"
            f"==== end of {report.nodeid}\n"
        )
        sys.stdout.flush()


@pytest.hookimpl(trylast=True)  # after -m / -k have deselected what the lane leaves out
def pytest_collection_modifyitems(config, items):
    """Under run_lane ($JAX_FUSEDAR_LANE): the lane's tests longest first (idle workers take the
    long ones first), the tests of one module-scoped fixture in one xdist group."""
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
