"""faststream-outbox relaying the same events to the same RabbitMQ (scenario 4's peer).

faststream-outbox 0.19 (PyPI) keeps its own outbox table (SQLAlchemy, asyncpg) and relays rows
with a FastStream subscriber stacked under a RabbitMQ publisher. Here: ``events`` rows are
written in transactions of 500 through ``OutboxBroker.publish(..., session=...)``, then the relay
app starts; events/s = events / (last arrival - first arrival) at a consumer of the target queue.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from benchmarks.common import AMQP_URL, bench_db_url

logger = logging.getLogger("benchmarks.faststream_outbox")


def run(events: int) -> dict[str, Any]:
    """Events/s of a faststream-outbox relay, or ``{"error": ...}`` saying why it could not run."""
    if events <= 0:
        return {"skipped": "no events in this mode"}
    try:
        import faststream_outbox  # noqa: F401
    except ImportError as exc:
        return {"error": f"faststream-outbox is not installed ({exc}); pip install -e '.[bench]'"}
    try:
        return asyncio.run(asyncio.wait_for(_run(events), 180))
    except Exception as exc:  # noqa: BLE001 - reported as is, never faked
        logger.warning("faststream-outbox run failed: %s", exc)
        return {"error": f"{type(exc).__name__}: {exc}"[:400]}


async def _run(events: int) -> dict[str, Any]:
    import aio_pika
    from faststream.rabbit import RabbitBroker
    from faststream_outbox import OutboxBroker, make_outbox_table
    from sqlalchemy import MetaData, text
    from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

    # FastStream logs every message at INFO; the benchmark's log keeps ids and outcomes only.
    for name in ("faststream", "faststream.access", "faststream_outbox"):
        logging.getLogger(name).setLevel(logging.WARNING)
    schema = "ckb_fs_" + uuid.uuid4().hex[:8]
    outbox_queue = f"{schema}_outbox"
    target = f"{schema}.events"
    url = bench_db_url().replace("postgresql://", "postgresql+asyncpg://")
    engine = create_async_engine(url, pool_size=4)
    metadata = MetaData(schema=schema)
    table = make_outbox_table(metadata, table_name="outbox")
    async with engine.begin() as conn:
        await conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        await conn.run_sync(metadata.create_all)
    arrivals: dict[str, float] = {}
    amqp = await aio_pika.connect(AMQP_URL)
    try:
        channel = await amqp.channel()
        await channel.set_qos(prefetch_count=1000)
        queue = await channel.declare_queue(target, durable=False, auto_delete=False)

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            arrivals.setdefault(str(message.correlation_id or message.message_id or len(arrivals)),
                                time.time())
            await message.ack()

        await queue.consume(on_message)

        broker_outbox = OutboxBroker(engine, outbox_table=table)
        rabbit = RabbitBroker(AMQP_URL)
        publisher = rabbit.publisher(target)

        @publisher
        @broker_outbox.subscriber(outbox_queue)
        async def relay(body: dict[str, Any]) -> dict[str, Any]:
            return body

        session_factory = async_sessionmaker(engine, expire_on_commit=False)
        for start in range(0, events, 500):
            async with session_factory() as session, session.begin():
                for i in range(start, min(events, start + 500)):
                    await broker_outbox.publish(
                        {"invoice_id": i, "order_id": i, "customer_id": f"c{i % 100}",
                         "amount_cents": 1000},
                        queue=outbox_queue, session=session,
                    )
        await rabbit.connect()
        await broker_outbox.start()
        started = time.monotonic()
        try:
            while len(arrivals) < events and time.monotonic() - started < 150:
                await asyncio.sleep(0.05)
        finally:
            await broker_outbox.stop()
            await rabbit.stop()
        await channel.queue_delete(target)
    finally:
        await amqp.close()
        async with engine.begin() as conn:
            await conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        await engine.dispose()
    if len(arrivals) < events:
        return {"error": f"only {len(arrivals)} of {events} events arrived in 150 s", "events": events}
    times = sorted(arrivals.values())
    return {"events": events, "drain_events_per_s": events / (times[-1] - times[0]),
            "version": _version()}


def _version() -> str:
    from importlib.metadata import version

    return version("faststream-outbox")
