"""The runtime: one delivery, step by step (docs/explanation/one-delivery.md and "Faults and attempts").

``Runtime.process`` reads as the steps, each in a module of its own:

1. **decode** and validate the body, compute scope, key and fingerprint
   (:mod:`consumer_kit.pipeline.decoding`; invalid: dead-letter with a reason);
2. **isolate** (:mod:`consumer_kit.pipeline.isolation`): the key's lane, at most ``concurrency``
   deliveries at once, a *redelivered* message alone with a crash count (parked as
   ``crashed_worker`` after ``crash_limit`` deaths);
3. **run** on the transactional path (:mod:`consumer_kit.pipeline.transactional`) or, for a
   handler with external effects, the leased path (:mod:`consumer_kit.pipeline.leased`); both ask
   the operation state machine (:mod:`consumer_kit.pipeline.operation`), which returns a neutral
   verdict. A fault is classified (:mod:`consumer_kit.pipeline.faults`) and costs what the fault
   policy says (:mod:`consumer_kit.pipeline.fault_policy`, a pure function);
4. **settle** as the one table of :mod:`consumer_kit.pipeline.settlement` says (after COMMIT,
   never inside; a COMMIT without a reply is never acked: the redelivery reads the ledger);
5. **report**: count, measure, log, tell the observers.

Every statement of consumer-kit's own is bounded (``statement_timeout``); the handler is bounded
by ``handler_timeout``; settlement is bounded by the delivery itself (``settle_timeout``).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from psycopg_pool import AsyncConnectionPool

from consumer_kit.app import App
from consumer_kit.broker import Delivery, Settlement, ack_all
from consumer_kit.codec.envelope import Envelope
from consumer_kit.db.pool import open_pool
from consumer_kit.errors import GiveBack, InvalidMessage, SimulatedCrash
from consumer_kit.ledger import AttemptBook
from consumer_kit.model.decision import Decision
from consumer_kit.model.outcomes import DeliveryReport, Outcome
from consumer_kit.model.verdict import Verdict, VerdictKind
from consumer_kit.pipeline import crashpoints
from consumer_kit.pipeline.admission import Admission
from consumer_kit.pipeline.batch import BatchItem, BatchOutcome, BatchPath
from consumer_kit.pipeline.crashpoints import CrashPoint
from consumer_kit.pipeline.decoding import DecodedDelivery as Decoded
from consumer_kit.pipeline.decoding import decode
from consumer_kit.pipeline.early_answers import EarlyAnswers
from consumer_kit.pipeline.fault_costs import FaultCosts
from consumer_kit.pipeline.fault_policy import Action, fault_decision
from consumer_kit.pipeline.faults import FaultKind, classify
from consumer_kit.pipeline.isolation import Isolation
from consumer_kit.pipeline.leased import LeasedPath
from consumer_kit.pipeline.operation import Operations
from consumer_kit.pipeline.settlement import decision_for, invalid_decision, report_of, settle
from consumer_kit.pipeline.transaction import on_own_connection
from consumer_kit.pipeline.transactional import TransactionalPath, message_intent
from consumer_kit.settings import Settings
from consumer_kit.telemetry import (
    DeliveryTrace,
    OutcomeCounters,
    delivery_span,
    describe_error,
    messaging_system,
    record,
)
from consumer_kit.telemetry.tracing import as_current, batch_span, member_span

__all__ = ["Runtime", "RuntimeHooks", "default_worker_id", "open_pool"]

logger = logging.getLogger("consumer_kit.runtime")


def default_worker_id() -> str:
    """``"<host>:<pid>:<random>"``: the lease owner name of this process."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class RuntimeHooks:
    """What the runtime tells its owner (the worker).

    Attributes:
        on_environment_fault: called with a one-line reason when a delivery met an environment
            fault (the worker pauses consuming and probes); ``None``: nobody to tell.
        before_release: awaited before a delivery is given back uncounted (the worker: until its
            consumers have stopped, bounded); ``None``: release at once.
        observers: called with every :class:`DeliveryReport`.
    """

    on_environment_fault: Callable[[str], None] | None = None
    before_release: Callable[[], Awaitable[None]] | None = None
    observers: Sequence[Callable[[DeliveryReport], None]] = ()


