"""The runtime under attack, on the real PostgreSQL and the real RabbitMQ.

Every test runs in-process workers (``Worker`` + RabbitMQ adapter) over a throwaway schema and
checks the one-effect guarantee after something goes wrong *inside* the delivery pipeline:

* database connection loss: idle pool connections killed (a PostgreSQL restart or fail-over),
  a backend killed mid-transaction, a backend killed inside COMMIT, a COMMIT whose reply is lost
  after it became durable (a TCP proxy that swallows the reply);
* a duplicate storm (200 operations x 5 copies, 3 workers);
* the claim's ``lock_timeout`` path (lease recovery lives in test_external_effects.py);
* handlers that break their transaction (``commit()``, raw ``COMMIT``, an uncaught or a
  swallowed database error), a handler timeout on a running query, and a lost ack.

Synchronisation is by events (handlers signal and wait on ``asyncio.Event``), report queues and
bounded polls of a database or broker condition; never by sleeping.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
import uuid

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from consumer_kit import Context, Outcome, Result
from consumer_kit.adapters.rabbitmq import consumer_from_settings
from consumer_kit.demo.app import CreateInvoice, CreateInvoiceHandler
from consumer_kit.worker.process import Worker
from tests.fixtures.broker_env import command
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


# -- 1. database connection loss ------------------------------------------------------------------


async def test_idle_pool_connections_killed_do_not_burn_deliveries(renv: ResilienceEnv) -> None:
    """A PostgreSQL restart or fail-over kills every idle pooled connection. The next deliveries must
    not be handed those dead connections one after another: with ``max_deliveries=3`` and a pool of
    more than three dead connections, a message would be dead-lettered without its handler ever
    running (``max_deliveries_exceeded:OperationalError``)."""
    gate = Gate(block=set(range(1, 7)), expect=6)
    async with renv.run(renv.app(GatedInvoiceHandler(gate)), concurrency=8, pool_size=8):
        # Grow the pool to six connections: six deliveries held in the handler at once.
        for order in range(1, 7):
            await renv.send_command(order)
        await asyncio.wait_for(gate.entered.wait(), 15)
        gate.release.set()
        first = await renv.next_reports(6)
        assert count(first, Outcome.EXECUTED) == 6
        idle = [row[0] for row in await renv.backends("state = 'idle'")]
        assert len(idle) >= 4, idle
        await renv.terminate(idle)

        await renv.send_command(100)
        reports = await renv.outcomes_until(lambda seen: count(seen, *TERMINAL) == 1)
    assert [r.outcome for r in reports] == [Outcome.EXECUTED], [(r.outcome, r.reason) for r in reports]
    await assert_effects(renv, {**dict.fromkeys(range(1, 7), 1250), 100: 1250})


async def test_backend_killed_mid_transaction_is_retried_and_the_pool_recovers(renv: ResilienceEnv) -> None:
    """The handler has written its invoice; its backend is terminated; the handler returns. Nothing
    was committed, so the redelivery executes: one effect, and the worker keeps consuming."""
    gate = Gate(block={1})
    async with renv.run(renv.app(GatedInvoiceHandler(gate, hold_after_writes=True))):
        await renv.send_command(1)
        await asyncio.wait_for(gate.entered.wait(), 15)
        pids = await renv.wait_for_backend("state = 'idle in transaction'")
        assert len(pids) == 1
        await renv.terminate(pids)
        gate.release.set()
        reports = await renv.outcomes_until(lambda seen: count(seen, *TERMINAL) == 1)
        # A lost backend is the environment's fault, not the message's: given back uncounted
        # (the worker pauses, probes and resumes), then executed.
        assert [r.outcome for r in reports] == [Outcome.RELEASED, Outcome.EXECUTED]
        # AdminShutdown (SQLSTATE 57P01) when the server's goodbye is read first, else the bare
        # OperationalError of a lost connection; either way nothing was committed
        assert reports[0].reason in ("environment:AdminShutdown", "environment:OperationalError")
        assert gate.calls == 2
        assert await renv.rows("SELECT failures, contentions, crashes, history FROM attempts") == []
        # The pool replaced the dead connection: later deliveries run normally.
        for order in (2, 3):
            await renv.send_command(order)
        later = await renv.next_reports(2)
    assert [r.outcome for r in later] == [Outcome.EXECUTED, Outcome.EXECUTED]
    await assert_effects(renv, {1: 1250, 2: 1250, 3: 1250})
    assert await renv.queue_depth() == 0


async def test_backend_killed_inside_commit_is_uncertain_then_executed(renv: ResilienceEnv) -> None:
    """The backend dies while executing COMMIT (held there by a deferred constraint trigger waiting
    on an advisory lock the test holds). The runtime cannot know whether COMMIT happened: outcome
    ``uncertain``, not acked. It did not happen, so the redelivery executes: one effect."""
    lock_key = uuid.uuid4().int % 2**31
    await renv.admin(
        sql.SQL(
            """
            CREATE FUNCTION {schema}.wait_at_commit() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN PERFORM pg_advisory_xact_lock({key}); RETURN NULL; END $$;
            CREATE CONSTRAINT TRIGGER wait_at_commit AFTER INSERT ON {schema}.invoices
                DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION {schema}.wait_at_commit();
            """
        ).format(schema=sql.Identifier(renv.schema), key=sql.Literal(lock_key)).as_string(None)
    )
    async with await psycopg.AsyncConnection.connect(renv.database_url, autocommit=True) as holder:
        await holder.execute("SELECT pg_advisory_lock(%s)", (lock_key,))
        async with renv.run(renv.app()):
            await renv.send_command(1)
            pids = await renv.wait_for_backend("query LIKE '%%COMMIT' AND wait_event_type = 'Lock'")
            await renv.terminate(pids)
            (uncertain,) = await renv.next_reports(1)
            assert (uncertain.outcome, uncertain.reason) == (Outcome.UNCERTAIN, "commit_outcome_unknown")
            assert uncertain.settlement == "released"  # never acked, and not counted
            assert await renv.rows("SELECT count(*) FROM operations") == [(0,)]
            await holder.execute("SELECT pg_advisory_unlock(%s)", (lock_key,))
            (redelivered,) = await renv.next_reports(1)
    assert redelivered.outcome is Outcome.EXECUTED
    assert (redelivered.delivery_count, redelivered.redelivered) == (1, False)  # a release is no attempt
    await assert_effects(renv, {1: 1250})
    assert await renv.queue_depth() == 0


async def test_commit_reply_lost_after_durable_commit_is_uncertain_then_duplicate(
    renv: ResilienceEnv,
) -> None:
    """COMMIT reaches the server and becomes durable, but the reply never arrives (the network
    drops). The runtime must not ack (``uncertain``); the redelivery reads the ledger and is a
    ``duplicate``: the handler never runs twice."""
    target = conninfo_to_dict(renv.database_url)
    proxy = ReplyEater(str(target.get("host") or "127.0.0.1"), int(target.get("port") or 5432))
    port = await proxy.start()
    gate = Gate(block=set())
    try:
        async with renv.run(
            renv.app(GatedInvoiceHandler(gate)), database_url=renv.worker_database_url(renv.database_url, host="127.0.0.1", port=port)
        ):
            proxy.armed = True
            await renv.send_command(1)
            await asyncio.wait_for(proxy.commit_forwarded.wait(), 15)
            await poll(lambda: renv.rows("SELECT count(*) = 1 FROM operations WHERE state = 'completed'"))
            proxy.cut()
            reports = await renv.outcomes_until(lambda seen: count(seen, *TERMINAL) == 1)
    finally:
        await proxy.close()
    assert [(r.outcome, r.reason) for r in reports] == [
        (Outcome.UNCERTAIN, "commit_outcome_unknown"), (Outcome.DUPLICATE, None),
    ]
    assert gate.calls == 1
    await assert_effects(renv, {1: 1250})
    assert await renv.queue_depth() == 0


# -- 2. duplicate storm ---------------------------------------------------------------------------


async def test_duplicate_storm_200_operations_5_copies_3_workers(renv: ResilienceEnv) -> None:
    """1000 messages at once (200 operations x 5 copies, shuffled), 3 workers x concurrency 16,
    20 customers shared between operations (row-lock contention in the handler too)."""
    operations, copies = 200, 5
    amounts = {order: 100 + order for order in range(1, operations + 1)}
    bodies = [
        command(order, amount, customer_id=f"c-{order % 20}")
        for order, amount in amounts.items() for _ in range(copies)
    ]
    random.Random(7).shuffle(bodies)
    gate = Gate(block=set())
    app = renv.app(GatedInvoiceHandler(gate))
    overrides = {"concurrency": 16, "pool_size": 10}  # max_deliveries=3, lock_timeout=2 s (Env)
    async with renv.run(app, **overrides), renv.run(app, **overrides), renv.run(app, **overrides):
        await asyncio.gather(*(renv.send(body) for body in bodies))
        seen = await renv.outcomes_until(
            lambda reports: count(reports, *TERMINAL, Outcome.DEAD_LETTERED) == operations * copies,
            timeout=25,
        )
    by_outcome = collections.Counter(r.outcome for r in seen)
    assert by_outcome[Outcome.EXECUTED] == operations, by_outcome
    assert by_outcome[Outcome.DUPLICATE] == operations * (copies - 1), by_outcome
    assert set(by_outcome) <= {Outcome.EXECUTED, Outcome.DUPLICATE, Outcome.IN_PROGRESS}, by_outcome
    executed_keys = collections.Counter(r.operation_key for r in seen if r.outcome is Outcome.EXECUTED)
    assert len(executed_keys) == operations and set(executed_keys.values()) == {1}
    assert gate.calls == operations  # the handler itself never ran twice for a key
    await assert_effects(renv, amounts)
    assert await renv.queue_depth() == 0
    assert await renv.depth(renv.queue + ".retry.200ms") == 0
    assert await renv.depth(renv.queue + ".dlq") == 0


# -- 3. the claim's lock_timeout ------------------------------------------------------------------


async def test_duplicate_waiting_past_lock_timeout_is_in_progress_then_duplicate(renv: ResilienceEnv) -> None:
    """Worker A's handler holds the claim (uncommitted) longer than ``lock_timeout``. The duplicate
    on worker B waits on the unique index, times out and comes back ``in_progress`` (retried with
    delay), again and again, never running in parallel; after A commits it is a ``duplicate``."""
    gate = Gate(block={1})
    app = renv.app(GatedInvoiceHandler(gate))
    async with renv.run(app, concurrency=1, lock_timeout=0.3):  # A: prefetch 1, holds copy 1
        await renv.send_command(1)
        await asyncio.wait_for(gate.entered.wait(), 15)
        async with renv.run(app, lock_timeout=0.3):  # B
            await renv.send_command(1)
            waiting = await renv.outcomes_until(lambda seen: count(seen, Outcome.IN_PROGRESS) >= 2)
            assert {(r.outcome, r.reason) for r in waiting} == {(Outcome.IN_PROGRESS, "claim_lock_timeout")}
            assert all(r.settlement == "retry" for r in waiting)
            assert (gate.calls, gate.max_running) == (1, 1)
            gate.release.set()
            rest = await renv.outcomes_until(
                lambda seen: count(seen, Outcome.EXECUTED) == 1 and count(seen, Outcome.DUPLICATE) == 1
            )
    assert set(r.outcome for r in rest) <= {Outcome.EXECUTED, Outcome.DUPLICATE, Outcome.IN_PROGRESS}
    duplicate = next(r for r in rest if r.outcome is Outcome.DUPLICATE)
    assert duplicate.result is not None and duplicate.result.status == "created"
    # waiting is not a failed attempt: the in_progress retries count nothing in the ledger
    assert await renv.rows("SELECT count(*) FROM attempts") == [(0,)]
    assert (gate.calls, gate.max_running) == (1, 1)
    await assert_effects(renv, {1: 1250})
    assert await renv.queue_depth() == 0


# -- 4. lease recovery: see tests/pipeline/test_leased.py (the leased path reconciles; a
# transactional handler never re-runs a row whose lease expired) ----------------------------------


# -- 5. handlers that break their transaction -----------------------------------------------------


class MisbehavingHandler(CreateInvoiceHandler):
    """Does the example's writes, then misbehaves as ``customer_id`` says."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()

    async def handle(self, message: CreateInvoice, ctx: Context) -> Result:
        mode = message.customer_id
        self.calls[mode] += 1
        result = await super().handle(message, ctx)
        conn = ctx.connection
        if mode == "commit-method":
            await conn.commit()
        elif mode == "raw-commit":
            await conn.execute("COMMIT")
        elif mode == "raw-rollback":
            await conn.execute("ROLLBACK")
            await conn.execute("INSERT INTO customers VALUES ('after-rollback', 1)")
        elif mode == "unique-violation":
            await conn.execute("INSERT INTO customers (customer_id) VALUES ('unique-violation')")
        elif mode == "swallowed-error":
            with contextlib.suppress(psycopg.errors.UniqueViolation):
                await conn.execute("INSERT INTO customers (customer_id) VALUES ('swallowed-error')")
        elif mode == "savepoint-handled":
            with contextlib.suppress(psycopg.errors.UniqueViolation):
                async with conn.transaction():
                    await conn.execute("INSERT INTO customers (customer_id) VALUES ('savepoint-handled')")
        return result


