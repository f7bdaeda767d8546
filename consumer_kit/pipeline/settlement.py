"""How a delivery is settled: the runtime's one table from verdicts and fault decisions to a
:class:`~consumer_kit.model.decision.Decision` (an outcome and a settlement), and the settling.

The rules themselves live elsewhere: what a ledger row means in
:mod:`consumer_kit.pipeline.operation`, what a fault costs in :mod:`consumer_kit.pipeline.fault_policy`;
this module only says how each answer is told to the broker (docs/explanation/one-delivery.md, step 5).
"""

from __future__ import annotations

import time
from typing import Any

from consumer_kit.broker import Delivery, Settlement
from consumer_kit.errors import DeadLetterReason, InvalidMessage
from consumer_kit.model.decision import Decision
from consumer_kit.model.decoded import Decoded
from consumer_kit.model.outcomes import DeliveryReport, Outcome
from consumer_kit.model.verdict import Verdict, VerdictKind
from consumer_kit.pipeline.fault_policy import Action, FaultDecision
from consumer_kit.pipeline.faults import FaultKind

__all__ = ["decision_for", "decision_for_fault", "settle"]

# verdict kind -> (outcome, settlement, the dead-letter reason when it has a fixed one)
_TABLE: dict[VerdictKind, tuple[Outcome, Settlement, str | None]] = {
    VerdictKind.EXECUTED: (Outcome.EXECUTED, Settlement.ACK, None),
    VerdictKind.FAILED: (Outcome.FAILED, Settlement.ACK, None),
    VerdictKind.DUPLICATE: (Outcome.DUPLICATE, Settlement.ACK, None),
    VerdictKind.REPLAYED_FAILURE: (Outcome.FAILED_RETAINED, Settlement.ACK, None),
    VerdictKind.CONFLICT: (Outcome.PAYLOAD_CONFLICT, Settlement.DEAD_LETTER, DeadLetterReason.PAYLOAD_CONFLICT.value),
    VerdictKind.IN_PROGRESS: (Outcome.IN_PROGRESS, Settlement.RETRY, None),
    # Reaching settlement with a recoverable lease means nothing recovered it: ask again later.
    VerdictKind.LEASE_RECOVERABLE: (Outcome.IN_PROGRESS, Settlement.RETRY, None),
    VerdictKind.NEEDS_RECONCILIATION: (
        Outcome.UNCERTAIN, Settlement.DEAD_LETTER, DeadLetterReason.NEEDS_RECONCILIATION.value,
    ),
    VerdictKind.KEY_EXPIRED: (Outcome.KEY_EXPIRED, Settlement.DEAD_LETTER, DeadLetterReason.KEY_EXPIRED.value),
    VerdictKind.UNCERTAIN: (Outcome.UNCERTAIN, Settlement.RELEASED, None),  # never acked: the ledger decides
    VerdictKind.LEASE_LOST: (Outcome.LEASE_LOST, Settlement.RELEASED, None),
}
# In-progress reasons retried at once rather than after in_progress_delay.
_RETRY_AT_ONCE = frozenset({"row_vanished"})


def decision_for(verdict: Verdict, in_progress_delay: float) -> Decision:
    """The runtime's settlement of ``verdict`` (a retry waits ``in_progress_delay`` seconds)."""
    outcome, how, reason = _TABLE[verdict.kind]
    why: str | None = verdict.why or None
    if verdict.kind is VerdictKind.EXECUTED:
        outcome = Outcome.LEASE_RECOVERED if why == "lease_recovered" else outcome
        why = None
    delay = 0.0
    if how is Settlement.RETRY and verdict.why not in _RETRY_AT_ONCE:
        delay = in_progress_delay
    result = verdict.result
    if verdict.kind in (VerdictKind.DUPLICATE, VerdictKind.REPLAYED_FAILURE):
        result = verdict.deciding_row.stored_result
    return Decision(
        outcome, how, delay=delay, reason=reason or why, detail=verdict.detail, result=result
    )


def decision_for_fault(
    kind: FaultKind, decided: FaultDecision, error_class: str, described: str, *, counted: str = ""
) -> Decision:
    """The runtime's settlement of a fault (``error_class`` and ``described`` name the exception;
    ``counted`` overrides what the count counted, for a dead-letter's detail)."""
    if decided.action is Action.RELEASE:
        return Decision(Outcome.RELEASED, Settlement.RELEASED, reason=f"environment:{error_class}", detail=described)
    if decided.action is Action.DEAD_LETTER and decided.limit is None:
        return Decision(
            Outcome.INVALID, Settlement.DEAD_LETTER,
            reason=f"{DeadLetterReason.INVALID_DATA.value}:{error_class}", detail=described,
        )
    contended = kind is FaultKind.CONTENTION
    if decided.action is Action.DEAD_LETTER:
        bound = DeadLetterReason.MAX_CONTENTIONS if contended else DeadLetterReason.MAX_DELIVERIES
        counted = counted or (" on contended attempt" if contended else " on attempt")
        return Decision(
            Outcome.DEAD_LETTERED, Settlement.DEAD_LETTER, reason=f"{bound.value}:{error_class}",
            detail=f"{described}{counted} {decided.attempt} of {decided.of}",
        )
    if contended:
        return Decision(Outcome.CONTENDED, Settlement.RETRY, delay=decided.delay, reason=f"contention:{error_class}")
    return Decision(Outcome.RETRIED, Settlement.RETRY, delay=decided.delay, reason=error_class)


async def settle(delivery: Delivery, decision: Decision) -> None:
    """Settle ``delivery`` as ``decision`` says; bounded and never raising (the delivery's own
    contract)."""
    if decision.how is Settlement.ACK:
        await delivery.ack()
    elif decision.how is Settlement.RETRY:
        await delivery.retry(decision.delay)
    elif decision.how is Settlement.DEAD_LETTER:
        await delivery.dead_letter(decision.reason or "unknown", decision.detail)
    else:
        await delivery.release()


def invalid_decision(exc: InvalidMessage) -> Decision:
    """A delivery that cannot be processed as sent: dead-lettered with its reason."""
    return Decision(Outcome.INVALID, Settlement.DEAD_LETTER, reason=exc.reason.value, detail=exc.detail)


def report_of(delivery: Delivery, decoded: Decoded[Any] | None, decision: Decision, started: float) -> DeliveryReport:
    """The report of one delivery, settled (or not) as ``decision`` says; ``started``: the loop's
    monotonic clock when the runtime took it (seconds)."""
    return DeliveryReport(
        outcome=decision.outcome,
        settlement=delivery.settlement,
        queue=delivery.queue,
        message_id=delivery.message_id,
        delivery_count=delivery.delivery_count,
        scope=decoded.identity.scope if decoded else None,
        operation_key=decoded.identity.key if decoded else None,
        reason=decision.reason,
        # the dead letter's own detail (also in its header and `dlq list`); other details may
        # describe a handler's exception and stay out of the log line
        detail=(decision.detail or None) if decision.how is Settlement.DEAD_LETTER else None,
        result=decision.result,
        duration_seconds=time.monotonic() - started,
        settlement_lost=delivery.lost,
        redelivered=delivery.redelivered,
    )
