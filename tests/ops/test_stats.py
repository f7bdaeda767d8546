"""``consumer-kit stats``: the outcomes of a scripted run on RabbitMQ and PostgreSQL, read back."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from typer.testing import CliRunner

from consumer_kit import App, Context, Outcome, RetryableError
from consumer_kit.cli.main import cli
from consumer_kit.demo.app import CreateInvoice, CreateInvoiceHandler
from consumer_kit.ops.stats import age_text as _age
from consumer_kit.outbox_relay import Relay, RelaySettings
from tests.fixtures.broker_env import Env, command
from tests.fixtures.harness import fetch_all

pytestmark = [pytest.mark.postgres, pytest.mark.rabbitmq]

STUCK_AND_PARKED = """
    INSERT INTO operations (scope, key, tenant, operation_type, fingerprint, projection_version, state,
                            lease_owner, lease_expires_at, updated_at)
    VALUES ('default/invoice.create/v1', 'stuck-1', 'default', 'invoice.create', 'f', 1, 'processing',
            'dead-worker', now() - interval '90 seconds', now() - interval '100 seconds'),
           ('default/invoice.create/v1', 'parked-1', 'default', 'invoice.create', 'f', 1,
            'needs_reconciliation', NULL, NULL, now() - interval '300 seconds');
    INSERT INTO outbox (event_id, destination, message_type, payload, attempts, created_at)
    VALUES (gen_random_uuid(), 'billing.events', 'InvoiceCreated', '{}', 20, now() - interval '1 hour');
"""


class FlakyOnce(CreateInvoiceHandler):
    """Order 9 fails its first attempt (a handler fault, retried), then succeeds."""

    failed = False

    async def handle(self, message: CreateInvoice, ctx: Context) -> Any:
        if message.order_id == 9 and not FlakyOnce.failed:
            FlakyOnce.failed = True
            raise RetryableError("downstream not ready")
        return await super().handle(message, ctx)


async def run_script(env: Env) -> None:
    app = App("stats")
    app.subscribe(env.queue, FlakyOnce())
    async with env.worker(app):
        for order in (1, 2, 3, 1, 1, 9):
            await env.send(command(order_id=order))
        await env.send(command(order_id=4, amount=-5))  # a permanent failure
        seen = await env.reports_until(
            lambda reports: sum(r.outcome is not Outcome.RETRIED for r in reports) == 7
        )
    outcomes = sorted(r.outcome.value for r in seen)
    assert outcomes == sorted(["executed"] * 4 + ["duplicate"] * 2 + ["failed", "retried"])
    relay = Relay(RelaySettings(database_url=env.database_url, broker_url=env.rabbitmq_url, db_schema=env.schema))
    await relay.run(once=True)
    assert relay.counters["published"] == 4
    await fetch_all(env.database_url, env.schema, "SELECT 1; " + STUCK_AND_PARKED)


async def stats(env: Env, *args: str) -> Any:
    """``consumer-kit stats ARGS`` in a thread (the command runs its own event loop)."""
    result = await asyncio.to_thread(CliRunner().invoke, cli, ["stats", *args], env={
        "CONSUMER_KIT_DATABASE_URL": env.database_url, "CONSUMER_KIT_DB_SCHEMA": env.schema, "COLUMNS": "200",
    })
    assert result.exit_code == 0, result.output
    return result.output


async def test_stats_json_matches_the_outcomes_of_a_scripted_run(env: Env) -> None:
    await run_script(env)
    report = json.loads(await stats(env, "--json", "--since", "1h"))
    [invoices] = report["operations"]
    assert invoices["operation_type"] == "invoice.create"
    expected = {"executed": 4, "failed": 1, "retries": 1, "lease_recovered": 0, "contentions": 0,
                "crashes": 0, "processing": 0, "expired_leases": 1, "needs_reconciliation": 1, "resolved": 0}
    assert {k: invoices[k] for k in expected} == expected
    assert 85 <= invoices["oldest_expired_age"] < 200
    assert 295 <= invoices["oldest_reconciliation_age"] < 400
    outbox = report["outbox"]
    assert (outbox["published"], outbox["pending"], outbox["parked"]) == (4, 0, 1)
    assert 0 <= outbox["latency_p50"] <= outbox["latency_p95"] <= outbox["latency_max"] < 60
    assert report["since"] == 3600

    # A window that starts after the run counts no new outcomes, yet still shows what is stuck now.
    later = json.loads(await stats(env, "--json", "--since", "0s"))
    [now] = later["operations"]
    assert (now["executed"], now["failed"], now["retries"]) == (0, 0, 0)
    assert (now["expired_leases"], now["needs_reconciliation"]) == (1, 1)

    table = await stats(env, "--since", "1h")
    assert "invoice.create" in table and "commit→publish" in table


def test_ages_read_as_an_operator_would() -> None:
    assert [_age(s) for s in (None, 45, 185, 7800, 97200)] == ["-", "45s", "3m05s", "2h10m", "1d03h"]
