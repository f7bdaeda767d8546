"""Shared fixtures: real PostgreSQL and real RabbitMQ, or a skip that says how to start them.

With ``CONSUMER_KIT_REQUIRE_SERVICES=1`` (CI), a missing service fails the test instead.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from urllib.parse import urlparse

import pytest

from tests.broker_env import env  # noqa: F401 - fixture: a schema, a queue and in-process workers

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
def rabbitmq_url() -> str:
    return _require(
        "RabbitMQ", os.environ.get("CONSUMER_KIT_TEST_BROKER_URL", DEFAULT_BROKER_URL), 5672
    )


@pytest.fixture
def unique_name() -> Iterator[str]:
    """A short unique name for queues, exchanges and schemas of one test."""
    yield "t" + uuid.uuid4().hex[:12]
