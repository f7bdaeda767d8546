"""The crash-point matrix of the transactional path, on the real PostgreSQL.

For every boundary of one delivery, the process "dies" there once and the message comes back:

* in-process (memory broker): the armed point raises ``SimulatedCrash``; the delivery stays
  unsettled and the broker redelivers it when its lock expires (1 s);
* real worker processes on real RabbitMQ: ``CONSUMER_KIT_CRASH_AT=<point>:kill`` SIGKILLs the worker
  at the point (no rollback message, no ack, no cleanup); RabbitMQ requeues the unacked message when
  the connection dies and a fresh worker finishes it.

Each case asserts: one effect, a terminal ledger row, the message eventually acked (nothing left on
the broker and nothing dead-lettered). The relay's ``after_publish_before_mark`` point is covered
by the relay's own tests.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from consumer_kit import Outcome
from consumer_kit.demo.app import SCHEMA_SQL, CreateInvoiceHandler
from consumer_kit.pipeline.crashpoints import CrashPoint
from consumer_kit.testing import Harness
from tests.conftest import rabbitmqctl, vhost_of

ROOT = Path(__file__).resolve().parents[2]


def command(order_id: int = 418, amount: int = 1250) -> dict[str, object]:
    return {
        "order_id": order_id, "revision": 2, "customer_id": "c-1", "amount_cents": amount,
        "currency": "EUR", "requested_at": dt.datetime.now(dt.UTC).isoformat(),
    }


# point -> the terminal outcome of the redelivery: a crash before COMMIT leaves nothing (the
# redelivery executes); a crash after COMMIT makes the redelivery a duplicate.
MATRIX = {
    CrashPoint.BEFORE_CLAIM: Outcome.EXECUTED,
    CrashPoint.AFTER_CLAIM: Outcome.EXECUTED,
    CrashPoint.IN_HANDLER: Outcome.EXECUTED,
    CrashPoint.AFTER_COMMIT_BEFORE_ACK: Outcome.DUPLICATE,
    CrashPoint.BEFORE_ACK: Outcome.DUPLICATE,
}


@pytest.mark.parametrize("point", list(MATRIX), ids=[p.value for p in MATRIX])
async def test_crash_once_then_redelivered(database_url: str, point: CrashPoint) -> None:
    async with Harness(CreateInvoiceHandler(), database_url=database_url, setup_sql=SCHEMA_SQL) as kit:
        kit.crash_at(point)
        reports = await kit.deliver(command())
        assert [r.outcome for r in reports] == [Outcome.CRASHED, MATRIX[point]]
        assert reports[1].delivery_count == 2  # the same message, redelivered after lock expiry
        kit.assert_outcomes({MATRIX[point].value: 1, "crashed": 1})
        await kit.assert_one_effect("SELECT count(*) FROM invoices")
        assert await kit.fetchval("SELECT invoiced_cents FROM customers") == 1250
        assert await kit.fetchval("SELECT count(*) FROM outbox") == 1
        assert [r["state"] for r in await kit.ledger()] == ["completed"]
        assert kit.dead_letters() == []


@pytest.mark.parametrize("point", list(MATRIX), ids=[p.value for p in MATRIX])
async def test_crash_at_every_delivery_of_a_storm(database_url: str, point: CrashPoint) -> None:
    """Five concurrent copies; the point fires three times (on whichever copies reach it)."""
    async with Harness(CreateInvoiceHandler(), database_url=database_url, setup_sql=SCHEMA_SQL) as kit:
        kit.crash_at(point, times=3)
        reports = await kit.deliver(command(), times=5, concurrently=True)
        # after_commit_before_ack is reached only by the one delivery that commits an execution
        assert kit.outcomes(reports)["crashed"] == (1 if point is CrashPoint.AFTER_COMMIT_BEFORE_ACK else 3)
        settled = kit.outcomes(kit.settled(reports))
        if point in (CrashPoint.BEFORE_CLAIM, CrashPoint.AFTER_CLAIM, CrashPoint.IN_HANDLER):
            kit.assert_outcomes({"executed": 1, "duplicate": 4})
        elif point is CrashPoint.AFTER_COMMIT_BEFORE_ACK:
            # the executing delivery died after COMMIT: its report is "crashed", all five
            # messages are finally acked as duplicates
            kit.assert_outcomes({"duplicate": 5})
        else:  # before_ack: whether it hit the executing delivery, the ledger says (its message id)
            executor = await kit.fetchval("SELECT message_id FROM operations")
            hidden = any(
                r.outcome is Outcome.CRASHED and r.message_id == executor and r.delivery_count == 1
                for r in reports
            )
            expected = {"executed": 0, "duplicate": 5} if hidden else {"executed": 1, "duplicate": 4}
            kit.assert_outcomes(expected)
            assert {k: settled[k] for k in expected} == expected, settled
        await kit.assert_one_effect("SELECT count(*) FROM invoices")
        assert await kit.fetchval("SELECT invoiced_cents FROM customers") == 1250
        assert await kit.fetchval("SELECT count(*) FROM outbox") == 1
        # and a replay of everything afterwards changes nothing
        replayed = await kit.replay_all()
        assert {r.outcome for r in replayed} == {Outcome.DUPLICATE}
        await kit.assert_one_effect("SELECT count(*) FROM invoices")


async def test_crash_while_settling_a_duplicate(database_url: str) -> None:
    async with Harness(CreateInvoiceHandler(), database_url=database_url, setup_sql=SCHEMA_SQL) as kit:
        await kit.deliver(command())
        kit.crash_at(CrashPoint.BEFORE_ACK)
        reports = await kit.deliver(command())
        assert [r.outcome for r in reports] == [Outcome.CRASHED, Outcome.DUPLICATE]
        await kit.assert_one_effect("SELECT count(*) FROM invoices")


async def test_crash_before_recording_a_permanent_failure(database_url: str) -> None:
    """A crash inside the handler before it fails: the redelivery records the failure once."""
    async with Harness(CreateInvoiceHandler(), database_url=database_url, setup_sql=SCHEMA_SQL) as kit:
        kit.crash_at(CrashPoint.AFTER_CLAIM)
        reports = await kit.deliver(command(amount=-5), times=2, concurrently=False)
        assert [r.outcome for r in reports] == [Outcome.CRASHED, Outcome.FAILED, Outcome.FAILED_RETAINED]
        await kit.assert_one_effect("SELECT count(*) FROM invoices", expected=0)
        assert [(r["state"], r["result_status"]) for r in await kit.ledger()] == [("failed", "negative_amount")]


# -- real worker processes, SIGKILLed, on real RabbitMQ ---------------------------------------

WORKER_SCRIPT = ROOT / "tests" / "system" / "chaos" / "worker_main.py"


def _have_rabbitmq_adapter() -> str | None:
    try:
        import consumer_kit.adapters.rabbitmq as rabbitmq
    except ImportError as exc:
        return f"consumer_kit.adapters.rabbitmq cannot be imported: {exc}"
    if not hasattr(rabbitmq, "RabbitMQConsumer"):
        return "consumer_kit.adapters.rabbitmq has no RabbitMQConsumer yet"
    return None


async def _prepare_schema(database_url: str, schema: str) -> None:
    from tests.system.chaos.app import create_tables

    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await create_tables(conn, schema)


async def _drop_schema(database_url: str, schema: str) -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def _worker(
    database_url: str, broker_url: str, schema: str, queue: str, crash_at: str | None, *, batch: int = 1
) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "CONSUMER_KIT_DATABASE_URL": database_url,
        "CONSUMER_KIT_BROKER_URL": broker_url,
        "CONSUMER_KIT_DB_SCHEMA": schema,
        "CK_CHAOS_QUEUE": queue,
        "CK_CHAOS_BATCH": str(batch),
        "CONSUMER_KIT_RETRY_DELAYS": "[0.05]",
        "CONSUMER_KIT_IN_PROGRESS_DELAY": "0.05",
        "PYTHONPATH": str(ROOT),
    }
    env.pop("CONSUMER_KIT_CRASH_AT", None)
    if crash_at:
        env["CONSUMER_KIT_CRASH_AT"] = crash_at
    return subprocess.Popen(
        [sys.executable, str(WORKER_SCRIPT)], env=env, cwd=ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )


async def _wait_for(predicate, timeout: float, what: str):  # type: ignore[no-untyped-def]
    """Poll ``predicate`` (an async function) until truthy: waiting on observable state."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.05)


