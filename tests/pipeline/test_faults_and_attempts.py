"""Faults of the environment are not faults of the message (docs/explanation/faults-and-attempts.md).

Each test is one thing an ordinary production week does to a worker, on the real PostgreSQL and
the real RabbitMQ, asserting the right value: a fail-over to a read-only node, a poison message
beside a healthy one, deploys during a long handler, queues sharing one concurrency limit, a
COMMIT that never answers, a handler that changes its session, and lock contention.

Long fault windows take their length from ``CONSUMER_KIT_TEST_FAULT_WINDOW`` (seconds, default 4;
the chaos run uses longer ones). The read-only fail-over runs on a database of its own, so
``ALTER DATABASE`` and terminating backends touch nothing shared.
"""

from __future__ import annotations

import asyncio
import collections
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import aio_pika
import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from consumer_kit import App, Context, Outcome, PermanentFailure, Result, RetryableError
from consumer_kit.demo.app import CreateInvoice, CreateInvoiceHandler
from consumer_kit.outbox import OutboxWriter
from tests.fixtures.broker_env import command
from tests.fixtures.harness import database_of_its_own, throwaway_schema
from tests.fixtures.resilience import (
    TERMINAL,
    Gate,
    GatedInvoiceHandler,
    ReplyEater,
    ResilienceEnv,
    assert_effects,
    count,
    poll,
)

pytestmark = [pytest.mark.postgres, pytest.mark.rabbitmq]

FAULT_WINDOW = float(os.environ.get("CONSUMER_KIT_TEST_FAULT_WINDOW", "4"))


# -- helpers -------------------------------------------------------------------------------------


@pytest.fixture
async def own_database(database_url: str) -> AsyncIterator[str]:
    """A database of this test's own (dropped afterwards), for faults that act on a whole database."""
    async with database_of_its_own(database_url) as url:
        yield url


async def set_read_only(admin_url: str, database: str, read_only: bool) -> None:
    """Make *new* sessions of ``database`` read-only (as after a fail-over to a demoted node) and end
    the existing ones, or make new sessions writable again."""
    async with await psycopg.AsyncConnection.connect(admin_url, autocommit=True) as conn:
        name = sql.Identifier(database)
        if read_only:
            await conn.execute(sql.SQL("ALTER DATABASE {} SET default_transaction_read_only = on").format(name))
            await conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = %s AND pid <> pg_backend_pid()", (database,),
            )
        else:
            await conn.execute(sql.SQL("ALTER DATABASE {} RESET default_transaction_read_only").format(name))


async def http_status(port: int, path: str) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET {path} HTTP/1.0\r\n\r\n".encode())
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 5)
        return int(status_line.split()[1])
    finally:
        writer.close()


async def attempts_of(env: ResilienceEnv) -> list[tuple[Any, ...]]:
    return await env.rows("SELECT key, failures, contentions, crashes FROM attempts ORDER BY key")


async def dead_letter_reasons(env: ResilienceEnv) -> list[str]:
    """The reasons of every message in the test queue's DLQ (consumed)."""
    depth = await env.depth(env.queue + ".dlq")
    if depth == 0:
        return []
    return [
        str((m.headers or {}).get("x-dead-letter-reason"))
        for m in await env.dead_letters(depth)
    ]


# -- 1. fail-over: the database turns read-only for a while ----------------------------------------


