"""Helpers shared by the relay loop and its LISTEN connection: retry logging and quiet closing."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from psycopg import AsyncConnection
from tenacity import RetryCallState

logger = logging.getLogger("outbox_relay")


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
