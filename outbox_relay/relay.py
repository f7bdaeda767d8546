"""The relay loop: wait for work, claim a batch, publish it with confirms, mark it, repeat.

One pass (:meth:`Relay.relay_batch`)::

    1. claim      up to batch_size rows under a lease (store.claim; FOR UPDATE SKIP LOCKED)
    2. publish    in chunks of max_in_flight, each chunk's confirms awaited together (RabbitMQ: one
                  write per chunk), each message with message id = event ID,
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
from typing import Any

import psycopg
from psycopg import AsyncConnection

from consumer_kit.broker.publishing import Publisher
from consumer_kit.codec.redaction import redact_url
from consumer_kit.db.embedded import database_url as resolve_database_url
from consumer_kit.db.pooler import connect_options
from consumer_kit.errors import ConfigurationError
from consumer_kit.ledger.mark_keys import install_mark_keys
from consumer_kit.outbox import notify_channel
from consumer_kit.pipeline.faults import FaultKind, classify
from consumer_kit.settings import Settings
from consumer_kit.telemetry import describe_error, messaging_system
from consumer_kit.worker.health import Health

from .binding import check_binding
from .counters import RelayCounters
from .listener import NotifyListener, listen_url
from .publishing import Connectable, RowPublisher
from .reconnect import (
    close_quietly,
    connect_error,
    connect_until_stopped,
    open_connection,
    sleep_unless_stopped,
)
from .routing import Routing
from .settings import RelaySettings
from .store import OutboxStore

logger = logging.getLogger("consumer_kit.outbox_relay")

_BACKOFF_FIRST = 0.5  # seconds between tries while the database is unavailable, doubling
_BACKOFF_MAX = 5.0
CLEANUP_INTERVAL = 60.0
"""Seconds between the relay's passes deleting published rows past ``RELAY_RETENTION`` (each pass
deletes in statements of ``RELAY_CLEANUP_BATCH`` rows); was ``CONSUMER_KIT_RELAY_CLEANUP_INTERVAL``."""


class Relay:
    """Publishes outbox rows of one schema to one broker.

    Args:
        settings: relay settings (database, broker, schema, batch, lease, backoff, ...).
        publisher: the broker publisher; default ``consumer_kit.broker.registry.open_publisher(settings)``
            (a publisher passed in is not closed by the relay).
        routing: destination map; default built from ``settings``.

    Attributes:
        counters: :class:`~consumer_kit.outbox_relay.counters.RelayCounters`.
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
        self._rows: RowPublisher | None = None  # step 2 of a pass, once the publisher is open
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
            self._conn = await open_connection(self._database_url, **connect_options(self.settings))
        except psycopg.OperationalError as exc:
            raise ConfigurationError(
                f"cannot connect to PostgreSQL at {redact_url(self._database_url)}: {connect_error(exc)}"
            ) from None
        await self.store.check_schema(self._conn)
        await check_binding(self._conn, self.settings.db_schema, self.settings.broker_url, relay_id=self.relay_id)
        await install_mark_keys(self._conn, self.settings)  # SQS copies carry a signed message-id mark
        self.routing.check(await self.store.pending_destinations(self._conn))
        if self._publisher is None:
            from consumer_kit.broker.registry import open_publisher

            self._publisher = open_publisher(self.settings)
        if isinstance(self._publisher, Connectable):
            await self._publisher.connect()
        self._rows = RowPublisher(
            self._publisher, self.routing, self.counters, relay_id=self.relay_id,
            messaging_system=self.messaging_system, max_in_flight=self.settings.relay_max_in_flight,
        )
        url = listen_url(self.settings, self._database_url) if listen else None
        if url is not None:
            self._listener = NotifyListener(url, notify_channel(self.settings.db_schema), self._on_notify)
            self._listener.start()
            await self._listener.wait_connected(10.0)
        if self.settings.relay_health_port is not None:
            await self.health.serve(self.settings.relay_health_port, self.settings.relay_health_host)
        logger.info(
            "relay %s started: schema=%s broker=%s batch=%s in_flight=%s ordered=%s lease=%.1fs poll=%.1fs"
            " wakeup=%s", self.relay_id, self.settings.db_schema, redact_url(self.settings.broker_url),
            self.settings.relay_batch_size, self.settings.relay_max_in_flight, self.settings.relay_ordered,
            self.settings.relay_claim_timeout, self.settings.relay_poll_interval,
            f"LISTEN on {redact_url(url)}" if url else "polling",
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
        assert self._rows is not None, "start() first"
        confirmed, failures = await self._rows.publish_all(rows, deadline)

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

    # -- waiting, cleanup, the database -----------------------------------------------------------

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
            self._next_cleanup = now + CLEANUP_INTERVAL
            await self.cleanup_published()

    async def _guarded(self, step: Callable[[], Awaitable[Any]], *, clears_outage: bool = True) -> None:
        """Run ``step``. An unavailable database (connection lost, read-only after a fail-over,
        shutting down: an environment fault, :mod:`consumer_kit.pipeline.faults`) is logged once per
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
            await sleep_unless_stopped(self._stop, self._outage_backoff)
            self._outage_backoff = min(self._outage_backoff * 2, _BACKOFF_MAX)
            return
        if not clears_outage:
            return  # the step may not have reached the database (cleanup not due): proves nothing
        if self._outage is not None:
            logger.info("database available again")
        self._outage = None
        self._outage_backoff = _BACKOFF_FIRST

    async def _connection(self) -> AsyncConnection[Any]:
        """The relay's autocommit connection, reopened (with backoff) when it was lost.

        Raises:
            psycopg.OperationalError: still failing when a stop was requested.
        """
        if self._conn is None or self._conn.closed:
            assert self._database_url is not None, "start() first"
            self._conn = await connect_until_stopped(self._database_url, self._stop, **connect_options(self.settings))
        return self._conn


async def relay_pending(settings: Settings, publisher: Publisher) -> int:
    """Publish every claimable row once through ``publisher`` and return rows published
    (``outbox-relay --once`` in-process; used by the demo, ``examples/invoices/demo.py``)."""
    relay_settings = (
        settings if isinstance(settings, RelaySettings)
        else RelaySettings(**settings.model_dump())
    )
    relay = Relay(relay_settings, publisher=publisher)
    await relay.run(once=True)
    return relay.counters["published"]
