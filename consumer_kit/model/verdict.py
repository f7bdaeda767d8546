"""What the operation state machine decided about one operation: a neutral verdict.

The state machine (:mod:`consumer_kit.pipeline.operation`) answers the ledger's questions (claim;
what does an existing row mean; complete; park) once for every caller. Its answer is a
:class:`Verdict`, which says nothing about brokers or HTTP: the runtime maps it to a settlement
(:mod:`consumer_kit.pipeline.settlement`), the HTTP front door to a response
(:mod:`consumer_kit.http.pipeline`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from consumer_kit.model.operation_row import OperationRow
from consumer_kit.model.results import StoredResult


class VerdictKind(enum.StrEnum):
    EXECUTED = "executed"  # this caller ran the operation and its completion committed
    DUPLICATE = "duplicate"  # completed before: the stored result is the answer; never run again
    FAILED = "failed"  # this caller ran it and it failed permanently: the failure is recorded
    REPLAYED_FAILURE = "replayed_failure"  # a retained failure: replayed, never run again
    CONFLICT = "conflict"  # the key exists with another intent: never executed
    IN_PROGRESS = "in_progress"  # another claimer holds the operation: ask again later (``why``)
    LEASE_RECOVERABLE = "lease_recoverable"  # processing under an expired lease: may be taken over
    NEEDS_RECONCILIATION = "needs_reconciliation"  # parked (or must be): an operator decides
    KEY_EXPIRED = "key_expired"  # older than its key retention and its identity is gone
    UNCERTAIN = "uncertain"  # the COMMIT got no reply: the outcome is unknown
    LEASE_LOST = "lease_lost"  # another worker took this attempt's lease over: it must not finish


@dataclass(frozen=True, slots=True)
class Verdict:
    """One decision about an operation.

    Attributes:
        kind: what was decided.
        why: a short machine-readable reason (``in_progress``: ``"lease_held"``,
            ``"claim_lock_timeout"``, ``"row_vanished"``...).
        detail: a human-readable explanation (logged, carried by a dead letter or a problem).
        row: the ledger row that decided; ``None`` when no row decided.
        result: what this caller's attempt returned or recorded (``executed``, ``failed``).
    """

    kind: VerdictKind
    why: str = ""
    detail: str = ""
    row: OperationRow | None = None
    result: StoredResult | None = None

    @property
    def deciding_row(self) -> OperationRow:
        """The ledger row that decided (always there for ``duplicate``, ``replayed_failure``,
        ``conflict`` and ``lease_recoverable``).

        Raises:
            LookupError: this verdict carries no row.
        """
        if self.row is None:
            raise LookupError(f"a {self.kind.value} verdict ({self.why or 'no reason'}) carries no ledger row")
        return self.row

    @classmethod
    def in_progress(cls, why: str, row: OperationRow | None = None) -> Verdict:
        """Another claimer holds the operation (``why`` names how this was seen)."""
        return cls(VerdictKind.IN_PROGRESS, why=why, row=row)

    @classmethod
    def needs_reconciliation(cls, why: str, detail: str, row: OperationRow | None = None) -> Verdict:
        """The outcome cannot be decided here: never run, never replayed; an operator decides."""
        return cls(VerdictKind.NEEDS_RECONCILIATION, why=why, detail=detail, row=row)
