"""One Service Bus delivery under peek-lock, and how each settlement reaches the broker.

=============  =====================================================================================
settlement     on Service Bus
=============  =====================================================================================
ack            ``complete_message``
retry(0)       ``abandon_message`` (remembered as our own give-back, see
               :mod:`consumer_kit.adapters.servicebus.redelivery`)
retry(delay)   a queue: a copy scheduled ``delay`` seconds ahead (``schedule_messages``), then
               ``complete_message`` the original. A session queue or a subscription (which cannot
               take a copy in order, or at all): the lock is *held*, renewed, for ``delay``
               seconds, then ``abandon_message``
(TTL)          a retry whose delay would outlast the message's time to live (``expires_at_utc``,
               mapped to the monotonic clock) is dead-lettered at once, reason
               ``expires_before_retry``; a retry or release copy carries only what is left of the
               original's TTL (never extending its life)
dead_letter    ``dead_letter_message(reason=..., error_description=...)`` (cut to 1024 and 4096
               characters): the message moves to ``<entity>/$DeadLetterQueue`` with them. They
               count toward the message's size: on a queue the description is cut to the room
               the size limit leaves; refused as too large anyway, it is dead-lettered again with
               the reason alone
release        a queue: an **uncounted copy** sent at once (``x-consumer-kit-deliveries`` =
               deliveries before this one, the suspect mark only if this delivery was a suspect),
               then ``complete_message``: graceful restarts and outages neither count toward the
               entity's ``MaxDeliveryCount`` nor make the next delivery a suspect, in any process.
               A session queue or a subscription: ``abandon_message``, remembered as our own
               give-back (Service Bus counts it; the next delivery is a suspect in any other
               process, see :mod:`consumer_kit.adapters.servicebus.redelivery`)
=============  =====================================================================================

**A lost lock ends it.** Once Service Bus reports the lock lost (``MessageLockLostError``, or
``SessionLockLostError`` for a session), from a renewal or a settlement, the delivery is no longer
ours: nothing is sent for it again (an ack after that raises at once, never reaching the broker),
``lost`` is set, and the broker redelivers the message to whoever receives next, where the ledger
answers it as a duplicate when its transaction had committed. Counted as ``locks_lost``.

**Trade-off of copies** (queues): a delayed retry costs no lock, no slot and no renewals, however
long, and a release leaves no count behind, but a copy is a new message: a new sequence number (it
leaves the queue's order), a new message id (the original's is kept in
``x-consumer-kit-message-id``: duplicate detection must not drop the copy), and the deliveries so
far in ``x-consumer-kit-deliveries`` (:mod:`consumer_kit.adapters.servicebus.envelope`). The copy is sent
before the original is completed (at least once): if the completion fails, both come back and the
ledger answers the second as a duplicate. A copy too large for the queue, or refused, is not sent:
the original is abandoned at once instead (a retry's delay is lost, not the message; counted
``copy_refused``). **Trade-off of the held retry** (sessions, subscriptions): order is kept
(the abandoned message is the session's next again) but the delivery keeps its slot and its lock,
renewed, until the delay is over; if the process dies meanwhile, the lock lapses and the message
comes back as a suspect.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
from collections.abc import Awaitable, Callable

from azure.servicebus import ServiceBusReceivedMessage
from azure.servicebus.aio import ServiceBusReceiver
from azure.servicebus.exceptions import MessageAlreadySettled, MessageSizeExceededError

from consumer_kit.broker import Delivery
from consumer_kit.codec import headers as own_headers
from consumer_kit.errors import LockLost

from .envelope import (
    as_sent,
    body_of,
    copy_of,
    delivery_count_of,
    fit_dead_letter,
    headers_of,
    message_id_of,
    schedule_time,
)
from .errors import LOCK_LOST, TooLarge, describe, is_refusal
from .header_limits import dead_letter_room
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


EXPIRES_BEFORE_RETRY = "expires_before_retry"
"""Dead-letter reason: a retry's delay would outlast the message's time to live."""

_WHOLE_SECOND = 1.0  # the SDK sets a time to live in whole seconds: less than one is none at all


class ServiceBusDelivery(Delivery):
    """One Service Bus delivery (settlement table in the module docstring).

    ``delivery_count`` and ``message_id`` follow :mod:`consumer_kit.adapters.servicebus.envelope`;
    ``redelivered`` follows :mod:`consumer_kit.adapters.servicebus.redelivery`; ``correlation_id`` is the
    message's correlation id; ``partition_key`` its session id; ``enqueued_at`` its enqueued time.

    Args:
        message: the SDK's message, received in peek-lock mode.
        route: where it came from.
        settle_timeout: seconds; the bound on each settlement and each renewal.
        requested: ``time.monotonic()`` when the receive that locked it was asked for (its lock
            expiry is kept on that clock, :mod:`consumer_kit.adapters.servicebus.lock_clock`).
        suspect: mark it ``redelivered`` whatever its count says (the first delivery of a session
            whose last holder died, :mod:`consumer_kit.adapters.servicebus.session_holds`).

    Attributes:
        sequence_number: Service Bus's sequence number of the message.
        released: set once the message is no longer locked by us (settled, given back, lost, or left
            to expire after an unsettled hand-back): renewal stops and its slot is free.
    """

    def __init__(
        self, message: ServiceBusReceivedMessage, route: Route, *, settle_timeout: float,
        requested: float | None = None, suspect: bool = False,
    ) -> None:
        reading = own_headers.read(headers_of(message), body_of(message))
        entity = route.entity.path
        broker_count = message.delivery_count or 0
        super().__init__(
            queue=entity,
            message_id=message_id_of(message, reading),
            headers=reading.headers,
            body=body_of(message),
            delivery_count=delivery_count_of(message, reading),
            redelivered=(
                route.give_backs.is_suspect(entity, message.sequence_number or 0, broker_count)
                or reading.suspect
                or suspect
            ),
            correlation_id=message.correlation_id,
            partition_key=message.session_id,
            enqueued_at=message.enqueued_time_utc,
            settle_timeout=settle_timeout,
        )
        self.sequence_number = message.sequence_number or 0
        self._message = message
        route.durations.observe(entity, message.locked_until_utc, message.enqueued_time_utc)
        self._expiry = LockExpiry(
            time.monotonic() if requested is None else requested, route.durations.of(entity), message.locked_until_utc
        )
        if route.session is not None and message.enqueued_time_utc is not None:
            # A session's message was enqueued before the session lock was granted: a bound on it.
            session_until = route.session.broker_locked_until()
            if session_until is not None and session_until > message.enqueued_time_utc:
                route.session.expiry.refine((session_until - message.enqueued_time_utc).total_seconds())
                route.session.align_sdk()
        else:
            self._align_sdk()
        self.released = asyncio.Event()
        self._route = route
        self._broker_count = broker_count
        self._lock_lost = False
        self._by_lock_token = False  # settled over $management (off_its_link), one request at a time
        self._settling = 0  # settlement requests on their way (_sdk)
        self._end_hold = asyncio.Event()
        self._hold: asyncio.Task[None] | None = None
        self._on_released: list[Callable[[ServiceBusDelivery], None]] = []
        route.counters.add("received")
        if self.redelivered:
            route.counters.add("suspects")

    # -- the lock (renewal.Renewable) -----------------------------------------------------------

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

    async def _renew_lock(self) -> bool:
        return await self.renew() is Renewal.RENEWED

    def on_released(self, callback: Callable[[ServiceBusDelivery], None]) -> None:
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

    def abandon_to_expiry(self) -> None:
        """The worker handed the delivery back unsettled (a simulated crash): stop renewing, so the
        lock lapses and Service Bus redelivers it as a suspect, as after a real crash."""
        if self.settlement is None:
            self._mark_released()

    async def end_hold(self) -> None:
        """Cut a held retry short and give the message back now (the consumer is closing)."""
        if self._hold is not None:
            self._end_hold.set()
            await asyncio.gather(self._hold, return_exceptions=True)

    # -- settlement hooks ---------------------------------------------------------------------------

    async def _ack(self) -> None:
        await self._sdk(lambda receiver, message: receiver.complete_message(message))
        self._mark_released()

    def ttl_left(self, after: float = 0.0) -> float | None:
        """Seconds of the message's time to live left ``after`` seconds from now (monotonic clock;
        its ``expires_at_utc`` is a broker time; without one, the entity's configured default,
        :mod:`consumer_kit.adapters.servicebus.ttl`), ``None`` when it never expires as far as known."""
        message = self._message
        expires = self._route.ttls.expires_at(self.queue, message.expires_at_utc, message.enqueued_time_utc)
        if expires is None:
            return None
        local = self.local_time_of(expires)
        return None if local is None else local - time.monotonic() - after

    async def _retry(self, delay: float) -> None:
        left = self.ttl_left(after=max(delay, 0.0))
        if delay > 0 and left is not None and left < self.settle_timeout + _WHOLE_SECOND:
            # Service Bus would expire it the moment the held retry gives it back (or the copy
            # before it is due), dropping it where the entity does not dead-letter on expiry:
            # dead-lettered now, with the reason, instead of lost.
            self._route.counters.add("expired_retries")
            await self._dead_letter(
                EXPIRES_BEFORE_RETRY,
                f"the message's time to live ends before its retry in {delay:g} s "
                f"({max(0.0, left + delay):.1f} s were left)",
            )
            return
        if delay <= 0:
            await self._give_back()
        elif self._route.copies is not None:
            await self._copy_then_complete(
                "retry", deliveries_before=self.delivery_count, suspect=False,
                # on the broker's clock (a copy scheduled by the host's would be early or late by its skew)
                when=self._expiry.broker_time_in(delay) or schedule_time(delay),
                time_to_live=left,
            )
        else:
            # one-shot: the held retry, cut short and awaited by end_hold()
            self._hold = asyncio.create_task(
                self._hold_then_give_back(delay), name=f"consumer-kit servicebus hold {self.message_id}"
            )
            self._route.counters.add("held_retries")

    async def _dead_letter(self, reason: str, detail: str) -> None:
        """Dead-letter with ``reason`` and ``detail``, both properties of the dead-lettered message:
        cut to the room Service Bus's header limit leaves beside the message's own properties
        (:mod:`consumer_kit.adapters.servicebus.header_limits`: 32 KB per property, 64 KB in all)
        and, on a queue, to the room its size limit leaves (not documented to apply: a precaution).
        If Service Bus still refuses the request as too large, it is made again without the detail."""
        header_room = dead_letter_room(self._message)
        size_room = await self._room_for_dead_letter()
        room = header_room if size_room is None else min(header_room, size_room)
        reason, description = fit_dead_letter(reason, detail, room, header_room=header_room)

        def dead_letter(text: str) -> Settle:
            # No description at all rather than an empty one: the property itself takes room.
            return lambda receiver, message: receiver.dead_letter_message(
                message, reason=reason, error_description=text or None
            )

        try:
            await self._sdk(dead_letter(description))
        except MessageSizeExceededError:
            logger.warning(
                "dead-letter of queue=%s message_id=%s too large with its description: sent with the "
                "reason %s only", self.queue, self.message_id, reason[:100],
            )
            await self._sdk(dead_letter(""))
        self._route.counters.add("dead_lettered")
        self._mark_released()

    async def _room_for_dead_letter(self) -> int | None:
        """Bytes the queue's size limit leaves beside this message, ``None`` where not known."""
        if self._route.copies is None:
            return None
        try:
            return await self._route.copies.room_beside(as_sent(self._message, self.headers, self.body))
        except Exception as exc:  # noqa: BLE001 - unknown: dead-letter in full, fall back if refused
            logger.info("could not measure queue=%s message_id=%s (%s)", self.queue, self.message_id, describe(exc))
            return None

    async def _release(self) -> None:
        left = self.ttl_left()
        if self._route.copies is not None and (left is None or left >= _WHOLE_SECOND):
            await self._copy_then_complete(
                "release", deliveries_before=self.delivery_count - 1, suspect=self.redelivered, when=None,
                time_to_live=left,
            )
        else:  # (an expired message given back: Service Bus applies the entity's expiry rule)
            await self._give_back()

    async def _abandon(self) -> None:
        """A settlement failed or overran: abandon, unless the lock is gone already. Not remembered
        as our give-back (we cannot tell what reached the broker): it comes back as a suspect."""
        self._route.counters.add("settlements_lost")
        try:
            if not self.lock_lost:
                await self._sdk(lambda receiver, message: receiver.abandon_message(message))
        finally:
            self._mark_released()

    # -- steps ------------------------------------------------------------------------------------

    async def _give_back(self) -> None:
        """Abandon, remembered first as our own give-back (the redelivery may reach our receiver
        before this call returns). Forgotten again only when the abandon was surely not applied:
        Service Bus refused it (lock lost) or it was never sent (lock known lost, message already
        settled in the SDK). Any other failure (the settle timeout, a lost or late reply, a dropped
        link, cancellation) leaves the outcome unknown: Service Bus may have applied it, so it stays
        remembered. (Forgetting it made the next delivery a suspect, the race fixed on SQS
        too.) If it was not applied, the lock lapses, Service Bus counts the same one delivery,
        and the redelivery is still our own give-back: no worker died holding it."""
        give_backs = self._route.give_backs
        give_backs.record(self.queue, self.sequence_number, self._broker_count, suspect=self.redelivered)
        try:
            await self._sdk(lambda receiver, message: receiver.abandon_message(message))
        except (*LOCK_LOST, LockLost, MessageAlreadySettled):
            give_backs.forget(self.queue, self.sequence_number)
            raise
        self._route.counters.add("given_back")
        self._mark_released()

    async def _copy_then_complete(
        self, why: str, *, deliveries_before: int, suspect: bool, when: dt.datetime | None,
        time_to_live: float | None = None,
    ) -> None:
        """Send a copy in this delivery's place (at ``when``, else now), then complete the original.
        ``time_to_live``: seconds of the original's left at ``when`` (the copy never outlives it).
        A copy too large or refused falls back to an abandon now (counted ``copy_refused``); a failed
        link fails the settlement (the broker redelivers the original)."""
        copies = self._route.copies
        assert copies is not None
        if self.lock_lost:
            raise LockLost(f"lock of message_id={self.message_id} already lost")
        copy = copy_of(
            self._message, self.headers_for_copies, self.body,
            deliveries_before=deliveries_before, message_id=self.message_id, suspect=suspect,
            # whole seconds, rounded down: the SDK keeps no less
            time_to_live=None if time_to_live is None else dt.timedelta(seconds=int(time_to_live)),
        )
        try:
            await copies.put(copy, when=when, body_size=len(self.body), what=f"{why} copy of message_id={self.message_id}")
        except Exception as exc:
            if not isinstance(exc, TooLarge) and not is_refusal(exc):
                raise  # the link failed: the settlement is lost, the broker redelivers
            self._route.counters.add("copy_refused")
            logger.warning(
                "%s copy of queue=%s message_id=%s not sent (%s): abandoning the original now instead",
                why, self.queue, self.message_id, describe(exc),
            )
            await self._give_back()
            return
        await self._sdk(lambda receiver, message: receiver.complete_message(message))
        self._route.counters.add(f"{why}_copies")
        self._mark_released()

    async def _hold_then_give_back(self, delay: float) -> None:
        """Keep the lock (the keeper renews it) for ``delay`` seconds, then give the message back.
        Runs outside the runtime's settlement, so it bounds and logs its own failure."""
        try:
            async with asyncio.timeout(delay):
                await self._end_hold.wait()
        except TimeoutError:
            pass
        try:
            async with asyncio.timeout(self.settle_timeout):
                await self._give_back()
        except Exception as exc:  # noqa: BLE001 - the lock lapses: it comes back as a suspect
            logger.warning(
                "giving back held queue=%s message_id=%s failed (%s): the lock lapses instead",
                self.queue, self.message_id, describe(exc),
            )
        finally:
            self._mark_released()

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
            logger.warning(
                "lock lost for queue=%s message_id=%s: no longer ours, never acked; the broker redelivers it",
                self.queue, self.message_id,
            )
        self._mark_released()

