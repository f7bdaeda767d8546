"""One JetStream delivery under ``ack_wait``, and how each settlement reaches the server.

=============  =====================================================================================
settlement     on JetStream
=============  =====================================================================================
ack            ``ack_sync`` (JetStream confirms it; the message leaves the work-queue stream)
retry(delay)   ``nak(delay)``, remembered (:mod:`consumer_kit.adapters.nats.redelivery`)
release        a confirmed copy on the message's own subject with ``x-consumer-kit-deliveries =
               delivery_count - 1`` (uncounted) and ``x-consumer-kit-redelivered`` only for a
               suspect, then ``ack_sync``: neither an attempt nor a redelivery, and nothing moves
               towards ``max_deliver``. A copy that cannot be sent: ``nak()``, remembered as uncounted
dead_letter    a confirmed copy to the dead-letter stream with ``x-dead-letter-reason``/``-detail``,
               ``x-original-queue`` and ``x-consumer-kit-deliveries``, then ``term()`` (no
               redelivery; the work-queue stream drops it). A copy that does not fit even trimmed
               is never sent: the message is given back (``nak``, ``lost``) and JetStream's
               ``max_deliver`` ends its loop (logged at ERROR)
=============  =====================================================================================

Copies carry a random ``Nats-Msg-Id`` (:func:`consumer_kit.broker.kit.copy_ids.random_copy_id`): no
producer can publish under it first to make JetStream drop the copy as a repeat. Each copy is sent
once, so a publish ack saying ``duplicate`` is an error (:class:`CopyDropped`): the settlement
fails and the message is given back, never settled as if its copy existed.

**The lock.** The adapter knows when its peek-lock lapses: the time the pull was *sent* plus
``ack_wait`` (the delivery's ``lock_seconds``), moved by each ``in_progress()``
(:mod:`consumer_kit.adapters.nats.renewal`). Past that (less 10 % of ``ack_wait``, at most 1 s:
:class:`consumer_kit.broker.kit.pull_consumer.PulledDelivery`) nothing is settled any more: JetStream may have
handed the message to someone else. Such a settlement raises :class:`LockLost` and the delivery is
``lost``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from nats.aio.msg import Msg
from nats.js import JetStreamContext

from consumer_kit.broker.kit.copy_ids import random_copy_id
from consumer_kit.broker.kit.pull_consumer import PulledDelivery
from consumer_kit.codec import headers as own_headers
from consumer_kit.codec.envelope import CORRELATION_ID_HEADER, PARTITION_KEY_HEADER
from consumer_kit.errors import LockLost

from .envelope import (
    DEAD_LETTER_DETAIL_HEADER,
    DEAD_LETTER_REASON_HEADER,
    DELIVERIES_HEADER,
    DETAIL_MAX_CHARS,
    MESSAGE_ID_HEADER,
    MSG_ID,
    ORIGINAL_QUEUE_HEADER,
    REDELIVERED_HEADER,
    copy_headers,
    headers_of,
)
from .errors import CopyDropped
from .limits import fit, limit_of
from .redelivery import GIVE_BACKS
from .topology import QueueInfo

logger = logging.getLogger(__name__)


class NATSDelivery(PulledDelivery):
    """One message of a pull (settlement table in the module docstring).

    ``message_id`` is ``x-consumer-kit-message-id`` (on copies), else ``Nats-Msg-Id`` (the
    event ID of a relay publish); ``delivery_count``/``redelivered`` follow
    :mod:`consumer_kit.adapters.nats.redelivery`; ``enqueued_at`` is the stream's timestamp;
    ``partition_key`` is header ``partition-key``; ``sender`` is ``None`` (NATS authenticates
    connections, not messages).

    Args:
        msg: the nats-py message.
        info: its work queue.
        js: the consumer's JetStream context (copies).
        max_payload: the server's limit in bytes.
        requested_at: ``time.monotonic()`` when the pull was sent (the lock's start).
        settle_timeout: seconds; the bound the base class puts on each settlement.
        renew: sends ``in_progress()`` now (the heartbeat's); ``False`` when the lock is lost.
        on_settled: told once the delivery is settled, whatever the outcome.
    """

    def __init__(
        self, msg: Msg, *, info: QueueInfo, js: JetStreamContext, max_payload: int, requested_at: float,
        settle_timeout: float, renew: Callable[[NATSDelivery], Awaitable[bool]],
        on_settled: Callable[[NATSDelivery], None],
    ) -> None:
        meta = msg.metadata
        self.msg = msg
        self.stream_seq = int(meta.sequence.stream)
        self.num_delivered = int(meta.num_delivered)
        reading = own_headers.read(headers_of(msg.headers), msg.data)
        delivery_count, redelivered = GIVE_BACKS.judge(
            (info.stream, self.stream_seq), self.num_delivered,
            earlier=reading.deliveries_before, copied_suspect=reading.suspect,
        )
        super().__init__(
            queue=info.queue,
            message_id=reading.message_id or own_headers.read_text((msg.headers or {}).get(MSG_ID), 512),
            headers=reading.headers,
            body=msg.data,
            delivery_count=delivery_count,
            redelivered=redelivered,
            correlation_id=own_headers.read_text(reading.headers.get(CORRELATION_ID_HEADER), 256),
            partition_key=own_headers.read_text(reading.headers.get(PARTITION_KEY_HEADER), 512),
            enqueued_at=meta.timestamp,
            settle_timeout=settle_timeout,
        )
        self.info = info
        self.lock_seconds = info.ack_wait
        self.locked_until = requested_at + info.ack_wait
        self.lock_lost = False
        self._js = js
        self._max_payload = max_payload
        self._renew = renew
        self._on_settled = on_settled

    # -- the lock ----------------------------------------------------------------------------

    def _ensure_lock(self) -> None:
        if not self.holds_lock:
            self.lock_lost = True
            raise LockLost(f"ack_wait of queue={self.queue} message_id={self.message_id} lapsed before its settlement")

    async def _renew_lock(self) -> bool:
        return await self._renew(self)

    # -- settlement --------------------------------------------------------------------------

    async def _ack(self) -> None:
        self._ensure_lock()
        await self.msg.ack_sync(timeout=self.settle_timeout)
        GIVE_BACKS.forget((self.info.stream, self.stream_seq))

    async def _retry(self, delay: float) -> None:
        self._ensure_lock()
        await self._nak(delay, uncounted=False)

    async def _release(self) -> None:
        self._ensure_lock()
        headers = copy_headers(self.headers_for_copies)
        headers[DELIVERIES_HEADER] = self.delivery_count - 1  # this delivery does not count
        if self.message_id is not None:  # the copy gets a Nats-Msg-Id of its own
            headers[MESSAGE_ID_HEADER] = self.message_id
        if self.redelivered:
            headers[REDELIVERED_HEADER] = 1
        if not await self._copy(self.msg.subject, self.info.max_msg_size, headers, "release"):
            await self._nak(0, uncounted=True)
            return
        await self.msg.ack_sync(timeout=self.settle_timeout)

    async def _dead_letter(self, reason: str, detail: str) -> None:
        self._ensure_lock()
        headers = copy_headers(self.headers_for_copies)
        headers[DEAD_LETTER_REASON_HEADER] = reason[:256]
        headers[DEAD_LETTER_DETAIL_HEADER] = detail[:DETAIL_MAX_CHARS]
        headers[ORIGINAL_QUEUE_HEADER] = self.queue
        headers[DELIVERIES_HEADER] = self.delivery_count
        if self.message_id is not None:
            headers[MESSAGE_ID_HEADER] = self.message_id
        droppable = (DEAD_LETTER_DETAIL_HEADER, ORIGINAL_QUEUE_HEADER, DELIVERIES_HEADER,
                     own_headers.FIRST_ENQUEUED, MESSAGE_ID_HEADER)
        if await self._copy(self.info.dlq_subject, self.info.dlq_max_msg_size, headers, "dead_letter", droppable):
            await self.msg.term()
            await self._flush()
            GIVE_BACKS.forget((self.info.stream, self.stream_seq))
            return
        logger.error(
            "dead-letter copy of queue=%s message_id=%s (reason %s) does not fit %s; giving it back: "
            "JetStream's max_deliver ends its loop", self.queue, self.message_id, reason, self.info.dlq_stream,
        )
        await self._nak(0, uncounted=False)
        self.lost = True

    async def _abandon(self) -> None:
        if self.holds_lock and not self.msg.is_acked:  # come back now rather than when ack_wait lapses
            await self.msg.nak()

    # -- helpers -----------------------------------------------------------------------------

    async def _nak(self, delay: float, *, uncounted: bool) -> None:
        # remembered first: a nak without delay is redelivered before its flush returns
        GIVE_BACKS.remember((self.info.stream, self.stream_seq), self.num_delivered,
                            uncounted=uncounted, suspect=self.redelivered and uncounted)
        await self.msg.nak(delay=delay if delay > 0 else None)
        await self._flush()

    async def _flush(self) -> None:
        """The server has read what was written before (a ping round trip)."""
        await self.msg._client.flush(timeout=max(1, int(self.settle_timeout)))

    async def _copy(self, subject: str, max_msg_size: int, headers: dict[Any, Any], why: str,
                    droppable: Iterable[str] = ()) -> bool:
        """Publish a copy of the body with ``headers`` on ``subject`` and wait for its publish
        ack. ``False`` when it does not fit (nothing sent, logged).

        Raises:
            CopyDropped: JetStream answered the copy as a duplicate (module docstring).
        """
        limit = limit_of(self._max_payload, max_msg_size)
        try:
            sent, dropped = fit(self.body, headers, limit, droppable=droppable,
                                extra={MSG_ID: random_copy_id()})
        except ValueError as exc:
            logger.warning("%s copy to %s not sent: %s (queue=%s message_id=%s)",
                           why, subject, exc, self.queue, self.message_id)
            return False
        if dropped:
            logger.warning("%s copy to %s left out %s header(s) to fit %s bytes: %s (queue=%s message_id=%s)",
                           why, subject, len(dropped), limit, ",".join(dropped)[:300], self.queue, self.message_id)
        ack = await self._js.publish(subject, self.body, headers=sent, timeout=self.settle_timeout)
        if ack.duplicate:
            raise CopyDropped(f"{why} copy of queue={self.queue} message_id={self.message_id} was answered as a "
                              f"duplicate by stream {ack.stream}: its Nats-Msg-Id was used before")
        return True
