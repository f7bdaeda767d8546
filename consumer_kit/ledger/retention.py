"""Retention: delete what an operation's retention says may go, in bounded batches.

Two steps, each a series of short autocommit statements (``FOR UPDATE SKIP LOCKED``: never
waiting on, nor blocking, a row a worker holds), safe while workers run:

1. **bodies**: ``result_body`` of completed and failed operations past ``body_expires_at`` is set
   to NULL; the identity stays, so a replayed message is still a duplicate (its replayed result
   has no body);
2. **identities**: completed and failed rows past ``key_expires_at`` (plus a grace for clock skew
   between producers and the database) are deleted with their attempts and evidence. A message of
   such an operation arriving later is older than its key retention, so the runtime refuses it as
   ``key_expired`` instead of executing it anew (it never claims a message that old).

Rows still ``processing`` or ``needs_reconciliation`` are never touched. On a hash-partitioned
ledger each partition is pruned on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from psycopg import AsyncConnection, sql

from consumer_kit.ledger.migrations import partition_names

_COUNT = """
    SELECT count(*) FILTER (WHERE body_expires_at <= now()),
           count(*) FILTER (WHERE key_expires_at <= now() - make_interval(secs => %(grace)s))
      FROM {table} WHERE state IN ('completed', 'failed')
"""

_BODIES = """
    WITH doomed AS (
        SELECT scope, key FROM {table}
         WHERE body_expires_at <= now() AND state IN ('completed', 'failed')
         ORDER BY body_expires_at LIMIT %(batch)s FOR UPDATE SKIP LOCKED)
    UPDATE {table} AS o SET result_body = NULL, body_expires_at = NULL
      FROM doomed WHERE o.scope = doomed.scope AND o.key = doomed.key
"""

_IDENTITIES = """
    WITH doomed AS (
        SELECT scope, key FROM {table}
         WHERE key_expires_at <= now() - make_interval(secs => %(grace)s) AND state IN ('completed', 'failed')
         ORDER BY key_expires_at LIMIT %(batch)s FOR UPDATE SKIP LOCKED),
    gone AS (
        DELETE FROM {table} AS o USING doomed WHERE o.scope = doomed.scope AND o.key = doomed.key
        RETURNING o.scope, o.key),
    attempts AS (
        DELETE FROM {attempts} AS a USING gone WHERE a.scope = gone.scope AND a.key = gone.key),
    evidence AS (
        DELETE FROM {evidence} AS e USING gone WHERE e.scope = gone.scope AND e.key = gone.key)
    SELECT count(*) FROM gone
"""


@dataclass(frozen=True)
class PruneCounts:
    """Rows whose ``bodies`` and ``identities`` may go now."""

    bodies: int
    identities: int


class Pruner:
    """Prunes one schema's ledger.

    Args:
        schema: the ledger's schema.
        grace: seconds an identity outlives its ``key_expires_at`` (clock skew between the
            producers that stamp ``operation-created-at`` and the database).
    """

    def __init__(self, schema: str, *, grace: float = 3600.0) -> None:
        self.schema = schema
        self.grace = grace

    async def tables(self, conn: AsyncConnection[Any]) -> list[str]:
        """The tables to prune one by one: each partition, or ``operations`` itself."""
        return await partition_names(conn, self.schema) or ["operations"]

    async def count(self, conn: AsyncConnection[Any]) -> PruneCounts:
        """What a prune would delete now (for ``--dry-run``)."""
        cur = await conn.execute(
            sql.SQL(_COUNT).format(table=sql.Identifier(self.schema, "operations")), {"grace": self.grace}
        )
        row = await cur.fetchone()
        assert row is not None
        return PruneCounts(int(row[0]), int(row[1]))

    async def prune_bodies(self, conn: AsyncConnection[Any], table: str, batch: int) -> int:
        """One batch of step 1 on ``table``; returns bodies deleted (fewer than ``batch``: done)."""
        cur = await conn.execute(
            sql.SQL(_BODIES).format(table=sql.Identifier(self.schema, table)), {"batch": batch}
        )
        return cur.rowcount

    async def prune_identities(self, conn: AsyncConnection[Any], table: str, batch: int) -> int:
        """One batch of step 2 on ``table``; returns identity rows deleted."""
        cur = await conn.execute(
            sql.SQL(_IDENTITIES).format(
                table=sql.Identifier(self.schema, table), attempts=sql.Identifier(self.schema, "attempts"),
                evidence=sql.Identifier(self.schema, "evidence"),
            ),
            {"batch": batch, "grace": self.grace},
        )
        row = await cur.fetchone()
        return int(row[0]) if row else 0
