"""Keeping held deliveries locked: ``in_progress()`` before ``ack_wait`` lapses.

Every delivery the consumer has pulled and not yet settled is *held* (running, or waiting for a
slot in the worker). The heartbeat wakes every quarter of the shortest ``ack_wait`` held (0.1 to
10 s) and sends ``in_progress()`` (``+WPI``: JetStream restarts the message's ``ack_wait``) for
every held delivery with half its ``ack_wait`` or less left, then one flush (a ping) for all of
them: each lock counts as extended from the moment its ``+WPI`` was written. It stops with the
settlement, and when the worker's hand-over ends with the delivery unsettled (a crash point): the
lock then lapses and JetStream redelivers it, as after a crash.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from consumer_kit.supervised import Supervised

from .errors import describe

if TYPE_CHECKING:
    from .delivery import NATSDelivery

logger = logging.getLogger(__name__)

_MIN_TICK, _MAX_TICK = 0.1, 10.0  # seconds


class Heartbeat:
    """Sends ``in_progress()`` for held deliveries (module docstring).

    Args:
        enabled: ``False`` (``heartbeat=off``): nothing is extended unless ``renew_lock()`` asks.

    Attributes:
        extensions: ``in_progress()`` sent and flushed.
    """

    def __init__(self, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self._held: set[NATSDelivery] = set()
        self._task = Supervised("consumer-kit nats heartbeat", self._beat)
        self._failing = False
        self.extensions = 0

    def hold(self, delivery: NATSDelivery) -> None:
        self._held.add(delivery)
        if self.enabled:
            self._task.start()  # idempotent

    def drop(self, delivery: NATSDelivery) -> None:
        self._held.discard(delivery)

    async def renew(self, delivery: NATSDelivery) -> bool:
        """``in_progress()`` for ``delivery`` now (``Delivery.renew_lock``); ``False`` when its
        lock is already lost. Raises what nats-py raises (the base class makes it ``False``)."""
        if not delivery.holds_lock:
            return False
        await self._extend([delivery])
        return True

    async def close(self) -> None:
        await self._task.stop()

    def supervised(self) -> list[Supervised]:
        return [self._task]

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self._tick())
            due = [d for d in self._held if d.settlement is None and d.holds_lock
                   and d.locked_until - time.monotonic() <= d.ack_wait / 2]
            if not due:
                continue
            try:
                await self._extend(due)
            except Exception as exc:  # noqa: BLE001 - tried again next tick, before the lock lapses
                if not self._failing:
                    logger.warning("in_progress for %s held deliveries failed (%s); retrying", len(due), describe(exc))
                self._failing = True
                continue
            self._failing = False

    async def _extend(self, deliveries: list[NATSDelivery]) -> None:
        sent_at = time.monotonic()
        for delivery in deliveries:
            await delivery.msg.in_progress()
        await deliveries[0].msg._client.flush(timeout=5)
        for delivery in deliveries:
            delivery.locked_until = max(delivery.locked_until, sent_at + delivery.ack_wait)
            self.extensions += 1

    def _tick(self) -> float:
        shortest = min((d.ack_wait for d in self._held), default=_MAX_TICK * 4)
        return max(_MIN_TICK, min(_MAX_TICK, shortest / 4))
