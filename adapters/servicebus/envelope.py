"""Message fields consumer-kit reads and writes on Service Bus, and the messages it builds.

Received messages: ``headers`` are the application properties with ``str`` names and text values
(the SDK hands both over as ``bytes``); ``body`` is the data sections joined (an AMQP value body is
taken as text); the delivery count and message id follow the formulas below.

Application properties of consumer-kit's own:

=================================  ================================================================
property                           meaning
=================================  ================================================================
``x-consumer-kit-deliveries``      on a copy (a delayed retry, a release): the deliveries of the
                                   message before the copy (the copy's own count starts again at 0
                                   on the broker; a release copy does not count the released one)
``x-consumer-kit-message-id``      on a copy: the message id of the original (the copy has a new
                                   one, see :func:`copy_of`)
``x-consumer-kit-redelivered``     on a release copy of a suspect: the copy is a suspect too (a
                                   suspect stays a suspect)
``x-consumer-kit-redriven``        on a redriven copy (``consumer-kit dlq redrive``): the dead-letter
                                   reason it had, for the record (the runtime ignores it)
=================================  ================================================================

Service Bus's own, on a dead letter: ``DeadLetterReason`` and ``DeadLetterErrorDescription`` (what
``dead_letter_message(reason, error_description)`` set, or Service Bus's reason such as
``MaxDeliveryCountExceeded``).

Delivery count: ``x-consumer-kit-deliveries + delivery_count + 1`` (the SDK's ``delivery_count`` is
0 on the first delivery). What each property may hold, and what a malformed one does, is
consumer-kit's one definition (:mod:`consumer_kit.codec.headers`). Published events: see
:func:`outgoing_message`.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import re
import uuid
from collections.abc import Mapping
from typing import Any

from azure.servicebus import ServiceBusMessage, ServiceBusReceivedMessage
from azure.servicebus.amqp import AmqpMessageBodyType

from consumer_kit.broker.publishing import OutgoingMessage, headers_to_send
from consumer_kit.codec import headers as own
from consumer_kit.codec.envelope import CORRELATION_ID_HEADER
from consumer_kit.codec.headers import OwnHeaders

logger = logging.getLogger(__name__)

# consumer-kit's names (consumer_kit.codec.headers), under this package's names.
DELIVERIES_PROPERTY = own.DELIVERIES
ORIGINAL_MESSAGE_ID_PROPERTY = own.MESSAGE_ID
REDELIVERED_PROPERTY = own.REDELIVERED
REDRIVEN_PROPERTY = own.REDRIVEN
DEAD_LETTER_REASON_PROPERTY = "DeadLetterReason"
DEAD_LETTER_DESCRIPTION_PROPERTY = "DeadLetterErrorDescription"

_NOT_REDRIVEN = frozenset({
    DEAD_LETTER_REASON_PROPERTY, DEAD_LETTER_DESCRIPTION_PROPERTY, DELIVERIES_PROPERTY, REDELIVERED_PROPERTY,
    ORIGINAL_MESSAGE_ID_PROPERTY, REDRIVEN_PROPERTY,
})

DEAD_LETTER_REASON_MAX_CHARS = 1024
DEAD_LETTER_DESCRIPTION_MAX_CHARS = 4096
"""Service Bus keeps the dead-letter reason and description as message properties, which count
toward the message's size: both are cut to these lengths (characters)."""

DEAD_LETTER_PROPERTY_BYTES = 64
"""Bytes the two dead-letter property names and their encoding add, besides the two texts."""


def fit_dead_letter(
    reason: str, description: str, room: int | None, *, header_room: int | None = None
) -> tuple[str, str]:
    """``reason`` and ``description`` cut to their maximum lengths and, when ``room`` (bytes left
    for the two) is known, the description cut further to what fits beside the reason. The reason,
    the machine-readable part, is cut only to ``header_room`` (bytes Service Bus's header limit
    leaves: a hard limit), when not even it fits there."""
    reason = reason[:DEAD_LETTER_REASON_MAX_CHARS]
    description = description[:DEAD_LETTER_DESCRIPTION_MAX_CHARS]
    if header_room is not None and len(reason.encode("utf-8")) > header_room - DEAD_LETTER_PROPERTY_BYTES:
        cut = max(0, header_room - DEAD_LETTER_PROPERTY_BYTES)
        return reason.encode("utf-8")[:cut].decode("utf-8", errors="ignore"), ""
    if room is None:
        return reason, description
    left = room - DEAD_LETTER_PROPERTY_BYTES - len(reason.encode("utf-8"))
    encoded = description.encode("utf-8")
    if len(encoded) <= left:
        return reason, description
    return reason, encoded[: max(0, left)].decode("utf-8", errors="ignore")


