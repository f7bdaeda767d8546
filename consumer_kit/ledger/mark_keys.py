"""The deployment's mark key: read from the ledger schema (table ``mark_keys``, made by migration 6)
and installed (:mod:`consumer_kit.codec.marks`) in a worker, relay or CLI."""

from __future__ import annotations

import logging
from typing import Any

from psycopg import AsyncConnection, sql

from consumer_kit.codec import marks
from consumer_kit.settings import DatabaseSettings

logger = logging.getLogger("consumer_kit.marks")


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



async def install_mark_keys(conn: AsyncConnection[Any], settings: DatabaseSettings) -> marks.Keyring:
    """Sign and verify marks with ``settings.mark_key`` when set, else with the key stored in the
    ledger schema; ``settings.mark_key_previous`` is accepted too. Without either, the process
    keeps its own random key (its marks are believed by itself only) and says so.

    Raises:
        ValueError: a key shorter than :data:`consumer_kit.codec.marks.MIN_KEY_BYTES` bytes.
    """
    previous = [] if settings.mark_key_previous is None else [settings.mark_key_previous.get_secret_value().encode()]
    if settings.mark_key is not None:
        return marks.install(settings.mark_key.get_secret_value().encode(), previous, source="settings")
    stored = await stored_mark_key(conn, settings.db_schema)
    if stored is None:
        logger.warning(
            "no mark key in schema %s (run `consumer-kit migrate`): marks are signed with this process's "
            "own key, so other processes ignore them", settings.db_schema,
        )
        return marks.installed()
    return marks.install(stored, previous, source="ledger")
