"""Shared helpers of the resilience tests: workers in-process on the real RabbitMQ and PostgreSQL,
gates that hold a handler at a known point, a reply-eating PostgreSQL proxy, and the effect checks.

``renv`` (registered in conftest) gives each test a :class:`ResilienceEnv`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aio_pika
import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from consumer_kit import App, Context, DeliveryReport, Outcome, Result
from consumer_kit.adapters.rabbitmq import consumer_from_settings
from consumer_kit.worker import Worker
from examples.invoices.app import CreateInvoice, CreateInvoiceHandler
from tests.broker_env import Env, command
from tests.harness import throwaway_schema

TERMINAL = (Outcome.EXECUTED, Outcome.DUPLICATE, Outcome.LEASE_RECOVERED, Outcome.DEAD_LETTERED)


# -- gates and environments -------------------------------------------------------------------------------------


class Gate:
    """Lets a test hold a handler at a known point: call ``n`` (1-based) in ``block`` sets
    ``entered`` and waits for ``release``. Counts calls and the largest number running at once."""

    def __init__(self, block: set[int] | None = None, *, expect: int = 1) -> None:
        self.block = block if block is not None else {1}
        self.expect = expect  # ``entered`` is set once this many calls are held
        self.held = 0
        self.calls = 0
        self.running = 0
        self.max_running = 0
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    @contextlib.asynccontextmanager
    async def around(self) -> AsyncIterator[int]:
        self.calls += 1
        number = self.calls
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            yield number
        finally:
            self.running -= 1

    async def hold(self, number: int) -> None:
        if number in self.block:
            self.held += 1
            if self.held >= self.expect:
                self.entered.set()
            await self.release.wait()


class GatedInvoiceHandler(CreateInvoiceHandler):
    """The invoices example's handler, held by a :class:`Gate` before or after its writes."""

    def __init__(self, gate: Gate, *, hold_after_writes: bool = False) -> None:
        super().__init__()
        self.gate = gate
        self.hold_after_writes = hold_after_writes

    async def handle(self, message: CreateInvoice, ctx: Context) -> Result:
        async with self.gate.around() as number:
            if not self.hold_after_writes:
                await self.gate.hold(number)
            result = await super().handle(message, ctx)
            if self.hold_after_writes:
                await self.gate.hold(number)
            return result


