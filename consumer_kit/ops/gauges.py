"""Observable gauges: pressure read from the database on an interval, and whether a worker is paused.

OpenTelemetry calls gauge callbacks synchronously at each collection (a Prometheus scrape, an OTLP
export), where no query can run, so a :class:`DatabaseGauges` refreshes a snapshot every
``interval`` seconds on a connection of its own and the callbacks report the last snapshot. Its
queries are bounded (:class:`~consumer_kit.ops.stats.StatsReader`: partial indexes only, outbox counts
capped), never run per delivery, and a failed refresh keeps the previous values (logged once at
WARNING until a refresh succeeds again).

The worker reads the ledger gauges (``ledger=True``), the relay the outbox gauges
(``outbox=True``); several processes on one schema report the same values, so dashboards and
alerts take ``max`` over them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import psycopg
from opentelemetry.metrics import CallbackOptions, Observation

from consumer_kit.ops.stats import LedgerPressure, OutboxPressure, StatsReader
from consumer_kit.resilience.supervised import Supervised
from consumer_kit.telemetry.describe import describe_error
from consumer_kit.telemetry.metrics import BY_NAME, OPERATION_TYPE, SCHEMA, meter

logger = logging.getLogger("consumer_kit.telemetry")

DEFAULT_INTERVAL = 15.0
"""Seconds between refreshes (Prometheus' default scrape interval); the CLIs pass the ``console``
group's ``CONSUMER_KIT_METRICS_INTERVAL`` instead."""

class _Pausable(Protocol):
    @property
    def paused(self) -> bool: ...


_sources: weakref.WeakSet[DatabaseGauges] = weakref.WeakSet()
_pausables: weakref.WeakSet[Any] = weakref.WeakSet()


def watch_paused(admission: _Pausable) -> None:
    """Report ``admission.paused`` (1 or 0) as ``consumer_kit.worker.paused`` while it lives."""
    _pausables.add(admission)


class DatabaseGauges:
    """Refreshes the database gauges of one schema every ``interval`` seconds while running.

    Use as ``async with DatabaseGauges(url, schema, ledger=True):``, or call :meth:`refresh`
    yourself (tests, a scrape-driven loop).

    Args:
        database_url: a PostgreSQL URL (one autocommit connection, reopened after a failure).
        schema: the ledger's and outbox's schema.
        ledger: report ``consumer_kit.ledger.*`` (the worker).
        outbox: report ``consumer_kit.outbox.pending``, ``.pending.oldest_age``, ``.parked`` (the relay).
        max_attempts: the relay's ``relay_max_attempts`` (what counts as parked).
        interval: seconds between refreshes (> 0; default :data:`DEFAULT_INTERVAL`).
        statement_timeout: seconds each refresh may take.
        connect: more psycopg connect arguments (``consumer_kit.db.pooler.connect_options``).
    """

    def __init__(
        self, database_url: str, schema: str, *, ledger: bool = False, outbox: bool = False,
        max_attempts: int = 20, interval: float | None = None, statement_timeout: float = 5.0,
        connect: dict[str, Any] | None = None,
    ) -> None:
        interval = DEFAULT_INTERVAL if interval is None else interval
        if interval <= 0:
            raise ValueError("interval must be > 0 seconds")
        self.database_url = database_url
        self._connect_options = connect or {}  # more psycopg connect arguments (db.pooler.connect_options)
        self.schema = schema
        self.ledger = ledger
        self.outbox = outbox
        self.interval = interval
        self.statement_timeout = statement_timeout
        self.reader = StatsReader(schema, max_attempts=max_attempts)
        self.ledger_values: list[LedgerPressure] = []
        self.outbox_values: OutboxPressure | None = None
        self._types_seen: set[str] = set()  # reported as 0 once they have nothing, not dropped
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._task: Supervised | None = None
        self._failing = False

    async def __aenter__(self) -> DatabaseGauges:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def start(self) -> None:
        """Register the gauges and refresh them every ``interval`` seconds in the background."""
        _sources.add(self)
        if self._task is None:
            self._task = Supervised("consumer-kit gauges", self._run).start()

    async def stop(self) -> None:
        """Stop refreshing, unregister, close the connection."""
        _sources.discard(self)
        if self._task is not None:
            await self._task.stop()
            self._task = None
        if self._conn is not None:
            with contextlib.suppress(Exception):
                await self._conn.close()
            self._conn = None

    async def refresh(self) -> None:
        """Read the gauges' values now (bounded by ``statement_timeout``).

        Raises:
            psycopg.Error, TimeoutError: the database did not answer; the previous values stay.
        """
        _sources.add(self)
        async with asyncio.timeout(self.statement_timeout):
            conn = await self._connection()
            try:
                if self.ledger:
                    self.ledger_values = await self.reader.ledger_pressure(conn)
                    self._types_seen.update(p.operation_type for p in self.ledger_values)
                if self.outbox:
                    self.outbox_values = await self.reader.outbox_pressure(conn)
            except BaseException:
                await self._drop_connection()
                raise

    async def _run(self) -> None:
        while True:
            try:
                await self.refresh()
                if self._failing:
                    logger.info("gauges of schema %s read again", self.schema)
                self._failing = False
            except (psycopg.Error, OSError, TimeoutError) as exc:
                if not self._failing:
                    logger.warning("cannot read the gauges of schema %s (%s); keeping the last values",
                                   self.schema, describe_error(exc))
                self._failing = True
            await asyncio.sleep(self.interval)

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = await psycopg.AsyncConnection.connect(
                self.database_url, autocommit=True, application_name="consumer-kit gauges",
                **self._connect_options,
            )
        return self._conn

    async def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()

    def ledger_observations(self) -> Iterator[tuple[str, LedgerPressure]]:
        """The last ledger values per operation type, with 0 for types seen before."""
        current = {p.operation_type: p for p in self.ledger_values}
        for operation_type in sorted(self._types_seen | set(current)):
            yield operation_type, current.get(operation_type) or LedgerPressure(operation_type, 0, None, 0, None)


# -- the callbacks ----------------------------------------------------------------------------------

def _ledger(value: str) -> Any:
    def observe(_options: CallbackOptions) -> Iterable[Observation]:
        for source in list(_sources):
            if not source.ledger:
                continue
            for operation_type, pressure in source.ledger_observations():
                reading = getattr(pressure, value)
                yield Observation(reading or 0, {SCHEMA: source.schema, OPERATION_TYPE: operation_type})
    return observe


def _outbox(value: str) -> Any:
    def observe(_options: CallbackOptions) -> Iterable[Observation]:
        for source in list(_sources):
            if source.outbox and source.outbox_values is not None:
                yield Observation(getattr(source.outbox_values, value) or 0, {SCHEMA: source.schema})
    return observe


def _paused(_options: CallbackOptions) -> Iterable[Observation]:
    pausables = list(_pausables)
    if pausables:
        yield Observation(int(any(p.paused for p in pausables)))


def _gauge(name: str, callback: Any) -> None:
    spec = BY_NAME[name]
    meter.create_observable_gauge(spec.name, callbacks=[callback], unit=spec.unit, description=spec.description)


_gauge("consumer_kit.ledger.expired_leases", _ledger("expired_leases"))
_gauge("consumer_kit.ledger.expired_leases.oldest_age", _ledger("oldest_expired_age"))
_gauge("consumer_kit.ledger.needs_reconciliation", _ledger("needs_reconciliation"))
_gauge("consumer_kit.ledger.needs_reconciliation.oldest_age", _ledger("oldest_reconciliation_age"))
_gauge("consumer_kit.outbox.pending", _outbox("pending"))
_gauge("consumer_kit.outbox.pending.oldest_age", _outbox("oldest_pending_age"))
_gauge("consumer_kit.outbox.parked", _outbox("parked"))
_gauge("consumer_kit.worker.paused", _paused)
