"""Publishing outbox events (the relay's side) with ``SendMessageBatch``.

The relay publishes a claimed batch concurrently; publishes to the same queue that arrive within
``linger`` seconds of each other (default 5 ms) go out in one ``SendMessageBatch`` of up to 10
entries and at most ``BATCH_MAX_BYTES`` (:mod:`consumer_kit.adapters.sqs.batching`). Each publish still gets its
own answer: SQS reports every entry on its own, and a failed entry becomes a
:class:`~consumer_kit.broker.publishing.PublishError` of its kind (:mod:`consumer_kit.adapters.sqs.errors`) for that event
only. An endpoint that refuses the batch as too long gets each entry again on its own.

**What is sent.** ``destination`` names the queue (``""``: ``routing_key`` does, as on RabbitMQ's
default exchange): a consumer-kit name, URL or ARN (:mod:`consumer_kit.adapters.sqs.topology`). The body is the
event's JSON text. Message attributes carry the event's headers (event id, ``message-type``,
trace context ``traceparent``/``tracestate``, correlation id, ...), ``x-consumer-kit-message-id``
= the event ID and ``routing-key`` when there is one, at most 10 attributes
(:mod:`consumer_kit.adapters.sqs.envelope`). On a FIFO queue ``MessageDeduplicationId`` = the event ID and
``MessageGroupId`` = the partition key (``consumer-kit`` without one).

**Size.** Body plus attributes are measured against the queue's ``MaximumMessageSize`` before
sending; larger is a permanent ``PublishError`` naming the limit and the size (the relay parks the
event at once).
"""

from __future__ import annotations

import logging
from typing import Any

from consumer_kit.broker.publishing import OutgoingMessage, Publisher, first_enqueued_mark
from consumer_kit.codec import headers as own
from consumer_kit.codec.envelope import MESSAGE_TYPE_HEADER
from consumer_kit.errors import ConfigurationError, PublishError

from .batching import Batcher
from .config import SQSConfig
from .connection import SQSClient
from .delivery import DEFAULT_GROUP
from .envelope import MESSAGE_ID_ATTRIBUTE, attributes_for
from .errors import (
    BATCH_TOO_LONG,
    describe,
    entry_publish_error,
    is_code,
    is_unreachable,
    publish_error,
)
from .limits import BATCH_MAX_BYTES, size_of
from .topology import QueueDirectory, QueueInfo

logger = logging.getLogger(__name__)

ROUTING_KEY_ATTRIBUTE = "routing-key"


