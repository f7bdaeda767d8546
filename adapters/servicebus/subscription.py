"""One queue or subscription without sessions: a receiver, and at most ``prefetch`` messages locked.

The pump asks Service Bus for exactly as many messages as it has free slots
(``receive_messages(max_message_count=free)`` on a receiver without SDK prefetch), so every
locked message is in the worker's hands, renewed by the lock keeper from the moment it arrives
until it is released (:attr:`ServiceBusDelivery.released`), which frees its slot.

Each receive runs under the pump's receive lock and waits at most ``receive_wait`` seconds for a
first message; :meth:`EntityPump.quiesce` takes that lock, so once it returns no receive is in
progress and none starts while deliveries are not wanted (pause, shutdown). A receive that fails
(connection lost, link detached, entity gone) drops the receiver and re-creates it with
exponential backoff (tenacity, 0.1 s doubling to 5 s) until it works. Deliveries in hand when the
link failed are not stranded: from that moment they settle over ``$management`` by lock token, on
the old receiver while it still answers and on the new one once it is open, and the lock keeper
renews them the same way (:meth:`ServiceBusDelivery.off_its_link`). A settlement or renewal that
fails on a dead receiver the loop has not noticed (every slot taken, so it is not receiving) asks
for the replacement itself (``Route.replace``). A throttled receive
(``ServiceBusServerBusyError``) first waits the throttle backoff
(:mod:`~consumer_kit.adapters.servicebus.throttling`), counted ``throttled``: with SDK 7.15 it
arrives only as the link's detach, so the receiver is re-created all the same.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from azure.servicebus import ServiceBusReceivedMessage
from azure.servicebus.aio import ServiceBusClient, ServiceBusReceiver
from tenacity import AsyncRetrying, RetryCallState

from consumer_kit.broker import DeliveryCallback, build_delivery
from consumer_kit.errors import DeadLetterReason
from consumer_kit.resilience.one_shots import OneShots
from consumer_kit.resilience.supervised import Supervised

from .connection import BACKOFF, close_quietly
from .copies import Copies
from .counters import ConsumerCounters
from .delivery import ServiceBusDelivery
from .errors import describe
from .lock_clock import LockDurations
from .redelivery import GiveBacks
from .renewal import LockKeeper
from .route import Route
from .throttling import backoff_seconds, is_throttled
from .topology import Entity
from .ttl import DefaultTtls

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PumpContext:
    """What every pump of one consumer shares.

    Attributes:
        client: makes receivers (each opens its own AMQP connection).
        give_backs, counters, keeper: the consumer's.
        running: set while deliveries are wanted (cleared on pause and on shutdown).
        dispatch: hands a delivery to its callback in a task of the consumer's.
        settle_timeout: seconds; bound on settlements, renewals, closing and quiescing.
        receive_wait: seconds one receive call waits for a first message.
        connect_timeout: seconds opening one receiver may take.
        renew_locks: renew held locks (``False`` only for tests that need a lock to lapse).
        durations: lock durations per entity (:mod:`consumer_kit.adapters.servicebus.lock_clock`).
        ttls: entities' default time to live, as configured (:mod:`consumer_kit.adapters.servicebus.ttl`).
    """

    client: ServiceBusClient
    give_backs: GiveBacks
    counters: ConsumerCounters
    keeper: LockKeeper
    running: asyncio.Event
    dispatch: Callable[[ServiceBusDelivery, DeliveryCallback], None]
    settle_timeout: float
    receive_wait: float
    connect_timeout: float
    renew_locks: bool = True
    durations: LockDurations = field(default_factory=LockDurations)
    ttls: DefaultTtls = field(default_factory=DefaultTtls)


class EntityPump:
    """Receives from one queue or subscription without sessions (see the module docstring).

    Attributes:
        healthy: the receiver is open and its last receive worked (readiness).
    """

    def __init__(self, entity: Entity, callback: DeliveryCallback, prefetch: int, context: PumpContext) -> None:
        self.entity = entity
        self._callback = callback
        self._prefetch = prefetch
        self._context = context
        self._copies = (
            Copies(context.client, entity.path, close_timeout=context.settle_timeout)
            if entity.is_queue else None
        )
        self._receiver: ServiceBusReceiver | None = None
        self._route: Route | None = None
        self._in_hand: set[ServiceBusDelivery] = set()
        self._slot_freed = asyncio.Event()
        self._receiving = asyncio.Lock()
        self._reconnecting = asyncio.Lock()  # one receiver replaced at a time (_recover)
        # Set by close(): the loop's unbounded waits also end on it, so the pump stops even if the
        # cancellation that follows is lost inside the SDK (see wait_either).
        self._stopping = asyncio.Event()
        self._task: Supervised | None = None
        self._receiver_healthy = False
        self._throttled_in_a_row = 0
        self._side_tasks = OneShots()

    @property
    def healthy(self) -> bool:
        """The receiver is open, its last receive worked and the loop is not down (readiness)."""
        return self._receiver_healthy and (self._task is None or not self._task.down)

    @healthy.setter
    def healthy(self, value: bool) -> None:
        self._receiver_healthy = value

    async def open(self) -> None:
        """Open the receiver now (so a missing entity or a refused sign-in fails the subscribe).

        Raises:
            azure.servicebus.exceptions.ServiceBusError, TimeoutError: it could not be opened.
        """
        receiver = self.entity.receiver(self._context.client)
        try:
            async with asyncio.timeout(self._context.connect_timeout):
                await receiver.__aenter__()
        except BaseException:
            await close_quietly(receiver, self._context.settle_timeout, f"the receiver of {self.entity.path}")
            raise
        if self._stopping.is_set():  # a settlement asked for it while the pump was closing
            await close_quietly(receiver, self._context.settle_timeout, f"the receiver of {self.entity.path}")
            raise ConnectionError(f"the pump of {self.entity.path} is closing")
        self._receiver = receiver
        self._route = Route(
            self.entity, receiver, self._context.give_backs, self._context.counters, copies=self._copies,
            durations=self._context.durations, ttls=self._context.ttls, replace=self._replacement_for,
        )
        for delivery in self._in_hand:  # each came through an earlier receiver
            delivery.off_its_link(self._route)
        self.healthy = True

    def start(self) -> None:
        self._task = Supervised(f"consumer-kit servicebus pump {self.entity.path}", self._run).start()

    async def quiesce(self) -> None:
        """Return once no receive is in progress (at most ``settle_timeout`` seconds); none starts
        afterwards while ``running`` is clear."""
        await wait_unlocked(self._receiving, self._context.settle_timeout, f"a receive on {self.entity.path}")

    async def shed_credit(self) -> None:
        """While paused (after :meth:`quiesce`): end the receive link, so that credit its last
        receive left (a receive asking for more than arrived) locks nothing that arrives meanwhile,
        to be handed out stale on resume (docs/brokers/servicebus.md, "pause"). Deliveries in hand
        move to a new receiver, settled and renewed by lock token (a link with no receive asks for
        nothing); with none in hand the receiver is just closed, and the next receive opens one.
        Never raises: a new receiver that cannot be opened now leaves the old one (logged)."""
        async with self._reconnecting, self._receiving:
            old = self._receiver
            if old is None or self._stopping.is_set():
                return
            if not self._in_hand:
                await self._drop_receiver()
                return
            for delivery in self._in_hand:
                delivery.off_its_link()
            try:
                await self.open()
            except Exception as exc:  # noqa: BLE001 - the old link stays: they settle through it
                logger.warning(
                    "pausing %s: no new receiver (%s), the old link keeps its credit", self.entity.path, describe(exc)
                )
                return
            await close_quietly(old, self._context.settle_timeout, f"the paused receiver of {self.entity.path}")

    async def close(self) -> None:
        """Stop receiving, give held retries back now, close the receiver: what is unsettled goes
        back to the broker when its lock lapses."""
        self._stopping.set()
        if self._task is not None:
            await self._task.stop()
        await asyncio.gather(*(delivery.end_hold() for delivery in list(self._in_hand)), self._side_tasks.wait())
        if self._copies is not None:
            await self._copies.close()
        await self._drop_receiver()

    # -- the loop -----------------------------------------------------------------------------

    async def _run(self) -> None:
        while not self._stopping.is_set():
            if not await wait_either(self._context.running, self._stopping):
                return
            if not await self._wait_for_slot():
                return
            async with self._receiving:
                if not self._context.running.is_set() or self._stopping.is_set():
                    continue
                route = self._route
                try:
                    requested = time.monotonic()  # no lock handed out now can have started earlier
                    messages, received_on = await self._receive(self._prefetch - len(self._in_hand))
                except Exception as exc:  # noqa: BLE001 - any failure: a new receiver
                    failure: Exception | None = exc
                else:
                    failure = None
            if failure is not None:
                if is_throttled(failure):
                    # server-busy on a receive reaches the SDK only as its link's detach (7.15):
                    # the receiver is gone, but a new one waits out the throttle (throttling.py).
                    self._context.counters.add("throttled")
                    if not await self._back_off_throttled(failure):
                        return
                await self._recover(route, failure)
                continue
            self._throttled_in_a_row = 0
            for message in messages:
                self._hand_out(message, requested, received_on)

    async def _receive(self, count: int) -> tuple[list[ServiceBusReceivedMessage], Route]:
        if self._receiver is None:
            await self.open()
        receiver, route = self._receiver, self._route
        assert receiver is not None and route is not None
        async with asyncio.timeout(self._context.receive_wait + self._context.settle_timeout):
            messages = await receiver.receive_messages(
                max_message_count=count, max_wait_time=self._context.receive_wait
            )
        self.healthy = True
        return messages, route

    def _hand_out(self, message: ServiceBusReceivedMessage, requested: float, route: Route) -> None:
        """Hand ``message`` out, settled through ``route`` (the receiver it came on), or by lock
        token through the current one if a settlement replaced that receiver during the receive:
        its delivery id means nothing on another link."""
        delivery = build_delivery(
            lambda: ServiceBusDelivery(
                message, route, settle_timeout=self._context.settle_timeout, requested=requested
            ),
            unbuildable=lambda detail: self._spawn(dead_letter_raw(route, message, detail, self._context.settle_timeout)),
            what=f"queue={self.entity.path} sequence_number={message.sequence_number}",
        )
        if delivery is None:
            return
        if self._route is not None and self._route is not route:
            delivery.off_its_link(self._route)
        self._in_hand.add(delivery)
        delivery.on_released(self._free_slot)
        if self._context.renew_locks:
            self._context.keeper.keep(delivery, name=f"queue={self.entity.path} message_id={delivery.message_id}")
        self._context.dispatch(delivery, self._callback)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        self._side_tasks.start(work, name=f"consumer-kit servicebus dead-letter raw {self.entity.path}")

    def _free_slot(self, delivery: ServiceBusDelivery) -> None:
        self._in_hand.discard(delivery)
        self._slot_freed.set()

    async def _wait_for_slot(self) -> bool:
        """Wait until fewer than ``prefetch`` deliveries are in hand; ``False`` when stopping."""
        while len(self._in_hand) >= self._prefetch:
            self._slot_freed.clear()
            if not await wait_either(self._slot_freed, self._stopping):
                return False
        return True

    # -- recovery -----------------------------------------------------------------------------

    async def _recover(self, failed: Route | None, failure: Exception) -> None:
        """Replace the receiver behind ``failed`` (``None``: none was open), unless that was done
        already: the loop and settlements may both find the same receiver dead."""
        async with self._reconnecting:
            if self._route is None or self._route is failed:
                await self._reconnect(failure)

    async def _replacement_for(self, failed: Route) -> Route | None:
        """``Route.replace``: a route through a receiver that works, ``None`` when closing."""
        await self._recover(failed, ConnectionError(f"a settlement through the receiver of {self.entity.path} failed"))
        return None if self._stopping.is_set() else self._route

    async def _reconnect(self, failure: Exception) -> None:
        """Open a new receiver, backing off, until it works (:meth:`open` moves the deliveries in
        hand onto it), then close the old one: until then its management link may settle them."""
        self.healthy = False
        logger.warning("receiving from %s failed (%s): re-creating the receiver", self.entity.path, describe(failure))
        old = self._receiver
        for delivery in self._in_hand:
            delivery.off_its_link()
        try:
            async for attempt in AsyncRetrying(
                wait=BACKOFF, before_sleep=log_attempt(f"re-creating the receiver of {self.entity.path}")
            ):
                with attempt:
                    if self._stopping.is_set():
                        return
                    await self.open()
        finally:
            if old is not self._receiver:
                await close_quietly(old, self._context.settle_timeout, f"the old receiver of {self.entity.path}")
        self._context.counters.add("reconnects")
        logger.info("receiver of %s re-created", self.entity.path)

    async def _back_off_throttled(self, failure: Exception) -> bool:
        """Wait out a throttled receive (longer each time in a row); ``False`` when stopping."""
        self._throttled_in_a_row += 1
        wait = backoff_seconds(self._throttled_in_a_row)
        logger.warning(
            "Service Bus throttled a receive on %s (%s): receiving again in %.1fs",
            self.entity.path, describe(failure), wait,
        )
        try:
            async with asyncio.timeout(wait):
                await self._stopping.wait()
        except TimeoutError:
            return True
        return False

    async def _drop_receiver(self) -> None:
        receiver, self._receiver, self._route = self._receiver, None, None
        await close_quietly(receiver, self._context.settle_timeout, f"the receiver of {self.entity.path}")


async def dead_letter_raw(route: Route, message: ServiceBusReceivedMessage, detail: str, timeout: float) -> None:
    """Dead-letter a message that could not be mapped onto a delivery, as it is, with reason
    ``invalid_header`` and ``detail`` (bounded by ``timeout`` seconds; a failure is logged and the
    lock lapses, so it comes back)."""
    try:
        async with asyncio.timeout(timeout):
            await route.receiver.dead_letter_message(
                message, reason=DeadLetterReason.INVALID_HEADER.value, error_description=detail
            )
        route.counters.add("dead_lettered")
    except Exception as exc:  # noqa: BLE001 - its lock lapses and it comes back
        logger.error("dead-lettering an unmappable message of %s failed (%s)", route.entity.path, describe(exc))


async def wait_either(wanted: asyncio.Event, stopping: asyncio.Event) -> bool:
    """Wait until ``wanted`` or ``stopping`` is set; ``True`` when ``wanted`` is. A loop that waits
    this way ends at a stop even when the cancellation meant to end it was lost: on Python 3.11,
    ``asyncio.wait_for`` (which the SDK uses inside receive and open) returns its result instead of
    raising when the cancellation and the result arrive together."""
    if not wanted.is_set() and not stopping.is_set():
        waits = [asyncio.ensure_future(wanted.wait()), asyncio.ensure_future(stopping.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
    return wanted.is_set()


async def wait_unlocked(lock: asyncio.Lock, timeout: float, what: str) -> None:
    """Return once ``lock`` is free (at most ``timeout`` seconds; past that, log ``what``)."""
    try:
        async with asyncio.timeout(timeout):
            async with lock:
                pass
    except TimeoutError:
        logger.warning("%s did not end within %.1fs", what, timeout)


def log_attempt(what: str) -> Callable[[RetryCallState], None]:
    """A tenacity ``before_sleep``: one WARNING per failed attempt at ``what``."""

    def log(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        logger.warning("%s: attempt %s failed (%s)", what, state.attempt_number, describe(exc))

    return log
