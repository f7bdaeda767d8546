"""Retention, key expiry, per-key lanes, optimistic versions and a partitioned ledger.

Real PostgreSQL (and RabbitMQ for the worker scenarios). Retentions are seconds long here so the
expiry can be waited for by polling the database clock, never by sleeping a guessed time.
"""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
import json
import subprocess
import sys
from typing import Any

import psycopg
import pytest
from psycopg import sql
from pydantic import BaseModel

from consumer_kit import (
    App,
    ConfigurationError,
    Context,
    Envelope,
    Handler,
    Outcome,
    PermanentFailure,
    Result,
)
from consumer_kit.adapters.memory import MemoryBroker, MemoryConsumer
from consumer_kit.errors import StaleVersion
from consumer_kit.ledger import migrate
from consumer_kit.ledger.retention import Pruner
from consumer_kit.versions import apply_if_newer, update_expecting
from examples.accounts.app import SCHEMA_SQL as ACCOUNTS_SQL
from examples.accounts.app import CreditLimitHandler, SetCreditLimit
from tests.fixtures.harness import fetch_all, runtime_for, throwaway_schema
from tests.fixtures.resilience import ResilienceEnv, count

pytestmark = [pytest.mark.postgres]


async def _schema_sql(env: ResilienceEnv, text: str) -> None:
    async with await psycopg.AsyncConnection.connect(
        env.database_url, autocommit=True, options=f"-c search_path={env.schema}"
    ) as conn:
        await conn.execute(text.encode())


async def _until(env: ResilienceEnv, condition: str, timeout: float = 15.0) -> None:
    """Poll the database until ``condition`` (a boolean SQL expression over ``operations``) holds."""
    async with asyncio.timeout(timeout):
        while not (await env.rows(f"SELECT coalesce(bool_and({condition}), false) FROM operations"))[0][0]:
            await asyncio.sleep(0.1)  # polling the database clock, not a guessed delay


# -- retention and key expiry ---------------------------------------------------------------------


class Note(BaseModel):
    text: str


class ShortLivedHandler(Handler[Note]):
    """Keeps result bodies 1 s and identities 2 s; one ``notes`` row per execution."""

    operation_type = "note.keep"
    result_retention = dt.timedelta(seconds=1)
    key_retention = dt.timedelta(seconds=2)

    async def handle(self, message: Note, ctx: Context) -> Result:
        await ctx.connection.execute("INSERT INTO notes (key, text) VALUES (%s, %s)", (ctx.operation.key, message.text))
        return Result("kept", body={"echo": message.text})


@pytest.mark.rabbitmq
async def test_prune_with_workers_running_never_re_executes_and_an_expired_identity_is_key_expired(
    renv: ResilienceEnv,
) -> None:
    """A body past its retention is pruned and the replayed message is still a duplicate (no body);
    once its identity is pruned, the replayed message is older than the key retention and is
    refused as ``key_expired``; operations sent meanwhile execute once each."""
    await _schema_sql(renv, "CREATE TABLE notes (key text NOT NULL, text text NOT NULL)")
    created = dt.datetime.now(dt.UTC).isoformat()
    old = {"operation-id": "n-1", "operation-created-at": created, "message-type": "Note"}
    pruner = Pruner(renv.schema, grace=0)
    async with renv.run(renv.app(ShortLivedHandler())):
        await renv.send(b'{"text": "hello"}', old, message_type="Note")
        (first,) = await renv.next_reports(1)
        assert first.outcome is Outcome.EXECUTED and first.result is not None and first.result.body == {"echo": "hello"}

        await _until(renv, "body_expires_at <= now()")
        async with await psycopg.AsyncConnection.connect(renv.database_url, autocommit=True) as conn:
            assert await pruner.count(conn) == type(await pruner.count(conn))(1, 0)
            assert await pruner.prune_bodies(conn, "operations", 100) == 1
        await renv.send(b'{"text": "hello"}', old, message_type="Note")
        (replayed,) = await renv.next_reports(1)
        assert replayed.outcome is Outcome.DUPLICATE and replayed.result is not None
        assert (replayed.result.status, replayed.result.body) == ("kept", None)

        await _until(renv, "key_expires_at <= now()")
        fresh = [{"operation-id": f"n-{i}", "operation-created-at": dt.datetime.now(dt.UTC).isoformat(),
                  "message-type": "Note"} for i in range(2, 12)]
        sending = asyncio.gather(*(renv.send(b'{"text": "new"}', h, message_type="Note") for h in fresh))
        async with await psycopg.AsyncConnection.connect(renv.database_url, autocommit=True) as conn:
            pruned = await pruner.prune_identities(conn, "operations", 100)  # while they arrive
        await sending
        await renv.outcomes_until(lambda seen: count(seen, Outcome.EXECUTED) == 10)
        assert pruned == 1

        await renv.send(b'{"text": "hello"}', old, message_type="Note")
        (expired,) = await renv.next_reports(1)
    assert (expired.outcome, expired.reason) == (Outcome.KEY_EXPIRED, "key_expired")
    notes = collections.Counter(key for key, in await renv.rows("SELECT key FROM notes"))
    assert notes == {f"n-{i}": 1 for i in range(1, 12)}  # n-1 once, never re-executed
    (dead,) = await renv.dead_letters(1)
    assert dead.headers["x-dead-letter-reason"] == "key_expired"


