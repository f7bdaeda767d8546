"""Where a delivery came from: the receiver that settles it, and the session lock that covers it."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from azure.servicebus.aio import ServiceBusReceiver

from consumer_kit.telemetry.metrics import record_lock_lost

from .copies import Copies
from .counters import ConsumerCounters
from .errors import LOCK_LOST, describe
from .lock_clock import LockDurations, LockExpiry, align_sdk
from .redelivery import GiveBacks
from .renewal import Renewal
from .throttling import is_throttled
from .topology import Entity
from .ttl import DefaultTtls

logger = logging.getLogger(__name__)


class SessionLock:
    """The lock one session receiver holds on one session (it covers every message of the session
    the receiver hands out). Renewed by the lock keeper while the receiver holds the session.

    Args:
        receiver: a session receiver, open.
        timeout: seconds one renewal may take.
        counters: the consumer's counters (``locks_lost``).

    Attributes:
        session_id: the session's id (the partition key of its messages).
        released: set once the receiver gives the session up (or loses it).
        lost: Service Bus reported the lock lost: nothing of the session may be settled anymore.
        management: one ``$management`` request at a time on this receiver (see :class:`Route`).
    """

    def __init__(
        self, receiver: ServiceBusReceiver, *, timeout: float, counters: ConsumerCounters,
        requested: float | None = None, durations: LockDurations | None = None, entity: str = "",
    ) -> None:
        self._receiver = receiver
        # requested: time.monotonic() when the accept was asked for; durations: what is known of
        # the entity's lock duration, which the session's grant itself tells (lock_clock.py)
        self._broker_until = receiver.session.locked_until_utc  # the broker's, before align_sdk
        durations = LockDurations() if durations is None else durations
        durations.observe(entity, self._broker_until)
        self.expiry = LockExpiry(
            time.monotonic() if requested is None else requested, durations.of(entity), self._broker_until
        )
        self.align_sdk()
        self.management = asyncio.Lock()
        self._timeout = timeout
        self._counters = counters
        self._entity = entity
        self.session_id = receiver.session.session_id
        self.released = asyncio.Event()
        self.lost = False

    def seconds_left(self) -> float | None:
        return self.expiry.seconds_left()

    def broker_locked_until(self) -> dt.datetime | None:
        """The session's ``locked_until`` as the broker last stated it (its clock)."""
        return self._broker_until

    def align_sdk(self) -> None:
        """The SDK's copy of the session expiry, on the host's clock (see ``lock_clock``)."""
        align_sdk(self._receiver.session, "_locked_until_utc", self.expiry.seconds_left())

    async def renew(self) -> Renewal:
        """Renew the session lock once (bounded by ``timeout``); never raises."""
        if self.lost:
            return Renewal.LOST
        try:
            async with asyncio.timeout(self._timeout), self.management:
                sent = time.monotonic()
                until = await self._receiver.session.renew_lock()
                self.expiry.renewed(until, sent=sent, answered=time.monotonic())
                self._broker_until = until
                self.align_sdk()
        except LOCK_LOST:
            self.mark_lost()
            return Renewal.LOST
        except Exception as exc:  # noqa: BLE001 - the lock may still hold: try again
            if is_throttled(exc):
                self._counters.add("throttled")  # the keeper's next try is the backoff
            logger.info("renewing session %s failed (%s)", self.session_id, describe(exc))
            return Renewal.FAILED
        self._counters.add("renewals")
        return Renewal.RENEWED

    def mark_lost(self) -> None:
        if not self.lost:
            self.lost = True
            self._counters.add("locks_lost")
            record_lock_lost(self._entity, "servicebus")
            logger.warning("session %s lock lost: its messages come back to another receiver", self.session_id)
        self.released.set()


@dataclass(frozen=True)
class Route:
    """What a delivery needs from the receiver it came from.

    Attributes:
        entity: the queue or subscription.
        receiver: the SDK receiver that locked the message (settlement goes through it).
        give_backs: this process's abandons (``redelivered``, see :mod:`consumer_kit.adapters.servicebus.redelivery`).
        counters: the consumer's counters.
        copies: sends retry and release copies (queues without sessions), else ``None``.
        session: the session lock covering the message (session entities), else ``None``.
        durations: the lock durations known per entity (:mod:`consumer_kit.adapters.servicebus.lock_clock`).
        ttls: the entities' default time to live, as configured (:mod:`consumer_kit.adapters.servicebus.ttl`).
        management: held around every ``$management`` request on ``receiver`` (lock renewals):
            the SDK sends concurrent requests on one link with out-of-order delivery ids, which an
            AMQP peer must refuse by closing the connection (seen as ``amqp:session:invalid-field,
            sequencing error`` against the local test server), so they go one at a time.
        replace: called with this route when a settlement or renewal through its receiver failed
            as a dead link or connection does; returns a route through a receiver that works (the
            pump's current one, or a new one), ``None`` when the pump is closing. ``None`` (sessions,
            the dead-letter tool): nothing to move to.
    """

    entity: Entity
    receiver: ServiceBusReceiver
    give_backs: GiveBacks
    counters: ConsumerCounters
    copies: Copies | None = None
    session: SessionLock | None = None
    durations: LockDurations = field(default_factory=LockDurations)
    ttls: DefaultTtls = field(default_factory=DefaultTtls)
    management: asyncio.Lock = field(default_factory=asyncio.Lock)
    replace: Callable[[Route], Awaitable[Route | None]] | None = None
