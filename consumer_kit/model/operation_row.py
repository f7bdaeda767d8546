"""One row of the ``operations`` table, as the pipeline reads it."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from consumer_kit.model.results import StoredResult


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
