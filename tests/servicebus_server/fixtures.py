"""Fixtures and helpers for tests of the Service Bus adapter against the local test server.

Import the fixtures into a test module (``from tests.servicebus_server.fixtures import sb_fixture,
sb_server_fixture``); they are named ``sb`` and ``sb_server``.
``sb`` gives each test an :class:`SBEnv`: the session's server, a unique queue name, an SDK client
for sending and reading dead letters (every call bounded: the SDK hangs instead of failing against
a server that answers wrongly), and consumers and publishers of the adapter that are closed after
the test.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from azure.servicebus import ServiceBusMessage, ServiceBusReceivedMessage, ServiceBusSubQueue
from azure.servicebus.aio import ServiceBusClient, ServiceBusReceiver, ServiceBusSender

from consumer_kit.adapters.servicebus import (
    Namespace,
    ServiceBusConsumer,
    ServiceBusDelivery,
    ServiceBusPublisher,
)
from tests.servicebus_server import Queue, ServiceBusTestServer

SDK_CALL_TIMEOUT = 10.0  # seconds any direct SDK call of a test may take


@pytest.fixture(scope="session", name="sb_server")
def sb_server_fixture() -> Iterator[ServiceBusTestServer]:
    """One local Service Bus test server for the whole test session (entities are per test)."""
    with ServiceBusTestServer() as server:
        yield server


class Received:
    """Deliveries a test consumer's callback saw, with a settle policy per delivery."""

    def __init__(self, settle: Callable[[ServiceBusDelivery], Any] | None = None) -> None:
        self.deliveries: list[ServiceBusDelivery] = []
        self._arrived: asyncio.Queue[ServiceBusDelivery] = asyncio.Queue()
        self._settle = settle

    async def __call__(self, delivery: Any) -> None:
        self.deliveries.append(delivery)
        self._arrived.put_nowait(delivery)
        if self._settle is not None:
            outcome = self._settle(delivery)
            if asyncio.iscoroutine(outcome):
                await outcome

    async def next(self, timeout: float = 10.0) -> ServiceBusDelivery:
        return await asyncio.wait_for(self._arrived.get(), timeout)

    async def take(self, count: int, timeout: float = 15.0) -> list[ServiceBusDelivery]:
        return [await self.next(timeout) for _ in range(count)]


class SBEnv:
    """One test's view of the session's server."""

    def __init__(self, server: ServiceBusTestServer, client: ServiceBusClient) -> None:
        self.server = server
        self.client = client
        self.namespace = Namespace.from_connection_string(server.connection_string)
        self.queue = "q" + uuid.uuid4().hex[:10]
        self._closing: list[Any] = []
        self._senders: dict[str, ServiceBusSender] = {}
        self._clock_advanced = 0.0  # seconds advance_broker_clock moved the broker's clock

    def advance_broker_clock(self, seconds: float) -> None:
        """Move the broker's clock ``seconds`` ahead (undone after the test): every lock held, not
        renewed meanwhile, lapses as if that time had passed, without waiting for it. Only the
        broker's time moves: the adapter's own timers (renewal, held retries) run on real time."""
        self._clock_advanced += seconds
        self.server.skew_clock(self._clock_advanced)

    def create_queue(self, name: str | None = None, **options: Any) -> Queue:
        return self.server.create_queue(name or self.queue, **options)

    def entity(self, path: str | None = None) -> Any:
        return self.server.entity(path or self.queue)

    def consumer(self, **options: Any) -> ServiceBusConsumer:
        options.setdefault("settle_timeout", 3.0)
        options.setdefault("receive_wait", 0.2)
        options.setdefault("connect_timeout", 10.0)
        consumer = ServiceBusConsumer(self.namespace, **options)
        self._closing.append(consumer)
        return consumer

    def publisher(self, **options: Any) -> ServiceBusPublisher:
        options.setdefault("confirm_timeout", 5.0)
        publisher = ServiceBusPublisher(self.namespace, **options)
        self._closing.append(publisher)
        return publisher

    async def send(self, *messages: ServiceBusMessage, entity: str | None = None) -> None:
        """Send ``messages`` to ``entity`` (default: the test's queue) in one call (one sender per
        entity, kept open for the test: opening one costs a connection set-up)."""
        name = entity or self.queue
        async with asyncio.timeout(SDK_CALL_TIMEOUT):
            sender = self._senders.get(name)
            if sender is None:
                sender = self._senders[name] = self.client.get_queue_sender(name, keep_alive=0)
            await sender.send_messages(messages[0] if len(messages) == 1 else list(messages))

    async def send_bodies(self, *bodies: bytes, entity: str | None = None, **fields: Any) -> list[str]:
        """Send one message per body (message ids returned)."""
        ids = [str(uuid.uuid4()) for _ in bodies]
        await self.send(*(ServiceBusMessage(b, message_id=i, **fields) for b, i in zip(bodies, ids, strict=True)),
                        entity=entity)
        return ids

    def receiver(self, path: str, *, prefetch: int = 1, **options: Any) -> ServiceBusReceiver:
        """An SDK receiver for a queue or ``topic/Subscriptions/name`` (closes quickly: prefetch > 0)."""
        options.update(prefetch_count=prefetch, keep_alive=0, socket_timeout=0.05)
        if "/" in path:
            topic, _, subscription = path.split("/")
            return self.client.get_subscription_receiver(topic, subscription, **options)
        return self.client.get_queue_receiver(path, **options)

    async def peek(self, path: str, count: int) -> list[ServiceBusReceivedMessage]:
        """The first ``count`` messages of ``path``, not locked (SDK ``peek_messages``)."""
        async with asyncio.timeout(SDK_CALL_TIMEOUT), self.receiver(path) as receiver:
            return await receiver.peek_messages(max_message_count=count)

    async def dead_letters(self, count: int, entity: str | None = None) -> list[ServiceBusReceivedMessage]:
        """Receive and complete ``count`` messages from the entity's dead-letter sub-queue (SDK)."""
        path = entity or self.queue
        found: list[ServiceBusReceivedMessage] = []
        async with asyncio.timeout(SDK_CALL_TIMEOUT + count):
            receiver = self.receiver(path, prefetch=count, sub_queue=ServiceBusSubQueue.DEAD_LETTER)
            async with receiver:
                while len(found) < count:
                    batch = await receiver.receive_messages(max_message_count=count - len(found), max_wait_time=2)
                    for message in batch:
                        await receiver.complete_message(message)
                    found.extend(batch)
        return found

    async def close(self) -> None:
        for closing in [*self._senders.values(), *reversed(self._closing)]:
            async with asyncio.timeout(30):
                await closing.close()
        if self._clock_advanced:
            self.server.skew_clock(0.0)


@pytest.fixture(name="sb")
async def sb_fixture(sb_server: ServiceBusTestServer) -> AsyncIterator[SBEnv]:
    client = ServiceBusClient.from_connection_string(sb_server.connection_string, retry_total=0)
    env = SBEnv(sb_server, client)
    try:
        yield env
    finally:
        await env.close()
        async with asyncio.timeout(10):
            await client.close()


async def eventually(condition: Callable[[], bool], *, within: float, what: str) -> None:
    """Poll server-side state until ``condition`` holds; fails after ``within`` seconds."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within} s waiting for {what}")
        await asyncio.sleep(0.02)
