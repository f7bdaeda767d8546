"""The batch path: many deliveries, one transaction (docs/explanation/architecture.md, "One state machine":
"the same machine over a set of keys"; docs/how-to/batches.md).

One transaction per batch: **one claim statement** for every key, sent with BEGIN in one round trip
(:meth:`~consumer_kit.pipeline.operation.Operations.claim_many`), each existing row answered by
the state machine's own :meth:`~consumer_kit.pipeline.operation.Operations.decide` (duplicate,
conflict, in progress, ... never run), ``handle`` for each newly claimed item in delivery order on
the one connection, **one completion statement** for all of them with all their outbox events
(:meth:`~consumer_kit.pipeline.operation.Operations.complete_many`), one COMMIT.

Per-item outcomes without a savepoint per item (two round trips each on the common path): when an
item's handler raises, the whole transaction rolls back and the batch runs again **without that
item**; the item is handed back to the caller, which runs it on its own, on the per-delivery path,
after the batch (where its fault is classified and counted, its permanent failure recorded:
exactly as if it had come alone). So the others lose neither their effect nor an attempt: a
rolled-back run of theirs is never counted, and an error that follows one item (its own statement
over ``temp_file_limit``) is that item's alone. An item that is not the batch's to answer (an
expired lease, a row that vanished, a second delivery of a key already in the batch, every item
when the claim's lock wait ran out) is handed back the same way. Two faults are the batch's, not an
item's. An environment fault propagates: the caller gives the whole batch back uncounted.
Contention (a deadlock, serialization failure or lock timeout in an item's handler) hands every
item back: a rerun of the rest at once, in a new transaction and in the same order, would meet the
same locks (two batches that lock rows in opposite orders deadlock again and again, each time
after ``deadlock_timeout``); one by one, each item holds only its own locks, and the per-delivery
path retries its contention in place with jitter, then through the broker, counted.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg_pool import AsyncConnectionPool

from consumer_kit.broker import Delivery
from consumer_kit.codec.envelope import Envelope
from consumer_kit.context import Context
from consumer_kit.errors import CommitUncertain, StaleConnection, TransactionEnded
from consumer_kit.handler import batches_at_once
from consumer_kit.model.results import StoredResult
from consumer_kit.model.verdict import Verdict, VerdictKind
from consumer_kit.pipeline import crashpoints
from consumer_kit.pipeline.crashpoints import CrashPoint
from consumer_kit.pipeline.decoding import DecodedDelivery as Decoded
from consumer_kit.pipeline.early_answers import EarlyAnswers
from consumer_kit.pipeline.faults import FaultKind, classify
from consumer_kit.pipeline.operation import Operations
from consumer_kit.pipeline.transaction import (
    begin_and_claim,
    commit,
    commit_forbidden,
    ensure_transaction_open,
    ensure_transaction_usable,
    on_own_connection,
    rollback,
    stored_result,
    within_handler_timeout,
)
from consumer_kit.pipeline.transactional import message_intent
from consumer_kit.settings import Settings
from consumer_kit.telemetry import describe_error, step
from consumer_kit.telemetry.tracing import DeliveryTrace, as_current

__all__ = ["BatchItem", "BatchOutcome", "BatchPath"]

logger = logging.getLogger("consumer_kit.runtime")


@dataclass(eq=False)
class BatchItem:
    """One decoded delivery of a batch, with its span's notes."""

    delivery: Delivery
    decoded: Decoded
    envelope: Envelope
    trace: DeliveryTrace | None = None


@dataclass
class BatchOutcome:
    """What the batch decided: a verdict per item it answered, the items handed back to be run
    on their own (in delivery order), after the batch's COMMIT, and the contention that rolled
    the batch back, if one did (its items are then all handed back)."""

    verdicts: dict[int, Verdict] = field(default_factory=dict)  # id(item) -> verdict
    alone: list[BatchItem] = field(default_factory=list)
    contention: BaseException | None = None  # the batch rolled back for it: every item runs alone


