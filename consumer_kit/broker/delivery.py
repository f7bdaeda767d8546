"""Deliveries: one hand-over of a message under peek-lock, and what every adapter does to build one.

Adapters (``consumer_kit.adapters.memory``, ``consumer_kit.adapters.rabbitmq``, ...) subclass
:class:`Delivery`; the core never imports a broker SDK. A *delivery* is one hand-over of a message
under *peek-lock*; it ends when it is *settled* by exactly one of ``ack``, ``retry`` or
``dead_letter`` (docs/explanation/architecture.md, "The adapter shape").
"""

from __future__ import annotations

import abc
import asyncio
import datetime as dt
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from consumer_kit.codec import headers as own
from consumer_kit.codec.envelope import Envelope
from consumer_kit.model.settlement import Settlement as Settlement

logger = logging.getLogger("consumer_kit.broker")


class Delivery(abc.ABC):
    """One delivery of one message, held under peek-lock until settled.

    Attributes:
        queue: the queue (or subscription) it came from.
        message_id: the broker message id, ``None`` where the producer set none.
        headers: application headers / properties, as the broker gave them (values may be any type).
        body: the raw message body (bytes).
        delivery_count: 1 on the first delivery, 2 on the first redelivery, ... (source per broker:
            RabbitMQ ``x-delivery-count`` plus consumer-kit's copies, SQS ``ApproximateReceiveCount``,
            Service Bus ``delivery_count + 1``). Informational: consumer-kit's own attempt count,
            kept in the ledger, decides dead-lettering (docs/explanation/faults-and-attempts.md).
        redelivered: the broker handed this message out before and no consumer-kit settlement
            ended that hand-over (the worker died, its connection was lost, its lock expired), or
            the adapter cannot tell. The runtime runs such a delivery alone and counts it as a
            possible crash (poison isolation).
        sender: the producer's identity as the broker authenticated it (RabbitMQ validated
            ``user_id``, SQS ``SenderId``), ``None`` where the broker gives none (docs/explanation/trust.md).
        correlation_id: the broker's own correlation-id property, where it has one.
        partition_key: the broker's ordering key (SQS FIFO group id, Service Bus session id).
        enqueued_at: when the broker accepted the message (aware UTC), where it says.
        first_enqueued_at: the earliest trustworthy time of the operation
            (:func:`first_enqueue_time`): it decides key expiry, and every copy made of this
            delivery carries it (signed; :attr:`headers_for_copies`).
        settle_timeout: seconds; the one bound on each settlement (see below).
        lost: set when a settlement did not take effect as asked and the broker will redeliver the
            message on its own, as a redelivery: the base class sets it when a hook fails or
            overruns; an adapter sets it itself when it had to fall back (e.g. a retry copy was
            refused, so the original was nacked back). Informational (reports, logs): a redelivery
            that follows is handled as any other (ledger: duplicate; crash count: only a death
            while running alone counts).

    An ack that a protocol does not confirm (AMQP 0-9-1 ``basic.ack`` has no reply) counts as done
    once written; if the connection then drops, the message comes back without ``lost`` set and
    the ledger answers it as a duplicate.

    Settlement (``ack``, ``retry``, ``dead_letter``, ``release``) is bounded by ``settle_timeout``
    seconds and never raises: when the adapter's hook fails or overruns, the delivery is
    *abandoned* (:meth:`_abandon`: the adapter makes sure the broker redelivers it, e.g. by closing
    the channel) and ``lost`` is set. This is the only timeout layer around a settlement.
    Settling twice is a programming error on our side and is ignored with a warning, never raised:
    the first settlement wins.
    """

    def __init__(
        self,
        *,
        queue: str,
        message_id: str | None,
        headers: Mapping[str, Any],
        body: bytes,
        delivery_count: int,
        redelivered: bool = False,
        correlation_id: str | None = None,
        partition_key: str | None = None,
        enqueued_at: dt.datetime | None = None,
        sender: str | None = None,
        settle_timeout: float = 10.0,
    ) -> None:
        self.queue = queue
        self.message_id = message_id
        self.headers = headers
        self.body = body
        self.sender = sender
        self.delivery_count = delivery_count
        self.redelivered = redelivered
        self.correlation_id = correlation_id
        self.partition_key = partition_key
        self.enqueued_at = enqueued_at
        self.first_enqueued_at = first_enqueue_time(headers, enqueued_at)
        self.settle_timeout = settle_timeout
        self.settlement: Settlement | None = None
        self.lost = False

    @property
    def headers_for_copies(self) -> dict[Any, Any]:
        """The headers every copy of this delivery starts from (retry, release, dead-letter): its
        own plus ``x-consumer-kit-first-enqueued`` (:attr:`first_enqueued_at`) and, where it has
        one, ``x-consumer-kit-sender`` (:attr:`sender`: the copy is sent by the worker, the sender
        stays the original's), which the adapter's copy signs with the other marks."""
        first = {own.FIRST_ENQUEUED: self.first_enqueued_at.astimezone(dt.UTC).isoformat()}
        return {**self.headers, **first, **({} if self.sender is None else {own.SENDER: self.sender})}

    @property
    def header_fault(self) -> str | None:
        """``None``, or why consumer-kit's own headers make this delivery ``invalid_header`` (it
        names the header; :func:`consumer_kit.codec.headers.read` puts it on ``headers``): the runtime
        dead-letters it at decoding, before any handler sees it."""
        return getattr(self.headers, "fault", None)

    async def ack(self) -> None:
        """Finish the delivery successfully: the broker forgets the message."""
        await self._settle(Settlement.ACK, self._ack)

    async def retry(self, delay: float = 0.0) -> None:
        """Give the message back to be delivered again after ``delay`` seconds (>= 0); the next
        delivery is not marked ``redelivered``."""
        await self._settle(Settlement.RETRY, lambda: self._retry(max(0.0, delay)))

    async def dead_letter(self, reason: str, detail: str = "") -> None:
        """Move the message to the dead-letter queue with a machine-readable ``reason`` code and a
        human-readable ``detail`` (no payload content)."""
        await self._settle(Settlement.DEAD_LETTER, lambda: self._dead_letter(reason, detail))

    async def release(self) -> None:
        """Give the message back now, uncounted (shutdown, environment fault, isolation): where the
        broker allows, the next delivery is neither counted nor marked ``redelivered`` unless this
        one was (a suspect stays a suspect)."""
        await self._settle(Settlement.RELEASED, self._release)

    async def renew_lock(self) -> bool:
        """Extend the peek-lock (SQS visibility timeout, Service Bus lock). ``False`` when the lock
        is lost: the delivery is no longer ours and must not be acked. Brokers without a lock
        (RabbitMQ holds a delivery until its channel closes) return ``True``. Never raises."""
        if self.settlement is not None or self.lost:
            return False
        try:
            async with asyncio.timeout(self.settle_timeout):
                return await self._renew_lock()
        except Exception as exc:  # noqa: BLE001 - a renewal that fails means the lock may be gone
            logger.warning(
                "lock renewal failed (%s) queue=%s message_id=%s",
                type(exc).__name__, self.queue, self.message_id,
            )
            return False

    def _settled_before(self, how: Settlement) -> bool:
        """``True`` (warned) when this delivery is settled already: the first settlement wins."""
        if self.settlement is None:
            return False
        logger.warning(
            "delivery already settled as %s; ignoring %s (queue=%s message_id=%s)",
            self.settlement.value, how.value, self.queue, self.message_id,
        )
        return True

    async def _settle(self, how: Settlement, hook: Callable[[], Awaitable[None]]) -> None:
        if self._settled_before(how):
            return
        self.settlement = how
        try:
            async with asyncio.timeout(self.settle_timeout):  # unlike wait_for, no extra task
                await hook()
            return
        except Exception as exc:  # noqa: BLE001 - any failure means "the broker will redeliver"
            failure = type(exc).__name__
        await self._abandon_after(how, failure)

    async def _abandon_after(self, how: Settlement, failure: str) -> None:
        self.lost = True
        try:
            async with asyncio.timeout(self.settle_timeout):
                await self._abandon()
        except Exception as exc:  # noqa: BLE001 - abandoning is best effort by definition
            logger.debug("abandon failed (%s) queue=%s message_id=%s", type(exc).__name__,
                         self.queue, self.message_id)
        logger.warning(
            "settlement %s failed (%s) queue=%s message_id=%s: the broker will redeliver",
            how.value, failure, self.queue, self.message_id,
        )

    @abc.abstractmethod
    async def _ack(self) -> None: ...

    @abc.abstractmethod
    async def _retry(self, delay: float) -> None: ...

    @abc.abstractmethod
    async def _dead_letter(self, reason: str, detail: str) -> None: ...

    @abc.abstractmethod
    async def _release(self) -> None: ...

    async def _renew_lock(self) -> bool:
        return True

    @classmethod
    def _ack_groups(cls, deliveries: list[Any]) -> tuple[list[AckGroup], list[Any]]:
        """The adapter's hook for :func:`ack_all`: which of ``deliveries`` (of this class, not
        settled, in delivery order) one broker call can ack together, and the rest, acked one by
        one. Each :class:`AckGroup` names its members and the call; the call may only be made when
        nothing but the members is settled by it (RabbitMQ: a multiple ``basic.ack`` covers every
        lower unacked tag of its channel). A group's members are acked without their own
        ``ack`` (no ``_settle`` hook runs): an adapter whose deliveries do work there (e.g.
        :class:`~consumer_kit.broker.kit.pull_consumer.PulledDelivery` freeing a slot) must do it in the
        group's call. Default: no groups, every delivery on its own."""
        return [], deliveries

    async def _abandon(self) -> None:  # noqa: B027 - optional hook, deliberately empty by default
        """Make sure the broker redelivers this message although its settlement failed (e.g. close
        the channel it came on). Default: nothing (the lock lapses by itself)."""

    def envelope(self) -> Envelope:
        """What a handler may read of this delivery (never the body); its ``enqueued_at`` is the
        operation's earliest trustworthy time."""
        return Envelope(
            self.queue, self.message_id, self.headers, self.delivery_count, sender=self.sender,
            correlation_property=self.correlation_id, partition_key=self.partition_key,
            enqueued_at=self.first_enqueued_at,
        )


