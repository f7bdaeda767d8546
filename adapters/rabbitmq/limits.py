"""Size checks made before every publish, so one message can never close a shared connection.

RabbitMQ enforces two limits on a published message:

* the **frame**: properties and headers travel in one content-header frame, which must fit the
  connection's negotiated ``frame_max`` (131,072 bytes by default). A larger frame is a protocol
  error that closes the *whole connection* (``FRAME_ERROR``), with every delivery and publish on it.
  The body is split over as many frames as it needs, so only properties and headers count here.
* the **message size**: a body above the broker's ``max_message_size`` (RabbitMQ 3.10 default:
  128 MiB) closes the publishing *channel* (``PRECONDITION_FAILED``).

:func:`check_fits` measures the exact encoded content-header frame (pamqp's own encoder, the
one aiormq sends with) and the body, and raises :class:`Unsendable` instead of sending.
:func:`fit_headers` trims headers that are neither consumer-kit's nor the operation's from a
copy (largest first) until it fits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pamqp.frame
from aiormq.abc import AbstractChannel
from pamqp.commands import Basic
from pamqp.header import ContentHeader

from consumer_kit.broker.publishing import OutgoingMessage
from consumer_kit.errors import PublishError

from .confirms import Publish
from .envelope import TRIMMED_HEADER, is_kept
from .errors import Unsendable

DEFAULT_MAX_MESSAGE_SIZE = 128 * 1024 * 1024
"""Bytes: RabbitMQ 3.10's default ``max_message_size``."""


def frame_max_of(channel: AbstractChannel) -> int:
    """The ``frame_max`` (bytes) negotiated by the connection ``channel`` belongs to; 0 = no limit."""
    return int(channel.connection.connection_tune.frame_max or 0)


def header_frame_size(properties: Basic.Properties, body_size: int) -> int:
    """Bytes of the content-header frame that carries ``properties`` (frame header, class id,
    weight, body size, property flags and values, frame end).

    Raises:
        Unsendable: a header value cannot be encoded as an AMQP field.
    """
    try:
        return len(pamqp.frame.marshal(ContentHeader(body_size=body_size, properties=properties), 1))
    except (TypeError, ValueError, OverflowError) as exc:
        raise Unsendable(f"headers cannot be encoded as AMQP fields: {exc}") from exc


def check_fits(
    properties: Basic.Properties, body_size: int, *, frame_max: int, max_message_size: int
) -> None:
    """Raise :class:`Unsendable` when the message would break ``frame_max`` (bytes, 0 = none) or
    ``max_message_size`` (bytes)."""
    if body_size > max_message_size:
        raise Unsendable(
            f"body of {body_size} bytes exceeds the maximum message size of "
            f"{max_message_size} bytes",
            size=body_size, limit=max_message_size,
        )
    if not frame_max:
        return
    bound = _header_frame_bound(properties)
    if bound is not None and bound <= frame_max:
        return  # fits for sure: no need to encode the frame twice
    size = header_frame_size(properties, body_size)
    if size > frame_max:
        raise Unsendable(
            f"properties and headers need a {size}-byte frame; the connection's frame_max is "
            f"{frame_max} bytes",
            size=size, limit=frame_max,
        )


# Bytes of a content-header frame besides its property values: frame type, channel, size (7),
# class id, weight, body size, property flags (14), frame end (1).
_HEADER_FRAME_FIXED = 22
_SHORT_STRING_PROPERTIES = (
    "content_type", "content_encoding", "correlation_id", "reply_to", "expiration", "message_id",
    "message_type", "user_id", "app_id", "cluster_id",
)


def _header_frame_bound(properties: Basic.Properties) -> int | None:
    """An upper bound (bytes) on :func:`header_frame_size` when every header is a string of a
    string and every short-string property fits its 255 bytes, else ``None`` (measure it).
    Strings are the common case (the relay's headers are), and the bound costs a fraction of
    encoding the frame (pamqp's encoder was 8 % of the relay's CPU in a drain profile)."""
    size = _HEADER_FRAME_FIXED + 1 + 1 + 8  # delivery mode, priority, timestamp
    for name in _SHORT_STRING_PROPERTIES:
        value = getattr(properties, name, None)
        if value is None:
            continue
        if not isinstance(value, str):
            return None
        length = len(value.encode())
        if length > 255:
            return None
        size += 1 + length
    headers = properties.headers
    if headers:
        size += 4  # the table's length
        for key, value in headers.items():
            if not (isinstance(key, str) and isinstance(value, str)):
                return None
            key_length = len(key.encode())
            if key_length > 255:
                return None
            size += 1 + key_length + 1 + 4 + len(value.encode())  # short-string key, 'S', long string
    return size


def fit_headers(
    headers: Mapping[str, Any],
    properties_for: Callable[[dict[str, Any]], Basic.Properties],
    body_size: int,
    *,
    frame_max: int,
    max_message_size: int,
) -> tuple[Basic.Properties, list[str]]:
    """The properties of a copy with ``headers`` that fit the frame, and the names of the headers
    left out to make it fit (largest first; never consumer-kit's own nor the operation headers,
    see :func:`consumer_kit.adapters.rabbitmq.envelope.is_kept`). A trimmed copy says how many it lost in
    ``x-consumer-kit-trimmed-headers``.

    Raises:
        Unsendable: it does not fit even with only the kept headers, or the body is too large.
    """
    current = dict(headers)
    trimmable = sorted(
        (name for name in current if not is_kept(name)),
        key=lambda name: len(repr(current[name])),
        reverse=True,
    )
    trimmed: list[str] = []
    while True:
        properties = properties_for(current)
        try:
            check_fits(properties, body_size, frame_max=frame_max, max_message_size=max_message_size)
            return properties, trimmed
        except Unsendable as exc:
            frame_too_small = bool(frame_max) and exc.limit == frame_max
            if not frame_too_small or not trimmable:
                raise
        name = trimmable.pop(0)
        del current[name]
        trimmed.append(name)
        current[TRIMMED_HEADER] = len(trimmed)


def prepare(
    message: OutgoingMessage, properties: Basic.Properties, *, frame_max: int, max_message_size: int,
) -> Publish | PublishError:
    """``message`` with its ``properties`` as :func:`~consumer_kit.adapters.rabbitmq.confirms.send`
    takes it, or the permanent error of one that can never be published as it is (a name over 255
    bytes, headers over ``frame_max`` or a body over ``max_message_size``, bytes): never sent."""
    if len(message.routing_key.encode()) > 255 or len(message.destination.encode()) > 255:
        return PublishError(
            f"message_id={message.message_id} cannot be published: an exchange name or routing "
            "key is at most 255 bytes",
            permanent=True,
        )
    try:
        check_fits(properties, len(message.body), frame_max=frame_max, max_message_size=max_message_size)
    except Unsendable as exc:
        return PublishError(
            f"message_id={message.message_id} to {message.destination!r} cannot be published: {exc}",
            permanent=True,
        )
    return message.destination, message.routing_key, properties, message.body

