"""The relay end to end: real PostgreSQL, real RabbitMQ .

RabbitMQ is never stopped: "broker down" is a TCP proxy in front of it (``tests.fixtures.tcp_proxy``) that
refuses connections and cuts the open ones. Relay processes are real (``python -m consumer_kit.outbox_relay.cli``) where a test kills
or signals them.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import signal
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any
from urllib.parse import urlparse, urlunparse

import aio_pika
import pytest
from psycopg import sql

from consumer_kit import App, OutgoingMessage
from consumer_kit.adapters.memory import MemoryBroker, MemoryConsumer
from consumer_kit.adapters.rabbitmq import RabbitMQPublisher
from consumer_kit.broker.registry import open_publisher
from consumer_kit.demo.app import CreateInvoiceHandler
from consumer_kit.outbox_relay import Relay, relay_pending
from tests.fixtures.harness import runtime_for, throwaway_schema
from tests.fixtures.relay_support import (
    Event,
    Recorder,
    connect,
    relay_settings,
    rows,
    start_relay_process,
    stop_process,
    wait_until,
    write_events,
)
from tests.fixtures.tcp_proxy import TcpProxy

pytestmark = pytest.mark.rabbitmq


def keyed_events(writer: int, keys: int, per_key: int, destination: str) -> list[Event]:
    """Events of writer ``writer``: its own keys, ``seq`` 0.. per key in write order."""
    return [
        Event(destination, "thing.happened", partition_key=f"w{writer}-k{k}",
              payload={"key": f"w{writer}-k{k}", "seq": s})
        for s in range(per_key) for k in range(keys)
    ]


async def write_concurrently(
    database_url: str, schema: str, batches_per_writer: list[list[list[Event]]]
) -> list[uuid.UUID]:
    """One connection per writer; each writer commits its batches (one transaction each) in order;
    writers run concurrently."""

    async def writer(batches: list[list[Event]]) -> list[uuid.UUID]:
        ids: list[uuid.UUID] = []
        async with await connect(database_url) as conn:
            for batch in batches:
                ids += await write_events(conn, schema, batch)
        return ids

    results = await asyncio.gather(*(writer(b) for b in batches_per_writer))
    return [i for ids in results for i in ids]


def chunks(events: list[Event], size: int) -> list[list[Event]]:
    return [events[i:i + size] for i in range(0, len(events), size)]


def assert_key_order(received: list[Any]) -> None:
    """Per key, first arrivals carry seq 0, 1, 2, ... (republished copies may come again later)."""
    seen: set[str] = set()
    last: dict[str, int] = defaultdict(lambda: -1)
    for r in received:
        if r.message_id in seen or "key" not in r.body:
            continue
        seen.add(r.message_id)
        key, seq = r.body["key"], r.body["seq"]
        assert seq == last[key] + 1, f"key {key}: seq {seq} after {last[key]}"
        last[key] = seq


async def test_10k_events_from_concurrent_transactions_survive_a_sigkilled_relay(
    database_url: str, rabbitmq_url: str, unique_name: str, tmp_path: Path
) -> None:
    async with throwaway_schema(database_url) as schema, Recorder(rabbitmq_url, unique_name) as rec:
        # 8 writers x 125 transactions x 10 rows; half keyed (5 keys per writer), half unkeyed.
        per_writer = []
        for w in range(8):
            keyed = keyed_events(w, keys=5, per_key=125, destination=unique_name)
            loose = [Event(unique_name, "thing.loose", payload={"w": w}) for _ in range(625)]
            mixed = [e for pair in zip(keyed, loose, strict=True) for e in pair]
            per_writer.append(chunks(mixed, 10))
        args = ("--claim-timeout", "3", "--poll-interval", "0.5", "--batch-size", "200")
        log = tmp_path / "relay.log"
        first = await start_relay_process(database_url, schema, rabbitmq_url, *args, log=log)
        try:
            ids = await write_concurrently(database_url, schema, per_writer)
            assert len(ids) == 10_000
            await rec.wait_count(3000, 60)
            first.send_signal(signal.SIGKILL)
            assert await first.wait() == -signal.SIGKILL
            unpublished = (await rows(database_url, sql.SQL(
                "SELECT count(*) FROM {} WHERE published_at IS NULL").format(
                    sql.Identifier(schema, "outbox")).as_string(None)))[0][0]
            assert unpublished > 0, "the kill came too late to be mid-run"

            second = await start_relay_process(database_url, schema, rabbitmq_url, *args, log=log)
            try:
                await rec.wait_for(ids, 90)
            finally:
                second.send_signal(signal.SIGTERM)
                assert await asyncio.wait_for(second.wait(), 30) == 0
        finally:
            await stop_process(first)

        received = Counter(r.message_id for r in rec.received)
        assert set(received) == {str(i) for i in ids}  # none lost, nothing foreign
        for r in rec.received:  # republished copies carry the same event id and body
            assert r.headers["event-id"] == r.message_id
        bodies: dict[str, Any] = {}
        for r in rec.received:
            assert bodies.setdefault(r.message_id, r.body) == r.body
        assert_key_order(rec.received)
        assert await rows(database_url, sql.SQL(
            "SELECT count(*) FROM {} WHERE published_at IS NULL").format(
                sql.Identifier(schema, "outbox")).as_string(None)) == [(0,)]


def via(url: str, port: int) -> str:
    parts = urlparse(url)
    netloc = parts.netloc.rsplit("@", 1)
    host = f"127.0.0.1:{port}"
    return urlunparse(parts._replace(netloc=f"{netloc[0]}@{host}" if len(netloc) == 2 else host))


async def test_broker_down_then_back_loses_nothing_and_backoff_shows(
    database_url: str, rabbitmq_url: str, unique_name: str
) -> None:
    parsed = urlparse(rabbitmq_url)
    proxy = TcpProxy(parsed.hostname or "127.0.0.1", parsed.port or 5672)
    await proxy.start()
    async with throwaway_schema(database_url) as schema, Recorder(rabbitmq_url, unique_name) as rec:
        table = sql.Identifier(schema, "outbox").as_string(None)
        settings = relay_settings(
            database_url, schema, via(rabbitmq_url, proxy.port),
            relay_backoff_base=0.2, relay_backoff_max=1.0, relay_max_attempts=100,
            relay_poll_interval=0.2,
        )
        relay = Relay(settings)
        task = asyncio.create_task(relay.run())
        try:
            async with await connect(database_url) as conn:
                before = await write_events(conn, schema, [Event(unique_name) for _ in range(20)])
            await rec.wait_for(before, 20)

            async def before_marked() -> bool:  # an arrival precedes its confirm and its mark
                return await rows(database_url, f"SELECT count(*) FROM {table} WHERE published_at IS NULL") == [(0,)]

            await wait_until(before_marked, 20, "the first 20 rows marked published")
            await proxy.close()
            async with await connect(database_url) as conn:
                during = await write_events(conn, schema, [Event(unique_name) for _ in range(50)])

            async def all_failed_at_least_twice() -> bool:
                found = await rows(database_url, f"SELECT min(attempts) FROM {table} "
                                   "WHERE published_at IS NULL")
                return found[0][0] is not None and found[0][0] >= 2

            await wait_until(all_failed_at_least_twice, 30, "failed attempts while the broker is down")
            errors = await rows(database_url, f"SELECT last_error, available_at > now() "
                                f"FROM {table} WHERE published_at IS NULL")
            assert len(errors) == 50 and all("PublishError" in e for e, _ in errors)
            assert relay.counters["publish_failed"] >= 100

            await proxy.start()
            await rec.wait_for(during, 30)
        finally:
            relay.request_stop()
            await asyncio.wait_for(task, 15)
            await proxy.close()
        assert await rows(database_url, f"SELECT count(*) FROM {table} "
                          "WHERE published_at IS NULL") == [(0,)]
        assert await rows(database_url, f"SELECT count(*) FROM {table} "
                          "WHERE last_error LIKE 'PublishError%%'") == [(50,)]
        assert relay.counters["republished"] == 50


async def test_relay_killed_after_publishing_part_of_its_batch_is_taken_over_by_another(
    database_url: str, rabbitmq_url: str, unique_name: str
) -> None:
    async with throwaway_schema(database_url) as schema, Recorder(rabbitmq_url, unique_name) as rec:
        table = sql.Identifier(schema, "outbox").as_string(None)
        async with await connect(database_url) as conn:
            ids = await write_events(conn, schema, [Event(unique_name) for _ in range(200)])
        claim_timeout, poll_interval = 3.0, 0.5
        relay_a = await start_relay_process(
            database_url, schema, rabbitmq_url, "--relay-id", "A", "--batch-size", "50",
            "--max-in-flight", "1", "--claim-timeout", str(claim_timeout),
            env={"CONSUMER_KIT_CRASH_AT": "after_publish_before_mark:kill"},
        )
        try:
            async def a_claimed() -> bool:
                found = await rows(database_url, f"SELECT count(*) FROM {table} "
                                   "WHERE claimed_by = 'A'")
                return found[0][0] > 0

            await wait_until(a_claimed, 30, "relay A to claim a batch")
            # B's own lease is relay_settings' (its batches never race it); A's is claim_timeout
            b = Relay(relay_settings(database_url, schema, rabbitmq_url, relay_id="B",
                                     relay_poll_interval=poll_interval))
            b_task = asyncio.create_task(b.run())
            try:
                assert await asyncio.wait_for(relay_a.wait(), 30) == -signal.SIGKILL
                a_died = time.monotonic()
                await rec.wait_for(ids, claim_timeout + poll_interval + 10)
                took = max(r.at for r in rec.received) - a_died
                assert took <= claim_timeout + poll_interval + 1.5, took
            finally:
                b.request_stop()
                await asyncio.wait_for(b_task, 15)
        finally:
            await stop_process(relay_a)

        assert b.counters["taken_over"] == 50  # A's whole claimed batch
        twice = [m for m, n in Counter(r.message_id for r in rec.received).items() if n > 1]
        assert len(twice) == 1  # A (one publish in flight) confirmed one, died before the mark; B republished it
        copies = [r.headers["relay-id"] for r in rec.received if r.message_id == twice[0]]
        assert copies == ["A", "B"]
        assert await rows(database_url, f"SELECT count(*) FROM {table} WHERE claimed_by = 'A' "
                          "OR published_at IS NULL OR claimed_until IS NOT NULL") == [(0,)]


async def test_three_relays_publish_each_row_once_and_keep_per_key_order(
    database_url: str, rabbitmq_url: str, unique_name: str, tmp_path: Path
) -> None:
    async with throwaway_schema(database_url) as schema, Recorder(rabbitmq_url, unique_name) as rec:
        relays = [
            await start_relay_process(database_url, schema, rabbitmq_url, "--relay-id", name,
                                      "--batch-size", "50", "--poll-interval", "0.5",
                                      log=tmp_path / f"{name}.log")
            for name in ("R1", "R2", "R3")
        ]
        try:
            per_writer = []
            for w in range(6):
                keyed = keyed_events(w, keys=10, per_key=40, destination=unique_name)
                loose = [Event(unique_name, "thing.loose") for _ in range(100)]
                per_writer.append(chunks(keyed + loose, 5))
            ids = await write_concurrently(database_url, schema, per_writer)
            await rec.wait_for(ids, 60)
        finally:
            for proc in relays:
                if proc.returncode is None:
                    proc.send_signal(signal.SIGTERM)
            codes = [await asyncio.wait_for(proc.wait(), 30) for proc in relays]
        assert codes == [0, 0, 0]

        # The broker-side record: every message id arrived exactly once, so no row was ever held
        # (and published) by two relays; each relay did part of the work.
        arrivals = Counter(r.message_id for r in rec.received)
        assert len(arrivals) == len(ids) == 3000 and set(arrivals.values()) == {1}
        assert {r.headers["relay-id"] for r in rec.received} == {"R1", "R2", "R3"}
        assert_key_order(rec.received)


async def test_rolled_back_transaction_leaves_no_event(
    database_url: str, rabbitmq_url: str, unique_name: str
) -> None:
    async with throwaway_schema(database_url) as schema, Recorder(rabbitmq_url, unique_name) as rec:
        rolled_back = Event(unique_name)
        async with await connect(database_url) as conn:
            with pytest.raises(RuntimeError):
                async with conn.transaction():
                    await write_events(conn, schema, [rolled_back])
                    raise RuntimeError("handler failed")
            (committed,) = await write_events(conn, schema, [Event(unique_name)])
        settings = relay_settings(database_url, schema, rabbitmq_url)
        publisher = open_publisher(settings)
        try:
            assert await relay_pending(settings, publisher) == 1
        finally:
            await publisher.close()
        await rec.wait_for([committed], 10)
        assert str(rolled_back.event_id) not in rec.ids()
        assert await rows(database_url, sql.SQL("SELECT event_id FROM {}").format(
            sql.Identifier(schema, "outbox")).as_string(None)) == [(committed,)]


async def test_notify_wakes_the_relay_without_waiting_for_the_poll(
    database_url: str, rabbitmq_url: str, unique_name: str
) -> None:
    async with throwaway_schema(database_url) as schema, Recorder(rabbitmq_url, unique_name) as rec:
        relay = Relay(relay_settings(database_url, schema, rabbitmq_url, relay_poll_interval=60))
        task = asyncio.create_task(relay.run())
        try:
            await wait_until(_listening(relay), 10, "LISTEN")
            async with await connect(database_url) as conn:
                ids = await write_events(conn, schema, [Event(unique_name) for _ in range(3)])
            written = time.monotonic()
            await rec.wait_for(ids, 10)
            assert max(r.at for r in rec.received) - written < 5  # far below the 60 s poll
            assert relay.counters["wakeups_notify"] >= 1 and relay.counters["wakeups_poll"] == 0
        finally:
            relay.request_stop()
            await asyncio.wait_for(task, 15)


def _listening(relay: Relay) -> Any:
    async def check() -> bool:
        return relay._listener is not None and relay._listener._connected.is_set()

    return check


async def test_lost_notify_is_covered_by_the_poll_fallback(
    database_url: str, rabbitmq_url: str, unique_name: str
) -> None:
    async with throwaway_schema(database_url) as schema, Recorder(rabbitmq_url, unique_name) as rec:
        table = sql.Identifier(schema, "outbox")
        async with await connect(database_url) as conn:
            # committed before any relay listens: that notification is lost
            early = await write_events(conn, schema, [Event(unique_name)])
        relay = Relay(relay_settings(database_url, schema, rabbitmq_url, relay_poll_interval=0.5))
        task = asyncio.create_task(relay.run())
        try:
            await rec.wait_for(early, 10)
            await wait_until(_listening(relay), 10, "LISTEN")
            async with await connect(database_url) as conn:
                await conn.execute(sql.SQL("ALTER TABLE {} DISABLE TRIGGER outbox_notify").format(
                    table))
                polls_before = relay.counters["wakeups_poll"]
                late = await write_events(conn, schema, [Event(unique_name)])  # no NOTIFY at all
            await rec.wait_for(late, 10)
            assert relay.counters["wakeups_poll"] > polls_before
        finally:
            relay.request_stop()
            await asyncio.wait_for(task, 15)


async def test_example_events_are_published_with_message_id_equal_to_event_id(
    database_url: str, rabbitmq_url: str
) -> None:
    """the invoices example's InvoiceCreated events reach exchange billing.events with
    routing key invoice.created, message id = event ID, with only the two URLs configured."""
    app = App("relay-example")
    app.subscribe("invoices.commands", CreateInvoiceHandler())
    async with throwaway_schema(database_url) as schema, \
            Recorder(rabbitmq_url, "billing.events", "invoice.created") as rec:
        async with runtime_for(app, database_url, schema) as runtime:
            broker = MemoryBroker()
            for order_id in (1, 2, 1):  # the second order 1 is a duplicate: no second event
                broker.send("invoices.commands", json.dumps({
                    "order_id": order_id, "revision": 1, "customer_id": "c-9",
                    "amount_cents": 100 * order_id, "currency": "EUR",
                    "requested_at": dt.datetime.now(dt.UTC).isoformat(),
                }).encode())
            consumer = MemoryConsumer(broker)

            async def process(delivery: Any) -> None:
                await runtime.process(delivery)

            await consumer.subscribe("invoices.commands", process, prefetch=1)
            await broker.wait_idle(20)
            await consumer.close()
        outbox = dict(await rows(database_url, sql.SQL(
            "SELECT event_id::text, operation_key FROM {}").format(
                sql.Identifier(schema, "outbox")).as_string(None)))
        assert len(outbox) == 2
        settings = relay_settings(database_url, schema, rabbitmq_url)
        publisher = open_publisher(settings)
        try:
            assert await relay_pending(settings, publisher) == 2
        finally:
            await publisher.close()
        await rec.wait_for(outbox, 10)
        mine = [r for r in rec.received if r.message_id in outbox]
        assert len(mine) == 2
        for r in mine:
            assert r.headers["event-id"] == r.message_id
            assert r.headers["message-type"] == "InvoiceCreated"
            assert r.headers["operation-key"] == outbox[r.message_id]
            assert r.body["customer_id"] == "c-9"


async def test_sigterm_finishes_the_in_flight_batch_and_exits_zero(
    database_url: str, rabbitmq_url: str, unique_name: str
) -> None:
    async with throwaway_schema(database_url) as schema, Recorder(rabbitmq_url, unique_name) as rec:
        table = sql.Identifier(schema, "outbox").as_string(None)
        async with await connect(database_url) as conn:
            await write_events(conn, schema, [Event(unique_name) for _ in range(3000)])
        proc = await start_relay_process(database_url, schema, rabbitmq_url, "--relay-id", "T",
                                         "--batch-size", "500", "--max-in-flight", "8")
        try:
            await rec.wait_count(100, 30)
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 30) == 0
        finally:
            await stop_process(proc)
        # Nothing left claimed: the batch in flight at SIGTERM was published and marked.
        assert await rows(database_url, f"SELECT count(*) FROM {table} "
                          "WHERE claimed_until IS NOT NULL") == [(0,)]
        published = {str(r[0]) for r in await rows(
            database_url, f"SELECT event_id FROM {table} WHERE published_at IS NOT NULL")}
        await rec.wait_for(published, 10)  # every row marked published reached the broker
        # It stopped early, and only after whole batches: the one in flight was finished.
        assert 0 < len(published) < 3000 and len(published) % 500 == 0


async def _publish_sentinel(rabbitmq_url: str, exchange: str, rec: Recorder) -> None:
    """Publish a marker after the relay finished and wait for it: every copy the relay had
    confirmed was routed before it, so the recorder has seen them all once the marker arrives."""
    publisher = RabbitMQPublisher(rabbitmq_url)
    sentinel = str(uuid.uuid4())
    try:
        await publisher.publish(OutgoingMessage(exchange, "sentinel", sentinel, b"{}", "Sentinel"))
    finally:
        await publisher.close()
    await rec.wait_for([sentinel], 10)


async def test_an_event_too_large_for_the_frame_is_parked_at_once_and_the_batch_publishes_once(
    database_url: str, rabbitmq_url: str, unique_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """a row whose headers exceed the broker's frame_max (written with SQL: the
    writer refuses such headers) would close the relay's whole connection. It is parked at once
    with the limit and the size; the connection stays up (one connection through the proxy) and
    every other row of the same batch is published exactly once."""
    parsed = urlparse(rabbitmq_url)
    proxy = TcpProxy(parsed.hostname or "127.0.0.1", parsed.port or 5672)
    await proxy.start()
    async with throwaway_schema(database_url) as schema, Recorder(rabbitmq_url, unique_name) as rec:
        table = sql.Identifier(schema, "outbox").as_string(None)
        healthy = [Event(unique_name, payload={"n": n}) for n in range(10)]
        blob = "blob-" + "x" * 200_000
        big = Event(unique_name, headers={"x-blob": blob})
        async with await connect(database_url) as conn:
            await write_events(conn, schema, [*healthy[:5], big, *healthy[5:]])
        settings = relay_settings(database_url, schema, via(rabbitmq_url, proxy.port))
        relay = Relay(settings)
        try:
            with caplog.at_level("INFO"):
                await relay.run(once=True)
        finally:
            await proxy.close()
        assert proxy.accepted == 1
        assert (relay.counters["published"], relay.counters["parked_permanent"]) == (10, 1)
        ((attempts, last_error),) = await rows(
            database_url, f"SELECT attempts, last_error FROM {table} WHERE event_id = %s", big.event_id)
        assert attempts == settings.relay_max_attempts  # parked, after a single try
        assert relay.counters["publish_failed"] == 1
        assert "frame_max is 131072 bytes" in last_error and "-byte frame" in last_error
        assert str(big.event_id) in caplog.text and "blob-" not in caplog.text
        await _publish_sentinel(rabbitmq_url, unique_name, rec)
        arrivals = Counter(r.message_id for r in rec.received if r.body != {})
        assert arrivals == Counter({str(e.event_id): 1 for e in healthy})


async def test_a_destination_of_another_exchange_type_is_parked_and_healthy_events_publish_once(
    database_url: str, rabbitmq_url: str, unique_name: str
) -> None:
    """the destination exists as a direct exchange. Its declaration, on a channel of
    its own, is refused (406), so only that channel closes: the row is parked at once with the
    broker's reply text, and each of the 30 healthy events in the same batch reaches the tap queue
    exactly once."""
    wrong = f"{unique_name}.direct"
    async with throwaway_schema(database_url) as schema, Recorder(rabbitmq_url, unique_name) as rec:
        connection = await aio_pika.connect(rabbitmq_url)
        try:
            channel = await connection.channel()
            await channel.declare_exchange(wrong, aio_pika.ExchangeType.DIRECT, durable=True)
        finally:
            await connection.close()
        table = sql.Identifier(schema, "outbox").as_string(None)
        healthy = [Event(unique_name, payload={"n": n}) for n in range(30)]
        bad = Event(wrong)
        async with await connect(database_url) as conn:
            await write_events(conn, schema, [*healthy[:15], bad, *healthy[15:]])
        settings = relay_settings(database_url, schema, rabbitmq_url, relay_batch_size=100)
        relay = Relay(settings)
        await relay.run(once=True)
        assert (relay.counters["published"], relay.counters["parked_permanent"]) == (30, 1)
        ((attempts, last_error),) = await rows(
            database_url, f"SELECT attempts, last_error FROM {table} WHERE event_id = %s", bad.event_id)
        assert attempts == settings.relay_max_attempts  # parked at once
        assert "PRECONDITION_FAILED" in last_error
        assert "inequivalent arg 'type'" in last_error and "'direct'" in last_error
        await _publish_sentinel(rabbitmq_url, unique_name, rec)
        arrivals = Counter(r.message_id for r in rec.received if r.body != {})
        assert arrivals == Counter({str(e.event_id): 1 for e in healthy})
