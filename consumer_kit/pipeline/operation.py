"""The operation state machine: the ledger's questions, answered once for every caller.

The transactional path (:mod:`consumer_kit.pipeline.transactional`), the leased path
(:mod:`consumer_kit.pipeline.leased`) and the HTTP front door (:mod:`consumer_kit.http.pipeline`)
ask the same questions of the ``operations`` row of a (scope, key); :class:`Operations` answers
each of them in one place and returns a neutral :class:`~consumer_kit.model.verdict.Verdict`:

* **claim** with ``INSERT ... ON CONFLICT DO NOTHING`` (:meth:`Operations.claim`). A concurrent
  claimer waits on the unique index until the first transaction ends, bounded by ``lock_timeout``:
  then ``in_progress`` (``claim_lock_timeout``), never a parallel run;
* **an existing row decides** (:meth:`Operations.decide`), in this order: another intent is a
  ``conflict``; ``completed`` is a ``duplicate`` (the stored result answers); ``failed`` is a
  ``replayed_failure``; ``needs_reconciliation`` stays parked; ``processing`` under a live lease is
  ``in_progress`` (``lease_held``); under an expired lease it is ``lease_recoverable`` (the leased
  path takes it over and reconciles; the others park it: :meth:`Operations.park`);
* **complete**, **record a failure**, **park**, **take a lease over**: the ledger writes and what it
  means when their fence no longer holds.

The projection-version rule (one policy, for every caller): a row whose fingerprint differs from
this message's or request's is compared under the projection version it was recorded with (the
caller's ``earlier`` projections, see :data:`IntentUnder`). Same fingerprint there: the same
intent. Another fingerprint: a ``conflict``. A version the caller can no longer compute (not
declared any more, or the input cannot be projected under it): **intents cannot be compared**,
``needs_reconciliation`` (``projection_unknown``): never executed, never replayed as a duplicate.
The runtime dead-letters it as ``needs_reconciliation``; the HTTP front door answers its
``needs-reconciliation`` problem.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from psycopg import errors as pg_errors

from consumer_kit.db.pool import bounded
from consumer_kit.errors import TransactionEnded
from consumer_kit.ledger import Claim, Ledger
from consumer_kit.ledger.failures import ClaimedFailures
from consumer_kit.model import operation_row as states
from consumer_kit.model.events import PendingEvent
from consumer_kit.model.fence import Fence
from consumer_kit.model.identity import OperationIdentity
from consumer_kit.model.operation_row import OperationRow
from consumer_kit.model.results import StoredResult
from consumer_kit.model.retention import Retention
from consumer_kit.model.verdict import Verdict, VerdictKind
from consumer_kit.pipeline.transaction import begin_and_claim
from consumer_kit.settings import Settings

__all__ = ["IntentUnder", "Operations"]

IntentUnder = Callable[[int], "str | None"]
"""The caller's fingerprint of this message (or request) under an earlier projection version;
``None``: it cannot be computed any more (the version is not declared, or the input cannot be
projected under it). Called only when a stored row's fingerprint and version differ."""


