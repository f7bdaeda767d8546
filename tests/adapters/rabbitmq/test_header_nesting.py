"""A header nested thousands of levels deep never closes the worker's RabbitMQ connection.

pamqp decodes header tables recursively inside aiormq's frame reader: before the guard of
:mod:`consumer_kit.adapters.rabbitmq.wire`, 10,000 levels of AMQP arrays raised RecursionError there and closed
the whole connection on every delivery of the message (22 reconnects in 20 s), until the broker's
delivery limit dead-lettered it without a consumer-kit reason.
"""

from __future__ import annotations

import asyncio
import struct
import subprocess
import sys

import pytest
from pamqp import decode, encode

from consumer_kit import App
from consumer_kit.adapters.rabbitmq import wire
from consumer_kit.broker.registry import open_consumer
from consumer_kit.demo.app import CreateInvoiceHandler
from consumer_kit.model.outcomes import Outcome
from consumer_kit.worker.process import Worker
from tests.fixtures.broker_env import Env, command
from tests.fixtures.children import communicate

U32 = struct.Struct(">I")


def nested_arrays(depth: int) -> bytes:
    """The AMQP encoding (type byte first) of ``depth`` arrays, each holding the next, built
    without recursion."""
    value = b"A" + U32.pack(0)
    for _ in range(depth - 1):
        value = b"A" + U32.pack(len(value)) + value
    return value


def table(**values: bytes) -> bytes:
    entries = b"".join(bytes([len(k)]) + k.encode() + v for k, v in values.items())
    return U32.pack(len(entries)) + entries


def test_depth_is_measured_without_recursion() -> None:
    assert wire.nesting_depth(table(), 64) == 1
    assert wire.nesting_depth(table(a=b"S" + U32.pack(3) + b"abc", b=b"I" + U32.pack(7)), 64) == 1
    assert wire.nesting_depth(table(a=nested_arrays(3)), 64) == 4
    assert wire.nesting_depth(table(a=nested_arrays(100_000)), 64) == 65  # stops looking past the limit
    inner_table = b"F" + table(x=nested_arrays(2))
    assert wire.nesting_depth(table(a=b"A" + U32.pack(len(inner_table)) + inner_table), 64) == 5
    assert wire.nesting_depth(nested_arrays(7), 64, value=True) == 7
    assert wire.nesting_depth(b"I" + U32.pack(7), 64, value=True) == 0


def test_the_guard_replaces_only_the_values_too_deep_and_decodes_the_rest_as_before() -> None:
    wire.install()
    wire.install()  # idempotent: one wrapper
    guarded = decode.METHODS["table"]
    original = guarded.__wrapped__
    assert getattr(original, "__wrapped__", None) is None
    deep = table(**{
        "operation-id": b"S" + U32.pack(3) + b"k-1",
        "x-app-deep": nested_arrays(10_000),
        "x-consumer-kit-deliveries": nested_arrays(wire.MAX_DEPTH),
        "x-app-flat": b"A" + U32.pack(5) + b"I" + U32.pack(7),
    }) + b"after"
    consumed, value = decode.by_type(deep, "table")
    assert consumed == len(deep) - len(b"after")
    assert value == {
        "operation-id": "k-1", "x-app-deep": list(wire.UNDECODED),
        "x-consumer-kit-deliveries": list(wire.UNDECODED), "x-app-flat": [7],
    }
    shallow = encode.field_table({"operation-id": "k-1", "n": 5, "list": [1, [2, [3]]], "t": {"u": "v"}})
    assert decode.by_type(shallow, "table") == original(shallow)
    at_limit = table(a=nested_arrays(wire.MAX_DEPTH - 1))  # 64 levels with the table itself
    assert decode.by_type(at_limit, "table") == original(at_limit)


PRODUCER = """
import asyncio, sys, aio_pika
sys.setrecursionlimit(200_000)  # pamqp encodes recursively too: only this producer needs it
url, queue, app_body, tenant_body = sys.argv[1], sys.argv[2], sys.argv[3].encode(), sys.argv[4].encode()
deep = []
for _ in range(10_000):
    deep = [deep]
async def main():
    connection = await aio_pika.connect(url)
    channel = await connection.channel(publisher_confirms=True)
    for message_id, header, body in (("deep-app", "x-app-deep", app_body), ("deep-tenant", "tenant-id", tenant_body)):
        await channel.default_exchange.publish(
            aio_pika.Message(body, message_id=message_id, headers={header: deep}), routing_key=queue)
    await connection.close()
asyncio.run(main())
"""


@pytest.mark.rabbitmq
async def test_headers_nested_10000_levels_follow_the_header_rules_and_the_connection_stays(env: Env) -> None:
    app = App("test")
    app.subscribe(env.queue, CreateInvoiceHandler())
    consumer = open_consumer(env.settings)
    worker = Worker(app, env.settings, consumer=consumer, on_report=env.reports.put_nowait)
    task = asyncio.create_task(worker.run())
    try:
        await asyncio.wait_for(worker.started.wait(), 30)
        producer = await asyncio.create_subprocess_exec(
            sys.executable, "-c", PRODUCER, env.rabbitmq_url, env.queue,
            command(order_id=1).decode(), command(order_id=2).decode(), stderr=subprocess.PIPE,
        )
        _, stderr = await communicate(producer, 60)
        assert producer.returncode == 0, stderr.decode()[-2000:]
        healthy = await env.send(command(order_id=3))
        reports = {r.message_id: r for r in await env.next_reports(3)}
        # an application header too deep is not consumer-kit's to judge: the message runs
        assert reports["deep-app"].outcome is Outcome.EXECUTED
        # the tenant defines the operation: refused, naming the header
        assert (reports["deep-tenant"].outcome, reports["deep-tenant"].reason) == (Outcome.INVALID, "invalid_header")
        assert reports[healthy].outcome is Outcome.EXECUTED
        assert consumer.reconnects == 0  # type: ignore[attr-defined]
        assert worker.health.ready
    finally:
        worker.stop()
        await asyncio.wait_for(task, 30)
    [letter] = await env.dead_letters(1)
    assert letter.message_id == "deep-tenant"
    assert letter.headers["x-dead-letter-reason"] == "invalid_header"
    assert "tenant-id" in str(letter.headers["x-dead-letter-detail"])