@dataclass(frozen=True, eq=False)
class AckGroup:
    """Deliveries one broker call acks together (:meth:`Delivery._ack_groups`): ``call`` acks
    every member or raises (then every member is abandoned, as a failed :meth:`Delivery.ack`)."""

    members: Sequence[Delivery]
    call: Callable[[], Awaitable[None]]


async def ack_all(deliveries: Sequence[Delivery]) -> None:
    """Ack ``deliveries`` (one queue's, in delivery order) with as few broker calls as their
    adapter can safely make (RabbitMQ: one multiple ``basic.ack`` per channel where every lower
    unacked tag is among them), each of the others with its own :meth:`Delivery.ack`. The same
    contract as ``ack``: bounded by ``settle_timeout``, never raising, first settlement wins; a
    group whose call fails or overruns is abandoned as a whole (every member ``lost``)."""
    fresh: dict[type[Delivery], list[Delivery]] = {}
    for delivery in deliveries:
        if not delivery._settled_before(Settlement.ACK):
            fresh.setdefault(type(delivery), []).append(delivery)
    calls: list[Awaitable[None]] = []
    for kind, members in fresh.items():
        groups, alone = kind._ack_groups(members)
        for group in groups:
            for delivery in group.members:
                # Settled now, before any await: a retry or release in between would be covered
                # by the group's one call all the same (a multiple ack acks every member).
                delivery.settlement = Settlement.ACK
        calls += [_ack_group(group) for group in groups]
        calls += [delivery.ack() for delivery in alone]
    if len(calls) == 1:
        await calls[0]  # the common case: no task per call
    elif calls:
        await asyncio.gather(*calls)


