"""What operators read and do by hand: list operations, show one with its evidence and attempts,
resolve a parked one (audited: who, when, note). Used by ``consumer-kit ledger``.

Bodies (``result_body``) are bulky and may hold personal data: they are read only when asked.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from psycopg import AsyncConnection, sql
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from consumer_kit.ledger.attempts import AttemptBook, AttemptRecord
from consumer_kit.ledger.evidence import EvidenceBook
from consumer_kit.model.evidence import OPERATOR_EVIDENCE, EvidenceRecord
from consumer_kit.model.operation_row import COMPLETED, FAILED, NEEDS_RECONCILIATION, PROCESSING

STATES = (PROCESSING, COMPLETED, FAILED, NEEDS_RECONCILIATION)

_SUMMARY_COLUMNS = """
    scope, key, state, attempts, lease_owner, lease_expires_at, coalesce(lease_expires_at <= now(), false)
    AS lease_expired, result_status, error_class, error_detail, message_id, created_at, updated_at,
    completed_at, resolved_by, resolved_at, resolution_note
"""

_LIST = """
    SELECT {columns} FROM {table}
     WHERE (%(state)s::text IS NULL OR state = %(state)s) AND updated_at <= now() - make_interval(secs => %(older_than)s)
       {watched}
     ORDER BY updated_at LIMIT %(limit)s
"""
# Processing and parked rows visible to others are the watched ones (migration 5): read them
# through the small watch index, not the whole ledger.
_WATCHED_STATES = (PROCESSING, NEEDS_RECONCILIATION)

_SHOW = "SELECT {columns}, fingerprint, projection_version, result_reference{body} FROM {table} WHERE scope = %s AND key = %s"

# An operator settles what the runtime could not: a parked operation, or one stuck processing
# under an expired lease (its worker is gone). A live lease is never overruled.
_RESOLVE = """
    UPDATE {table} SET state = %(state)s, result_status = coalesce(result_status, %(status)s),
           lease_owner = NULL, lease_expires_at = NULL, updated_at = now(), completed_at = now(),
           watch_since = NULL, resolved_by = %(by)s, resolved_at = now(), resolution_note = %(note)s
     WHERE scope = %(scope)s AND key = %(key)s
       AND (state = 'needs_reconciliation'
            OR (state = 'processing' AND (lease_expires_at IS NULL OR lease_expires_at <= now())))
    RETURNING state
"""


# "Not done": the operator checked that the remote effect did not happen. The row goes back to
# processing under a lease that has already run out, so the next delivery (the redriven message)
# takes it over; the operator's verdict, recorded as the operation's last evidence, tells that run
# to call again with the same downstream keys instead of asking ``reconcile`` (which said unknown).
_REOPEN = """
    WITH reopened AS (
        UPDATE {table} SET state = 'processing', lease_owner = NULL, lease_expires_at = now(),
               updated_at = now(), watch_since = now(), resolved_by = %(by)s, resolved_at = now(),
               resolution_note = %(note)s
         WHERE scope = %(scope)s AND key = %(key)s
           AND (state = 'needs_reconciliation'
                OR (state = 'processing' AND (lease_expires_at IS NULL OR lease_expires_at <= now())))
        RETURNING attempts
    )
    INSERT INTO {evidence} (scope, key, name, attempt, worker, facts)
    SELECT %(scope)s, %(key)s, %(name)s, attempts, %(worker)s, %(facts)s FROM reopened
    RETURNING 'processing'
