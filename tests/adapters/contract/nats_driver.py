"""NATS JetStream in the contract suite: one work-queue stream, its dead-letter stream and durable
consumer per case (names unique per test), deleted afterwards."""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlencode

import pytest
from nats.js.errors import NotFoundError

from consumer_kit.adapters.nats import (
    DEAD_LETTER_DETAIL_HEADER,
    DEAD_LETTER_REASON_HEADER,
    NATSConfig,
    NATSConnection,
    NATSConsumer,
    NATSDelivery,
    NATSPublisher,
    headers_of,
    stream_name,
)
from consumer_kit.adapters.nats.limits import size_of
from consumer_kit.broker import Consumer, Delivery, DeliveryCallback
from consumer_kit.broker.publishing import OutgoingMessage, Publisher
from consumer_kit.settings import Settings
from tests.adapters.contract.driver import DeadLetter, Driver, as_text

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


@pytest.fixture(scope="session")
def nats_url() -> str:
    """``CONSUMER_KIT_TEST_NATS_URL`` (default ``nats://127.0.0.1:4222``, JetStream on): fails with
    ``CONSUMER_KIT_REQUIRE_SERVICES=1`` when it does not answer, else skips."""
    url = os.environ.get("CONSUMER_KIT_TEST_NATS_URL", DEFAULT_NATS_URL)
    host, _, port = url.split("://", 1)[-1].rsplit("@", 1)[-1].partition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port or 4222)), 2):
            return url
    except OSError:
        message = (f"NATS does not answer at {host}:{port or 4222}: start nats-server -js (see .ci/run) "
                   "or set CONSUMER_KIT_TEST_NATS_URL")
        if os.environ.get("CONSUMER_KIT_REQUIRE_SERVICES") == "1":
            pytest.fail(message)
        pytest.skip(message)


class TrackingConsumer(NATSConsumer):
    """A NATS consumer that keeps the deliveries it hands out, so that the driver can make their
    locks lapse."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.deliveries: list[NATSDelivery] = []

    async def subscribe(self, queue: str, callback: DeliveryCallback, *, prefetch: int) -> None:
        async def keeping(delivery: Delivery) -> None:
            assert isinstance(delivery, NATSDelivery)
            self.deliveries.append(delivery)
            await callback(delivery)

        await super().subscribe(queue, keeping, prefetch=prefetch)


class NATSDriver(Driver):
    name = "nats"
    lock_seconds = 3.0  # ack_wait of short_lock consumers; the heartbeat renews at half of it

    def __init__(self, queue: str, url: str) -> None:
        super().__init__(queue)
        self.base_url = url
        self.url = url
        self.connection = NATSConnection(NATSConfig.from_url(url))
        self.publisher = NATSPublisher(NATSConfig.from_url(url), connection=self.connection)
        self.stream = stream_name(queue)
        self._streams = [self.stream, f"{self.stream}_dlq"]

    async def consumer(
        self, settings: Settings, *, short_lock: bool = False, renewal: bool = True, copy_limit: int | None = None
    ) -> Consumer:
        options: dict[str, str] = {"fetch_wait": "1"}
        if short_lock:
            options["ack_wait"] = str(self.lock_seconds)
        if not renewal:
            options["heartbeat"] = "off"
        config = NATSConfig.from_url(f"{self.base_url}?{urlencode(options)}")
        consumer = TrackingConsumer(
            config, max_deliveries=settings.max_deliveries, crash_limit=settings.crash_limit,
            settle_timeout=settings.settle_timeout, handler_timeout=settings.handler_timeout,
        )
        await consumer.declare(self.queue)
        if copy_limit is not None:
            js = await self.connection.jetstream()
            for name in self._streams:
                info = await js.stream_info(name)
                info.config.max_msg_size = copy_limit
                await js.update_stream(info.config)
        return consumer

    async def lapse_locks(self, consumer: Consumer) -> None:
        """Each unsettled delivery whose lock still holds lapses on both sides: the adapter's clock
        (``locked_until``) and JetStream's (a ``nak`` sent past the adapter: JetStream hands the
        message out again at once, counted, as after a lapsed ``ack_wait``)."""
        assert isinstance(consumer, TrackingConsumer)
        for delivery in consumer.deliveries:
            if delivery.settlement is None and delivery.holds_lock:
                delivery.locked_until = time.monotonic()
                await delivery.msg.nak()
                await delivery.msg._client.flush()

    async def send(self, body: bytes, headers: dict[str, str] | None = None, message_id: str | None = None) -> str:
        message_id = message_id or str(uuid.uuid4())
        await self.publisher.publish(OutgoingMessage("", self.queue, message_id, body, "CreateInvoice", headers or {}))
        return message_id

    async def dead_letters(self, expected: int, timeout: float = 15.0) -> list[DeadLetter]:
        js = await self.connection.jetstream()
        found: list[DeadLetter] = []
        deadline = time.monotonic() + timeout
        seq = 1
        while len(found) < expected:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(found)} of {expected} dead letters after {timeout} s")
            try:
                raw = await js.get_msg(f"{self.stream}_dlq", seq=seq)
            except NotFoundError:
                info = await js.stream_info(f"{self.stream}_dlq")
                if seq > int(info.state.last_seq or 0):
                    await _pause()
                elif not await _stored(js, f"{self.stream}_dlq", seq):
                    seq += 1  # deleted (asked again: it may have been stored since the first get)
                continue
            seq += 1
            await js.delete_msg(f"{self.stream}_dlq", int(raw.seq or 0))
            headers = headers_of(raw.headers)
            found.append(DeadLetter(
                message_id=as_text(headers.get("x-consumer-kit-message-id")) or as_text(headers.get("Nats-Msg-Id")),
                body=raw.data or b"",
                reason=as_text(headers.get(DEAD_LETTER_REASON_HEADER)),
                detail=as_text(headers.get(DEAD_LETTER_DETAIL_HEADER)),
                copied=DEAD_LETTER_REASON_HEADER in headers,
                size=size_of(raw.data or b"", {str(k): str(v) for k, v in (raw.headers or {}).items()}),
            ))
        return found

    async def depth(self) -> int:
        return await self.depth_of(self.stream)

    async def depth_of(self, stream: str) -> int:
        js = await self.connection.jetstream()
        return int((await js.stream_info(stream)).state.messages)

    async def size_limited(self, limit: int) -> tuple[Publisher, str, Callable[[], Awaitable[int]]]:
        subject = f"{self.queue}-small"
        name = stream_name(subject)
        js = await self.connection.jetstream()
        await js.add_stream(name=name, subjects=[subject], max_msg_size=limit)
        self._streams.append(name)
        return NATSPublisher(NATSConfig.from_url(self.url)), subject, lambda: self.depth_of(name)

    async def close(self) -> None:
        js = await self.connection.jetstream()
        for name in self._streams:
            try:
                await js.delete_stream(name)
            except NotFoundError:
                pass
        await self.connection.close()


async def _stored(js: Any, stream: str, seq: int) -> bool:
    try:
        await js.get_msg(stream, seq=seq)
    except NotFoundError:
        return False
    return True


async def _pause() -> None:
    await asyncio.sleep(0.05)  # polling the stream for the next dead letter (bounded by the deadline)
