"""RabbitMQ adapter against the real local broker (see tests/conftest.py for the URL)."""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import aio_pika
import pytest

from adapters.rabbitmq import (
    DELIVERIES_HEADER,
    RabbitMQConsumer,
    RabbitMQDelivery,
    RabbitMQPublisher,
    broker_delivery_limit,
    consumer_from_settings,
    delivery_count_of,
    publisher_from_settings,
)
from consumer_kit.broker import Delivery, OutgoingMessage, PublishError, Settlement
from tests.conftest import close_vhost_connections, vhost_of

pytestmark = pytest.mark.rabbitmq

WAIT = 10.0  # seconds: upper bound for anything that should happen "soon"


# -- helpers ---------------------------------------------------------------------------------


class Inbox:
    """Collects deliveries handed to a callback; ``next()`` waits for one (bounded)."""

    def __init__(self, on_delivery: Callable[[Delivery], Awaitable[None]] | None = None) -> None:
        self.queue: asyncio.Queue[Delivery] = asyncio.Queue()
        self.on_delivery = on_delivery

    async def __call__(self, delivery: Delivery) -> None:
        await self.queue.put(delivery)
        if self.on_delivery is not None:
            await self.on_delivery(delivery)

    async def next(self, timeout: float = WAIT) -> Delivery:
        return await asyncio.wait_for(self.queue.get(), timeout)


async def send(url: str, queue: str, body: bytes, message_id: str | None = None) -> str:
    message_id = message_id or str(uuid.uuid4())
    publisher = RabbitMQPublisher(url)
    try:
        await publisher.publish(
            OutgoingMessage(
                destination="", routing_key=queue, message_id=message_id, body=body,
                message_type="test.command",
            )
        )
    finally:
        await publisher.close()
    return message_id


async def receive_raw(url: str, queue: str) -> aio_pika.abc.AbstractIncomingMessage:
    """The next message on ``queue`` with a plain aio-pika consumer (acked), waiting at most WAIT."""
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        amqp_queue = await channel.declare_queue(queue, passive=True)
        async with amqp_queue.iterator() as messages:
            message = await asyncio.wait_for(messages.__anext__(), WAIT)
            await message.ack()
            return message
    finally:
        await connection.close()


async def queue_state(url: str, queue: str) -> tuple[int, int]:
    """(ready message count, consumer count) of ``queue`` via a passive declare."""
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue, passive=True)
        result = declared.declaration_result
        return result.message_count or 0, result.consumer_count or 0
    finally:
        await connection.close()


@pytest.fixture
async def cleanup(rabbitmq_url: str, unique_name: str) -> AsyncIterator[list[str]]:
    """Deletes the test's queues (and the exchanges the test appends) at the end."""
    extra: list[str] = []
    yield extra
    suffixes = ["", ".dlq", ".retry.500ms", ".retry.5000ms", ".bound"]
    queues = [unique_name + suffix for suffix in suffixes]
    connection = await aio_pika.connect(rabbitmq_url)
    try:
        for name in queues:
            channel = await connection.channel()
            await channel.queue_delete(name)  # idempotent: a missing queue is fine
        for name in extra:
            channel = await connection.channel()
            await channel.exchange_delete(name)
    finally:
        await connection.close()


def make_consumer(url: str, **kwargs: object) -> RabbitMQConsumer:
    options: dict[str, object] = {"max_deliveries": 5, "retry_delays": [0.5, 5.0],
                                  "settle_timeout": 2.0, "reconnect_timeout": 10.0}
    options.update(kwargs)
    return RabbitMQConsumer(url, **options)  # type: ignore[arg-type]


# -- pure functions ----------------------------------------------------------------------------


