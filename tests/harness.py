"""Test harness: a throwaway schema on the real PostgreSQL and a runtime over it."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import psycopg
from psycopg import sql

from consumer_kit import App, Settings
from consumer_kit.ledger import migrate
from consumer_kit.pipeline.runtime import Runtime, open_pool
from examples.invoices.app import create_tables


@asynccontextmanager
async def throwaway_schema(
    database_url: str, *, example_tables: bool = True, partitions: int | None = None
) -> AsyncIterator[str]:
    """A fresh schema holding the ledger (hash-partitioned into ``partitions`` if given), the
    outbox and (unless ``example_tables=False``) the invoices example's tables; dropped afterwards."""
    schema = "ck_" + uuid.uuid4().hex[:10]
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await migrate(conn, schema, partitions=partitions)
        await conn.execute(sql.SQL("SET search_path = {}").format(sql.Identifier(schema)))
        if example_tables:
            await create_tables(conn)
    try:
        yield schema
    finally:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            await conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


@asynccontextmanager
async def runtime_for(
    app: App, database_url: str, schema: str, **overrides: Any
) -> AsyncIterator[Runtime]:
    settings = Settings(database_url=database_url, db_schema=schema, **overrides)
    pool = await open_pool(settings, database_url, search_path=schema)
    try:
        yield Runtime(app, pool, settings)
    finally:
        await pool.close()


async def fetch_all(database_url: str, schema: str, query: str, *params: Any) -> list[tuple[Any, ...]]:
    async with await psycopg.AsyncConnection.connect(
        database_url, autocommit=True, options=f"-c search_path={schema}"
    ) as conn:
        cur = await conn.execute(query, params)
        return await cur.fetchall()
