"""Named event counters an operator may ask about, kept the same way by every adapter.

An adapter object (a consumer, its settler, a batcher) holds one :class:`Counters` with the names it
counts (each starts at 0), reads as ``counters["locks_lost"]`` and logs ``counters.summary()`` when
it closes. Where a count is read as an attribute (``settler.deletes``), :class:`Counted` keeps that
attribute in the object's ``counters``. This module imports nothing of consumer_kit.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Protocol


class Counters:
    """Event counts by name: ``counters.add("renewals")``, ``counters["renewals"]``.

    Args:
        names: the names counted; each starts at 0 (and shows in :meth:`snapshot`). Others may be
            added too: they appear once counted.
    """

    def __init__(self, names: Iterable[str]) -> None:
        self._counts: collections.Counter[str] = collections.Counter({name: 0 for name in names})

    def add(self, name: str, amount: int = 1) -> None:
        """Count ``amount`` more events ``name``."""
        self._counts[name] += amount

    def set(self, name: str, value: int) -> None:
        """Set the count of ``name`` (what ``obj.name += 1`` on a :class:`Counted` attribute does)."""
        self._counts[name] = value

    def __getitem__(self, name: str) -> int:
        return self._counts[name]

    def snapshot(self) -> dict[str, int]:
        """``{name: count}`` for every name, in the order given."""
        return dict(self._counts)

    def summary(self) -> str:
        """``"received=3 renewals=7"``: the names counted so far (non-zero), for one log line."""
        return " ".join(f"{name}={count}" for name, count in self._counts.items() if count)


class HasCounters(Protocol):
    counters: Counters


class Counted:
    """An ``int`` attribute kept in its owner's ``counters`` under the attribute's name::

        class Settler:
            deletes = Counted()

            def __init__(self) -> None:
                self.counters = Counters(["deletes"])

    ``settler.deletes += 1`` counts one more; ``settler.deletes`` reads ``counters["deletes"]``.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, obj: HasCounters | None, objtype: type | None = None) -> int:
        if obj is None:
            raise AttributeError(f"{self._name} is a count of each instance")
        return obj.counters[self._name]

    def __set__(self, obj: HasCounters, value: int) -> None:
        obj.counters.set(self._name, value)
