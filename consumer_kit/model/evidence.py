"""One evidence record: what a handler with external effects recorded about a remote call."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EvidenceRecord:
    """One recorded fact set: ``name`` of the call, the ``attempt`` (fencing token) and ``worker``
    that recorded it, the ``facts`` (JSON object) and when (``recorded_at``, UTC)."""

    name: str
    attempt: int
    worker: str
    facts: dict[str, Any]
    recorded_at: dt.datetime
