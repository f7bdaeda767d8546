"""The names of consumer-kit's own headers and the table of their types and limits
(:mod:`consumer_kit.codec.headers` documents each, reads them and re-exports these names)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DELIVERIES = "x-consumer-kit-deliveries"
"""On a republished copy: how many deliveries the message had before this copy."""
REDELIVERED = "x-consumer-kit-redelivered"
"""On a released copy of a delivery that was itself a redelivery: the copy stays a suspect."""
MESSAGE_ID = "x-consumer-kit-message-id"
"""On a copy: the message id of the original (brokers give a copy an id of its own)."""
PACKED = "x-consumer-kit-headers"
"""A JSON object of the headers that did not fit as attributes of their own (SQS)."""
REDRIVEN = "x-consumer-kit-redriven"
"""On a redriven copy: the dead-letter reason it had, for the record."""
TRIMMED = "x-consumer-kit-trimmed-headers"
"""On a copy that only fitted the frame without some of the original's headers: how many."""
DEAD_LETTER_REASON = "x-dead-letter-reason"
DEAD_LETTER_DETAIL = "x-dead-letter-detail"
ORIGINAL_QUEUE = "x-original-queue"
FIRST_ENQUEUED = "x-consumer-kit-first-enqueued"
"""On a copy: the broker's enqueue time of the operation's first copy (decides key expiry)."""
SIGNATURE = "x-consumer-kit-mac"
"""The HMAC over the marks of a copy (:mod:`consumer_kit.codec.marks`)."""
SENDER = "x-consumer-kit-sender"
"""On a copy: the authenticated sender of the message it copies (``""``: none), not the copier's."""
BROKER_COUNT = "x-delivery-count"
"""RabbitMQ's own delivery count (quorum queues)."""

OPERATION_ID = "operation-id"
TENANT = "tenant-id"
MESSAGE_TYPE = "message-type"
CORRELATION_ID = "correlation-id"
PARTITION_KEY = "partition-key"
OPERATION_CREATED_AT = "operation-created-at"


@dataclass(frozen=True)
class Spec:
    """One header consumer-kit reads: its ``name``, ``kind`` (``count``, ``flag``, ``text``,
    ``time``, ``packed``), ``max_chars`` (text), and whether a bad value is ``invalid``
    (dead-lettered ``invalid_header``) or ignored."""

    name: str
    kind: str
    invalid: bool
    max_chars: int = 0


SPECS: tuple[Spec, ...] = (
    Spec(DELIVERIES, "count", invalid=False),
    Spec(REDELIVERED, "flag", invalid=False),
    Spec(BROKER_COUNT, "count", invalid=False),
    Spec(MESSAGE_ID, "text", invalid=True, max_chars=512),
    Spec(PACKED, "packed", invalid=True),
    Spec(REDRIVEN, "text", invalid=False, max_chars=1024),
    Spec(TRIMMED, "count", invalid=False),
    Spec(DEAD_LETTER_REASON, "text", invalid=False, max_chars=1024),
    Spec(DEAD_LETTER_DETAIL, "text", invalid=False, max_chars=4096),
    Spec(ORIGINAL_QUEUE, "text", invalid=False, max_chars=1024),
    Spec(FIRST_ENQUEUED, "time", invalid=False, max_chars=64),
    Spec(SIGNATURE, "text", invalid=False, max_chars=64),
    Spec(SENDER, "text", invalid=False, max_chars=255),
    Spec(TENANT, "text", invalid=True, max_chars=200),
    Spec(MESSAGE_TYPE, "text", invalid=True, max_chars=256),
    Spec(OPERATION_CREATED_AT, "time", invalid=True, max_chars=64),
    Spec(PARTITION_KEY, "text", invalid=True, max_chars=512),
    Spec(CORRELATION_ID, "text", invalid=False, max_chars=256),
)
"""Every header of the table in the module docstring that this codec checks (``operation-id`` is
the decoder's)."""

SPEC_BY_NAME = {spec.name: spec for spec in SPECS}

MARKS = frozenset({DELIVERIES, REDELIVERED, MESSAGE_ID, REDRIVEN, TRIMMED, FIRST_ENQUEUED, SENDER,
                   DEAD_LETTER_REASON, DEAD_LETTER_DETAIL, ORIGINAL_QUEUE})
"""consumer-kit's bookkeeping on a message: believed only under a valid :data:`SIGNATURE`."""


def lookup(headers: Mapping[Any, Any], name: str) -> Any:
    """A header's value: the exact ``name`` first, else the first name equal ignoring case;
    ``None`` when absent. Names that are not ``str`` never match."""
    if name in headers:
        return headers[name]
    lowered = name.lower()
    for key, value in headers.items():
        if isinstance(key, str) and key.lower() == lowered:
            return value
    return None


_SPEC_BY_LOWER = {spec.name.lower(): spec.name for spec in SPECS}


def own_values(headers: Mapping[Any, Any]) -> dict[str, Any]:
    """The values of the headers in :data:`SPECS`, by their names, found as :func:`lookup` finds
    them (the exact name first, else the first equal ignoring case), in one pass."""
    found: dict[str, Any] = {}
    exact: set[str] = set()
    for key, value in headers.items():
        if not isinstance(key, str):
            continue
        name = _SPEC_BY_LOWER.get(key.lower())
        if name is None or name in exact:
            continue
        if key == name:
            found[name] = value
            exact.add(name)
        elif name not in found:
            found[name] = value
    return found