async def _ack_group(group: AckGroup) -> None:
    """Make ``group``'s call (its members are marked acked already, by :func:`ack_all`)."""
    try:
        async with asyncio.timeout(min(d.settle_timeout for d in group.members)):
            await group.call()
        return
    except Exception as exc:  # noqa: BLE001 - any failure means "the broker will redeliver"
        failure = type(exc).__name__
    for delivery in group.members:
        await delivery._abandon_after(Settlement.ACK, failure)


DeliveryCallback = Callable[[Delivery], Awaitable[None]]

D = TypeVar("D", bound=Delivery)


def build_delivery(
    build: Callable[[], D], *, unbuildable: Callable[[str], None], what: str
) -> D | None:
    """The one guard around making a :class:`Delivery` from a broker message: ``build()``, or,
    when it raises (a message the adapter cannot even map), ``None`` after logging ``what`` (ids
    only) and calling ``unbuildable(detail)``, the adapter's fallback that dead-letters the raw
    message with reason ``invalid_header`` and ``detail`` (nothing lost, never retried forever).
    Never raises ``Exception``: the receive loop goes on with the next message."""
    try:
        return build()
    except Exception as exc:
        detail = f"the message could not be mapped ({type(exc).__name__})"  # no text: it may quote the payload
        logger.error("cannot build a delivery from %s (%s): dead-lettering it as it is", what,
                     type(exc).__name__, exc_info=True)
    try:
        unbuildable(detail)
    except Exception:
        logger.exception("dead-lettering the unmappable message %s failed", what)
    return None



def sender_across_copies(headers: Mapping[str, Any], broker_sender: str | None) -> str | None:
    """The authenticated sender of a delivery whose headers :func:`consumer_kit.codec.headers.read` has
    verified: the signed ``x-consumer-kit-sender`` an earlier copy carried (``""``: the original had
    none), else ``broker_sender`` (the broker's sender of this copy, e.g. SQS ``SenderId``)."""
    carried = own.read_text(own.lookup(headers, own.SENDER), 255)
    if carried is None:
        return broker_sender
    return carried or None


def first_enqueue_time(headers: Mapping[str, Any], enqueued_at: dt.datetime | None) -> dt.datetime:
    """The earliest trustworthy enqueue time of the operation a delivery belongs to: the signed
    ``x-consumer-kit-first-enqueued`` mark its earlier copies carried (the codec has dropped an
    unsigned one), never later than the broker's time for this copy (``enqueued_at``; RabbitMQ has
    none, so the time of receipt). Every copy consumer-kit makes of the delivery (retry, release,
    dead-letter, then redrive) carries it (:attr:`Delivery.headers_for_copies`), signed by
    :func:`consumer_kit.codec.headers.seal`: a copy's new enqueue time never makes the operation look
    newer."""
    now = dt.datetime.now(dt.UTC)
    first = min(enqueued_at, now) if enqueued_at is not None else now
    carried = own.read_time(own.lookup(headers, own.FIRST_ENQUEUED))
    if carried is not None:
        first = min(first, carried)
    return first
