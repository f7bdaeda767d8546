"""What ``consumer-kit dlq`` shows of one message of a Service Bus dead-letter sub-queue (rules in
:mod:`consumer_kit.adapters.servicebus.dead_letters`, "What a dead letter shows")."""

from __future__ import annotations

from typing import Any

from azure.servicebus import ServiceBusReceivedMessage

from consumer_kit.broker import DeadLetter
from consumer_kit.codec import headers as own
from consumer_kit.codec.envelope import OPERATION_ID_HEADER

from .envelope import DELIVERIES_PROPERTY, body_of, headers_of, message_id_of

SERVICE_BUS_REASONS = frozenset({
    "MaxDeliveryCountExceeded", "TTLExpiredException", "HeaderSizeExceeded", "MaxTransferHopCountExceeded",
    "Session id is null",
})
"""``DeadLetterReason`` values Service Bus sets when it moves a message itself (listed as
``broker:<reason>``)."""


def dead_letter_of(message: ServiceBusReceivedMessage, queue: str) -> DeadLetter:
    """What ``consumer-kit dlq list`` shows of one message of ``queue``'s dead-letter sub-queue
    (reason, delivery count and times as in the module docstring).

    Args:
        message: a message peeked or received from the dead-letter sub-queue.
        queue: the queue or subscription as asked for.
    """
    # Only consumer-kit's signed marks are believed (deliveries, original message id).
    reading = own.read(headers_of(message), body_of(message))
    headers = dict(reading.headers)
    reason = message.dead_letter_reason or ""
    by_service_bus = reason in SERVICE_BUS_REASONS
    operation_key = headers.get(OPERATION_ID_HEADER)
    return DeadLetter(
        queue=queue,
        message_id=message_id_of(message, reading),
        reason=f"broker:{reason}" if by_service_bus else reason or "unknown",
        detail=message.dead_letter_error_description or "",
        delivery_count=_count(headers.get(DELIVERIES_PROPERTY)) + (message.delivery_count or 0)
        + (0 if by_service_bus else 1),
        dead_lettered_at=None,
        enqueued_at=message.enqueued_time_utc,
        operation_key=str(operation_key) if operation_key else None,
        headers=headers,
        body=body_of(message),
    )


def _count(value: Any) -> int:
    try:
        return max(0, int(value)) if value is not None else 0
    except (TypeError, ValueError):
        return 0