def test_delivery_count_formula() -> None:
    assert delivery_count_of({}, redelivered=False) == 1
    assert delivery_count_of({}, redelivered=True) == 2  # classic: a lower bound
    assert delivery_count_of({"x-delivery-count": 1}, redelivered=True) == 2  # quorum
    assert delivery_count_of({"x-delivery-count": 3}, redelivered=True) == 4
    assert delivery_count_of({DELIVERIES_HEADER: 2}, redelivered=False) == 3  # retry copy
    assert delivery_count_of({DELIVERIES_HEADER: 2, "x-delivery-count": 1}, redelivered=True) == 4
    assert delivery_count_of({DELIVERIES_HEADER: b"junk"}, redelivered=False) == 1
    assert broker_delivery_limit(3) > 3 and broker_delivery_limit(20) >= 40


def test_factories_from_settings() -> None:
    from consumer_kit.settings import Settings

    settings = Settings(broker_url="amqp://guest:guest@127.0.0.1:5672/", retry_delays=[0, 1.0, 5.0])
    consumer = consumer_from_settings(settings)
    assert isinstance(consumer, RabbitMQConsumer)
    # 0 is an immediate retry (no queue); 1 s, 5 s and the in-progress delay are tiers.
    topology = consumer._topology_for("q")
    assert topology.retry_queue_for(0) == "q"
    assert topology.retry_queue_for(1.0) == "q.retry.1000ms"
    assert topology.retry_queue_for(60) == "q.retry.5000ms"
    assert isinstance(publisher_from_settings(settings), RabbitMQPublisher)


def test_handler_timeout_warning(caplog: pytest.LogCaptureFixture, rabbitmq_url: str) -> None:
    with caplog.at_level(logging.WARNING, logger="adapters.rabbitmq"):
        make_consumer(rabbitmq_url, handler_timeout=60.0, consumer_timeout=1800.0)
    assert "consumer_timeout" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="adapters.rabbitmq"):
        make_consumer(rabbitmq_url, handler_timeout=1800.0, consumer_timeout=1800.0)
    assert "consumer_timeout" in caplog.text


# -- consumer ----------------------------------------------------------------------------------


async def test_ack_removes_the_message(rabbitmq_url: str, unique_name: str, cleanup: list[str]) -> None:
    inbox = Inbox()
    consumer = make_consumer(rabbitmq_url)
    await consumer.subscribe(unique_name, inbox, prefetch=1)
    try:
        first = await send(rabbitmq_url, unique_name, b'{"n": 1}')
        second = await send(rabbitmq_url, unique_name, b'{"n": 2}')
        delivery = await inbox.next()
        assert isinstance(delivery, RabbitMQDelivery)
        assert (delivery.message_id, delivery.body, delivery.delivery_count) == (first, b'{"n": 1}', 1)
        assert delivery.queue == unique_name
        await delivery.ack()
        # prefetch=1: the broker hands out the second message only once it has the ack.
        following = await inbox.next()
        assert following.message_id == second
        await following.ack()
    finally:
        await consumer.close()
    assert await queue_state(rabbitmq_url, unique_name) == (0, 0)


async def test_retry_with_delay_redelivers_later_with_count_plus_one(
    rabbitmq_url: str, unique_name: str, cleanup: list[str]
) -> None:
    inbox = Inbox()
    consumer = make_consumer(rabbitmq_url)
    await consumer.subscribe(unique_name, inbox, prefetch=4)
    try:
        message_id = await send(rabbitmq_url, unique_name, b"{}")
        first = await inbox.next()
        assert first.delivery_count == 1
        started = time.monotonic()
        await first.retry(0.3)  # smallest tier >= 0.3 s is 0.5 s
        second = await inbox.next()
        elapsed = time.monotonic() - started
        assert second.message_id == message_id and second.body == b"{}"
        assert second.delivery_count == 2
        assert second.headers[DELIVERIES_HEADER] == 1
        assert 0.4 <= elapsed < 4.5, elapsed
        await second.retry(0)  # immediate retry: a copy straight to the work queue
        third = await inbox.next()
        assert third.delivery_count == 3
        await third.ack()
    finally:
        await consumer.close()
    assert (await queue_state(rabbitmq_url, f"{unique_name}.retry.500ms"))[0] == 0
    assert (await queue_state(rabbitmq_url, f"{unique_name}.retry.5000ms"))[0] == 0
    assert (await queue_state(rabbitmq_url, unique_name))[0] == 0


