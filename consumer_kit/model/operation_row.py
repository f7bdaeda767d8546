"""One row of the ``operations`` table, as the pipeline reads it."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from consumer_kit.model.results import StoredResult

# The states of a row: processing -> completed | failed | needs_reconciliation, and
# needs_reconciliation -> completed | failed (operator or reconcile pass).
PROCESSING = "processing"
COMPLETED = "completed"
FAILED = "failed"
NEEDS_RECONCILIATION = "needs_reconciliation"


@dataclass(frozen=True)
class OperationRow:
    """One ledger row, as the runtime needs it."""

    scope: str
    key: str
    fingerprint: str
    projection_version: int
    state: str
    attempts: int
    lease_owner: str | None
    lease_live: bool
    result_status: str | None
    result_reference: str | None
    result_body: Any
    error_class: str | None
    error_detail: str | None
    completed_at: dt.datetime | None

    @property
    def stored_result(self) -> StoredResult:
        return StoredResult(self.result_status, self.result_reference, self.result_body)
