"""The headers consumer-kit reads and writes on RabbitMQ messages, and the delivery count they give.

Delivery count (``Delivery.delivery_count``)::

    delivery_count = earlier_copies + this_copy
    earlier_copies = int(headers["x-consumer-kit-deliveries"])        (0 when absent)
    this_copy      = headers["x-delivery-count"] + 1   on a quorum queue (absent on the 1st delivery)
                   = 2 if redelivered else 1           on a classic queue (a lower bound)

Both counts are read by consumer-kit's one codec (:func:`consumer_kit.codec.headers.read`): a value that
is not a count in range (a double, 2^63 as text, a nested array) is ignored, never believed.

A copy consumer-kit republishes (retry, release, dead-letter) is a new message for the broker,
whose own count restarts, so the copy carries the deliveries before it in
``x-consumer-kit-deliveries``; the broker-owned ``x-delivery-count`` is never copied.

Sender (``Delivery.sender``): the AMQP ``user_id`` property, which RabbitMQ validates against the
publishing connection's user ("Validated User-ID": a publish naming another user is refused, unless
that user has the ``impersonator`` tag). A copy is published by the worker, so it carries the
worker's own user in ``user_id`` and the original sender in ``x-consumer-kit-sender`` (``""`` for
none, so that a copy of an anonymous message is not taken for the worker's own). That header is a
signed mark (its signature also covers the operation's identity): it is believed on whichever user
published the copy (the worker's, or the operator's for a ``dlq redrive``), and a producer cannot
write one (docs/explanation/trust.md).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import aio_pika
from pamqp.commands import Basic

from consumer_kit.broker.delivery import sender_across_copies
from consumer_kit.broker.publishing import OutgoingMessage, headers_to_send
from consumer_kit.codec import headers as own
from consumer_kit.codec.envelope import (
    CORRELATION_ID_HEADER,
    MESSAGE_TYPE_HEADER,
    OPERATION_ID_HEADER,
    TENANT_HEADER,
)
from consumer_kit.codec.headers import OwnHeaders

# consumer-kit's names (consumer_kit.codec.headers), as this package calls them.
DELIVERIES_HEADER, REDELIVERED_HEADER, TRIMMED_HEADER, BROKER_COUNT_HEADER = (
    own.DELIVERIES, own.REDELIVERED, own.TRIMMED, own.BROKER_COUNT,
)
DEAD_LETTER_REASON_HEADER, DEAD_LETTER_DETAIL_HEADER, ORIGINAL_QUEUE_HEADER = (
    own.DEAD_LETTER_REASON, own.DEAD_LETTER_DETAIL, own.ORIGINAL_QUEUE,
)

DETAIL_MAX_CHARS = 1000
"""``x-dead-letter-detail`` is cut to this many characters (it is ours, and must fit a frame)."""

OPERATION_HEADERS = frozenset(
    {OPERATION_ID_HEADER, TENANT_HEADER, MESSAGE_TYPE_HEADER, CORRELATION_ID_HEADER}
)
"""Headers that define the operation: never trimmed from a copy."""

# Set on a copy by consumer-kit itself, never carried over from the delivery it copies: a quorum
# queue would read a copied x-delivery-count as its own, and a retry is never a suspect.
SENDER_HEADER = own.SENDER
"""On a copy consumer-kit made: the sender of the message it copies (see the module docstring)."""

_NOT_COPIED = frozenset({BROKER_COUNT_HEADER, REDELIVERED_HEADER, TRIMMED_HEADER, SENDER_HEADER})


def delivery_count_of(headers: Mapping[str, Any] | OwnHeaders, redelivered: bool) -> int:
    """The 1-based delivery count of a RabbitMQ delivery (formula in the module docstring) from
    its headers or their reading (:func:`consumer_kit.codec.headers.read`: a malformed count is
    ignored); ``redelivered`` is the broker's own flag."""
    reading = headers if isinstance(headers, OwnHeaders) else own.read(headers)
    if reading.broker_count is not None:
        this_copy = reading.broker_count + 1
    else:
        this_copy = 2 if redelivered else 1
    return reading.deliveries_before + this_copy


def copy_headers(headers: Mapping[str, Any]) -> dict[str, Any]:
    """The headers a republished copy starts from: the delivery's, minus broker-owned and
    per-copy ones."""
    return {k: v for k, v in headers.items() if k not in _NOT_COPIED}


def is_kept(name: str) -> bool:
    """True for headers a copy never loses to make it fit a frame: consumer-kit's own
    (``x-consumer-kit-*``, ``x-dead-letter-*``, ``x-original-queue``) and the operation headers."""
    return (
        name.startswith(("x-consumer-kit-", "x-dead-letter-"))
        or name == ORIGINAL_QUEUE_HEADER
        or name in OPERATION_HEADERS
    )



def own_user_of(channel: Any) -> str | None:
    """The user the worker's connection (of ``channel``, an aiormq channel) authenticated as:
    :func:`user_of_url` of its URL; ``None`` where it cannot tell."""
    url = getattr(getattr(channel, "connection", None), "url", None)
    return None if url is None else user_of_url(str(url))


@functools.lru_cache(maxsize=64)  # one URL per connection: parsed once, not per delivery
def user_of_url(url: str) -> str | None:
    """The user an AMQP URL authenticates as (PLAIN: its user, aiormq's default ``guest``), or
    ``None`` where the URL does not say (``auth=external``: a client certificate)."""
    parts = urlsplit(url)
    if parse_qs(parts.query).get("auth", ["plain"])[-1].lower() != "plain":
        return None
    return unquote(parts.username) if parts.username else "guest"


def sender_of(user_id: str | None, headers: Mapping[str, Any]) -> str | None:
    """The authenticated sender of a delivery whose ``headers`` the codec has verified: the signed
    ``x-consumer-kit-sender`` a copy carries (``""``: the copied message had none), whoever
    published the copy (the worker, or an operator's redrive), else its validated ``user_id``.
    ``None``: no authenticated sender."""
    return sender_across_copies(headers, user_id or None)


def properties_of(message: OutgoingMessage, *, user_id: str | None = None) -> Basic.Properties:
    """The AMQP properties the publisher sends ``message`` with (persistent; ``message_id``,
    ``type`` and header ``message-type``; ``content_type``; ``user_id``: the publisher's own user,
    which RabbitMQ validates, ``None`` for none; headers: :func:`~consumer_kit.broker.publishing.headers_to_send`)."""
    # Built directly, as aio_pika.Message(...).properties would build them (priority 0 included),
    # without a Message per publish (7 % of the relay's CPU in a drain profile).
    return Basic.Properties(
        content_type=message.content_type,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        headers=headers_to_send(message),
        message_id=message.message_id,
        message_type=message.message_type,
        priority=0,
        user_id=user_id,
    )
