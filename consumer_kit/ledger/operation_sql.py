"""The SQL of the ``operations`` table, composed once per schema (executed by
:class:`consumer_kit.ledger.operations.Ledger`).

Every statement is built with ``psycopg.sql`` and rendered to bytes at start-up: the schema is an
identifier that never changes, so nothing is composed on the hot path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from psycopg import sql

from consumer_kit.model.fence import LEASE, LEASE_AND_TRANSACTION, TRANSACTION
from consumer_kit.model.operation_row import FAILED, NEEDS_RECONCILIATION
from consumer_kit.outbox import batch_events_cte, events_cte

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
class BatchStatements:
    """The batch path's statements (one round trip each for a whole batch; arrays of one element
    per operation, see ``Ledger.claim_many``).

    Attributes:
        claim: insert every operation of the batch that has no row yet (``unnest``, ``ON CONFLICT
            DO NOTHING``) and, in the same statement, read the rows that already existed.
        fetch: the rows of the given ``(scope, key)`` arrays (a fresh snapshot, for the rows a
            concurrent claimer committed after the claim's snapshot).
        complete: the completion of every claimed row, fenced by the claiming transaction,
            without and with the outbox events of the batch (key ``False`` / ``True``).
    """

    claim: bytes
    fetch: bytes
    complete: Mapping[bool, bytes]


@dataclass(frozen=True)
class OperationStatements:
    """The rendered statements on ``<schema>.operations`` (bytes, ready to execute).

    Attributes:
        claim: insert-or-read of one operation (named parameters; see ``Ledger.claim``).
        fetch: the row of ``(scope, key)`` (positional parameters).
        complete: the fenced completion per ``(fence kind, with outbox events)``.
        record_failure, park: terminal upserts (failed; needs_reconciliation).
        take_over, renew, give_up, end_leased: the leased path's fenced transitions.
    """

    claim: bytes
    fetch: bytes
    complete: Mapping[tuple[str, bool], bytes]
    record_failure: bytes
    park: bytes
    take_over: bytes
    renew: bytes
    give_up: bytes
    end_leased: bytes
    batch: BatchStatements


def _render(statement: sql.Composable) -> bytes:
    """Compose once at start-up, not on every execute (the identifiers never change)."""
    return statement.as_bytes(None)



def operation_statements(schema: str) -> OperationStatements:
    """Compose and render every statement on ``<schema>.operations``."""
    table = sql.Identifier(schema, "operations")
    # Claim and, in the same round trip, read the existing row when the claim lost. If the winner
    # committed after this statement's snapshot was taken, the second SELECT sees nothing and
    # ``claim`` reads again with a fresh snapshot.
    claim = _render(sql.SQL(
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
    fetch = _render(sql.SQL(
        "SELECT false AS claimed, NULL AS xid, {columns} FROM {table} WHERE scope = %s AND key = %s"
    ).format(table=table, columns=_ROW_COLUMNS))
    # The completion is fenced: in the transactional path by the transaction that claimed (a
    # handler that sent COMMIT and began anew is caught even though a transaction is open); in
    # the leased path by lease owner and attempt (a worker whose lease was taken over cannot
    # complete). Each with and without the handler's outbox events in the same statement.
    complete_template = sql.SQL(
        """
        UPDATE {table} SET state = 'completed', result_status = %(status)s,
               result_reference = %(reference)s, result_body = %(body)s, lease_owner = NULL,
               lease_expires_at = NULL, updated_at = now(), completed_at = now(),
               watch_since = NULL
         WHERE scope = %(scope)s AND key = %(key)s AND state = 'processing' AND {fence}
        """
    )
    completes: dict[tuple[str, bool], bytes] = {}
    for kind, fence in _FENCES.items():
        statement = complete_template.format(table=table, fence=fence)
        completes[kind, False] = _render(statement)
        completes[kind, True] = _render(
            sql.SQL("WITH {events} {complete}").format(events=events_cte(schema), complete=statement)
        )
    # A permanent failure is recorded in its own transaction, after the handler's was rolled
    # back: insert the failed row, or turn a processing row into it when its lease is over.
    record_failure = _render(_TERMINAL_UPSERT.format(
        table=table, state=sql.Literal(FAILED),
        only_if=sql.SQL("(o.lease_expires_at IS NULL OR o.lease_expires_at <= now())"),
    ))
    # Park an operation whose outcome the runtime cannot know (the handler ended the
    # transaction itself): whatever committed stays, and nobody re-runs it blindly.
    park = _render(_TERMINAL_UPSERT.format(
        table=table, state=sql.Literal(NEEDS_RECONCILIATION), only_if=sql.SQL("true")
    ))
    # Compare-and-set on (owner, attempt): of two workers that found the same expired lease,
    # one takes it over; the attempt number it returns is its fencing token from then on.
    take_over = _render(sql.SQL(
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
    renew = _render(sql.SQL(
        """
        UPDATE {table} SET lease_expires_at = now() + make_interval(secs => %(lease)s)
         WHERE scope = %(scope)s AND key = %(key)s AND state = 'processing' AND {fence}
        """
    ).format(table=table, fence=lease_fence))
    # Give the lease up at once (a handler fault): the retry takes it over and reconciles.
    give_up = _render(sql.SQL(
        """
        UPDATE {table} SET lease_expires_at = now(), updated_at = now()
         WHERE scope = %(scope)s AND key = %(key)s AND state = 'processing' AND {fence}
        """
    ).format(table=table, fence=lease_fence))
    # The leased path's own terminal transitions, fenced like its completion.
    end_leased = _render(sql.SQL(
        """
        UPDATE {table} SET state = %(state)s, result_status = %(code)s, error_class = %(error_class)s,
               error_detail = %(detail)s, lease_owner = NULL, lease_expires_at = NULL,
               updated_at = now(), completed_at = CASE WHEN %(state)s = 'failed' THEN now() END,
               watch_since = CASE WHEN %(state)s = 'needs_reconciliation' THEN now() END
         WHERE scope = %(scope)s AND key = %(key)s AND state = 'processing' AND {fence}
        """
    ).format(table=table, fence=lease_fence))

    return OperationStatements(
        batch=_batch_statements(schema, table, complete_template),
        claim=claim, fetch=fetch, complete=completes, record_failure=record_failure, park=park,
        take_over=take_over, renew=renew, give_up=give_up, end_leased=end_leased,
    )


def _batch_statements(schema: str, table: sql.Identifier, complete_template: sql.SQL) -> BatchStatements:
    # The claim of a batch: one row per operation from parallel arrays. Rows are inserted in
    # (scope, key) order, so two batches that share keys lock them in the same order (one waits,
    # neither deadlocks). The existing rows come from the statement's snapshot; a row committed by
    # a concurrent claimer after it is read again with ``fetch`` (a fresh snapshot).
    claim = _render(sql.SQL(
        """
        WITH input AS (
            SELECT * FROM unnest(%(scope)s::text[], %(key)s::text[], %(tenant)s::text[],
                %(operation_type)s::text[], %(fingerprint)s::text[], %(projection_version)s::int[],
                %(message_id)s::text[], %(body_keep)s::float8[], %(key_keep)s::float8[])
              AS i(scope, key, tenant, operation_type, fingerprint, projection_version, message_id,
                   body_keep, key_keep)
        ),
        claimed AS (
            INSERT INTO {table} AS o (scope, key, tenant, operation_type, fingerprint,
                projection_version, state, attempts, lease_owner, lease_expires_at, message_id,
                body_expires_at, key_expires_at)
            SELECT i.scope, i.key, i.tenant, i.operation_type, i.fingerprint, i.projection_version,
                   'processing', 1, %(owner)s, now() + make_interval(secs => %(lease)s), i.message_id,
                   now() + make_interval(secs => i.body_keep), now() + make_interval(secs => i.key_keep)
              FROM input AS i ORDER BY i.scope, i.key
            ON CONFLICT (scope, key) DO NOTHING
            RETURNING o.scope, o.key
        )
        SELECT true AS claimed, pg_current_xact_id_if_assigned()::text AS xid, scope, key,
               NULL AS fingerprint, NULL::int AS projection_version, NULL AS state, NULL::int AS attempts,
               NULL AS lease_owner, NULL::bool AS lease_live, NULL AS result_status,
               NULL AS result_reference, NULL::jsonb AS result_body, NULL AS error_class,
               NULL AS error_detail, NULL::timestamptz AS completed_at
          FROM claimed
        UNION ALL
        SELECT false AS claimed, NULL AS xid, {columns} FROM {table}
         WHERE (scope, key) IN (SELECT scope, key FROM input)
           AND (scope, key) NOT IN (SELECT scope, key FROM claimed)
        """
    ).format(table=table, columns=_ROW_COLUMNS))
    fetch = _render(sql.SQL(
        """
        SELECT false AS claimed, NULL AS xid, {columns} FROM {table}
         WHERE (scope, key) IN (SELECT * FROM unnest(%(scope)s::text[], %(key)s::text[]))
        """
    ).format(table=table, columns=_ROW_COLUMNS))
    # The completion of a batch: every claimed row in one UPDATE ... FROM unnest(...), fenced by
    # the claiming transaction like the single completion; the events of every item in the same
    # statement (each event carries its own operation and correlation id).
    complete = sql.SQL(
        """
        UPDATE {table} AS o SET state = 'completed', result_status = d.status,
               result_reference = d.reference, result_body = d.body, lease_owner = NULL,
               lease_expires_at = NULL, updated_at = now(), completed_at = now(), watch_since = NULL
          FROM unnest(%(scope)s::text[], %(key)s::text[], %(status)s::text[], %(reference)s::text[],
                      %(body)s::jsonb[]) AS d(scope, key, status, reference, body)
         WHERE o.scope = d.scope AND o.key = d.key AND o.state = 'processing'
           AND {fence}
        """
    ).format(table=table, fence=_FENCES[TRANSACTION])
    completes = {
        False: _render(complete),
        True: _render(sql.SQL("WITH {events} {complete}").format(events=batch_events_cte(schema), complete=complete)),
    }
    return BatchStatements(claim=claim, fetch=fetch, complete=completes)
