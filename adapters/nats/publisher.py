"""The relay's confirmed publishes: one JetStream publish and one publish ack per event.

**Subject.** Destination ``""``: the routing key is the subject (a work queue's name); otherwise
``<destination>.<routing key>`` (just ``<destination>`` without one); with a partition key,
``.k.<key token>`` is appended (:func:`~consumer_kit.adapters.nats.topology.subject_for`).

**Stable id.** ``Nats-Msg-Id`` = the event ID on every attempt: within the stream's duplicate
window (2 minutes for streams consumer-kit creates) JetStream stores a repeat once and answers it
with ``duplicate: true`` (counted, not an error). It protects publishes only; a redelivery is the
ledger's to answer.

**Size.** Headers plus body are checked against the server's ``max_payload`` and the target
stream's ``max_msg_size`` (looked up once per subject) before anything is sent: a message that
can never fit never reaches the connection others share (docs/explanation/faults-and-attempts.md).
"""

from __future__ import annotations

import logging

from consumer_kit.broker.publishing import OutgoingMessage, Publisher, headers_to_send
from consumer_kit.codec import headers as own
from consumer_kit.errors import PublishError

from .config import NATSConfig
from .connection import API_TIMEOUT, NATSConnection
from .envelope import MSG_ID, headers_for
from .errors import describe, is_unreachable, publish_error
from .limits import limit_of, size_of
from .topology import check_subject, ensure_stream, stream_name, subject_for

logger = logging.getLogger(__name__)


def subject_of(message: OutgoingMessage) -> str:
    """The subject ``message`` is published on (module docstring)."""
    base = message.routing_key if not message.destination else (
        f"{message.destination}.{message.routing_key}" if message.routing_key else message.destination)
    return check_subject(subject_for(base, message.partition_key))


class NATSPublisher(Publisher):
    """Publish outbox events to JetStream (module docstring).

    Attributes:
        published: publish acks received; ``duplicates``: of them, repeats JetStream dropped.
    """

    def __init__(self, config: NATSConfig, *, connection: NATSConnection | None = None) -> None:
        self._owns_connection = connection is None
        self.connection = connection or NATSConnection(config)
        self._stream_limits: dict[str, int] = {}
        self.published = 0
        self.duplicates = 0

    async def declare(self, destination: str) -> None:
        """Create the event stream of ``destination`` (subjects ``D`` and ``D.>``) unless it exists.

        Raises:
            ConfigurationError: an invalid name, or JetStream refused the stream.
            ConnectionError: NATS cannot be reached.
        """
        try:
            js = await self.connection.jetstream()
            await ensure_stream(js, stream_name(destination), [destination, f"{destination}.>"], work_queue=False)
        except Exception as exc:
            if is_unreachable(exc):
                raise ConnectionError(f"NATS cannot be reached: {describe(exc)}") from exc
            raise

    async def publish(self, message: OutgoingMessage) -> None:
        """Publish ``message`` and wait for its publish ack (module docstring).

        Raises:
            PublishError: permanent (too large, a bad subject), row (no stream takes the subject),
                transient (no ack in time, connection lost); :mod:`consumer_kit.adapters.nats.errors`.
        """
        try:
            subject = subject_of(message)
        except Exception as exc:
            raise PublishError(f"message_id={message.message_id}: {exc}", permanent=True) from exc
        headers = {**headers_for(headers_to_send(message)), MSG_ID: message.message_id}
        if message.partition_key:
            headers.setdefault(own.PARTITION_KEY, message.partition_key)
        try:
            limit = await self._limit(subject)
            size = size_of(message.body, headers)
            if size > limit:
                raise PublishError(
                    f"message_id={message.message_id} of {size} bytes exceeds the maximum message size of "
                    f"{limit} bytes on {subject!r}", permanent=True)
            js = await self.connection.jetstream()
            ack = await js.publish(subject, message.body, headers=headers, timeout=API_TIMEOUT)
        except Exception as exc:
            raise publish_error(exc, message.message_id, subject) from exc
        self.published += 1
        if ack.duplicate:
            self.duplicates += 1
            logger.info("message_id=%s on %s was a duplicate (stream %s seq %s): stored once",
                        message.message_id, subject, ack.stream, ack.seq)

    async def _limit(self, subject: str) -> int:
        """``max_payload``, or the smaller ``max_msg_size`` of the stream taking ``subject``."""
        max_payload = await self.connection.max_payload()
        if subject not in self._stream_limits:
            js = await self.connection.jetstream()
            try:
                name = await js.find_stream_name_by_subject(subject)
                info = await js.stream_info(name)
                self._stream_limits[subject] = int(info.config.max_msg_size or -1)
            except Exception as exc:
                if is_unreachable(exc):
                    raise
                return max_payload  # no stream: the publish says so (a row error)
        return limit_of(max_payload, self._stream_limits[subject])

    async def close(self) -> None:
        if self._owns_connection:
            await self.connection.close()
