"""Operator commands print producer text as text: keys, message ids, reasons, details, bodies and
operation types holding rich markup, terminal escape sequences or bidi overrides come out plain
(no markup read, control characters escaped) at 80 columns and in ``--json``, on real ledger rows,
outbox rows and RabbitMQ dead letters."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import subprocess
import sys
from typing import Any

import aio_pika
import psycopg
import pytest
from psycopg import sql
from psycopg.types.json import Jsonb
from typer.testing import CliRunner

from consumer_kit.cli.console import Field, output, plain, print_records
from consumer_kit.cli.main import cli
from consumer_kit.telemetry.logs import JsonFormatter, SafeTextFormatter
from tests.fixtures.broker_env import Env

MARKUP_KEY = "order-[/]-1"  # a valid key that rich reads as a closing tag (MarkupError)
LINK = "[link=http://x]y[/link]"
ESCAPE = "\x1b[31mred"
BIDI = "\u202eevil"
HOSTILE = (MARKUP_KEY, LINK, ESCAPE, BIDI)
SCOPE = f"default/invoice.create{LINK}/v1"
NARROW = {"COLUMNS": "80"}


def squashed(text: str) -> str:
    """``text`` without whitespace and table borders, so a folded cell reads as one string."""
    return re.sub(r"[\s│┃║|─━═┌┐└┘├┤┬┴┼╭╮╰╯╇╈╉╊┡┩┏┓┗┛]+", "", text)


def assert_plain(printed: str, *expected: str) -> None:
    assert "\x1b" not in printed and "\u202e" not in printed and "\x9b" not in printed
    for value in expected:
        assert squashed(plain(value)) in squashed(printed), (value, printed)


def test_plain_escapes_every_control_and_bidi_character_and_leaves_the_rest() -> None:
    assert plain("\x1b[31mred") == "\\x1b[31mred"
    assert plain("a\x00b\x7f\x9b\n\t") == "a\\x00b\\x7f\\x9b\\x0a\\x09"
    assert plain("\u202aa\u202eb\u2066c\u2069d\u200fe\u2028") == "\\u202aa\\u202eb\\u2066c\\u2069d\\u200fe\\u2028"
    assert plain("back\\slash") == "back\\\\slash"  # so an escape in the output reads one way only
    assert plain("op-🧾-ß-ǅ [b]x[/b] 日本") == "op-🧾-ß-ǅ [b]x[/b] 日本"
    assert plain(None) == "" and plain(42) == "42"


def test_a_narrow_terminal_gets_one_block_per_record_with_whole_words(capsys: pytest.CaptureFixture[str]) -> None:
    detail = "ValueError at handler.py:12: the downstream answered 503 three times in a row"
    console = output()
    console.width = 80
    print_records("t", [Field("scope", 16), Field("key", 16), Field("attempts", 8), Field("updated", 8),
                        Field("lease", 12), Field("reason", 20)],
                  [("default/invoice.create/v1", "k-1", 3, "5s ago", "", detail)], console)
    printed = capsys.readouterr().out
    assert all(word in printed for word in detail.split())  # folded at words, not every 8 characters
    assert squashed(detail) in squashed(printed)
    assert "default/invoice.create/v1" in printed
    assert max(len(line) for line in printed.splitlines()) <= 80
    console.width = 200
    print_records("t", [Field("a", 5), Field("b", 5)], [("x", "y")], console)
    assert printed.count("\n") > capsys.readouterr().out.count("\n")  # wide: one table row per record


async def seed_ledger(env: Env) -> None:
    """Rows of every kind the ledger commands print, each field holding hostile text."""
    statements = [
        ("INSERT INTO operations (scope, key, tenant, operation_type, fingerprint, projection_version, state,"
         " attempts, message_id, error_class, error_detail, result_status, result_body, resolution_note,"
         " resolved_at, resolved_by, watch_since, updated_at) VALUES (%s, %s, 'default', %s, %s, 1, %s, 2, %s, %s, %s, %s, %s, %s,"
         " now(), 'ops', now(), now() - interval '1 hour')",
         (SCOPE, key, f"invoice.create{LINK}", "f" * 64, state, f"{ESCAPE}-{LINK}", f"Err{LINK}",
          f"{ESCAPE} {BIDI} {MARKUP_KEY} " + "the downstream answered 503 " * 3, f"ok{ESCAPE}",
          Jsonb({"note": list(HOSTILE)}), f"checked {BIDI}"))
        for key, state in ((MARKUP_KEY, "needs_reconciliation"), (BIDI, "needs_reconciliation"),
                           (LINK, "failed"))
    ]
    statements.append((
        "INSERT INTO attempts (scope, key, failures, history) VALUES (%s, %s, 1, %s)",
        (SCOPE, MARKUP_KEY, Jsonb([{"at": "2026-12-01T09:00:00Z", "kind": "failure", "worker": f"w{LINK}",
                                    "message_id": ESCAPE, "detail": f"{BIDI} {ESCAPE}"}])),
    ))
    statements.append((
        "INSERT INTO evidence (scope, key, name, attempt, worker, facts) VALUES (%s, %s, %s, 1, %s, %s)",
        (SCOPE, MARKUP_KEY, f"send{LINK}", f"w{ESCAPE}", Jsonb({"id": ESCAPE, "x": LINK})),
    ))
    statements.append((
        "INSERT INTO outbox (event_id, destination, message_type, partition_key, payload, attempts, last_error)"
        " VALUES (gen_random_uuid(), %s, 'InvoiceCreated', %s, '{}', 50, %s)",
        (f"billing{LINK}", MARKUP_KEY, f"{ESCAPE} {BIDI}"),
    ))
    async with await psycopg.AsyncConnection.connect(env.database_url, autocommit=True) as conn:
        await conn.execute(sql.SQL("SET search_path = {}").format(sql.Identifier(env.schema)))
        for query, params in statements:
            await conn.execute(query, params)


def consumer_kit(env: Env, *args: str, columns: str = "80") -> str:
    result = CliRunner().invoke(cli, list(args), env={
        "CONSUMER_KIT_DATABASE_URL": env.database_url, "CONSUMER_KIT_DB_SCHEMA": env.schema,
        "CONSUMER_KIT_BROKER_URL": env.rabbitmq_url, "COLUMNS": columns,
    })
    assert result.exit_code == 0, (result.output, result.exception)
    return result.output


@pytest.mark.postgres
async def test_ledger_list_show_and_stats_print_hostile_rows_as_text_at_80_columns(env: Env) -> None:
    await seed_ledger(env)
    for columns in ("80", "250"):
        listed = await asyncio.to_thread(consumer_kit, env, "ledger", "list", columns=columns)
        assert_plain(listed, SCOPE, MARKUP_KEY, BIDI, f"Err{LINK}", "the downstream answered 503")
        failed = await asyncio.to_thread(consumer_kit, env, "ledger", "list", "--state", "failed", columns=columns)
        assert_plain(failed, LINK)
        shown = await asyncio.to_thread(
            consumer_kit, env, "ledger", "show", SCOPE, MARKUP_KEY, "--bodies", columns=columns
        )
        assert_plain(shown, SCOPE, MARKUP_KEY, f"{ESCAPE}-{LINK}", f"ok{ESCAPE}", f"checked {BIDI}",
                     f"send{LINK}", f"w{ESCAPE}", f"w{LINK}", f"{BIDI} {ESCAPE}")
        stats = await asyncio.to_thread(consumer_kit, env, "stats", columns=columns)
        assert_plain(stats, f"invoice.create{LINK}")
        assert max(len(line) for line in (listed + shown + stats).splitlines()) <= int(columns)
    narrow = await asyncio.to_thread(consumer_kit, env, "ledger", "list")
    assert "the downstream answered 503 the downstream" in narrow  # whole words on a line

    rows = json.loads(await asyncio.to_thread(
        consumer_kit, env, "ledger", "list", "--state", "needs_reconciliation", "--json"))
    assert {row["key"] for row in rows} == {MARKUP_KEY, BIDI}  # the JSON holds the values themselves
    raw = await asyncio.to_thread(consumer_kit, env, "ledger", "show", SCOPE, MARKUP_KEY, "--bodies", "--json")
    assert raw.isascii() and "\\u001b" in raw and "\\u202e" in raw  # JSON escapes: nothing reaches the terminal
    assert json.loads(raw)["result_body"] == {"note": list(HOSTILE)}
    assert (await asyncio.to_thread(consumer_kit, env, "stats", "--json")).isascii()


@pytest.mark.postgres
async def test_outbox_relay_status_prints_a_hostile_parked_row_as_text(env: Env) -> None:
    await seed_ledger(env)
    base = [sys.executable, "-m", "consumer_kit.outbox_relay.cli", "status", "--schema", env.schema]
    environ = {"CONSUMER_KIT_DATABASE_URL": env.database_url, "PATH": "/usr/bin:/bin", **NARROW}
    text = await asyncio.to_thread(subprocess.run, base, env=environ, capture_output=True, text=True, timeout=60)
    assert text.returncode == 0, text.stderr
    assert_plain(text.stdout, f"billing{LINK}", MARKUP_KEY, f"{ESCAPE} {BIDI}")
    raw = await asyncio.to_thread(
        subprocess.run, [*base, "--json"], env=environ, capture_output=True, text=True, timeout=60
    )
    assert raw.returncode == 0 and raw.stdout.isascii(), raw.stderr
    (parked,) = json.loads(raw.stdout)["parked_rows"]
    assert (parked["partition_key"], parked["last_error"]) == (MARKUP_KEY, f"{ESCAPE} {BIDI}")


@pytest.mark.postgres
def test_an_error_line_quoting_a_key_escapes_it(env: Env) -> None:
    result = CliRunner().invoke(cli, ["ledger", "show", SCOPE, ESCAPE], env={
        "CONSUMER_KIT_DATABASE_URL": env.database_url, "CONSUMER_KIT_DB_SCHEMA": env.schema, **NARROW,
    })
    assert result.exit_code == 2
    assert "\x1b" not in result.output and plain(ESCAPE) in result.output


async def publish_dead_letters(env: Env) -> list[dict[str, Any]]:
    """Two hostile messages in ``<queue>.dlq``, as a producer's message the broker dead-lettered
    itself arrives there: with every header and property the producer wrote."""
    letters = [
        {"message_id": f"{ESCAPE}{LINK}", "headers": {"operation-id": MARKUP_KEY, "x-dead-letter-reason": LINK,
                                                      "x-dead-letter-detail": f"{ESCAPE} {BIDI}"}},
        {"message_id": BIDI, "headers": {"operation-id": f"{BIDI}{MARKUP_KEY}", "x-dead-letter-reason": ESCAPE}},
    ]
    connection = await aio_pika.connect(env.rabbitmq_url)
    async with connection:
        channel = await connection.channel()
        await channel.declare_queue(env.queue + ".dlq", durable=True)
        for letter in letters:
            await channel.default_exchange.publish(aio_pika.Message(
                json.dumps({"text": list(HOSTILE)}, ensure_ascii=False).encode(),
                message_id=letter["message_id"], headers=letter["headers"],
            ), routing_key=env.queue + ".dlq")
    return letters


@pytest.mark.postgres
@pytest.mark.rabbitmq
async def test_dlq_list_prints_hostile_dead_letters_as_text(env: Env) -> None:
    letters = await publish_dead_letters(env)
    for columns in ("80", "250"):
        table = await asyncio.to_thread(consumer_kit, env, "dlq", "list", env.queue, "--show-body", columns=columns)
        assert_plain(table, *(letter["message_id"] for letter in letters), MARKUP_KEY, f"{BIDI}{MARKUP_KEY}",
                     json.dumps({"text": list(HOSTILE)}, ensure_ascii=False))
        assert max(len(line) for line in table.splitlines()) <= int(columns)
    raw = await asyncio.to_thread(consumer_kit, env, "dlq", "list", env.queue, "--show-body", "--json")
    assert raw.isascii()
    listed = json.loads(raw)
    assert sorted(row["message_id"] for row in listed) == sorted(letter["message_id"] for letter in letters)
    assert {row["body"] for row in listed} == {json.dumps({"text": list(HOSTILE)}, ensure_ascii=False)}


def test_log_lines_escape_what_a_terminal_would_act_on_and_json_logs_keep_the_values() -> None:
    """The worker's own output: a delivery line quoting a producer's message id and key."""
    message_id, key = f"{ESCAPE}\x9b2J{LINK}", f"{BIDI}{MARKUP_KEY}"
    record = logging.LogRecord("consumer_kit.runtime", logging.WARNING, __file__, 1,
                               "delivery message_id=%s operation_key=%s", (message_id, key), None)
    text = SafeTextFormatter("%(levelname)s %(message)s").format(record)
    assert text == f"WARNING delivery message_id=\\x1b[31mred\\x9b2J{LINK} operation_key=\\u202eevil{MARKUP_KEY}"
    line = JsonFormatter().format(record)
    assert not any(char in line for char in "\x1b\x9b\u202e")
    assert json.loads(line)["message"] == f"delivery message_id={message_id} operation_key={key}"
    assert "op-🧾-日本" in JsonFormatter().format(logging.LogRecord(
        "consumer_kit", logging.INFO, __file__, 1, "%s", ("op-🧾-日本",), None))  # the rest stays readable
