"""What the AMQP library may decode: a field table nested too deeply is never decoded.

pamqp (under aio-pika) decodes a message's ``headers`` table recursively, copying the rest of the
frame at every level, inside the connection's frame reader. A table of arrays nested some
thousands of levels deep (a producer can send one) raises ``RecursionError`` there, before any
consumer-kit code runs, and the reader's failure closes the **whole connection**: every delivery
on it goes back, and the message returns and does it again, until the broker's delivery limit.
One message must never close a connection that other deliveries share
(docs/explanation/faults-and-attempts.md).

:func:`install` wraps pamqp's decoder of top-level tables (content-header properties such as
``headers``, and method arguments) with a depth check that walks the encoded bytes without
recursion. In a table nested deeper than :data:`MAX_DEPTH` levels, each value too deep is skipped
whole (its length prefix says how long it is) and read as :data:`UNDECODED`; the other headers
decode as before, and so does every table within the limit. The delivery then follows
consumer-kit's header rules (a bookkeeping count is ignored, an operation header makes it
``invalid_header`` naming the header); the connection stays.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from pamqp import decode

MAX_DEPTH = 64
"""Levels of nested tables and arrays a header table may have (the table itself is level 1)."""

UNDECODED = (f"not decoded: nested deeper than {MAX_DEPTH} levels",)
"""What a header value nested too deeply reads as (an array of one text): not a count, a flag
or a text, so consumer-kit's codec treats it as a value of the wrong type, by the header's rule
(:mod:`consumer_kit.codec.headers`: ignored, or ``invalid_header`` naming the header)."""

# Encoded sizes of the AMQP 0-9-1 field values that hold no others (pamqp's TABLE_MAPPING).
_FIXED = {
    b"t": 1, b"b": 1, b"B": 1, b"s": 2, b"u": 2, b"I": 4, b"i": 4, b"f": 4, b"l": 8, b"L": 8,
    b"d": 8, b"T": 8, b"D": 5, b"V": 0, b"\x00": 0,
}
_LENGTH_PREFIXED = frozenset({b"S", b"x"})
_CONTAINERS = frozenset({b"A", b"F"})
_U32 = struct.Struct(">I")


def nesting_depth(data: bytes, limit: int, start: int = 0, *, value: bool = False) -> int:
    """Levels of nesting of the field table encoded at ``data[start:]`` (with ``value``: of the
    field value there, type byte first; 0 for one that holds no others), counted up to
    ``limit + 1`` (then it stops looking), without recursion. A malformed encoding counts what
    it read so far: pamqp's own decoder then refuses it as it always did."""
    stack: list[tuple[bool, int]] = []  # (is a table, where it ends)
    pos, deepest = start, 0
    try:
        if value:
            if data[pos : pos + 1] not in _CONTAINERS:
                return 0
            is_table = data[pos : pos + 1] == b"F"
            pos += 1
        else:
            is_table = True
        stack.append((is_table, pos + 4 + _U32.unpack_from(data, pos)[0]))
        pos, deepest = pos + 4, 1
        while stack:
            is_table, container_end = stack[-1]
            if pos >= container_end:
                stack.pop()
                continue
            if is_table:
                pos += 1 + data[pos]  # the key: one length byte, then the name
            kind = data[pos : pos + 1]
            pos += 1
            if kind in _FIXED:
                pos += _FIXED[kind]
            elif kind in _LENGTH_PREFIXED:
                pos += 4 + _U32.unpack_from(data, pos)[0]
            elif kind in _CONTAINERS:
                stack.append((kind == b"F", pos + 4 + _U32.unpack_from(data, pos)[0]))
                pos += 4
                deepest = max(deepest, len(stack))
                if deepest > limit:
                    return deepest
            else:
                return deepest
    except (IndexError, struct.error):
        return deepest
    return deepest


def _guarded(table: Callable[[bytes], tuple[int, Any]]) -> Callable[[bytes], tuple[int, Any]]:
    def field_table(data: bytes) -> tuple[int, Any]:
        if len(data) < 4 or nesting_depth(data, MAX_DEPTH) <= MAX_DEPTH:
            return table(data)
        # Decode entry by entry; a value too deep is skipped whole (its length prefix says how
        # long it is) and replaced by UNDECODED, whatever the header.
        end = 4 + _U32.unpack_from(data, 0)[0]
        pos = 4
        decoded: dict[str, Any] = {}
        while pos < end:
            key_length = data[pos]
            key = data[pos + 1 : pos + 1 + key_length].decode("utf-8", "replace")
            pos += 1 + key_length
            if nesting_depth(data, MAX_DEPTH - 1, pos, value=True) > MAX_DEPTH - 1:
                decoded[key] = list(UNDECODED)
                pos += 5 + _U32.unpack_from(data, pos + 1)[0]
            else:
                consumed, decoded[key] = decode.embedded_value(data[pos:])
                pos += consumed
        return end, decoded

    field_table.__wrapped__ = table  # type: ignore[attr-defined]
    return field_table


def install() -> None:
    """Put the depth check in front of pamqp's top-level table decoder (idempotent; nested
    tables are decoded by the original through pamqp's own mapping)."""
    current = decode.METHODS["table"]
    if getattr(current, "__wrapped__", None) is None:
        decode.METHODS["table"] = _guarded(current)
