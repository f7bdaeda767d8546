"""Every consumer-kit header with every kind of bad value, on every broker, through a real worker:
each message is dead-lettered as ``invalid_header`` naming the header or runs once with the value
ignored (the table of :mod:`consumer_kit.codec.headers`), the healthy message after them runs, the
worker stays ready and no receive task dies. The matrix: :mod:`tests.system.hostile.bookkeeping`.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import aio_pika
import pytest

from consumer_kit.adapters.memory import get_broker
from tests.fixtures.moto_server import sqs_endpoint, sqs_url  # noqa: F401 - fixture
from tests.system.hostile.bookkeeping import CASE_HEADER, SKIP, TABLE, Broker, nested, run_matrix

pytestmark = pytest.mark.postgres


def _same(_kind: str, value: Any) -> Any:
    return value


def test_the_matrix_covers_every_header_the_codec_reads() -> None:
    """A header added to consumer_kit.codec.headers without a row here would go untested (as the
    first-enqueued, sender and signature marks once did)."""
    from consumer_kit.codec import headers as own

    assert {spec.name for spec in own.SPECS} <= set(TABLE)


async def test_every_bad_bookkeeping_header_on_memory(database_url: str) -> None:
    url = f"memory://bookkeeping-{uuid.uuid4().hex[:8]}"
    memory = get_broker(url)
    queue = "bookkeeping"

    async def send(headers: dict[str, Any], body: bytes) -> None:
        memory.send(queue, body, headers=headers)

    async def dead_letters(count: int) -> list[tuple[str, str, str]]:
        return [(str(d.message.headers[CASE_HEADER]), d.reason, d.detail) for d in memory.dead_letters(queue)]

    matrix = await run_matrix(database_url, Broker(
        queue=queue, settings={"broker_url": url}, send=send, dead_letters=dead_letters, carry=_same,
        receive_task="memory-pump:bookkeeping",
    ))
    assert len(matrix) == len(TABLE) * 11


RABBITMQ_DEPTH = 200
"""AMQP arrays nested this deep: past consumer_kit.adapters.rabbitmq.wire's 64 levels, so each such value reads
as wire.UNDECODED (a value of the wrong type) and the header's rule applies. pamqp encodes
recursively, so this process cannot send 10,000 levels: tests/adapters/rabbitmq/test_header_nesting.py sends
them from a producer process of its own. 10,000 levels also travel as JSON text here."""

RABBITMQ_HUGE = 100_000
"""Characters: the largest test string whose header fits RabbitMQ's default 131,072-byte frame."""


def _rabbitmq_carry(kind: str, value: Any) -> Any:
    if kind in ("two_pow_63_int", "two_pow_63_bytes", "undecodable"):
        return SKIP  # AMQP has no unsigned 64-bit field; pamqp sends no bytes
    if kind == "non_finite":
        return "inf"  # RabbitMQ 3.10 closes the producer's connection for an infinite double
    if kind == "nested":
        return nested(RABBITMQ_DEPTH)
    if kind == "huge":
        return "9" * RABBITMQ_HUGE
    return value


@pytest.mark.rabbitmq
async def test_every_bad_bookkeeping_header_on_rabbitmq(database_url: str, rabbitmq_url: str) -> None:
    queue = f"ck-bookkeeping-{uuid.uuid4().hex[:8]}"
    connection = await aio_pika.connect(rabbitmq_url)
    try:
        channel = await connection.channel(publisher_confirms=True)

        async def send(headers: dict[str, Any], body: bytes) -> None:
            await channel.default_exchange.publish(
                aio_pika.Message(body, message_id=str(uuid.uuid4()), headers=headers), routing_key=queue
            )

        async def dead_letters(count: int) -> list[tuple[str, str, str]]:
            dlq = await channel.declare_queue(f"{queue}.dlq", passive=True)
            letters = []
            async with asyncio.timeout(30):
                while len(letters) < count:
                    message = await dlq.get(no_ack=True, fail=False)
                    if message is None:
                        await asyncio.sleep(0.05)  # polling the DLQ's observable state
                        continue
                    headers = message.headers
                    letters.append((str(headers[CASE_HEADER]), str(headers["x-dead-letter-reason"]),
                                    str(headers.get("x-dead-letter-detail", ""))))
            assert await dlq.get(no_ack=True, fail=False) is None
            return letters

        matrix = await run_matrix(database_url, Broker(
            queue=queue, settings={"broker_url": rabbitmq_url}, send=send, dead_letters=dead_letters,
            carry=_rabbitmq_carry, receive_task="consumer-kit rabbitmq supervisor",
        ))
        assert len(matrix) == len(TABLE) * 8
        for name in (queue, f"{queue}.dlq", f"{queue}.retry.50ms"):
            await channel.queue_delete(name)
    finally:
        await connection.close()


def _sqs_carry(kind: str, value: Any) -> Any:
    """SQS attributes are text or binary: numbers go as their text, nesting as JSON text."""
    if kind == "nested":
        return SKIP  # the same as nested_text here: SQS carries no structure
    if isinstance(value, bytes):
        return value
    return value if isinstance(value, str) else json.dumps(value) if not isinstance(value, float) else repr(value)


