"""Step 2 of a relay pass: publish the claimed rows to the broker, a chunk at a time, within the deadline.

A chunk is up to ``max_in_flight`` rows handed to the publisher's ``publish_batch`` together (on
RabbitMQ: one socket write, one wait for all their confirms); each row's outcome is its own.

Each row becomes one broker message whose message id is the row's event ID (the same on every
attempt, so consumers deduplicate a republish), inside a ``publish {destination}`` PRODUCER span
that continues the trace stored with the row. A failure says what it means for the row
(:class:`~consumer_kit.outbox_relay.store.Failure`: park at once, back off briefly, or back off and count).
"""

from __future__ import annotations

import logging
import time
from contextlib import ExitStack
from typing import Protocol, runtime_checkable

from opentelemetry import propagate, trace

from consumer_kit.broker.publishing import OutgoingMessage, Publisher
from consumer_kit.errors import PublishError, PublishTimeout
from consumer_kit.pipeline import crashpoints
from consumer_kit.pipeline.crashpoints import CrashPoint
from consumer_kit.telemetry.metrics import record_published
from consumer_kit.telemetry.tracing import mark_failed, producer_span

from .counters import RelayCounters
from .errors import UnknownDestination
from .routing import Routing
from .store import ClaimedRow, Failure

logger = logging.getLogger("consumer_kit.outbox_relay")


@runtime_checkable
class Connectable(Protocol):
    """A publisher that can open its broker connection before the first publish (RabbitMQ,
    memory): the relay's start-up probe. Publishers without it are probed by their first publish."""

    async def connect(self) -> None: ...


