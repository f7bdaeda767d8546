"""What a handler reports (:class:`Result`) and what the ledger replays (:class:`StoredResult`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Result:
    """What a handler reports; stored in the ledger and replayed to duplicates.

    Attributes:
        status: short status such as ``"created"`` (<= 200 characters).
        reference: reference to the effect, e.g. the new row's id (<= 500 characters).
        body: small JSON-compatible body (kept until the result-body retention ends).
    """

    status: str = "ok"
    reference: str | None = None
    body: Any = None


@dataclass(frozen=True)
class StoredResult:
    """An operation's recorded outcome, replayed to duplicates.

    Attributes:
        status: handler-chosen status (e.g. ``"created"``) or a failure code.
        reference: a short reference to the effect (e.g. an invoice id), or ``None``.
        body: small JSON-compatible result body, or ``None``.
    """

    status: str | None
    reference: str | None
    body: Any = None
