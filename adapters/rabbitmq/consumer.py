"""The consuming side: one connection, a channel per subscription, recovery, pause and resume.

Recovery, by what was lost:

* **one subscription's channel or consumer** (the broker closed the channel, cancelled the
  consumer because its queue was deleted, or a delivery abandoned the channel): only that
  subscription is re-created (topology, channel, qos, consumer), backing off from 0.1 s to 5 s;
  other subscriptions keep their channels and in-flight deliveries.
* **the connection**: every subscription is re-created on a new connection, backing off the same
  way for as long as the consumer is open; an outage longer than ``reconnect_timeout`` is logged
  at ERROR.

:meth:`RabbitMQConsumer.pause` cancels every consumer (basic.cancel) and keeps the channels, so
deliveries in flight still settle; :meth:`~RabbitMQConsumer.resume` consumes again. A delivery
that arrives while paused (it was on the wire when the cancel was sent) is released at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from aio_pika.abc import AbstractConnection
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type

from consumer_kit.broker import Consumer, DeliveryCallback, hand_over
from consumer_kit.codec.redaction import redact_url
from consumer_kit.resilience.one_shots import OneShots
from consumer_kit.resilience.supervised import Supervised, all_running

from .connection import (
    BACKOFF,
    close_quietly,
    connect_retrying,
    is_open,
    log_retries,
    open_connection,
)
from .delivery import RabbitMQDelivery
from .limits import DEFAULT_MAX_MESSAGE_SIZE
from .subscription import Subscription
from .topology import QueueDeclarer, QueueNames, broker_delivery_limit

logger = logging.getLogger(__name__)


class RabbitMQConsumer(Consumer):
    """Consume RabbitMQ queues with manual ack, delayed retry queues and a DLQ.

    Args:
        url: AMQP URL, e.g. ``amqp://guest:guest@127.0.0.1:5672/``.
        max_deliveries: the runtime's bound on handler faults; with ``crash_limit`` it sets the
            broker's ``x-delivery-limit`` loop guard (:func:`broker_delivery_limit`).
        retry_delays: retry delay tiers in seconds (>= 0); one retry queue per distinct
            non-zero millisecond value. A zero delay (or no tiers) retries immediately.
        queue_type: ``"quorum"`` (default; exact ``x-delivery-count``) or ``"classic"``.
        crash_limit: the runtime's bound on crashes of one message (see ``max_deliveries``).
        reconnect_timeout: seconds. Bounds the first connection made by :meth:`subscribe`
            (``ConnectionError`` after it) and each recovery attempt (module docstring).
        handler_timeout: the runtime's handler timeout in seconds, only checked against
            ``consumer_timeout`` (WARNING when not below it).
        consumer_timeout: the broker's ``consumer_timeout`` in seconds (RabbitMQ default 1800):
            a delivery unacked for longer closes the channel.
        settle_timeout: seconds; the bound on each settlement (and on cancelling a consumer).
        max_message_size: bytes; retry, release and dead-letter copies larger than this are not
            sent (RabbitMQ 3.10 default 128 MiB).

    Raises:
        ValueError: on invalid arguments.

    Attributes:
        reconnects: how many times the connection (with every subscription) was re-created.
        resubscribes: how many times a single subscription was re-created on a live connection.
    """

    def __init__(
        self,
        url: str,
        *,
        max_deliveries: int,
        retry_delays: Sequence[float],
        queue_type: str = "quorum",
        crash_limit: int = 3,
        reconnect_timeout: float = 30.0,
        handler_timeout: float | None = None,
        consumer_timeout: float = 1800.0,
        settle_timeout: float = 10.0,
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
    ) -> None:
        if max_deliveries < 1 or crash_limit < 1:
            raise ValueError("max_deliveries and crash_limit must be >= 1")
        if any(d < 0 for d in retry_delays):
            raise ValueError("retry_delays must be >= 0 seconds")
        if reconnect_timeout <= 0 or settle_timeout <= 0:
            raise ValueError("reconnect_timeout and settle_timeout must be > 0 seconds")
        if handler_timeout is not None and handler_timeout >= consumer_timeout:
            logger.warning(
                "handler_timeout=%ss is not below RabbitMQ's consumer_timeout=%ss: the broker "
                "closes the channel under a slow handler and redelivers its messages",
                handler_timeout, consumer_timeout,
            )
        self._url = url
        self._retry_delays = tuple(retry_delays)
        self._declarer = QueueDeclarer(
            queue_type=queue_type,
            delivery_limit=broker_delivery_limit(max_deliveries, crash_limit),
            max_deliveries=max_deliveries,
        )
        self._reconnect_timeout = reconnect_timeout
        self._settle_timeout = settle_timeout
        self._max_message_size = max_message_size
        self._subscriptions: dict[str, Subscription] = {}
        self._connection: AbstractConnection | None = None
        self._generation = 0  # +1 per connection: callbacks of an older one are ignored
        self._lost = asyncio.Event()
        self._lock = asyncio.Lock()  # one (re)start of connection or subscription at a time
        self._supervisor = Supervised("consumer-kit rabbitmq supervisor", self._supervise)
        self._handlers = OneShots()
        self._reconnecting = False
        self._paused = False
        self._consuming = True
        self._closed = False
        self.reconnects = 0
        self.resubscribes = 0

    @property
    def connected(self) -> bool:
        """True while the connection is open and no loss is pending."""
        return is_open(self._connection) and not self._lost.is_set()

    @property
    def ready(self) -> bool:
        """True while the connection is up and not being re-created (readiness)."""
        return self.connected and not self._reconnecting and all_running([self._supervisor])

    # -- Consumer API ------------------------------------------------------------------------

    async def subscribe(self, queue: str, callback: DeliveryCallback, *, prefetch: int) -> None:
        """Declare ``queue``'s topology (see :mod:`consumer_kit.adapters.rabbitmq.topology`) and start
        consuming it with at most ``prefetch`` unacked deliveries, calling ``callback`` once per
        delivery in its own task (not while paused).

        Raises:
            ValueError: ``queue`` is already subscribed or ``prefetch`` < 1.
            RuntimeError: the consumer was stopped or closed.
            ConnectionError: no connection within ``reconnect_timeout`` seconds.
            aio_pika.exceptions.AMQPError: the broker refused a declaration or the consume.
        """
        if prefetch < 1:
            raise ValueError("prefetch must be >= 1")
        if self._closed or not self._consuming:
            raise RuntimeError("consumer is stopped")
        subscription = Subscription(
            self._names_for(queue), callback, prefetch,
            declarer=self._declarer,
            settle_timeout=self._settle_timeout,
            max_message_size=self._max_message_size,
            dispatch=self._dispatch,
            wanted=self._wants_deliveries,
            on_lost=self._on_subscription_lost,
        )
        async with self._lock:
            if queue in self._subscriptions:
                raise ValueError(f"queue {queue!r} is already subscribed")
            connection = await self._ensure_connection()
            await subscription.open(connection)
            self._subscriptions[queue] = subscription
        self._supervisor.start()  # idempotent
        logger.info("consuming queue=%s prefetch=%s", queue, prefetch)

    async def declare(self, queue: str) -> list[str]:
        """Declare ``queue``'s topology exactly as :meth:`subscribe` does (DLQ, one retry queue
        per delay tier, the work queue; :mod:`consumer_kit.adapters.rabbitmq.topology`), without consuming.
        Returns the names, work queue first.

        Raises:
            RuntimeError: the consumer was closed.
            ConnectionError: no connection within ``reconnect_timeout`` seconds (a missing vhost
                or refused login at once).
            aio_pika.exceptions.AMQPError: the broker refused a declaration.
        """
        if self._closed:
            raise RuntimeError("consumer is closed")
        names = self._names_for(queue)
        async with self._lock:
            connection = await self._ensure_connection()
            await self._declarer.declare(connection, names)
        return [names.queue, names.dlq, *(name for _, name in names.retry_tiers)]

    async def pause(self) -> None:
        """Cancel every consumer, keeping the channels: no new deliveries until :meth:`resume`;
        deliveries in flight still settle. Idempotent; each cancel is bounded by
        ``settle_timeout`` seconds."""
        if self._paused:
            return
        self._paused = True
        for subscription in list(self._subscriptions.values()):
            await subscription.sync_consumer(self._settle_timeout)
        logger.info("paused consuming queues=%s", ",".join(self._subscriptions))

    async def resume(self) -> None:
        """Consume every subscribed queue again after :meth:`pause`. Idempotent."""
        if not self._paused:
            return
        self._paused = False
        if self._closed or not self._consuming:
            return
        for subscription in list(self._subscriptions.values()):
            await subscription.sync_consumer(self._settle_timeout)
        logger.info("resumed consuming queues=%s", ",".join(self._subscriptions))

    async def stop_consuming(self) -> None:
        """Cancel every consumer (no new deliveries) and stop recovering. Deliveries already
        handed out can still be settled while the connection lasts."""
        self._consuming = False
        await self._stop_supervisor()
        await self._stop_recoveries()
        for subscription in list(self._subscriptions.values()):
            await subscription.sync_consumer(self._settle_timeout)

    async def close(self) -> None:
        """Stop consuming and close the connection. Unsettled deliveries go back to the broker;
        callback tasks still running are cancelled."""
        if not self._closed:
            await self.stop_consuming()
            self._closed = True
        await self._handlers.cancel(self._settle_timeout)
        await self._drop_connection()

    def _wants_deliveries(self) -> bool:
        return self._consuming and not self._paused and not self._closed

    def _names_for(self, queue: str) -> QueueNames:
        return QueueNames.for_queue(queue, self._retry_delays)

    # -- deliveries --------------------------------------------------------------------------

    def _dispatch(self, subscription: Subscription, delivery: RabbitMQDelivery) -> None:
        # Our own task, not the channel's: a lost channel must not cancel a running handler
        # (its settlement then fails and the message comes back from the broker).
        self._handlers.start(self._handle(subscription, delivery))

    async def _handle(self, subscription: Subscription, delivery: RabbitMQDelivery) -> None:
        # Unwanted: it was on the wire when the consumer was cancelled (given back uncounted).
        await hand_over(delivery, subscription.callback, wanted=self._wants_deliveries())

    # -- one subscription lost ---------------------------------------------------------------

    def _on_subscription_lost(self, subscription: Subscription, what: str) -> None:
        if self._closed or not self._consuming or not self.connected:
            return  # shutting down, or the whole connection is being re-created
        if subscription.recovery is not None and not subscription.recovery.done():
            return
        logger.warning("queue=%s: %s; re-creating this subscription", subscription.queue, what)
        # one-shot: one recovery per subscription at a time, cancelled by close()
        subscription.recovery = asyncio.create_task(
            self._recover(subscription, self._generation),
            name=f"consumer-kit rabbitmq recover {subscription.queue}",
        )

    async def _recover(self, subscription: Subscription, generation: int) -> None:
        """Re-create ``subscription`` on the current connection, backing off, until it works or
        the connection is lost (then the supervisor re-creates everything)."""

        def connection_replaced(_: RetryCallState) -> bool:
            return generation != self._generation or self._closed or not self._consuming

        async for attempt in AsyncRetrying(
            wait=BACKOFF,
            stop=connection_replaced,
            before_sleep=log_retries(f"re-creating the subscription of queue={subscription.queue}"),
            retry_error_callback=lambda _state: None,  # gave up: the supervisor takes over
        ):
            with attempt:
                async with self._lock:
                    if connection_replaced(attempt.retry_state) or not self.connected:
                        return
                    assert self._connection is not None
                    async with asyncio.timeout(self._reconnect_timeout):
                        await subscription.open(self._connection)
                    self.resubscribes += 1
                    logger.info("queue=%s: subscription re-created", subscription.queue)

    async def _stop_recoveries(self) -> None:
        tasks = [s.recovery for s in self._subscriptions.values() if s.recovery is not None]
        for subscription in self._subscriptions.values():
            subscription.recovery = None
        for task in tasks:
            if task is not asyncio.current_task():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- the connection ----------------------------------------------------------------------

    async def _ensure_connection(self) -> AbstractConnection:
        if self._connection is not None and is_open(self._connection):
            return self._connection
        await connect_retrying(self._url, self._connect, within=self._reconnect_timeout)
        assert self._connection is not None
        return self._connection

    async def _connect(self) -> None:
        await self._drop_connection()
        connection = await open_connection(
            self._url, timeout=self._reconnect_timeout, name="consumer-kit consumer"
        )
        self._generation += 1
        self._lost.clear()
        connection.close_callbacks.add(self._on_connection_lost(self._generation))
        self._connection = connection

    async def _drop_connection(self) -> None:
        connection, self._connection = self._connection, None
        self._generation += 1  # callbacks of the old connection no longer count
        for subscription in self._subscriptions.values():
            subscription.forget()
        await close_quietly(connection, self._settle_timeout, "consumer")

    def _on_connection_lost(self, generation: int) -> Any:
        def callback(*_: Any) -> None:
            if generation != self._generation or self._closed or not self._consuming:
                return
            if not self._lost.is_set():
                logger.warning("RabbitMQ connection lost; every subscription will be re-created")
            self._lost.set()

        return callback

    async def _supervise(self) -> None:
        """Wait for a connection loss, then reconnect and re-create every subscription."""
        while self._consuming and not self._closed:
            await self._lost.wait()
            if not self._consuming or self._closed:
                return
            self._reconnecting = True
            try:
                await self._stop_recoveries()
                async with self._lock:
                    await self._reconnect_all()
            finally:
                self._reconnecting = False
            self.reconnects += 1
            logger.info(
                "reconnected to RabbitMQ; subscriptions re-created for queues=%s",
                ",".join(self._subscriptions),
            )

    async def _reconnect_all(self) -> None:
        async for attempt in AsyncRetrying(
            wait=BACKOFF,
            retry=retry_if_exception_type(Exception),
            before_sleep=log_retries(
                f"reconnecting to RabbitMQ at {redact_url(self._url)}",
                alert_after=self._reconnect_timeout,
            ),
        ):
            with attempt:
                async with asyncio.timeout(self._reconnect_timeout):
                    await self._open_all()

    async def _open_all(self) -> None:
        await self._connect()
        assert self._connection is not None
        for subscription in self._subscriptions.values():
            await subscription.open(self._connection)

    async def _stop_supervisor(self) -> None:
        await self._supervisor.stop()
