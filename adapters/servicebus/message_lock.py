"""A Service Bus message's lock and the one path every settlement and renewal takes to the broker.

:class:`MessageLock` is the half of :class:`~consumer_kit.adapters.servicebus.delivery.ServiceBusDelivery`
that knows the lock: its expiry on the worker's monotonic clock
(:mod:`consumer_kit.adapters.servicebus.lock_clock`), its renewal
(:mod:`consumer_kit.adapters.servicebus.renewal`), a loss reported by Service Bus (never settled
as done afterwards, counted ``locks_lost``), and the receiver a request goes through: the one that
delivered the message, else, once that link is dead, another receiver of the entity by lock token.
What each settlement sends is the delivery's own business (:mod:`consumer_kit.adapters.servicebus.delivery`).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Self

from azure.servicebus import ServiceBusReceivedMessage
from azure.servicebus.aio import ServiceBusReceiver
from azure.servicebus.exceptions import MessageAlreadySettled, MessageSizeExceededError

from consumer_kit.errors import LockLost
from consumer_kit.telemetry.metrics import record_lock_lost

from .errors import LOCK_LOST, describe
from .lock_clock import LockExpiry, align_sdk
from .renewal import Renewal
from .route import Route
from .throttling import is_throttled, while_throttled

logger = logging.getLogger(__name__)

_NOT_A_DEAD_LINK = (MessageAlreadySettled, MessageSizeExceededError)
"""Errors of a settlement that another receiver would meet just the same."""

_REPLACEMENTS = 3
"""Receivers one settlement or renewal tries after the first failed as a dead one (each a new one)."""

Settle = Callable[[ServiceBusReceiver, ServiceBusReceivedMessage], Awaitable[None]]
"""One SDK settlement of a message through a receiver (complete, abandon, dead-letter)."""


class MessageLock:
    """The lock of one received message (a base of the Service Bus delivery, which sets every
    attribute below in its constructor).

    Attributes:
        released: set once the message is no longer locked by us (settled, given back, lost, or
            left to expire): renewal stops and its slot is free.
    """

    queue: str
    message_id: str | None
    settle_timeout: float
    released: asyncio.Event
    _message: ServiceBusReceivedMessage
    _route: Route
    _expiry: LockExpiry
    _lock_lost: bool
    _by_lock_token: bool
    _settling: int
    _on_released: list[Callable[[Any], None]]  # each called with the delivery

    @property
    def lock_lost(self) -> bool:
        """Service Bus reported this delivery's lock (or its session's) lost."""
        session = self._route.session
        return self._lock_lost or (session is not None and session.lost)

    def seconds_left(self) -> float | None:
        """Seconds left on the lock (the session's for a session message), monotonic clock."""
        session = self._route.session
        return session.seconds_left() if session is not None else self._expiry.seconds_left()

    def _align_sdk(self) -> None:
        """The SDK's copy of the message lock expiry, on the host's clock (see ``lock_clock``)."""
        align_sdk(self._message, "_expiry", self._expiry.seconds_left())

    def local_time_of(self, broker_time: dt.datetime) -> float | None:
        """A broker timestamp of this message (e.g. ``expires_at_utc``) on the monotonic clock."""
        session = self._route.session
        return (session.expiry if session is not None else self._expiry).local_time_of(broker_time)

    async def renew(self) -> Renewal:
        """Renew the message lock (the session lock for a session message) once, bounded by
        ``settle_timeout``; never raises. Used by the lock keeper, also while a retry is held."""
        if self.lock_lost:
            return Renewal.LOST
        if self._route.session is not None:
            return await self._route.session.renew()

        async def renew(route: Route) -> None:
            async with route.management:
                sent = time.monotonic()
                until = await route.receiver.renew_message_lock(self._message)
                self._expiry.renewed(until, sent=sent, answered=time.monotonic())
                self._align_sdk()

        try:
            async with asyncio.timeout(self.settle_timeout):
                await self._on_a_live_receiver(renew)
        except LOCK_LOST:
            # Settled while the renewal was on its way (or being settled now: the settlement's own
            # answer tells whether the lock was lost): not a loss of the renewal's to report.
            if not self.released.is_set() and not self._settling:
                self._lost_lock()
            return Renewal.LOST
        except Exception as exc:  # noqa: BLE001 - the lock may still hold: try again
            if is_throttled(exc):
                self._route.counters.add("throttled")  # the keeper's next try is the backoff
            logger.info(
                "renewing the lock of queue=%s message_id=%s failed (%s)",
                self.queue, self.message_id, describe(exc),
            )
            left = self.seconds_left()
            if left is not None and left <= 0:
                self._lost_lock()  # past its expiry and not renewable: nobody can renew it now
                return Renewal.LOST
            return Renewal.FAILED
        self._route.counters.add("renewals")
        return Renewal.RENEWED

    def on_released(self, callback: Callable[[Self], None]) -> None:
        """Call ``callback(self)`` once the delivery is released (at once if it already is)."""
        if self.released.is_set():
            callback(self)
        else:
            self._on_released.append(callback)

    def _mark_released(self) -> None:
        if self.released.is_set():
            return
        self.released.set()
        callbacks, self._on_released = self._on_released, []
        for callback in callbacks:
            callback(self)

    def off_its_link(self, route: Route | None = None) -> None:
        """The receive link that delivered this message is gone (a throttled or failed receive):
        settle it from now on over ``$management`` by its lock token, through ``route``'s receiver
        once the pump has a new one (renewals already go that way).

        A disposition on a new link would name a delivery id of that link, not this message. By
        lock token, Service Bus settles and renews a message of an entity without sessions from any
        receiver of the entity until its lock expires (azure-sdk-for-go 1.10.0, "settle and renew
        message locks with only a lock token, so long as they are not using Service Bus sessions";
        azure-sdk-for-js #8406, "settle previously received messages when a receiver recovers from
        a broken link or connection"). Only for deliveries of session-less entities: a session's
        messages are covered by its session lock, which dies with the link.
        """
        # The SDK's own switch to its management settlement (``com.microsoft:update-disposition``),
        # the path it takes for deferred messages (azure-servicebus 7.15 ``_settle_message``).
        self._message._is_deferred_message = True
        self._by_lock_token = True
        if route is not None:
            self._route = route

    async def _sdk(self, settle: Settle) -> None:
        """Run one SDK settlement on the message, unless its lock is known lost; a lock reported
        lost now is remembered (never settled as done afterwards) and counted. A throttled one
        (``ServiceBusServerBusyError``) is made again after a backoff, within ``settle_timeout``."""
        if self.lock_lost:
            raise LockLost(f"lock of message_id={self.message_id} already lost")

        async def settle_through(route: Route) -> None:
            # Throttled: made again after a backoff, on the same receiver and lock (throttling.py).
            async with route.management if self._by_lock_token else contextlib.nullcontext():
                await while_throttled(
                    lambda: settle(route.receiver, self._message),
                    what=f"a settlement of queue={self.queue} message_id={self.message_id}",
                    counters=route.counters,
                )

        self._settling += 1
        try:
            await self._on_a_live_receiver(settle_through)
        except LOCK_LOST:
            self._lost_lock()
            raise
        finally:
            self._settling -= 1

    async def _on_a_live_receiver(self, call: Callable[[Route], Awaitable[None]]) -> None:
        """``call(route)`` through the receiver this delivery came from. When that fails as a dead
        link or connection does (anything but a lost lock, a throttle outlasting the bound, or a
        refusal of the request itself), the pump is asked for a receiver that works
        (``Route.replace``: the one it has opened since, else a new one; it may be idle with every
        slot taken and not have noticed) and ``call`` runs again there, by lock token
        (:meth:`off_its_link`); a replacement that fails the same way is replaced in turn, at most
        ``_REPLACEMENTS`` times. Session messages are never moved (their lock dies with the link)."""
        route = self._route
        for replacements_left in reversed(range(_REPLACEMENTS + 1)):
            try:
                await call(route)
                return
            except (*LOCK_LOST, *_NOT_A_DEAD_LINK):
                raise
            except Exception as exc:
                if replacements_left == 0 or route.replace is None or route.session is not None or is_throttled(exc):
                    raise
                # The replacement may be dead too (its connection dropped as it opened): it is
                # replaced in turn, a few times at most, all within the caller's bound.
                replacement = await route.replace(route)
                if replacement is None:
                    raise
                logger.info(
                    "queue=%s message_id=%s: its receiver failed (%s), settling it by lock token on a new one",
                    self.queue, self.message_id, describe(exc),
                )
                self.off_its_link(replacement)
                route = replacement

    def _lost_lock(self) -> None:
        session = self._route.session
        if session is not None:
            session.mark_lost()
        elif not self._lock_lost:
            self._lock_lost = True
            self._route.counters.add("locks_lost")
            record_lock_lost(self.queue, "servicebus")
            logger.warning(
                "lock lost for queue=%s message_id=%s: no longer ours, never acked; the broker redelivers it",
                self.queue, self.message_id,
            )
        self._mark_released()
