"""The broker contract: what the runtime needs from any queue, and what the relay needs to publish.

Adapters (``adapters.memory``, ``adapters.rabbitmq``, ...) implement these classes; the core never
imports a broker SDK. Words follow DESIGN.md: a *delivery* is one hand-over of a message under
*peek-lock*; it ends when it is *settled* by exactly one of ``ack``, ``retry`` or ``dead_letter``.
"""

from __future__ import annotations

import abc
import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("consumer_kit.broker")


class Settlement(enum.StrEnum):
    """How a delivery was finished."""

    ACK = "ack"
    RETRY = "retry"
    DEAD_LETTER = "dead_letter"
    RELEASED = "released"  # given back unsettled (shutdown or crash): the broker redelivers it


class Delivery(abc.ABC):
    """One delivery of one message, held under peek-lock until settled.

    Attributes:
        queue: the queue (or subscription) it came from.
        message_id: the broker message id, ``None`` where the producer set none.
        headers: application headers / properties, as the broker gave them (values may be any type).
        body: the raw message body (bytes).
        delivery_count: 1 on the first delivery, 2 on the first redelivery, ... (source per broker:
            RabbitMQ ``x-delivery-count``, SQS ``ApproximateReceiveCount``, Service Bus ``delivery_count``).

    Settling twice is a programming error on our side and is ignored with a warning, never raised:
    the first settlement wins. Adapters implement the ``_ack``/``_retry``/``_dead_letter`` hooks;
    a hook must not hang when the connection is gone (the delivery then simply comes back).
    """

    def __init__(
        self,
        *,
        queue: str,
        message_id: str | None,
        headers: Mapping[str, Any],
        body: bytes,
        delivery_count: int,
    ) -> None:
        self.queue = queue
        self.message_id = message_id
        self.headers = headers
        self.body = body
        self.delivery_count = delivery_count
        self.settlement: Settlement | None = None

    async def ack(self) -> None:
        """Finish the delivery successfully: the broker forgets the message."""
        if self._claim_settlement(Settlement.ACK):
            await self._ack()

    async def retry(self, delay: float = 0.0, *, count: bool = True) -> None:
        """Give the message back to be delivered again after ``delay`` seconds (>= 0).

        ``count=False`` asks the adapter not to count this delivery towards the next delivery
        count, where the broker lets it (RabbitMQ and memory: yes; SQS and Service Bus count every
        receive themselves): the runtime uses it for ``in_progress``, which is not a failure, so
        waiting behind a long-running duplicate does not use up ``max_deliveries``."""
        if self._claim_settlement(Settlement.RETRY):
            await self._retry(max(0.0, delay), count)

    async def dead_letter(self, reason: str, detail: str = "") -> None:
        """Move the message to the dead-letter queue with a machine-readable ``reason`` code and a
        human-readable ``detail`` (no payload content)."""
        if self._claim_settlement(Settlement.DEAD_LETTER):
            await self._dead_letter(reason, detail)

    async def release(self) -> None:
        """Give the delivery back unsettled (shutdown): the broker redelivers it. Not counted as a
        retry by consumer-kit; brokers may count it as a delivery."""
        if self._claim_settlement(Settlement.RELEASED):
            await self._release()

    def _claim_settlement(self, how: Settlement) -> bool:
        if self.settlement is not None:
            logger.warning(
                "delivery already settled as %s; ignoring %s (queue=%s message_id=%s)",
                self.settlement.value, how.value, self.queue, self.message_id,
            )
            return False
        self.settlement = how
        return True

    @abc.abstractmethod
    async def _ack(self) -> None: ...

    @abc.abstractmethod
    async def _retry(self, delay: float, count: bool) -> None: ...

    @abc.abstractmethod
    async def _dead_letter(self, reason: str, detail: str) -> None: ...

    @abc.abstractmethod
    async def _release(self) -> None: ...


DeliveryCallback = Callable[[Delivery], Awaitable[None]]


class Consumer(abc.ABC):
    """The consuming side of a broker.

    ``subscribe`` registers a callback for a queue; ``start`` begins delivering. The adapter calls
    the callback once per delivery with at most ``prefetch`` deliveries of that queue in flight
    (RabbitMQ: basic.qos prefetch; memory: a semaphore). The callback always settles the delivery.
    """

    @abc.abstractmethod
    async def subscribe(self, queue: str, callback: DeliveryCallback, *, prefetch: int) -> None:
        """Declare what the queue needs (DLQ, retry queues) and register ``callback`` for it."""

    @abc.abstractmethod
    async def stop_consuming(self) -> None:
        """Stop taking new deliveries; in-flight deliveries can still be settled."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Close connections. Unsettled deliveries go back to the broker."""


@dataclass(frozen=True)
class OutgoingMessage:
    """A message for the relay to publish.

    Attributes:
        destination: the outbox destination name (RabbitMQ: a topic exchange of that name).
        routing_key: the routing key within the destination ("" where unused).
        message_id: the stable event ID (a UUID string): the broker message id on every attempt.
        body: serialised payload (bytes, JSON).
        message_type: the event type name, also sent as header ``message-type``.
        headers: application headers (str values).
        partition_key: ordering key, where the broker has one (SQS FIFO group, Service Bus session).
    """

    destination: str
    routing_key: str
    message_id: str
    body: bytes
    message_type: str
    headers: Mapping[str, str] = field(default_factory=dict)
    partition_key: str | None = None
    content_type: str = "application/json"


class PublishError(Exception):
    """The broker did not confirm a publish (nack, return, timeout or lost connection).

    Attributes:
        transient: ``True`` (default) when the broker or the connection is at fault and the same
            message will go through once it is back (connection lost, timeout, nack); ``False``
            when this message cannot be delivered as addressed (no such queue). The relay backs
            off a transient failure briefly and never parks a row for it.
    """

    def __init__(self, message: str, *, transient: bool = True) -> None:
        super().__init__(message)
        self.transient = transient


class Publisher(abc.ABC):
    """The publishing side of a broker, used by the relay."""

    @abc.abstractmethod
    async def publish(self, message: OutgoingMessage) -> None:
        """Publish and wait for the broker's confirm.

        Raises:
            PublishError: the broker did not confirm; the caller may publish again with the same
                ``message_id``.
        """

    @abc.abstractmethod
    async def close(self) -> None: ...


async def settle_quietly(coro: Awaitable[None], *, timeout: float, what: str) -> None:
    """Await a settlement, never hanging past ``timeout`` seconds and never raising: a delivery
    whose settlement is lost comes back from the broker and is then handled as a duplicate."""
    try:
        async with asyncio.timeout(timeout):  # unlike wait_for, no extra task per settlement
            await coro
    except Exception as exc:  # noqa: BLE001 - any failure here means "the broker will redeliver"
        logger.warning("settlement %s failed (%s); the broker will redeliver", what, type(exc).__name__)
