"""A bounded chaos run in CI (~55-70 s on 2 cores): 45 s of kills with an 8-s read-only window and
a poison message; see tests/system/chaos/run.py for what it does and checks.

The long run is documented there: ``python -m tests.system.chaos.run --seed 7 --duration 600`` (a 70-s
read-only window).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.adapters.contract.nats_driver import nats_url  # noqa: F401 - fixture

ROOT = Path(__file__).resolve().parents[3]

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


def _missing(*, rabbitmqctl: bool = True) -> str | None:
    if rabbitmqctl and not shutil.which("rabbitmqctl"):
        return "rabbitmqctl is not on PATH (the chaos run creates a vhost and closes connections with it)"
    for tool in ("consumer-kit", "outbox-relay"):
        if not (shutil.which(tool) or Path(sys.executable).with_name(tool).exists()):
            return f"{tool} is not installed (pip install -e .)"
    return None


@pytest.mark.parametrize("batch", ["1", "10"], ids=["per-delivery", "batches-of-10"])
def test_bounded_chaos_run(database_url: str, rabbitmq_url: str, tmp_path: Path, batch: str) -> None:
    reason = _missing()
    if reason:
        pytest.skip(reason)
    _run_and_check(database_url, rabbitmq_url, tmp_path, batch)


@pytest.mark.parametrize("batch", ["1", "10"], ids=["per-delivery", "batches-of-10"])
def test_bounded_chaos_run_on_nats(database_url: str, nats_url: str, tmp_path: Path, batch: str) -> None:  # noqa: F811 - fixture
    """The same run on NATS JetStream, only the broker URL changed (``ack_wait=10``: a killed
    worker's deliveries come back within the drain)."""
    reason = _missing(rabbitmqctl=False)
    if reason:
        pytest.skip(reason)
    _run_and_check(database_url, f"{nats_url}?ack_wait=10", tmp_path, batch)


def _run_and_check(database_url: str, broker_url: str, tmp_path: Path, batch: str = "1") -> None:
    duration = os.environ.get("CK_CHAOS_DURATION", "45")
    window = os.environ.get("CK_CHAOS_READ_ONLY_WINDOW", "8")
    summary_file = tmp_path / "summary.json"
    result = subprocess.run(
        [sys.executable, "-m", "tests.system.chaos.run", "--seed", os.environ.get("CK_CHAOS_SEED", "7"),
         "--duration", duration, "--rate", "15", "--drain-timeout", "60",
         "--read-only-window", window, "--poison-copies", "2", "--batch", batch,
         "--database-url", database_url, "--broker-url", broker_url,
         "--logdir", str(tmp_path / "logs"), "--summary-json", str(summary_file)],
        cwd=ROOT, capture_output=True, text=True, timeout=float(duration) + 150,
    )
    print(result.stdout)
    assert summary_file.exists(), result.stderr[-3000:]
    summary = json.loads(summary_file.read_text())
    assert summary["violations"] == [], summary["violations"]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert summary["operations"] > 100
    assert summary["effects"] == summary["operations"]
    assert summary["worker_kills"] + summary["relay_kills"] >= 5
    assert summary["lost"] == summary["applied_twice"] == 0
    assert summary["dead_lettered"] == summary["expected_dead_letters"]
    assert summary["events_received"] == summary["outbox_events"] == summary["operations"]
    # the read-only window paused workers, and they resumed on their own (the run drained)
    assert summary["read_only_seconds"] >= float(window)
    assert summary["worker_pauses_logged"] >= 1
    # the poison: parked as crashed_worker after crash_limit deaths alone, no effect; nothing
    # healthy dead-lettered
    assert summary["poison_parked"] is True
    assert summary["poison_copies"] == 2
    assert summary["poison_crashes"] >= 3
    assert summary["poison_effects"] == 0
    assert summary["healthy_dead_lettered"] == 0
    assert summary["worker_exits"] >= 3  # the poison's own deaths, restarted by the run
    # relays survive kills, terminated backends and the read-only window without crashing
    assert summary["relay_exits"] == 0
    assert summary["relay_tracebacks"] == 0 and summary["worker_tracebacks"] == 0
