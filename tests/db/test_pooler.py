"""Through a real PgBouncer in transaction mode (Debian's, its default startup-parameter rules):
the worker's pool, its per-transaction settings, the relay and the reachability check
(consumer_kit.db.pooler, docs/scaling.md)."""

from __future__ import annotations

import logging
from pathlib import Path

import psycopg
import pytest

from consumer_kit import App, ConfigurationError, Outcome, Settings
from consumer_kit.adapters.memory import MemoryBroker, MemoryPublisher
from consumer_kit.db.pool import open_pool
from consumer_kit.demo.app import CreateInvoiceHandler
from consumer_kit.outbox_relay import relay_pending
from consumer_kit.pipeline.faults import FaultKind, classify
from tests.fixtures.harness import fetch_all, runtime_for, throwaway_schema
from tests.fixtures.pgbouncer import pgbouncer, server_connections
from tests.fixtures.relay_support import relay_settings
from tests.pipeline.test_runtime import QUEUE, command, run_all

MEMORY = "memory://"


class RecordingHandler(CreateInvoiceHandler):
    """The invoices handler, noting the session settings its transaction ran with."""

    seen: set[tuple[str, str, str]]

    async def handle(self, message, ctx):  # type: ignore[override]
        cur = await ctx.connection.execute(
            "SELECT current_setting('lock_timeout'), current_setting('idle_in_transaction_session_timeout'),"
            " current_setting('search_path')"
        )
        self.seen.add(await cur.fetchone())
        return await super().handle(message, ctx)


@pytest.fixture
def bouncer(database_url: str, tmp_path: Path):
    with pgbouncer(database_url, tmp_path / "pgbouncer", pool_size=3) as url:
        yield url


async def test_workers_run_through_a_transaction_mode_pooler_with_their_settings(database_url: str, bouncer: str) -> None:
    handler = RecordingHandler()
    handler.seen = set()
    app = App("test")
    app.subscribe(QUEUE, handler)
    async with throwaway_schema(database_url) as schema, runtime_for(
        app, bouncer, schema, database_pooler="transaction", concurrency=8, lock_timeout=2.5,
    ) as rt:
        broker = MemoryBroker()
        for order in range(40):  # more than psycopg's prepare threshold on every pooled connection
            broker.send(QUEUE, command(order_id=order))
            broker.send(QUEUE, command(order_id=order))  # and its duplicate
        reports = await run_all(broker, rt, concurrency=8)
        assert server_connections(bouncer) <= 3  # for 10 client connections
        outcomes = [r.outcome for r in reports]
        assert outcomes.count(Outcome.EXECUTED) == 40, outcomes
        assert set(outcomes) <= {Outcome.EXECUTED, Outcome.DUPLICATE, Outcome.IN_PROGRESS}
        assert broker.dead_letters(QUEUE) == []
        assert await fetch_all(database_url, schema, "SELECT count(*) FROM invoices") == [(40,)]
    # every transaction ran with the worker's own settings, set in it (no `options` reached PgBouncer)
    idle = f"{round(rt.settings.effective_idle_in_transaction_timeout)}s"  # PostgreSQL shows whole seconds so
    assert handler.seen == {("2500ms", idle, schema)}, handler.seen


async def test_the_reachability_check_opens_a_connection_as_the_pool_does(bouncer: str) -> None:
    """Without the pooler setting the pool's `options` are refused: said at once, with the fix."""
    settings = Settings(database_url=bouncer)
    with pytest.raises(ConfigurationError, match=r"unsupported startup parameter.*DATABASE_POOLER=transaction"):
        await open_pool(settings, bouncer, search_path="public")


async def test_the_relay_publishes_every_row_through_the_pooler_and_says_it_polls(
    database_url: str, bouncer: str, caplog: pytest.LogCaptureFixture
) -> None:
    app = App("test")
    app.subscribe(QUEUE, CreateInvoiceHandler())
    async with throwaway_schema(database_url) as schema:
        async with runtime_for(app, bouncer, schema, database_pooler="transaction") as rt:
            broker = MemoryBroker()
            for order in range(30):
                broker.send(QUEUE, command(order_id=order))
            await run_all(broker, rt)
        settings = relay_settings(bouncer, schema, MEMORY, database_pooler="transaction", relay_batch_size=2)
        with caplog.at_level(logging.INFO, logger="consumer_kit.outbox_relay"):
            published = await relay_pending(settings, MemoryPublisher(MemoryBroker()))
        assert published == 30  # 15 claims and marks, more than psycopg's prepare threshold
        assert await fetch_all(database_url, schema, "SELECT count(*) FROM outbox WHERE published_at IS NULL") == [(0,)]
    started = [r.getMessage() for r in caplog.records if " started: " in r.getMessage()]
    assert started and started[0].endswith("wakeup=polling"), started


async def test_a_statement_the_pooler_lost_is_the_environments_fault(database_url: str) -> None:
    """A prepared statement missing on the server a pooler picked (psycopg's `_pg3_N`, our claim)."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        for name in ("_pg3_7", "ck_claim_0123456789ab"):
            with pytest.raises(psycopg.Error) as raised:
                await conn.execute(f"EXECUTE {name}".encode())
            assert classify(raised.value) is FaultKind.ENVIRONMENT
        with pytest.raises(psycopg.Error) as own:
            await conn.execute(b"EXECUTE handlers_own_statement")
        assert classify(own.value) is FaultKind.HANDLER  # a handler's own statement stays its fault
