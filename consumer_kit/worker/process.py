"""A worker process: subscribes an :class:`App`'s queues and runs deliveries through the runtime.

* **Concurrency** is one limit per process, across all its queues (``concurrency``); the pool is
  sized from it. Each queue may hand out ``prefetch`` deliveries ahead (default: concurrency).
* **Environment faults** (docs/explanation/faults-and-attempts.md): when a delivery meets an unavailable
  database, the worker *pauses*: it stops the broker from handing out deliveries, gives back the
  ones it holds (uncounted), reports not-ready, and probes the database with backoff (up to
  ``probe_backoff_max`` seconds apart) until a new session can write; then it replaces its pooled
  connections and resumes on its own.
* **Poison isolation**: a redelivered message runs alone (see :mod:`consumer_kit.pipeline.admission`);
  the other deliveries the broker hands out meanwhile wait (prefetch bounds them).
* **Health**: ``health_file`` is touched every second while the loop runs; ``health_port`` serves
  ``/live`` and ``/ready`` (not ready while paused or while the broker connection is down).
* **Graceful shutdown** (SIGTERM/SIGINT): stop taking deliveries, let in-flight ones finish for up
  to ``shutdown_timeout`` seconds, give the rest back (uncounted, not as redeliveries), close
  connections, log a summary, return normally (exit code 0).
* **Outcome counts** per operation type and minute go to the ledger's ``outcome_counts`` table
  (:mod:`consumer_kit.ledger.outcome_counts`) in one statement every ``summary_interval`` and once
  at shutdown, never per delivery; a failed write is logged and retried next interval, and what a
  killed process (SIGKILL) had not written yet is lost.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import signal
import time
from collections.abc import Callable
from typing import Any

from psycopg_pool import AsyncConnectionPool

from consumer_kit.app import App
from consumer_kit.broker import Consumer, Delivery
from consumer_kit.broker.registry import open_consumer
from consumer_kit.codec import headers as own_headers
from consumer_kit.codec.redaction import redact_url
from consumer_kit.db.durability import describe_durability
from consumer_kit.db.embedded import database_url
from consumer_kit.db.pool import open_pool, probe_writable
from consumer_kit.errors import ConfigurationError, SimulatedCrash
from consumer_kit.ledger import migrate, missing_migrations
from consumer_kit.ledger.mark_keys import install_mark_keys
from consumer_kit.ledger.migrations import run_startup_hooks
from consumer_kit.ledger.outcome_counts import OutcomeCountBook
from consumer_kit.model.outcomes import DeliveryReport
from consumer_kit.ops.gauges import watch_paused
from consumer_kit.pipeline.admission import Admission
from consumer_kit.pipeline.batching import Batcher, batch_setting
from consumer_kit.pipeline.runtime import Runtime, RuntimeHooks
from consumer_kit.resilience.backoff import Backoff
from consumer_kit.resilience.supervised import Supervised
from consumer_kit.settings import Settings
from consumer_kit.telemetry.metrics import record_pause
from consumer_kit.telemetry.minute_counts import MinuteCounts
from consumer_kit.worker.health import Health

logger = logging.getLogger("consumer_kit.worker")

_HEARTBEAT = 1.0  # seconds between liveness beats
_FIRST_PROBE_DELAY = 0.5  # seconds; doubles up to probe_backoff_max
_FLUSH_TIMEOUT = 5.0  # seconds one write of the outcome counts may take (then retried next time)


class Worker:
    """Runs ``app`` until stopped.

    Args:
        app: queue -> handler routes.
        settings: defaults to ``Settings()`` read from the environment.
        consumer: a broker consumer; default: the adapter for ``settings.broker_url``.
        migrate_schema: create/upgrade the ledger and outbox at start (always on for the embedded
            database, where there is no operator to run ``consumer-kit migrate``).
        on_report: called with every delivery's report.

    Attributes:
        pauses: how many times the worker paused for an unavailable database.
        health: liveness and readiness (see :mod:`consumer_kit.worker.health`).
    """

    def __init__(
        self,
        app: App,
        settings: Settings | None = None,
        *,
        consumer: Consumer | None = None,
        migrate_schema: bool = False,
        on_report: Callable[[DeliveryReport], None] | None = None,
    ) -> None:
        self.app = app
        self.settings = settings or Settings()
        self._consumer = consumer
        self._migrate = migrate_schema or self.settings.database_url is None
        self._stop = asyncio.Event()
        self._inflight: set[asyncio.Task[Any]] = set()
        self.runtime: Runtime | None = None
        self.started = asyncio.Event()
        self._on_report = on_report
        self.admission = Admission(self.settings.concurrency, on_change=self._hold_consumers)
        watch_paused(self.admission)  # gauge consumer_kit.worker.paused
        self.pauses = 0
        self._database_url: str | None = None
        self._pool: AsyncConnectionPool | None = None
        self._probe: Supervised | None = None
        self._consumers_held = False
        self._holding = asyncio.Event()  # wakes the task that pauses and resumes the consumer
        self._consumer_stopped = asyncio.Event()  # set while the consumer is paused
        self.health = Health(
            stale_after=10 * _HEARTBEAT, file=self.settings.health_file,
            detail=self._health_detail, ready=self._ready,
        )

    def stop(self) -> None:
        """Ask the worker to shut down gracefully (safe from a signal handler)."""
        self._stop.set()

    async def run(self) -> None:
        """Start, serve until :meth:`stop` or SIGTERM/SIGINT, then shut down gracefully.

        Raises:
            ConfigurationError: no queues, schema missing (run ``consumer-kit migrate``), bad URL.
        """
        if not self.app.queues:
            raise ConfigurationError(f"app {self.app.name!r} subscribes no queue")
        self._database_url = database_url(self.settings)
        pool = self._pool = await open_pool(
            self.settings, self._database_url, search_path=self.settings.search_path
        )
        try:
            await self._prepare_schema(pool)
            hooks = RuntimeHooks(
                on_environment_fault=self._on_environment_fault, before_release=self._until_consumer_stopped,
                observers=() if self._on_report is None else (self._on_report,),
            )
            self.runtime = Runtime(self.app, pool, self.settings, admission=self.admission, hooks=hooks)
            self.runtime.counters.minutes = MinuteCounts()
            consumer = self._consumer = self._consumer or open_consumer(self.settings)
            background: list[Supervised] = []
            try:
                for queue in self.app.queues:
                    size, wait = batch_setting(self.app, queue)
                    if size > 1:
                        # Enough deliveries ahead to fill a batch in every slot (the batch path,
                        # docs/how-to/batches.md).
                        batcher = Batcher(
                            self.runtime.process_batch, size=size, wait=wait, limit=self.settings.concurrency
                        )
                        prefetch = max(self.settings.effective_prefetch, size * self.settings.concurrency)
                        await consumer.subscribe(queue, functools.partial(self._on_batched, batcher), prefetch=prefetch)
                        continue
                    await consumer.subscribe(
                        queue, self._on_delivery, prefetch=self.settings.effective_prefetch
                    )
                self._install_signal_handlers()
                if self.settings.health_port is not None:
                    await self.health.serve(self.settings.health_port, self.settings.health_host)
                background = [
                    Supervised("consumer-kit summary", self._log_summaries).start(),
                    Supervised("consumer-kit heartbeat", self._heartbeat).start(),
                    Supervised("consumer-kit consumer hold", functools.partial(self._apply_holds, consumer)).start(),
                ]
                logger.info(
                    "worker %s consuming %s with concurrency %s, prefetch %s per queue (broker %s, schema %s)",
                    self.runtime.worker_id, ", ".join(self.app.queues), self.settings.concurrency,
                    self.settings.effective_prefetch, redact_url(self.settings.broker_url),
                    self.settings.db_schema,
                )
                # What start-up made (modules, the app, settings, the pool) lives as long as the
                # process: out of the collector's generations, its full collections scan only what
                # deliveries leave behind (docs/scaling.md, "CPU per delivery").
                gc.freeze()
                self.started.set()
                await self._stop.wait()
                logger.info("shutting down: %s deliveries in flight", len(self._inflight))
                await consumer.stop_consuming()
                await self._drain()
            finally:
                if self._probe is not None:
                    self._probe.cancel()
                await asyncio.gather(*(task.stop() for task in background))
                await consumer.close()
                await self.health.close()
                await self._write_outcome_counts()  # the last interval's, before the pool closes
        finally:
            if self.runtime is not None:
                await self.runtime.close()
            await pool.close()
        totals = self.runtime.counters.snapshot() if self.runtime else {}
        logger.info(
            "worker stopped: %s",
            " ".join(f"{k}={v}" for k, v in sorted(totals.items())) or "no deliveries",
        )

    # -- deliveries ------------------------------------------------------------------------------

    async def _on_delivery(self, delivery: Delivery) -> None:
        assert self.runtime is not None
        task = asyncio.current_task()
        assert task is not None
        self._inflight.add(task)
        try:
            await self.runtime.process(delivery)
        except SimulatedCrash as crash:
            # An armed crash point: behave as a dead process would, leaving the delivery unsettled.
            logger.warning("crash point %s fired: leaving message_id=%s unsettled", crash, delivery.message_id)
        finally:
            self._inflight.discard(task)

    async def _on_batched(self, batcher: Batcher, delivery: Delivery) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._inflight.add(task)
        try:
            await batcher.add(delivery)
        except SimulatedCrash as crash:
            logger.warning("crash point %s fired: leaving message_id=%s unsettled", crash, delivery.message_id)
        finally:
            self._inflight.discard(task)

    async def _drain(self) -> None:
        if not self._inflight:
            return
        _, pending = await asyncio.wait(set(self._inflight), timeout=self.settings.shutdown_timeout)
        for task in pending:
            task.cancel()  # the runtime rolls back and releases the delivery (uncounted)
        if pending:
            logger.warning(
                "released %s deliveries still running after %.0f s", len(pending), self.settings.shutdown_timeout
            )
            await asyncio.wait(pending, timeout=self.settings.settle_timeout)

    # -- environment faults: pause, probe, resume --------------------------------------------------

    def _on_environment_fault(self, reason: str) -> None:
        if self._stop.is_set() or not self.admission.pause(reason):
            return
        self.pauses += 1
        record_pause()
        logger.warning("paused: %s; giving deliveries back and probing the database", reason)
        self._probe = Supervised("consumer-kit probe", self._probe_until_writable).start()

    async def _probe_until_writable(self) -> None:
        assert self._database_url is not None and self._pool is not None and self.runtime is not None
        paused_at = time.monotonic()
        cap = self.settings.probe_backoff_max
        probes, backoff = 0, Backoff(first=min(_FIRST_PROBE_DELAY, cap), cap=cap)
        while not self._stop.is_set():
            probes += 1
            await asyncio.sleep(backoff.delay(probes))
            reason = await probe_writable(self._database_url, timeout=self.settings.statement_timeout)
            if reason is None:
                break
            logger.info("database still unavailable (%s); next probe in %.1f s", reason, backoff.delay(probes + 1))
        else:
            return
        # Sessions opened during the outage may be read-only or dead: start from new ones.
        await self._pool.drain()
        await self.runtime.flush_markers()
        self.admission.resume()
        logger.info("resumed: the database accepts writes again after %.1f s", time.monotonic() - paused_at)

    def _hold_consumers(self, hold: bool) -> None:
        """Admission says whether the broker should stop handing out deliveries (paused);
        :meth:`_apply_holds` makes the consumer follow, one call at a time."""
        self._consumers_held = hold
        self._holding.set()

    async def _until_consumer_stopped(self) -> None:
        """Before a delivery is given back: wait (at most ``settle_timeout`` seconds) until the
        consumer no longer hands out deliveries, if the worker is pausing it."""
        if not self._consumers_held or self._consumer_stopped.is_set():
            return
        try:
            async with asyncio.timeout(self.settings.settle_timeout):
                await self._consumer_stopped.wait()
        except TimeoutError:
            logger.warning("the consumer did not pause within %.0f s; releasing anyway", self.settings.settle_timeout)

    async def _apply_holds(self, consumer: Consumer) -> None:
        applied = False
        while True:
            await self._holding.wait()
            self._holding.clear()
            wanted = self._consumers_held
            if wanted == applied:
                continue
            try:
                if wanted:
                    await consumer.pause()
                    self._consumer_stopped.set()
                else:
                    self._consumer_stopped.clear()
                    await consumer.resume()
                applied = wanted
            except Exception as exc:  # noqa: BLE001 - retried on the next change; deliveries are given back meanwhile
                logger.warning("consumer %s failed (%s)", "pause" if wanted else "resume", type(exc).__name__)
                await asyncio.sleep(1.0)
                self._holding.set()

    # -- health ------------------------------------------------------------------------------------

    def _ready(self) -> bool:
        return (
            self.started.is_set() and not self._stop.is_set() and not self.admission.paused
            and (self._consumer is None or self._consumer.ready)
        )

    def _health_detail(self) -> dict[str, Any]:
        return {
            "paused": self.admission.paused_reason,
            "running": self.admission.running,
            "pauses": self.pauses,
            "outcomes": self.runtime.counters.snapshot() if self.runtime else {},
        }

    async def _heartbeat(self) -> None:
        while True:
            self.health.beat()
            await asyncio.sleep(_HEARTBEAT)

    async def _log_summaries(self) -> None:
        """Every ``summary_interval`` seconds with activity, one INFO line of outcome counts, so
        routine deliveries (logged at DEBUG one by one) stay visible without a line each."""
        assert self.runtime is not None
        counters = self.runtime.counters
        previous: dict[str, int] = {}
        while True:
            await asyncio.sleep(self.settings.summary_interval)
            now = counters.snapshot()
            if unverified := sum(own_headers.UNVERIFIED.values()):  # forged marks, ignored
                now["marks_unverified"] = unverified
            delta = {k: v - previous.get(k, 0) for k, v in now.items() if v != previous.get(k, 0)}
            if delta:
                logger.info(
                    "last %.0f s: %s (totals: %s)", self.settings.summary_interval,
                    " ".join(f"{k}={v}" for k, v in sorted(delta.items())),
                    " ".join(f"{k}={v}" for k, v in sorted(now.items())),
                )
            previous = now
            await self._write_outcome_counts()

    async def _write_outcome_counts(self) -> None:
        """Add the outcome counts since the last write to the ledger's ``outcome_counts`` in one
        statement. Off the deliveries' path (the summary task and shutdown call it); a failure is
        logged and the counts are kept for the next call."""
        minutes = self.runtime.counters.minutes if self.runtime else None
        if minutes is None or self._pool is None or not len(minutes):
            return
        counts = minutes.take()
        try:
            async with asyncio.timeout(_FLUSH_TIMEOUT):
                async with self._pool.connection() as conn:
                    await OutcomeCountBook(self.settings.db_schema).add(conn, counts)
        except asyncio.CancelledError:
            minutes.give_back(counts)
            raise
        except Exception as exc:  # noqa: BLE001 - any failure: keep the counts, try next interval
            minutes.give_back(counts)
            logger.warning(
                "outcome counts not written (%s); %s minute counts kept for the next interval",
                type(exc).__name__, len(minutes),
            )

    # -- start-up --------------------------------------------------------------------------------
    # Hooks (App.on_startup) run one worker at a time: run_startup_hooks.

    async def _prepare_schema(self, pool: AsyncConnectionPool) -> None:
        async with pool.connection() as conn:
            if self._migrate:
                await migrate(conn, self.settings.db_schema)
            elif missing := await missing_migrations(conn, self.settings.db_schema):
                raise ConfigurationError(
                    f"schema {self.settings.db_schema!r} lacks ledger migrations "
                    f"{', '.join(map(str, missing))}: run `consumer-kit migrate` first"
                )
            await install_mark_keys(conn, self.settings)
            logger.info("durability: %s", await describe_durability(conn))
            await run_startup_hooks(conn, self.settings.db_schema, self.app.startup)

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self.stop)
            except (NotImplementedError, RuntimeError):  # not the main thread
                pass