async def test_handlers_that_break_their_transaction(renv: ResilienceEnv) -> None:
    """What each misbehaviour does (all with ``max_deliveries=3``):

    * ``ctx.connection.commit()``: psycopg forbids it inside a transaction block
      (``ProgrammingError``): rolled back, retried, dead-lettered; nothing committed.
    * an uncaught unique violation: rolled back entirely, retried, dead-lettered; nothing
      committed.
    * a swallowed database error (the handler catches ``UniqueViolation`` and returns normally):
      the transaction is aborted, so the runtime refuses to complete it
      (``InFailedSqlTransaction``): rolled back, retried, dead-lettered; nothing committed.
    * the same error caught around the handler's own ``conn.transaction()`` (a savepoint): fine,
      executed once.
    In every failing case the ledger has no row and no invoice survives.
    """
    handler = MisbehavingHandler()
    modes = {"commit-method": 1, "unique-violation": 2, "swallowed-error": 3, "savepoint-handled": 4}
    async with renv.run(renv.app(handler)):
        for mode, order in modes.items():
            await renv.send_command(order, customer_id=mode)
        seen = await renv.outcomes_until(lambda reports: count(reports, *TERMINAL) == len(modes))
    final = {r.operation_key: (r.outcome, r.reason) for r in seen if r.outcome in TERMINAL}
    assert final == {
        "order-1-rev-2": (Outcome.DEAD_LETTERED, "max_deliveries_exceeded:ProgrammingError"),
        "order-2-rev-2": (Outcome.DEAD_LETTERED, "max_deliveries_exceeded:UniqueViolation"),
        "order-3-rev-2": (Outcome.DEAD_LETTERED, "max_deliveries_exceeded:InFailedSqlTransaction"),
        "order-4-rev-2": (Outcome.EXECUTED, None),
    }
    assert handler.calls == {"commit-method": 3, "unique-violation": 3, "swallowed-error": 3, "savepoint-handled": 1}
    assert await renv.rows("SELECT key, state FROM operations") == [("order-4-rev-2", "completed")]
    assert await renv.rows("SELECT order_id FROM invoices") == [(4,)]
    assert await renv.rows("SELECT customer_id, invoiced_cents FROM customers ORDER BY 1") == [
        ("savepoint-handled", 1250)
    ]
    assert len(await renv.dead_letters(3)) == 3


