"""An event a handler published, on its way to the outbox (written by :mod:`consumer_kit.outbox`)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PendingEvent:
    """An event a handler published, written to the outbox with the ledger's completion.

    ``payload`` and ``headers`` are JSON text, serialised when the handler called ``publish`` so
    that an unserialisable event fails there, in the handler, not at COMMIT time.
    """

    event_id: uuid.UUID
    destination: str
    routing_key: str
    message_type: str
    partition_key: str | None
    payload: str
    headers: str


@dataclass(frozen=True)
class OutboxEvent:
    """An outbox row as written (read back by :func:`consumer_kit.outbox.outbox_events`).

    ``payload`` and ``headers`` are the decoded JSON; ``operation_key`` is the key of the operation
    whose completion wrote the row (``None`` for rows written outside a handler);
    ``published`` says whether a relay has published it yet.
    """

    event_id: uuid.UUID
    destination: str
    routing_key: str
    message_type: str
    partition_key: str | None
    payload: Any
    headers: dict[str, Any]
    operation_key: str | None
    published: bool
