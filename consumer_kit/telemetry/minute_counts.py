"""Outcome counts per operation type and minute, kept in memory until the worker writes them to
the ledger's ``outcome_counts`` table (:mod:`consumer_kit.ledger.outcome_counts`).

Counting is a dictionary increment on the delivery's report step; the table is written by the
worker's summary task (one statement per interval), never by a delivery.
"""

from __future__ import annotations

import collections
import datetime as dt
import time
from collections.abc import Callable, Mapping

MinuteKey = tuple[str, str, dt.datetime]
"""``(operation type, outcome, minute)``; the minute is UTC, seconds zero."""


class MinuteCounts:
    """``{(operation type, outcome, minute): count}`` since the last :meth:`take`.

    Args:
        clock: seconds since the epoch (the worker's wall clock buckets the minutes).
    """

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        # keyed by the minute's epoch seconds (an int: no datetime made per delivery)
        self._counts: collections.Counter[tuple[str, str, int]] = collections.Counter()

    def add(self, operation_type: str | None, outcome: str, amount: int = 1) -> None:
        """Count ``amount`` deliveries of ``outcome`` now (``operation_type`` ``None``: the
        delivery never decoded, counted under ``""``)."""
        self._counts[(operation_type or "", outcome, int(self._clock()) // 60 * 60)] += amount

    def take(self) -> dict[MinuteKey, int]:
        """The counts so far, which start again from zero (to write them)."""
        taken, self._counts = self._counts, collections.Counter()
        return {
            (kind, outcome, dt.datetime.fromtimestamp(minute, dt.UTC)): count
            for (kind, outcome, minute), count in taken.items()
        }

    def give_back(self, counts: Mapping[MinuteKey, int]) -> None:
        """Return counts :meth:`take` gave out that could not be written (retried next time)."""
        for (kind, outcome, minute), count in counts.items():
            self._counts[(kind, outcome, int(minute.timestamp()))] += count

    def __len__(self) -> int:
        return len(self._counts)
