"""What a log line may hold (docs/explanation/architecture.md, "Logs carry ids": ids, never payloads).

Ids (operation key, scope, message id, event ids, correlation id, downstream request ids),
outcomes, reasons, counts and times; header values only of :data:`LOGGED_HEADERS`; evidence values
only of facts whose name ends in ``_id`` (:data:`EVIDENCE_ID_SUFFIX`). Never a payload, a result
body or another header's value; exception texts appear only as
:func:`~consumer_kit.telemetry.describe.describe_error` descriptions and frames-only tracebacks
(an exception's message may quote the payload).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

LOGGED_HEADERS = frozenset({
    "message-type", "correlation-id", "operation-id", "tenant-id", "event-id", "operation-scope",
    "operation-key", "publish-attempt", "relay-id", "traceparent",
})
"""Headers whose values may appear in logs: ids and routing facts, never business data."""

EVIDENCE_ID_SUFFIX = "_id"
"""Evidence facts logged with their value: names ending in this (``provider_message_id``,
``request_id``); other facts are named only by their evidence record's name."""


def allowed_headers(headers: Mapping[str, Any]) -> dict[str, str]:
    """The headers of :data:`LOGGED_HEADERS` present in ``headers`` (values as text)."""
    found: dict[str, str] = {}
    for name, value in headers.items():
        if isinstance(name, str) and name.lower() in LOGGED_HEADERS:
            found[name.lower()] = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    return found


def evidence_ids(facts: Mapping[str, Any]) -> dict[str, str]:
    """The id facts of an evidence record (names ending in :data:`EVIDENCE_ID_SUFFIX`)."""
    return {k: str(v) for k, v in facts.items() if k.endswith(EVIDENCE_ID_SUFFIX) and v is not None}
