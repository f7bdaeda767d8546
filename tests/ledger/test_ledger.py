"""Ledger statements on the real PostgreSQL: the claim and the terminal upserts."""

from __future__ import annotations

from collections.abc import AsyncIterator

import psycopg
import pytest
from psycopg import sql

from consumer_kit.ledger import EvidenceBook, Ledger
from consumer_kit.model.fence import Fence
from consumer_kit.model.identity import OperationIdentity
from consumer_kit.model.results import StoredResult
from tests.fixtures.harness import throwaway_schema

IDENTITY = OperationIdentity("t", "invoice.create", 1, "order-1", "f" * 64, 1)


@pytest.fixture
async def ledger_conn(database_url: str) -> AsyncIterator[tuple[Ledger, psycopg.AsyncConnection]]:
    async with throwaway_schema(database_url, example_tables=False) as schema:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            yield Ledger(schema), conn


async def _state(ledger: Ledger, conn: psycopg.AsyncConnection) -> tuple[str, str | None]:
    row = await ledger.fetch(conn, IDENTITY.scope, IDENTITY.key)
    assert row is not None
    return row.state, row.result_status


async def test_claim_then_duplicate_claim_sees_the_row(ledger_conn) -> None:
    ledger, conn = ledger_conn
    first = await ledger.claim(conn, IDENTITY, owner="w1", lease_seconds=30, message_id="m1")
    assert first.claimed and first.row is not None and first.row.state == "processing" and first.row.lease_live
    assert first.xid is not None  # the claiming transaction's id: the transactional path's fence
    again = await ledger.claim(conn, IDENTITY, owner="w2", lease_seconds=30, message_id="m2")
    assert not again.claimed and again.row is not None and again.row.lease_owner == "w1"
    assert again.xid is None


async def test_failure_is_recorded_on_an_empty_key(ledger_conn) -> None:
    ledger, conn = ledger_conn
    assert await ledger.record_failure(conn, IDENTITY, message_id="m", code="closed", error_class="E", detail="")
    assert await _state(ledger, conn) == ("failed", "closed")


async def test_failure_never_overwrites_a_completed_or_failed_row(ledger_conn) -> None:
    ledger, conn = ledger_conn
    await ledger.claim(conn, IDENTITY, owner="w1", lease_seconds=30, message_id="m1")
    assert await ledger.complete(conn, IDENTITY, StoredResult("created", "7"), fence=Fence.of_lease("w1", 1))
    assert not await ledger.record_failure(conn, IDENTITY, message_id="m", code="closed", error_class="E", detail="")
    assert await _state(ledger, conn) == ("completed", "created")


async def test_failure_waits_for_a_live_lease_and_takes_an_expired_one(ledger_conn) -> None:
    ledger, conn = ledger_conn
    await ledger.claim(conn, IDENTITY, owner="w1", lease_seconds=30, message_id="m1")
    assert not await ledger.record_failure(conn, IDENTITY, message_id="m", code="closed", error_class="E", detail="")
    assert await _state(ledger, conn) == ("processing", None)
    await conn.execute(
        sql.SQL("UPDATE {} SET lease_expires_at = now() - interval '1 s'").format(
            sql.Identifier(ledger.schema, "operations")
        )
    )
    assert await ledger.record_failure(conn, IDENTITY, message_id="m", code="closed", error_class="E", detail="")
    assert await _state(ledger, conn) == ("failed", "closed")


async def test_park_moves_processing_to_needs_reconciliation_only(ledger_conn) -> None:
    ledger, conn = ledger_conn
    await ledger.claim(conn, IDENTITY, owner="w1", lease_seconds=30, message_id="m1")
    await ledger.park(conn, IDENTITY, message_id="m", error_class="E", detail="handler committed")
    assert (await _state(ledger, conn))[0] == "needs_reconciliation"


async def test_completion_writes_the_events_in_publish_order(ledger_conn) -> None:
    from consumer_kit.outbox import pending_event

    ledger, conn = ledger_conn
    events = [
        pending_event(destination="d", routing_key=f"r{i}", message_type="E", payload={"i": i},
                      partition_key="p" if i % 2 else None, headers={"h": str(i)})
        for i in range(5)
    ]
    await ledger.claim(conn, IDENTITY, owner="w1", lease_seconds=30, message_id="m1")
    assert await ledger.complete(
        conn, IDENTITY, StoredResult("ok", None), fence=Fence.of_lease("w1", 1), events=events, correlation_id="c-9"
    )
    cur = await conn.execute(
        sql.SQL(
            "SELECT event_id, routing_key, payload, headers, operation_key, correlation_id, partition_key"
            " FROM {} ORDER BY id"
        ).format(sql.Identifier(ledger.schema, "outbox"))
    )
    rows = await cur.fetchall()
    assert [r[0] for r in rows] == [e.event_id for e in events]
    assert [r[1] for r in rows] == [f"r{i}" for i in range(5)]
    assert [r[2] for r in rows] == [{"i": i} for i in range(5)]
    assert rows[3][3] == {"h": "3"} and rows[3][4] == IDENTITY.key and rows[3][5] == "c-9"
    assert [r[6] for r in rows] == [None, "p", None, "p", None]
    assert await _state(ledger, conn) == ("completed", "ok")


