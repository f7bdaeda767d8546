"""A pytest hook that keeps a failure's report from ending the whole run on CPython 3.11 before
3.11.8 (tests/conftest.py imports it; tests/test_report_guard.py shows it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    """Report a failure even when CPython 3.11 (before 3.11.8) refuses to parse its source.

    On those versions ``ast.parse`` in pytest's traceback raises ``SystemError: AST constructor
    recursion depth mismatch`` when a nested parse runs during it (a garbage-collected object's
    finalizer formatting a traceback: gh-106905, fixed by python/cpython#113476). pytest turns that
    into an INTERNALERROR that ends the whole run without its summary. Built again, the report
    almost always parses; if not, it is built in Python's own traceback style."""
    try:
        return (yield)
    except SystemError as error:
        if "recursion depth mismatch" not in str(error):
            raise
    try:
        return pytest.TestReport.from_item_and_call(item, call)
    except SystemError as error:
        if "recursion depth mismatch" not in str(error):
            raise
    item.config.option.tbstyle = "native"
    return pytest.TestReport.from_item_and_call(item, call)