@pytest.mark.rabbitmq
@pytest.mark.parametrize(
    ("point", "redelivery"),
    [
        (CrashPoint.IN_HANDLER, "executed"),  # before COMMIT: nothing durable
        (CrashPoint.AFTER_COMMIT_BEFORE_ACK, "duplicate"),  # after COMMIT, before ack
        (CrashPoint.BEFORE_CLAIM, "executed"),
    ],
    ids=lambda v: v.value if isinstance(v, CrashPoint) else v,
)
async def test_sigkilled_worker_on_rabbitmq(
    database_url: str, rabbitmq_url: str, point: CrashPoint, redelivery: str
) -> None:
    reason = _have_rabbitmq_adapter()
    if reason:
        pytest.skip(reason)
    import aio_pika

    from tests.system.chaos.app import QUEUE_PREFIX, command_body

    schema = "ck_crash_" + uuid.uuid4().hex[:8]
    queue = f"{QUEUE_PREFIX}.{schema}"
    await _prepare_schema(database_url, schema)
    connection = await aio_pika.connect_robust(rabbitmq_url)
    workers: list[subprocess.Popen[bytes]] = []
    try:
        # 1. a worker armed to SIGKILL itself at the point; it declares the topology.
        doomed = _worker(database_url, rabbitmq_url, schema, queue, f"{point.value}:kill")
        workers.append(doomed)
        channel = await connection.channel(publisher_confirms=True)
        await _wait_for(lambda: _queue_exists(connection, queue), 30, "the worker to declare its queue")
        op = "op-" + uuid.uuid4().hex[:8]
        await channel.default_exchange.publish(
            aio_pika.Message(command_body(op, 7), message_id=op, headers={"operation-id": op},
                             delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
            routing_key=queue,
        )
        returncode = await asyncio.wait_for(asyncio.to_thread(doomed.wait), 30)
        assert returncode == -signal.SIGKILL, doomed.stderr.read().decode()[-2000:] if doomed.stderr else ""

        committed = await _effects(database_url, schema, op)
        assert committed == (1 if redelivery == "duplicate" else 0)

        # 2. a healthy worker finishes the job from the broker's requeued copy.
        workers.append(_worker(database_url, rabbitmq_url, schema, queue, None))

        async def done() -> bool:
            rows = await _ledger(database_url, schema, op)
            return bool(rows) and rows[0][0] == "completed" and await _queue_empty(connection, queue)

        await _wait_for(done, 60, "the redelivery to complete and be acked")
        assert await _effects(database_url, schema, op) == 1
        assert (await _ledger(database_url, schema, op))[0][0] == "completed"
        assert await _queue_depth(connection, f"{queue}.dlq") == 0
    finally:
        for proc in workers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in workers:
            try:
                await asyncio.wait_for(asyncio.to_thread(proc.wait), 20)
            except TimeoutError:
                proc.kill()
        await _delete_queues(connection, queue)
        await connection.close()
        await _drop_schema(database_url, schema)


@pytest.mark.rabbitmq
@pytest.mark.parametrize(
    "point", [CrashPoint.IN_HANDLER, CrashPoint.AFTER_COMMIT_BEFORE_ACK, None],
    ids=lambda v: v.value if isinstance(v, CrashPoint) else "external-sigkill",
)
async def test_sigkilled_batch_worker_on_rabbitmq(database_url: str, rabbitmq_url: str, point: CrashPoint | None) -> None:
    """The batch path (batches of 10): a worker SIGKILLed with batches in flight (at a crash point
    of the batch, or from outside once some operations committed); a healthy batch worker then
    drains the queue. Every operation applied exactly once: 0 applied twice, 0 lost."""
    reason = _have_rabbitmq_adapter()
    if reason:
        pytest.skip(reason)
    import aio_pika

    from tests.system.chaos.app import QUEUE_PREFIX, command_body

    schema = "ck_crashb_" + uuid.uuid4().hex[:8]
    queue = f"{QUEUE_PREFIX}.{schema}"
    await _prepare_schema(database_url, schema)
    connection = await aio_pika.connect_robust(rabbitmq_url)
    workers: list[subprocess.Popen[bytes]] = []
    ops = [f"op-{n}-" + uuid.uuid4().hex[:6] for n in range(60)]
    try:
        doomed = _worker(database_url, rabbitmq_url, schema, queue, point and f"{point.value}:kill", batch=10)
        workers.append(doomed)
        channel = await connection.channel(publisher_confirms=True)
        await _wait_for(lambda: _queue_exists(connection, queue), 30, "the worker to declare its queue")
        for n, op in enumerate(ops + ops[:15]):  # 15 operations sent twice
            await channel.default_exchange.publish(
                aio_pika.Message(command_body(op, n % 60 % 7 + 1, account=f"acct-{n % 60 % 4}"), message_id=f"{op}-{n}",
                                 headers={"operation-id": op}, delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                routing_key=queue,
            )
        if point is None:
            await _wait_for(lambda: _completed(database_url, schema), 60, "some operations to commit")
            doomed.send_signal(signal.SIGKILL)
        returncode = await asyncio.wait_for(asyncio.to_thread(doomed.wait), 60)
        assert returncode == -signal.SIGKILL, doomed.stderr.read().decode()[-2000:] if doomed.stderr else ""

        workers.append(_worker(database_url, rabbitmq_url, schema, queue, None, batch=10))

        async def drained() -> bool:
            return await _completed(database_url, schema) == len(ops) and await _queue_empty(connection, queue)

        await _wait_for(drained, 120, "every operation to complete and every message to be acked")
        counts = await _effect_counts(database_url, schema)
        assert sorted(counts) == sorted(ops)  # 0 lost
        assert set(counts.values()) == {1}  # 0 applied twice
        assert await _queue_depth(connection, f"{queue}.dlq") == 0
    finally:
        for proc in workers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in workers:
            try:
                await asyncio.wait_for(asyncio.to_thread(proc.wait), 20)
            except TimeoutError:
                proc.kill()
        await _delete_queues(connection, queue)
        await connection.close()
        await _drop_schema(database_url, schema)


async def _completed(database_url: str, schema: str) -> int:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        cur = await conn.execute(
            sql.SQL("SELECT count(*) FROM {} WHERE state = 'completed'").format(sql.Identifier(schema, "operations"))
        )
        row = await cur.fetchone()
        return int(row[0]) if row else 0


async def _effect_counts(database_url: str, schema: str) -> dict[str, int]:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        cur = await conn.execute(
            sql.SQL("SELECT operation_key, count(*) FROM {} GROUP BY operation_key").format(
                sql.Identifier(schema, "effects")
            )
        )
        return {str(k): int(n) for k, n in await cur.fetchall()}


async def _effects(database_url: str, schema: str, op: str) -> int:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        cur = await conn.execute(
            sql.SQL("SELECT count(*) FROM {} WHERE operation_key = %s").format(sql.Identifier(schema, "effects")),
            (op,),
        )
        row = await cur.fetchone()
        return int(row[0]) if row else 0


async def _ledger(database_url: str, schema: str, op: str) -> list[tuple[object, ...]]:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        cur = await conn.execute(
            sql.SQL("SELECT state FROM {} WHERE key = %s").format(sql.Identifier(schema, "operations")), (op,)
        )
        return await cur.fetchall()


async def _queue_exists(connection, queue: str) -> bool:  # type: ignore[no-untyped-def]
    channel = await connection.channel()
    try:
        await channel.declare_queue(queue, passive=True)
        return True
    except Exception:  # noqa: BLE001 - a passive declare of a missing queue closes the channel
        return False
    finally:
        if not channel.is_closed:
            await channel.close()


async def _queue_depth(connection, queue: str) -> int:  # type: ignore[no-untyped-def]
    """Ready messages of ``queue``. A queue that does not exist is an error, never 0: "the DLQ is
    empty" must not hold because there is no DLQ."""
    channel = await connection.channel()
    try:
        q = await channel.declare_queue(queue, passive=True)
        return int(q.declaration_result.message_count or 0)
    finally:
        if not channel.is_closed:
            await channel.close()


async def _queue_empty(connection, queue: str) -> bool:  # type: ignore[no-untyped-def]
    vhost = vhost_of(str(connection.url))
    return _rabbitmqctl_unsettled(vhost, queue) == 0 and await _queue_depth(connection, queue) == 0


def _rabbitmqctl_unsettled(vhost: str, queue: str) -> int:
    """Ready + unacknowledged messages as RabbitMQ counts them (``rabbitmqctl list_queues``)."""
    out = rabbitmqctl("list_queues", "-p", vhost, "name", "messages", "--no-table-headers")
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == queue:
            return int(parts[1])
    raise AssertionError(f"queue {queue} is not listed in vhost {vhost}: {out!r}")


async def _delete_queues(connection, queue: str) -> None:  # type: ignore[no-untyped-def]
    channel = await connection.channel()
    names = [queue, f"{queue}.dlq"] + [f"{queue}.retry.{ms}ms" for ms in (50,)]
    for name in names:
        try:
            await channel.queue_delete(name)
        except Exception:  # noqa: BLE001 - best-effort cleanup
            channel = await connection.channel()
    if not channel.is_closed:
        await channel.close()

