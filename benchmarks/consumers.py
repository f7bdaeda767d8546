"""The three consumers being compared, each run as its own process:

``python -m benchmarks.consumers VARIANT --queue Q --schema S --concurrency C --expect N``

* ``naive``: aio-pika + psycopg. Writes the effect in one transaction, then acks. No ledger, no
  outbox machinery (the event row is inserted directly). The limit for this design.
* ``ck``: consumer-kit's :class:`~consumer_kit.worker.process.Worker` with the RabbitMQ adapter.
* ``naive_batch``: aio-pika + psycopg taking up to ``--batch`` messages at once: ``concurrency``
  channels, each with prefetch ``--batch``, each batch's effect as one ``unnest`` statement per
  table in one transaction, then one multiple ack of the channel's batch.
* ``ck_batch``: consumer-kit's worker on the batch path: the invoices example's
  ``BatchCreateInvoiceHandler`` (``examples/invoices/batches.py``) with ``batch_size = --batch``.
* ``powertools``: aio-pika + AWS Lambda Powertools ``idempotent_function`` with its Redis
  persistence layer; the decorated function is synchronous (Powertools has no async variant), so
  it runs in a thread pool of ``C`` threads with a psycopg ``ConnectionPool``.

With ``--expect N`` the process exits after N deliveries were finished and prints one JSON line:
``{"processed", "seconds", "rate", "peak_rss_mb"}`` where ``seconds`` runs from the first finished
delivery to the N-th (start-up and connection set-up excluded, the same for every variant).
With ``--expect 0`` it consumes until SIGTERM (the crash scenario kills it with SIGKILL).

Options for the scale-out scenarios (``benchmarks.scaleout_bench``): ``--wait-go`` prints
``ready`` once imported and starts only on SIGUSR1, so several processes start together;
``--loop uvloop`` runs the process on uvloop's event loop; ``--no-outbox-notify`` opens the
sessions with ``-c consumer_kit.outbox_notify=off`` (CONSUMER_KIT_OUTBOX_NOTIFY=false). The JSON
line then also carries wall-clock ``first_at``/``last_at`` and ``timeline`` (finished deliveries
per 0.1 s of wall clock), so rates across processes can be combined.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import resource
import signal
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from psycopg import sql

from benchmarks.common import (
    AMQP_URL,
    MAX_DELIVERIES,
    REDIS_HOST,
    REDIS_PORT,
    EffectSQL,
    bench_db_url,
    event_payload,
)

logger = logging.getLogger("benchmarks.consumers")


class _Progress:
    """Counts finished deliveries; resolves ``done`` at the expected count.

    The per-delivery tick is a count and a monotonic clock read, the same in every variant: the
    process CPU clock is read only at the first finished delivery and at the last (a system call,
    several per cent of a delivery's CPU if read every time); the timeline (finished deliveries
    per 0.1 s of wall clock, for the scale-out runs) comes from :meth:`sample`, a task that reads
    the count ten times a second, off the delivery path.
    """

    def __init__(self, expect: int) -> None:
        self.expect = expect
        self.wall_offset = time.time() - time.perf_counter()
        self.timeline: dict[int, int] = {}
        self.first_cpu = self.last_cpu = 0.0  # process CPU seconds at the first and last delivery
        self.count = 0
        self.first_count = 0  # deliveries finished when the first was seen (1 when ticked inline)
        self.first: float | None = None
        self.last: float | None = None
        self.done = asyncio.Event()

    def tick(self, n: int = 1) -> None:
        self.count += n
        self.last = time.perf_counter()
        if self.first is None:
            self.first, self.first_count, self.first_cpu = self.last, self.count, time.process_time()
        if self.count >= self.expect > 0:
            self.last_cpu = time.process_time()
            self.done.set()

    async def sample(self, total: Any = None) -> None:
        """Every 0.1 s: the timeline slot and the CPU clock of the last delivery (the run ends at
        SIGTERM when nothing is expected); with ``total`` (a callable: the deliveries finished so
        far, e.g. a consumer-kit runtime's counters) the count is read from it every 5 ms instead
        of ticked by the variant, so that the measured process does no per-delivery work of the
        harness's at all."""
        seen, slot_at = 0, 0.0
        while True:
            await asyncio.sleep(0.005 if total is not None else 0.1)
            if total is not None:
                finished = total()
                if finished > self.count:
                    self.tick(finished - self.count)
            now = time.perf_counter()
            if now - slot_at < 0.1 and total is not None:
                continue
            slot_at = now
            if self.count > seen:
                slot = int((now + self.wall_offset) * 10)
                self.timeline[slot] = self.timeline.get(slot, 0) + self.count - seen
                seen = self.count
                if not self.done.is_set():
                    self.last_cpu = time.process_time()

    def result(self) -> dict[str, Any]:
        seconds = (self.last or 0.0) - (self.first or 0.0)
        # deliveries finished after the first one seen, over the time since it was seen
        after_first = self.count - self.first_count
        rate = after_first / seconds if seconds > 0 and after_first > 0 else None
        peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        cpu = self.last_cpu - self.first_cpu
        return {
            "processed": self.count,
            "seconds": seconds,
            "rate": rate,
            "peak_rss_mb": peak_kb / 1024.0,
            "first_at": None if self.first is None else self.first + self.wall_offset,
            "last_at": None if self.last is None else self.last + self.wall_offset,
            "timeline": self.timeline,
            # CPU of the whole process (all threads) from the first finished delivery to the last
            "cpu_seconds": cpu,
            "cpu_us_per_delivery": cpu / after_first * 1e6 if after_first > 0 else None,
        }


# -- naive ------------------------------------------------------------------------------------


async def run_naive(args: argparse.Namespace, progress: _Progress, stop: asyncio.Event) -> None:
    import aio_pika
    from psycopg.types.json import Jsonb  # noqa: F401  (parity with the others' imports)
    from psycopg_pool import AsyncConnectionPool

    effect = EffectSQL.for_schema(args.schema)
    kwargs: dict[str, Any] = {"autocommit": True}
    if not args.outbox_notify:  # what consumer-kit's pool sets for CONSUMER_KIT_OUTBOX_NOTIFY=false
        kwargs["options"] = "-c consumer_kit.outbox_notify=off"
    pool = AsyncConnectionPool(
        bench_db_url(), min_size=args.concurrency, max_size=args.concurrency, kwargs=kwargs, open=False,
    )
    await pool.open(wait=True)
    connection = await aio_pika.connect_robust(AMQP_URL)  # reconnects and re-consumes
    channel = await connection.channel()
    await channel.set_qos(prefetch_count=args.concurrency)
    queue = await channel.declare_queue(args.queue, passive=True)

    async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        msg = json.loads(message.body)
        async with pool.connection() as conn:
            async with conn.transaction():
                cur = await conn.execute(
                    effect.insert_invoice,
                    (msg["order_id"], msg["revision"], msg["customer_id"], msg["amount_cents"], msg["currency"]),
                )
                row = await cur.fetchone()
                assert row is not None
                await conn.execute(effect.add_to_customer, (msg["customer_id"], msg["amount_cents"]))
                await conn.execute(
                    effect.insert_event, (uuid.uuid4(), msg["customer_id"], event_payload(row[0], msg))
                )
        await message.ack()
        progress.tick()

    await queue.consume(on_message)
    try:
        await wait_for(progress, stop)
    finally:
        await connection.close()
        await pool.close()


@dataclass(frozen=True)
class NaiveBatchSQL:
    """The naive batch consumers' effect: one ``unnest`` statement per table for a whole batch, in
    one transaction (the statements of ``examples/invoices/batches.py``, events inserted directly)."""

    insert_invoices: sql.Composed
    add_to_customers: sql.Composed
    insert_events: sql.Composed

    @classmethod
    def for_schema(cls, schema: str) -> NaiveBatchSQL:
        return cls(
            insert_invoices=sql.SQL(
                "INSERT INTO {} (order_id, revision, customer_id, amount_cents, currency) "
                "SELECT * FROM unnest(%s::bigint[], %s::int[], %s::text[], %s::bigint[], %s::text[]) "
                "RETURNING invoice_id, order_id, revision"
            ).format(sql.Identifier(schema, "invoices")),
            add_to_customers=sql.SQL(
                "INSERT INTO {} AS c (customer_id, invoiced_cents) "
                "SELECT customer_id, sum(amount) FROM unnest(%s::text[], %s::bigint[]) AS t(customer_id, amount) "
                "GROUP BY customer_id ORDER BY customer_id "
                "ON CONFLICT (customer_id) DO UPDATE SET invoiced_cents = c.invoiced_cents + EXCLUDED.invoiced_cents"
            ).format(sql.Identifier(schema, "customers")),
            insert_events=sql.SQL(
                "INSERT INTO {} (event_id, destination, routing_key, message_type, partition_key, payload, headers) "
                "SELECT e, 'billing.events', 'invoice.created', 'InvoiceCreated', p, b::jsonb, '{{}}'::jsonb "
                "FROM unnest(%s::uuid[], %s::text[], %s::text[]) AS t(e, p, b)"
            ).format(sql.Identifier(schema, "outbox")),
        )

    async def apply(self, conn: Any, msgs: list[dict[str, Any]]) -> None:
        """The effect of ``msgs`` (decoded bodies) in one transaction on ``conn``."""
        async with conn.transaction():
            cur = await conn.execute(self.insert_invoices, (
                [m["order_id"] for m in msgs], [m["revision"] for m in msgs], [m["customer_id"] for m in msgs],
                [m["amount_cents"] for m in msgs], [m["currency"] for m in msgs],
            ))
            ids = {(o, r): i for i, o, r in await cur.fetchall()}
            await conn.execute(self.add_to_customers, (
                [m["customer_id"] for m in msgs], [m["amount_cents"] for m in msgs],
            ))
            await conn.execute(self.insert_events, (
                [uuid.uuid4() for _ in msgs], [m["customer_id"] for m in msgs],
                [event_payload(ids[m["order_id"], m["revision"]], m) for m in msgs],
            ))


async def run_naive_batch(args: argparse.Namespace, progress: _Progress, stop: asyncio.Event) -> None:
    import aio_pika
    from psycopg_pool import AsyncConnectionPool

    statements = NaiveBatchSQL.for_schema(args.schema)
    kwargs: dict[str, Any] = {"autocommit": True}
    if not args.outbox_notify:
        kwargs["options"] = "-c consumer_kit.outbox_notify=off"
    pool = AsyncConnectionPool(
        bench_db_url(), min_size=args.concurrency, max_size=args.concurrency, kwargs=kwargs, open=False,
    )
    await pool.open(wait=True)
    connection = await aio_pika.connect_robust(AMQP_URL)

    async def apply(batch: list[aio_pika.abc.AbstractIncomingMessage]) -> None:
        async with pool.connection() as conn:
            await statements.apply(conn, [json.loads(m.body) for m in batch])
        await batch[-1].ack(multiple=True)  # the channel's whole batch, one frame
        progress.tick(len(batch))

    async def one_channel() -> None:
        # One channel per task: a multiple ack then covers this task's batch and nothing else.
        # Prefetch two batches: the next one arrives while this one is applied.
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=2 * args.batch)
        queue = await channel.declare_queue(args.queue, passive=True)
        held: list[aio_pika.abc.AbstractIncomingMessage] = []
        ready, full = asyncio.Event(), asyncio.Event()

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            held.append(message)
            ready.set()
            if len(held) >= args.batch:
                full.set()

        await queue.consume(on_message)
        loop = asyncio.get_running_loop()
        while True:
            await ready.wait()
            first_at = loop.time()
            if len(held) < args.batch:
                # the rest of what arrives together: until the batch is full, at most batch_wait
                # after its first message (consumer-kit's Batcher does the same)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(full.wait(), first_at + args.batch_wait - loop.time())
            batch, held[:] = held[: args.batch], held[args.batch:]
            if len(held) < args.batch:
                full.clear()
            if not held:
                ready.clear()
            await apply(batch)

    tasks = [asyncio.create_task(one_channel()) for _ in range(args.concurrency)]
    try:
        await wait_for(progress, stop)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await connection.close()
        await pool.close()


