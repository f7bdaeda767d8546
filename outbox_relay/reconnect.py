"""Connecting to PostgreSQL for the relay loop and its LISTEN connection: one attempt, attempts with
backoff until a stop, retry logging and quiet closing."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import AsyncConnection
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type

from consumer_kit.resilience.backoff import Backoff

logger = logging.getLogger("consumer_kit.outbox_relay")


_CONNECT = Backoff(first=0.2, cap=10.0)  # between attempts to reach the database


def log_retry(what: str) -> Callable[[RetryCallState], None]:
    """A tenacity ``before_sleep`` hook for connecting: logs ``"<what> failed (<error class>:
    <first line of the error>); retry N in S s"``, e.g. the server's ``password authentication
    failed`` (a connection error names the server, never row values)."""

    def before_sleep(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        logger.warning(
            "%s failed (%s); retry %s in %.1f s",
            what, connect_error(exc), state.attempt_number,
            state.next_action.sleep if state.next_action else 0.0,
        )

    return before_sleep


def connect_error(exc: BaseException | None) -> str:
    """``"<error class>: <first line>"`` of a failed connection attempt (one line, <= 300 chars)."""
    if exc is None:
        return "unknown error"
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}"[:300] if lines else type(exc).__name__


async def close_quietly(conn: AsyncConnection[Any]) -> None:
    """Close ``conn``, ignoring errors: it is going away either way."""
    try:
        await conn.close()
    except Exception:  # noqa: BLE001 - the connection is going away either way
        pass


async def open_connection(database_url: str, **options: Any) -> AsyncConnection[Any]:
    """One attempt at the relay's autocommit connection (10 s connect timeout; ``options``: more
    psycopg connect arguments, e.g. ``consumer_kit.db.pooler.connect_options``).

    Raises:
        psycopg.OperationalError: refused or unreachable.
    """
    return await AsyncConnection.connect(
        database_url, autocommit=True, connect_timeout=10, application_name="outbox-relay", **options
    )


async def connect_until_stopped(database_url: str, stop: asyncio.Event, **options: Any) -> AsyncConnection[Any]:
    """:func:`open_connection`, retried with exponential backoff (0.2 s doubling up to 10 s,
    tenacity) until it works or ``stop`` is set.

    Raises:
        psycopg.OperationalError: still failing when ``stop`` was set.
    """
    retrying = AsyncRetrying(
        retry=retry_if_exception_type(psycopg.OperationalError),
        wait=_CONNECT.wait(),
        stop=lambda _state: stop.is_set(),
        sleep=lambda seconds: sleep_unless_stopped(stop, seconds),
        before_sleep=log_retry("database connect"),
        reraise=True,
    )
    conn: AsyncConnection[Any] | None = None
    async for attempt in retrying:
        with attempt:
            conn = await open_connection(database_url, **options)
    assert conn is not None
    return conn


async def sleep_unless_stopped(stop: asyncio.Event, seconds: float) -> None:
    """Sleep ``seconds``, or less when ``stop`` is set meanwhile."""
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        pass
