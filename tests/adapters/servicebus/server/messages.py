"""A message held by an entity: its sequence number, state, delivery count and lock.

Imitates what Service Bus keeps per message: a sequence number assigned on arrival, the enqueued
time, a delivery count that grows on abandon and lock expiry (not on release), a state (active,
deferred, scheduled) and, while a receiver holds it, a lock token with an expiry.
"""

from __future__ import annotations

import enum
import math
import uuid
from dataclasses import dataclass, field
from typing import Any

from . import wire
from .sections import EncodedMessage


class MessageState(enum.IntEnum):
    """Values of the ``x-opt-message-state`` annotation (the SDK's ``ServiceBusMessageState``)."""

    ACTIVE = 0
    DEFERRED = 1
    SCHEDULED = 2


@dataclass(eq=False)
class StoredMessage:
    """One message in one entity. Times are seconds since the Unix epoch."""

    sequence_number: int
    content: EncodedMessage
    enqueued_time: float
    delivery_count: int = 0
    state: MessageState = MessageState.ACTIVE
    scheduled_time: float | None = None
    lock_token: uuid.UUID | None = None
    locked_until: float = 0.0
    lock_owner: object | None = field(default=None, repr=False)
    time_to_live: float = math.inf  # seconds, the effective one (message's, capped by the entity's)

    @property
    def expires_at(self) -> float:
        """Service Bus's ExpiresAtUtc: enqueued time + time to live (epoch seconds)."""
        return self.enqueued_time + self.time_to_live

    def is_expired(self, now: float) -> bool:
        return self.expires_at <= now

    @property
    def message_id(self) -> str | None:
        return self.content.message_id

    @property
    def session_id(self) -> str | None:
        return self.content.session_id

    def is_locked(self, now: float) -> bool:
        return self.lock_token is not None and self.locked_until > now

    def lock(self, owner: object, until: float) -> uuid.UUID:
        """Lock for ``owner`` until ``until`` (``math.inf`` for session messages) with a new token."""
        self.lock_token = uuid.uuid4()
        self.locked_until = until
        self.lock_owner = owner
        return self.lock_token

    def unlock(self) -> None:
        self.lock_token = None
        self.locked_until = 0.0
        self.lock_owner = None

    def render(self, *, locked_until: float | None = None, with_lock_token: bool = True) -> bytes:
        """The bytes a receiver gets: the producer's message plus the broker's annotations."""
        annotations: dict[Any, Any] = {
            wire.SEQUENCE_NUMBER: self.sequence_number,
            wire.ENQUEUED_TIME: wire.amqp_timestamp(self.enqueued_time),
        }
        if self.state is not MessageState.ACTIVE:
            annotations[wire.MESSAGE_STATE] = int(self.state)
        if self.scheduled_time is not None:
            annotations[wire.SCHEDULED_ENQUEUE_TIME] = wire.amqp_timestamp(self.scheduled_time)
        until = self.locked_until if locked_until is None else locked_until
        if self.lock_token is not None and math.isfinite(until):
            annotations[wire.LOCKED_UNTIL] = wire.amqp_timestamp(until)
        delivery_annotations = (
            {wire.LOCK_TOKEN: self.lock_token} if with_lock_token and self.lock_token is not None else None
        )
        return self.content.render(
            delivery_count=self.delivery_count,
            annotations=annotations,
            delivery_annotations=delivery_annotations,
            # Azure shows no TTL the sender did not set (the entity's default applies unseen:
            # azure-sdk-for-net #21127, Azure/azure-service-bus #432)
            time_to_live=self.time_to_live if self.content.time_to_live is not None else None,
        )

    def snapshot(self, now: float) -> MessageSnapshot:
        properties = self.content.application_properties
        return MessageSnapshot(
            sequence_number=self.sequence_number,
            message_id=self.message_id,
            session_id=self.session_id,
            delivery_count=self.delivery_count,
            state=self.state,
            locked=self.is_locked(now),
            body=self.content.body,
            size=self.content.size,
            application_properties=properties,
            expires_at=self.expires_at,
            dead_letter_reason=wire.as_text(properties.get(wire.DEAD_LETTER_REASON)),
            dead_letter_error_description=wire.as_text(properties.get(wire.DEAD_LETTER_ERROR_DESCRIPTION)),
        )


@dataclass(frozen=True)
class MessageSnapshot:
    """What a test may inspect about a held message without going through the SDK."""

    sequence_number: int
    message_id: str | None
    session_id: str | None
    delivery_count: int
    state: MessageState
    locked: bool
    body: bytes
    size: int  # bytes of the message as stored (dead-letter properties included)
    application_properties: dict[Any, Any]
    expires_at: float  # epoch seconds (inf: never)
    dead_letter_reason: str | None
    dead_letter_error_description: str | None
