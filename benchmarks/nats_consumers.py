"""The NATS JetStream batch consumers being compared (``benchmarks.consumers`` runs them):

* ``faststream_nats_batch``: FastStream's batch subscriber on a JetStream pull consumer
  (``NatsBroker.subscriber(subject, stream=..., durable=..., pull_sub=PullSub(batch_size, timeout,
  batch=True))``, docs page "NATS JetStream / Pull Subscriber"): ``concurrency`` subscribers on one
  durable pull consumer, each fetching up to ``--batch`` messages (waiting at most
  ``--batch-wait`` for a batch to fill), each batch's effect as one ``unnest`` statement per table
  in one transaction (the naive batch consumer's statements), then FastStream's own ack of the
  batch. No idempotency: the peer of consumer-kit's batch path on this broker.
* ``ck_nats_batch``: consumer-kit's worker on the batch path with the NATS adapter and the
  invoices example's ``BatchCreateInvoiceHandler`` (``batch_size = --batch``).

Both drain the same kind of stream: declared as consumer-kit's adapter declares a work queue
(:func:`fill_stream`), pre-filled with the benchmark's messages.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import uuid
from collections.abc import Iterable
from typing import Any

NATS_URL = os.environ.get("CK_BENCH_NATS_URL", "nats://127.0.0.1:4222")


async def fill_stream(queue: str, bodies: Iterable[bytes], *, window: int = 256) -> int:
    """Create the work-queue stream of ``queue`` as consumer-kit's NATS adapter would (name,
    subjects, retention) and publish ``bodies`` on subject ``queue`` with publish acks, ``window``
    unacknowledged at a time. Returns the count."""
    import nats

    from consumer_kit.adapters.nats.topology import ensure_stream, stream_name

    client = await nats.connect(NATS_URL)
    try:
        js = client.jetstream()
        await ensure_stream(js, stream_name(queue), [queue, f"{queue}.k.>"], work_queue=True)
        items = list(bodies)
        for start in range(0, len(items), window):
            await asyncio.gather(*(
                js.publish(queue, body, headers={"Nats-Msg-Id": uuid.uuid4().hex})
                for body in items[start:start + window]
            ))
        return len(items)
    finally:
        await client.close()


async def delete_stream(queue: str) -> None:
    """Delete the work-queue stream of ``queue`` and its dead-letter stream (whatever exists)."""
    import nats
    from nats.js.errors import NotFoundError

    from consumer_kit.adapters.nats.topology import stream_name

    client = await nats.connect(NATS_URL)
    try:
        js = client.jetstream()
        for name in (stream_name(queue), stream_name(queue) + "_dlq"):
            try:
                await js.delete_stream(name)
            except NotFoundError:
                pass
    finally:
        await client.close()


async def run_faststream_nats_batch(args: argparse.Namespace, progress: Any, stop: asyncio.Event) -> None:
    from faststream.nats import JStream, NatsBroker, PullSub
    from psycopg_pool import AsyncConnectionPool

    from benchmarks.common import bench_db_url
    from benchmarks.consumers import NaiveBatchSQL, wait_for
    from consumer_kit.adapters.nats.topology import stream_name

    statements = NaiveBatchSQL.for_schema(args.schema)
    pool = AsyncConnectionPool(
        bench_db_url(), min_size=args.concurrency, max_size=args.concurrency, kwargs={"autocommit": True},
        open=False,
    )
    await pool.open(wait=True)
    broker = NatsBroker(NATS_URL, logger=None)
    stream = JStream(name=stream_name(args.queue), declare=False)
    durable = "fs_" + stream_name(args.queue)

    async def handle(messages: list[dict[str, Any]]) -> None:
        async with pool.connection() as conn:
            await statements.apply(conn, messages)
        progress.tick(len(messages))  # FastStream acks the batch when this returns

    for _ in range(args.concurrency):  # one fetch loop per subscriber, all on one durable consumer
        broker.subscriber(
            args.queue, stream=stream, durable=durable,
            pull_sub=PullSub(args.batch, timeout=args.batch_wait, batch=True),
        )(handle)
    await broker.start()
    try:
        await wait_for(progress, stop)
    finally:
        await broker.stop()
        await pool.close()


async def run_ck_nats_batch(args: argparse.Namespace, progress: Any, stop: asyncio.Event) -> None:
    """consumer-kit's batch path on NATS: ``run_ck_batch`` with a ``nats://`` broker URL."""
    from benchmarks.consumers import run_ck_batch

    await run_ck_batch(args, progress, stop, broker_url=NATS_URL)
