"""Each GPU test's failure is written out the moment the test fails, not only in pytest's
summary at the end: a lane job that its time limit cuts short (python -m tests.gpu.run_lane)
still shows why its finished tests failed."""


def pytest_runtest_logreport(report):
    if not report.failed:
        return
    import sys

    sys.stdout.write(
        f"\n==== failed now: {report.nodeid} ({report.when})\n{report.longreprtext}\n"
        f"==== end of {report.nodeid}\n"
    )
    sys.stdout.flush()
