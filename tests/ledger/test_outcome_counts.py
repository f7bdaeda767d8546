"""The workers' per-minute outcome counts (ledger migration 8, ``outcome_counts``), against real
PostgreSQL and RabbitMQ: written by the worker every summary interval and at shutdown (never per
delivery), a failed write retried at the next interval, read back by ``consumer-kit stats`` and the
console's Pressure page (Debian's Chromium via Playwright), pruned by ``consumer-kit prune``."""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
import json
import logging
from typing import Any

import psycopg
import pytest
from typer.testing import CliRunner

from consumer_kit import App, Outcome
from consumer_kit.cli.main import cli
from consumer_kit.demo.app import CreateInvoiceHandler
from consumer_kit.model.outcomes import DeliveryReport
from consumer_kit.settings import Settings
from tests.console_web.test_app import browser, page_of, serve_settings  # noqa: F401 - browser: fixture
from tests.fixtures.broker_env import Env, command

pytestmark = [pytest.mark.postgres, pytest.mark.rabbitmq]

TYPE = "invoice.create"


class ExpiringInvoices(CreateInvoiceHandler):
    """The invoices handler with a key retention of one hour (a message older is refused)."""

    key_retention = dt.timedelta(hours=1)


def mix_app(env: Env) -> App:
    app = App("outcome-counts")
    app.subscribe(env.queue, ExpiringInvoices())
    return app


async def until(condition: Any, timeout: float = 20.0) -> None:
    """Wait until the awaitable factory ``condition`` returns true (polling the database)."""
    async with asyncio.timeout(timeout):
        while not await condition():
            await asyncio.sleep(0.1)  # polling a condition, not a guessed delay


async def counted(env: Env) -> dict[str, int]:
    """``{outcome: count}`` of the invoice type in ``outcome_counts``, all minutes."""
    rows = await env.rows(
        "SELECT outcome, sum(count)::int FROM outcome_counts WHERE operation_type = %s GROUP BY outcome", TYPE
    )
    return {str(outcome): int(n) for outcome, n in rows}


async def execute(env: Env, statement: str) -> None:
    async with await psycopg.AsyncConnection.connect(
        env.database_url, autocommit=True, options=f"-c search_path={env.schema}"
    ) as conn:
        await conn.execute(statement.encode())


def drain(env: Env) -> list[DeliveryReport]:
    seen = []
    while not env.reports.empty():
        seen.append(env.reports.get_nowait())
    return seen


async def run_mix(env: Env) -> collections.Counter[str]:
    """A worker meets a first execution, two duplicates, a payload conflict, an in-progress
    collision and a key-expired message, then stops. Returns every outcome it reported."""
    seen: list[DeliveryReport] = []
    async with env.worker(mix_app(env)):
        await env.send(command(order_id=1))
        seen += await env.next_reports(1)
        for _ in range(2):
            await env.send(command(order_id=1))
            seen += await env.next_reports(1)
        await env.send(command(order_id=1, amount=999))  # same key, another intent
        seen += await env.next_reports(1)
        # Order 2 runs, then its row is made another worker's live lease: the next copy collides.
        await env.send(command(order_id=2))
        seen += await env.next_reports(1)
        await env.rows(
            "UPDATE operations SET state = 'processing', lease_owner = 'other-worker', "
            "lease_expires_at = now() + interval '1 hour', completed_at = NULL, watch_since = now() "
            "WHERE key = 'order-2-rev-2' RETURNING 1"
        )
        await env.send(command(order_id=2))
        seen += await env.reports_until(lambda reports: any(r.outcome is Outcome.IN_PROGRESS for r in reports))
        two_hours_ago = (dt.datetime.now(dt.UTC) - dt.timedelta(hours=2)).isoformat()
        await env.send(command(order_id=3), {"operation-created-at": two_hours_ago})
        seen += await env.reports_until(lambda reports: any(r.outcome is Outcome.KEY_EXPIRED for r in reports))
    seen += drain(env)  # the in-progress copy's retries until the worker stopped
    outcomes = collections.Counter(r.outcome.value for r in seen)
    assert outcomes["executed"] == 2 and outcomes["duplicate"] == 2
    assert outcomes["payload_conflict"] == 1 and outcomes["key_expired"] == 1 and outcomes["in_progress"] >= 1
    return outcomes


async def stats(env: Env, *args: str, columns: int = 200) -> str:
    result = await asyncio.to_thread(CliRunner().invoke, cli, ["stats", *args], env={
        "CONSUMER_KIT_DATABASE_URL": env.database_url, "CONSUMER_KIT_DB_SCHEMA": env.schema,
        "COLUMNS": str(columns),
    })
    assert result.exit_code == 0, result.output
    return result.output


