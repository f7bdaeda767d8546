"""Counters for every event an operator may ask about, in-process and as OpenTelemetry metrics."""

from __future__ import annotations

import collections

from opentelemetry import metrics

_meter = metrics.get_meter("outbox_relay")
_events = _meter.create_counter(
    "outbox_relay.events", unit="{event}",
    description="Relay events by name (claimed, published, publish_failed, parked, taken_over, ...)",
)

NAMES = (
    "batches",            # claims that returned at least one row
    "empty_claims",       # claims that returned nothing
    "claimed",            # rows claimed
    "published",          # rows confirmed by the broker and marked published
    "republished",        # published rows whose earlier attempt failed or whose lease expired
    "publish_failed",     # failed attempts (attempts + 1, backoff)
    "parked",             # rows that reached max attempts (or were parked at once)
    "parked_permanent",   # rows parked at once: the broker can never take them as they are
    "unknown_destination",
    "taken_over",         # rows claimed after another relay's lease ran out
    "deadline_exceeded",  # publishes cancelled because the lease was about to run out
    "mark_lost",          # confirmed rows whose published mark did not reach the database
    "wakeups_notify",     # loop woken by NOTIFY
    "wakeups_poll",       # loop woken by the poll interval
    "db_errors",          # lost database connections in the loop
    "cleanup_deleted",    # published rows deleted by cleanup
)


class RelayCounters:
    """``counters["published"]`` etc.; every name in :data:`NAMES` starts at 0."""

    def __init__(self) -> None:
        self._counts: collections.Counter[str] = collections.Counter({name: 0 for name in NAMES})

    def add(self, name: str, amount: int = 1) -> None:
        if amount:
            self._counts[name] += amount
            _events.add(amount, {"event": name})

    def __getitem__(self, name: str) -> int:
        return self._counts[name]

    def snapshot(self) -> dict[str, int]:
        return dict(self._counts)
