"""The fault policy as a pure function (docs/explanation/faults-and-attempts.md): no database, no broker."""

from __future__ import annotations

import pytest

from consumer_kit.pipeline.fault_policy import (
    IN_PLACE_CONTENTION_RETRIES,
    Action,
    FaultLimits,
    backoff,
    fault_decision,
)
from consumer_kit.pipeline.faults import FaultKind

LIMITS = FaultLimits(max_deliveries=3, max_contentions=5, in_progress_delay=2.0, retry_delays=(1.0, 4.0, 9.0))


def test_an_environment_fault_gives_the_delivery_back_uncounted_whatever_the_counts() -> None:
    for failures in (None, 0, 3, 99):
        decision = fault_decision(FaultKind.ENVIRONMENT, LIMITS, failures=failures, contentions=failures)
        assert decision.action is Action.RELEASE and decision.limit is None


def test_a_message_fault_dead_letters_at_once_without_counting() -> None:
    decision = fault_decision(FaultKind.MESSAGE, LIMITS)
    assert decision.action is Action.DEAD_LETTER and decision.limit is None


def test_a_handler_fault_is_counted_first() -> None:
    assert fault_decision(FaultKind.HANDLER, LIMITS).action is Action.COUNT


@pytest.mark.parametrize(("failures", "delay"), [(1, 1.0), (2, 4.0)])
def test_a_handler_fault_below_max_deliveries_retries_with_its_backoff(failures: int, delay: float) -> None:
    decision = fault_decision(FaultKind.HANDLER, LIMITS, failures=failures)
    assert (decision.action, decision.delay, decision.attempt, decision.of) == (Action.RETRY, delay, failures, 3)


def test_a_handler_fault_at_max_deliveries_dead_letters() -> None:
    for failures in (3, 4):
        decision = fault_decision(FaultKind.HANDLER, LIMITS, failures=failures)
        assert (decision.action, decision.limit, decision.attempt) == (Action.DEAD_LETTER, "max_deliveries", failures)


def test_a_handler_fault_ignores_in_place_retries_and_contention_counts() -> None:
    decision = fault_decision(FaultKind.HANDLER, LIMITS, retried_in_place=0, failures=1, contentions=50)
    assert decision.action is Action.RETRY


def test_contention_is_retried_in_place_first_with_a_growing_jittered_wait() -> None:
    ceilings = []
    for done in range(IN_PLACE_CONTENTION_RETRIES):
        low = fault_decision(FaultKind.CONTENTION, LIMITS, retried_in_place=done, jitter=0.0)
        high = fault_decision(FaultKind.CONTENTION, LIMITS, retried_in_place=done, jitter=0.999)
        assert low.action is high.action is Action.RETRY_IN_PLACE
        assert low.delay == 0.0 < high.delay
        ceilings.append(high.delay)
    assert ceilings == sorted(ceilings) and ceilings[0] < 0.11 and ceilings[-1] < 0.41


def test_contention_past_the_in_place_retries_is_counted_then_retried_with_jitter_apart() -> None:
    done = IN_PLACE_CONTENTION_RETRIES
    assert fault_decision(FaultKind.CONTENTION, LIMITS, retried_in_place=done).action is Action.COUNT
    low = fault_decision(FaultKind.CONTENTION, LIMITS, retried_in_place=done, contentions=1, jitter=0.0)
    high = fault_decision(FaultKind.CONTENTION, LIMITS, retried_in_place=done, contentions=4, jitter=0.999)
    assert low.action is high.action is Action.RETRY
    assert low.delay == 1.0 and 2.99 < high.delay < 3.0  # 0.5 to 1.5 x in_progress_delay


def test_contention_at_max_contentions_dead_letters_and_handler_failures_do_not_count() -> None:
    done = IN_PLACE_CONTENTION_RETRIES
    decision = fault_decision(FaultKind.CONTENTION, LIMITS, retried_in_place=done, contentions=5, failures=0)
    assert (decision.action, decision.limit, decision.of) == (Action.DEAD_LETTER, "max_contentions", 5)
    below = fault_decision(FaultKind.CONTENTION, LIMITS, retried_in_place=done, contentions=4, failures=99)
    assert below.action is Action.RETRY


def test_backoff_repeats_its_last_delay_and_treats_counts_below_one_as_the_first() -> None:
    assert [backoff((1.0, 4.0), n) for n in (0, 1, 2, 3, 10)] == [1.0, 1.0, 4.0, 4.0, 4.0]
