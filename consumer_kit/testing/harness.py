"""The testing kit's :class:`Harness`: your handlers, a throwaway schema, the memory broker.

A harness owns one fresh PostgreSQL schema (ledger + outbox + your tables), a
:class:`~consumer_kit.pipeline.runtime.Runtime` over it and an in-process broker with peek-lock semantics
(``memory://``): a delivery that is not settled within ``lock_timeout`` seconds (a crash point
fired) is redelivered, exactly as a real broker redelivers after a consumer died.

Example::

    async with Harness(CreateInvoiceHandler(), database_url=url, setup_sql=SCHEMA_SQL) as kit:
        await kit.deliver(command, times=5, concurrently=True)
        kit.assert_outcomes({"executed": 1, "duplicate": 4})
        await kit.assert_one_effect("SELECT count(*) FROM invoices")

Outcomes (``kit.reports``) are :class:`~consumer_kit.model.outcomes.DeliveryReport` objects, one per
delivery, including ``crashed`` ones. The harness imports the memory adapter through the
``consumer_kit.brokers`` entry point, like any other adapter.
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any

import psycopg
from psycopg import sql
from pydantic import BaseModel

from consumer_kit.app import App
from consumer_kit.broker import Delivery
from consumer_kit.errors import ConfigurationError, SimulatedCrash
from consumer_kit.handler import Handler
from consumer_kit.ledger import migrate
from consumer_kit.model.events import OutboxEvent
from consumer_kit.model.operation_row import COMPLETED, FAILED
from consumer_kit.model.outcomes import DeliveryReport, Outcome
from consumer_kit.outbox import outbox_events
from consumer_kit.pipeline import crashpoints
from consumer_kit.pipeline.batching import Batcher, batch_setting
from consumer_kit.pipeline.crashpoints import CrashPoint
from consumer_kit.settings import Settings
from consumer_kit.testing.messages import Sent, encode_body, message_headers
from consumer_kit.testing.outcomes import check_outcomes, count_outcomes, settled_reports

SetupSQL = str | Callable[[psycopg.AsyncConnection[Any]], Awaitable[None]] | None

# Fast defaults: retries and in-progress back-offs in milliseconds, so a test never waits long.
_TEST_SETTINGS: dict[str, Any] = {
    "max_deliveries": 5,
    "retry_delays": [0.01, 0.02, 0.05],
    "in_progress_delay": 0.05,
    "lock_timeout": 0.5,  # PostgreSQL claim wait: kept below the broker lock (1 s) so a waiting
    # delivery never outlives its lock and gets redelivered while still running
    "handler_timeout": 10.0,
    "settle_timeout": 5.0,
    "concurrency": 16,
}


class Harness:
    """Runs ``handlers`` against a throwaway schema and the memory broker.

    Args:
        *handlers: handler instances; each gets its own queue ``"ck-test.<message_type>"``.
        database_url: PostgreSQL URL (the fixture ``consumer_kit_harness`` passes the configured
            or the embedded one).
        setup_sql: your tables: SQL text run in the new schema (``search_path`` set to it), or an
            ``async def setup(conn)``.
        lock_timeout: seconds the memory broker keeps an unsettled delivery locked before it
            redelivers it (how long a crashed delivery takes to come back).
        **settings: :class:`~consumer_kit.settings.Settings` overrides (``max_deliveries``,
            ``lock_timeout`` is the *PostgreSQL* one there: use ``pg_lock_timeout`` here).

    Raises:
        ConfigurationError: no handler given, or two handlers with the same message type.
    """

    def __init__(
        self,
        *handlers: Handler[Any],
        database_url: str,
        setup_sql: SetupSQL = None,
        lock_timeout: float = 1.0,
        pg_lock_timeout: float | None = None,
        **settings: Any,
    ) -> None:
        if not handlers:
            raise ConfigurationError("Harness needs at least one handler")
        self.handlers = list(handlers)
        self.database_url = database_url
        self.schema = "ck_test_" + uuid.uuid4().hex[:12]
        self._setup_sql = setup_sql
        self._lock_timeout = lock_timeout
        overrides = {**_TEST_SETTINGS, **settings}
        if pg_lock_timeout is not None:
            overrides["lock_timeout"] = pg_lock_timeout
        self.settings = Settings(database_url=database_url, db_schema=self.schema, **overrides)
        self.app = App("consumer-kit-test")
        self._queues: dict[int, str] = {}
        for handler in self.handlers:
            queue = f"ck-test.{type(handler).message_type}"
            self.app.subscribe(queue, handler)
            self._queues[id(handler)] = queue
        self.reports: list[DeliveryReport] = []
        self.sent: list[Sent] = []
        self.runtime: Any = None
        self.broker: Any = None
        self._consumer: Any = None
        self._pool: Any = None
        self._errors: list[BaseException] = []
        self._started = False
        self._inflight = 0  # deliveries inside _on_delivery (a settled one may not have reported yet)
        self._quiet = asyncio.Event()
        self._quiet.set()

    # -- lifecycle -----------------------------------------------------------------------------

    async def __aenter__(self) -> Harness:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def start(self) -> None:
        """Create the schema (ledger, outbox, your tables), open the pool, start consuming."""
        from consumer_kit.broker.registry import adapter_for
        from consumer_kit.pipeline.runtime import Runtime, open_pool

        async with await psycopg.AsyncConnection.connect(self.database_url, autocommit=True) as conn:
            await migrate(conn, self.schema)
            await conn.execute(sql.SQL("SET search_path = {}, public").format(sql.Identifier(self.schema)))
            if isinstance(self._setup_sql, str):
                await conn.execute(self._setup_sql.encode())  # bytes: several statements at once
            elif self._setup_sql is not None:
                await self._setup_sql(conn)
        self._started = True
        self._pool = await open_pool(
            self.settings, self.database_url, size=self.settings.concurrency + 2,
            search_path=f"{self.schema},public",
        )
        self.runtime = Runtime(self.app, self._pool, self.settings, worker_id=f"ck-test:{self.schema}")
        memory = adapter_for("memory://")
        self.broker = memory.MemoryBroker(self.schema, lock_timeout=self._lock_timeout)
        self._consumer = memory.MemoryConsumer(self.broker)
        for queue in self.app.queues:
            size, wait = batch_setting(self.app, queue)
            if size > 1:  # the batch path, as the worker runs it
                batcher = Batcher(self._on_batch, size=size, wait=wait, limit=self.settings.concurrency)
                await self._consumer.subscribe(
                    queue, functools.partial(self._on_batched, batcher),
                    prefetch=max(self.settings.concurrency, size * self.settings.concurrency),
                )
                continue
            await self._consumer.subscribe(queue, self._on_delivery, prefetch=self.settings.concurrency)

    async def close(self) -> None:
        """Stop consuming, disarm crash points, close the pool and drop the schema."""
        crashpoints.disarm_all()
        if self._consumer is not None:
            await self._consumer.close()
        if self._pool is not None:
            await self.runtime.close()  # made with the pool: its late transaction ends first
            await self._pool.close()
        if self._started:
            async with await psycopg.AsyncConnection.connect(self.database_url, autocommit=True) as conn:
                await conn.execute(
                    sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(self.schema))
                )
            self._started = False

    async def _on_batch(self, deliveries: Sequence[Delivery]) -> None:
        assert self.runtime is not None
        self.reports.extend(await self.runtime.process_batch(deliveries))

    async def _on_batched(self, batcher: Batcher, delivery: Delivery) -> None:
        await self._on_delivery(delivery, batcher)

    async def _on_delivery(self, delivery: Delivery, batcher: Batcher | None = None) -> None:
        self._inflight += 1
        self._quiet.clear()
        try:
            if batcher is None:
                self.reports.append(await self.runtime.process(delivery))
            else:
                await batcher.add(delivery)
        except SimulatedCrash as crash:
            # Behave like a dead worker: leave the delivery unsettled; the lock expires, the
            # broker redelivers.
            self.reports.append(
                DeliveryReport(
                    outcome=Outcome.CRASHED, settlement=None, queue=delivery.queue,
                    message_id=delivery.message_id, delivery_count=delivery.delivery_count,
                    reason=f"crash point {crash}",
                )
            )
        except BaseException as exc:  # the runtime promises never to raise: surface it in run()
            self._errors.append(exc)
            raise
        finally:
            self._inflight -= 1
            if not self._inflight:
                self._quiet.set()

    # -- sending and running -------------------------------------------------------------------

    def queue_of(self, handler: Handler[Any] | None = None) -> str:
        """The harness queue of ``handler`` (default: the first handler)."""
        handler = handler or self.handlers[0]
        try:
            return self._queues[id(handler)]
        except KeyError:
            raise ConfigurationError(f"{type(handler).__name__} is not one of this harness's handlers") from None

    def send(
        self,
        message: BaseModel | Mapping[str, Any] | Sequence[Any] | str | bytes,
        *,
        handler: Handler[Any] | None = None,
        operation_id: Any = None,
        tenant: Any = None,
        headers: Mapping[str, Any] | None = None,
        message_id: str | None = None,
        message_type: Any = None,
    ) -> str:
        """Put one message on ``handler``'s queue without waiting; returns its message id.

        ``message`` may be a pydantic model, a JSON-compatible dict/list, a ``str`` or raw
        ``bytes`` (sent as is: hostile input). Headers: ``message-type`` is the handler's unless
        ``message_type`` is given (``False``: no such header); ``operation-id`` and ``tenant-id``
        are set when given; ``headers`` are added last and win.
        """
        handler = handler or self.handlers[0]
        body = encode_body(message)
        all_headers = message_headers(
            type(handler).message_type if message_type is None else message_type,
            operation_id=operation_id, tenant=tenant, headers=headers,
        )
        queue = self.queue_of(handler)
        message_id = message_id or str(uuid.uuid4())
        self.sent.append(Sent(queue, body, dict(all_headers), message_id))
        self.broker.send(queue, body, message_id=message_id, headers=all_headers)
        return message_id

    async def run(self, timeout: float = 30.0) -> list[DeliveryReport]:
        """Wait until every message sent so far is settled for good (acked or dead-lettered);
        returns the reports produced meanwhile.

        Raises:
            TimeoutError: messages still unsettled after ``timeout`` seconds.
            AssertionError: the runtime raised (it must not).
        """
        start = len(self.reports)
        async with asyncio.timeout(timeout):
            # The broker is idle once the last message is acked; the delivery that acked it may
            # still be on its way to returning its report: wait for both.
            await self.broker.wait_idle(timeout)
            await self._quiet.wait()
        if self._errors:
            raise AssertionError(f"the runtime raised: {self._errors[0]!r}") from self._errors[0]
        return self.reports[start:]

    async def deliver(
        self,
        handler_or_message: Any,
        message: Any = None,
        *,
        times: int = 1,
        concurrently: bool = True,
        timeout: float = 30.0,
        **send_options: Any,
    ) -> list[DeliveryReport]:
        """Deliver one message ``times`` times and wait until all copies are settled.

        Called as ``deliver(message, ...)`` (first handler) or ``deliver(handler, message, ...)``.
        ``concurrently=True`` puts all copies on the queue at once (they race for the claim);
        ``False`` delivers them one after the other. ``send_options`` go to :meth:`send`.

        Returns:
            Every delivery report produced meanwhile (retries and crashes included).
        """
        if isinstance(handler_or_message, Handler):
            send_options["handler"] = handler_or_message
        else:
            handler_or_message, message = None, handler_or_message
        if times < 1:
            raise ValueError("times must be >= 1")
        start = len(self.reports)
        for _ in range(times):
            self.send(message, **send_options)
            if not concurrently:
                await self.run(timeout)
        await self.run(timeout)
        return self.reports[start:]

    async def replay_all(self, *, concurrently: bool = True, timeout: float = 30.0) -> list[DeliveryReport]:
        """Send every message sent so far once more (a redelivery storm after the fact) and wait.
        A correct handler produces no new effect: only duplicates, replayed failures, conflicts
        and the same dead-letter reasons."""
        start = len(self.reports)
        for sent in list(self.sent):
            self.sent.append(sent)
            self.broker.send(sent.queue, sent.body, message_id=sent.message_id, headers=sent.headers)
            if not concurrently:
                await self.run(timeout)
        await self.run(timeout)
        return self.reports[start:]

    # -- crash points --------------------------------------------------------------------------

    def crash_at(self, point: CrashPoint | str, *, times: int = 1) -> crashpoints.Armed:
        """Arm crash point ``point`` (``"before_claim"``, ``"in_handler"``, ...) to fire ``times``
        times (``-1``: always) by raising ``SimulatedCrash``: the delivery is left unsettled as if
        the process died, and comes back after the broker lock expires. Usable as a context
        manager; :meth:`close` disarms everything anyway."""
        return crashpoints.arm(point, action="raise", times=times)

    # -- reading state -------------------------------------------------------------------------

    async def fetch(self, query: str, *params: Any) -> list[tuple[Any, ...]]:
        """Rows of ``query`` run in the harness schema."""
        async with await psycopg.AsyncConnection.connect(
            self.database_url, autocommit=True, options=f"-c search_path={self.schema},public"
        ) as conn:
            cur = await conn.execute(query.encode() if not params else query, params or None)
            return await cur.fetchall()

    async def fetchval(self, query: str, *params: Any) -> Any:
        """The single value of ``query`` (first column of the only row)."""
        rows = await self.fetch(query, *params)
        if len(rows) != 1:
            raise AssertionError(f"expected one row from {query!r}, got {len(rows)}")
        return rows[0][0]

    async def ledger(self) -> list[dict[str, Any]]:
        """Every ledger row as a dict (scope, key, state, fingerprint, result_status, attempts)."""
        rows = await self.fetch(
            "SELECT scope, key, state, fingerprint, result_status, attempts FROM operations ORDER BY created_at"
        )
        names = ("scope", "key", "state", "fingerprint", "result_status", "attempts")
        return [dict(zip(names, row, strict=True)) for row in rows]

    async def outbox_events(self, destination: str | None = None) -> list[OutboxEvent]:
        """The events your handlers wrote to the outbox (``ctx.publish``), in the order written:
        :class:`~consumer_kit.model.events.OutboxEvent` objects with ``destination``,
        ``routing_key``, ``message_type``, ``partition_key``, ``payload`` (decoded JSON),
        ``headers``, ``operation_key`` and ``published`` (the harness runs no relay: ``False``).
        Only ``destination``'s events when given. A duplicate writes no second event, so after
        ``deliver(message, times=5)`` a handler that publishes once shows one event here."""
        async with await psycopg.AsyncConnection.connect(self.database_url, autocommit=True) as conn:
            return await outbox_events(conn, self.schema, destination=destination)

    def dead_letters(self, handler: Handler[Any] | None = None) -> list[tuple[str, str]]:
        """``(reason, detail)`` of every message dead-lettered from ``handler``'s queue."""
        return [(d.reason, d.detail) for d in self.broker.dead_letters(self.queue_of(handler))]

    def outcomes(self, reports: Iterable[DeliveryReport] | None = None) -> Counter[str]:
        """Count of reports by outcome value."""
        return count_outcomes(self.reports if reports is None else reports)

    # -- assertions ----------------------------------------------------------------------------

    def assert_outcomes(
        self, expected: Mapping[str | Outcome, int], reports: Iterable[DeliveryReport] | None = None
    ) -> None:
        """Assert how many deliveries ended with each outcome.

        Terminal outcomes (``executed``, ``duplicate``, ``payload_conflict``, ``failed``,
        ``failed_retained``, ``invalid``, ``dead_lettered``, ...) not named in ``expected`` must not
        occur at all; transient ones (``crashed``, ``in_progress``, ``retried``, ``uncertain``) are
        checked only when named.
        """
        check_outcomes(self.outcomes(reports), expected)

    async def assert_one_effect(self, query: str, *params: Any, expected: int = 1) -> None:
        """Assert that ``query`` (a count of your effect, e.g. ``SELECT count(*) FROM invoices
        WHERE order_id = %s``) returns ``expected`` (default 1), that no message is left on the
        broker and that every ledger row is terminal (``completed`` or ``failed``)."""
        value = await self.fetchval(query, *params)
        assert value == expected, (
            f"{query!r} returned {value}, expected {expected} (outcomes: {dict(self.outcomes())})"
        )
        await self.assert_ledger_terminal()

    async def assert_ledger_terminal(self) -> None:
        """Every ledger row is ``completed`` or ``failed`` and nothing is left on the broker."""
        open_rows = [r for r in await self.ledger() if r["state"] not in (COMPLETED, FAILED)]
        assert not open_rows, f"ledger rows not terminal: {open_rows}"
        await self.run(timeout=10)  # raises TimeoutError if any message is still unsettled

    def settled(self, reports: Iterable[DeliveryReport] | None = None) -> list[DeliveryReport]:
        """Reports of deliveries that ended the message's life (acked or dead-lettered)."""
        return settled_reports(self.reports if reports is None else reports)
