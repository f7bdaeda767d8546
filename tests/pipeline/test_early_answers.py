"""A duplicate is answered at once, and nothing it answers can be undone by the end of its
transaction (consumer_kit.pipeline.early_answers, docs/explanation/one-delivery.md).

On the real PostgreSQL (through a TCP proxy that can cut the COMMIT's reply) with the memory broker.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

from consumer_kit import App, Outcome, Settings
from consumer_kit.adapters.memory import MemoryBroker, MemoryConsumer
from consumer_kit.broker import Delivery, Settlement
from consumer_kit.codec.envelope import Envelope
from consumer_kit.demo.app import CreateInvoiceHandler
from consumer_kit.ledger import Claim
from consumer_kit.model.fence import Fence
from consumer_kit.model.outcomes import DeliveryReport
from consumer_kit.model.results import StoredResult
from consumer_kit.model.verdict import VerdictKind
from consumer_kit.pipeline.decoding import decode
from consumer_kit.pipeline.operation import Operations
from consumer_kit.pipeline.runtime import RuntimeHooks
from consumer_kit.pipeline.transactional import message_intent
from tests.fixtures.batches import QUEUE
from tests.fixtures.broker_env import command
from tests.fixtures.harness import fetch_all, runtime_for, throwaway_schema
from tests.fixtures.tcp_proxy import TcpProxy

pytestmark = pytest.mark.postgres


def app() -> App:
    app = App("early")
    app.subscribe(QUEUE, CreateInvoiceHandler())
    return app


async def one_by_one(broker: MemoryBroker, runtime: Any, count: int) -> list[DeliveryReport]:
    reports: list[DeliveryReport] = []
    done = asyncio.Event()

    async def on_delivery(delivery: Delivery) -> None:
        reports.append(await runtime.process(delivery))
        if len(reports) == count:
            done.set()

    consumer = MemoryConsumer(broker)
    await consumer.subscribe(QUEUE, on_delivery, prefetch=1)
    try:
        await asyncio.wait_for(done.wait(), 15)
    finally:
        await consumer.close()
    return reports


async def test_a_duplicate_is_acked_even_when_the_commit_of_its_empty_transaction_gets_no_reply(
    database_url: str,
) -> None:
    """The duplicate's transaction wrote nothing, so its answer does not wait for its COMMIT: with
    that COMMIT's reply cut (the connection reset), the duplicate is still acked with the stored
    result, the worker sees no outage, and the ledger row and the effect are as they were. Before,
    the same delivery was ``uncertain``: given back, and the worker paused."""
    parts = urlsplit(database_url)
    proxy = TcpProxy(parts.hostname or "127.0.0.1", parts.port or 5432)
    port = await proxy.start()
    proxied = urlunsplit(parts._replace(netloc=f"{parts.username or 'postgres'}@127.0.0.1:{port}"))
    outages: list[str] = []
    try:
        async with throwaway_schema(database_url) as schema, runtime_for(
            app(), proxied, schema, hooks=RuntimeHooks(on_environment_fault=outages.append), statement_timeout=2.0,
        ) as rt:
            broker = MemoryBroker()
            broker.send(QUEUE, command(order_id=7))
            (first,) = await one_by_one(broker, rt, 1)
            assert first.outcome is Outcome.EXECUTED
            row = await fetch_all(database_url, schema, "SELECT state, result_status, result_reference, updated_at FROM operations")

            proxy.lose_replies(b"COMMIT")
            broker.send(QUEUE, command(order_id=7))
            (again,) = await one_by_one(broker, rt, 1)
            await rt.close()  # the duplicate's transaction has ended (its connection reset)
            assert len(proxy.requests) == 1 and b"COMMIT" in proxy.requests[0]  # the COMMIT was sent

            assert (again.outcome, again.settlement) == (Outcome.DUPLICATE, Settlement.ACK)
            assert again.result is not None and again.result.reference == first.result.reference  # type: ignore[union-attr]
            assert outages == []
            assert await fetch_all(
                database_url, schema, "SELECT state, result_status, result_reference, updated_at FROM operations"
            ) == row
            assert await fetch_all(database_url, schema, "SELECT count(*) FROM invoices") == [(1,)]
            assert await fetch_all(database_url, schema, "SELECT count(*) FROM outbox") == [(1,)]
    finally:
        await proxy.close()


async def waits_for_a_lock(database_url: str, pid: int) -> None:
    """Until backend ``pid`` waits for a lock (bounded)."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn, asyncio.timeout(10):
        while True:
            cur = await conn.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,))
            row = await cur.fetchone()
            if row and row[0] == "Lock":
                return


