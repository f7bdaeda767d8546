"""The ``operations`` table: the claim and the transitions of one operation's row.

States: ``processing -> completed | failed | needs_reconciliation`` and
``needs_reconciliation -> completed | failed`` (operator or reconcile pass).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from psycopg import AsyncConnection, sql
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from consumer_kit.model.events import PendingEvent
from consumer_kit.model.fence import LEASE, LEASE_AND_TRANSACTION, TRANSACTION, Fence
from consumer_kit.model.identity import OperationIdentity
from consumer_kit.model.operation_row import OperationRow
from consumer_kit.model.results import StoredResult
from consumer_kit.model.retention import KEEP, Retention
from consumer_kit.outbox import events_cte, events_params
from consumer_kit.prepared import SessionStatement

PROCESSING = "processing"
COMPLETED = "completed"
FAILED = "failed"
NEEDS_RECONCILIATION = "needs_reconciliation"

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
        state, attempts, message_id, result_status, error_class, error_detail, completed_at,
        body_expires_at, key_expires_at, watch_since)
    VALUES (%(scope)s, %(key)s, %(tenant)s, %(operation_type)s, %(fingerprint)s,
        %(projection_version)s, {state}, 1, %(message_id)s, %(code)s, %(error_class)s, %(detail)s,
        CASE WHEN {state} = 'failed' THEN now() END,
        now() + make_interval(secs => %(body_keep)s), now() + make_interval(secs => %(key_keep)s),
        CASE WHEN {state} = 'needs_reconciliation' THEN now() END)
    ON CONFLICT (scope, key) DO UPDATE SET state = EXCLUDED.state, watch_since = EXCLUDED.watch_since,
           result_status = coalesce(EXCLUDED.result_status, o.result_status),
           error_class = EXCLUDED.error_class, error_detail = EXCLUDED.error_detail,
           lease_owner = NULL, lease_expires_at = NULL, updated_at = now(),
           completed_at = EXCLUDED.completed_at
     WHERE o.state = 'processing' AND o.fingerprint = EXCLUDED.fingerprint AND {only_if}
    """
)


_FENCES = {
    TRANSACTION: sql.SQL("pg_current_xact_id_if_assigned() = %(xid)s::xid8"),
    LEASE: sql.SQL("lease_owner = %(owner)s AND attempts = %(attempt)s"),
    LEASE_AND_TRANSACTION: sql.SQL(
        "lease_owner = %(owner)s AND attempts = %(attempt)s "
        "AND pg_current_xact_id_if_assigned() = %(xid)s::xid8"
    ),
}


