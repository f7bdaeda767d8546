"""The envelope: broker-level facts about a delivery that a handler may read (never the body)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

OPERATION_ID_HEADER = "operation-id"
TENANT_HEADER = "tenant-id"
MESSAGE_TYPE_HEADER = "message-type"
CORRELATION_ID_HEADER = "correlation-id"
PARTITION_KEY_HEADER = "partition-key"
OPERATION_CREATED_AT_HEADER = "operation-created-at"
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
    """

    queue: str
    message_id: str | None
    headers: Mapping[str, Any]
    delivery_count: int
    correlation_property: str | None = None
    partition_key: str | None = None
    enqueued_at: dt.datetime | None = None

    def header(self, name: str) -> Any:
        """A header's value (case-insensitive name), or ``None``."""
        if name in self.headers:
            return self.headers[name]
        lowered = name.lower()
        for key, value in self.headers.items():
            if isinstance(key, str) and key.lower() == lowered:
                return value
        return None

    @property
    def operation_id(self) -> Any:
        """Header ``operation-id``: the application's operation key, if the producer set one."""
        return self.header(OPERATION_ID_HEADER)

    @property
    def correlation_id(self) -> str | None:
        """The broker's correlation-id property when set, else header ``correlation-id``."""
        if self.correlation_property:
            return self.correlation_property
        value = self.header(CORRELATION_ID_HEADER)
        return value if isinstance(value, str) and value else None
