"""Azure Service Bus in the contract suite: the local test server (``tests/adapters/servicebus/server``, one
per session) through the real azure-servicebus SDK, one queue per case.

What the broker-side reads mean here: a dead letter is the original moved by Service Bus with
consumer-kit's reason and description (``copied`` is ``True`` when the reason is consumer-kit's,
not one of Service Bus's own like ``MaxDeliveryCountExceeded``); its ``size`` is the message as
the dead-letter queue stores it, properties included. The depth counts held, locked, deferred and
scheduled messages (a delayed retry is a scheduled copy).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable

from azure.servicebus import ServiceBusSubQueue
from azure.servicebus.aio import ServiceBusClient

from consumer_kit.adapters.servicebus import (
    ORIGINAL_MESSAGE_ID_PROPERTY,
    Namespace,
    ServiceBusConsumer,
    ServiceBusDeadLetters,
    ServiceBusPublisher,
)
from consumer_kit.broker import Consumer, DeadLetterQueues
from consumer_kit.broker.publishing import OutgoingMessage, Publisher
from consumer_kit.settings import Settings
from tests.adapters.contract.driver import DeadLetter, Driver, as_text
from tests.adapters.servicebus.server import Queue, ServiceBusTestServer

SERVICE_BUS_REASONS = {"MaxDeliveryCountExceeded", "TTLExpiredException"}
LONG_LOCK = 30.0  # seconds: the lock of consumers without short_lock
DEFAULT_SIZE = 256 * 1024  # bytes: Service Bus standard tier


class ServiceBusDriver(Driver):
    name = "servicebus"
    # Service Bus's shortest lock (the test server refuses less); the adapter renews at half the
    # time left, so each renewal has 2.5 s for its round trip
    lock_seconds = 5.0

    def __init__(self, queue: str, server: ServiceBusTestServer) -> None:
        super().__init__(queue)
        self.server = server
        self.url = "servicebus://"
        self.namespace = Namespace.from_connection_string(server.connection_string)
        self.publisher = ServiceBusPublisher(self.namespace, confirm_timeout=10.0)
        self.entity: Queue | None = None

    async def open(self) -> None:
        self.entity = self.server.create_queue(self.queue, lock_duration=LONG_LOCK, max_delivery_count=50)

    async def consumer(
        self, settings: Settings, *, short_lock: bool = False, renewal: bool = True, copy_limit: int | None = None
    ) -> Consumer:
        assert self.entity is not None
        self.entity.configure(
            lock_duration=self.lock_seconds if short_lock else LONG_LOCK,
            max_message_size=copy_limit or DEFAULT_SIZE,
        )
        return ServiceBusConsumer(
            self.namespace, settle_timeout=settings.settle_timeout, receive_wait=0.2, renew_locks=renewal
        )

    async def lapse_locks(self, consumer: Consumer) -> None:
        """The server drops every lock (a settlement with one is refused from now on) and gives
        the messages back, counted, as when their time runs out."""
        assert self.entity is not None
        entity = self.entity
        locked = {m.sequence_number: m.delivery_count for m in entity.messages if m.locked}
        entity.expire_all_locks(time.time())

        def given_back() -> bool:
            counts = {m.sequence_number: m.delivery_count for m in entity.messages}
            return all(counts.get(n, count + 1) > count for n, count in locked.items())

        async with asyncio.timeout(10):
            while not given_back():
                await asyncio.sleep(0.02)  # polling the server's state: its next tick gives them back

    async def send(self, body: bytes, headers: dict[str, str] | None = None, message_id: str | None = None) -> str:
        message_id = message_id or str(uuid.uuid4())
        await self.publisher.publish(
            OutgoingMessage("", self.queue, message_id, body, "CreateInvoice", headers or {})
        )
        return message_id

    async def dead_letters(self, expected: int, timeout: float = 15.0) -> list[DeadLetter]:
        """Received (and completed) from the dead-letter sub-queue through the SDK."""
        assert self.entity is not None
        sizes = {m.sequence_number: m.size for m in self.entity.dead_letters}
        found: list[DeadLetter] = []
        client = ServiceBusClient.from_connection_string(self.server.connection_string, retry_total=0)
        try:
            async with asyncio.timeout(timeout), client.get_queue_receiver(
                self.queue, sub_queue=ServiceBusSubQueue.DEAD_LETTER, prefetch_count=expected,
                keep_alive=0, socket_timeout=0.05,
            ) as receiver:
                while len(found) < expected:
                    for message in await receiver.receive_messages(max_message_count=expected, max_wait_time=1):
                        await receiver.complete_message(message)
                        properties = {as_text(k): v for k, v in (message.application_properties or {}).items()}
                        reason = as_text(message.dead_letter_reason)
                        found.append(DeadLetter(
                            message_id=as_text(properties.get(ORIGINAL_MESSAGE_ID_PROPERTY)) or message.message_id,
                            body=b"".join(message.body), reason=reason,
                            detail=as_text(message.dead_letter_error_description),
                            copied=reason not in SERVICE_BUS_REASONS,
                            size=sizes.get(message.sequence_number or 0, 0),
                        ))
        finally:
            async with asyncio.timeout(10):
                await client.close()
        return found[:expected]

    def dead_letter_queues(self, settings: Settings) -> DeadLetterQueues:
        """The adapter's dead-letter queues on this server (the broker URL ``servicebus://`` names
        no namespace by itself: the connection string does)."""
        return ServiceBusDeadLetters(self.namespace, receive_wait=0.5)

    async def depth(self) -> int:
        assert self.entity is not None
        return len(self.entity.messages) + self.entity.scheduled_count

    async def size_limited(self, limit: int) -> tuple[Publisher, str, Callable[[], Awaitable[int]]]:
        name = f"{self.queue}-small"
        small = self.server.create_queue(name, max_message_size=limit)

        async def count() -> int:
            return len(small.messages)

        return ServiceBusPublisher(self.namespace, confirm_timeout=10.0), name, count

    async def close(self) -> None:
        await self.publisher.close()
