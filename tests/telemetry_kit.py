"""The OpenTelemetry SDK with in-memory exporters, for tests that read spans and metrics.

The SDK's providers are global and can be set once per process, so the first test that asks
installs them for the rest of the session; spans are kept only while a test captures them
(``otel`` fixture), so other tests' deliveries do not pile up in memory. Metrics are cumulative:
tests compare a value before and after what they do (:meth:`Telemetry.value`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


class _WhileCapturing(SpanProcessor):
    """Passes finished spans on only while a test captures."""

    def __init__(self, inner: SpanProcessor) -> None:
        self.inner = inner
        self.capturing = False

    def on_end(self, span: ReadableSpan) -> None:
        if self.capturing:
            self.inner.on_end(span)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class Telemetry:
    """The session's in-memory span exporter and metric reader."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.processor = _WhileCapturing(SimpleSpanProcessor(self.exporter))
        provider = TracerProvider()
        provider.add_span_processor(self.processor)
        trace.set_tracer_provider(provider)
        self.reader = InMemoryMetricReader()
        metrics.set_meter_provider(MeterProvider(metric_readers=[self.reader]))
        installed = metrics.get_meter_provider()
        assert isinstance(installed, MeterProvider), "another test installed a MeterProvider first"

    def spans(self) -> Sequence[ReadableSpan]:
        return self.exporter.get_finished_spans()

    def points(self, name: str) -> list[tuple[dict[str, Any], Any]]:
        """``(attributes, point)`` of every data point of metric ``name`` now."""
        data = self.reader.get_metrics_data()
        found: list[tuple[dict[str, Any], Any]] = []
        for resource in data.resource_metrics if data else []:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name == name:
                        found.extend((dict(p.attributes or {}), p) for p in metric.data.data_points)
        return found

    def value(self, name: str, **attributes: Any) -> float:
        """The sum (counters), count (histograms) or value (gauges) of ``name`` over the data
        points whose attributes include ``attributes`` (keys with ``_`` for ``.``: pass
        ``{"messaging.destination.name": q}`` as ``attrs=``)."""
        wanted: Mapping[str, Any] = attributes.pop("attrs", {}) | attributes
        total = 0.0
        for point_attributes, point in self.points(name):
            if all(point_attributes.get(k) == v for k, v in wanted.items()):
                total += getattr(point, "count", None) if hasattr(point, "bucket_counts") else point.value
        return total


_telemetry: Telemetry | None = None


@pytest.fixture
def otel() -> Iterator[Telemetry]:
    """The session's :class:`Telemetry`, capturing spans for this test only."""
    global _telemetry
    if _telemetry is None:
        _telemetry = Telemetry()
    _telemetry.exporter.clear()
    _telemetry.processor.capturing = True
    try:
        yield _telemetry
    finally:
        _telemetry.processor.capturing = False
        _telemetry.exporter.clear()
