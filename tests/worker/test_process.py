"""Worker lifecycle on the real RabbitMQ and PostgreSQL: graceful shutdown and the supervisor."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import aio_pika
import pytest

from consumer_kit import App, Context, Handler, Outcome
from consumer_kit.demo.app import CreateInvoice, CreateInvoiceHandler
from tests.fixtures.broker_env import Env, command

pytestmark = [pytest.mark.postgres, pytest.mark.rabbitmq]


class GatedHandler(Handler[CreateInvoice]):
    """Creates the invoice, then waits for ``release`` (set by the test)."""

    operation_type = "invoice.create"

    def __init__(self) -> None:
        super().__init__()
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    def operation_key(self, message: CreateInvoice, envelope: object) -> str:
        return f"order-{message.order_id}"

    async def handle(self, message: CreateInvoice, ctx: Context) -> None:
        await CreateInvoiceHandler().handle(message, ctx)
        self.entered.set()
        await self.release.wait()


async def test_sigterm_lets_in_flight_delivery_finish(env: Env) -> None:
    handler = GatedHandler()
    app = App("test")
    app.subscribe(env.queue, handler)
    async with env.worker(app) as worker:
        await env.send(command())
        await asyncio.wait_for(handler.entered.wait(), 10)
        os.kill(os.getpid(), signal.SIGTERM)  # the worker's own signal handler asks it to stop
        await asyncio.wait_for(worker._stop.wait(), 5)  # the signal reached the worker
        handler.release.set()
        (report,) = await env.next_reports(1)
    assert report.outcome is Outcome.EXECUTED
    assert len(await env.rows("SELECT * FROM invoices")) == 1
    assert await env.queue_depth() == 0


async def test_shutdown_timeout_releases_a_stuck_delivery_without_effect(env: Env) -> None:
    handler = GatedHandler()
    app = App("test")
    app.subscribe(env.queue, handler)
    env.settings = env.settings.model_copy(update={"shutdown_timeout": 0.5})
    async with env.worker(app):
        await env.send(command())
        await asyncio.wait_for(handler.entered.wait(), 10)
    # The stuck handler was cancelled: its transaction rolled back and the message went back.
    assert await env.rows("SELECT * FROM invoices") == []
    assert await env.rows("SELECT * FROM operations") == []
    assert await env.queue_depth() == 1


async def _consumer_count(url: str, queue: str) -> int:
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue, passive=True)
        return int(declared.declaration_result.consumer_count or 0)
    except aio_pika.exceptions.ChannelClosed:
        return 0
    finally:
        await connection.close()


async def _wait_for_consumers(url: str, queue: str, wanted: int, timeout: float = 60.0) -> None:
    """Poll the broker's consumer count (there is no event to wait on) until it is ``wanted``."""
    deadline = time.monotonic() + timeout
    while await _consumer_count(url, queue) != wanted:
        assert time.monotonic() < deadline, f"queue {queue} never had {wanted} consumers"
        await asyncio.sleep(0.2)


def _children(pid: int) -> list[int]:
    """Live child processes of ``pid`` (``pgrep -P``: ask while ``pid`` itself still runs)."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False)
    return [int(line) for line in out.stdout.split()]


def _alive(pid: int) -> bool:
    """``pid`` still exists (a zombie counts: nobody reaped it). Not a child of ours, so
    ``os.kill(pid, 0)`` is the question, not ``waitpid``."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_supervisor_restarts_a_killed_worker_and_stops_cleanly(env: Env) -> None:
    environment = env.worker_environment()
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "consumer_kit", "worker", "tests.fixtures.apps.invoices_on_test_queue:app",
         "--processes", "2"],
        env=environment,
    )
    try:
        await _wait_for_consumers(env.rabbitmq_url, env.queue, 2)
        first, _second = _children(supervisor.pid)
        os.kill(first, signal.SIGKILL)
        await _wait_for_consumers(env.rabbitmq_url, env.queue, 1)
        await _wait_for_consumers(env.rabbitmq_url, env.queue, 2)  # restarted
        children = _children(supervisor.pid)
        assert first not in children and len(children) == 2, children
        await env.send(command())
        await _wait_for_rows(env, "SELECT * FROM operations WHERE state = 'completed'", 1)
        supervisor.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(asyncio.to_thread(supervisor.wait), 60)
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
    assert code == 0
    # The supervisor is reaped, so `pgrep -P` on it would find nothing whatever happened: ask about
    # the children it had instead. It waits for them before exiting, so none may be left.
    assert [pid for pid in children if _alive(pid)] == []
    assert await _consumer_count(env.rabbitmq_url, env.queue) == 0


async def _wait_for_rows(env: Env, query: str, count: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while len(await env.rows(query)) != count:
        assert time.monotonic() < deadline, f"{query} never returned {count} rows"
        await asyncio.sleep(0.1)


async def test_worker_logs_a_summary_of_outcomes(env: Env, caplog: pytest.LogCaptureFixture) -> None:
    env.settings = env.settings.model_copy(update={"summary_interval": 0.2})
    with caplog.at_level("INFO", logger="consumer_kit.worker"):
        async with env.worker():
            for _ in range(3):
                await env.send(command())
            await env.next_reports(3)
            deadline = time.monotonic() + 10
            while "executed=1" not in caplog.text:  # the summary task logs on its own schedule
                assert time.monotonic() < deadline, caplog.text
                await asyncio.sleep(0.05)
    summary = next(r.getMessage() for r in caplog.records if "executed=1" in r.getMessage())
    assert "duplicate=2" in summary
