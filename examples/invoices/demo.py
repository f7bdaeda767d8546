"""The demo: the invoices example against the embedded PostgreSQL and the memory broker.

Run it with ``python -m consumer_kit.demo`` (installed: this folder, ``examples/invoices``, installs
as ``consumer_kit.demo``) or, from a clone, ``python -m consumer_kit.demo.demo``. It lives with the
example (not in the core) because it wires everything together: the core, the memory adapter and
the relay; the core does not import it. Imports of this folder are relative, so both names work.

It sends commands in phases (unique ones, duplicates sequential and concurrent, a resend with
only ``requested_at`` changed, a conflicting amount, invalid bodies, a permanent failure and its
duplicate, a crash between COMMIT and ack), relays the outbox, then prints every delivery's
outcome and checks that each customer's balance equals the sum of its unique valid commands.
Exit code 0 when every check holds, 1 otherwise.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import sys
from typing import Any

import psycopg
import typer
from psycopg import sql
from rich.console import Console
from rich.table import Table

from consumer_kit.adapters.memory import MemoryBroker, MemoryConsumer, MemoryPublisher
from consumer_kit.broker import Delivery
from consumer_kit.cli.console import LibraryLogLevel, LogLevel, read_settings, setup_logging, user_errors
from consumer_kit.db.embedded import database_url
from consumer_kit.errors import SimulatedCrash
from consumer_kit.ledger import migrate
from consumer_kit.model.outcomes import DeliveryReport
from consumer_kit.outbox_relay.relay import relay_pending
from consumer_kit.pipeline import crashpoints
from consumer_kit.pipeline.crashpoints import CrashPoint
from consumer_kit.pipeline.runtime import Runtime, open_pool
from consumer_kit.settings import Settings

from .app import app, create_tables

DEMO_SCHEMA = "consumer_kit_demo"
QUEUE = "invoices.commands"
LOCK_TIMEOUT = 0.5  # seconds: short, so the crashed delivery comes back quickly


def _command(order_id: int, customer: str, amount: int, **changes: Any) -> bytes:
    body: dict[str, Any] = {
        "order_id": order_id, "revision": 1, "customer_id": customer, "amount_cents": amount,
        "currency": "EUR", "requested_at": dt.datetime.now(dt.UTC).isoformat(),
    }
    body.update(changes)
    return json.dumps(body).encode()


# (label, body, counts towards the balance); phases run one after another.
def _phases() -> list[list[tuple[str, bytes, bool]]]:
    return [
        [("order 1, crash after COMMIT", _command(1, "acme", 1000), True)],
        [
            ("order 2", _command(2, "acme", 2500), True),
            ("order 3", _command(3, "globex", 4000), True),
            ("order 4", _command(4, "globex", 700), True),
        ],
        [("order 5, 3 copies at once", _command(5, "initech", 300), copy == 0) for copy in range(3)],
        [
            ("order 2 resent", _command(2, "acme", 2500), False),
            ("order 3, new requested_at", _command(3, "globex", 4000, requested_at="2030-01-01T00:00:00Z"), False),
            ("order 4, amount changed", _command(4, "globex", 99999), False),
            ("not JSON", b"{this is not json", False),
            ("wrong shape", json.dumps({"order_id": "x"}).encode(), False),
            ("order 6, negative amount", _command(6, "acme", -10), False),
        ],
        [("order 6 resent", _command(6, "acme", -10), False)],
    ]


async def run_demo(settings: Settings, console: Console | None = None, schema: str = DEMO_SCHEMA) -> int:
    """Run the demo in ``schema`` (dropped and recreated first); returns the process exit code
    (0: balances and outbox check out)."""
    console = console or Console(width=None if sys.stdout.isatty() else 130)

    settings = settings.model_copy(update={"db_schema": schema, "max_deliveries": 3})
    url = database_url(settings)
    console.print(f"[bold]consumer-kit demo[/bold]: PostgreSQL {_where(url)}, memory broker")
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
        await migrate(conn, schema)
        await conn.execute(sql.SQL("SET search_path = {}").format(sql.Identifier(schema)))
        await create_tables(conn)

    broker = MemoryBroker("demo", lock_timeout=LOCK_TIMEOUT)
    pool = await open_pool(settings, url, search_path=schema)
    runtime = Runtime(app, pool, settings, worker_id="demo")
    rows: list[tuple[str, DeliveryReport | None, int]] = []
    labels: dict[str, str] = {}
    expected: dict[str, int] = {}

    async def on_delivery(delivery: Delivery) -> None:
        try:
            rows.append((labels[delivery.message_id or ""], await runtime.process(delivery), delivery.delivery_count))
        except SimulatedCrash:
            rows.append((labels[delivery.message_id or ""], None, delivery.delivery_count))

    consumer = MemoryConsumer(broker)
    await consumer.subscribe(QUEUE, on_delivery, prefetch=settings.concurrency)
    try:
        for number, phase in enumerate(_phases()):
            if number == 0:
                crashpoints.arm(CrashPoint.AFTER_COMMIT_BEFORE_ACK, action="raise", times=1)
            for label, body, counts in phase:
                labels[broker.send(QUEUE, body)] = f"{label}{_what(body)}"
                if counts:
                    payload = json.loads(body)
                    expected[payload["customer_id"]] = expected.get(payload["customer_id"], 0) + payload["amount_cents"]
            await broker.wait_idle(timeout=30)
            crashpoints.disarm_all()
        published = await _relay(settings, url, broker)
    finally:
        crashpoints.disarm_all()
        await consumer.close()
        await pool.close()

    _print_deliveries(console, rows)
    balances = await _balances(url, schema)
    unique_commands = sum(counts for phase in _phases() for _, _, counts in phase)
    return _print_checks(console, expected, balances, published, unique_commands, broker.dead_letters(QUEUE))


async def _relay(settings: Settings, url: str, broker: Any) -> int:
    """Publish the outbox through the relay onto the memory broker; returns rows published."""


    published: int = await relay_pending(settings.model_copy(update={"database_url": url}), MemoryPublisher(broker))
    return published


async def _balances(url: str, schema: str) -> dict[str, int]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(
            sql.SQL("SELECT customer_id, invoiced_cents FROM {} ORDER BY 1").format(
                sql.Identifier(schema, "customers")
            )
        )
        return {row[0]: row[1] for row in await cur.fetchall()}


def _what(body: bytes) -> str:
    """`` (acme, 25.00)`` for a valid command body, ``""`` otherwise."""
    try:
        payload = json.loads(body)
        return f" ({payload['customer_id']}, {payload['amount_cents'] / 100:.2f})"
    except (ValueError, KeyError, TypeError):
        return ""


def _print_deliveries(console: Console, rows: list[tuple[str, DeliveryReport | None, int]]) -> None:
    table = Table(title="Deliveries, in the order they finished")
    for column in ("#", "command (customer, amount)", "delivery", "outcome", "settled", "reason"):
        table.add_column(column)
    for number, (label, report, delivery_count) in enumerate(rows, 1):
        if report is None:
            table.add_row(str(number), label, str(delivery_count), "[red]crashed[/red]", "-", "died after COMMIT")
            continue
        table.add_row(
            str(number), label, str(delivery_count), report.outcome.value,
            report.settlement.value if report.settlement else "-", report.reason or "",
        )
    console.print(table)
    console.print(
        "Order 1's first delivery committed its invoice, then the process 'died' before the ack, so\n"
        "it never reported 'executed'; the broker redelivered it (delivery 2) and the ledger answered\n"
        "'duplicate'. 'failed' is a permanent business failure (recorded once); 'failed_retained' is\n"
        "its duplicate, answered from the ledger without running the handler.\n"
    )


def _print_checks(
    console: Console,
    expected: dict[str, int],
    balances: dict[str, int],
    published: int,
    unique_commands: int,
    dead: list[Any],
) -> int:
    table = Table(title="Balances: invoiced_cents per customer")
    for column in ("customer", "expected (unique commands)", "actual", "ok"):
        table.add_column(column)
    ok = True
    for customer in sorted(set(expected) | set(balances)):
        good = expected.get(customer, 0) == balances.get(customer, 0)
        ok &= good
        table.add_row(customer, str(expected.get(customer, 0)), str(balances.get(customer, 0)), "yes" if good else "[red]NO[/red]")
    console.print(table)
    events_ok = published == unique_commands  # one InvoiceCreated per unique valid command
    ok &= events_ok
    console.print(f"outbox events relayed: {published} (expected {unique_commands}) {'ok' if events_ok else 'MISMATCH'}")
    console.print("dead-lettered: " + ", ".join(sorted(d.reason for d in dead)))
    console.print("[green]all checks passed[/green]" if ok else "[red]checks failed[/red]")
    return 0 if ok else 1


def _where(url: str) -> str:
    return "embedded (pgserver)" if "host=/" in url or "host=%2F" in url else url.split("@")[-1]


def main(
    log_level: LogLevel = "ERROR", library_log_level: LibraryLogLevel = "WARNING", schema: str = DEMO_SCHEMA
) -> None:
    """Run the invoices example with duplicates, a conflict, invalid bodies and a crash.

    Uses CONSUMER_KIT_DATABASE_URL if set, else an embedded PostgreSQL (the ``embedded`` extra;
    as root run as the account ``nobody``); the broker is the in-process memory broker. Drops and recreates ``--schema``
    (default consumer_kit_demo) on each run: give another one on a shared database.
    Exit code 0 when every balance equals the sum of the unique commands."""
    setup_logging(log_level, library_log_level)
    settings = read_settings(Settings)
    with user_errors(settings):  # no pgserver, no server: one `error:` line, exit 2
        code = asyncio.run(run_demo(settings, schema=schema))
    raise typer.Exit(code)


if __name__ == "__main__":
    command = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    command.command()(main)
    command()