@pytest.mark.rabbitmq
async def test_a_malformed_operation_time_is_an_invalid_header(renv: ResilienceEnv) -> None:
    await _schema_sql(renv, "CREATE TABLE notes (key text NOT NULL, text text NOT NULL)")
    async with renv.run(renv.app(ShortLivedHandler())):
        await renv.send(b'{"text": "x"}', {"operation-id": "n-9", "operation-created-at": "yesterday"},
                        message_type="Note")
        (report,) = await renv.next_reports(1)
    assert (report.outcome, report.reason) == (Outcome.INVALID, "invalid_header")


def test_permanent_types_take_no_key_retention() -> None:
    class Charge(ShortLivedHandler):
        permanent = True

    with pytest.raises(ConfigurationError, match="permanent"):
        Charge()

    class Forever(ShortLivedHandler):
        permanent = True
        key_retention = None

    assert Forever().retention.key_seconds is None and Forever().retention.body_seconds == 1.0


async def test_prune_cli_dry_run_counts_and_changes_nothing(database_url: str) -> None:
    async with throwaway_schema(database_url, example_tables=False) as schema:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            await conn.execute(sql.SQL(
                "INSERT INTO {} (scope, key, tenant, operation_type, fingerprint, projection_version, state, "
                "result_body, body_expires_at, key_expires_at) VALUES "
                "('s', 'a', 't', 'o', 'f', 1, 'completed', '{{}}', now() - interval '1 s', now() + interval '1 h'),"
                "('s', 'b', 't', 'o', 'f', 1, 'failed', NULL, NULL, now() - interval '2 h'),"
                "('s', 'c', 't', 'o', 'f', 1, 'needs_reconciliation', NULL, NULL, now() - interval '2 h')"
            ).format(sql.Identifier(schema, "operations")))
        env = {"CONSUMER_KIT_DATABASE_URL": database_url, "CONSUMER_KIT_DB_SCHEMA": schema, "PATH": ""}
        command = [sys.executable, "-m", "consumer_kit", "prune"]
        dry = await asyncio.to_thread(subprocess.run, [*command, "--dry-run"], env=env, capture_output=True, text=True)
        assert dry.returncode == 0, dry.stderr
        assert "would delete 1 result bodies and 1 identities" in dry.stdout
        real = await asyncio.to_thread(subprocess.run, command, env=env, capture_output=True, text=True)
        assert "deleted 1 result bodies and 1 identities" in real.stdout, real.stderr
        rows = await fetch_all(database_url, schema, "SELECT key, result_body IS NULL FROM operations ORDER BY key")
        assert rows == [("a", True), ("c", True)]  # b's identity gone; c parked: never pruned


