"""A process frozen inside a delivery's transaction (SIGSTOP, a paused VM) no longer holds its
claim for ever: consumer-kit's sessions carry ``idle_in_transaction_session_timeout``
(``Settings.idle_in_transaction_timeout``), so PostgreSQL ends the frozen session, its row lock
goes, another worker executes the operation once, and the frozen one, woken, applies nothing.

Real PostgreSQL, a real worker subprocess (``tests/fixtures/apps/frozen_claim.py``) stopped with SIGSTOP.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from consumer_kit import App, Outcome, Settings
from consumer_kit.adapters.memory import MemoryBroker, MemoryDelivery
from consumer_kit.db.pool import connection_options
from consumer_kit.demo.app import CreateInvoiceHandler
from consumer_kit.pipeline.runtime import Runtime, open_pool
from tests.fixtures.apps.frozen_claim import HANDLER_TIMEOUT, QUEUE
from tests.fixtures.broker_env import command
from tests.fixtures.harness import fetch_all, throwaway_schema

pytestmark = [pytest.mark.postgres]

ROOT = Path(__file__).resolve().parents[2]


def test_the_bound_defaults_to_the_handlers_longest_wait_and_is_never_below_it() -> None:
    settings = Settings(handler_timeout=60, statement_timeout=10)
    assert settings.effective_idle_in_transaction_timeout == 70
    assert "idle_in_transaction_session_timeout=70000" in connection_options(settings, None)["options"]
    assert Settings(handler_timeout=5, idle_in_transaction_timeout=9).effective_idle_in_transaction_timeout == 9
    with pytest.raises(ValueError, match="must not be below handler_timeout"):
        Settings(handler_timeout=60, idle_in_transaction_timeout=30)


async def test_a_sigstopped_workers_operation_runs_once_elsewhere_and_never_twice(
    database_url: str, tmp_path: Path,
) -> None:
    message_id = str(uuid.uuid4())
    marker = tmp_path / "frozen.pid"
    async with throwaway_schema(database_url) as schema:
        child = subprocess.Popen(
            [sys.executable, "-m", "tests.fixtures.apps.frozen_claim", database_url, schema, message_id, str(marker)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        try:
            async with asyncio.timeout(60):
                while not marker.exists() or not marker.read_text():
                    assert child.poll() is None, child.stderr.read().decode()[-2000:] if child.stderr else ""
                    await asyncio.sleep(0.02)
            os.kill(child.pid, signal.SIGSTOP)
            frozen_at = time.monotonic()
            backend = int(marker.read_text())
            state = await fetch_all(database_url, schema, "SELECT state FROM pg_stat_activity WHERE pid = %s", backend)
            assert state == [("idle in transaction",)]  # frozen holding its claim's row lock

            settings = Settings(database_url=database_url, db_schema=schema, search_path=schema,
                                lock_timeout=0.5, in_progress_delay=0.1, retry_delays=[0.1])
            app = App("other")
            app.subscribe(QUEUE, CreateInvoiceHandler())
            pool = await open_pool(settings, database_url, search_path=schema)
            outcomes: list[Outcome] = []
            try:
                runtime = Runtime(app, pool, settings)
                async with asyncio.timeout(HANDLER_TIMEOUT * 4 + 10):  # never for as long as it is frozen
                    while Outcome.EXECUTED not in outcomes:
                        broker = MemoryBroker(lock_timeout=600)
                        broker.send(QUEUE, command(order_id=7), message_id=message_id)
                        delivery = MemoryDelivery(broker, QUEUE, broker.queue(QUEUE).ready.popleft())
                        outcomes.append((await runtime.process(delivery)).outcome)
            finally:
                await pool.close()
            took = time.monotonic() - frozen_at
            gone = await fetch_all(database_url, schema, "SELECT 1 FROM pg_stat_activity WHERE pid = %s", backend)
            assert gone == []  # PostgreSQL ended the frozen session
            assert set(outcomes[:-1]) <= {Outcome.IN_PROGRESS}
        finally:
            os.kill(child.pid, signal.SIGCONT)
            out, err = child.communicate(timeout=60)
        woken = json.loads(out.decode().strip().splitlines()[-1])
        assert woken["outcome"] != Outcome.EXECUTED.value, err.decode()[-2000:]
        assert await fetch_all(database_url, schema, "SELECT count(*) FROM invoices") == [(1,)]
        assert await fetch_all(database_url, schema, "SELECT invoiced_cents FROM customers") == [(1250,)]
        assert await fetch_all(database_url, schema, "SELECT count(*) FROM outbox") == [(1,)]
        assert await fetch_all(database_url, schema, "SELECT state FROM operations") == [("completed",)]
        print(f"frozen worker's operation executed elsewhere {took:.1f} s after SIGSTOP "
              f"(bound {HANDLER_TIMEOUT:g} s); {len(outcomes) - 1} in_progress answers before; woken: {woken}")
