"""The delivery pipeline on the memory broker and the real PostgreSQL."""

from __future__ import annotations

import asyncio
import datetime as dt
import json

import pytest

from consumer_kit import App, ConfigurationError, Outcome
from consumer_kit.adapters.memory import MemoryBroker, MemoryConsumer
from consumer_kit.demo.app import CreateInvoiceHandler
from tests.fixtures.harness import fetch_all, runtime_for, throwaway_schema

QUEUE = "invoices.commands"


def command(order_id: int = 418, amount: int = 1250, **extra: object) -> bytes:
    body = {
        "order_id": order_id, "revision": 2, "customer_id": "c-1", "amount_cents": amount,
        "currency": "EUR", "requested_at": dt.datetime.now(dt.UTC).isoformat(),
    }
    body.update(extra)
    return json.dumps(body).encode()


@pytest.fixture
def app() -> App:
    app = App("test")
    app.subscribe(QUEUE, CreateInvoiceHandler())
    return app


async def run_all(broker: MemoryBroker, runtime, concurrency: int = 8) -> list:
    reports: list = []

    async def on_delivery(delivery):
        reports.append(await runtime.process(delivery))

    consumer = MemoryConsumer(broker)
    await consumer.subscribe(QUEUE, on_delivery, prefetch=concurrency)
    await broker.wait_idle(20)
    await consumer.close()
    return reports


async def test_five_deliveries_one_effect(database_url: str, app: App) -> None:
    async with throwaway_schema(database_url) as schema, runtime_for(app, database_url, schema) as rt:
        broker = MemoryBroker()
        for _ in range(5):
            broker.send(QUEUE, command())
        reports = await run_all(broker, rt)
        outcomes = sorted(r.outcome for r in reports)
        assert outcomes.count(Outcome.EXECUTED) == 1
        # every other copy ends as a duplicate; one that met the first in flight is in_progress
        # first (retried), never anything else
        assert outcomes.count(Outcome.DUPLICATE) == 4
        assert set(outcomes) <= {Outcome.EXECUTED, Outcome.DUPLICATE, Outcome.IN_PROGRESS}
        assert len(await fetch_all(database_url, schema, "SELECT * FROM invoices")) == 1
        assert await fetch_all(database_url, schema, "SELECT invoiced_cents FROM customers") == [(1250,)]
        assert len(await fetch_all(database_url, schema, "SELECT * FROM outbox")) == 1
        assert await fetch_all(database_url, schema, "SELECT state FROM operations") == [("completed",)]


async def test_conflict_and_volatile_field(database_url: str, app: App) -> None:
    async with throwaway_schema(database_url) as schema, runtime_for(app, database_url, schema) as rt:
        broker = MemoryBroker()
        broker.send(QUEUE, command())
        await run_all(broker, rt)
        broker.send(QUEUE, command(amount=9999))
        broker.send(QUEUE, command(requested_at="2020-01-01T00:00:00Z"))
        reports = await run_all(broker, rt, concurrency=1)
        assert sorted(r.outcome.value for r in reports) == ["duplicate", "payload_conflict"]
        assert [d.reason for d in broker.dead_letters(QUEUE)] == ["payload_conflict"]
        assert await fetch_all(database_url, schema, "SELECT invoiced_cents FROM customers") == [(1250,)]


class MissingTableHandler(CreateInvoiceHandler):
    async def handle(self, message, ctx):  # type: ignore[override]
        await ctx.connection.execute("INSERT INTO no_such_table VALUES (%s)", (message.customer_id,))


class ChattyHandler(CreateInvoiceHandler):
    async def handle(self, message, ctx):  # type: ignore[override]
        raise ValueError(f"cannot bill {message.customer_id}")  # a message quoting business data


@pytest.mark.parametrize(
    ("handler", "reason", "described"),
    [
        (MissingTableHandler(), "UndefinedTable", 'UndefinedTable [42P01] relation "no_such_table" does not exist'),
        (ChattyHandler(), "ValueError", "ValueError at test_runtime.py:"),
    ],
)
async def test_handler_errors_are_logged_by_object_never_by_value(
    database_url: str, caplog: pytest.LogCaptureFixture, handler: CreateInvoiceHandler, reason: str,
    described: str,
) -> None:
    app = App("test")
    app.subscribe(QUEUE, handler)
    async with throwaway_schema(database_url) as schema, runtime_for(
        app, database_url, schema, max_deliveries=1
    ) as rt:
        broker = MemoryBroker()
        broker.send(QUEUE, command(customer_id="secret-customer-77"))
        with caplog.at_level("WARNING", logger="consumer_kit.runtime"):
            (report,) = await run_all(broker, rt)
    assert report.outcome is Outcome.DEAD_LETTERED
    (dead,) = broker.dead_letters(QUEUE)
    assert dead.reason == f"max_deliveries_exceeded:{reason}"
    assert described in dead.detail
    assert described in caplog.text
    assert "secret-customer-77" not in caplog.text and "secret-customer-77" not in dead.detail


