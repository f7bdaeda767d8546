"""Step 2 of a relay pass: publish the claimed rows to the broker, concurrently, within the deadline.

Each row becomes one broker message whose message id is the row's event ID (the same on every
attempt, so consumers deduplicate a republish), inside a ``publish {destination}`` PRODUCER span
that continues the trace stored with the row. A failure says what it means for the row
(:class:`~consumer_kit.outbox_relay.store.Failure`: park at once, back off briefly, or back off and count).
"""

from __future__ import annotations

import asyncio
import logging

from opentelemetry import propagate

from consumer_kit.errors import SimulatedCrash
from consumer_kit.pipeline import crashpoints
from consumer_kit.pipeline.crashpoints import CrashPoint
from consumer_kit.publishing import OutgoingMessage, Publisher, PublishError
from consumer_kit.telemetry.metrics import record_published
from consumer_kit.telemetry.tracing import mark_failed, producer_span

from .counters import RelayCounters
from .routing import Routing, UnknownDestination
from .store import ClaimedRow, Failure

logger = logging.getLogger("consumer_kit.outbox_relay")


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
        """Publish ``rows`` concurrently; returns (confirmed ids, failures). Publishes still
        unconfirmed after ``deadline`` seconds are cancelled and count as failures."""
        slots = asyncio.Semaphore(self.max_in_flight)
        confirmed: list[int] = []
        failures: list[Failure] = []

        async def publish_one(row: ClaimedRow) -> None:
            async with slots:
                failure = await self._publish_row(row)
            if failure is None:
                # Critical point: the broker has the message, the row is not marked yet.
                crashpoints.reached(CrashPoint.AFTER_PUBLISH_BEFORE_MARK)
                confirmed.append(row.id)
            else:
                failures.append(failure)

        tasks = {asyncio.create_task(publish_one(row)): row for row in rows}
        done, pending = await asyncio.wait(tasks, timeout=max(deadline, 0.0))
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
            self.counters.add("deadline_exceeded", len(pending))
            failures.extend(
                Failure(tasks[t].id, "not confirmed before the claim lease ran low", transient=True)
                for t in pending
            )
        for task in done:
            exc = task.exception()
            if isinstance(exc, SimulatedCrash):
                raise exc
            if exc is not None:  # a bug in our own code, not a broker failure
                failures.append(Failure(tasks[task].id, f"relay error: {type(exc).__name__}"))
        return confirmed, failures

    async def _publish_row(self, row: ClaimedRow) -> Failure | None:
        try:
            exchange, routing_key = self.routing.resolve(row.destination, row.routing_key)
        except UnknownDestination as exc:
            self.counters.add("unknown_destination")
            return Failure(row.id, str(exc), park=True)
        stored = {str(k): str(v) for k, v in row.headers.items()}
        # Continues the trace context stored with the row (consumer_kit.telemetry.tracing).
        with producer_span(
            exchange, stored, system=self.messaging_system, event_id=str(row.event_id),
            attempt=row.attempts + 1, operation_key=row.operation_key, correlation_id=row.correlation_id,
        ) as span:
            message = self.outgoing(row, exchange, routing_key, stored)
            try:
                await self.publisher.publish(message)
            except Exception as exc:  # noqa: BLE001 - PublishError or an adapter's own error
                mark_failed(span, exc)
                return self._failure(row, exc)
        record_published(exchange, row.created_at)
        return None

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
