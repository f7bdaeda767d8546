"""A worker process: subscribes an :class:`App`'s queues and runs deliveries through the runtime.

Graceful shutdown (SIGTERM/SIGINT): stop taking deliveries, let in-flight ones finish for up to
``shutdown_timeout`` seconds, release the rest back to the broker (unsettled: redelivered), close
connections, return normally (exit code 0).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from typing import Any

from psycopg_pool import AsyncConnectionPool

from consumer_kit.app import App
from consumer_kit.broker import Consumer, Delivery
from consumer_kit.brokers import open_consumer
from consumer_kit.embedded import database_url
from consumer_kit.errors import ConfigurationError, SimulatedCrash
from consumer_kit.ledger import migrate, schema_ready
from consumer_kit.outcomes import DeliveryReport
from consumer_kit.runtime import Runtime, open_pool
from consumer_kit.settings import Settings, redact_url

logger = logging.getLogger("consumer_kit.worker")


class Worker:
    """Runs ``app`` until stopped.

    Args:
        app: queue -> handler routes.
        settings: defaults to ``Settings()`` read from the environment.
        consumer: a broker consumer; default: the adapter for ``settings.broker_url``.
        migrate_schema: create/upgrade the ledger and outbox at start (always on for the embedded
            database, where there is no operator to run ``consumer-kit migrate``).
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
        pool = await open_pool(
            self.settings, database_url(self.settings), search_path=self.settings.search_path
        )
        try:
            await self._prepare_schema(pool)
            self.runtime = Runtime(self.app, pool, self.settings)
            if self._on_report is not None:
                self.runtime.observers.append(self._on_report)
            consumer = self._consumer or open_consumer(self.settings)
            try:
                for queue in self.app.queues:
                    await consumer.subscribe(queue, self._on_delivery, prefetch=self.settings.concurrency)
                self._install_signal_handlers()
                logger.info(
                    "worker %s consuming %s with concurrency %s (broker %s, schema %s)",
                    self.runtime.worker_id, ", ".join(self.app.queues), self.settings.concurrency,
                    redact_url(self.settings.broker_url), self.settings.db_schema,
                )
                self.started.set()
                summary = asyncio.create_task(self._log_summaries(), name="consumer-kit-summary")
                await self._stop.wait()
                summary.cancel()
                logger.info("shutting down: %s deliveries in flight", len(self._inflight))
                await consumer.stop_consuming()
                await self._drain()
            finally:
                await consumer.close()
        finally:
            await pool.close()
        logger.info("worker stopped")

    async def _log_summaries(self) -> None:
        """Every ``summary_interval`` seconds with activity, one INFO line of outcome counts, so
        routine deliveries (logged at DEBUG one by one) stay visible without a line each."""
        assert self.runtime is not None
        counters = self.runtime.counters
        previous: dict[str, int] = {}
        while True:
            await asyncio.sleep(self.settings.summary_interval)
            now = counters.snapshot()
            delta = {k: v - previous.get(k, 0) for k, v in now.items() if v != previous.get(k, 0)}
            if delta:
                logger.info(
                    "last %.0f s: %s (totals: %s)", self.settings.summary_interval,
                    " ".join(f"{k}={v}" for k, v in sorted(delta.items())),
                    " ".join(f"{k}={v}" for k, v in sorted(now.items())),
                )
            previous = now

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

    async def _drain(self) -> None:
        if not self._inflight:
            return
        _, pending = await asyncio.wait(set(self._inflight), timeout=self.settings.shutdown_timeout)
        for task in pending:
            task.cancel()  # the runtime releases the delivery and rolls back its transaction
        if pending:
            logger.warning("released %s deliveries still running after %.0f s", len(pending), self.settings.shutdown_timeout)
            await asyncio.wait(pending, timeout=self.settings.settle_timeout)

    async def _prepare_schema(self, pool: AsyncConnectionPool) -> None:
        async with pool.connection() as conn:
            if self._migrate:
                await migrate(conn, self.settings.db_schema)
            elif not await schema_ready(conn, self.settings.db_schema):
                raise ConfigurationError(
                    f"schema {self.settings.db_schema!r} has no ledger: run `consumer-kit migrate` first"
                )
            for startup in self.app.startup:
                await startup(conn)

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self.stop)
            except (NotImplementedError, RuntimeError):  # not the main thread
                pass
