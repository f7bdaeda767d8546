"""The envelope: broker-level facts about a delivery that a handler may read (never the body)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

OPERATION_ID_HEADER = "operation-id"
TENANT_HEADER = "tenant-id"
MESSAGE_TYPE_HEADER = "message-type"
CORRELATION_ID_HEADER = "correlation-id"
DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class Envelope:
    """Attributes of one delivery.

    Attributes:
        queue: the queue it came from.
        message_id: broker message id, or ``None``.
        headers: application headers as the broker gave them.
        delivery_count: 1-based count of deliveries of this message.
    """

    queue: str
    message_id: str | None
    headers: Mapping[str, Any]
    delivery_count: int

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
        value = self.header(CORRELATION_ID_HEADER)
        return value if isinstance(value, str) else None
