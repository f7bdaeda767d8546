"""Helpers for tests of the Service Bus adapter against the local test server.

The fixtures ``sb_server`` and ``sb`` are registered once, in tests/conftest.py: a test takes them
by name, and a module imports from here only the helpers it uses (:class:`SBEnv`, :class:`Received`,
:func:`eventually`, :func:`outgoing_event`). This module (and with it the azure-servicebus SDK) is
imported only by runs that collect such a module or ask for a fixture.
``sb_server`` is one :class:`ServiceBusTestServer` for the session; ``sb`` gives each test an
:class:`SBEnv` (:func:`sb_env`): the session's server, a unique queue name and a topic name beside
it, an SDK client for sending and reading dead letters (every call bounded: the SDK hangs instead of
failing against a server that answers wrongly), and consumers, publishers and dead-letter readers of
the adapter that are closed after the test.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from azure.servicebus import ServiceBusMessage, ServiceBusReceivedMessage, ServiceBusSubQueue
from azure.servicebus.aio import ServiceBusClient, ServiceBusReceiver, ServiceBusSender

from consumer_kit.adapters.servicebus import (
    Namespace,
    ServiceBusConsumer,
    ServiceBusDeadLetters,
    ServiceBusDelivery,
    ServiceBusPublisher,
)
from consumer_kit.broker.publishing import OutgoingMessage
from tests.adapters.servicebus.server import Queue, ServiceBusTestServer, Topic

SDK_CALL_TIMEOUT = 10.0  # seconds any direct SDK call of a test may take


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
        self.topic = self.queue + "-topic"  # made by create_topic or the first create_subscription
        self._topic_made = False
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

    def create_topic(self, **options: Any) -> Topic:
        """Create the test's topic ``self.topic`` (``options``: ``EntityOptions`` fields)."""
        self._topic_made = True
        return self.server.create_topic(self.topic, **options)

    def create_subscription(self, name: str, **options: Any) -> Queue:
        """Create subscription ``name`` of the test's topic (the topic too, if not made yet); its
        ``path`` is ``<topic>/Subscriptions/<name>``. ``options``: ``rules=`` and ``EntityOptions``
        fields, as ``server.create_subscription``."""
        if not self._topic_made:
            self.create_topic()
        return self.server.create_subscription(self.topic, name, **options)

    def entity(self, path: str | None = None) -> Any:
        return self.server.entity(path or self.queue)

    def consumer(self, **options: Any) -> ServiceBusConsumer:
        options.setdefault("settle_timeout", 3.0)
        options.setdefault("receive_wait", 0.2)
        options.setdefault("connect_timeout", 10.0)
        consumer = ServiceBusConsumer(self.namespace, **options)
        self._closing.append(consumer)
        return consumer

    async def subscribe(
        self,
        callback: Callable[[ServiceBusDelivery], Awaitable[None]],
        path: str | None = None,
        *,
        prefetch: int,
        **options: Any,
    ) -> ServiceBusConsumer:
        """A new consumer (``options`` as :meth:`consumer`) subscribed to ``path`` (default: the
        test's queue), handing each delivery to ``callback`` (a :class:`Received`, say)."""
        consumer = self.consumer(**options)
        await consumer.subscribe(path or self.queue, callback, prefetch=prefetch)
        return consumer

    def publisher(self, **options: Any) -> ServiceBusPublisher:
        options.setdefault("confirm_timeout", 5.0)
        publisher = ServiceBusPublisher(self.namespace, **options)
        self._closing.append(publisher)
        return publisher

    def dead_letter_reader(self, **options: Any) -> ServiceBusDeadLetters:
        """The adapter's dead-letter browser (what ``consumer-kit dlq`` uses), closed after the test."""
        letters = ServiceBusDeadLetters(self.namespace, **options)
        self._closing.append(letters)
        return letters

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

    async def receive_and_dead_letter(
        self, count: int, path: str | None = None, *, reason: str, description: str | None = None,
        **options: Any,
    ) -> None:
        """Receive ``count`` messages of ``path`` (default: the test's queue) through the SDK and
        dead-letter each with ``reason`` and ``description``, as a worker does; ``options`` go to
        the receiver (``session_id=``)."""
        async with (
            asyncio.timeout(SDK_CALL_TIMEOUT + count),
            self.receiver(path or self.queue, prefetch=count, **options) as receiver,
        ):
            done = 0
            while done < count:
                batch = await receiver.receive_messages(max_message_count=count - done, max_wait_time=2)
                for message in batch:  # one at a time: the SDK needs its settlements in order
                    await receiver.dead_letter_message(message, reason=reason, error_description=description)
                    done += 1

    async def close(self) -> None:
        for closing in [*self._senders.values(), *reversed(self._closing)]:
            async with asyncio.timeout(30):
                await closing.close()
        if self._clock_advanced:
            self.server.skew_clock(0.0)


@asynccontextmanager
async def sb_env(server: ServiceBusTestServer) -> AsyncIterator[SBEnv]:
    """One test's :class:`SBEnv` on ``server`` (the ``sb`` fixture), closed with what it opened."""
    client = ServiceBusClient.from_connection_string(server.connection_string, retry_total=0)
    env = SBEnv(server, client)
    try:
        yield env
    finally:
        await env.close()
        async with asyncio.timeout(10):
            await client.close()


def outgoing_event(
    n: int,
    destination: str,
    *,
    partition_key: str | None = None,
    body: bytes = b'{"n": 1}',
    routing_key: str = "invoice.created",
    message_type: str = "InvoiceCreated",
    headers: dict[str, str] | None = None,
) -> OutgoingMessage:
    """Outbox event number ``n`` as the relay hands it to a publisher (event ID
    ``00000000-0000-4000-8000-<n, 12 digits>``)."""
    return OutgoingMessage(
        destination=destination,
        routing_key=routing_key,
        message_id=f"00000000-0000-4000-8000-{n:012d}",
        body=body,
        message_type=message_type,
        headers=headers or {},
        partition_key=partition_key,
    )


async def eventually(condition: Callable[[], bool], *, within: float, what: str) -> None:
    """Poll server-side state until ``condition`` holds; fails after ``within`` seconds."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within} s waiting for {what}")
        await asyncio.sleep(0.02)
