"""What the runtime decided for one delivery (docs/explanation/architecture.md, "Words") and its report."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from consumer_kit.model.results import StoredResult
from consumer_kit.model.settlement import Settlement


class Outcome(enum.StrEnum):
    EXECUTED = "executed"  # first execution: handler ran, committed
    DUPLICATE = "duplicate"  # completed before: stored result replayed, handler not run
    PAYLOAD_CONFLICT = "payload_conflict"  # same key, different fingerprint: dead-lettered
    IN_PROGRESS = "in_progress"  # another worker holds the operation: retried later
    LEASE_RECOVERED = "lease_recovered"  # an expired lease was taken over, reconciled and completed
    LEASE_LOST = "lease_lost"  # another worker took the lease over: not completed, not acked
    RETRIED = "retried"  # handler fault: rolled back, retried (counted toward max_deliveries)
    CONTENDED = "contended"  # lock timeout / deadlock / serialization failure: retried, counted apart
    RELEASED = "released"  # given back uncounted: environment fault, shutdown, running alone
    FAILED = "failed"  # handler raised PermanentFailure: failed row retained, acked
    FAILED_RETAINED = "failed_retained"  # duplicate of a failed operation: failure replayed
    INVALID = "invalid"  # bad body/key/headers: dead-lettered
    DEAD_LETTERED = "dead_lettered"  # retryable error past max deliveries
    UNCERTAIN = "uncertain"  # COMMIT outcome unknown: not acked, redelivery reads the ledger
    KEY_EXPIRED = "key_expired"  # older than its key retention, identity gone: refused, dead-lettered
    CRASHED_WORKER = "crashed_worker"  # the process died crash_limit times running it alone: parked
    CRASHED = "crashed"  # a crash point fired: left unsettled


@dataclass(frozen=True)
class DeliveryReport:
    """What happened to one delivery; returned by the runtime, logged, counted, used by tests."""

    outcome: Outcome
    settlement: Settlement | None
    queue: str
    message_id: str | None
    delivery_count: int
    scope: str | None = None
    operation_key: str | None = None
    reason: str | None = None
    # what the reason is about (schema_mismatch: the field and error type, invalid_header: the
    # header, ...): the dead letter's detail, never a value from the message
    detail: str | None = None
    result: StoredResult | None = None
    duration_seconds: float = 0.0
    settlement_lost: bool = False  # the settlement did not reach the broker: it redelivers
    redelivered: bool = False  # the broker handed it out before without a settlement (ran alone)
