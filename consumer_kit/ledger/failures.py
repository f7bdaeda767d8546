"""A permanent failure recorded by the transaction that claimed the operation, with the result a
replay must return (the HTTP front door's stored error response).

The runtime records a failure in a transaction of its own after rolling the handler's back
(:meth:`consumer_kit.ledger.Ledger.record_failure`). The HTTP front door runs the endpoint after a
savepoint instead: on a permanent failure it rolls back to the savepoint (the endpoint's writes
and events go, the claim stays) and turns its own ``processing`` row into ``failed`` here, in the
same transaction, so no concurrent request can claim the key in between.
"""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection, sql
from psycopg.types.json import Jsonb

from consumer_kit.model.identity import OperationIdentity


class ClaimedFailures:
    """The ``failed`` transition of a claimed row on ``<schema>.operations``."""

    def __init__(self, schema: str) -> None:
        # Fenced like the transactional completion: only the transaction that claimed may end it.
        self._fail = sql.SQL(
            """
            UPDATE {table} SET state = 'failed', result_status = %(code)s, result_body = %(body)s,
                   error_class = %(error_class)s, error_detail = %(detail)s, lease_owner = NULL,
                   lease_expires_at = NULL, updated_at = now(), completed_at = now()
             WHERE scope = %(scope)s AND key = %(key)s AND state = 'processing'
               AND pg_current_xact_id_if_assigned() = %(xid)s::xid8
            """
        ).format(table=sql.Identifier(schema, "operations")).as_bytes(None)

    async def fail_claimed(
        self,
        conn: AsyncConnection[Any],
        identity: OperationIdentity,
        *,
        xid: str,
        code: str,
        error_class: str,
        detail: str,
        body: Any,
    ) -> bool:
        """Mark the operation this transaction (id ``xid``) claimed ``failed``, with ``code``
        (<= 200 characters), ``detail`` (<= 2,000) and ``body`` (JSON, replayed to retries).

        Returns ``False`` when the fence no longer holds (the claiming transaction was ended):
        nothing written.
        """
        cur = await conn.execute(
            self._fail,
            {
                "scope": identity.scope, "key": identity.key, "xid": xid, "code": code[:200],
                "error_class": error_class, "detail": detail[:2000],
                "body": None if body is None else Jsonb(body),
            },
        )
        return cur.rowcount == 1
