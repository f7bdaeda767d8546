"""Partitioned entities (``EntityOptions.enable_partitioning``): which partition a message goes
to, its sequence number, the batch rule and how a peek answers.

Imitates Service Bus as Microsoft documents it (sources in the server's README):

- **16 partitions** (Basic and Standard always create 16, *Partitioned queues and topics*);
  partition ids here are 0..15.
- **Sequence numbers**: "for partitioned entities, the topmost 16 bits reflect the partition
  identifier" and the number "is issued relative to the partition" (*Message sequencing and
  timestamps*; the .NET ``SequenceNumber`` reference): ``(partition << 48) | n`` with ``n``
  counting from 1 in each partition.
- **Partition key** (*Use of partition keys*): the session id if set, else the partition key
  (``x-opt-partition-key``), else the message id when duplicate detection is on, else none (the
  partition is then chosen in turn, round robin). Messages of one key share a partition (a stable
  hash of the key here; Azure's hash is not documented).
- **Batches**: a batch is stored in one partition as one transaction, so one whose messages carry
  different session ids or partition keys is refused with ``amqp:not-allowed`` (a Service Bus
  engineer on Azure/azure-service-bus#103: "a sendBatch command is transactional", "a transaction
  cannot span across partitions", a batch of different partition keys "indeed is an invalid
  operation"; azure-sdk-for-js's sendBatch tests: "Not allowed for partitioned entities"). With
  duplicate detection on, any batch of distinct session ids, partition keys **or message ids** is
  refused, with Service Bus's own text (quoted in azure-sdk-for-python#21955, #36333: "not
  implemented by the service").
- **Peek** (*Partitioned queues and topics*: a peek "returns the oldest message in one of the
  partitions whose message broker responded first", with no order across partitions; SDK users saw
  one partition's messages per peek: azure-sdk-for-js#1108, azure-service-bus-dotnet#586): a peek
  from sequence number S answers with the messages (>= S) of **one** partition, in its sequence
  order; which partition answers first goes round among those holding messages >= S. Assumption:
  that turn is fair (no partition is starved); not seen on a real namespace.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Iterable, Sequence
from typing import Protocol, TypeVar

from .errors import NotAllowed
from .sections import EncodedMessage

PARTITION_COUNT = 16
"""Partitions of a partitioned entity (Basic and Standard tiers always create 16)."""

PARTITION_SHIFT = 48
"""Bits below the partition id in a sequence number (its topmost 16 bits hold the id)."""

DISTINCT_KEYS_WITH_DUPLICATE_DETECTION = (
    "Batching brokered messages with distinct SessionId, PartitionKey, or MessageId is not supported "
    "for an entity with partitioning and duplicate detection enabled."
)
"""Service Bus's refusal of such a batch, as users quote it."""

DISTINCT_KEYS = (
    "A batch sent to a partitioned entity must not mix session ids or partition keys: a batch is "
    "stored in one partition."
)
"""This server's own text (Azure's wording for this case is not documented); condition and SDK
error class are as for the documented case."""


def partition_of(sequence_number: int) -> int:
    """The partition id in a sequence number's topmost 16 bits (0 on a non-partitioned entity)."""
    return sequence_number >> PARTITION_SHIFT


def partition_key(content: EncodedMessage, *, duplicate_detection: bool) -> str | None:
    """What Service Bus partitions ``content`` by (*Use of partition keys*), or None."""
    if content.session_id is not None:
        return content.session_id
    if content.partition_key is not None:
        return content.partition_key
    return content.message_id if duplicate_detection else None


class Partitions:
    """The partitions of one entity: where the next message goes and the numbers it gets."""

    def __init__(self, count: int = PARTITION_COUNT) -> None:
        self.count = count
        self._next = [1] * count  # per partition, the number (low 48 bits) of its next message
        self._turn = itertools.cycle(range(count))  # keyless messages go round

    def partition_for(self, content: EncodedMessage, *, duplicate_detection: bool) -> int:
        key = partition_key(content, duplicate_detection=duplicate_detection)
        if key is None:
            return next(self._turn)
        return zlib.crc32(key.encode("utf-8")) % self.count

    def next_sequence_number(self, partition: int) -> int:
        number = (partition << PARTITION_SHIFT) | self._next[partition]
        self._next[partition] += 1
        return number


def check_batch(contents: Sequence[EncodedMessage], *, duplicate_detection: bool) -> None:
    """Raise NotAllowed for a batch a partitioned entity refuses (module docstring)."""
    if len(contents) < 2:
        return
    if duplicate_detection:
        if len({(c.session_id, c.partition_key, c.message_id) for c in contents}) > 1:
            raise NotAllowed(DISTINCT_KEYS_WITH_DUPLICATE_DETECTION)
    elif len({partition_key(c, duplicate_detection=False) for c in contents}) > 1:
        raise NotAllowed(DISTINCT_KEYS)


class _Numbered(Protocol):
    @property
    def sequence_number(self) -> int: ...


N = TypeVar("N", bound=_Numbered)


class PeekTurn:
    """Which partition answers a peek first: in turn among those that have something to show."""

    def __init__(self) -> None:
        self._calls = 0

    def answer(self, candidates: Iterable[N], count: int) -> list[N]:
        """Of ``candidates`` (messages >= the peek's start, any order), the first ``count`` of one
        partition, in sequence order."""
        by_partition: dict[int, list[N]] = {}
        for message in candidates:
            by_partition.setdefault(partition_of(message.sequence_number), []).append(message)
        if not by_partition:
            return []
        partitions = sorted(by_partition)
        # The lowest partition does not answer first on the first call: a browse that assumes
        # sequence order across partitions misses messages at once.
        self._calls += 1
        chosen = by_partition[partitions[self._calls % len(partitions)]]
        return sorted(chosen, key=lambda m: m.sequence_number)[:count]