@pytest.mark.parametrize(
    ("mode", "invoices", "customers"),
    [
        # The claim and the invoice were committed by the handler's COMMIT.
        ("raw-commit", [(5,)], [("raw-commit", 1250)]),
        # The claim and the invoice were rolled back; the write after ROLLBACK autocommitted.
        ("raw-rollback", [], [("after-rollback", 1)]),
    ],
)
async def test_handler_ending_the_transaction_itself_is_parked_for_reconciliation(
    renv: ResilienceEnv, mode: str, invoices: list[tuple[int]], customers: list[tuple[str, int]]
) -> None:
    """A handler that sends ``COMMIT`` or ``ROLLBACK`` as SQL ends the runtime's transaction under
    its feet: part of its effect is durable without the ledger's completion.

    Before the fix: ``RELEASE SAVEPOINT`` failed (``NoActiveSqlTransaction``), the delivery was
    retried; after ``COMMIT`` the claim was durable as ``processing`` with a live lease, so the
    redeliveries were ``in_progress`` until the lease expired and lease recovery ran the handler
    again: two invoices. After ``ROLLBACK`` every redelivery re-ran the handler from scratch and
    repeated the autocommitted write. Now the runtime detects the ended transaction, marks the
    operation ``needs_reconciliation`` and dead-letters the delivery with that reason; duplicates
    are dead-lettered the same way and never run the handler."""
    handler = MisbehavingHandler()
    async with renv.run(renv.app(handler)):
        await renv.send_command(5, customer_id=mode)
        (first,) = await renv.next_reports(1)
        await renv.send_command(5, customer_id=mode)
        (duplicate,) = await renv.next_reports(1)
    for report in (first, duplicate):
        assert (report.outcome, report.settlement, report.reason) == (
            Outcome.UNCERTAIN, "dead_letter", "needs_reconciliation",
        )
    assert handler.calls == {mode: 1}
    assert await renv.rows("SELECT key, state, lease_owner, error_class FROM operations") == [
        ("order-5-rev-2", "needs_reconciliation", None, "TransactionEnded")
    ]
    assert await renv.rows("SELECT order_id FROM invoices") == invoices
    assert await renv.rows("SELECT customer_id, invoiced_cents FROM customers") == customers
    reasons = [m.headers["x-dead-letter-reason"] for m in await renv.dead_letters(2)]
    assert reasons == ["needs_reconciliation"] * 2


