"""Throttling (``com.microsoft:server-busy``, the SDK's ``ServiceBusServerBusyError``) through the real
azure-servicebus SDK against the local test server, which refuses the next N operations of a kind on
an entity when a test asks (``tests/adapters/servicebus/server/throttling.py``; the rule and its sources are
there: Microsoft's *Throttling operations on Azure Service Bus*, azure-servicebus 7.15
``_common/constants.py`` ``ERROR_CODE_SERVER_BUSY``).

Only a fault of the message costs it an attempt: a throttled settlement is made again on the same
lock, a throttled send is sent again, a throttled peek is peeked again. Every wait is bounded.
"""

from __future__ import annotations

import asyncio

import pytest
from azure.servicebus import ServiceBusMessage
from azure.servicebus.exceptions import ServiceBusServerBusyError

from consumer_kit.adapters.servicebus import ServiceBusDelivery, ServiceBusPublisher
from consumer_kit.outbox_relay import Relay
from consumer_kit.outbox_relay.settings import RelaySettings
from tests.adapters.servicebus.server.fixtures import (
    SDK_CALL_TIMEOUT,
    Received,
    SBEnv,
    eventually,
    outgoing_event,
)
from tests.fixtures.harness import throwaway_schema
from tests.fixtures.relay_support import Event, connect, write_events


async def test_the_server_answers_a_throttled_send_with_server_busy_and_stores_nothing(sb: SBEnv) -> None:
    sb.create_queue()
    sb.server.throttle(sb.queue, "send", 1)
    async with asyncio.timeout(SDK_CALL_TIMEOUT), sb.client.get_queue_sender(sb.queue, keep_alive=0) as sender:
        try:
            await sender.send_messages(ServiceBusMessage(b"x"))
        except ServiceBusServerBusyError as exc:
            assert "server-busy" in str(exc)
        else:
            raise AssertionError("a throttled send was accepted")
        await sender.send_messages(ServiceBusMessage(b"y"))  # the throttle is over: the same link works
    assert [m.body for m in sb.entity().messages] == [b"y"]
    assert sb.server.throttled(sb.queue, "send") == 1


async def test_a_throttled_complete_is_made_again_on_the_same_lock_and_costs_no_attempt(sb: SBEnv) -> None:
    sb.create_queue(lock_duration=30)
    await sb.send_bodies(b"a", b"b")
    sb.server.throttle(sb.queue, "settle", 2)  # the first two dispositions refused, not applied
    received = Received(lambda d: d.ack())
    consumer = await sb.subscribe(received, prefetch=2, settle_timeout=5.0)
    deliveries = await received.take(2)
    await eventually(lambda: sb.entity().messages == [], within=10, what="both completions")
    assert sb.server.throttled(sb.queue, "settle") == 2
    assert [(d.delivery_count, d.redelivered, d.lost) for d in deliveries] == [(1, False, False)] * 2
    assert consumer.counters["throttled"] == 2
    assert consumer.counters["settlements_lost"] == 0 and consumer.counters["received"] == 2


async def test_a_throttled_receive_is_waited_out_and_the_delivery_in_hand_still_settles(sb: SBEnv) -> None:
    """On SDK 7.15 a receive can meet server-busy only as its link's detach (the only AMQP way to
    refuse a receive): that receiver can no longer receive or settle over its link (``Link already
    closed``). The pump waits the throttle backoff, counts it, opens a new receiver and goes on; the
    delivery in hand is not stranded: its lock is renewed and its ack made over ``$management`` by
    lock token, which Service Bus accepts from any receiver of an entity without sessions
    (azure-sdk-for-go 1.10.0; azure-sdk-for-js #8406; ``ServiceBusDelivery.off_its_link``). It is
    completed once, never redelivered, and costs no attempt. Whether Azure throttles a receive by a
    detach at all was never seen on a real namespace."""
    sb.create_queue(lock_duration=5)
    await sb.send_bodies(b"first")
    release = asyncio.Event()

    async def settle(delivery: ServiceBusDelivery) -> None:
        if delivery.body == b"first":
            await release.wait()  # in hand while the receive is throttled
        await delivery.ack()

    received = Received(settle)
    consumer = await sb.subscribe(received, prefetch=2, settle_timeout=2.0)
    first = await received.next()
    sb.server.throttle(sb.queue, "receive", 1)
    await eventually(lambda: sb.server.throttled(sb.queue, "receive") == 1, within=5, what="a throttled receive")
    await sb.send_bodies(b"second")
    second = await received.next()  # received by the new receiver
    assert (second.body, second.delivery_count, second.redelivered) == (b"second", 1, False)
    await eventually(lambda: consumer.counters["reconnects"] == 1, within=5, what="the new receiver")
    left = first.seconds_left()  # the old receiver is closed: a renewal now goes through the new one
    assert left is not None
    await eventually(lambda: (first.seconds_left() or 0) > left + 0.5, within=10, what="a renewal of the held lock")
    release.set()
    await eventually(lambda: first.settlement is not None, within=10, what="the held delivery's ack")
    await eventually(lambda: sb.entity().messages == [], within=10, what="every completion")
    assert not first.lost and len(received.deliveries) == 2
    assert consumer.counters["throttled"] == 1 and consumer.counters["reconnects"] == 1
    assert consumer.counters["settlements_lost"] == 0 and consumer.counters["locks_lost"] == 0
    assert consumer.ready


