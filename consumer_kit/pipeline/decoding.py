"""Steps 2 and 3 of a delivery: pick the handler, validate the body, compute the operation identity.

Everything here is a pure function of the delivery: an invalid one raises
:class:`~consumer_kit.errors.InvalidMessage` with the specific dead-letter reason, and nothing has
touched the database yet.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, TypeAlias

from pydantic import ValidationError

from consumer_kit.app import App
from consumer_kit.codec import strict_json
from consumer_kit.codec.envelope import (
    MESSAGE_TYPE_HEADER,
    OPERATION_CREATED_AT_HEADER,
    OPERATION_ID_HEADER,
    TENANT_HEADER,
    Envelope,
)
from consumer_kit.errors import DeadLetterReason, InvalidMessage, UnsupportedNumber
from consumer_kit.handler import Handler
from consumer_kit.identity import MAX_TENANT_BYTES, normalize_key
from consumer_kit.model.decoded import Decoded
from consumer_kit.model.identity import OperationIdentity

DecodedDelivery: TypeAlias = Decoded[Handler[Any]]
"""A delivery decoded for one of the app's handlers: what the pipeline runs."""

MAX_BODY_BYTES = 4 * 1024 * 1024  # a larger body is dead-lettered as invalid_json before parsing


def decode(app: App, queue: str, body: bytes, envelope: Envelope) -> DecodedDelivery:
    """Route, parse and validate ``body`` and compute scope, key and fingerprint.

    Raises:
        InvalidMessage: with the specific dead-letter reason (``invalid_json``, ``invalid_number``,
            ``schema_mismatch``, ``missing_operation_key``, ``invalid_operation_key``,
            ``invalid_header``, ``unknown_message_type``).
        Exception: whatever a handler's own hook raised (``operation_key``, ``tenant``,
            ``partition_key``, ``projection``): the runtime counts it as a handler fault.
    """
    if envelope.header_fault is not None:  # consumer-kit's own headers are invalid: believe nothing
        raise InvalidMessage(DeadLetterReason.INVALID_HEADER, envelope.header_fault)
    handler = route(app, queue, envelope)
    if len(body) > MAX_BODY_BYTES:
        raise InvalidMessage(
            DeadLetterReason.INVALID_JSON, f"body is {len(body)} bytes (max {MAX_BODY_BYTES})"
        )
    raw = strict_json.loads(body)  # RFC 8259 with one meaning, or invalid_json / invalid_number
    try:
        message = handler.model.model_validate(raw)
    except ValidationError as exc:
        raise InvalidMessage(DeadLetterReason.SCHEMA_MISMATCH, describe_validation(exc)) from None
    key = normalize_key(handler.operation_key(message, envelope), what=_key_source(handler))
    try:
        tenant = normalize_key(handler.tenant(message, envelope), what=_tenant_source(handler),
                               max_bytes=MAX_TENANT_BYTES)
    except InvalidMessage as exc:  # the tenant comes from a header: report it as one
        raise InvalidMessage(DeadLetterReason.INVALID_HEADER, exc.detail) from None
    if "/" in tenant:  # the scope "<tenant>/<operation_type>/v<n>" must read one way only
        raise InvalidMessage(DeadLetterReason.INVALID_HEADER, "tenant-id contains '/'")
    handler.refuse_tenant(tenant, envelope)  # the allow-list: before any claim, so no key is taken
    try:
        message_fingerprint = handler.fingerprint_under(message, handler.projection_version)
    except UnsupportedNumber as exc:  # e.g. "NaN" or "1E+5000" in a string, read as a number
        raise InvalidMessage(DeadLetterReason.INVALID_NUMBER, str(exc)) from None
    except UnicodeEncodeError:  # a surrogate a validator produced: not Unicode (RFC 8259 8.2)
        raise InvalidMessage(DeadLetterReason.INVALID_JSON, "a value holds a lone surrogate") from None
    except RecursionError:  # strict JSON reads ~1000 levels; the canonical form recurses deeper
        raise InvalidMessage(DeadLetterReason.INVALID_JSON, "a value is nested too deeply to fingerprint") from None
    assert message_fingerprint is not None  # the current version is always known
    identity = OperationIdentity(
        tenant=tenant,
        operation_type=handler.operation_type,
        version=handler.version,
        key=key,
        fingerprint=message_fingerprint,
        projection_version=handler.projection_version,
    )
    return DecodedDelivery(
        handler, message, identity, handler.partition_key(message, envelope), operation_time(envelope)
    )


