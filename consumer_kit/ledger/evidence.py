"""The ``evidence`` table: what a handler with external effects recorded about its remote calls.

``ctx.record_evidence(name, **facts)`` writes one row per call, in a short transaction of its own,
*fenced*: only while this worker still holds the operation's lease (owner and attempt). The row
lock taken on the operation (``FOR SHARE``) orders it against a take-over: either the evidence is
written before another worker takes the lease over (and that worker reads it when it reconciles),
or the take-over comes first and the write is refused.
"""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection, sql
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from consumer_kit.model.evidence import EvidenceRecord
from consumer_kit.model.fence import Fence
from consumer_kit.model.identity import OperationIdentity

_RECORD = """
    WITH held AS (
        SELECT 1 FROM {operations}
         WHERE scope = %(scope)s AND key = %(key)s AND state = 'processing'
           AND lease_owner = %(owner)s AND attempts = %(attempt)s
           FOR SHARE
    )
    INSERT INTO {evidence} (scope, key, name, attempt, worker, facts)
    SELECT %(scope)s, %(key)s, %(name)s, %(attempt)s, %(owner)s, %(facts)s FROM held
"""

_FETCH = """
    SELECT name, attempt, worker, facts, recorded_at FROM {evidence}
     WHERE scope = %s AND key = %s ORDER BY id
"""


class EvidenceBook:
    """Statements on ``<schema>.evidence``, rendered once per schema."""

    def __init__(self, schema: str) -> None:
        names = {"operations": sql.Identifier(schema, "operations"),
                 "evidence": sql.Identifier(schema, "evidence")}
        self._record = sql.SQL(_RECORD).format(**names).as_bytes(None)
        self._fetch = sql.SQL(_FETCH).format(**names).as_bytes(None)

    async def record(
        self, conn: AsyncConnection[Any], identity: OperationIdentity, fence: Fence, name: str,
        facts: dict[str, Any],
    ) -> bool:
        """Record ``facts`` about call ``name`` while ``fence`` (a lease) still holds. ``False``:
        the lease is no longer this worker's (nothing written)."""
        cur = await conn.execute(
            self._record,
            {"scope": identity.scope, "key": identity.key, "name": name, "facts": Jsonb(facts),
             **fence.params()},
        )
        return cur.rowcount == 1

    async def fetch(self, conn: AsyncConnection[Any], scope: str, key: str) -> list[EvidenceRecord]:
        """Every record of the operation, oldest first."""
        async with conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(self._fetch, (scope, key))
            return [EvidenceRecord(**row) for row in await cur.fetchall()]
