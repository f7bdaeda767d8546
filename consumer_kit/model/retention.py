"""How long an operation's row is kept (written by the ledger, deleted by ``consumer-kit prune``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Retention:
    """How long an operation's bulky result body and its compact identity row are kept, in
    seconds from its first write (``None``: kept until deleted by hand). Stored in the row as
    ``body_expires_at`` / ``key_expires_at`` for ``consumer-kit prune``."""

    body_seconds: float | None = None
    key_seconds: float | None = None

    def params(self) -> dict[str, float | None]:
        return {"body_keep": self.body_seconds, "key_keep": self.key_seconds}


KEEP = Retention()
"""Kept until deleted by hand: no result-body or identity expiry."""