async def test_dead_letter_moves_to_dlq_with_reason(
    rabbitmq_url: str, unique_name: str, cleanup: list[str]
) -> None:
    inbox = Inbox()
    consumer = make_consumer(rabbitmq_url)
    await consumer.subscribe(unique_name, inbox, prefetch=1)
    try:
        message_id = await send(rabbitmq_url, unique_name, b'{"bad": true}')
        delivery = await inbox.next()
        await delivery.dead_letter("payload_conflict", "fingerprint differs")
        dead = await receive_raw(rabbitmq_url, f"{unique_name}.dlq")
        assert dead.message_id == message_id and dead.body == b'{"bad": true}'
        assert dead.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
        assert dead.headers["x-dead-letter-reason"] == "payload_conflict"
        assert dead.headers["x-dead-letter-detail"] == "fingerprint differs"
        assert dead.headers["x-original-queue"] == unique_name
        assert dead.headers[DELIVERIES_HEADER] == 1
    finally:
        await consumer.close()
    assert (await queue_state(rabbitmq_url, unique_name))[0] == 0


async def test_release_on_quorum_counts_x_delivery_count(
    rabbitmq_url: str, unique_name: str, cleanup: list[str]
) -> None:
    inbox = Inbox()
    consumer = make_consumer(rabbitmq_url)
    await consumer.subscribe(unique_name, inbox, prefetch=1)
    try:
        await send(rabbitmq_url, unique_name, b"{}")
        first = await inbox.next()
        assert first.delivery_count == 1 and "x-delivery-count" not in first.headers
        await first.release()
        second = await inbox.next()
        assert second.headers.get("x-delivery-count") == 1
        assert second.delivery_count == 2
        await second.ack()
    finally:
        await consumer.close()


async def test_broker_delivery_limit_dead_letters_into_the_dlq(
    rabbitmq_url: str, unique_name: str, cleanup: list[str]
) -> None:
    """A message released again and again hits the quorum x-delivery-limit: the broker's DLX
    routes it to <queue>.dlq instead of dropping it."""
    limit = broker_delivery_limit(1)

    async def release(delivery: Delivery) -> None:
        await delivery.release()

    inbox = Inbox(on_delivery=release)
    consumer = make_consumer(rabbitmq_url, max_deliveries=1)
    await consumer.subscribe(unique_name, inbox, prefetch=1)
    try:
        message_id = await send(rabbitmq_url, unique_name, b"{}")
        counts = [(await inbox.next()).delivery_count for _ in range(limit + 1)]
        assert counts == list(range(1, limit + 2))
    finally:
        await consumer.close()
    dead = await receive_raw(rabbitmq_url, f"{unique_name}.dlq")
    assert dead.message_id == message_id
    assert dead.headers["x-death"][0]["reason"] == "delivery_limit"


