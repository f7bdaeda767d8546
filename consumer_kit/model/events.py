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


@dataclass(frozen=True)
class WatchedEvent:
    """One message seen on an event destination by ``consumer-kit watch`` (a temporary tap).

    ``headers`` are the message's headers as the broker carries them (values as text); ``body``
    the raw bytes (untrusted: printed only with ``--show-body``, escaped).
    """

    destination: str
    routing_key: str
    message_id: str | None
    message_type: str | None
    headers: dict[str, str]
    body: bytes
