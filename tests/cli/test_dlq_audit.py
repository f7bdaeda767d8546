"""``consumer-kit dlq`` audits as the console does (docs/how-to/console.md, "Audit"): a redrive and
a ``--show-body`` listing are recorded before they act, an unwritable audit stops the redrive
before a letter moves, and the audit's rows cannot be changed or deleted."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import psycopg
import psycopg.sql
import pytest
from typer.testing import CliRunner

from consumer_kit import App, Context, Outcome, RetryableError
from consumer_kit.cli.main import cli
from consumer_kit.demo.app import CreateInvoice, CreateInvoiceHandler
from tests.fixtures.broker_env import Env, command

pytestmark = [pytest.mark.postgres, pytest.mark.rabbitmq]


class Down(CreateInvoiceHandler):
    async def handle(self, message: CreateInvoice, ctx: Context) -> Any:
        raise RetryableError("ledger service down")


async def dlq(env: Env, *args: str) -> Any:
    return await asyncio.to_thread(CliRunner().invoke, cli, ["dlq", *args], env={
        "CONSUMER_KIT_BROKER_URL": env.rabbitmq_url, "CONSUMER_KIT_DATABASE_URL": env.database_url,
        "CONSUMER_KIT_DB_SCHEMA": env.schema, "COLUMNS": "250",
    })


async def execute(env: Env, statement: str) -> None:
    async with await psycopg.AsyncConnection.connect(env.database_url, autocommit=True) as conn:
        await conn.execute(psycopg.sql.SQL("SET search_path TO {}").format(psycopg.sql.Identifier(env.schema)))
        await conn.execute(statement.encode())


async def one_dead_letter(env: Env) -> None:
    env.settings = env.settings.model_copy(update={"max_deliveries": 1})
    app = App("down")
    app.subscribe(env.queue, Down())
    async with env.worker(app):
        await env.send(command(order_id=5), {"operation-id": "order-5"})
        [report] = await env.reports_until(lambda seen: len(seen) == 1)
        assert report.outcome is Outcome.DEAD_LETTERED


async def test_show_body_and_redrive_from_the_cli_are_audited_the_redrive_before_it_moves(env: Env) -> None:
    await one_dead_letter(env)
    shown = await dlq(env, "list", env.queue, "--show-body")
    assert shown.exit_code == 0, shown.output
    assert await env.rows("SELECT source, action, outcome FROM audit") == [("cli", "show_body", "shown 1")]
    assert (await dlq(env, "list", env.queue)).exit_code == 0  # no body shown: nothing to audit
    assert len(await env.rows("SELECT id FROM audit")) == 1

    moved = await dlq(env, "redrive", env.queue, "--key", "order-5")
    assert moved.exit_code == 0 and "redrove 1" in moved.output, moved.output
    rows = await env.rows("SELECT source, action, outcome, details ->> 'redriven' FROM audit "
                          "WHERE action = 'redrive' ORDER BY id")
    assert rows == [("cli", "redrive", "started", None), ("cli", "redrive", "redrove 1, kept 0, failed 0", "1")]


async def test_a_redrive_whose_audit_cannot_be_written_moves_nothing(env: Env) -> None:
    await one_dead_letter(env)
    await execute(env, "ALTER TABLE audit RENAME TO audit_elsewhere")
    refused = await dlq(env, "redrive", env.queue, "--all")
    assert refused.exit_code != 0 and "redrove" not in refused.output
    await execute(env, "ALTER TABLE audit_elsewhere RENAME TO audit")
    listed = await dlq(env, "list", env.queue, "--json")
    assert len(json.loads(listed.output)) == 1  # the letter is still dead-lettered


@pytest.mark.parametrize("statement", ["UPDATE audit SET actor = 'nobody'", "DELETE FROM audit",
                                       "TRUNCATE audit"])
async def test_the_audit_is_append_only(env: Env, statement: str) -> None:
    await execute(env, "INSERT INTO audit (actor, source, action, target, outcome) "
                      "VALUES ('ops@host', 'cli', 'redrive', 'q all', 'redrove 1')")
    with pytest.raises(psycopg.errors.InsufficientPrivilege, match="append-only"):
        await execute(env, statement)
    assert await env.rows("SELECT actor FROM audit") == [("ops@host",)]
