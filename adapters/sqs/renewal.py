"""Keeping held deliveries locked: extending their visibility before it lapses.

The shared heartbeat (:mod:`consumer_kit.broker.kit.lock_heartbeat`: every quarter of the shortest visibility
timeout held, 0.1 to 10 s, each held delivery with half its visibility timeout or less left)
extends, with ``ChangeMessageVisibilityBatch`` (10 entries a call, per queue), every due delivery
to a full visibility timeout from now. Held are the deliveries running in a handler, waiting for a
slot in the worker (admission, running alone) or waiting in their FIFO group's lane. It stops with
the settlement (a settled delivery is no longer held), and when the worker's hand-over ends with
the delivery unsettled (a crash point): it is dropped then, so its visibility lapses and SQS
redelivers it, as after a crash (:mod:`consumer_kit.adapters.sqs.subscription`).

**12 hours.** SQS refuses to extend a message's visibility beyond 12 hours from its receive.
An extension asks at most for what is left of them; once nothing is left, the delivery is logged
once at WARNING and its lock lapses (the message comes back and the ledger answers it; a handler
this long should take the leased external-effects path instead).

A failed entry whose receipt handle is stale means the lock is already gone: the delivery is
marked ``lock_lost`` (its settlement will not ack) and logged once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from consumer_kit.broker.kit.lock_heartbeat import LockHeartbeat
from consumer_kit.telemetry.metrics import record_lock_lost

from .connection import SQSClient
from .delivery import SQSDelivery
from .errors import describe, entry_code, is_stale, is_stale_receipt

logger = logging.getLogger(__name__)

_BATCH = 10


class Heartbeat(LockHeartbeat[SQSDelivery]):
    """Extends the visibility of held deliveries (module docstring).

    Args:
        client: the consumer's SQS client.
        enabled: ``False`` (``heartbeat=off``): nothing is extended unless ``renew_lock()`` asks.

    Attributes:
        extensions: visibility extensions SQS accepted.
        locks_lost: held deliveries found to have lost their lock.
    """

    log = logger
    call = "visibility extension"

    def __init__(self, client: SQSClient, *, enabled: bool = True) -> None:
        super().__init__("consumer-kit sqs heartbeat", enabled=enabled)
        self._client = client
        self._warned_12h: set[SQSDelivery] = set()
        self.locks_lost = 0

    def drop(self, delivery: SQSDelivery) -> None:
        """Stop extending ``delivery`` (it was settled, or handed back unsettled)."""
        self._held.discard(delivery)
        self._warned_12h.discard(delivery)

    async def renew(self, delivery: SQSDelivery) -> bool:
        """Extend ``delivery``'s visibility now (``Delivery.renew_lock``); ``False`` when its lock
        is lost or the 12 hours are used up.

        Raises:
            botocore errors: SQS did not answer (the base class turns it into ``False``).
        """
        seconds = min(delivery.lock_seconds, delivery.seconds_left_of_12_hours())
        if not delivery.holds_lock or seconds <= 0:
            return False
        sent_at = time.monotonic()
        try:
            await self._client.call(
                "change_message_visibility", QueueUrl=delivery.queue_url,
                ReceiptHandle=delivery.receipt_handles[-1], VisibilityTimeout=seconds,
            )
        except Exception as exc:
            if is_stale(exc):
                self._lost(delivery, describe(exc))
                return False
            raise
        self._extended(delivery, sent_at, seconds)
        return True

    # -- the beat ----------------------------------------------------------------------------

    def _batches(self, due: list[SQSDelivery]) -> Iterable[list[SQSDelivery]]:
        by_queue: dict[str, list[SQSDelivery]] = {}
        for delivery in due:
            by_queue.setdefault(delivery.queue_url, []).append(delivery)
        for deliveries in by_queue.values():
            for start in range(0, len(deliveries), _BATCH):
                yield deliveries[start:start + _BATCH]

    def _due(self, delivery: SQSDelivery) -> bool:
        if not super()._due(delivery):
            return False
        if delivery.seconds_left_of_12_hours() <= 0:
            if delivery not in self._warned_12h:
                self._warned_12h.add(delivery)
                logger.warning(
                    "queue=%s message_id=%s reached SQS's 12-hour visibility maximum: its lock "
                    "lapses and the message comes back", delivery.queue, delivery.message_id,
                )
            return False
        return True

    async def _extend(self, deliveries: list[SQSDelivery]) -> None:
        timeouts = [min(d.lock_seconds, d.seconds_left_of_12_hours()) for d in deliveries]
        sent_at = time.monotonic()
        reply = await self._client.call(
            "change_message_visibility_batch", QueueUrl=deliveries[0].queue_url,
            Entries=[
                {"Id": str(i), "ReceiptHandle": d.receipt_handles[-1], "VisibilityTimeout": t}
                for i, (d, t) in enumerate(zip(deliveries, timeouts, strict=True))
            ],
        )
        failed = {str(f.get("Id")): f for f in reply.get("Failed", [])}
        for i, (delivery, seconds) in enumerate(zip(deliveries, timeouts, strict=True)):
            entry = failed.get(str(i))
            if entry is None:
                self._extended(delivery, sent_at, seconds)
            elif is_stale_receipt(entry_code(entry), str(entry.get("Message", ""))):
                self._lost(delivery, entry_code(entry))
            else:
                logger.info(
                    "visibility extension of queue=%s message_id=%s failed (%s); retrying",
                    delivery.queue, delivery.message_id, entry_code(entry),
                )

    def _describe(self, exc: Exception) -> str:
        return describe(exc)

    def _lost(self, delivery: SQSDelivery, why: str) -> None:
        if not delivery.lock_lost:
            delivery.lock_lost = True
            self.locks_lost += 1
            record_lock_lost(delivery.queue, "aws_sqs")
            logger.warning(
                "queue=%s message_id=%s lost its lock (%s): it will not be acked here",
                delivery.queue, delivery.message_id, why,
            )
