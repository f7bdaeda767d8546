"""The one backoff: the waits it gives, its jitter, and the same waits as a tenacity strategy."""

from __future__ import annotations

import pytest
from tenacity import RetryCallState

from consumer_kit.resilience.backoff import RECONNECT, Backoff


def test_waits_double_from_first_up_to_the_cap() -> None:
    backoff = Backoff(first=0.5, cap=3.0)
    assert [backoff.delay(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert backoff.delay(0) == 0.5  # no failure yet counts as the first
    assert backoff.delay(10_000) == 3.0  # far past the cap: no overflow
    assert [RECONNECT.delay(n) for n in (1, 2, 7, 8)] == [0.1, 0.2, 5.0, 5.0]


def test_full_jitter_stays_below_the_wait() -> None:
    backoff = Backoff(first=0.1, cap=60.0)
    assert backoff.jittered(3, 0.0) == 0.0
    assert backoff.jittered(3, 0.5) == pytest.approx(0.2)
    draws = [backoff.jittered(2) for _ in range(200)]
    assert all(0 <= d < 0.2 for d in draws) and len(set(draws)) > 100


def test_the_tenacity_wait_gives_the_same_waits() -> None:
    backoff = Backoff(first=0.2, cap=10.0)
    wait = backoff.wait()
    for attempt in range(1, 10):
        state = RetryCallState(retry_object=None, fn=None, args=(), kwargs={})  # type: ignore[arg-type]
        state.attempt_number = attempt
        assert wait(state) == pytest.approx(backoff.delay(attempt))


@pytest.mark.parametrize(("first", "cap", "factor"), [(0, 1, 2), (2, 1, 2), (0.1, 1, 1)])
def test_a_backoff_that_cannot_back_off_is_refused(first: float, cap: float, factor: float) -> None:
    with pytest.raises(ValueError, match="first <= cap"):
        Backoff(first=first, cap=cap, factor=factor)
