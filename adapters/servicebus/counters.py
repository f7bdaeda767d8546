"""Counters for every Service Bus consumer event an operator may ask about."""

from __future__ import annotations

import collections

NAMES = (
    "received",          # deliveries handed to the worker
    "suspects",          # deliveries marked redelivered (a worker may have died holding them)
    "given_back",        # abandons of our own (retry without delay, end of a held retry, release
                         # on sessions and subscriptions, a copy that could not be sent)
    "retry_copies",      # delayed retries sent as a scheduled copy (then the original completed)
    "release_copies",    # releases sent as an uncounted copy (then the original completed)
    "held_retries",      # delayed retries held under lock, then abandoned (sessions, subscriptions)
    "copy_refused",      # retry or release copies that could not be sent: abandoned at once instead
    "dead_lettered",     # deliveries moved to the dead-letter sub-queue
    "locks_lost",        # MessageLockLostError / SessionLockLostError (renewal or settlement)
    "settlements_lost",  # settlements that failed or overran: the broker redelivers the message
    "renewals",          # lock renewals that worked (messages and sessions)
    "reconnects",        # receivers re-created after a failure
    "sessions",          # sessions accepted
)


class ConsumerCounters:
    """``counters["locks_lost"]`` etc.; every name in :data:`NAMES` starts at 0."""

    def __init__(self) -> None:
        self._counts: collections.Counter[str] = collections.Counter({name: 0 for name in NAMES})

    def add(self, name: str, amount: int = 1) -> None:
        self._counts[name] += amount

    def __getitem__(self, name: str) -> int:
        return self._counts[name]

    def snapshot(self) -> dict[str, int]:
        return dict(self._counts)
