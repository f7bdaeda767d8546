"""The relay loop: wait for work, claim a batch, publish it with confirms, mark it, repeat.

One pass (:meth:`Relay.relay_batch`)::

    1. claim      up to batch_size rows under a lease (store.claim; FOR UPDATE SKIP LOCKED)
    2. publish    concurrently (at most max_in_flight unconfirmed), each with message id = event ID,
                  within publish_deadline (80 % of the lease) so no other relay can hold the row yet;
                  a permanent PublishError (too large, refused as addressed) parks its row at once
    3. crash point AFTER_PUBLISH_BEFORE_MARK (after each confirm, before the mark)
    4. mark       confirmed rows published in one statement; failed rows attempts + 1, last_error,
                  exponential backoff (parked at max_attempts) in one more statement

The loop (:meth:`Relay.run`) drains (passes until a claim comes back empty), then sleeps until a
NOTIFY arrives or ``poll_interval`` seconds pass, and runs the cleanup when it is due. SIGTERM
(:meth:`Relay.request_stop`) lets the in-flight pass finish (publish and mark) and ends the loop.

Delivery is at least once: a relay that dies after a confirm and before the mark leaves the row
claimed; when its lease runs out another relay (or the restarted one) publishes it again with the
same event ID, which consumers deduplicate. Ordering per partition key: see ``outbox_relay``'s
package docstring.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, runtime_checkable

import psycopg
from opentelemetry import propagate
from psycopg import AsyncConnection, sql
from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential

from consumer_kit import crashpoints
from consumer_kit.broker import OutgoingMessage, Publisher, PublishError
from consumer_kit.crashpoints import CrashPoint
from consumer_kit.embedded import database_url as resolve_database_url
from consumer_kit.errors import ConfigurationError, SimulatedCrash
from consumer_kit.faults import FaultKind, classify
from consumer_kit.health import Health
from consumer_kit.outbox import notify_channel
from consumer_kit.settings import Settings, redact_url
from consumer_kit.telemetry import describe_error, messaging_system
from consumer_kit.telemetry.metrics import record_published
from consumer_kit.telemetry.tracing import mark_failed, producer_span
from outbox_relay.counters import RelayCounters
from outbox_relay.listener import NotifyListener
from outbox_relay.reconnect import close_quietly, connect_error, log_retry
from outbox_relay.routing import Routing, UnknownDestination
from outbox_relay.settings import RelaySettings
from outbox_relay.store import ClaimedRow, Failure, OutboxStore

logger = logging.getLogger("outbox_relay")

_BACKOFF_FIRST = 0.5  # seconds between tries while the database is unavailable, doubling
_BACKOFF_MAX = 5.0

REQUIRED_MIGRATION = 102
"""The outbox migration that adds ``commit_seq`` (commit order per partition key)."""


@runtime_checkable
class _Connectable(Protocol):
    """A publisher that can open its broker connection before the first publish (RabbitMQ,
    memory): the relay's start-up probe. Publishers without it are probed by their first publish."""

    async def connect(self) -> None: ...


