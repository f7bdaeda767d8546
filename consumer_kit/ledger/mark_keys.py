"""Reading the deployment's mark key (table ``mark_keys``, made by migration 6)."""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection, sql


async def stored_mark_key(conn: AsyncConnection[Any], schema: str) -> bytes | None:
    """The random key ``consumer-kit migrate`` stored in ``schema`` (32 bytes), ``None`` when the
    schema has none (not migrated yet)."""
    table = sql.Identifier(schema, "mark_keys")
    cur = await conn.execute("SELECT to_regclass(%s) IS NOT NULL", (table.as_string(conn),))
    row = await cur.fetchone()
    if not (row and row[0]):
        return None
    cur = await conn.execute(sql.SQL("SELECT secret FROM {} WHERE id = 1").format(table))
    row = await cur.fetchone()
    return bytes(row[0]) if row else None
