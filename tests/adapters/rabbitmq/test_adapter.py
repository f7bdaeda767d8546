"""RabbitMQ adapter against the real local broker (see tests/conftest.py for the URL).

Fault tests put a :class:`tests.fixtures.tcp_proxy.TcpProxy` between the adapter and the broker: paused,
it is a broker that stops answering; dropped, a network cut.
"""

from __future__ import annotations

import asyncio
import logging
import random
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlparse, urlunparse

import aio_pika
import aiormq
import pytest

from consumer_kit.adapters.rabbitmq import (
    DEAD_LETTER_REASON_HEADER,
    DELIVERIES_HEADER,
    REDELIVERED_HEADER,
    TRIMMED_HEADER,
    RabbitMQConsumer,
    RabbitMQDelivery,
    RabbitMQPublisher,
    broker_delivery_limit,
    consumer_from_settings,
    delivery_count_of,
    publisher_from_settings,
)
from consumer_kit.adapters.rabbitmq.envelope import properties_of, user_of_url
from consumer_kit.adapters.rabbitmq.errors import publish_error
from consumer_kit.adapters.rabbitmq.limits import _header_frame_bound, header_frame_size
from consumer_kit.broker import Delivery, Settlement, ack_all
from consumer_kit.broker.publishing import OutgoingMessage
from consumer_kit.codec import headers as own
from consumer_kit.errors import PublishError
from tests.conftest import close_vhost_connections, vhost_of
from tests.fixtures.tcp_proxy import TcpProxy

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


def command(queue: str, message_id: str | None = None, headers: dict[str, str] | None = None,
            body: bytes = b"{}") -> OutgoingMessage:
    return OutgoingMessage(
        destination="", routing_key=queue, message_id=message_id or str(uuid.uuid4()), body=body,
        message_type="test.command", headers=headers or {},
    )


async def send(url: str, queue: str, body: bytes = b"{}", message_id: str | None = None,
               headers: dict[str, str] | None = None) -> str:
    message = command(queue, message_id, headers, body)
    publisher = RabbitMQPublisher(url)
    try:
        await publisher.publish(message)
    finally:
        await publisher.close()
    return message.message_id


@asynccontextmanager
async def raw_channel(url: str) -> AsyncIterator[aio_pika.abc.AbstractChannel]:
    connection = await aio_pika.connect(url)
    try:
        yield await connection.channel()
    finally:
        await connection.close()


async def receive_raw(url: str, queue: str) -> aio_pika.abc.AbstractIncomingMessage:
    """The next message on ``queue`` with a plain aio-pika consumer (acked), waiting at most WAIT."""
    async with raw_channel(url) as channel:
        amqp_queue = await channel.declare_queue(queue, passive=True)
        async with amqp_queue.iterator() as messages:
            message = await asyncio.wait_for(messages.__anext__(), WAIT)
            await message.ack()
            return message


async def queue_state(url: str, queue: str) -> tuple[int, int]:
    """(ready message count, consumer count) of ``queue`` via a passive declare."""
    async with raw_channel(url) as channel:
        declared = await channel.declare_queue(queue, passive=True)
        result = declared.declaration_result
        return result.message_count or 0, result.consumer_count or 0


async def frame_max(url: str) -> int:
    connection = await aio_pika.connect(url)
    try:
        assert connection.transport is not None
        return int(connection.transport.connection.connection_tune.frame_max)
    finally:
        await connection.close()


def headers_of_frame_size(
    message: OutgoingMessage, name: str, size: int, *, user_id: str | None = None
) -> dict[str, str]:
    """Headers for ``message``: its own plus ``name`` padded so that the content-header frame is
    exactly ``size`` bytes (sent with ``user_id``, as the publisher sends its own user)."""
    def frame(length: int) -> int:
        padded = OutgoingMessage(**{**message.__dict__, "headers": {**message.headers, name: "x" * length}})
        return header_frame_size(properties_of(padded, user_id=user_id), len(message.body))

    length = max(0, size - frame(0))
    while frame(length) < size:
        length += 1
    assert frame(length) == size
    return {**message.headers, name: "x" * length}


def via(url: str, port: int) -> str:
    parts = urlparse(url)
    credentials, _, _ = parts.netloc.rpartition("@")
    host = f"127.0.0.1:{port}"
    return urlunparse(parts._replace(netloc=f"{credentials}@{host}" if credentials else host))


async def wait_for(predicate: Callable[[], Awaitable[bool]], what: str, timeout: float = WAIT) -> None:
    """Poll ``predicate`` until true, at most ``timeout`` seconds (a bounded wait on a condition)."""
    async with asyncio.timeout(timeout):
        while not await predicate():
            await asyncio.sleep(0.05)


@pytest.fixture
async def cleanup(rabbitmq_url: str, unique_name: str) -> AsyncIterator[list[str]]:
    """Deletes the test's queues (``unique_name`` and ``<unique_name>.b`` with their DLQs and
    retry tiers) and the exchanges the test appends, at the end."""
    extra: list[str] = []
    yield extra
    suffixes = ["", ".dlq", ".retry.500ms", ".retry.5000ms", ".bound"]
    queues = [base + suffix for base in (unique_name, unique_name + ".b") for suffix in suffixes]
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


