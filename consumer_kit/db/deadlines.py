"""One timer for every bounded step of a delivery's transaction.

The transactional path bounds four steps of each delivery: the claim (``lock_timeout +
statement_timeout``), the handler (``handler_timeout``), the ledger completion and the COMMIT
(``statement_timeout`` each). An ``asyncio.timeout`` per step arms and cancels a loop timer four
times a delivery (9 µs each on the benchmark machine). A :class:`DeliveryClock` keeps one timer
for the whole transaction: it is armed at the first step's deadline and moved only when a later
step's deadline comes earlier (a handler that ran longer than ``lock_timeout``); when it fires
early (a step still within its bound) it is armed again at the earliest running step's deadline.
A healthy delivery pays one timer.

A step that overruns behaves exactly as under ``asyncio.timeout`` (Python 3.11): its task is
cancelled, and the step's block raises ``TimeoutError`` when the cancellation is its own
(``Task.uncancel`` back to the count at entry), else the ``CancelledError`` propagates. Steps
nest; each has its own deadline. A step entered from another task than the clock's (a task
started inside the block copies the context) gets an ``asyncio.timeout`` of its own.
"""

from __future__ import annotations

import asyncio
import contextvars
from types import TracebackType

__all__ = ["DeliveryClock", "Step", "overran", "step_bound"]

_current: contextvars.ContextVar[DeliveryClock | None] = contextvars.ContextVar(
    "consumer_kit_clock", default=None
)


class Step:
    """One bounded step of a :class:`DeliveryClock` (use it as ``async with``)."""

    __slots__ = ("_cancelling", "_clock", "_seconds", "deadline", "expired")

    def __init__(self, clock: DeliveryClock, seconds: float) -> None:
        self._clock, self._seconds = clock, seconds
        self.deadline = 0.0
        self.expired = False
        self._cancelling = 0

    async def __aenter__(self) -> Step:
        clock = self._clock
        self.deadline = clock.loop.time() + self._seconds
        self._cancelling = clock.task.cancelling()
        clock.steps.append(self)
        clock.arm(self.deadline)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        clock = self._clock
        clock.steps.remove(self)
        if clock.steps and clock.handle is None:  # an outer step still runs
            clock.arm(min(s.deadline for s in clock.steps))
        if self.expired and clock.task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc


class DeliveryClock:
    """The timer of the current task's delivery; install it with ``with DeliveryClock():``
    around the delivery's transaction (the running task's, inside a running loop)."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        task = asyncio.current_task(self.loop)
        assert task is not None  # a delivery runs in a task
        self.task = task
        self.steps: list[Step] = []
        self.handle: asyncio.TimerHandle | None = None
        self._token: contextvars.Token[DeliveryClock | None] | None = None

    def __enter__(self) -> DeliveryClock:
        self._token = _current.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            _current.reset(self._token)
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None

    def arm(self, when: float) -> None:
        handle = self.handle
        if handle is not None:
            if handle.when() <= when:
                return
            handle.cancel()
        self.handle = self.loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self.handle = None
        if not self.steps:
            return  # between steps: the next one arms again
        first = min(self.steps, key=lambda s: s.deadline)
        if first.expired:
            return  # its cancellation is on its way
        if first.deadline <= self.loop.time():
            first.expired = True
            self.task.cancel()
        else:
            self.arm(first.deadline)


def step_bound(seconds: float) -> Step | asyncio.Timeout:
    """An async context manager bounding its block to ``seconds``: a step of the current task's
    :class:`DeliveryClock`, or an ``asyncio.timeout`` when there is none. Either raises
    ``TimeoutError`` from the block on overrun; tell it from a ``TimeoutError`` raised inside by
    ``expired`` (the step) or ``expired()`` (the timeout): see :func:`overran`."""
    clock = _current.get()
    if clock is not None and asyncio.current_task(clock.loop) is clock.task:
        return Step(clock, seconds)
    return asyncio.timeout(seconds)


def overran(scope: Step | asyncio.Timeout) -> bool:
    """Whether ``scope`` (from :func:`step_bound`) ended its block for overrunning."""
    return scope.expired if isinstance(scope, Step) else scope.expired()
