"""Batching concurrent SQS calls: up to 10 entries per ``...Batch`` call, per queue.

Used for ``DeleteMessageBatch`` (acks) and ``SendMessageBatch`` (the relay's publishes). Each
caller submits one entry and awaits its own result; entries waiting for the same queue go out
together. ``linger`` seconds (0: none) let concurrent callers join before the first call; while
``max_in_flight`` calls to a queue are out, later entries wait and form the next batch, so a busy
queue batches by itself and an idle one adds no latency.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from consumer_kit.broker.kit.counters import Counted, Counters
from consumer_kit.resilience.one_shots import OneShots

logger = logging.getLogger(__name__)

E = TypeVar("E")
R = TypeVar("R")

MAX_ENTRIES = 10
"""SQS's limit of entries per batch call."""


@dataclass
class _Pending(Generic[E, R]):
    entry: E
    size: int
    future: asyncio.Future[R] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


SendBatch = Callable[[str, list[E]], Awaitable[list[R | BaseException]]]


class Batcher(Generic[E, R]):
    """Sends entries in batches through ``send(queue_url, entries)``, which returns one result
    (or exception) per entry, in order; an exception from ``send`` itself fails the whole batch.
    ``batches`` (in ``counters``) counts the batch calls made.

    Args:
        send: the batch call.
        linger: seconds to wait for more entries before a queue's first call (0: none).
        max_bytes: the most bytes one batch may carry (``None``: no limit); an entry larger than
            that goes alone.
        max_in_flight: batch calls at once per queue.
    """

    batches = Counted()

    def __init__(
        self,
        send: SendBatch[E, R],
        *,
        linger: float = 0.0,
        max_bytes: int | None = None,
        max_in_flight: int = 4,
    ) -> None:
        self._send = send
        self._linger = linger
        self._max_bytes = max_bytes
        self._max_in_flight = max_in_flight
        self._waiting: dict[str, list[_Pending[E, R]]] = {}
        self._in_flight: dict[str, int] = {}
        self._tasks = OneShots()
        self.counters = Counters(("batches",))

    async def submit(self, queue_url: str, entry: E, size: int = 0) -> R:
        """Send ``entry`` (of ``size`` bytes) with the next batch for ``queue_url``; returns its
        result or raises its exception."""
        pending: _Pending[E, R] = _Pending(entry, size)
        waiting = self._waiting.setdefault(queue_url, [])
        waiting.append(pending)
        if len(waiting) == 1 or len(waiting) >= MAX_ENTRIES:
            self._start(queue_url, linger=self._linger if len(waiting) == 1 else 0.0)
        return await pending.future

    async def close(self) -> None:
        """Wait for the calls still out."""
        await self._tasks.wait()

    def _start(self, queue_url: str, *, linger: float) -> None:
        if self._in_flight.get(queue_url, 0) >= self._max_in_flight:
            return  # a finishing call starts the next batch
        self._in_flight[queue_url] = self._in_flight.get(queue_url, 0) + 1
        self._tasks.start(self._flush(queue_url, linger), name=f"consumer-kit sqs batch {queue_url}")

    def _take(self, queue_url: str) -> list[_Pending[E, R]]:
        waiting = self._waiting.get(queue_url, [])
        batch: list[_Pending[E, R]] = []
        total = 0
        while waiting and len(batch) < MAX_ENTRIES:
            size = waiting[0].size
            if batch and self._max_bytes is not None and total + size > self._max_bytes:
                break
            batch.append(waiting.pop(0))
            total += size
        return batch

    async def _flush(self, queue_url: str, linger: float) -> None:
        try:
            if linger > 0:
                await asyncio.sleep(linger)
            while batch := self._take(queue_url):
                await self._send_one(queue_url, batch)
        finally:
            self._in_flight[queue_url] -= 1
            if self._waiting.get(queue_url):
                self._start(queue_url, linger=0.0)

    async def _send_one(self, queue_url: str, batch: list[_Pending[E, R]]) -> None:
        self.batches += 1
        try:
            results = await self._send(queue_url, [p.entry for p in batch])
        except BaseException as exc:  # handed to every caller of this batch
            for pending in batch:
                if not pending.future.done():
                    pending.future.set_exception(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        for pending, result in zip(batch, results, strict=True):
            if pending.future.done():
                continue  # the caller gave up (its settlement timed out)
            if isinstance(result, BaseException):
                pending.future.set_exception(result)
            else:
                pending.future.set_result(result)