class ResilienceEnv(Env):
    """``Env`` whose workers connect with their own ``application_name`` (so the test can find and
    terminate exactly their backends) and can take per-worker settings."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.application_name = "ck_resilience_" + self.schema
        self.settings = self.settings.model_copy(
            update={"database_url": self.worker_database_url(self.database_url)}
        )

    def worker_database_url(self, base: str, **changes: Any) -> str:
        """``base`` with the workers' application_name (and no TLS, so a proxy can read it)."""
        return make_conninfo(base, application_name=self.application_name, sslmode="disable", **changes)

    def app(self, handler: Any = None) -> App:
        app = App("resilience")
        app.subscribe(self.queue, handler or CreateInvoiceHandler())
        return app

    @asynccontextmanager
    async def run(self, app: App, **overrides: Any) -> AsyncIterator[Worker]:
        settings = self.settings.model_copy(update=overrides)
        worker = Worker(
            app, settings, consumer=consumer_from_settings(settings), on_report=self.reports.put_nowait
        )
        task = asyncio.create_task(worker.run())
        started = asyncio.create_task(worker.started.wait())
        await asyncio.wait({task, started}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()
        try:
            yield worker
        finally:
            worker.stop()
            await asyncio.wait_for(task, 30)

    async def send_command(self, order_id: int = 418, amount: int = 1250, **changes: Any) -> str:
        return await self.send(command(order_id, amount, **changes))

    async def admin(self, query: str, *params: Any) -> list[tuple[Any, ...]]:
        async with await psycopg.AsyncConnection.connect(self.database_url, autocommit=True) as conn:
            cur = await conn.execute(query, params)
            return await cur.fetchall() if cur.description else []

    async def backends(self, where: str = "true") -> list[tuple[Any, ...]]:
        """(pid, state, query, wait_event_type) of the workers' backends matching ``where``."""
        return await self.admin(
            "SELECT pid, state, query, wait_event_type FROM pg_stat_activity "
            f"WHERE application_name = %s AND ({where})",
            self.application_name,
        )

    async def terminate(self, pids: list[int]) -> None:
        await self.admin("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid", pids)
        await poll(lambda: self.admin("SELECT count(*) = 0 FROM pg_stat_activity WHERE pid = ANY(%s)", pids))

    async def wait_for_backend(self, where: str) -> list[int]:
        """Pids of the workers' backends matching ``where``, once there is at least one."""
        found: list[tuple[Any, ...]] = []

        async def present() -> bool:
            found[:] = await self.backends(where)
            return bool(found)

        await poll(present)
        return [row[0] for row in found]

    async def outcomes_until(
        self, done: Callable[[list[DeliveryReport]], bool], timeout: float = 30.0
    ) -> list[DeliveryReport]:
        return await self.reports_until(done, timeout)

    async def depth(self, name: str) -> int:
        connection = await aio_pika.connect(self.rabbitmq_url)
        try:
            channel = await connection.channel()
            declared = await channel.declare_queue(name, passive=True)
            return int(declared.declaration_result.message_count or 0)
        finally:
            await connection.close()


async def poll(condition: Callable[[], Any], timeout: float = 15.0, interval: float = 0.02) -> None:
    """Wait until ``await condition()`` is truthy (a database or broker condition with no event)."""
    async with asyncio.timeout(timeout):
        while True:
            value = await condition()
            if value and (not isinstance(value, list) or value[0][0]):
                return
            await asyncio.sleep(interval)


def count(reports: list[DeliveryReport], *outcomes: Outcome) -> int:
    return sum(r.outcome in outcomes for r in reports)


@pytest.fixture
async def renv(database_url: str, rabbitmq_url: str, unique_name: str) -> AsyncIterator[ResilienceEnv]:
    async with throwaway_schema(database_url) as schema:
        environment = ResilienceEnv(database_url, rabbitmq_url, schema, f"{unique_name}.commands")
        try:
            yield environment
        finally:
            await environment.cleanup()


async def assert_effects(env: Env, expected: dict[int, int]) -> None:
    """Exactly one invoice per order in ``expected`` (order_id -> amount), balances add up,
    one outbox row per operation, every ledger row completed."""
    invoices = await env.rows("SELECT order_id, amount_cents FROM invoices ORDER BY order_id")
    assert invoices == sorted(expected.items())
    (balance,) = await env.rows("SELECT coalesce(sum(invoiced_cents), 0) FROM customers")
    assert balance == (sum(expected.values()),)
    assert await env.rows("SELECT count(*) FROM outbox") == [(len(expected),)]
    assert await env.rows("SELECT state, count(*) FROM operations GROUP BY state") == (
        [("completed", len(expected))] if expected else []
    )



class ReplyEater:
    """A TCP proxy in front of PostgreSQL that, once armed, forwards the next ``COMMIT`` to the
    server but swallows everything the server answers on that connection, until :meth:`cut`."""

    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self.armed = False
        self.commit_forwarded = asyncio.Event()
        self._victim: tuple[asyncio.StreamWriter, asyncio.StreamWriter] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        self._writers += [writer, up_writer]
        state = {"eat": False}

        async def client_to_server() -> None:
            while data := await reader.read(65536):
                up_writer.write(data)
                await up_writer.drain()
                if self.armed and b"COMMIT\x00" in data:
                    self.armed = False
                    state["eat"] = True
                    self._victim = (writer, up_writer)
                    self.commit_forwarded.set()
            up_writer.close()

        async def server_to_client() -> None:
            while data := await up_reader.read(65536):
                if not state["eat"]:
                    writer.write(data)
                    await writer.drain()
            writer.close()

        for pump in (client_to_server(), server_to_client()):
            task = asyncio.create_task(pump)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def cut(self) -> None:
        """Close the connection whose COMMIT reply was swallowed (the client sees it drop)."""
        assert self._victim is not None
        for writer in self._victim:
            writer.transport.abort()

    async def close(self) -> None:
        for writer in self._writers:
            writer.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.server is not None:
            self.server.close()