# -- consumer-kit -----------------------------------------------------------------------------


def ck_settings(args: argparse.Namespace, broker_url: str = AMQP_URL) -> Any:
    from consumer_kit import Settings

    return Settings(
        database_url=bench_db_url(),
        broker_url=broker_url,
        db_schema=args.schema,
        search_path=args.schema,
        concurrency=args.concurrency,
        max_deliveries=MAX_DELIVERIES,
        in_progress_delay=1.0,
        retry_delays=[1.0, 5.0, 30.0],
        outbox_notify=getattr(args, "outbox_notify", True),
    )


async def run_ck(
    args: argparse.Namespace, progress: _Progress, stop: asyncio.Event, handler: Any = None,
    broker_url: str = AMQP_URL,
) -> None:
    """The invoices example's own handler (``examples/invoices/app.py``); its unqualified table
    names resolve to the benchmark schema through ``search_path``."""
    from consumer_kit import App
    from consumer_kit.demo.app import CreateInvoiceHandler
    from consumer_kit.worker.process import Worker

    app = App("bench-invoices")
    app.subscribe(args.queue, handler or CreateInvoiceHandler())
    settings = ck_settings(args, broker_url)
    # No observer: the runtime builds what it builds for a production worker, and the harness
    # reads its outcome counters off the delivery path (_Progress.sample).
    worker = Worker(app, settings)
    task = asyncio.create_task(worker.run())
    await worker.started.wait()
    assert worker.runtime is not None
    counters = worker.runtime.counters
    sampler = asyncio.create_task(progress.sample(lambda: sum(counters.by_outcome.values())))
    try:
        await wait_for(progress, stop, also=task)
    finally:
        sampler.cancel()
        worker.stop()
        try:
            await asyncio.wait_for(task, 30)
        except Exception as exc:  # noqa: BLE001
            logger.warning("worker stop: %s", type(exc).__name__)
    if not progress.done.is_set() and task.done() and task.exception() is not None:
        raise task.exception()  # type: ignore[misc]
    print(json.dumps({"counters": counters.snapshot()}), file=sys.stderr)