class RowPublisher:
    """Publishes claimed outbox rows through one broker publisher.

    Args:
        publisher: the broker publisher (not closed here).
        routing: destination map (outbox destination -> exchange or queue).
        counters: the relay's counters (``unknown_destination``, ``parked_permanent``,
            ``deadline_exceeded``).
        relay_id: written to each message's ``relay-id`` header.
        messaging_system: the spans' ``messaging.system``.
        max_in_flight: most publishes awaiting their confirm at once.
    """

    def __init__(
        self, publisher: Publisher, routing: Routing, counters: RelayCounters, *, relay_id: str,
        messaging_system: str, max_in_flight: int,
    ) -> None:
        self.publisher = publisher
        self.routing = routing
        self.counters = counters
        self.relay_id = relay_id
        self.messaging_system = messaging_system
        self.max_in_flight = max_in_flight

    async def publish_all(
        self, rows: list[ClaimedRow], deadline: float
    ) -> tuple[list[int], list[Failure]]:
        """Publish ``rows``; returns (confirmed ids, failures). Rows go to the publisher's
        :meth:`~consumer_kit.broker.publishing.Publisher.publish_batch` in chunks of ``max_in_flight``
        (one confirm wait per chunk, chunks one after the other); rows still unconfirmed
        ``deadline`` seconds after the call count as failures (``deadline_exceeded``)."""
        confirmed: list[int] = []
        failures: list[Failure] = []
        end = time.monotonic() + max(deadline, 0.0)
        for start in range(0, len(rows), self.max_in_flight):
            chunk = rows[start : start + self.max_in_flight]
            within = end - time.monotonic()
            if within <= 0:
                # Never sent once the time is up: a chunk sent now could reach the broker and still
                # count as a failure, published again later (a duplicate, an attempt spent).
                self.counters.add("deadline_exceeded", len(chunk))
                failures.extend(Failure(row.id, "not sent before the claim lease ran low", transient=True) for row in chunk)
                continue
            await self._publish_chunk(chunk, within, confirmed, failures)
        return confirmed, failures

    async def _publish_chunk(
        self, rows: list[ClaimedRow], within: float, confirmed: list[int], failures: list[Failure]
    ) -> None:
        sendable: list[tuple[ClaimedRow, str, trace.Span]] = []
        messages: list[OutgoingMessage] = []
        with ExitStack() as spans:
            for row in rows:
                try:
                    exchange, routing_key = self.routing.resolve(row.destination, row.routing_key)
                except UnknownDestination as exc:
                    self.counters.add("unknown_destination")
                    failures.append(Failure(row.id, str(exc), park=True))
                    continue
                stored = {str(k): str(v) for k, v in row.headers.items()}
                # Continues the trace context stored with the row (consumer_kit.telemetry.tracing);
                # each row's span stays open until the chunk's confirms are in.
                span = spans.enter_context(producer_span(
                    exchange, stored, system=self.messaging_system, event_id=str(row.event_id),
                    attempt=row.attempts + 1, operation_key=row.operation_key,
                    correlation_id=row.correlation_id,
                ))
                try:
                    messages.append(self.outgoing(row, exchange, routing_key, stored))
                except Exception as exc:  # noqa: BLE001 - a bug in our own code, not a broker failure
                    failures.append(Failure(row.id, f"relay error: {type(exc).__name__}"))
                    continue
                sendable.append((row, exchange, span))
            if not messages:
                return
            try:
                outcomes = await self.publisher.publish_batch(messages, within=max(within, 0.0))
            except Exception as exc:  # noqa: BLE001 - a bug in an adapter, not a broker failure
                outcomes = [exc] * len(messages)
            for (row, exchange, span), outcome in zip(sendable, outcomes, strict=True):
                if outcome is None:
                    # Critical point: the broker has the message, the row is not marked yet.
                    crashpoints.reached(CrashPoint.AFTER_PUBLISH_BEFORE_MARK)
                    record_published(exchange, row.created_at)
                    confirmed.append(row.id)
                elif isinstance(outcome, PublishTimeout):
                    mark_failed(span, outcome)
                    self.counters.add("deadline_exceeded")
                    failures.append(Failure(row.id, "not confirmed before the claim lease ran low", transient=True))
                elif isinstance(outcome, Exception):
                    mark_failed(span, outcome)
                    failures.append(self._failure(row, outcome))
                else:  # CancelledError, SimulatedCrash (a BaseException) from an adapter: not ours to map
                    raise outcome

    def _failure(self, row: ClaimedRow, exc: Exception) -> Failure:
        """What a failed publish means for ``row`` (``PublishError``'s three kinds): permanent
        parks it at once with the broker's reply; transient backs off briefly and never parks;
        anything else (row errors, an adapter's own exception) backs off and parks after
        ``max_attempts``. The text never carries the payload."""
        error = f"{type(exc).__name__}: {exc}"[:500]
        if isinstance(exc, PublishError) and exc.permanent:
            self.counters.add("parked_permanent")  # logged once the park is recorded
            return Failure(row.id, error, park=True)
        logger.debug(
            "publish failed event_id=%s destination=%s attempt=%s: %s",
            row.event_id, row.destination, row.attempts + 1, error,
        )
        # The broker's or the connection's fault, not the row's: short backoff, no parking.
        return Failure(row.id, error, transient=isinstance(exc, PublishError) and exc.transient)

    def outgoing(
        self, row: ClaimedRow, exchange: str, routing_key: str, stored: dict[str, str]
    ) -> OutgoingMessage:
        """The broker message for ``row``: message id = event ID; headers = the row's headers plus
        event-id, message-type, operation-scope/-key, correlation-id, partition-key,
        publish-attempt, relay-id and the trace context (W3C traceparent where a tracer is set);
        ``first_enqueued_at`` = the row's ``created_at`` (the publisher signs it as a mark)."""
        headers = dict(stored)
        headers["event-id"] = str(row.event_id)
        headers["message-type"] = row.message_type
        headers["publish-attempt"] = str(row.attempts + 1)
        headers["relay-id"] = self.relay_id
        for name, value in (
            ("operation-scope", row.operation_scope),
            ("operation-key", row.operation_key),
            ("correlation-id", row.correlation_id),
            ("partition-key", row.partition_key),
        ):
            if value is not None:
                headers[name] = value
        propagate.inject(headers)
        return OutgoingMessage(
            destination=exchange,
            routing_key=routing_key,
            message_id=str(row.event_id),
            body=row.payload.encode("utf-8"),
            message_type=row.message_type,
            headers=headers,
            partition_key=row.partition_key,
            # the event starts operations: they are as old as its commit, not its publish (key expiry)
            first_enqueued_at=row.created_at,
        )
