"""Who caused a fault decides what it costs (docs/explanation/faults-and-attempts.md): a resource
error that follows one message while the others succeed is that message's (counted, dead-lettered
at the limit), on the per-delivery path and on the batch path, where its batch-mates never share
its fate; a full disk and a server out of connections stay the environment's.

On the real PostgreSQL with the memory broker: the poison message's handler runs a sort whose
temporary files exceed its ``temp_file_limit`` (SQLSTATE 53400), the others write their invoice.
"""

from __future__ import annotations

import asyncio

import psycopg
import pytest
from psycopg import errors as pg_errors

from consumer_kit import App, Context, Outcome, Result
from consumer_kit.adapters.memory import MemoryBroker, MemoryConsumer
from consumer_kit.broker import Delivery
from consumer_kit.demo.app import CreateInvoice, CreateInvoiceHandler
from consumer_kit.model.outcomes import DeliveryReport
from consumer_kit.pipeline.faults import FaultKind, classify
from consumer_kit.pipeline.runtime import RuntimeHooks
from tests.fixtures.batches import QUEUE, run_as_one_batch
from tests.fixtures.broker_env import command
from tests.fixtures.harness import fetch_all, runtime_for, throwaway_schema
from tests.fixtures.telemetry_kit import Telemetry

pytestmark = pytest.mark.postgres

POISON = 13


class TempFileHandler(CreateInvoiceHandler):
    """The invoices example's handler; for order 13 it first runs a sort too large for its own
    ``temp_file_limit``: PostgreSQL refuses that statement, and only that one."""

    batch_size = 10
    batch_wait = 0.01

    async def handle(self, message: CreateInvoice, ctx: Context) -> Result:
        if message.order_id == POISON:
            await ctx.connection.execute("SET LOCAL work_mem = '64kB'")
            await ctx.connection.execute("SET LOCAL temp_file_limit = '64kB'")
            await ctx.connection.execute(
                "SELECT count(*) FROM (SELECT g FROM generate_series(1, 100000) AS g ORDER BY g DESC OFFSET 0) AS s"
            )
        return await super().handle(message, ctx)


def app() -> App:
    app = App("fault-owner")
    app.subscribe(QUEUE, TempFileHandler())
    return app


async def run_each(broker: MemoryBroker, runtime, idle: float = 15) -> list[DeliveryReport]:  # type: ignore[no-untyped-def]
    """Every delivery on its own (the per-delivery path) until the broker is idle."""
    reports: list[DeliveryReport] = []

    async def on_delivery(delivery: Delivery) -> None:
        reports.append(await runtime.process(delivery))

    consumer = MemoryConsumer(broker)
    await consumer.subscribe(QUEUE, on_delivery, prefetch=4)
    try:
        await broker.wait_idle(idle)
    finally:
        await consumer.close()
    return reports


def of(reports: list[DeliveryReport], message_id: str) -> list[str]:
    return [r.outcome.value for r in reports if r.message_id == message_id]


def test_only_a_full_disk_and_too_many_connections_of_class_53_are_the_environments() -> None:
    for error, kind in (
        (pg_errors.DiskFull, FaultKind.ENVIRONMENT), (pg_errors.TooManyConnections, FaultKind.ENVIRONMENT),
        (pg_errors.ConfigurationLimitExceeded, FaultKind.HANDLER), (pg_errors.OutOfMemory, FaultKind.HANDLER),
        (pg_errors.InsufficientResources, FaultKind.HANDLER),
    ):
        assert classify(error()) is kind, error


