"""The delivery's transaction, with BEGIN travelling with the claim and COMMIT with the completion.

A delivery's transaction is ``BEGIN; claim; <handler statements>; complete; COMMIT``. Sent one by
one that is two round trips more than the handler's own work needs, and round trips are most of
a worker's CPU (psycopg's wait and result handling). psycopg's pipeline mode sends BEGIN and the
claim in one round trip and the completion and COMMIT in another. The handler runs between the two
pipelines, outside pipeline mode, so its statements behave as usual (errors at once, ``rowcount``
known, savepoints through ``conn.transaction()``, ``conn.commit()`` refused).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, TypeVar

import psycopg

logger = logging.getLogger("consumer_kit.runtime")

T = TypeVar("T")


class Stage(enum.Enum):
    NEW = "new"
    BEGINNING = "beginning"  # BEGIN and the first statement sent; nothing is durable yet
    OPEN = "open"
    COMMITTING = "committing"  # COMMIT sent: a lost reply leaves the outcome unknown
    DONE = "done"


class DeliveryTransaction:
    """One delivery's transaction on an autocommit connection.

    Use as ``async with DeliveryTransaction(conn) as tx``: ``await tx.begin(first)`` runs BEGIN and
    ``first()`` in one round trip; ``await tx.commit(last)`` runs ``last()`` and COMMIT in one round
    trip. Leaving the block with an exception rolls back (if the transaction is still open);
    leaving it without one commits what was not committed yet.

    ``first``/``last`` are statement callables; inside a pipeline a cursor's ``rowcount`` is only
    known after the pipeline ends, so ``last`` returns its cursor and :attr:`last_rowcount` holds
    the count afterwards.
    """

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self.conn = conn
        self.stage = Stage.NEW
        self.last_rowcount = -1
        # The transaction object itself, not conn.transaction(): inside a pipeline that context
        # manager syncs before BEGIN, which is the round trip this class exists to save. Holding
        # it keeps psycopg's guard: the handler's conn.commit() raises, its conn.transaction()
        # becomes a savepoint.
        self._tx = psycopg.AsyncTransaction(conn)
        self._entered = False

    async def __aenter__(self) -> DeliveryTransaction:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            if self.stage is Stage.OPEN:
                await self.commit()
            return
        if self._entered and self.stage in (Stage.BEGINNING, Stage.OPEN):
            # self.stage keeps where the failure happened: the runtime decides on it
            self._entered = False
            try:
                await self._tx.__aexit__(exc_type, exc, tb)  # ROLLBACK (skipped on a dead connection)
            except psycopg.Error as rollback_error:
                logger.debug("rollback failed (%s)", type(rollback_error).__name__)

    async def begin(self, first: Callable[[], Awaitable[T]]) -> T:
        """BEGIN and ``first()`` in one round trip; returns what ``first()`` returns (it should
        fetch its rows, which ends the round trip)."""
        self.stage = Stage.BEGINNING
        async with self.conn.pipeline():
            await self._tx.__aenter__()  # queues BEGIN
            self._entered = True
            result = await first()
        self.stage = Stage.OPEN
        return result

    async def commit(self, last: Callable[[], Awaitable[psycopg.AsyncCursor[Any]]] | None = None) -> None:
        """``last()`` (if any) and COMMIT in one round trip.

        Raises:
            psycopg.OperationalError: with ``conn.broken`` and :attr:`stage` ``COMMITTING``, the
                COMMIT's outcome is unknown.
        """
        self.stage = Stage.COMMITTING
        commit_queued = False
        try:
            async with self.conn.pipeline():
                cursor = await last() if last is not None else None
                self._entered = False
                await self._tx.__aexit__(None, None, None)  # queues COMMIT
                commit_queued = True
        finally:
            if not commit_queued:
                self._entered = True
                self.stage = Stage.OPEN  # COMMIT never left: leaving the block rolls back
        self.stage = Stage.DONE
        if cursor is not None:
            self.last_rowcount = cursor.rowcount