CLOCK_SKEW_SECONDS = 60.0
"""How far in the future an ``operation-created-at`` may lie (producers' clocks drift): beyond it,
``invalid_header``."""


def operation_time(envelope: Envelope) -> dt.datetime | None:
    """When the operation was created, the time that decides key expiry: the envelope's
    ``enqueued_at`` (the runtime passes the operation's earliest trustworthy enqueue time,
    :func:`consumer_kit.broker.first_enqueue_time`), made earlier (never later) by a header
    ``operation-created-at`` (ISO 8601 with an offset, e.g. ``2026-11-30T12:00:00Z``); ``None``
    when neither is known.

    Raises:
        InvalidMessage: ``invalid_header`` naming ``operation-created-at`` for a header that is not
            such a time, or one more than :data:`CLOCK_SKEW_SECONDS` in the future.
    """
    value = envelope.header(OPERATION_CREATED_AT_HEADER)
    if value is None:
        return envelope.enqueued_at
    if isinstance(value, bytes):
        value = value.decode("utf-8", errors="replace")
    if isinstance(value, dt.datetime):  # an AMQP timestamp header
        parsed: dt.datetime | None = value
    else:
        try:
            parsed = dt.datetime.fromisoformat(str(value))
        except ValueError:
            parsed = None
    if parsed is None or parsed.tzinfo is None:
        raise InvalidMessage(
            DeadLetterReason.INVALID_HEADER,
            f"{OPERATION_CREATED_AT_HEADER} must be an ISO 8601 time with an offset (e.g. 2026-11-30T12:00:00Z)",
        )
    if (parsed - dt.datetime.now(dt.UTC)).total_seconds() > CLOCK_SKEW_SECONDS:
        raise InvalidMessage(
            DeadLetterReason.INVALID_HEADER,
            f"{OPERATION_CREATED_AT_HEADER} is {parsed.isoformat()}, more than {CLOCK_SKEW_SECONDS:.0f} s in the future",
        )
    return parsed if envelope.enqueued_at is None else min(parsed, envelope.enqueued_at)


def route(app: App, queue: str, envelope: Envelope) -> Handler[Any]:
    """The handler of ``queue`` for the delivery's ``message-type`` header (the only handler of
    the queue when the header is absent).

    Raises:
        InvalidMessage: ``invalid_header`` or ``unknown_message_type``.
    """
    handlers = app.routes.get(queue, {})
    wanted = envelope.header(MESSAGE_TYPE_HEADER)
    if wanted is None and len(handlers) == 1:
        return next(iter(handlers.values()))
    if isinstance(wanted, bytes):
        wanted = wanted.decode("utf-8", errors="replace")
    if not isinstance(wanted, str) and wanted is not None:
        raise InvalidMessage(DeadLetterReason.INVALID_HEADER, "message-type must be a string")
    handler = handlers.get(wanted) if wanted is not None else None
    if handler is None:
        raise InvalidMessage(
            DeadLetterReason.UNKNOWN_MESSAGE_TYPE,
            f"no handler on queue {queue!r} for message-type {str(wanted)[:100]!r}",
        )
    return handler


def describe_validation(exc: ValidationError) -> str:
    """Field locations and error types only: pydantic's default text would echo payload values."""
    parts = [
        f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['type']}"
        for err in exc.errors(include_url=False, include_input=False, include_context=False)[:10]
    ]
    return "; ".join(parts)


def _key_source(handler: Handler[Any]) -> str:
    """How to name the key in an error: where it comes from when the handler does not say."""
    if type(handler).operation_key is Handler.operation_key:
        return f"operation key (header {OPERATION_ID_HEADER!r})"
    return f"operation key of {type(handler).__name__}"


def _tenant_source(handler: Handler[Any]) -> str:
    """How to name the tenant in an error: the header it comes from unless the handler says."""
    if type(handler).tenant is Handler.tenant:
        return f"tenant (header {TENANT_HEADER!r})"
    return f"tenant of {type(handler).__name__}"
