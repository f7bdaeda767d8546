"""Forged suspect marks benchmark: does a producer that writes
``x-consumer-kit-redelivered: 1`` on every message still cut a worker's throughput?

``python -m benchmarks.forged_marks_bench [--messages 1000] [--concurrency 8] [--rounds 3]
[--out FILE]``

Per round, unmarked and marked back to back (which goes first alternates): fill a fresh quorum
queue on RabbitMQ with N CreateInvoice commands (the invoices example), marked ones carrying the
forged header, then start one in-process worker (concurrency C) and time from its start until N
deliveries are reported; count how many ran as suspects (``redelivered``, i.e. alone) and the
attempt-book rows written. Before the marks were signed, the issue measured 300 marked messages
at concurrency 8 taking 7.7 s against 1.15 s unmarked (300 attempt rows). Writes JSON to --out
(default ``benchmarks/results/forged_marks.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from benchmarks import common

FORGED = {"x-consumer-kit-redelivered": 1}


async def _fill(queue: str, count: int, headers: dict[str, Any]) -> None:
    import aio_pika

    connection = await aio_pika.connect(common.AMQP_URL)
    try:
        channel = await connection.channel(publisher_confirms=True)
        await channel.declare_queue(f"{queue}.dlq", durable=True, arguments={"x-queue-type": "quorum"})
        await channel.declare_queue(queue, durable=True, arguments=common.work_queue_arguments(queue))
        await asyncio.gather(*(
            channel.default_exchange.publish(
                aio_pika.Message(common.message_body(order), headers=dict(headers), message_id=str(uuid.uuid4()),
                                 content_type="application/json", delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                routing_key=queue,
            ) for order in range(count)
        ))
    finally:
        await connection.close()


async def one_run(db_url: str, marked: bool, messages: int, concurrency: int) -> dict[str, Any]:
    from consumer_kit import App, Settings
    from consumer_kit.demo.app import CreateInvoiceHandler
    from consumer_kit.worker.process import Worker

    schema, queue = common.new_name("ckb_marks"), common.new_name("ckb.marks")
    await asyncio.to_thread(common.create_schema, db_url, schema)
    await _fill(queue, messages, FORGED if marked else {})
    app = App("bench-marks")
    app.subscribe(queue, CreateInvoiceHandler())
    settings = Settings(database_url=db_url, broker_url=common.AMQP_URL, db_schema=schema, search_path=schema,
                        concurrency=concurrency, max_deliveries=common.MAX_DELIVERIES)
    seen: list[Any] = []
    done = asyncio.Event()

    def report(item: Any) -> None:
        seen.append(item)
        if len(seen) >= messages:
            done.set()

    worker = Worker(app, settings, on_report=report)
    started = time.perf_counter()
    task = asyncio.create_task(worker.run())
    try:
        await asyncio.wait_for(done.wait(), 300)
        seconds = time.perf_counter() - started
    finally:
        worker.stop()
        await asyncio.wait_for(task, 30)
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, "attempts"))).fetchone()
    await common.delete_queues(queue)
    await asyncio.to_thread(common.drop_schema, db_url, schema)
    return {
        "marked": marked, "messages": messages, "seconds": round(seconds, 3),
        "per_second": round(messages / seconds, 1), "ran_alone": sum(1 for r in seen if r.redelivered),
        "attempt_rows": int(row[0]) if row else 0,
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    db_url = common.ensure_database()
    runs: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        order = (False, True) if round_ % 2 == 0 else (True, False)
        for marked in order:
            runs.append(await one_run(db_url, marked, args.messages, args.concurrency))
    unmarked = [r["seconds"] for r in runs if not r["marked"]]
    marked = [r["seconds"] for r in runs if r["marked"]]
    return {
        "scenario": "forged_marks", "concurrency": args.concurrency, "runs": runs,
        "median_seconds": {"unmarked": statistics.median(unmarked), "marked": statistics.median(marked)},
        "marked_over_unmarked": round(statistics.median(marked) / statistics.median(unmarked), 3),
        "before_signing (300 messages)": {"unmarked": 1.15, "marked": 7.7},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.forged_marks_bench", description=__doc__)
    parser.add_argument("--messages", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/forged_marks.json"))
    args = parser.parse_args(argv)
    result = asyncio.run(main_async(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    main()
