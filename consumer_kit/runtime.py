"""The runtime: one delivery, step by step (DESIGN.md "One delivery").

``Runtime.process`` is the whole pipeline and reads as the numbered steps:

1. the adapter hands over a delivery under peek-lock;
2. decode and validate (invalid: dead-letter with a reason);
3. compute scope, key and fingerprint;
4. BEGIN; claim with ``INSERT ... ON CONFLICT DO NOTHING`` (a concurrent claimer waits on the
   unique index, bounded by ``lock_timeout``: then ``in_progress``);
5. an existing row decides: duplicate, replayed failure, payload conflict, in progress, or an
   expired lease to recover;
6. run the handler in the same transaction; complete the ledger row and write the outbox events
   it published in one statement (a permanent failure rolls everything back and records a
   retained ``failed`` row in a transaction of its own);
7. COMMIT, then settle. A COMMIT whose reply is lost is *uncertain*: never acked.
8. Retryable errors roll back and retry with backoff; after ``max_deliveries``, dead-letter.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel, ValidationError

from consumer_kit import crashpoints
from consumer_kit import ledger as ledger_states
from consumer_kit.app import App
from consumer_kit.broker import Delivery, Settlement
from consumer_kit.crashpoints import CrashPoint
from consumer_kit.envelope import MESSAGE_TYPE_HEADER, OPERATION_ID_HEADER, Envelope
from consumer_kit.errors import (
    ConfigurationError,
    DeadLetterReason,
    InvalidMessage,
    PermanentFailure,
    SimulatedCrash,
)
from consumer_kit.handler import Context, Handler, Result
from consumer_kit.identity import MAX_SCOPE_PART_LENGTH, OperationIdentity, fingerprint, normalize_key
from consumer_kit.ledger import Ledger, OperationRow
from consumer_kit.outcomes import DeliveryReport, Outcome, StoredResult
from consumer_kit.settings import Settings, redact_url
from consumer_kit.telemetry import Counters, describe_error, record, tracer

logger = logging.getLogger("consumer_kit.runtime")

MAX_BODY_BYTES = 4 * 1024 * 1024  # a larger body is dead-lettered as invalid_json before parsing


@dataclass(frozen=True)
class _Decoded:
    handler: Handler[Any]
    message: BaseModel
    identity: OperationIdentity


class _TransactionEnded(Exception):
    """The handler ended the delivery's transaction itself (``COMMIT``/``ROLLBACK`` sent as SQL):
    part of its effect may be durable without the ledger's completion."""


