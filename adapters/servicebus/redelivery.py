"""Telling a crash from our own give-back: the abandons this process made, by sequence number.

Service Bus raises a message's ``delivery_count`` when a receiver abandons it *and* when its lock
expires, and the SDK cannot mark an abandoned message. So a redelivery (``delivery_count > 0``)
alone does not say whether a worker died holding the message (a *suspect*: the runtime must run it
alone and count a possible crash) or the adapter gave it back itself: ``retry(0)``, the end of a
held retry, a release on a session entity or a subscription, or a copy that could not be sent.
(On a plain queue a release is an uncounted copy: its next delivery has ``delivery_count`` 0 and
is told apart without any memory, see :mod:`consumer_kit.adapters.servicebus.delivery`.)

The adapter remembers each abandon it makes: entity, sequence number and the ``delivery_count``
the next delivery must then have. A redelivery is *ours* only when it matches a remembered
abandon exactly; everything else is a suspect:

====================================================  ===========================================
redelivery of a message with ``delivery_count > 0``   ``redelivered``
====================================================  ===========================================
this process abandoned it, and the count is exactly   ``False`` (``True`` when the abandoned
the one after that abandon                            delivery was itself a suspect: a suspect
                                                      stays a suspect)
count higher than that (a lock expired after our      ``True``: a real crash is never missed
abandon: someone held it and died)
another process abandoned it, or this process before  ``True``: a *false suspect*; it costs only
a restart (nothing remembered)                        running alone once
====================================================  ===========================================

So a real crash is never taken for a give-back: only an exact match with an abandon this very
process made clears a redelivery. What is remembered is bounded (``capacity`` entries, oldest
dropped first; a dropped entry makes its redelivery a false suspect).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

DEFAULT_CAPACITY = 10_000


@dataclass(frozen=True)
class _GiveBack:
    next_delivery_count: int  # the SDK's delivery_count the redelivery must have
    suspect: bool  # the abandoned delivery was itself a suspect


class GiveBacks:
    """Abandons made by this process, looked up when their messages come back.

    Args:
        capacity: most abandons remembered at once (oldest dropped first).
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._capacity = capacity
        self._entries: OrderedDict[tuple[str, int], _GiveBack] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, entity: str, sequence_number: int, delivery_count: int, *, suspect: bool) -> None:
        """Remember that this process abandoned message ``sequence_number`` of ``entity``, handed
        out with the SDK's ``delivery_count`` (Service Bus adds one on abandon)."""
        key = (entity.casefold(), sequence_number)
        self._entries.pop(key, None)
        self._entries[key] = _GiveBack(delivery_count + 1, suspect)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)

    def forget(self, entity: str, sequence_number: int) -> None:
        """Drop a recorded abandon that did not happen after all (the call failed)."""
        self._entries.pop((entity.casefold(), sequence_number), None)

    def is_suspect(self, entity: str, sequence_number: int, delivery_count: int) -> bool:
        """Whether a delivery with the SDK's ``delivery_count`` must count as ``redelivered``
        (table in the module docstring). Forgets the matching abandon."""
        if delivery_count <= 0:
            self.forget(entity, sequence_number)
            return False
        given_back = self._entries.pop((entity.casefold(), sequence_number), None)
        if given_back is None or given_back.next_delivery_count != delivery_count:
            return True
        return given_back.suspect
