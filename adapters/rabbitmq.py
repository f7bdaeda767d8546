"""RabbitMQ adapter (aio-pika): deliveries in, settlement, publishers out.

Topology declared by :meth:`RabbitMQConsumer.subscribe` for a work queue ``<queue>``
(all durable, idempotent, quorum by default):

* ``<queue>``: the work queue. Dead-letters through the default exchange to ``<queue>.dlq``
  (``x-dead-letter-exchange=""``, ``x-dead-letter-routing-key=<queue>.dlq``), so a message the
  broker itself dead-letters (quorum ``x-delivery-limit``) lands in the DLQ instead of being
  dropped. Quorum queues also get ``x-delivery-limit`` (see :func:`broker_delivery_limit`) and
  ``x-dead-letter-strategy=at-least-once`` (with ``x-overflow=reject-publish``, which that
  strategy requires).
* ``<queue>.dlq``: the dead-letter queue. :meth:`RabbitMQDelivery.dead_letter` publishes a copy
  here with headers ``x-dead-letter-reason``, ``x-dead-letter-detail``, ``x-original-queue`` and
  ``x-consumer-kit-deliveries``.
* ``<queue>.retry.<ms>ms``: one retry queue per delay tier, ``x-message-ttl=<ms>``, dead-lettering
  back to ``<queue>`` through the default exchange. RabbitMQ has no delayed-message plugin here,
  and per-message ``expiration`` only expires at the head of a queue, hence one queue per tier.

Delivery count (``Delivery.delivery_count``)::

    delivery_count = earlier_copies + this_copy
    earlier_copies = int(headers["x-consumer-kit-deliveries"])        (0 when absent)
    this_copy      = headers["x-delivery-count"] + 1   on a quorum queue (absent on the 1st delivery)
                   = 2 if redelivered else 1           on a classic queue (a lower bound)

A retry republishes a copy (a new message for the broker, whose own count restarts), so the copy
carries ``x-consumer-kit-deliveries = delivery_count`` of the delivery that was retried; the
broker-owned ``x-delivery-count`` header is not copied.

Settlement never raises and never hangs: each broker step is bounded by ``settle_timeout``
seconds; when the channel is gone the message simply comes back from the broker and the runtime
handles it as a duplicate. A retry or dead-letter copy is published with publisher confirms
*before* the original is acked (at least once); when the copy is not confirmed, the original is
nacked with requeue instead, so it is never lost and never stuck.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aio_pika
import aiormq
from aio_pika.abc import (
    AbstractChannel,
    AbstractConnection,
    AbstractExchange,
    AbstractIncomingMessage,
    AbstractQueue,
)
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    retry_if_not_exception_type,
    stop_after_delay,
    wait_exponential,
)

from consumer_kit.broker import (
    Consumer,
    Delivery,
    DeliveryCallback,
    OutgoingMessage,
    Publisher,
    PublishError,
    settle_quietly,
)
from consumer_kit.settings import redact_url

logger = logging.getLogger(__name__)

# Connection errors that retrying cannot fix (credentials, permissions, missing vhost).
_REFUSED = (aiormq.exceptions.AuthenticationError, aiormq.exceptions.ProbableAuthenticationError,
            aiormq.exceptions.ConnectionNotAllowed)


async def _close_quietly(connection: AbstractConnection | None, timeout: float, whose: str) -> None:
    """Close ``connection`` within ``timeout`` seconds, ignoring errors: it is going away either way."""
    if connection is None or connection.is_closed:
        return
    try:
        await asyncio.wait_for(connection.close(), timeout)
    except Exception as exc:  # noqa: BLE001 - it is going away either way
        logger.debug("closing the %s connection failed (%s)", whose, type(exc).__name__)


def _describe(exc: BaseException | None) -> str:
    """``"ErrorClass: first line"`` of an exception, for one-line logs and errors."""
    if exc is None:
        return "unknown error"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__

DELIVERIES_HEADER = "x-consumer-kit-deliveries"
"""Header on a republished copy: how many deliveries the message had before this copy."""

DEAD_LETTER_REASON_HEADER = "x-dead-letter-reason"
DEAD_LETTER_DETAIL_HEADER = "x-dead-letter-detail"
ORIGINAL_QUEUE_HEADER = "x-original-queue"
MESSAGE_TYPE_HEADER = "message-type"

QUEUE_TYPES = ("quorum", "classic")

# Broker-owned headers that must not travel on a republished copy: a quorum queue would read
# a copied x-delivery-count as its own.
_BROKER_HEADERS = frozenset({"x-delivery-count"})

# Pause between reconnect attempts: 0.1 s, 0.2 s, 0.4 s, ... at most this many seconds.
_MAX_BACKOFF = 5.0


def broker_delivery_limit(max_deliveries: int) -> int:
    """The ``x-delivery-limit`` declared on a quorum work queue: comfortably above
    ``max_deliveries`` (``max_deliveries + max(5, max_deliveries)``), so consumer-kit dead-letters
    with its own reason first, and the broker's limit only catches messages that crash workers
    or are released again and again (shutdowns)."""
    return max_deliveries + max(5, max_deliveries)


def delivery_count_of(headers: Mapping[str, Any], redelivered: bool) -> int:
    """The 1-based delivery count of a RabbitMQ delivery (formula in the module docstring)."""
    earlier = _as_int(headers.get(DELIVERIES_HEADER))
    broker_count = headers.get("x-delivery-count")
    if broker_count is not None:
        this_copy = _as_int(broker_count) + 1
    else:
        this_copy = 2 if redelivered else 1
    return earlier + this_copy


def _as_int(value: Any) -> int:
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    try:
        return max(0, int(value))
    except (TypeError, ValueError):
        return 0


def _ms(delay: float) -> int:
    return round(delay * 1000)


@dataclass(frozen=True)
class _Topology:
    """Queue names of one subscription."""

    queue: str
    dlq: str
    retry_tiers: tuple[tuple[float, str], ...]  # (delay in seconds, queue name), ascending

    @classmethod
    def for_queue(cls, queue: str, retry_delays: Sequence[float]) -> _Topology:
        tiers = sorted({_ms(d) for d in retry_delays if _ms(d) > 0})
        return cls(
            queue=queue,
            dlq=f"{queue}.dlq",
            retry_tiers=tuple((ms / 1000, f"{queue}.retry.{ms}ms") for ms in tiers),
        )

    def retry_queue_for(self, delay: float) -> str:
        """The smallest tier >= ``delay`` (or the largest); the work queue itself for ``delay``
        0 or when there are no tiers."""
        if delay <= 0 or not self.retry_tiers:
            return self.queue
        for tier_delay, name in self.retry_tiers:
            if tier_delay >= delay:
                return name
        return self.retry_tiers[-1][1]


class RabbitMQDelivery(Delivery):
    """One RabbitMQ delivery under manual ack (see the module docstring for the settlement
    rules and the ``delivery_count`` formula).

    Every settlement is bounded by ``settle_timeout`` seconds per broker step and never raises.
    """

    def __init__(
        self,
        message: AbstractIncomingMessage,
        *,
        channel: AbstractChannel,
        topology: _Topology,
        settle_timeout: float,
    ) -> None:
        headers = dict(message.headers or {})
        super().__init__(
            queue=topology.queue,
            message_id=message.message_id,
            headers=headers,
            body=message.body,
            delivery_count=delivery_count_of(headers, bool(message.redelivered)),
        )
        self._message = message
        self._channel = channel
        self._topology = topology
        self._settle_timeout = settle_timeout

    async def _ack(self) -> None:
        await settle_quietly(self._message.ack(), timeout=self._settle_timeout, what=self._what("ack"))

    async def _retry(self, delay: float, count: bool) -> None:
        target = self._topology.retry_queue_for(delay)
        headers = self._copy_headers()
        # the copy carries the deliveries before it; an uncounted retry leaves this one out
        headers[DELIVERIES_HEADER] = self.delivery_count if count else self.delivery_count - 1
        if await self._publish_copy(target, headers, "retry"):
            await self._ack()
        else:
            await self._release()

    async def _dead_letter(self, reason: str, detail: str) -> None:
        headers = self._copy_headers()
        headers[DELIVERIES_HEADER] = self.delivery_count
        headers[DEAD_LETTER_REASON_HEADER] = reason
        headers[DEAD_LETTER_DETAIL_HEADER] = detail
        headers[ORIGINAL_QUEUE_HEADER] = self.queue
        if await self._publish_copy(self._topology.dlq, headers, "dead_letter"):
            await self._ack()
        else:
            await self._release()

    async def _release(self) -> None:
        await settle_quietly(
            self._message.nack(requeue=True),
            timeout=self._settle_timeout,
            what=self._what("nack-requeue"),
        )

    def _copy_headers(self) -> dict[str, Any]:
        return {k: v for k, v in self.headers.items() if k not in _BROKER_HEADERS}

    async def _publish_copy(self, queue: str, headers: dict[str, Any], why: str) -> bool:
        """Publish a persistent copy to ``queue`` via the default exchange and wait for the
        confirm. True when confirmed and routed; False (logged) otherwise."""
        original = self._message
        copy = aio_pika.Message(
            body=self.body,
            headers=headers,
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
        )
        try:
            # The channel was opened with on_return_raises: an unroutable copy (its queue was
            # deleted) raises instead of counting as confirmed.
            await asyncio.wait_for(
                self._channel.default_exchange.publish(
                    copy, routing_key=queue, mandatory=True, timeout=self._settle_timeout
                ),
                self._settle_timeout,
            )
        except Exception as exc:  # noqa: BLE001 - any failure means "not confirmed"
            logger.warning(
                "%s copy to %s not confirmed (%s); requeueing the original (queue=%s message_id=%s)",
                why, queue, type(exc).__name__, self.queue, self.message_id,
            )
            return False
        logger.debug(
            "%s copy confirmed on %s (queue=%s message_id=%s delivery_count=%s)",
            why, queue, self.queue, self.message_id, self.delivery_count,
        )
        return True

    def _what(self, action: str) -> str:
        return f"{action} queue={self.queue} message_id={self.message_id}"


@dataclass
class _Subscription:
    topology: _Topology
    callback: DeliveryCallback
    prefetch: int
    # set while consuming on the current connection
    channel: AbstractChannel | None = None
    amqp_queue: AbstractQueue | None = None
    consumer_tag: str | None = None


@dataclass
class _Declared:
    durable: bool = True
    arguments: dict[str, Any] = field(default_factory=dict)
    passive: bool = False


_INEQUIVALENT = re.compile(
    r"inequivalent arg '(?P<arg>[^']+)' for queue .*?: "
    r"received (?P<received>.+?) but current is (?P<current>.+)$"
)
_TYPED_VALUE = re.compile(r"^the value '(?P<value>.*)' of type '(?P<type>\w+)'$")
_BARE_VALUE = re.compile(r"^'(?P<value>.*)'$")
_INT_TYPES = frozenset(
    {"byte", "short", "signedint", "long", "unsignedbyte", "unsignedshort", "unsignedint"}
)
_MISSING = object()


def _parse_inequivalent(text: str, wanted: Mapping[str, Any]) -> tuple[str, Any] | None:
    """Parse RabbitMQ's PRECONDITION_FAILED text into (argument, current value); the value is
    ``_MISSING`` when the existing queue lacks the argument. None when it can't be parsed."""
    match = _INEQUIVALENT.search(text)
    if match is None:
        return None
    arg, current = match["arg"], match["current"].strip()
    if current == "none":
        return arg, _MISSING
    typed = _TYPED_VALUE.match(current)
    bare = _BARE_VALUE.match(current)
    if typed is not None:
        value, kind = typed["value"], typed["type"]
    elif bare is not None:
        value, kind = bare["value"], ""
    else:
        return None
    numeric = value.lstrip("-").isdigit()
    if kind in _INT_TYPES or (kind == "" and isinstance(wanted.get(arg), int) and numeric):
        return arg, int(value)
    if kind == "bool" or arg == "durable":
        return arg, value == "true"
    return arg, value


