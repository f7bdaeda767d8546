"""Every metric consumer-kit and the relay emit: one catalogue (:data:`CATALOGUE`), the instruments
made from it, and the calls that record them.

Metrics go through the OpenTelemetry **API** only: they cost next to nothing and go nowhere until
the application (or ``consumer-kit worker --metrics-port`` / ``--otel``, see
:mod:`consumer_kit.telemetry.setup`) installs an SDK ``MeterProvider``. Names, units and attribute
keys follow the OpenTelemetry conventions (dotted, namespaced names; UCUM units, ``s`` for
durations and ``{thing}`` for counts; ``messaging.*`` and ``error.type`` where a convention
exists). The Prometheus exporter turns ``consumer_kit.handler.duration`` (``s``) into
``consumer_kit_handler_duration_seconds`` and ``consumer_kit.deliveries`` (a counter) into
``consumer_kit_deliveries_total``: :meth:`MetricSpec.prometheus_names` says which.

Per-delivery cost (benchmarks/ measures it): one counter add for ``consumer_kit.deliveries``, one for
the outcome's own counter (and one for ``consumer_kit.dead_letters`` when dead-lettered), three
histogram records (delivery, claim wait, handler); attribute dicts are cached per
(queue, operation type, outcome), so nothing is built per delivery.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import metrics

# -- attribute keys ---------------------------------------------------------------------------------

OPERATION_TYPE = "consumer_kit.operation.type"
"""The handler's ``operation_type`` (``invoice.create``); ``""`` before a handler was chosen."""
OUTCOME = "consumer_kit.outcome"
"""The runtime's outcome (:class:`~consumer_kit.model.outcomes.Outcome` values)."""
QUEUE = "messaging.destination.name"
"""The queue a delivery came from, or the destination an event was published to."""
DEAD_LETTER_REASON = "consumer_kit.dead_letter.reason"
"""The machine-readable dead-letter reason code (``payload_conflict``, ``max_deliveries``, ...:
the part before ``:``)."""
ERROR_TYPE = "error.type"
"""The exception class of a retried fault (``RetryableError``, ``LockNotAvailable``)."""
SCHEMA = "consumer_kit.schema"
"""The PostgreSQL schema of the ledger and outbox a gauge reads."""
BROKER = "messaging.system"
"""The broker an adapter speaks to (``servicebus``, ``aws_sqs``: OpenTelemetry's
``messaging.system`` values)."""
RELAY_EVENT = "event"
"""The relay event name of ``outbox_relay.events`` (see :mod:`consumer_kit.outbox_relay.counters`)."""

# Seconds: from a millisecond to five minutes (handlers, claims, deliveries, outbox lag).
DURATION_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)


@dataclass(frozen=True)
class MetricSpec:
    """One metric: its OpenTelemetry name, instrument kind (``counter``, ``histogram``,
    ``gauge``), unit, meaning, attribute keys, and which process emits it (``worker`` or
    ``relay``)."""

    name: str
    kind: str
    unit: str
    description: str
    attributes: tuple[str, ...]
    emitted_by: str = "worker"

    @property
    def prometheus_names(self) -> tuple[str, ...]:
        """The series names the OpenTelemetry Prometheus exporter writes for it: dots become
        ``_``, a unit ``s`` adds ``_seconds`` (``{...}`` units add nothing), counters end in
        ``_total``, histograms have ``_bucket``, ``_sum`` and ``_count``."""
        base = self.name.replace(".", "_")
        if self.unit == "s":
            base += "_seconds"
        if self.kind == "counter":
            return (base + "_total",)
        if self.kind == "histogram":
            return (base + "_bucket", base + "_sum", base + "_count")
        return (base,)


_DELIVERY = (OPERATION_TYPE, OUTCOME, QUEUE)
_DELIVERY_ERROR = (*_DELIVERY, ERROR_TYPE)
_LEDGER = (SCHEMA, OPERATION_TYPE)

