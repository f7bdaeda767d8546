"""The broker contract: what the runtime needs from any queue (deliveries in, settlement, the
consuming side), and the dead-letter queues of ``consumer-kit dlq``. The relay's side is
:mod:`consumer_kit.broker.publishing`; finding the adapter for a URL is
:mod:`consumer_kit.broker.registry`; what several adapters share is :mod:`consumer_kit.broker.kit`.

Adapters import the contract from here (docs/explanation/architecture.md, "The adapter shape").
"""

from consumer_kit.broker.consumer import Consumer, hand_over
from consumer_kit.broker.dead_letters import (
    DeadLetter,
    DeadLetterQueues,
    RedriveProgress,
    RedriveReport,
    header_count,
    header_text,
)
from consumer_kit.broker.delivery import (
    AckGroup,
    Delivery,
    DeliveryCallback,
    Settlement,
    ack_all,
    build_delivery,
    first_enqueue_time,
    sender_across_copies,
)

__all__ = [
    "AckGroup", "Consumer", "DeadLetter", "DeadLetterQueues", "Delivery",
    "DeliveryCallback", "RedriveProgress", "RedriveReport", "Settlement", "ack_all", "build_delivery",
    "first_enqueue_time", "hand_over", "header_count", "header_text", "sender_across_copies",
]
