"""The runtime: one delivery, step by step (DESIGN.md "One delivery" and "Faults and attempts").

``Runtime.process`` is the whole pipeline and reads as the numbered steps:

1. the adapter hands over a delivery under peek-lock;
2. decode and validate (invalid: dead-letter with a reason);
3. compute scope, key and fingerprint;
   admission: at most ``concurrency`` deliveries run at once; a *redelivered* message (nobody
   settled its last hand-over: the process may have died running it) runs alone, and is parked as
   ``crashed_worker`` once the process died ``crash_limit`` times running it alone;
4. BEGIN; claim with ``INSERT ... ON CONFLICT DO NOTHING`` (a concurrent claimer waits on the
   unique index, bounded by ``lock_timeout``: then ``in_progress``);
5. an existing row decides: duplicate, replayed failure, payload conflict, in progress, or an
   expired lease to recover;
6. run the handler in the same transaction; complete the ledger row and write the outbox events
   it published in one statement (a permanent failure rolls everything back and records a
   retained ``failed`` row in a transaction of its own);
7. COMMIT (with the session reset), then settle. A COMMIT whose reply is lost or late is
   *uncertain*: never acked; the redelivery reads the truth from the ledger.
8. Every other failure is classified (:mod:`consumer_kit.faults`): a *message* fault dead-letters
   at once; a *handler* fault retries with backoff and counts toward ``max_deliveries`` (counted
   in the ledger's ``attempts``); *contention* retries with jitter under its own bound; an
   *environment* fault gives the delivery back uncounted and tells the worker to pause.

Every statement of consumer-kit's own is bounded (``statement_timeout``); the handler is bounded
by ``handler_timeout``; settlement is bounded by the delivery itself (``settle_timeout``).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg_pool import AsyncConnectionPool

from consumer_kit import crashpoints
from consumer_kit.admission import Admission, GiveBack
from consumer_kit.app import App
from consumer_kit.broker import Delivery, Settlement
from consumer_kit.crashpoints import CrashPoint
from consumer_kit.database import bounded, open_pool
from consumer_kit.decision import Decision
from consumer_kit.decoding import DecodedDelivery as Decoded
from consumer_kit.decoding import decode
from consumer_kit.envelope import Envelope
from consumer_kit.errors import (
    DeadLetterReason,
    InvalidMessage,
    PermanentFailure,
    SimulatedCrash,
)
from consumer_kit.faults import FaultKind, StatementTimeout, classify
from consumer_kit.handler import Context
from consumer_kit.identity import UnsupportedNumber
from consumer_kit.lanes import Lanes
from consumer_kit.leased import LeasedPath
from consumer_kit.ledger import AttemptBook, AttemptCounts, Ledger
from consumer_kit.model import operation_row as ledger_states
from consumer_kit.model.fence import Fence
from consumer_kit.model.identity import OperationIdentity
from consumer_kit.model.operation_row import OperationRow
from consumer_kit.model.outcomes import DeliveryReport, Outcome
from consumer_kit.model.results import StoredResult
from consumer_kit.settings import Settings
from consumer_kit.telemetry import (
    Counters,
    delivery_span,
    describe_error,
    describe_traceback,
    messaging_system,
    note_events,
    record,
    step,
)
from consumer_kit.transaction import (
    CommitUncertain,
    StaleConnection,
    TransactionEnded,
    begin_and_claim,
    commit,
    commit_forbidden,
    ensure_transaction_open,
    ensure_transaction_usable,
    rollback,
    stored_result,
    within_handler_timeout,
)

__all__ = ["Runtime", "default_worker_id", "open_pool"]

logger = logging.getLogger("consumer_kit.runtime")

T = TypeVar("T")

# Contention is retried in place first (roll back, wait a jittered moment, run again) before the
# delivery goes back to the broker: most lock waits clear within a second.
IN_PLACE_CONTENTION_RETRIES = 3
_CONTENTION_BASE_DELAY = 0.05  # seconds; full jitter, doubling per retry


class _ClaimBusy(Exception):
    """The claim waited on a concurrent claimer of the same key for longer than lock_timeout."""


def default_worker_id() -> str:
    """``"<host>:<pid>:<random>"``: the lease owner name of this process."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class Runtime:
    """Processes deliveries for the handlers of one :class:`App`.

    Args:
        app: queue -> handler routes.
        pool: an ``AsyncConnectionPool`` opened with ``autocommit=True`` (see :func:`open_pool`).
        settings: timeouts, bounds and retry delays.
        worker_id: lease owner name; default ``host:pid:random``.
        admission: who may run when (the worker's, with its concurrency limit); default: no limit.

    Attributes:
        on_environment_fault: called with a one-line reason when a delivery met an environment
            fault (the worker pauses consuming and probes); ``None``: nobody to tell.
        before_release: awaited before a delivery is given back uncounted (the worker: until its
            consumers have stopped, bounded); ``None``: release at once.
        counters: in-process outcome counters.
        observers: called with every :class:`DeliveryReport`.
    """

    def __init__(
        self,
        app: App,
        pool: AsyncConnectionPool,
        settings: Settings,
        *,
        worker_id: str | None = None,
        admission: Admission | None = None,
    ) -> None:
        self.app = app
        self.pool = pool
        self.settings = settings
        self.worker_id = worker_id or default_worker_id()
        self.admission = admission or Admission()
        self.ledger = Ledger(settings.db_schema)
        self.attempts = AttemptBook(settings.db_schema, self.worker_id)
        self.counters = Counters()
        self.messaging_system = messaging_system(settings.broker_url)  # the spans' messaging.system
        self.observers: list[Callable[[DeliveryReport], None]] = []
        self.on_environment_fault: Callable[[str], None] | None = None
        self.before_release: Callable[[], Awaitable[None]] | None = None
        self._uncleared: set[OperationIdentity] = set()  # run-alone markers to clear once it can
        self.lanes = Lanes()
        self.leased = LeasedPath(
            pool, settings, self.ledger, self.worker_id,
            existing_row=self._handle_for_state, on_commit_uncertain=self._commit_uncertain,
        )

    async def process(self, delivery: Delivery) -> DeliveryReport:
        """Run one delivery through the pipeline and settle it. Never raises except
        ``SimulatedCrash`` (an armed crash point: the delivery stays unsettled) and cancellation
        (the delivery is released first)."""
        started = time.monotonic()
        envelope = Envelope(
            delivery.queue, delivery.message_id, delivery.headers, delivery.delivery_count,
            correlation_property=delivery.correlation_id, partition_key=delivery.partition_key,
            enqueued_at=delivery.enqueued_at,
        )
        with delivery_span(delivery, self.messaging_system) as span:
            decoded: Decoded | None = None
            try:
                try:
                    decoded = decode(self.app, delivery.queue, delivery.body, envelope)  # steps 2, 3
                except (InvalidMessage, SimulatedCrash):
                    raise
                except Exception as exc:  # noqa: BLE001 - a handler hook raised: the handler's fault
                    decision = self._after_hook_fault(delivery, exc)
                else:
                    span.decoded(decoded, envelope)
                    decision = await self._admitted(delivery, decoded, envelope)  # steps 4 to 8
            except InvalidMessage as exc:
                decision = Decision(
                    Outcome.INVALID, Settlement.DEAD_LETTER, reason=exc.reason.value, detail=exc.detail
                )
            except SimulatedCrash:
                report = self._report(delivery, decoded, Outcome.CRASHED, started, reason="crash point")
                record(report, self.counters, None, span)
                raise
            except asyncio.CancelledError:
                await delivery.release()  # shutdown: given back uncounted
                raise
            span.decided(decision)
            crashpoints.reached(CrashPoint.BEFORE_ACK)
            if decision.how is Settlement.RELEASED and self.before_release is not None:
                # Give back only once the consumer has stopped: a copy put back while it still
                # consumes could be handed out again at once (or, on a quorum queue, come back
                # as a redelivery when the consumer is cancelled with it in transit).
                await self.before_release()
            await self._settle(delivery, decision)
        report = self._report(
            delivery, decoded, decision.outcome, started, reason=decision.reason, result=decision.result
        )
        record(report, self.counters, decoded.handler.operation_type if decoded else None, span)
        for observe in self.observers:
            observe(report)
        return report

    # -- admission: one limit per process, redelivered messages alone ------------------------------

    async def _admitted(self, delivery: Delivery, decoded: Decoded, envelope: Envelope) -> Decision:
        # The lane first: a delivery waiting behind an earlier one of its key holds no slot.
        async with self.lanes.lane(decoded.partition_key):
            try:
                if delivery.redelivered:
                    async with self.admission.alone():
                        return await self._run_alone(delivery, decoded, envelope)
                async with self.admission.slot():
                    return await self._run(delivery, decoded, envelope)
            except GiveBack as back:
                return Decision(Outcome.RELEASED, Settlement.RELEASED, reason=back.reason)

    async def _run_alone(self, delivery: Delivery, decoded: Decoded, envelope: Envelope) -> Decision:
        """Run a redelivered message with nothing else running: if the process dies now, the next
        run finds this run's marker and counts a crash against this operation, and only this one."""
        identity = decoded.identity
        limit = self.settings.crash_limit
        try:
            counts = await self._start_alone(delivery, identity)
        except Exception as exc:  # noqa: BLE001 - classified below
            if classify(exc) is FaultKind.ENVIRONMENT:
                return self._released_for_environment(exc)
            logger.error(
                "cannot keep the crash count (%s; is the schema migrated?): running message_id=%s "
                "alone without it", describe_error(exc), delivery.message_id,
            )
            return await self._run(delivery, decoded, envelope)
        if counts is None:
            # Another copy runs alone on a live worker (its marker stays renewed): it decides;
            # this copy comes back later and answers from the ledger.
            return Decision.in_progress(self.settings.in_progress_delay, "running_alone_elsewhere")
        if counts.crashes >= limit:
            logger.error(
                "parking scope=%s operation_key=%s message_id=%s: the process died %s times running it alone",
                identity.scope, identity.key, delivery.message_id, counts.crashes,
            )
            return Decision(
                Outcome.CRASHED_WORKER, Settlement.DEAD_LETTER,
                reason=DeadLetterReason.CRASHED_WORKER.value,
                detail=f"the worker process died {counts.crashes} times while running this operation "
                f"alone (crash_limit {limit}); attempt history in the ledger's attempts table",
            )
        renewer = asyncio.create_task(self._renew_alone(identity), name="consumer-kit run-alone marker")
        try:
            decision = await self._run(delivery, decoded, envelope)
        except SimulatedCrash:
            raise  # a simulated death leaves the marker to expire, as a real one would
        except BaseException:
            renewer.cancel()
            await self._finish_alone(identity)
            raise
        finally:
            renewer.cancel()
        await self._finish_alone(identity)
        return decision

    async def _start_alone(self, delivery: Delivery, identity: OperationIdentity) -> AttemptCounts | None:
        """Set the run-alone marker. A live marker of another run is waited out for at most one
        marker lifetime (still holding this process to itself): a dead run's marker expires in
        that time and its crash is counted; a live one is renewed, and ``None`` says so. Waiting
        here rather than through the broker keeps this delivery a suspect, so it still runs alone."""
        ttl = self.settings.alone_marker_ttl
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ttl * 1.2
        while True:
            counts = await self._bookkeeping(
                lambda conn: self.attempts.start_alone(
                    conn, identity, message_id=delivery.message_id, delivery_count=delivery.delivery_count,
                    crash_limit=self.settings.crash_limit, ttl=ttl,
                ),
                "the run-alone marker",
            )
            if counts is not None or loop.time() >= deadline:
                return counts
            await asyncio.sleep(ttl / 5)

    async def _renew_alone(self, identity: OperationIdentity) -> None:
        """Keep the run-alone marker live while the run lasts (a renewal that fails is retried at
        the next tick; the marker only expires if several in a row fail)."""
        ttl = self.settings.alone_marker_ttl
        while True:
            await asyncio.sleep(ttl / 5)
            try:
                await self._bookkeeping(lambda conn: self.attempts.renew_alone(conn, identity, ttl), "marker renewal")
            except Exception as exc:  # noqa: BLE001 - the next tick tries again
                logger.debug("run-alone marker renewal failed (%s)", type(exc).__name__)

    async def _finish_alone(self, identity: OperationIdentity) -> None:
        try:
            await self._bookkeeping(lambda conn: self.attempts.finish_alone(conn, identity), "run-alone end")
        except Exception as exc:  # noqa: BLE001 - kept and cleared by flush_markers() later
            self._uncleared.add(identity)
            logger.warning(
                "could not clear the run-alone marker of scope=%s operation_key=%s (%s); will retry",
                identity.scope, identity.key, describe_error(exc),
            )

    async def flush_markers(self) -> None:
        """Clear the run-alone markers an unavailable database kept this process from clearing
        (a marker left behind would count as a crash on the operation's next run alone). The
        worker calls it when the database is back, before it starts deliveries again."""
        for identity in list(self._uncleared):
            try:
                await self._bookkeeping(
                    functools.partial(self.attempts.finish_alone, identity=identity), "run-alone end"
                )
            except Exception:  # noqa: BLE001 - still unavailable: try again at the next resume
                return
            self._uncleared.discard(identity)

    # -- steps 4 to 8 ----------------------------------------------------------------------------

    async def _run(self, delivery: Delivery, decoded: Decoded, envelope: Envelope) -> Decision:
        """Execute, retrying contention in place a few times, and turn any fault into a decision."""
        if self._key_may_have_expired(decoded):
            expired = await self._answer_old_message(delivery, decoded)
            if expired is not None:
                return expired
        contended = 0
        while True:
            try:
                crashpoints.reached(CrashPoint.BEFORE_CLAIM)
                if decoded.handler.external_effects:
                    return await self.leased.execute(delivery, decoded, envelope)
                return await self._execute(decoded, envelope)
            except InvalidMessage:
                raise  # a handler may declare its input invalid: dead-lettered by process()
            except Exception as exc:  # noqa: BLE001 - classified below (DESIGN "Faults and attempts")
                kind = classify(exc)
                if kind is FaultKind.CONTENTION and contended < IN_PLACE_CONTENTION_RETRIES:
                    contended += 1
                    await asyncio.sleep(random.uniform(0, _CONTENTION_BASE_DELAY * 2**contended))
                    continue
                return await self._after_fault(delivery, decoded, exc, kind)

    def _key_may_have_expired(self, decoded: Decoded) -> bool:
        """The message is older than its handler's key retention: its identity may be gone."""
        retention = decoded.handler.retention.key_seconds
        if retention is None or decoded.operation_time is None:
            return False
        age = (dt.datetime.now(dt.UTC) - decoded.operation_time).total_seconds()
        return age > retention

    async def _answer_old_message(self, delivery: Delivery, decoded: Decoded) -> Decision | None:
        """Key expiry is not a new operation (README "Retention"): a message older than its key
        retention is never claimed. Its row, if still there, answers it (duplicate, replayed
        failure, conflict, in progress); without one it is refused as ``key_expired``.
        ``None``: a processing row whose lease expired, which the ordinary path recovers."""
        identity = decoded.identity
        row = await self._bookkeeping(
            lambda conn: self.ledger.fetch(conn, identity.scope, identity.key), "reading the ledger row"
        )
        if row is None:
            logger.warning(
                "key expired scope=%s operation_key=%s message_id=%s: created %s, older than its key "
                "retention, and no ledger row: refused, never executed as new",
                identity.scope, identity.key, delivery.message_id, decoded.operation_time,
            )
            return Decision(
                Outcome.KEY_EXPIRED, Settlement.DEAD_LETTER, reason=DeadLetterReason.KEY_EXPIRED.value,
                detail=f"operation created {decoded.operation_time:%Y-%m-%dT%H:%M:%SZ} is older than the key "
                f"retention of {type(decoded.handler).__name__} and its identity is gone: reconcile by hand",
            )
        return self._handle_for_state(row, decoded)

    async def _execute(self, decoded: Decoded, envelope: Envelope) -> Decision:
        identity = decoded.identity
        try:
            for _ in range(self.pool.max_size + 1):
                async with self.pool.connection() as conn:
                    try:
                        decision = await self._transaction(conn, decoded, envelope)
                    except StaleConnection:
                        continue  # a connection that died in the pool: not this delivery's fault
                    break
            else:
                raise StatementTimeout("no live pooled connection")
        except PermanentFailure as failure:
            decision = await self._record_failure(decoded, envelope, failure)
        except TransactionEnded as exc:
            # What committed cannot be known here: park the operation (never re-run it blindly).
            detail = str(exc)
            await self._bookkeeping(
                lambda conn: self.ledger.park(
                    conn, identity, message_id=envelope.message_id,
                    error_class=TransactionEnded.__name__, detail=detail,
                ),
                "parking",
            )
            return Decision(
                Outcome.UNCERTAIN, Settlement.DEAD_LETTER,
                reason=DeadLetterReason.NEEDS_RECONCILIATION.value, detail=detail,
            )
        except _ClaimBusy:
            # Another transaction holds this key's claim past lock_timeout: never run in parallel.
            return Decision(
                Outcome.IN_PROGRESS, Settlement.RETRY, delay=self.settings.in_progress_delay,
                reason="claim_lock_timeout",
            )
        if decision.outcome in (Outcome.EXECUTED, Outcome.LEASE_RECOVERED, Outcome.FAILED):
            crashpoints.reached(CrashPoint.AFTER_COMMIT_BEFORE_ACK)
        logger.debug("committed scope=%s operation_key=%s", identity.scope, identity.key)
        return decision

    async def _transaction(
        self, conn: psycopg.AsyncConnection[Any], decoded: Decoded, envelope: Envelope
    ) -> Decision:
        """BEGIN and claim (one round trip), run, COMMIT with the session reset; ROLLBACK on any
        exception."""
        timeout = self.settings.statement_timeout
        try:
            decision = await self._claim_and_run(conn, decoded, envelope)
        except BaseException:
            await rollback(conn, timeout)
            raise
        try:
            with step("consumer_kit.commit", decoded.handler.operation_type):
                await commit(conn, timeout, reset=decision.outcome is Outcome.EXECUTED)
        except CommitUncertain as exc:
            # Never ack; the redelivery reads the truth from the ledger.
            return self._commit_uncertain(exc)
        return decision

    def _commit_uncertain(self, exc: CommitUncertain) -> Decision:
        described = describe_error(exc.__cause__ or exc)
        self._environment_fault(f"COMMIT outcome unknown ({described})")
        return Decision(
            Outcome.UNCERTAIN, Settlement.RELEASED, reason="commit_outcome_unknown", detail=described
        )

    async def _claim_and_run(
        self, conn: psycopg.AsyncConnection[Any], decoded: Decoded, envelope: Envelope
    ) -> Decision:
        identity = decoded.identity
        try:
            # The claim may wait lock_timeout on a concurrent claimer, then must answer.
            with step("consumer_kit.claim", decoded.handler.operation_type, histogram="claim"):
                async with bounded(self.settings.lock_timeout + self.settings.statement_timeout, "the claim"):
                    claim = await begin_and_claim(conn, lambda: self.ledger.claim(
                        conn, identity, owner=self.worker_id, lease_seconds=self.settings.lease_seconds,
                        message_id=envelope.message_id, retention=decoded.handler.retention, begin=True,
                    ))
        except pg_errors.LockNotAvailable as exc:
            # Only a lock wait on the claim itself means "in progress"; a lock timeout inside the
            # handler (on a business row) is contention.
            raise _ClaimBusy from exc
        if not claim.claimed:
            if claim.row is None:  # deleted between our two reads: let the redelivery claim afresh
                return Decision(Outcome.IN_PROGRESS, Settlement.RETRY, reason="row_vanished")
            verdict = self._handle_for_state(claim.row, decoded)
            if verdict is not None:
                return verdict
            # A processing row whose lease expired was committed by a run that died (a handler
            # with external effects, or one that committed its own transaction). This handler
            # declares no external effects, so nothing can reconcile it: never run it again
            # blindly (DESIGN.md "External effects"). Park it in this transaction, as the run
            # that died would have: such a row may carry no watch_since (a transactional claim
            # committed by the handler), and the gauges and `ledger list` see only watched rows.
            detail = (
                f"operation {identity.scope}/{identity.key} is processing under an expired "
                f"lease of {claim.row.lease_owner} and {type(decoded.handler).__name__} has no "
                "external_effects to reconcile it: resolve it with `consumer-kit ledger`"
            )
            async with bounded(self.settings.statement_timeout, "parking"):
                await self.ledger.park(
                    conn, identity, message_id=envelope.message_id, error_class="LeaseExpired", detail=detail
                )
            return Decision(
                Outcome.UNCERTAIN, Settlement.DEAD_LETTER,
                reason=DeadLetterReason.NEEDS_RECONCILIATION.value, detail=detail,
            )
        assert claim.xid is not None  # the claim inserted: the transaction has an id
        crashpoints.reached(CrashPoint.AFTER_CLAIM)
        ctx = Context(conn, identity, envelope)
        # A PermanentFailure propagates: the whole transaction (claim included) rolls back and
        # _execute records the failure in a transaction of its own (DESIGN.md step 8). No
        # savepoint on the common path: it would cost two round trips on every delivery.
        try:
            with commit_forbidden(conn):
                try:
                    with step("consumer_kit.handle", decoded.handler.operation_type, histogram="handler"):
                        result = await within_handler_timeout(
                            decoded.handler.handle(decoded.message, ctx), self.settings.handler_timeout
                        )
                finally:
                    ctx.seal()  # a publish after this point raises ContextSealed
        finally:
            ensure_transaction_open(conn)
        ensure_transaction_usable(conn)
        crashpoints.reached(CrashPoint.IN_HANDLER)
        stored = stored_result(result)
        async with bounded(self.settings.statement_timeout, "the ledger completion"):
            completed = await self.ledger.complete(
                conn, identity, stored, fence=Fence.of_transaction(claim.xid), events=ctx.events,
                correlation_id=envelope.correlation_id,
            )
        if not completed:
            # The claim's transaction is not this one any more: the handler sent COMMIT (or
            # ROLLBACK) and BEGIN itself, so part of its effect may be durable already.
            raise TransactionEnded(
                "the handler ended the delivery's transaction and began another (COMMIT; BEGIN sent as SQL)"
            )
        note_events(ctx.events)
        return Decision(Outcome.EXECUTED, Settlement.ACK, result=stored)

    async def _record_failure(
        self, decoded: Decoded, envelope: Envelope, failure: PermanentFailure
    ) -> Decision:
        """Record a permanent failure after its transaction rolled back. If another delivery of the
        key committed in between, its row decides (duplicate, replayed failure or in progress)."""
        identity = decoded.identity

        async def write(conn: psycopg.AsyncConnection[Any]) -> tuple[bool, OperationRow | None]:
            async with conn.transaction():
                recorded = await self.ledger.record_failure(
                    conn, identity, message_id=envelope.message_id, code=failure.code,
                    error_class=type(failure).__name__, detail=failure.detail,
                    retention=decoded.handler.retention,
                )
                row = None if recorded else await self.ledger.fetch(conn, identity.scope, identity.key)
            return recorded, row

        recorded, row = await self._bookkeeping(write, "recording the failure")
        if recorded:
            stored = StoredResult(failure.code, None, None)
            return Decision(Outcome.FAILED, Settlement.ACK, reason=failure.code, result=stored)
        verdict = self._handle_for_state(row, decoded) if row is not None else None
        return verdict or Decision(
            Outcome.IN_PROGRESS, Settlement.RETRY, delay=self.settings.in_progress_delay,
            reason="failure_not_recorded",
        )

    def _handle_for_state(self, row: OperationRow, decoded: Decoded) -> Decision | None:
        """Decide for a key that already has a ledger row. ``None``: an expired lease to recover."""
        identity = decoded.identity
        if row.fingerprint != identity.fingerprint:
            conflict = self._compare_intent(row, decoded)
            if conflict is not None:
                return conflict
        if row.state == ledger_states.COMPLETED:
            return Decision(Outcome.DUPLICATE, Settlement.ACK, result=row.stored_result)
        if row.state == ledger_states.FAILED:
            return Decision(
                Outcome.FAILED_RETAINED, Settlement.ACK, reason=row.result_status, result=row.stored_result
            )
        if row.state == ledger_states.NEEDS_RECONCILIATION:
            return Decision(
                Outcome.UNCERTAIN, Settlement.DEAD_LETTER,
                reason=DeadLetterReason.NEEDS_RECONCILIATION.value,
                detail="operation awaits reconciliation; redrive once it is resolved",
            )
        if row.lease_live:
            return Decision(
                Outcome.IN_PROGRESS, Settlement.RETRY, delay=self.settings.in_progress_delay,
                reason="lease_held",
            )
        return None

    def _compare_intent(self, row: OperationRow, decoded: Decoded) -> Decision | None:
        """The stored fingerprint differs from this message's: a payload conflict, unless the row
        was recorded under another projection version, in which case this message is compared
        under that version (``Handler.earlier_projections``). ``None``: the same intent."""
        identity, handler = decoded.identity, decoded.handler
        conflict = Decision(
            Outcome.PAYLOAD_CONFLICT, Settlement.DEAD_LETTER,
            reason=DeadLetterReason.PAYLOAD_CONFLICT.value,
            detail=f"operation {identity.scope}/{identity.key} exists with another fingerprint",
        )
        if row.projection_version == identity.projection_version:
            return conflict
        try:
            earlier = handler.fingerprint_under(decoded.message, row.projection_version)
        except UnsupportedNumber:
            earlier = None
        if earlier is None:
            # Never ack a possibly different intent as a duplicate: park the message instead.
            logger.warning(
                "operation scope=%s operation_key=%s was recorded under projection v%s, which %s "
                "no longer declares: parked for reconciliation",
                identity.scope, identity.key, row.projection_version, type(handler).__name__,
            )
            return Decision(
                Outcome.UNCERTAIN, Settlement.DEAD_LETTER,
                reason=DeadLetterReason.NEEDS_RECONCILIATION.value,
                detail=f"recorded under projection v{row.projection_version}; "
                f"{type(handler).__name__} declares v{identity.projection_version} and no "
                f"earlier_projections[{row.projection_version}]: intents cannot be compared",
            )
        return None if earlier == row.fingerprint else conflict

    # -- step 8: what a fault costs ----------------------------------------------------------------

    async def _after_fault(
        self, delivery: Delivery, decoded: Decoded, exc: Exception, kind: FaultKind
    ) -> Decision:
        described = describe_error(exc)
        error_class = type(exc).__name__
        # The exception's own text can quote business values: the traceback is frames only.
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("fault traceback message_id=%s\n%s", delivery.message_id, describe_traceback(exc))
        if kind is FaultKind.ENVIRONMENT:
            return self._released_for_environment(exc)
        if kind is FaultKind.MESSAGE:
            # The same values fail the same way on every delivery: dead-letter now.
            logger.warning(
                "deterministic rejection %s on queue=%s message_id=%s: dead-lettering",
                described, delivery.queue, delivery.message_id,
            )
            return Decision(
                Outcome.INVALID, Settlement.DEAD_LETTER,
                reason=f"{DeadLetterReason.INVALID_DATA.value}:{error_class}", detail=described,
            )
        identity = decoded.identity
        contention = kind is FaultKind.CONTENTION
        try:
            counts: AttemptCounts = await self._bookkeeping(
                lambda conn: (self.attempts.count_contention if contention else self.attempts.count_failure)(
                    conn, identity, message_id=delivery.message_id,
                    delivery_count=delivery.delivery_count, detail=described,
                ),
                "the attempt count",
            )
        except Exception as book_exc:  # noqa: BLE001 - classified below
            if classify(book_exc) is FaultKind.ENVIRONMENT:
                return self._released_for_environment(book_exc)
            # Not an outage (a schema not migrated, a bug): fall back to the broker's count rather
            # than loop, and say so loudly.
            logger.error(
                "cannot count attempts of operation_key=%s (%s; is the schema migrated?): using the "
                "broker's delivery count", identity.key, describe_error(book_exc),
            )
            count = delivery.delivery_count
            counts = AttemptCounts(failures=count, contentions=count, crashes=0)
        if contention:
            return self._after_contention(delivery, identity, counts, error_class, described)
        return self._after_handler_fault(delivery, identity, counts, error_class, described)

    def _after_hook_fault(self, delivery: Delivery, exc: Exception) -> Decision:
        """A handler's own hook (``operation_key``, ``tenant``, ``partition_key``, ``projection``)
        raised before the delivery had an identity: a handler fault, retried with backoff and
        dead-lettered after ``max_deliveries``, counted by the broker's delivery count (no
        operation to count it against). Never given back uncounted: it would loop forever."""
        limit = self.settings.max_deliveries
        count = max(delivery.delivery_count, 1)
        error_class = type(exc).__name__
        described = describe_error(exc)
        last = count >= limit
        logger.log(
            logging.ERROR if last else logging.WARNING,
            "handler hook error %s on queue=%s message_id=%s delivery %s of %s: %s",
            described, delivery.queue, delivery.message_id, count, limit,
            "dead-lettering" if last else "will retry",
        )
        if last:
            return Decision(
                Outcome.DEAD_LETTERED, Settlement.DEAD_LETTER,
                reason=f"{DeadLetterReason.MAX_DELIVERIES.value}:{error_class}",
                detail=f"{described} in a handler hook before the claim, on delivery {count} of {limit}",
            )
        return Decision(Outcome.RETRIED, Settlement.RETRY, delay=self.settings.retry_delay(count), reason=error_class)

    def _after_handler_fault(
        self, delivery: Delivery, identity: OperationIdentity, counts: AttemptCounts,
        error_class: str, described: str,
    ) -> Decision:
        limit = self.settings.max_deliveries
        last = counts.failures >= limit
        logger.log(
            logging.ERROR if last else logging.WARNING,
            "handler error %s on queue=%s message_id=%s operation_key=%s attempt %s of %s: %s",
            described, delivery.queue, delivery.message_id, identity.key, counts.failures, limit,
            "dead-lettering" if last else "rolled back, will retry",
        )
        if last:
            return Decision(
                Outcome.DEAD_LETTERED, Settlement.DEAD_LETTER,
                reason=f"{DeadLetterReason.MAX_DELIVERIES.value}:{error_class}",
                detail=f"{described} on attempt {counts.failures} of {limit}",
            )
        return Decision(
            Outcome.RETRIED, Settlement.RETRY,
            delay=self.settings.retry_delay(counts.failures), reason=error_class,
        )

    def _after_contention(
        self, delivery: Delivery, identity: OperationIdentity, counts: AttemptCounts,
        error_class: str, described: str,
    ) -> Decision:
        limit = self.settings.max_contentions
        last = counts.contentions >= limit
        logger.log(
            logging.ERROR if last else logging.INFO,
            "contention %s on queue=%s message_id=%s operation_key=%s (%s of %s): %s",
            described, delivery.queue, delivery.message_id, identity.key, counts.contentions, limit,
            "dead-lettering" if last else "rolled back, will retry",
        )
        if last:
            return Decision(
                Outcome.DEAD_LETTERED, Settlement.DEAD_LETTER,
                reason=f"{DeadLetterReason.MAX_CONTENTIONS.value}:{error_class}",
                detail=f"{described} on contended attempt {counts.contentions} of {limit}",
            )
        return Decision(
            Outcome.CONTENDED, Settlement.RETRY,
            delay=random.uniform(0.5, 1.5) * self.settings.in_progress_delay,
            reason=f"contention:{error_class}",
        )

    def _released_for_environment(self, exc: BaseException) -> Decision:
        described = describe_error(exc)
        self._environment_fault(described)
        return Decision(
            Outcome.RELEASED, Settlement.RELEASED, reason=f"environment:{type(exc).__name__}",
            detail=described,
        )

    def _environment_fault(self, reason: str) -> None:
        logger.warning("database unavailable (%s): deliveries go back uncounted", reason)
        if self.on_environment_fault is not None:
            self.on_environment_fault(reason)

    async def _bookkeeping(
        self, write: Callable[[psycopg.AsyncConnection[Any]], Awaitable[T]], what: str
    ) -> T:
        """Run ``write`` on a pooled connection of its own, bounded by ``statement_timeout``
        (waiting for the connection included)."""
        async with bounded(self.settings.statement_timeout, what):
            async with self.pool.connection() as conn:
                return await write(conn)

    # -- settlement ----------------------------------------------------------------------------

    async def _settle(self, delivery: Delivery, decision: Decision) -> None:
        """Settle; bounded and never raising (the delivery's own contract)."""
        if decision.how is Settlement.ACK:
            await delivery.ack()
        elif decision.how is Settlement.RETRY:
            await delivery.retry(decision.delay)
        elif decision.how is Settlement.DEAD_LETTER:
            await delivery.dead_letter(decision.reason or "unknown", decision.detail)
        else:
            await delivery.release()

    def _report(
        self,
        delivery: Delivery,
        decoded: Decoded | None,
        outcome: Outcome,
        started: float,
        *,
        reason: str | None = None,
        result: StoredResult | None = None,
    ) -> DeliveryReport:
        return DeliveryReport(
            outcome=outcome,
            settlement=delivery.settlement,
            queue=delivery.queue,
            message_id=delivery.message_id,
            delivery_count=delivery.delivery_count,
            scope=decoded.identity.scope if decoded else None,
            operation_key=decoded.identity.key if decoded else None,
            reason=reason,
            result=result,
            duration_seconds=time.monotonic() - started,
            settlement_lost=delivery.lost,
            redelivered=delivery.redelivered,
        )
