"""Telling a crash from the adapter's own give-back: the give-backs this process made, by message.

A broker counts a hand-out the same whether the worker holding the message died (its lock lapsed)
or the adapter gave the message back itself (a retry, a release, a copy that could not be sent),
and where the give-back cannot mark the message, the count alone cannot tell the two apart. So the
adapter remembers each such give-back here, *before* it is sent (its redelivery may arrive before
the call returns): the message (a key of the adapter's own), the count its next hand-out must then
have, whether the given-back delivery was itself a suspect, and how many of the message's
hand-outs were given back *uncounted* (a release: neither an attempt nor a redelivery).

A hand-out is judged against what is remembered of its message (counts start at 1: the adapter
maps its broker's count onto that):

=============================  ===================================================================
hand-out                       ``redelivered``
=============================  ===================================================================
the first (count 1)            ``False``
the count a give-back expects  ``False``, or ``True`` when the given-back delivery was a suspect (a
                               suspect stays a suspect)
any other count                ``True``: a lock lapsed after our give-back (someone held the
                               message and died); a real crash is never missed
nothing remembered             ``True``: given back by another process, by this one before a
                               restart, or dropped: a *false suspect*, it costs only running alone
                               once
=============================  ===================================================================

::

    delivery_count = deliveries the copies carried before (x-consumer-kit-deliveries, 0 without)
                     + the count - the hand-outs given back uncounted
    redelivered    = the copy's signed suspect mark, or the table above

A give-back explains one hand-out only: the next needs a give-back of its own (its uncounted
hand-outs still count on later ones). What is remembered is bounded: ``capacity`` entries, the
oldest dropped first, and with ``keep_for`` none older than that (a give-back cannot wait
longer); a dropped entry only makes a false suspect, never a missed crash.

Nothing here imports an adapter: each says in its own ``redelivery`` module what its broker
counts and which of its give-backs need remembering.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


@dataclass(slots=True)
class GivenBack:
    """What is remembered of one message (module docstring)."""

    next_count: int  # the count its next hand-out must have; 0 once that hand-out came
    uncounted: int  # hand-outs of it given back uncounted
    suspect: bool  # the given-back delivery was itself a suspect
    at: float  # time.monotonic() of the give-back (only with keep_for)


class GiveBacks(Generic[K]):
    """Give-backs made by this process, looked up when their messages come back (module docstring).

    Args:
        capacity: most messages remembered at once (oldest dropped first).
        keep_for: seconds an entry is believed at most; ``None``: until dropped.

    Raises:
        ValueError: ``capacity`` < 1.
    """

    def __init__(self, capacity: int, *, keep_for: float | None = None) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._capacity = capacity
        self._keep_for = keep_for
        self._entries: OrderedDict[K, GivenBack] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def remember(self, key: K, count: int, *, suspect: bool, uncounted: bool = False) -> GivenBack | None:
        """The hand-out ``count`` of message ``key`` is being given back; ``uncounted`` for a
        release, ``suspect`` when that delivery was a redelivery. Call it before the give-back is
        sent. Returns what was remembered before, for :meth:`forget`."""
        earlier = self._entries.pop(key, None)
        self._entries[key] = GivenBack(
            next_count=count + 1,
            uncounted=(earlier.uncounted if earlier is not None else 0) + (1 if uncounted else 0),
            suspect=suspect,
            at=time.monotonic() if self._keep_for is not None else 0.0,
        )
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)
        return earlier

    def forget(self, key: K, earlier: GivenBack | None = None) -> None:
        """Drop what is remembered of ``key`` (it left the queue, or the give-back failed), and
        put back ``earlier`` (what :meth:`remember` returned) when given."""
        self._entries.pop(key, None)
        if earlier is not None:
            self._entries[key] = earlier

    def judge(self, key: K, count: int, *, earlier: int = 0, copied_suspect: bool = False) -> tuple[int, bool]:
        """``(delivery_count, redelivered)`` of hand-out ``count`` of message ``key``; ``earlier``:
        the deliveries its copies carried before, ``copied_suspect``: its signed suspect mark
        (formula and table in the module docstring). The entry then explains no other hand-out."""
        entry = self._entries.get(key)
        if entry is not None and self._keep_for is not None and time.monotonic() - entry.at > self._keep_for:
            del self._entries[key]
            entry = None
        if entry is None:
            return max(1, earlier + count), count > 1 or copied_suspect
        redelivered = count > 1 and (entry.next_count != count or entry.suspect)
        uncounted = entry.uncounted
        if uncounted:
            entry.next_count = 0  # used: a later hand-out needs a give-back of its own
        else:
            del self._entries[key]  # nothing left to explain
        return max(1, earlier + count - uncounted), redelivered or copied_suspect
