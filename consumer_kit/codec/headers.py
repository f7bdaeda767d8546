"""consumer-kit's own headers and properties: their one definition and the one codec that reads them.

A message is untrusted input, its headers included (docs/explanation/trust.md). Every header consumer-kit
itself reads is listed here once, with its type, its range and what a bad value does. A value is
*bad* when it has the wrong type, is out of range (negative, a count above :data:`MAX_COUNT`,
2^63 as an int, a float or text), is non-finite, nested (a list or map, however deep), longer
than its limit (a 1 MB string), or undecodable bytes. A bad value is never believed and never
raises: it is either

* **ignored** and counted (:data:`IGNORED`, by header name; logged at INFO): bookkeeping
  consumer-kit can do without; the delivery runs as if the header were absent, or
* **invalid_header**: the delivery is dead-lettered with reason ``invalid_header`` and a detail
  naming the header; it never reaches a handler. The fault travels with the delivery's headers
  (:class:`Headers`): the first read of its :class:`~consumer_kit.codec.envelope.Envelope`, which is the
  decoder picking a handler, raises :class:`~consumer_kit.errors.InvalidMessage`, so the runtime
  dead-letters and reports it like any invalid message.

=================================  =======  ================  =========================================
header                             type     bad value         why
=================================  =======  ================  =========================================
``x-consumer-kit-deliveries``      count    ignored (0)       informational (the ledger's attempt count
                                                              decides dead-lettering); absent = first copy
``x-consumer-kit-redelivered``     flag 1   ignored (absent)  a suspect mark; absent is what a producer
                                                              gets by leaving it out anyway
``x-delivery-count``               count    ignored (absent)  the broker's own count (RabbitMQ quorum);
                                                              without it the ``redelivered`` flag counts
``x-consumer-kit-message-id``      text     invalid_header    it is the message id (and, for handlers
                                  <= 512                      keyed by message id, the operation key):
                                                              falling back to the copy's new broker id
                                                              would run a retry copy as a new operation
``x-consumer-kit-headers``         JSON     invalid_header    the packed headers (SQS) may carry
                                  object                      ``operation-id`` and ``tenant-id``: without
                                  of text                     them the operation's identity would change
``x-consumer-kit-redriven``        text     ignored           for the record only (``dlq redrive``)
``x-consumer-kit-trimmed-headers`` count    ignored           for the record only (RabbitMQ copies)
``x-dead-letter-reason``           text     ignored           read by operator tools only, as text
``x-dead-letter-detail``           text     ignored           read by operator tools only, as text
``x-original-queue``               text     ignored           read by ``dlq redrive`` only (the DLQ side)
``x-consumer-kit-first-enqueued``  ISO      ignored           the operation's first enqueue time (key
                                  8601+tz                     expiry); absent: this copy's broker time
``x-consumer-kit-mac``             text     ignored           authenticates the marks (below)
``x-consumer-kit-sender``          text     ignored           on a copy: the original's sender (tenancy);
                                  <= 255                      absent: the broker's sender of this copy
``operation-id``                   text     (the decoder's)   the operation key: missing or empty is
                                                              ``missing_operation_key``, anything else bad
                                                              ``invalid_operation_key`` (the hostile
                                                              corpus pins both); the decoder never raises
                                                              on any value, so nothing is checked here
``tenant-id``                      text     invalid_header    part of the operation's scope
                                  <= 200
``message-type``                   text     invalid_header    picks the handler
                                  <= 256
``operation-created-at``           ISO      invalid_header    decides key expiry
                                  8601+tz
``partition-key``                  text     invalid_header    ordering was asked for: never run
                                  <= 512                      unordered on an unreadable key
``correlation-id``                 text     ignored (None)    logs and spans only
                                  <= 256
=================================  =======  ================  =========================================

**Marks** (:data:`MARKS`: the ``x-consumer-kit-*`` bookkeeping, ``x-dead-letter-*`` and
``x-original-queue``) are believed only when ``x-consumer-kit-mac`` authenticates them
(:mod:`consumer_kit.codec.marks`: one HMAC over the good marks and the body's digest). Unauthenticated
marks are all removed from the delivery's headers, as if absent, and counted (:data:`UNVERIFIED`);
a message without marks costs no HMAC. Every copy consumer-kit writes is signed by :func:`seal`.

Accepted encodings, as the brokers hand them over: a count is an ``int`` (not ``bool``) or ASCII
decimal digits as ``str``/``bytes`` (SQS and Service Bus carry text); text is ``str`` or UTF-8
``bytes``, without control characters or lone surrogates; a time is ISO 8601 with an offset or an
aware ``datetime`` (an AMQP timestamp). Names are matched as :meth:`Envelope.header` matches them
(exact first, then case-insensitive).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from consumer_kit.codec.header_names import (
    BROKER_COUNT,
    CORRELATION_ID,
    DEAD_LETTER_DETAIL,
    DEAD_LETTER_REASON,
    DELIVERIES,
    FIRST_ENQUEUED,
    MARKS,
    MESSAGE_ID,
    MESSAGE_TYPE,
    OPERATION_CREATED_AT,
    OPERATION_ID,
    ORIGINAL_QUEUE,
    PACKED,
    PARTITION_KEY,
    REDELIVERED,
    REDRIVEN,
    SENDER,
    SIGNATURE,
    SPEC_BY_NAME,
    SPECS,
    TENANT,
    TRIMMED,
    Spec,
    lookup,
    own_values,
)
from consumer_kit.codec.header_values import (
    MAX_COUNT,
    read_count,
    read_flag,
    read_packed,
    read_text,
    read_time,
)
from consumer_kit.codec.sealing import (
    IDENTITY,
    UNVERIFIED,
    drop_unverified,
    identity_of,
    seal,
    seal_new,
    without_marks,
)

# the value readers are the codec's public API too (consumer_kit.codec.header_values holds them)
__all__ = [
    "BROKER_COUNT", "CORRELATION_ID", "DEAD_LETTER_DETAIL", "DEAD_LETTER_REASON", "DELIVERIES",
    "FIRST_ENQUEUED", "IGNORED", "MARKS", "MAX_COUNT", "MESSAGE_ID", "MESSAGE_TYPE", "OPERATION_CREATED_AT",
    "OPERATION_ID", "ORIGINAL_QUEUE", "PACKED", "PARTITION_KEY", "REDELIVERED", "REDRIVEN", "SENDER", "SIGNATURE",
    "SPECS", "SPEC_BY_NAME", "TENANT", "TRIMMED", "UNVERIFIED", "Headers", "OwnHeaders", "Spec",
    "IDENTITY", "identity_of", "is_valid", "lookup", "pack", "read", "read_count", "read_flag", "read_packed", "read_text",
    "read_time", "seal", "seal_new", "unpack", "without_marks",
]

logger = logging.getLogger("consumer_kit.headers")

IGNORED: Counter[str] = Counter()
"""Bad values ignored since the process started, by header name (the operator's counter)."""


# -- values ----------------------------------------------------------------------------------------


def pack(headers: Mapping[str, str]) -> str:
    """The value of ``x-consumer-kit-headers`` carrying ``headers`` (what :func:`read_packed` reads)."""
    return json.dumps(dict(headers), separators=(",", ":"))


def is_valid(spec: Spec, value: Any) -> bool:
    """Whether ``value`` is a good value of the header ``spec`` describes (never raises)."""
    if spec.kind == "count":
        return read_count(value) is not None
    if spec.kind == "flag":
        return read_flag(value) is not None
    if spec.kind == "time":
        return read_time(value) is not None
    if spec.kind == "packed":
        return read_packed(value) is not None
    return read_text(value, spec.max_chars) is not None


# -- one delivery's headers ------------------------------------------------------------------------


class Headers(dict[Any, Any]):
    """A delivery's application headers as :func:`read` gives them: a ``dict``, plus ``fault``
    (``None``, or the detail of the ``invalid_header`` dead-letter they make, naming the header)."""

    fault: str | None = None


@dataclass(frozen=True)
class OwnHeaders:
    """What consumer-kit reads from one message's headers (:func:`read`).

    Attributes:
        headers: the application headers, with ``x-consumer-kit-headers`` unpacked (the message's
            own headers win over packed ones of the same name), carrying ``fault``.
        deliveries_before: ``x-consumer-kit-deliveries``, 0 when absent or ignored.
        broker_count: ``x-delivery-count``, ``None`` when absent or ignored.
        suspect: ``x-consumer-kit-redelivered`` is set.
        message_id: ``x-consumer-kit-message-id``, ``None`` when absent.
        fault: ``None``, or the detail of an ``invalid_header`` dead-letter (it names the header).
        ignored: the names of headers whose bad value was ignored.
    """

    headers: Headers
    deliveries_before: int = 0
    broker_count: int | None = None
    suspect: bool = False
    message_id: str | None = None
    fault: str | None = None
    ignored: tuple[str, ...] = field(default=())


def read(raw: Mapping[Any, Any], body: bytes | None = None) -> OwnHeaders:
    """Read consumer-kit's headers from ``raw`` (as the adapter mapped them) of a message with
    ``body`` by the table in the module docstring; marks without a valid signature over them and
    ``body`` are dropped (``None``: none can be verified). Never raises: a failure of its own
    becomes a ``fault``."""
    try:
        return _read(raw, body)
    except Exception as exc:  # noqa: BLE001 - the codec must never stop a receive loop
        logger.error("reading headers failed (%s): the delivery is invalid_header", type(exc).__name__)
        try:
            headers = Headers(raw)
        except Exception:  # noqa: BLE001 - not even a copy: the delivery is dead-lettered as it is
            headers = Headers()
        headers.fault = f"headers could not be read ({type(exc).__name__})"
        return OwnHeaders(headers=headers, fault=headers.fault)


def unpack(raw: Mapping[Any, Any]) -> dict[Any, Any]:
    """``raw`` with a good ``x-consumer-kit-headers`` unpacked into it (the message's own headers
    win over packed ones of the same name); a bad one stays as it is, for :func:`read` to report.
    Never raises."""
    headers: dict[Any, Any] = dict(raw)
    packed = read_packed(headers.get(PACKED))
    if packed is None:
        return headers
    del headers[PACKED]
    return {**packed, **headers}


def _read(raw: Mapping[Any, Any], body: bytes | None) -> OwnHeaders:
    headers = Headers(unpack(raw))
    own = own_values(headers)
    drop_unverified(headers, own, body)
    fault: str | None = None
    ignored: list[str] = []
    if PACKED in own:
        fault = f"header {PACKED} is not a JSON object of text values"
    for name, value in own.items():
        spec = SPEC_BY_NAME[name]
        if spec.kind == "packed" or value is None or is_valid(spec, value):
            continue
        if spec.invalid:
            fault = fault or f"header {spec.name} is not a valid {_describe(spec)}"
        else:
            ignored.append(spec.name)
            IGNORED[spec.name] += 1
    if ignored:
        logger.info("ignored malformed header(s) %s", ",".join(ignored))
    headers.fault = fault
    message_id = read_text(own.get(MESSAGE_ID), 512)
    return OwnHeaders(
        headers=headers,
        deliveries_before=read_count(own.get(DELIVERIES)) or 0,
        broker_count=read_count(own.get(BROKER_COUNT)),
        suspect=read_flag(own.get(REDELIVERED)) is True,
        message_id=message_id or None,
        fault=fault,
        ignored=tuple(ignored),
    )


def _describe(spec: Spec) -> str:
    if spec.kind == "count":
        return f"count (0 to {MAX_COUNT})"
    if spec.kind == "time":
        return "ISO 8601 time with an offset"
    return f"text of at most {spec.max_chars} characters"
