"""Per-aggregate lanes: deliveries with the same partition key run one at a time, in the order the
broker handed them over; different keys run in parallel (up to the process's concurrency).

Ordering is separate from idempotency: the ledger makes each operation take effect once whatever
the order; lanes make the effects of one aggregate (an account, an order) happen in delivery
order. A delivery waiting for its lane holds no concurrency slot and no database connection.

What lanes cannot promise: order across worker processes (route one key to one consumer: SQS FIFO
message groups, Service Bus sessions, RabbitMQ single-active-consumer or per-key queues), and the
order of a message retried after a failure, which goes back behind the later messages of its key
(as with any broker retry). Handlers that must never apply an older state after a newer one use
versions (:mod:`consumer_kit.versions`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class Lanes:
    """One FIFO lock per partition key, created on first use and dropped when idle."""

    def __init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}
        self._users: dict[str, int] = {}

    @contextlib.asynccontextmanager
    async def lane(self, key: str | None) -> AsyncIterator[None]:
        """Hold ``key``'s lane (``None``: no ordering asked for: enter at once). Waiters enter in
        the order they asked (asyncio locks are fair)."""
        if key is None:
            yield
            return
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = asyncio.Lock()
        self._users[key] = self._users.get(key, 0) + 1
        try:
            async with lock:
                yield
        finally:
            self._users[key] -= 1
            if self._users[key] == 0:
                del self._users[key], self._locks[key]

    def __len__(self) -> int:
        """Keys with a delivery running or waiting."""
        return len(self._locks)
