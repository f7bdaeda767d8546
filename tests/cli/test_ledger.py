"""A committed claim of the transactional path carries no ``watch_since`` (ledger migration 5), so
the gauges and ``consumer-kit ledger list`` cannot see it. Such a row exists when a handler (or an
HTTP endpoint) committed the delivery's transaction itself and the process died before the
runtime could park it: the operation must still end up where operators look."""

from __future__ import annotations

import datetime as dt

import httpx
import psycopg
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from consumer_kit import Outcome, Settings
from consumer_kit.demo.app import SCHEMA_SQL
from consumer_kit.errors import SimulatedCrash
from consumer_kit.http import Idempotency, IdempotencyPolicy, current_operation
from consumer_kit.ledger.inspect import LedgerInspector
from consumer_kit.ops.stats import StatsReader
from consumer_kit.pipeline.crashpoints import CrashPoint
from consumer_kit.testing import Harness
from tests.fixtures.harness import fetch_all, throwaway_schema
from tests.fixtures.relay_support import wait_until
from tests.pipeline.test_leased import CommitBeginHandler


async def test_a_self_committed_claim_whose_worker_died_is_parked_where_operators_look(
    database_url: str,
) -> None:
    """The worker dies (crash point in_handler) after the handler's own COMMIT: the claim is
    durable as ``processing`` without ``watch_since``. The redelivery, once the lease is over,
    dead-letters the message as needs_reconciliation; before the fix the row stayed
    ``processing`` with no ``watch_since``: absent from ``ledger list`` (both states) and from the
    stuck/parked gauges, though its message sat in the DLQ saying needs_reconciliation."""
    async with Harness(
        CommitBeginHandler(), database_url=database_url, setup_sql=SCHEMA_SQL, lease_seconds=1.0,
    ) as kit:
        kit.crash_at(CrashPoint.IN_HANDLER)
        reports = await kit.deliver({
            "order_id": 7, "revision": 1, "customer_id": "c-7", "amount_cents": 700,
            "currency": "EUR", "requested_at": dt.datetime.now(dt.UTC).isoformat(),
        })
        assert reports[0].outcome is Outcome.CRASHED
        assert (reports[-1].outcome, reports[-1].reason) == (Outcome.UNCERTAIN, "needs_reconciliation")
        assert await kit.fetchval("SELECT count(*) FROM invoices") == 1  # run once, never again
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            parked = await LedgerInspector(kit.schema).list(conn, "needs_reconciliation")
            pressure = await StatsReader(kit.schema).ledger_pressure(conn)
        assert [row.key for row in parked] == [r["key"] for r in await kit.ledger()]
        assert [(p.operation_type, p.needs_reconciliation) for p in pressure] == [("invoice.create", 1)]


KEY = "8e03978e-40d5-43e8-bc93-6894a57f9324"


async def test_an_endpoint_that_committed_itself_and_died_is_parked_by_the_retry(database_url: str) -> None:
    """The HTTP twin: the endpoint sends ``COMMIT; BEGIN`` and the process dies before the front
    door can park the key. Once the lease is over a retry with the key answers 409
    needs-reconciliation and parks the operation where ``ledger list`` and the gauges see it."""
    async with throwaway_schema(database_url, example_tables=False) as schema:
        settings = Settings(database_url=database_url, db_schema=schema, search_path=schema, lease_seconds=1.0)
        idempotency = Idempotency(
            settings, client=lambda request: "c-1", policy=IdempotencyPolicy(docs_url="https://api.example/k"),
        )
        calls: list[str] = []

        @idempotency.endpoint()
        async def commits_then_dies(request: Request) -> Response:
            calls.append("run")
            await current_operation().connection.execute("COMMIT; BEGIN")
            raise SimulatedCrash("the process died here")

        app = Starlette(routes=[Route("/pay", commits_then_dies, methods=["POST"])])
        async with idempotency.lifespan(app):
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
                headers = {"Idempotency-Key": f'"{KEY}"'}
                with pytest.raises(SimulatedCrash):
                    await client.post("/pay", json={"n": 1}, headers=headers)

                async def lease_over() -> bool:
                    rows = await fetch_all(database_url, schema, "SELECT lease_expires_at <= now() FROM operations")
                    return rows == [(True,)]

                await wait_until(lease_over, 10, "the dead request's lease to run out")
                retry = await client.post("/pay", json={"n": 1}, headers=headers)
        assert retry.status_code == 409 and "needs-reconciliation" in retry.json()["type"]
        assert calls == ["run"]
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            parked = await LedgerInspector(schema).list(conn, "needs_reconciliation")
            pressure = await StatsReader(schema).ledger_pressure(conn)
        assert [row.key for row in parked] == [KEY]
        assert [p.needs_reconciliation for p in pressure] == [1]
