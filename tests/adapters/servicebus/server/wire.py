"""Names and encodings Service Bus uses on the AMQP wire, as the azure-servicebus SDK reads them.

Everything here was checked against azure-servicebus 7.15's own source (``_common/constants.py``,
``_pyamqp``): the SDK compares these symbols byte for byte, so a typo here makes it hang or
misreport an error rather than fail cleanly.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any

from proton import UNDESCRIBED, Array, Data, Described, symbol, timestamp

VENDOR = "com.microsoft"

# Message annotations Service Bus stamps on every delivery.
SEQUENCE_NUMBER = symbol("x-opt-sequence-number")
ENQUEUED_TIME = symbol("x-opt-enqueued-time")
LOCKED_UNTIL = symbol("x-opt-locked-until")
LOCK_TOKEN = symbol("x-opt-lock-token")  # a delivery annotation, as the SDK reads it
SCHEDULED_ENQUEUE_TIME = symbol("x-opt-scheduled-enqueue-time")
MESSAGE_STATE = symbol("x-opt-message-state")
PARTITION_KEY = symbol("x-opt-partition-key")

# Application properties a dead-lettered message carries (the SDK reads them back from there).
DEAD_LETTER_REASON = "DeadLetterReason"
DEAD_LETTER_ERROR_DESCRIPTION = "DeadLetterErrorDescription"

# Link attach: session receivers name their session in a source filter; the service answers
# with the session it locked and the lock's expiry in .NET ticks.
SESSION_FILTER = symbol(f"{VENDOR}:session-filter")
SESSION_LOCKED_UNTIL = symbol(f"{VENDOR}:locked-until-utc")
LINK_TIMEOUT = symbol(f"{VENDOR}:timeout")  # ms the client will wait for a NEXT_AVAILABLE session
TRACKING_ID = symbol(f"{VENDOR}:tracking-id")  # error info key Service Bus fills for support cases

# Error conditions the SDK maps to its exception classes.
NOT_FOUND = "amqp:not-found"
NOT_ALLOWED = "amqp:not-allowed"
NOT_IMPLEMENTED = "amqp:not-implemented"
MESSAGE_SIZE_EXCEEDED = "amqp:link:message-size-exceeded"
MESSAGE_LOCK_LOST = f"{VENDOR}:message-lock-lost"
SESSION_LOCK_LOST = f"{VENDOR}:session-lock-lost"
SESSION_CANNOT_BE_LOCKED = f"{VENDOR}:session-cannot-be-locked"
MESSAGE_NOT_FOUND = f"{VENDOR}:message-not-found"
ARGUMENT_ERROR = f"{VENDOR}:argument-error"
OPERATION_TIMEOUT = f"{VENDOR}:timeout"

# .NET DateTime ticks (100 ns) at the Unix epoch; session lock expiry travels in ticks.
DOTNET_TICKS_AT_UNIX_EPOCH = 621355968000000000

DEAD_LETTER_SUFFIX = "/$DeadLetterQueue"
MANAGEMENT_SUFFIX = "/$management"
SUBSCRIPTIONS_INFIX = "/Subscriptions/"


def amqp_timestamp(seconds: float) -> timestamp:
    """An AMQP timestamp (milliseconds since the Unix epoch) for ``seconds`` since the epoch."""
    return timestamp(int(seconds * 1000))


def dotnet_ticks(seconds: float) -> int:
    """.NET ticks (100 ns units since 0001-01-01) for ``seconds`` since the Unix epoch."""
    return DOTNET_TICKS_AT_UNIX_EPOCH + int(seconds * 10_000_000)


def delivery_tag(lock_token: uuid.UUID) -> bytes:
    """The delivery tag for a lock token: the SDK reads the token back as ``UUID(bytes_le=tag)``."""
    return lock_token.bytes_le


def entity_path(address: str | None) -> str:
    """The entity path of a link address: ``amqps://host:port/q/$DeadLetterQueue`` -> ``q/$DeadLetterQueue``.

    The SDK attaches with full ``amqps://`` URIs for entities and bare paths for ``$cbs`` and
    ``<entity>/$management``; both forms name the same thing.
    """
    if not address:
        return ""
    if "://" in address:
        address = address.split("://", 1)[1]
        address = address.split("/", 1)[1] if "/" in address else ""
    return address.strip("/")


def as_list(value: Any) -> list[Any]:
    """The elements of an AMQP array or list (the SDK sends arrays; proton decodes them as ``Array``)."""
    if value is None:
        return []
    if isinstance(value, Array):
        return list(value.elements)
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        return list(value)
    return [value]


def long_array(values: Iterable[int]) -> Array:
    """An AMQP array of longs (how Service Bus returns sequence numbers)."""
    return Array(UNDESCRIBED, Data.LONG, *[int(v) for v in values])


def timestamp_array(values: Iterable[float]) -> Array:
    """An AMQP array of timestamps for ``values`` in seconds since the epoch (lock expirations)."""
    return Array(UNDESCRIBED, Data.TIMESTAMP, *[amqp_timestamp(v) for v in values])


def as_text(value: Any) -> str | None:
    """A string from an AMQP string, symbol or binary value (None stays None)."""
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8")
    return str(value)


def detach_buffers(value: Any) -> Any:
    """``value`` with every binary copied out of proton's buffers.

    python-qpid-proton decodes AMQP binary as a memoryview into the decoder's memory, which is
    reused once that decoder is gone: anything kept must own its bytes.
    """
    if isinstance(value, memoryview):
        return bytes(value)
    if isinstance(value, dict):
        return {detach_buffers(k): detach_buffers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [detach_buffers(v) for v in value]
    if isinstance(value, Described):
        return Described(value.descriptor, detach_buffers(value.value))
    if isinstance(value, Array):
        return Array(value.descriptor, value.type, *[detach_buffers(v) for v in value.elements])
    return value


def read_data(data: Data | None) -> Any:
    """The value held by a proton ``Data`` (a terminus filter, for instance), with buffers detached."""
    if data is None:
        return None
    data.rewind()
    if not data.next():
        return None
    return detach_buffers(data.get_object())