async def test_read_only_window_dead_letters_nothing_and_executes_each_once(
    own_database: str, database_url: str, rabbitmq_url: str, unique_name: str
) -> None:
    """10 valid messages arrive while new sessions are read-only. Before the fix all 10 ended in the
    DLQ as ``max_deliveries_exceeded:ReadOnlySqlTransaction``. Right: the worker pauses (not
    ready), gives the deliveries back uncounted, probes, resumes on its own, and each message
    executes exactly once; nothing is dead-lettered and no attempt is counted."""
    database = str(conninfo_to_dict(own_database)["dbname"])
    async with throwaway_schema(own_database) as schema:
        env = ResilienceEnv(own_database, rabbitmq_url, schema, f"{unique_name}.commands")
        try:
            async with env.run(
                env.app(), retry_delays=[0.2], max_deliveries=5, probe_backoff_max=0.5, health_port=0
            ) as worker:
                assert worker.health.port is not None
                assert await http_status(worker.health.port, "/ready") == 200
                await set_read_only(database_url, database, True)
                for order in range(1, 11):
                    await env.send_command(order)
                await poll(lambda: _true(worker.pauses >= 1))
                assert await http_status(worker.health.port, "/ready") == 503
                assert await http_status(worker.health.port, "/live") == 200  # alive: do not restart
                await asyncio.sleep(FAULT_WINDOW)  # the fail-over window itself, not a synchronisation
                assert await env.rows("SELECT count(*) FROM operations") == [(0,)]
                await set_read_only(database_url, database, False)
                reports = await env.outcomes_until(lambda seen: count(seen, Outcome.EXECUTED) == 10, timeout=60)
                await poll(lambda: _ready(worker.health.port))
            outcomes = collections.Counter(r.outcome for r in reports)
            assert set(outcomes) <= {Outcome.EXECUTED, Outcome.RELEASED}, outcomes
            released = {r.reason for r in reports if r.outcome is Outcome.RELEASED}
            assert all(reason and reason.startswith(("environment:", "paused")) for reason in released), released
            assert await env.depth(env.queue + ".dlq") == 0
            await assert_effects(env, dict.fromkeys(range(1, 11), 1250))
            # nothing counted: no failure, no crash (messages that were in transit when the
            # consumer paused come back as redeliveries and run alone, but none died running)
            assert await env.rows("SELECT count(*) FROM attempts WHERE failures + crashes > 0") == [(0,)]
        finally:
            await env.cleanup()


async def _true(value: bool) -> bool:
    return value


async def _ready(port: int | None) -> bool:
    assert port is not None
    return await http_status(port, "/ready") == 200


# -- 2. a poison message beside a healthy one -----------------------------------------------------


