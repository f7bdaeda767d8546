"""The one backoff every retry loop waits with: exponential, capped, optionally jittered.

A loop that retries a call with tenacity takes :meth:`Backoff.wait` (the same delays as a tenacity
``wait_exponential``); a loop of its own asks :meth:`Backoff.delay` for the n-th wait
(docs/explanation/architecture.md, "Background tasks and backoff").
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tenacity import wait_exponential


@dataclass(frozen=True)
class Backoff:
    """Waits of ``first`` seconds, multiplied by ``factor`` after each failure, at most ``cap``.

    Attributes:
        first: the first wait, seconds (> 0).
        cap: the longest wait, seconds (>= ``first``).
        factor: the growth per failure (> 1).
    """

    first: float
    cap: float
    factor: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.first <= self.cap or self.factor <= 1:
            raise ValueError(f"a backoff needs 0 < first <= cap and factor > 1, not {self}")

    def delay(self, failures: int) -> float:
        """The wait in seconds after ``failures`` failures in a row (1: ``first``)."""
        exponent = max(0, failures - 1)
        if exponent > 64:  # far past any cap: no float overflow
            return self.cap
        return min(self.cap, self.first * self.factor ** exponent)

    def jittered(self, failures: int, draw: float | None = None) -> float:
        """:meth:`delay` with full jitter: uniform in ``[0, delay)``, so that retries of many
        contenders spread apart. ``draw``: a number in ``[0, 1)`` (default: a random one)."""
        return (random.random() if draw is None else draw) * self.delay(failures)

    def wait(self) -> wait_exponential:
        """The same waits as a tenacity ``wait`` strategy (attempt 1 waits ``first``)."""
        return wait_exponential(multiplier=self.first, exp_base=self.factor, max=self.cap)


RECONNECT = Backoff(first=0.1, cap=5.0)
"""Between attempts to reach a broker again (connects, pulls, receives): 0.1 s doubling to 5 s."""
