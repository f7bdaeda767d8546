"""The consuming side of Service Bus: one pump per subscribed entity, pause and resume, shutdown.

Each subscribed name becomes an :class:`~consumer_kit.adapters.servicebus.subscription.EntityPump` (a queue or a
subscription) or, when it requires sessions, :class:`~consumer_kit.adapters.servicebus.sessions.SessionPumps`.
Every delivery runs its callback in a task of the consumer's own; every lock it holds is renewed
by one :class:`~consumer_kit.adapters.servicebus.renewal.LockKeeper` until released.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping

from consumer_kit.broker import Consumer, DeliveryCallback, hand_over
from consumer_kit.resilience.one_shots import OneShots

from .config import Namespace
from .connection import Connection
from .counters import ConsumerCounters
from .delivery import ServiceBusDelivery
from .errors import describe
from .lock_clock import LockDurations
from .redelivery import DEFAULT_CAPACITY, GiveBacks
from .renewal import LockKeeper
from .sessions import SessionPumps
from .subscription import EntityPump, PumpContext
from .topology import Entity, not_created_here
from .ttl import DefaultTtls

logger = logging.getLogger(__name__)


class ServiceBusConsumer(Consumer):
    """Consume Service Bus queues and topic subscriptions in peek-lock mode.

    Args:
        namespace: where and how to sign in (:class:`~consumer_kit.adapters.servicebus.config.Namespace`).
        session_entities: subscribed names that require sessions.
        settle_timeout: seconds; the bound on each settlement, renewal and close.
        receive_wait: seconds one receive call waits for a first message (and one session accept
            for a session with messages); bounds how long pause and shutdown wait for a receive.
        connect_timeout: seconds opening one receiver may take.
        give_back_capacity: how many of its own abandons the consumer remembers
            (:mod:`consumer_kit.adapters.servicebus.redelivery`).
        renew_locks: renew every held lock (the default). ``False`` only for tests that need a lock
            to lapse under a running handler.
        lock_duration: seconds, the subscribed entities' LockDuration (Service Bus: 5 s to 5 min):
            one value, or ``{entity path: seconds}``; an override, never needed with the host's
            clock in step with the broker's. Locks are timed on the worker's monotonic clock from
            the duration granted, otherwise learned from each lock's grant
            (:mod:`consumer_kit.adapters.servicebus.lock_clock`).
        default_ttls: ``{entity path: seconds}``, entities' DefaultMessageTimeToLive: Service Bus
            applies it to a message without a TTL of its own but does not show it on the message,
            so without it such a message is taken as never expiring by the retry guards
            (:mod:`consumer_kit.adapters.servicebus.ttl`).

    Raises:
        ValueError: on invalid arguments.

    Attributes:
        counters: :class:`~consumer_kit.adapters.servicebus.counters.ConsumerCounters`.
        give_backs: this consumer's own abandons.
    """

    def __init__(
        self,
        namespace: Namespace,
        *,
        session_entities: Iterable[str] = (),
        settle_timeout: float = 10.0,
        receive_wait: float = 1.0,
        connect_timeout: float = 30.0,
        give_back_capacity: int = DEFAULT_CAPACITY,
        renew_locks: bool = True,
        lock_duration: float | Mapping[str, float] | None = None,
        default_ttls: Mapping[str, float] | None = None,
    ) -> None:
        if settle_timeout <= 0 or receive_wait <= 0 or connect_timeout <= 0:
            raise ValueError("settle_timeout, receive_wait and connect_timeout must be > 0 seconds")
        self._namespace = namespace
        self._session_entities = frozenset(name.casefold() for name in session_entities)
        self._settle_timeout = settle_timeout
        self._receive_wait = receive_wait
        self._connect_timeout = connect_timeout
        self._renew_locks = renew_locks
        self._durations = LockDurations(lock_duration)
        self._ttls = DefaultTtls(default_ttls)
        self.counters = ConsumerCounters()
        self.give_backs = GiveBacks(give_back_capacity)
        self._keeper = LockKeeper()
        self._running = asyncio.Event()  # set while deliveries are wanted
        self._running.set()
        self._connection: Connection | None = None
        self._context: PumpContext | None = None
        self._pumps: dict[str, EntityPump | SessionPumps] = {}
        self._handlers = OneShots()
        self._paused = False
        self._consuming = True
        self._closed = False

    @property
    def ready(self) -> bool:
        """True while every subscribed entity has a working receiver (readiness)."""
        return (
            not self._closed and self._consuming and all(p.healthy for p in self._pumps.values())
            and self._keeper.running
        )

    # -- Consumer API ------------------------------------------------------------------------

    async def subscribe(self, queue: str, callback: DeliveryCallback, *, prefetch: int) -> None:
        """Receive from ``queue`` (a queue name or ``topic/Subscriptions/name``) with at most
        ``prefetch`` messages locked at once (for a session entity: ``prefetch`` sessions at once,
        one message each), calling ``callback`` once per delivery in its own task.

        Raises:
            ValueError: ``queue`` is not an entity name or is already subscribed, or ``prefetch`` < 1.
            RuntimeError: the consumer was stopped or closed.
            ConnectionError: the entity's receiver could not be opened (no such entity, sign-in
                refused, namespace unreachable within ``connect_timeout``).
        """
        if prefetch < 1:
            raise ValueError("prefetch must be >= 1")
        if self._closed or not self._consuming:
            raise RuntimeError("consumer is stopped")
        if queue in self._pumps:
            raise ValueError(f"queue {queue!r} is already subscribed")
        entity = Entity.parse(queue, session_entities=self._session_entities)
        context = self._shared()
        pump: EntityPump | SessionPumps = (
            SessionPumps(entity, callback, prefetch, context) if entity.requires_session
            else EntityPump(entity, callback, prefetch, context)
        )
        try:
            await pump.open()
        except Exception as exc:
            raise ConnectionError(
                f"cannot receive from {queue!r} at {self._namespace.description}: {describe(exc)}"
            ) from exc
        self._pumps[queue] = pump
        pump.start()
        logger.info(
            "consuming queue=%s prefetch=%s%s from %s", queue, prefetch,
            " (sessions)" if entity.requires_session else "", self._namespace.description,
        )

    async def declare(self, queue: str) -> list[str]:
        """``consumer-kit declare``: not on Service Bus.

        Raises:
            ConfigurationError: always, naming what to create and how.
        """
        raise not_created_here(f"queue {queue!r} (or the topic subscription it names)")

    async def pause(self) -> None:
        """No new deliveries until :meth:`resume`; returns once no receive is in progress (each
        pump waits at most ``settle_timeout`` seconds). Deliveries in flight still settle; session
        slots give their sessions up once their current delivery is released. Idempotent."""
        if self._paused:
            return
        self._paused = True
        self._running.clear()
        await self._quiesce()
        await asyncio.gather(*(pump.shed_credit() for pump in self._pumps.values()))
        logger.info("paused consuming queues=%s", ",".join(self._pumps))

    async def resume(self) -> None:
        """Receive again after :meth:`pause`. Idempotent."""
        if not self._paused:
            return
        self._paused = False
        if self._consuming and not self._closed:
            self._running.set()
            logger.info("resumed consuming queues=%s", ",".join(self._pumps))

    async def stop_consuming(self) -> None:
        """No new deliveries from now on; deliveries handed out can still be settled until
        :meth:`close`."""
        self._consuming = False
        self._running.clear()
        await self._quiesce()

    async def close(self) -> None:
        """Stop consuming, cancel callback tasks still running (the runtime gives their deliveries
        back), give held retries back, close every receiver and the client. Locks of deliveries
        nobody settled lapse, and Service Bus redelivers them."""
        if self._closed:
            return
        await self.stop_consuming()
        self._closed = True
        await self._handlers.cancel(self._settle_timeout)
        await asyncio.gather(*(pump.close() for pump in self._pumps.values()))
        await self._keeper.close()
        if self._connection is not None:
            await self._connection.close(self._settle_timeout)
        logger.info("consumer closed: %s", " ".join(f"{k}={v}" for k, v in self.counters.snapshot().items() if v))

    # -- deliveries --------------------------------------------------------------------------

    def _dispatch(self, delivery: ServiceBusDelivery, callback: DeliveryCallback) -> None:
        self._handlers.start(self._handle(delivery, callback))

    async def _handle(self, delivery: ServiceBusDelivery, callback: DeliveryCallback) -> None:
        try:
            # Unwanted: it arrived while a pause or the shutdown began (given back uncounted).
            await hand_over(delivery, callback, wanted=self._running.is_set())
        finally:
            delivery.abandon_to_expiry()  # no-op once settled; unsettled: left to lapse, like a crash

    # -- shared pieces -----------------------------------------------------------------------

    def _shared(self) -> PumpContext:
        if self._context is None:
            self._connection = Connection(self._namespace, name="consumer-kit consumer")
            self._context = PumpContext(
                client=self._connection.client,
                give_backs=self.give_backs,
                counters=self.counters,
                keeper=self._keeper,
                running=self._running,
                dispatch=self._dispatch,
                settle_timeout=self._settle_timeout,
                receive_wait=self._receive_wait,
                connect_timeout=self._connect_timeout,
                renew_locks=self._renew_locks,
                durations=self._durations,
                ttls=self._ttls,
            )
        return self._context

    async def _quiesce(self) -> None:
        await asyncio.gather(*(pump.quiesce() for pump in self._pumps.values()))
