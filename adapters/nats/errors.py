"""What a NATS failure means: one-line descriptions, outages, PublishError kinds.

Classification of a failed publish (``consumer_kit.broker.publishing.PublishError``):

==========================================================  ==========  ==========================
cause                                                       kind        why
==========================================================  ==========  ==========================
larger than ``max_payload`` or the stream's ``max_msg_size``  permanent   the same bytes fail the
(checked before sending; JetStream's 10054), a subject NATS              same way every time
refuses, a JetStream ``BadRequest`` (400)
no stream for the subject (``NoStreamResponseError``, no    row         it may be created later
responders)
no publish ack in time, connection lost or reconnecting,    transient   the server or the network
a JetStream 503                                                         is at fault; retry soon
==========================================================  ==========  ==========================
"""

from __future__ import annotations

import asyncio

import nats.errors
from nats.js import errors as js_errors

from consumer_kit.errors import PublishError


class CopyDropped(Exception):
    """JetStream answered a copy consumer-kit made (release, dead-letter, retry, redrive) with
    ``duplicate: true``: not stored. Its id is random, so someone else published under it."""


MESSAGE_TOO_LARGE = 10054
"""JetStream's error code for a message over the stream's ``max_msg_size``."""


def describe(exc: BaseException | None) -> str:
    """``"ErrorClass: first line"`` (JetStream API errors: code and description), one line."""
    if exc is None:
        return "unknown error"
    if isinstance(exc, js_errors.APIError):
        return f"{type(exc).__name__}: {exc.err_code} {str(exc.description or '')[:200]}"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def is_unreachable(exc: BaseException) -> bool:
    """True when NATS gave no answer (connection lost, reconnecting, closed, timeout)."""
    return isinstance(exc, (
        ConnectionError, OSError, asyncio.TimeoutError, nats.errors.TimeoutError, nats.errors.NoServersError,
        nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError,
        nats.errors.StaleConnectionError, nats.errors.ConnectionDrainingError,
        js_errors.ServiceUnavailableError,
    ))


def publish_error(exc: BaseException, message_id: str, subject: str) -> PublishError:
    """The :class:`PublishError` for ``exc``, raised publishing ``message_id`` on ``subject``
    (table in the module docstring)."""
    if isinstance(exc, PublishError):
        return exc
    if isinstance(exc, (js_errors.NoStreamResponseError, nats.errors.NoRespondersError)):
        return PublishError(f"no JetStream stream takes subject {subject!r} for message_id={message_id}",
                            transient=False)
    if isinstance(exc, js_errors.APIError) and (
        exc.err_code == MESSAGE_TOO_LARGE or isinstance(exc, js_errors.BadRequestError)
    ):
        return PublishError(f"JetStream refused message_id={message_id} on {subject!r}: {describe(exc)}",
                            permanent=True)
    if isinstance(exc, (nats.errors.BadSubjectError, nats.errors.MaxPayloadError, nats.errors.BadHeaderError)):
        return PublishError(f"NATS refused message_id={message_id} on {subject!r}: {describe(exc)}", permanent=True)
    return PublishError(f"publish of message_id={message_id} on {subject!r} not confirmed: {describe(exc)}")
