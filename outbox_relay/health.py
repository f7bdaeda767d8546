"""Liveness for orchestrators: a file touched on every loop and/or a tiny HTTP endpoint.

The loop beats at least every ``poll_interval`` seconds, and at most ``claim_timeout`` seconds can
pass inside one batch, so a beat older than ``poll_interval + claim_timeout`` (plus slack) means
the relay is stuck. ``GET /`` (any path) on ``127.0.0.1:<port>`` answers ``200`` with JSON
``{"status": "ok", "last_beat_age": seconds, "counters": {...}}`` while fresh, ``503`` when stale.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger("outbox_relay.health")


class Health:
    """Beats for liveness.

    Args:
        stale_after: seconds after which the last beat counts as stuck.
        file: path touched (mtime updated) on every beat, or ``None``.
        counters: returns the counters served by the endpoint.
    """

    def __init__(
        self, *, stale_after: float, file: Path | None, counters: Callable[[], dict[str, int]]
    ) -> None:
        self.stale_after = stale_after
        self.file = file
        self._counters = counters
        self._last_beat = time.monotonic()
        self._server: asyncio.base_events.Server | None = None
        self.port: int | None = None

    def beat(self) -> None:
        self._last_beat = time.monotonic()
        if self.file is not None:
            try:
                self.file.touch()
                os.utime(self.file)
            except OSError as exc:
                logger.warning("cannot touch health file %s (%s)", self.file, exc)

    @property
    def last_beat_age(self) -> float:
        return time.monotonic() - self._last_beat

    async def serve(self, port: int) -> int:
        """Start the endpoint on ``127.0.0.1:port`` (``0``: any free port); returns the port."""
        self._server = await asyncio.start_server(self._answer, "127.0.0.1", port)
        self.port = self._server.sockets[0].getsockname()[1]
        logger.info("health endpoint on http://127.0.0.1:%s/", self.port)
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await asyncio.wait_for(reader.readline(), 5)
            age = self.last_beat_age
            fresh = age <= self.stale_after
            body = json.dumps(
                {"status": "ok" if fresh else "stale", "last_beat_age": round(age, 3),
                 "counters": self._counters()}
            ).encode()
            status = "200 OK" if fresh else "503 Service Unavailable"
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body
            )
            await writer.drain()
        except (OSError, TimeoutError):
            pass
        finally:
            writer.close()
