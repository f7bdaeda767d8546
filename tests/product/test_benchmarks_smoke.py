"""Smoke run of the benchmarks (``python -m benchmarks run --smoke``): a few hundred messages
through every scenario except the relay (plus a 2,000-row relay drain and a 2-process scale-out
round); checks that the files exist and carry numbers.
Figures are not asserted. Needs PostgreSQL, RabbitMQ, Redis and the ``bench`` extra."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.postgres, pytest.mark.rabbitmq, pytest.mark.slow]


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), 2):
            return True
    except OSError:
        return False


def _skip_or_fail(why: str) -> None:
    if os.environ.get("CONSUMER_KIT_REQUIRE_SERVICES") == "1":
        pytest.fail(why)
    pytest.skip(why)


def test_smoke_run_writes_results_report_and_charts(tmp_path: Path) -> None:
    for name, port in (("PostgreSQL", 5432), ("RabbitMQ", 5672), ("NATS", 4222)):
        if not _answers(port):
            _skip_or_fail(f"{name} does not answer on 127.0.0.1:{port}")
    # Redis and the bench extra are the benchmark's own needs, not the test suite's: without them
    # this test skips even where services are required (CI must install '.[bench]' and start Redis).
    if not _answers(6379):
        pytest.skip("Redis does not answer on 127.0.0.1:6379 (Powertools peer): start redis-server")
    for module in ("aws_lambda_powertools", "redis", "matplotlib", "psutil", "boto3", "faststream.nats"):
        try:
            __import__(module)
        except ImportError:
            pytest.skip(f"{module} missing: pip install -e '.[bench]'")

    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "run", "--smoke", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,  # a bound against a hang, not a speed goal (the loaded 2-core CI takes ~2 min)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    results = json.loads((tmp_path / "results.json").read_text())
    scenarios = results["scenarios"]
    idem = scenarios["idempotency"]["by_concurrency"]["8"]
    for variant in ("naive", "ck", "powertools"):
        assert isinstance(idem[variant]["median"], float), (variant, idem)
    assert isinstance(scenarios["idempotency"]["duplicate"]["ratio"]["median"], float)
    for size in scenarios["ledger"]["sizes"].values():
        assert isinstance(size["ratio_to_empty"]["median"], float), size
    assert all(isinstance(r["tps"], float) for r in scenarios["pgbench"]["runs"].values())
    assert isinstance(scenarios["memory"]["worker"]["peak_rss_mb"], float)
    for variant in ("ck", "powertools"):
        assert isinstance(scenarios["crash"][variant]["lost"], int)
        assert isinstance(scenarios["crash"][variant]["applied_more_than_once"], int)

    for variant in ("naive", "ck", "powertools"):  # client CPU per delivery in every row
        assert isinstance(scenarios["idempotency"]["by_concurrency"]["8"]["cpu_us"][variant]["median"], float)
    batch = scenarios["batch"]["c8_b10"]
    for variant in ("naive", "naive_batch", "ck_batch"):
        assert isinstance(batch[variant]["median"], float) and isinstance(batch["cpu_us"][variant]["median"], float)
    nats = scenarios["nats_batch"]["c8_b10"]  # FastStream's batch subscriber beside consumer-kit's, on NATS
    for variant in ("faststream_nats_batch", "ck_nats_batch"):
        assert isinstance(nats[variant]["median"], float), (variant, nats.get("errors"))
    for run in scenarios["drain"]["runs"].values():  # relay drain under stale statistics
        assert run["pending_after"] == 0 and isinstance(run["rows_per_s"], int), run.get("error", run)
    assert isinstance(scenarios["scaleout"]["by_processes"]["2"]["ratio_ck_naive"]["median"], float)

    report = (tmp_path / "REPORT.md").read_text()
    assert "Cost of idempotency" in report and "| 8 |" in report
    assert (tmp_path / "idempotency.png").stat().st_size > 1000
