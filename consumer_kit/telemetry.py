"""Metrics, spans and log fields. Everything carries ids, never payloads.

Metrics go to OpenTelemetry (a no-op unless the application installs an SDK) and to in-process
counters that ``consumer-kit demo``, the testing kit and health output read.
"""

from __future__ import annotations

import collections
import logging
import traceback
from pathlib import Path
from typing import Any

from opentelemetry import metrics, trace

from consumer_kit.outcomes import DeliveryReport

logger = logging.getLogger("consumer_kit.runtime")
tracer = trace.get_tracer("consumer_kit")
_meter = metrics.get_meter("consumer_kit")

_deliveries = _meter.create_counter(
    "consumer_kit.deliveries", unit="{delivery}",
    description="Deliveries by outcome (executed, duplicate, payload_conflict, in_progress, ...)",
)
_duration = _meter.create_histogram(
    "consumer_kit.delivery.duration", unit="s", description="Time from receipt to settlement"
)

_QUIET = {"executed", "duplicate"}
_LOUD = {"payload_conflict", "invalid", "dead_lettered", "uncertain", "crashed", "lease_recovered"}


class Counters:
    """In-process outcome counters: ``counters["duplicate"]`` etc."""

    def __init__(self) -> None:
        self.by_outcome: collections.Counter[str] = collections.Counter()

    def __getitem__(self, outcome: str) -> int:
        return self.by_outcome[outcome]

    def snapshot(self) -> dict[str, int]:
        return dict(self.by_outcome)


def record(report: DeliveryReport, counters: Counters, operation_type: str | None) -> None:
    """Count and log one delivery report."""
    outcome = report.outcome.value
    counters.by_outcome[outcome] += 1
    attributes: dict[str, Any] = {"outcome": outcome, "queue": report.queue}
    if operation_type:
        attributes["operation_type"] = operation_type
    _deliveries.add(1, attributes)
    _duration.record(report.duration_seconds, attributes)
    level = logging.DEBUG if outcome in _QUIET else logging.WARNING if outcome in _LOUD else logging.INFO
    if logger.isEnabledFor(level):
        logger.log(
            level,
            "delivery outcome=%s settlement=%s queue=%s message_id=%s delivery_count=%s scope=%s "
            "operation_key=%s reason=%s duration_ms=%.1f",
            outcome,
            report.settlement.value if report.settlement else None,
            report.queue,
            report.message_id,
            report.delivery_count,
            report.scope,
            report.operation_key,
            report.reason,
            report.duration_seconds * 1000,
        )


def describe_error(exc: BaseException) -> str:
    """A one-line description of a handler error that names no business values.

    PostgreSQL errors give their SQLSTATE and primary message, which names objects (tables,
    constraints) but not row values (those are in the detail, left out); other errors give their
    class and where they were raised (``file:line in function``), not their message.
    Shape: ``"UndefinedTable [42P01] relation \"invoices\" does not exist"`` or
    ``"KeyError at app.py:42 in handle"``.
    """
    diag = getattr(exc, "diag", None)
    sqlstate = getattr(exc, "sqlstate", None)
    if diag is not None and sqlstate:
        primary = (diag.message_primary or "").strip()
        return f"{type(exc).__name__} [{sqlstate}] {primary}"[:300]
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return type(exc).__name__
    last = frames[-1]
    return f"{type(exc).__name__} at {Path(last.filename).name}:{last.lineno} in {last.name}"
