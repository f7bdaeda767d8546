"""Helpers shared by the relay loop and its LISTEN connection: retry logging and quiet closing."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from psycopg import AsyncConnection
from tenacity import RetryCallState

logger = logging.getLogger("outbox_relay")


def log_retry(what: str) -> Callable[[RetryCallState], None]:
    """A tenacity ``before_sleep`` hook that logs ``"<what> failed (<error class>); retry N in S s"``."""

    def before_sleep(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        logger.warning(
            "%s failed (%s); retry %s in %.1f s",
            what, type(exc).__name__, state.attempt_number,
            state.next_action.sleep if state.next_action else 0.0,
        )

    return before_sleep


async def close_quietly(conn: AsyncConnection[Any]) -> None:
    """Close ``conn``, ignoring errors: it is going away either way."""
    try:
        await conn.close()
    except Exception:  # noqa: BLE001 - the connection is going away either way
        pass
