"""Keeping held deliveries locked: extending their visibility before it lapses.

Every delivery the consumer has received and not yet settled is *held*: running in a handler,
waiting for a slot in the worker (admission, running alone) or waiting in its FIFO group's lane.
The heartbeat wakes every ``tick`` seconds (a quarter of the shortest visibility timeout held,
0.1 to 10 s) and extends, with ``ChangeMessageVisibilityBatch`` (10 entries a call, per queue),
every held delivery with half its visibility timeout or less left, to a full visibility timeout
from now. It stops with the settlement (a settled delivery is no longer held), and when the
worker's hand-over ends with the delivery unsettled (a crash point): it is dropped then, so its
visibility lapses and SQS redelivers it, as after a crash (:mod:`consumer_kit.adapters.sqs.subscription`).

**12 hours.** SQS refuses to extend a message's visibility beyond 12 hours from its receive.
An extension asks at most for what is left of them; once nothing is left, the delivery is logged
once at WARNING and its lock lapses (the message comes back and the ledger answers it; a handler
this long should take the leased external-effects path instead).

A failed entry whose receipt handle is stale means the lock is already gone: the delivery is
marked ``lock_lost`` (its settlement will not ack) and logged once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from consumer_kit.supervised import Supervised

from .connection import SQSClient
from .errors import describe, entry_code, is_stale, is_stale_receipt

if TYPE_CHECKING:
    from .delivery import SQSDelivery

logger = logging.getLogger(__name__)

_MIN_TICK, _MAX_TICK = 0.1, 10.0  # seconds
_BATCH = 10


class Heartbeat:
    """Extends the visibility of held deliveries (module docstring).

    Args:
        client: the consumer's SQS client.
        enabled: ``False`` (``heartbeat=off``): nothing is extended unless ``renew_lock()`` asks.

    Attributes:
        extensions: visibility extensions SQS accepted.
        locks_lost: held deliveries found to have lost their lock.
    """

    def __init__(self, client: SQSClient, *, enabled: bool = True) -> None:
        self._client = client
        self.enabled = enabled
        self._held: set[SQSDelivery] = set()
        self._task = Supervised("consumer-kit sqs heartbeat", self._beat)
        self._warned_12h: set[SQSDelivery] = set()
        self._failing = False
        self.extensions = 0
        self.locks_lost = 0

    def hold(self, delivery: SQSDelivery) -> None:
        """Keep ``delivery`` locked until :meth:`drop`."""
        self._held.add(delivery)
        if self.enabled:
            self._task.start()  # idempotent

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
        seconds = min(delivery.visibility, delivery.seconds_left_of_12_hours())
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

    async def close(self) -> None:
        await self._task.stop()

    def supervised(self) -> list[Supervised]:
        """The heartbeat's task (readiness)."""
        return [self._task]

    # -- the beat ----------------------------------------------------------------------------

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self._tick())
            due = [d for d in self._held if self._due(d)]
            by_queue: dict[str, list[SQSDelivery]] = {}
            for delivery in due:
                by_queue.setdefault(delivery.queue_url, []).append(delivery)
            for queue_url, deliveries in by_queue.items():
                for start in range(0, len(deliveries), _BATCH):
                    await self._extend(queue_url, deliveries[start:start + _BATCH])

    def _tick(self) -> float:
        shortest = min((d.visibility for d in self._held), default=_MAX_TICK * 4)
        return max(_MIN_TICK, min(_MAX_TICK, shortest / 4))

    def _due(self, delivery: SQSDelivery) -> bool:
        if delivery.settlement is not None or not delivery.holds_lock:
            return False
        if delivery.visible_until - time.monotonic() > delivery.visibility / 2:
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

    async def _extend(self, queue_url: str, deliveries: list[SQSDelivery]) -> None:
        timeouts = [min(d.visibility, d.seconds_left_of_12_hours()) for d in deliveries]
        sent_at = time.monotonic()
        try:
            reply = await self._client.call(
                "change_message_visibility_batch", QueueUrl=queue_url,
                Entries=[
                    {"Id": str(i), "ReceiptHandle": d.receipt_handles[-1], "VisibilityTimeout": t}
                    for i, (d, t) in enumerate(zip(deliveries, timeouts, strict=True))
                ],
            )
        except Exception as exc:  # noqa: BLE001 - tried again next tick, before the lock lapses
            if not self._failing:
                logger.warning("visibility extension failed (%s); retrying", describe(exc))
            self._failing = True
            return
        self._failing = False
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

    def _extended(self, delivery: SQSDelivery, sent_at: float, seconds: int) -> None:
        delivery.visible_until = max(delivery.visible_until, sent_at + seconds)
        self.extensions += 1

    def _lost(self, delivery: SQSDelivery, why: str) -> None:
        if not delivery.lock_lost:
            delivery.lock_lost = True
            self.locks_lost += 1
            logger.warning(
                "queue=%s message_id=%s lost its lock (%s): it will not be acked here",
                delivery.queue, delivery.message_id, why,
            )

    def held(self) -> Iterable[SQSDelivery]:
        return tuple(self._held)