# -- fences ---------------------------------------------------------------------------------------


async def test_the_transaction_fence_holds_only_in_the_claiming_transaction(ledger_conn) -> None:
    ledger, conn = ledger_conn
    async with conn.transaction():
        claim = await ledger.claim(conn, IDENTITY, owner="w1", lease_seconds=30, message_id="m1")
        assert claim.xid is not None
        fence = Fence.of_transaction(claim.xid)
    async with conn.transaction():  # COMMIT; BEGIN: another transaction
        await ledger.claim(conn, OperationIdentity("t", "other", 1, "k", "f" * 64, 1),
                           owner="w1", lease_seconds=30, message_id="m2")  # gets a transaction id
        assert not await ledger.complete(conn, IDENTITY, StoredResult("ok", None), fence=fence)
    assert await _state(ledger, conn) == ("processing", None)


async def test_the_lease_fence_refuses_another_owner_or_attempt_and_take_over_is_a_compare_and_set(
    ledger_conn,
) -> None:
    ledger, conn = ledger_conn
    await ledger.claim(conn, IDENTITY, owner="w1", lease_seconds=30, message_id="m1")
    # a live lease is never taken over
    assert await ledger.take_over(conn, IDENTITY, owner="w2", expected_owner="w1", expected_attempt=1,
                                  lease_seconds=30) is None
    assert await ledger.renew(conn, IDENTITY, Fence.of_lease("w1", 1), 30)
    assert not await ledger.renew(conn, IDENTITY, Fence.of_lease("w2", 1), 30)
    assert await ledger.give_up(conn, IDENTITY, Fence.of_lease("w1", 1))  # expired now
    # of two workers that read (w1, 1), one wins; the other's expectation is stale
    assert await ledger.take_over(conn, IDENTITY, owner="w2", expected_owner="w1", expected_attempt=1,
                                  lease_seconds=30) == 2
    await ledger.give_up(conn, IDENTITY, Fence.of_lease("w2", 2))
    assert await ledger.take_over(conn, IDENTITY, owner="w3", expected_owner="w1", expected_attempt=1,
                                  lease_seconds=30) is None
    # the old owner is fenced out of every write
    evidence = EvidenceBook(ledger.schema)
    assert not await evidence.record(conn, IDENTITY, Fence.of_lease("w1", 1), "send", {"x": 1})
    assert not await ledger.complete(conn, IDENTITY, StoredResult("ok", None), fence=Fence.of_lease("w1", 1))
    assert not await ledger.end_leased(conn, IDENTITY, Fence.of_lease("w1", 1), state="failed", code="c",
                                       error_class="E", detail="")
    assert await evidence.fetch(conn, IDENTITY.scope, IDENTITY.key) == []
    # the holder of attempt 2 may still write (its lease expired, nobody took it over)
    assert await evidence.record(conn, IDENTITY, Fence.of_lease("w2", 2), "send", {"x": 2})
    assert await ledger.end_leased(conn, IDENTITY, Fence.of_lease("w2", 2), state="needs_reconciliation",
                                   code=None, error_class="E", detail="unknown")
    assert await _state(ledger, conn) == ("needs_reconciliation", None)
    (record,) = await evidence.fetch(conn, IDENTITY.scope, IDENTITY.key)
    assert (record.name, record.attempt, record.worker, record.facts) == ("send", 2, "w2", {"x": 2})


@pytest.mark.parametrize("partitions", [None, 4])
async def test_the_transactional_completion_is_a_hot_update(database_url: str, partitions) -> None:
    """No index may cover a column the completion changes (ledger migration 5): a claim then its
    completion in one transaction updates the row in place (HOT), on a plain and on a
    partitioned ledger. Counted by PostgreSQL for the current transaction."""
    async with throwaway_schema(database_url, example_tables=False, partitions=partitions) as schema:
        ledger = Ledger(schema)
        tables = ["operations"] if partitions is None else [f"operations_p{r}" for r in range(partitions)]
        async with await psycopg.AsyncConnection.connect(database_url) as conn:
            for i in range(300):
                identity = OperationIdentity("t", "invoice.create", 1, f"order-{i}", "f" * 64, 1)
                claim = await ledger.claim(conn, identity, owner="w1", lease_seconds=30, message_id=f"m{i}")
                assert claim.claimed and claim.xid is not None
                assert await ledger.complete(conn, identity, StoredResult("created", str(i), {"n": i}),
                                             fence=Fence.of_transaction(claim.xid))
            cur = await conn.execute(
                "SELECT sum(pg_stat_get_xact_tuples_updated(c.oid)),"
                "       sum(pg_stat_get_xact_tuples_hot_updated(c.oid))"
                "  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
                " WHERE n.nspname = %s AND c.relname = ANY(%s)", (schema, tables))
            updated, hot = await cur.fetchone()
            await conn.rollback()
    assert updated == 300
    assert hot == updated, f"only {hot} of {updated} completions were HOT updates"