async def test_settle_on_a_closed_channel_neither_hangs_nor_raises(
    rabbitmq_url: str, unique_name: str, cleanup: list[str]
) -> None:
    inbox = Inbox()
    consumer = make_consumer(rabbitmq_url, settle_timeout=1.0)
    await consumer.subscribe(unique_name, inbox, prefetch=4)
    ids = [await send(rabbitmq_url, unique_name, b"{}") for _ in range(4)]
    held = [await inbox.next() for _ in ids]
    await consumer.close()  # the deliveries' channel is gone: they go back to the broker
    started = time.monotonic()
    await held[0].ack()
    await held[1].retry(0.5)
    await held[2].dead_letter("invalid", "")
    await held[3].release()
    assert time.monotonic() - started < 4 * 2 * 1.0
    assert [d.settlement for d in held] == [
        Settlement.ACK, Settlement.RETRY, Settlement.DEAD_LETTER, Settlement.RELEASED
    ]
    # Nothing was lost: all four come back (a quorum queue counts the lost channel).
    again = Inbox()
    consumer2 = make_consumer(rabbitmq_url)
    await consumer2.subscribe(unique_name, again, prefetch=4)
    try:
        back = [await again.next() for _ in ids]
        assert sorted(d.message_id for d in back) == sorted(ids)  # type: ignore[type-var]
        assert {d.delivery_count for d in back} == {2}
        for delivery in back:
            await delivery.ack()
    finally:
        await consumer2.close()
    assert (await queue_state(rabbitmq_url, f"{unique_name}.dlq"))[0] == 0


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("rabbitmqctl") is None, reason="needs rabbitmqctl")
async def test_consumers_come_back_after_the_vhost_connections_close(
    rabbitmq_url: str, unique_name: str, cleanup: list[str]
) -> None:
    inbox = Inbox()
    consumer = make_consumer(rabbitmq_url)
    await consumer.subscribe(unique_name, inbox, prefetch=2)
    publisher = RabbitMQPublisher(rabbitmq_url)
    command = OutgoingMessage(
        destination="", routing_key=unique_name, message_id="", body=b"{}", message_type="t"
    )
    try:
        await publisher.publish(_with_id(command, "before"))
        assert (await inbox.next()).message_id == "before"
        held = None
        await publisher.publish(_with_id(command, "held"))
        held = await inbox.next()

        closed = await asyncio.to_thread(close_vhost_connections, vhost_of(rabbitmq_url))
        assert closed >= 2  # the consumer's and the publisher's
        await held.ack()  # its channel is gone: must return quietly

        # The publisher reconnects on the next publish; the consumer re-creates its consumer.
        await asyncio.wait_for(_publish_until_confirmed(publisher, _with_id(command, "after")), WAIT)
        seen = set()
        while "after" not in seen:
            delivery = await inbox.next(WAIT)
            seen.add(delivery.message_id)
            await delivery.ack()
        assert consumer.reconnects >= 1 and consumer.connected
        assert (await queue_state(rabbitmq_url, unique_name))[1] == 1
    finally:
        await publisher.close()
        await consumer.close()
    assert await queue_state(rabbitmq_url, unique_name) == (0, 0)


async def test_consumer_comes_back_after_its_queue_is_deleted(
    rabbitmq_url: str, unique_name: str, cleanup: list[str]
) -> None:
    """The broker cancels a consumer whose queue is deleted; the adapter re-declares the
    topology and consumes again (a queue must never be left with zero consumers)."""
    inbox = Inbox()
    consumer = make_consumer(rabbitmq_url)
    await consumer.subscribe(unique_name, inbox, prefetch=1)
    publisher = RabbitMQPublisher(rabbitmq_url)
    try:
        connection = await aio_pika.connect(rabbitmq_url)
        try:
            channel = await connection.channel()
            await channel.queue_delete(unique_name)
        finally:
            await connection.close()
        command = OutgoingMessage(
            destination="", routing_key=unique_name, message_id="after-delete", body=b"{}",
            message_type="t",
        )
        # PublishError ("no queue") until the adapter has declared the queue again.
        await asyncio.wait_for(_publish_until_confirmed(publisher, command), WAIT)
        delivery = await inbox.next()
        assert delivery.message_id == "after-delete"
        await delivery.ack()
        assert consumer.reconnects == 1
        assert (await queue_state(rabbitmq_url, unique_name))[1] == 1
    finally:
        await publisher.close()
        await consumer.close()


def _with_id(message: OutgoingMessage, message_id: str) -> OutgoingMessage:
    return OutgoingMessage(
        destination=message.destination, routing_key=message.routing_key, message_id=message_id,
        body=message.body, message_type=message.message_type,
    )


async def _publish_until_confirmed(publisher: RabbitMQPublisher, message: OutgoingMessage) -> None:
    while True:
        try:
            await publisher.publish(message)
            return
        except PublishError:
            await asyncio.sleep(0.1)  # the broker may still be closing connections


