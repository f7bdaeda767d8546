"""Headers as NATS message headers, and the header names consumer-kit uses on JetStream.

NATS headers are text (``Name: value`` lines after ``NATS/1.0``): a name is printable ASCII
without ``:`` or whitespace, a value has no CR or LF. consumer-kit's headers are written as they
are; a header NATS cannot carry (a name it does not allow, a value with a line break) travels in
one ``x-consumer-kit-headers`` JSON header, which :func:`headers_of` unpacks again
(:func:`consumer_kit.codec.headers.unpack`), so a handler sees the same headers on every broker.
JetStream's own ``Nats-*`` headers (``Nats-Msg-Id``, ``Nats-Expected-*``) are the publisher's per
message and never copied.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from consumer_kit.codec import headers as ck_headers

MSG_ID = "Nats-Msg-Id"
"""JetStream's de-duplication header: the event ID on a relay publish."""

MESSAGE_ID_HEADER, DELIVERIES_HEADER, REDELIVERED_HEADER, PACKED_HEADER = (
    ck_headers.MESSAGE_ID, ck_headers.DELIVERIES, ck_headers.REDELIVERED, ck_headers.PACKED,
)
DEAD_LETTER_REASON_HEADER, DEAD_LETTER_DETAIL_HEADER, ORIGINAL_QUEUE_HEADER = (
    ck_headers.DEAD_LETTER_REASON, ck_headers.DEAD_LETTER_DETAIL, ck_headers.ORIGINAL_QUEUE,
)
DETAIL_MAX_CHARS = 1000
"""``x-dead-letter-detail`` is cut to this many characters."""

NOT_COPIED = frozenset({DELIVERIES_HEADER, REDELIVERED_HEADER})
"""Set on each copy by consumer-kit itself, never carried over from the delivery it copies."""

_NAME = re.compile(r"^[!-9;-~]{1,256}$")  # printable ASCII without ':' and space


def headers_for(headers: Mapping[Any, Any]) -> dict[str, str]:
    """NATS headers carrying ``headers`` (values as text); the ones NATS cannot carry are packed
    into ``x-consumer-kit-headers`` (module docstring)."""
    plain = {str(k): as_text(v) for k, v in headers.items() if v is not None}
    out: dict[str, str] = {}
    packed: dict[str, str] = {}
    for name, value in plain.items():
        if name == PACKED_HEADER:
            continue
        if _NAME.fullmatch(name) and "\r" not in value and "\n" not in value:
            out[name] = value
        else:
            packed[name] = value
    if packed:
        out[PACKED_HEADER] = ck_headers.pack(packed)
    return out


def headers_of(raw: Mapping[str, Any] | None) -> dict[str, Any]:
    """The headers a received message carries, with the packed header unpacked (a malformed one
    stays as it is: :func:`consumer_kit.codec.headers.read` reports it)."""
    return ck_headers.unpack(dict(raw or {}))


def copy_headers(headers: Mapping[Any, Any]) -> dict[Any, Any]:
    """The headers a copy starts from: the delivery's, without the per-copy ones and JetStream's."""
    return {k: v for k, v in headers.items()
            if k not in NOT_COPIED and not (isinstance(k, str) and k.lower().startswith("nats-"))}


def as_text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value if isinstance(value, str) else str(value)
