"""Gathering deliveries into batches: what arrived together on one queue, up to ``size``
(docs/how-to/batches.md).

Every adapter already hands each delivery to its callback in a task of its own, as many at once as
the queue's prefetch allows (RabbitMQ basic.qos, an SQS receive of up to 10, a Service Bus receive
of ``max_message_count``, the memory broker's semaphore). A :class:`Batcher` is that callback for a
queue whose handler takes batches: it holds the deliveries until ``size`` are there or ``wait``
seconds passed since the first, then runs them as one batch; each callback returns once its own
delivery is settled, so the adapter's prefetch keeps bounding what is held.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from consumer_kit.app import App
from consumer_kit.broker import Delivery

__all__ = ["Batcher", "batch_setting"]

logger = logging.getLogger("consumer_kit.runtime")

RunBatch = Callable[[Sequence[Delivery]], Awaitable[Any]]


def batch_setting(app: App, queue: str) -> tuple[int, float]:
    """``(size, wait)`` of ``queue``: the largest ``batch_size`` of its handlers and the longest
    ``batch_wait`` of those that batch (``(1, 0.0)``: no batches; each delivery alone). A delivery
    routed to a handler without batches still runs on its own."""
    batching = [h for h in app.routes.get(queue, {}).values() if type(h).batch_size > 1]
    if not batching:
        return 1, 0.0
    return max(type(h).batch_size for h in batching), max(float(type(h).batch_wait) for h in batching)


class Batcher:
    """Collects one queue's deliveries into batches for ``run`` (``Runtime.process_batch``).

    Args:
        run: runs and settles a batch; whatever it raises (``SimulatedCrash``) is raised by each
            delivery's :meth:`add`.
        size: the most deliveries in one batch (>= 1).
        wait: seconds to wait for more once the first delivery is held (0: only what arrived in
            the same turn of the event loop).
        limit: the most batches running at once (the worker's concurrency; ``None``: no limit).
            While that many run, deliveries keep gathering and the next batch starts when one
            ends, with what arrived meanwhile: under load, batches are full rather than many
            small ones queueing for a slot.
    """

    def __init__(self, run: RunBatch, *, size: int, wait: float, limit: int | None = None) -> None:
        self._run = run
        self.size = size
        self.wait = wait
        self.limit = limit
        self._running = 0
        self._first_held_at = 0.0  # loop time the oldest held delivery arrived
        self._held: list[tuple[Delivery, asyncio.Future[None]]] = []
        self._timer: asyncio.Handle | None = None
        self._batch_of: dict[int, asyncio.Task[None]] = {}  # id(delivery) -> the batch running it

    async def add(self, delivery: Delivery) -> None:
        """The adapter's callback: hold ``delivery`` for the next batch and return once the batch
        settled it. Cancelled while held, the delivery is released (uncounted); cancelled while
        its batch runs, the batch is cancelled (it releases what it has not settled)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        if not self._held:
            self._first_held_at = loop.time()
        self._held.append((delivery, done))
        if len(self._held) >= self.size:
            self._flush()
        elif self._timer is None and not self._full:
            self._start_timer()
        try:
            # No shield (a future and callbacks more per delivery): cancelled here, ``done`` is
            # cancelled too, and the batch skips it (it tells only futures not done yet).
            await done
        except asyncio.CancelledError:
            if any(d is delivery for d, _ in self._held):
                self._held = [(d, f) for d, f in self._held if d is not delivery]
                await delivery.release()
            elif (task := self._batch_of.get(id(delivery))) is not None:
                task.cancel()
            raise

    def _start_timer(self) -> None:
        """Flush ``wait`` seconds after the first held delivery arrived. Even with no wait, yield
        one turn: the deliveries the adapter received together are all handed over first."""
        loop = asyncio.get_running_loop()
        due = self._first_held_at + self.wait
        self._timer = loop.call_at(due, self._flush) if due > loop.time() else loop.call_soon(self._flush)

    @property
    def _full(self) -> bool:
        return self.limit is not None and self._running >= self.limit

    def _flush(self) -> None:
        """Start batches of what is held, as many as the limit allows; the rest waits for a
        running batch to end (which flushes again)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._held and not self._full:
            held, self._held = self._held[: self.size], self._held[self.size:]
            self._first_held_at = asyncio.get_running_loop().time()  # the rest waits from now
            self._running += 1
            # one-shot: kept by each member's delivery until the batch ends; a member given back cancels it
            task = asyncio.create_task(self._batch(held), name="consumer-kit batch")
            for delivery, _ in held:
                self._batch_of[id(delivery)] = task

    async def _batch(self, held: list[tuple[Delivery, asyncio.Future[None]]]) -> None:
        try:
            await self._run_and_tell(held)
        finally:
            for delivery, _ in held:
                self._batch_of.pop(id(delivery), None)
            self._running -= 1
            # What gathered while this batch ran: a full batch now, else when its wait is over.
            if len(self._held) >= self.size:
                self._flush()
            elif self._held and self._timer is None:
                self._start_timer()

    async def _run_and_tell(self, held: list[tuple[Delivery, asyncio.Future[None]]]) -> None:
        try:
            await self._run([delivery for delivery, _ in held])
        except BaseException as exc:
            for _, done in held:
                if not done.done():
                    if isinstance(exc, asyncio.CancelledError):
                        done.cancel()
                    else:
                        done.set_exception(exc)
            if not isinstance(exc, Exception | asyncio.CancelledError):
                raise
            return
        for _, done in held:
            if not done.done():
                done.set_result(None)
