"""Per-key lanes: throughput of 1,000 messages over 20 partition keys at concurrency 1 and 16.

Run: ``python -m benchmarks.lanes_bench [--messages 1000] [--keys 20] [--rounds 3]``. One in-process
worker on the local RabbitMQ and PostgreSQL (a vhost-less default URL, a throwaway schema and
queue), the messages queued first, then drained; each handler does one small write. Per-key order
is checked on every run (a run out of order fails). Writes ``benchmarks/latest/lanes.json``: per
concurrency, messages/s of each round and their median, and the ratio 16 : 1 of the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from pydantic import BaseModel

from consumer_kit import App, Context, Envelope, Handler, OutgoingMessage, Result, Settings
from consumer_kit.adapters.rabbitmq import RabbitMQPublisher
from consumer_kit.worker.process import Worker
from tests.fixtures.harness import throwaway_schema

DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/test"
BROKER_URL = "amqp://guest:guest@127.0.0.1:5672/"
OUT = Path(__file__).resolve().parent / "latest" / "lanes.json"


class Step(BaseModel):
    account: str
    seq: int


class StepHandler(Handler[Step]):
    operation_type = "bench.step"

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, list[int]] = collections.defaultdict(list)
        self.done = 0
        self.finished = asyncio.Event()
        self.expected = 0
        self.first: float | None = None  # when the first step reached the handler

    def operation_key(self, message: Step, envelope: Envelope) -> str:
        return f"{message.account}-{message.seq}"

    def partition_key(self, message: Step, envelope: Envelope) -> str:
        return message.account

    async def handle(self, message: Step, ctx: Context) -> Result:
        if self.first is None:
            self.first = time.perf_counter()
        self.seen[message.account].append(message.seq)
        await ctx.connection.execute("INSERT INTO steps (account, seq) VALUES (%s, %s)", (message.account, message.seq))
        self.done += 1
        if self.done == self.expected:
            self.finished.set()
        return Result("applied")


async def one_run(messages: int, keys: int, concurrency: int) -> float:
    """Messages/s of one drain; raises when a key's order broke."""
    queue = f"ckb-lanes-{uuid.uuid4().hex[:8]}"
    handler = StepHandler()
    handler.expected = messages
    async with throwaway_schema(DATABASE_URL, example_tables=False) as schema:
        async with await psycopg.AsyncConnection.connect(DATABASE_URL, autocommit=True,
                                                         options=f"-c search_path={schema}") as conn:
            await conn.execute("CREATE TABLE steps (account text NOT NULL, seq int NOT NULL)")
        app = App("lanes-bench")
        app.subscribe(queue, handler)
        settings = Settings(database_url=DATABASE_URL, broker_url=BROKER_URL, db_schema=schema, search_path=schema,
                            concurrency=concurrency)
        publisher = RabbitMQPublisher(BROKER_URL)
        try:
            declaring = Worker(app, settings)  # declares the queue, then steps aside
            task = asyncio.create_task(declaring.run())
            await declaring.started.wait()
            declaring.stop()
            await task
            for seq in range(messages // keys):
                await asyncio.gather(*(
                    publisher.publish(OutgoingMessage(
                        destination="", routing_key=queue, message_id=str(uuid.uuid4()),
                        body=json.dumps({"account": f"a{k}", "seq": seq}).encode(), message_type="Step",
                    )) for k in range(keys)
                ))
            worker = Worker(app, settings)
            task = asyncio.create_task(worker.run())
            await asyncio.wait_for(handler.finished.wait(), 300)
            assert handler.first is not None
            elapsed = time.perf_counter() - handler.first
            worker.stop()
            await task
        finally:
            await publisher.close()
            await _delete_queues(queue)
    if any(steps != sorted(steps) for steps in handler.seen.values()):
        raise AssertionError("a key's steps reached the handler out of order")
    return messages / elapsed


async def _delete_queues(queue: str) -> None:
    import aio_pika

    connection = await aio_pika.connect(BROKER_URL)
    try:
        channel = await connection.channel()
        for suffix in ("", ".dlq", ".retry.1000ms", ".retry.2000ms", ".retry.5000ms", ".retry.30000ms"):
            await channel.queue_delete(queue + suffix)
    finally:
        await connection.close()


async def main(messages: int, keys: int, rounds: int) -> dict[str, Any]:
    results: dict[str, Any] = {"messages": messages, "keys": keys, "rounds": rounds}
    for concurrency in (1, 16):
        rates = [await one_run(messages, keys, concurrency) for _ in range(rounds)]
        results[f"concurrency_{concurrency}"] = {"rates": [round(r, 1) for r in rates],
                                                 "median": round(statistics.median(rates), 1)}
    results["ratio_16_to_1"] = round(results["concurrency_16"]["median"] / results["concurrency_1"]["median"], 2)
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=1000)
    parser.add_argument("--keys", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    figures = asyncio.run(main(args.messages, args.keys, args.rounds))
    OUT.write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))