def _sqs_attribute(value: Any) -> dict[str, Any]:
    if isinstance(value, bytes):
        return {"DataType": "Binary", "BinaryValue": value}
    return {"DataType": "String", "StringValue": value}


async def test_every_bad_bookkeeping_header_on_sqs(database_url: str, sqs_endpoint: str) -> None:  # noqa: F811
    from consumer_kit.adapters.sqs import SQSClient, SQSConfig, headers_of
    from consumer_kit.adapters.sqs.topology import sqs_queue_name

    queue = f"ck-bookkeeping-{uuid.uuid4().hex[:8]}"
    client = SQSClient(SQSConfig.from_url(sqs_url(sqs_endpoint)), threads=4, pollers=0)
    size = {"MaximumMessageSize": str(1024 * 1024)}
    dlq_url = (await client.call("create_queue", QueueName=sqs_queue_name(queue) + "-dlq", Attributes=size))["QueueUrl"]
    arn = (await client.call("get_queue_attributes", QueueUrl=dlq_url, AttributeNames=["QueueArn"]))["Attributes"]["QueueArn"]
    policy = json.dumps({"deadLetterTargetArn": arn, "maxReceiveCount": 20})
    queue_url = (await client.call(
        "create_queue", QueueName=sqs_queue_name(queue), Attributes={**size, "RedrivePolicy": policy}
    ))["QueueUrl"]
    try:
        async def send(headers: dict[str, Any], body: bytes) -> None:
            attributes = {name: _sqs_attribute(value) for name, value in headers.items()}
            await client.call("send_message", QueueUrl=queue_url, MessageBody=body.decode(), MessageAttributes=attributes)

        async def dead_letters(count: int) -> list[tuple[str, str, str]]:
            letters: list[tuple[str, str, str]] = []
            async with asyncio.timeout(60):
                while len(letters) < count:
                    reply = await client.call("receive_message", QueueUrl=dlq_url, MaxNumberOfMessages=10,
                                              WaitTimeSeconds=1, MessageAttributeNames=["All"])
                    for raw in reply.get("Messages", []):
                        headers = headers_of(raw.get("MessageAttributes"))
                        letters.append((str(headers[CASE_HEADER]), str(headers["x-dead-letter-reason"]),
                                        str(headers.get("x-dead-letter-detail", ""))))
            return letters

        matrix = await run_matrix(database_url, Broker(
            # visibility 5 s: the poll in flight when the receive task is killed may take the message
            # sent next; it comes back when that receive's visibility lapses
            queue=queue, settings={"broker_url": sqs_url(sqs_endpoint, visibility=5)}, send=send,
            dead_letters=dead_letters, carry=_sqs_carry, receive_task=f"consumer-kit sqs poll {queue}",
        ))
        assert len(matrix) == len(TABLE) * 10
    finally:
        for url in (queue_url, dlq_url):
            await client.call("delete_queue", QueueUrl=url)
        await client.close()


SERVICEBUS_DEPTH = 50
"""AMQP lists nested this deep (the SDK's encoder gives up at Python's recursion limit, and a
message a few hundred levels deep never comes out of its receive call); 10,000 levels travel as
JSON text."""

SERVICEBUS_HUGE = 30_000
"""Characters: Service Bus refuses a property over 32 KB at send (*Service Bus quotas*; the test
server too, tests/adapters/servicebus/server/header_limits.py), so no larger header can reach a consumer."""


def _servicebus_carry(kind: str, value: Any) -> Any:
    if kind in ("two_pow_63_int", "undecodable"):
        return SKIP  # the SDK refuses an int beyond 64 bits and sends bytes as UTF-8 text
    if kind == "nested":
        return nested(SERVICEBUS_DEPTH)
    if kind == "huge":
        return "9" * SERVICEBUS_HUGE
    return value


def _servicebus_received(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value  # the adapter decodes UTF-8


async def test_every_bad_bookkeeping_header_on_servicebus(database_url: str, sb: Any) -> None:
    from azure.servicebus import ServiceBusMessage

    sb.create_queue()

    async def send(headers: dict[str, Any], body: bytes) -> None:
        await sb.send(ServiceBusMessage(body, application_properties=headers))

    async def dead_letters(count: int) -> list[tuple[str, str, str]]:
        letters = []
        for message in await sb.dead_letters(count):
            properties = {_text(k): v for k, v in (message.application_properties or {}).items()}
            letters.append((_text(properties[CASE_HEADER]), str(message.dead_letter_reason),
                            str(message.dead_letter_error_description or "")))
        return letters

    matrix = await run_matrix(database_url, Broker(
        queue=sb.queue, settings={"broker_url": "servicebus://", "settle_timeout": 5.0},
        consumer=sb.consumer(settle_timeout=5.0), send=send, dead_letters=dead_letters,
        carry=_servicebus_carry, received=_servicebus_received,
        receive_task=f"consumer-kit servicebus pump {sb.queue}",
    ))
    assert len(matrix) == len(TABLE) * 9


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
