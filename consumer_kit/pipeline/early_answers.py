"""Answers that do not wait for the end of a transaction that wrote nothing
(docs/explanation/one-delivery.md, "A duplicate is answered at once").

A claim that finds its operation's row already there (a duplicate, a replayed failure, a payload
conflict, an operation in progress or parked) has written nothing: ``INSERT ... ON CONFLICT DO
NOTHING`` inserts no row and locks none, so the transaction has no transaction id. Its answer
comes from a row another transaction committed (a snapshot shows only committed rows), and the
COMMIT or ROLLBACK that ends this transaction changes nothing in the database either way. So the
delivery (or the HTTP response) does not wait for it: the caller hands the connection here as soon
as the row is read, the transaction is ended in a task of its own, and only then does the
connection go back to the pool. ``tests/pipeline/test_early_answers.py`` shows both halves: the
transaction holds no transaction id when the answer leaves, and a COMMIT that never gets its reply
leaves the answer as it was.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import psycopg
from psycopg_pool import AsyncConnectionPool

from consumer_kit.db.pool import discard
from consumer_kit.pipeline.transaction import commit, rollback
from consumer_kit.resilience.one_shots import OneShots

__all__ = ["EarlyAnswers"]

T = TypeVar("T")

_ABORTED = psycopg.pq.TransactionStatus.INERROR
_IDLE = psycopg.pq.TransactionStatus.IDLE


class EarlyAnswers:
    """Ends the transactions whose answer has already been given, then returns their connections.

    Args:
        pool: the pool the connections came from (``getconn``); each goes back with ``putconn``.
        timeout: seconds the COMMIT (or ROLLBACK) may take; past it the connection is discarded.
    """

    def __init__(self, pool: AsyncConnectionPool, timeout: float) -> None:
        self.pool = pool
        self.timeout = timeout
        self._ending = OneShots()  # each ends with its transaction; wait() before the pool closes

    async def on_connection(
        self, run: Callable[[psycopg.AsyncConnection[Any]], Awaitable[tuple[T, bool]]]
    ) -> T:
        """``run`` on a connection of the pool: it returns its answer and whether its
        transaction is still open (it wrote nothing: then the transaction ends later, see
        :meth:`end_later`, and the answer returns at once); else the connection goes back now.

        Raises:
            BaseException: what ``run`` raised (the connection goes back first).
        """
        conn = await self.pool.getconn()
        try:
            answer, still_open = await run(conn)
        except BaseException:
            await self.pool.putconn(conn)
            raise
        if still_open:
            self.end_later(conn)
        else:
            await self.pool.putconn(conn)
        return answer

    def end_later(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """End ``conn``'s transaction (it wrote nothing) and return ``conn`` to the pool, in a task
        of its own; the caller answers meanwhile. Never raises."""
        self._ending.start(self._end(conn), name="consumer-kit transaction end")

    async def wait(self) -> None:
        """Until every transaction handed over has ended and its connection is back (before the
        pool closes)."""
        while len(self._ending):
            await self._ending.wait()

    async def _end(self, conn: psycopg.AsyncConnection[Any]) -> None:
        try:
            if conn.closed or conn.broken:
                return
            status = conn.info.transaction_status
            if status is _ABORTED:
                await rollback(conn, self.timeout)  # never raises: a connection that cannot is discarded
            elif status is not _IDLE:
                await commit(conn, self.timeout, reset=False)
        except BaseException as exc:  # nothing depends on this end: the connection is thrown away
            await discard(conn)
            if not isinstance(exc, Exception):
                raise
        finally:
            await self.pool.putconn(conn)
