"""A handful of the hostile corpus through the real RabbitMQ: AMQP header types as the broker
delivers them, the DLQ's reason headers, and a worker that keeps running."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from typing import Any

import aio_pika
import pytest

from consumer_kit import App, DeliveryReport, Settings
from consumer_kit.testing.outcomes import TERMINAL_OUTCOMES
from consumer_kit.worker.process import Worker
from tests.fixtures.harness import fetch_all
from tests.system.hostile.corpus import CASES_BY_NAME, GOOD_BYTES, TABLES, PlaceOrderHandler

pytestmark = [pytest.mark.postgres, pytest.mark.rabbitmq]

SUBSET = [
    "invalid_json_truncated",
    "non_utf8_latin1",
    "json_array",
    "operation_key_int",
    "operation_key_list",  # an AMQP array (pamqp cannot send non-UTF-8 header bytes)
    "operation_key_sql",
    "tenant_int",
    "message_type_unknown",
    "number_10_point_0",
    "conflicting_amount",
    "operation_key_nfc_then_nfd",
]


async def test_hostile_subset_on_rabbitmq(database_url: str, rabbitmq_url: str) -> None:
    import psycopg
    from psycopg import sql

    from consumer_kit.ledger import migrate

    schema = "ck_hostile_" + uuid.uuid4().hex[:8]
    queue = f"ck-hostile.{schema}"
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await migrate(conn, schema)
        await conn.execute(sql.SQL("SET search_path = {}").format(sql.Identifier(schema)))
        await conn.execute(TABLES.encode())
    settings = Settings(
        database_url=database_url, broker_url=rabbitmq_url, db_schema=schema, search_path=schema,
        retry_delays=[0.05], in_progress_delay=0.05, max_deliveries=3, concurrency=4,
    )
    app = App("hostile")
    app.subscribe(queue, PlaceOrderHandler())
    reports: list[DeliveryReport] = []
    arrived = asyncio.Event()

    def on_report(report: DeliveryReport) -> None:
        reports.append(report)
        arrived.set()

    worker = Worker(app, settings, on_report=on_report)
    task = asyncio.create_task(worker.run())
    connection = await aio_pika.connect(rabbitmq_url)
    try:
        await asyncio.wait_for(worker.started.wait(), 30)
        channel = await connection.channel(publisher_confirms=True)
        sends = 0
        expected_dead: Counter[str] = Counter()
        executions = 0
        for name in SUBSET:
            case = CASES_BY_NAME[name]
            for send in case.sends:
                headers: dict[str, Any] = {"message-type": "PlaceOrder"}
                if send.message_type is not None:
                    headers["message-type"] = send.message_type
                key = send.operation_id
                if isinstance(key, str):
                    key = f"{key}-{name}"  # one key per case
                if key is not None:
                    headers["operation-id"] = key
                headers.update(send.headers)
                await channel.default_exchange.publish(
                    aio_pika.Message(send.body, message_id=str(uuid.uuid4()), headers=headers),
                    routing_key=queue,
                )
                sends += 1
                # one at a time, so "first then variant" cases keep their order
                await _wait_terminal(reports, arrived, sends)
            executions += case.executions
            expected_dead.update(
                e.removeprefix("dead:") if e.startswith("dead:") else "payload_conflict"
                for e in case.expect if e.startswith("dead:") or e == "payload_conflict"
            )
        # a good message afterwards: the worker is still running
        await channel.default_exchange.publish(
            aio_pika.Message(GOOD_BYTES, message_id="good", headers={"operation-id": "good-after"}),
            routing_key=queue,
        )
        await _wait_terminal(reports, arrived, sends + 1)
        assert reports[-1].outcome.value == "executed"

        dlq = await channel.declare_queue(f"{queue}.dlq", passive=True)
        reasons: Counter[str] = Counter()
        for _ in range(sum(expected_dead.values())):
            message = await _get(dlq)
            reasons[str(message.headers.get("x-dead-letter-reason"))] += 1
        assert reasons == expected_dead
        assert await dlq.get(no_ack=True, fail=False) is None  # nothing else dead-lettered
        effects = await fetch_all(database_url, schema, "SELECT operation_key, count(*) FROM effects GROUP BY 1")
        assert all(n == 1 for _, n in effects), effects
        assert len(effects) == executions + 1
        states = await fetch_all(database_url, schema, "SELECT DISTINCT state FROM operations")
        assert states == [("completed",)]
        assert task.done() is False  # the worker kept running through all of it
    finally:
        worker.stop()
        await asyncio.wait_for(task, 30)
        ch = await connection.channel()
        for name in (queue, f"{queue}.dlq", f"{queue}.retry.50ms"):
            await ch.queue_delete(name)
        await connection.close()
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            await conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


async def _wait_terminal(reports: list[DeliveryReport], arrived: asyncio.Event, count: int) -> None:
    async with asyncio.timeout(30):
        while sum(r.outcome in TERMINAL_OUTCOMES for r in reports) < count:
            arrived.clear()
            await arrived.wait()


async def _get(queue: aio_pika.abc.AbstractQueue) -> aio_pika.abc.AbstractIncomingMessage:
    async with asyncio.timeout(10):
        while True:
            message = await queue.get(no_ack=True, fail=False)
            if message is not None:
                return message
            await asyncio.sleep(0.05)  # polling the DLQ's observable state, not a timing guess