class _ItemFailed(Exception):
    """An item's handler raised (the transaction is rolled back): run the rest without it."""

    def __init__(self, item: BatchItem, cause: BaseException) -> None:
        super().__init__(describe_error(cause))
        self.item = item
        self.cause = cause


class _AtOnceFailed(Exception):
    """A ``handle_batch`` raised (the transaction is rolled back): which item's fault it was
    cannot be told, so the batch runs again item by item through ``handle``."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(describe_error(cause))
        self.cause = cause


class _ClaimWaited(Exception):
    """The batch's claim waited ``lock_timeout`` on a concurrent claimer of one of its keys."""


class _BatchEnded(Exception):
    """A handler ended the batch's transaction (rolled back since): park what it had claimed."""

    def __init__(self, detail: str, claimed: Sequence[BatchItem]) -> None:
        super().__init__(detail)
        self.claimed = list(claimed)


class BatchPath:
    """Runs batches of deliveries of handlers without external effects.

    Args:
        pool: the worker's connection pool (autocommit connections).
        settings: ``statement_timeout``, ``handler_timeout``, ``lock_timeout`` (seconds).
        operations: the state machine.
    """

    def __init__(
        self, pool: AsyncConnectionPool, settings: Settings, operations: Operations, early: EarlyAnswers
    ) -> None:
        self.pool = pool
        self.settings = settings
        self.operations = operations
        self.early = early

    async def execute(self, items: Sequence[BatchItem]) -> BatchOutcome:
        """Run ``items`` (not redelivered, handlers without external effects) as one transaction,
        again without each item whose handler raised.

        Raises:
            Exception: an environment fault (classified by the caller: the whole batch goes back
                uncounted), or a fault of no single item (the claim, the completion or the COMMIT
                refused): nothing of the batch committed.
        """
        outcome = BatchOutcome()
        pending: list[BatchItem] = []
        seen: set[tuple[str, str]] = set()
        for item in items:
            where = (item.decoded.identity.scope, item.decoded.identity.key)
            # A second delivery of a key in the same batch runs after it, on its own: it answers
            # from the row the first one leaves (duplicate, or payload conflict).
            (outcome.alone if where in seen else pending).append(item)
            seen.add(where)
        at_once = True
        while pending:
            try:
                answered = await self._on_a_connection(pending, at_once)
            except (_AtOnceFailed, _ItemFailed) as failed:
                kind = classify(failed.cause)
                if kind is FaultKind.ENVIRONMENT:
                    raise failed.cause from None
                if kind is FaultKind.CONTENTION:
                    # The batch's, not an item's: rerun without the item that met the lock, the
                    # rest would meet it again. One by one, each item's transaction holds only its
                    # own locks and meets contention with the per-delivery path's backoff.
                    outcome.contention = failed.cause
                    outcome.alone.extend(pending)
                    break
                if isinstance(failed, _AtOnceFailed):
                    logger.info("handle_batch of %s items failed (%s): running them one by one", len(pending), failed)
                    at_once = False
                    continue
                logger.info(
                    "batch item message_id=%s operation_key=%s failed (%s): running the rest of the batch "
                    "without it", failed.item.delivery.message_id, failed.item.decoded.identity.key, failed,
                )
                pending.remove(failed.item)
                outcome.alone.append(failed.item)
                continue
            except _ClaimWaited:
                # A concurrent claimer held one of the keys past lock_timeout; which one cannot
                # be told, so each item claims on its own (and waits, or answers in_progress).
                outcome.alone.extend(pending)
                break
            for item, verdict in answered:
                if verdict is None:
                    outcome.alone.append(item)
                else:
                    outcome.verdicts[id(item)] = verdict
            break
        order = {id(item): n for n, item in enumerate(items)}
        outcome.alone.sort(key=lambda item: order[id(item)])
        return outcome

    async def _on_a_connection(self, pending: list[BatchItem], at_once: bool) -> list[tuple[BatchItem, Verdict | None]]:
        for _ in range(self.pool.max_size + 1):
            try:
                # a batch that claimed nothing is answered before its transaction ends
                return await self.early.on_connection(lambda conn: self._transaction(conn, pending, at_once))
            except StaleConnection:
                continue  # a connection that died in the pool: not this batch's fault
            except _BatchEnded as ended:
                return await self._park(pending, ended.claimed, str(ended))
        raise psycopg.OperationalError("no live pooled connection for the batch")

    async def _transaction(
        self, conn: psycopg.AsyncConnection[Any], pending: list[BatchItem], at_once: bool
    ) -> tuple[list[tuple[BatchItem, Verdict | None]], bool]:
        """BEGIN, claim all, run the new ones, complete all, COMMIT; ROLLBACK on any exception.
        ``None`` for an item: run it on its own after the batch. With it, whether the transaction
        is still open: it claimed nothing (every row already existed), so wrote nothing, and its
        end does not hold the answers back."""
        timeout = self.settings.statement_timeout
        try:
            answered, claimed = await self._claim_and_run(conn, pending, at_once)
        except BaseException:
            await rollback(conn, timeout)
            raise
        if not claimed:
            return answered, True
        ran = any(isinstance(v, Verdict) and v.kind is VerdictKind.EXECUTED for _, v in answered)
        try:
            with step("consumer_kit.commit", "batch"):
                await commit(conn, timeout, reset=ran)
        except CommitUncertain as exc:
            # Never ack what may not be durable; the redeliveries read the truth from the ledger.
            uncertain = Verdict(VerdictKind.UNCERTAIN, why="commit_outcome_unknown", detail=describe_error(exc.__cause__ or exc))
            return [(item, uncertain if v is not None and v.kind is VerdictKind.EXECUTED else v) for item, v in answered], False
        if ran:
            crashpoints.reached(CrashPoint.AFTER_COMMIT_BEFORE_ACK)
        return answered, False

    async def _claim_and_run(
        self, conn: psycopg.AsyncConnection[Any], pending: list[BatchItem], at_once: bool
    ) -> tuple[list[tuple[BatchItem, Verdict | None]], bool]:
        """The answers, and whether the claim inserted any row (claimed an operation)."""
        with step("consumer_kit.claim", "batch", histogram="claim"):
            # BEGIN goes with the claim (one round trip); StaleConnection: take another one
            try:
                xid, found = await begin_and_claim(conn, self.operations.claim_many(
                    conn,
                    [(i.decoded.identity, message_intent(i.decoded), i.envelope.message_id, i.decoded.handler.retention)
                     for i in pending],
                ))
            except pg_errors.LockNotAvailable as exc:  # the claim's own wait: not contention of the batch
                raise _ClaimWaited from exc
        crashpoints.reached(CrashPoint.AFTER_CLAIM)
        answered: list[tuple[BatchItem, Verdict | None]] = []
        claimed: list[BatchItem] = []
        for item, verdict in zip(pending, found, strict=True):
            if verdict is None:
                claimed.append(item)
                continue
            # An expired lease or a vanished row: the per-delivery path knows what to do.
            keep = verdict.kind is not VerdictKind.LEASE_RECOVERABLE and verdict.why != "row_vanished"
            answered.append((item, verdict if keep else None))
        handled = await self._run_handlers(conn, claimed, at_once)
        completions = [
            (item.decoded.identity, h.stored, h.events, item.envelope.correlation_id)
            for item, h in zip(claimed, handled, strict=True)
        ]
        crashpoints.reached(CrashPoint.IN_HANDLER)
        if completions:
            assert xid is not None  # the claim inserted: the transaction has an id
            try:
                executed = await self.operations.complete_many(conn, completions, xid=xid)
            except TransactionEnded as exc:
                raise _BatchEnded(str(exc), claimed) from None
            done = dict(zip((id(i) for i in claimed), executed, strict=True))
            answered.extend((item, done[id(item)]) for item in claimed)
        return answered, xid is not None

    async def _run_handlers(
        self, conn: psycopg.AsyncConnection[Any], claimed: list[BatchItem], at_once: bool
    ) -> list[_Handled]:
        """Each claimed item's effect, in delivery order: one ``handle_batch`` call for the items
        of a handler that has one (``at_once``), else ``handle`` per item."""
        handled: dict[int, _Handled] = {}
        groups: dict[int, list[BatchItem]] = {}
        for item in claimed:
            if at_once and batches_at_once(item.decoded.handler):
                groups.setdefault(id(item.decoded.handler), []).append(item)
        for items in groups.values():
            for item, done in zip(items, await self._handle_at_once(conn, items, claimed), strict=True):
                handled[id(item)] = done
        for item in claimed:
            if id(item) not in handled:
                handled[id(item)] = await self._handle(conn, item, claimed)
        return [handled[id(item)] for item in claimed]

    async def _handle_at_once(
        self, conn: psycopg.AsyncConnection[Any], items: list[BatchItem], claimed: list[BatchItem]
    ) -> list[_Handled]:
        handler = items[0].decoded.handler
        contexts = [Context(conn, item.decoded.identity, item.envelope) for item in items]
        try:
            with commit_forbidden(conn):
                try:
                    with step("consumer_kit.handle_batch", handler.operation_type, histogram="handler"):
                        results = await within_handler_timeout(
                            handler.handle_batch([(i.decoded.message, c) for i, c in zip(items, contexts, strict=True)]),
                            self.settings.handler_timeout,
                        )
                finally:
                    for ctx in contexts:
                        ctx.seal()
            ensure_transaction_open(conn)
            ensure_transaction_usable(conn)
            if len(results) != len(items):
                raise TypeError(f"handle_batch returned {len(results)} results for {len(items)} items")
            stored = [stored_result(result) for result in results]
        except TransactionEnded as exc:
            raise _BatchEnded(str(exc), claimed) from None
        except Exception as exc:
            raise _AtOnceFailed(exc) from exc
        done = []
        for item, ctx, result in zip(items, contexts, stored, strict=True):
            if item.trace is not None:
                item.trace.event_ids.extend(str(e.event_id) for e in ctx.events)
            done.append(_Handled(result, ctx.events))
        return done

    async def _handle(self, conn: psycopg.AsyncConnection[Any], item: BatchItem, claimed: list[BatchItem]) -> _Handled:
        """Run one item's handler in the batch's transaction; any failure is the item's."""
        handler = item.decoded.handler
        ctx = Context(conn, item.decoded.identity, item.envelope)
        try:
            with as_current(item.trace), commit_forbidden(conn):
                try:
                    with step("consumer_kit.handle", handler.operation_type, histogram="handler"):
                        result = await within_handler_timeout(
                            handler.handle(item.decoded.message, ctx), self.settings.handler_timeout
                        )
                finally:
                    ctx.seal()
            ensure_transaction_open(conn)
            ensure_transaction_usable(conn)
            stored = stored_result(result)
        except TransactionEnded as exc:
            raise _BatchEnded(str(exc), claimed) from None
        except Exception as exc:
            raise _ItemFailed(item, exc) from exc
        if item.trace is not None:
            item.trace.event_ids.extend(str(e.event_id) for e in ctx.events)
        return _Handled(stored, ctx.events)

    async def _park(
        self, pending: list[BatchItem], claimed: Sequence[BatchItem], detail: str
    ) -> list[tuple[BatchItem, Verdict | None]]:
        """A handler ended the batch's transaction: what committed of it cannot be known, so every
        operation it had claimed is parked (never run again blindly); the others run on their own."""
        parked = {id(i) for i in claimed}
        answered: list[tuple[BatchItem, Verdict | None]] = []
        for item in pending:
            if id(item) not in parked:
                answered.append((item, None))
                continue
            park = functools.partial(
                self.operations.park, identity=item.decoded.identity, message_id=item.envelope.message_id,
                error_class=TransactionEnded.__name__, why="transaction_ended", detail=detail,
            )
            verdict = await on_own_connection(self.pool, self.settings.statement_timeout, park, "parking")
            answered.append((item, verdict))
        return answered


@dataclass(frozen=True)
class _Handled:
    stored: StoredResult
    events: Any
