"""Headers as SQS message attributes, and the attribute names consumer-kit uses.

SQS allows at most **10 message attributes** per message, each name 1 to 256 characters of
``A-Z a-z 0-9 _ - .`` (not starting with ``AWS.`` or ``Amazon.``, no leading, trailing or doubled
dot) and a non-empty value. Headers are written as ``String`` attributes, consumer-kit's own and
the operation's first (:data:`PRIORITY`); whatever does not fit that way (an eleventh header, a
name SQS does not allow, an empty value) travels in one ``x-consumer-kit-headers`` attribute
holding a JSON object, which :func:`headers_of` unpacks again (:func:`consumer_kit.codec.headers.unpack`;
a malformed one makes the delivery ``invalid_header``), so a handler sees the same headers on
every broker. Their size, against the queue's limit: :mod:`consumer_kit.adapters.sqs.limits`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from consumer_kit.codec import headers as ck_headers
from consumer_kit.codec.envelope import (
    CORRELATION_ID_HEADER,
    MESSAGE_TYPE_HEADER,
    OPERATION_ID_HEADER,
    TENANT_HEADER,
)

MAX_ATTRIBUTES = 10
"""SQS's limit of message attributes per message."""

# consumer-kit's names (consumer_kit.codec.headers), as this package calls them. The message id is the
# stable one (the outbox event ID, or the producer's id) across copies: SQS gives every send a new
# ``MessageId``.
MESSAGE_ID_ATTRIBUTE, DELIVERIES_ATTRIBUTE, REDELIVERED_ATTRIBUTE, PACKED_ATTRIBUTE = (
    ck_headers.MESSAGE_ID, ck_headers.DELIVERIES, ck_headers.REDELIVERED, ck_headers.PACKED,
)
DEAD_LETTER_REASON_ATTRIBUTE, DEAD_LETTER_DETAIL_ATTRIBUTE, ORIGINAL_QUEUE_ATTRIBUTE = (
    ck_headers.DEAD_LETTER_REASON, ck_headers.DEAD_LETTER_DETAIL, ck_headers.ORIGINAL_QUEUE,
)

DETAIL_MAX_CHARS = 1000
"""``x-dead-letter-detail`` is cut to this many characters."""

PRIORITY = (
    ck_headers.SIGNATURE, ck_headers.FIRST_ENQUEUED, DEAD_LETTER_REASON_ATTRIBUTE, MESSAGE_ID_ATTRIBUTE, DELIVERIES_ATTRIBUTE, REDELIVERED_ATTRIBUTE,
    OPERATION_ID_HEADER, TENANT_HEADER, MESSAGE_TYPE_HEADER, CORRELATION_ID_HEADER,
    ORIGINAL_QUEUE_ATTRIBUTE, DEAD_LETTER_DETAIL_ATTRIBUTE,
)
"""Headers that get attributes of their own first (then the rest, smallest first)."""

NOT_COPIED = frozenset({DELIVERIES_ATTRIBUTE, REDELIVERED_ATTRIBUTE})
"""Set on each copy by consumer-kit itself, never carried over from the delivery it copies."""

_NAME = re.compile(r"^[A-Za-z0-9_\-.]{1,256}$")
_STRING = "String"

Attributes = dict[str, dict[str, Any]]
"""``MessageAttributes`` as boto3 takes them: name -> ``{"DataType": ..., "StringValue": ...}``."""


def is_valid_name(name: str) -> bool:
    """True when SQS accepts ``name`` as a message attribute name (module docstring)."""
    return (
        bool(_NAME.fullmatch(name))
        and not name.startswith((".", "AWS.", "Amazon.", "aws.", "amazon."))
        and not name.endswith(".")
        and ".." not in name
    )


def attributes_for(headers: Mapping[str, Any]) -> Attributes:
    """``MessageAttributes`` carrying ``headers`` (values as strings), at most 10 of them; the
    headers that do not fit go into one packed JSON attribute (module docstring)."""
    plain = {str(k): as_text(v) for k, v in headers.items() if v is not None}
    own = [n for n in plain if is_valid_name(n) and plain[n] != "" and n != PACKED_ATTRIBUTE]
    ranked = sorted(own, key=lambda n: (PRIORITY.index(n) if n in PRIORITY else len(PRIORITY), len(plain[n])))
    if len(plain) > len(ranked) or len(ranked) > MAX_ATTRIBUTES:
        separate, packed = ranked[: MAX_ATTRIBUTES - 1], [n for n in plain if n not in ranked[: MAX_ATTRIBUTES - 1]]
    else:
        separate, packed = ranked, []
    attributes: Attributes = {n: {"DataType": _STRING, "StringValue": plain[n]} for n in separate}
    if packed:
        attributes[PACKED_ATTRIBUTE] = {
            "DataType": _STRING,
            "StringValue": ck_headers.pack({n: plain[n] for n in packed}),
        }
    return attributes


def headers_of(attributes: Mapping[str, Mapping[str, Any]] | None) -> dict[str, Any]:
    """The headers a received message carries: each attribute's value (``String``/``Number`` as
    ``str``, ``Binary`` as ``bytes``), with the packed attribute unpacked (a malformed one is kept
    as it is: :func:`consumer_kit.codec.headers.read` reports it)."""
    flat = {name: attribute.get("StringValue", attribute.get("BinaryValue")) for name, attribute in (attributes or {}).items()}
    return ck_headers.unpack(flat)


def copy_headers(headers: Mapping[str, Any]) -> dict[str, Any]:
    """The headers a copy starts from: the delivery's, without the per-copy ones."""
    return {k: v for k, v in headers.items() if k not in NOT_COPIED}


def as_text(value: Any) -> str:
    """A header value as the string an attribute carries (bytes decoded as UTF-8, bad bytes replaced)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value if isinstance(value, str) else str(value)