@asynccontextmanager
async def consuming(url: str, queue: str, inbox: Inbox, prefetch: int = 1,
                    **kwargs: object) -> AsyncIterator[RabbitMQConsumer]:
    consumer = make_consumer(url, **kwargs)
    await consumer.subscribe(queue, inbox, prefetch=prefetch)
    try:
        yield consumer
    finally:
        await consumer.close()


async def ack_what_comes_back(url: str, queue: str, expected: list[str]) -> None:
    """Consume ``queue`` afresh: exactly the messages ``expected`` (ids, in any order) come back;
    acked, they settle and leave the queue empty with no consumer."""
    inbox = Inbox()
    async with consuming(url, queue, inbox, prefetch=5):
        back = [await inbox.next() for _ in expected]
        assert sorted(d.message_id or "" for d in back) == sorted(expected)
        await ack_all(back)
        assert all(d.settlement is Settlement.ACK and not d.lost for d in back)
    assert await queue_state(url, queue) == (0, 0)


@asynccontextmanager
async def proxy_to(url: str) -> AsyncIterator[TcpProxy]:
    parsed = urlparse(url)
    proxy = TcpProxy(parsed.hostname or "127.0.0.1", parsed.port or 5672)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()


# -- pure functions ----------------------------------------------------------------------------


def signed(headers: dict[str, Any]) -> own.OwnHeaders:
    """``headers`` of a body-less copy as consumer-kit sends it (signed), read by the codec."""
    return own.read(own.seal(headers, b""), b"")


def test_delivery_count_formula() -> None:
    assert delivery_count_of({}, redelivered=False) == 1
    assert delivery_count_of({}, redelivered=True) == 2  # classic: a lower bound
    assert delivery_count_of({"x-delivery-count": 1}, redelivered=True) == 2  # quorum
    assert delivery_count_of({"x-delivery-count": 3}, redelivered=True) == 4
    # a retry copy as the adapter sends it: its marks signed
    assert delivery_count_of(signed({DELIVERIES_HEADER: 2}), redelivered=False) == 3  # retry copy
    assert delivery_count_of(signed({DELIVERIES_HEADER: 2, "x-delivery-count": 1}), redelivered=True) == 4
    assert delivery_count_of({DELIVERIES_HEADER: b"junk"}, redelivered=False) == 1


def test_the_frame_bound_never_undercounts_and_only_covers_string_headers() -> None:
    """check_fits skips encoding the frame when this bound fits: it must never be below the size
    pamqp encodes (multi-byte characters, empty and long values), and it gives up (None) on a
    header that is not a string or a short string over 255 bytes."""
    rnd = random.Random(7)
    alphabet = "ab-9 é€😀"

    def text(longest: int) -> str:
        return "".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, longest)))

    for _ in range(500):
        message = OutgoingMessage(
            destination="x", routing_key="", message_id=text(60) or "m", body=b"{}",
            message_type=text(40) or "T", headers={text(30) or "k": text(400) for _ in range(rnd.randint(0, 10))},
        )
        properties = properties_of(message)
        bound = _header_frame_bound(properties)
        assert bound is not None and bound >= header_frame_size(properties, 2)
    assert _header_frame_bound(properties_of(OutgoingMessage(
        destination="x", routing_key="", message_id="m", body=b"", message_type="T", headers={"n": 1},
    ))) is None
    assert _header_frame_bound(properties_of(OutgoingMessage(
        destination="x", routing_key="", message_id="m" * 256, body=b"", message_type="T", headers={},
    ))) is None


def test_broker_delivery_limit_sits_well_above_our_own_bounds() -> None:
    assert broker_delivery_limit(5, 3) == 50  # the floor
    assert broker_delivery_limit(1, 1) == 50
    assert broker_delivery_limit(20, 4) == 120  # 5 * (20 + 4)
    for max_deliveries in range(1, 40):  # the README's formula, not only "well above"
        for crash_limit in range(1, 10):
            limit = broker_delivery_limit(max_deliveries, crash_limit)
            assert limit == max(50, 5 * (max_deliveries + crash_limit)), (max_deliveries, crash_limit)


def test_broker_replies_are_classified_into_publish_error_kinds() -> None:
    refused = aiormq.exceptions.ChannelPreconditionFailed(
        "PRECONDITION_FAILED - inequivalent arg 'type' for exchange 'x' in vhost 'v': "
        "received 'topic' but current is 'direct'"
    )
    alone = publish_error(refused, "m-1", "x", alone=True)
    assert alone.permanent and not alone.transient
    assert "inequivalent arg 'type'" in str(alone) and "m-1" in str(alone)
    # The same close on a channel other messages share may have been caused by any of them.
    shared = publish_error(refused, "m-2", "x", alone=False)
    assert shared.transient and not shared.permanent
    for exc in (aiormq.exceptions.ChannelNotFoundEntity("NOT_FOUND - no exchange 'x'"),
                aiormq.exceptions.ChannelAccessRefused("ACCESS_REFUSED - access to exchange 'x'"),
                aiormq.exceptions.ConnectionFrameError("FRAME_ERROR - frame_too_large")):
        assert publish_error(exc, "m", "x", alone=True).permanent, exc
    for exc in (TimeoutError(), ConnectionResetError(),
                aiormq.exceptions.ChannelClosed(320, "CONNECTION_FORCED - broker forced"),
                aiormq.exceptions.DeliveryError(None, aiormq.spec.Basic.Nack(delivery_tag=1))):
        error = publish_error(exc, "m", "x", alone=True)
        assert error.transient and not error.permanent, exc


