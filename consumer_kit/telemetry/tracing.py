"""Spans: one CONSUMER span per delivery, child spans for its steps, the relay's PRODUCER span, and
the trace context carried through the outbox.

Uses the OpenTelemetry **API** only: without an SDK every span is a non-recording no-op (no
attributes are built then: each setter checks ``is_recording()`` first).

One trace from the command to the event's consumer:

1. the delivery's span continues the producer's context, read from the message headers (W3C
   ``traceparent``/``tracestate``, case-insensitive, ``bytes`` values decoded);
2. ``ctx.publish`` and ``OutboxWriter.add`` store the current context in the event's stored
   headers (:func:`~consumer_kit.telemetry.trace_context.inject_into`, called by :func:`consumer_kit.outbox.pending_event`): no column of
   its own, so rows written before keep working and the relay needs no migration;
3. the relay's ``publish {destination}`` PRODUCER span continues the stored context
   (:func:`producer_span`) and injects its own into the published message's headers, which the
   event's consumer reads in step 1.

Span names and attributes (OpenTelemetry messaging semantic conventions where one exists):

* ``process {queue}`` (CONSUMER): ``messaging.system``, ``messaging.destination.name``,
  ``messaging.message.id``, ``messaging.operation.type`` = ``process``,
  ``messaging.operation.name`` = ``process``, ``messaging.message.conversation_id`` (the correlation
  id), ``consumer_kit.delivery_count`` (the conventions define a delivery count per system only),
  ``consumer_kit.redelivered``, ``consumer_kit.operation.type``, ``consumer_kit.scope``,
  ``consumer_kit.operation.key``, ``consumer_kit.correlation_id``, ``consumer_kit.outcome``,
  ``consumer_kit.settlement``, ``consumer_kit.reason``, ``consumer_kit.event_count``; status ERROR
  for outcomes that need a look (dead-lettered, uncertain, ...), with the reason code.
* children (INTERNAL): ``consumer_kit.claim``, ``consumer_kit.handle`` / ``consumer_kit.reconcile``,
  ``consumer_kit.commit`` (on the leased path: the completion transaction); status ERROR with a
  one-line description (:func:`~consumer_kit.telemetry.describe.describe_error`) when they raise.
* ``process batch {queue}`` (CONSUMER, the batch path): ``messaging.system``,
  ``messaging.destination.name``, ``messaging.batch.message_count``; its children are the batch's
  ``consumer_kit.claim`` and ``consumer_kit.commit``. Each delivery of the batch keeps its own
  ``process {queue}`` span (continuing its producer's context, with a link to the batch's span) and
  its own ``consumer_kit.handle`` child.
* ``publish {destination}`` (PRODUCER, relay): ``messaging.system``, ``messaging.destination.name``,
  ``messaging.message.id`` (the event id), ``messaging.operation.type`` = ``send``,
  ``messaging.operation.name`` = ``publish``, ``consumer_kit.operation.key``,
  ``consumer_kit.correlation_id``, ``outbox.attempt``.

Exceptions are never recorded as span events: their text may quote business values.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlparse

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from consumer_kit.telemetry import metrics
from consumer_kit.telemetry.describe import describe_error
from consumer_kit.telemetry.loggable import evidence_ids
from consumer_kit.telemetry.trace_context import extract

if TYPE_CHECKING:
    from consumer_kit.codec.envelope import Envelope
    from consumer_kit.model.decision import Decision
    from consumer_kit.model.decoded import Decoded, NamedOperation
    from consumer_kit.model.events import PendingEvent

tracer = trace.get_tracer("consumer_kit")


class TracedDelivery(Protocol):
    """What a span reads of a delivery (:class:`consumer_kit.broker.Delivery` has it): telemetry
    stands below the broker contract, so it names only these attributes."""

    queue: str
    headers: Mapping[str, Any]
    message_id: str | None
    delivery_count: int
    redelivered: bool

MESSAGING_SYSTEMS = {
    "amqp": "rabbitmq", "amqps": "rabbitmq", "sqs": "aws_sqs", "servicebus": "servicebus",
    "sb": "servicebus", "memory": "memory",
}
"""Broker URL scheme -> ``messaging.system`` (the conventions' names; ``memory`` is ours)."""

# Outcomes whose span gets status ERROR: someone should look at them.
_ERROR_OUTCOMES = frozenset({
    "payload_conflict", "invalid", "dead_lettered", "uncertain", "crashed_worker", "lease_lost",
    "key_expired", "crashed",
})


def messaging_system(broker_url: str) -> str:
    """``messaging.system`` for a broker URL (``amqp://...`` -> ``rabbitmq``); the scheme itself
    for a scheme this table does not know."""
    scheme = urlparse(broker_url).scheme
    return MESSAGING_SYSTEMS.get(scheme, scheme or "unknown")


_current: contextvars.ContextVar[DeliveryTrace | None] = contextvars.ContextVar(
    "consumer_kit_delivery", default=None
)


class DeliveryTrace:
    """One delivery's span and what its log line needs beyond the report: the operation type,
    the correlation id, the event ids it published and the evidence its remote calls recorded.

    Attributes:
        span: the ``process {queue}`` span (non-recording without an SDK).
        operation_type: the handler's ``operation_type`` once decoded, else ``""``.
        correlation_id: the delivery's correlation id, if any.
        event_ids: event ids written to the outbox by this delivery's completion.
        evidence: ``(name, {fact: value})`` of each evidence record (id facts only, see
            :data:`~consumer_kit.telemetry.loggable.EVIDENCE_ID_SUFFIX`).
    """

    __slots__ = ("correlation_id", "event_ids", "evidence", "operation_type", "span")

    def __init__(self, span: trace.Span) -> None:
        self.span = span
        self.operation_type = ""
        self.correlation_id: str | None = None
        self.event_ids: list[str] = []
        self.evidence: list[tuple[str, dict[str, str]]] = []

    def decoded(self, decoded: Decoded[NamedOperation], envelope: Envelope) -> None:
        """Steps 2 and 3 passed: name the operation on the span."""
        self.operation_type = decoded.handler.operation_type
        self.correlation_id = envelope.correlation_id
        span = self.span
        if span.is_recording():
            identity = decoded.identity
            span.set_attribute("consumer_kit.operation.type", self.operation_type)
            span.set_attribute("consumer_kit.scope", identity.scope)
            span.set_attribute("consumer_kit.operation.key", identity.key)
            if self.correlation_id:
                span.set_attribute("messaging.message.conversation_id", self.correlation_id)
                span.set_attribute("consumer_kit.correlation_id", self.correlation_id)

    def decided(self, decision: Decision) -> None:
        """The outcome and how the delivery is settled."""
        span = self.span
        if not span.is_recording():
            return
        outcome = decision.outcome.value
        span.set_attribute("consumer_kit.outcome", outcome)
        span.set_attribute("consumer_kit.settlement", decision.how.value)
        if decision.reason:
            span.set_attribute("consumer_kit.reason", decision.reason)
        span.set_attribute("consumer_kit.event_count", len(self.event_ids))
        if outcome in _ERROR_OUTCOMES:
            span.set_status(Status(StatusCode.ERROR, f"{outcome}: {decision.reason or ''}"))


def _carried(headers: Mapping[str, Any]) -> trace.Span:
    """Without an SDK: the producer's span context from ``headers`` as a non-recording span (what
    the API's no-op tracer would start), or ``INVALID_SPAN`` when the producer sent none."""
    parent = extract(headers)
    return trace.INVALID_SPAN if parent is None else trace.get_current_span(parent)


@contextlib.contextmanager
def delivery_span(delivery: TracedDelivery, system: str) -> Iterator[DeliveryTrace]:
    """The ``process {queue}`` CONSUMER span of one delivery, continuing the producer's context
    from its headers; current (with its :class:`DeliveryTrace`) until the block ends.

    Without an SDK tracer provider nothing would record the span, so none is started: the
    producer's span context (if it sent one) is made current as it is, so ``ctx.publish`` still
    stores it with the events (the relay's span continues it), and the steps start no child."""
    if not tracing_enabled():
        notes = DeliveryTrace(trace.INVALID_SPAN)
        carried = _carried(delivery.headers)
        token = _current.set(notes)
        attached = None if carried is trace.INVALID_SPAN else otel_context.attach(trace.set_span_in_context(carried))
        try:
            yield notes
        finally:
            if attached is not None:
                otel_context.detach(attached)
            _current.reset(token)
        return
    with tracer.start_as_current_span(
        f"process {delivery.queue}", context=extract(delivery.headers), kind=SpanKind.CONSUMER,
        record_exception=False, set_status_on_exception=False,
    ) as span:
        notes = DeliveryTrace(span)
        token = _current.set(notes)
        try:
            if span.is_recording():
                span.set_attributes(_delivery_attributes(delivery, system))
            yield notes
        finally:
            _current.reset(token)


@contextlib.contextmanager
def batch_span(queue: str, system: str, size: int) -> Iterator[trace.Span]:
    """The ``process batch {queue}`` CONSUMER span of a batch of ``size`` deliveries, current
    until the block ends (the batch's claim and commit are its children). Without an SDK tracer
    provider: none (``INVALID_SPAN``), as for :func:`delivery_span`."""
    if not tracing_enabled():
        yield trace.INVALID_SPAN
        return
    with tracer.start_as_current_span(
        f"process batch {queue}", kind=SpanKind.CONSUMER, record_exception=False, set_status_on_exception=False,
    ) as span:
        if span.is_recording():
            span.set_attributes({
                "messaging.system": system,
                "messaging.destination.name": queue,
                "messaging.operation.type": "process",
                "messaging.operation.name": "process",
                "messaging.batch.message_count": size,
            })
        yield span


def member_span(delivery: TracedDelivery, system: str, batch: trace.Span) -> DeliveryTrace:
    """The ``process {queue}`` span of one delivery of a batch: the same span as
    :func:`delivery_span` (continuing the producer's context), linked to the ``batch`` span and
    not current (:func:`as_current` makes it so around the delivery's own steps). The caller ends
    it (``trace.span.end()``). Without an SDK tracer provider: the producer's span context, not
    recording (as for :func:`delivery_span`)."""
    if not tracing_enabled():
        return DeliveryTrace(_carried(delivery.headers))
    links = [trace.Link(batch.get_span_context())] if batch.get_span_context().is_valid else None
    span = tracer.start_span(
        f"process {delivery.queue}", context=extract(delivery.headers), kind=SpanKind.CONSUMER, links=links,
        record_exception=False, set_status_on_exception=False,
    )
    if span.is_recording():
        span.set_attributes(_delivery_attributes(delivery, system))
    return DeliveryTrace(span)


def _delivery_attributes(delivery: TracedDelivery, system: str) -> dict[str, Any]:
    return {
        "messaging.system": system,
        "messaging.destination.name": delivery.queue,
        "messaging.message.id": delivery.message_id or "",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "consumer_kit.delivery_count": delivery.delivery_count,
        "consumer_kit.redelivered": delivery.redelivered,
    }


@contextlib.contextmanager
def as_current(notes: DeliveryTrace | None) -> Iterator[None]:
    """Make a batch member's span (:func:`member_span`) the current delivery and span for the
    block (its handler's steps and log lines); ``None``: leave the current one."""
    if notes is None:
        yield
        return
    token = _current.set(notes)
    try:
        if notes.span is trace.INVALID_SPAN:  # nothing to make current (no SDK, no producer context)
            yield
        else:
            with trace.use_span(notes.span, end_on_exit=False):
                yield
    finally:
        _current.reset(token)


def current() -> DeliveryTrace | None:
    """The delivery being processed in this task, if any."""
    return _current.get()


def note_events(events: Sequence[PendingEvent]) -> None:
    """Remember the event ids the delivery's completion wrote (for its log line and span)."""
    notes = _current.get()
    if notes is not None and events:
        notes.event_ids.extend(str(e.event_id) for e in events)


def note_evidence(name: str, facts: Mapping[str, Any]) -> None:
    """Remember an evidence record's name and its id facts (for the delivery's log line)."""
    notes = _current.get()
    if notes is not None:
        notes.evidence.append((name, evidence_ids(facts)))


class step:
    """A child span ``name`` of the current delivery; with ``histogram`` (``"claim"`` or
    ``"handler"``) its duration is recorded as ``consumer_kit.claim.wait`` or
    ``consumer_kit.handler.duration``. An exception leaves the span with status ERROR and a
    one-line description (never the exception's text), and propagates. A class rather than a
    generator: it runs several times per delivery."""

    __slots__ = ("_histogram", "_name", "_opened", "_operation_type", "_started")

    def __init__(self, name: str, operation_type: str, *, histogram: str | None = None) -> None:
        self._name, self._operation_type, self._histogram = name, operation_type, histogram
        self._opened: Any = None
        self._started = 0.0

    def __enter__(self) -> trace.Span:
        self._started = time.perf_counter()
        notes = _current.get()
        current = notes.span if notes is not None else trace.get_current_span()
        if not current.is_recording():
            return trace.INVALID_SPAN  # nothing records the delivery's span (no SDK, not sampled): no child
        self._opened = tracer.start_as_current_span(self._name, record_exception=False, set_status_on_exception=False)
        return self._opened.__enter__()  # type: ignore[no-any-return]

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        try:
            if self._opened is not None:
                if exc is not None:
                    span = trace.get_current_span()
                    if span.is_recording():
                        span.set_status(Status(StatusCode.ERROR, describe_error(exc)))
                        span.set_attribute("error.type", type(exc).__name__)
                self._opened.__exit__(exc_type, exc, tb)
        finally:
            _record_step(self._histogram, self._operation_type, self._started)


def _record_step(histogram: str | None, operation_type: str, started: float) -> None:
    if histogram == "claim":
        metrics.record_claim(operation_type, time.perf_counter() - started)
    elif histogram == "handler":
        metrics.record_handler(operation_type, time.perf_counter() - started)


def tracing_enabled() -> bool:
    """True once an application installed a tracer provider (the OpenTelemetry SDK's): until then
    every span is a no-op."""
    return not isinstance(trace.get_tracer_provider(), (trace.ProxyTracerProvider, trace.NoOpTracerProvider))


@contextlib.contextmanager
def producer_span(
    destination: str, stored_headers: Mapping[str, str], *, system: str, event_id: str, attempt: int,
    operation_key: str | None, correlation_id: str | None,
) -> Iterator[trace.Span]:
    """The relay's ``publish {destination}`` PRODUCER span for one outbox row, continuing the
    trace context stored with the row; current until the block ends (inject inside it).

    Without an SDK tracer provider the span would record nothing and carry the stored context
    unchanged, which the row's stored headers already do: so none is made (it was 12.7 % of the
    relay's CPU in a drain profile)."""
    if not tracing_enabled():
        yield trace.INVALID_SPAN
        return
    with tracer.start_as_current_span(
        f"publish {destination}", context=extract(stored_headers), kind=SpanKind.PRODUCER,
        record_exception=False, set_status_on_exception=False,
    ) as span:
        if span.is_recording():
            span.set_attributes({
                "messaging.system": system,
                "messaging.destination.name": destination,
                "messaging.message.id": event_id,
                "messaging.operation.type": "send",
                "messaging.operation.name": "publish",
                "outbox.attempt": attempt,
            })
            if operation_key:
                span.set_attribute("consumer_kit.operation.key", operation_key)
            if correlation_id:
                span.set_attribute("messaging.message.conversation_id", correlation_id)
                span.set_attribute("consumer_kit.correlation_id", correlation_id)
        yield span


def mark_failed(span: trace.Span, exc: BaseException) -> None:
    """Status ERROR on ``span`` with a one-line description of ``exc`` (no exception text)."""
    if span.is_recording():
        span.set_status(Status(StatusCode.ERROR, describe_error(exc)))
        span.set_attribute("error.type", type(exc).__name__)