async def test_a_statement_over_temp_file_limit_costs_its_message_attempts_not_the_worker_a_pause(
    database_url: str, otel: Telemetry
) -> None:
    paused: list[str] = []
    retried_before = otel.value("consumer_kit.retries", attrs={"error.type": "ConfigurationLimitExceeded"})
    async with throwaway_schema(database_url) as schema, runtime_for(
        app(), database_url, schema, hooks=RuntimeHooks(on_environment_fault=paused.append),
        max_deliveries=3, retry_delays=[0.05],
    ) as rt:
        broker = MemoryBroker()
        healthy = [broker.send(QUEUE, command(order)) for order in (1, 2)]
        poison = broker.send(QUEUE, command(POISON))
        reports = await run_each(broker, rt)

        assert of(reports, poison) == ["retried", "retried", "dead_lettered"]
        assert [of(reports, m) for m in healthy] == [["executed"], ["executed"]]
        assert paused == []  # the database worked for everyone else: never an outage
        (dead,) = broker.dead_letters(QUEUE)
        assert dead.reason == "max_deliveries_exceeded:ConfigurationLimitExceeded"
        assert await fetch_all(
            database_url, schema, "SELECT key, failures, contentions FROM attempts"
        ) == [(f"order-{POISON}-rev-2", 3, 0)]
        assert await fetch_all(database_url, schema, "SELECT order_id FROM invoices ORDER BY 1") == [(1,), (2,)]
    retried = otel.value("consumer_kit.retries", attrs={"error.type": "ConfigurationLimitExceeded"})
    assert retried - retried_before == 2


async def test_batch_mates_of_an_item_over_temp_file_limit_execute_in_their_batch(database_url: str) -> None:
    paused: list[str] = []
    async with throwaway_schema(database_url) as schema, runtime_for(
        app(), database_url, schema, hooks=RuntimeHooks(on_environment_fault=paused.append),
        max_deliveries=2, retry_delays=[0.05],
    ) as rt:
        broker = MemoryBroker()
        orders = [*range(1, 10), POISON]
        ids = {order: broker.send(QUEUE, command(order)) for order in orders}
        reports = await run_as_one_batch(broker, rt, len(orders), idle=15)

        first = reports[: len(orders)]  # the batch's own reports
        assert {r.outcome for r in first if r.message_id != ids[POISON]} == {Outcome.EXECUTED}
        assert of(reports, ids[POISON]) == ["retried", "dead_lettered"]
        assert Outcome.RELEASED not in {r.outcome for r in reports}
        assert paused == []
        assert await fetch_all(database_url, schema, "SELECT count(*) FROM invoices") == [(9,)]
        assert await fetch_all(database_url, schema, "SELECT key, failures FROM attempts") == [
            (f"order-{POISON}-rev-2", 2)
        ]


async def test_a_resource_error_the_count_cannot_follow_is_the_environments(database_url: str) -> None:
    """The same poison while the ledger refuses writes to everyone (its ``attempts`` table made
    read-only by a trigger that raises out-of-memory, class 53 like the poison's): the count cannot
    be written, so it is the environment's: given back uncounted, the worker told to pause."""
    paused: list[str] = []
    async with throwaway_schema(database_url) as schema, runtime_for(
        app(), database_url, schema, hooks=RuntimeHooks(on_environment_fault=paused.append),
        max_deliveries=3, retry_delays=[0.05],
    ) as rt:
        async with await psycopg.AsyncConnection.connect(
            database_url, autocommit=True, options=f"-c search_path={schema}"
        ) as conn:
            await conn.execute(
                "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS "
                "$$BEGIN RAISE EXCEPTION 'no space for anyone' USING ERRCODE = 'disk_full'; END$$"
            )
            await conn.execute("CREATE TRIGGER refuse BEFORE INSERT OR UPDATE ON attempts EXECUTE FUNCTION refuse()")
        broker = MemoryBroker()
        broker.send(QUEUE, command(POISON))
        reports: list[DeliveryReport] = []
        processed = asyncio.Event()

        async def once(delivery: Delivery) -> None:
            if not processed.is_set():
                reports.append(await rt.process(delivery))
                processed.set()

        consumer = MemoryConsumer(broker)
        await consumer.subscribe(QUEUE, once, prefetch=1)
        await asyncio.wait_for(processed.wait(), 10)
        await consumer.close()
        assert [(r.outcome, r.reason) for r in reports] == [(Outcome.RELEASED, "environment:DiskFull")]
        assert len(paused) == 1
        assert await fetch_all(database_url, schema, "SELECT count(*) FROM attempts") == [(0,)]