class _Settle:
    """What to do with the delivery once the transaction is over (settle after COMMIT, never inside)."""

    def __init__(
        self,
        outcome: Outcome,
        how: Settlement,
        *,
        delay: float = 0.0,
        reason: str | None = None,
        detail: str = "",
        result: StoredResult | None = None,
    ) -> None:
        self.outcome, self.how, self.delay = outcome, how, delay
        self.reason, self.detail, self.result = reason, detail, result


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
        settings: timeouts, max deliveries and retry delays.
        worker_id: lease owner name; default ``host:pid:random``.
    """

    def __init__(
        self, app: App, pool: AsyncConnectionPool, settings: Settings, *, worker_id: str | None = None
    ) -> None:
        self.app = app
        self.pool = pool
        self.settings = settings
        self.worker_id = worker_id or default_worker_id()
        self.ledger = Ledger(settings.db_schema)
        self.counters = Counters()
        self.observers: list[Callable[[DeliveryReport], None]] = []  # called with every report

    async def process(self, delivery: Delivery) -> DeliveryReport:
        """Run one delivery through the pipeline and settle it. Never raises except
        ``SimulatedCrash`` (an armed crash point: the delivery stays unsettled) and cancellation."""
        started = time.monotonic()
        envelope = Envelope(delivery.queue, delivery.message_id, delivery.headers, delivery.delivery_count)
        with tracer.start_as_current_span("consumer_kit.delivery") as span:
            span.set_attribute("messaging.message.id", delivery.message_id or "")
            span.set_attribute("messaging.destination.name", delivery.queue)
            decoded: _Decoded | None = None
            try:
                decoded = self._decode(delivery, envelope)  # steps 2 and 3
                span.set_attribute("consumer_kit.operation_key", decoded.identity.key)
                crashpoints.reached(CrashPoint.BEFORE_CLAIM)
                decision = await self._execute(decoded, envelope)  # steps 4 to 7
            except InvalidMessage as exc:
                decision = _Settle(
                    Outcome.INVALID, Settlement.DEAD_LETTER, reason=exc.reason.value, detail=exc.detail
                )
            except SimulatedCrash:
                report = self._report(delivery, decoded, Outcome.CRASHED, started, reason="crash point")
                record(report, self.counters, None)
                raise
            except asyncio.CancelledError:
                await self._settle(delivery, _Settle(Outcome.RETRIED, Settlement.RELEASED))
                raise
            except psycopg.DataError as exc:
                # The same values fail the same way on every delivery (SQLSTATE class 22): retrying
                # cannot help, so dead-letter now rather than after max_deliveries.
                decision = _Settle(
                    Outcome.INVALID, Settlement.DEAD_LETTER,
                    reason=f"{DeadLetterReason.INVALID_DATA.value}:{type(exc).__name__}",
                    detail=f"SQLSTATE {exc.sqlstate}" if exc.sqlstate else type(exc).__name__,
                )
            except Exception as exc:  # noqa: BLE001 - step 8: anything else is retryable
                decision = self._retry_or_dead_letter(delivery, exc)
            span.set_attribute("consumer_kit.outcome", decision.outcome.value)
            crashpoints.reached(CrashPoint.BEFORE_ACK)
            await self._settle(delivery, decision)
        report = self._report(
            delivery, decoded, decision.outcome, started, reason=decision.reason, result=decision.result
        )
        record(report, self.counters, decoded.handler.operation_type if decoded else None)
        for observe in self.observers:
            observe(report)
        return report

    # -- step 2 and 3 ---------------------------------------------------------------------------

    def _decode(self, delivery: Delivery, envelope: Envelope) -> _Decoded:
        """Pick the handler, validate the body, compute the operation identity.

        Raises:
            InvalidMessage: with the specific dead-letter reason.
        """
        handler = self._route(delivery.queue, envelope)
        if len(delivery.body) > MAX_BODY_BYTES:
            raise InvalidMessage(
                DeadLetterReason.INVALID_JSON,
                f"body is {len(delivery.body)} bytes (max {MAX_BODY_BYTES})",
            )
        try:
            raw = json.loads(delivery.body)  # bytes: UTF-8/16/32 detected per RFC 8259
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise InvalidMessage(DeadLetterReason.INVALID_JSON, f"{type(exc).__name__} at body") from None
        try:
            message = handler.model.model_validate(raw)
        except ValidationError as exc:
            raise InvalidMessage(DeadLetterReason.SCHEMA_MISMATCH, _describe_validation(exc)) from None
        key = normalize_key(handler.operation_key(message, envelope), what=_key_source(handler))
        try:
            tenant = normalize_key(handler.tenant(message, envelope), what="tenant")
        except InvalidMessage as exc:  # the tenant comes from a header: report it as one
            raise InvalidMessage(DeadLetterReason.INVALID_HEADER, exc.detail) from None
        if len(tenant) > MAX_SCOPE_PART_LENGTH:
            raise InvalidMessage(DeadLetterReason.INVALID_HEADER, "tenant-id is too long")
        try:
            message_fingerprint = fingerprint(message, handler.fingerprint_exclude)
        except UnicodeEncodeError:  # "\ud800" is valid JSON syntax but not Unicode (RFC 8259 8.2)
            raise InvalidMessage(DeadLetterReason.INVALID_JSON, "body holds a lone surrogate") from None
        identity = OperationIdentity(
            tenant=tenant,
            operation_type=handler.operation_type,
            version=handler.version,
            key=key,
            fingerprint=message_fingerprint,
            projection_version=handler.projection_version,
        )
        return _Decoded(handler, message, identity)

    def _route(self, queue: str, envelope: Envelope) -> Handler[Any]:
        handlers = self.app.routes.get(queue, {})
        wanted = envelope.header(MESSAGE_TYPE_HEADER)
        if wanted is None and len(handlers) == 1:
            return next(iter(handlers.values()))
        if isinstance(wanted, bytes):
            wanted = wanted.decode("utf-8", errors="replace")
        if not isinstance(wanted, str) and wanted is not None:
            raise InvalidMessage(DeadLetterReason.INVALID_HEADER, "message-type must be a string")
        handler = handlers.get(wanted) if wanted is not None else None
        if handler is None:
            raise InvalidMessage(
                DeadLetterReason.UNKNOWN_MESSAGE_TYPE,
                f"no handler on queue {queue!r} for message-type {str(wanted)[:100]!r}",
            )
        return handler

    # -- steps 4 to 7 ---------------------------------------------------------------------------

    async def _execute(self, decoded: _Decoded, envelope: Envelope) -> _Settle:
        identity = decoded.identity
        committing = False
        try:
            for stale in range(self.pool.max_size + 1):
                async with self.pool.connection() as conn:
                    began = False
                    try:
                        async with conn.transaction():  # BEGIN ... COMMIT on leaving the block
                            began = True
                            decision = await self._claim_and_run(conn, decoded, envelope)
                            committing = True
                    except psycopg.OperationalError:
                        if not began and conn.broken and stale < self.pool.max_size:
                            # A pooled connection that died while idle (server restart, fail-over,
                            # pg_terminate_backend) fails at BEGIN, before anything was claimed.
                            # The pool discards it on return; take the next one instead of
                            # burning a delivery (each dead connection would cost one).
                            continue
                        if committing and conn.broken:
                            # The COMMIT was sent but its reply is lost: the effect may or may not be
                            # durable. Never ack; the redelivery reads the truth from the ledger.
                            return _Settle(
                                Outcome.UNCERTAIN,
                                Settlement.RETRY,
                                delay=self.settings.in_progress_delay,
                                reason="commit_outcome_unknown",
                            )
                        raise
                break
        except PermanentFailure as failure:
            decision = await self._record_failure(decoded, envelope, failure)
        except _TransactionEnded as exc:
            # What committed cannot be known here: park the operation (never re-run it blindly).
            async with self.pool.connection() as conn:
                await self.ledger.park(
                    conn, identity, message_id=envelope.message_id,
                    error_class=type(exc).__name__, detail=str(exc),
                )
            return _Settle(
                Outcome.UNCERTAIN, Settlement.DEAD_LETTER,
                reason=DeadLetterReason.NEEDS_RECONCILIATION.value, detail=str(exc),
            )
        except _ClaimBusy:
            # Another transaction holds this key's claim past lock_timeout: never run in parallel.
            return _Settle(
                Outcome.IN_PROGRESS, Settlement.RETRY, delay=self.settings.in_progress_delay,
                reason="claim_lock_timeout",
            )
        if decision.outcome in (Outcome.EXECUTED, Outcome.LEASE_RECOVERED, Outcome.FAILED):
            crashpoints.reached(CrashPoint.AFTER_COMMIT_BEFORE_ACK)
        logger.debug("committed scope=%s operation_key=%s", identity.scope, identity.key)
        return decision

    async def _claim_and_run(
        self, conn: psycopg.AsyncConnection[Any], decoded: _Decoded, envelope: Envelope
    ) -> _Settle:
        identity = decoded.identity
        try:
            claimed, row = await self.ledger.claim(
                conn, identity, owner=self.worker_id,
                lease_seconds=self.settings.lease_seconds, message_id=envelope.message_id,
            )
        except pg_errors.LockNotAvailable as exc:
            # Only a lock wait on the claim itself means "in progress"; a lock timeout inside the
            # handler (on a business row) is an ordinary retryable error.
            raise _ClaimBusy from exc
        recovered = False
        if not claimed:
            if row is None:  # deleted between our two reads: let the redelivery claim afresh
                return _Settle(Outcome.IN_PROGRESS, Settlement.RETRY, reason="row_vanished")
            verdict = self._handle_for_state(row, identity)
            if verdict is not None:
                return verdict
            # Expired lease on a processing row: take it over with a conditional write.
            recovered = await self.ledger.take_over_expired_lease(
                conn, identity.scope, identity.key, owner=self.worker_id,
                lease_seconds=self.settings.lease_seconds,
            )
            if not recovered:
                return _Settle(
                    Outcome.IN_PROGRESS, Settlement.RETRY, delay=self.settings.in_progress_delay,
                    reason="lease_taken_by_another_worker",
                )
        crashpoints.reached(CrashPoint.AFTER_CLAIM)
        ctx = Context(conn, identity, envelope)
        # A PermanentFailure propagates: the whole transaction (claim included) rolls back and
        # _execute records the failure in a transaction of its own (DESIGN.md step 8). No
        # savepoint on the common path: it would cost two round trips on every delivery.
        try:
            async with asyncio.timeout(self.settings.handler_timeout):
                result = await decoded.handler.handle(decoded.message, ctx)
        finally:
            _ensure_transaction_open(conn)
        _ensure_transaction_usable(conn)
        crashpoints.reached(CrashPoint.IN_HANDLER)
        stored = _stored(result)
        await self.ledger.complete(
            conn, identity, stored, events=ctx.events, correlation_id=envelope.correlation_id
        )
        outcome = Outcome.LEASE_RECOVERED if recovered else Outcome.EXECUTED
        return _Settle(outcome, Settlement.ACK, result=stored)

    async def _record_failure(
        self, decoded: _Decoded, envelope: Envelope, failure: PermanentFailure
    ) -> _Settle:
        """Record a permanent failure after its transaction rolled back. If another delivery of the
        key committed in between, its row decides (duplicate, replayed failure or in progress)."""
        identity = decoded.identity
        async with self.pool.connection() as conn, conn.transaction():
            recorded = await self.ledger.record_failure(
                conn, identity, message_id=envelope.message_id, code=failure.code,
                error_class=type(failure).__name__, detail=failure.detail,
            )
            if not recorded:
                row = await self.ledger.fetch(conn, identity.scope, identity.key)
        if recorded:
            stored = StoredResult(failure.code, None, None)
            return _Settle(Outcome.FAILED, Settlement.ACK, reason=failure.code, result=stored)
        verdict = self._handle_for_state(row, identity) if row is not None else None
        return verdict or _Settle(
            Outcome.IN_PROGRESS, Settlement.RETRY, delay=self.settings.in_progress_delay,
            reason="failure_not_recorded",
        )

    def _handle_for_state(self, row: OperationRow, identity: OperationIdentity) -> _Settle | None:
        """Decide for a key that already has a ledger row. ``None``: an expired lease to recover."""
        if row.fingerprint != identity.fingerprint:
            if row.projection_version == identity.projection_version:
                return _Settle(
                    Outcome.PAYLOAD_CONFLICT, Settlement.DEAD_LETTER,
                    reason=DeadLetterReason.PAYLOAD_CONFLICT.value,
                    detail=f"operation {identity.scope}/{identity.key} exists with another fingerprint",
                )
            # Fingerprints of different projection versions cannot be compared; the key decides.
            logger.warning(
                "fingerprint projection changed (stored v%s, now v%s) scope=%s operation_key=%s: "
                "treated as the same operation",
                row.projection_version, identity.projection_version, identity.scope, identity.key,
            )
        if row.state == ledger_states.COMPLETED:
            return _Settle(Outcome.DUPLICATE, Settlement.ACK, result=row.stored_result)
        if row.state == ledger_states.FAILED:
            return _Settle(
                Outcome.FAILED_RETAINED, Settlement.ACK, reason=row.result_status, result=row.stored_result
            )
        if row.state == ledger_states.NEEDS_RECONCILIATION:
            return _Settle(
                Outcome.UNCERTAIN, Settlement.DEAD_LETTER,
                reason=DeadLetterReason.NEEDS_RECONCILIATION.value,
                detail="operation awaits reconciliation; redrive once it is resolved",
            )
        if row.lease_live:
            return _Settle(
                Outcome.IN_PROGRESS, Settlement.RETRY, delay=self.settings.in_progress_delay,
                reason="lease_held",
            )
        return None

    # -- step 8 and settlement -------------------------------------------------------------------

    def _retry_or_dead_letter(self, delivery: Delivery, exc: Exception) -> _Settle:
        error_class = type(exc).__name__
        described = describe_error(exc)
        last = delivery.delivery_count >= self.settings.max_deliveries
        logger.log(
            logging.ERROR if last else logging.WARNING,
            "handler error %s on queue=%s message_id=%s delivery_count=%s: %s",
            described, delivery.queue, delivery.message_id, delivery.delivery_count,
            "dead-lettering" if last else "rolled back, will retry",
        )
        # The exception's own text can quote business values, so the full traceback is DEBUG only.
        logger.debug("handler error traceback message_id=%s", delivery.message_id, exc_info=exc)
        if last:
            return _Settle(
                Outcome.DEAD_LETTERED, Settlement.DEAD_LETTER,
                reason=f"{DeadLetterReason.MAX_DELIVERIES.value}:{error_class}",
                detail=f"{described} on delivery {delivery.delivery_count} of {self.settings.max_deliveries}",
            )
        return _Settle(
            Outcome.RETRIED, Settlement.RETRY,
            delay=self.settings.retry_delay(delivery.delivery_count), reason=error_class,
        )

    async def _settle(self, delivery: Delivery, decision: _Settle) -> None:
        """Settle without ever raising or hanging (a lost settlement means a redelivery)."""
        try:
            async with asyncio.timeout(self.settings.settle_timeout):  # no extra task, unlike wait_for
                if decision.how is Settlement.ACK:
                    await delivery.ack()
                elif decision.how is Settlement.RETRY:
                    # waiting for another worker is not a failed attempt: do not count it
                    await delivery.retry(decision.delay, count=decision.outcome is not Outcome.IN_PROGRESS)
                elif decision.how is Settlement.DEAD_LETTER:
                    await delivery.dead_letter(decision.reason or "unknown", decision.detail)
                else:
                    await delivery.release()
        except Exception as exc:  # noqa: BLE001 - the broker redelivers; the ledger makes it a duplicate
            logger.warning(
                "settlement %s failed (%s) queue=%s message_id=%s: the broker will redeliver",
                decision.how.value, type(exc).__name__, delivery.queue, delivery.message_id,
            )

    def _report(
        self,
        delivery: Delivery,
        decoded: _Decoded | None,
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
        )


def _ensure_transaction_open(conn: psycopg.AsyncConnection[Any]) -> None:
    """Raise :class:`_TransactionEnded` when the handler left no transaction open (the autocommit
    connection is idle: its writes so far, and the claim, were committed or rolled back)."""
    if conn.info.transaction_status is psycopg.pq.TransactionStatus.IDLE:
        raise _TransactionEnded(
            "the handler ended the delivery's transaction (COMMIT or ROLLBACK sent as SQL)"
        )


def _ensure_transaction_usable(conn: psycopg.AsyncConnection[Any]) -> None:
    """After a handler returned normally: raise ``InFailedSqlTransaction`` when it caught a
    database error and carried on (the transaction is aborted, so nothing of it can commit; said
    here rather than as a confusing failure of the ledger's completion)."""
    if conn.info.transaction_status is psycopg.pq.TransactionStatus.INERROR:
        raise pg_errors.InFailedSqlTransaction(
            "the handler caught a database error and returned: its transaction is aborted "
            "(use `async with ctx.connection.transaction():` around statements that may fail)"
        )


def _stored(result: Any) -> StoredResult:
    if result is None:
        return StoredResult("ok", None, None)
    if isinstance(result, Result):
        return StoredResult(result.status[:200], (result.reference or None) and result.reference[:500], result.body)
    raise TypeError(f"handle() must return consumer_kit.Result or None, not {type(result).__name__}")


def _key_source(handler: Handler[Any]) -> str:
    """How to name the key in an error: where it comes from when the handler does not say."""
    if type(handler).operation_key is Handler.operation_key:
        return f"operation key (header {OPERATION_ID_HEADER!r})"
    return f"operation key of {type(handler).__name__}"


def _describe_validation(exc: ValidationError) -> str:
    """Field locations and error types only: pydantic's default text would echo payload values."""
    parts = [
        f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['type']}"
        for err in exc.errors(include_url=False, include_input=False, include_context=False)[:10]
    ]
    return "; ".join(parts)


