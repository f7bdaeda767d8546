"""One-shot tasks: each does one job and ends (a delivery's callback, a release, a flush, a channel
close), kept by its owner until it ends.

A task nobody references may be garbage-collected before it ends, and one nobody waits for is
left running when its owner closes. :class:`OneShots` keeps each task it starts until the task
ends, and lets its owner wait for them or cancel them, bounded, when it closes. A task that must
live as long as its owner is :class:`~consumer_kit.resilience.supervised.Supervised` instead
(docs/explanation/architecture.md, "Background tasks and backoff").
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterable, Iterator
from typing import Any


class OneShots:
    """The one-shot tasks of one owner (a consumer, a subscription, a batcher)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def start(self, work: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task[Any]:
        """Run ``work`` in a task of its own, kept until it ends; returns the task.

        Raises:
            RuntimeError: no event loop is running.
        """
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def wait(self, timeout: float | None = None) -> None:
        """Wait until every task running now has ended, at most ``timeout`` seconds (``None``: no
        bound). Never raises what a task raised."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)

    async def cancel(self, timeout: float, *, also: Iterable[asyncio.Task[Any]] = ()) -> None:
        """Cancel every task still running (and ``also``) and wait for them, at most ``timeout``
        seconds."""
        running = {*self._tasks, *also}
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running, timeout=timeout)

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(list(self._tasks))
