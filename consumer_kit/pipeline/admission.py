"""Admission: when a delivery of this process may run (docs/explanation/faults-and-attempts.md).

Three rules, one object:

* **one limit per process**: at most ``limit`` deliveries run at once, across every queue of the
  worker (the database pool is sized from the same number);
* **poison isolation**: a redelivered message (the broker handed it out before and nobody settled
  it: the process may have died running it) runs *alone*: it waits until nothing else runs, and
  other deliveries wait until it is done, so a message that kills its process takes only itself
  down. The waiting deliveries stay with the worker (the broker's prefetch bounds how many): if
  the process dies they come back as redeliveries, never having run, and no crash is counted
  against them.
* **environment pause**: while the database (or another dependency of every delivery) is
  unavailable, nothing is started: deliveries are given back uncounted (:class:`GiveBack`) until
  :meth:`resume`, and ``on_change`` tells the worker to stop the broker from handing out more.

Why running alone does not pause the broker's consumer: on a RabbitMQ quorum queue, cancelling a
consumer returns the messages already checked out to it but still in transit as *redeliveries*
(``x-delivery-count`` + 1), which would make each of them run alone in turn, and so on.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from consumer_kit.errors import GiveBack
from consumer_kit.resilience.one_shots import OneShots


class Admission:
    """Slots for deliveries of one process.

    Args:
        limit: deliveries running at once (``None``: no limit, e.g. in tests of the runtime alone).
        on_change: called with ``True`` when the process pauses (consumers should stop) and with
            ``False`` when it resumes.

    Attributes:
        running: deliveries running now.
        paused_reason: why the process is paused, or ``None``.
    """

    def __init__(self, limit: int | None = None, on_change: Callable[[bool], None] | None = None) -> None:
        self.limit = limit
        self.on_change = on_change
        self.running = 0
        self.paused_reason: str | None = None
        self._alone_waiting = 0  # redelivered messages waiting to run alone, or running alone
        self._alone_running = False
        self._changed = asyncio.Condition()
        self._wakers = OneShots()

    @property
    def paused(self) -> bool:
        return self.paused_reason is not None

    @property
    def isolating(self) -> bool:
        """``True`` while a redelivered message waits to run alone or runs alone."""
        return self._alone_waiting > 0

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Run one ordinary delivery: waits for a free slot, and for any redelivered message that
        waits to run (or runs) alone.

        Raises:
            GiveBack: the process is paused.
        """
        async with self._changed:
            while True:
                if self.paused:
                    raise GiveBack("paused")
                if self._alone_waiting == 0 and (self.limit is None or self.running < self.limit):
                    break
                await self._changed.wait()
            self.running += 1
        try:
            yield
        finally:
            async with self._changed:
                self.running -= 1
                self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def alone(self) -> AsyncIterator[None]:
        """Run a redelivered message with nothing else running in this process. Waits for the
        running deliveries to finish (and for an earlier one running alone); ordinary deliveries
        wait meanwhile.

        Raises:
            GiveBack: the process is paused.
        """
        async with self._changed:
            if self.paused:
                raise GiveBack("paused")
            self._alone_waiting += 1
            try:
                while self.running > 0 or self._alone_running:
                    await self._changed.wait()
                    if self.paused:
                        raise GiveBack("paused")
            except BaseException:
                self._alone_waiting -= 1
                self._changed.notify_all()
                raise
            self._alone_running = True
        try:
            yield
        finally:
            async with self._changed:
                self._alone_running = False
                self._alone_waiting -= 1
                self._changed.notify_all()

    def pause(self, reason: str) -> bool:
        """Stop starting deliveries (an environment fault): waiting ones are given back. Returns
        ``True`` if this call paused."""
        if self.paused:
            return False
        self.paused_reason = reason
        self._notify_change(True)
        self._wake()
        return True

    def resume(self) -> None:
        """Start deliveries again after :meth:`pause`."""
        if not self.paused:
            return
        self.paused_reason = None
        self._notify_change(False)
        self._wake()

    def _notify_change(self, hold: bool) -> None:
        if self.on_change is not None:
            self.on_change(hold)

    def _wake(self) -> None:
        async def notify() -> None:
            async with self._changed:
                self._changed.notify_all()

        try:
            self._wakers.start(notify())
        except RuntimeError:  # no loop yet: nobody can be waiting
            return
