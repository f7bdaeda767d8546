"""Shared fixtures: real PostgreSQL and real RabbitMQ, or a skip that says how to start them;
the local Service Bus test server.

With ``CONSUMER_KIT_REQUIRE_SERVICES=1`` (CI), a missing service fails the test instead.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING
from urllib.parse import quote, urlparse, urlunparse

import pytest

from tests.fixtures.broker_env import env  # noqa: F401 - fixture: a schema, a queue and in-process workers
from tests.fixtures.report_guard import pytest_runtest_makereport  # noqa: F401 - hook: CPython 3.11's AST bug
from tests.fixtures.resilience import renv  # noqa: F401 - fixture: env with per-worker settings and backends
from tests.fixtures.telemetry_kit import otel  # noqa: F401 - fixture: the OpenTelemetry SDK, in memory

if TYPE_CHECKING:
    from tests.adapters.servicebus.server import ServiceBusTestServer
    from tests.adapters.servicebus.server.fixtures import SBEnv

DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_BROKER_URL = "amqp://guest:guest@127.0.0.1:5672/"

HOW_TO_START = {
    "PostgreSQL": "start it with `pg_ctlcluster --skip-systemctl-redirect 15 main start` or "
    "`docker compose up -d postgres`, or set CONSUMER_KIT_TEST_DATABASE_URL",
    "RabbitMQ": "start it with `rabbitmq-server -detached` or `docker compose up -d rabbitmq`, "
    "or set CONSUMER_KIT_TEST_BROKER_URL",
}


def _answers(url: str, default_port: int) -> bool:
    parsed = urlparse(url)
    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or default_port), 2):
            return True
    except OSError:
        return False


def _require(service: str, url: str, default_port: int) -> str:
    if _answers(url, default_port):
        return url
    message = f"{service} does not answer at {urlparse(url).netloc}: {HOW_TO_START[service]}"
    if os.environ.get("CONSUMER_KIT_REQUIRE_SERVICES") == "1":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def database_url() -> str:
    return _require(
        "PostgreSQL", os.environ.get("CONSUMER_KIT_TEST_DATABASE_URL", DEFAULT_DATABASE_URL), 5432
    )


@pytest.fixture(scope="session")
def rabbitmq_url() -> Iterator[str]:
    """The broker URL of this test session's own vhost (``ck-test-<random>``), created with
    ``rabbitmqctl add_vhost`` and deleted at the end, so tests never see or touch another run's
    queues or connections on a shared broker. A URL that already names a vhost other than ``/``
    is used as it is (a dedicated vhost someone made for the tests)."""
    url = _require("RabbitMQ", os.environ.get("CONSUMER_KIT_TEST_BROKER_URL", DEFAULT_BROKER_URL), 5672)
    parsed = urlparse(url)
    if parsed.path not in ("", "/") or shutil.which("rabbitmqctl") is None:
        yield url
        return
    vhost = "ck-test-" + uuid.uuid4().hex[:10]
    rabbitmqctl("add_vhost", vhost)
    try:
        rabbitmqctl("set_permissions", "-p", vhost, parsed.username or "guest", ".*", ".*", ".*")
        yield urlunparse(parsed._replace(path="/" + quote(vhost, safe="")))
    finally:
        rabbitmqctl("delete_vhost", vhost, check=False)


def rabbitmqctl(*args: str, check: bool = True) -> str:
    """Run ``rabbitmqctl -q ARGS`` and return its output. Commands that act on queues or
    connections must pass ``-p <vhost>``: the broker is shared with other runs."""
    result = subprocess.run(
        ["rabbitmqctl", "-q", *args], capture_output=True, text=True, timeout=60, check=False
    )
    if check and result.returncode != 0:
        raise RuntimeError(f"rabbitmqctl {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout


def close_vhost_connections(vhost: str, reason: str = "test") -> int:
    """Close every client connection to ``vhost`` (never another vhost's: the broker is shared);
    returns how many were closed."""
    closed = 0
    for line in rabbitmqctl("list_connections", "pid", "vhost", "--no-table-headers").splitlines():
        parts = line.split("\t") if "\t" in line else line.split()
        if len(parts) >= 2 and parts[1].strip() == vhost:
            rabbitmqctl("close_connection", parts[0].strip(), reason, check=False)
            closed += 1
    return closed


def vhost_of(url: str) -> str:
    """The vhost an AMQP URL names (``/`` when none)."""
    path = urlparse(url).path
    return "/" if path in ("", "/") else path[1:].replace("%2F", "/")


# The Service Bus fixtures import the test server (and the azure-servicebus SDK) only when a test
# asks for them: runs without Service Bus tests do not load the SDK.


@pytest.fixture(scope="session")
def sb_server() -> Iterator[ServiceBusTestServer]:
    """One local Service Bus test server (tests/adapters/servicebus/server) for the whole test session;
    entities are per test."""
    from tests.adapters.servicebus.server import ServiceBusTestServer

    with ServiceBusTestServer() as server:
        yield server


@pytest.fixture
async def sb(sb_server: ServiceBusTestServer) -> AsyncIterator[SBEnv]:
    """One test's view of ``sb_server``: a :class:`tests.adapters.servicebus.server.fixtures.SBEnv`."""
    from tests.adapters.servicebus.server.fixtures import sb_env

    async with sb_env(sb_server) as view:
        yield view


@pytest.fixture
def cli_logging() -> Iterator[None]:
    """For tests that run a command in this process: the commands set logger levels (their
    ``--log-level`` options); put them back so later tests' ``caplog`` sees what it expects."""
    from consumer_kit.cli.console import OWN_LOGGERS

    saved = {name: logging.getLogger(name).level for name in ("", *OWN_LOGGERS)}
    yield
    for name, level in saved.items():
        logging.getLogger(name).setLevel(level)


@pytest.fixture
def unique_name() -> Iterator[str]:
    """A short unique name for queues, exchanges and schemas of one test."""
    yield "t" + uuid.uuid4().hex[:12]
