"""Lock renewal: every lock the adapter holds is renewed at half its remaining time until released.

What is held: each unsettled delivery of a queue or subscription (its message lock, from the
moment it is received: a delivery waiting for a slot, behind a message that runs alone, keeps its
lock too), each delivery whose delayed retry is being held (:mod:`consumer_kit.adapters.servicebus.delivery`),
and each session a session receiver holds (its session lock covers its messages).

Timing: the next renewal is due when half of the time left on the lock has passed (the time left
on the worker's monotonic clock, :mod:`consumer_kit.adapters.servicebus.lock_clock`: never the broker's
``locked_until`` against the host's wall clock, which a skewed clock makes too late or too often), at least :data:`MIN_WAIT` and at most :data:`MAX_WAIT` seconds after the
last one. A renewal that fails without losing the lock (a connection blip) is tried again on the
same rule, so retries come quicker as the expiry nears. A lock reported lost
(``MessageLockLostError``, ``SessionLockLostError``) is never renewed again: the lock holder marks
itself lost (and logs it), and the broker redelivers the message.

(The SDK's own ``AutoLockRenewer`` compares ``locked_until`` with the host's clock, hence is not used.)
"""

from __future__ import annotations

import asyncio
import enum
import logging
from typing import Protocol

from consumer_kit.resilience.supervised import Supervised, all_running

logger = logging.getLogger(__name__)

MIN_WAIT = 0.1  # seconds between two renewals of one lock, at least
MAX_WAIT = 60.0  # seconds, at most (Service Bus locks last 5 s to 5 min)


class Renewal(enum.Enum):
    """What one renewal attempt found."""

    RENEWED = "renewed"
    LOST = "lost"  # the broker says the lock is gone: stop, the message comes back to someone
    FAILED = "failed"  # no answer or another error: the lock may still hold, try again


class Renewable(Protocol):
    """A lock the keeper renews: a delivery's message lock or a session lock."""

    @property
    def released(self) -> asyncio.Event:
        """Set once the lock needs no more renewal (settled, given back, lost, or left to expire)."""
        ...

    def seconds_left(self) -> float | None:
        """Seconds until the lock expires on the worker's monotonic clock, ``None`` when unknown."""
        ...

    async def renew(self) -> Renewal:
        """One renewal attempt, bounded in time by the implementation; never raises."""
        ...


def seconds_until_renewal(seconds_left: float | None) -> float:
    """Seconds to wait before the next renewal: half the time left, within [MIN_WAIT, MAX_WAIT]."""
    if seconds_left is None:
        return MIN_WAIT
    return min(MAX_WAIT, max(MIN_WAIT, seconds_left / 2))


class LockKeeper:
    """Runs one small renewal task per held lock (the locks count their own renewals)."""

    def __init__(self) -> None:
        self._tasks: set[Supervised] = set()

    def keep(self, lock: Renewable, *, name: str) -> None:
        """Renew ``lock`` until its ``released`` event is set or it is lost; ``name`` shows in logs.
        The renewal task is supervised (restarted if it dies)."""
        task = Supervised(f"consumer-kit servicebus renew {name}", lambda: self._keep(lock, name))
        self._tasks.add(task)
        task.start().on_finished(self._tasks.discard)

    @property
    def running(self) -> bool:
        """No renewal task is down (readiness)."""
        return all_running(list(self._tasks))

    async def close(self) -> None:
        """Stop renewing every lock (the consumer is closing: what is not settled goes back)."""
        await asyncio.gather(*(task.stop() for task in list(self._tasks)))

    async def _keep(self, lock: Renewable, name: str) -> None:
        while not lock.released.is_set():
            wait = seconds_until_renewal(lock.seconds_left())
            try:
                async with asyncio.timeout(wait):
                    await lock.released.wait()
                return
            except TimeoutError:
                pass
            if await lock.renew() is Renewal.LOST:
                logger.debug("stopped renewing %s: its lock is lost", name)
                return
