"""Helpers shared by the relay tests (no tests here): outbox writes, a RabbitMQ recorder, relay
processes and bounded waits ("broker down" is ``tests.tcp_proxy.TcpProxy``)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from consumer_kit.outbox_relay.settings import RelaySettings

ROOT = Path(__file__).resolve().parents[1]

INSERT = """
    INSERT INTO {table} (event_id, destination, routing_key, message_type, partition_key, payload,
                         headers, operation_scope, operation_key, correlation_id)
    VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)
"""


@dataclass(frozen=True)
class Event:
    destination: str
    routing_key: str = "thing.happened"
    partition_key: str | None = None
    payload: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    event_id: uuid.UUID = field(default_factory=uuid.uuid4)


async def write_events(
    conn: psycopg.AsyncConnection[Any], schema: str, events: Iterable[Event]
) -> list[uuid.UUID]:
    """Insert ``events`` in one transaction on ``conn`` (autocommit connection); returns ids."""
    query = sql.SQL(INSERT).format(table=sql.Identifier(schema, "outbox"))
    events = list(events)
    async with conn.transaction():
        async with conn.cursor() as cur:
            await cur.executemany(
                query,
                [
                    (e.event_id, e.destination, e.routing_key, "ThingHappened", e.partition_key,
                     Jsonb(e.payload), Jsonb(e.headers), "tenant/thing.do/v1",
                     f"op-{e.event_id.hex[:8]}", "corr-1")
                    for e in events
                ],
            )
    return [e.event_id for e in events]


async def connect(database_url: str) -> psycopg.AsyncConnection[Any]:
    return await psycopg.AsyncConnection.connect(database_url, autocommit=True)


async def rows(database_url: str, query: str, *params: Any) -> list[tuple[Any, ...]]:
    async with await connect(database_url) as conn:
        cur = await conn.execute(query, params)
        return await cur.fetchall()


async def wait_until(
    predicate: Callable[[], Awaitable[bool]], timeout: float, what: str, every: float = 0.05
) -> float:
    """Poll ``predicate`` until true; returns seconds waited. Raises ``AssertionError`` after
    ``timeout`` seconds (a bounded wait on a condition, not a sleep used as synchronisation)."""
    start = time.monotonic()
    while not await predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(every)
    return time.monotonic() - start


def relay_settings(database_url: str, schema: str, broker_url: str, **overrides: Any) -> RelaySettings:
    base: dict[str, Any] = {
        "database_url": database_url,
        "db_schema": schema,
        "broker_url": broker_url,
        "relay_poll_interval": 0.5,
        # A batch publishes for 80 % of the claim lease: 8 s, which a loaded machine does not
        # outrun (with 3 s, 2.4 s for a connection and a batch's confirms it could: rows failed,
        # counted and republished). Tests about a lease running out set their own.
        "relay_claim_timeout": 10.0,
        "relay_backoff_base": 0.1,
        "relay_backoff_max": 0.5,
        "settle_timeout": 2.0,
    }
    base.update(overrides)
    return RelaySettings(**base)


# -- RabbitMQ ----------------------------------------------------------------------------------


@dataclass
class Received:
    message_id: str
    headers: dict[str, Any]
    body: dict[str, Any]
    at: float  # time.monotonic() at receipt


class Recorder:
    """Consumes everything published to ``exchange`` (a topic exchange, all routing keys) and
    keeps the broker-side record: message id, headers, body, receipt time, in arrival order."""

    def __init__(self, url: str, exchange: str, routing_key: str = "#") -> None:
        self.url = url
        self.exchange = exchange
        self.routing_key = routing_key
        self.received: list[Received] = []
        self._changed = asyncio.Event()
        self._connection: Any = None

    async def __aenter__(self) -> Recorder:
        import aio_pika

        self._connection = await aio_pika.connect(self.url)
        channel = await self._connection.channel()
        await channel.set_qos(prefetch_count=1000)
        exchange = await channel.declare_exchange(
            self.exchange, aio_pika.ExchangeType.TOPIC, durable=True
        )
        queue = await channel.declare_queue(exclusive=True, auto_delete=True)
        await queue.bind(exchange, self.routing_key)
        await queue.consume(self._on_message, no_ack=True)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._connection.close()

    async def _on_message(self, message: Any) -> None:
        self.received.append(
            Received(message.message_id, dict(message.headers), json.loads(message.body),
                     time.monotonic())
        )
        self._changed.set()

    def ids(self) -> set[str]:
        return {r.message_id for r in self.received}

    async def wait_for(self, expected: Iterable[uuid.UUID | str], timeout: float) -> None:
        wanted = {str(e) for e in expected}
        deadline = time.monotonic() + timeout
        while not wanted <= self.ids():
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"{len(wanted - self.ids())} of {len(wanted)} events not received in {timeout} s"
                )
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), min(left, 1.0))
            except TimeoutError:
                pass

    async def wait_count(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.received) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"received {len(self.received)} of {n} in {timeout} s")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), min(left, 1.0))
            except TimeoutError:
                pass


# -- relay processes ---------------------------------------------------------------------------


async def start_relay_process(
    database_url: str,
    schema: str,
    broker_url: str,
    *args: str,
    env: dict[str, str] | None = None,
    log: Path | None = None,
) -> asyncio.subprocess.Process:
    """``python -m consumer_kit.outbox_relay.cli --schema <schema> <args>`` with the test's URLs."""
    environment = {
        **os.environ,
        "CONSUMER_KIT_DATABASE_URL": database_url,
        "CONSUMER_KIT_BROKER_URL": broker_url,
        "CONSUMER_KIT_SETTLE_TIMEOUT": "2",
        "PYTHONPATH": str(ROOT),
        **(env or {}),
    }
    stderr = open(log, "ab") if log else asyncio.subprocess.DEVNULL
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "consumer_kit.outbox_relay.cli", "--schema", schema, *args,
        env=environment, cwd=str(ROOT), stdout=asyncio.subprocess.DEVNULL, stderr=stderr,
    )


async def stop_process(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.kill()
    await proc.wait()


@asynccontextmanager
async def running(coro: Awaitable[Any]):  # type: ignore[no-untyped-def]
    """Run ``coro`` as a task for the block; cancel it afterwards, re-raising its failure."""
    task = asyncio.ensure_future(coro)
    try:
        yield task
    finally:
        if not task.done():
            task.cancel()
        results = await asyncio.gather(task, return_exceptions=True)
        if isinstance(results[0], Exception):
            raise results[0]
