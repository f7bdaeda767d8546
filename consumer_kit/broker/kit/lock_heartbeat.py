"""Keeping held deliveries locked: one heartbeat per consumer extends every lock before it lapses.

What the pull adapters (SQS, NATS JetStream) share. A delivery the consumer has pulled and not yet
settled is *held* (running in a handler, waiting for a slot in the worker, waiting in a lane) from
:meth:`LockHeartbeat.hold` to :meth:`LockHeartbeat.drop`: it is dropped once settled, and when the
worker's hand-over ends with it unsettled (a crash point), so that its lock lapses and the broker
redelivers it, as after a crash (:mod:`consumer_kit.broker.kit.pull_consumer`).

The heartbeat wakes every quarter of the shortest lock held (0.1 to 10 s) and extends every held
delivery with half its lock or less left, in as few broker calls as the adapter can make; each
lock counts as extended from the moment its extension was *sent*
(:attr:`~consumer_kit.broker.kit.pull_consumer.PulledDelivery.locked_until`). A call that fails is logged
once per outage and made again at the next tick, before the lock lapses. With the heartbeat off
(``heartbeat=off``) nothing is extended unless ``Delivery.renew_lock()`` asks.

The adapter supplies the broker's call (:meth:`LockHeartbeat._extend`, :meth:`LockHeartbeat.renew`),
how due deliveries are grouped into calls (:meth:`LockHeartbeat._batches`) and any limit of its own
on what is due (SQS: 12 hours). Nothing here imports an adapter or an SDK.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
from collections.abc import Iterable
from typing import ClassVar, Generic, TypeVar

from consumer_kit.broker.kit.pull_consumer import PulledDelivery
from consumer_kit.resilience.supervised import Supervised

MIN_TICK, MAX_TICK = 0.1, 10.0  # seconds between two beats

D = TypeVar("D", bound=PulledDelivery)


class LockHeartbeat(abc.ABC, Generic[D]):
    """Extends the locks of held deliveries (module docstring); the task is supervised.

    Args:
        name: the heartbeat task's name (logs).
        enabled: ``False`` (``heartbeat=off``): nothing is extended unless ``renew_lock()`` asks.

    Class attributes (the adapter's): ``log`` (its logger), ``call`` (what one extension is
    called in its log lines: ``"in_progress"``, ``"visibility extension"``).

    Attributes:
        extensions: locks extended (the broker accepted the extension).
    """

    log: ClassVar[logging.Logger]
    call: ClassVar[str]

    def __init__(self, name: str, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self._held: set[D] = set()
        self._task = Supervised(name, self._beat)
        self._failing = False
        self.extensions = 0

    def hold(self, delivery: D) -> None:
        """Keep ``delivery`` locked until :meth:`drop`."""
        self._held.add(delivery)
        if self.enabled:
            self._task.start()  # idempotent

    def drop(self, delivery: D) -> None:
        """Stop extending ``delivery`` (it was settled, or handed back unsettled)."""
        self._held.discard(delivery)

    def held(self) -> tuple[D, ...]:
        """The deliveries held now."""
        return tuple(self._held)

    @abc.abstractmethod
    async def renew(self, delivery: D) -> bool:
        """Extend ``delivery``'s lock now (``Delivery.renew_lock``); ``False`` when it is lost.
        Raises what the broker call raises (the base class of deliveries makes it ``False``)."""

    async def close(self) -> None:
        await self._task.stop()

    def supervised(self) -> list[Supervised]:
        """The heartbeat's task (readiness)."""
        return [self._task]

    # -- the beat ----------------------------------------------------------------------------

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self._tick())
            for batch in self._batches([d for d in self._held if self._due(d)]):
                try:
                    await self._extend(batch)
                except Exception as exc:  # noqa: BLE001 - tried again next tick, before the lock lapses
                    if not self._failing:
                        self.log.warning(
                            "%s of %s held deliveries failed (%s); retrying", self.call, len(batch),
                            self._describe(exc),
                        )
                    self._failing = True
                    continue
                self._failing = False

    def _tick(self) -> float:
        shortest = min((d.lock_seconds for d in self._held), default=MAX_TICK * 4)
        return max(MIN_TICK, min(MAX_TICK, shortest / 4))

    def _due(self, delivery: D) -> bool:
        """Unsettled, still locked, and half its lock or less left."""
        return (
            delivery.settlement is None and delivery.holds_lock
            and delivery.locked_until - time.monotonic() <= delivery.lock_seconds / 2
        )

    def _batches(self, due: list[D]) -> Iterable[list[D]]:
        """The broker calls ``due`` takes, one list each. Default: one call for all."""
        return [due] if due else []

    @abc.abstractmethod
    async def _extend(self, deliveries: list[D]) -> None:
        """Extend the locks of ``deliveries`` (one batch) and call :meth:`_extended` for each one
        extended. Raises when the call fails as a whole (logged, tried again next tick)."""

    @abc.abstractmethod
    def _describe(self, exc: Exception) -> str:
        """What a failed extension says in the log (no secrets, no payloads)."""

    def _extended(self, delivery: D, sent_at: float, seconds: float) -> None:
        """The lock of ``delivery`` now lasts ``seconds`` from ``sent_at`` (``time.monotonic()``
        when the extension was sent)."""
        delivery.locked_until = max(delivery.locked_until, sent_at + seconds)
        self.extensions += 1
