"""The leased path: a handler with external effects (docs/how-to/external-effects.md).

One remote call cannot sit inside a PostgreSQL transaction, and a timeout is not proof of
failure, so a handler with ``external_effects = True`` runs like this:

1. **claim** in a transaction of its own, committed at once: the row is ``processing`` under a
   lease (owner = this worker, expiry, ``attempts`` = the fencing token);
2. the handler runs outside any transaction: remote calls with ``ctx.downstream_key(name)``,
   ``ctx.record_evidence(name, ...)`` before and after each call (each fenced by the lease), while
   a renewer extends the lease and the broker's peek-lock; if a renewal fails the worker no longer
   owns the operation and the handler is cancelled;
3. ``await ctx.begin()`` opens the **completion transaction**: the handler's local writes, its
   outbox events and the ledger's completion commit together, the completion fenced by owner and
   attempt (and by the transaction that began it): a worker whose lease was taken over cannot
   complete, is not acked, and says so.

A worker that finds a ``processing`` row whose lease expired takes it over with a compare-and-set
on (owner, attempt) (``lease_recovered``) and calls ``Handler.reconcile(message, evidence, ctx)``
before anything else: ``done`` completes without calling, ``not_done`` runs ``handle`` again (same
downstream keys), ``unknown`` parks the operation as ``needs_reconciliation`` (dead-lettered with
that reason; an operator resolves it with ``consumer-kit ledger resolve``).

A handler fault after the claim gives the lease up at once, so the retry takes it over and
reconciles: the remote call may have happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import psycopg
from psycopg_pool import AsyncConnectionPool

from consumer_kit.broker import Delivery
from consumer_kit.codec.envelope import Envelope
from consumer_kit.context import Context
from consumer_kit.db.pool import bounded
from consumer_kit.effects import Evidence, Reconciled, Reconciliation
from consumer_kit.errors import CommitUncertain, LeaseLost, PermanentFailure, SimulatedCrash, TransactionEnded
from consumer_kit.ledger import EvidenceBook
from consumer_kit.model.fence import Fence
from consumer_kit.model.results import Result, StoredResult
from consumer_kit.model.verdict import Verdict, VerdictKind
from consumer_kit.pipeline import crashpoints
from consumer_kit.pipeline.crashpoints import CrashPoint
from consumer_kit.pipeline.decoding import DecodedDelivery as Decoded
from consumer_kit.pipeline.lease_renewal import renewing
from consumer_kit.pipeline.operation import Operations
from consumer_kit.pipeline.transaction import (
    begin,
    commit,
    ensure_transaction_open,
    ensure_transaction_usable,
    on_own_connection,
    rollback,
    stored_result,
    within_handler_timeout,
)
from consumer_kit.pipeline.transactional import message_intent
from consumer_kit.settings import Settings
from consumer_kit.telemetry import describe_error, note_events, note_evidence, step

logger = logging.getLogger("consumer_kit.leased")

T = TypeVar("T")



class LeasedPath:
    """Runs deliveries of handlers with external effects.

    Args:
        pool: the worker's connection pool.
        settings: ``lease_seconds``, ``handler_timeout``, ``statement_timeout`` (seconds).
        operations: the state machine (claim, the existing row, take-over, the end of a lease).
    """

    def __init__(self, pool: AsyncConnectionPool, settings: Settings, operations: Operations) -> None:
        self.pool = pool
        self.settings = settings
        self.operations = operations
        self.ledger = operations.ledger
        self.evidence = EvidenceBook(settings.db_schema)
        self.worker_id = operations.worker_id

    async def execute(self, delivery: Delivery, decoded: Decoded, envelope: Envelope) -> Verdict:
        """Steps 1-3 (module docstring) for one delivery; faults propagate to the runtime's
        classification after the lease was given up."""
        identity = decoded.identity
        with step("consumer_kit.claim", decoded.handler.operation_type, histogram="claim"):
            leased_from, claim = await self._timed_statement(
                lambda conn: self.operations.claim(
                    conn, identity, message_intent(decoded), message_id=envelope.message_id,
                    retention=decoded.handler.retention, watch=True,
                ),
                "the claim",
            )
        if not isinstance(claim, Verdict):
            assert claim.row is not None  # this claim inserted the row
            fence, recovered = Fence.of_lease(self.worker_id, claim.row.attempts), False
        elif claim.kind is not VerdictKind.LEASE_RECOVERABLE:
            return claim
        else:
            row = claim.deciding_row
            leased_from, taken = await self._timed_statement(
                lambda conn: self.operations.take_over(conn, identity, row), "the lease take-over"
            )
            if isinstance(taken, Verdict):
                return taken
            logger.warning(
                "lease of scope=%s operation_key=%s taken over from %s (attempt %s): reconciling",
                identity.scope, identity.key, row.lease_owner, taken.attempt,
            )
            fence, recovered = taken, True
        crashpoints.reached(CrashPoint.AFTER_CLAIM)
        run = _LeasedRun(self, delivery, decoded, envelope, fence, leased_from)
        return await run.own(recovered)

    async def _statement(self, write: Callable[[psycopg.AsyncConnection[Any]], Awaitable[T]], what: str) -> T:
        """One autocommit statement on a pooled connection, bounded by ``statement_timeout``."""
        return await on_own_connection(self.pool, self.settings.statement_timeout, write, what)

    async def _timed_statement(
        self, write: Callable[[psycopg.AsyncConnection[Any]], Awaitable[T]], what: str
    ) -> tuple[float, T]:
        """:meth:`_statement`, also returning when it was sent: the event loop's clock (monotonic
        seconds) read once the pool gave the connection, just before ``write`` sends. The
        database's ``now()`` for the statement (a lease's start) is no earlier than that."""
        async with bounded(self.settings.statement_timeout, what):
            async with self.pool.connection() as conn:
                sent = asyncio.get_running_loop().time()
                return sent, await write(conn)


class _LeasedRun:
    """One attempt holding the lease under ``fence``: what the handler's context calls (the
    :class:`~consumer_kit.effects.LeaseHooks`), the renewer, and the completion.

    ``leased_from``: the event loop's clock (monotonic seconds) just before the statement that
    granted the lease (the claim, or the take-over) was sent; the first renewal deadline counts
    from it."""

    def __init__(
        self, path: LeasedPath, delivery: Delivery, decoded: Decoded, envelope: Envelope, fence: Fence,
        leased_from: float,
    ) -> None:
        self.path = path
        self.delivery = delivery
        self.decoded = decoded
        self.identity = decoded.identity
        self.fence = fence
        self.leased_from = leased_from
        self.ctx = Context(None, decoded.identity, envelope, lease=self)
        self.lost: str | None = None  # why this worker no longer holds the lease
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._conn_cm: contextlib.AbstractAsyncContextManager[psycopg.AsyncConnection[Any]] | None = None
        self._recorded: set[str] = set()
        self.completion_fence = fence

    # -- the handler's hooks ---------------------------------------------------------------------

    async def begin(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None:
            self._raise_if_lost()
            self._conn_cm = self.path.pool.connection()
            conn = await self._conn_cm.__aenter__()
            timeout = self.path.settings.statement_timeout
            await begin(conn, timeout)
            async with bounded(timeout, "the completion transaction's id"):
                cur = await conn.execute("SELECT pg_current_xact_id()::text")
                row = await cur.fetchone()
            assert row is not None
            # The completion must come from this very transaction (a handler that sends COMMIT
            # and BEGIN itself is fenced out) and from the lease's holder.
            self.completion_fence = self.fence.within_transaction(row[0])
            conn._num_transactions += 1  # commit()/rollback() forbidden, as in commit_forbidden()
            self._conn = conn
        return self._conn

    async def record_evidence(self, name: str, facts: dict[str, Any]) -> None:
        self._raise_if_lost()
        if name in self._recorded:
            # The remote call named ``name`` has returned and its outcome is being recorded: the
            # moment "the remote side accepted, the reply is lost" (a crash here).
            crashpoints.reached(CrashPoint.DURING_EXTERNAL_CALL)
        recorded = await self.path._statement(
            lambda conn: self.path.evidence.record(conn, self.identity, self.fence, name, facts),
            "recording evidence",
        )
        if not recorded:
            self.lost = "lease taken over (evidence refused)"
            self._raise_if_lost()
        self._recorded.add(name)
        note_evidence(name, facts)

    # -- the attempt -------------------------------------------------------------------------------

    async def own(self, recovered: bool) -> Verdict:
        handler, message = self.decoded.handler, self.decoded.message
        timeout = self.path.settings.handler_timeout
        operation_type = handler.operation_type
        try:
            async with renewing(self):
                if recovered:
                    evidence = Evidence(await self.path._statement(
                        lambda conn: self.path.evidence.fetch(conn, self.identity.scope, self.identity.key),
                        "reading evidence",
                    ))
                    if evidence and evidence[-1].operator_not_done:
                        # An operator checked the remote side: not done, call again (same keys).
                        verdict = Reconciled.not_done()
                    else:
                        with step("consumer_kit.reconcile", operation_type, histogram="handler"):
                            verdict = await within_handler_timeout(
                                handler.reconcile(message, evidence, self.ctx), timeout
                            )
                    if verdict.verdict is Reconciliation.UNKNOWN:
                        return await self._park(verdict)
                    result = verdict.result if verdict.verdict is Reconciliation.DONE else None
                    if verdict.verdict is Reconciliation.NOT_DONE:
                        with step("consumer_kit.handle", operation_type, histogram="handler"):
                            result = await within_handler_timeout(handler.handle(message, self.ctx), timeout)
                    elif result is None:
                        result = Result("reconciled")
                else:
                    with step("consumer_kit.handle", operation_type, histogram="handler"):
                        result = await within_handler_timeout(handler.handle(message, self.ctx), timeout)
                self.ctx.seal()
                crashpoints.reached(CrashPoint.IN_HANDLER)
                with step("consumer_kit.commit", operation_type):
                    return await self._complete(stored_result(result), recovered)
        except LeaseLost as exc:
            await self._end_transaction()
            return self._lease_lost(str(exc))
        except TransactionEnded as exc:
            # What the handler committed itself cannot be known here: park, never re-run blindly.
            await self._end_transaction()
            return await self._park(Reconciled.unknown(str(exc)))
        except PermanentFailure as failure:
            await self._end_transaction()
            return await self._fail(failure)
        except SimulatedCrash:
            await self._end_transaction()  # as a dead process's transaction; the lease stays
            raise
        except BaseException:
            self.ctx.seal()
            await self._end_transaction()
            await self._give_up()  # the retry takes the lease over and reconciles
            raise

    async def _complete(self, result: StoredResult, recovered: bool) -> Verdict:
        conn = await self.begin()
        settings = self.path.settings
        ensure_transaction_open(conn)
        ensure_transaction_usable(conn)
        try:
            await self.path.operations.complete(
                conn, self.identity, result, fence=self.completion_fence, events=self.ctx.events,
                correlation_id=self.ctx.envelope.correlation_id,
            )
        except TransactionEnded:
            row = await self.path._statement(
                lambda c: self.path.ledger.fetch(c, self.identity.scope, self.identity.key), "reading the row"
            )
            if row is not None and row.lease_owner == self.fence.owner and row.attempts == self.fence.attempt:
                # Still ours: the handler ended the completion transaction and began another.
                raise TransactionEnded(
                    "the handler ended the completion transaction and began another (COMMIT; BEGIN sent as SQL)"
                ) from None
            raise LeaseLost("the completion was fenced out: another worker holds the lease") from None
        self._release_guard()
        try:
            await commit(conn, settings.statement_timeout, reset=True)
        except CommitUncertain as exc:
            return Verdict(VerdictKind.UNCERTAIN, why="commit_outcome_unknown", detail=describe_error(exc.__cause__ or exc))
        finally:
            await self._return_connection()
        note_events(self.ctx.events)
        crashpoints.reached(CrashPoint.AFTER_COMMIT_BEFORE_ACK)
        return Verdict(VerdictKind.EXECUTED, why="lease_recovered" if recovered else "", result=result)

    async def _fail(self, failure: PermanentFailure) -> Verdict:
        return await self._end(failure.code, type(failure).__name__, failure.detail, "the failure was fenced out")

    async def _park(self, reconciled: Reconciled) -> Verdict:
        verdict = await self._end(None, "Reconciled.unknown", reconciled.reason, "parking was fenced out")
        if verdict.kind is VerdictKind.NEEDS_RECONCILIATION:
            logger.error(
                "scope=%s operation_key=%s needs reconciliation: %s", self.identity.scope, self.identity.key,
                reconciled.reason,
            )
        return verdict

    async def _end(self, code: str | None, error_class: str, detail: str, fenced_out: str) -> Verdict:
        """End the lease as ``failed`` (with ``code``) or parked (without); ``lease_lost`` when the
        lease is no longer held."""
        verdict = await self.path._statement(
            lambda conn: self.path.operations.end_leased(
                conn, self.identity, self.fence, code=code, error_class=error_class, detail=detail,
            ),
            "ending the lease",
        )
        return self._lease_lost(fenced_out) if verdict.kind is VerdictKind.LEASE_LOST else verdict

    def _lease_lost(self, why: str) -> Verdict:
        logger.warning(
            "lease of scope=%s operation_key=%s lost (%s): not completing, not acking message_id=%s",
            self.identity.scope, self.identity.key, why, self.delivery.message_id,
        )
        return Verdict(VerdictKind.LEASE_LOST, why="lease_lost", detail=why)

    async def _give_up(self) -> None:
        try:
            await self.path._statement(
                lambda conn: self.path.ledger.give_up(conn, self.identity, self.fence), "giving the lease up"
            )
        except Exception as exc:  # noqa: BLE001 - the lease then simply runs out
            logger.debug("could not give the lease up (%s); it runs out by itself", type(exc).__name__)

    # -- the completion transaction's connection ----------------------------------------------------

    async def _end_transaction(self) -> None:
        if self._conn is not None:
            self._release_guard()
            await rollback(self._conn, self.path.settings.statement_timeout)
            await self._return_connection()

    def _release_guard(self) -> None:
        if self._conn is not None and self._conn._num_transactions > 0:
            self._conn._num_transactions -= 1

    async def _return_connection(self) -> None:
        cm, self._conn_cm, self._conn = self._conn_cm, None, None
        if cm is not None:
            await cm.__aexit__(None, None, None)

    # -- the lease -----------------------------------------------------------------------------------

    @property
    def lease_seconds(self) -> float:
        return self.path.settings.lease_seconds

    async def renew_lease(self) -> bool:
        """One renewal of the lease in the ledger: ``False`` when another worker took it over."""
        return await self.path._statement(
            lambda conn: self.path.ledger.renew(conn, self.identity, self.fence, self.lease_seconds),
            "lease renewal",
        )

    def _raise_if_lost(self) -> None:
        if self.lost is not None:
            raise LeaseLost(self.lost)
