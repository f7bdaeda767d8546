"""A delivery's decision: the outcome the runtime reached and how to settle the delivery for it.

Decided while the delivery's transaction runs, carried out after it ended (settle after COMMIT,
never inside). Shared by the transactional and the leased path.
"""

from __future__ import annotations

from consumer_kit.broker import Settlement
from consumer_kit.model.outcomes import Outcome
from consumer_kit.model.results import StoredResult


class Decision:
    """``outcome`` and ``how`` to settle (``delay`` seconds for a retry; ``reason`` and ``detail``
    for a dead-letter, the report and the log; ``result`` replayed or recorded)."""

    def __init__(
        self,
        outcome: Outcome,
        how: Settlement,
        *,
        delay: float = 0.0,
        reason: str | None = None,
        detail: str = "",
        result: StoredResult | None = None,
    ) -> None:
        self.outcome, self.how, self.delay = outcome, how, delay
        self.reason, self.detail, self.result = reason, detail, result

    @classmethod
    def in_progress(cls, delay: float, reason: str) -> Decision:
        """Another delivery holds the operation: retry later, never in parallel."""
        return cls(Outcome.IN_PROGRESS, Settlement.RETRY, delay=delay, reason=reason)
