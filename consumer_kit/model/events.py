"""An event a handler published, on its way to the outbox (written by :mod:`consumer_kit.outbox`)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass


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