def test_a_synchronous_handle_is_refused_at_start() -> None:
    class Sync(CreateInvoiceHandler):
        def handle(self, message, ctx):  # type: ignore[override]
            return None

    with pytest.raises(ConfigurationError, match="must be `async def`"):
        Sync()


@pytest.mark.parametrize("operation_type", ["invoice/create", "invoice.create\n"])
def test_an_operation_type_that_would_make_scopes_ambiguous_is_refused(operation_type: str) -> None:
    class Slashed(CreateInvoiceHandler):
        pass

    Slashed.operation_type = operation_type
    with pytest.raises(ConfigurationError, match="no '/' and no control characters"):
        Slashed()


async def test_memory_broker_release_is_uncounted_and_a_suspect_stays_a_suspect() -> None:
    broker = MemoryBroker(lock_timeout=0.3)
    broker.send(QUEUE, b"{}")
    seen: asyncio.Queue = asyncio.Queue()

    async def on_delivery(delivery):
        await seen.put((delivery.delivery_count, delivery.redelivered))
        step = seen.qsize()
        if step == 1:
            await delivery.release()  # a shutdown: neither counted nor a redelivery
        elif step == 2:
            await delivery.retry(0)  # a handler fault: counted
        elif step == 3:
            return  # the worker "dies": the lock expires, the broker redelivers
        elif step == 4:
            await delivery.release()  # a suspect released stays a suspect, uncounted
        else:
            await delivery.ack()

    consumer = MemoryConsumer(broker)
    await consumer.subscribe(QUEUE, on_delivery, prefetch=1)
    await broker.wait_idle(5)
    await consumer.close()
    assert [seen.get_nowait() for _ in range(5)] == [
        (1, False), (1, False), (2, False), (3, True), (3, True)
    ]


async def test_memory_broker_abandon_and_lock_renewal() -> None:
    broker = MemoryBroker(lock_timeout=0.5)
    broker.send(QUEUE, b"{}")
    deliveries: asyncio.Queue = asyncio.Queue()

    async def on_delivery(delivery):
        await deliveries.put(delivery)

    consumer = MemoryConsumer(broker)
    await consumer.subscribe(QUEUE, on_delivery, prefetch=1)
    first = await asyncio.wait_for(deliveries.get(), 5)
    assert await first.renew_lock()
    await first._abandon()  # what a failed settlement does: give it back as a redelivery
    second = await asyncio.wait_for(deliveries.get(), 5)
    assert (second.delivery_count, second.redelivered) == (2, True)
    assert not await first.renew_lock()  # the first hand-over is over
    await first.ack()  # too late: the lock is gone, so the settlement is lost, never raised
    assert first.lost
    await second.ack()
    assert not second.lost
    await broker.wait_idle(5)
    await consumer.close()


async def test_memory_consumer_pause_and_resume() -> None:
    broker = MemoryBroker(lock_timeout=5)
    broker.send(QUEUE, b"{}", message_id="held")
    deliveries: asyncio.Queue = asyncio.Queue()

    async def on_delivery(delivery):
        await deliveries.put(delivery)

    consumer = MemoryConsumer(broker)
    await consumer.subscribe(QUEUE, on_delivery, prefetch=4)
    held = await asyncio.wait_for(deliveries.get(), 5)
    await consumer.pause()
    await consumer.pause()  # idempotent
    for n in range(3):
        broker.send(QUEUE, b"{}", message_id=f"waiting-{n}")
    # Nothing is handed out while paused: a running pump would take a ready message within a
    # loop turn or two; after twenty the messages are still on the queue.
    for _ in range(20):
        await asyncio.sleep(0)
    assert broker.ready_count(QUEUE) == 3 and deliveries.empty()
    await held.ack()  # in flight: settles while paused
    assert not held.lost
    await consumer.resume()
    await consumer.resume()  # idempotent
    got = [await asyncio.wait_for(deliveries.get(), 5) for _ in range(3)]
    assert [d.message_id for d in got] == ["waiting-0", "waiting-1", "waiting-2"]
    for delivery in got:
        await delivery.ack()
    await broker.wait_idle(5)
    await consumer.close()
