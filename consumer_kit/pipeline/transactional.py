"""The transactional path: one delivery, one transaction (docs/explanation/one-delivery.md, steps 4 to 8).

BEGIN and the claim go in one round trip (:meth:`~consumer_kit.pipeline.operation.Operations.claim`
with ``begin``); an existing row's verdict is the answer; otherwise the handler runs in the same
transaction, the ledger completion writes the result and the outbox events in one statement, and
COMMIT carries the session reset. A permanent failure rolls everything back and is recorded in a
transaction of its own; a handler that ended the transaction itself has its operation parked.
Faults propagate to the runtime's classification after the ROLLBACK.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import psycopg
from psycopg_pool import AsyncConnectionPool

from consumer_kit.broker import Delivery
from consumer_kit.codec.envelope import Envelope
from consumer_kit.context import Context
from consumer_kit.db.deadlines import DeliveryClock
from consumer_kit.errors import (
    CommitUncertain,
    PermanentFailure,
    StaleConnection,
    StatementTimeout,
    TransactionEnded,
    UnsupportedNumber,
)
from consumer_kit.model.fence import Fence
from consumer_kit.model.verdict import Verdict, VerdictKind
from consumer_kit.pipeline import crashpoints
from consumer_kit.pipeline.crashpoints import CrashPoint
from consumer_kit.pipeline.decoding import DecodedDelivery as Decoded
from consumer_kit.pipeline.early_answers import EarlyAnswers
from consumer_kit.pipeline.operation import IntentUnder, Operations
from consumer_kit.pipeline.transaction import (
    commit,
    commit_forbidden,
    ensure_transaction_open,
    ensure_transaction_usable,
    on_own_connection,
    rollback,
    stored_result,
    within_handler_timeout,
)
from consumer_kit.settings import Settings
from consumer_kit.telemetry import describe_error, note_events, step

__all__ = ["TransactionalPath", "message_intent"]

logger = logging.getLogger("consumer_kit.runtime")

T = TypeVar("T")

_ABORTED = psycopg.pq.TransactionStatus.INERROR


def message_intent(decoded: Decoded) -> IntentUnder:
    """This message's fingerprint under an earlier projection version of its handler
    (``Handler.earlier_projections``); ``None`` when the handler no longer declares it or the
    message holds a number it cannot project."""

    def under(version: int) -> str | None:
        try:
            return decoded.handler.fingerprint_under(decoded.message, version)
        except UnsupportedNumber:
            return None

    return under


class TransactionalPath:
    """Runs deliveries of handlers without external effects.

    Args:
        pool: the worker's connection pool (autocommit connections).
        settings: ``statement_timeout``, ``handler_timeout`` (seconds).
        operations: the state machine.
    """

    def __init__(
        self, pool: AsyncConnectionPool, settings: Settings, operations: Operations, early: EarlyAnswers
    ) -> None:
        self.pool = pool
        self.settings = settings
        self.operations = operations
        self.early = early

    async def execute(self, delivery: Delivery, decoded: Decoded, envelope: Envelope) -> Verdict:
        """Steps 4 to 7 for one delivery; faults propagate (rolled back). An existing row's verdict
        returns before its transaction (which wrote nothing) has ended: :mod:`consumer_kit.pipeline.early_answers`."""
        identity = decoded.identity
        try:
            for _ in range(self.pool.max_size + 1):
                try:
                    verdict = await self.early.on_connection(lambda conn: self._transaction(conn, decoded, envelope))
                except StaleConnection:
                    continue  # a connection that died in the pool: not this delivery's fault
                break
            else:
                raise StatementTimeout("no live pooled connection")
        except PermanentFailure as failure:
            verdict = await self._record_failure(decoded, envelope, failure)
        except TransactionEnded as exc:
            # What committed cannot be known here: park the operation (never re-run it blindly).
            detail = str(exc)
            return await self._bookkeeping(
                lambda conn: self.operations.park(
                    conn, identity, message_id=envelope.message_id, error_class=TransactionEnded.__name__,
                    why="transaction_ended", detail=detail,
                ),
                "parking",
            )
        if verdict.kind in (VerdictKind.EXECUTED, VerdictKind.FAILED):
            crashpoints.reached(CrashPoint.AFTER_COMMIT_BEFORE_ACK)
        logger.debug("committed scope=%s operation_key=%s", identity.scope, identity.key)
        return verdict

    async def _transaction(
        self, conn: psycopg.AsyncConnection[Any], decoded: Decoded, envelope: Envelope
    ) -> tuple[Verdict, bool]:
        """BEGIN and claim (one round trip), run, COMMIT with the session reset; ROLLBACK on any
        exception, and when the handler's transaction is aborted. The verdict, and whether the
        transaction is still open: it wrote nothing (an existing row answered), so its end does
        not hold the answer back."""
        with DeliveryClock():  # one timer for the claim's, handler's, completion's and COMMIT's bounds
            return await self._bounded_transaction(conn, decoded, envelope)

    async def _bounded_transaction(
        self, conn: psycopg.AsyncConnection[Any], decoded: Decoded, envelope: Envelope
    ) -> tuple[Verdict, bool]:
        timeout = self.settings.statement_timeout
        try:
            verdict, wrote = await self._claim_and_run(conn, decoded, envelope)
        except BaseException:
            await rollback(conn, timeout)
            raise
        if not wrote:
            return verdict, True  # ended (COMMIT, or ROLLBACK after the claim's lock wait) later
        if conn.info.transaction_status is _ABORTED:
            await rollback(conn, timeout)
            return verdict, False
        try:
            with step("consumer_kit.commit", decoded.handler.operation_type):
                await commit(conn, timeout, reset=verdict.kind is VerdictKind.EXECUTED)
        except CommitUncertain as exc:
            # Never ack; the redelivery reads the truth from the ledger.
            uncertain = Verdict(VerdictKind.UNCERTAIN, why="commit_outcome_unknown", detail=describe_error(exc.__cause__ or exc))
            return uncertain, False
        return verdict, False

    async def _claim_and_run(
        self, conn: psycopg.AsyncConnection[Any], decoded: Decoded, envelope: Envelope
    ) -> tuple[Verdict, bool]:
        """The verdict, and whether this transaction wrote anything (not when an existing row
        answered the claim)."""
        identity, handler = decoded.identity, decoded.handler
        with step("consumer_kit.claim", handler.operation_type, histogram="claim"):
            claim = await self.operations.claim(
                conn, identity, message_intent(decoded), message_id=envelope.message_id,
                retention=handler.retention, begin=True,
            )
        if isinstance(claim, Verdict):
            if claim.kind is not VerdictKind.LEASE_RECOVERABLE:
                return claim, False
            # A processing row whose lease expired was committed by a run that died (a handler
            # with external effects, or one that committed its own transaction). This handler
            # declares no external effects, so nothing can reconcile it: never run it again
            # blindly (docs/how-to/external-effects.md). Park it in this transaction, as the run
            # that died would have: such a row may carry no watch_since (a transactional claim
            # committed by the handler), and the gauges and `ledger list` see only watched rows.
            parked = await self.operations.park(
                conn, identity, message_id=envelope.message_id, error_class="LeaseExpired", why="lease_expired",
                detail=f"operation {identity.scope}/{identity.key} is processing under an expired "
                f"lease of {claim.deciding_row.lease_owner} and {type(handler).__name__} has no "
                "external_effects to reconcile it: resolve it with `consumer-kit ledger`",
            )
            return parked, True
        assert claim.xid is not None  # the claim inserted: the transaction has an id
        crashpoints.reached(CrashPoint.AFTER_CLAIM)
        ctx = Context(conn, identity, envelope)
        # A PermanentFailure propagates: the whole transaction (claim included) rolls back and
        # execute() records the failure in a transaction of its own (docs/explanation/one-delivery.md, step 8). No
        # savepoint on the common path: it would cost two round trips on every delivery.
        try:
            with commit_forbidden(conn):
                try:
                    with step("consumer_kit.handle", handler.operation_type, histogram="handler"):
                        result = await within_handler_timeout(
                            handler.handle(decoded.message, ctx), self.settings.handler_timeout
                        )
                finally:
                    ctx.seal()  # a publish after this point raises ContextSealed
        finally:
            ensure_transaction_open(conn)
        ensure_transaction_usable(conn)
        crashpoints.reached(CrashPoint.IN_HANDLER)
        verdict = await self.operations.complete(
            conn, identity, stored_result(result), fence=Fence.of_transaction(claim.xid), events=ctx.events,
            correlation_id=envelope.correlation_id,
        )
        note_events(ctx.events)
        return verdict, True

    async def _record_failure(self, decoded: Decoded, envelope: Envelope, failure: PermanentFailure) -> Verdict:
        """Record a permanent failure after its transaction rolled back (its own transaction)."""
        return await self._bookkeeping(
            lambda conn: self.operations.record_failure(
                conn, decoded.identity, message_intent(decoded), message_id=envelope.message_id, code=failure.code,
                error_class=type(failure).__name__, detail=failure.detail, retention=decoded.handler.retention,
            ),
            "recording the failure",
        )

    async def _bookkeeping(self, write: Callable[[psycopg.AsyncConnection[Any]], Awaitable[T]], what: str) -> T:
        return await on_own_connection(self.pool, self.settings.statement_timeout, write, what)
