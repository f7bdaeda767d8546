"""``consumer-kit ledger``: look at operations and resolve the parked ones by hand.

    consumer-kit ledger list --state needs_reconciliation --older-than 10m [--json]
    consumer-kit ledger show SCOPE KEY [--bodies] [--json]
    consumer-kit ledger resolve SCOPE KEY --completed|--failed --note "refund checked in the PSP"

Reads CONSUMER_KIT_DATABASE_URL and CONSUMER_KIT_DB_SCHEMA only. Result bodies are printed only
with ``--bodies`` (they may hold personal data).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import getpass
import json
import re
import socket
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, TypeVar

import psycopg
import typer
from rich.console import Console
from rich.table import Table

from consumer_kit.cli.console import Embedded, fail, read_settings, require_database, user_errors
from consumer_kit.embedded import database_url
from consumer_kit.ledger.inspect import STATES, LedgerInspector, OperationDetail, OperationSummary
from consumer_kit.settings import EMBEDDED, DatabaseSettings

T = TypeVar("T")

ledger_cli = typer.Typer(
    no_args_is_help=True, help="Look at operations in the ledger; resolve parked ones (audited)."
)

Schema = Annotated[str | None, typer.Option(help="Schema (default CONSUMER_KIT_DB_SCHEMA or consumer_kit)")]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table")]

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """``"90"``, ``"90s"``, ``"10m"``, ``"2h"``, ``"1d"`` in seconds.

    Raises:
        ValueError: anything else.
    """
    match = _DURATION.match(text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not a duration such as 30s, 10m, 2h or 1d")
    return float(match[1]) * _UNIT_SECONDS[match[2]]


@ledger_cli.command("list")
def list_operations(
    state: Annotated[str, typer.Option(help=f"One of {', '.join(STATES)}")] = "needs_reconciliation",
    older_than: Annotated[str, typer.Option(help="Not updated for this long: 30s, 10m, 2h, 1d")] = "0s",
    limit: Annotated[int, typer.Option(min=1, max=10000)] = 100,
    schema: Schema = None,
    as_json: AsJson = False,
    embedded: Embedded = False,
) -> None:
    """Operations in one state, oldest first (no bodies)."""
    if state not in STATES:
        fail(f"--state={state}: must be one of {', '.join(STATES)}")
    try:
        seconds = parse_duration(older_than)
    except ValueError as exc:
        fail(f"--older-than: {exc}")
    settings = _settings(schema, embedded)
    inspector = LedgerInspector(settings.db_schema)
    rows = _run(settings, lambda conn: inspector.list(conn, state, older_than=seconds, limit=limit))
    if as_json:
        typer.echo(json.dumps([_jsonable(dataclasses.asdict(r)) for r in rows], indent=2))
        return
    table = Table(title=f"{state} operations in {settings.db_schema} ({len(rows)})")
    for column in ("scope", "key", "attempts", "updated", "lease", "reason"):
        # scope and key are whole (folded, never cut with ...): they are what `ledger show` takes
        table.add_column(column, overflow="fold" if column in ("scope", "key") else "ellipsis")
    now = dt.datetime.now(dt.UTC)
    for row in rows:
        table.add_row(
            row.scope, row.key, str(row.attempts), f"{_age(now, row.updated_at)} ago",
            _lease(row, now), (row.error_class or "") + (f": {row.error_detail}" if row.error_detail else ""),
        )
    Console().print(table)


@ledger_cli.command()
def show(
    scope: Annotated[str, typer.Argument(help="e.g. default/invoice.create/v1")],
    key: Annotated[str, typer.Argument(help="The operation key")],
    bodies: Annotated[bool, typer.Option("--bodies", help="Also print the stored result body")] = False,
    schema: Schema = None,
    as_json: AsJson = False,
    embedded: Embedded = False,
) -> None:
    """One operation: its row, the evidence its remote calls recorded, its attempt history."""
    settings = _settings(schema, embedded)
    inspector = LedgerInspector(settings.db_schema)
    detail = _run(settings, lambda conn: inspector.show(conn, scope, key, bodies=bodies))
    if detail is None:
        hint = "" if scope.count("/") >= 2 else (
            "; a scope is tenant/operation type/version, e.g. default/invoice.create/v1"
            " (`consumer-kit ledger list --json` prints whole scopes)"
        )
        fail(f"no operation {scope} {key} in schema {settings.db_schema}{hint}")
    if as_json:
        typer.echo(json.dumps(_jsonable(dataclasses.asdict(detail)), indent=2))
        return
    _print_detail(detail, bodies)


@ledger_cli.command()
def resolve(
    scope: Annotated[str, typer.Argument(help="e.g. default/email.welcome/v1")],
    key: Annotated[str, typer.Argument(help="The operation key")],
    completed: Annotated[bool, typer.Option("--completed", help="The effect happened")] = False,
    failed: Annotated[bool, typer.Option("--failed", help="The effect did not happen and will not")] = False,
    note: Annotated[str, typer.Option(help="Why (kept with the row: what you checked)")] = "",
    by: Annotated[str | None, typer.Option(help="Who (default user@host)")] = None,
    status: Annotated[str | None, typer.Option(help="Result status replayed to duplicates")] = None,
    schema: Schema = None,
    embedded: Embedded = False,
) -> None:
    """Settle a parked operation (or one stuck processing under an expired lease) as completed or
    failed. Its parked message can then be redriven: it answers as a duplicate (or the failure)."""
    if completed == failed:
        fail("say what happened: exactly one of --completed or --failed")
    if not note.strip():
        fail("--note is required: say what you checked (it is kept with the row)")
    settings = _settings(schema, embedded)
    who = by or f"{getpass.getuser()}@{socket.gethostname()}"
    inspector = LedgerInspector(settings.db_schema)
    state = _run(settings, lambda conn: inspector.resolve(
        conn, scope, key, completed=completed, note=note.strip()[:2000], by=who, status=status,
    ))
    if state is None:
        fail(
            f"{scope} {key} is not parked (needs_reconciliation) nor stuck under an expired lease: "
            "see `consumer-kit ledger show`"
        )
    typer.echo(f"{scope} {key}: {state} (resolved by {who})")


def _settings(schema: str | None, embedded: bool) -> DatabaseSettings:
    settings = read_settings(
        DatabaseSettings, db_schema=schema, database_url=EMBEDDED if embedded else None,
        options={"db_schema": "--schema"},
    )
    with user_errors(settings):
        require_database(settings, "consumer-kit ledger")
    return settings


def _run(settings: DatabaseSettings, query: Callable[[psycopg.AsyncConnection[Any]], Awaitable[T]]) -> T:
    async def run() -> T:
        async with await psycopg.AsyncConnection.connect(database_url(settings), autocommit=True) as conn:
            return await query(conn)

    with user_errors(settings):
        return asyncio.run(run())
    raise AssertionError("unreachable")  # user_errors exits on every error


def _print_detail(detail: OperationDetail, bodies: bool) -> None:
    console = Console()
    row = detail.summary
    table = Table(title=f"{row.scope} {row.key}", show_header=False)
    table.add_column("field")
    table.add_column("value")
    for name, value in (
        ("state", row.state), ("attempts", row.attempts), ("lease", _lease(row, dt.datetime.now(dt.UTC))),
        ("result status", row.result_status), ("result reference", detail.result_reference),
        ("error", row.error_class and f"{row.error_class}: {row.error_detail or ''}"),
        ("fingerprint", f"{detail.fingerprint[:16]}... (projection v{detail.projection_version})"),
        ("message id", row.message_id), ("created", row.created_at), ("updated", row.updated_at),
        ("completed", row.completed_at),
        ("resolved", row.resolved_at and f"{row.resolved_at} by {row.resolved_by}: {row.resolution_note}"),
    ):
        if value is not None:
            table.add_row(name, str(value))
    if bodies:
        table.add_row("result body", json.dumps(detail.result_body))
    console.print(table)
    if detail.evidence:
        evidence = Table(title="evidence")
        for column in ("recorded", "call", "attempt", "worker", "facts"):
            evidence.add_column(column)
        for record in detail.evidence:
            evidence.add_row(str(record.recorded_at), record.name, str(record.attempt), record.worker,
                             json.dumps(record.facts, default=str))
        console.print(evidence)
    if detail.attempts is not None:
        attempts = detail.attempts
        history = Table(title=f"attempts: failures {attempts.failures}, contentions "
                              f"{attempts.contentions}, crashes {attempts.crashes}")
        for column in ("at", "kind", "worker", "message id", "detail"):
            history.add_column(column)
        for entry in attempts.history:
            history.add_row(*(str(entry.get(k, "")) for k in ("at", "kind", "worker", "message_id", "detail")))
        console.print(history)


def _lease(row: OperationSummary, now: dt.datetime) -> str:
    if row.lease_owner is None or row.lease_expires_at is None:
        return ""
    if row.lease_expired:
        return f"{row.lease_owner}, expired {_age(now, row.lease_expires_at)} ago"
    return f"{row.lease_owner}, {_age(row.lease_expires_at, now)} left"


def _age(later: dt.datetime, earlier: dt.datetime) -> str:
    seconds = max(0, int((later - earlier).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dt.datetime | dt.date):
        return value.isoformat()
    return value
