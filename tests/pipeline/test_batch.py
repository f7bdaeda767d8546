"""The batch path (docs/how-to/batches.md) on the real PostgreSQL, the memory broker and RabbitMQ.

A batch is handed to ``Runtime.process_batch`` exactly as gathered (a callback that holds the
deliveries until all are there), so each test knows which deliveries shared a transaction.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from collections.abc import Sequence
from typing import Any, ClassVar

import pytest

from consumer_kit import App, ConfigurationError, Context, Outcome, Result
from consumer_kit.adapters.memory import MemoryBroker, MemoryConsumer
from consumer_kit.broker import Delivery, Settlement
from consumer_kit.demo.app import CreateInvoice, CreateInvoiceHandler
from consumer_kit.handler import Handler
from consumer_kit.model.outcomes import DeliveryReport
from consumer_kit.pipeline.batching import Batcher, batch_setting
from tests.fixtures.batches import run_as_one_batch
from tests.fixtures.harness import fetch_all, runtime_for, throwaway_schema
from tests.fixtures.tcp_proxy import TcpProxy

QUEUE = "invoices.commands"
FAILING_ORDER = 13  # the handler raises (a handler fault)
REJECTED_ORDER = 14  # the handler's statement is refused by the database (class 22: a message fault)


class BatchInvoiceHandler(CreateInvoiceHandler):
    batch_size = 50
    batch_wait = 0.01

    async def handle(self, message: CreateInvoice, ctx: Context) -> Result:
        if message.order_id == FAILING_ORDER:
            raise RuntimeError("the handler's own bug")
        if message.order_id == REJECTED_ORDER:
            await ctx.connection.execute("SELECT 1 / 0")
        return await super().handle(message, ctx)


def command(order_id: int, amount: int = 100, **extra: object) -> bytes:
    body = {
        "order_id": order_id, "revision": 1, "customer_id": f"c-{order_id % 3}", "amount_cents": amount,
        "currency": "EUR", "requested_at": dt.datetime.now(dt.UTC).isoformat(),
    }
    body.update(extra)
    return json.dumps(body).encode()


def batch_app(handler: Handler[Any] | None = None) -> App:
    app = App("batches")
    app.subscribe(QUEUE, handler or BatchInvoiceHandler())
    return app


def outcome_of(reports: Sequence[DeliveryReport], message_id: str) -> list[str]:
    return [r.outcome.value for r in reports if r.message_id == message_id]


async def test_each_item_of_a_mixed_batch_gets_its_own_outcome(database_url: str) -> None:
    async with throwaway_schema(database_url) as schema, runtime_for(
        batch_app(), database_url, schema, retry_delays=[0.05], max_deliveries=2
    ) as rt:
        broker = MemoryBroker()
        # a completed operation first: its copy in the batch is a duplicate, another intent a conflict
        broker.send(QUEUE, command(1))
        assert [r.outcome for r in await run_as_one_batch(broker, rt, 1)] == [Outcome.EXECUTED]
        ids = {
            "new-a": broker.send(QUEUE, command(2)),
            "duplicate": broker.send(QUEUE, command(1)),
            "conflict": broker.send(QUEUE, command(1, amount=999)),
            "invalid": broker.send(QUEUE, b'{"order_id": "not json'),
            "handler-fault": broker.send(QUEUE, command(FAILING_ORDER)),
            "rejected": broker.send(QUEUE, command(REJECTED_ORDER)),
            "permanent": broker.send(QUEUE, command(5, amount=-1)),
            "new-b": broker.send(QUEUE, command(6)),
            "same-key-twice": broker.send(QUEUE, command(6)),
        }
        reports = await run_as_one_batch(broker, rt, len(ids))
        assert outcome_of(reports, ids["new-a"]) == ["executed"]
        assert outcome_of(reports, ids["new-b"]) == ["executed"]
        assert outcome_of(reports, ids["duplicate"]) == ["duplicate"]
        assert outcome_of(reports, ids["same-key-twice"]) == ["duplicate"]
        assert outcome_of(reports, ids["conflict"]) == ["payload_conflict"]
        assert outcome_of(reports, ids["invalid"]) == ["invalid"]
        assert outcome_of(reports, ids["rejected"]) == ["invalid"]  # dead-lettered at once
        assert outcome_of(reports, ids["permanent"]) == ["failed"]
        # the handler fault: retried, then dead-lettered after max_deliveries (2) counted attempts
        assert outcome_of(reports, ids["handler-fault"]) == ["retried", "dead_lettered"]
        dead = sorted(d.reason.split(":")[0] for d in broker.dead_letters(QUEUE))
        assert dead == sorted(["payload_conflict", "invalid_json", "invalid_data", "max_deliveries_exceeded"]), dead

        # the effects: one per executed operation, nothing of the failing ones
        assert await fetch_all(database_url, schema, "SELECT order_id FROM invoices ORDER BY order_id") == [(1,), (2,), (6,)]
        assert len(await fetch_all(database_url, schema, "SELECT * FROM outbox")) == 3
        states = dict(await fetch_all(database_url, schema, "SELECT key, state FROM operations"))
        assert states == {
            "order-1-rev-1": "completed", "order-2-rev-1": "completed", "order-6-rev-1": "completed",
            "order-5-rev-1": "failed",
        }
        # only the faulty item was counted: nobody else lost an attempt
        counted = await fetch_all(database_url, schema, "SELECT key, failures FROM attempts WHERE failures > 0")
        assert counted == [(f"order-{FAILING_ORDER}-rev-1", 2)]


async def test_redeliveries_of_a_batch_answer_from_the_ledger(database_url: str) -> None:
    async with throwaway_schema(database_url) as schema, runtime_for(batch_app(), database_url, schema) as rt:
        broker = MemoryBroker()
        for order in range(100, 120):
            broker.send(QUEUE, command(order))
        first = await run_as_one_batch(broker, rt, 20)
        assert {r.outcome for r in first} == {Outcome.EXECUTED}
        for order in range(100, 120):
            broker.send(QUEUE, command(order))
        again = await run_as_one_batch(broker, rt, 20)
        assert [r.outcome for r in again] == [Outcome.DUPLICATE] * 20
        assert len(await fetch_all(database_url, schema, "SELECT * FROM invoices")) == 20
        assert len(await fetch_all(database_url, schema, "SELECT * FROM outbox")) == 20


async def test_database_down_gives_the_whole_batch_back_uncounted(database_url: str) -> None:
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(database_url)
    proxy = TcpProxy(parts.hostname or "127.0.0.1", parts.port or 5432)
    port = await proxy.start()
    proxied = urlunsplit(parts._replace(netloc=f"{parts.username or 'postgres'}@127.0.0.1:{port}"))
    try:
        async with throwaway_schema(database_url) as schema, runtime_for(
            batch_app(), proxied, schema, statement_timeout=1.0, lock_timeout=0.5
        ) as rt:
            broker = MemoryBroker()
            for order in range(10):
                broker.send(QUEUE, command(order))
            held: list[Delivery] = []
            gathered = asyncio.Event()
            consumer = MemoryConsumer(broker)

            async def on_delivery(delivery: Delivery) -> None:
                held.append(delivery)
                if len(held) == 10:
                    gathered.set()

            await consumer.subscribe(QUEUE, on_delivery, prefetch=10)
            await asyncio.wait_for(gathered.wait(), 10)
            await consumer.close()
            await proxy.drop()
            proxy.pause()  # the database is unreachable now
            reports = await rt.process_batch(held)
            assert [r.outcome for r in reports] == [Outcome.RELEASED] * 10
            proxy.resume()
            assert await fetch_all(database_url, schema, "SELECT * FROM invoices") == []
            assert await fetch_all(database_url, schema, "SELECT * FROM operations") == []
            assert await fetch_all(database_url, schema, "SELECT * FROM attempts") == []
            # given back uncounted: the next deliveries are first deliveries, and execute
            again = await run_as_one_batch(broker, rt, 10)
            assert [r.outcome for r in again] == [Outcome.EXECUTED] * 10
            assert {r.delivery_count for r in again} == {1}
    finally:
        await proxy.close()


async def test_a_crash_in_the_middle_of_a_batch_leaves_nothing_half_committed(database_url: str) -> None:
    from consumer_kit.errors import SimulatedCrash
    from consumer_kit.pipeline import crashpoints
    from consumer_kit.pipeline.crashpoints import CrashPoint

    async with throwaway_schema(database_url) as schema, runtime_for(batch_app(), database_url, schema) as rt:
        broker = MemoryBroker(lock_timeout=0.5)
        for order in range(10):
            broker.send(QUEUE, command(order))
        held: list[Delivery] = []
        crashed = asyncio.Event()
        reports: list[DeliveryReport] = []

        async def on_delivery(delivery: Delivery) -> None:
            if crashed.is_set():
                reports.append(await rt.process(delivery))
                return
            held.append(delivery)
            if len(held) == 10:
                crashpoints.arm(CrashPoint.IN_HANDLER)
                try:
                    await rt.process_batch(held)
                except SimulatedCrash:
                    crashed.set()

        consumer = MemoryConsumer(broker)
        await consumer.subscribe(QUEUE, on_delivery, prefetch=10)
        try:
            await broker.wait_idle(30)
        finally:
            crashpoints.disarm_all()
            await consumer.close()
        assert crashed.is_set()
        # nothing of the dead batch committed; every redelivery executed once
        assert sorted(r.outcome.value for r in reports) == ["executed"] * 10
        assert len(await fetch_all(database_url, schema, "SELECT * FROM invoices")) == 10


async def test_the_batcher_gathers_what_arrives_together(database_url: str) -> None:
    async with throwaway_schema(database_url) as schema, runtime_for(batch_app(), database_url, schema) as rt:
        broker = MemoryBroker()
        sizes: list[int] = []

        async def run(deliveries: Sequence[Delivery]) -> None:
            sizes.append(len(deliveries))
            await rt.process_batch(deliveries)

        size, wait = batch_setting(batch_app(), QUEUE)
        assert (size, wait) == (50, 0.01)
        batcher = Batcher(run, size=10, wait=wait)
        for order in range(100, 125):
            broker.send(QUEUE, command(order))
        consumer = MemoryConsumer(broker)
        await consumer.subscribe(QUEUE, batcher.add, prefetch=25)
        await broker.wait_idle(30)
        await consumer.close()
        assert sum(sizes) == 25 and max(sizes) == 10, sizes
        assert len(await fetch_all(database_url, schema, "SELECT * FROM invoices")) == 25


async def test_a_cancelled_delivery_is_released_while_held_and_cancels_its_running_batch() -> None:
    broker = MemoryBroker()
    inbox: asyncio.Queue[Delivery] = asyncio.Queue()
    never = asyncio.Event()

    async def hold(delivery: Delivery) -> None:
        inbox.put_nowait(delivery)
        await never.wait()

    async def run(deliveries: Sequence[Delivery]) -> None:
        try:
            await never.wait()
        except asyncio.CancelledError:
            for delivery in deliveries:
                await delivery.release()  # as process_batch does
            raise

    batcher = Batcher(run, size=2, wait=3600.0)
    for order in range(3):
        broker.send(QUEUE, command(order))
    consumer = MemoryConsumer(broker)
    await consumer.subscribe(QUEUE, hold, prefetch=3)
    first, second, third = [await asyncio.wait_for(inbox.get(), 10) for _ in range(3)]
    in_batch = [asyncio.create_task(batcher.add(first)), asyncio.create_task(batcher.add(second))]
    held = asyncio.create_task(batcher.add(third))
    await asyncio.sleep(0)  # each add runs up to its wait; the first two make a full batch
    held.cancel()
    with pytest.raises(asyncio.CancelledError):
        await held
    assert third.settlement is Settlement.RELEASED and first.settlement is None
    in_batch[0].cancel()
    results = await asyncio.gather(*in_batch, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in results), results
    assert (first.settlement, second.settlement) == (Settlement.RELEASED, Settlement.RELEASED)
    never.set()  # the adapter's callbacks end
    await consumer.close()


async def test_each_delivery_has_its_span_linked_to_the_batch(database_url: str, otel) -> None:  # type: ignore[no-untyped-def]
    async with throwaway_schema(database_url) as schema, runtime_for(batch_app(), database_url, schema) as rt:
        broker = MemoryBroker()
        for order in range(3):
            broker.send(QUEUE, command(order))
        await run_as_one_batch(broker, rt, 3)
        spans = otel.spans()
        (batch,) = [s for s in spans if s.name == f"process batch {QUEUE}"]
        members = [s for s in spans if s.name == f"process {QUEUE}"]
        assert len(members) == 3
        for member in members:
            assert [link.context.span_id for link in member.links] == [batch.context.span_id]
            assert member.attributes["consumer_kit.outcome"] == "executed"
        handles = [s for s in spans if s.name == "consumer_kit.handle"]
        assert sorted(s.parent.span_id for s in handles) == sorted(m.context.span_id for m in members)
        assert [s.parent.span_id for s in spans if s.name == "consumer_kit.claim"] == [batch.context.span_id]


def test_external_effects_cannot_batch() -> None:
    class Leased(CreateInvoiceHandler):
        external_effects: ClassVar[bool] = True
        batch_size = 10

    with pytest.raises(ConfigurationError, match="external_effects and batch_size 10"):
        Leased()


@pytest.mark.parametrize("size", [0, -1, 1001, 2.5, True])
def test_a_bad_batch_size_is_refused(size: object) -> None:
    class Bad(CreateInvoiceHandler):
        batch_size = size  # type: ignore[assignment]

    with pytest.raises(ConfigurationError, match="batch_size must be an int"):
        Bad()


async def test_batches_on_rabbitmq_with_a_worker(env) -> None:  # type: ignore[no-untyped-def]
    app = App("batches")
    app.subscribe(env.queue, BatchInvoiceHandler())
    async with env.worker(app):
        ids = [await env.send(command(order)) for order in range(100, 140)]
        ids += [await env.send(command(order)) for order in range(100, 110)]  # 10 duplicates
        ids.append(await env.send(command(101, amount=5)))  # a conflict
        reports = await env.reports_until(
            lambda seen: sum(r.outcome is not Outcome.IN_PROGRESS for r in seen) >= len(ids), timeout=60
        )
    outcomes = sorted(r.outcome.value for r in reports)
    assert outcomes.count("executed") == 40
    assert outcomes.count("duplicate") == 10
    assert outcomes.count("payload_conflict") == 1
    assert len(await fetch_all(env.database_url, env.schema, "SELECT * FROM invoices")) == 40
    assert len(await fetch_all(env.database_url, env.schema, "SELECT * FROM outbox")) == 40


async def test_handle_batch_runs_once_and_falls_back_item_by_item(database_url: str) -> None:
    from consumer_kit.demo.batches import BatchCreateInvoiceHandler

    class Counting(BatchCreateInvoiceHandler):
        calls = 0

        async def handle_batch(self, batch):  # type: ignore[no-untyped-def,override]
            type(self).calls += 1
            return await super().handle_batch(batch)

    async with throwaway_schema(database_url) as schema, runtime_for(batch_app(Counting()), database_url, schema) as rt:
        broker = MemoryBroker()
        for order in range(100, 110):
            broker.send(QUEUE, command(order))
        reports = await run_as_one_batch(broker, rt, 10)
        assert [r.outcome for r in reports] == [Outcome.EXECUTED] * 10
        assert Counting.calls == 1  # one call for the whole batch
        assert len(await fetch_all(database_url, schema, "SELECT * FROM outbox")) == 10
        # one negative amount: handle_batch raises, the batch runs again through handle() item by
        # item; that item fails on its own (recorded), the others execute
        for order in range(200, 205):
            broker.send(QUEUE, command(order, amount=-1 if order == 202 else 100))
        reports = await run_as_one_batch(broker, rt, 5)
        assert sorted(r.outcome.value for r in reports) == ["executed"] * 4 + ["failed"]
        assert Counting.calls == 2
        rows = await fetch_all(database_url, schema, "SELECT order_id FROM invoices WHERE order_id >= 200 ORDER BY 1")
        assert rows == [(200,), (201,), (203,), (204,)]
        assert await fetch_all(database_url, schema, "SELECT key, failures FROM attempts WHERE failures > 0") == []


async def test_a_batch_holds_the_lanes_of_its_partition_keys(database_url: str) -> None:
    """Two deliveries of one aggregate never run at once, whether batched or alone."""
    running: dict[str, int] = {}
    overlaps: list[str] = []

    class Laned(BatchInvoiceHandler):
        def partition_key(self, message, envelope):  # type: ignore[no-untyped-def,override]
            return message.customer_id

        async def handle(self, message, ctx):  # type: ignore[no-untyped-def,override]
            running[message.customer_id] = running.get(message.customer_id, 0) + 1
            if running[message.customer_id] > 1:
                overlaps.append(message.customer_id)
            await asyncio.sleep(0)
            try:
                return await super().handle(message, ctx)
            finally:
                running[message.customer_id] -= 1

    class Small(Laned):
        batch_size = 4
        batch_wait = 0.0

    async with throwaway_schema(database_url) as schema, runtime_for(batch_app(Small()), database_url, schema) as rt:
        broker = MemoryBroker()
        batcher = Batcher(rt.process_batch, size=4, wait=0.0, limit=4)
        for order in range(100, 140):
            broker.send(QUEUE, command(order))
        consumer = MemoryConsumer(broker)
        await consumer.subscribe(QUEUE, batcher.add, prefetch=40)
        await broker.wait_idle(30)
        await consumer.close()
        assert overlaps == []
        assert len(await fetch_all(database_url, schema, "SELECT * FROM invoices")) == 40


async def test_a_batch_writes_each_keys_events_in_publish_order(database_url: str) -> None:
    """The batch's events go in partition-key order (one lock order for every batch); within a
    key they keep the order their deliveries had (commit_seq, which the relay follows)."""
    async with throwaway_schema(database_url) as schema, runtime_for(batch_app(), database_url, schema) as rt:
        broker = MemoryBroker()
        orders = [105, 101, 104, 102, 103, 100]  # customers c-0, c-2, c-2, c-0, c-1, c-1
        for order in orders:
            broker.send(QUEUE, command(order))
        reports = await run_as_one_batch(broker, rt, len(orders))
        assert {r.outcome for r in reports} == {Outcome.EXECUTED}
        rows = await fetch_all(
            database_url, schema,
            "SELECT partition_key, (payload ->> 'order_id')::int FROM outbox ORDER BY partition_key, commit_seq",
        )
        expected = sorted(((f"c-{o % 3}", o) for o in orders), key=lambda r: (r[0], orders.index(r[1])))
        assert rows == expected