class Runtime:
    """Processes deliveries for the handlers of one :class:`App`.

    Args:
        app: queue -> handler routes.
        pool: an ``AsyncConnectionPool`` opened with ``autocommit=True`` (see :func:`open_pool`).
        settings: timeouts, bounds and retry delays.
        worker_id: lease owner name; default ``host:pid:random``.
        admission: who may run when (the worker's, with its concurrency limit); default: no limit.
        hooks: what to tell the owner (:class:`RuntimeHooks`); default: nobody.

    Attributes:
        counters: in-process outcome counters.
    """

    def __init__(
        self, app: App, pool: AsyncConnectionPool, settings: Settings, *, worker_id: str | None = None,
        admission: Admission | None = None, hooks: RuntimeHooks = RuntimeHooks(),
    ) -> None:
        self.app = app
        self.pool = pool
        self.settings = settings
        self.worker_id = worker_id or default_worker_id()
        self.admission = admission or Admission()
        self.hooks = hooks
        self.counters = OutcomeCounters()
        self.messaging_system = messaging_system(settings.broker_url)  # the spans' messaging.system
        self.operations = Operations(settings, self.worker_id)
        self.attempts = AttemptBook(settings.db_schema, self.worker_id)
        self.faults = FaultCosts(pool, settings, self.attempts, self.counters, hooks.on_environment_fault)
        self.isolation = Isolation(
            pool, settings, self.attempts, self.admission, run=self._run, released=self.faults.released_for_environment,
        )
        self.early_answers = EarlyAnswers(pool, settings.statement_timeout)
        self.transactional = TransactionalPath(pool, settings, self.operations, self.early_answers)
        self.leased = LeasedPath(pool, settings, self.operations)
        self.batch = BatchPath(pool, settings, self.operations, self.early_answers)

    async def process(self, delivery: Delivery) -> DeliveryReport:
        """Run one delivery through the pipeline and settle it. Never raises except
        ``SimulatedCrash`` (an armed crash point: the delivery stays unsettled) and cancellation
        (the delivery is released first)."""
        started = time.monotonic()
        envelope = delivery.envelope()
        with delivery_span(delivery, self.messaging_system) as span:
            decoded: Decoded | None = None
            try:
                try:
                    decoded = decode(self.app, delivery.queue, delivery.body, envelope)  # 1. decode
                except (InvalidMessage, SimulatedCrash):
                    raise
                except Exception as exc:  # noqa: BLE001 - a handler hook raised: the handler's fault
                    decision = self.faults.after_hook_fault(delivery, exc)
                else:
                    span.decoded(decoded, envelope)
                    decision = await self.isolation.run(delivery, decoded, envelope)  # 2. isolate, 3. run
            except InvalidMessage as exc:
                decision = invalid_decision(exc)
            except SimulatedCrash:
                report = report_of(delivery, decoded, Decision(Outcome.CRASHED, Settlement.RELEASED, reason="crash point"), started)
                record(report, self.counters, None, span)
                raise
            except asyncio.CancelledError:
                await delivery.release()  # shutdown: given back uncounted
                raise
            span.decided(decision)
            await self._settle(delivery, decision)  # 4. settle
        report = report_of(delivery, decoded, decision, started)  # 5. report
        record(report, self.counters, decoded.handler.operation_type if decoded else None, span)
        for observe in self.hooks.observers:
            observe(report)
        return report

    async def process_batch(self, deliveries: Sequence[Delivery]) -> list[DeliveryReport]:
        """Run deliveries that arrived together (one queue) through the batch path and settle
        each (docs/how-to/batches.md): those of a handler with ``batch_size > 1`` share one
        transaction (:mod:`consumer_kit.pipeline.batch`); a redelivered one, one whose key may
        have expired and one of a handler without batches run on their own as :meth:`process`
        would run them, beside the batch. Each delivery gets its own outcome, settlement, report
        and span (linked to the batch's). Never raises except ``SimulatedCrash`` (every delivery
        not yet settled stays so) and cancellation (the unsettled ones are released first)."""
        if not deliveries:
            return []
        started = time.monotonic()
        batched: list[BatchItem] = []
        on_own: list[BatchItem] = []
        decoded_of: dict[int, Decoded | None] = {}
        decisions: dict[int, Decision] = {}
        traces: dict[int, DeliveryTrace] = {}
        with batch_span(deliveries[0].queue, self.messaging_system, len(deliveries)) as span:
            for delivery in deliveries:
                notes = traces[id(delivery)] = member_span(delivery, self.messaging_system, span)
                envelope = delivery.envelope()
                decoded_of[id(delivery)] = None
                try:
                    with as_current(notes):
                        decoded = decode(self.app, delivery.queue, delivery.body, envelope)  # 1. decode
                except InvalidMessage as exc:
                    decisions[id(delivery)] = invalid_decision(exc)
                    continue
                except Exception as exc:  # noqa: BLE001 - a handler hook raised: the handler's fault
                    decisions[id(delivery)] = self.faults.after_hook_fault(delivery, exc)
                    continue
                notes.decoded(decoded, envelope)
                decoded_of[id(delivery)] = decoded
                item = BatchItem(delivery, decoded, envelope, notes)
                alone = delivery.redelivered or decoded.handler.batch_size <= 1 or self._key_may_have_expired(decoded)
                (on_own if alone else batched).append(item)
            try:
                try:
                    runs = [self._run_batch(batched)] if batched else []
                    runs += [self._isolated(item) for item in on_own]
                    if len(runs) == 1:  # the common case: no task for it
                        decisions.update(await runs[0])  # 2. isolate, 3. run
                    else:
                        for ran in await asyncio.gather(*runs):  # 2. isolate, 3. run
                            decisions.update(ran)
                except SimulatedCrash:
                    for delivery in deliveries:
                        if delivery.settlement is None:
                            crashed = Decision(Outcome.CRASHED, Settlement.RELEASED, reason="crash point")
                            record(report_of(delivery, decoded_of[id(delivery)], crashed, started), self.counters,
                                   None, traces[id(delivery)])
                    raise
                except asyncio.CancelledError:
                    for delivery in deliveries:
                        if delivery.settlement is None:
                            await delivery.release()  # shutdown: given back uncounted
                    raise
                for delivery in deliveries:
                    traces[id(delivery)].decided(decisions[id(delivery)])
                await self._settle_batch(deliveries, decisions)  # 4. settle
            finally:
                for notes in traces.values():
                    notes.span.end()
        reports = []
        for delivery in deliveries:  # 5. report
            of = decoded_of[id(delivery)]
            report = report_of(delivery, of, decisions[id(delivery)], started)
            record(report, self.counters, of.handler.operation_type if of else None, traces[id(delivery)])
            for observe in self.hooks.observers:
                observe(report)
            reports.append(report)
        return reports

    async def close(self) -> None:
        """Wait until the transactions of deliveries answered before their end have ended and
        their connections are back (:mod:`consumer_kit.pipeline.early_answers`): before the pool
        closes."""
        await self.early_answers.wait()

    async def flush_markers(self) -> None:
        """Clear the run-alone markers an unavailable database kept this process from clearing
        (see :meth:`Isolation.flush_markers`); the worker calls it before it resumes."""
        await self.isolation.flush_markers()

    # -- 3. run ------------------------------------------------------------------------------------

    async def _run(self, delivery: Delivery, decoded: Decoded, envelope: Envelope) -> Decision:
        """Execute on the handler's path, retrying contention in place as the fault policy says,
        and turn the verdict or the fault into a decision."""
        if self._key_may_have_expired(decoded):
            verdict = await self._expired_key(delivery, decoded)
            if verdict.kind is not VerdictKind.LEASE_RECOVERABLE:  # an expired lease: recovered below
                return self._decided(verdict)
        path = self.leased if decoded.handler.external_effects else self.transactional
        retried = 0
        while True:
            try:
                crashpoints.reached(CrashPoint.BEFORE_CLAIM)
                return self._decided(await path.execute(delivery, decoded, envelope))
            except InvalidMessage:
                raise  # a handler may declare its input invalid: dead-lettered by process()
            except Exception as exc:  # noqa: BLE001 - classified below (DESIGN "Faults and attempts")
                kind = classify(exc)
                decided = fault_decision(kind, self.faults.limits, retried_in_place=retried, jitter=random.random())
                if decided.action is not Action.RETRY_IN_PLACE:
                    return await self.faults.after_fault(delivery, decoded, exc, kind, retried)
                retried += 1
                self.faults.retried_in_place([(delivery, decoded)], exc, f"again in {decided.delay * 1000:.0f} ms")
                await asyncio.sleep(decided.delay)

    async def _isolated(self, item: BatchItem) -> dict[int, Decision]:
        with as_current(item.trace):
            try:
                return {id(item.delivery): await self.isolation.run(item.delivery, item.decoded, item.envelope)}
            except InvalidMessage as exc:  # the handler declared its input invalid
                return {id(item.delivery): invalid_decision(exc)}

    async def _run_batch(self, items: list[BatchItem]) -> dict[int, Decision]:
        """The batch's lanes (every partition key it holds, in one order, so two batches never
        wait on each other crosswise) and one admission slot, then the batch path; the items it
        hands back run on their own, in delivery order, still inside the lanes and the slot."""
        keys = sorted({item.decoded.partition_key for item in items if item.decoded.partition_key is not None})
        try:
            async with contextlib.AsyncExitStack() as lanes:
                for key in keys:
                    await lanes.enter_async_context(self.isolation.lanes.lane(key))
                async with self.admission.slot():
                    return await self._execute_batch(items)
        except GiveBack as back:
            given_back = Decision(Outcome.RELEASED, Settlement.RELEASED, reason=back.reason)
            return {id(item.delivery): given_back for item in items}

    async def _execute_batch(self, items: list[BatchItem]) -> dict[int, Decision]:
        crashpoints.reached(CrashPoint.BEFORE_CLAIM)
        try:
            outcome = await self.batch.execute(items)
        except Exception as exc:  # noqa: BLE001 - classified below
            kind = classify(exc)
            if kind is FaultKind.ENVIRONMENT:
                released = self.faults.released_for_environment(exc)  # the whole batch, uncounted
                return {id(item.delivery): released for item in items}
            # A fault of no single item (the claim, the completion or the COMMIT refused, a
            # deadlock or serialization failure there): nothing of the batch committed; each item
            # runs on its own and meets its own fault there.
            logger.warning("batch of %s failed (%s): running its deliveries one by one", len(items), describe_error(exc))
            outcome = BatchOutcome(alone=list(items), contention=exc if kind is FaultKind.CONTENTION else None)
        if outcome.contention is not None:
            self.faults.retried_in_place([(i.delivery, i.decoded) for i in outcome.alone], outcome.contention)
        decisions = {id(item.delivery): self._decided(outcome.verdicts[id(item)]) for item in items if id(item) in outcome.verdicts}
        for item in outcome.alone:
            with as_current(item.trace):
                try:
                    decisions[id(item.delivery)] = await self._run(item.delivery, item.decoded, item.envelope)
                except InvalidMessage as exc:  # the handler declared its input invalid
                    decisions[id(item.delivery)] = invalid_decision(exc)
        return decisions

    def _decided(self, verdict: Verdict) -> Decision:
        if verdict.kind is VerdictKind.UNCERTAIN:
            self.faults.environment_fault(f"COMMIT outcome unknown ({verdict.detail})")
        elif verdict.why == "projection_unknown":
            row = verdict.deciding_row
            logger.warning(
                "operation scope=%s operation_key=%s was recorded under projection v%s, which its handler "
                "no longer declares: parked for reconciliation", row.scope, row.key, row.projection_version,
            )
        return decision_for(verdict, self.settings.in_progress_delay)

    def _key_may_have_expired(self, decoded: Decoded) -> bool:
        """The message is older than its handler's key retention: its identity may be gone."""
        retention = decoded.handler.retention.key_seconds
        if retention is None or decoded.operation_time is None:
            return False
        age = (dt.datetime.now(dt.UTC) - decoded.operation_time).total_seconds()
        return age > retention

    async def _expired_key(self, delivery: Delivery, decoded: Decoded) -> Verdict:
        identity = decoded.identity
        gone = (
            f"operation created {decoded.operation_time:%Y-%m-%dT%H:%M:%SZ} is older than the key retention "
            f"of {type(decoded.handler).__name__} and its identity is gone: reconcile by hand"
        )
        verdict = await on_own_connection(
            self.pool, self.settings.statement_timeout,
            lambda conn: self.operations.expired_key(conn, identity, message_intent(decoded), gone=gone),
            "reading the ledger row",
        )
        if verdict.kind is VerdictKind.KEY_EXPIRED:
            logger.warning(
                "key expired scope=%s operation_key=%s message_id=%s: created %s, older than its key "
                "retention, and no ledger row: refused, never executed as new",
                identity.scope, identity.key, delivery.message_id, decoded.operation_time,
            )
        return verdict

    # -- 4. settle, 5. report ------------------------------------------------------------------------

    async def _settle(self, delivery: Delivery, decision: Decision) -> None:
        crashpoints.reached(CrashPoint.BEFORE_ACK)
        if decision.how is Settlement.RELEASED and self.hooks.before_release is not None:
            # Give back only once the consumer has stopped: a copy put back while it still
            # consumes could be handed out again at once (or, on a quorum queue, come back
            # as a redelivery when the consumer is cancelled with it in transit).
            await self.hooks.before_release()
        await settle(delivery, decision)

    async def _settle_batch(self, deliveries: Sequence[Delivery], decisions: dict[int, Decision]) -> None:
        """A batch's settlements: its acks together (one multiple ack, batched deletes: the
        adapter's :meth:`Delivery._ack_groups`), every other settlement on its own, beside them."""
        acks = [d for d in deliveries if decisions[id(d)].how is Settlement.ACK]
        for _ in acks:
            crashpoints.reached(CrashPoint.BEFORE_ACK)
        others = [self._settle(d, decisions[id(d)]) for d in deliveries if decisions[id(d)].how is not Settlement.ACK]
        if not others:
            await ack_all(acks)
        else:
            await asyncio.gather(ack_all(acks), *others)
