"""The AMQP 0-9-1 frames of one publish, encoded without pamqp's generic encoder where they can be.

pamqp encodes every property and header through a type-dispatching encoder; for the relay's
messages (short-string properties, persistent delivery, priority 0, a table of string headers)
that was about a fifth of the relay's CPU per event in a drain profile. :func:`encode` writes the
same bytes directly, the ``Basic.Publish`` method frame once per (channel, exchange, routing key)
(it is the same for every event of a destination), and returns ``None`` for a message outside
that shape (any other property set, a header value that is not a string, a short string over
255 bytes): the caller encodes that one with pamqp. ``tests/adapters/rabbitmq/test_frames.py`` checks the
bytes equal pamqp's.

Wire format (AMQP 0-9-1 section 4.2.3, 4.2.6): frame = type (1) channel (2) size (4) payload
end (0xCE); content header payload = class 60 (2), weight 0 (2), body size (8), property flags
(2), then the set properties in flag order; a table = its byte length (4) and, per entry sorted by key
(as pamqp writes them), a short string key, ``S`` and a long string.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Mapping
from typing import cast

from pamqp.commands import Basic

_FRAME = struct.Struct(">BHI")
_END = b"\xce"
_HEADER_START = struct.Struct(">HHQH")  # class 60, weight 0, body size, property flags
_LONG = struct.Struct(">I")

# property flag bits (AMQP 0-9-1 Basic class), of the properties encoded here
_CONTENT_TYPE, _HEADERS, _DELIVERY_MODE, _PRIORITY = 1 << 15, 1 << 13, 1 << 12, 1 << 11
_MESSAGE_ID, _TYPE, _USER_ID = 1 << 7, 1 << 5, 1 << 4
_OTHERS = (
    "content_encoding",
    "correlation_id",
    "reply_to",
    "expiration",
    "timestamp",
    "app_id",
    "cluster_id",
)


def encode(
    channel: int,
    exchange: str,
    routing_key: str,
    properties: Basic.Properties,
    body: bytes,
    max_content_size: int,
) -> bytes | None:
    """The method, content header and body frames of a mandatory publish, as pamqp would encode
    them, or ``None`` when ``properties`` are outside this module's shape (module doc).
    ``max_content_size``: body bytes per body frame (``frame_max`` less the frame overhead)."""
    header = _content_header(channel, properties, len(body))
    if header is None:
        return None
    parts = [publish_frame(channel, exchange, routing_key), header]
    for start in range(0, len(body), max_content_size):
        chunk = body[start : start + max_content_size]
        parts.append(_FRAME.pack(3, channel, len(chunk)) + chunk + _END)
    return b"".join(parts)


@functools.lru_cache(maxsize=1024)
def publish_frame(channel: int, exchange: str, routing_key: str) -> bytes:
    """``Basic.Publish(exchange, routing_key, mandatory=True)`` on ``channel``: the same bytes for
    every event of a destination, so encoded once (per channel, exchange and routing key).

    Raises:
        ValueError: the exchange or the routing key is over 255 bytes.
    """
    payload = b"\x00\x3c\x00\x28\x00\x00" + _short(exchange) + _short(routing_key) + b"\x01"
    return _FRAME.pack(1, channel, len(payload)) + payload + _END


def _short(text: str) -> bytes:
    data = text.encode()
    if len(data) > 255:
        raise ValueError(f"short string of {len(data)} bytes (at most 255)")
    return bytes((len(data),)) + data


def _short_or_none(text: object) -> bytes | None:
    if not isinstance(text, str):
        return None
    data = text.encode()
    return bytes((len(data),)) + data if len(data) <= 255 else None


def _content_header(channel: int, p: Basic.Properties, body_size: int) -> bytes | None:
    # pamqp sends a property that is neither None nor "" (cluster_id defaults to "")
    if any(getattr(p, name, None) not in (None, "") for name in _OTHERS):
        return None
    flags = 0
    parts: list[bytes] = []
    if p.content_type not in (None, ""):
        encoded = _short_or_none(p.content_type)
        if encoded is None:
            return None
        flags |= _CONTENT_TYPE
        parts.append(encoded)
    if p.headers is not None:  # an empty table too, as pamqp
        table = _table(p.headers)
        if table is None:
            return None
        flags |= _HEADERS
        parts.append(table)
    for flag, number in ((_DELIVERY_MODE, p.delivery_mode), (_PRIORITY, p.priority)):
        if number is not None:
            if isinstance(number, bool) or not isinstance(number, int) or not 0 <= number <= 255:
                return None
            flags |= flag
            parts.append(bytes((number,)))
    for flag, value in ((_MESSAGE_ID, p.message_id), (_TYPE, p.message_type), (_USER_ID, p.user_id)):
        if value not in (None, ""):
            encoded = _short_or_none(value)
            if encoded is None:
                return None
            flags |= flag
            parts.append(encoded)
    payload = _HEADER_START.pack(60, 0, body_size, flags) + b"".join(parts)
    return _FRAME.pack(2, channel, len(payload)) + payload + _END


def _table(headers: Mapping[str, object]) -> bytes | None:
    """A field table of string keys and string values (``S``, long string), else ``None``."""
    parts: list[bytes] = []
    if not all(isinstance(key, str) and isinstance(value, str) for key, value in headers.items()):
        return None
    for key, value in sorted(headers.items()):  # pamqp's order: sorted by key
        name = key.encode()
        if len(name) > 128:  # pamqp truncates such a key (with a warning): its own encoder does that
            return None
        name = bytes((len(name),)) + name
        data = cast(str, value).encode()  # every value is a str (checked above)
        parts.append(name + b"S" + _LONG.pack(len(data)) + data)
    table = b"".join(parts)
    return _LONG.pack(len(table)) + table
