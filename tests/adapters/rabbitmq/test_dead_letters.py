"""``<queue>.dlq`` never drops a dead letter: RabbitMQ 4.x gives every quorum queue a
delivery limit of 20, and ``dlq list`` / a selective ``dlq redrive`` browse by putting messages
back (a counted delivery). The declaration is checked here per version (this machine's broker is
3.10: the 4.x side is the documented argument, -1, checked as arguments), and on the real 3.x
broker by browsing one dead letter 25 times (the "about 20 listings" that lost letters on 4.x).
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import aio_pika
import pytest

from consumer_kit.adapters.rabbitmq.topology import (
    QueueDeclarer,
    QueueNames,
    broker_version,
    dead_letter_queue_arguments,
    dead_letter_queue_drops,
)

pytestmark = [pytest.mark.rabbitmq]

BROWSES = 25


def test_a_quorum_dlq_is_unlimited_in_each_versions_own_syntax() -> None:
    assert dead_letter_queue_arguments("quorum", (4, 0, 5)) == {"x-queue-type": "quorum", "x-delivery-limit": -1}
    assert dead_letter_queue_arguments("quorum", (3, 13, 7)) == {"x-queue-type": "quorum"}  # -1 drops on 3.x
    assert dead_letter_queue_arguments("quorum", None) == {"x-queue-type": "quorum"}
    assert dead_letter_queue_arguments("classic", (4, 1, 0)) == {}


def test_an_existing_dlq_that_would_drop_is_named() -> None:
    quorum = {"x-queue-type": "quorum"}
    assert "default of 20" in str(dead_letter_queue_drops(quorum, "quorum", (4, 0, 1)))
    assert dead_letter_queue_drops({**quorum, "x-delivery-limit": -1}, "quorum", (4, 0, 1)) is None
    assert "first browse" in str(dead_letter_queue_drops({**quorum, "x-delivery-limit": -1}, "quorum", (3, 10, 8)))
    assert "after 5 browses" in str(dead_letter_queue_drops({**quorum, "x-delivery-limit": 5}, "quorum", (3, 10, 8)))
    assert dead_letter_queue_drops(quorum, "quorum", (3, 10, 8)) is None
    assert dead_letter_queue_drops({}, "classic", (4, 0, 1)) is None
    assert dead_letter_queue_drops({**quorum, "x-dead-letter-exchange": "dlx"}, "quorum", (4, 0, 1)) is None


async def browse_and_put_back(connection: aio_pika.abc.AbstractRobustConnection, queue: str) -> bool:
    """One ``dlq list`` browse: basic.get, then close the channel (the message goes back)."""
    channel = await connection.channel()
    message = await (await channel.declare_queue(queue, passive=True)).get(no_ack=False, fail=False)
    await channel.close()
    return message is not None


async def test_a_dead_letter_survives_25_browses_on_this_broker(rabbitmq_url: str) -> None:
    names = QueueNames.for_queue(f"t{uuid.uuid4().hex[:10]}", [])
    connection = await aio_pika.connect_robust(rabbitmq_url)
    try:
        await QueueDeclarer(queue_type="quorum", delivery_limit=50, max_deliveries=5).declare(connection, names)
        channel = await connection.channel()
        await channel.default_exchange.publish(aio_pika.Message(b"{}", message_id="dead-1"), routing_key=names.dlq)
        queue = await channel.declare_queue(names.dlq, passive=True)
        async with asyncio.timeout(10):
            while queue.declaration_result.message_count != 1:
                await asyncio.sleep(0.05)
                queue = await channel.declare_queue(names.dlq, passive=True)
        seen = [await browse_and_put_back(connection, names.dlq) for _ in range(BROWSES)]
        assert all(seen), f"dropped after {seen.index(False)} browses on RabbitMQ {broker_version(connection)}"
        message = await queue.get(no_ack=True)
        assert message.message_id == "dead-1" and int(message.headers["x-delivery-count"]) == BROWSES
        for name in (names.queue, names.dlq):
            await channel.queue_delete(name)
    finally:
        await connection.close()


async def test_start_up_warns_about_an_existing_dlq_that_would_drop(
    rabbitmq_url: str, caplog: pytest.LogCaptureFixture,
) -> None:
    names = QueueNames.for_queue(f"t{uuid.uuid4().hex[:10]}", [])
    connection = await aio_pika.connect_robust(rabbitmq_url)
    try:
        channel = await connection.channel()
        await channel.declare_queue(names.dlq, durable=True,
                                    arguments={"x-queue-type": "quorum", "x-delivery-limit": 5})
        with caplog.at_level(logging.WARNING, logger="consumer_kit.adapters.rabbitmq"):
            await QueueDeclarer(queue_type="quorum", delivery_limit=50, max_deliveries=5).declare(connection, names)
        warnings = [r.getMessage() for r in caplog.records if "would drop dead letters" in r.getMessage()]
        assert len(warnings) == 1 and names.dlq in warnings[0] and "x-delivery-limit=5" in warnings[0]
        channel = await connection.channel()
        for name in (names.queue, names.dlq):
            await channel.queue_delete(name)
    finally:
        await connection.close()
