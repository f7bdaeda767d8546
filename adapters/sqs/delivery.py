"""One SQS delivery under its visibility timeout, and how each settlement reaches SQS.

=============  =====================================================================================
settlement     on SQS
=============  =====================================================================================
ack            ``DeleteMessage`` (batched: :mod:`consumer_kit.adapters.sqs.settlement`)
retry(delay)   standard queue: a copy with ``DelaySeconds`` = ``ceil(delay)`` and
               ``x-consumer-kit-deliveries = delivery_count``, then the original is deleted.
               FIFO queue with the heartbeat on: *held* (below), no call.
               FIFO queue otherwise, a delay above 900 s, or a copy that does not fit:
               ``ChangeMessageVisibility(ceil(delay))`` (remembered: :mod:`consumer_kit.adapters.sqs.redelivery`)
release        standard queue: a copy with ``x-consumer-kit-deliveries = delivery_count - 1``
               (uncounted) and ``x-consumer-kit-redelivered`` for a suspect, then the original is
               deleted. FIFO queue: ``ChangeMessageVisibility(0)``, remembered as uncounted
dead_letter    a copy to the dead-letter queue (:mod:`consumer_kit.adapters.sqs.topology`) with
               ``x-dead-letter-reason``, ``x-dead-letter-detail``, ``x-original-queue`` and
               ``x-consumer-kit-deliveries``, then the original is deleted. SQS's redrive cannot
               carry a reason, so consumer-kit always sends the copy itself
=============  =====================================================================================

A copy that does not fit the target's ``MaximumMessageSize`` loses headers first (any that are
not consumer-kit's or the operation's, then the dead-letter detail, ...; never the reason); one
that still does not fit is never sent: retry and release fall back to ``ChangeMessageVisibility``,
and a dead letter gives the message back (visibility 0, ``lost``) for the queue's redrive policy
to move after ``maxReceiveCount`` receives (logged at ERROR: without a redrive policy it keeps
coming back).

**Held retries (FIFO).** SQS counts every receive towards the redrive policy's
``maxReceiveCount``, and a FIFO retry given back to SQS gives back the rest of its message group
too (it must not run first): each attempt of a failing head would then cost every follower in
hand a receive, and SQS would move healthy followers to the DLQ, without a reason and never run. So on a FIFO queue with the heartbeat on, a retry keeps the message: the delivery's
:attr:`successor` (same receipt handle and lock, ``delivery_count + 1``, not redelivered) stays
held and extended, and the group's lane (:mod:`consumer_kit.adapters.sqs.fifo`) runs it after the
delay, its followers still waiting, held, behind it. Every message is received once; attempts are
counted by the ledger, not by SQS. A retry whose delay plus one visibility timeout does not fit
in what is left of the 12 hours is given back as before. If the process dies meanwhile, the lock
lapses and the message comes back redelivered (a crash, as it is).

**The lock.** The adapter knows when its peek-lock lapses: the time the receive was *sent* plus
the visibility timeout (the delivery's ``lock_seconds``), moved by each extension
(:mod:`consumer_kit.adapters.sqs.renewal`). Past that (less a margin of 10 % of the timeout, at most
1 s: :class:`consumer_kit.broker.kit.pull_consumer.PulledDelivery`) nothing is settled any more: SQS may have
handed the message to someone else, so an ack would delete a message another worker holds.
Such a settlement raises :class:`~consumer_kit.errors.LockLost` and the delivery is ``lost``;
the message comes back (or already came back) and the ledger answers it as a duplicate.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from botocore.exceptions import ClientError

from consumer_kit.broker import sender_across_copies
from consumer_kit.broker.kit.copy_ids import keyed_copy_id
from consumer_kit.broker.kit.pull_consumer import PulledDelivery
from consumer_kit.codec import headers as own_headers
from consumer_kit.codec.envelope import CORRELATION_ID_HEADER
from consumer_kit.errors import LockLost

from .config import MAX_VISIBILITY_SECONDS
from .envelope import (
    DEAD_LETTER_DETAIL_ATTRIBUTE,
    DEAD_LETTER_REASON_ATTRIBUTE,
    DELIVERIES_ATTRIBUTE,
    DETAIL_MAX_CHARS,
    MESSAGE_ID_ATTRIBUTE,
    ORIGINAL_QUEUE_ATTRIBUTE,
    REDELIVERED_ATTRIBUTE,
    copy_headers,
    headers_of,
)
from .limits import fit
from .redelivery import GIVE_BACKS
from .settlement import Settler
from .topology import QueueInfo

logger = logging.getLogger(__name__)

MAX_DELAY_SECONDS = 900
"""SQS's longest ``DelaySeconds`` of a send: longer retries change the visibility instead."""