def test_factories_from_settings() -> None:
    from consumer_kit.settings import Settings

    settings = Settings(broker_url="amqp://guest:guest@127.0.0.1:5672/", retry_delays=[0, 1.0, 5.0],
                        max_deliveries=9, crash_limit=3)
    consumer = consumer_from_settings(settings)
    assert isinstance(consumer, RabbitMQConsumer)
    # 0 is an immediate retry (no queue); 1 s, 5 s and the in-progress delay are tiers.
    names = consumer._names_for("q")
    assert names.retry_queue_for(0) == "q"
    assert names.retry_queue_for(1.0) == "q.retry.1000ms"
    assert names.retry_queue_for(60) == "q.retry.5000ms"
    assert consumer._declarer.work_queue_arguments(names)["x-delivery-limit"] == 60  # 5 * (9 + 3)
    assert isinstance(publisher_from_settings(settings), RabbitMQPublisher)


def test_handler_timeout_warning(caplog: pytest.LogCaptureFixture, rabbitmq_url: str) -> None:
    with caplog.at_level(logging.WARNING, logger="consumer_kit.adapters.rabbitmq"):
        make_consumer(rabbitmq_url, handler_timeout=60.0, consumer_timeout=1800.0)
    assert "consumer_timeout" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="consumer_kit.adapters.rabbitmq"):
        make_consumer(rabbitmq_url, handler_timeout=1800.0, consumer_timeout=1800.0)
    assert "consumer_timeout" in caplog.text


# -- consumer: settlement ----------------------------------------------------------------------


async def test_ack_removes_the_message(rabbitmq_url: str, unique_name: str, cleanup: list[str]) -> None:
    inbox = Inbox()
    async with consuming(rabbitmq_url, unique_name, inbox) as consumer:
        assert consumer.ready
        publisher = RabbitMQPublisher(rabbitmq_url)
        first = command(unique_name)
        try:
            await publisher.publish(first)
            # correlation_id comes from the AMQP property, not from a header
            async with raw_channel(rabbitmq_url) as channel:
                await channel.default_exchange.publish(
                    aio_pika.Message(b'{"n": 2}', message_id="second", correlation_id="corr-7"),
                    routing_key=unique_name,
                )
        finally:
            await publisher.close()
        delivery = await inbox.next()
        assert isinstance(delivery, RabbitMQDelivery)
        assert (delivery.message_id, delivery.body, delivery.delivery_count) == (first.message_id, b"{}", 1)
        assert delivery.queue == unique_name and not delivery.redelivered
        await delivery.ack()
        assert not delivery.lost
        # prefetch=1: the broker hands out the second message only once it has the ack.
        following = await inbox.next()
        assert (following.message_id, following.correlation_id) == ("second", "corr-7")
        await following.ack()
    assert not consumer.ready
    assert await queue_state(rabbitmq_url, unique_name) == (0, 0)


async def test_a_batch_of_acks_is_one_multiple_ack_only_over_its_own_tags(
    rabbitmq_url: str, unique_name: str, cleanup: list[str]
) -> None:
    inbox = Inbox()
    consumer = make_consumer(rabbitmq_url)
    await consumer.subscribe(unique_name, inbox, prefetch=5)
    ids = [await send(rabbitmq_url, unique_name, message_id=f"m{n}") for n in range(1, 6)]
    held = [await inbox.next() for _ in ids]
    assert [d.message_id for d in held] == ids  # tag order
    d1, d2, d3, d4, _d5 = held
    # d1 is unacked below them: a multiple ack of d3 would ack it too
    assert RabbitMQDelivery._ack_groups([d2, d3])[0] == []
    groups, alone = RabbitMQDelivery._ack_groups([d4, d1, d2])
    assert [list(g.members) for g in groups] == [[d1, d2]] and alone == [d4]
    await ack_all([d4, d1, d2])
    assert [d.settlement for d in held] == [Settlement.ACK] * 2 + [None, Settlement.ACK, None]
    assert not any(d.lost for d in held)
    await consumer.close()  # d3 and d5, never acked, go back; the acks covered nothing else
    await ack_what_comes_back(rabbitmq_url, unique_name, ["m3", "m5"])


