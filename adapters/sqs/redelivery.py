"""``delivery_count`` and ``redelivered`` of an SQS delivery.

SQS counts **every** receive in ``ApproximateReceiveCount``: a retry or a release given back with
``ChangeMessageVisibility`` comes back counted, exactly like a message whose worker died. The
adapter keeps the two apart so that a real crash is never missed and a graceful give-back is
never taken for one:

* **standard queues**: retry and release send a *copy* (``x-consumer-kit-deliveries`` = the
  deliveries before it, ``x-consumer-kit-redelivered`` when a suspect is released) and delete the
  original, so the copy starts again at ``ApproximateReceiveCount = 1``. Any receive count above 1
  means a hand-over ended without a settlement of ours: a crash, a lost lock, a settlement that
  failed. This works across processes and restarts.
* **FIFO queues** (and the fallbacks of standard queues: a delay above SQS's 900 s
  ``DelaySeconds``, a copy that does not fit): a copy would go to the back of the message group,
  so the message is given back with ``ChangeMessageVisibility`` and this process remembers, in
  :class:`GiveBacks`, the receive count it expects next and how many of the receives were
  uncounted releases. A receive count that the remembered give-backs explain is no redelivery;
  anything else above 1 is. A message given back by another process, or by this one before a
  restart, comes back as a suspect: it runs alone once (a false suspect costs only that), and a
  real crash is never missed.

::

    delivery_count = x-consumer-kit-deliveries (0 without) + ApproximateReceiveCount
                     - receives this process gave back uncounted (FIFO releases)
    redelivered    = x-consumer-kit-redelivered, or
                     ApproximateReceiveCount > 1 and not the count a remembered give-back expects
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from .config import MAX_VISIBILITY_SECONDS

_MAX_ENTRIES = 100_000  # a forgotten entry only makes a false suspect


@dataclass
class _GivenBack:
    next_receive_count: int
    uncounted: int
    suspect: bool
    at: float


class GiveBacks:
    """Messages this process gave back with ``ChangeMessageVisibility``, by (queue URL, SQS
    message id): at most 100,000, each kept 12 hours (the longest a give-back can wait)."""

    def __init__(self) -> None:
        self._entries: OrderedDict[tuple[str, str], _GivenBack] = OrderedDict()

    def remember(
        self, queue_url: str, sqs_message_id: str, *, receive_count: int, uncounted: bool, suspect: bool
    ) -> _GivenBack | None:
        """The delivery received ``receive_count`` times is being given back; ``uncounted`` for a
        release, ``suspect`` when it was a redelivery (a suspect stays a suspect). Called before
        the give-back is sent: the receive it makes possible may come back before its reply does.
        Returns what was remembered before, for :meth:`forget`."""
        key = (queue_url, sqs_message_id)
        earlier = self._entries.pop(key, None)
        self._entries[key] = _GivenBack(
            next_receive_count=receive_count + 1,
            uncounted=(earlier.uncounted if earlier else 0) + (1 if uncounted else 0),
            suspect=suspect,
            at=time.monotonic(),
        )
        while len(self._entries) > _MAX_ENTRIES:
            self._entries.popitem(last=False)
        return earlier

    def forget(self, queue_url: str, sqs_message_id: str, earlier: _GivenBack | None) -> None:
        """The give-back just remembered failed: back to what was remembered before it."""
        key = (queue_url, sqs_message_id)
        self._entries.pop(key, None)
        if earlier is not None:
            self._entries[key] = earlier

    def judge(
        self, queue_url: str, sqs_message_id: str, *, receive_count: int, earlier: int, copied_suspect: bool
    ) -> tuple[int, bool]:
        """``(delivery_count, redelivered)`` of a receive (formula in the module docstring).
        The entry stays (its uncounted releases still count on later receives) but explains only
        this receive."""
        key = (queue_url, sqs_message_id)
        entry = self._entries.get(key)
        if entry is not None and time.monotonic() - entry.at > MAX_VISIBILITY_SECONDS:
            del self._entries[key]
            entry = None
        uncounted = entry.uncounted if entry is not None else 0
        if receive_count <= 1:
            redelivered = False
        elif entry is not None and entry.next_receive_count == receive_count:
            redelivered = entry.suspect
        else:
            redelivered = True
        if entry is not None:
            entry.next_receive_count = 0  # used: a later receive needs a give-back of its own
        return max(1, earlier + receive_count - uncounted), redelivered or copied_suspect

    def __len__(self) -> int:
        return len(self._entries)


GIVE_BACKS = GiveBacks()
"""The process's give-backs: shared by every consumer, so a worker restarted inside one process
(tests, an embedded worker) still recognises them."""
