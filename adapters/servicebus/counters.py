"""What a Service Bus consumer counts: the names (kept the core's way, :mod:`consumer_kit.broker.kit.counters`)."""

from __future__ import annotations

from consumer_kit.broker.kit.counters import Counters

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
    "throttled",         # receives, settlements, renewals Service Bus answered "server busy", waited out
    "sessions",          # sessions accepted
)


class ConsumerCounters(Counters):
    """``counters["locks_lost"]`` etc. (:class:`consumer_kit.broker.kit.counters.Counters`); every name in
    :data:`NAMES` starts at 0."""

    def __init__(self) -> None:
        super().__init__(NAMES)