async def test_retry_with_delay_redelivers_later_with_count_plus_one(
    rabbitmq_url: str, unique_name: str, cleanup: list[str]
) -> None:
    inbox = Inbox()
    async with consuming(rabbitmq_url, unique_name, inbox, prefetch=4):
        message_id = await send(rabbitmq_url, unique_name)
        first = await inbox.next()
        assert first.delivery_count == 1
        started = time.monotonic()
        await first.retry(0.3)  # smallest tier >= 0.3 s is 0.5 s
        second = await inbox.next()
        elapsed = time.monotonic() - started
        assert second.message_id == message_id and second.body == b"{}"
        assert second.delivery_count == 2 and not second.redelivered
        assert second.headers[DELIVERIES_HEADER] == 1
        assert 0.4 <= elapsed < 4.5, elapsed
        await second.retry(0)  # immediate retry: a copy straight to the work queue
        third = await inbox.next()
        assert third.delivery_count == 3 and not third.redelivered
        await third.ack()
    assert (await queue_state(rabbitmq_url, f"{unique_name}.retry.500ms"))[0] == 0
    assert (await queue_state(rabbitmq_url, f"{unique_name}.retry.5000ms"))[0] == 0
    assert (await queue_state(rabbitmq_url, unique_name))[0] == 0


async def test_dead_letter_moves_to_dlq_with_reason(
    rabbitmq_url: str, unique_name: str, cleanup: list[str]
) -> None:
    inbox = Inbox()
    async with consuming(rabbitmq_url, unique_name, inbox):
        message_id = await send(rabbitmq_url, unique_name, b'{"bad": true}')
        delivery = await inbox.next()
        await delivery.dead_letter("payload_conflict", "fingerprint differs")
        dead = await receive_raw(rabbitmq_url, f"{unique_name}.dlq")
        assert dead.message_id == message_id and dead.body == b'{"bad": true}'
        assert dead.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
        assert dead.headers[DEAD_LETTER_REASON_HEADER] == "payload_conflict"
        assert dead.headers["x-dead-letter-detail"] == "fingerprint differs"
        assert dead.headers["x-original-queue"] == unique_name
        assert dead.headers[DELIVERIES_HEADER] == 1
    assert (await queue_state(rabbitmq_url, unique_name))[0] == 0


async def test_released_eleven_times_is_never_a_redelivery_nor_dead_lettered(
    rabbitmq_url: str, unique_name: str, cleanup: list[str]
) -> None:
    """eleven graceful restarts each give the delivery back. The work queue here
    has x-delivery-limit=10 (made beforehand; the adapter uses it as it is), so eleven
    nack-requeues would dead-letter it; released copies are never counted by the broker."""
    async with raw_channel(rabbitmq_url) as channel:
        await channel.declare_queue(unique_name, durable=True, arguments={
            "x-queue-type": "quorum", "x-delivery-limit": 10, "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": f"{unique_name}.dlq",
        })
    inbox = Inbox()
    async with consuming(rabbitmq_url, unique_name, inbox):
        message_id = await send(rabbitmq_url, unique_name)
        for _ in range(11):
            delivery = await inbox.next()
            assert delivery.message_id == message_id
            assert (delivery.redelivered, delivery.delivery_count) == (False, 1)
            assert "x-delivery-count" not in delivery.headers
            await delivery.release()
            assert delivery.settlement is Settlement.RELEASED and not delivery.lost
        last = await inbox.next()
        assert (last.message_id, last.redelivered, last.delivery_count) == (message_id, False, 1)
        assert "x-delivery-count" not in last.headers and REDELIVERED_HEADER not in last.headers
        await last.ack()
    assert (await queue_state(rabbitmq_url, f"{unique_name}.dlq"))[0] == 0
    assert (await queue_state(rabbitmq_url, unique_name))[0] == 0


async def test_a_released_suspect_stays_a_suspect_and_keeps_its_count(
    rabbitmq_url: str, unique_name: str, cleanup: list[str]
) -> None:
    inbox = Inbox()
    async with consuming(rabbitmq_url, unique_name, inbox):
        message_id = await send(rabbitmq_url, unique_name)
        first = await inbox.next()
        # A worker that died with it in flight: the broker takes it back itself.
        await first._message.nack(requeue=True)
        suspect = await inbox.next()
        assert (suspect.message_id, suspect.redelivered, suspect.delivery_count) == (message_id, True, 2)
        await suspect.release()
        again = await inbox.next()
        assert (again.message_id, again.redelivered, again.delivery_count) == (message_id, True, 2)
        assert again.headers[REDELIVERED_HEADER] == 1 and "x-delivery-count" not in again.headers
        await again.retry(0)  # a settlement ended that hand-over: no longer a suspect
        retried = await inbox.next()
        assert (retried.redelivered, retried.delivery_count) == (False, 3)
        await retried.ack()


async def test_broker_delivery_limit_dead_letters_a_loop_into_the_dlq(
    rabbitmq_url: str, unique_name: str, cleanup: list[str]
) -> None:
    """The loop guard: a message the broker itself takes back again and again (as dying workers
    would) is dead-lettered by the broker after broker_delivery_limit(...) = 50 redeliveries, and
    the work queue's DLX routes it to <queue>.dlq instead of dropping it."""
    consumer = make_consumer(rabbitmq_url, max_deliveries=1, crash_limit=1)
    await consumer.subscribe(unique_name, Inbox(), prefetch=1)
    await consumer.close()  # the topology stays; the loop below plays the crashing workers
    message_id = await send(rabbitmq_url, unique_name)
    limit = broker_delivery_limit(1, 1)
    deliveries = 0
    async with raw_channel(rabbitmq_url) as channel:
        queue = await channel.declare_queue(unique_name, passive=True)
        while (message := await queue.get(timeout=WAIT, fail=False)) is not None:
            deliveries += 1
            await message.nack(requeue=True)
    assert deliveries == limit + 1
    dead = await receive_raw(rabbitmq_url, f"{unique_name}.dlq")
    assert dead.message_id == message_id
    assert dead.headers["x-death"][0]["reason"] == "delivery_limit"


