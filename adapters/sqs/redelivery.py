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
  :data:`GIVE_BACKS` (:mod:`consumer_kit.broker.kit.give_backs`), the receive count it expects next and how
  many of the receives were uncounted releases. A receive count that the remembered give-backs explain is no redelivery;
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

from consumer_kit.broker.kit.give_backs import GiveBacks

from .config import MAX_VISIBILITY_SECONDS

MAX_ENTRIES = 100_000
"""Give-backs remembered at most (a forgotten one only makes a false suspect)."""

GIVE_BACKS: GiveBacks[tuple[str, str]] = GiveBacks(MAX_ENTRIES, keep_for=MAX_VISIBILITY_SECONDS)
"""The process's ``ChangeMessageVisibility`` give-backs by (queue URL, SQS message id), each
believed 12 hours (the longest a give-back can wait): shared by every consumer, so a worker
restarted inside one process (tests, an embedded worker) still recognises them. A give-back SQS
refused is forgotten with what :meth:`~consumer_kit.broker.kit.give_backs.GiveBacks.remember` returned."""
