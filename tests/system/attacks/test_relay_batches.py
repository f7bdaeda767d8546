"""Attacks on the relay's batch publish on RabbitMQ (adapters/rabbitmq/confirms.py, frames.py,
``RabbitMQPublisher.publish_batch``): a message counts as confirmed only after its own broker ack.

One chunk mixes acks, nacks (a full ``reject-publish`` queue), a return (no such queue) and a
publish to an exchange deleted behind the publisher's back, which makes the broker close the
publishing channel in the middle of the chunk. Whatever the broker managed to confirm before the
close, every message reported confirmed must be in its queue, every other one must fail (none
silently dropped), and publishing the failed ones again must get every one through. Also: a
relay SIGKILLed with chunks in flight, and two publishes of one message id in one batch (a return
is matched to its publish by message id).
"""

from __future__ import annotations

import asyncio
import json
import signal

import aio_pika
import pytest
from psycopg import sql

from consumer_kit.adapters.rabbitmq import RabbitMQPublisher
from consumer_kit.broker.publishing import OutgoingMessage
from consumer_kit.errors import PublishError
from consumer_kit.outbox_relay import Relay
from tests.adapters.rabbitmq.test_adapter import queue_state, raw_channel
from tests.fixtures.harness import throwaway_schema
from tests.fixtures.relay_support import (
    Event,
    Received,
    Recorder,
    connect,
    relay_settings,
    rows,
    start_relay_process,
    stop_process,
    wait_until,
    write_events,
)
from tests.outbox_relay.test_rabbitmq import assert_key_order, chunks, keyed_events

pytestmark = [pytest.mark.rabbitmq]


def message(destination: str, routing_key: str, n: int) -> OutgoingMessage:
    return OutgoingMessage(
        destination=destination, routing_key=routing_key, message_id=f"ev-{n}", body=b'{"n": %d}' % n,
        message_type="Attack", headers={"n": str(n)},
    )


def loose_events(destination: str, n: int) -> list[Event]:
    """``n`` events without a partition key, ``payload={"n": 0..n-1}``."""
    return [Event(destination, "thing.loose", payload={"n": i}) for i in range(n)]


async def drain(queue: aio_pika.abc.AbstractQueue) -> list[str]:
    got: list[str] = []
    while (m := await queue.get(no_ack=True, fail=False)) is not None:
        got.append(m.message_id or "")
    return got


async def test_a_channel_closed_mid_chunk_confirms_only_what_arrived_and_the_rest_goes_through_later(
    rabbitmq_url: str, unique_name: str
) -> None:
    publisher = RabbitMQPublisher(rabbitmq_url)
    exchange = f"{unique_name}.events"
    try:
        async with raw_channel(rabbitmq_url) as channel:
            ok = await channel.declare_queue(f"{unique_name}.ok", auto_delete=True)
            full = await channel.declare_queue(
                f"{unique_name}.full", auto_delete=True, arguments={"x-max-length": 1, "x-overflow": "reject-publish"}
            )
            bound = await channel.declare_queue(f"{unique_name}.bound", auto_delete=True)
            await publisher.declare(exchange)  # the publisher now believes the exchange exists
            await channel.exchange_delete(exchange)  # ...and it is gone: the publish closes the channel

            batch = [
                message("", ok.name, 0),
                message("", full.name, 1),
                message("", full.name, 2),  # nacked
                message("", f"{unique_name}.missing", 3),  # returned
                message("", ok.name, 4),
                message(exchange, "k", 5),  # 404: the broker closes the publishing channel here
                message("", ok.name, 6),
                message("", ok.name, 7),
            ]
            outcomes = await publisher.publish_batch(batch, within=10.0)
            arrived_ok, arrived_full = await drain(ok), await drain(full)
            confirmed = {batch[i].message_id for i, o in enumerate(outcomes) if o is None}
            # confirmed => arrived (the guarantee); never the ones written after the closing publish
            assert confirmed <= set(arrived_ok) | set(arrived_full), (outcomes, arrived_ok, arrived_full)
            assert all(isinstance(outcomes[i], PublishError) for i in (2, 3, 5, 6, 7)), outcomes
            assert all(o is None or isinstance(o, PublishError) for o in outcomes)
            assert "ev-2" not in arrived_full  # the nacked one really was refused
            # the channel-closing failure is the broker's (transient) for the others; the nacked one too
            for i in (2, 5, 6, 7):
                failure = outcomes[i]
                assert isinstance(failure, PublishError) and failure.transient, (i, failure)
            returned = outcomes[3]
            assert isinstance(returned, PublishError) and not returned.transient and not returned.permanent

            # the relay publishes the failed ones again (same message ids): all of them go through now
            await channel.declare_exchange(exchange, aio_pika.ExchangeType.TOPIC, durable=True)
            await bound.bind(exchange, "k")
            again = [m for m, o in zip(batch, outcomes, strict=True) if o is not None and m.routing_key != full.name
                     and not m.routing_key.endswith(".missing")]
            assert [m.message_id for m in again if m.destination == exchange] == ["ev-5"]
            retried = await publisher.publish_batch(again, within=10.0)
            assert retried == [None] * len(again), retried
            arrived_ok += await drain(ok)
            assert set(arrived_ok) == {"ev-0", "ev-4", "ev-6", "ev-7"}  # every one at least once
            assert await drain(bound) == ["ev-5"]
            # and the channel is good for the next batch (the destination's suspicion cleared)
            assert await publisher.publish_batch([message(exchange, "k", 8), message("", ok.name, 9)], within=10.0) == [
                None, None,
            ]
            assert await drain(bound) == ["ev-8"] and await drain(ok) == ["ev-9"]
    finally:
        await publisher.close()