async def test_settle_on_a_closed_channel_neither_hangs_nor_raises(
    rabbitmq_url: str, unique_name: str, cleanup: list[str]
) -> None:
    inbox = Inbox()
    consumer = make_consumer(rabbitmq_url, settle_timeout=1.0)
    await consumer.subscribe(unique_name, inbox, prefetch=4)
    ids = [await send(rabbitmq_url, unique_name) for _ in range(4)]
    held = [await inbox.next() for _ in ids]
    await consumer.close()  # the deliveries' channel is gone: they go back to the broker
    started = time.monotonic()
    await held[0].ack()
    await held[1].retry(0.5)
    await held[2].dead_letter("invalid", "")
    await held[3].release()
    assert time.monotonic() - started < 4 * 1.0
    assert [d.settlement for d in held] == [
        Settlement.ACK, Settlement.RETRY, Settlement.DEAD_LETTER, Settlement.RELEASED
    ]
    assert all(d.lost for d in held)
    # Nothing was lost: all four come back as redeliveries (a quorum queue counts the lost channel).
    again = Inbox()
    async with consuming(rabbitmq_url, unique_name, again, prefetch=4):
        back = [await again.next() for _ in ids]
        assert sorted(d.message_id for d in back) == sorted(ids)  # type: ignore[type-var]
        assert {(d.delivery_count, d.redelivered) for d in back} == {(2, True)}
        for delivery in back:
            await delivery.ack()
    assert (await queue_state(rabbitmq_url, f"{unique_name}.dlq"))[0] == 0