async def test_a_stopped_worker_leaves_the_counts_of_every_outcome_and_stats_shows_them(env: Env) -> None:
    outcomes = await run_mix(env)
    # Written once, at shutdown (the summary interval, 10 s, may or may not have passed): every
    # reported outcome is in the table, no more, no less.
    assert await counted(env) == dict(outcomes)

    report = json.loads(await stats(env, "--json", "--since", "1h"))
    [invoices] = report["operations"]
    figures = {k: invoices[k] for k in
               ("executed", "duplicates", "payload_conflicts", "in_progress", "lease_recovered", "uncertain",
                "key_expired")}
    assert figures == {"executed": 1,  # the ledger's: order 2's row was made another's live lease
                       "duplicates": 2, "payload_conflicts": 1, "in_progress": outcomes["in_progress"],
                       "lease_recovered": 0, "uncertain": 0, "key_expired": 1}

    # 80 columns: the deliveries table stays a table, every line fits, the legend spells it out.
    table = await stats(env, "--since", "1h", columns=80)
    assert all(len(line) <= 80 for line in table.splitlines()), table
    [row] = [line for line in table.splitlines() if line.startswith("│ invoice.create") and "│     2 │" in line]
    cells = [c.strip() for c in row.strip("│").split("│")]
    assert cells == ["invoice.create", "1", "2", "1", str(outcomes["in_progress"]), "0", "0", "1"], row
    assert "dupes: duplicates" in " ".join(table.split())


async def test_counts_are_written_every_summary_interval_while_the_worker_runs(env: Env) -> None:
    env.settings = env.settings.model_copy(update={"summary_interval": 1.0})
    async with env.worker(mix_app(env)):
        await env.send(command(order_id=5))
        await env.next_reports(1)

        async def written() -> bool:
            return await counted(env) == {"executed": 1}

        await until(written)  # while it runs, not at shutdown
        await env.send(command(order_id=5))
        await env.next_reports(1)

        async def both() -> bool:
            return await counted(env) == {"executed": 1, "duplicate": 1}

        await until(both)
    assert await counted(env) == {"executed": 1, "duplicate": 1}  # the shutdown adds nothing twice


async def test_a_failed_write_is_logged_and_its_counts_written_at_the_next_interval(
    env: Env, caplog: pytest.LogCaptureFixture,
) -> None:
    env.settings = env.settings.model_copy(update={"summary_interval": 1.0})
    caplog.set_level(logging.WARNING, logger="consumer_kit.worker")
    async with env.worker(mix_app(env)):
        await execute(env, "ALTER TABLE outcome_counts RENAME TO outcome_counts_away")
        await env.send(command(order_id=6))
        (report,) = await env.next_reports(1)
        assert report.outcome is Outcome.EXECUTED  # the delivery never waits on the counts

        async def refused() -> bool:
            return any("outcome counts not written" in r.getMessage() for r in caplog.records)

        await until(refused)
        await execute(env, "ALTER TABLE outcome_counts_away RENAME TO outcome_counts")

        async def written() -> bool:
            return await counted(env) == {"executed": 1}

        await until(written)
    assert await counted(env) == {"executed": 1}
    [warning] = {r.getMessage() for r in caplog.records if "outcome counts" in r.getMessage()}
    assert "UndefinedTable" in warning and "kept for the next interval" in warning


async def test_prune_removes_the_counts_past_their_retention(env: Env) -> None:
    await env.rows(
        "INSERT INTO outcome_counts (operation_type, outcome, minute, count) VALUES "
        "(%s, 'duplicate', date_trunc('minute', now() - interval '8 days'), 4), "
        "(%s, 'duplicate', date_trunc('minute', now() - interval '6 days'), 3), "
        "(%s, 'executed', date_trunc('minute', now()), 2) RETURNING 1", TYPE, TYPE, TYPE,
    )

    def prune(*args: str) -> str:
        result = CliRunner().invoke(cli, ["prune", *args], env={
            "CONSUMER_KIT_DATABASE_URL": env.database_url, "CONSUMER_KIT_DB_SCHEMA": env.schema,
        })
        assert result.exit_code == 0, result.output
        return result.output

    dry = await asyncio.to_thread(prune, "--dry-run")
    assert "would delete 0 result bodies and 0 identities, and 1 per-minute outcome counts older than 7d" in dry
    assert len(await env.rows("SELECT 1 FROM outcome_counts")) == 3
    real = await asyncio.to_thread(prune)
    assert "deleted 0 result bodies and 0 identities, and 1 per-minute outcome counts" in real
    assert await env.rows("SELECT outcome, count FROM outcome_counts ORDER BY count") == [
        ("executed", 2), ("duplicate", 3),
    ]
    assert "1 per-minute outcome counts" in await asyncio.to_thread(prune, "--outcome-counts-retention", "1d")
    assert await env.rows("SELECT outcome, count FROM outcome_counts") == [("executed", 2)]


async def test_the_pressure_page_shows_the_seven_figures(env: Env, browser: Any) -> None:  # noqa: F811
    outcomes = await run_mix(env)
    settings = Settings(database_url=env.database_url, broker_url=env.rabbitmq_url, db_schema=env.schema)
    async with serve_settings(settings, mix_app(env)) as base, page_of(browser, base) as page:
        await page.goto(f"{base}/pressure")
        table = page.locator("table.deliveries")
        headers = [h.strip() for h in await table.locator("thead th").all_inner_texts()]
        cells = [c.strip() for c in await table.locator("tbody tr").first.locator("td").all_inner_texts()]
    assert dict(zip(headers, cells, strict=True)) == {
        "operation type": TYPE, "first executions": "1", "duplicates": "2", "payload conflicts": "1",
        "in-progress collisions": str(outcomes["in_progress"]), "recovered leases": "0",
        "uncertain outcomes": "0", "key-expiry refusals": "1",
    }
