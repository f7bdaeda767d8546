"""Liveness and readiness for orchestrators: a file touched on every beat and/or a tiny HTTP endpoint.

* **liveness**: the process's event loop still runs. A beat older than ``stale_after`` seconds
  means it is stuck (restart it). ``GET /live`` answers ``200`` while fresh, ``503`` when stale; the
  file's modification time is the last beat.
* **readiness**: the process can do its work now (a worker: not paused by an environment fault and
  connected to its broker). ``GET /ready`` answers ``200`` or ``503``. A paused worker is alive
  and not ready: it recovers on its own, so do not restart it, just do not count on it.

Any other path answers like ``/live``. Every answer is JSON:
``{"status": "ok"|"stale", "ready": bool, "last_beat_age": seconds, "detail": {...}}``.
The endpoint listens on 127.0.0.1 unless told otherwise (``CONSUMER_KIT_HEALTH_HOST``, ``--health-host``):
its answers stay on the host by default; ``0.0.0.0`` or ``::`` opens it to a Kubernetes probe.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from consumer_kit.errors import ConfigurationError

logger = logging.getLogger("consumer_kit.health")


class Health:
    """Beats for liveness, a readiness check, and the endpoint that serves both.

    Args:
        stale_after: seconds after which the last beat counts as stuck.
        file: path touched (mtime updated) on every beat, or ``None``.
        detail: returns the JSON-able details served with every answer (counters, state).
        ready: returns readiness; default always ready.
    """

    def __init__(
        self,
        *,
        stale_after: float,
        file: Path | None,
        detail: Callable[[], dict[str, Any]],
        ready: Callable[[], bool] | None = None,
    ) -> None:
        self.stale_after = stale_after
        self.file = file
        self._detail = detail
        self._ready = ready or (lambda: True)
        self._last_beat = time.monotonic()
        self._server: asyncio.Server | None = None
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

    @property
    def alive(self) -> bool:
        return self.last_beat_age <= self.stale_after

    @property
    def ready(self) -> bool:
        return self.alive and self._ready()

    async def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Start the endpoint on ``host:port`` (``0``: any free port); returns the port.

        Args:
            host: address to listen on (``127.0.0.1``: this host only; ``0.0.0.0`` or ``::``:
                every interface, as a Kubernetes probe needs).

        Raises:
            ConfigurationError: the address cannot be listened on (not this host's, in use).
        """
        try:
            self._server = await asyncio.start_server(self._answer, host, port)
        except OSError as exc:  # EADDRNOTAVAIL, EADDRINUSE, an unresolvable name
            raise ConfigurationError(
                f"health endpoint: cannot listen on {host} port {port} ({exc.strerror or exc})"
            ) from None
        self.port = self._server.sockets[0].getsockname()[1]
        logger.info("health endpoint on %s port %s (/live, /ready)", host, self.port)
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(reader.readline(), 5)
            parts = request_line.decode("latin-1").split()
            path = parts[1] if len(parts) > 1 else "/"
            ok = self.ready if path.startswith("/ready") else self.alive
            body = json.dumps(
                {"status": "ok" if self.alive else "stale", "ready": self.ready,
                 "last_beat_age": round(self.last_beat_age, 3), "detail": self._detail()}
            ).encode()
            status = "200 OK" if ok else "503 Service Unavailable"
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body
            )
            await writer.drain()
        except (OSError, TimeoutError):
            pass
        finally:
            writer.close()
