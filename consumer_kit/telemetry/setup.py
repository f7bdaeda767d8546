"""The OpenTelemetry SDK, set up by the command-line programs only (``consumer-kit worker``,
``outbox-relay``) when asked: the library itself never installs one.

* ``--metrics-port P``: a :class:`~opentelemetry.sdk.metrics.MeterProvider` with the OpenTelemetry
  Prometheus exporter, served at ``http://<addr>:P/metrics`` (``prometheus_client``'s server, in a
  thread; ``<addr>``: ``--metrics-host``, default 0.0.0.0). With several worker processes on one
  host, each child takes the first free port of ``P .. P + processes - 1``.
* ``--otel``: OTLP export of traces (batched) and metrics (every ``OTEL_METRIC_EXPORT_INTERVAL``
  ms, default 60000), configured by the standard variables: ``OTEL_EXPORTER_OTLP_ENDPOINT``,
  ``OTEL_EXPORTER_OTLP_PROTOCOL`` (``grpc``, the default, or ``http/protobuf``),
  ``OTEL_EXPORTER_OTLP_HEADERS``, ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``, ...

Needs the ``otel`` extra (``pip install 'consumer-kit[otel]'``).
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from consumer_kit.errors import ConfigurationError, install_hint

logger = logging.getLogger("consumer_kit.telemetry")

EXTRA = install_hint("otel")


@dataclass
class Installed:
    """What :func:`install` set up: the metrics port actually bound (``None``: none) and the
    shutdown to call before the process exits (flushes the OTLP exporters)."""

    metrics_port: int | None = None
    shutdowns: list[Callable[[], Any]] = field(default_factory=list)

    def shutdown(self) -> None:
        for stop in reversed(self.shutdowns):
            try:
                stop()
            except Exception as exc:  # noqa: BLE001 - exiting anyway
                logger.debug("telemetry shutdown failed (%s)", type(exc).__name__)


def install(
    *, service_name: str, metrics_port: int | None = None, metrics_addr: str = "0.0.0.0",
    port_range: int = 1, otel: bool = False,
) -> Installed:
    """Install the SDK's providers globally for this process (see the module docstring); nothing
    when neither ``metrics_port`` nor ``otel`` is given.

    Raises:
        ConfigurationError: the ``otel`` extra is missing, or no port of ``metrics_port ..
            metrics_port + port_range - 1`` could be bound on ``metrics_addr`` (an address or
            host name).
    """
    installed = Installed()
    if metrics_port is None and not otel:
        return installed
    try:
        from opentelemetry import metrics, trace
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import MetricReader
        from opentelemetry.sdk.resources import Resource
    except ImportError as exc:
        raise ConfigurationError(f"--metrics-port and --otel need the OpenTelemetry SDK: {EXTRA} ({exc})") from None
    os.environ.setdefault("OTEL_SERVICE_NAME", service_name)
    resource = Resource.create()
    readers: list[MetricReader] = []
    if metrics_port is not None:
        readers.append(_prometheus(installed, metrics_port, metrics_addr, port_range))
    if otel:
        readers.append(_otlp_metrics())
        trace.set_tracer_provider(_otlp_traces(resource))
        installed.shutdowns.append(trace.get_tracer_provider().shutdown)  # type: ignore[attr-defined]
    provider = MeterProvider(metric_readers=readers, resource=resource)
    metrics.set_meter_provider(provider)
    installed.shutdowns.append(provider.shutdown)
    return installed


def _prometheus(installed: Installed, port: int, addr: str, port_range: int) -> Any:
    try:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import start_http_server
    except ImportError as exc:
        raise ConfigurationError(f"--metrics-port needs the Prometheus exporter: {EXTRA} ({exc})") from None
    reader = PrometheusMetricReader()
    last: OSError | None = None
    for candidate in range(port, port + max(1, port_range)):
        try:
            server, _thread = start_http_server(candidate, addr=addr)
        except OSError as exc:
            last = exc
            continue
        installed.metrics_port = candidate
        installed.shutdowns.append(server.shutdown)
        shown = f"[{addr}]" if ":" in addr else addr  # an IPv6 address goes in brackets in a URL
        logger.info("metrics at http://%s:%s/metrics (Prometheus format)", shown, candidate)
        return reader
    raise ConfigurationError(
        f"--metrics-port: cannot listen on {addr} port {port}"
        + (f" to {port + port_range - 1}" if port_range > 1 else "") + f" ({last})"
    )


def _otlp_metrics() -> Any:
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    return PeriodicExportingMetricReader(_otlp_exporter("metric", "OTLPMetricExporter")())


def _otlp_traces(resource: Any) -> Any:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(_otlp_exporter("trace", "OTLPSpanExporter")()))
    return provider


def _otlp_exporter(kind: str, name: str) -> Any:
    """The OTLP exporter class ``name`` for ``kind`` (``metric``, ``trace``) over the protocol
    ``OTEL_EXPORTER_OTLP_PROTOCOL`` names (``grpc``, the default, or ``http/protobuf``).

    Raises:
        ConfigurationError: the OTLP exporter is not installed.
    """
    protocol = "http" if os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc").startswith("http") else "grpc"
    try:
        module = importlib.import_module(f"opentelemetry.exporter.otlp.proto.{protocol}.{kind}_exporter")
    except ImportError as exc:
        raise ConfigurationError(f"--otel needs the OTLP exporter: {EXTRA} ({exc})") from None
    return getattr(module, name)