class RabbitMQConsumer(Consumer):
    """Consume RabbitMQ queues with manual ack, delayed retry queues and a DLQ.

    Args:
        url: AMQP URL, e.g. ``amqp://guest:guest@127.0.0.1:5672/``.
        max_deliveries: the runtime's delivery limit; the broker's ``x-delivery-limit`` is set
            comfortably above it (:func:`broker_delivery_limit`), never below.
        retry_delays: retry delay tiers in seconds (>= 0); one retry queue per distinct
            non-zero millisecond value. A zero delay (or no tiers) retries immediately.
        queue_type: ``"quorum"`` (default; exact ``x-delivery-count``) or ``"classic"``.
        reconnect_timeout: seconds. Bounds the first connection made by :meth:`subscribe`
            (``ConnectionError`` after it) and each reconnect attempt. After a connection or
            channel loss the adapter reconnects and re-creates every consumer, backing off from
            0.1 s up to 5 s between attempts, for as long as it is open; an outage longer than
            ``reconnect_timeout`` is logged at ERROR.
        handler_timeout: the runtime's handler timeout in seconds, only checked against
            ``consumer_timeout`` (WARNING when not below it).
        consumer_timeout: the broker's ``consumer_timeout`` in seconds (RabbitMQ default 1800):
            a delivery unacked for longer closes the channel.
        settle_timeout: seconds; bounds every broker step of a settlement.

    Raises:
        ValueError: on invalid arguments.

    Attributes:
        reconnects: how many times consumers were re-created after a loss.
    """

    def __init__(
        self,
        url: str,
        *,
        max_deliveries: int,
        retry_delays: Sequence[float],
        queue_type: str = "quorum",
        reconnect_timeout: float = 30.0,
        handler_timeout: float | None = None,
        consumer_timeout: float = 1800.0,
        settle_timeout: float = 10.0,
    ) -> None:
        if max_deliveries < 1:
            raise ValueError("max_deliveries must be >= 1")
        if any(d < 0 for d in retry_delays):
            raise ValueError("retry_delays must be >= 0 seconds")
        if queue_type not in QUEUE_TYPES:
            raise ValueError(f"queue_type must be one of {QUEUE_TYPES}, not {queue_type!r}")
        if reconnect_timeout <= 0 or settle_timeout <= 0:
            raise ValueError("reconnect_timeout and settle_timeout must be > 0 seconds")
        if handler_timeout is not None and handler_timeout >= consumer_timeout:
            logger.warning(
                "handler_timeout=%ss is not below RabbitMQ's consumer_timeout=%ss: the broker "
                "closes the channel under a slow handler and redelivers its messages",
                handler_timeout, consumer_timeout,
            )
        self._url = url
        self._max_deliveries = max_deliveries
        self._retry_delays = tuple(retry_delays)
        self._queue_type = queue_type
        self._reconnect_timeout = reconnect_timeout
        self._settle_timeout = settle_timeout
        self._subscriptions: dict[str, _Subscription] = {}
        self._connection: AbstractConnection | None = None
        self._generation = 0
        self._lost = asyncio.Event()
        self._lock = asyncio.Lock()
        self._supervisor: asyncio.Task[None] | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._warned: set[str] = set()
        self._consuming = True
        self._closed = False
        self.reconnects = 0

    @property
    def connected(self) -> bool:
        """True while the connection is open and no loss is pending."""
        return (
            self._connection is not None
            and not self._connection.is_closed
            and not self._lost.is_set()
        )

    # -- Consumer API ------------------------------------------------------------------------

    async def subscribe(self, queue: str, callback: DeliveryCallback, *, prefetch: int) -> None:
        """Declare ``queue``'s topology (module docstring) and start consuming it with at most
        ``prefetch`` unacked deliveries, calling ``callback`` once per delivery in its own task.

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
        subscription = _Subscription(
            topology=self._topology_for(queue),
            callback=callback,
            prefetch=prefetch,
        )
        async with self._lock:
            if queue in self._subscriptions:
                raise ValueError(f"queue {queue!r} is already subscribed")
            connection = await self._ensure_connection()
            await self._start(subscription, connection)
            self._subscriptions[queue] = subscription
        if self._supervisor is None:
            self._supervisor = asyncio.create_task(
                self._supervise(), name="consumer-kit rabbitmq supervisor"
            )
        logger.info("consuming queue=%s prefetch=%s", queue, prefetch)

    async def stop_consuming(self) -> None:
        """Cancel every consumer (no new deliveries) and stop reconnecting. Deliveries already
        handed out can still be settled while the connection lasts."""
        self._consuming = False
        await self._stop_supervisor()
        for subscription in self._subscriptions.values():
            amqp_queue, tag = subscription.amqp_queue, subscription.consumer_tag
            subscription.consumer_tag = None
            if amqp_queue is None or tag is None:
                continue
            try:
                await asyncio.wait_for(amqp_queue.cancel(tag), self._settle_timeout)
            except Exception as exc:  # noqa: BLE001 - a lost channel has no consumer left
                logger.debug(
                    "cancel consumer on queue=%s failed (%s)",
                    subscription.topology.queue, type(exc).__name__,
                )

    async def close(self) -> None:
        """Stop consuming and close the connection. Unsettled deliveries go back to the broker;
        callback tasks still running are cancelled."""
        if not self._closed:
            await self.stop_consuming()
            self._closed = True
        for task in list(self._handlers):
            task.cancel()
        if self._handlers:
            await asyncio.wait(list(self._handlers), timeout=self._settle_timeout)
        await self._drop_connection()

    def _topology_for(self, queue: str) -> _Topology:
        return _Topology.for_queue(queue, self._retry_delays)

    # -- connection and consumers ------------------------------------------------------------

    async def _ensure_connection(self) -> AbstractConnection:
        if self._connection is not None and not self._connection.is_closed:
            return self._connection
        try:
            async for attempt in AsyncRetrying(
                wait=wait_exponential(multiplier=0.1, max=_MAX_BACKOFF),
                stop=stop_after_delay(self._reconnect_timeout),
                # Wrong credentials or vhost will not fix themselves: fail at once.
                retry=retry_if_not_exception_type(_REFUSED),
                before_sleep=self._log_connect_retry,
                reraise=True,
            ):
                with attempt:
                    await self._connect()
        except Exception as exc:
            raise ConnectionError(
                f"cannot connect to RabbitMQ at {redact_url(self._url)}: {_describe(exc)}"
            ) from exc
        assert self._connection is not None
        return self._connection

    def _log_connect_retry(self, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        logger.warning(
            "cannot connect to RabbitMQ at %s (%s); retry %s in %.1f s",
            redact_url(self._url), _describe(exc), state.attempt_number,
            state.next_action.sleep if state.next_action else 0.0,
        )

    async def _connect(self) -> None:
        await self._drop_connection()
        connection = await aio_pika.connect(
            self._url,
            timeout=self._reconnect_timeout,
            client_properties={"connection_name": "consumer-kit consumer"},
        )
        self._generation += 1
        self._lost.clear()
        connection.close_callbacks.add(self._on_loss(self._generation, "connection"))
        self._connection = connection

    async def _drop_connection(self) -> None:
        connection, self._connection = self._connection, None
        self._generation += 1  # callbacks of the old connection no longer count
        for subscription in self._subscriptions.values():
            subscription.channel = subscription.amqp_queue = subscription.consumer_tag = None
        await _close_quietly(connection, self._settle_timeout, "consumer")

    def _on_loss(self, generation: int, what: str) -> Any:
        def callback(*_: Any) -> None:
            if generation != self._generation or self._closed or not self._consuming:
                return
            if not self._lost.is_set():
                logger.warning("RabbitMQ %s lost; consumers will be re-created", what)
            self._lost.set()

        return callback

    async def _start(self, subscription: _Subscription, connection: AbstractConnection) -> None:
        """Declare the topology and start consuming on a channel of its own (its own prefetch;
        also used to publish retry and dead-letter copies with confirms)."""
        declared = await self._declare_topology(connection, subscription.topology)
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        channel.close_callbacks.add(self._on_loss(self._generation, "channel"))
        underlay = await channel.get_underlay_channel()
        # The broker cancels a consumer when its queue is deleted (or a quorum leader moves
        # away): treat it as a loss, so the consumer is re-created.
        underlay.on_consumer_cancel_callbacks.add(self._on_loss(self._generation, "consumer"))
        await channel.set_qos(prefetch_count=subscription.prefetch)
        amqp_queue = await channel.declare_queue(
            subscription.topology.queue,
            durable=declared.durable,
            arguments=declared.arguments or None,
            passive=declared.passive,
        )

        async def on_message(message: AbstractIncomingMessage) -> None:
            delivery = RabbitMQDelivery(
                message,
                channel=channel,
                topology=subscription.topology,
                settle_timeout=self._settle_timeout,
            )
            # Our own task, not the channel's: a lost channel must not cancel a running handler
            # (its settlement then fails quietly and the message comes back as a duplicate).
            task = asyncio.create_task(self._handle(subscription, delivery))
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

        subscription.consumer_tag = await amqp_queue.consume(on_message, no_ack=False)
        subscription.channel, subscription.amqp_queue = channel, amqp_queue

    async def _handle(self, subscription: _Subscription, delivery: RabbitMQDelivery) -> None:
        try:
            await subscription.callback(delivery)
        except Exception:
            logger.exception(
                "callback failed (queue=%s message_id=%s); releasing the delivery",
                delivery.queue, delivery.message_id,
            )
            if delivery.settlement is None:
                await delivery.release()

    async def _supervise(self) -> None:
        """Wait for a loss, then reconnect and re-create every consumer (backing off)."""
        while self._consuming and not self._closed:
            await self._lost.wait()
            if not self._consuming or self._closed:
                return
            async with self._lock:
                await self._reconnect_all()
            self.reconnects += 1
            logger.info(
                "reconnected to RabbitMQ; consumers re-created for queues=%s",
                ",".join(self._subscriptions),
            )

    async def _reconnect_all(self) -> None:
        loop = asyncio.get_running_loop()
        lost_at = loop.time()
        alerted = False

        def before_sleep(state: RetryCallState) -> None:
            nonlocal alerted
            exc = state.outcome.exception() if state.outcome is not None else None
            down = loop.time() - lost_at
            if down > self._reconnect_timeout and not alerted:
                alerted = True
                logger.error(
                    "RabbitMQ unreachable for %.1fs (%s); still retrying", down, type(exc).__name__
                )
            else:
                logger.warning(
                    "reconnect attempt %s failed (%s); next in %.1fs",
                    state.attempt_number, type(exc).__name__,
                    state.next_action.sleep if state.next_action else 0.0,
                )

        async for attempt in AsyncRetrying(
            wait=wait_exponential(multiplier=0.1, max=_MAX_BACKOFF),
            retry=retry_if_exception_type(Exception),
            before_sleep=before_sleep,
        ):
            with attempt:
                await asyncio.wait_for(self._open_all(), self._reconnect_timeout)

    async def _open_all(self) -> None:
        await self._connect()
        assert self._connection is not None
        for subscription in self._subscriptions.values():
            await self._start(subscription, self._connection)

    async def _stop_supervisor(self) -> None:
        task, self._supervisor = self._supervisor, None
        if task is None or task is asyncio.current_task():
            return
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    # -- declarations and start-up checks ----------------------------------------------------

    def _work_queue_arguments(self, topology: _Topology) -> dict[str, Any]:
        args: dict[str, Any] = {
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": topology.dlq,
        }
        if self._queue_type == "quorum":
            args["x-delivery-limit"] = broker_delivery_limit(self._max_deliveries)
        return self._typed(args)

    def _typed(self, args: dict[str, Any]) -> dict[str, Any]:
        if self._queue_type == "quorum":
            args = {"x-queue-type": "quorum", **args}
            if "x-dead-letter-exchange" in args:
                args["x-dead-letter-strategy"] = "at-least-once"
                args["x-overflow"] = "reject-publish"
        return args

    async def _declare_topology(
        self, connection: AbstractConnection, topology: _Topology
    ) -> _Declared:
        """Declare DLQ, retry queues and the work queue; return how to declare the work queue
        on the consuming channel. Warns (once per queue) about an existing, different queue."""
        first_time = topology.queue not in self._warned
        self._warned.add(topology.queue)
        helpers: list[tuple[str, dict[str, Any]]] = [(topology.dlq, self._typed({}))]
        for delay, name in topology.retry_tiers:
            retry_args = {
                "x-message-ttl": _ms(delay),
                "x-dead-letter-exchange": "",
                "x-dead-letter-routing-key": topology.queue,
            }
            helpers.append((name, self._typed(retry_args)))
        for name, args in helpers:
            helper = await self._declare_tolerant(connection, name, args)
            if first_time and not helper.passive and helper.arguments != args:
                logger.warning(
                    "queue %s exists with arguments %s; consumer-kit would declare %s",
                    name, helper.arguments, args,
                )
        wanted = self._work_queue_arguments(topology)
        declared = await self._declare_tolerant(connection, topology.queue, wanted)
        if first_time:
            self._check_work_queue(topology, wanted, declared)
        return declared

    async def _declare_tolerant(
        self, connection: AbstractConnection, name: str, wanted: dict[str, Any]
    ) -> _Declared:
        """Declare ``name`` durable with ``wanted`` arguments. When the queue exists with other
        arguments (PRECONDITION_FAILED, which closes the channel and names one argument), adopt
        the existing value and try again on a new channel, so the loop learns every difference;
        if the text can't be parsed, fall back to a passive declare (use the queue as it is)."""
        declared = _Declared(durable=True, arguments=dict(wanted))
        for _ in range(len(wanted) + 4):
            channel = await connection.channel(publisher_confirms=False)
            try:
                await channel.declare_queue(
                    name, durable=declared.durable, arguments=declared.arguments or None
                )
                return declared
            except aiormq.exceptions.ChannelPreconditionFailed as exc:
                parsed = _parse_inequivalent(str(exc), wanted)
                if parsed is None:
                    break
                arg, current = parsed
                if arg == "durable":
                    declared.durable = bool(current)
                elif current is _MISSING:
                    declared.arguments.pop(arg, None)
                else:
                    declared.arguments[arg] = current
            finally:
                if not channel.is_closed:
                    await channel.close()
        logger.warning(
            "queue %s exists with arguments consumer-kit cannot compare; using it as it is", name
        )
        channel = await connection.channel(publisher_confirms=False)
        try:
            await channel.declare_queue(name, passive=True)
        finally:
            if not channel.is_closed:
                await channel.close()
        return _Declared(passive=True)

    def _check_work_queue(
        self, topology: _Topology, wanted: dict[str, Any], declared: _Declared
    ) -> None:
        if declared.passive:
            return  # already warned
        queue, existing = topology.queue, declared.arguments
        if not declared.durable:
            logger.warning("queue %s exists and is not durable: messages die with the broker", queue)
        for arg in sorted(set(wanted) | set(existing)):
            if wanted.get(arg, _MISSING) == existing.get(arg, _MISSING):
                continue
            logger.warning(
                "queue %s exists with %s=%s; consumer-kit would declare %s; using the existing queue",
                queue, arg, existing.get(arg, "(none)"), wanted.get(arg, "(none)"),
            )
        limit = existing.get("x-delivery-limit")
        if isinstance(limit, int) and limit < self._max_deliveries:
            logger.warning(
                "queue %s has x-delivery-limit=%s below max_deliveries=%s: the broker dead-letters "
                "(or drops) a message before consumer-kit does",
                queue, limit, self._max_deliveries,
            )
        if "x-dead-letter-exchange" not in existing:
            logger.warning(
                "queue %s has no dead-letter settings: a message the broker dead-letters "
                "(delivery limit, rejection) is dropped instead of reaching %s",
                queue, topology.dlq,
            )
        elif (
            existing.get("x-dead-letter-exchange") != ""
            or existing.get("x-dead-letter-routing-key") != topology.dlq
        ):
            logger.warning(
                "queue %s dead-letters elsewhere than %s (exchange=%s routing_key=%s)",
                queue, topology.dlq, existing.get("x-dead-letter-exchange"),
                existing.get("x-dead-letter-routing-key"),
            )


