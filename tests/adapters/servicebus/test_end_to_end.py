"""End to end: the invoices example on Service Bus (the local test server, through the real
azure-servicebus SDK) with ``consumer_kit.worker.process.Worker``, the outbox relay and the real PostgreSQL.

The broker contract suite runs the rest of the issue's cases on Service Bus through the same worker
(``tests/adapters/contract``, driver ``servicebus``): duplicates, payload conflict, a crash before the ack
(a lapsed lock: a suspect, answered as a duplicate), a retry waiting its delay (a scheduled copy),
dead-letters with reason and description read from the dead-letter sub-queue, invalid input, lock
renewal past the lock, a settlement after a lost lock, oversized events and dead-letters, and
uncounted shutdown give-backs. This module adds what is Service Bus's own: the example configured
by environment alone, the dead-letter sub-queue read through the SDK, a lock Service Bus drops
under a running handler, sessions, prefetched deliveries given back at shutdown, and the relay's
batches.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from azure.servicebus import ServiceBusMessage
from psycopg import sql

from consumer_kit import App, Context, DeliveryReport, Handler, Outcome, Settings
from consumer_kit.adapters.servicebus import ServiceBusConsumer, ServiceBusPublisher
from consumer_kit.demo.app import CreateInvoice, CreateInvoiceHandler
from consumer_kit.outbox_relay import Relay
from consumer_kit.outbox_relay.settings import RelaySettings
from consumer_kit.pipeline import crashpoints
from consumer_kit.pipeline.crashpoints import CrashPoint
from consumer_kit.worker.process import Worker
from tests.adapters.servicebus.server import Queue
from tests.adapters.servicebus.server.fixtures import SBEnv, eventually
from tests.fixtures.broker_env import command
from tests.fixtures.harness import fetch_all, throwaway_schema
from tests.fixtures.relay_support import Event, connect, write_events

pytestmark = pytest.mark.postgres


class World:
    """One test's queue on the Service Bus test server, its schema, settings, workers and reports."""

    def __init__(self, sb: SBEnv, database_url: str, schema: str) -> None:
        self.sb = sb
        self.database_url, self.schema = database_url, schema
        self.queue = sb.queue
        self.reports: asyncio.Queue[DeliveryReport] = asyncio.Queue()
        self.consumers: list[ServiceBusConsumer] = []

    def settings(self, **overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "database_url": self.database_url, "db_schema": self.schema, "search_path": self.schema,
            "broker_url": "servicebus://", "retry_delays": [0.3], "in_progress_delay": 0.3,
            "max_deliveries": 3, "concurrency": 4, "lock_timeout": 2.0, "shutdown_timeout": 5.0,
            "settle_timeout": 5.0,
        }
        values.update(overrides)
        return Settings(**values)

    @asynccontextmanager
    async def worker(
        self, handler: Handler[Any] | None = None, *, sessions: bool = False, **overrides: Any
    ) -> AsyncIterator[Worker]:
        app = App("servicebus-test")
        app.subscribe(self.queue, handler or CreateInvoiceHandler())
        settings = self.settings(**overrides)
        consumer = self.sb.consumer(settle_timeout=settings.settle_timeout,
                                    session_entities=[self.queue] if sessions else [])
        self.consumers.append(consumer)
        worker = Worker(app, settings, consumer=consumer, on_report=self.reports.put_nowait)
        async with running(worker):
            yield worker

    async def send(self, body: bytes, **fields: Any) -> str:
        [message_id] = await self.sb.send_bodies(body, **fields)
        return message_id

    async def next_reports(self, count: int, timeout: float = 20.0) -> list[DeliveryReport]:
        return [await asyncio.wait_for(self.reports.get(), timeout) for _ in range(count)]

    async def rows(self, query: str, *params: Any) -> list[tuple[Any, ...]]:
        return await fetch_all(self.database_url, self.schema, query, *params)

    async def assert_one_effect(self, amount: int = 1250) -> None:
        assert len(await self.rows("SELECT invoice_id FROM invoices")) == 1
        assert await self.rows("SELECT invoiced_cents FROM customers") == [(amount,)]
        assert len(await self.rows("SELECT event_id FROM outbox")) == 1