async def xid_of(conn: psycopg.AsyncConnection[Any]) -> Any:
    cur = await conn.execute("SELECT pg_current_xact_id_if_assigned()")
    row = await cur.fetchone()
    return row[0] if row else None


@pytest.mark.parametrize("behind_a_claimer", [False, True], ids=["row-there", "after-a-concurrent-claimer"])
async def test_the_transaction_that_answers_a_duplicate_has_written_nothing(
    database_url: str, behind_a_claimer: bool
) -> None:
    """What makes the early answer safe, asked of PostgreSQL itself: after a claim that found the
    operation's row (there already, or committed by a concurrent claimer the claim waited for),
    its transaction has no transaction id: it inserted no row, locked none, and its COMMIT and its
    ROLLBACK are the same. The row it answered from was committed by another transaction."""
    async with throwaway_schema(database_url) as schema:
        operations = Operations(Settings(database_url=database_url, db_schema=schema), "test-worker")
        decoded = decode(app(), QUEUE, command(order_id=9), Envelope(QUEUE, "m", {}, 1))
        identity = decoded.identity

        async def claim(conn: psycopg.AsyncConnection[Any]) -> Any:
            return await operations.claim(
                conn, identity, message_intent(decoded), message_id="m", retention=decoded.handler.retention, begin=True
            )

        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as winner, \
                await psycopg.AsyncConnection.connect(database_url, autocommit=True) as duplicate:
            won = await claim(winner)
            assert isinstance(won, Claim) and won.claimed and await xid_of(winner) is not None
            assert won.xid is not None
            await operations.complete(winner, identity, StoredResult("created", "r-9", None), fence=Fence.of_transaction(won.xid))
            if behind_a_claimer:
                waiting = asyncio.create_task(claim(duplicate))  # blocks on the winner's key
                await waits_for_a_lock(database_url, duplicate.info.backend_pid)
                await winner.execute("COMMIT")
                verdict = await asyncio.wait_for(waiting, 10)
            else:
                await winner.execute("COMMIT")
                verdict = await claim(duplicate)
            assert verdict.kind is VerdictKind.DUPLICATE
            assert verdict.deciding_row.stored_result.reference == "r-9"
            assert duplicate.info.transaction_status is psycopg.pq.TransactionStatus.INTRANS
            assert await xid_of(duplicate) is None  # wrote nothing: no transaction id was assigned
            await duplicate.execute("ROLLBACK")  # the other end of the same answer
        assert await fetch_all(database_url, schema, "SELECT state, result_reference FROM operations") == [
            ("completed", "r-9")
        ]


async def test_an_http_replay_answers_even_when_the_end_of_its_empty_transaction_gets_no_reply(
    database_url: str,
) -> None:
    """The HTTP front door's replay (a retry with the same Idempotency-Key) wrote nothing either:
    its response does not wait for the end of its transaction, whose reply the proxy cuts. Before,
    the replay waited for a ROLLBACK; now it is the stored response whatever that end meets, and
    the stored row is as it was."""
    import httpx

    from consumer_kit.demo.api import create_app

    parts = urlsplit(database_url)
    proxy = TcpProxy(parts.hostname or "127.0.0.1", parts.port or 5432)
    port = await proxy.start()
    proxied = urlunsplit(parts._replace(netloc=f"{parts.username or 'postgres'}@127.0.0.1:{port}"))
    body = {"order_id": 5, "revision": 1, "customer_id": "c-1", "amount_cents": 100, "currency": "EUR",
            "requested_at": "2026-03-01T10:00:00+00:00"}
    headers = {"Authorization": "Bearer token-a", "Idempotency-Key": '"6d1e7c2a-5b0f-4f7e-9d3a-replay000001"'}
    try:
        async with throwaway_schema(database_url) as schema:
            api = create_app(Settings(database_url=proxied, db_schema=schema, search_path=schema,
                                      statement_timeout=2.0), tokens={"token-a": "client-a"})
            async with api.router.lifespan_context(api):
                transport = httpx.ASGITransport(app=api)
                async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
                    first = await client.post("/invoices", json=body, headers=headers)
                    assert first.status_code == 202, first.text
                    proxy.lose_replies(b"COMMIT")
                    replay = await client.post("/invoices", json=body, headers=headers)
            assert len(proxy.requests) == 1  # the replay's transaction end was sent, its reply cut
            assert replay.status_code == first.status_code and replay.json() == first.json()
            assert await fetch_all(database_url, schema, "SELECT state FROM operations") == [("completed",)]
    finally:
        await proxy.close()
