"""Structured logs: one line per settled delivery, a JSON formatter, and what may be logged.

**What a log line may hold** is said in :mod:`consumer_kit.telemetry.loggable`: ids, outcomes,
reasons, counts and times; never a payload, a result body or a header's value outside its list.

**The delivery line** (logger ``consumer_kit.runtime``; DEBUG for ``executed`` and ``duplicate``,
WARNING for outcomes that need a look, INFO for the rest): as text,
``delivery outcome=... settlement=... queue=... message_id=... ... reason=... detail="..."`` (the
detail names what the reason is about: the field of a ``schema_mismatch``, the header of an
``invalid_header``); as JSON
(``--log-format json``), one object with the fields of :data:`DELIVERY_FIELDS`.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from consumer_kit.codec.plain_text import escape_controls, escape_json_controls
from consumer_kit.telemetry.describe import describe_traceback

if TYPE_CHECKING:
    from consumer_kit.model.outcomes import DeliveryReport
    from consumer_kit.telemetry.tracing import DeliveryTrace

FIELDS_ATTRIBUTE = "consumer_kit_fields"
"""The ``LogRecord`` attribute (``extra={FIELDS_ATTRIBUTE: {...}}``) the JSON formatter merges."""

DELIVERY_FIELDS = (
    "event", "outcome", "settlement", "reason", "detail", "queue", "message_id", "delivery_count",
    "redelivered", "operation_type", "scope", "operation_key", "correlation_id", "event_ids",
    "evidence", "duration_ms", "settlement_lost",
)
"""The fields of the JSON delivery line (``event`` is ``"delivery"``)."""

_QUIET = {"executed", "duplicate"}
_LOUD = {"payload_conflict", "invalid", "dead_lettered", "uncertain", "crashed", "lease_recovered",
         "crashed_worker", "lease_lost", "key_expired"}

logger = logging.getLogger("consumer_kit.runtime")


def level_of(outcome: str) -> int:
    """The delivery line's level for ``outcome``."""
    return logging.DEBUG if outcome in _QUIET else logging.WARNING if outcome in _LOUD else logging.INFO


def log_delivery(report: DeliveryReport, notes: DeliveryTrace | None) -> None:
    """Write the delivery line for ``report`` (nothing is built when its level is off)."""
    outcome = report.outcome.value
    level = level_of(outcome)
    if not logger.isEnabledFor(level):
        return
    event_ids = notes.event_ids if notes is not None else []
    evidence = notes.evidence if notes is not None else []
    correlation_id = notes.correlation_id if notes is not None else None
    operation_type = notes.operation_type if notes is not None else ""
    fields = {
        "event": "delivery",
        "outcome": outcome,
        "settlement": report.settlement.value if report.settlement else None,
        "reason": report.reason,
        "detail": report.detail,
        "queue": report.queue,
        "message_id": report.message_id,
        "delivery_count": report.delivery_count,
        "redelivered": report.redelivered,
        "operation_type": operation_type or None,
        "scope": report.scope,
        "operation_key": report.operation_key,
        "correlation_id": correlation_id,
        "event_ids": event_ids,
        "evidence": [{"name": name, **ids} for name, ids in evidence],
        "duration_ms": round(report.duration_seconds * 1000, 1),
        "settlement_lost": report.settlement_lost,
    }
    logger.log(
        level,
        "delivery outcome=%s settlement=%s queue=%s message_id=%s delivery_count=%s scope=%s "
        "operation_key=%s correlation_id=%s event_ids=%s evidence=%s reason=%s detail=%s duration_ms=%.1f",
        outcome, fields["settlement"], report.queue, report.message_id, report.delivery_count,
        report.scope, report.operation_key, correlation_id, ",".join(event_ids) or None,
        ",".join(_evidence_text(name, ids) for name, ids in evidence) or None, report.reason,
        _quoted(report.detail), report.duration_seconds * 1000,
        extra={FIELDS_ATTRIBUTE: fields},
    )


def _quoted(detail: str | None) -> str | None:
    """The detail in double quotes (it holds spaces: ``"amount_cents: int_parsing"``)."""
    return None if not detail else json.dumps(detail, ensure_ascii=False)


def _evidence_text(name: str, ids: Mapping[str, str]) -> str:
    return name + "".join(f"[{k}={v}]" for k, v in ids.items())


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``time`` (UTC, ISO 8601), ``level``, ``logger``, ``pid``,
    ``message`` (the rendered ``%s`` message), the record's structured fields
    (``extra={FIELDS_ATTRIBUTE: {...}}``) and, for a record with an exception, ``exception``: a
    frames-only traceback (:func:`~consumer_kit.telemetry.describe.describe_traceback`), never
    the exception's text."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
            "message": record.getMessage(),
        }
        fields = getattr(record, FIELDS_ATTRIBUTE, None)
        if isinstance(fields, Mapping):
            entry.update(fields)
        if record.exc_info and record.exc_info[1] is not None:
            entry["exception"] = describe_traceback(record.exc_info[1])
        # JSON escapes C0 itself; the rest a terminal acts on (C1, bidi) as \u escapes, same value
        return escape_json_controls(json.dumps(entry, default=str, ensure_ascii=False))


class SafeTextFormatter(logging.Formatter):
    """The text format, with exceptions as frames-only tracebacks (no exception text) and control
    and bidi characters of the line escaped (``\x1b``, ``\u202e``): a message id or key from a
    producer can neither drive the terminal nor split the record into two lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return escape_controls(super().formatMessage(record), double_backslash=False)

    def formatException(self, ei: Any) -> str:
        exc = ei[1] if isinstance(ei, tuple) else None
        return describe_traceback(exc) if exc is not None else ""
