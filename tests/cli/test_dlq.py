"""``consumer-kit dlq list`` and ``dlq redrive`` on RabbitMQ: 50 dead letters, 20 of whose operations
completed meanwhile, are redriven; the other 30 execute once each and the 20 answer as duplicates."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from typing import Any

import pytest
from typer.testing import CliRunner

from consumer_kit import App, Context, Outcome, RetryableError
from consumer_kit.cli.main import cli
from consumer_kit.demo.app import CreateInvoice, CreateInvoiceHandler
from tests.fixtures.broker_env import Env, command

pytestmark = [pytest.mark.postgres, pytest.mark.rabbitmq]

APP = "tests.fixtures.apps.invoices_on_test_queue:app"


class Gated(CreateInvoiceHandler):
    """Fails every attempt while ``open`` is false (the downstream is down)."""

    open = False

    async def handle(self, message: CreateInvoice, ctx: Context) -> Any:
        if not Gated.open:
            raise RetryableError("ledger service down")
        return await super().handle(message, ctx)


async def dlq(env: Env, *args: str) -> str:
    """``consumer-kit dlq ARGS`` in a thread (the command runs its own event loop)."""
    result = await asyncio.to_thread(CliRunner().invoke, cli, ["dlq", *args], env={
        "CONSUMER_KIT_BROKER_URL": env.rabbitmq_url, "CONSUMER_KIT_DATABASE_URL": env.database_url,
        "CONSUMER_KIT_DB_SCHEMA": env.schema, "CK_TEST_QUEUE": env.queue, "COLUMNS": "250",
    })
    assert result.exit_code == 0, result.output
    return result.output


def terminal(count: int) -> Any:
    return lambda seen: sum(r.outcome in (Outcome.EXECUTED, Outcome.DUPLICATE, Outcome.DEAD_LETTERED)
                            for r in seen) == count


async def test_redrive_of_50_dead_letters_executes_the_rest_once_and_answers_the_others_as_duplicates(
    env: Env,
) -> None:
    env.settings = env.settings.model_copy(update={"max_deliveries": 1})
    app = App("gated")
    app.subscribe(env.queue, Gated())
    Gated.open = False
    async with env.worker(app):
        for order in range(1, 51):
            await env.send(command(order_id=order))
        dead = await env.reports_until(terminal(50))
        assert {r.outcome for r in dead} == {Outcome.DEAD_LETTERED}

        Gated.open = True
        for order in range(1, 21):  # fresh copies of 20 of them complete their operations
            await env.send(command(order_id=order))
        done = await env.reports_until(terminal(20))
        assert {r.outcome for r in done} == {Outcome.EXECUTED}

        listed = json.loads(await dlq(env, "list", env.queue, "--json", "--app", APP))
        assert len(listed) == 50
        assert {row["reason"] for row in listed} == {"max_deliveries_exceeded:RetryableError"}
        assert {row["operation_key"] for row in listed} == {f"order-{n}-rev-2" for n in range(1, 51)}
        assert all(row["delivery_count"] == 1 and "body" not in row for row in listed)
        assert all(row["first_failure"] and row["first_failure"] <= row["last_failure"] for row in listed
                   if row["last_failure"])  # the ledger's attempt history names when it failed
        table = await dlq(env, "list", env.queue, "--limit", "3")
        assert "max_deliveries_exceeded:RetryableError" in table and "ledger service down" not in table

        dry = await dlq(env, "redrive", env.queue, "--key", "order-7-rev-2", "--dry-run", "--app", APP)
        assert "would redrive 1, kept 49, failed 0" in dry and "note:" not in dry
        blind = await dlq(env, "redrive", env.queue, "--key", "order-7-rev-2", "--dry-run")
        assert "would redrive 0, kept 50, failed 0" in blind  # the key is in the body: say --app
        assert "note: 50 dead letter(s) carry no operation-id header" in blind and "--app" in blind
        assert len(json.loads(await dlq(env, "list", env.queue, "--json"))) == 50  # nothing moved

        moved = await dlq(env, "redrive", env.queue, "--reason", "max_deliveries_exceeded")
        assert "redrove 50, kept 0, failed 0" in moved
        redriven = await env.reports_until(terminal(50))

    outcomes = {order: r.outcome for r in redriven for order in [int(r.operation_key.split("-")[1])]}
    assert {o for n, o in outcomes.items() if n <= 20} == {Outcome.DUPLICATE}
    assert {o for n, o in outcomes.items() if n > 20} == {Outcome.EXECUTED}
    assert len(outcomes) == 50
    [(invoices, orders)] = await env.rows("SELECT count(*), count(DISTINCT order_id) FROM invoices")
    assert (invoices, orders) == (50, 50)  # each operation's effect exactly once
    assert json.loads(await dlq(env, "list", env.queue, "--json")) == []


async def test_redrive_needs_a_selection(env: Env) -> None:
    result = await asyncio.to_thread(CliRunner().invoke, cli, ["dlq", "redrive", env.queue], env={
        "CONSUMER_KIT_BROKER_URL": env.rabbitmq_url,
    })
    assert result.exit_code == 2 and "--reason R, --key K or --all" in result.output


async def test_the_last_failure_is_the_ledgers_last_attempt_not_the_first_retry_expiry(env: Env) -> None:
    """Three handler faults, two of them through the retry queue: RabbitMQ's x-death time is the
    first retry's expiry, the ledger's attempt history holds the third fault (docs/operations/dead-letters.md)."""
    app = App("gated")
    app.subscribe(env.queue, Gated())
    Gated.open = False
    async with env.worker(app):
        await env.send(command(order_id=9), {"operation-id": "order-9"})  # the key without --app
        seen = await env.reports_until(terminal(1))
        assert [r.outcome for r in seen] == [Outcome.RETRIED, Outcome.RETRIED, Outcome.DEAD_LETTERED]
    [(first, last, faults)] = await env.rows(
        "SELECT min((e ->> 'at')::timestamptz), max((e ->> 'at')::timestamptz), count(*) "
        "FROM attempts, jsonb_array_elements(history) AS e WHERE e ->> 'kind' = 'failure'")
    assert faults == 3

    [row] = json.loads(await dlq(env, "list", env.queue, "--json"))
    assert row["operation_key"] == "order-9"
    assert dt.datetime.fromisoformat(row["last_failure"]) == last
    assert dt.datetime.fromisoformat(row["first_failure"]) == first
    assert dt.datetime.fromisoformat(row["dead_lettered_at"]) < last  # the broker's own time: not used
    table = await dlq(env, "list", env.queue)
    assert last.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S") in table
