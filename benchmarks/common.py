"""Shared pieces of the benchmarks: service URLs, the benchmark database and schemas, queues,
message bodies, the business effect's SQL and the statistics every scenario reports.

Everything a run creates is named ``ckb_<random>`` (schemas, queues) inside database ``ck_bench``
and is dropped/deleted when the scenario ends (``drop_schema``, ``delete_queues``).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import statistics
import subprocess
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from consumer_kit.demo.app import SCHEMA_SQL as INVOICES_SCHEMA_SQL

logger = logging.getLogger("benchmarks")

PG_ADMIN_URL = os.environ.get("CK_BENCH_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
BENCH_DB = os.environ.get("CK_BENCH_DATABASE", "ck_bench")
AMQP_URL = os.environ.get("CK_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
REDIS_HOST = os.environ.get("CK_BENCH_REDIS_HOST", "127.0.0.1")
REDIS_PORT = int(os.environ.get("CK_BENCH_REDIS_PORT", "6379"))
MAX_DELIVERIES = 5  # consumer-kit's default; all variants' queues get the same x-delivery-limit
CUSTOMERS = 1000  # distinct counter rows: enough that row locks on the counter do not dominate


def bench_db_url() -> str:
    base = PG_ADMIN_URL.rsplit("/", 1)[0]
    return f"{base}/{BENCH_DB}"


def new_name(prefix: str = "ckb") -> str:
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


def ensure_database() -> str:
    """Create database ``ck_bench`` when missing; return its URL."""
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        found = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (BENCH_DB,)).fetchone()
        if not found:
            try:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(BENCH_DB)))
            except (psycopg.errors.DuplicateDatabase, psycopg.errors.UniqueViolation):
                pass  # another run made it meanwhile: the server is shared
    return bench_db_url()


# -- the business effect ----------------------------------------------------------------------

# The business effect's tables are the invoices example's own (examples/invoices/app.py).
APP_TABLES_SQL = INVOICES_SCHEMA_SQL


@dataclass(frozen=True)
class EffectSQL:
    """The three statements of the business effect, schema-qualified (identifiers via psycopg.sql).

    ``insert_event`` writes an ``outbox``-shaped row directly (the naive and Powertools peers have
    no outbox machinery; the row is the same size and goes to the same table, so the database work
    matches consumer-kit's ``ctx.publish``)."""

    insert_invoice: sql.Composed
    add_to_customer: sql.Composed
    insert_event: sql.Composed

    @classmethod
    def for_schema(cls, schema: str) -> EffectSQL:
        return cls(
            insert_invoice=sql.SQL(
                "INSERT INTO {} (order_id, revision, customer_id, amount_cents, currency) "
                "VALUES (%s, %s, %s, %s, %s) RETURNING invoice_id"
            ).format(sql.Identifier(schema, "invoices")),
            add_to_customer=sql.SQL(
                "INSERT INTO {t} AS c (customer_id, invoiced_cents) VALUES (%s, %s) "
                "ON CONFLICT (customer_id) DO UPDATE "
                "SET invoiced_cents = c.invoiced_cents + EXCLUDED.invoiced_cents"
            ).format(t=sql.Identifier(schema, "customers")),
            insert_event=sql.SQL(
                "INSERT INTO {} (event_id, destination, routing_key, message_type, partition_key, "
                "payload, headers) VALUES (%s, 'billing.events', 'invoice.created', "
                "'InvoiceCreated', %s, %s, '{{}}'::jsonb)"
            ).format(sql.Identifier(schema, "outbox")),
        )


def event_payload(invoice_id: int, msg: dict[str, Any]) -> str:
    return json.dumps(
        {
            "invoice_id": invoice_id,
            "order_id": msg["order_id"],
            "revision": msg["revision"],
            "customer_id": msg["customer_id"],
            "amount_cents": msg["amount_cents"],
        }
    )


def message_body(order_id: int) -> bytes:
    """A ~150-byte CreateInvoice command (the invoices example's message)."""
    return json.dumps(
        {
            "order_id": order_id,
            "revision": 1,
            "customer_id": f"c{order_id % CUSTOMERS}",
            "amount_cents": 1000 + order_id % 97,
            "currency": "EUR",
            "requested_at": dt.datetime.now(dt.UTC).isoformat(),
        },
        separators=(",", ":"),
    ).encode()


def create_schema(db_url: str, schema: str) -> None:
    """consumer-kit's ledger + outbox (its own migration) and the app tables in ``schema``."""
    import asyncio

    from consumer_kit.ledger import migrate

    async def _go() -> None:
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
            await migrate(conn, schema)

    asyncio.run(_go())
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(sql.SQL("SET search_path = {}").format(sql.Identifier(schema)))
        conn.execute(APP_TABLES_SQL)


def drop_schema(db_url: str, schema: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def effect_counts(db_url: str, schema: str) -> dict[str, int]:
    """How many operations were applied once, more than once, and how many invoice rows exist."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute(
            sql.SQL(
                "SELECT count(*) FILTER (WHERE n = 1), count(*) FILTER (WHERE n > 1), "
                "coalesce(sum(n), 0) FROM (SELECT order_id, count(*) AS n FROM {} GROUP BY order_id) s"
            ).format(sql.Identifier(schema, "invoices"))
        ).fetchone()
    assert row is not None
    return {"once": int(row[0]), "more_than_once": int(row[1]), "rows": int(row[2])}


# -- RabbitMQ queues --------------------------------------------------------------------------


def work_queue_arguments(queue: str) -> dict[str, Any]:
    """The arguments consumer-kit's RabbitMQ adapter declares on a quorum work queue; every
    variant consumes from a queue declared this way, so the broker does the same work for all."""
    return {
        "x-queue-type": "quorum",
        "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": f"{queue}.dlq",
        "x-delivery-limit": MAX_DELIVERIES + max(5, MAX_DELIVERIES),
        "x-dead-letter-strategy": "at-least-once",
        "x-overflow": "reject-publish",
    }


async def declare_and_fill(queue: str, bodies: Iterable[bytes], *, window: int = 256) -> int:
    """Declare ``queue`` (quorum, as consumer-kit would) and its DLQ, then publish ``bodies``
    persistently with publisher confirms, ``window`` unconfirmed at a time. Returns the count.

    The broker is shared with other test runs, which may force-close connections: on a failure
    the queue is deleted and filled again from scratch (3 attempts)."""
    items = list(bodies)
    for attempt in range(3):
        try:
            return await _fill_once(queue, items, window)
        except Exception as exc:  # noqa: BLE001
            logger.warning("filling %s failed (%s); attempt %s of 3", queue, type(exc).__name__, attempt + 1)
            await delete_queues(queue)
    raise RuntimeError(f"could not fill queue {queue}")


async def _fill_once(queue: str, items: list[bytes], window: int) -> int:
    import asyncio

    import aio_pika

    connection = await aio_pika.connect(AMQP_URL)
    try:
        channel = await connection.channel(publisher_confirms=True)
        await channel.declare_queue(f"{queue}.dlq", durable=True, arguments={"x-queue-type": "quorum"})
        await channel.declare_queue(queue, durable=True, arguments=work_queue_arguments(queue))
        pending: set[asyncio.Future[Any]] = set()
        count = 0
        for body in items:
            msg = aio_pika.Message(
                body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT, message_id=str(uuid.uuid4()),
                content_type="application/json",
            )
            pending.add(asyncio.ensure_future(channel.default_exchange.publish(msg, routing_key=queue)))
            count += 1
            if len(pending) >= window:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    if fut.exception() is not None:
                        for other in pending:
                            other.cancel()
                        await asyncio.gather(*pending, return_exceptions=True)
                        raise fut.exception()  # type: ignore[misc]
        if pending:
            await asyncio.gather(*pending)
        return count
    finally:
        await connection.close()


async def queue_depth(queue: str) -> int:
    """Ready messages on ``queue`` (passive declare)."""
    import aio_pika

    connection = await aio_pika.connect(AMQP_URL)
    try:
        channel = await connection.channel()
        q = await channel.declare_queue(queue, passive=True)
        return int(q.declaration_result.message_count or 0)
    finally:
        await connection.close()


async def delete_queues(queue: str) -> None:
    """Delete ``queue``, its DLQ and consumer-kit's retry tiers (whatever exists)."""
    import aio_pika

    names = [queue, f"{queue}.dlq"] + [f"{queue}.retry.{ms}ms" for ms in (1000, 2000, 5000, 30000)]
    connection = await aio_pika.connect(AMQP_URL)
    try:
        for name in names:
            channel = await connection.channel()
            try:
                await channel.queue_delete(name)
            except Exception:  # noqa: BLE001 - absent queue closes the channel; fine
                pass
            finally:
                if not channel.is_closed:
                    await channel.close()
    finally:
        await connection.close()


def delete_redis_keys(prefix: str) -> int:
    """Delete the Powertools idempotency records written under ``key_prefix=prefix``."""
    import redis

    client = redis.Redis(host=REDIS_HOST, port=REDIS_PORT)
    try:
        keys = list(client.scan_iter(match=f"{prefix}#*", count=1000))
        for i in range(0, len(keys), 1000):
            client.delete(*keys[i : i + 1000])
        return len(keys)
    finally:
        client.close()


# -- statistics -------------------------------------------------------------------------------


def summarize(values: Sequence[float]) -> dict[str, Any]:
    """Median and spread of repeated rounds: ``spread`` = (max - min) / median."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None, "spread": None, "rounds": 0, "values": []}
    med = statistics.median(vals)
    return {
        "median": med,
        "min": min(vals),
        "max": max(vals),
        "spread": (max(vals) - min(vals)) / med if med else None,
        "rounds": len(vals),
        "values": vals,
    }


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or not b:
        return None
    return a / b


def paired_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> dict[str, Any]:
    """Per-round ratios (round i of both series ran back to back), summarised."""
    return summarize([n / d for n, d in zip(numerators, denominators, strict=False) if d])


def pgbench(db_url: str, schema: str, script: Path, clients: int, seconds: int,
            options: str | None = None) -> float | None:
    """tps of ``script`` run by pgbench with ``clients`` clients for ``seconds`` s (prepared
    statements, ``search_path`` = ``schema`` plus session ``options``); ``None`` if it failed."""
    env = dict(os.environ, PGOPTIONS=f"-c search_path={schema}" + (f" {options}" if options else ""))
    cmd = ["pgbench", "-n", "-f", str(script), "-c", str(clients), "-j", str(min(clients, 2)),
           "-T", str(seconds), "-M", "prepared", db_url]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=seconds + 60)
    for line in proc.stdout.splitlines():
        if line.startswith("tps ="):
            return float(line.split()[2])
    logger.warning("pgbench failed: %s", proc.stderr[-1000:])
    return None


def format_number(value: Any, digits: int = 0) -> str:
    """``value`` with thousands separators and ``digits`` decimals; ``n/a`` for None."""
    if value is None:
        return "n/a"
    if isinstance(value, (int, float)):
        return f"{value:,.{digits}f}"
    return str(value)


def format_summary(summary: dict[str, Any] | None, digits: int = 0) -> str:
    """'median (min-max, spread %)' of a summary."""
    if not summary or summary.get("median") is None:
        return "n/a"
    spread = summary.get("spread")
    sp = f", ±{spread * 50:.0f}%" if spread is not None and summary.get("rounds", 0) > 1 else ""
    return f"{format_number(summary['median'], digits)} ({format_number(summary['min'], digits)}–{format_number(summary['max'], digits)}{sp})"  # noqa: RUF001 - an en dash in a range
