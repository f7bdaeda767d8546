"""Relay benchmark: events/s and commit-to-publish latency of ``outbox-relay`` on the local
PostgreSQL and RabbitMQ, next to the raw aio-pika publish-with-confirms rate of the same run.

Run: ``python -m benchmarks.relay_bench [--events 10000] [--steady-rate 1000] [--steady-seconds 5]``
(``CONSUMER_KIT_TEST_DATABASE_URL`` / ``CONSUMER_KIT_TEST_BROKER_URL`` override the local URLs).
Writes ``benchmarks/results/relay_bench.json`` and ``.md``.

Scenarios: 1 and 3 relay processes, each with per-key ordering on (events over 100 partition
keys, ``--ordered``) and off (``--unordered``). For each:

* **drain**: ``--events`` rows are committed first, then the relays start; events/s = events /
  (last arrival - first arrival) at a consumer bound to the exchange;
* **steady**: the relays are running; writers commit ``--steady-rate`` events/s (transactions of
  10 rows) for ``--steady-seconds``; latency = consumer arrival time - the writer's COMMIT return
  time (same host clock), reported as p50/p99 in milliseconds.

Raw: one aio-pika channel with publisher confirms, 256 unconfirmed in flight, ~100-byte persistent
messages, ``--events`` of them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import aio_pika
import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from consumer_kit.ledger import migrate

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DATABASE_URL = os.environ.get("CONSUMER_KIT_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test")
BROKER_URL = os.environ.get("CONSUMER_KIT_TEST_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672/")
KEYS = 100


class Arrivals:
    """A consumer on ``exchange`` recording arrival time (time.time()) per message id."""

    def __init__(self, exchange: str) -> None:
        self.exchange = exchange
        self.at: dict[str, float] = {}
        self._changed = asyncio.Event()

    async def __aenter__(self) -> Arrivals:
        self._conn = await aio_pika.connect(BROKER_URL)
        channel = await self._conn.channel()
        await channel.set_qos(prefetch_count=2000)
        exchange = await channel.declare_exchange(self.exchange, aio_pika.ExchangeType.TOPIC,
                                                  durable=True)
        self._exchange = exchange
        queue = await channel.declare_queue(exclusive=True, auto_delete=True)
        await queue.bind(exchange, "#")
        await queue.consume(self._on_message, no_ack=True)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._exchange.delete()
        await self._conn.close()

    async def _on_message(self, message: Any) -> None:
        self.at.setdefault(message.message_id, time.time())
        self._changed.set()

    async def wait_all(self, ids: set[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ids <= self.at.keys():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(ids - self.at.keys())} events missing after {timeout} s")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), 1.0)
            except TimeoutError:
                pass


async def raw_publish_rate(n: int) -> float:
    """Messages/s publishing ``n`` persistent messages with confirms, 256 in flight."""
    conn = await aio_pika.connect(BROKER_URL)
    try:
        channel = await conn.channel(publisher_confirms=True)
        queue = await channel.declare_queue(exclusive=True, auto_delete=True)
        body = json.dumps({"invoice_id": 1, "order_id": 2, "customer_id": "c-1",
                           "amount_cents": 1250, "pad": "x" * 30}).encode()
        slots = asyncio.Semaphore(256)

        async def one(i: int) -> None:
            async with slots:
                await channel.default_exchange.publish(
                    aio_pika.Message(body, message_id=str(i),
                                     delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                    routing_key=queue.name)

        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        return n / (time.perf_counter() - start)
    finally:
        await conn.close()


async def write(conn: psycopg.AsyncConnection[Any], schema: str, destination: str, n: int,
                keyed: bool) -> tuple[list[str], float]:
    """Commit ``n`` events in one transaction; returns (event ids, time.time() after COMMIT)."""
    query = sql.SQL(
        "INSERT INTO {} (event_id, destination, routing_key, message_type, partition_key, payload) "
        "VALUES (%s, %s, 'bench.event', 'BenchEvent', %s, %s)"
    ).format(sql.Identifier(schema, "outbox"))
    ids = [uuid.uuid4() for _ in range(n)]
    async with conn.transaction():
        async with conn.cursor() as cur:
            await cur.executemany(query, [
                (i, destination, f"k{i.int % KEYS}" if keyed else None, Jsonb({"n": j}))
                for j, i in enumerate(ids)])
    return [str(i) for i in ids], time.time()


async def start_relays(schema: str, count: int, ordered: bool) -> list[asyncio.subprocess.Process]:
    env = {**os.environ, "CONSUMER_KIT_DATABASE_URL": DATABASE_URL,
           "CONSUMER_KIT_BROKER_URL": BROKER_URL, "PYTHONPATH": str(ROOT)}
    return [
        await asyncio.create_subprocess_exec(
            sys.executable, "-m", "consumer_kit.outbox_relay.cli", "--schema", schema,
            "--ordered" if ordered else "--unordered", "--batch-size", "500",
            "--poll-interval", "1", "--log-level", "WARNING", "--relay-id", f"bench-{i}",
            env=env, cwd=str(ROOT), stdout=asyncio.subprocess.DEVNULL,
        )
        for i in range(count)
    ]


async def stop_relays(procs: list[asyncio.subprocess.Process]) -> None:
    for proc in procs:
        if proc.returncode is None:
            proc.terminate()
    for proc in procs:
        await asyncio.wait_for(proc.wait(), 30)


async def scenario(relays: int, ordered: bool, events: int, rate: int, seconds: float) -> dict[str, Any]:
    schema = "bench_" + uuid.uuid4().hex[:8]
    destination = schema + ".events"
    async with await psycopg.AsyncConnection.connect(DATABASE_URL, autocommit=True) as conn:
        await migrate(conn, schema)
        try:
            async with Arrivals(destination) as arrivals:
                # drain: a backlog committed before the relays start
                ids: list[str] = []
                for _ in range(events // 500):
                    ids += (await write(conn, schema, destination, 500, keyed=True))[0]
                procs = await start_relays(schema, relays, ordered)
                try:
                    await arrivals.wait_all(set(ids), 300)
                    times = [arrivals.at[i] for i in ids]
                    drain_rate = len(ids) / (max(times) - min(times))

                    # steady: the relays run, writers commit at a fixed rate
                    committed: dict[str, float] = {}
                    per_tx, interval = 10, 10 / rate
                    start = time.monotonic()
                    for k in range(int(rate * seconds / per_tx)):
                        delay = start + k * interval - time.monotonic()
                        if delay > 0:
                            await asyncio.sleep(delay)  # pacing the writer, not synchronising
                        batch, at = await write(conn, schema, destination, per_tx, keyed=True)
                        committed.update(dict.fromkeys(batch, at))
                    await arrivals.wait_all(set(committed), 120)
                    latencies = sorted((arrivals.at[i] - at) * 1000 for i, at in committed.items())
                finally:
                    await stop_relays(procs)
        finally:
            await conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
    q = statistics.quantiles(latencies, n=100)
    return {
        "relays": relays, "ordered": ordered, "drain_events": len(ids),
        "drain_events_per_s": round(drain_rate), "steady_rate": rate,
        "steady_events": len(latencies), "latency_p50_ms": round(q[49], 1),
        "latency_p99_ms": round(q[98], 1),
    }


async def main(events: int, rate: int, seconds: float) -> dict[str, Any]:
    raw = await raw_publish_rate(events)
    print(f"raw aio-pika publish with confirms (256 in flight): {raw:.0f} msg/s", flush=True)
    runs = []
    for relays in (1, 3):
        for ordered in (True, False):
            result = await scenario(relays, ordered, events, rate, seconds)
            print(json.dumps(result), flush=True)
            runs.append(result)
    return {"raw_aio_pika_confirms_per_s": round(raw), "events": events, "keys": KEYS,
            "cpu_count": os.cpu_count(), "runs": runs}


def write_results(results: dict[str, Any]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "relay_bench.json").write_text(json.dumps(results, indent=2))
    lines = [
        "# outbox-relay benchmark", "",
        f"Raw aio-pika publish with confirms (256 in flight), same run: "
        f"**{results['raw_aio_pika_confirms_per_s']} msg/s**.", "",
        f"Drain: {results['events']} committed events over {results['keys']} partition keys. "
        "Steady: latency from the writer's COMMIT to arrival at a consumer.", "",
        "| relays | per-key ordering | drain events/s | steady rate (ev/s) | p50 ms | p99 ms |",
        "|---|---|---|---|---|---|",
    ]
    for r in results["runs"]:
        lines.append(f"| {r['relays']} | {'on' if r['ordered'] else 'off'} | "
                     f"{r['drain_events_per_s']} | {r['steady_rate']} | {r['latency_p50_ms']} | "
                     f"{r['latency_p99_ms']} |")
    (RESULTS / "relay_bench.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=10_000)
    parser.add_argument("--steady-rate", type=int, default=1000)
    parser.add_argument("--steady-seconds", type=float, default=5.0)
    args = parser.parse_args()
    results = asyncio.run(main(args.events, args.steady_rate, args.steady_seconds))
    write_results(results)
    print(f"written to {RESULTS / 'relay_bench.md'}")
