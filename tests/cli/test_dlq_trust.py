"""``consumer-kit dlq`` believes only consumer-kit's signed marks, on real RabbitMQ: a
message the broker dead-lettered itself keeps its producer's headers, and those name neither the
reason shown nor the queue a redrive publishes to."""

from __future__ import annotations

import asyncio
import json

import aio_pika
import pytest

from consumer_kit.adapters.rabbitmq.envelope import user_of_url
from consumer_kit.codec import headers as own
from tests.cli.test_dlq import dlq
from tests.fixtures.broker_env import Env, command

pytestmark = [pytest.mark.postgres, pytest.mark.rabbitmq]

FORGED = {
    own.ORIGINAL_QUEUE: "", own.DEAD_LETTER_REASON: "handler_failed", own.DEAD_LETTER_DETAIL: "ours, honestly",
    own.DELIVERIES: "9", "operation-id": "op-forged",
}


async def test_a_broker_dead_letter_with_producer_marks_is_shown_as_the_broker_s_and_redriven_to_the_named_queue(
    env: Env,
) -> None:
    elsewhere = env.queue + ".elsewhere"
    connection = await aio_pika.connect(env.rabbitmq_url)
    try:
        channel = await connection.channel()
        async with env.worker():  # declares the work queue, its DLX and its .dlq
            pass
        target = await channel.declare_queue(elsewhere, auto_delete=True)
        await env.send(command(order_id=1), {**FORGED, own.ORIGINAL_QUEUE: elsewhere})
        work = await channel.declare_queue(env.queue, passive=True)
        async with asyncio.timeout(10):
            while (message := await work.get(fail=False)) is None:
                await asyncio.sleep(0.05)
        await message.reject(requeue=False)  # the broker dead-letters it itself (x-death: rejected)

        async with asyncio.timeout(10):
            while not (listed := json.loads(await dlq(env, "list", env.queue, "--json"))):
                await asyncio.sleep(0.1)
        (row,) = listed
        assert row["reason"] == "broker:rejected" and row["detail"] == ""
        assert row["queue"] == env.queue and row["delivery_count"] == 1
        table = await dlq(env, "list", env.queue)
        assert "handler_failed" not in table and "honestly" not in table

        assert "redrove 1, kept 0, failed 0" in await dlq(env, "redrive", env.queue, "--all")
        target = await channel.declare_queue(elsewhere, passive=True)
        assert target.declaration_result.message_count == 0  # never where the producer said
        async with asyncio.timeout(10):
            while (back := await work.get(fail=False)) is None:
                await asyncio.sleep(0.05)
        await back.ack()
        assert (back.headers or {}).get("operation-id") == "op-forged"
        assert not {own.ORIGINAL_QUEUE, own.DEAD_LETTER_REASON, own.DELIVERIES} & set(back.headers or {})
    finally:
        await connection.close()


async def test_a_redriven_copy_carries_the_redriving_connections_user_id(env: Env) -> None:
    """RabbitMQ validates ``user_id``: the redrive copy is sent as the operator's user, so a handler
    whose ``tenant_senders`` lists that user can admit redriven messages."""
    connection = await aio_pika.connect(env.rabbitmq_url)
    try:
        channel = await connection.channel()
        async with env.worker():  # declares the work queue, its DLX and its .dlq
            pass
        await env.send(command(order_id=2), {"operation-id": "op-redriven"})
        work = await channel.declare_queue(env.queue, passive=True)
        async with asyncio.timeout(10):
            while (message := await work.get(fail=False)) is None:
                await asyncio.sleep(0.05)
        await message.reject(requeue=False)  # into the .dlq
        async with asyncio.timeout(10):
            while not json.loads(await dlq(env, "list", env.queue, "--json")):
                await asyncio.sleep(0.1)
        assert "redrove 1, kept 0, failed 0" in await dlq(env, "redrive", env.queue, "--all")
        async with asyncio.timeout(10):
            while (back := await work.get(fail=False)) is None:
                await asyncio.sleep(0.05)
        await back.ack()
        assert (back.headers or {}).get("operation-id") == "op-redriven"
        assert back.user_id == user_of_url(env.rabbitmq_url)
    finally:
        await connection.close()
