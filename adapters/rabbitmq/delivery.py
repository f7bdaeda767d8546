"""One RabbitMQ delivery under manual ack, and how each settlement reaches the broker.

=============  =====================================================================================
settlement     on RabbitMQ
=============  =====================================================================================
ack            basic.ack (AMQP has no reply to it: it counts as done once written to the socket)
retry(delay)   a confirmed copy to the retry tier for ``delay`` (or the work queue for 0) with
               ``x-consumer-kit-deliveries = delivery_count``, then basic.ack
dead_letter    a confirmed copy to ``<queue>.dlq`` with ``x-dead-letter-reason``/``-detail``,
               ``x-original-queue`` and ``x-consumer-kit-deliveries = delivery_count``, then basic.ack
release        a confirmed copy to the work queue with ``x-consumer-kit-deliveries =
               delivery_count - 1`` (uncounted) and ``x-consumer-kit-redelivered: 1`` only when
               this delivery was itself a redelivery (a suspect stays a suspect), then basic.ack.
               Never a broker redelivery: graceful restarts neither mark a healthy message
               ``redelivered`` nor move it towards the broker's ``x-delivery-limit``
=============  =====================================================================================

Copies are published on the delivery's own channel with publisher confirms *before* the original is
acked (at least once). When a copy cannot be confirmed (nacked, returned because its queue is gone,
or too large even after trimming), retry and release fall back to ``basic.nack(requeue=True)``
and set ``lost`` (the broker now redelivers it as a redelivery, which the runtime must excuse);
a dead-letter copy that cannot fit the frame is ``basic.reject(requeue=False)``-ed instead, so the
work queue's own dead-letter exchange moves the original to ``<queue>.dlq`` (reason ``rejected``
in ``x-death``), without looping and without closing the channel (an existing queue without
dead-letter settings, warned about at start-up, drops it: logged at ERROR).

The base class bounds each settlement by ``settle_timeout`` seconds; when one fails or overruns,
:meth:`RabbitMQDelivery._abandon` closes the delivery's channel, so the broker redelivers every
delivery still unacked on it (never one left unacked on a live channel).
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
from typing import Any

import aio_pika
import aiormq.exceptions
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage
from pamqp.commands import Basic

from consumer_kit.broker import AckGroup, Delivery
from consumer_kit.codec import headers as own_headers

from . import acks
from .connection import close_channel_soon
from .envelope import (
    DEAD_LETTER_DETAIL_HEADER,
    DEAD_LETTER_REASON_HEADER,
    DELIVERIES_HEADER,
    DETAIL_MAX_CHARS,
    ORIGINAL_QUEUE_HEADER,
    REDELIVERED_HEADER,
    SENDER_HEADER,
    copy_headers,
    delivery_count_of,
    own_user_of,
    sender_of,
)
from .errors import Unsendable
from .limits import fit_headers, frame_max_of
from .topology import QueueNames

logger = logging.getLogger(__name__)

# The broker answered the copy but did not take it: try the fallback on the same, healthy channel.
_NOT_TAKEN = (aiormq.exceptions.DeliveryError, aiormq.exceptions.PublishError, Unsendable)

# Seconds _abandon waits for the broker to confirm a channel close; the close goes on after it.
_ABANDON_WAIT = 1.0


class RabbitMQDelivery(Delivery):
    """One RabbitMQ delivery (settlement table in the module docstring).

    ``redelivered`` is the broker's own flag or the ``x-consumer-kit-redelivered`` header of a
    released suspect; ``correlation_id`` is the AMQP ``correlation_id`` property; ``sender`` the
    validated ``user_id`` (or, on a copy, the sender it carries: :mod:`consumer_kit.adapters.rabbitmq.envelope`); ``partition_key``
    and ``enqueued_at`` are ``None`` (RabbitMQ has no ordering key and records no enqueue time).

    Args:
        message: the aio-pika message, delivered with manual ack.
        channel: the channel it came on (copies are published on it; :meth:`_abandon` closes it).
        names: the subscription's queue names.
        settle_timeout: seconds; the bound the base class puts on each settlement.
        max_message_size: bytes; copies larger than this are not sent.
    """

    def __init__(
        self,
        message: AbstractIncomingMessage,
        *,
        channel: AbstractChannel,
        names: QueueNames,
        settle_timeout: float,
        max_message_size: int,
    ) -> None:
        reading = own_headers.read(message.headers or {}, message.body)
        broker_redelivered = bool(message.redelivered)
        self._own_user = own_user_of(message.channel)
        super().__init__(
            queue=names.queue,
            message_id=message.message_id,
            headers=reading.headers,
            body=message.body,
            delivery_count=delivery_count_of(reading, broker_redelivered),
            redelivered=broker_redelivered or reading.suspect,
            correlation_id=message.correlation_id,
            # RabbitMQ stamps no enqueue time: the AMQP timestamp property is the producer's.
            enqueued_at=_aware(message.timestamp),
            sender=sender_of(message.user_id, reading.headers),
            settle_timeout=settle_timeout,
        )
        self._message = message
        self._channel = channel
        self._names = names
        self._max_message_size = max_message_size

    async def _ack(self) -> None:
        await self._message.ack()
        acks.settled(self._message)

    @classmethod
    def _ack_groups(cls, deliveries: list[Any]) -> tuple[list[AckGroup], list[Any]]:
        """Per channel, the deliveries whose tags are that channel's lowest unacked ones: one
        multiple ``basic.ack`` of the highest (:mod:`consumer_kit.adapters.rabbitmq.acks`); the
        others ack alone."""
        by_channel: dict[int, list[RabbitMQDelivery]] = {}
        for delivery in deliveries:
            by_channel.setdefault(id(delivery._message.channel), []).append(delivery)
        groups: list[AckGroup] = []
        alone: list[Any] = []
        for members in by_channel.values():
            members.sort(key=lambda d: d._message.delivery_tag or 0)
            n = acks.multiple_ack_prefix([d._message for d in members])
            if n < 2:
                alone += members
                continue
            together = members[:n]
            groups.append(AckGroup(together, functools.partial(_ack_up_to, together)))
            alone += members[n:]
        return groups, alone

    async def _retry(self, delay: float) -> None:
        headers = copy_headers(self.headers_for_copies)
        headers[DELIVERIES_HEADER] = self.delivery_count
        target = self._names.retry_queue_for(delay)
        if not await self._copy_then_ack(target, headers, "retry"):
            await self._requeue_instead("retry")

    async def _dead_letter(self, reason: str, detail: str) -> None:
        headers = copy_headers(self.headers_for_copies)
        headers[DELIVERIES_HEADER] = self.delivery_count
        headers[DEAD_LETTER_REASON_HEADER] = reason
        headers[DEAD_LETTER_DETAIL_HEADER] = detail[:DETAIL_MAX_CHARS]
        headers[ORIGINAL_QUEUE_HEADER] = self.queue
        try:
            properties, trimmed = self._fit(headers)
        except Unsendable as exc:
            # The broker's own dead-lettering moves the original, unchanged, to the DLQ.
            logger.error(
                "dead-letter copy does not fit (%s); rejecting the original into %s via the queue's "
                "dead-letter exchange (queue=%s message_id=%s reason=%s)",
                exc, self._names.dlq, self.queue, self.message_id, reason,
            )
            await self._message.reject(requeue=False)
            acks.settled(self._message)
            return
        if not await self._publish_then_ack(self._names.dlq, properties, trimmed, "dead_letter"):
            await self._requeue_instead("dead_letter")

    async def _release(self) -> None:
        headers = copy_headers(self.headers_for_copies)
        headers[DELIVERIES_HEADER] = self.delivery_count - 1  # this delivery does not count
        if self.redelivered:
            headers[REDELIVERED_HEADER] = 1
        if not await self._copy_then_ack(self.queue, headers, "release"):
            await self._requeue_instead("release")

    async def _abandon(self) -> None:
        logger.warning(
            "abandoning the channel of queue=%s message_id=%s: the broker redelivers its unacked "
            "deliveries", self.queue, self.message_id,
        )
        await close_channel_soon(self._channel, min(_ABANDON_WAIT, self.settle_timeout))

    # -- copies ------------------------------------------------------------------------------

    async def _copy_then_ack(self, queue: str, headers: dict[str, Any], why: str) -> bool:
        """Publish a copy with ``headers`` to ``queue``, wait for its confirm, then ack the
        original. False when the copy was not taken (logged): the original is still unacked."""
        try:
            properties, trimmed = self._fit(headers)
        except Unsendable as exc:
            logger.warning(
                "%s copy to %s does not fit (%s) (queue=%s message_id=%s)",
                why, queue, exc, self.queue, self.message_id,
            )
            return False
        return await self._publish_then_ack(queue, properties, trimmed, why)

    async def _publish_then_ack(
        self, queue: str, properties: Basic.Properties, trimmed: list[str], why: str
    ) -> bool:
        if trimmed:
            logger.warning(
                "%s copy to %s left out %s header(s) to fit the frame: %s (queue=%s message_id=%s)",
                why, queue, len(trimmed), ",".join(trimmed)[:300], self.queue, self.message_id,
            )
        underlay = self._message.channel
        try:
            # mandatory + the channel's on_return_raises: an unroutable copy raises, never
            # counts as confirmed. No timeout here: the base class bounds the whole settlement.
            await underlay.basic_publish(
                self.body, exchange="", routing_key=queue, properties=properties, mandatory=True
            )
        except _NOT_TAKEN as exc:
            logger.warning(
                "%s copy to %s not taken by the broker (%s) (queue=%s message_id=%s)",
                why, queue, type(exc).__name__, self.queue, self.message_id,
            )
            return False
        logger.debug(
            "%s copy confirmed on %s (queue=%s message_id=%s delivery_count=%s)",
            why, queue, self.queue, self.message_id, self.delivery_count,
        )
        await self._message.ack()
        acks.settled(self._message)
        return True

    async def _requeue_instead(self, why: str) -> None:
        """The copy was not taken: give the original back with basic.nack(requeue=True). The
        broker redelivers it as a redelivery, so the delivery counts as ``lost`` (the runtime
        excuses that redelivery)."""
        await self._message.nack(requeue=True)
        acks.settled(self._message)
        self.lost = True
        logger.warning(
            "%s fell back to nack-requeue (queue=%s message_id=%s): it comes back as a redelivery",
            why, self.queue, self.message_id,
        )

    def _fit(self, headers: dict[str, Any]) -> tuple[Basic.Properties, list[str]]:
        return fit_headers(
            headers,
            self._properties,
            len(self.body),
            frame_max=frame_max_of(self._message.channel),
            max_message_size=self._max_message_size,
        )

    def _properties(self, headers: dict[str, Any]) -> Basic.Properties:
        """The original's properties with ``headers``, persistent, without an expiration; sent as
        the worker's own user, with the original's sender (module :mod:`consumer_kit.adapters.rabbitmq.envelope`)."""
        original = self._message
        headers = {**headers, SENDER_HEADER: self.sender or ""}
        return aio_pika.Message(
            body=b"",
            headers=own_headers.seal(dict(headers), self.body),
            content_type=original.content_type,
            content_encoding=original.content_encoding,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            priority=original.priority,
            correlation_id=original.correlation_id,
            reply_to=original.reply_to,
            message_id=original.message_id,
            timestamp=original.timestamp,
            type=original.type,
            app_id=original.app_id,
            user_id=self._own_user,
        ).properties


async def _ack_up_to(members: list[RabbitMQDelivery]) -> None:
    """One ``basic.ack`` with ``multiple`` of the highest tag: every member (and, by the check of
    :meth:`RabbitMQDelivery._ack_groups`, nothing else) is acked."""
    await members[-1]._message.ack(multiple=True)
    acks.settled_all([delivery._message for delivery in members])


def _aware(value: dt.datetime | None) -> dt.datetime | None:
    """AMQP timestamps are whole seconds since the epoch; aio-pika gives them naive (UTC)."""
    if value is None:
        return None
    return value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)
