"""tests/report_guard.py: a failure whose source pytest cannot parse (CPython 3.11's SystemError,
gh-106905) is still reported as a failure; the run goes on and ends with its summary.

The inner run's conftest makes pytest's source lookup raise that SystemError the way CPython does
(the race needs a garbage collection inside ``ast.parse``, which a test cannot time)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PARSE_FAILS = """
import os

import _pytest._code.code as code

_real = code.TracebackEntry.getsource
_left = [int(os.environ["PARSES_THAT_FAIL"])]


def _parse(self, astcache=None):
    if _left[0] > 0:
        _left[0] -= 1
        raise SystemError("AST constructor recursion depth mismatch (before=129, after=146)")
    return _real(self, astcache)


code.TracebackEntry.getsource = _parse
"""

TESTS = """
def test_fails():
    assert 1 + 1 == 3


def test_after_it():
    assert True
"""


def _run(tmp_path: Path, parses_that_fail: int, *plugin: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "conftest.py").write_text(PARSE_FAILS)
    (tmp_path / "test_inner.py").write_text(TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PARSES_THAT_FAIL": str(parses_that_fail)}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin, str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False,
    )


def test_without_the_guard_the_run_ends_in_an_internal_error(tmp_path: Path) -> None:
    result = _run(tmp_path, 1)
    assert "INTERNALERROR> SystemError: AST constructor recursion depth mismatch" in result.stdout
    assert "1 failed" not in result.stdout  # the run ended without its summary


@pytest.mark.parametrize("parses_that_fail", [1, 100], ids=["once", "every time"])
def test_with_the_guard_the_failure_is_reported_and_the_run_goes_on(tmp_path: Path, parses_that_fail: int) -> None:
    result = _run(tmp_path, parses_that_fail, "-p", "tests.report_guard")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "INTERNALERROR" not in result.stdout
    assert "FAILED test_inner.py::test_fails - assert (1 + 1) == 3" in result.stdout
    assert "1 failed, 1 passed" in result.stdout