async def test_callback_error_releases_the_delivery_uncounted(
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
        await send(rabbitmq_url, unique_name)
        delivery = await inbox.next()
        assert (delivery.delivery_count, delivery.redelivered) == (1, False)
        await delivery.ack()
    finally:
        await consumer.close()


# -- consumer: copies that do not fit the frame --------------------------------------------------


async def test_a_dead_letter_copy_drops_foreign_headers_to_fit_the_frame(
    rabbitmq_url: str, unique_name: str, cleanup: list[str]
) -> None:
    limit = await frame_max(rabbitmq_url)
    original = command(unique_name, headers={"operation-id": "op-1"})
    # The original fits with 40 bytes to spare; the dead-letter headers need more than that.
    headers = headers_of_frame_size(original, "x-vendor-trace", limit - 40)
    inbox = Inbox()
    async with consuming(rabbitmq_url, unique_name, inbox, prefetch=2) as consumer:
        message_id = await send(rabbitmq_url, unique_name, headers=headers)
        delivery = await inbox.next()
        await delivery.dead_letter("invalid_body", "d" * 5000)
        assert not delivery.lost
        dead = await receive_raw(rabbitmq_url, f"{unique_name}.dlq")
        assert dead.message_id == message_id
        assert "x-vendor-trace" not in dead.headers and dead.headers[TRIMMED_HEADER] == 1
        assert dead.headers["operation-id"] == "op-1"  # operation headers are never trimmed
        assert dead.headers[DEAD_LETTER_REASON_HEADER] == "invalid_body"
        assert dead.headers["x-dead-letter-detail"] == "d" * 1000  # ours, bounded
        # The channel is fine: the next delivery on it settles.
        await send(rabbitmq_url, unique_name)
        following = await inbox.next()
        await following.ack()
        assert not following.lost and consumer.resubscribes == 0


async def test_a_copy_that_cannot_fit_is_rejected_into_the_dlx_or_requeued_never_looping(
    rabbitmq_url: str, unique_name: str, cleanup: list[str]
) -> None:
    """Kept headers (operation headers) fill the frame: a dead-letter copy cannot fit even
    trimmed, so the original is rejected into the work queue's own dead-letter exchange; a retry
    copy cannot fit either, so it falls back to nack-requeue (lost: a redelivery we caused)."""
    limit = await frame_max(rabbitmq_url)
    original = command(unique_name)
    headers = headers_of_frame_size(original, "correlation-id", limit - 20)
    inbox = Inbox()
    async with consuming(rabbitmq_url, unique_name, inbox) as consumer:
        message_id = await send(rabbitmq_url, unique_name, headers=headers)
        first = await inbox.next()
        await first.retry(0.5)
        assert first.lost and first.settlement is Settlement.RETRY
        again = await inbox.next()
        assert (again.message_id, again.redelivered, again.delivery_count) == (message_id, True, 2)
        await again.dead_letter("payload_conflict", "fingerprint differs")
        assert not again.lost
        dead = await receive_raw(rabbitmq_url, f"{unique_name}.dlq")
        assert dead.message_id == message_id
        assert dead.headers["x-death"][0]["reason"] == "rejected"
        assert DEAD_LETTER_REASON_HEADER not in dead.headers
        # No channel was closed on the way, and nothing loops back.
        await send(rabbitmq_url, unique_name, message_id="after")
        after = await inbox.next()
        assert after.message_id == "after"
        await after.ack()
        assert not after.lost and consumer.resubscribes == 0 and consumer.reconnects == 0
    assert await queue_state(rabbitmq_url, unique_name) == (0, 0)
    assert (await queue_state(rabbitmq_url, f"{unique_name}.retry.500ms"))[0] == 0


# -- consumer: a broker that stops answering, one channel lost, pause -----------------------------


@pytest.mark.parametrize("then", ["resume", "drop"])
async def test_a_settlement_in_a_broker_stall_is_lost_and_the_broker_redelivers(
    rabbitmq_url: str, unique_name: str, cleanup: list[str], then: str
) -> None:
    """the retry copy's confirm never comes, the settlement gives up after
    settle_timeout, marks the delivery lost and abandons its channel; once the broker reads
    again (or the connection drops) the message comes back as a redelivery, while the consumer is
    still connected: it was not left unacked on a live channel."""
    settle_timeout = 1.0
    inbox = Inbox()
    async with proxy_to(rabbitmq_url) as proxy:
        url = via(rabbitmq_url, proxy.port)
        async with consuming(url, unique_name, inbox, settle_timeout=settle_timeout) as consumer:
            message_id = await send(rabbitmq_url, unique_name)
            held = await inbox.next()
            proxy.pause()
            started = time.monotonic()
            await held.retry(0.5)
            elapsed = time.monotonic() - started
            assert held.lost and held.settlement is Settlement.RETRY
            assert settle_timeout <= elapsed < 2 * settle_timeout + 0.5, elapsed
            if then == "drop":
                await proxy.drop()  # the held bytes die with the connection
            proxy.resume()
            seen: list[Delivery] = []
            while not any(d.redelivered for d in seen):
                delivery = await inbox.next()
                seen.append(delivery)
                await delivery.ack()
            assert {d.message_id for d in seen} == {message_id}
            assert consumer.connected
            # one abandoned channel: re-created once alone; one dropped connection: one reconnect
            expected = (1, 0) if then == "resume" else (0, 1)
            assert (consumer.resubscribes, consumer.reconnects) == expected


async def test_one_lost_subscription_is_re_created_alone(
    rabbitmq_url: str, unique_name: str, cleanup: list[str]
) -> None:
    """the broker cancels the consumer of a deleted queue, and another
    subscription's channel is closed; only those are re-created, while a delivery held on the
    other queue still acks on its original channel."""
    a, b = unique_name, unique_name + ".b"
    inbox_a, inbox_b = Inbox(), Inbox()
    consumer = make_consumer(rabbitmq_url)
    await consumer.subscribe(a, inbox_a, prefetch=1)
    await consumer.subscribe(b, inbox_b, prefetch=1)
    publisher = RabbitMQPublisher(rabbitmq_url)
    try:
        await publisher.publish(command(a))
        await publisher.publish(command(b))
        await inbox_a.next()
        held_b = await inbox_b.next()

        async with raw_channel(rabbitmq_url) as channel:
            await channel.queue_delete(a)  # the broker cancels a's consumer
        # a's subscription re-declares its queue and consumes again; until then "no queue".
        await asyncio.wait_for(_publish_until_confirmed(publisher, command(a, "after-delete")), WAIT)
        after_delete = await inbox_a.next()
        assert after_delete.message_id == "after-delete"
        await after_delete.ack()

        await held_b.ack()  # b's channel was never touched
        assert not held_b.lost
        assert (consumer.resubscribes, consumer.reconnects) == (1, 0)

        # Now b's channel goes away (as when a delivery abandons it): only b is re-created.
        held_a = await _next_after_send(publisher, a, inbox_a)
        b_channel = consumer._subscriptions[b].channel
        assert b_channel is not None
        await b_channel.close()

        async def b_re_created() -> bool:
            return consumer.resubscribes == 2

        await wait_for(b_re_created, "b's subscription to be re-created")
        await publisher.publish(command(b, "after-close"))
        assert (await inbox_b.next()).message_id == "after-close"
        await held_a.ack()
        assert not held_a.lost and consumer.reconnects == 0
    finally:
        await publisher.close()
        await consumer.close()
    assert (await queue_state(rabbitmq_url, a))[0] == 0
    assert (await queue_state(rabbitmq_url, b))[0] == 1  # "after-close" was never acked


async def test_pause_hands_out_nothing_in_flight_settles_resume_gets_the_waiting(
    rabbitmq_url: str, unique_name: str, cleanup: list[str]
) -> None:
    inbox = Inbox()
    async with consuming(rabbitmq_url, unique_name, inbox, prefetch=4) as consumer:
        held = await _next_after_send(None, unique_name, inbox, url=rabbitmq_url)
        await consumer.pause()
        await consumer.pause()  # idempotent
        waiting = [await send(rabbitmq_url, unique_name) for _ in range(3)]
        # Broker-side proof: the messages wait on the queue although prefetch has room.
        assert (await queue_state(rabbitmq_url, unique_name))[0] == 3
        await held.ack()  # in flight: settles while paused
        assert not held.lost and inbox.queue.empty() and consumer.ready

        # A quorum queue keeps a cancelled consumer until its deliveries are settled; then none.
        async def no_consumer() -> bool:
            return await queue_state(rabbitmq_url, unique_name) == (3, 0)

        await wait_for(no_consumer, "the queue to show no consumer")
        await consumer.resume()
        await consumer.resume()  # idempotent
        got = [await inbox.next() for _ in waiting]
        assert [d.message_id for d in got] == waiting
        assert all((d.redelivered, d.delivery_count) == (False, 1) for d in got)
        for delivery in got:
            await delivery.ack()

        async def one_consumer_nothing_ready() -> bool:
            return await queue_state(rabbitmq_url, unique_name) == (0, 1)

        await wait_for(one_consumer_nothing_ready, "one consumer again, nothing left")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("rabbitmqctl") is None, reason="needs rabbitmqctl")
