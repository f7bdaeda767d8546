"""Names, streams and durable consumers: what a consumer-kit queue is on JetStream.

==================  ==============================================================================
consumer-kit        JetStream
==================  ==============================================================================
work queue ``Q``    stream :func:`stream_name` (``Q`` with every character outside ``A-Za-z0-9_-``
                    as ``_``), retention ``workqueue`` (a message leaves it once acked or
                    terminated), subjects ``Q`` and ``Q.k.>`` (one subject per partition key:
                    :func:`subject_for`), duplicate window 2 minutes (``Nats-Msg-Id``)
its consumer        the durable pull consumer of the same name: explicit ack, ``ack_wait`` (the
                    peek-lock), ``max_deliver`` (a loop guard above consumer-kit's bounds:
                    :func:`recommended_max_deliver`), ``max_ack_pending=1`` when ``ordered``
dead letters        stream ``<stream>_dlq``, subject ``Q.dlq``, retention ``limits`` (kept until
                    ``consumer-kit dlq redrive`` removes them)
event destination   stream :func:`stream_name` of ``D``, subjects ``D`` and ``D.>``, retention
                    ``limits`` (``consumer-kit declare`` for a relay's destination)
==================  ==============================================================================

An existing stream is used as it is (never changed here: streams are shared infrastructure); an
existing durable consumer gets this adapter's ``ack_wait`` and ``max_deliver`` (JetStream
updates them in place).
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StreamConfig
from nats.js.errors import NotFoundError

from consumer_kit.errors import ConfigurationError

logger = logging.getLogger(__name__)

DUPLICATE_WINDOW = 120.0
"""Seconds JetStream remembers a ``Nats-Msg-Id`` (its default): a relay's repeat within it is dropped."""

_NOT_NAME = re.compile(r"[^A-Za-z0-9_-]")
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_SUBJECT = re.compile(r"^[^\s*>]+$")


def recommended_max_deliver(max_deliveries: int, crash_limit: int) -> int:
    """JetStream's ``max_deliver`` for a work queue's consumer: a loop guard well above
    consumer-kit's own bounds, ``max(50, 5 * (max_deliveries + crash_limit))`` (the rule of
    RabbitMQ's ``x-delivery-limit`` and SQS's ``maxReceiveCount``)."""
    return max(50, 5 * (max_deliveries + crash_limit))


def stream_name(queue: str) -> str:
    """The stream (and durable consumer) name of a consumer-kit queue or destination name.

    Raises:
        ConfigurationError: ``queue`` is empty or not a valid subject (whitespace, ``*``, ``>``).
    """
    check_subject(queue)
    return _NOT_NAME.sub("_", queue)


def check_subject(subject: str) -> str:
    """``subject`` when NATS accepts it as a literal subject; else raises ConfigurationError."""
    if not subject or not _SUBJECT.fullmatch(subject) or subject.startswith(".") or subject.endswith(".") or ".." in subject:
        raise ConfigurationError(f"{subject!r} is not a NATS subject (no whitespace, '*', '>' or empty tokens)")
    return subject


def key_token(partition_key: str) -> str:
    """The subject token of a partition key: the key itself when it is 1 to 64 characters of
    ``A-Za-z0-9_-``, else ``h`` + the first 32 hex digits of its SHA-256."""
    if _TOKEN.fullmatch(partition_key):
        return partition_key
    return "h" + hashlib.sha256(partition_key.encode("utf-8")).hexdigest()[:32]


def subject_for(base: str, partition_key: str | None) -> str:
    """The subject a message for ``base`` (a queue or ``destination.routing_key``) is published
    on: ``base``, or ``base.k.<key token>`` with a partition key (:func:`key_token`)."""
    return base if not partition_key else f"{base}.k.{key_token(partition_key)}"


def dead_letter_subject(queue: str) -> str:
    return f"{queue}.dlq"


