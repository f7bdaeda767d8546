"""Trace context through messages: the W3C ``traceparent``/``tracestate`` headers read from a
delivery (:func:`extract`) and stored with an outbox event (:func:`inject_into`), for
:mod:`consumer_kit.telemetry.tracing` (which spans continue them: its module docstring).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate
from opentelemetry.propagators.textmap import Getter

__all__ = ["TRACE_HEADERS", "extract", "inject_into"]

TRACE_HEADERS = ("traceparent", "tracestate")
"""The W3C trace-context headers stored with an outbox row and sent with its event."""


class _HeaderGetter(Getter[Mapping[str, Any]]):
    """Reads trace headers from broker headers: names case-insensitive, ``bytes`` decoded."""

    def get(self, carrier: Mapping[str, Any], key: str) -> list[str] | None:
        value = carrier.get(key)
        if value is None:
            lowered = key.lower()
            value = next((v for k, v in carrier.items() if isinstance(k, str) and k.lower() == lowered), None)
        if value is None:
            return None
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        return [str(value)]

    def keys(self, carrier: Mapping[str, Any]) -> list[str]:
        return [str(k) for k in carrier]


_GETTER = _HeaderGetter()


def extract(headers: Mapping[str, Any]) -> otel_context.Context | None:
    """The producer's context from a delivery's headers, or ``None`` when it sent none."""
    if not any(name in headers for name in TRACE_HEADERS) and not any(
        isinstance(k, str) and k.lower() in TRACE_HEADERS for k in headers
    ):
        return None
    return propagate.extract(headers, getter=_GETTER)


def inject_into(headers: MutableMapping[str, str]) -> None:
    """Store the current trace context in ``headers`` (``traceparent``, ``tracestate`` and any
    other field of the configured propagator), unless the caller set ``traceparent`` itself.
    Nothing is added without an active span context (no SDK and no incoming trace)."""
    if "traceparent" not in headers and otel_context.get_current():  # an empty context injects nothing
        propagate.inject(headers)
