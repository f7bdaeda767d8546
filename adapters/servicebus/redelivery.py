"""Telling a crash from our own give-back: the abandons this process made, by sequence number.

Service Bus raises a message's ``delivery_count`` when a receiver abandons it *and* when its lock
expires, and the SDK cannot mark an abandoned message. So a redelivery (``delivery_count > 0``)
alone does not say whether a worker died holding the message (a *suspect*: the runtime must run it
alone and count a possible crash) or the adapter gave it back itself: ``retry(0)``, the end of a
held retry, a release on a session entity or a subscription, or a copy that could not be sent.
(On a plain queue a release is an uncounted copy: its next delivery has ``delivery_count`` 0 and
is told apart without any memory, see :mod:`consumer_kit.adapters.servicebus.delivery`.)

The adapter remembers each abandon it makes (:mod:`consumer_kit.broker.kit.give_backs`, whose table says
how a redelivery is judged): entity (names are case-insensitive), sequence number and the
``delivery_count`` the next delivery must then have. A redelivery is *ours* only when it matches
a remembered abandon exactly; everything else is a suspect: a count higher than that (a lock
expired after our abandon: someone held it and died) is never missed, and a message another
process abandoned, or this one before a restart, is a *false suspect* (it costs only running alone
once). A suspect stays a suspect. The SDK's ``delivery_count`` starts at 0, consumer-kit's
counts at 1: the book is kept in consumer-kit's (``delivery_count + 1``). What is remembered is
bounded (``capacity`` entries, oldest dropped first; a dropped entry makes its redelivery a false
suspect).
"""

from __future__ import annotations

from consumer_kit.broker.kit import give_backs

DEFAULT_CAPACITY = 10_000


class GiveBacks:
    """Abandons made by this process, looked up when their messages come back.

    Args:
        capacity: most abandons remembered at once (oldest dropped first).

    Raises:
        ValueError: ``capacity`` < 1.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._book: give_backs.GiveBacks[tuple[str, int]] = give_backs.GiveBacks(capacity)

    def __len__(self) -> int:
        return len(self._book)

    def record(self, entity: str, sequence_number: int, delivery_count: int, *, suspect: bool) -> None:
        """Remember that this process abandoned message ``sequence_number`` of ``entity``, handed
        out with the SDK's ``delivery_count`` (Service Bus adds one on abandon)."""
        self._book.remember((entity.casefold(), sequence_number), delivery_count + 1, suspect=suspect)

    def forget(self, entity: str, sequence_number: int) -> None:
        """Drop a recorded abandon that did not happen after all (the call failed)."""
        self._book.forget((entity.casefold(), sequence_number))

    def is_suspect(self, entity: str, sequence_number: int, delivery_count: int) -> bool:
        """Whether a delivery with the SDK's ``delivery_count`` must count as ``redelivered``
        (module docstring). Forgets the matching abandon."""
        return self._book.judge((entity.casefold(), sequence_number), delivery_count + 1)[1]