async def run_ck_batch(
    args: argparse.Namespace, progress: _Progress, stop: asyncio.Event, broker_url: str = AMQP_URL
) -> None:
    """The batch path: ``BatchCreateInvoiceHandler`` with ``batch_size = --batch``; one report per
    delivery, as on the per-message path."""
    from consumer_kit.demo.batches import BatchCreateInvoiceHandler

    handler_class = type(
        "BenchBatchHandler", (BatchCreateInvoiceHandler,), {"batch_size": args.batch, "batch_wait": args.batch_wait}
    )
    await run_ck(args, progress, stop, handler=handler_class(), broker_url=broker_url)


# -- Powertools -------------------------------------------------------------------------------


async def run_powertools(args: argparse.Namespace, progress: _Progress, stop: asyncio.Event) -> None:
    import aio_pika
    from aws_lambda_powertools.utilities.idempotency import IdempotencyConfig, idempotent_function
    from aws_lambda_powertools.utilities.idempotency.exceptions import (
        IdempotencyAlreadyInProgressError,
    )
    from aws_lambda_powertools.utilities.idempotency.persistence.cache import CachePersistenceLayer
    from psycopg_pool import ConnectionPool

    effect = EffectSQL.for_schema(args.schema)
    pool = ConnectionPool(
        bench_db_url(), min_size=args.concurrency, max_size=args.concurrency,
        kwargs={"autocommit": True}, open=True,
    )
    pool.wait()
    # ssl defaults to True in Powertools (ElastiCache); the local Redis speaks plain TCP.
    persistence = CachePersistenceLayer(host=REDIS_HOST, port=REDIS_PORT, ssl=False)
    # The operation key is (order_id, revision): the same key consumer-kit uses.
    config = IdempotencyConfig(event_key_jmespath="[order_id, revision]", expires_after_seconds=3600)

    @idempotent_function(
        data_keyword_argument="message", persistence_store=persistence, config=config,
        key_prefix=args.schema,
    )
    def create_invoice(message: dict[str, Any]) -> dict[str, Any]:
        with pool.connection() as conn:
            with conn.transaction():
                row = conn.execute(
                    effect.insert_invoice,
                    (message["order_id"], message["revision"], message["customer_id"],
                     message["amount_cents"], message["currency"]),
                ).fetchone()
                assert row is not None
                conn.execute(effect.add_to_customer, (message["customer_id"], message["amount_cents"]))
                conn.execute(
                    effect.insert_event,
                    (uuid.uuid4(), message["customer_id"], event_payload(row[0], message)),
                )
        return {"status": "created", "reference": str(row[0])}

    executor = ThreadPoolExecutor(max_workers=args.concurrency, thread_name_prefix="powertools")
    loop = asyncio.get_running_loop()
    connection = await aio_pika.connect_robust(AMQP_URL)  # reconnects and re-consumes
    channel = await connection.channel()
    await channel.set_qos(prefetch_count=args.concurrency)
    queue = await channel.declare_queue(args.queue, passive=True)

    async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        payload = json.loads(message.body)
        try:
            await loop.run_in_executor(executor, lambda: create_invoice(message=payload))
        except IdempotencyAlreadyInProgressError:
            # Another delivery (or a dead process) holds the INPROGRESS record: try again later.
            await asyncio.sleep(0.5)
            await message.nack(requeue=True)
            return
        except Exception as exc:  # noqa: BLE001
            logger.warning("handler failed (%s); requeueing", type(exc).__name__)
            await message.nack(requeue=True)
            return
        await message.ack()
        progress.tick()

    await queue.consume(on_message)
    try:
        await wait_for(progress, stop)
    finally:
        await connection.close()
        executor.shutdown(wait=False, cancel_futures=True)
        pool.close()