async def open_pool(
    settings: Settings, database_url: str, *, size: int | None = None, search_path: str | None = None
) -> AsyncConnectionPool:
    """Open an autocommit connection pool whose sessions carry ``lock_timeout``.

    ``lock_timeout`` bounds how long a claim waits on a concurrent claimer of the same key (and any
    lock the handler waits on): past it the delivery is retried as ``in_progress``. ``search_path``
    (e.g. ``"app,public"``) sets where the handlers' unqualified table names resolve. With
    ``settings.outbox_notify`` off, the sessions' outbox writes send no NOTIFY.

    Raises:
        ConfigurationError: PostgreSQL cannot be reached or refuses the URL (checked with one
            connection first, so a wrong URL fails at once instead of after the pool's timeout).
    """
    await _probe(database_url)
    lock_ms = int(settings.lock_timeout * 1000)
    options = f"-c lock_timeout={lock_ms}"
    if not settings.outbox_notify:
        options += " -c consumer_kit.outbox_notify=off"
    if search_path:
        options += f" -c search_path={search_path}"
    pool = AsyncConnectionPool(
        database_url,
        min_size=1,
        max_size=size or settings.effective_pool_size,
        kwargs={"autocommit": True, "options": options},
        open=False,
        name="consumer-kit",
    )
    await pool.open(wait=True, timeout=30)
    return pool


async def _probe(database_url: str) -> None:
    try:
        conn = await psycopg.AsyncConnection.connect(database_url, connect_timeout=10)
    except (psycopg.OperationalError, psycopg.ProgrammingError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigurationError(f"cannot connect to PostgreSQL at {redact_url(database_url)}: {reason}") from None
    await conn.close()
