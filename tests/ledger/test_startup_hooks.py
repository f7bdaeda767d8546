"""Start-up hooks (App.on_startup) of workers started together run one at a time, under the
schema's start-up advisory lock, on the real PostgreSQL."""

from __future__ import annotations

import asyncio
import uuid

import psycopg
from psycopg import sql

from consumer_kit.ledger.migrations import run_startup_hooks


async def test_hooks_of_workers_started_together_never_race(database_url: str) -> None:
    schema = "ck_hooks_" + uuid.uuid4().hex[:8]
    table = sql.Identifier(schema, "app_table")
    inside: list[int] = []
    overlaps: list[int] = []

    async def hook(conn: psycopg.AsyncConnection) -> None:
        inside.append(1)
        if len(inside) > 1:
            overlaps.append(len(inside))
        # the example's idempotent DDL, which races without the lock (pg_type unique violation)
        await conn.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} (id int)").format(table))
        await conn.execute(b"SELECT 1")  # a round trip in which another worker could enter
        inside.pop()

    async def worker() -> None:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            await run_startup_hooks(conn, schema, [hook])

    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as admin:
        await admin.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        try:
            await asyncio.gather(*(worker() for _ in range(8)))
        finally:
            await admin.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
    assert overlaps == []
