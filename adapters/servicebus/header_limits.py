"""Service Bus's header limits, checked before a message leaves: 32 KB per property, 64 KB in all.

Microsoft's *Service Bus quotas* ("Message property size for a queue, topic, or subscription
entity"): each message property at most 32 KB; all properties, user and system (message id,
subject, session id, ..., sequence number), at most 64 KB: the whole header. Which error the
service answers over AMQP is not documented (the .NET client raises ``SerializationException``),
so consumer-kit never relies on it:

* a published event whose header breaks a limit is refused before sending
  (:func:`check_header`: a permanent ``PublishError`` naming the property and the sizes, never
  a value);
* a dead-letter's reason and description (themselves properties of the dead-lettered message)
  are cut to the room the message's own header leaves (:func:`dead_letter_room`).

Sizes are estimates of the AMQP encoding that err on the large side (:func:`property_bytes`);
:data:`BROKER_MARGIN` bytes are kept for what the broker stamps on the message.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Mapping
from typing import Any

from azure.servicebus import ServiceBusMessage, ServiceBusReceivedMessage

from .errors import HeaderTooLarge

PROPERTY_LIMIT = 32 * 1024
"""Bytes one message property may take, name and value (Service Bus quotas)."""
HEADER_LIMIT = 64 * 1024
"""Bytes all properties of a message may take together (Service Bus quotas)."""
BROKER_MARGIN = 1024
"""Bytes kept for the broker's own header entries (sequence number, enqueued time, lock token,
locked-until, dead-letter source, ...)."""

_SYSTEM_FIELDS = (
    "message_id",
    "correlation_id",
    "subject",
    "session_id",
    "reply_to_session_id",
    "to",
    "reply_to",
    "content_type",
    "partition_key",
)


def property_bytes(value: Any) -> int:
    """Bytes ``value`` takes AMQP-encoded, at most (a string's 4-byte length form, for example)."""
    if value is None or isinstance(value, bool):
        return 1
    if isinstance(value, str):
        return 5 + len(value.encode("utf-8"))
    if isinstance(value, bytes | bytearray | memoryview):
        return 5 + len(value)
    if isinstance(value, int | float | dt.datetime | dt.timedelta):
        return 9
    if isinstance(value, uuid.UUID):
        return 17
    return 5 + len(str(value).encode("utf-8"))


def _system_bytes(message: ServiceBusMessage | ServiceBusReceivedMessage) -> int:
    return sum(property_bytes(getattr(message, name, None)) for name in _SYSTEM_FIELDS) + 64


def _user_properties(message: ServiceBusMessage | ServiceBusReceivedMessage) -> Mapping[Any, Any]:
    return message.application_properties or {}


def header_bytes(message: ServiceBusMessage | ServiceBusReceivedMessage) -> int:
    """Bytes of ``message``'s header as Service Bus counts it (its properties, user and system),
    without the broker's own entries."""
    user = sum(property_bytes(k) + property_bytes(v) for k, v in _user_properties(message).items())
    return 8 + user + _system_bytes(message)


def check_header(message: ServiceBusMessage, *, what: str) -> None:
    """Raise :class:`HeaderTooLarge` unless ``message`` is within both header limits.

    Raises:
        HeaderTooLarge: a property over :data:`PROPERTY_LIMIT` bytes, or a header over
            :data:`HEADER_LIMIT` less :data:`BROKER_MARGIN` bytes.
    """
    for name, value in _user_properties(message).items():
        size = property_bytes(name) + property_bytes(value)
        if size > PROPERTY_LIMIT:
            shown = name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name)
            raise HeaderTooLarge(
                f"{what}: property {shown[:100]!r} takes about {size} bytes, over Service Bus's "
                f"{PROPERTY_LIMIT}-byte limit per message property"
            )
    total = header_bytes(message)
    if total > HEADER_LIMIT - BROKER_MARGIN:
        raise HeaderTooLarge(
            f"{what}: its properties take about {total} bytes, over Service Bus's {HEADER_LIMIT}-byte "
            f"header limit (less {BROKER_MARGIN} bytes kept for the broker's own entries)"
        )


def dead_letter_room(message: ServiceBusReceivedMessage) -> int:
    """Bytes the header limit leaves for a dead-letter reason and description beside ``message``'s
    own properties (0 when none is left)."""
    return max(0, HEADER_LIMIT - BROKER_MARGIN - header_bytes(message))
