"""The headers consumer-kit reads and writes on RabbitMQ messages, and the delivery count they give.

Delivery count (``Delivery.delivery_count``)::

    delivery_count = earlier_copies + this_copy
    earlier_copies = int(headers["x-consumer-kit-deliveries"])        (0 when absent)
    this_copy      = headers["x-delivery-count"] + 1   on a quorum queue (absent on the 1st delivery)
                   = 2 if redelivered else 1           on a classic queue (a lower bound)

A copy consumer-kit republishes (retry, release, dead-letter) is a new message for the broker,
whose own count restarts, so the copy carries the deliveries before it in
``x-consumer-kit-deliveries``; the broker-owned ``x-delivery-count`` is never copied.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from consumer_kit.envelope import (
    CORRELATION_ID_HEADER,
    MESSAGE_TYPE_HEADER,
    OPERATION_ID_HEADER,
    TENANT_HEADER,
)

DELIVERIES_HEADER = "x-consumer-kit-deliveries"
"""On a republished copy: how many deliveries the message had before this copy."""

REDELIVERED_HEADER = "x-consumer-kit-redelivered"
"""On a released copy of a delivery that was itself a redelivery: the copy stays a suspect."""

TRIMMED_HEADER = "x-consumer-kit-trimmed-headers"
"""On a copy that only fitted the frame without some of the original's headers: how many."""

DEAD_LETTER_REASON_HEADER = "x-dead-letter-reason"
DEAD_LETTER_DETAIL_HEADER = "x-dead-letter-detail"
ORIGINAL_QUEUE_HEADER = "x-original-queue"
BROKER_COUNT_HEADER = "x-delivery-count"

DETAIL_MAX_CHARS = 1000
"""``x-dead-letter-detail`` is cut to this many characters (it is ours, and must fit a frame)."""

OPERATION_HEADERS = frozenset(
    {OPERATION_ID_HEADER, TENANT_HEADER, MESSAGE_TYPE_HEADER, CORRELATION_ID_HEADER}
)
"""Headers that define the operation: never trimmed from a copy."""

# Set on a copy by consumer-kit itself, never carried over from the delivery it copies: a quorum
# queue would read a copied x-delivery-count as its own, and a retry is never a suspect.
_NOT_COPIED = frozenset({BROKER_COUNT_HEADER, REDELIVERED_HEADER, TRIMMED_HEADER})


def delivery_count_of(headers: Mapping[str, Any], redelivered: bool) -> int:
    """The 1-based delivery count of a RabbitMQ delivery (formula in the module docstring);
    ``redelivered`` is the broker's own flag."""
    earlier = _as_int(headers.get(DELIVERIES_HEADER))
    broker_count = headers.get(BROKER_COUNT_HEADER)
    if broker_count is not None:
        this_copy = _as_int(broker_count) + 1
    else:
        this_copy = 2 if redelivered else 1
    return earlier + this_copy


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


def _as_int(value: Any) -> int:
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    try:
        return max(0, int(value))
    except (TypeError, ValueError):
        return 0
