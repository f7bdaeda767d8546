"""What a fault costs a delivery, with the ledger's counts (docs/explanation/faults-and-attempts.md).

The pure rules are :func:`consumer_kit.pipeline.fault_policy.fault_decision`; this module applies
them to a delivery that met a fault: it counts the attempt in the ledger's ``attempts`` table (the
count of a handler fault is also the proof that the database still does work for others, see
:mod:`consumer_kit.pipeline.faults`), turns the decision into a settlement, logs it, tells the
worker about an environment fault, and makes every contention visible, the ones retried in place
included (metric ``consumer_kit.contentions.in_place``, the ``contended_in_place`` outcome count
the Pressure page reads).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence

from psycopg_pool import AsyncConnectionPool

from consumer_kit.broker import Delivery
from consumer_kit.ledger import AttemptBook, AttemptCounts
from consumer_kit.model.decision import Decision
from consumer_kit.pipeline.decoding import DecodedDelivery as Decoded
from consumer_kit.pipeline.fault_policy import Action, FaultDecision, FaultLimits, fault_decision
from consumer_kit.pipeline.faults import FaultKind, classify
from consumer_kit.pipeline.settlement import decision_for_fault
from consumer_kit.pipeline.transaction import on_own_connection
from consumer_kit.settings import Settings
from consumer_kit.telemetry import OutcomeCounters, describe_error, describe_traceback
from consumer_kit.telemetry.metrics import record_contention_in_place

__all__ = ["CONTENDED_IN_PLACE", "FaultCosts"]

logger = logging.getLogger("consumer_kit.runtime")

CONTENDED_IN_PLACE = "contended_in_place"
"""The ``outcome_counts`` entry of a contention retried in place: not an outcome of its own (the
delivery's outcome follows), counted per delivery that waited, per minute, for the Pressure page."""


class FaultCosts:
    """The ledger-backed half of the fault policy for one runtime.

    Args:
        pool: the worker's pool (each count is one autocommit statement on a connection of its own).
        settings: the bounds (``max_deliveries``, ``max_contentions``, ``in_progress_delay``,
            ``retry_delays``, ``statement_timeout``).
        attempts: the ledger's attempt counts.
        counters: the runtime's outcome counters (their per-minute counts get the contentions
            retried in place).
        on_environment_fault: called with a one-line reason on an environment fault (the worker
            pauses and probes); ``None``: nobody to tell.
    """

    def __init__(
        self, pool: AsyncConnectionPool, settings: Settings, attempts: AttemptBook, counters: OutcomeCounters,
        on_environment_fault: Callable[[str], None] | None,
    ) -> None:
        self.pool = pool
        self.settings = settings
        self.attempts = attempts
        self.counters = counters
        self.on_environment_fault = on_environment_fault
        self.limits = FaultLimits(
            settings.max_deliveries, settings.max_contentions, settings.in_progress_delay, settings.retry_delays
        )

    async def after_fault(
        self, delivery: Delivery, decoded: Decoded, exc: Exception, kind: FaultKind, retried: int
    ) -> Decision:
        """The settlement of a fault that is not retried in place (any more): counted in the
        ledger where the policy says so."""
        described, error_class = describe_error(exc), type(exc).__name__
        # The exception's own text can quote business values: the traceback is frames only.
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("fault traceback message_id=%s\n%s", delivery.message_id, describe_traceback(exc))
        if kind is FaultKind.ENVIRONMENT:
            return self.released_for_environment(exc)
        decided = fault_decision(kind, self.limits, retried_in_place=retried)
        if decided.action is Action.COUNT:
            counts = await self._count(delivery, decoded, kind, described)
            if isinstance(counts, Decision):
                return counts
            decided = fault_decision(
                kind, self.limits, retried_in_place=retried, failures=counts.failures,
                contentions=counts.contentions, jitter=random.random(),
            )
        self._log_fault(delivery, decoded, kind, decided, described)
        return decision_for_fault(kind, decided, error_class, described)

    def retried_in_place(
        self, deliveries: Sequence[tuple[Delivery, Decoded]], exc: BaseException, how: str = "one by one"
    ) -> None:
        """Count and log a contention retried in place: ``deliveries`` (one, or a whole batch)
        rolled back and run again (``how``: "again in 40 ms", "one by one")."""
        error_type = type(exc).__name__
        for delivery, decoded in deliveries:
            operation_type = decoded.handler.operation_type
            record_contention_in_place(delivery.queue, operation_type, error_type)
            if self.counters.minutes is not None:
                self.counters.minutes.add(operation_type, CONTENDED_IN_PLACE)
        if deliveries:
            first = deliveries[0][0]
            logger.info(
                "contention %s on queue=%s (%s deliveries, first message_id=%s): rolled back, running "
                "them %s", describe_error(exc), first.queue, len(deliveries), first.message_id, how,
            )

    async def _count(
        self, delivery: Delivery, decoded: Decoded, kind: FaultKind, described: str
    ) -> AttemptCounts | Decision:
        """Count this attempt in the ledger (a fault or a contention). A database that is down
        releases the delivery; any other failure falls back to the broker's count, loudly."""
        identity = decoded.identity
        count = self.attempts.count_contention if kind is FaultKind.CONTENTION else self.attempts.count_failure
        try:
            return await on_own_connection(
                self.pool, self.settings.statement_timeout,
                lambda conn: count(
                    conn, identity, message_id=delivery.message_id, delivery_count=delivery.delivery_count,
                    detail=described,
                ),
                "the attempt count",
            )
        except Exception as book_exc:  # noqa: BLE001 - classified below
            if classify(book_exc) is FaultKind.ENVIRONMENT:
                return self.released_for_environment(book_exc)
            # Not an outage (a schema not migrated, a bug): fall back to the broker's count rather
            # than loop, and say so loudly.
            logger.error(
                "cannot count attempts of operation_key=%s (%s; is the schema migrated?): using the "
                "broker's delivery count", identity.key, describe_error(book_exc),
            )
            return AttemptCounts(failures=delivery.delivery_count, contentions=delivery.delivery_count, crashes=0)

    def _log_fault(
        self, delivery: Delivery, decoded: Decoded, kind: FaultKind, decided: FaultDecision, described: str
    ) -> None:
        if kind is FaultKind.MESSAGE:
            # The same values fail the same way on every delivery: dead-letter now.
            logger.warning(
                "deterministic rejection %s on queue=%s message_id=%s: dead-lettering",
                described, delivery.queue, delivery.message_id,
            )
            return
        last = decided.action is Action.DEAD_LETTER
        contended = kind is FaultKind.CONTENTION
        logger.log(
            logging.ERROR if last else logging.INFO if contended else logging.WARNING,
            "contention %s on queue=%s message_id=%s operation_key=%s (%s of %s): %s" if contended else
            "handler error %s on queue=%s message_id=%s operation_key=%s attempt %s of %s: %s",
            described, delivery.queue, delivery.message_id, decoded.identity.key, decided.attempt,
            decided.of, "dead-lettering" if last else "rolled back, will retry",
        )

    def after_hook_fault(self, delivery: Delivery, exc: Exception) -> Decision:
        """A handler's own hook (``operation_key``, ``tenant``, ``partition_key``, ``projection``)
        raised before the delivery had an identity: a handler fault, retried with backoff and
        dead-lettered after ``max_deliveries``, counted by the broker's delivery count (no
        operation to count it against). Never given back uncounted: it would loop forever."""
        count = max(delivery.delivery_count, 1)
        decided = fault_decision(FaultKind.HANDLER, self.limits, failures=count)
        described = describe_error(exc)
        last = decided.action is Action.DEAD_LETTER
        logger.log(
            logging.ERROR if last else logging.WARNING,
            "handler hook error %s on queue=%s message_id=%s delivery %s of %s: %s",
            described, delivery.queue, delivery.message_id, count, decided.of,
            "dead-lettering" if last else "will retry",
        )
        return decision_for_fault(
            FaultKind.HANDLER, decided, type(exc).__name__, described,
            counted=" in a handler hook before the claim, on delivery",
        )

    def released_for_environment(self, exc: BaseException) -> Decision:
        """Give the delivery back uncounted; the worker pauses (:meth:`environment_fault`)."""
        described = describe_error(exc)
        self.environment_fault(described)
        return decision_for_fault(
            FaultKind.ENVIRONMENT, FaultDecision(Action.RELEASE), type(exc).__name__, described
        )

    def environment_fault(self, reason: str) -> None:
        logger.warning("database unavailable (%s): deliveries go back uncounted", reason)
        if self.on_environment_fault is not None:
            self.on_environment_fault(reason)
