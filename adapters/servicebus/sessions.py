"""A session-enabled queue or subscription: sessions in parallel, each session's messages in order.

Service Bus locks a whole session to one receiver and hands its messages out in order. The adapter
runs ``prefetch`` *session slots* per entity; each slot, over and over:

1. accepts the next available session (``session_id=NEXT_AVAILABLE_SESSION``, waiting up to
   ``receive_wait`` seconds for one to have messages) and keeps its session lock renewed
   (:class:`~consumer_kit.adapters.servicebus.route.SessionLock`, by the lock keeper);
2. receives **one** message, hands it to the worker and waits until it is released (settled, or a
   held retry given back) before it receives the next: one session's messages are handled one at a
   time, in order, whatever the worker's concurrency; different sessions run in parallel, up to
   ``prefetch`` of them;
3. gives the session up (closes the receiver) when it has no message within ``receive_wait``, when
   deliveries are not wanted (pause, shutdown), when the worker handed a delivery back unsettled
   (a simulated crash), or when the session lock is lost (``SessionLockLostError``: the delivery
   is no longer ours, never acked).

**Crashes.** Service Bus returns a session's unsettled messages *uncounted* when the session is
closed or its connection drops, so the delivery count cannot tell that the last holder died. Each
slot keeps a hold mark in the session state instead (:mod:`consumer_kit.adapters.servicebus.session_holds`):
set on accept, cleared on a clean give-up, left behind by a crash or a simulated one; a mark found
on accept makes the session's first delivery a suspect, which runs alone under the ledger's
run-alone marker (crash counted, ``crashed_worker`` at ``crash_limit``). A session lock that
*expires* is counted by Service Bus too; either sign makes a suspect.

A delayed retry of a session message is held (lock renewed, then abandoned when the delay is over,
see :mod:`consumer_kit.adapters.servicebus.delivery`): the abandoned message is again the first of its
session, so order is kept. The session id is the delivery's ``partition_key``. Each accepted
session is a new SDK receiver, hence a new AMQP connection: switching sessions costs a connection
set-up (the SDK shares none).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

from azure.servicebus.aio import ServiceBusReceiver
from azure.servicebus.exceptions import OperationTimeoutError
from tenacity import AsyncRetrying, RetryCallState

from consumer_kit.broker import DeliveryCallback, build_delivery
from consumer_kit.resilience.one_shots import OneShots
from consumer_kit.resilience.supervised import Supervised, all_running

from .connection import BACKOFF, close_quietly
from .delivery import ServiceBusDelivery
from .errors import LOCK_LOST, describe
from .route import Route, SessionLock
from .session_holds import Hold, clear_hold, take_hold
from .subscription import PumpContext, dead_letter_raw, log_attempt, wait_either, wait_unlocked
from .topology import Entity

logger = logging.getLogger(__name__)


class SessionPumps:
    """``prefetch`` session slots on one session entity (see the module docstring).

    Attributes:
        healthy: no slot's last attempt to accept a session failed (readiness).
    """

    def __init__(self, entity: Entity, callback: DeliveryCallback, prefetch: int, context: PumpContext) -> None:
        self.entity = entity
        self._slots = [_SessionSlot(entity, callback, context, index) for index in range(prefetch)]
        self._tasks: list[Supervised] = []

    @property
    def healthy(self) -> bool:
        return all(slot.healthy for slot in self._slots) and all_running(self._tasks)

    async def open(self) -> None:
        """Nothing to check up front: a session receiver needs a session with messages."""

    def start(self) -> None:
        self._tasks = [
            Supervised(f"consumer-kit servicebus session slot {self.entity.path}#{slot.index}", slot.run).start()
            for slot in self._slots
        ]

    async def quiesce(self) -> None:
        """Return once no slot is accepting a session or receiving (each bounded)."""
        await asyncio.gather(*(slot.quiesce() for slot in self._slots))

    async def shed_credit(self) -> None:
        """Nothing to do: a slot's receive asks for one message and an empty one gives the session
        (and its link) up, so no credit is left while paused."""

    async def close(self) -> None:
        """Stop every slot: held retries are given back now and sessions are given up (messages still
        unsettled go back to their sessions, counted). Each slot is told to stop before it is
        cancelled: a cancellation lost inside the SDK cannot keep it waiting."""
        for slot in self._slots:
            slot.stopping.set()
        await asyncio.gather(*(task.stop() for task in self._tasks))
        await asyncio.gather(*(slot.closing.wait() for slot in self._slots))


class _SessionSlot:
    """One session at a time, one message of it at a time."""

    def __init__(self, entity: Entity, callback: DeliveryCallback, context: PumpContext, index: int) -> None:
        self.entity = entity
        self.index = index
        self._callback = callback
        self._context = context
        self._receiving = asyncio.Lock()
        self._current: ServiceBusDelivery | None = None
        self.closing = OneShots()  # receivers of given-up sessions, closing
        # Set by SessionPumps.close: every unbounded wait of the slot also ends on it, so the slot
        # stops even if the cancellation that follows is lost (see wait_either).
        self.stopping = asyncio.Event()
        self.healthy = True

    async def quiesce(self) -> None:
        await wait_unlocked(self._receiving, self._context.settle_timeout, f"a session receive on {self.entity.path}")

    async def run(self) -> None:
        while not self.stopping.is_set():
            if not await wait_either(self._context.running, self.stopping):
                return
            requested = time.monotonic()  # the session lock cannot have been granted earlier
            receiver = await self._accept_with_backoff()
            if receiver is None:
                continue  # no session with messages within receive_wait, or not wanted now
            lock = SessionLock(
                receiver, timeout=self._context.settle_timeout, counters=self._context.counters,
                requested=requested, durations=self._context.durations, entity=self.entity.path,
            )
            hold: Hold | None = None
            try:
                hold = await take_hold(receiver, lock.management, self._context.settle_timeout)
                await self._serve(receiver, lock, hold)
            finally:
                await self._give_up(receiver, lock, marked=hold is not None and hold.marked)

    async def _accept_with_backoff(self) -> ServiceBusReceiver | None:
        """:meth:`_accept`, re-tried with exponential backoff (tenacity) while it fails."""

        def failed(state: RetryCallState) -> None:
            self.healthy = False
            log_attempt(f"accepting a session of {self.entity.path}")(state)

        async for attempt in AsyncRetrying(wait=BACKOFF, before_sleep=failed):
            with attempt:
                receiver = await self._accept()
        self.healthy = True
        return receiver

    async def _accept(self) -> ServiceBusReceiver | None:
        """The next available session's receiver, ``None`` when none had messages in time."""
        async with self._receiving:
            if not self._context.running.is_set() or self.stopping.is_set():
                return None
            receiver = self.entity.receiver(self._context.client, session_wait=self._context.receive_wait)
            try:
                async with asyncio.timeout(self._context.receive_wait + self._context.connect_timeout):
                    await receiver.__aenter__()
            except OperationTimeoutError:
                await close_quietly(receiver, self._context.settle_timeout, "an idle session receiver")
                return None
            except BaseException:
                await close_quietly(receiver, self._context.settle_timeout, "a session receiver")
                raise
        self._context.counters.add("sessions")
        logger.debug("session %s of %s accepted by slot %s", receiver.session.session_id, self.entity.path, self.index)
        return receiver

    async def _serve(self, receiver: ServiceBusReceiver, lock: SessionLock, hold: Hold) -> None:
        """Hand the session's messages out one at a time, the first a suspect when ``hold`` says so."""
        suspect = hold.suspect  # only the session's first delivery: the one a dead holder had
        # Renewal starts with the first message, which bounds the session lock further
        # (lock_clock.py); the first receive waits receive_wait, far less than any lock.
        renewing = not self._context.renew_locks
        route = Route(
            self.entity, receiver, self._context.give_backs, self._context.counters, session=lock,
            durations=self._context.durations, ttls=self._context.ttls,
        )
        while not lock.lost:
            async with self._receiving:
                if not self._context.running.is_set() or self.stopping.is_set():
                    return
                try:
                    async with asyncio.timeout(self._context.receive_wait + self._context.settle_timeout):
                        messages = await receiver.receive_messages(
                            max_message_count=1, max_wait_time=self._context.receive_wait
                        )
                except LOCK_LOST:
                    lock.mark_lost()
                    return
                except Exception as exc:  # noqa: BLE001 - give the session up; the slot goes on
                    logger.warning("receiving session %s of %s failed (%s)", lock.session_id, self.entity.path, describe(exc))
                    return
            if not messages:
                return  # the session is empty for now: take another one
            message, why = messages[0], list[str]()
            delivery = build_delivery(
                functools.partial(
                    ServiceBusDelivery, message, route, settle_timeout=self._context.settle_timeout, suspect=suspect
                ),
                unbuildable=why.append,
                what=f"queue={self.entity.path} session={lock.session_id} sequence_number={message.sequence_number}",
            )
            suspect = False
            if not renewing:
                renewing = True
                self._context.keeper.keep(lock, name=f"queue={self.entity.path} session={lock.session_id}")
            if delivery is None:  # in order: dead-letter it before the session's next message
                await dead_letter_raw(route, message, why[0], self._context.settle_timeout)
                continue
            self._current = delivery
            self._context.dispatch(delivery, self._callback)
            if not await wait_either(delivery.released, self.stopping):
                return  # stopping: the runtime gave the delivery back already, or it lapses
            if delivery.settlement is None or delivery.lost:
                return  # handed back unsettled or not settled as asked: give the session up

    async def _give_up(self, receiver: ServiceBusReceiver, lock: SessionLock, *, marked: bool) -> None:
        """Stop renewing, clear the hold mark (``marked``: this slot set it) when nothing is left
        unsettled, and close the receiver (which releases the session) in the background: the SDK's
        close waits up to a second for its keep-alive task, and the slot need not wait."""
        current, self._current = self._current, None
        if current is not None:
            await current.end_hold()
        lock.released.set()
        # Clean: the last delivery (if any) was settled as asked. Handed back unsettled (a simulated
        # crash) or lost, the mark stays for the next holder. On shutdown the runtime has given
        # every delivery back before the slots stop.
        clean = current is None or (current.settlement is not None and not current.lost)
        if marked and clean and not lock.lost:
            await clear_hold(receiver, lock.management, self._context.settle_timeout)
        self.closing.start(
            close_quietly(receiver, self._context.settle_timeout, f"session {lock.session_id} of {self.entity.path}")
        )