class Operations:
    """The state machine on the ledger of ``settings.db_schema``.

    Args:
        settings: ``lock_timeout`` and ``statement_timeout`` (seconds) bound the claim,
            ``statement_timeout`` every other statement; ``lease_seconds`` for a lease.
        worker_id: the claim's owner (the lease owner name of this process).
    """

    def __init__(self, settings: Settings, worker_id: str) -> None:
        self.settings = settings
        self.worker_id = worker_id
        self.ledger = Ledger(settings.db_schema)
        self.failures = ClaimedFailures(settings.db_schema)

    # -- claim and the existing row ----------------------------------------------------------------

    async def claim(
        self,
        conn: psycopg.AsyncConnection[Any],
        identity: OperationIdentity,
        intent_under: IntentUnder,
        *,
        message_id: str | None,
        retention: Retention,
        begin: bool = False,
        watch: bool = False,
    ) -> Claim | Verdict:
        """Claim ``identity``: the :class:`~consumer_kit.ledger.Claim` when this transaction
        inserted the row (it owns the operation), else the existing row's :class:`Verdict`.
        With ``begin`` the claim opens the transaction (BEGIN and the prepared claim in one round
        trip); with ``watch`` (a claim committed on its own, under a lease) the row is watched.

        Raises:
            StaleConnection: (``begin``) the pooled connection was dead; nothing was sent.
            psycopg.Error: the database refused the claim (the caller rolls back and classifies).
        """
        try:
            # The claim may wait lock_timeout on a concurrent claimer, then must answer.
            async with bounded(self.settings.lock_timeout + self.settings.statement_timeout, "the claim"):
                claiming = self.ledger.claim(
                    conn, identity, owner=self.worker_id, lease_seconds=self.settings.lease_seconds,
                    message_id=message_id, retention=retention, watch=watch, begin=begin,
                )
                claim = await (begin_and_claim(conn, claiming) if begin else claiming)
        except pg_errors.LockNotAvailable:
            # Only a lock wait on the claim itself means "in progress"; a lock timeout inside the
            # handler (on a business row) is contention.
            return Verdict.in_progress("claim_lock_timeout")
        if claim.claimed:
            return claim
        if claim.row is None:  # deleted between the claim's two reads: the next try claims afresh
            return Verdict.in_progress("row_vanished")
        return self.decide(claim.row, identity, intent_under)

    async def claim_many(
        self,
        conn: psycopg.AsyncConnection[Any],
        batch: Sequence[tuple[OperationIdentity, IntentUnder, str | None, Retention]],
    ) -> tuple[str | None, list[Verdict | None]]:
        """Open a transaction on ``conn`` and claim a batch of distinct operations ``(identity,
        intent_under, message_id, retention)`` in it, BEGIN and one statement in one round trip: the claiming
        transaction's id (``None``: nothing claimed) and, per operation in order, ``None`` when
        this transaction claimed it, else the existing row's :class:`Verdict` (the same
        :meth:`decide` as one claim; a row that vanished between the reads is ``in_progress``
        ``row_vanished``, as for one claim).

        Raises:
            psycopg.errors.LockNotAvailable: a concurrent claimer held one of the keys past
                ``lock_timeout``: the statement failed and the transaction is aborted (which key
                cannot be told: the caller runs the items one by one).
            psycopg.Error: the database refused the claim.
        """
        async with bounded(self.settings.lock_timeout + self.settings.statement_timeout, "the batch claim"):
            found = await self.ledger.claim_many(
                conn, [b[0] for b in batch], owner=self.worker_id, lease_seconds=self.settings.lease_seconds,
                message_ids=[b[2] for b in batch], retentions=[b[3] for b in batch],
            )
        verdicts: list[Verdict | None] = []
        for identity, intent_under, _, _ in batch:
            where = (identity.scope, identity.key)
            if where in found.claimed:
                verdicts.append(None)
                continue
            row = found.rows.get(where)
            verdicts.append(Verdict.in_progress("row_vanished") if row is None else self.decide(row, identity, intent_under))
        return found.xid, verdicts

    def decide(self, row: OperationRow, identity: OperationIdentity, intent_under: IntentUnder) -> Verdict:
        """What an existing row means for this message or request (order in the module docstring)."""
        if row.fingerprint != identity.fingerprint:
            differs = self._compare_intent(row, identity, intent_under)
            if differs is not None:
                return differs
        if row.state == states.COMPLETED:
            return Verdict(VerdictKind.DUPLICATE, row=row)
        if row.state == states.FAILED:
            return Verdict(VerdictKind.REPLAYED_FAILURE, why=row.result_status or "", row=row)
        if row.state == states.NEEDS_RECONCILIATION:
            return Verdict.needs_reconciliation(
                "parked", "operation awaits reconciliation; redrive once it is resolved", row
            )
        if row.lease_live:
            return Verdict.in_progress("lease_held", row)
        return Verdict(VerdictKind.LEASE_RECOVERABLE, row=row)

    @staticmethod
    def _compare_intent(
        row: OperationRow, identity: OperationIdentity, intent_under: IntentUnder
    ) -> Verdict | None:
        """The stored fingerprint differs: compare under the row's projection version (module
        docstring). ``None``: the same intent."""
        conflict = Verdict(
            VerdictKind.CONFLICT, why="payload_conflict", row=row,
            detail=f"operation {identity.scope}/{identity.key} exists with another fingerprint",
        )
        if row.projection_version == identity.projection_version:
            return conflict
        earlier = intent_under(row.projection_version)
        if earlier is None:
            # Never run or replay a possibly different intent: an operator decides.
            return Verdict.needs_reconciliation(
                "projection_unknown",
                f"recorded under projection v{row.projection_version}, which is no longer declared "
                f"(this one is v{identity.projection_version}): intents cannot be compared",
                row,
            )
        return None if earlier == row.fingerprint else conflict

    async def expired_key(
        self, conn: psycopg.AsyncConnection[Any], identity: OperationIdentity, intent_under: IntentUnder,
        *, gone: str,
    ) -> Verdict:
        """A message older than its key retention is never claimed (docs/explanation/retention.md): its row,
        if still there, decides; without one it is ``key_expired`` with the detail ``gone``."""
        async with bounded(self.settings.statement_timeout, "reading the ledger row"):
            row = await self.ledger.fetch(conn, identity.scope, identity.key)
        if row is None:
            return Verdict(VerdictKind.KEY_EXPIRED, why="key_expired", detail=gone)
        return self.decide(row, identity, intent_under)

    # -- the end of an attempt -----------------------------------------------------------------------

    async def complete(
        self,
        conn: psycopg.AsyncConnection[Any],
        identity: OperationIdentity,
        result: StoredResult,
        *,
        fence: Fence,
        events: Sequence[PendingEvent] = (),
        correlation_id: str | None = None,
        ran: str = "the handler",
    ) -> Verdict:
        """Complete the claimed row with ``result`` and write the outbox ``events`` (one statement
        of the caller's transaction): ``executed``.

        Raises:
            TransactionEnded: the fence no longer holds: ``ran`` (the handler, the endpoint) ended
                the claim's transaction and began another, or (a lease fence) the lease was taken
                over; nothing was written.
        """
        async with bounded(self.settings.statement_timeout, "the ledger completion"):
            completed = await self.ledger.complete(
                conn, identity, result, fence=fence, events=events, correlation_id=correlation_id
            )
        if not completed:
            raise TransactionEnded(f"{ran} ended the operation's transaction and began another (COMMIT; BEGIN sent as SQL)")
        return Verdict(VerdictKind.EXECUTED, result=result)

    async def complete_many(
        self,
        conn: psycopg.AsyncConnection[Any],
        completions: Sequence[tuple[OperationIdentity, StoredResult, Sequence[PendingEvent], str | None]],
        *,
        xid: str,
    ) -> list[Verdict]:
        """Complete every operation a batch claimed in transaction ``xid`` with its result and
        write their outbox events, in one statement: ``executed`` for each, in order.

        Raises:
            TransactionEnded: a handler of the batch ended the claiming transaction; nothing of
                the batch's completion was written.
        """
        async with bounded(self.settings.statement_timeout, "the batch completion"):
            completed = await self.ledger.complete_many(conn, completions, xid=xid)
        if not completed:
            raise TransactionEnded("a handler of the batch ended its transaction and began another (COMMIT; BEGIN sent as SQL)")
        return [Verdict(VerdictKind.EXECUTED, result=c[1]) for c in completions]

    async def record_failure(
        self,
        conn: psycopg.AsyncConnection[Any],
        identity: OperationIdentity,
        intent_under: IntentUnder,
        *,
        message_id: str | None,
        code: str,
        error_class: str,
        detail: str,
        retention: Retention,
    ) -> Verdict:
        """Record a permanent failure in a transaction of its own, after the claim's rolled back:
        ``failed``. If another claimer's row got there first, that row decides (an expired lease
        there: ``in_progress``, ``failure_not_recorded``)."""
        async with bounded(self.settings.statement_timeout, "recording the failure"), conn.transaction():
            recorded = await self.ledger.record_failure(
                conn, identity, message_id=message_id, code=code, error_class=error_class,
                detail=detail, retention=retention,
            )
            row = None if recorded else await self.ledger.fetch(conn, identity.scope, identity.key)
        if recorded:
            return Verdict(VerdictKind.FAILED, why=code, result=StoredResult(code, None, None))
        verdict = None if row is None else self.decide(row, identity, intent_under)
        if verdict is None or verdict.kind is VerdictKind.LEASE_RECOVERABLE:
            return Verdict.in_progress("failure_not_recorded", row)
        return verdict

    async def fail_claimed(
        self, conn: psycopg.AsyncConnection[Any], identity: OperationIdentity, *, xid: str, code: str,
        error_class: str, detail: str, body: Any, ran: str,
    ) -> Verdict:
        """Record a permanent failure (with ``body``, replayed) in the claiming transaction ``xid``,
        after the caller rolled its own work back to a savepoint: ``failed``.

        Raises:
            TransactionEnded: ``ran`` ended the claiming transaction; nothing was written.
        """
        async with bounded(self.settings.statement_timeout, "recording the failure"):
            recorded = await self.failures.fail_claimed(
                conn, identity, xid=xid, code=code, error_class=error_class, detail=detail, body=body
            )
        if not recorded:
            raise TransactionEnded(f"{ran} ended the operation's transaction and began another")
        return Verdict(VerdictKind.FAILED, why=code, result=StoredResult(code, None, None))

    async def park(
        self, conn: psycopg.AsyncConnection[Any], identity: OperationIdentity, *, message_id: str | None,
        error_class: str, why: str, detail: str,
    ) -> Verdict:
        """Mark the operation ``needs_reconciliation`` (in the caller's transaction, or on its own
        on an autocommit connection): what committed cannot be known here, so it is never run
        again blindly. A ``completed`` or ``failed`` row, or one of another fingerprint, is left
        as it is. Used for a claim whose transaction the handler ended (``transaction_ended``)
        and for a processing row under an expired lease that nothing can reconcile
        (``lease_expired``)."""
        async with bounded(self.settings.statement_timeout, "parking"):
            await self.ledger.park(conn, identity, message_id=message_id, error_class=error_class, detail=detail)
        return Verdict.needs_reconciliation(why, detail)

    # -- the lease (the leased path) -----------------------------------------------------------------

    async def take_over(
        self, conn: psycopg.AsyncConnection[Any], identity: OperationIdentity, row: OperationRow
    ) -> Fence | Verdict:
        """Take over ``row``'s expired lease with a compare-and-set on (owner, attempt): the new
        lease's fence, or ``in_progress`` when another worker got there first."""
        async with bounded(self.settings.statement_timeout, "the lease take-over"):
            attempt = await self.ledger.take_over(
                conn, identity, owner=self.worker_id, expected_owner=row.lease_owner,
                expected_attempt=row.attempts, lease_seconds=self.settings.lease_seconds,
            )
        if attempt is None:
            return Verdict.in_progress("lease_taken_by_another_worker", row)
        return Fence.of_lease(self.worker_id, attempt)

    async def end_leased(
        self, conn: psycopg.AsyncConnection[Any], identity: OperationIdentity, fence: Fence, *,
        code: str | None, error_class: str, detail: str,
    ) -> Verdict:
        """End a leased operation still held under ``fence``: ``failed`` with ``code`` (a permanent
        failure), or without a code parked as ``needs_reconciliation`` (an unknown outcome).
        ``lease_lost`` when the lease is no longer held (nothing written)."""
        state = states.FAILED if code is not None else states.NEEDS_RECONCILIATION
        async with bounded(self.settings.statement_timeout, "ending the lease"):
            ended = await self.ledger.end_leased(
                conn, identity, fence, state=state, code=code, error_class=error_class, detail=detail
            )
        if not ended:
            return Verdict(VerdictKind.LEASE_LOST, why="lease_lost", detail=f"the {state} row was fenced out")
        if code is not None:
            return Verdict(VerdictKind.FAILED, why=code, result=StoredResult(code, None, None))
        return Verdict.needs_reconciliation("reconcile_unknown", detail[:1000])
