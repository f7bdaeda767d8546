"""Keeping held deliveries locked: ``in_progress()`` before ``ack_wait`` lapses.

The shared heartbeat (:mod:`consumer_kit.broker.kit.lock_heartbeat`: every quarter of the shortest
``ack_wait`` held, 0.1 to 10 s, each held delivery with half its ``ack_wait`` or less left) sends
``in_progress()`` (``+WPI``: JetStream restarts the message's ``ack_wait``) for every due delivery,
then one flush (a ping) for all of them: each lock counts as extended from the moment its
``+WPI`` was written. It stops with the settlement, and when the worker's hand-over ends with the
delivery unsettled (a crash point): the lock then lapses and JetStream redelivers it, as after a
crash.
"""

from __future__ import annotations

import logging
import time

from consumer_kit.broker.kit.lock_heartbeat import LockHeartbeat

from .delivery import NATSDelivery
from .errors import describe

logger = logging.getLogger(__name__)


class Heartbeat(LockHeartbeat[NATSDelivery]):
    """Sends ``in_progress()`` for held deliveries (module docstring).

    Args:
        enabled: ``False`` (``heartbeat=off``): nothing is extended unless ``renew_lock()`` asks.

    Attributes:
        extensions: ``in_progress()`` sent and flushed.
    """

    log = logger
    call = "in_progress"

    def __init__(self, *, enabled: bool = True) -> None:
        super().__init__("consumer-kit nats heartbeat", enabled=enabled)

    async def renew(self, delivery: NATSDelivery) -> bool:
        """``in_progress()`` for ``delivery`` now (``Delivery.renew_lock``); ``False`` when its
        lock is already lost. Raises what nats-py raises (the base class makes it ``False``)."""
        if not delivery.holds_lock:
            return False
        await self._extend([delivery])
        return True

    async def _extend(self, deliveries: list[NATSDelivery]) -> None:
        sent_at = time.monotonic()
        for delivery in deliveries:
            await delivery.msg.in_progress()
        await deliveries[0].msg._client.flush(timeout=5)
        for delivery in deliveries:
            self._extended(delivery, sent_at, delivery.lock_seconds)

    def _describe(self, exc: Exception) -> str:
        return describe(exc)