CATALOGUE: tuple[MetricSpec, ...] = (
    # -- per delivery (worker) ----------------------------------------------------------------
    MetricSpec("consumer_kit.deliveries", "counter", "{delivery}",
               "Settled deliveries by outcome (every outcome; the denominator of rates)", _DELIVERY),
    MetricSpec("consumer_kit.executions", "counter", "{operation}",
               "First executions: the handler ran and committed (outcome executed)", _DELIVERY),
    MetricSpec("consumer_kit.duplicates", "counter", "{delivery}",
               "Duplicates answered from the ledger (outcomes duplicate, failed_retained)", _DELIVERY),
    MetricSpec("consumer_kit.payload_conflicts", "counter", "{delivery}",
               "Same operation key, another intent: dead-lettered, never executed", _DELIVERY),
    MetricSpec("consumer_kit.in_progress", "counter", "{delivery}",
               "In-progress collisions: another delivery holds the operation, retried later", _DELIVERY),
    MetricSpec("consumer_kit.lease.recoveries", "counter", "{operation}",
               "Expired leases taken over, reconciled and completed (outcome lease_recovered)", _DELIVERY),
    MetricSpec("consumer_kit.lease.losses", "counter", "{delivery}",
               "Leases lost to another worker: not completed, not acked (outcome lease_lost)", _DELIVERY),
    MetricSpec("consumer_kit.uncertain", "counter", "{delivery}",
               "Uncertain outcomes: COMMIT reply lost, or parked for reconciliation", _DELIVERY),
    MetricSpec("consumer_kit.key_expiry_refusals", "counter", "{delivery}",
               "Deliveries refused because their operation key expired (outcome key_expired)", _DELIVERY),
    MetricSpec("consumer_kit.retries", "counter", "{delivery}",
               "Handler faults rolled back and retried (count toward max_deliveries)", _DELIVERY_ERROR),
    MetricSpec("consumer_kit.contentions", "counter", "{delivery}",
               "Lock timeouts, deadlocks, serialization failures retried through the broker",
               _DELIVERY_ERROR),
    MetricSpec("consumer_kit.contentions.in_place", "counter", "{delivery}",
               "Lock timeouts, deadlocks, serialization failures retried in place (rolled back, run "
               "again after a jittered wait; a batch counts each of its deliveries)",
               (OPERATION_TYPE, QUEUE, ERROR_TYPE)),
    MetricSpec("consumer_kit.failures", "counter", "{operation}",
               "Permanent business failures recorded and acked (outcome failed)", _DELIVERY),
    MetricSpec("consumer_kit.dead_letters", "counter", "{message}",
               "Deliveries moved to the dead-letter queue, by reason", (*_DELIVERY, DEAD_LETTER_REASON)),
    MetricSpec("consumer_kit.crashes", "counter", "{operation}",
               "Operations parked as crashed_worker: the process died crash_limit times running them",
               _DELIVERY),
    MetricSpec("consumer_kit.delivery.duration", "histogram", "s",
               "Time from receipt to settlement", _DELIVERY),
    MetricSpec("consumer_kit.handler.duration", "histogram", "s",
               "Time the handler (or its reconcile) ran", (OPERATION_TYPE,)),
    MetricSpec("consumer_kit.claim.wait", "histogram", "s",
               "Time the claim took, waiting on a concurrent claimer of the same key included",
               (OPERATION_TYPE,)),
    MetricSpec("consumer_kit.locks_lost", "counter", "{lock}",
               "Held deliveries whose broker lock was lost (renewal or settlement refused, or the "
               "broker handed the message out again): never acked here, the broker redelivers them",
               (QUEUE, BROKER)),
    # -- per worker process -------------------------------------------------------------------
    MetricSpec("consumer_kit.worker.pauses", "counter", "{pause}",
               "Times a worker paused consuming for an unavailable database (environment fault)", ()),
    MetricSpec("consumer_kit.worker.paused", "gauge", "{worker}",
               "1 while this worker is paused for an unavailable database, else 0", ()),
    # -- read from the database (gauges, refreshed on an interval) ------------------------------
    MetricSpec("consumer_kit.ledger.expired_leases", "gauge", "{operation}",
               "Operations still processing past their lease (a worker died or hangs)", _LEDGER),
    MetricSpec("consumer_kit.ledger.expired_leases.oldest_age", "gauge", "s",
               "Seconds since the oldest expired lease ran out", _LEDGER),
    MetricSpec("consumer_kit.ledger.needs_reconciliation", "gauge", "{operation}",
               "Operations parked as needs_reconciliation (an operator must resolve them)", _LEDGER),
    MetricSpec("consumer_kit.ledger.needs_reconciliation.oldest_age", "gauge", "s",
               "Seconds since the oldest needs_reconciliation operation was parked", _LEDGER),
    MetricSpec("consumer_kit.outbox.pending", "gauge", "{event}",
               "Outbox rows not published yet and still tried (capped at the gauge query's bound)",
               (SCHEMA,), "relay"),
    MetricSpec("consumer_kit.outbox.pending.oldest_age", "gauge", "s",
               "Seconds since the oldest pending outbox row was written", (SCHEMA,), "relay"),
    MetricSpec("consumer_kit.outbox.parked", "gauge", "{event}",
               "Outbox rows parked after max attempts (need `outbox-relay requeue`)", (SCHEMA,), "relay"),
    # -- relay ----------------------------------------------------------------------------------
    MetricSpec("consumer_kit.outbox.commit_to_publish", "histogram", "s",
               "From the writing transaction to the broker's confirm (relay clock minus the row's "
               "created_at)", (QUEUE,), "relay"),
    MetricSpec("outbox_relay.events", "counter", "{event}",
               "Relay events by name (claimed, published, publish_failed, parked, taken_over, ...)",
               (RELAY_EVENT,), "relay"),
)