# -- lanes ----------------------------------------------------------------------------------------------


class Step(BaseModel):
    account: str
    seq: int


class OrderedHandler(Handler[Step]):
    """Records the order steps of each account reach it, and how many run at once (per account and
    overall)."""

    operation_type = "step.apply"

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, list[int]] = collections.defaultdict(list)
        self.running: collections.Counter[str] = collections.Counter()
        self.max_per_key = 0
        self.max_total = 0

    def operation_key(self, message: Step, envelope: Envelope) -> str:
        return f"{message.account}-{message.seq}"

    def partition_key(self, message: Step, envelope: Envelope) -> str:
        return message.account

    async def handle(self, message: Step, ctx: Context) -> Result:
        self.running[message.account] += 1
        self.max_per_key = max(self.max_per_key, self.running[message.account])
        self.max_total = max(self.max_total, sum(self.running.values()))
        try:
            self.seen[message.account].append(message.seq)
            await ctx.connection.execute("SELECT pg_sleep(0.002)")  # a little database work
            return Result("applied")
        finally:
            self.running[message.account] -= 1


@pytest.mark.rabbitmq
async def test_per_key_order_holds_with_concurrency_16_and_keys_run_in_parallel(renv: ResilienceEnv) -> None:
    """1,000 messages over 20 accounts, concurrency 16: each account's steps reach the handler in
    the order they were sent, one at a time; different accounts run in parallel."""
    handler = OrderedHandler()
    async with renv.run(renv.app(handler), concurrency=16):
        for seq in range(50):
            await asyncio.gather(*(
                renv.send(json.dumps({"account": f"acct-{a}", "seq": seq}).encode(), message_type="Step")
                for a in range(20)
            ))
        await renv.outcomes_until(lambda seen: count(seen, Outcome.EXECUTED) == 1000, timeout=90)
    assert {account: steps for account, steps in handler.seen.items()} == {
        f"acct-{a}": list(range(50)) for a in range(20)
    }
    assert handler.max_per_key == 1
    assert handler.max_total > 1


# -- versions ------------------------------------------------------------------------------------------


async def test_a_stale_expected_version_is_refused(database_url: str) -> None:
    async with throwaway_schema(database_url, example_tables=False) as schema:
        async with await psycopg.AsyncConnection.connect(
            database_url, autocommit=True, options=f"-c search_path={schema}"
        ) as conn:
            await conn.execute(ACCOUNTS_SQL)
            assert await apply_if_newer(conn, "credit_limits", {"account_id": "a"}, version=1,
                                        values={"limit_cents": 100})
            assert await update_expecting(conn, "credit_limits", {"account_id": "a"}, expected=1,
                                          values={"limit_cents": 200}) == 2
            with pytest.raises(StaleVersion) as stale:  # another writer moved it on
                await update_expecting(conn, "credit_limits", {"account_id": "a"}, expected=1,
                                       values={"limit_cents": 300})
            assert (stale.value.expected, stale.value.found) == (1, 2)
            with pytest.raises(LookupError):
                await update_expecting(conn, "credit_limits", {"account_id": "nobody"}, expected=1,
                                       values={"limit_cents": 1})
            cur = await conn.execute("SELECT limit_cents, version FROM credit_limits")
            assert await cur.fetchall() == [(200, 2)]


@pytest.mark.rabbitmq
async def test_a_late_old_event_never_rolls_newer_state_back(renv: ResilienceEnv) -> None:
    """v2 then v3 of an account's limit; then v1 arrives late (a new key: the ledger executes it)
    and v2 again (a duplicate): the limit stays v3's."""
    await _schema_sql(renv, ACCOUNTS_SQL)
    app = App("accounts-test")
    app.subscribe(renv.queue, CreditLimitHandler())
    async with renv.run(app):
        for version, limit in ((2, 500), (3, 700), (1, 100), (2, 500)):
            body = SetCreditLimit(account_id="acct-7", limit_cents=limit, version=version).model_dump_json()
            await renv.send(body.encode(), message_type="SetCreditLimit")
            await renv.next_reports(1)
    results = await renv.rows("SELECT key, result_status FROM operations ORDER BY key")
    assert results == [("acct-7-v1", "stale_ignored"), ("acct-7-v2", "applied"), ("acct-7-v3", "applied")]
    assert await renv.rows("SELECT limit_cents, version FROM credit_limits") == [(700, 3)]


