"""One outbox, one broker: after the broker URL switched, a pending RabbitMQ event
went to SQS. The relay now records its broker at the first start and refuses another while events
are pending; ``outbox-relay rebind`` is the deliberate way over."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import uuid
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from consumer_kit.adapters.rabbitmq import RabbitMQPublisher
from consumer_kit.errors import ConfigurationError
from consumer_kit.ledger import migrate
from consumer_kit.outbox_relay.binding import broker_identity
from consumer_kit.outbox_relay.relay import Relay
from tests.fixtures.children import communicate
from tests.fixtures.relay_support import Event, relay_settings, write_events

ROOT = Path(__file__).resolve().parents[2]
OTHER = "sqs://127.0.0.1:5000?region=us-east-1&tls=false"


@pytest.mark.parametrize("url, identity", [
    ("amqp://guest:secret@MQ.example:5672/prod?heartbeat=30", "amqp://mq.example:5672/prod"),
    ("amqp://guest:guest@127.0.0.1:5672/", "amqp://127.0.0.1:5672/"),
    ("sqs://127.0.0.1:5000?region=us-east-1&tls=false&wait=2", "sqs://127.0.0.1:5000?region=us-east-1"),
    ("sqs://?region=eu-west-1", "sqs://?region=eu-west-1"),
    ("memory://", None),
])
def test_a_broker_identity_has_no_credentials_or_options(url: str, identity: str | None) -> None:
    assert broker_identity(url) == identity


async def _relay_once(database_url: str, schema: str, broker_url: str, rabbitmq_url: str) -> int:
    publisher = RabbitMQPublisher(rabbitmq_url)
    try:
        relay = Relay(relay_settings(database_url, schema, broker_url), publisher=publisher)
        await relay.run(once=True)
        return int(relay.counters["published"])
    finally:
        await publisher.close()  # the caller owns a publisher it passes in


@pytest.mark.postgres
@pytest.mark.rabbitmq
async def test_a_relay_on_another_broker_refuses_while_events_are_pending(
    database_url: str, rabbitmq_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    schema = "ck_bind_" + uuid.uuid4().hex[:8]
    destination = f"ck-bind-{uuid.uuid4().hex[:8]}"
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await migrate(conn, schema)
        try:
            await write_events(conn, schema, [Event(destination)])
            assert await _relay_once(database_url, schema, rabbitmq_url, rabbitmq_url) == 1  # first start binds
            cur = await conn.execute(sql.SQL("SELECT broker FROM {}").format(sql.Identifier(schema, "outbox_broker")))
            assert await cur.fetchall() == [(broker_identity(rabbitmq_url),)]

            await write_events(conn, schema, [Event(destination)])  # pending, written for RabbitMQ
            with pytest.raises(ConfigurationError) as refused:
                await _relay_once(database_url, schema, OTHER, rabbitmq_url)
            text = str(refused.value)
            assert f"belongs to broker {broker_identity(rabbitmq_url)}" in text
            assert "holds 1 pending event(s)" in text and "sqs://127.0.0.1:5000?region=us-east-1" in text
            assert "outbox-relay rebind" in text and "guest" not in text
            cur = await conn.execute(sql.SQL("SELECT count(*) FROM {} WHERE published_at IS NULL").format(
                sql.Identifier(schema, "outbox")))
            assert await cur.fetchone() == (1,)  # nothing was published to the other broker

            # the way over, as a user types it; then the relay starts
            env = {k: v for k, v in os.environ.items() if not k.startswith("CONSUMER_KIT_")}
            env.update(CONSUMER_KIT_DATABASE_URL=database_url, CONSUMER_KIT_DB_SCHEMA=schema,
                       CONSUMER_KIT_BROKER_URL=OTHER, PYTHONPATH=str(ROOT))
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "consumer_kit.outbox_relay.cli", "rebind", env=env,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await communicate(proc, 60)
            assert proc.returncode == 0, err.decode()
            assert out.decode() == f"outbox of schema {schema} now belongs to broker sqs://127.0.0.1:5000?region=us-east-1\n"
            # (published through the RabbitMQ publisher passed in: the binding is what is under test)
            assert await _relay_once(database_url, schema, OTHER, rabbitmq_url) == 1

            # no pending event: a move is allowed, with a warning, and recorded
            with caplog.at_level(logging.WARNING, logger="consumer_kit.outbox_relay"):
                assert await _relay_once(database_url, schema, rabbitmq_url, rabbitmq_url) == 0
            assert any("moves from broker sqs://127.0.0.1:5000?region=us-east-1 to amqp://" in r.getMessage()
                       for r in caplog.records)
            cur = await conn.execute(sql.SQL("SELECT broker FROM {}").format(sql.Identifier(schema, "outbox_broker")))
            assert await cur.fetchall() == [(broker_identity(rabbitmq_url),)]
        finally:
            await conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
