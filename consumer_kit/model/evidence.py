"""One evidence record: what a handler with external effects recorded about a remote call."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

OPERATOR_EVIDENCE = "operator"
"""The evidence name of an operator's verdict on a parked operation (``consumer-kit ledger resolve
--not-done``, the console): facts ``{"verdict": "not_done", "by": ..., "note": ...}``."""


@dataclass(frozen=True)
class EvidenceRecord:
    """One recorded fact set: ``name`` of the call, the ``attempt`` (fencing token) and ``worker``
    that recorded it, the ``facts`` (JSON object) and when (``recorded_at``, UTC)."""

    name: str
    attempt: int
    worker: str
    facts: dict[str, Any]
    recorded_at: dt.datetime

    @property
    def operator_not_done(self) -> bool:
        """Whether this is an operator's "not done" verdict: run again with the same downstream keys."""
        return self.name == OPERATOR_EVIDENCE and self.facts.get("verdict") == "not_done"