async def test_consumers_come_back_after_the_vhost_connections_close(
    rabbitmq_url: str, unique_name: str, cleanup: list[str]
) -> None:
    inbox = Inbox()
    consumer = make_consumer(rabbitmq_url)
    await consumer.subscribe(unique_name, inbox, prefetch=2)
    publisher = RabbitMQPublisher(rabbitmq_url)
    try:
        await publisher.publish(command(unique_name, "before"))
        assert (await inbox.next()).message_id == "before"
        await publisher.publish(command(unique_name, "held"))
        held = await inbox.next()

        closed = await asyncio.to_thread(close_vhost_connections, vhost_of(rabbitmq_url))
        assert closed == 2  # the consumer's and the publisher's (this session's vhost only)
        await held.ack()  # its channel is gone: must return quietly

        # The publisher reconnects on the next publish; the consumer re-creates its consumer.
        await asyncio.wait_for(_publish_until_confirmed(publisher, command(unique_name, "after")), WAIT)
        seen = set()
        while "after" not in seen:
            delivery = await inbox.next(WAIT)
            seen.add(delivery.message_id)
            await delivery.ack()
        assert consumer.reconnects == 1 and consumer.connected
        assert (await queue_state(rabbitmq_url, unique_name))[1] == 1
    finally:
        await publisher.close()
        await consumer.close()
    assert await queue_state(rabbitmq_url, unique_name) == (0, 0)


