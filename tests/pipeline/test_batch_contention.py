"""Contention in a batch never cascades (docs/how-to/batches.md, docs/explanation/faults-and-attempts.md).

Two workers' batches that touch the same customer rows in opposite orders deadlock. The batch that
PostgreSQL rolls back must not run again at once into the same locks (without the item that met
the deadlock, in the same order, it meets the other batch again: about one deadlock per pair of
items): its items run one by one, each holding only its own locks. Every contention shows: the
metric ``consumer_kit.contentions.in_place``, the outcome counts the Pressure page reads, and, once
the in-place retries of an item are used up, its ``contended`` outcome and its ledger count.

On the real PostgreSQL (a database of the test's own, so that its deadlock count is this test's)
with the memory broker and two runtimes, as two worker processes.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator

import httpx
import psycopg
import pytest

from consumer_kit import App, Context, Outcome, Result, Settings
from consumer_kit.adapters.memory import MemoryBroker, MemoryConsumer
from consumer_kit.broker import Delivery
from consumer_kit.console_web.app import ConsoleConfig, create_app
from consumer_kit.demo.app import CreateInvoice, CreateInvoiceHandler
from consumer_kit.ledger.outcome_counts import OutcomeCountBook
from consumer_kit.model.outcomes import DeliveryReport
from consumer_kit.pipeline.fault_costs import CONTENDED_IN_PLACE
from consumer_kit.telemetry.minute_counts import MinuteCounts
from tests.fixtures.batches import QUEUE
from tests.fixtures.harness import database_of_its_own, fetch_all, runtime_for, throwaway_schema
from tests.fixtures.telemetry_kit import Telemetry

pytestmark = pytest.mark.postgres

CUSTOMERS = [f"c{n}" for n in range(6)]


class SlowInvoiceHandler(CreateInvoiceHandler):
    """The invoices example's handler, whose work after the customer's row takes a while (it
    holds that row lock for 30 ms: a slow statement of the handler's own)."""

    batch_size = 10
    batch_wait = 0.01

    async def handle(self, message: CreateInvoice, ctx: Context) -> Result:
        result = await super().handle(message, ctx)
        await ctx.connection.execute("SELECT pg_sleep(0.03)")
        return result


def order(order_id: int, customer: str) -> bytes:
    return json.dumps({
        "order_id": order_id, "revision": 1, "customer_id": customer, "amount_cents": 100,
        "currency": "EUR", "requested_at": "2026-12-01T00:00:00+00:00",
    }).encode()


@pytest.fixture
async def own_database(database_url: str) -> AsyncIterator[str]:
    """A database of this test's own, with a short ``deadlock_timeout`` (its deadlock count is
    this test's alone); dropped afterwards."""
    async with database_of_its_own(database_url, deadlock_timeout="200ms") as url:
        yield url


async def deadlocks(url: str) -> int:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
        row = await cur.fetchone()
        return int(row[0]) if row else 0


async def gather_batch(broker: MemoryBroker, queue: str, count: int) -> list[Delivery]:
    """The first ``count`` deliveries of ``queue``, held (unsettled) to be run as one batch."""
    held: list[Delivery] = []
    all_there = asyncio.Event()

    async def hold(delivery: Delivery) -> None:
        held.append(delivery)
        if len(held) == count:
            all_there.set()

    consumer = MemoryConsumer(broker)
    await consumer.subscribe(queue, hold, prefetch=count)
    await asyncio.wait_for(all_there.wait(), 10)
    await consumer.close()
    return held


def app() -> App:
    app = App("contention")
    app.subscribe(QUEUE, SlowInvoiceHandler())
    return app


async def test_two_batches_locking_rows_in_opposite_orders_deadlock_once_not_once_per_item(
    own_database: str, otel: Telemetry
) -> None:
    waits_before = otel.value("consumer_kit.contentions.in_place", attrs={"error.type": "DeadlockDetected"})
    async with throwaway_schema(own_database) as schema:
        async with runtime_for(app(), own_database, schema) as one, runtime_for(app(), own_database, schema) as two:
            minutes = one.counters.minutes = MinuteCounts()
            two.counters.minutes = minutes
            brokers = MemoryBroker("one"), MemoryBroker("two")
            for n, customer in enumerate(CUSTOMERS):
                brokers[0].send(QUEUE, order(100 + n, customer))
            for n, customer in enumerate(reversed(CUSTOMERS)):
                brokers[1].send(QUEUE, order(200 + n, customer))
            batches = [await gather_batch(b, QUEUE, len(CUSTOMERS)) for b in brokers]
            before = await deadlocks(own_database)
            reports: list[list[DeliveryReport]] = list(
                await asyncio.gather(one.process_batch(batches[0]), two.process_batch(batches[1]))
            )
        met = await deadlocks(own_database) - before  # the pools are closed: their counts are in

        assert [r.outcome for rs in reports for r in rs] == [Outcome.EXECUTED] * 2 * len(CUSTOMERS)
        assert met == 1, f"{met} deadlocks: the rolled-back batch ran into the same locks again"
        invoiced = dict(await fetch_all(own_database, schema, "SELECT customer_id, invoiced_cents FROM customers"))
        assert invoiced == dict.fromkeys(CUSTOMERS, 200)  # each customer once from each batch
        assert await fetch_all(own_database, schema, "SELECT count(*) FROM outbox") == [(12,)]
        # the rolled-back batch's deliveries, each counted once as a contention retried in place
        waits = otel.value("consumer_kit.contentions.in_place", attrs={"error.type": "DeadlockDetected"})
        assert waits - waits_before == len(CUSTOMERS)
        counts = minutes.take()
        assert {outcome: n for (_, outcome, _), n in counts.items()} == {
            "executed": 12, CONTENDED_IN_PLACE: len(CUSTOMERS)
        }
        # as the workers write them at their summary interval: on the Pressure page
        async with await psycopg.AsyncConnection.connect(own_database, autocommit=True) as conn:
            await OutcomeCountBook(schema).add(conn, counts)
        assert await pressure_row(own_database, schema) == {"contentions": "0", "contentions retried in place": "6"}


async def pressure_row(database_url: str, schema: str) -> dict[str, str]:
    """The console's Pressure page, Operations table, the invoice.create row's contention cells."""
    settings = Settings(database_url=database_url, broker_url="memory://", db_schema=schema)
    console = create_app(ConsoleConfig(settings=settings, app=app(), token="t" * 32))
    transport = httpx.ASGITransport(app=console)
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:  # a served name
        page = await client.get("/pressure", headers={"Authorization": "Bearer " + "t" * 32})
    assert page.status_code == 200
    table = page.text.split("<table", 2)[1]  # the first table: Operations
    headers = re.findall(r"<th>([^<]*)</th>", table)
    row = table.split("<td>invoice.create</td>", 1)[1].split("</tr>", 1)[0]
    cells = dict(zip(headers[1:], re.findall(r"<td[^>]*>([^<]*)</td>", row), strict=False))
    return {k: cells[k] for k in ("contentions", "contentions retried in place")}


class LockedInvoiceHandler(CreateInvoiceHandler):
    """The invoices example's handler; customer ``c-held`` is locked by another transaction."""

    batch_size = 10
    batch_wait = 0.01


async def test_a_lock_timeout_in_a_batch_costs_only_the_items_that_wait_for_the_lock(
    database_url: str, otel: Telemetry
) -> None:
    """A row one item of the batch needs is held past ``lock_timeout``: that item's contention
    is counted and it is given back (``contended``) after its retries in place; the others execute.
    Before, the batch reran at once without it (after ``lock_timeout``), and its contention was
    counted nowhere until its own retries ran out."""
    given_back_before = otel.value("consumer_kit.contentions", attrs={"consumer_kit.outcome": "contended"})
    in_place_before = otel.value("consumer_kit.contentions.in_place", attrs={"error.type": "LockNotAvailable"})
    app_ = App("lock-timeout")
    app_.subscribe(QUEUE, LockedInvoiceHandler())
    async with throwaway_schema(database_url) as schema, runtime_for(
        app_, database_url, schema, lock_timeout=0.1, in_progress_delay=30.0, max_contentions=5
    ) as rt:
        async with await psycopg.AsyncConnection.connect(
            database_url, autocommit=True, options=f"-c search_path={schema}"
        ) as holder:
            await holder.execute("INSERT INTO customers (customer_id, invoiced_cents) VALUES ('c-held', 0)")
            await holder.execute("BEGIN")
            await holder.execute("SELECT * FROM customers WHERE customer_id = 'c-held' FOR UPDATE")
            broker = MemoryBroker()
            ids = [broker.send(QUEUE, order(300 + n, f"c-free-{n}")) for n in range(4)]
            held = broker.send(QUEUE, order(399, "c-held"))
            batch = await gather_batch(broker, QUEUE, 5)
            reports = await rt.process_batch(batch)
            await holder.execute("ROLLBACK")
        by_id = {r.message_id: r for r in reports}
        assert [by_id[i].outcome for i in ids] == [Outcome.EXECUTED] * 4
        assert by_id[held].outcome is Outcome.CONTENDED
        assert by_id[held].reason == "contention:LockNotAvailable"
        assert await fetch_all(database_url, schema, "SELECT key, failures, contentions FROM attempts") == [
            ("order-399-rev-1", 0, 1)
        ]
    # in place: the batch's 5 deliveries once (rolled back for it), then the held one's own 3 retries
    in_place = otel.value("consumer_kit.contentions.in_place", attrs={"error.type": "LockNotAvailable"})
    assert in_place - in_place_before == 5 + 3
    given_back = otel.value("consumer_kit.contentions", attrs={"consumer_kit.outcome": "contended"})
    assert given_back - given_back_before == 1
