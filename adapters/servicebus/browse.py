"""Where the next ``peek_messages`` call of a browse starts, on plain and partitioned entities.

A browse asks for messages from sequence number ``start`` on and continues after what it got. On a
plain entity a peek answers in sequence order, so "the highest number seen plus one" is the next
start. On a **partitioned** entity it is not: the sequence number carries the partition id in its
topmost 16 bits and "is issued relative to the partition" (Microsoft's *Message sequencing and
timestamps*), and a peek "returns the oldest message in one of the partitions whose message broker
responded first", with no order across partitions (*Partitioned queues and topics*; SDK users saw
one partition's messages per peek: azure-sdk-for-js#1108, azure-service-bus-dotnet#586). Jumping
past the highest number seen would skip every lower partition the answer did not come from.

:class:`BrowseCursor` moves ``start`` only past numbers it has seen all of:

* an answer holding messages of ``start``'s own partition (always, on a plain entity) moves
  ``start`` to the highest of them plus one: a partition answers in its own sequence order, so
  nothing of it between the two was missed;
* an answer from higher partitions only leaves ``start`` where it is (their messages are kept,
  each counted once) and is asked again: another partition may answer first next time;
* once a partition answers first a second time at the same ``start``, every partition holding
  messages at or after ``start`` has had its turn, so ``start``'s partition has nothing more:
  ``start`` moves to the lowest higher partition that answered.

Nothing is counted twice (messages are remembered by sequence number); each call either moves
``start`` or brings a partition's first answer at it, so a browse ends. It relies on every partition
answering first in its turn (Azure documents no order; never seen on a real namespace); on a
plain entity it costs no extra call; on a partitioned one that answers in sequence order, two or
three at each partition boundary.
"""

from __future__ import annotations

from collections.abc import Sequence

PARTITION_SHIFT = 48
"""Bits below the partition id in a partitioned entity's sequence numbers."""


def partition_of(sequence_number: int) -> int:
    """The partition id in the topmost 16 bits (0 on a plain entity)."""
    return sequence_number >> PARTITION_SHIFT


class BrowseCursor:
    """The start of the next peek of one browse, and which peeked messages are new (module docstring).

    Attributes:
        start: the sequence number the next peek starts at (1 at first).
    """

    def __init__(self) -> None:
        self.start = 1
        self._seen: set[int] = set()
        self._first_at_start: set[int] = set()  # partitions that answered first at this start

    def take(self, numbers: Sequence[int]) -> tuple[list[int], bool]:
        """Account for one peek's answer (its sequence numbers, in the order received).

        Returns:
            the positions in ``numbers`` of messages not seen before, and whether the browse goes
            on (False once a peek brought nothing: nothing at or after ``start`` remains).
        """
        if not numbers:
            return [], False
        new = [i for i, n in enumerate(numbers) if n not in self._seen]
        self._seen.update(numbers)
        own = partition_of(self.start)
        mine = [n for n in numbers if partition_of(n) == own and n >= self.start]
        if mine:
            self._move(max(mine) + 1)
            return new, True
        first = partition_of(numbers[0])
        if first in self._first_at_start:  # a second turn: ``start``'s partition is done
            higher = [p for p in self._first_at_start if p > own]
            self._move(min(higher) << PARTITION_SHIFT if higher else max(numbers) + 1)
            return new, True
        self._first_at_start.add(first)
        return new, True

    def _move(self, start: int) -> None:
        self.start = max(start, self.start + 1)
        self._first_at_start.clear()