class RabbitMQPublisher(Publisher):
    """Publish :class:`~consumer_kit.broker.OutgoingMessage` with publisher confirms.

    ``message.destination`` names a durable topic exchange (declared on first use, then cached
    per connection) and ``message.routing_key`` its routing key; destination ``""`` is the
    default exchange, so the routing key is a queue name (commands, tests). Messages are
    persistent, with ``message_id``, ``content_type``, ``type = message_type`` and the headers
    plus ``message-type``. ``partition_key`` is not used on RabbitMQ.

    Unroutable messages (mandatory publish returned by the broker): on a topic exchange this is
    a normal pub/sub state (no subscriber bound yet), logged at DEBUG and treated as published;
    on the default exchange it means the queue does not exist, which raises ``PublishError``.

    The connection is opened on first publish and re-opened on the next publish after a loss.

    Args:
        url: AMQP URL.
        confirm_timeout: seconds to wait for connecting, declaring and the broker's confirm.
    """

    def __init__(self, url: str, *, confirm_timeout: float = 10.0) -> None:
        if confirm_timeout <= 0:
            raise ValueError("confirm_timeout must be > 0 seconds")
        self._url = url
        self._confirm_timeout = confirm_timeout
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        self._exchanges: dict[str, AbstractExchange] = {}
        self._lock = asyncio.Lock()

    async def publish(self, message: OutgoingMessage) -> None:
        """Publish ``message`` and wait for the broker's confirm.

        Raises:
            PublishError: nack, confirm timeout, connection loss, a refused exchange declaration,
                or an unroutable message on the default exchange. Publishing again with the
                same ``message_id`` is safe for consumers that deduplicate.
        """
        amqp_message = aio_pika.Message(
            body=message.body,
            headers={**message.headers, MESSAGE_TYPE_HEADER: message.message_type},
            content_type=message.content_type,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            message_id=message.message_id,
            type=message.message_type,
        )
        try:
            # one deadline for both steps, without wait_for's extra task per publish
            async with asyncio.timeout(self._confirm_timeout):
                exchange = await self._exchange(message.destination)
                result = await exchange.publish(
                    amqp_message,
                    routing_key=message.routing_key,
                    mandatory=True,
                    timeout=self._confirm_timeout,
                )
        except aio_pika.exceptions.DeliveryError as exc:
            raise PublishError(f"broker nacked message_id={message.message_id}") from exc
        except Exception as exc:
            await self._reset()
            raise PublishError(
                f"publish of message_id={message.message_id} to {message.destination!r} "
                f"not confirmed: {type(exc).__name__}"
            ) from exc
        if isinstance(result, aiormq.abc.DeliveredMessage):  # returned: nothing bound
            if message.destination == "":
                raise PublishError(
                    f"no queue {message.routing_key!r} for message_id={message.message_id}",
                    transient=False,
                )
            logger.debug(
                "no binding on exchange %s for routing key %s; message_id=%s published unrouted",
                message.destination, message.routing_key, message.message_id,
            )
            return
        logger.debug(
            "published message_id=%s to exchange=%s routing_key=%s",
            message.message_id, message.destination, message.routing_key,
        )

    async def close(self) -> None:
        """Close the connection (idempotent)."""
        await self._reset()

    async def _exchange(self, name: str) -> AbstractExchange:
        async with self._lock:
            channel = await self._ensure_channel()
            if name == "":
                return channel.default_exchange
            exchange = self._exchanges.get(name)
            if exchange is None:
                exchange = await channel.declare_exchange(
                    name, aio_pika.ExchangeType.TOPIC, durable=True
                )
                self._exchanges[name] = exchange
            return exchange

    async def _ensure_channel(self) -> AbstractChannel:
        if (
            self._connection is not None
            and not self._connection.is_closed
            and self._channel is not None
            and not self._channel.is_closed
        ):
            return self._channel
        await self._reset()
        self._connection = await aio_pika.connect(
            self._url,
            timeout=self._confirm_timeout,
            client_properties={"connection_name": "consumer-kit publisher"},
        )
        self._channel = await self._connection.channel(
            publisher_confirms=True, on_return_raises=False
        )
        return self._channel

    async def _reset(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        self._exchanges.clear()
        await _close_quietly(connection, self._confirm_timeout, "publisher")


def consumer_from_settings(settings: Any) -> RabbitMQConsumer:
    """Entry point ``consumer_kit.brokers: amqp``: a consumer for ``consumer_kit.settings.Settings``
    (``broker_url``, ``max_deliveries``, ``retry_delays`` plus ``in_progress_delay`` as delay
    tiers, ``handler_timeout``, ``settle_timeout``)."""
    delays = [*settings.retry_delays, getattr(settings, "in_progress_delay", 0.0)]
    return RabbitMQConsumer(
        settings.broker_url,
        max_deliveries=settings.max_deliveries,
        retry_delays=delays,
        handler_timeout=settings.handler_timeout,
        settle_timeout=settings.settle_timeout,
    )


def publisher_from_settings(settings: Any) -> RabbitMQPublisher:
    """Entry point ``consumer_kit.brokers: amqp``: a publisher for ``settings.broker_url``,
    waiting at most ``settings.settle_timeout`` seconds for a confirm."""
    return RabbitMQPublisher(settings.broker_url, confirm_timeout=settings.settle_timeout)
