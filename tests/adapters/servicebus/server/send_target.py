"""The producer side of an entity: sequence numbers, duplicate detection, size and header limits, scheduling.

Imitates Service Bus (times in seconds since the Unix epoch): each entity that accepts sends
assigns sequence numbers from 1; with duplicate detection on, a message whose ``message_id`` was
seen within the window is accepted and dropped; a message over ``max_message_size`` bytes, or over
the header limits (``header_limits.py``: 32 KB per property, 64 KB in all), is refused; a message
with a future ``x-opt-scheduled-enqueue-time`` (or sent through
``schedule-message``) is held until then. Scheduled messages go through duplicate detection like
any send, and get a **new** sequence number when they become active (*Message sequencing and
timestamps*: the message "is appended to the queue as if had been enqueued at the current instant,
which includes assigning a new SequenceNumber"; *Duplicate detection*: "Scheduled messages are
included in duplicate detection"). Partitioned entities number and place messages as
:mod:`.partitions` says.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

from . import header_limits, wire
from .errors import MessageNotFound, MessageTooLarge
from .messages import MessageSnapshot, MessageState, StoredMessage
from .partitions import Partitions, check_batch, partition_key
from .sections import EncodedMessage


@dataclass(frozen=True)
class EntityOptions:
    """Per-entity settings, named as in the Service Bus portal.

    ``lock_duration`` (seconds) applies to message locks and session locks alike;
    ``duplicate_detection_window`` (seconds) or None turns duplicate detection off;
    ``max_message_size`` is in bytes; ``max_delivery_count`` None never dead-letters;
    ``default_message_time_to_live`` (seconds, None: never) is the TTL of a message that sets none
    and the ceiling of one that does; ``dead_lettering_on_message_expiration`` moves expired
    messages to the dead-letter queue (reason ``TTLExpiredException``) instead of dropping them.
    """

    lock_duration: float = 60.0  # MIN_LOCK_DURATION..MAX_LOCK_DURATION; 60 s: Azure's default LockDuration
    max_delivery_count: int | None = 10
    requires_session: bool = False
    duplicate_detection_window: float | None = None
    max_message_size: int = 256 * 1024
    default_message_time_to_live: float | None = None
    dead_lettering_on_message_expiration: bool = False
    # What a session entity does with a message without a session id: Azure's behaviour is not
    # documented (queues.py, "sessionless sends"), so a test picks: "refuse" or "dead-letter".
    sessionless_sends: str = "refuse"
    enable_partitioning: bool = False

    def __post_init__(self) -> None:
        if self.sessionless_sends not in ("refuse", "dead-letter"):
            raise ValueError(f"sessionless_sends is 'refuse' or 'dead-letter', not {self.sessionless_sends!r}")
        # Raised at creation and at configure(), as the portal, ARM and the emulator refuse it.
        if not MIN_LOCK_DURATION <= self.lock_duration <= MAX_LOCK_DURATION:
            raise ValueError(
                f"lock_duration {self.lock_duration} s is outside Service Bus's "
                f"{MIN_LOCK_DURATION:g}-{MAX_LOCK_DURATION:g} s: in a test, advance the broker's "
                "clock (skew_clock) or expire_all_locks instead of a shorter lock"
            )


MIN_LOCK_DURATION = 5.0
"""Seconds: the shortest LockDuration Service Bus allows (the Azure portal's minimum, and the
emulator's since its 2025 release notes; Azure/azure-service-bus#22 and
Azure/azure-sdk-for-node#1747 report older clients that set less, on an unvalidated path)."""
MAX_LOCK_DURATION = 300.0
"""Seconds: the longest LockDuration (``CreateQueueOptions.LockDuration``: "Max value is 5 minutes")."""


class SendTarget:
    """Something producers send to (a queue or a topic): sequencing, dedup, size and scheduling."""

    def __init__(self, path: str, options: EntityOptions, lock: threading.RLock) -> None:
        self.path = path
        self.options = options
        self._lock = lock
        self._next_sequence_number = 1
        self._seen_message_ids: dict[str, float] = {}
        self._scheduled: dict[int, StoredMessage] = {}
        self._partitions = Partitions() if options.enable_partitioning else None

    # -- producer side ------------------------------------------------------------------------

    def configure(self, **changes: object) -> None:
        """Change options in place (``EntityOptions`` fields): new locks and sends follow them, as
        after an update of the entity in the portal."""
        with self._lock:
            self.options = dataclasses.replace(self.options, **changes)  # type: ignore[arg-type]

    def check(self, content: EncodedMessage) -> None:
        """Raise the BrokerError a send of ``content`` would meet (size, sessions), storing nothing."""
        self._check_acceptable(content)

    def check_batch(self, contents: list[EncodedMessage]) -> None:
        """Raise the BrokerError a batch of ``contents`` would meet as a whole (a partitioned entity
        refuses mixed keys, :func:`.partitions.check_batch`), storing nothing."""
        if self._partitions is not None:
            check_batch(contents, duplicate_detection=self._deduplicates)

    def send(self, content: EncodedMessage, now: float) -> None:
        """Store one message (a duplicate is accepted and dropped, as Service Bus does)."""
        self._check_acceptable(content)
        if self._is_duplicate(content, now):
            return
        scheduled = content.annotations.get(wire.SCHEDULED_ENQUEUE_TIME)
        if scheduled is not None and int(scheduled) / 1000 > now:
            self._hold(content, int(scheduled) / 1000)
            return
        self._accept(self._new_message(content, now))

    def schedule(self, content: EncodedMessage, when: float, now: float) -> int:
        """Hold a message until ``when``; returns its sequence number (for cancel, valid while it is
        scheduled). A duplicate (duplicate detection on) is dropped: the number returned then names
        no message (assumption: what Azure returns for it is not documented)."""
        self._check_acceptable(content)
        if self._is_duplicate(content, now):
            return self._next_number(content)
        if when <= now:
            stored = self._new_message(content, now)
            self._accept(stored)
            return stored.sequence_number
        return self._hold(content, when).sequence_number

    def cancel_scheduled(self, sequence_number: int) -> None:
        if self._scheduled.pop(sequence_number, None) is None:
            raise MessageNotFound(f"no scheduled message {sequence_number} in {self.path}")

    def release_due(self, now: float) -> None:
        """Enqueue scheduled messages whose time has come, each under a new sequence number."""
        for sequence_number, stored in list(self._scheduled.items()):
            if stored.scheduled_time is not None and stored.scheduled_time <= now:
                del self._scheduled[sequence_number]
                stored.state = MessageState.ACTIVE
                stored.enqueued_time = stored.scheduled_time
                stored.sequence_number = self._next_number(stored.content)
                self._accept(stored)

    # -- hooks ----------------------------------------------------------------------------------

    def _check_acceptable(self, content: EncodedMessage) -> None:
        if content.size > self.options.max_message_size:
            raise MessageTooLarge(
                f"message of {content.size} bytes exceeds {self.options.max_message_size} bytes"
            )
        header_limits.check(content)

    def _accept(self, stored: StoredMessage) -> None:
        raise NotImplementedError

    # -- helpers --------------------------------------------------------------------------------

    def _new_message(self, content: EncodedMessage, now: float) -> StoredMessage:
        return StoredMessage(self._next_number(content), content, enqueued_time=now)

    def _next_number(self, content: EncodedMessage) -> int:
        """The sequence number the next message (``content``) gets: entity-wide from 1, or, on a
        partitioned entity, in the partition its key picks."""
        if self._partitions is not None:
            partition = self._partitions.partition_for(content, duplicate_detection=self._deduplicates)
            return self._partitions.next_sequence_number(partition)
        number = self._next_sequence_number
        self._next_sequence_number += 1
        return number

    @property
    def _deduplicates(self) -> bool:
        return self.options.duplicate_detection_window is not None

    def _hold(self, content: EncodedMessage, when: float) -> StoredMessage:
        stored = self._new_message(content, when)
        stored.state = MessageState.SCHEDULED
        stored.scheduled_time = when
        self._scheduled[stored.sequence_number] = stored
        return stored

    def _is_duplicate(self, content: EncodedMessage, now: float) -> bool:
        """Whether duplicate detection drops ``content`` (recording it otherwise). On a partitioned
        entity uniqueness is ``MessageId+PartitionKey`` (*Duplicate detection*)."""
        window = self.options.duplicate_detection_window
        if window is None or content.message_id is None:
            return False
        message_id = content.message_id
        if self._partitions is not None:
            message_id = f"{partition_key(content, duplicate_detection=False) or ''}/{message_id}"
        for seen_id, seen_at in list(self._seen_message_ids.items()):
            if seen_at + window > now:
                break  # insertion order is time order: the rest are younger
            del self._seen_message_ids[seen_id]
        if message_id in self._seen_message_ids:
            return True
        self._seen_message_ids[message_id] = now
        return False

    # -- inspection (takes the namespace lock) --------------------------------------------------

    @property
    def scheduled(self) -> list[MessageSnapshot]:
        """Messages waiting for their scheduled enqueue time, in sequence order."""
        with self._lock:
            return [self._scheduled[n].snapshot(0.0) for n in sorted(self._scheduled)]

    @property
    def scheduled_count(self) -> int:
        with self._lock:
            return len(self._scheduled)
