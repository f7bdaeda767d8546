"""Publishing outbox events (the relay's side) to Service Bus queues and topics, in batches.

``message.destination`` names a queue or a topic; destination ``""`` means the routing key names a
queue (commands, tests), as RabbitMQ's default exchange does. The message itself is built by
:func:`consumer_kit.adapters.servicebus.envelope.outgoing_message`; batching, size checks and outcomes per
publish are :mod:`consumer_kit.adapters.servicebus.batching`'s.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from consumer_kit.broker.publishing import OutgoingMessage, Publisher
from consumer_kit.errors import PublishError

from .batching import EntityBatcher, Pending
from .config import Namespace
from .connection import Connection
from .envelope import outgoing_message
from .errors import HeaderTooLarge
from .header_limits import check_header
from .topology import not_created_here

logger = logging.getLogger(__name__)


class ServiceBusPublisher(Publisher):
    """Publish :class:`~consumer_kit.broker.publishing.OutgoingMessage` to Service Bus, batching concurrent
    publishes per entity. The client is opened on first publish.

    Args:
        namespace: where and how to sign in.
        confirm_timeout: seconds a publish waits for Service Bus's confirmation (and one batch send
            may take).
        batch_max_messages: most events per ``ServiceBusMessageBatch``.
        session_entities: queues that require sessions (``CONSUMER_KIT_SERVICEBUS_SESSION_ENTITIES``;
            topic subscriptions listed there are ignored: a topic's other subscriptions may take
            any event). An event without a partition key to one of them is refused before sending:
            what Service Bus does with it is not documented (it refuses the send, or accepts it and
            dead-letters it as ``Session id is null``, where no consumer sees it).

    Raises:
        ValueError: on invalid arguments.
    """

    def __init__(
        self, namespace: Namespace, *, confirm_timeout: float = 10.0, batch_max_messages: int = 100,
        session_entities: Iterable[str] = (),
    ) -> None:
        if confirm_timeout <= 0:
            raise ValueError("confirm_timeout must be > 0 seconds")
        if batch_max_messages < 1:
            raise ValueError("batch_max_messages must be >= 1")
        self._namespace = namespace
        self._confirm_timeout = confirm_timeout
        self._batch_max_messages = batch_max_messages
        self._connection: Connection | None = None
        self._batchers: dict[str, EntityBatcher] = {}
        self._session_queues = {e.casefold() for e in session_entities if "/" not in e}

    async def publish(self, message: OutgoingMessage) -> None:
        """Publish ``message`` and wait for Service Bus to confirm its batch.

        Raises:
            PublishError: permanent: no partition key for a queue in ``session_entities``, too
                large for the entity (the limit is named), headers over
                Service Bus's header limits (32 KB per property, 64 KB in all: the property and
                sizes are named, never a value), a message the
                SDK cannot build, or refused as addressed when sent alone; row: no such queue or
                topic (or disabled); transient: timeout, connection or link failure, throttling.
                Publishing again with the same ``message_id`` is safe: duplicate detection, where
                enabled, drops the repeat, and consumers deduplicate.
        """
        entity = message.destination or message.routing_key
        if not entity:
            raise PublishError(f"message_id={message.message_id} names no queue or topic", permanent=True)
        if message.partition_key is None and entity.casefold() in self._session_queues:
            raise PublishError(
                f"message_id={message.message_id} has no partition key, and {entity!r} requires sessions "
                "(the session id is the partition key)", permanent=True,
            )
        try:
            built = outgoing_message(message)
        except (ValueError, TypeError) as exc:
            raise PublishError(
                f"message_id={message.message_id} cannot be built as a Service Bus message: {exc}", permanent=True
            ) from exc
        try:
            check_header(built, what=f"message_id={message.message_id}")
        except HeaderTooLarge as exc:
            raise PublishError(str(exc), permanent=True) from exc
        pending = Pending(built, message.message_id, len(message.body))
        batcher = self._batcher(entity)
        batcher.submit(pending)
        try:
            async with asyncio.timeout(self._confirm_timeout):
                await asyncio.shield(pending.outcome)  # a publisher that gives up never cancels a batch
        except TimeoutError as exc:
            batcher.withdraw(pending)
            raise PublishError(
                f"publish of message_id={message.message_id} to {entity!r} not confirmed in time"
            ) from exc
        except asyncio.CancelledError:
            batcher.withdraw(pending)
            raise
        logger.debug("published message_id=%s to %s", message.message_id, entity)

    async def declare(self, destination: str) -> None:
        """``consumer-kit declare``: not on Service Bus.

        Raises:
            ConfigurationError: always, naming what to create and how.
        """
        raise not_created_here(f"the queue or topic {destination!r}")

    async def close(self) -> None:
        """Let batches in flight finish (bounded), close every sender and the client (idempotent)."""
        batchers, self._batchers = list(self._batchers.values()), {}
        await asyncio.gather(*(b.close(self._confirm_timeout) for b in batchers))
        connection, self._connection = self._connection, None
        if connection is not None:
            await connection.close(self._confirm_timeout)

    def _batcher(self, entity: str) -> EntityBatcher:
        batcher = self._batchers.get(entity)
        if batcher is None:
            if self._connection is None:
                self._connection = Connection(self._namespace, name="consumer-kit publisher")
            batcher = self._batchers[entity] = EntityBatcher(
                self._connection.client, entity,
                max_messages=self._batch_max_messages, send_timeout=self._confirm_timeout,
            )
        return batcher
