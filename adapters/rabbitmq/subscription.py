"""One subscribed queue: its topology, its own channel (prefetch, copies), its consumer.

Each subscription consumes on a channel of its own, so a channel the broker closes (or one
:meth:`RabbitMQDelivery._abandon` closes) and a consumer the broker cancels (its queue was
deleted, a quorum leader moved) touch only this subscription: the consumer re-creates it alone,
while the other subscriptions' channels stay open and their in-flight deliveries keep settling.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractIncomingMessage, AbstractQueue

from consumer_kit.broker import DeliveryCallback, build_delivery
from consumer_kit.resilience.one_shots import OneShots

from . import acks
from .connection import close_channel_soon
from .delivery import RabbitMQDelivery
from .errors import describe
from .topology import QueueDeclarer, QueueNames

logger = logging.getLogger(__name__)


class Subscription:
    """One queue, consumed on a channel of its own.

    Args:
        names: the queue's names (work queue, DLQ, retry tiers).
        callback: called once per delivery (by the consumer, in a task of its own).
        prefetch: basic.qos prefetch count of the channel.
        declarer: declares the queue's topology before every (re)start.
        settle_timeout: seconds; passed to each delivery.
        max_message_size: bytes; passed to each delivery (its copies are checked against it).
        dispatch: the consumer's hand-over of a new delivery.
        wanted: whether the consumer wants this queue consumed right now (False while paused
            or stopping); read under this subscription's lock, so a pause is never missed.
        on_lost: told ``(subscription, what)`` when the broker closed this channel or cancelled
            this consumer.
    """

    def __init__(
        self,
        names: QueueNames,
        callback: DeliveryCallback,
        prefetch: int,
        *,
        declarer: QueueDeclarer,
        settle_timeout: float,
        max_message_size: int,
        dispatch: Callable[[Subscription, RabbitMQDelivery], None],
        wanted: Callable[[], bool],
        on_lost: Callable[[Subscription, str], None],
    ) -> None:
        self.names = names
        self.callback = callback
        self.prefetch = prefetch
        self.channel: AbstractChannel | None = None
        self._declarer = declarer
        self._settle_timeout = settle_timeout
        self._max_message_size = max_message_size
        self._dispatch = dispatch
        self._wanted = wanted
        self._on_lost = on_lost
        self._queue: AbstractQueue | None = None
        self._consumer_tag: str | None = None
        self._lock = asyncio.Lock()  # one state change (open, consume, cancel) at a time
        self.recovery: asyncio.Task[None] | None = None  # set by the consumer while re-creating
        self._rejects = OneShots()

    @property
    def queue(self) -> str:
        return self.names.queue

    async def open(self, connection: AbstractConnection) -> None:
        """Declare the topology, then (re)start on this subscription's channel: the open one
        when the broker only cancelled the consumer (its in-flight deliveries stay settleable),
        else a new one with confirms and ``prefetch``. Consumes when ``wanted()``.

        Raises:
            aio_pika.exceptions.AMQPError, OSError, TimeoutError: the broker refused or the
                connection failed; nothing is left half-started but the channel.
        """
        async with self._lock:
            declared = await self._declarer.declare(connection, self.names)
            channel = self.channel
            if channel is None or channel.is_closed:
                channel = await self._open_channel(connection)
            self._consumer_tag = None  # any earlier consumer is gone (cancelled or its channel)
            self._queue = await channel.declare_queue(
                self.queue,
                durable=declared.durable,
                arguments=declared.arguments or None,
                passive=declared.passive,
            )
            if self._wanted():
                self._consumer_tag = await self._consume(self._queue, channel)

    async def sync_consumer(self, timeout: float) -> None:
        """Start or cancel this queue's consumer on its open channel as ``wanted()`` says,
        keeping the channel; deliveries already handed out stay settleable. Bounded by
        ``timeout`` seconds; a channel that is gone has no consumer left (the consumer re-creates
        it)."""
        async with self._lock:
            on = self._wanted()
            queue, tag = self._queue, self._consumer_tag
            if queue is None or self.channel is None or self.channel.is_closed:
                self._consumer_tag = None
                return
            try:
                async with asyncio.timeout(timeout):
                    if on and tag is None:
                        self._consumer_tag = await self._consume(queue, self.channel)
                    elif not on and tag is not None:
                        self._consumer_tag = None
                        await queue.cancel(tag)
            except Exception as exc:  # noqa: BLE001 - a lost channel is re-created by the consumer
                logger.warning(
                    "%s consumer on queue=%s failed (%s)",
                    "starting" if on else "cancelling", self.queue, describe(exc),
                )

    def forget(self) -> None:
        """The connection is gone: so are the channel and the consumer."""
        self.channel = self._queue = self._consumer_tag = None

    async def _open_channel(self, connection: AbstractConnection) -> AbstractChannel:
        # on_return_raises: a retry or release copy whose queue is gone raises instead of
        # counting as confirmed.
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        try:
            underlay = await channel.get_underlay_channel()
            underlay.on_consumer_cancel_callbacks.add(self._on_consumer_cancelled)
            await channel.set_qos(prefetch_count=self.prefetch)
        except BaseException:
            await close_channel_soon(channel, self._settle_timeout)  # half-made: never reused
            raise
        channel.close_callbacks.add(self._on_channel_closed)
        self.channel = channel
        return channel

    def _on_channel_closed(self, channel: Any, exc: BaseException | None = None) -> None:
        if channel is not self.channel:
            return  # an earlier channel of this subscription
        self._consumer_tag = None
        self._on_lost(self, f"channel closed ({describe(exc)})")

    def _on_consumer_cancelled(self, frame: Any) -> None:
        if frame.consumer_tag is None or frame.consumer_tag != self._consumer_tag:
            return
        self._consumer_tag = None
        self._on_lost(self, "consumer cancelled by the broker")

    async def _consume(self, queue: AbstractQueue, channel: AbstractChannel) -> str:
        async def on_message(message: AbstractIncomingMessage) -> None:
            acks.hold(message)  # unacked until the frame settling it is written
            delivery = build_delivery(
                lambda: RabbitMQDelivery(
                    message,
                    channel=channel,  # the channel it came on: its copies, its ack, its abandon
                    names=self.names,
                    settle_timeout=self._settle_timeout,
                    max_message_size=self._max_message_size,
                ),
                unbuildable=lambda _detail: self._reject_unmappable(message),
                what=f"queue={self.queue} message_id={message.message_id}",
            )
            if delivery is not None:
                self._dispatch(self, delivery)

        return str(await queue.consume(on_message, no_ack=False))

    def _reject_unmappable(self, message: AbstractIncomingMessage) -> None:
        """A message that cannot be mapped onto a delivery: basic.reject without requeue, so the
        queue's dead-letter exchange moves it, unchanged, to ``<queue>.dlq`` (``x-death`` reason
        ``rejected``; why is logged)."""
        self._rejects.start(self._reject(message), name=f"consumer-kit rabbitmq reject {self.queue}")

    @staticmethod
    async def _reject(message: AbstractIncomingMessage) -> None:
        await message.reject(requeue=False)
        acks.settled(message)