class Relay:
    """Publishes outbox rows of one schema to one broker.

    Args:
        settings: relay settings (database, broker, schema, batch, lease, backoff, ...).
        publisher: the broker publisher; default ``consumer_kit.brokers.open_publisher(settings)``
            (a publisher passed in is not closed by the relay).
        routing: destination map; default built from ``settings``.

    Attributes:
        counters: :class:`~outbox_relay.counters.RelayCounters`.
        relay_id: this relay's ``claimed_by`` name.
    """

    def __init__(
        self,
        settings: RelaySettings,
        *,
        publisher: Publisher | None = None,
        routing: Routing | None = None,
    ) -> None:
        self.settings = settings
        self.relay_id = settings.relay_id
        self.counters = RelayCounters()
        self.messaging_system = messaging_system(settings.broker_url)  # the spans' messaging.system
        self.routing = routing or Routing.from_settings(settings)
        self.store = OutboxStore.from_settings(settings)
        self.health = Health(
            stale_after=settings.relay_poll_interval + settings.relay_claim_timeout + _BACKOFF_MAX + 5.0,
            file=settings.relay_health_file,
            detail=lambda: {"counters": self.counters.snapshot(), "database_unavailable": self._outage},
            ready=lambda: self._outage is None,
        )
        self._publisher = publisher
        self._owns_publisher = publisher is None
        self._database_url: str | None = None
        self._conn: AsyncConnection[Any] | None = None
        self._listener: NotifyListener | None = None
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._next_cleanup = 0.0
        self._outage: str | None = None  # why the database is unavailable, while it is
        self._outage_backoff = _BACKOFF_FIRST

    # -- lifecycle -----------------------------------------------------------------------------

    async def run(self, *, once: bool = False) -> None:
        """Relay until :meth:`request_stop` (or, with ``once``, until nothing is claimable).

        Raises:
            ConfigurationError: the outbox is not migrated, or pending rows use destinations the
                destination map does not know.
        """
        await self.start(listen=not once)
        try:
            while not self._stop.is_set():
                self.health.beat()
                self._wake.clear()
                if once:  # errors propagate: a one-shot run must not report success
                    await self.relay_until_idle()
                    break
                await self._guarded(self.relay_until_idle)
                await self._guarded(self._cleanup_if_due, clears_outage=False)
                await self._wait_for_work()
        finally:
            await self.close()

    async def start(self, *, listen: bool = True) -> None:
        """Probe the database and the broker, check the schema and the destination map, LISTEN.

        PostgreSQL gets one connection attempt; the broker as long as the worker gives its first
        connection (RabbitMQ: 30 s, a refused login or missing vhost at once). So a wrong URL, a
        refused login or a broker that is down stops the relay here with the reason instead of
        retrying forever or looking healthy until the first event. Faults after start-up are
        retried, with the reason in the log.

        Raises:
            ConfigurationError: PostgreSQL refuses or cannot be reached (URL with the password
                redacted, and the server's reason); the outbox is not migrated; pending rows use
                destinations the destination map does not know.
            ConnectionError: the broker cannot be reached (the adapter's reason).
        """
        try:
            await self._start(listen)
        except BaseException:
            await self._release()  # nothing half-open is left behind
            raise

    async def _start(self, listen: bool) -> None:
        self._database_url = resolve_database_url(self.settings)
        try:
            self._conn = await self._open_connection()
        except psycopg.OperationalError as exc:
            raise ConfigurationError(
                f"cannot connect to PostgreSQL at {redact_url(self._database_url)}: {connect_error(exc)}"
            ) from None
        await self._check_schema(self._conn)
        self.routing.check(await self.store.pending_destinations(self._conn))
        if self._publisher is None:
            from consumer_kit.brokers import open_publisher

            self._publisher = open_publisher(self.settings)
        if isinstance(self._publisher, _Connectable):
            await self._publisher.connect()
        if listen:
            self._listener = NotifyListener(
                self._database_url, notify_channel(self.settings.db_schema), self._on_notify
            )
            self._listener.start()
            await self._listener.wait_connected(10.0)
        if self.settings.relay_health_port is not None:
            await self.health.serve(self.settings.relay_health_port)
        logger.info(
            "relay %s started: schema=%s broker=%s batch=%s in_flight=%s ordered=%s lease=%.1fs poll=%.1fs",
            self.relay_id, self.settings.db_schema, redact_url(self.settings.broker_url),
            self.settings.relay_batch_size, self.settings.relay_max_in_flight,
            self.settings.relay_ordered, self.settings.relay_claim_timeout,
            self.settings.relay_poll_interval,
        )

    def request_stop(self) -> None:
        """Finish the in-flight pass (publish and mark), then end :meth:`run` (SIGTERM)."""
        if not self._stop.is_set():
            logger.info("relay %s stopping after the in-flight batch", self.relay_id)
        self._stop.set()
        self._wake.set()

    async def close(self) -> None:
        """Stop listening, close the database connection and (if owned) the publisher, and log
        the run's counters at INFO (``relay <id> stopped: published=... claimed=...``)."""
        await self._release()
        totals = self.counters.snapshot()
        logger.info(
            "relay %s stopped: %s", self.relay_id,
            " ".join(f"{k}={v}" for k, v in sorted(totals.items()) if v) or "nothing relayed",
        )

    async def _release(self) -> None:
        if self._listener is not None:
            await self._listener.stop()
            self._listener = None
        await self.health.close()
        if self._conn is not None:
            await close_quietly(self._conn)
            self._conn = None
        if self._owns_publisher and self._publisher is not None:
            try:
                await self._publisher.close()
            except Exception as exc:  # noqa: BLE001 - closing is best effort
                logger.debug("closing the publisher failed (%s)", type(exc).__name__)
            self._publisher = None

    # -- the work ------------------------------------------------------------------------------

    async def relay_until_idle(self) -> int:
        """Run passes until a claim finds nothing claimable (an empty claim whose windows reached
        the end, see :meth:`OutboxStore.claim`) or a stop is requested; returns rows published.
        Each call looks again from the start: rows may have arrived, or become due, anywhere."""
        self.store.rescan()
        published = 0
        while not self._stop.is_set():
            claimed, confirmed = await self.relay_batch()
            published += confirmed
            if claimed == 0 and self.store.idle:  # else only the claim's windows were empty
                break
        return published

    async def relay_batch(self) -> tuple[int, int]:
        """One pass: claim, publish, mark. Returns ``(rows claimed, rows marked published)``.

        Raises:
            psycopg.OperationalError: the database connection was lost (rows stay claimed until
                their lease runs out, then any relay publishes them again with the same event ID).
            SimulatedCrash: an armed crash point fired (nothing is marked).
        """
        conn = await self._connection()
        rows = await self.store.claim(
            conn, self.settings.relay_batch_size, ordered=self.settings.relay_ordered
        )
        claimed_at = time.monotonic()
        if not rows:
            self.counters.add("empty_claims")
            return 0, 0
        self.counters.add("batches")
        self.counters.add("claimed", len(rows))
        self.counters.add("taken_over", sum(1 for r in rows if r.previous_owner is not None))
        for row in rows:
            if row.previous_owner is not None:
                logger.info(
                    "event_id=%s taken over from %s (lease expired)", row.event_id, row.previous_owner
                )

        deadline = self.settings.publish_deadline - (time.monotonic() - claimed_at)
        confirmed, failures = await self._publish_all(rows, deadline)

        marked = 0
        try:
            marked = await self.store.mark_published(conn, confirmed)
            parked = await self.store.mark_failed(conn, failures)
        except psycopg.Error:  # lost, read-only, ...: republished with the same IDs after the lease
            self.counters.add("mark_lost", len(confirmed))
            raise
        retried = {r.id for r in rows if r.attempts > 0 or r.previous_owner is not None}
        self.counters.add("published", len(confirmed))
        self.counters.add("republished", sum(1 for i in confirmed if i in retried))
        self.counters.add("publish_failed", len(failures))
        self.counters.add("parked", len(parked))
        if failures:  # one line per batch: an outage must not flood the log
            logger.warning(
                "%s of %s publishes failed (backing off); first error: %s",
                len(failures), len(rows), failures[0].error,
            )
        event_ids = {row.id: row.event_id for row in rows}
        for failure in failures:
            if failure.id in parked:
                logger.error(
                    "event_id=%s parked %s: %s", event_ids.get(failure.id),
                    "at once" if failure.park else "after its last attempt", failure.error,
                )
        logger.debug(
            "batch claimed=%s published=%s failed=%s parked=%s",
            len(rows), len(confirmed), len(failures), len(parked),
        )
        return len(rows), marked

    async def cleanup_published(self) -> int:
        """Delete rows published longer than ``relay_retention`` seconds ago, in bounded batches
        of ``relay_cleanup_batch`` (short statements, no table rewrite); returns rows deleted."""
        conn = await self._connection()
        deleted = 0
        while not self._stop.is_set():
            n = await self.store.delete_published(
                conn, older_than=self.settings.relay_retention, limit=self.settings.relay_cleanup_batch
            )
            deleted += n
            self.counters.add("cleanup_deleted", n)
            if n < self.settings.relay_cleanup_batch:
                break
            await asyncio.sleep(0)  # let the listener and signals in between batches
        if deleted:
            logger.info("cleanup deleted %s published rows", deleted)
        return deleted

    # -- publishing ----------------------------------------------------------------------------

    async def _publish_all(
        self, rows: list[ClaimedRow], deadline: float
    ) -> tuple[list[int], list[Failure]]:
        """Publish ``rows`` concurrently; returns (confirmed ids, failures). Publishes still
        unconfirmed after ``deadline`` seconds are cancelled and count as failures."""
        slots = asyncio.Semaphore(self.settings.relay_max_in_flight)
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
            message = self._outgoing(row, exchange, routing_key, stored)
            assert self._publisher is not None
            try:
                await self._publisher.publish(message)
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

    def _outgoing(
        self, row: ClaimedRow, exchange: str, routing_key: str, stored: dict[str, str]
    ) -> OutgoingMessage:
        """The broker message for ``row``: message id = event ID; headers = the row's headers plus
        event-id, message-type, operation-scope/-key, correlation-id, partition-key,
        publish-attempt, relay-id and the trace context (W3C traceparent where a tracer is set)."""
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
        )

    # -- waiting, cleanup, connections -----------------------------------------------------------

    def _on_notify(self) -> None:
        self._wake.set()

    async def _wait_for_work(self) -> None:
        try:
            await asyncio.wait_for(self._wake.wait(), self.settings.relay_poll_interval)
        except TimeoutError:
            self.counters.add("wakeups_poll")
            return
        if not self._stop.is_set():
            self.counters.add("wakeups_notify")

    async def _cleanup_if_due(self) -> None:
        now = time.monotonic()
        if now >= self._next_cleanup:
            self._next_cleanup = now + self.settings.relay_cleanup_interval
            await self.cleanup_published()

    async def _guarded(self, step: Callable[[], Awaitable[Any]], *, clears_outage: bool = True) -> None:
        """Run ``step``. An unavailable database (connection lost, read-only after a fail-over,
        shutting down: an environment fault, :mod:`consumer_kit.faults`) is logged once per
        outage, the connection dropped, and the loop backs off (0.5 s doubling up to 5 s) before
        it reconnects; the relay reports not-ready meanwhile. Rows claimed before the fault are
        published again, with the same event ID, once their lease runs out. Only a step that
        always reaches the database (``clears_outage``) ends an outage."""
        try:
            await step()
        except psycopg.Error as exc:
            if classify(exc) is not FaultKind.ENVIRONMENT and not isinstance(exc, psycopg.OperationalError):
                raise
            self.counters.add("db_errors")
            reason = describe_error(exc)
            if self._outage is None:
                logger.warning("database unavailable (%s); backing off and reconnecting", reason)
            else:
                logger.info("database still unavailable (%s); next try in %.1f s", reason, self._outage_backoff)
            self._outage = reason
            if self._conn is not None:
                await close_quietly(self._conn)
                self._conn = None
            await self._sleep_unless_stopped(self._outage_backoff)
            self._outage_backoff = min(self._outage_backoff * 2, _BACKOFF_MAX)
            return
        if not clears_outage:
            return  # the step may not have reached the database (cleanup not due): proves nothing
        if self._outage is not None:
            logger.info("database available again")
        self._outage = None
        self._outage_backoff = _BACKOFF_FIRST

    async def _connection(self) -> AsyncConnection[Any]:
        """The relay's autocommit connection, (re)opened with exponential backoff (tenacity)
        until it works or a stop is requested.

        Raises:
            psycopg.OperationalError: still failing when a stop was requested.
        """
        if self._conn is not None and not self._conn.closed:
            return self._conn
        assert self._database_url is not None, "start() first"
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(psycopg.OperationalError),
            wait=wait_exponential(multiplier=0.2, max=10.0),
            stop=lambda _state: self._stop.is_set(),
            sleep=self._sleep_unless_stopped,
            before_sleep=log_retry("database connect"),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                self._conn = await self._open_connection()
        assert self._conn is not None
        return self._conn

    async def _open_connection(self) -> AsyncConnection[Any]:
        """One attempt at the relay's autocommit connection.

        Raises:
            psycopg.OperationalError: refused or unreachable.
        """
        assert self._database_url is not None, "start() first"
        return await AsyncConnection.connect(
            self._database_url, autocommit=True, connect_timeout=10, application_name="outbox-relay"
        )

    async def _sleep_unless_stopped(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._stop.wait(), seconds)
        except TimeoutError:
            pass

    async def _check_schema(self, conn: AsyncConnection[Any]) -> None:
        query = sql.SQL("SELECT version FROM {} WHERE version = %s").format(
            sql.Identifier(self.settings.db_schema, "schema_migrations")
        )
        try:
            cur = await conn.execute(query, (REQUIRED_MIGRATION,))
            found = await cur.fetchone()
        except psycopg.errors.UndefinedTable:
            found = None
        if found is None:
            raise ConfigurationError(
                f"schema {self.settings.db_schema!r} has no up-to-date outbox (migration "
                f"{REQUIRED_MIGRATION} missing): run `consumer-kit migrate` first"
            )


async def relay_pending(settings: Settings, publisher: Publisher) -> int:
    """Publish every claimable row once through ``publisher`` and return rows published
    (``outbox-relay --once`` in-process; used by ``consumer-kit demo``)."""
    relay_settings = (
        settings if isinstance(settings, RelaySettings)
        else RelaySettings(**settings.model_dump())
    )
    relay = Relay(relay_settings, publisher=publisher)
    await relay.run(once=True)
    return relay.counters["published"]