# -- entry point ------------------------------------------------------------------------------


async def wait_for(progress: _Progress, stop: asyncio.Event, also: asyncio.Task[Any] | None = None) -> None:
    waiters = [asyncio.create_task(progress.done.wait()), asyncio.create_task(stop.wait())]
    if also is not None:
        waiters.append(also)  # type: ignore[arg-type]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for w in waiters[:2]:
        w.cancel()


def _nats(name: str) -> Any:
    async def run(args: argparse.Namespace, progress: _Progress, stop: asyncio.Event) -> None:
        from benchmarks import nats_consumers

        await getattr(nats_consumers, name)(args, progress, stop)

    return run


RUNNERS = {
    "naive": run_naive, "ck": run_ck, "powertools": run_powertools, "naive_batch": run_naive_batch,
    "ck_batch": run_ck_batch, "faststream_nats_batch": _nats("run_faststream_nats_batch"),
    "ck_nats_batch": _nats("run_ck_nats_batch"),
}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    progress = _Progress(args.expect)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    if not args.variant.startswith("ck"):  # the consumer-kit Worker installs its own SIGTERM handler
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    if args.wait_go:  # start together with the other processes of a scale-out run
        go = asyncio.Event()
        loop.add_signal_handler(signal.SIGUSR1, go.set)
        print("ready", flush=True)
        await go.wait()
    timeout = args.timeout
    # consumer-kit's runners read the runtime's counters (their own sampler); the others tick
    sampler = None if args.variant.startswith("ck") else asyncio.create_task(progress.sample())
    try:
        await asyncio.wait_for(RUNNERS[args.variant](args, progress, stop), timeout)
    except TimeoutError:
        logger.warning("timed out after %s s with %s of %s", timeout, progress.count, args.expect)
    finally:
        if sampler is not None:
            sampler.cancel()
    return progress.result()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.consumers")
    parser.add_argument("variant", choices=sorted(RUNNERS))
    parser.add_argument("--queue", required=True)
    parser.add_argument("--schema", required=True)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--expect", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--batch", type=int, default=10, help="batch variants: up to this many at once")
    parser.add_argument("--batch-wait", type=float, default=0.02, help="batch variants: seconds to wait for more")
    parser.add_argument("--wait-go", action="store_true", help="print 'ready', start on SIGUSR1")
    parser.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    parser.add_argument("--no-outbox-notify", dest="outbox_notify", action="store_false")
    args = parser.parse_args(argv)
    import warnings

    # Powertools warns on every call outside Lambda (no remaining-time context) and about its
    # Redis class name; neither changes behaviour here.
    warnings.filterwarnings("ignore", category=UserWarning, module="aws_lambda_powertools")
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.loop == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            result = runner.run(main_async(args))
    else:
        result = asyncio.run(main_async(args))
    result["loop"] = args.loop
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
