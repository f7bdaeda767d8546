"""`python -m examples.invoices.demo` on the embedded PostgreSQL (pgserver) exits 0 and its balances match."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_on_embedded_postgres_exits_0_with_matching_balances(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONSUMER_KIT_")}
    env["CONSUMER_KIT_EMBEDDED_DATA_DIR"] = str(tmp_path / "pgdata")
    env["COLUMNS"] = "160"
    env["PYTHONPATH"] = str(REPO)  # the demo is an example: it runs from the repository, not the core
    result = subprocess.run(
        [sys.executable, "-m", "examples.invoices.demo"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "all checks passed" in out
    assert "outbox events relayed: 5 (expected 5) ok" in out
    for customer, cents in (("acme", "3500"), ("globex", "4700"), ("initech", "300")):
        line = next(line for line in out.splitlines() if f" {customer} " in line)
        assert line.count(cents) == 2 and "yes" in line  # expected == actual
    for outcome in ("crashed", "duplicate", "payload_conflict", "invalid_json", "failed_retained"):
        assert outcome in out