def headers_of(message: ServiceBusReceivedMessage) -> dict[str, Any]:
    """The application properties as ``{str: value}``: names decoded as UTF-8 (bad bytes
    replaced), ``bytes`` values decoded as UTF-8 text where they are UTF-8 (else kept as
    ``bytes``, for :func:`consumer_kit.codec.headers.read` to judge).

    Trace context: producers on older Azure SDKs send only ``Diagnostic-Id`` (W3C traceparent
    format), no ``traceparent``. As azure-servicebus reads it (``_common/tracing.py``:
    ``traceparent``, else ``Diagnostic-Id``), a well-formed ``Diagnostic-Id`` stands in for a
    missing ``traceparent``; any other form (the old hierarchical ``Request-Id`` ``|a.b.``) is
    ignored."""
    properties = message.application_properties or {}
    headers = {_name(name): _value(value) for name, value in properties.items()}
    names = {name.lower(): name for name in headers if isinstance(name, str)}
    if "traceparent" not in names and DIAGNOSTIC_ID_PROPERTY.lower() in names:
        diagnostic = headers[names[DIAGNOSTIC_ID_PROPERTY.lower()]]
        if isinstance(diagnostic, str) and _TRACEPARENT.fullmatch(diagnostic.strip()):
            headers["traceparent"] = diagnostic.strip()
    return headers


DIAGNOSTIC_ID_PROPERTY = "Diagnostic-Id"
"""The trace property older Azure SDKs send instead of ``traceparent`` (same W3C format)."""

# W3C Trace Context "traceparent": version-traceid-parentid-flags, lower-case hex, not all zero
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")


def body_of(message: ServiceBusReceivedMessage) -> bytes:
    """The body as bytes: data sections joined; a value body as UTF-8 text (JSON for non-text)."""
    if message.body_type == AmqpMessageBodyType.DATA:
        return b"".join(message.body)
    value = message.body
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    return json.dumps(value, default=str).encode("utf-8")


def delivery_count_of(message: ServiceBusReceivedMessage, headers: Mapping[str, Any] | OwnHeaders) -> int:
    """1 on the first delivery: ``x-consumer-kit-deliveries`` (retry copies; a malformed one is
    ignored) plus the broker's ``delivery_count`` plus one; ``headers`` as :func:`headers_of`
    gives them, or their reading (:func:`consumer_kit.codec.headers.read`)."""
    return _reading(headers).deliveries_before + (message.delivery_count or 0) + 1


def message_id_of(message: ServiceBusReceivedMessage, headers: Mapping[str, Any] | OwnHeaders) -> str | None:
    """The original message id (a retry copy carries it in ``x-consumer-kit-message-id``)."""
    return _reading(headers).message_id or message.message_id


def _reading(headers: Mapping[str, Any] | OwnHeaders) -> OwnHeaders:
    return headers if isinstance(headers, OwnHeaders) else own.read(headers)


def copy_of(
    message: ServiceBusReceivedMessage, headers: Mapping[str, Any], body: bytes, *,
    deliveries_before: int, message_id: str | None, suspect: bool, time_to_live: dt.timedelta | None = None,
) -> ServiceBusMessage:
    """A copy of ``message`` to send back in its place (a delayed retry, a release): same body and
    properties, a new message id (duplicate detection must not drop it as a repeat of the
    original), ``deliveries_before`` and the original id in consumer-kit's properties, the
    suspect mark only when ``suspect``, and ``time_to_live`` when given (what is left of the
    original's, so that a copy never outlives it; else the original's own)."""
    properties: dict[str | bytes, Any] = {k: v for k, v in headers.items() if k != REDELIVERED_PROPERTY}
    properties[DELIVERIES_PROPERTY] = deliveries_before
    if message_id is not None:
        properties[ORIGINAL_MESSAGE_ID_PROPERTY] = message_id
    if suspect:
        properties[REDELIVERED_PROPERTY] = 1
    own.seal(properties, body)  # consumer-kit's marks on every copy, signed
    return _resent(message, body, properties, message_id=str(uuid.uuid4()), time_to_live=time_to_live)


