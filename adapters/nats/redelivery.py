"""``delivery_count`` and ``redelivered`` of a JetStream delivery.

JetStream counts **every** hand-out in ``num_delivered``: a ``nak`` (consumer-kit's retry) comes
back counted, exactly like a message whose worker died or whose ``ack_wait`` lapsed. The adapter
keeps the two apart as the SQS adapter does for FIFO queues:

* release (shutdown, outage, isolation) sends a *copy* (``x-consumer-kit-deliveries`` = the
  deliveries before it, ``x-consumer-kit-redelivered`` for a suspect) and acks the original: the
  copy starts again at ``num_delivered = 1``, across processes and restarts;
* retry is ``nak(delay)`` (JetStream has no delayed publish before 2.12): this process remembers,
  in :class:`GiveBacks`, the ``num_delivered`` it expects next. A count the remembered give-back
  explains is no redelivery; anything else above 1 is. A message nak-ed by another process, or by
  this one before a restart, comes back as a suspect: it runs alone once (a false suspect costs
  only that), and a real crash is never missed.

::

    delivery_count = x-consumer-kit-deliveries (0 without) + num_delivered - uncounted give-backs
    redelivered    = x-consumer-kit-redelivered, or num_delivered > 1 and not what a
                     remembered give-back expects
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

_MAX_ENTRIES = 100_000  # a forgotten entry only makes a false suspect


@dataclass
class _GivenBack:
    next_count: int
    uncounted: int
    suspect: bool


class GiveBacks:
    """Messages this process gave back with ``nak``, by (stream, stream sequence)."""

    def __init__(self) -> None:
        self._entries: OrderedDict[tuple[str, int], _GivenBack] = OrderedDict()

    def remember(self, stream: str, seq: int, *, num_delivered: int, uncounted: bool, suspect: bool) -> None:
        """Called before the ``nak`` is sent: its redelivery may arrive before the call returns."""
        earlier = self._entries.pop((stream, seq), None)
        self._entries[(stream, seq)] = _GivenBack(
            next_count=num_delivered + 1,
            uncounted=(earlier.uncounted if earlier else 0) + (1 if uncounted else 0),
            suspect=suspect,
        )
        while len(self._entries) > _MAX_ENTRIES:
            self._entries.popitem(last=False)

    def judge(self, stream: str, seq: int, *, num_delivered: int, earlier: int, copied_suspect: bool) -> tuple[int, bool]:
        """``(delivery_count, redelivered)`` of a hand-out (formula in the module docstring)."""
        entry = self._entries.get((stream, seq))
        uncounted = entry.uncounted if entry is not None else 0
        if num_delivered <= 1:
            redelivered = False
        elif entry is not None and entry.next_count == num_delivered:
            redelivered = entry.suspect
        else:
            redelivered = True
        if entry is not None:
            entry.next_count = 0  # used: a later hand-out needs a give-back of its own
        return max(1, earlier + num_delivered - uncounted), redelivered or copied_suspect

    def forget(self, stream: str, seq: int) -> None:
        """The message left the stream (acked, terminated): nothing to explain any more."""
        self._entries.pop((stream, seq), None)


GIVE_BACKS = GiveBacks()
"""The process's give-backs, shared by every consumer (a worker restarted in one process still
recognises them)."""