async def test_a_relay_sigkilled_with_chunks_in_flight_loses_nothing_and_marked_only_what_it_published(
    database_url: str, rabbitmq_url: str, unique_name: str
) -> None:
    """Relay A publishes batches of 60 in chunks of 20 (one write, one confirm wait each) and is SIGKILLed
    mid-run, while a chunk is in flight; relay B takes over. Every event arrives at least once,
    every row A had marked published was received from A itself (B never republishes a marked
    row, so a mark without A's own confirmed publish would be an event lost), per-key order holds."""
    async with throwaway_schema(database_url) as schema, Recorder(rabbitmq_url, unique_name) as rec:
        table = sql.Identifier(schema, "outbox").as_string(None)
        events = keyed_events(0, keys=6, per_key=40, destination=unique_name) + loose_events(unique_name, 240)
        async with await connect(database_url) as conn:
            ids = []
            for chunk in chunks(events, 60):  # one transaction each
                ids += await write_events(conn, schema, chunk)
        relay_a = await start_relay_process(
            database_url, schema, rabbitmq_url, "--relay-id", "A", "--batch-size", "60",
            "--max-in-flight", "20", "--claim-timeout", "3", "--poll-interval", "0.5",
        )
        marked_query = (f"SELECT event_id FROM {table} WHERE published_at > '-infinity' "
                        "AND published_at < 'infinity'")
        try:
            async def a_marked_a_batch() -> bool:
                return bool(await rows(database_url, marked_query + " LIMIT 1"))

            await wait_until(a_marked_a_batch, 60, "relay A to mark its first batch")
            relay_a.send_signal(signal.SIGKILL)  # mid-run: a chunk of its next batch is in flight
            assert await relay_a.wait() == -signal.SIGKILL
        finally:
            await stop_process(relay_a)
        marked = {str(r[0]) for r in await rows(database_url, marked_query)}
        assert 0 < len(marked) < len(ids), "the kill came too late (or too early) to be mid-run"

        b = Relay(relay_settings(database_url, schema, rabbitmq_url, relay_id="B", relay_max_in_flight=20))
        b_task = asyncio.create_task(b.run())
        try:
            await rec.wait_for(ids, 60)
        finally:
            b.request_stop()
            await asyncio.wait_for(b_task, 15)

        assert {r.message_id for r in rec.received} == {str(i) for i in ids}  # none lost
        from_a = {r.message_id for r in rec.received if r.headers["relay-id"] == "A"}
        assert marked <= from_a, sorted(marked - from_a)[:5]
        assert not any(r.headers["relay-id"] == "B" for r in rec.received if r.message_id in marked)
        assert all(r.headers["event-id"] == r.message_id for r in rec.received)  # message id = event id
        assert_key_order(rec.received)
        assert await rows(database_url, f"SELECT count(*) FROM {table} WHERE published_at IS NULL") == [(0,)]


