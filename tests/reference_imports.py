"""A pytest plugin (conftest.py loads it): a test or module that cannot import what it
compares against fails instead of skipping. pytest.importorskip("torch") skips, and a
parity test that skips passes CI having proven nothing; every reference is a test
dependency (setup.cfg), so a missing one is a broken environment.
MSINFER_ALLOW_MISSING_REFERENCES=1 skips them, knowingly (a developer without torch)."""
import os

import pytest

ALLOW = "MSINFER_ALLOW_MISSING_REFERENCES"


def _import_skip_message(report):
    """importorskip's message when `report` is its skip (and skipping is not allowed)."""
    if not report.skipped or os.environ.get(ALLOW):
        return None
    longrepr = report.longrepr
    message = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return message if "could not import" in message else None


def _fail(report, message):
    report.outcome = "failed"
    report.longrepr = (f"{message.removeprefix('Skipped: ')}: a reference this test compares "
                       f"against is missing (install the test dependencies, setup.cfg; "
                       f"{ALLOW}=1 skips instead)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    message = _import_skip_message(report)
    if message:
        _fail(report, message)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    report = (yield).get_result()
    message = _import_skip_message(report)
    if message:
        _fail(report, message)
