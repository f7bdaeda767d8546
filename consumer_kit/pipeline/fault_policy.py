"""What a fault costs a delivery: a pure function (docs/explanation/faults-and-attempts.md).

:func:`fault_decision` takes the fault's kind (:func:`consumer_kit.pipeline.faults.classify`), how
often it was retried in place, the operation's attempt counts and the settings' numbers, and
returns what to do; it reads no clock, no database and no settings object, so every rule is
unit-tested without a database (``tests/pipeline/test_fault_policy.py``):

* *environment*: give the delivery back uncounted (the worker pauses and probes);
* *message*: dead-letter at once (the same values fail the same way on every delivery);
* *contention*: retry in place (roll back, wait a jittered moment, run again) up to
  ``IN_PLACE_CONTENTION_RETRIES`` times, since most lock waits clear within a second; then count
  it and retry through the broker with jitter, dead-lettering past ``max_contentions``;
* *handler*: count it, retry with the backoff of ``retry_delays``, dead-letter past
  ``max_deliveries``.

A decision that needs the count (``Action.COUNT``) is asked again once the attempt is counted.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from consumer_kit.pipeline.faults import FaultKind
from consumer_kit.resilience.backoff import Backoff

__all__ = ["IN_PLACE_CONTENTION_RETRIES", "Action", "FaultDecision", "FaultLimits", "fault_decision"]

IN_PLACE_CONTENTION_RETRIES = 3
_IN_PLACE = Backoff(first=0.1, cap=60.0)  # seconds, full jitter: 0.1, 0.2, 0.4 for the in-place retries


class Action(enum.StrEnum):
    RETRY_IN_PLACE = "retry_in_place"  # roll back, sleep ``delay``, run again (the broker never knows)
    COUNT = "count"  # count this attempt in the ledger, then ask again with the counts
    RELEASE = "release"  # give the delivery back uncounted
    RETRY = "retry"  # settle as retry after ``delay`` seconds
    DEAD_LETTER = "dead_letter"  # settle as dead-letter with ``reason``


@dataclass(frozen=True)
class FaultLimits:
    """The settings' numbers the policy needs: ``max_deliveries`` (handler faults),
    ``max_contentions``, ``in_progress_delay`` (seconds, the contention retry's centre) and
    ``retry_delays`` (seconds, the backoff per handler failure, the last one repeating)."""

    max_deliveries: int
    max_contentions: int
    in_progress_delay: float
    retry_delays: Sequence[float]


@dataclass(frozen=True)
class FaultDecision:
    """What to do: ``action``; ``delay`` seconds (a retry); ``limit`` (the bound that was reached,
    ``"max_deliveries"`` or ``"max_contentions"``, for a dead-letter past it, else ``None``);
    ``attempt`` and ``of`` (the count and the bound it was judged against, for the log)."""

    action: Action
    delay: float = 0.0
    limit: str | None = None
    attempt: int = 0
    of: int = 0


def fault_decision(
    kind: FaultKind,
    limits: FaultLimits,
    *,
    retried_in_place: int = 0,
    failures: int | None = None,
    contentions: int | None = None,
    jitter: float = 0.5,
) -> FaultDecision:
    """The decision for one fault.

    Args:
        kind: the fault's kind.
        limits: the settings' bounds and delays.
        retried_in_place: contention retries already made in place for this delivery.
        failures: handler faults counted for the operation, this one included (``None``: not
            counted yet).
        contentions: contentions counted for the operation, this one included (``None``: not yet).
        jitter: a draw in [0, 1) that spreads the retries of contended deliveries apart.
    """
    if kind is FaultKind.ENVIRONMENT:
        return FaultDecision(Action.RELEASE)
    if kind is FaultKind.MESSAGE:
        return FaultDecision(Action.DEAD_LETTER)
    if kind is FaultKind.CONTENTION:
        if retried_in_place < IN_PLACE_CONTENTION_RETRIES:
            return FaultDecision(Action.RETRY_IN_PLACE, delay=_IN_PLACE.jittered(retried_in_place + 1, jitter))
        if contentions is None:
            return FaultDecision(Action.COUNT)
        bound = limits.max_contentions
        if contentions >= bound:
            return FaultDecision(Action.DEAD_LETTER, limit="max_contentions", attempt=contentions, of=bound)
        delay = (0.5 + jitter) * limits.in_progress_delay
        return FaultDecision(Action.RETRY, delay=delay, attempt=contentions, of=bound)
    if failures is None:
        return FaultDecision(Action.COUNT)
    bound = limits.max_deliveries
    if failures >= bound:
        return FaultDecision(Action.DEAD_LETTER, limit="max_deliveries", attempt=failures, of=bound)
    return FaultDecision(Action.RETRY, delay=backoff(limits.retry_delays, failures), attempt=failures, of=bound)


def backoff(retry_delays: Sequence[float], count: int) -> float:
    """The delay in seconds before the next delivery after the ``count``-th failure (1-based;
    the last delay repeats)."""
    index = min(max(count, 1) - 1, len(retry_delays) - 1)
    return retry_delays[index]