BY_NAME: Mapping[str, MetricSpec] = {spec.name: spec for spec in CATALOGUE}


def prometheus_series() -> frozenset[str]:
    """Every Prometheus series name the catalogue exports (what ``deploy/`` may refer to)."""
    return frozenset(name for spec in CATALOGUE for name in spec.prometheus_names)


# -- instruments ------------------------------------------------------------------------------------

meter = metrics.get_meter("consumer_kit")


def _counter(name: str) -> metrics.Counter:
    spec = BY_NAME[name]
    return meter.create_counter(spec.name, unit=spec.unit, description=spec.description)


def _histogram(name: str) -> metrics.Histogram:
    spec = BY_NAME[name]
    return meter.create_histogram(
        spec.name, unit=spec.unit, description=spec.description,
        explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
    )


_deliveries = _counter("consumer_kit.deliveries")
_contentions_in_place = _counter("consumer_kit.contentions.in_place")
_dead_letters = _counter("consumer_kit.dead_letters")
_pauses = _counter("consumer_kit.worker.pauses")
_locks_lost = _counter("consumer_kit.locks_lost")
_delivery_duration = _histogram("consumer_kit.delivery.duration")
_handler_duration = _histogram("consumer_kit.handler.duration")
_claim_wait = _histogram("consumer_kit.claim.wait")
_commit_to_publish = _histogram("consumer_kit.outbox.commit_to_publish")

# outcome value -> the name of its own counter (outcomes without one: only consumer_kit.deliveries)
OUTCOME_COUNTERS: Mapping[str, str] = {
    "executed": "consumer_kit.executions",
    "duplicate": "consumer_kit.duplicates",
    "failed_retained": "consumer_kit.duplicates",
    "payload_conflict": "consumer_kit.payload_conflicts",
    "in_progress": "consumer_kit.in_progress",
    "lease_recovered": "consumer_kit.lease.recoveries",
    "lease_lost": "consumer_kit.lease.losses",
    "uncertain": "consumer_kit.uncertain",
    "key_expired": "consumer_kit.key_expiry_refusals",
    "retried": "consumer_kit.retries",
    "contended": "consumer_kit.contentions",
    "failed": "consumer_kit.failures",
    "crashed_worker": "consumer_kit.crashes",
}
_counters = {name: _counter(name) for name in sorted(set(OUTCOME_COUNTERS.values()))}
_BY_OUTCOME = {outcome: _counters[name] for outcome, name in OUTCOME_COUNTERS.items()}
_WITH_ERROR_TYPE = {"retried", "contended"}