@dataclass(frozen=True)
class QueueInfo:
    """One work queue on JetStream.

    Attributes:
        queue: the consumer-kit name (also its base subject).
        stream, durable: the stream and its durable consumer.
        dlq_stream, dlq_subject: where its dead letters go.
        ack_wait: seconds of peek-lock, as the consumer has it.
        max_msg_size, dlq_max_msg_size: the streams' limits in bytes (``-1``: none but max_payload).
    """

    queue: str
    stream: str
    durable: str
    dlq_stream: str
    dlq_subject: str
    ack_wait: float
    max_msg_size: int
    dlq_max_msg_size: int


async def ensure_stream(js: JetStreamContext, name: str, subjects: list[str], *, work_queue: bool) -> int:
    """Create stream ``name`` with ``subjects`` unless it exists; returns its ``max_msg_size``.

    Raises:
        ConfigurationError: JetStream refused it (e.g. its subjects overlap another stream's).
    """
    try:
        info = await js.stream_info(name)
        return int(info.config.max_msg_size or -1)
    except NotFoundError:
        pass
    config = StreamConfig(
        name=name, subjects=subjects, duplicate_window=DUPLICATE_WINDOW,
        retention=RetentionPolicy.WORK_QUEUE if work_queue else RetentionPolicy.LIMITS,
    )
    try:
        info = await js.add_stream(config)
    except Exception as exc:
        if type(exc).__name__.endswith(("BadRequestError", "APIError", "ServerError")):
            raise ConfigurationError(f"JetStream refused stream {name!r} for {subjects}: {exc}") from exc
        raise
    logger.info("created stream %s subjects=%s", name, ",".join(subjects))
    return int(info.config.max_msg_size or -1)


async def ensure_queue(
    js: JetStreamContext, queue: str, *, ack_wait: float, max_deliver: int, ordered: bool
) -> QueueInfo:
    """The work queue ``queue`` with its dead-letter stream and durable consumer, created or
    updated (module docstring). Idempotent.

    Raises:
        ConfigurationError: an invalid name, or JetStream refused a stream or the consumer.
    """
    stream = stream_name(queue)
    size = await ensure_stream(js, stream, [queue, f"{queue}.k.>"], work_queue=True)
    dlq_stream, dlq_subject = f"{stream}_dlq", dead_letter_subject(queue)
    dlq_size = await ensure_stream(js, dlq_stream, [dlq_subject], work_queue=False)
    config = ConsumerConfig(
        durable_name=stream, ack_policy=AckPolicy.EXPLICIT, ack_wait=ack_wait, max_deliver=max_deliver,
        max_ack_pending=1 if ordered else None,
    )
    try:
        info = await js.add_consumer(stream, config)
    except Exception as exc:
        if type(exc).__name__.endswith(("BadRequestError", "APIError", "ServerError")):
            raise ConfigurationError(f"JetStream refused consumer {stream!r} of stream {stream!r}: {exc}") from exc
        raise
    return QueueInfo(
        queue=queue, stream=stream, durable=stream, dlq_stream=dlq_stream, dlq_subject=dlq_subject,
        ack_wait=float(info.config.ack_wait or ack_wait), max_msg_size=size, dlq_max_msg_size=dlq_size,
    )


async def lookup_queue(js: JetStreamContext, queue: str) -> QueueInfo:
    """The existing work queue ``queue`` (nothing created).

    Raises:
        ConfigurationError: no such stream, dead-letter stream or consumer.
    """
    stream = stream_name(queue)
    try:
        work = await js.stream_info(stream)
        dlq = await js.stream_info(f"{stream}_dlq")
        consumer = await js.consumer_info(stream, stream)
    except NotFoundError:
        raise ConfigurationError(
            f"no JetStream work queue {queue!r} (stream {stream!r}, {stream}_dlq and consumer {stream!r}): "
            "run consumer-kit declare"
        ) from None
    return QueueInfo(
        queue=queue, stream=stream, durable=stream, dlq_stream=f"{stream}_dlq", dlq_subject=dead_letter_subject(queue),
        ack_wait=float(consumer.config.ack_wait or 30.0), max_msg_size=int(work.config.max_msg_size or -1),
        dlq_max_msg_size=int(dlq.config.max_msg_size or -1),
    )