# -- a hash-partitioned ledger ---------------------------------------------------------------------------


class Charge(BaseModel):
    amount: int


class ChargeHandler(Handler[Charge]):
    operation_type = "charge"
    result_retention = dt.timedelta(seconds=1)
    key_retention = dt.timedelta(seconds=1)

    async def handle(self, message: Charge, ctx: Context) -> Result:
        if message.amount < 0:
            raise PermanentFailure("negative")
        await ctx.connection.execute("INSERT INTO charges (key, amount) VALUES (%s, %s)", (ctx.operation.key, message.amount))
        return Result("charged")


async def test_claim_conflict_and_replay_behave_the_same_on_a_partitioned_ledger(database_url: str) -> None:
    async with throwaway_schema(database_url, example_tables=False, partitions=4) as schema:
        async with await psycopg.AsyncConnection.connect(
            database_url, autocommit=True, options=f"-c search_path={schema}"
        ) as conn:
            await conn.execute("CREATE TABLE charges (key text NOT NULL, amount int NOT NULL)")
        app = App("partitioned")
        app.subscribe("charges", ChargeHandler())
        async with runtime_for(app, database_url, schema) as runtime:
            broker = MemoryBroker()
            sends = [("k-1", 5)] * 5 + [("k-1", 6)] + [(f"k-{i}", i) for i in range(2, 30)] + [("k-neg", -1)] * 2
            for key, amount in sends:
                broker.send("charges", json.dumps({"amount": amount}).encode(), headers={"operation-id": key})
            reports: list[Any] = []

            async def on_delivery(delivery: Any) -> None:
                reports.append(await runtime.process(delivery))

            consumer = MemoryConsumer(broker)
            await consumer.subscribe("charges", on_delivery, prefetch=8)
            await broker.wait_idle(30)
            await consumer.close()
        outcomes = collections.Counter(r.outcome for r in reports)
        assert outcomes[Outcome.EXECUTED] == 29 and outcomes[Outcome.PAYLOAD_CONFLICT] == 1
        assert outcomes[Outcome.FAILED] == 1 and outcomes[Outcome.FAILED_RETAINED] == 1
        assert outcomes[Outcome.DUPLICATE] == 4  # and nothing else but waits on the claim:
        assert set(outcomes) <= {Outcome.EXECUTED, Outcome.DUPLICATE, Outcome.PAYLOAD_CONFLICT, Outcome.FAILED,
                                 Outcome.FAILED_RETAINED, Outcome.IN_PROGRESS}
        assert await fetch_all(database_url, schema, "SELECT count(*) FROM charges WHERE key = 'k-1'") == [(1,)]
        spread = await fetch_all(database_url, schema,
                                 "SELECT count(DISTINCT tableoid) FROM operations")
        assert spread == [(4,)]  # the rows live in all four partitions
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            pruner = Pruner(schema, grace=0)
            assert len(await pruner.tables(conn)) == 4
            await conn.execute(sql.SQL("UPDATE {} SET key_expires_at = now() - interval '1 s'").format(
                sql.Identifier(schema, "operations")))
            deleted = sum([await pruner.prune_identities(conn, table, 1000) for table in await pruner.tables(conn)])
        assert deleted == 30  # 29 completed + 1 failed, partition by partition


async def test_an_existing_unpartitioned_ledger_is_never_repartitioned_by_migrate(database_url: str) -> None:
    async with throwaway_schema(database_url, example_tables=False) as schema:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            with pytest.raises(ConfigurationError, match="not hash-partitioned"):
                await migrate(conn, schema, partitions=4)
