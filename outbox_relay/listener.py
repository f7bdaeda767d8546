"""LISTEN on the outbox channel over a dedicated connection and wake the relay loop.

The outbox trigger sends one ``NOTIFY <schema>_outbox`` per committing transaction. A notification
only says "look now": the relay still polls every ``poll_interval`` seconds, so a notification
lost while this connection was down (or sent before the relay started) strands nothing. After a
reconnect the listener wakes the loop once, because notifications sent meanwhile are gone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import AsyncConnection, sql
from tenacity import AsyncRetrying, retry_if_exception_type

from consumer_kit.db.pooler import in_transaction_mode
from consumer_kit.resilience.backoff import Backoff
from consumer_kit.resilience.supervised import Supervised

from .reconnect import close_quietly, log_retry

logger = logging.getLogger("consumer_kit.outbox_relay.listener")


def listen_url(settings: Any, database_url: str) -> str | None:
    """The URL the relay LISTENs on, or ``None`` to poll only: ``relay_listen_url`` (``off``:
    none); unset, ``database_url`` unless it goes through a transaction-mode pooler, where a
    LISTEN holds a server connection that other clients' transactions share (docs/scaling.md)."""
    chosen = getattr(settings, "relay_listen_url", None)
    if chosen is not None:
        return None if chosen.strip().lower() == "off" else chosen
    return None if in_transaction_mode(settings) else database_url


class NotifyListener:
    """A background task that LISTENs and calls ``wake()`` per notification.

    Args:
        database_url: PostgreSQL URL (a dedicated connection is opened; not from a pool).
        channel: the channel name (``consumer_kit.outbox.notify_channel(schema)``).
        wake: called (on the loop) for every notification and after every (re)connect.
        max_backoff: longest wait between reconnect attempts (seconds).

    Attributes:
        notifications: notifications received.
        reconnects: successful connects after the first.
    """

    def __init__(
        self,
        database_url: str,
        channel: str,
        wake: Callable[[], None],
        *,
        max_backoff: float = 10.0,
    ) -> None:
        self._url = database_url
        self._channel = channel
        self._wake = wake
        self._max_backoff = max_backoff
        self._task: Supervised | None = None
        self._connected = asyncio.Event()
        self.notifications = 0
        self.reconnects = 0

    def start(self) -> None:
        self._task = Supervised("outbox-relay-listen", self._listen_forever).start()

    async def wait_connected(self, timeout: float) -> bool:
        """``True`` once LISTEN is in place (within ``timeout`` seconds)."""
        try:
            await asyncio.wait_for(self._connected.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def stop(self) -> None:
        if self._task is not None:
            await self._task.stop()
            self._task = None

    async def _listen_forever(self) -> None:
        first = True
        while True:
            retrying = AsyncRetrying(
                retry=retry_if_exception_type(psycopg.OperationalError),
                wait=Backoff(first=min(0.2, self._max_backoff), cap=self._max_backoff).wait(),
                before_sleep=log_retry("LISTEN connect"),
            )
            async for attempt in retrying:
                with attempt:
                    conn = await self._connect()
            if not first:
                self.reconnects += 1
            first = False
            try:
                self._wake()  # anything committed while we were not listening
                await self._drain(conn)
            except psycopg.OperationalError as exc:
                logger.warning("LISTEN connection lost (%s); reconnecting", type(exc).__name__)
            finally:
                self._connected.clear()
                await close_quietly(conn)

    async def _connect(self) -> AsyncConnection[Any]:
        conn = await AsyncConnection.connect(self._url, autocommit=True, connect_timeout=10)
        await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._channel)))
        self._connected.set()
        logger.debug("listening on channel %s", self._channel)
        return conn

    async def _drain(self, conn: AsyncConnection[Any]) -> None:
        async for _ in conn.notifies():
            self.notifications += 1
            self._wake()
