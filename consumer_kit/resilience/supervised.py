"""Supervised background tasks: a receive loop, a renewal or a probe that dies is restarted.

A long-running task that ends with an unexpected exception would otherwise vanish silently (an
asyncio task's exception is only reported when it is garbage-collected) while readiness stays
green. :class:`Supervised` runs a coroutine factory in a task of its own; when the coroutine
raises, it logs the failure with its traceback, reports itself down (:attr:`Supervised.up` is
``False``: an adapter's ``Consumer.ready`` and so the worker's ``/ready`` say not ready), pauses
(0.1 s, doubling up to 5 s while it keeps dying right after starting) and runs a new coroutine
from the factory. A coroutine that returns has finished its job: the task ends, up.

Test hook: :meth:`Supervised.inject` makes the running coroutine die with a given exception at the
point where it is waiting now, the way ``asyncio.timeout`` turns a cancellation into
``TimeoutError``: the coroutine sees a cancellation (its ``finally`` blocks run), and the
supervisor sees the injected exception as the coroutine's death. It can hold the restart until
an event is set, so a test observes the task down without timing it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from consumer_kit.resilience.backoff import Backoff

logger = logging.getLogger("consumer_kit.supervised")

FIRST_PAUSE = 0.1  # seconds before the first restart
MAX_PAUSE = 5.0  # seconds, at most, between restarts
_HEALTHY_AFTER = 10.0  # seconds a run must last for the pause to start again from FIRST_PAUSE

_LIVE: weakref.WeakSet[Supervised] = weakref.WeakSet()


class Supervised:
    """One supervised background task (module docstring).

    Args:
        name: the task's name (logs, :func:`find`).
        factory: makes the coroutine to run, once per (re)start.
        first_pause, max_pause: seconds before a restart: ``first_pause``, doubling up to
            ``max_pause`` while runs keep failing within 10 s of their start.

    Attributes:
        deaths: how many times the coroutine died with an exception.
        restarts: how many times it was started again after a death.
        died: set at each death until the next restart (tests observe it).
    """

    def __init__(
        self,
        name: str,
        factory: Callable[[], Coroutine[Any, Any, None]],
        *,
        first_pause: float = FIRST_PAUSE,
        max_pause: float = MAX_PAUSE,
    ) -> None:
        self.name = name
        self._factory = factory
        self._first_pause = first_pause
        self._max_pause = max_pause
        self._task: asyncio.Task[None] | None = None
        self._run: asyncio.Task[None] | None = None  # the current coroutine's own task
        self._injected: BaseException | None = None
        self._hold: asyncio.Event | None = None
        self.up = True
        self.deaths = 0
        self.restarts = 0
        self.died = asyncio.Event()
        self.started = asyncio.Event()

    def start(self) -> Supervised:
        """Start supervising (idempotent); returns ``self``."""
        if self._task is None:
            self._task = asyncio.create_task(self._supervise(), name=f"{self.name} (supervisor)")
            _LIVE.add(self)
        return self

    @property
    def running(self) -> bool:
        """Started, not finished, and not between a death and its restart."""
        return self._task is not None and not self._task.done() and self.up

    @property
    def finished(self) -> bool:
        return self._task is not None and self._task.done()

    @property
    def down(self) -> bool:
        """Between a death and its restart (what makes readiness false)."""
        return self._task is not None and not self._task.done() and not self.up

    async def stop(self) -> None:
        """Cancel the task and wait until it has ended."""
        task, self._task = self._task, None
        _LIVE.discard(self)
        if task is None:
            return
        task.cancel()
        if asyncio.current_task() in (task, self._run):
            return  # stopped from inside: the cancellation ends it once this returns
        await asyncio.gather(task, return_exceptions=True)

    def on_finished(self, callback: Callable[[Supervised], None]) -> None:
        """Call ``callback(self)`` once the task has ended (finished, stopped or failed for good)."""
        assert self._task is not None, "start() first"
        self._task.add_done_callback(lambda _task: callback(self))

    async def wait_finished(self, timeout: float) -> None:
        """Wait at most ``timeout`` seconds for the task to end by itself (it is not cancelled)."""
        if self._task is not None and not self._task.done():
            await asyncio.wait({self._task}, timeout=timeout)

    def cancel(self) -> None:
        """Cancel the task without waiting (a done-callback context)."""
        if self._task is not None:
            self._task.cancel()
        _LIVE.discard(self)

    def inject(self, exc: BaseException, *, hold: asyncio.Event | None = None) -> None:
        """Test hook: make the running coroutine die with ``exc`` where it waits now; with
        ``hold``, its restart waits until ``hold`` is set.

        Raises:
            RuntimeError: it is not running.
        """
        if self._run is None or self._run.done():
            raise RuntimeError(f"{self.name} is not running")
        self._injected, self._hold = exc, hold
        self._run.cancel()

    async def _supervise(self) -> None:
        try:
            await self._restarting()
        finally:
            _LIVE.discard(self)

    async def _restarting(self) -> None:
        backoff, deaths_in_a_row = Backoff(first=self._first_pause, cap=self._max_pause), 0
        while True:
            began = time.monotonic()
            self._run = asyncio.ensure_future(self._one_run())
            self.up = True
            self.started.set()
            try:
                await asyncio.shield(self._run)
                return  # the coroutine finished its job
            except asyncio.CancelledError:
                if not self._run.done():  # the supervisor itself was cancelled: stop the run too
                    self._run.cancel()
                    await asyncio.gather(self._run, return_exceptions=True)
                    raise
                if self._run.cancelled():
                    raise
                death: BaseException | None = self._run.exception()
            except Exception as exc:  # noqa: BLE001 - any death: log, report down, restart
                death = exc
            self.up = False
            self.deaths += 1
            self.died.set()
            self.started.clear()
            deaths_in_a_row = 1 if time.monotonic() - began > _HEALTHY_AFTER else deaths_in_a_row + 1
            pause = backoff.delay(deaths_in_a_row)
            logger.error(
                "background task %s died (%s); restarting in %.1f s", self.name, type(death).__name__, pause,
                exc_info=death,
            )
            hold, self._hold = self._hold, None
            if hold is not None:
                await hold.wait()
            await asyncio.sleep(pause)
            self.restarts += 1
            self.died.clear()
            logger.info("background task %s restarted", self.name)

    async def _one_run(self) -> None:
        try:
            await self._factory()
        except asyncio.CancelledError:
            injected, self._injected = self._injected, None
            if injected is None:
                raise
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()
            raise injected from None


def find(name: str) -> list[Supervised]:
    """The supervised tasks alive now whose name contains ``name`` (tests)."""
    return [task for task in list(_LIVE) if name in task.name]


def all_running(tasks: Iterable[Supervised]) -> bool:
    """``True`` when no :class:`Supervised` in ``tasks`` is :attr:`~Supervised.down` (what an
    adapter's readiness adds; a task not started yet or stopped is not down)."""
    return not any(task.down for task in tasks)
