"""``consumer-kit ledger``: look at operations and resolve the parked ones by hand.

    consumer-kit ledger list --state needs_reconciliation --older-than 10m [--json]
    consumer-kit ledger show SCOPE KEY [--bodies] [--json]
    consumer-kit ledger resolve SCOPE KEY --completed|--not-done|--failed --note "refund checked in the PSP"

Reads CONSUMER_KIT_DATABASE_URL and CONSUMER_KIT_DB_SCHEMA only. Result bodies are printed only
with ``--bodies`` (they may hold personal data).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import re
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, TypeVar

import psycopg
import typer

from consumer_kit.cli.console import (
    Embedded,
    Field,
    fail,
    output,
    plain,
    print_fields,
    print_records,
    read_settings,
    require_database,
    to_json,
    user_errors,
)
from consumer_kit.db.embedded import database_url
from consumer_kit.db.pooler import connect_options
from consumer_kit.errors import Refused
from consumer_kit.ledger.inspect import (
    COMPLETED_DECISION,
    FAILED_DECISION,
    NOT_DONE_DECISION,
    STATES,
    LedgerInspector,
    OperationDetail,
    OperationSummary,
)
from consumer_kit.ops.operator_actions import default_actor, resolve_parked
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
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not a duration such as 30s, 10m, 2h or 1d")
    return float(match[1]) * _UNIT_SECONDS[match[2]]


ALL_STATES = "all"


@ledger_cli.command("list")
def list_operations(
    state: Annotated[
        str, typer.Option(help=f"{ALL_STATES} (every state), or one of {', '.join(STATES)}")
    ] = ALL_STATES,
    older_than: Annotated[str, typer.Option(help="Not updated for this long: 30s, 10m, 2h, 1d")] = "0s",
    limit: Annotated[int, typer.Option(min=1, max=10000)] = 100,
    schema: Schema = None,
    as_json: AsJson = False,
    embedded: Embedded = False,
) -> None:
    """Operations, oldest first (no bodies): every state unless --state names one; the title says
    which states it shows (parked ones: --state needs_reconciliation)."""
    if state != ALL_STATES and state not in STATES:
        fail(f"--state={state}: must be {ALL_STATES} or one of {', '.join(STATES)}")
    try:
        seconds = parse_duration(older_than)
    except ValueError as exc:
        fail(f"--older-than: {exc}")
    settings = _settings(schema, embedded, "consumer-kit ledger list")
    inspector = LedgerInspector(settings.db_schema)
    only = None if state == ALL_STATES else state
    rows = _run(settings, lambda conn: inspector.list(conn, only, older_than=seconds, limit=limit))
    if as_json:
        typer.echo(to_json([_jsonable(dataclasses.asdict(r)) for r in rows]))
        return
    now = dt.datetime.now(dt.UTC)
    shown = f"state {state}" if only else f"all states ({', '.join(STATES)})"
    older = f", not updated for {older_than}" if seconds else ""
    # scope and key are whole (folded, never cut with ...): they are what `ledger show` takes
    print_records(
        f"operations in {settings.db_schema}, {shown}{older} ({len(rows)}{', limit reached' if len(rows) == limit else ''})",
        (Field("scope", 16), Field("key", 16), Field("state", 10), Field("attempts", 8, "right"),
         Field("updated", 8), Field("lease", 12), Field("reason", 20)),
        [(row.scope, row.key, row.state, row.attempts, f"{_age(now, row.updated_at)} ago", _lease(row, now),
          (row.error_class or "") + (f": {row.error_detail}" if row.error_detail else "")) for row in rows],
    )
    if only and not rows:
        typer.echo(f"no operation in state {state}; `consumer-kit ledger list` shows every state")


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
    settings = _settings(schema, embedded, "consumer-kit ledger show")
    inspector = LedgerInspector(settings.db_schema)
    detail = _run(settings, lambda conn: inspector.show(conn, scope, key, bodies=bodies))
    if detail is None:
        hint = "" if scope.count("/") >= 2 else (
            "; a scope is tenant/operation type/version, e.g. default/invoice.create/v1"
            " (`consumer-kit ledger list --json` prints whole scopes)"
        )
        fail(f"no operation {scope} {key} in schema {settings.db_schema}{hint}")
    if as_json:
        typer.echo(to_json(_jsonable(dataclasses.asdict(detail))))
        return
    _print_detail(detail, bodies)


@ledger_cli.command()
def resolve(
    scope: Annotated[str, typer.Argument(help="e.g. default/email.welcome/v1")],
    key: Annotated[str, typer.Argument(help="The operation key")],
    completed: Annotated[bool, typer.Option("--completed", help="The effect happened")] = False,
    not_done: Annotated[bool, typer.Option(
        "--not-done", help="The effect did not happen: run again with the same downstream keys")] = False,
    failed: Annotated[bool, typer.Option("--failed", help="The effect did not happen and will not")] = False,
    note: Annotated[str, typer.Option(help="Why (kept with the row: what you checked)")] = "",
    by: Annotated[str | None, typer.Option(help="Who (default user@host)")] = None,
    status: Annotated[str | None, typer.Option(help="Result status replayed to duplicates")] = None,
    schema: Schema = None,
    embedded: Embedded = False,
) -> None:
    """Settle a parked operation (or one stuck processing under an expired lease) as completed,
    not done or failed (audited). Its parked message can then be redriven: it answers as a
    duplicate (or the failure), or, not done, runs the handler again with the same downstream keys."""
    if completed + not_done + failed != 1:
        fail("say what happened: exactly one of --completed, --not-done or --failed")
    if not note.strip():
        fail("--note is required: say what you checked (it is kept with the row)")
    settings = _settings(schema, embedded, "consumer-kit ledger resolve")
    who = by or default_actor()
    decision = COMPLETED_DECISION if completed else NOT_DONE_DECISION if not_done else FAILED_DECISION
    try:
        state = _run(settings, lambda conn: resolve_parked(
            conn, settings.db_schema, scope, key, decision=decision, note=note, by=who, source="cli",
            status=status,
        ))
    except Refused as refused:
        fail(str(refused))
    typer.echo(plain(f"{scope} {key}: {state} (resolved by {who})"))


def _settings(schema: str | None, embedded: bool, program: str) -> DatabaseSettings:
    """The database settings of ``program`` (named in the refusal when no database is set)."""
    settings = read_settings(
        DatabaseSettings, db_schema=schema, database_url=EMBEDDED if embedded else None,
        options={"db_schema": "--schema"},
    )
    with user_errors(settings):
        require_database(settings, program)
    return settings


def _run(settings: DatabaseSettings, query: Callable[[psycopg.AsyncConnection[Any]], Awaitable[T]]) -> T:
    async def run() -> T:
        async with await psycopg.AsyncConnection.connect(database_url(settings), autocommit=True, **connect_options(settings)) as conn:
            return await query(conn)

    with user_errors(settings):
        return asyncio.run(run())
    raise AssertionError("unreachable")  # user_errors exits on every error


def _print_detail(detail: OperationDetail, bodies: bool) -> None:
    console = output()
    row = detail.summary
    fields: list[tuple[str, object]] = []
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
            fields.append((name, value))
    if bodies:
        fields.append(("result body", to_json(detail.result_body, indent=None)))
    print_fields(f"{row.scope} {row.key}", fields, console)
    if detail.evidence:
        print_records(
            "evidence",
            (Field("recorded", 19), Field("call", 12), Field("attempt", 7, "right"), Field("worker", 12),
             Field("facts", 24)),
            [(record.recorded_at, record.name, record.attempt, record.worker,
              to_json(record.facts, indent=None)) for record in detail.evidence],
            console,
        )
    if detail.attempts is not None:
        attempts = detail.attempts
        print_records(
            f"attempts: failures {attempts.failures}, contentions {attempts.contentions}, "
            f"crashes {attempts.crashes}",
            (Field("at", 19), Field("kind", 10), Field("worker", 12), Field("message id", 16),
             Field("detail", 24)),
            [[entry.get(k, "") for k in ("at", "kind", "worker", "message_id", "detail")]
             for entry in attempts.history],
            console,
        )


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
