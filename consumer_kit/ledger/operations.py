"""The ``operations`` table: the claim and the transitions of one operation's row.

States: ``processing -> completed | failed | needs_reconciliation`` and
``needs_reconciliation -> completed | failed`` (operator or reconcile pass).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from psycopg import AsyncConnection
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from consumer_kit.db.prepared import SessionStatement
from consumer_kit.ledger.operation_sql import operation_statements
from consumer_kit.model.events import PendingEvent
from consumer_kit.model.fence import Fence
from consumer_kit.model.identity import OperationIdentity
from consumer_kit.model.operation_row import OperationRow
from consumer_kit.model.results import StoredResult
from consumer_kit.model.retention import KEEP, Retention
from consumer_kit.outbox import batch_events_params, events_params


@dataclass(frozen=True)
class Claim:
    """What :meth:`Ledger.claim` found: ``claimed`` (this transaction inserted the row), the row,
    and the id of the transaction that claimed (``None`` when not claimed)."""

    claimed: bool
    row: OperationRow | None
    xid: str | None


@dataclass(frozen=True)
class BatchClaim:
    """What :meth:`Ledger.claim_many` found: the ``(scope, key)`` this transaction inserted (it
    owns them until COMMIT), the rows that already existed, by ``(scope, key)``, and the id of
    the claiming transaction (``None`` when it inserted nothing). A key in neither had its row
    vanish between the two reads (retention): the caller runs it on its own."""

    claimed: frozenset[tuple[str, str]]
    rows: dict[tuple[str, str], OperationRow]
    xid: str | None


class Ledger:
    """The claim and the transitions of operations in ``<schema>.operations`` (statements in
    :mod:`consumer_kit.ledger.operation_sql`)."""

    def __init__(self, schema: str) -> None:
        self.schema = schema
        self._sql = operation_statements(schema)
        self._begin_and_claim = SessionStatement("ck_claim", self._sql.claim)
        self._begin_and_claim_many = SessionStatement("ck_claim_many", self._sql.batch.claim)

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
        (:mod:`consumer_kit.db.prepared`).

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
                await cur.execute(self._sql.claim, params)
                found = await cur.fetchone()
        if found is None:  # the winner committed after the claim's snapshot: read again
            async with conn.cursor(row_factory=dict_row) as cur:
                await cur.execute(self._sql.fetch, (identity.scope, identity.key))
                found = await cur.fetchone()
        if found is None:
            return Claim(False, None, None)
        claimed = bool(found.pop("claimed"))
        xid = found.pop("xid")
        return Claim(claimed, OperationRow(**found), xid)

    async def claim_many(
        self,
        conn: AsyncConnection[Any],
        identities: Sequence[OperationIdentity],
        *,
        owner: str,
        lease_seconds: float,
        message_ids: Sequence[str | None],
        retentions: Sequence[Retention],
    ) -> BatchClaim:
        """Open a transaction and claim every operation of a batch in it: BEGIN and one prepared
        statement in one round trip (the batch path; keys must be distinct), which also reads the
        rows that already existed; the ones the claim's snapshot did not show (a concurrent
        claimer committed meanwhile) are read again with a second statement.

        Raises:
            psycopg.errors.LockNotAvailable: a concurrent claimer held one of the keys past
                ``lock_timeout`` (the whole statement failed: nothing is claimed).
        """
        params = {
            "scope": [i.scope for i in identities],
            "key": [i.key for i in identities],
            "tenant": [i.tenant for i in identities],
            "operation_type": [i.operation_type for i in identities],
            "fingerprint": [i.fingerprint for i in identities],
            "projection_version": [i.projection_version for i in identities],
            "message_id": list(message_ids),
            "body_keep": [r.body_seconds for r in retentions],
            "key_keep": [r.key_seconds for r in retentions],
            "owner": owner,
            "lease": lease_seconds,
        }
        claimed: set[tuple[str, str]] = set()
        rows: dict[tuple[str, str], OperationRow] = {}
        xid: str | None = None
        for found in await self._begin_and_claim_many.begin_and_fetchall(conn, params):
            if found.pop("claimed"):
                claimed.add((found["scope"], found["key"]))
                xid = found.pop("xid")
            else:
                found.pop("xid")
                rows[found["scope"], found["key"]] = OperationRow(**found)
        unseen = [i for i in identities if (i.scope, i.key) not in claimed and (i.scope, i.key) not in rows]
        if unseen:  # the winner committed after the claim's snapshot: read again
            async with conn.cursor(row_factory=dict_row) as cur:
                await cur.execute(
                    self._sql.batch.fetch, {"scope": [i.scope for i in unseen], "key": [i.key for i in unseen]}
                )
                for found in await cur.fetchall():
                    found.pop("claimed")
                    found.pop("xid")
                    rows[found["scope"], found["key"]] = OperationRow(**found)
        return BatchClaim(frozenset(claimed), rows, xid)

    async def complete_many(
        self,
        conn: AsyncConnection[Any],
        completions: Sequence[tuple[OperationIdentity, StoredResult, Sequence[PendingEvent], str | None]],
        *,
        xid: str,
    ) -> bool:
        """Mark every claimed operation of a batch ``completed`` with its result and write all
        their outbox events, in one statement of the claiming transaction ``xid``:
        ``(identity, result, events, correlation id)`` per operation. ``False`` when the fence no
        longer holds for all of them (nothing written for those: a handler ended the claim's
        transaction)."""
        params: dict[str, Any] = {
            "scope": [c[0].scope for c in completions],
            "key": [c[0].key for c in completions],
            "status": [c[1].status for c in completions],
            "reference": [c[1].reference for c in completions],
            "body": [None if c[1].body is None else Jsonb(c[1].body) for c in completions],
            "xid": xid,
        }
        with_events = any(c[2] for c in completions)
        if with_events:
            params.update(batch_events_params([(c[2], c[0], c[3]) for c in completions]))
        cur = await conn.execute(self._sql.batch.complete[with_events], params)
        return cur.rowcount == len(completions)

    async def fetch(self, conn: AsyncConnection[Any], scope: str, key: str) -> OperationRow | None:
        """The row for (scope, key), or ``None``."""
        async with conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(self._sql.fetch, (scope, key))
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
        cur = await conn.execute(self._sql.complete[fence.kind, bool(events)], params)
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
            self._sql.take_over,
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
            self._sql.renew, {"scope": identity.scope, "key": identity.key, "lease": lease_seconds, **fence.params()}
        )
        return cur.rowcount == 1

    async def give_up(self, conn: AsyncConnection[Any], identity: OperationIdentity, fence: Fence) -> bool:
        """Expire the lease held under ``fence`` now, so the next delivery takes it over and
        reconciles (a handler fault after a remote call may have happened)."""
        cur = await conn.execute(self._sql.give_up, {"scope": identity.scope, "key": identity.key, **fence.params()})
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
            self._sql.end_leased,
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
            conn, self._sql.record_failure, identity, message_id=message_id, code=code,
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
            conn, self._sql.park, identity, message_id=message_id, code=None,
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
