"""What the testing kit asserts about delivery reports: which outcomes end a message's life, and
how many of each a test expected."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

from consumer_kit.model.outcomes import DeliveryReport, Outcome
from consumer_kit.model.settlement import Settlement

#: Outcomes that end a delivery's life (the message left the queue). The others are steps on the
#: way (``crashed``, ``in_progress``, ``retried``, ``uncertain``): ``assert_outcomes`` ignores them
#: unless you name them.
TERMINAL_OUTCOMES = frozenset(
    {
        Outcome.EXECUTED, Outcome.DUPLICATE, Outcome.PAYLOAD_CONFLICT, Outcome.LEASE_RECOVERED,
        Outcome.FAILED, Outcome.FAILED_RETAINED, Outcome.INVALID, Outcome.DEAD_LETTERED,
        Outcome.KEY_EXPIRED, Outcome.CRASHED_WORKER,
    }
)


def count_outcomes(reports: Iterable[DeliveryReport]) -> Counter[str]:
    """Count of ``reports`` by outcome value."""
    return Counter(r.outcome.value for r in reports)


def check_outcomes(counts: Mapping[str, int], expected: Mapping[str | Outcome, int]) -> None:
    """Assert that ``counts`` (outcome value -> deliveries) holds ``expected``.

    Terminal outcomes (:data:`TERMINAL_OUTCOMES`) not named in ``expected`` must not occur at all;
    transient ones (``crashed``, ``in_progress``, ``retried``, ``uncertain``) are checked only when
    named.

    Raises:
        AssertionError: the counts differ, with every count in the message.
    """
    wanted = {Outcome(k).value: v for k, v in expected.items()}
    actual = {
        o.value: counts.get(o.value, 0)
        for o in Outcome
        if o.value in wanted or (o in TERMINAL_OUTCOMES and counts.get(o.value, 0))
    }
    wanted_full = {k: wanted.get(k, 0) for k in actual}
    assert actual == wanted_full, (
        f"outcomes {actual} != expected {wanted_full} (all reports: {dict(counts)})"
    )


def settled_reports(reports: Iterable[DeliveryReport]) -> list[DeliveryReport]:
    """Reports of deliveries that ended the message's life (acked or dead-lettered)."""
    return [r for r in reports if r.settlement in (Settlement.ACK, Settlement.DEAD_LETTER)]
