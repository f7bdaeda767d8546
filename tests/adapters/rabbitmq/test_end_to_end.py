"""The end-to-end guarantees on the real RabbitMQ and the real PostgreSQL.

Workers run in this process (``Worker`` with the RabbitMQ adapter) or, for the crash tests, as
``consumer-kit worker`` subprocesses killed with SIGKILL at a named crash point.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from typing import Any, ClassVar

import pytest

from consumer_kit import (
    App,
    Context,
    Handler,
    Outcome,
    RetryableError,
)
from consumer_kit.demo.app import CreateInvoice, CreateInvoiceHandler
from tests.fixtures.broker_env import Env, command

pytestmark = [pytest.mark.postgres, pytest.mark.rabbitmq]


async def assert_one_effect(env: Env, amount: int = 1250) -> None:
    assert len(await env.rows("SELECT invoice_id FROM invoices")) == 1
    assert await env.rows("SELECT invoiced_cents FROM customers") == [(amount,)]
    assert len(await env.rows("SELECT event_id FROM outbox")) == 1
    assert await env.rows("SELECT state FROM operations") == [("completed",)]


async def test_same_message_five_times_sequentially(env: Env) -> None:
    async with env.worker():
        outcomes = []
        for _ in range(5):
            await env.send(command())
            (report,) = await env.next_reports(1)
            outcomes.append(report.outcome)
    assert outcomes == [Outcome.EXECUTED] + [Outcome.DUPLICATE] * 4
    await assert_one_effect(env)
    assert await env.queue_depth() == 0


async def test_same_message_five_times_concurrently_on_three_workers(env: Env) -> None:
    async with env.worker(), env.worker(), env.worker():
        await asyncio.gather(*(env.send(command()) for _ in range(5)))
        seen = await env.reports_until(
            lambda reports: sum(r.outcome in (Outcome.EXECUTED, Outcome.DUPLICATE) for r in reports) == 5
        )
    executed = [r for r in seen if r.outcome is Outcome.EXECUTED]
    assert len(executed) == 1
    assert {r.outcome for r in seen} <= {Outcome.EXECUTED, Outcome.DUPLICATE, Outcome.IN_PROGRESS}
    await assert_one_effect(env)
    assert await env.queue_depth() == 0


async def test_changed_amount_is_a_conflict_and_changed_timestamp_a_duplicate(env: Env) -> None:
    async with env.worker():
        await env.send(command())
        (first,) = await env.next_reports(1)
        await env.send(command(amount=9999))
        (conflict,) = await env.next_reports(1)
        await env.send(command(requested_at="2031-05-01T10:00:00+02:00"))
        (resend,) = await env.next_reports(1)
    assert (first.outcome, conflict.outcome, resend.outcome) == (
        Outcome.EXECUTED, Outcome.PAYLOAD_CONFLICT, Outcome.DUPLICATE,
    )
    (dead,) = await env.dead_letters(1)
    assert dead.headers["x-dead-letter-reason"] == "payload_conflict"
    await assert_one_effect(env)  # the original result is untouched
    assert resend.result is not None and resend.result.status == "created"


async def test_invalid_bodies_are_dead_lettered_with_distinct_reasons(env: Env) -> None:
    class KeyFromHeader(Handler[CreateInvoice]):
        operation_type = "invoice.create"

    app = App("test")
    app.subscribe(env.queue, KeyFromHeader())
    async with env.worker(app):
        await env.send(b"{not json")
        await env.send(json.dumps({"order_id": "many"}).encode())
        await env.send(command())  # valid body, but this handler takes its key from a header
        reports = await env.next_reports(3)
    assert {r.outcome for r in reports} == {Outcome.INVALID}
    reasons = sorted(m.headers["x-dead-letter-reason"] for m in await env.dead_letters(3))
    assert reasons == ["invalid_json", "missing_operation_key", "schema_mismatch"]
    assert await env.rows("SELECT * FROM operations") == []


class FlakyHandler(Handler[CreateInvoice]):
    """Fails retryably ``failures`` times per key, then creates the invoice."""

    operation_type = "invoice.flaky"
    failures = 2
    calls: ClassVar[dict[str, int]] = {}

    def operation_key(self, message: CreateInvoice, envelope: Any) -> str:
        return f"order-{message.order_id}"

    async def handle(self, message: CreateInvoice, ctx: Context) -> Any:
        count = self.calls[ctx.operation.key] = self.calls.get(ctx.operation.key, 0) + 1
        await CreateInvoiceHandler().handle(message, ctx)  # the writes happen, then roll back
        if count <= self.failures:
            raise RetryableError("downstream busy")
        return None


async def test_retryable_error_twice_then_success_has_one_effect(env: Env) -> None:
    FlakyHandler.calls = {}
    app = App("test")
    app.subscribe(env.queue, FlakyHandler())
    async with env.worker(app):
        await env.send(command())
        reports = await env.next_reports(3)
    assert [r.outcome for r in reports] == [Outcome.RETRIED, Outcome.RETRIED, Outcome.EXECUTED]
    assert [r.delivery_count for r in reports] == [1, 2, 3]
    await assert_one_effect(env)


async def test_always_failing_is_dead_lettered_after_max_deliveries(env: Env) -> None:
    class Broken(FlakyHandler):
        failures = 10**6

    FlakyHandler.calls = {}
    app = App("test")
    app.subscribe(env.queue, Broken())
    async with env.worker(app):
        await env.send(command())
        reports = await env.next_reports(3)
    assert [r.outcome for r in reports] == [Outcome.RETRIED, Outcome.RETRIED, Outcome.DEAD_LETTERED]
    (dead,) = await env.dead_letters(1)
    assert dead.headers["x-dead-letter-reason"] == "max_deliveries_exceeded:RetryableError"
    assert await env.rows("SELECT * FROM invoices") == []
    assert await env.rows("SELECT * FROM operations") == []


async def test_permanent_failure_is_recorded_and_replayed(env: Env) -> None:
    async with env.worker():
        await env.send(command(amount=-5))
        (first,) = await env.next_reports(1)
        await env.send(command(amount=-5))
        (again,) = await env.next_reports(1)
    assert (first.outcome, again.outcome) == (Outcome.FAILED, Outcome.FAILED_RETAINED)
    assert again.result is not None and again.result.status == "negative_amount"
    assert await env.rows("SELECT state, result_status FROM operations") == [("failed", "negative_amount")]
    assert await env.rows("SELECT * FROM invoices") == []
    assert await env.queue_depth() == 0


def _worker_subprocess(env: Env, crash_at: str) -> subprocess.Popen[bytes]:
    environment = env.worker_environment(
        CONSUMER_KIT_RETRY_DELAYS="[0.2]",
        CONSUMER_KIT_IN_PROGRESS_DELAY="0.2",
        CONSUMER_KIT_CRASH_AT=f"{crash_at}:kill",
    )
    return subprocess.Popen(
        [sys.executable, "-m", "consumer_kit", "worker", "tests.fixtures.apps.invoices_on_test_queue:app"],
        env=environment,
    )


@pytest.mark.parametrize(
    ("crash_at", "redelivery_outcome", "effect_before_redelivery"),
    [("after_commit_before_ack", Outcome.DUPLICATE, 1), ("in_handler", Outcome.EXECUTED, 0)],
)
async def test_worker_killed_around_commit(
    env: Env, crash_at: str, redelivery_outcome: Outcome, effect_before_redelivery: int
) -> None:
    async with env.worker() as declaring:  # declare the queue topology, then step aside
        pass
    del declaring
    child = _worker_subprocess(env, crash_at)
    try:
        await env.send(command())
        code = await asyncio.wait_for(asyncio.to_thread(child.wait), 60)
    finally:
        if child.poll() is None:
            child.kill()
    assert code == -signal.SIGKILL
    assert len(await env.rows("SELECT * FROM invoices")) == effect_before_redelivery
    async with env.worker():
        (report,) = await env.next_reports(1)
    assert report.outcome is redelivery_outcome
    assert report.delivery_count == 2
    await assert_one_effect(env)
    assert await env.queue_depth() == 0
