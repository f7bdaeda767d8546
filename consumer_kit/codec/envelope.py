"""The envelope: broker-level facts about a delivery that a handler may read (never the body).

The header names and how consumer-kit reads them are defined once, in :mod:`consumer_kit.codec.headers`.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from consumer_kit.codec import headers as own
from consumer_kit.errors import DeadLetterReason, InvalidMessage

OPERATION_ID_HEADER = own.OPERATION_ID
TENANT_HEADER = own.TENANT
MESSAGE_TYPE_HEADER = own.MESSAGE_TYPE
CORRELATION_ID_HEADER = own.CORRELATION_ID
PARTITION_KEY_HEADER = own.PARTITION_KEY
OPERATION_CREATED_AT_HEADER = own.OPERATION_CREATED_AT
DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class Envelope:
    """Attributes of one delivery.

    Attributes:
        queue: the queue it came from.
        message_id: broker message id, or ``None``.
        headers: application headers as the broker gave them.
        delivery_count: 1-based count of deliveries of this message (informational).
        correlation_property: the broker's own correlation-id property (AMQP ``correlation_id``,
            Service Bus ``correlation_id``), where the producer set it.
        partition_key: the broker's ordering key (SQS FIFO group, Service Bus session), or ``None``.
        enqueued_at: when the broker accepted the message (aware UTC), where it says.
        sender: the producer as the broker authenticated it (RabbitMQ validated ``user_id``, SQS
            ``SenderId``), ``None`` where the broker gives none: unlike a header, a producer
            cannot choose it (docs/explanation/trust.md).
    """

    queue: str
    message_id: str | None
    headers: Mapping[str, Any]
    delivery_count: int
    correlation_property: str | None = None
    partition_key: str | None = None
    enqueued_at: dt.datetime | None = None
    sender: str | None = None

    def header(self, name: str) -> Any:
        """A header's value (exact name first, then case-insensitive), or ``None``.

        Raises:
            InvalidMessage: ``invalid_header``, naming the header, when consumer-kit's own headers
                of this delivery are invalid (:mod:`consumer_kit.codec.headers`): nothing of such a
                delivery is believed, so nothing of it is read.
        """
        fault = self.header_fault
        if fault is not None:
            raise InvalidMessage(DeadLetterReason.INVALID_HEADER, fault)
        return own.lookup(self.headers, name)

    @property
    def header_fault(self) -> str | None:
        """Why this delivery is ``invalid_header`` (it names the header), or ``None``."""
        return getattr(self.headers, "fault", None)

    @property
    def operation_id(self) -> Any:
        """Header ``operation-id``: the application's operation key, if the producer set one."""
        return self.header(OPERATION_ID_HEADER)

    @property
    def correlation_id(self) -> str | None:
        """The broker's correlation-id property when set, else header ``correlation-id``."""
        if self.correlation_property:
            return self.correlation_property
        spec = own.SPEC_BY_NAME[CORRELATION_ID_HEADER]
        return own.read_text(self.header(CORRELATION_ID_HEADER), spec.max_chars) or None
