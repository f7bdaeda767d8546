"""Listing and redriving ``<queue>.dlq`` (``consumer-kit dlq``; contract:
:class:`consumer_kit.broker.DeadLetterQueues`).

RabbitMQ has no peek: :meth:`RabbitMQDeadLetters.peek` takes messages with ``basic.get`` (no
auto-ack) and closes its channel, which puts every one of them back. :meth:`~RabbitMQDeadLetters.redrive`
takes each message that was in the queue when it started, once: a selected one is published to the
work queue (default exchange, ``mandatory``, publisher confirm) and only then acked; the others are
held until the end and put back by closing the channel (on a quorum dead-letter queue each such
return counts one more ``x-delivery-count``: the dead-letter queue has no delivery limit).

What a dead letter says: consumer-kit's copies carry ``x-dead-letter-reason``/``-detail``,
``x-original-queue`` and ``x-consumer-kit-deliveries``; a message the broker dead-lettered itself
(a copy too large to send, the broker's delivery limit) has ``x-death`` instead, read as reason
``broker:<reason>`` and its time as the dead-letter time.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Mapping
from typing import Any

import aio_pika
import aiormq.exceptions
from aio_pika.abc import AbstractConnection, AbstractIncomingMessage

from consumer_kit.broker import DeadLetter, DeadLetterQueues, RedriveReport, header_count, header_text
from consumer_kit.broker.dead_letters import REASON_ON_COPY_CHARS, Redrive, RedriveAsked
from consumer_kit.codec import headers as own
from consumer_kit.codec.envelope import OPERATION_ID_HEADER
from consumer_kit.errors import ConfigurationError, CopyRefused

from .connection import close_quietly, open_connection
from .envelope import (
    BROKER_COUNT_HEADER,
    DEAD_LETTER_DETAIL_HEADER,
    DEAD_LETTER_REASON_HEADER,
    DELIVERIES_HEADER,
    ORIGINAL_QUEUE_HEADER,
    REDELIVERED_HEADER,
    TRIMMED_HEADER,
    user_of_url,
)
from .errors import describe

logger = logging.getLogger(__name__)

REDRIVEN_HEADER = "x-consumer-kit-redriven"
"""On a redriven message: the dead-letter reason it had (for the record; the runtime ignores it)."""

# Headers a redriven copy does not carry over: the dead-letter record and every delivery counter.
_DROPPED = frozenset({
    DEAD_LETTER_REASON_HEADER, DEAD_LETTER_DETAIL_HEADER, ORIGINAL_QUEUE_HEADER, DELIVERIES_HEADER,
    REDELIVERED_HEADER, TRIMMED_HEADER, BROKER_COUNT_HEADER, REDRIVEN_HEADER, "x-death",
    "x-first-death-exchange", "x-first-death-queue", "x-first-death-reason", "x-last-death-exchange",
    "x-last-death-queue", "x-last-death-reason",
})


class RabbitMQDeadLetters(DeadLetterQueues):
    """``<queue>.dlq`` of the work queues on the broker at ``url`` (one connection, opened on first
    use).

    Args:
        url: AMQP URL.
        timeout: seconds for connecting and for each broker operation.
    """

    def __init__(self, url: str, *, timeout: float = 10.0) -> None:
        self._url = url
        self._timeout = timeout
        self._connection: AbstractConnection | None = None

    async def count(self, queue: str) -> int:
        connection = await self._connect()
        channel = await connection.channel()
        try:
            declared = await self._dlq(channel, queue)
            return int(declared.declaration_result.message_count or 0)
        finally:
            await channel.close()

    async def peek(self, queue: str, *, limit: int = 100) -> list[DeadLetter]:
        connection = await self._connect()
        channel = await connection.channel()
        found: list[DeadLetter] = []
        try:
            dlq = await self._dlq(channel, queue)
            for _ in range(min(limit, int(dlq.declaration_result.message_count or 0))):
                message = await dlq.get(no_ack=False, fail=False, timeout=self._timeout)
                if message is None:
                    break
                found.append(dead_letter_of(message, queue))
        finally:
            await channel.close()  # every message taken goes back
        return found

    async def _redrive(self, queue: str, asked: RedriveAsked) -> RedriveReport:
        connection = await self._connect()
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        try:
            dlq = await self._dlq(channel, queue)
            run = _Redrive(asked, channel, self._timeout, target=queue, source=dlq.name, user_id=user_of_url(self._url))
            for _ in range(int(dlq.declaration_result.message_count or 0)):
                message = await dlq.get(no_ack=False, fail=False, timeout=self._timeout)
                if message is None:
                    break
                await run.look_at(message, dead_letter_of(message, queue))
        finally:
            await channel.close()  # the messages not acked go back to the dead-letter queue
        return run.report

    async def close(self) -> None:
        await close_quietly(self._connection, self._timeout, "dead-letter")
        self._connection = None

    async def _dlq(self, channel: aio_pika.abc.AbstractChannel, queue: str) -> aio_pika.abc.AbstractQueue:
        try:
            return await channel.declare_queue(f"{queue}.dlq", passive=True, timeout=self._timeout)
        except aiormq.exceptions.ChannelNotFoundEntity:
            raise ConfigurationError(f"no dead-letter queue {queue}.dlq on the broker (is {queue!r} a work queue?)") from None

    async def _connect(self) -> AbstractConnection:
        if self._connection is None or self._connection.is_closed:
            try:
                self._connection = await open_connection(self._url, timeout=self._timeout, name="consumer-kit dlq")
            except (OSError, aiormq.exceptions.AMQPError, TimeoutError) as exc:
                raise ConnectionError(f"cannot connect to RabbitMQ: {describe(exc)}") from exc
        return self._connection


class _Redrive(Redrive[AbstractIncomingMessage]):
    """One redrive on one channel: publish the copy to the work queue (default exchange,
    ``mandatory``, publisher confirm), then ack the dead letter."""

    def __init__(
        self, asked: RedriveAsked, channel: aio_pika.abc.AbstractChannel, timeout: float, *, target: str, source: str,
        user_id: str | None,
    ) -> None:
        super().__init__(asked, target=target, source=source)
        self._channel = channel
        self._timeout = timeout
        self._user_id = user_id  # this connection's own user: RabbitMQ validates it, handlers may allow it

    async def send_copy(self, message: AbstractIncomingMessage, letter: DeadLetter) -> None:
        # from the letter's verified headers: a mark a producer forged is never signed anew here
        headers = {k: v for k, v in letter.headers.items() if k not in _DROPPED}
        headers[REDRIVEN_HEADER] = letter.reason[:REASON_ON_COPY_CHARS]
        own.seal(headers, message.body)
        copy = aio_pika.Message(
            body=message.body, headers=headers, content_type=message.content_type,
            content_encoding=message.content_encoding, delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            priority=message.priority, correlation_id=message.correlation_id, reply_to=message.reply_to,
            message_id=message.message_id, timestamp=message.timestamp, type=message.type,
            app_id=message.app_id, user_id=self._user_id,
        )
        try:
            async with asyncio.timeout(self._timeout):
                await self._channel.default_exchange.publish(copy, routing_key=letter.queue, mandatory=True)
        except (aiormq.exceptions.DeliveryError, aiormq.exceptions.PublishError, TimeoutError) as exc:
            raise CopyRefused(describe(exc)) from exc

    async def remove(self, message: AbstractIncomingMessage, letter: DeadLetter) -> None:
        await message.ack()


def dead_letter_of(message: AbstractIncomingMessage, queue: str) -> DeadLetter:
    """What ``consumer-kit dlq list`` shows of one message of ``<queue>.dlq``."""
    # Only consumer-kit's signed marks are believed (reason, detail, original queue, count); a
    # producer's own are dropped by the codec, so a broker's dead-lettering shows as broker:<reason>.
    headers = dict(own.read(message.headers or {}, message.body).headers)
    death = _first_death(headers)
    reason = header_text(headers.get(DEAD_LETTER_REASON_HEADER))
    if not reason:
        reason = f"broker:{header_text(death.get('reason')) or 'unknown'}" if death else "unknown"
    dead_lettered_at = death.get("time") if death else None
    if isinstance(dead_lettered_at, dt.datetime) and dead_lettered_at.tzinfo is None:
        dead_lettered_at = dead_lettered_at.replace(tzinfo=dt.UTC)
    deliveries = headers.get(DELIVERIES_HEADER)
    return DeadLetter(
        queue=header_text(headers.get(ORIGINAL_QUEUE_HEADER)) or queue,
        message_id=message.message_id,
        reason=reason,
        detail=header_text(headers.get(DEAD_LETTER_DETAIL_HEADER)),
        delivery_count=header_count(deliveries) if deliveries is not None else header_count(death.get("count") if death else 0),
        dead_lettered_at=dead_lettered_at if isinstance(dead_lettered_at, dt.datetime) else None,
        enqueued_at=message.timestamp if isinstance(message.timestamp, dt.datetime) else None,
        operation_key=header_text(headers.get(OPERATION_ID_HEADER)) or None,
        headers=headers,
        body=message.body,
        sender=message.user_id or None,
    )


def _first_death(headers: Mapping[str, Any]) -> dict[str, Any]:
    deaths = headers.get("x-death")
    if isinstance(deaths, list) and deaths and isinstance(deaths[-1], Mapping):
        return dict(deaths[-1])  # the oldest death is last
    return {}
