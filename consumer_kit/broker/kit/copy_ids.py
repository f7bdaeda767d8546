"""De-duplication ids for the copies a worker or ``consumer-kit dlq`` makes (release, retry,
dead-letter, redrive) on brokers that drop a repeat id: JetStream's ``Nats-Msg-Id``, an SQS FIFO
queue's ``MessageDeduplicationId``, a Service Bus entity's ``MessageId`` under duplicate detection.

A producer can publish anything with any id (docs/explanation/trust.md). An id it can compute
before the copy is made (``<stream>-<sequence>-release``, ``<MessageId>-redrive``, a UUIDv5 of
public parts) lets it publish junk under that id first, so that the broker drops the real copy as
a repeat while the original is settled: the message vanishes. Two kinds here, neither computable
by a producer:

* :func:`random_copy_id` — 128 random bits: for a copy sent once per settlement (a repeat answer
  from the broker then means someone else used the id, never a success);
* :func:`keyed_copy_id` — HMAC-SHA256 of the parts under the deployment's mark key
  (:mod:`consumer_kit.codec.marks`): the same parts give the same id in every process of one
  deployment, so a copy sent again (a redrive whose removal failed) is still dropped as a repeat.
"""

from __future__ import annotations

import secrets

from consumer_kit.codec import marks

ID_CHARS = 32
"""The length of an id: 128 bits in hex (fits ``Nats-Msg-Id``, SQS's 128 and Service Bus's 128)."""

_CONTEXT = b"consumer-kit copy id\n"


def random_copy_id() -> str:
    """A fresh id of :data:`ID_CHARS` hex digits (``secrets``)."""
    return secrets.token_hex(ID_CHARS // 2)


def keyed_copy_id(*parts: str | int) -> str:
    """The id of :data:`ID_CHARS` hex digits for ``parts`` (e.g. target, sequence number, message
    id): HMAC-SHA256 under the current mark key, so stable across the deployment's processes and
    unknown to producers. ``parts`` are joined with a separator no part can fake (each is
    length-prefixed)."""
    return marks.keyed_digest(_CONTEXT, *parts).hex()[:ID_CHARS]
