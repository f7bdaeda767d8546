"""The hot path's claim, prepared once per session and sent with BEGIN (consumer_kit.db.prepared), on
the real PostgreSQL: prepared once, and still right after its session lost the statement."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import psycopg
import pytest

from consumer_kit.db import prepared
from consumer_kit.ledger import Ledger
from consumer_kit.model.identity import OperationIdentity
from consumer_kit.pipeline.transaction import rollback
from tests.fixtures.harness import throwaway_schema


def identity() -> OperationIdentity:
    return OperationIdentity("t", "invoice.create", 1, f"order-{uuid.uuid4().hex}", "f" * 64, 1)


@pytest.fixture
async def ledger_conn(database_url: str) -> AsyncIterator[tuple[Ledger, psycopg.AsyncConnection]]:
    async with throwaway_schema(database_url, example_tables=False) as schema:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            yield Ledger(schema), conn


async def claim_and_commit(ledger: Ledger, conn: psycopg.AsyncConnection, ident: OperationIdentity) -> bool:
    claim = await ledger.claim(conn, ident, owner="w", lease_seconds=30, message_id="m", begin=True)
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS  # BEGIN went with it
    await conn.execute(b"COMMIT")
    return claim.claimed


async def session_statements(conn: psycopg.AsyncConnection) -> list[str]:
    cur = await conn.execute(b"SELECT name FROM pg_prepared_statements WHERE name LIKE 'ck_claim%%'")
    return [name for (name,) in await cur.fetchall()]


async def test_the_claim_is_prepared_once_per_session_and_answers_like_the_plain_claim(ledger_conn) -> None:
    ledger, conn = ledger_conn
    ident = identity()
    for _ in range(3):
        assert await claim_and_commit(ledger, conn, identity())
    assert len(await session_statements(conn)) == 1
    assert await claim_and_commit(ledger, conn, ident)
    again = await ledger.claim(conn, ident, owner="w2", lease_seconds=30, message_id="m2", begin=True)
    plain = await ledger.claim(conn, ident, owner="w2", lease_seconds=30, message_id="m2")
    await conn.execute(b"COMMIT")
    assert not again.claimed and again.row is not None and again.row.lease_owner == "w"
    assert (again.claimed, again.row) == (plain.claimed, plain.row)


@pytest.mark.parametrize("lost_by", ["DEALLOCATE ALL", "DISCARD ALL"])
async def test_a_statement_deallocated_behind_our_back_is_prepared_again(ledger_conn, lost_by: str) -> None:
    ledger, conn = ledger_conn
    assert await claim_and_commit(ledger, conn, identity())
    await conn.execute(lost_by.encode())  # as a handler might, or psycopg after a ROLLBACK
    assert await session_statements(conn) == []
    ident = identity()
    assert await claim_and_commit(ledger, conn, ident)
    assert len(await session_statements(conn)) == 1
    row = await ledger.fetch(conn, ident.scope, ident.key)
    assert row is not None and row.state == "processing"


async def test_after_a_rollback_psycopg_deallocates_and_the_next_claim_still_runs(ledger_conn) -> None:
    ledger, conn = ledger_conn
    for _ in range(6):  # psycopg prepares statements of its own after 5 runs...
        await ledger.fetch(conn, "s", "k")
    assert await claim_and_commit(ledger, conn, identity())
    await ledger.claim(conn, identity(), owner="w", lease_seconds=30, message_id="m", begin=True)
    await rollback(conn, 5.0)  # ...and drops them all, ours with them, after a ROLLBACK
    assert await session_statements(conn) == []
    assert await claim_and_commit(ledger, conn, identity())


async def test_a_forgotten_statement_still_on_the_session_is_reused(ledger_conn) -> None:
    ledger, conn = ledger_conn
    assert await claim_and_commit(ledger, conn, identity())
    prepared.forget(conn)  # e.g. a ROLLBACK after which psycopg had nothing to deallocate
    assert await claim_and_commit(ledger, conn, identity())
    assert len(await session_statements(conn)) == 1