async def test_startup_warns_about_existing_queue_with_low_delivery_limit(
    rabbitmq_url: str, unique_name: str, cleanup: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    async with raw_channel(rabbitmq_url) as channel:
        await channel.declare_queue(
            unique_name, durable=True, arguments={"x-queue-type": "quorum", "x-delivery-limit": 2}
        )
    inbox = Inbox()
    consumer = make_consumer(rabbitmq_url, max_deliveries=5)
    with caplog.at_level(logging.WARNING, logger="consumer_kit.adapters.rabbitmq"):
        await consumer.subscribe(unique_name, inbox, prefetch=1)
    try:
        assert "x-delivery-limit=2 below max_deliveries=5" in caplog.text
        assert "has no dead-letter settings" in caplog.text
        # ... and the existing queue is used as it is.
        message_id = await send(rabbitmq_url, unique_name)
        delivery = await inbox.next()
        assert delivery.message_id == message_id
        await delivery.ack()
    finally:
        await consumer.close()


async def test_subscribe_raises_connection_error_when_unreachable() -> None:
    consumer = make_consumer("amqp://guest:guest@127.0.0.1:1/", reconnect_timeout=0.5)
    with pytest.raises(ConnectionError):
        await consumer.subscribe("nowhere", Inbox(), prefetch=1)
    await consumer.close()


async def _publish_until_confirmed(publisher: RabbitMQPublisher, message: OutgoingMessage) -> None:
    while True:
        try:
            await publisher.publish(message)
            return
        except PublishError:
            await asyncio.sleep(0.1)  # the queue is not declared yet, or connections are closing


async def _next_after_send(publisher: RabbitMQPublisher | None, queue: str, inbox: Inbox,
                           url: str = "") -> Delivery:
    message = command(queue)
    if publisher is None:
        await send(url, queue, message_id=message.message_id)
    else:
        await publisher.publish(message)
    delivery = await inbox.next()
    assert delivery.message_id == message.message_id
    return delivery


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
        async with raw_channel(rabbitmq_url) as channel:
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
        # Straight to a queue that does not exist: a row error (a queue may appear later).
        with pytest.raises(PublishError) as missing:
            await publisher.publish(command(f"{unique_name}.missing", event_id))
        assert not missing.value.transient and not missing.value.permanent
    finally:
        await publisher.close()


async def test_publisher_refuses_what_breaks_the_frame_or_size_limit_before_sending(
    rabbitmq_url: str, unique_name: str, cleanup: list[str]
) -> None:
    """headers whose frame exceeds the negotiated frame_max (which would close the
    whole connection) and a body over max_message_size are refused, permanently, naming the limit
    and the size; the connection stays up (one connection through the proxy all along). A frame
    of exactly frame_max goes through."""
    limit = await frame_max(rabbitmq_url)
    sender = user_of_url(rabbitmq_url)  # the publisher sends its own user as user_id
    async with raw_channel(rabbitmq_url) as channel:
        await channel.declare_queue(unique_name, durable=True)
    async with proxy_to(rabbitmq_url) as proxy:
        publisher = RabbitMQPublisher(via(rabbitmq_url, proxy.port), max_message_size=1000)
        try:
            await publisher.publish(command(unique_name, "first"))
            exact = command(unique_name, "exact")
            exact = OutgoingMessage(**{**exact.__dict__, "headers": headers_of_frame_size(exact, "pad", limit, user_id=sender)})
            await publisher.publish(exact)

            over = command(unique_name, "over")
            over = OutgoingMessage(**{**over.__dict__, "headers": headers_of_frame_size(over, "pad", limit + 1, user_id=sender)})
            with pytest.raises(PublishError) as too_large:
                await publisher.publish(over)
            assert too_large.value.permanent
            assert f"{limit + 1}-byte frame" in str(too_large.value)
            assert f"frame_max is {limit} bytes" in str(too_large.value)

            with pytest.raises(PublishError) as too_long:
                await publisher.publish(command(unique_name, "long", body=b"x" * 1001))
            assert too_long.value.permanent
            assert "1001 bytes" in str(too_long.value) and "1000 bytes" in str(too_long.value)

            await publisher.publish(command(unique_name, "last"))
            assert proxy.accepted == 1
        finally:
            await publisher.close()
    received = [(await receive_raw(rabbitmq_url, unique_name)).message_id for _ in range(3)]
    assert received == ["first", "exact", "last"]
    assert (await queue_state(rabbitmq_url, unique_name))[0] == 0


async def test_publisher_refused_declaration_is_permanent_and_leaves_other_publishes_alone(
    rabbitmq_url: str, unique_name: str, cleanup: list[str]
) -> None:
    """a destination that exists as a direct exchange is refused
    on its own declaration channel, with the broker's reply text; publishes in flight on the
    publishing channel at the same time all get their confirms."""
    healthy, wrong = f"{unique_name}.events", f"{unique_name}.direct"
    cleanup.extend([healthy, wrong])
    async with raw_channel(rabbitmq_url) as channel:
        await channel.declare_exchange(wrong, aio_pika.ExchangeType.DIRECT, durable=True)
        tap = await channel.declare_queue(f"{unique_name}.bound", durable=True)
        await channel.declare_exchange(healthy, aio_pika.ExchangeType.TOPIC, durable=True)
        await tap.bind(healthy, routing_key="#")
    publisher = RabbitMQPublisher(rabbitmq_url)
    try:
        await publisher.publish(OutgoingMessage(healthy, "k", "warm-up", b"{}", "E"))
        good = [OutgoingMessage(healthy, "k", f"good-{i}", b"{}", "E") for i in range(30)]
        bad = OutgoingMessage(wrong, "k", "bad", b"{}", "E")
        results = await asyncio.gather(*(publisher.publish(m) for m in [*good[:15], bad, *good[15:]]),
                                       return_exceptions=True)
        refused = results[15]
        assert isinstance(refused, PublishError) and refused.permanent
        assert "PRECONDITION_FAILED" in str(refused) and "inequivalent arg 'type'" in str(refused)
        assert [r for i, r in enumerate(results) if i != 15] == [None] * 30
    finally:
        await publisher.close()
    assert (await queue_state(rabbitmq_url, f"{unique_name}.bound"))[0] == 31


async def test_publisher_isolates_a_destination_that_closed_the_publishing_channel(
    rabbitmq_url: str, unique_name: str, cleanup: list[str]
) -> None:
    """An exchange deleted behind the publisher's cache: the publish closes the shared publishing
    channel (404), which cannot be pinned on one message, so it is transient; the next publish to
    that destination runs alone, declares the exchange again and goes through."""
    exchange = f"{unique_name}.events"
    cleanup.append(exchange)
    publisher = RabbitMQPublisher(rabbitmq_url)
    try:
        await publisher.publish(OutgoingMessage(exchange, "k", "one", b"{}", "E"))
        async with raw_channel(rabbitmq_url) as channel:
            await channel.exchange_delete(exchange)
        with pytest.raises(PublishError) as closed:
            await publisher.publish(OutgoingMessage(exchange, "k", "two", b"{}", "E"))
        assert closed.value.transient and "NOT_FOUND" in str(closed.value)
        await publisher.publish(OutgoingMessage(exchange, "k", "three", b"{}", "E"))
        await publisher.publish(OutgoingMessage(exchange, "k", "four", b"{}", "E"))  # shared again
    finally:
        await publisher.close()
    async with raw_channel(rabbitmq_url) as channel:
        await channel.declare_exchange(exchange, aio_pika.ExchangeType.TOPIC, durable=True, passive=True)


async def test_publisher_raises_publish_error_when_broker_unreachable() -> None:
    publisher = RabbitMQPublisher("amqp://guest:guest@127.0.0.1:1/", confirm_timeout=2.0)
    with pytest.raises(PublishError) as unreachable:
        await publisher.publish(OutgoingMessage("x", "", "1", b"", "t"))
    assert unreachable.value.transient
    await publisher.close()

