"""The ledger's attempts table on the real PostgreSQL: consumer-kit's own counts, and the run-alone
marker that tells a crash from a run that is alive elsewhere."""

from __future__ import annotations

from collections.abc import AsyncIterator

import psycopg
import pytest
from psycopg import sql

from consumer_kit.ledger import AttemptBook
from consumer_kit.model.identity import OperationIdentity
from tests.fixtures.harness import throwaway_schema

IDENTITY = OperationIdentity("t", "invoice.create", 1, "order-1", "f" * 64, 1)


@pytest.fixture
async def schema_conn(database_url: str) -> AsyncIterator[tuple[str, psycopg.AsyncConnection]]:
    async with throwaway_schema(database_url, example_tables=False) as schema:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            yield schema, conn


async def _expire_markers(schema: str, conn: psycopg.AsyncConnection) -> None:
    await conn.execute(sql.SQL("UPDATE {} SET running_until = now() - interval '1 ms'").format(
        sql.Identifier(schema, "attempts")))


async def test_two_live_runs_alone_of_one_operation_count_no_crash(schema_conn) -> None:
    """Two redelivered copies on two live workers: the second waits (``None``) instead of reading the
    first one's marker as a crash, and the first one's finish still clears its own marker."""
    schema, conn = schema_conn
    a, b = AttemptBook(schema, "host:1001"), AttemptBook(schema, "host:1002")
    first = await a.start_alone(conn, IDENTITY, message_id="m", delivery_count=2, crash_limit=3)
    assert first is not None and first.crashes == 0
    assert await b.start_alone(conn, IDENTITY, message_id="m", delivery_count=2, crash_limit=3) is None
    assert await a.renew_alone(conn, IDENTITY)
    assert not await b.renew_alone(conn, IDENTITY)  # not b's marker
    await a.finish_alone(conn, IDENTITY)
    second = await b.start_alone(conn, IDENTITY, message_id="m", delivery_count=3, crash_limit=3)
    assert second is not None and second.crashes == 0
    record = await a.fetch(conn, IDENTITY.scope, IDENTITY.key)
    assert record is not None and record.running_owner == "host:1002"
    assert [e["kind"] for e in record.history] == ["run_alone", "run_alone"]


async def test_an_expired_marker_is_a_crash_and_the_limit_parks(schema_conn) -> None:
    schema, conn = schema_conn
    book = AttemptBook(schema, "host:1")
    for expected in (0, 1, 2):
        counts = await book.start_alone(conn, IDENTITY, message_id="m", delivery_count=1, crash_limit=3)
        assert counts is not None and counts.crashes == expected
        await _expire_markers(schema, conn)  # the process died: nobody renews it
    parked = await book.start_alone(conn, IDENTITY, message_id="m", delivery_count=4, crash_limit=3)
    assert parked is not None and parked.crashes == 3
    record = await book.fetch(conn, IDENTITY.scope, IDENTITY.key)
    assert record is not None and record.running_owner is None  # parked: no new marker
    assert [e["kind"] for e in record.history] == [
        "run_alone", "crash", "run_alone", "crash", "run_alone", "crash", "parked"
    ]


async def test_failures_and_contentions_are_counted_apart(schema_conn) -> None:
    schema, conn = schema_conn
    book = AttemptBook(schema, "host:1")
    await book.count_failure(conn, IDENTITY, message_id="m", delivery_count=1, detail="KeyError at x.py:1")
    await book.count_contention(conn, IDENTITY, message_id="m", delivery_count=2, detail="LockNotAvailable")
    counts = await book.count_failure(conn, IDENTITY, message_id="m", delivery_count=3, detail="KeyError")
    assert (counts.failures, counts.contentions, counts.crashes) == (2, 1, 0)
