"""The values of consumer-kit's headers, read one by one: each reader returns ``None`` for a bad
value and never raises (the table in :mod:`consumer_kit.codec.headers` says what a bad value does)."""

from __future__ import annotations

import datetime as dt
import json
import unicodedata
from typing import Any

MAX_COUNT = 2**31 - 1
"""The largest count believed (Service Bus and AMQP counts are 32-bit); above it: bad."""
MAX_PACKED_BYTES = 1024 * 1024
"""The largest packed-headers value read (SQS's maximum message size)."""


def read_count(value: Any) -> int | None:
    """A count in ``[0, MAX_COUNT]`` from an ``int`` or ASCII decimal digits (``str``/``bytes``);
    ``None`` for anything else (never raises)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if 0 <= value <= MAX_COUNT else None
    if isinstance(value, bytes | bytearray):
        if len(value) > 10 or not value.isdigit() or not value.isascii():
            return None
        value = value.decode("ascii")
    if isinstance(value, str) and 0 < len(value) <= 10 and value.isascii() and value.isdigit():
        number = int(value)
        return number if number <= MAX_COUNT else None
    return None


def read_flag(value: Any) -> bool | None:
    """``True`` for the mark consumer-kit writes (``1``, ``"1"``, ``b"1"``, ``True``), ``None`` for
    anything else."""
    if value is True or (type(value) is int and value == 1):
        return True
    if type(value) in (str, bytes) and value in ("1", b"1"):
        return True
    return None


def read_text(value: Any, max_chars: int) -> str | None:
    """``str`` or UTF-8 ``bytes`` of at most ``max_chars`` characters without control characters
    or lone surrogates; ``None`` for anything else."""
    if isinstance(value, bytes | bytearray):
        if len(value) > 4 * max_chars:
            return None
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return None
    if not isinstance(value, str) or len(value) > max_chars:
        return None
    if any(unicodedata.category(ch) in ("Cc", "Cs") for ch in value):
        return None
    return value


def read_time(value: Any) -> dt.datetime | None:
    """An aware ``datetime`` from an aware ``datetime`` or ISO 8601 text with an offset (at most
    64 characters); ``None`` for anything else."""
    if isinstance(value, dt.datetime):
        return value if value.tzinfo is not None else None
    text = read_text(value, 64)
    if text is None:
        return None
    try:
        parsed = dt.datetime.fromisoformat(text)
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else None


def read_packed(value: Any) -> dict[str, str] | None:
    """The headers packed in ``x-consumer-kit-headers``: a JSON object of text values (at most
    :data:`MAX_PACKED_BYTES`); ``None`` for anything else, however deep or large."""
    if isinstance(value, bytes | bytearray):
        value = bytes(value).decode("utf-8", "replace")
    if not isinstance(value, str) or len(value) > MAX_PACKED_BYTES or not value.startswith("{"):
        return None
    try:
        loaded = json.loads(value)
    except (ValueError, RecursionError):  # RecursionError: nested thousands of levels deep
        return None
    if not isinstance(loaded, dict) or not all(isinstance(v, str) for v in loaded.values()):
        return None
    return loaded
