"""Admission: when a delivery of this process may run (DESIGN.md "Faults and attempts").

Three rules, one object:

* **one limit per process**: at most ``limit`` deliveries run at once, across every queue of the
  worker (the database pool is sized from the same number);
* **poison isolation**: a redelivered message (the broker handed it out before and nobody settled
  it: the process may have died running it) runs *alone*: it waits until nothing else runs, and
  while it waits or runs, other deliveries are given back instead of started, so a message that
  kills its process takes only itself down;
* **environment pause**: while the database (or another dependency of every delivery) is
  unavailable, nothing is started: deliveries are given back uncounted until :meth:`resume`.

A delivery that must not start gets :class:`GiveBack`; the runtime then releases it to the broker
(uncounted, a suspect staying a suspect). ``on_change`` is told when the process starts or stops
needing its consumers paused (running alone or paused), so the worker can stop the broker from
handing out more deliveries meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable


class GiveBack(Exception):
    """The delivery must not start now; ``reason`` is ``"paused"`` or ``"running_alone"``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Admission:
    """Slots for deliveries of one process.

    Args:
        limit: deliveries running at once (``None``: no limit, e.g. in tests of the runtime alone).
        on_change: called with ``True`` when consumers should pause (someone runs alone, or the
            process is paused) and with ``False`` when they may resume.
    """

    def __init__(self, limit: int | None = None, on_change: Callable[[bool], None] | None = None) -> None:
        self.limit = limit
        self.on_change = on_change
        self.running = 0
        self._alone_waiting = 0
        self._alone_running = False
        self.paused_reason: str | None = None
        self._changed = asyncio.Condition()
        self._wakers: set[asyncio.Task[None]] = set()

    @property
    def paused(self) -> bool:
        return self.paused_reason is not None

    @property
    def holding_back(self) -> bool:
        """``True`` while deliveries are given back instead of started."""
        return self.paused or self._alone_waiting > 0

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Run one ordinary delivery.

        Raises:
            GiveBack: the process is paused, or a redelivered message waits to run (or runs) alone.
        """
        async with self._changed:
            while True:
                self._raise_if_holding_back()
                if self.limit is None or self.running < self.limit:
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
        running deliveries to finish (and for an earlier one running alone).

        Raises:
            GiveBack: the process is paused.
        """
        async with self._changed:
            if self.paused:
                raise GiveBack("paused")
            self._alone_waiting += 1
            if self._alone_waiting == 1:
                self._notify_change(True)
            self._changed.notify_all()  # waiters for an ordinary slot: give back now
            try:
                while self.running > 0 or self._alone_running:
                    await self._changed.wait()
                    if self.paused:
                        raise GiveBack("paused")
            except BaseException:
                self._leave_alone()
                raise
            self._alone_running = True
        try:
            yield
        finally:
            async with self._changed:
                self._alone_running = False
                self._leave_alone()

    def pause(self, reason: str) -> bool:
        """Stop starting deliveries (an environment fault). Returns ``True`` if this call paused."""
        if self.paused:
            return False
        self.paused_reason = reason
        if self._alone_waiting == 0:
            self._notify_change(True)
        self._wake()
        return True

    def resume(self) -> None:
        """Start deliveries again after :meth:`pause`."""
        if not self.paused:
            return
        self.paused_reason = None
        if self._alone_waiting == 0:
            self._notify_change(False)
        self._wake()

    def _raise_if_holding_back(self) -> None:
        if self.paused:
            raise GiveBack("paused")
        if self._alone_waiting > 0:
            raise GiveBack("running_alone")

    def _leave_alone(self) -> None:
        self._alone_waiting -= 1
        if self._alone_waiting == 0 and not self.paused:
            self._notify_change(False)
        self._changed.notify_all()

    def _notify_change(self, hold: bool) -> None:
        if self.on_change is not None:
            self.on_change(hold)

    def _wake(self) -> None:
        async def notify() -> None:
            async with self._changed:
                self._changed.notify_all()

        try:
            task = asyncio.get_running_loop().create_task(notify())
        except RuntimeError:  # no loop yet: nobody can be waiting
            return
        self._wakers.add(task)
        task.add_done_callback(self._wakers.discard)