async def test_startup_warns_about_existing_queue_with_low_delivery_limit(
    rabbitmq_url: str, unique_name: str, cleanup: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    connection = await aio_pika.connect(rabbitmq_url)
    try:
        channel = await connection.channel()
        await channel.declare_queue(
            unique_name, durable=True, arguments={"x-queue-type": "quorum", "x-delivery-limit": 2}
        )
    finally:
        await connection.close()
    inbox = Inbox()
    consumer = make_consumer(rabbitmq_url, max_deliveries=5)
    with caplog.at_level(logging.WARNING, logger="adapters.rabbitmq"):
        await consumer.subscribe(unique_name, inbox, prefetch=1)
    try:
        assert "x-delivery-limit=2 below max_deliveries=5" in caplog.text
        assert "has no dead-letter settings" in caplog.text
        # ... and the existing queue is used as it is.
        message_id = await send(rabbitmq_url, unique_name, b"{}")
        delivery = await inbox.next()
        assert delivery.message_id == message_id
        await delivery.ack()
    finally:
        await consumer.close()


async def test_callback_error_releases_the_delivery(
    rabbitmq_url: str, unique_name: str, cleanup: list[str]
) -> None:
    calls = 0

    async def flaky(delivery: Delivery) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("boom")
        await inbox(delivery)

    inbox = Inbox()
    consumer = make_consumer(rabbitmq_url)
    await consumer.subscribe(unique_name, flaky, prefetch=1)
    try:
        await send(rabbitmq_url, unique_name, b"{}")
        delivery = await inbox.next()
        assert delivery.delivery_count == 2
        await delivery.ack()
    finally:
        await consumer.close()


# -- publisher ---------------------------------------------------------------------------------


async def test_publisher_confirms_with_given_message_id(
    rabbitmq_url: str, unique_name: str, cleanup: list[str]
) -> None:
    exchange_name = f"{unique_name}.events"
    cleanup.append(exchange_name)
    publisher = RabbitMQPublisher(rabbitmq_url, confirm_timeout=5.0)
    event_id = str(uuid.uuid4())
    try:
        # No binding yet: normal in pub/sub, treated as published.
        await publisher.publish(
            OutgoingMessage(destination=exchange_name, routing_key="invoice.created",
                            message_id=str(uuid.uuid4()), body=b"{}", message_type="InvoiceCreated")
        )
        connection = await aio_pika.connect(rabbitmq_url)
        try:
            channel = await connection.channel()
            queue = await channel.declare_queue(f"{unique_name}.bound", durable=True)
            await queue.bind(exchange_name, routing_key="invoice.*")
            await publisher.publish(
                OutgoingMessage(
                    destination=exchange_name, routing_key="invoice.created", message_id=event_id,
                    body=b'{"invoice": 1}', message_type="InvoiceCreated",
                    headers={"correlation-id": "c-1"},
                )
            )
            received = await queue.get(timeout=WAIT, fail=True)
            assert received is not None
            await received.ack()
            assert received.message_id == event_id
            assert received.body == b'{"invoice": 1}'
            assert received.type == "InvoiceCreated"
            assert received.content_type == "application/json"
            assert received.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
            assert received.headers["message-type"] == "InvoiceCreated"
            assert received.headers["correlation-id"] == "c-1"
        finally:
            await connection.close()
        # Straight to a queue that does not exist: nobody would ever get it.
        with pytest.raises(PublishError):
            await publisher.publish(
                OutgoingMessage(destination="", routing_key=f"{unique_name}.missing",
                                message_id=event_id, body=b"{}", message_type="t")
            )
    finally:
        await publisher.close()


async def test_publisher_raises_publish_error_when_broker_unreachable() -> None:
    publisher = RabbitMQPublisher("amqp://guest:guest@127.0.0.1:1/", confirm_timeout=2.0)
    with pytest.raises(PublishError):
        await publisher.publish(
            OutgoingMessage(destination="x", routing_key="", message_id="1", body=b"",
                            message_type="t")
        )
    await publisher.close()


async def test_subscribe_raises_connection_error_when_unreachable() -> None:
    consumer = make_consumer("amqp://guest:guest@127.0.0.1:1/", reconnect_timeout=0.5)
    with pytest.raises(ConnectionError):
        await consumer.subscribe("nowhere", Inbox(), prefetch=1)
    await consumer.close()