DEFAULT_GROUP = "consumer-kit"
"""``MessageGroupId`` of a FIFO copy or event that has no partition key."""


class SQSDelivery(PulledDelivery):
    """One received SQS message (settlement table in the module docstring).

    ``message_id`` is the ``x-consumer-kit-message-id`` attribute (the outbox event ID, kept on
    every copy) or SQS's ``MessageId``; ``delivery_count`` and ``redelivered`` follow
    :mod:`consumer_kit.adapters.sqs.redelivery`; ``enqueued_at`` is ``SentTimestamp``; ``partition_key`` is the
    FIFO ``MessageGroupId``; ``correlation_id`` is the ``correlation-id`` attribute; ``sender`` is
    ``SenderId`` (the sending IAM user or role id, or account id; a copy consumer-kit sends is the worker's).

    Args:
        raw: one message of a ``ReceiveMessage`` reply.
        queue: the consumer-kit queue name it was subscribed as.
        info: the queue it came from.
        dead_letters: where its dead letters go.
        settler: the consumer's settlement calls.
        requested_at: ``time.monotonic()`` when the receive was sent (the lock's start).
        visibility: seconds of peek-lock the receive asked for (and each extension gives): the
            delivery's ``lock_seconds``.
        settle_timeout: seconds; the bound the base class puts on each settlement.
        renew: extends the lock now (the heartbeat's); ``False`` when it is lost.
        on_settled: told once the delivery is settled, whatever the outcome.
    """

    lock_seconds: int  # SQS's VisibilityTimeout is whole seconds

    def __init__(
        self,
        raw: dict[str, Any],
        *,
        queue: str,
        info: QueueInfo,
        dead_letters: QueueInfo,
        settler: Settler,
        requested_at: float,
        visibility: int,
        settle_timeout: float,
        renew: Callable[[SQSDelivery], Awaitable[bool]],
        on_settled: Callable[[SQSDelivery], None],
        hold_retries: bool = False,
        judged: tuple[int, bool] | None = None,
    ) -> None:
        system = raw.get("Attributes", {})
        reading = own_headers.read(headers_of(raw.get("MessageAttributes")), str(raw.get("Body", "")).encode("utf-8"))
        self.sqs_message_id = str(raw["MessageId"])
        self.receive_count = int(system.get("ApproximateReceiveCount", 1))  # SQS's own, not the producer's
        delivery_count, redelivered = judged or GIVE_BACKS.judge(
            (info.url, self.sqs_message_id), self.receive_count,
            earlier=reading.deliveries_before, copied_suspect=reading.suspect,
        )
        sent = system.get("SentTimestamp")
        self._text = str(raw.get("Body", ""))
        super().__init__(
            queue=queue,
            message_id=reading.message_id or self.sqs_message_id,
            headers=reading.headers,
            body=self._text.encode("utf-8"),
            delivery_count=delivery_count,
            redelivered=redelivered,
            correlation_id=own_headers.read_text(reading.headers.get(CORRELATION_ID_HEADER), 256),
            partition_key=system.get("MessageGroupId"),
            enqueued_at=dt.datetime.fromtimestamp(int(sent) / 1000, dt.UTC) if sent else None,
            # set by SQS, not the producer; on a copy the worker sent, the original's (a signed mark)
            sender=sender_across_copies(reading.headers, str(system["SenderId"]) if system.get("SenderId") else None),
            settle_timeout=settle_timeout,
        )
        self.queue_url = info.url
        self.receipt_handles = [str(raw["ReceiptHandle"])]
        self.requested_at = requested_at
        self.lock_seconds = visibility
        self.locked_until = requested_at + visibility
        self.lock_lost = False
        self._info = info
        self._dead_letters = dead_letters
        self._settler = settler
        self._renew = renew
        self._on_settled = on_settled
        self._raw = raw
        self._hold_retries = hold_retries
        self.retry_delay = 0.0
        self.successor: SQSDelivery | None = None

    # -- the lock ----------------------------------------------------------------------------

    def seconds_left_of_12_hours(self) -> int:
        """Whole seconds the visibility may still be extended to (SQS's 12 hours from the receive,
        less 1 s)."""
        return int(MAX_VISIBILITY_SECONDS - (time.monotonic() - self.requested_at) - 1)

    def _ensure_lock(self) -> None:
        if not self.holds_lock:
            self.lock_lost = True
            raise LockLost(
                f"the visibility of queue={self.queue} message_id={self.message_id} lapsed before "
                "its settlement"
            )

    async def _renew_lock(self) -> bool:
        return await self._renew(self)

    # -- settlement --------------------------------------------------------------------------

    async def _ack(self) -> None:
        self._ensure_lock()
        await self._settler.delete(self)

    async def _retry(self, delay: float) -> None:
        self._ensure_lock()
        seconds = math.ceil(delay)
        if self._hold_retries and seconds + self.lock_seconds < self.seconds_left_of_12_hours():
            # FIFO: the retry stays in this process (module docstring, "Held retries"); nothing
            # is sent, the successor takes over the lock and the lane runs it after the delay.
            self.retry_delay = delay
            self.successor = self._again()
            return
        if not self._info.fifo and seconds <= MAX_DELAY_SECONDS:
            headers = copy_headers(self.headers_for_copies)
            headers[DELIVERIES_ATTRIBUTE] = self.delivery_count
            if await self._copy_then_delete(self._info, headers, seconds, "retry"):
                return
        await self._give_back(seconds, uncounted=False)

    async def _release(self) -> None:
        self._ensure_lock()
        if not self._info.fifo:
            headers = copy_headers(self.headers_for_copies)
            headers[DELIVERIES_ATTRIBUTE] = self.delivery_count - 1  # this delivery does not count
            if self.redelivered:
                headers[REDELIVERED_ATTRIBUTE] = 1
            if await self._copy_then_delete(self._info, headers, 0, "release"):
                return
        await self._give_back(0, uncounted=True)

    async def _dead_letter(self, reason: str, detail: str) -> None:
        self._ensure_lock()
        headers = copy_headers(self.headers_for_copies)
        headers[DEAD_LETTER_REASON_ATTRIBUTE] = reason[:256]
        headers[DEAD_LETTER_DETAIL_ATTRIBUTE] = detail[:DETAIL_MAX_CHARS]
        headers[ORIGINAL_QUEUE_ATTRIBUTE] = self.queue
        headers[DELIVERIES_ATTRIBUTE] = self.delivery_count
        headers[MESSAGE_ID_ATTRIBUTE] = self.message_id
        # the first enqueue time before the message id (the operation's identity): without it a
        # redrive of this copy counts the operation's age from the copy's SentTimestamp (logged)
        droppable = (DEAD_LETTER_DETAIL_ATTRIBUTE, ORIGINAL_QUEUE_ATTRIBUTE, DELIVERIES_ATTRIBUTE,
                     own_headers.FIRST_ENQUEUED, MESSAGE_ID_ATTRIBUTE)
        if await self._copy_then_delete(self._dead_letters, headers, 0, "dead_letter", droppable):
            return
        logger.error(
            "dead-letter copy of queue=%s message_id=%s (reason %s) does not fit %s; giving it back "
            "for the queue's redrive policy (%s)",
            self.queue, self.message_id, reason, self._dead_letters.name,
            f"maxReceiveCount {self._info.redrive.max_receive_count}" if self._info.redrive
            else "none: it will keep coming back",
        )
        await self._give_back(0, uncounted=False)
        self.lost = True

    async def _abandon(self) -> None:
        if self.holds_lock:  # make it come back now rather than when the lock lapses
            await self._settler.change_visibility(self, 0)

    # -- helpers -----------------------------------------------------------------------------

    def _again(self) -> SQSDelivery:
        """The next delivery of this very receive (a held retry): the same receipt handles and
        lock, one delivery more, not redelivered."""
        successor = SQSDelivery(
            self._raw, queue=self.queue, info=self._info, dead_letters=self._dead_letters,
            settler=self._settler, requested_at=self.requested_at, visibility=self.lock_seconds,
            settle_timeout=self.settle_timeout, renew=self._renew, on_settled=self._on_settled,
            hold_retries=self._hold_retries, judged=(self.delivery_count + 1, False),
        )
        successor.receipt_handles = list(self.receipt_handles)
        successor.locked_until = self.locked_until
        successor.lock_lost = self.lock_lost
        return successor

    async def _give_back(self, seconds: int, *, uncounted: bool) -> None:
        """``ChangeMessageVisibility`` to ``seconds`` (at most what is left of the 12 hours),
        remembered so that the next receive is not taken for a redelivery."""
        seconds = max(0, min(seconds, self.seconds_left_of_12_hours()))
        # Remembered first: with 0 s the message is visible again the moment SQS applies the
        # change, and a receive in flight can hand it back before the change's reply arrives.
        earlier = GIVE_BACKS.remember(
            (self.queue_url, self.sqs_message_id), self.receive_count,
            uncounted=uncounted, suspect=self.redelivered and uncounted,
        )
        try:
            await self._settler.change_visibility(self, seconds)
        except (ClientError, LockLost):
            # SQS answered with a refusal: the change was not applied.
            GIVE_BACKS.forget((self.queue_url, self.sqs_message_id), earlier)
            raise
        # Anything else (the settle timeout, a lost reply, cancellation) leaves the outcome
        # unknown: SQS may have applied the change, so the give-back stays remembered. Forgetting
        # it made the next receive a "redelivery" on a loaded machine; if the change
        # was not applied, the lock lapses and the receive it brings is still our own give-back.

    async def _copy_then_delete(
        self, target: QueueInfo, headers: dict[str, Any], delay: int, why: str,
        droppable: Iterable[str] = (),
    ) -> bool:
        """Send a copy with ``headers`` to ``target``, then delete the original. ``False`` when
        the copy does not fit ``target``'s ``MaximumMessageSize`` (nothing sent, logged)."""
        try:
            attributes, dropped = fit(self._text, headers, target.max_message_size, droppable=droppable)
        except ValueError as exc:
            logger.warning(
                "%s copy to %s not sent: %s (queue=%s message_id=%s)",
                why, target.name, exc, self.queue, self.message_id,
            )
            return False
        if dropped:
            logger.warning(
                "%s copy to %s left out %s header(s) to fit %s bytes: %s (queue=%s message_id=%s)",
                why, target.name, len(dropped), target.max_message_size, ",".join(dropped)[:300],
                self.queue, self.message_id,
            )
        params: dict[str, Any] = {"MessageBody": self._text, "MessageAttributes": attributes}
        if delay > 0:
            params["DelaySeconds"] = delay
        if target.fifo:
            params["MessageGroupId"] = self.partition_key or DEFAULT_GROUP
            params["MessageDeduplicationId"] = keyed_copy_id(target.name, self.sqs_message_id, why)  # copy_ids: unguessable
        copy_id = await self._settler.send(target.url, params)
        logger.debug(
            "%s copy %s sent to %s (queue=%s message_id=%s delivery_count=%s)",
            why, copy_id, target.name, self.queue, self.message_id, self.delivery_count,
        )
        await self._settler.delete(self)
        return True