@pytest.mark.slow
async def test_poison_is_parked_as_crashed_worker_and_the_healthy_message_runs_once(
    renv: ResilienceEnv,
) -> None:
    """A message whose handler kills its process, published just before a healthy one, prefetch 5,
    the worker restarted after each death. Before the fix the poison reached the DLQ by the broker's
    delivery limit with no reason and no ledger trace, and the healthy message was dead-lettered
    without ever running. Right: the healthy message executes once and is never dead-lettered;
    redelivered messages run alone, so every later death is the poison's own; after
    ``crash_limit`` (3) of them it is parked as ``crashed_worker`` with its history in the ledger."""
    async with renv.run(renv.app()):  # declare the topology, then step aside
        pass
    await renv.send(command(1, customer_id="poison"))
    await renv.send(command(2, customer_id="c-healthy"))
    environment = renv.worker_environment(
        CONSUMER_KIT_CONCURRENCY="5", CONSUMER_KIT_RETRY_DELAYS="[0.2]",
        CONSUMER_KIT_IN_PROGRESS_DELAY="0.2", CONSUMER_KIT_CRASH_LIMIT="3", CONSUMER_KIT_ALONE_MARKER_TTL="1",
    )

    async def settled() -> bool:
        done = await renv.rows("SELECT count(*) FROM operations WHERE state = 'completed'")
        return done == [(1,)] and await renv.depth(renv.queue + ".dlq") == 1

    deaths = 0
    for _ in range(8):  # a bound on restarts: the right answer needs crash_limit + 1 deaths
        worker = subprocess.Popen(
            [sys.executable, "-m", "consumer_kit", "worker", "tests.fixtures.apps.poison:app"],
            env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            async with asyncio.timeout(60):
                while worker.poll() is None and not await settled():
                    await asyncio.sleep(0.1)  # polling observable state (process, ledger, queue)
        finally:
            if worker.poll() is None:
                worker.terminate()
                await asyncio.wait_for(asyncio.to_thread(worker.wait), 30)
            elif worker.returncode == 1:
                deaths += 1
        if await settled():
            break
    assert deaths == 4  # one death with both in flight (attributed to neither), then 3 running alone
    assert await renv.rows("SELECT key, state FROM operations") == [("order-2-rev-2", "completed")]
    assert await renv.rows("SELECT order_id FROM invoices") == [(2,)]
    (parked,) = await renv.dead_letters(1)
    headers = parked.headers or {}
    assert headers["x-dead-letter-reason"] == "crashed_worker"
    assert "3 times" in str(headers["x-dead-letter-detail"])
    rows = await renv.rows("SELECT key, crashes, failures, history FROM attempts ORDER BY key")
    poison = next(r for r in rows if r[0] == "order-1-rev-2")
    assert (poison[1], poison[2]) == (3, 0)
    assert [e["kind"] for e in poison[3]].count("crash") == 3
    healthy = [r for r in rows if r[0] == "order-2-rev-2"]
    assert all(r[1] == 0 for r in healthy)  # never blamed for the poison's crashes
    assert await renv.queue_depth() == 0


# -- 3. deploys: graceful restarts while a long handler runs --------------------------------------


class DeployedHandler(CreateInvoiceHandler):
    """Runs longer than ``shutdown_timeout`` on its first ``slow_runs`` calls (so each graceful
    restart gives the delivery back), then fails once with a transient error, then succeeds."""

    def __init__(self, slow_runs: int) -> None:
        super().__init__()
        self.slow_runs = slow_runs
        self.calls = 0
        self.entered = asyncio.Event()

    async def handle(self, message: CreateInvoice, ctx: Context) -> Result:
        self.calls += 1
        if self.calls <= self.slow_runs:
            self.entered.set()
            await asyncio.Event().wait()  # cancelled by the graceful shutdown
        if self.calls == self.slow_runs + 1:
            raise RetryableError("the remote side hiccuped once")
        return await super().handle(message, ctx)


async def test_deliveries_given_back_at_shutdown_are_not_attempts(renv: ResilienceEnv) -> None:
    """11 graceful restarts while the handler runs, then one transient error. Before the fix the
    requeues at shutdown counted as deliveries: dead-lettered at the first real failure, and the
    broker's own delivery limit dead-lettered it after about 11 restarts with no effect. Right: a
    delivery given back at shutdown costs nothing; the one transient error is attempt 1 of 3."""
    restarts = 11
    handler = DeployedHandler(slow_runs=restarts)
    app = renv.app(handler)
    for restart in range(restarts):
        async with renv.run(app, shutdown_timeout=0.2):
            if restart == 0:
                await renv.send_command(1)  # once the worker has declared the queue
            await asyncio.wait_for(handler.entered.wait(), 30)
            handler.entered.clear()
    async with renv.run(app, shutdown_timeout=0.2):
        reports = await renv.outcomes_until(lambda seen: count(seen, *TERMINAL) == 1, timeout=30)
    assert [r.outcome for r in reports] == [Outcome.RETRIED, Outcome.EXECUTED]
    assert handler.calls == restarts + 2
    assert await attempts_of(renv) == [("order-1-rev-2", 1, 0, 0)]
    assert await renv.depth(renv.queue + ".dlq") == 0
    await assert_effects(renv, {1: 1250})


# -- 6. one concurrency limit per process, across its queues ---------------------------------------


def _multi_queue_app(renv: ResilienceEnv, handler: Any, queues: int) -> tuple[App, list[str]]:
    app = App("many-queues")
    names = [f"{renv.queue}.{i}" for i in range(queues)]
    for name in names:
        app.subscribe(name, handler)
    return app, names


async def _delete_queues(renv: ResilienceEnv, names: list[str]) -> None:
    connection = await aio_pika.connect(renv.rabbitmq_url)
    try:
        channel = await connection.channel()
        for name in names:
            for suffix in ("", ".dlq", ".retry.200ms"):
                await channel.queue_delete(name + suffix)
    finally:
        await connection.close()


async def test_concurrency_is_one_limit_across_all_queues(renv: ResilienceEnv) -> None:
    """3 queues, ``CONCURRENCY=2``, 2 messages each. Before the fix, 4 handlers ran at once (the
    limit was per queue). Right: never more than 2 handlers at once in the process."""
    gate = Gate(block=set(range(1, 7)), expect=2)
    app, names = _multi_queue_app(renv, GatedInvoiceHandler(gate), 3)
    try:
        async with renv.run(app, concurrency=2) as worker:
            for i, name in enumerate(names):
                for j in range(2):
                    await renv.send_to(name, command(10 * i + j + 1))
            await asyncio.wait_for(gate.entered.wait(), 15)
            await poll(lambda: _true(len(worker._inflight) == 6))  # all six handed to the worker
            for _ in range(20):
                await asyncio.sleep(0)  # let any that could start, start
            assert (gate.running, worker.admission.running) == (2, 2)
            gate.release.set()
            await renv.outcomes_until(lambda seen: count(seen, Outcome.EXECUTED) == 6)
        assert gate.max_running == 2
    finally:
        await _delete_queues(renv, names)


async def test_pool_waits_are_not_failures_with_long_transactions_on_many_queues(renv: ResilienceEnv) -> None:
    """4 queues, ``CONCURRENCY=1``, a handler holding its transaction longer than the pool's wait.
    Before the fix one delivery waited for a pooled connection, got ``PoolTimeout``, and it counted
    as a failed attempt. Right: deliveries wait for their turn in the process, never for a
    connection; nothing is retried, nothing counted. ``statement_timeout`` (the pool's wait) bounds
    every statement of consumer-kit's too: 3 s, which a loaded machine does not outrun (1 s it
    could: an environment fault, the deliveries released)."""
    gate = Gate(block={1})
    app, names = _multi_queue_app(renv, GatedInvoiceHandler(gate), 4)
    statement_timeout = 3.0
    try:
        async with renv.run(app, concurrency=1, statement_timeout=statement_timeout) as worker:
            for i, name in enumerate(names):
                await renv.send_to(name, command(i + 1))
            await asyncio.wait_for(gate.entered.wait(), 15)
            await poll(lambda: _true(len(worker._inflight) == 4))
            await asyncio.sleep(statement_timeout + 1.0)  # hold the transaction past the pool's wait (the scenario)
            gate.release.set()
            reports = await renv.outcomes_until(lambda seen: count(seen, Outcome.EXECUTED) == 4)
        assert [r.outcome for r in reports] == [Outcome.EXECUTED] * 4
        assert gate.max_running == 1
        assert await attempts_of(renv) == []
    finally:
        await _delete_queues(renv, names)


# -- 7. a COMMIT that never answers ----------------------------------------------------------------


async def test_commit_that_never_answers_is_bounded_and_uncertain(renv: ResilienceEnv) -> None:
    """A TCP proxy forwards the COMMIT and then nothing more, leaving the connection open. Before the
    fix ``process()`` had not returned after 20 s. Right: the COMMIT is bounded by
    ``statement_timeout`` (plus psycopg's own 5 s cancel attempt), the outcome is ``uncertain``,
    the delivery is never acked, its connection is discarded, and the redelivery (after the
    worker's probe) finds the committed row: a duplicate, one effect. Every other statement must
    answer within ``statement_timeout``: 3 s, which a loaded machine does not outrun (1 s it could)."""
    statement_timeout = 3.0
    target = conninfo_to_dict(renv.database_url)
    proxy = ReplyEater(str(target.get("host") or "127.0.0.1"), int(target.get("port") or 5432))
    port = await proxy.start()
    gate = Gate(block=set())
    try:
        url = renv.worker_database_url(renv.database_url, host="127.0.0.1", port=port)
        async with renv.run(renv.app(GatedInvoiceHandler(gate)), database_url=url,
                            statement_timeout=statement_timeout, probe_backoff_max=0.5):
            proxy.armed = True
            await renv.send_command(1)
            await asyncio.wait_for(proxy.commit_forwarded.wait(), 15)
            (uncertain,) = await renv.next_reports(1, timeout=statement_timeout + 5.0 + 5.0)
            assert (uncertain.outcome, uncertain.reason) == (Outcome.UNCERTAIN, "commit_outcome_unknown")
            assert uncertain.settlement == "released"
            assert uncertain.duration_seconds < statement_timeout + 5.0 + 2.0
            reports = await renv.outcomes_until(lambda seen: count(seen, *TERMINAL) == 1)
    finally:
        await proxy.close()
    assert [r.outcome for r in reports if r.outcome in TERMINAL] == [Outcome.DUPLICATE]
    assert gate.calls == 1
    await assert_effects(renv, {1: 1250})
    assert await renv.queue_depth() == 0


# -- 9. connections come back from a delivery as they went in --------------------------------------


class SessionHandler(CreateInvoiceHandler):
    """``customer_id`` says what to do: ``dirty`` changes its session and succeeds,
    ``dirty-fail`` changes it and fails permanently, ``check`` reports what its session looks like."""

    async def handle(self, message: CreateInvoice, ctx: Context) -> Result:
        conn = ctx.connection
        if message.customer_id.startswith("dirty"):
            await conn.execute("SET lock_timeout = 0")
            await conn.execute("SET statement_timeout = '1min'")
            await conn.execute("SELECT pg_advisory_lock(4242)")
            await conn.execute("LISTEN ck_session_leak")
            await conn.execute("DECLARE leaky CURSOR WITH HOLD FOR SELECT 1")
            if message.customer_id == "dirty-fail":
                raise PermanentFailure("rejected")
            return await super().handle(message, ctx)
        cur = await conn.execute(
            "SELECT pg_backend_pid(), current_setting('lock_timeout'), current_setting('statement_timeout'),"
            " (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()),"
            " (SELECT count(*) FROM pg_listening_channels()), (SELECT count(*) FROM pg_cursors)"
        )
        row = await cur.fetchone()
        assert row is not None
        await super().handle(message, ctx)
        return Result(status="checked", body=list(row))


async def test_a_handler_cannot_change_the_next_deliverys_session(renv: ResilienceEnv) -> None:
    """A handler that runs ``SET lock_timeout = 0`` (and takes a session advisory lock, LISTENs,
    keeps a cursor) must not change the session of the next delivery on its connection: before the
    fix it did. Both the committed and the rolled-back path are reset."""
    async with renv.run(renv.app(SessionHandler()), concurrency=1, pool_size=1, lock_timeout=2.0):
        checks = []
        for order, customer in ((1, "check"), (2, "dirty"), (3, "check"), (4, "dirty-fail"), (5, "check")):
            await renv.send(command(order, customer_id=customer))
            (report,) = await renv.next_reports(1)
            if customer == "check":
                assert report.result is not None
                checks.append(report.result.body)
    pids = {c[0] for c in checks}
    assert len(pids) == 1  # one connection served every delivery
    assert [c[1:] for c in checks] == [["2s", "0", 0, 0, 0]] * 3


# -- 11. contention is counted apart ----------------------------------------------------------------


async def test_lock_timeout_on_a_business_row_is_contention_not_a_failure(renv: ResilienceEnv) -> None:
    """The handler waits past ``lock_timeout`` on a customer row another transaction holds. Before the
    fix that counted toward ``max_deliveries`` (1 here: dead-lettered at once). Right: it is
    contention, retried with jitter under its own bound; once the row is free it executes."""
    await renv.rows("INSERT INTO customers (customer_id) VALUES ('c-hot') RETURNING 1")
    async with await psycopg.AsyncConnection.connect(renv.database_url) as holder:
        await holder.execute(
            sql.SQL("SELECT 1 FROM {} WHERE customer_id = 'c-hot' FOR UPDATE").format(
                sql.Identifier(renv.schema, "customers")
            )
        )
        async with renv.run(renv.app(), lock_timeout=0.1, max_deliveries=1, in_progress_delay=0.2):
            await renv.send(command(1, customer_id="c-hot"))
            waiting = await renv.outcomes_until(lambda seen: count(seen, Outcome.CONTENDED) >= 2)
            await holder.rollback()
            rest = await renv.outcomes_until(lambda seen: count(seen, Outcome.EXECUTED) == 1)
    reports = waiting + rest
    assert {r.outcome for r in reports} == {Outcome.CONTENDED, Outcome.EXECUTED}
    assert {r.reason for r in waiting} == {"contention:LockNotAvailable"}
    ((_key, failures, contentions, crashes),) = await attempts_of(renv)
    assert (failures, crashes) == (0, 0) and contentions == count(reports, Outcome.CONTENDED)
    assert await renv.depth(renv.queue + ".dlq") == 0


async def test_outbox_partition_lock_held_by_an_outbox_writer_is_contention(renv: ResilienceEnv) -> None:
    """A long ``OutboxWriter`` transaction holds the per-partition-key outbox lock; the handler's
    events for that key wait past ``lock_timeout`` at completion. Right: contention, not a failure."""
    async with await psycopg.AsyncConnection.connect(renv.database_url) as writer_conn:
        await OutboxWriter(renv.schema).add(
            writer_conn, destination="billing.events", routing_key="x", message_type="Other",
            payload={}, partition_key="c-2",
        )  # transaction left open: the partition lock is held until it ends
        async with renv.run(renv.app(), lock_timeout=0.1, max_deliveries=1, in_progress_delay=0.2):
            await renv.send(command(1, customer_id="c-2"))
            waiting = await renv.outcomes_until(lambda seen: count(seen, Outcome.CONTENDED) >= 1)
            await writer_conn.commit()
            rest = await renv.outcomes_until(lambda seen: count(seen, Outcome.EXECUTED) == 1)
    assert {r.outcome for r in waiting + rest} == {Outcome.CONTENDED, Outcome.EXECUTED}
    assert await renv.rows("SELECT failures FROM attempts") == [(0,)]
    assert await renv.rows("SELECT count(*) FROM outbox WHERE partition_key = 'c-2'") == [(2,)]


async def test_contention_past_its_own_bound_is_dead_lettered_with_that_reason(renv: ResilienceEnv) -> None:
    await renv.rows("INSERT INTO customers (customer_id) VALUES ('c-stuck') RETURNING 1")
    async with await psycopg.AsyncConnection.connect(renv.database_url) as holder:
        await holder.execute(
            sql.SQL("SELECT 1 FROM {} WHERE customer_id = 'c-stuck' FOR UPDATE").format(
                sql.Identifier(renv.schema, "customers")
            )
        )
        async with renv.run(renv.app(), lock_timeout=0.05, max_contentions=2, in_progress_delay=0.1):
            await renv.send(command(1, customer_id="c-stuck"))
            reports = await renv.outcomes_until(lambda seen: count(seen, Outcome.DEAD_LETTERED) == 1)
    assert [r.outcome for r in reports] == [Outcome.CONTENDED, Outcome.DEAD_LETTERED]
    assert reports[-1].reason == "max_contentions_exceeded:LockNotAvailable"
    assert await renv.rows("SELECT failures, contentions FROM attempts") == [(0, 2)]
    assert await dead_letter_reasons(renv) == ["max_contentions_exceeded:LockNotAvailable"]


# -- 1b. the relay through the same fail-over ------------------------------------------------------


async def test_relay_survives_a_read_only_window_and_publishes_everything_once_writes_work(
    own_database: str, database_url: str, rabbitmq_url: str, unique_name: str
) -> None:
    """The relay claims rows with an UPDATE, which a read-only database refuses. It must neither
    crash nor spin: it logs the outage once, backs off, reports not-ready, and publishes every
    event (with message id = event id) once the database is writable again."""
    from consumer_kit.outbox_relay import Relay
    from tests.fixtures.relay_support import Event, Recorder, connect, relay_settings, write_events

    database = str(conninfo_to_dict(own_database)["dbname"])
    async with throwaway_schema(own_database) as schema, Recorder(rabbitmq_url, unique_name) as rec:
        async with await connect(own_database) as conn:
            before = await write_events(conn, schema, [Event(unique_name) for _ in range(3)])
        relay = Relay(relay_settings(own_database, schema, rabbitmq_url, relay_health_port=0))
        task = asyncio.create_task(relay.run())
        try:
            await rec.wait_for(before, 15)
            await set_read_only(database_url, database, True)
            await poll(lambda: _true(relay.counters["db_errors"] >= 3))
            assert not task.done()
            # one outage, backing off: a step that never reached the database (cleanup not due)
            # must not end it (the back-off would restart at 0.5 s on every loop)
            assert relay._outage is not None and relay._outage_backoff >= 2.0
            assert relay.health.port is not None
            assert await http_status(relay.health.port, "/ready") == 503
            await set_read_only(database_url, database, False)
            async with await connect(own_database) as conn:
                after = await write_events(conn, schema, [Event(unique_name) for _ in range(3)])
            await rec.wait_for(after, 30)
            await poll(lambda: _ready(relay.health.port))
        finally:
            relay.request_stop()
            await asyncio.wait_for(task, 15)
    assert sorted(r.message_id for r in rec.received) == sorted(str(e) for e in before + after)
