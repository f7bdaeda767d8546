"""The ``operations`` table: the claim and the transitions of one operation's row.

States: ``processing -> completed | failed | needs_reconciliation`` and
``needs_reconciliation -> completed | failed`` (operator or reconcile pass).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from psycopg import AsyncConnection, sql
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from consumer_kit.identity import OperationIdentity
from consumer_kit.outbox import PendingEvent, events_cte, events_params
from consumer_kit.outcomes import StoredResult

PROCESSING = "processing"
COMPLETED = "completed"
FAILED = "failed"
NEEDS_RECONCILIATION = "needs_reconciliation"

@dataclass(frozen=True)
class OperationRow:
    """One ledger row, as the runtime needs it."""

    scope: str
    key: str
    fingerprint: str
    projection_version: int
    state: str
    attempts: int
    lease_owner: str | None
    lease_live: bool
    result_status: str | None
    result_reference: str | None
    result_body: Any
    error_class: str | None
    error_detail: str | None
    completed_at: dt.datetime | None

    @property
    def stored_result(self) -> StoredResult:
        return StoredResult(self.result_status, self.result_reference, self.result_body)


_ROW_COLUMNS = sql.SQL(
    "scope, key, fingerprint, projection_version, state, attempts, lease_owner, "
    "coalesce(lease_expires_at > now(), false) AS lease_live, result_status, result_reference, "
    "result_body, error_class, error_detail, completed_at"
)


# Insert an operation straight into a terminal state, or move a ``processing`` row (of the same
# fingerprint) into it where ``only_if`` holds; completed and failed rows are never overwritten.
_TERMINAL_UPSERT = sql.SQL(
    """
    INSERT INTO {table} AS o (scope, key, tenant, operation_type, fingerprint, projection_version,
        state, attempts, message_id, result_status, error_class, error_detail, completed_at)
    VALUES (%(scope)s, %(key)s, %(tenant)s, %(operation_type)s, %(fingerprint)s,
        %(projection_version)s, {state}, 1, %(message_id)s, %(code)s, %(error_class)s, %(detail)s,
        CASE WHEN {state} = 'failed' THEN now() END)
    ON CONFLICT (scope, key) DO UPDATE SET state = EXCLUDED.state,
           result_status = coalesce(EXCLUDED.result_status, o.result_status),
           error_class = EXCLUDED.error_class, error_detail = EXCLUDED.error_detail,
           lease_owner = NULL, lease_expires_at = NULL, updated_at = now(),
           completed_at = EXCLUDED.completed_at
     WHERE o.state = 'processing' AND o.fingerprint = EXCLUDED.fingerprint AND {only_if}
    """
)


def _render(statement: sql.Composable) -> bytes:
    """Compose once at start-up, not on every execute (the identifiers never change)."""
    return statement.as_bytes(None)


class Ledger:
    """Statements on ``<schema>.operations``, rendered once per schema."""

    def __init__(self, schema: str) -> None:
        self.schema = schema
        table = sql.Identifier(schema, "operations")
        # Claim and, in the same round trip, read the existing row when the claim lost. If the winner
        # committed after this statement's snapshot was taken, the second SELECT sees nothing and
        # ``claim`` reads again with a fresh snapshot.
        self._claim = _render(sql.SQL(
            """
            WITH claimed AS (
                INSERT INTO {table} AS o (scope, key, tenant, operation_type, fingerprint,
                    projection_version, state, attempts, lease_owner, lease_expires_at, message_id)
                VALUES (%(scope)s, %(key)s, %(tenant)s, %(operation_type)s, %(fingerprint)s,
                    %(projection_version)s, 'processing', 1, %(owner)s,
                    now() + make_interval(secs => %(lease)s), %(message_id)s)
                ON CONFLICT (scope, key) DO NOTHING
                RETURNING true AS claimed, {columns}
            )
            SELECT * FROM claimed
            UNION ALL
            SELECT false AS claimed, {columns} FROM {table}
             WHERE scope = %(scope)s AND key = %(key)s AND NOT EXISTS (SELECT 1 FROM claimed)
            """
        ).format(table=table, columns=_ROW_COLUMNS))
        self._fetch = _render(sql.SQL(
            "SELECT false AS claimed, {columns} FROM {table} WHERE scope = %s AND key = %s"
        ).format(table=table, columns=_ROW_COLUMNS))
        complete = sql.SQL(
            """
            UPDATE {table} SET state = 'completed', result_status = %(status)s,
                   result_reference = %(reference)s, result_body = %(body)s, lease_owner = NULL,
                   lease_expires_at = NULL, updated_at = now(), completed_at = now()
             WHERE scope = %(scope)s AND key = %(key)s AND state = 'processing'
            """
        ).format(table=table)
        self._complete = _render(complete)
        # The same completion with the handler's outbox events written in the same statement.
        self._complete_with_events = _render(
            sql.SQL("WITH {events} {complete}").format(events=events_cte(schema), complete=complete)
        )
        # A permanent failure is recorded in its own transaction, after the handler's was rolled
        # back: insert the failed row, or turn a processing row into it when its lease is over.
        self._record_failure = _render(_TERMINAL_UPSERT.format(
            table=table, state=sql.Literal(FAILED),
            only_if=sql.SQL("(o.lease_expires_at IS NULL OR o.lease_expires_at <= now())"),
        ))
        # Park an operation whose outcome the runtime cannot know (the handler ended the
        # transaction itself): whatever committed stays, and nobody re-runs it blindly.
        self._park = _render(_TERMINAL_UPSERT.format(
            table=table, state=sql.Literal(NEEDS_RECONCILIATION), only_if=sql.SQL("true")
        ))
        # Conditional write: only one worker can take over a given expired lease.
        self._take_over = _render(sql.SQL(
            """
            UPDATE {table} SET lease_owner = %s, lease_expires_at = now() + make_interval(secs => %s),
                   attempts = attempts + 1, updated_at = now()
             WHERE scope = %s AND key = %s AND state = 'processing'
               AND (lease_expires_at IS NULL OR lease_expires_at <= now())
            RETURNING attempts
            """
        ).format(table=table))

    async def claim(
        self,
        conn: AsyncConnection[Any],
        identity: OperationIdentity,
        *,
        owner: str,
        lease_seconds: float,
        message_id: str | None,
    ) -> tuple[bool, OperationRow | None]:
        """Atomically claim ``identity`` inside the caller's transaction.

        Returns ``(True, row)`` when this transaction inserted the row (it owns the operation until
        COMMIT), else ``(False, existing_row)``; ``existing_row`` is ``None`` only if the row vanished
        between the two reads (retention), in which case the caller retries.

        Raises:
            psycopg.errors.LockNotAvailable: a concurrent claimer held the key past ``lock_timeout``.
        """
        params = {
            "scope": identity.scope,
            "key": identity.key,
            "tenant": identity.tenant,
            "operation_type": identity.operation_type,
            "fingerprint": identity.fingerprint,
            "projection_version": identity.projection_version,
            "owner": owner,
            "lease": lease_seconds,
            "message_id": message_id,
        }
        async with conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(self._claim, params)
            found = await cur.fetchone()
            if found is None:
                await cur.execute(self._fetch, (identity.scope, identity.key))
                found = await cur.fetchone()
        if found is None:
            return False, None
        claimed = bool(found.pop("claimed"))
        return claimed, OperationRow(**found)

    async def fetch(self, conn: AsyncConnection[Any], scope: str, key: str) -> OperationRow | None:
        """The row for (scope, key), or ``None``."""
        async with conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(self._fetch, (scope, key))
            found = await cur.fetchone()
        if found is None:
            return None
        found.pop("claimed")
        return OperationRow(**found)

    async def complete(
        self,
        conn: AsyncConnection[Any],
        identity: OperationIdentity,
        result: StoredResult,
        *,
        events: Sequence[PendingEvent] = (),
        correlation_id: str | None = None,
    ) -> None:
        """Mark the claimed operation ``completed`` with its result and write its outbox
        ``events``, in one statement of the caller's transaction (the effect's transaction).

        Raises:
            RuntimeError: the row was not ``processing`` (changed inside the handler's transaction).
        """
        params: dict[str, Any] = {
            "status": result.status,
            "reference": result.reference,
            "body": None if result.body is None else Jsonb(result.body),
            "scope": identity.scope,
            "key": identity.key,
        }
        statement = self._complete
        if events:
            params.update(events_params(events, identity, correlation_id))
            statement = self._complete_with_events
        cur = await conn.execute(statement, params)
        if cur.rowcount != 1:
            raise RuntimeError(f"ledger row {identity.scope}/{identity.key} was not processing at completion")

    async def record_failure(
        self,
        conn: AsyncConnection[Any],
        identity: OperationIdentity,
        *,
        message_id: str | None,
        code: str,
        error_class: str,
        detail: str,
    ) -> bool:
        """Record a retained ``failed`` row (duplicates replay it). ``False`` when another worker's
        row got there first (completed, failed, or processing under a live lease): that row decides."""
        return await self._upsert_terminal(
            conn, self._record_failure, identity, message_id=message_id, code=code,
            error_class=error_class, detail=detail,
        )

    async def park(
        self,
        conn: AsyncConnection[Any],
        identity: OperationIdentity,
        *,
        message_id: str | None,
        error_class: str,
        detail: str,
    ) -> None:
        """Mark the operation ``needs_reconciliation`` (inserting the row if the claim was lost);
        a ``completed`` or ``failed`` row is left as it is. Run in its own transaction."""
        await self._upsert_terminal(
            conn, self._park, identity, message_id=message_id, code=None,
            error_class=error_class, detail=detail,
        )

    async def _upsert_terminal(
        self,
        conn: AsyncConnection[Any],
        statement: bytes,
        identity: OperationIdentity,
        *,
        message_id: str | None,
        code: str | None,
        error_class: str,
        detail: str,
    ) -> bool:
        cur = await conn.execute(
            statement,
            {
                "scope": identity.scope,
                "key": identity.key,
                "tenant": identity.tenant,
                "operation_type": identity.operation_type,
                "fingerprint": identity.fingerprint,
                "projection_version": identity.projection_version,
                "message_id": message_id,
                "code": code,
                "error_class": error_class,
                "detail": detail,
            },
        )
        return cur.rowcount == 1

    async def take_over_expired_lease(
        self, conn: AsyncConnection[Any], scope: str, key: str, *, owner: str, lease_seconds: float
    ) -> bool:
        """Take over a ``processing`` row whose lease has expired. ``True`` when this call won."""
        cur = await conn.execute(self._take_over, (owner, lease_seconds, scope, key))
        return cur.rowcount == 1
