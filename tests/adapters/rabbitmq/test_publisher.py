"""RabbitMQPublisher.publish_batch on the real broker: one write, one confirm wait, and still one
outcome per message (adapters/rabbitmq/confirms.py): an ack confirms only its own message, a nack,
a return or a refusal before sending fails only its own."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from urllib.parse import urlsplit

import aio_pika
import pytest

from consumer_kit.adapters.rabbitmq import RabbitMQPublisher
from consumer_kit.broker.publishing import OutgoingMessage
from consumer_kit.errors import PublishError, PublishTimeout
from tests.fixtures.tcp_proxy import TcpProxy
from tests.outbox_relay.test_rabbitmq import via

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


async def test_a_batch_never_written_gives_its_delivery_tags_back(rabbitmq_url: str, unique_name: str) -> None:
    """A batch whose frames cannot even enter the connection's write queue in time (aiormq's is
    bounded: a blocked socket fills it) is never seen by the broker, so its delivery tags are given
    back (adapters/rabbitmq/confirms.py). Kept, they would shift every later confirm onto the
    message before it: a nacked message reported confirmed, its outbox row marked published.
    The socket is blocked for real: a TCP proxy that stops reading."""
    proxy = TcpProxy("127.0.0.1", urlsplit(rabbitmq_url).port or 5672)
    via_proxy = via(rabbitmq_url, await proxy.start())
    connection = await aio_pika.connect(rabbitmq_url)
    publisher = RabbitMQPublisher(via_proxy, confirm_timeout=60.0)
    try:
        channel = await connection.channel()
        ok = await channel.declare_queue(f"{unique_name}.ok", auto_delete=True)
        full = await channel.declare_queue(  # the broker nacks every publish to it
            f"{unique_name}.full", auto_delete=True, arguments={"x-max-length": 0, "x-overflow": "reject-publish"}
        )
        assert await publisher.publish_batch([to_queue(ok.name, 0)], within=10.0) == [None]
        proxy.pause()
        big = b"x" * (4 * 1024 * 1024)
        for n in range(16):  # more than the socket's buffers and the write queue's 10 frames hold
            message = replace(to_queue(full.name, 100 + n), body=big)
            [outcome] = await publisher.publish_batch([message], within=0.2)
            assert isinstance(outcome, PublishError)
        proxy.resume()
        probe = [to_queue(full.name, 1), to_queue(ok.name, 2), to_queue(ok.name, 3)]
        outcomes = await publisher.publish_batch(probe, within=30.0)
        assert [o is None for o in outcomes] == [False, True, True], outcomes
        assert "nacked" in str(outcomes[0])
        got = []
        while (message := await ok.get(no_ack=True, fail=False)) is not None:
            got.append(message.message_id)
        assert got == ["m-0", "m-2", "m-3"]
    finally:
        await publisher.close()
        await connection.close()
        await proxy.close()


async def test_a_batch_with_no_time_left_is_not_sent(rabbitmq_url: str, unique_name: str) -> None:
    """asyncio's timeout fires only at a suspension, and queueing the frames need not suspend: a
    batch called past its bound must not be sent (it would reach the queue yet be reported unsent,
    and the relay would publish it again)."""
    connection = await aio_pika.connect(rabbitmq_url)
    publisher = RabbitMQPublisher(rabbitmq_url)
    try:
        channel = await connection.channel()
        ok = await channel.declare_queue(f"{unique_name}.ok", auto_delete=True)
        assert await publisher.publish_batch([to_queue(ok.name, 0)], within=10.0) == [None]  # connected, declared
        outcomes = await publisher.publish_batch([to_queue(ok.name, 1), to_queue(ok.name, 2)], within=0.0)
        assert all(isinstance(o, PublishTimeout) and "not sent" in str(o) for o in outcomes), outcomes
        assert await publisher.publish_batch([to_queue(ok.name, 3)], within=10.0) == [None]
        got = []
        while (message := await ok.get(no_ack=True, fail=False)) is not None:
            got.append(message.message_id)
        assert got == ["m-0", "m-3"]
    finally:
        await publisher.close()
        await connection.close()


async def test_short_waits_that_add_up_to_the_confirm_timeout_reset_a_silent_connection(
    rabbitmq_url: str, unique_name: str
) -> None:
    """A relay whose publish deadline stays just under ``confirm_timeout`` waits less than it on
    every call: counted call by call, a connection that stopped answering (a blocked socket) would
    never be reset, and every pass would time out on it again. Unanswered waits add up across calls:
    after ``confirm_timeout`` seconds of silence the next call opens a new connection."""
    proxy = TcpProxy("127.0.0.1", urlsplit(rabbitmq_url).port or 5672)
    via_proxy = via(rabbitmq_url, await proxy.start())
    connection = await aio_pika.connect(rabbitmq_url)
    publisher = RabbitMQPublisher(via_proxy, confirm_timeout=1.0)
    try:
        channel = await connection.channel()
        ok = await channel.declare_queue(f"{unique_name}.ok", auto_delete=True)
        assert await publisher.publish_batch([to_queue(ok.name, 0)], within=10.0) == [None]
        # answered waits shorter than confirm_timeout never reset anything
        for n in range(1, 4):
            assert await publisher.publish_batch([to_queue(ok.name, n)], within=0.9) == [None]
        assert proxy.accepted == 1
        proxy.pause()
        loop = asyncio.get_running_loop()
        paused_at = loop.time()
        calls = 0
        while proxy.accepted == 1 and loop.time() - paused_at < 10:
            [outcome] = await publisher.publish_batch([to_queue(ok.name, 10 + calls)], within=0.3)
            assert isinstance(outcome, PublishTimeout), outcome
            calls += 1
        assert proxy.accepted == 2, "the silent connection was never reset"
        assert calls >= 3  # each call alone (0.3 s) was far from confirm_timeout (1 s)
        proxy.resume()
        assert await publisher.publish_batch([to_queue(ok.name, 99)], within=10.0) == [None]
        got = set()
        while (message := await ok.get(no_ack=True, fail=False)) is not None:
            got.add(message.message_id)
        assert {"m-0", "m-1", "m-2", "m-3", "m-99"} <= got  # sent while blocked: at most once more
    finally:
        await publisher.close()
        await connection.close()
        await proxy.close()
