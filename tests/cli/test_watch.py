"""``consumer-kit watch``: a newcomer sees the event the relay publishes to an exchange nothing is
bound to, on a real RabbitMQ, and the tap leaves nothing behind."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import urllib.parse
import uuid
from pathlib import Path

import aio_pika
import psycopg
import pytest
from psycopg import sql

from consumer_kit.adapters.rabbitmq import RabbitMQPublisher
from consumer_kit.ledger import migrate
from consumer_kit.outbox_relay.relay import relay_pending
from tests.fixtures.children import communicate, reap
from tests.fixtures.relay_support import Event, relay_settings, write_events

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.postgres, pytest.mark.rabbitmq]


def _env(broker_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONSUMER_KIT_")}
    return {**env, "CONSUMER_KIT_BROKER_URL": broker_url, "PYTHONPATH": str(ROOT)}


async def _start_watch(broker_url: str, *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "consumer_kit", "watch", *args, env=_env(broker_url),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )


async def test_watch_prints_what_the_relay_publishes_and_leaves_no_queue(
    database_url: str, rabbitmq_url: str
) -> None:
    exchange_name = f"ck-watch-{uuid.uuid4().hex[:8]}.events"
    schema = "ck_watch_" + uuid.uuid4().hex[:8]
    connection = await aio_pika.connect(rabbitmq_url)
    try:
        channel = await connection.channel()
        exchange = await channel.declare_exchange(exchange_name, aio_pika.ExchangeType.TOPIC, durable=True)
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            await migrate(conn, schema)
            proc = await _start_watch(rabbitmq_url, exchange_name, "--count", "1", "--show-body", "--json",
                                      "--timeout", "60")
            try:
                assert proc.stderr is not None and proc.stdout is not None
                ready = await asyncio.wait_for(proc.stderr.readline(), 30)
                assert ready.decode().startswith(f"watching {exchange_name} (routing key #) through a temporary queue")
                [event_id] = await write_events(conn, schema, [Event(exchange_name, "invoice.created", payload={"n": 1})])
                publisher = RabbitMQPublisher(rabbitmq_url)
                try:
                    published = await relay_pending(relay_settings(database_url, schema, rabbitmq_url), publisher)
                finally:
                    await publisher.close()
                assert published == 1
                out, err = await communicate(proc, 60)
                assert proc.returncode == 0, err.decode()
                [line] = out.decode().splitlines()
                seen = json.loads(line)
                assert (seen["destination"], seen["routing_key"], seen["message_id"]) == (
                    exchange_name, "invoice.created", str(event_id))
                assert seen["message_type"] == "ThingHappened" and json.loads(seen["body"]) == {"n": 1}
            finally:
                await reap(proc)  # a failed step leaves it running
            await conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
        # the exclusive queue went with the watch's connection: the vhost holds no queue
        if shutil.which("rabbitmqctl"):
            vhost = urllib.parse.unquote(urllib.parse.urlparse(rabbitmq_url).path.lstrip("/")) or "/"
            listed = subprocess.run(["rabbitmqctl", "-q", "-p", vhost, "list_queues", "name"],
                                    capture_output=True, text=True, timeout=60, check=True).stdout
            assert "amq.gen" not in listed, listed
        await exchange.delete()
    finally:
        await connection.close()


async def test_watch_of_a_missing_exchange_says_how_to_create_it(rabbitmq_url: str) -> None:
    name = f"ck-watch-missing-{uuid.uuid4().hex[:8]}"
    proc = await _start_watch(rabbitmq_url, name, "--timeout", "5")
    _, err = await communicate(proc, 60)
    assert proc.returncode == 2
    assert err.decode().startswith(f"error: exchange '{name}' does not exist: `consumer-kit declare module:app`")


async def test_watch_on_a_broker_without_a_tap_says_what_to_use() -> None:
    proc = await _start_watch("sqs://127.0.0.1:1?region=us-east-1&tls=false", "billing.events", "--timeout", "1")
    _, err = await communicate(proc, 60)
    assert proc.returncode == 2
    assert "consumer-kit watch supports RabbitMQ (amqp://) only, not sqs://" in err.decode()
