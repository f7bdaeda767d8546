"""The publishing side of the broker contract: what the relay hands an adapter's publisher.

Adapters implement :class:`Publisher`; the relay (``outbox_relay``) calls it with one
:class:`OutgoingMessage` per outbox row and reads a :class:`PublishError`'s kind to decide between
retrying soon, backing off and parking the row.
"""

from __future__ import annotations

import abc
import asyncio
import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from consumer_kit.codec import headers as own
from consumer_kit.errors import ConfigurationError, PublishTimeout


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
        first_enqueued_at: for a relay publish, the outbox row's commit time (aware): the operation
            the event starts is that old on arrival (key expiry), carried as the signed mark
            ``x-consumer-kit-first-enqueued`` (:func:`first_enqueued_mark`); ``None``: no mark.
    """

    destination: str
    routing_key: str
    message_id: str
    body: bytes
    message_type: str
    headers: Mapping[str, str] = field(default_factory=dict)
    partition_key: str | None = None
    content_type: str = "application/json"
    first_enqueued_at: dt.datetime | None = None


class Publisher(abc.ABC):
    """The publishing side of a broker, used by the relay."""

    async def declare(self, destination: str) -> None:
        """Create the event destination ``destination`` as :meth:`publish` would on first use
        (RabbitMQ: a durable topic exchange), so consumers can bind to it before the first
        event (``consumer-kit declare``). Idempotent.

        Raises:
            ConfigurationError: this broker cannot create destinations from here (the default),
                or refused this one (e.g. it exists as another kind); the text says which.
            ConnectionError: the broker cannot be reached.
        """
        raise ConfigurationError(
            f"declaring event destinations is not supported by this broker ({type(self).__name__}): "
            f"create {destination!r} yourself"
        )

    @abc.abstractmethod
    async def publish(self, message: OutgoingMessage) -> None:
        """Publish and wait for the broker's confirm.

        Raises:
            PublishError: the broker did not confirm; the caller may publish again with the same
                ``message_id``.
        """

    async def publish_batch(
        self, messages: Sequence[OutgoingMessage], *, within: float
    ) -> list[BaseException | None]:
        """Publish ``messages`` and wait for their confirms together, at most ``within`` seconds.

        Returns one outcome per message, in order: ``None`` confirmed; else the exception
        :meth:`publish` would have raised for it (usually a :class:`PublishError`), or
        :class:`PublishTimeout` when it was not confirmed within ``within`` seconds (its publish
        is then abandoned). One message's failure never fails the others. This default publishes
        each message with :meth:`publish`, all concurrently; RabbitMQ sends the batch's frames
        in one write and awaits its confirms once.
        """
        if not messages:
            return []
        if within <= 0:  # never sent once the time is up (it could arrive and count as failed)
            return [PublishTimeout(f"not sent within {within:.1f} s") for _ in messages]
        tasks = [asyncio.ensure_future(self.publish(m)) for m in messages]
        try:
            _, pending = await asyncio.wait(tasks, timeout=within)
        except BaseException:  # the caller is cancelled: no publish outlives it
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        return [
            PublishTimeout(f"not confirmed within {within:.1f} s") if t in pending or t.cancelled() else t.exception()
            for t in tasks
        ]

    @abc.abstractmethod
    async def close(self) -> None: ...


def first_enqueued_mark(message: OutgoingMessage) -> dict[str, str]:
    """``{x-consumer-kit-first-enqueued: ISO time}`` for a message with ``first_enqueued_at``, else
    ``{}``; the publisher signs it with :func:`consumer_kit.codec.headers.seal`."""
    if message.first_enqueued_at is None:
        return {}
    return {own.FIRST_ENQUEUED: message.first_enqueued_at.astimezone(dt.UTC).isoformat()}


def headers_to_send(message: OutgoingMessage) -> dict[str, Any]:
    """The application headers a publisher sends ``message`` with, ``message-type`` included: its
    headers as given; for a message with ``first_enqueued_at`` (a relay publish) without any mark
    they carried (consumer-kit signs only the marks it wrote), plus the first-enqueued mark,
    signed under the installed mark key."""
    headers: dict[str, Any] = {**message.headers, own.MESSAGE_TYPE: message.message_type}
    mark = first_enqueued_mark(message)
    if not mark:
        return headers
    # The mark's value is an aware UTC time's isoformat: already the text seal() would read back.
    return own.seal_new(own.without_marks(headers), mark, message.body)
