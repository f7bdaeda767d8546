"""Running a handler inside a delivery's transaction: the pieces both paths share.

The runtime sends BEGIN and COMMIT itself on an autocommit connection (the COMMIT carries the
session reset in the same round trip, see :mod:`consumer_kit.db.pool`), bounds each of them, and
watches the handler: it must return a usable, still-open transaction, within ``handler_timeout``,
without committing it itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg_pool import AsyncConnectionPool

from consumer_kit.db import pooler, prepared
from consumer_kit.db.deadlines import overran, step_bound
from consumer_kit.db.pool import BEGIN, COMMIT, COMMIT_AND_RESET, ROLLBACK_AND_RESET, bounded, discard
from consumer_kit.errors import (
    CommitUncertain,
    HandlerTimeout,
    StaleConnection,
    StatementTimeout,
    TransactionEnded,
)
from consumer_kit.model.results import Result, StoredResult

T = TypeVar("T")


async def begin(conn: psycopg.AsyncConnection[Any], timeout: float) -> None:
    """BEGIN, bounded by ``timeout`` seconds.

    Raises:
        StaleConnection: the pooled connection was already dead.
    """
    try:
        async with bounded(timeout, "BEGIN"):
            await conn.execute(pooler.begin_statement(conn) or BEGIN)
    except psycopg.OperationalError as exc:
        if conn.broken:
            raise StaleConnection from exc
        raise


async def begin_and_claim(conn: psycopg.AsyncConnection[Any], claim: Awaitable[T]) -> T:
    """Await ``claim``, which sends BEGIN with the claim (see ``Ledger.claim(begin=True)``);
    returns what it returns. The caller bounds it and rolls back on an error.

    Raises:
        StaleConnection: the pooled connection was dead (nothing of this transaction committed).
        psycopg.Error: the server refused BEGIN or the claim.
    """
    try:
        return await claim
    except psycopg.OperationalError as exc:
        if conn.broken:
            raise StaleConnection from exc
        raise


async def on_own_connection(
    pool: AsyncConnectionPool, timeout: float, write: Callable[[psycopg.AsyncConnection[Any]], Awaitable[T]], what: str
) -> T:
    """Run ``write`` on a pooled (autocommit) connection of its own, bounded by ``timeout``
    seconds, waiting for the connection included: the bookkeeping beside a delivery's own
    transaction (attempt counts, run-alone markers, parking, a lease's statements).

    Raises:
        StatementTimeout: no connection or no answer in time (``what`` names the statement).
    """
    async with bounded(timeout, what):
        async with pool.connection() as conn:
            return await write(conn)


async def commit(conn: psycopg.AsyncConnection[Any], timeout: float, *, reset: bool) -> None:
    """COMMIT (with the session reset when a handler ran on it), bounded by ``timeout`` seconds.

    Raises:
        CommitUncertain: no reply in time, or the connection broke: outcome unknown.
        psycopg.Error: the server answered with an error (a deferred constraint, a serialization
            failure): the transaction rolled back.
    """
    try:
        async with bounded(timeout, "COMMIT"):
            await conn.execute(COMMIT_AND_RESET if reset else COMMIT, prepare=False)
    except (StatementTimeout, psycopg.OperationalError, psycopg.InterfaceError) as exc:
        if isinstance(exc, psycopg.Error) and exc.sqlstate and not conn.broken:
            raise  # the server answered
        await discard(conn)
        raise CommitUncertain(str(exc)) from exc


async def rollback(conn: psycopg.AsyncConnection[Any], timeout: float) -> None:
    """ROLLBACK (and unlock session advisory locks), bounded; a connection that cannot roll back
    is discarded. Never raises."""
    if conn.closed or conn.broken:
        return
    prepared.forget(conn)  # psycopg deallocates its session's statements after a ROLLBACK
    try:
        async with bounded(timeout, "ROLLBACK"):
            await conn.execute(ROLLBACK_AND_RESET, prepare=False)
    except BaseException:  # noqa: BLE001 - a connection that cannot roll back is thrown away
        await discard(conn)


async def within_handler_timeout(call: Awaitable[T], timeout: float) -> T:
    """Await the handler's ``call`` within ``timeout`` seconds.

    Raises:
        HandlerTimeout: it ran longer.
    """
    scope = step_bound(timeout)  # the delivery's one timer, inside its transaction
    try:
        async with scope:
            return await call
    except TimeoutError:
        if overran(scope):
            raise HandlerTimeout(f"handler ran longer than handler_timeout ({timeout:g} s)") from None
        raise


@contextlib.contextmanager
def commit_forbidden(conn: psycopg.AsyncConnection[Any]) -> Iterator[None]:
    """While the handler runs, psycopg treats the connection as inside a ``transaction()`` block:
    ``commit()`` and ``rollback()`` raise ``ProgrammingError`` and a nested ``transaction()``
    becomes a savepoint, exactly as inside ``async with conn.transaction():``. The runtime sends
    BEGIN and COMMIT itself (COMMIT with the session reset, in one round trip), so it counts the
    block on psycopg's own counter (``_num_transactions``, stable since psycopg 3.0; a test fails
    if a release changes it). A raw ``COMMIT`` sent as SQL is caught by the fences instead."""
    conn._num_transactions += 1
    try:
        yield
    finally:
        conn._num_transactions -= 1


def ensure_transaction_open(conn: psycopg.AsyncConnection[Any]) -> None:
    """Raise :class:`TransactionEnded` when the handler left no transaction open (the autocommit
    connection is idle: its writes so far, and the claim, were committed or rolled back)."""
    if conn.info.transaction_status is psycopg.pq.TransactionStatus.IDLE:
        raise TransactionEnded(
            "the handler ended the delivery's transaction (COMMIT or ROLLBACK sent as SQL)"
        )


def ensure_transaction_usable(conn: psycopg.AsyncConnection[Any]) -> None:
    """After a handler returned normally: raise ``InFailedSqlTransaction`` when it caught a
    database error and carried on (the transaction is aborted, so nothing of it can commit; said
    here rather than as a confusing failure of the ledger's completion)."""
    if conn.info.transaction_status is psycopg.pq.TransactionStatus.INERROR:
        raise pg_errors.InFailedSqlTransaction(
            "the handler caught a database error and returned: its transaction is aborted "
            "(use `async with ctx.connection.transaction():` around statements that may fail)"
        )


def stored_result(result: Any) -> StoredResult:
    """What the ledger keeps of a handler's return value.

    Raises:
        TypeError: it is neither a :class:`~consumer_kit.handler.Result` nor ``None``.
    """
    if result is None:
        return StoredResult("ok", None, None)
    if isinstance(result, Result):
        return StoredResult(
            result.status[:200], (result.reference or None) and result.reference[:500], result.body
        )
    raise TypeError(f"handle() must return consumer_kit.Result or None, not {type(result).__name__}")


__all__ = [
    "CommitUncertain",
    "HandlerTimeout",
    "StaleConnection",
    "TransactionEnded",
    "begin",
    "commit",
    "commit_forbidden",
    "ensure_transaction_open",
    "ensure_transaction_usable",
    "on_own_connection",
    "rollback",
    "stored_result",
    "within_handler_timeout",
]