@pytest.mark.parametrize("sessions", [False, True], ids=["queue", "session"])
async def test_a_throttled_lock_renewal_is_tried_again_and_the_lock_holds(sb: SBEnv, sessions: bool) -> None:
    """A renewal answered server-busy (a ``$management`` 503) is counted ``throttled`` and tried
    again by the lock keeper; the lock holds through a handler longer than the lock."""
    queue = sb.create_queue(lock_duration=5, requires_session=sessions)
    await sb.send(ServiceBusMessage(b"x", session_id="s1" if sessions else None))
    sb.server.throttle(sb.queue, "renew", 1)
    renewed = asyncio.Event()

    async def slow(delivery: ServiceBusDelivery) -> None:
        await renewed.wait()
        await delivery.ack()

    received = Received(slow)
    consumer = await sb.subscribe(
        received, prefetch=1, settle_timeout=2.0, session_entities=[sb.queue] if sessions else []
    )
    delivery = await received.next()
    await eventually(lambda: consumer.counters["renewals"] >= 1, within=10, what="a renewal after the throttled one")
    renewed.set()
    await eventually(lambda: queue.messages == [], within=10, what="the completion")
    assert sb.server.throttled(sb.queue, "renew") == 1 and consumer.counters["throttled"] == 1
    assert not delivery.lost and consumer.counters["locks_lost"] == 0 and len(received.deliveries) == 1


async def test_a_throttled_publish_is_sent_again_and_stored_once(sb: SBEnv) -> None:
    sb.create_queue()
    sb.server.throttle(sb.queue, "send", 1)
    publisher = sb.publisher(confirm_timeout=5.0)
    message = outgoing_event(1, sb.queue, routing_key="thing.happened", message_type="ThingHappened")
    await publisher.publish(message)
    assert [m.message_id for m in sb.entity().messages] == [message.message_id]
    assert sb.server.throttled(sb.queue, "send") == 1


async def test_the_relay_publishes_every_event_once_through_a_throttled_send(sb: SBEnv, database_url: str) -> None:
    topic = sb.topic
    ledger = sb.create_subscription("ledger")
    events = [Event(topic, partition_key=f"customer-{n}", payload={"n": n}) for n in range(5)]
    sb.server.throttle(topic, "send", 1)  # the pass's batch refused once
    async with throwaway_schema(database_url) as schema:
        async with await connect(database_url) as conn:
            await write_events(conn, schema, events)
        settings = RelaySettings(
            database_url=database_url, db_schema=schema, broker_url="servicebus://", relay_claim_timeout=10.0,
            relay_backoff_base=0.1, relay_backoff_max=0.5, settle_timeout=5.0,
        )
        publisher = ServiceBusPublisher(sb.namespace, confirm_timeout=5.0)
        relay = Relay(settings, publisher=publisher)
        try:
            await relay.run(once=True)
        finally:
            await publisher.close()
        assert relay.counters["published"] == 5
    assert sb.server.throttled(topic, "send") == 1
    assert sorted(m.message_id for m in ledger.messages) == sorted(str(e.event_id) for e in events)


async def test_dlq_count_peeks_again_through_a_throttled_peek(sb: SBEnv) -> None:
    sb.create_queue(lock_duration=30)
    await sb.send_bodies(b"a", b"b", b"c")
    await sb.receive_and_dead_letter(3, reason="poison")
    assert len(sb.entity().dead_letters) == 3
    dead_letters = f"{sb.queue}/$DeadLetterQueue"
    sb.server.throttle(dead_letters, "peek", 1)
    assert await sb.dead_letter_reader(receive_wait=0.3).count(sb.queue) == 3
    assert sb.server.throttled(dead_letters, "peek") == 1
