"""A delivery's decision: the outcome the runtime reached and how to settle the delivery for it.

Made from a verdict of the operation state machine or from a fault decision by the one table of
:mod:`consumer_kit.pipeline.settlement`, carried out after the delivery's transaction ended
(settle after COMMIT, never inside).
"""

from __future__ import annotations

from consumer_kit.model.outcomes import Outcome
from consumer_kit.model.results import StoredResult
from consumer_kit.model.settlement import Settlement


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