def redrive_copy_of(
    message: ServiceBusReceivedMessage, headers: Mapping[str, Any], body: bytes, *,
    copy_id: str, message_id: str | None, reason: str | None,
) -> ServiceBusMessage:
    """A copy of the dead letter ``message`` to send back to its queue (``consumer-kit dlq redrive``).

    Same body, session id, correlation id, subject, content type and application properties
    (operation id, message type, trace context, ...), **without** the dead-letter properties
    (``DeadLetterReason``, ``DeadLetterErrorDescription``) and consumer-kit's delivery-count and
    suspect marks (its delivery count starts again at 1). ``message_id`` (the id consumer-kit saw)
    goes in ``x-consumer-kit-message-id``; the copy's own id is ``copy_id``, never the original's:
    an entity with duplicate detection would drop a copy sent under an id it saw within its window,
    and the dead letter would then be completed with nothing sent. ``reason`` (the dead letter's,
    ``None`` to leave it out) goes in ``x-consumer-kit-redriven``.

    Raises:
        ValueError, TypeError: the SDK cannot build it.
    """
    properties: dict[str | bytes, Any] = {k: v for k, v in headers.items() if k not in _NOT_REDRIVEN}
    if message_id is not None:
        properties[ORIGINAL_MESSAGE_ID_PROPERTY] = message_id
    if reason is not None:
        properties[REDRIVEN_PROPERTY] = reason
    own.seal(properties, body)
    return _resent(message, body, properties, message_id=copy_id, session_id=message.session_id)


def as_sent(message: ServiceBusReceivedMessage, headers: Mapping[str, Any], body: bytes) -> ServiceBusMessage:
    """``message`` rebuilt as its producer sent it (same id, properties and body): what measuring
    its size needs."""
    return _resent(message, body, dict(headers.items()), message_id=message.message_id)


def _resent(
    message: ServiceBusReceivedMessage, body: bytes, properties: dict[str | bytes, Any], *, message_id: str | None,
    session_id: str | None = None, time_to_live: dt.timedelta | None = None,
) -> ServiceBusMessage:
    # The SDK refuses a partition key that differs from the session id.
    partition_key = message.partition_key if session_id is None or message.partition_key == session_id else None
    return ServiceBusMessage(
        body,
        application_properties=properties,
        message_id=message_id,
        session_id=session_id,
        content_type=message.content_type,
        correlation_id=message.correlation_id,
        subject=message.subject,
        partition_key=partition_key,
        to=message.to,
        reply_to=message.reply_to,
        reply_to_session_id=message.reply_to_session_id,
        time_to_live=message.time_to_live if time_to_live is None else time_to_live,
    )


def outgoing_message(message: OutgoingMessage) -> ServiceBusMessage:
    """The Service Bus message for a relay event: ``message_id`` = event id (the entity's duplicate
    detection, where enabled, drops a repeat), ``session_id`` = partition key, ``subject`` = routing
    key (what subscription filters match, like a RabbitMQ routing key), ``correlation_id`` from the
    ``correlation-id`` header, and application properties = the headers (message type, causing
    operation, trace context) plus ``message-type``.

    Raises:
        ValueError, TypeError: the SDK cannot build it (e.g. a property value of an unknown type).
    """
    properties: dict[str | bytes, Any] = dict(headers_to_send(message).items())
    return ServiceBusMessage(
        message.body,
        application_properties=properties,
        message_id=message.message_id,
        session_id=message.partition_key,
        subject=message.routing_key or None,
        content_type=message.content_type,
        correlation_id=message.headers.get(CORRELATION_ID_HEADER),
    )


def schedule_time(delay: float) -> dt.datetime:
    """The UTC time ``delay`` seconds from now (when a scheduled copy becomes receivable)."""
    return dt.datetime.now(dt.UTC) + dt.timedelta(seconds=delay)



def _name(name: Any) -> Any:
    return name.decode("utf-8", errors="replace") if isinstance(name, bytes) else name


def _value(value: Any) -> Any:
    if not isinstance(value, bytes):
        return value
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return value
