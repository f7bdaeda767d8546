"""RabbitMQPublisher.publish_batch on the real broker: one write, one confirm wait, and still one
outcome per message (adapters/rabbitmq/confirms.py): an ack confirms only its own message, a nack,
a return or a refusal before sending fails only its own."""

from __future__ import annotations

import aio_pika
import pytest

from consumer_kit.adapters.rabbitmq import RabbitMQPublisher
from consumer_kit.publishing import OutgoingMessage, PublishError

pytestmark = [pytest.mark.rabbitmq]


def to_queue(queue: str, n: int) -> OutgoingMessage:
    return OutgoingMessage(
        destination="",
        routing_key=queue,
        message_id=f"m-{n}",
        body=b'{"n": %d}' % n,
        message_type="BatchProbe",
        headers={"relay-id": "test", "n": str(n)},
    )


async def test_each_message_of_a_batch_gets_its_own_outcome(rabbitmq_url: str, unique_name: str) -> None:
    connection = await aio_pika.connect(rabbitmq_url)
    publisher = RabbitMQPublisher(rabbitmq_url)
    try:
        channel = await connection.channel()
        ok = await channel.declare_queue(f"{unique_name}.ok", auto_delete=True)
        # the broker nacks a publish that would take this queue past one message
        await channel.declare_queue(
            f"{unique_name}.full",
            auto_delete=True,
            arguments={"x-max-length": 1, "x-overflow": "reject-publish"},
        )
        batch = [
            to_queue(ok.name, 0),
            to_queue(f"{unique_name}.full", 1),
            to_queue(f"{unique_name}.full", 2),  # nacked
            to_queue(f"{unique_name}.missing", 3),  # returned: no such queue
            to_queue("k" * 256, 4),  # a routing key over 255 bytes: refused before sending
            to_queue(ok.name, 5),
        ]
        outcomes = await publisher.publish_batch(batch, within=10.0)

        assert [o is None for o in outcomes] == [True, True, False, False, False, True], outcomes
        nacked, returned, refused = outcomes[2], outcomes[3], outcomes[4]
        assert isinstance(nacked, PublishError) and nacked.transient and "nacked" in str(nacked)
        assert isinstance(returned, PublishError) and not returned.transient and not returned.permanent
        assert isinstance(refused, PublishError) and refused.permanent
        got = []
        while (message := await ok.get(no_ack=True, fail=False)) is not None:
            got.append((message.message_id, message.headers["n"], message.type))
        assert got == [("m-0", "0", "BatchProbe"), ("m-5", "5", "BatchProbe")]

        # the publishing channel is still good for the next batch
        assert await publisher.publish_batch([to_queue(ok.name, 6)], within=10.0) == [None]
    finally:
        await publisher.close()
        await connection.close()
