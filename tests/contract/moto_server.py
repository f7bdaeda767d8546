"""A local SQS endpoint for the tests: moto in server mode, one per test session.

Started on first use in a subprocess (``python -m moto.server``) on a free loopback port, so its
request handling does not compete with the tests' event loop for the GIL; stopped when the last
fixture using it ends. What moto does and does not do like SQS: ../shared/SERVICES.md (it never
duplicates or reorders, accepts stale receipt handles on delete, is slow: tests inject duplicates
and never measure throughput).

The ``sqs_endpoint`` fixture is imported by ``tests/contract/conftest.py`` and by the
``tests/test_sqs_*.py`` modules; both share the one server.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

_server: subprocess.Popen[bytes] | None = None
_endpoint: str | None = None
_users = 0

REGION = "us-east-1"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), 0.5):
            return True
    except OSError:
        return False


def start() -> str:
    """The endpoint URL (``http://127.0.0.1:PORT``) of the session's moto server, started if
    needed (at most 30 s).

    Raises:
        RuntimeError: moto did not come up.
    """
    global _server, _endpoint, _users
    _users += 1
    if _endpoint is not None:
        return _endpoint
    # moto accepts any credentials; the adapter reads them from the standard chain.
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    port = _free_port()
    _server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while not _answers(port):
        if _server.poll() is not None or time.monotonic() > deadline:
            _server.kill()
            raise RuntimeError("moto_server did not start (is moto[server] installed? pip install -e '.[dev]')")
        time.sleep(0.1)
    _endpoint = f"http://127.0.0.1:{port}"
    return _endpoint


def stop() -> None:
    """One user less; the last one stops the server."""
    global _server, _endpoint, _users
    _users -= 1
    if _users > 0 or _server is None:
        return
    _server.terminate()
    try:
        _server.wait(10)
    except subprocess.TimeoutExpired:
        _server.kill()
    _server, _endpoint = None, None


def sqs_url(endpoint: str, **options: object) -> str:
    """An ``sqs://`` broker URL for ``endpoint`` (no TLS, region us-east-1, 1 s long polls) plus
    ``options`` (``visibility=2``, ``heartbeat="off"``, ...)."""
    host = endpoint.split("://", 1)[1]
    query = "&".join(f"{k}={v}" for k, v in {"region": REGION, "tls": "false", "wait": 1, **options}.items())
    return f"sqs://{host}?{query}"


@pytest.fixture(scope="session")
def sqs_endpoint() -> Iterator[str]:
    """``http://127.0.0.1:PORT`` of the session's moto server."""
    endpoint = start()
    try:
        yield endpoint
    finally:
        stop()
