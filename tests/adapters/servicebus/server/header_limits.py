"""Service Bus's header limits: 32 KB per message property, 64 KB for the whole header.

Microsoft's *Service Bus quotas* ("Message property size for a queue, topic, or subscription
entity"): "Maximum message property size for each property is 32 KB. Cumulative size of all
properties can't exceed 64 KB. This limit applies to the entire header of the brokered message,
which has both user properties and system properties, such as sequence number, label, and message
ID." Exceeding it raises ``SerializationException`` in the .NET client; which AMQP condition the
service sends is not documented. Here:

- a property's size is its encoded name plus its encoded value (AMQP bytes); the header is the
  producer's properties, application-properties and message-annotations sections as sent, plus
  :data:`BROKER_HEADER_BYTES` for what the broker stamps (sequence number, enqueued time, lock);
- a send over either limit is refused, and so is a dead-letter request whose reason and
  description would take the message over them (the message stays locked), both with
  ``amqp:link:message-size-exceeded`` (the SDK's ``MessageSizeExceededError``): the condition is
  an assumption, not seen on a real namespace.
"""

from __future__ import annotations

from typing import Any

from proton import Data

from .errors import MessageTooLarge
from .sections import APPLICATION_PROPERTIES, MESSAGE_ANNOTATIONS, PROPERTIES, EncodedMessage

PROPERTY_LIMIT = 32 * 1024
"""Bytes one message property may take (name and value)."""
HEADER_LIMIT = 64 * 1024
"""Bytes all properties, user and system, may take together."""
BROKER_HEADER_BYTES = 128
"""Bytes the broker's own annotations add (sequence number, enqueued time, locked-until, ...)."""


class HeaderTooLarge(MessageTooLarge):
    """A property over :data:`PROPERTY_LIMIT` or a header over :data:`HEADER_LIMIT`."""


def _encoded(value: Any) -> int:
    data = Data()
    data.put_object(value)
    return len(data.encode())


def header_size(content: EncodedMessage) -> int:
    """Bytes of ``content``'s header as Service Bus counts it (see the module docstring)."""
    sent = sum(
        len(s.raw)
        for s in content.sections
        if s.code in (PROPERTIES, APPLICATION_PROPERTIES, MESSAGE_ANNOTATIONS)
    )
    return sent + BROKER_HEADER_BYTES


def check(content: EncodedMessage, what: str = "message") -> None:
    """Raise HeaderTooLarge when ``content`` breaks a header limit; the error names the property
    (never its value) and the sizes in bytes."""
    for name, value in content.application_properties.items():
        size = _encoded(name) + _encoded(value)
        if size > PROPERTY_LIMIT:
            raise HeaderTooLarge(
                f"{what}: property {str(name)[:100]!r} takes {size} bytes, over Service Bus's "
                f"{PROPERTY_LIMIT}-byte limit per property"
            )
    total = header_size(content)
    if total > HEADER_LIMIT:
        raise HeaderTooLarge(
            f"{what}: header of {total} bytes, over Service Bus's {HEADER_LIMIT}-byte header limit"
        )