# -- 6. timeouts and lost settlements -------------------------------------------------------------


class SlowQueryHandler(CreateInvoiceHandler):
    """First call: a query that runs far past ``handler_timeout``; later calls: the example."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    async def handle(self, message: CreateInvoice, ctx: Context) -> Result:
        self.calls += 1
        result = await super().handle(message, ctx)
        if self.calls == 1:
            await ctx.connection.execute("SELECT pg_sleep(60)")
        return result


async def test_handler_timeout_cancels_the_running_query_and_retries(renv: ResilienceEnv) -> None:
    """``handler_timeout`` fires while the handler's query is running on the server. The runtime
    must not wait for the query nor leave it running: the delivery is retried promptly, the
    redelivery executes once, and no backend is left sleeping. The timeout bounds the redelivery's
    handler too: 3 s, which its few statements do not outrun on a loaded machine (0.5 s they
    could: retried as a second HandlerTimeout)."""
    handler = SlowQueryHandler()
    handler_timeout = 3.0
    async with renv.run(renv.app(handler), handler_timeout=handler_timeout):
        await renv.send_command(1)
        reports = await renv.outcomes_until(lambda seen: count(seen, *TERMINAL) == 1, timeout=20)
        sleeping = await renv.backends("query LIKE '%%pg_sleep%%' AND state = 'active'")
    assert [(r.outcome, r.reason) for r in reports] == [
        (Outcome.RETRIED, "HandlerTimeout"), (Outcome.EXECUTED, None),
    ]
    assert reports[0].duration_seconds < handler_timeout + 4.5  # not the query's 60 s
    assert sleeping == []
    await assert_effects(renv, {1: 1250})


async def test_ack_lost_after_commit_makes_the_redelivery_a_duplicate(renv: ResilienceEnv) -> None:
    """The broker connection drops while the handler runs: the COMMIT succeeds but the ack cannot
    be sent. The broker redelivers (on the adapter's new connection); the ledger turns the
    redelivery into a ``duplicate``; one effect."""
    gate = Gate(block={1})
    settings = renv.settings
    consumer = consumer_from_settings(settings)
    worker = Worker(renv.app(GatedInvoiceHandler(gate)), settings, consumer=consumer,
                    on_report=renv.reports.put_nowait)
    task = asyncio.create_task(worker.run())
    try:
        await asyncio.wait_for(worker.started.wait(), 30)
        await renv.send_command(1)
        await asyncio.wait_for(gate.entered.wait(), 15)
        connection = consumer._connection  # the adapter's live aio-pika connection
        assert connection is not None
        await connection.close()
        await poll(lambda: asyncio.sleep(0, consumer.reconnects >= 1))
        gate.release.set()
        seen = await renv.outcomes_until(lambda reports: count(reports, Outcome.DUPLICATE) == 1)
    finally:
        worker.stop()
        await asyncio.wait_for(task, 30)
    assert [r.outcome for r in seen if r.outcome in TERMINAL] == [Outcome.EXECUTED, Outcome.DUPLICATE]
    assert seen[-1].delivery_count == 2  # the broker redelivered the message whose ack was lost, once
    assert consumer.reconnects == 1
    assert set(r.outcome for r in seen) <= {Outcome.EXECUTED, Outcome.DUPLICATE, Outcome.IN_PROGRESS}
    assert gate.calls == 1
    await assert_effects(renv, {1: 1250})
    assert await renv.queue_depth() == 0
