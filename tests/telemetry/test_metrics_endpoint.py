"""``consumer-kit worker --metrics-port`` and ``outbox-relay --metrics-port``: the Prometheus
endpoint of real subprocesses serves the counters of a scripted run and the database gauges with
the values the database holds."""

from __future__ import annotations

import asyncio
import sys
import urllib.request
from collections.abc import Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families

from consumer_kit.errors import PublishError
from consumer_kit.telemetry.metrics import prometheus_series
from tests.fixtures.broker_env import Env, command
from tests.fixtures.children import stop_gracefully
from tests.product.test_first_hour import closed_port

pytestmark = [pytest.mark.postgres, pytest.mark.rabbitmq, pytest.mark.slow]

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]

SCRIPT = """
    -- rows as the leased path leaves them: claimed under a lease or parked, so watched
    INSERT INTO operations (scope, key, tenant, operation_type, fingerprint, projection_version, state,
                            lease_owner, lease_expires_at, updated_at, watch_since)
    VALUES ('default/invoice.create/v1', 'stuck-1', 'default', 'invoice.create', 'f', 1, 'processing',
            'dead-worker', now() - interval '90 seconds', now() - interval '95 seconds',
            now() - interval '95 seconds'),
           ('default/invoice.create/v1', 'stuck-2', 'default', 'invoice.create', 'f', 1, 'processing',
            'dead-worker', now() - interval '30 seconds', now() - interval '35 seconds',
            now() - interval '35 seconds'),
           ('default/invoice.create/v1', 'live-1', 'default', 'invoice.create', 'f', 1, 'processing',
            'live-worker', now() + interval '1 hour', now(), now()),
           ('default/email.send/v1', 'parked-1', 'default', 'email.send', 'f', 1,
            'needs_reconciliation', NULL, NULL, now() - interval '600 seconds',
            now() - interval '600 seconds');
    INSERT INTO outbox (event_id, destination, message_type, payload, attempts, created_at, available_at)
    SELECT gen_random_uuid(), 'billing.events', 'InvoiceCreated', '{}', 1,
           now() - interval '120 seconds', now() + interval '1 hour'
      FROM generate_series(1, 3);
    INSERT INTO outbox (event_id, destination, message_type, payload, attempts, created_at)
    SELECT gen_random_uuid(), 'billing.events', 'InvoiceCreated', '{}', 20, now() - interval '1 day'
      FROM generate_series(1, 2);
"""


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text) for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    wanted = set(labels.items())
    found = [v for (n, ls), v in samples.items() if n == name and wanted <= set(ls)]
    return sum(found) if found else None


async def scrape_until(port: int, ready: Callable[[Samples], bool], timeout: float = 30.0) -> Samples:
    """Scrape until ``ready`` holds (the process has started, refreshed its gauges, counted)."""
    async with asyncio.timeout(timeout):
        while True:
            try:
                samples = await asyncio.to_thread(scrape, port)
                if ready(samples):
                    return samples
            except OSError:
                pass  # not listening yet
            await asyncio.sleep(0.2)


async def test_the_prometheus_endpoints_serve_counters_and_database_gauges(env: Env) -> None:
    await env.rows("SELECT 1; " + SCRIPT)
    worker_port, relay_port = closed_port(), closed_port()
    environment = env.worker_environment(CONSUMER_KIT_LOG_LEVEL="WARNING", CONSUMER_KIT_METRICS_INTERVAL="0.2")
    worker = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "consumer_kit", "worker", "tests.fixtures.apps.invoices_on_test_queue:app",
        "--metrics-port", str(worker_port), env=environment, stderr=asyncio.subprocess.PIPE,
    )
    relay = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "consumer_kit.outbox_relay.cli", "--metrics-port", str(relay_port), env=environment,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(30):
            while True:  # until the worker has declared its queue
                try:
                    await env.send(command())
                    break
                except PublishError:
                    await asyncio.sleep(0.2)
        schema = {"consumer_kit_schema": env.schema}
        worker_samples = await scrape_until(worker_port, lambda s: (
            value(s, "consumer_kit_executions_total") == 1
            and value(s, "consumer_kit_ledger_expired_leases", **schema) is not None
        ))
        relay_samples = await scrape_until(relay_port, lambda s: (
            value(s, "outbox_relay_events_total", event="published") == 1
            and value(s, "consumer_kit_outbox_pending", **schema) == 3
        ))
    finally:
        worker_log = await stop_gracefully(worker)
        relay_log = await stop_gracefully(relay)
    assert worker.returncode == 0, worker_log
    assert relay.returncode == 0, relay_log

    invoices = {**schema, "consumer_kit_operation_type": "invoice.create"}
    emails = {**schema, "consumer_kit_operation_type": "email.send"}
    assert value(worker_samples, "consumer_kit_ledger_expired_leases", **invoices) == 2  # not the live one
    assert 85 <= (value(worker_samples, "consumer_kit_ledger_expired_leases_oldest_age_seconds", **invoices) or 0) < 200
    assert value(worker_samples, "consumer_kit_ledger_needs_reconciliation", **invoices) == 0
    assert value(worker_samples, "consumer_kit_ledger_needs_reconciliation", **emails) == 1
    assert 595 <= (value(worker_samples, "consumer_kit_ledger_needs_reconciliation_oldest_age_seconds", **emails)
                   or 0) < 700
    assert value(worker_samples, "consumer_kit_worker_paused") == 0
    assert value(worker_samples, "consumer_kit_deliveries_total", consumer_kit_outcome="executed",
                 messaging_destination_name=env.queue) == 1
    assert value(worker_samples, "consumer_kit_handler_duration_seconds_count",
                 consumer_kit_operation_type="invoice.create") == 1
    assert value(worker_samples, "consumer_kit_claim_wait_seconds_count",
                 consumer_kit_operation_type="invoice.create") == 1

    # The relay published the run's one event; the 3 rows in backoff are still pending.
    assert 115 <= (value(relay_samples, "consumer_kit_outbox_pending_oldest_age_seconds", **schema) or 0) < 300
    assert value(relay_samples, "consumer_kit_outbox_parked", **schema) == 2
    assert value(relay_samples, "consumer_kit_outbox_commit_to_publish_seconds_count",
                 messaging_destination_name="billing.events") == 1

    # Every consumer-kit series either process served is one the catalogue (and deploy/) knows.
    served = {name for name, _ in (*worker_samples, *relay_samples)
              if name.startswith(("consumer_kit_", "outbox_relay_"))}
    assert served and served <= prometheus_series(), served - prometheus_series()