@dataclass(frozen=True)
class Claim:
    """What :meth:`Ledger.claim` found: ``claimed`` (this transaction inserted the row), the row,
    and the id of the transaction that claimed (``None`` when not claimed)."""

    claimed: bool
    row: OperationRow | None
    xid: str | None


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
                    projection_version, state, attempts, lease_owner, lease_expires_at, message_id,
                    body_expires_at, key_expires_at, watch_since)
                VALUES (%(scope)s, %(key)s, %(tenant)s, %(operation_type)s, %(fingerprint)s,
                    %(projection_version)s, 'processing', 1, %(owner)s,
                    now() + make_interval(secs => %(lease)s), %(message_id)s,
                    now() + make_interval(secs => %(body_keep)s), now() + make_interval(secs => %(key_keep)s),
                    CASE WHEN %(watch)s THEN now() END)
                ON CONFLICT (scope, key) DO NOTHING
                RETURNING true AS claimed, pg_current_xact_id_if_assigned()::text AS xid, {columns}
            )
            SELECT * FROM claimed
            UNION ALL
            SELECT false AS claimed, NULL AS xid, {columns} FROM {table}
             WHERE scope = %(scope)s AND key = %(key)s AND NOT EXISTS (SELECT 1 FROM claimed)
            """
        ).format(table=table, columns=_ROW_COLUMNS))
        self._begin_and_claim = SessionStatement("ck_claim", self._claim)
        self._fetch = _render(sql.SQL(
            "SELECT false AS claimed, NULL AS xid, {columns} FROM {table} WHERE scope = %s AND key = %s"
        ).format(table=table, columns=_ROW_COLUMNS))
        # The completion is fenced: in the transactional path by the transaction that claimed (a
        # handler that sent COMMIT and began anew is caught even though a transaction is open); in
        # the leased path by lease owner and attempt (a worker whose lease was taken over cannot
        # complete). Each with and without the handler's outbox events in the same statement.
        complete = sql.SQL(
            """
            UPDATE {table} SET state = 'completed', result_status = %(status)s,
                   result_reference = %(reference)s, result_body = %(body)s, lease_owner = NULL,
                   lease_expires_at = NULL, updated_at = now(), completed_at = now(),
                   watch_since = NULL
             WHERE scope = %(scope)s AND key = %(key)s AND state = 'processing' AND {fence}
            """
        )
        self._complete: dict[tuple[str, bool], bytes] = {}
        for kind, fence in _FENCES.items():
            statement = complete.format(table=table, fence=fence)
            self._complete[kind, False] = _render(statement)
            self._complete[kind, True] = _render(
                sql.SQL("WITH {events} {complete}").format(events=events_cte(schema), complete=statement)
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
        # Compare-and-set on (owner, attempt): of two workers that found the same expired lease,
        # one takes it over; the attempt number it returns is its fencing token from then on.
        self._take_over = _render(sql.SQL(
            """
            UPDATE {table} SET lease_owner = %(owner)s,
                   lease_expires_at = now() + make_interval(secs => %(lease)s),
                   attempts = attempts + 1, updated_at = now(),
                   watch_since = coalesce(watch_since, now())
             WHERE scope = %(scope)s AND key = %(key)s AND state = 'processing'
               AND attempts = %(attempt)s AND lease_owner IS NOT DISTINCT FROM %(expected_owner)s
               AND (lease_expires_at IS NULL OR lease_expires_at <= now())
            RETURNING attempts
            """
        ).format(table=table))
        lease_fence = _FENCES[LEASE]
        self._renew = _render(sql.SQL(
            """
            UPDATE {table} SET lease_expires_at = now() + make_interval(secs => %(lease)s)
             WHERE scope = %(scope)s AND key = %(key)s AND state = 'processing' AND {fence}
            """
        ).format(table=table, fence=lease_fence))
        # Give the lease up at once (a handler fault): the retry takes it over and reconciles.
        self._give_up = _render(sql.SQL(
            """
            UPDATE {table} SET lease_expires_at = now(), updated_at = now()
             WHERE scope = %(scope)s AND key = %(key)s AND state = 'processing' AND {fence}
            """
        ).format(table=table, fence=lease_fence))
        # The leased path's own terminal transitions, fenced like its completion.
        self._end_leased = _render(sql.SQL(
            """
            UPDATE {table} SET state = %(state)s, result_status = %(code)s, error_class = %(error_class)s,
                   error_detail = %(detail)s, lease_owner = NULL, lease_expires_at = NULL,
                   updated_at = now(), completed_at = CASE WHEN %(state)s = 'failed' THEN now() END,
                   watch_since = CASE WHEN %(state)s = 'needs_reconciliation' THEN now() END
             WHERE scope = %(scope)s AND key = %(key)s AND state = 'processing' AND {fence}
            """
        ).format(table=table, fence=lease_fence))

    async def claim(
        self,
        conn: AsyncConnection[Any],
        identity: OperationIdentity,
        *,
        owner: str,
        lease_seconds: float,
        message_id: str | None,
        retention: Retention = KEEP,
        watch: bool = False,
        begin: bool = False,
    ) -> Claim:
        """Atomically claim ``identity`` in the caller's transaction (the leased path runs it as a
        transaction of its own, committed at once).

        Returns a :class:`Claim`: ``claimed`` when this transaction inserted the row (it owns the
        operation: until COMMIT, or under its lease), else the existing row; ``row`` is ``None``
        only if it vanished between the two reads (retention), and the caller retries. With
        ``watch`` (a claim committed on its own, under a lease), the row is watched by the stuck
        and reconciliation queries (``watch_since``) until it ends. With ``begin``, the claim opens
        the transaction: BEGIN goes with it in one round trip, the claim prepared once per session
        (:mod:`consumer_kit.prepared`).

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
            "watch": watch,
            **retention.params(),
        }
        if begin:
            found = await self._begin_and_claim.begin_and_fetchone(conn, params)
        else:
            async with conn.cursor(row_factory=dict_row) as cur:
                await cur.execute(self._claim, params)
                found = await cur.fetchone()
        if found is None:  # the winner committed after the claim's snapshot: read again
            async with conn.cursor(row_factory=dict_row) as cur:
                await cur.execute(self._fetch, (identity.scope, identity.key))
                found = await cur.fetchone()
        if found is None:
            return Claim(False, None, None)
        claimed = bool(found.pop("claimed"))
        xid = found.pop("xid")
        return Claim(claimed, OperationRow(**found), xid)

    async def fetch(self, conn: AsyncConnection[Any], scope: str, key: str) -> OperationRow | None:
        """The row for (scope, key), or ``None``."""
        async with conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(self._fetch, (scope, key))
            found = await cur.fetchone()
        if found is None:
            return None
        found.pop("claimed")
        found.pop("xid")
        return OperationRow(**found)

    async def complete(
        self,
        conn: AsyncConnection[Any],
        identity: OperationIdentity,
        result: StoredResult,
        *,
        fence: Fence,
        events: Sequence[PendingEvent] = (),
        correlation_id: str | None = None,
    ) -> bool:
        """Mark the claimed operation ``completed`` with its result and write its outbox
        ``events``, in one statement of the caller's transaction (the effect's transaction).

        Returns ``False`` when the fence no longer holds (nothing written): the transaction that
        claimed was ended by the handler, or the lease was taken over by another worker.
        """
        params: dict[str, Any] = {
            "status": result.status,
            "reference": result.reference,
            "body": None if result.body is None else Jsonb(result.body),
            "scope": identity.scope,
            "key": identity.key,
            **fence.params(),
        }
        if events:
            params.update(events_params(events, identity, correlation_id))
        cur = await conn.execute(self._complete[fence.kind, bool(events)], params)
        return cur.rowcount == 1

    async def take_over(
        self,
        conn: AsyncConnection[Any],
        identity: OperationIdentity,
        *,
        owner: str,
        expected_owner: str | None,
        expected_attempt: int,
        lease_seconds: float,
    ) -> int | None:
        """Take over a ``processing`` row whose lease expired, if it is still the one read
        (``expected_owner``, ``expected_attempt``): returns the new attempt number (the fencing
        token), or ``None`` when another worker got there first."""
        cur = await conn.execute(
            self._take_over,
            {"owner": owner, "lease": lease_seconds, "scope": identity.scope, "key": identity.key,
             "attempt": expected_attempt, "expected_owner": expected_owner},
        )
        row = await cur.fetchone()
        return None if row is None else int(row[0])

    async def renew(
        self, conn: AsyncConnection[Any], identity: OperationIdentity, fence: Fence, lease_seconds: float
    ) -> bool:
        """Extend the lease held under ``fence`` by ``lease_seconds`` from now. ``False``: it is
        no longer held (taken over, or the operation ended)."""
        cur = await conn.execute(
            self._renew, {"scope": identity.scope, "key": identity.key, "lease": lease_seconds, **fence.params()}
        )
        return cur.rowcount == 1

    async def give_up(self, conn: AsyncConnection[Any], identity: OperationIdentity, fence: Fence) -> bool:
        """Expire the lease held under ``fence`` now, so the next delivery takes it over and
        reconciles (a handler fault after a remote call may have happened)."""
        cur = await conn.execute(self._give_up, {"scope": identity.scope, "key": identity.key, **fence.params()})
        return cur.rowcount == 1

    async def end_leased(
        self,
        conn: AsyncConnection[Any],
        identity: OperationIdentity,
        fence: Fence,
        *,
        state: str,
        code: str | None,
        error_class: str,
        detail: str,
    ) -> bool:
        """Move a leased operation still held under ``fence`` to ``failed`` (a permanent failure)
        or ``needs_reconciliation`` (unknown outcome). ``False``: no longer held."""
        cur = await conn.execute(
            self._end_leased,
            {"scope": identity.scope, "key": identity.key, "state": state, "code": code,
             "error_class": error_class, "detail": detail[:2000], **fence.params()},
        )
        return cur.rowcount == 1

    async def record_failure(
        self,
        conn: AsyncConnection[Any],
        identity: OperationIdentity,
        *,
        message_id: str | None,
        code: str,
        error_class: str,
        detail: str,
        retention: Retention = KEEP,
    ) -> bool:
        """Record a retained ``failed`` row (duplicates replay it). ``False`` when another worker's
        row got there first (completed, failed, or processing under a live lease): that row decides."""
        return await self._upsert_terminal(
            conn, self._record_failure, identity, message_id=message_id, code=code,
            error_class=error_class, detail=detail, retention=retention,
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
        retention: Retention = KEEP,
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
                **retention.params(),
            },
        )
        return cur.rowcount == 1