_attribute_cache: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
_CACHE_LIMIT = 4096  # distinct (queue, type, outcome, ...) combinations kept


def _attributes(*pairs: tuple[str, str]) -> dict[str, Any]:
    """The attribute dict for ``pairs``, built once per combination (the SDK never mutates it)."""
    found = _attribute_cache.get(pairs)
    if found is None:
        found = dict(pairs)
        if len(_attribute_cache) < _CACHE_LIMIT:
            _attribute_cache[pairs] = found
    return found


def record_delivery(
    *, queue: str, operation_type: str, outcome: str, duration: float, reason: str | None,
    dead_lettered: bool,
) -> None:
    """Count one settled delivery (``duration`` in seconds) under ``consumer_kit.deliveries``,
    its outcome's own counter and, when ``dead_lettered``, ``consumer_kit.dead_letters``."""
    attributes = _attributes((OPERATION_TYPE, operation_type), (OUTCOME, outcome), (QUEUE, queue))
    _deliveries.add(1, attributes)
    _delivery_duration.record(duration, attributes)
    own = _BY_OUTCOME.get(outcome)
    if own is not None:
        if outcome in _WITH_ERROR_TYPE:
            error_type = (reason or "").removeprefix("contention:") or "unknown"
            own.add(1, _attributes(
                (OPERATION_TYPE, operation_type), (OUTCOME, outcome), (QUEUE, queue), (ERROR_TYPE, error_type)
            ))
        else:
            own.add(1, attributes)
    if dead_lettered:
        code = (reason or "unknown").split(":", 1)[0]
        _dead_letters.add(1, _attributes(
            (OPERATION_TYPE, operation_type), (OUTCOME, outcome), (QUEUE, queue), (DEAD_LETTER_REASON, code)
        ))


def record_contention_in_place(queue: str, operation_type: str, error_type: str) -> None:
    """``consumer_kit.contentions.in_place``: one delivery rolled back for a contention
    (``error_type``: the exception class) and run again in place."""
    _contentions_in_place.add(1, _attributes((OPERATION_TYPE, operation_type), (QUEUE, queue), (ERROR_TYPE, error_type)))


def record_handler(operation_type: str, seconds: float) -> None:
    """``consumer_kit.handler.duration``: the handler (or reconcile) ran ``seconds``."""
    _handler_duration.record(seconds, _attributes((OPERATION_TYPE, operation_type)))


def record_claim(operation_type: str, seconds: float) -> None:
    """``consumer_kit.claim.wait``: the claim statement took ``seconds``."""
    _claim_wait.record(seconds, _attributes((OPERATION_TYPE, operation_type)))


def record_pause() -> None:
    """``consumer_kit.worker.pauses``: a worker paused for an unavailable database."""
    _pauses.add(1)


def record_lock_lost(queue: str, broker: str) -> None:
    """``consumer_kit.locks_lost``: one held delivery of ``queue`` lost its lock on ``broker``
    (a :data:`BROKER` value)."""
    _locks_lost.add(1, _attributes((QUEUE, queue), (BROKER, broker)))


def record_published(destination: str, created_at: dt.datetime) -> None:
    """``consumer_kit.outbox.commit_to_publish``: the relay's clock now minus the row's
    ``created_at`` (the database clock at the writing transaction's start; clock skew between the
    two hosts shifts it), in seconds, never below 0."""
    seconds = max(0.0, time.time() - created_at.timestamp())
    _commit_to_publish.record(seconds, _attributes((QUEUE, destination)))
