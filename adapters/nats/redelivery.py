"""``delivery_count`` and ``redelivered`` of a JetStream delivery.

JetStream counts **every** hand-out in ``num_delivered``: a ``nak`` (consumer-kit's retry) comes
back counted, exactly like a message whose worker died or whose ``ack_wait`` lapsed. The adapter
keeps the two apart as the SQS adapter does for FIFO queues:

* release (shutdown, outage, isolation) sends a *copy* (``x-consumer-kit-deliveries`` = the
  deliveries before it, ``x-consumer-kit-redelivered`` for a suspect) and acks the original: the
  copy starts again at ``num_delivered = 1``, across processes and restarts;
* retry is ``nak(delay)`` (JetStream has no delayed publish before 2.12): this process remembers,
  in :data:`GIVE_BACKS` (:mod:`consumer_kit.broker.kit.give_backs`), the ``num_delivered`` it expects next
  (a release whose copy cannot be sent is a ``nak`` too, remembered as uncounted). A count the
  remembered give-back explains is no redelivery; anything else above 1 is. A message nak-ed by
  another process, or by this one before a restart, comes back as a suspect: it runs alone once
  (a false suspect costs only that), and a real crash is never missed.

::

    delivery_count = x-consumer-kit-deliveries (0 without) + num_delivered - uncounted give-backs
    redelivered    = x-consumer-kit-redelivered, or num_delivered > 1 and not what a
                     remembered give-back expects
"""

from __future__ import annotations

from consumer_kit.broker.kit.give_backs import GiveBacks

MAX_ENTRIES = 100_000
"""Give-backs remembered at most (a forgotten one only makes a false suspect)."""

GIVE_BACKS: GiveBacks[tuple[str, int]] = GiveBacks(MAX_ENTRIES)
"""The process's ``nak``-s by (stream, stream sequence), shared by every consumer (a worker
restarted in one process still recognises them). ``forget`` once the message left the stream
(acked, terminated): nothing to explain any more."""