async def test_two_messages_of_a_batch_with_one_message_id_each_get_their_own_outcome(
    rabbitmq_url: str, unique_name: str
) -> None:
    """A ``basic.return`` finds its publish by message id (aiormq): with two publishes of one id in
    flight on the channel, the return of the first resolved the second's confirmation, and the
    first, returned, counted as confirmed on its ack (a message lost, reported published)."""
    publisher = RabbitMQPublisher(rabbitmq_url)
    try:
        async with raw_channel(rabbitmq_url) as channel:
            ok = await channel.declare_queue(f"{unique_name}.ok", auto_delete=True)
            returned = message("", f"{unique_name}.missing", 1)
            arrives = message("", ok.name, 1)  # the same message id, to a queue that exists
            outcomes = await publisher.publish_batch([returned, arrives, message("", ok.name, 2)], within=10.0)
            first = outcomes[0]
            assert isinstance(first, PublishError) and not first.transient, outcomes
            assert outcomes[1:] == [None, None], outcomes
            assert sorted(await drain(ok)) == ["ev-1", "ev-2"]
    finally:
        await publisher.close()


async def test_nacks_in_the_middle_of_relay_chunks_keep_rows_pending_and_per_key_order(
    database_url: str, rabbitmq_url: str, unique_name: str
) -> None:
    """A queue bound to the destination holds 10 messages and refuses more (``reject-publish``):
    the broker nacks the rest of each chunk while the first ones of it are acked. Nacked rows stay
    pending and are retried as the queue drains; that queue gets every event, and per key its
    first arrivals come in commit order (a key's next row is never published before its nacked
    predecessor is confirmed)."""
    async with throwaway_schema(database_url) as schema, Recorder(rabbitmq_url, unique_name) as rec:
        table = sql.Identifier(schema, "outbox").as_string(None)
        async with raw_channel(rabbitmq_url) as channel:
            exchange = await channel.declare_exchange(unique_name, aio_pika.ExchangeType.TOPIC, durable=True)
            small = await channel.declare_queue(
                f"{unique_name}.small", auto_delete=True,
                arguments={"x-max-length": 10, "x-overflow": "reject-publish"},
            )
            await small.bind(exchange, "#")
            events = keyed_events(0, keys=6, per_key=5, destination=unique_name) + loose_events(unique_name, 30)
            async with await connect(database_url) as conn:
                ids = await write_events(conn, schema, events)
            relay = Relay(relay_settings(database_url, schema, rabbitmq_url, relay_id="R", relay_max_in_flight=20))
            relay_task = asyncio.create_task(relay.run())
            try:
                async def small_is_full() -> bool:
                    return (await queue_state(rabbitmq_url, small.name))[0] == 10

                await wait_until(small_is_full, 30, "the small queue to fill up")
                pending = await rows(database_url, f"SELECT count(*) FROM {table} WHERE published_at IS NULL")
                assert pending[0][0] > 0  # the rest was nacked: still pending

                got: list[Received] = []
                done = asyncio.Event()
                wanted = {str(i) for i in ids}

                async def on_message(m: aio_pika.abc.AbstractIncomingMessage) -> None:
                    got.append(Received(m.message_id or "", dict(m.headers), json.loads(m.body), 0.0))
                    await m.ack()
                    if wanted <= {r.message_id for r in got}:
                        done.set()

                await channel.set_qos(prefetch_count=1)
                await small.consume(on_message)
                await asyncio.wait_for(done.wait(), 60)
                await rec.wait_for(ids, 30)

                async def all_marked() -> bool:
                    left = await rows(database_url, f"SELECT count(*) FROM {table} WHERE published_at IS NULL")
                    return left[0][0] == 0

                await wait_until(all_marked, 30, "every row to be marked published")
            finally:
                relay.request_stop()
                await asyncio.wait_for(relay_task, 15)
        assert_key_order(got)
        assert_key_order(rec.received)
        # a nacked publish was still routed to the recorder's queue: republished rows came twice there
        assert len(rec.received) > len(ids)
