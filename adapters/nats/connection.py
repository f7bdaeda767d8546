"""Opening and closing the NATS connection: one ``nats.aio.client.Client`` and its JetStream
context per adapter object.

nats-py reconnects by itself (forever, every 2 s); while it is away, calls fail fast with
``ConnectionReconnectingError`` or time out, which the adapter reads as an outage
(:mod:`consumer_kit.adapters.nats.errors`). Its callbacks log ids and the server, never the URL's
user info.
"""

from __future__ import annotations

import logging

import nats
from nats.aio.client import Client
from nats.js import JetStreamContext

from .config import NATSConfig

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT = 5.0  # seconds
API_TIMEOUT = 5.0  # seconds each JetStream API request and publish ack may take


class NATSConnection:
    """One NATS client and its JetStream context, connected on first use.

    Attributes:
        config: the parsed ``nats://`` URL.
    """

    def __init__(self, config: NATSConfig) -> None:
        self.config = config
        self._client: Client | None = None
        self._js: JetStreamContext | None = None
        self._closing = False

    async def client(self) -> Client:
        """The connected client (connects on first call).

        Raises:
            ConnectionError: no server answered within the connect timeout.
        """
        if self._client is None or self._client.is_closed:
            try:
                self._client = await nats.connect(
                    servers=list(self.config.servers), connect_timeout=CONNECT_TIMEOUT,
                    max_reconnect_attempts=-1, reconnect_time_wait=1,
                    allow_reconnect=True, error_cb=self._error, disconnected_cb=self._disconnected,
                    reconnected_cb=self._reconnected,
                )
            except Exception as exc:
                raise ConnectionError(f"NATS at {self.config.display} cannot be reached ({type(exc).__name__})") from exc
            self._js = self._client.jetstream(timeout=API_TIMEOUT)
        return self._client

    async def jetstream(self) -> JetStreamContext:
        """The JetStream context (connects on first call; raises as :meth:`client`)."""
        await self.client()
        assert self._js is not None
        return self._js

    @property
    def connected(self) -> bool:
        return self._client is not None and self._client.is_connected

    async def max_payload(self) -> int:
        """The server's ``max_payload`` in bytes (headers plus body of one message)."""
        return int((await self.client()).max_payload)

    async def close(self) -> None:
        """Flush what is written (acks) and close."""
        self._closing = True
        if self._client is not None and not self._client.is_closed:
            try:
                await self._client.flush(timeout=2)
            except Exception as exc:  # noqa: BLE001 - closing anyway
                logger.debug("flush before close failed (%s)", type(exc).__name__)
            await self._client.close()
        self._client = None

    async def _error(self, exc: Exception) -> None:
        if self._closing:
            return
        logger.warning("NATS connection to %s: %s", self.config.display, type(exc).__name__)

    async def _disconnected(self) -> None:
        if self._closing:
            return
        logger.warning("NATS connection to %s lost; reconnecting", self.config.display)

    async def _reconnected(self) -> None:
        logger.info("NATS connection to %s is back", self.config.display)