"""

_STATE = "SELECT state, coalesce(lease_expires_at > now(), false) FROM {table} WHERE scope = %s AND key = %s"

COMPLETED_DECISION, NOT_DONE_DECISION, FAILED_DECISION = "completed", "not_done", "failed"
DECISIONS = (COMPLETED_DECISION, NOT_DONE_DECISION, FAILED_DECISION)
"""What an operator may decide about a parked operation: the effect happened (``completed``), it
did not and may be tried again with the same downstream keys (``not_done``), it did not and will
not (``failed``)."""


@dataclass(frozen=True)
class OperationSummary:
    """One ``operations`` row as an operator sees it (no bodies)."""

    scope: str
    key: str
    state: str
    attempts: int
    lease_owner: str | None
    lease_expires_at: dt.datetime | None
    lease_expired: bool
    result_status: str | None
    error_class: str | None
    error_detail: str | None
    message_id: str | None
    created_at: dt.datetime
    updated_at: dt.datetime
    completed_at: dt.datetime | None
    resolved_by: str | None
    resolved_at: dt.datetime | None
    resolution_note: str | None


@dataclass(frozen=True)
class OperationDetail:
    """An operation with everything recorded about it."""

    summary: OperationSummary
    fingerprint: str
    projection_version: int
    result_reference: str | None
    result_body: Any = None
    evidence: list[EvidenceRecord] = field(default_factory=list)
    attempts: AttemptRecord | None = None


class LedgerInspector:
    """Operator statements on one schema's ledger."""

    def __init__(self, schema: str) -> None:
        self.schema = schema
        self._table = sql.Identifier(schema, "operations")
        self._evidence = EvidenceBook(schema)
        self._attempts = AttemptBook(schema, worker="operator")

    async def list(
        self, conn: AsyncConnection[Any], state: str | None, *, older_than: float = 0.0, limit: int = 100
    ) -> list[OperationSummary]:
        """Operations in ``state`` (``None``: every state) not updated for ``older_than`` seconds,
        oldest first, at most ``limit``.

        Raises:
            ValueError: an unknown state.
        """
        if state is not None and state not in STATES:
            raise ValueError(f"state must be one of {', '.join(STATES)}, not {state!r}")
        watched = "AND watch_since IS NOT NULL" if state in _WATCHED_STATES else ""
        query = sql.SQL(_LIST).format(
            columns=sql.SQL(_SUMMARY_COLUMNS), table=self._table, watched=sql.SQL(watched)
        )
        async with conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(query, {"state": state, "older_than": older_than, "limit": limit})
            return [OperationSummary(**row) for row in await cur.fetchall()]

    async def show(
        self, conn: AsyncConnection[Any], scope: str, key: str, *, bodies: bool = False
    ) -> OperationDetail | None:
        """The operation (``None`` when the ledger has no such row), its evidence and attempts;
        ``result_body`` only with ``bodies``."""
        query = sql.SQL(_SHOW).format(
            columns=sql.SQL(_SUMMARY_COLUMNS), table=self._table,
            body=sql.SQL(", result_body") if bodies else sql.SQL(""),
        )
        async with conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(query, (scope, key))
            row = await cur.fetchone()
        if row is None:
            return None
        extra = {name: row.pop(name) for name in ("fingerprint", "projection_version", "result_reference")}
        body = row.pop("result_body", None)
        return OperationDetail(
            summary=OperationSummary(**row), result_body=body,
            evidence=await self._evidence.fetch(conn, scope, key),
            attempts=await self._attempts.fetch(conn, scope, key), **extra,
        )

    async def resolve(
        self, conn: AsyncConnection[Any], scope: str, key: str, *, decision: str, note: str, by: str,
        status: str | None = None,
    ) -> str | None:
        """Settle a parked (or stuck, lease expired) operation, recording who, when and why:
        ``completed`` or ``failed`` end it (its parked message, redriven, answers as a duplicate or
        a replayed failure); ``not_done`` reopens it so the redriven message runs the handler
        again with the same downstream keys (see ``_REOPEN``). Returns the new state, or ``None``
        when the row is not parked (already terminal, missing, or processing under a live lease).

        Raises:
            ValueError: ``decision`` not one of :data:`DECISIONS`.
        """
        if decision not in DECISIONS:
            raise ValueError(f"decision must be one of {', '.join(DECISIONS)}, not {decision!r}")
        if decision == NOT_DONE_DECISION:
            statement = sql.SQL(_REOPEN).format(table=self._table, evidence=sql.Identifier(self.schema, "evidence"))
            params: dict[str, Any] = {
                "scope": scope, "key": key, "by": by, "note": note, "name": OPERATOR_EVIDENCE,
                "worker": f"operator:{by}", "facts": Jsonb({"verdict": "not_done", "by": by, "note": note}),
            }
        else:
            completed = decision == COMPLETED_DECISION
            statement = sql.SQL(_RESOLVE).format(table=self._table)
            params = {"scope": scope, "key": key, "state": COMPLETED if completed else FAILED,
                      "status": status or ("resolved" if completed else "resolved_failed"), "by": by,
                      "note": note}
        cur = await conn.execute(statement, params)
        row = await cur.fetchone()
        return None if row is None else str(row[0])

    async def state(self, conn: AsyncConnection[Any], scope: str, key: str) -> tuple[str, bool] | None:
        """(state, whether a lease is live now) of the operation; ``None`` when there is no row."""
        cur = await conn.execute(sql.SQL(_STATE).format(table=self._table), (scope, key))
        row = await cur.fetchone()
        return None if row is None else (str(row[0]), bool(row[1]))