@asynccontextmanager
async def running(worker: Worker) -> AsyncIterator[Worker]:
    """Run ``worker`` until the block ends, then stop it gracefully."""
    task = asyncio.create_task(worker.run())
    started = asyncio.create_task(worker.started.wait())
    await asyncio.wait({task, started}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        task.result()  # start-up failed: raise its error
    try:
        yield worker
    finally:
        worker.stop()
        await asyncio.wait_for(task, 30)


@pytest.fixture
async def world(sb: SBEnv, database_url: str) -> AsyncIterator[World]:
    async with throwaway_schema(database_url) as schema:
        yield World(sb, database_url, schema)


# -- the example, configured by environment only ----------------------------------------------------


async def test_the_invoices_example_runs_on_service_bus_by_changing_only_broker_settings(
    sb: SBEnv, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``consumer_kit.demo.app:app`` and the relay, set up from CONSUMER_KIT_* variables alone (what
    the README shows): the same command three times makes one invoice and one InvoiceCreated event,
    published to the ``billing.events`` topic with message id = event id and session id = customer."""
    from consumer_kit.demo.app import app

    queue = sb.create_queue("invoices.commands", lock_duration=30)
    sb.server.create_topic("billing.events")
    ledger = sb.server.create_subscription("billing.events", "ledger")
    async with throwaway_schema(database_url) as schema:
        for name, value in {
            "CONSUMER_KIT_DATABASE_URL": database_url, "CONSUMER_KIT_DB_SCHEMA": schema,
            "CONSUMER_KIT_SEARCH_PATH": schema, "CONSUMER_KIT_BROKER_URL": "servicebus://",
            "CONSUMER_KIT_SERVICEBUS_CONNECTION_STRING": sb.server.connection_string,
            "CONSUMER_KIT_SERVICEBUS_RECEIVE_WAIT": "0.2",
        }.items():
            monkeypatch.setenv(name, value)
        reports: asyncio.Queue[DeliveryReport] = asyncio.Queue()
        worker = Worker(app, on_report=reports.put_nowait)  # Settings() from the environment
        async with running(worker):
            assert isinstance(worker._consumer, ServiceBusConsumer)
            await sb.send_bodies(command(), command(), command(), entity="invoices.commands")
            outcomes = sorted([(await asyncio.wait_for(reports.get(), 20)).outcome for _ in range(3)])
        assert outcomes == sorted([Outcome.EXECUTED, Outcome.DUPLICATE, Outcome.DUPLICATE])
        assert queue.messages == []
        relay = Relay(RelaySettings())
        await relay.run(once=True)
        assert relay.counters["published"] == 1
        [(event_id, customer)] = await fetch_all(
            database_url, schema, "SELECT event_id, partition_key FROM outbox")
        [published] = ledger.messages
        assert (published.message_id, published.session_id) == (str(event_id), customer)
        assert published.application_properties["message-type"] == "InvoiceCreated"
        assert json.loads(published.body)["customer_id"] == customer == "c-1"


# -- duplicates, conflicts, invalid input -------------------------------------------------------------


async def test_duplicates_conflict_and_invalid_input_on_service_bus(world: World) -> None:
    world.sb.create_queue(lock_duration=30)
    async with world.worker():
        await world.send(command())
        await world.send(command())
        first, duplicate = await world.next_reports(2)
        conflict_id = await world.send(command(amount=9999))
        (conflict,) = await world.next_reports(1)
        invalid_id = await world.send(b"{not json")
        (invalid,) = await world.next_reports(1)
    # the two copies may report in either order: a duplicate that waited on the first's claim is
    # answered as soon as that claim commits, possibly before the first's own report
    assert sorted(r.outcome for r in (first, duplicate)) == sorted([Outcome.EXECUTED, Outcome.DUPLICATE])
    assert [r.outcome for r in (conflict, invalid)] == [Outcome.PAYLOAD_CONFLICT, Outcome.INVALID]
    dead = {m.message_id: m for m in await world.sb.dead_letters(2)}
    assert dead[conflict_id].dead_letter_reason == "payload_conflict"
    assert "another fingerprint" in (dead[conflict_id].dead_letter_error_description or "")
    assert dead[invalid_id].dead_letter_reason == "invalid_json"
    assert json.loads(b"".join(dead[conflict_id].body))["amount_cents"] == 9999  # the message, unchanged
    await world.assert_one_effect()
    assert world.sb.entity().messages == []


# -- crashes, retries, dead letters -------------------------------------------------------------------


class SlowHandler(CreateInvoiceHandler):
    """Creates the invoice after waiting ``seconds`` (or until ``proceed`` is set, when given)."""

    def __init__(self, seconds: float = 0.0, proceed: asyncio.Event | None = None) -> None:
        self.seconds, self.proceed = seconds, proceed
        self.started = asyncio.Event()

    async def handle(self, message: CreateInvoice, ctx: Context) -> Any:
        self.started.set()
        if self.proceed is not None and not self.proceed.is_set():
            await self.proceed.wait()
        await asyncio.sleep(self.seconds)
        return await super().handle(message, ctx)


async def test_a_lock_lost_before_the_ack_is_never_acked_and_the_redelivery_is_a_duplicate(world: World) -> None:
    queue = world.sb.create_queue(lock_duration=30)
    proceed = asyncio.Event()
    handler = SlowHandler(proceed=proceed)
    async with world.worker(handler, concurrency=1, prefetch=1):  # the redelivery waits for the slot
        await world.send(command())
        await asyncio.wait_for(handler.started.wait(), 10)
        queue.expire_all_locks(time.time())  # Service Bus takes the lock away while the handler runs
        await eventually(lambda: queue.locked_count == 0, within=5, what="the lock to go")
        proceed.set()
        first, redelivery = await world.next_reports(2)
    assert (first.outcome, first.settlement_lost) == (Outcome.EXECUTED, True)  # committed, never acked
    assert (redelivery.outcome, redelivery.redelivered, redelivery.delivery_count) == (Outcome.DUPLICATE, True, 2)
    assert world.consumers[-1].counters["locks_lost"] == 1
    await world.assert_one_effect()
    assert queue.messages == []


# -- sessions and shutdown ---------------------------------------------------------------------------


class OrderRecorder(CreateInvoiceHandler):
    """Records, per customer, the order ids in the order their handlers ran."""

    def __init__(self) -> None:
        self.seen: dict[str, list[int]] = defaultdict(list)

    def operation_key(self, message: CreateInvoice, envelope: Any) -> str:
        return f"order-{message.order_id}"

    async def handle(self, message: CreateInvoice, ctx: Context) -> Any:
        self.seen[message.customer_id].append(message.order_id)
        await asyncio.sleep(0.02)
        return await super().handle(message, ctx)


async def test_one_customers_commands_run_in_order_in_their_session_with_concurrency(world: World) -> None:
    world.sb.create_queue(lock_duration=30, requires_session=True)
    recorder = OrderRecorder()
    commands = [(customer, order) for order in range(1, 6) for customer in ("c-1", "c-2", "c-3")]
    await world.sb.send(*(
        ServiceBusMessage(command(order_id=order * 10 + int(customer[-1]), customer_id=customer), session_id=customer)
        for customer, order in commands
    ))
    async with world.worker(recorder, sessions=True, concurrency=4):
        reports = await world.next_reports(len(commands))
    assert {r.outcome for r in reports} == {Outcome.EXECUTED}
    assert recorder.seen == {c: [o * 10 + int(c[-1]) for o in range(1, 6)] for c in ("c-1", "c-2", "c-3")}
    assert len(await world.rows("SELECT invoice_id FROM invoices")) == len(commands)


async def test_a_session_message_that_killed_its_worker_runs_alone_though_azure_never_counts_it(
    world: World,
) -> None:
    """Service Bus returns a session message left unsettled by a closed session *uncounted*
    (Microsoft's *Message sessions* page: "the messages within the session aren't completed ...
    and the session is closed: No"), so a message that killed its worker comes back looking fresh
    and would never run alone, never count a crash, never reach ``crash_limit``. The hold mark in
    the session state makes it a suspect: it runs alone under the ledger's run-alone marker (which
    counts a death and parks at ``crash_limit``, ``consumer_kit.pipeline.isolation``)."""
    queue = world.sb.create_queue(lock_duration=30, requires_session=True, max_delivery_count=50)
    crashpoints.arm(CrashPoint.IN_HANDLER, times=-1)  # the handler kills its process
    try:
        await world.send(command(), session_id="c-1")
        async with world.worker(sessions=True, prefetch=1):  # (a crash is logged, not reported)
            consumer = world.consumers[-1]
            # redelivered: already a suspect, though Azure did not count it
            await eventually(lambda: consumer.counters["suspects"] >= 1, within=20, what="a suspect")
            assert [m.delivery_count for m in queue.messages] == [0]  # never counted by the broker
            crashpoints.disarm_all()
            [again] = await world.next_reports(1)
    finally:
        crashpoints.disarm_all()
    assert (again.outcome, again.redelivered, again.delivery_count) == (Outcome.EXECUTED, True, 1)
    [(history,)] = await world.rows("SELECT history FROM attempts")
    assert "run_alone" in [entry["kind"] for entry in history]  # it ran alone, under the marker
    await world.assert_one_effect()
    assert queue.messages == [] and queue.dead_letters == []


async def test_shutdown_gives_running_and_waiting_deliveries_back_at_once(world: World) -> None:
    """A graceful stop: the running delivery and the ones waiting for its slot go back to Service
    Bus right away (uncounted copies), not when their 30 s locks lapse; nothing was executed."""
    queue: Queue = world.sb.create_queue(lock_duration=30)
    handler = SlowHandler(proceed=asyncio.Event())  # never proceeds
    await world.sb.send(*(ServiceBusMessage(command(order_id=order_id)) for order_id in (1, 2, 3)))
    async with world.worker(handler, concurrency=1, prefetch=3, shutdown_timeout=0.5):
        await asyncio.wait_for(handler.started.wait(), 10)
        await eventually(lambda: queue.locked_count == 3, within=5, what="three deliveries in hand")
    stopped_at = time.monotonic()
    await eventually(lambda: queue.locked_count == 0 and queue.active_count == 3, within=5,
                     what="the deliveries to be back")
    assert time.monotonic() - stopped_at < 5
    assert await world.rows("SELECT * FROM invoices") == []
    assert world.consumers[-1].counters["release_copies"] == 3
    assert {m.delivery_count for m in queue.messages} == {0}  # the copies: not counted by Service Bus


# -- the relay ---------------------------------------------------------------------------------------


async def test_the_relay_publishes_a_batch_with_event_ids_and_partition_keys_and_parks_an_oversized_event(
    sb: SBEnv, database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    topic, limit = sb.topic, 64 * 1024
    sb.create_topic(max_message_size=limit)
    ledger = sb.create_subscription("ledger")
    events = [Event(topic, partition_key=f"customer-{n}", payload={"n": n}) for n in range(10)]
    oversized = Event(topic, partition_key="customer-big", payload={"blob": "blob-" + "x" * 100_000})
    async with throwaway_schema(database_url) as schema:
        async with await connect(database_url) as conn:
            await write_events(conn, schema, [*events[:5], oversized, *events[5:]])
        settings = RelaySettings(
            database_url=database_url, db_schema=schema, broker_url="servicebus://", relay_claim_timeout=10.0,
            relay_backoff_base=0.1, relay_backoff_max=0.5, settle_timeout=5.0,
        )
        publisher = ServiceBusPublisher(sb.namespace, confirm_timeout=5.0)
        relay = Relay(settings, publisher=publisher)
        try:
            with caplog.at_level("INFO"):
                await relay.run(once=True)
            batches = [batcher.batches_sent for batcher in publisher._batchers.values()]
        finally:
            await publisher.close()
        assert (relay.counters["published"], relay.counters["parked_permanent"]) == (10, 1)
        table = sql.Identifier(schema, "outbox").as_string(None)
        [(attempts, last_error)] = await fetch_all(
            database_url, schema, f"SELECT attempts, last_error FROM {table} WHERE event_id = %s", oversized.event_id)
        assert attempts == settings.relay_max_attempts  # parked after a single try
        assert f"{limit}-byte message limit" in last_error
        assert str(oversized.event_id) in caplog.text and "blob-" not in caplog.text
    assert batches == [1]  # ten events of ten keys, one ServiceBusMessageBatch (a plain entity)
    stored = ledger.messages
    assert sorted((m.message_id, m.session_id) for m in stored) == sorted(
        (str(e.event_id), e.partition_key) for e in events
    )
    assert all(m.application_properties["message-type"] == "ThingHappened" for m in stored)