class SQSPublisher(Publisher):
    """Publish :class:`~consumer_kit.broker.publishing.OutgoingMessage` to SQS queues (module docstring).

    Args:
        config: the parsed ``sqs://`` URL.
        linger: seconds concurrent publishes wait to share a batch call.
        client: an :class:`~consumer_kit.adapters.sqs.connection.SQSClient` to use (tests); default: its own.

    Attributes:
        batches: ``SendMessageBatch`` calls made.
    """

    def __init__(self, config: SQSConfig, *, linger: float = 0.005, client: SQSClient | None = None) -> None:
        if linger < 0:
            raise ValueError("linger must be >= 0 seconds")
        self._owns_client = client is None
        self.client = client or SQSClient(config, threads=8, pollers=0)
        self._directory = QueueDirectory(self.client, account_id=config.account_id)
        self._batcher: Batcher[dict[str, Any], str] = Batcher(
            self._send_batch, linger=linger, max_bytes=BATCH_MAX_BYTES
        )

    @property
    def batches(self) -> int:
        return self._batcher.batches

    async def publish(self, message: OutgoingMessage) -> None:
        """Send ``message`` and wait for SQS to accept it.

        Raises:
            PublishError: permanent: larger than the queue's ``MaximumMessageSize``, not UTF-8
                text, or refused by SQS as sent; row: no such queue; transient: throttled, SQS's
                own failure, no answer. Sending again with the same ``message_id`` is safe: it
                is the FIFO deduplication id and consumers deduplicate.
        """
        target = message.destination or message.routing_key
        try:
            queue = await self._directory.lookup(target)
        except LookupError as exc:
            raise PublishError(f"no SQS queue {target!r} for message_id={message.message_id}",
                               transient=False) from exc
        except Exception as exc:
            raise publish_error(exc, message.message_id, target) from exc
        entry, size = self._entry(message, queue)
        try:
            await self._batcher.submit(queue.url, entry, size)
        except PublishError:
            raise
        except Exception as exc:
            if is_code(exc, frozenset({"NonExistentQueue", "QueueDoesNotExist"})):
                self._directory.forget(target)
            raise publish_error(exc, message.message_id, queue.name) from exc
        logger.debug("published message_id=%s to queue=%s", message.message_id, queue.name)

    async def declare(self, destination: str) -> None:
        """Create the queue ``destination`` names where it does not exist (``consumer-kit
        declare``): a plain queue, FIFO when the name ends in ``.fifo``. Idempotent.

        Raises:
            ConfigurationError: SQS refused to create it (the text says why).
            ConnectionError: SQS cannot be reached.
        """
        try:
            await self._directory.ensure(destination, dead_letters=False)
        except Exception as exc:
            if is_unreachable(exc):
                raise ConnectionError(f"SQS cannot be reached: {describe(exc)}") from exc
            raise ConfigurationError(f"cannot declare SQS queue {destination!r}: {describe(exc)}") from exc

    async def close(self) -> None:
        """Wait for batches in flight, then close the client (idempotent)."""
        await self._batcher.close()
        if self._owns_client:
            await self.client.close()

    def _entry(self, message: OutgoingMessage, queue: QueueInfo) -> tuple[dict[str, Any], int]:
        try:
            body = message.body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PublishError(
                f"message_id={message.message_id} cannot be sent to SQS: the body is not UTF-8 text",
                permanent=True,
            ) from exc
        # a relay publish's first-enqueued mark is made here, never taken from the headers
        headers: dict[str, Any] = {**own.without_marks(message.headers), **first_enqueued_mark(message),
                                   MESSAGE_TYPE_HEADER: message.message_type, MESSAGE_ID_ATTRIBUTE: message.message_id}
        if message.routing_key and message.destination:
            headers[ROUTING_KEY_ATTRIBUTE] = message.routing_key
        if message.content_type != "application/json":
            headers["content-type"] = message.content_type
        # the message-id (and first-enqueued) mark, signed: consumers believe it only so (consumer_kit.codec.headers)
        attributes = attributes_for(own.seal(headers, message.body))
        size = size_of(body, attributes)
        if size > queue.max_message_size:
            raise PublishError(
                f"message_id={message.message_id} to {queue.name!r} cannot be published: "
                f"{size} bytes (body and attributes) exceed the queue's maximum message size of "
                f"{queue.max_message_size} bytes",
                permanent=True,
            )
        entry: dict[str, Any] = {"MessageBody": body, "MessageAttributes": attributes,
                                 "_message_id": message.message_id, "_queue": queue.name}
        if queue.fifo:
            entry["MessageGroupId"] = message.partition_key or DEFAULT_GROUP
            entry["MessageDeduplicationId"] = message.message_id
        return entry, size

    async def _send_batch(self, queue_url: str, entries: list[dict[str, Any]]) -> list[str | BaseException]:
        wire = [
            {"Id": str(i), **{k: v for k, v in entry.items() if not k.startswith("_")}}
            for i, entry in enumerate(entries)
        ]
        try:
            reply = await self.client.call("send_message_batch", QueueUrl=queue_url, Entries=wire)
        except Exception as exc:
            if len(entries) > 1 and is_code(exc, BATCH_TOO_LONG):
                logger.info("SendMessageBatch of %s entries too long for the endpoint; sending one by one",
                            len(entries))
                return [r for entry in entries for r in await self._send_batch(queue_url, [entry])]
            raise
        sent = {str(s.get("Id")): str(s.get("MessageId", "")) for s in reply.get("Successful", [])}
        failed = {str(f.get("Id")): f for f in reply.get("Failed", [])}
        results: list[str | BaseException] = []
        for i, entry in enumerate(entries):
            key = str(i)
            if key in sent:
                results.append(sent[key])
            elif key in failed:
                results.append(entry_publish_error(failed[key], entry["_message_id"], entry["_queue"]))
            else:
                results.append(PublishError(f"SQS said nothing about message_id={entry['_message_id']}"))
        return results
