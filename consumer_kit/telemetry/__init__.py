"""Metrics, spans and logs. Everything carries ids, never payloads.

The library uses the OpenTelemetry **API** only (a no-op until the application installs an SDK);
the command-line programs install the SDK when asked (:mod:`consumer_kit.telemetry.setup`). One
module per job:

=================  ===============================================================================
module             job
=================  ===============================================================================
``metrics``        the metric catalogue (names, units, attributes) and the calls that record them
``tracing``        the delivery's CONSUMER span and its steps, the relay's PRODUCER span
``trace_context``  trace context through messages and the outbox (W3C headers read and stored)
``logs``           the delivery log line, the JSON formatter, what may be logged (allow-lists)
``describe``       error descriptions and tracebacks without exception texts
``gauges``         observable gauges read from the database on an interval, and the paused gauge
``setup``          SDK set-up for the CLIs: Prometheus endpoint, OTLP export
``minute_counts``  outcome counts per operation type and minute, for the ledger's outcome_counts
=================  ===============================================================================

In-process outcome counters (:class:`OutcomeCounters`) feed the demo (``examples/invoices/demo.py``), the testing kit and
health output.
"""

from __future__ import annotations

import collections

from consumer_kit.model.outcomes import DeliveryReport
from consumer_kit.telemetry import metrics
from consumer_kit.telemetry.describe import describe_error, describe_traceback
from consumer_kit.telemetry.logs import log_delivery
from consumer_kit.telemetry.minute_counts import MinuteCounts
from consumer_kit.telemetry.tracing import (
    DeliveryTrace,
    delivery_span,
    messaging_system,
    note_events,
    note_evidence,
    step,
    tracer,
)

__all__ = [
    "OutcomeCounters",
    "DeliveryTrace",
    "delivery_span",
    "describe_error",
    "describe_traceback",
    "messaging_system",
    "note_events",
    "note_evidence",
    "record",
    "step",
    "tracer",
]


class OutcomeCounters:
    """In-process outcome counters: ``counters["duplicate"]`` etc."""

    def __init__(self) -> None:
        self.by_outcome: collections.Counter[str] = collections.Counter()
        # Set by the worker: outcomes by operation type and minute, for the ledger's
        # outcome_counts (None: not kept, e.g. an embedded runtime nobody flushes).
        self.minutes: MinuteCounts | None = None

    def __getitem__(self, outcome: str) -> int:
        return self.by_outcome[outcome]

    def snapshot(self) -> dict[str, int]:
        return dict(self.by_outcome)


def record(
    report: DeliveryReport, counters: OutcomeCounters, operation_type: str | None,
    notes: DeliveryTrace | None = None,
) -> None:
    """Count, measure and log one delivery report (``notes``: its span's notes, for the log
    line's correlation id, event ids and evidence)."""
    outcome = report.outcome.value
    counters.by_outcome[outcome] += 1
    if counters.minutes is not None:
        counters.minutes.add(operation_type, outcome)
    metrics.record_delivery(
        queue=report.queue, operation_type=operation_type or "", outcome=outcome,
        duration=report.duration_seconds, reason=report.reason,
        dead_lettered=report.settlement is not None and report.settlement.value == "dead_letter",
    )
    log_delivery(report, notes)
