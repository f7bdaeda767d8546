"""``consumer-kit dlq``: list a work queue's dead letters and move them back.

    consumer-kit dlq list QUEUE [--limit 100] [--show-body] [--json] [--app APP]
    consumer-kit dlq redrive QUEUE (--reason R | --key K | --all) [--dry-run] [--app APP]

Works through the broker's adapter (:class:`consumer_kit.broker.DeadLetterQueues`): RabbitMQ
``<queue>.dlq``, SQS the queue's dead-letter queue, Service Bus ``<queue>/$DeadLetterQueue``.
Reads ``CONSUMER_KIT_BROKER_URL``; with ``CONSUMER_KIT_DATABASE_URL`` set, first and last failure
come from the ledger's attempt history (else from the broker's times). Bodies are printed only with
``--show-body`` (they may hold personal data). ``--app`` computes operation keys that handlers
derive from the body (otherwise: header ``operation-id``). A redrive (dry run included) and a
``--show-body`` listing are written to the audit table (``source`` ``cli``) before they act; without
``CONSUMER_KIT_DATABASE_URL`` they run unaudited, with a warning.

Reasons, details, original queues and counts shown are consumer-kit's signed marks only (with the
deployment's key: from the ledger schema, or ``CONSUMER_KIT_MARK_KEY``); a producer's own are not
shown, and a letter the broker dead-lettered shows ``broker:<reason>``. A redrive sends each letter
to QUEUE (or the queue a signed mark names), never to a queue a producer's header names.

A redriven message keeps its body, message id and operation headers, so it keeps its operation key:
one whose operation completed meanwhile is answered as a duplicate, never executed twice.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, TypeVar

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from consumer_kit.app import App, load_app
from consumer_kit.broker import DeadLetterQueues
from consumer_kit.cli.console import (
    Field,
    fail,
    output,
    plain,
    print_records,
    read_settings,
    require_shared_broker,
    to_json,
    user_errors,
)
from consumer_kit.errors import Refused
from consumer_kit.ops.audit_trail import AuditTrail
from consumer_kit.ops.operator_actions import (
    RedriveOutcome,
    Row,
    Selection,
    dead_letter_rows,
    default_actor,
    open_dead_letter_queues,
    redrive_dead_letters,
)
from consumer_kit.ops.stats import UNKNOWN_TIME
from consumer_kit.settings import BrokerSettings, LoggingSettings

T = TypeVar("T")

dlq_cli = typer.Typer(no_args_is_help=True, help="List a queue's dead letters; move them back (redrive).")

Queue = Annotated[str, typer.Argument(help="The work queue (as the app subscribes it)")]
AppOption = Annotated[
    str | None, typer.Option("--app", help="package.module:attribute: compute operation keys with its handlers")
]


@dlq_cli.command("list")
def list_dead_letters(
    queue: Queue,
    limit: Annotated[int, typer.Option(min=1, max=10_000, help="At most this many, oldest first")] = 100,
    show_body: Annotated[bool, typer.Option("--show-body", help="Also print each body (may hold personal data)")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table")] = False,
    app: AppOption = None,
) -> None:
    """Reason, detail, delivery count, first and last failure and operation key of each dead letter
    (nothing is removed)."""
    settings = _settings()
    application = _app(app)

    trail = _trail(settings) if show_body else None

    async def read(dead: DeadLetterQueues) -> list[Row]:
        rows = await dead_letter_rows(settings, application, await dead.peek(queue, limit=limit))
        if trail is not None:  # recorded before any body is printed
            await trail.record("show_body", f"{queue} list", f"shown {len(rows)}", queue=queue,
                               message_ids=[row.letter.message_id for row in rows])
        return rows

    rows = _with_dead_letters(settings, read)
    if as_json:
        typer.echo(to_json([_json(row, show_body) for row in rows]))
        return
    fields = [Field("message id", 16), Field("operation key", 16), Field("reason", 16), Field("detail", 20),
              Field("deliveries", 10, "right"), Field("first failure", 10), Field("last failure", 10)]
    print_records(
        f"dead letters of {queue} ({len(rows)}{'+' if len(rows) == limit else ''})",
        fields + ([Field("body", 24)] if show_body else []),
        [(row.letter.message_id or "-", row.operation_key or "-", row.letter.reason, row.letter.detail[:120],
          row.letter.delivery_count, _time(row.first_failure), _time(row.last_failure),
          *([row.letter.body.decode("utf-8", "replace")] if show_body else [])) for row in rows],
    )


@dlq_cli.command()
def redrive(
    queue: Queue,
    reason: Annotated[str | None, typer.Option(help="Only this reason (max_deliveries_exceeded also matches max_deliveries_exceeded:...)")] = None,
    key: Annotated[list[str] | None, typer.Option(help="Only this operation key (repeatable)")] = None,
    everything: Annotated[bool, typer.Option("--all", help="Every dead letter of the queue")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Count what would move; move nothing")] = False,
    app: AppOption = None,
) -> None:
    """Move dead letters back to QUEUE, each with its operation key (a redrive of an operation that
    is done answers as a duplicate). Say which: --reason, --key or --all."""
    try:
        selection = Selection(reason=reason, keys=frozenset(key or []), everything=everything)
    except Refused as refused:
        fail(str(refused))
    settings = _settings()
    application = _app(app)
    trail = _trail(settings)

    async def move(dead: DeadLetterQueues) -> RedriveOutcome:
        async with trail.around("redrive_dry_run" if dry_run else "redrive", f"{queue} {selection.describe()}",
                                queue=queue, reason=reason, keys=sorted(selection.keys)) as result:
            outcome = await _moved(dead)
            report = outcome.report
            result.update(outcome=f"{'would redrive' if dry_run else 'redrove'} {report.redriven}, kept "
                          f"{report.kept}, failed {report.failed}", redriven=report.redriven, kept=report.kept,
                          failed=report.failed)
        return outcome

    async def _moved(dead: DeadLetterQueues) -> RedriveOutcome:
        total = await dead.count(queue)
        with Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=output(stderr=True), disable=not sys.stderr.isatty() and not read_settings(LoggingSettings).progress,
        ) as progress:
            # a description is read as markup: the queue's name goes in escaped
            task = progress.add_task(escape(f"{'checking' if dry_run else 'redriving'} {plain(queue)}"), total=total)
            return await redrive_dead_letters(
                dead, queue, selection, app=application, dry_run=dry_run,
                progress=lambda _letter, _moved: progress.advance(task),
            )

    outcome = _with_dead_letters(settings, move)
    report, keyless = outcome.report, outcome.keyless
    verb = "would redrive" if dry_run else "redrove"
    typer.echo(plain(f"{verb} {report.redriven}, kept {report.kept}, failed {report.failed} (queue {queue})"))
    if keyless:
        typer.echo(
            f"note: {keyless} dead letter(s) carry no operation-id header, so --key cannot match them: "
            "pass --app package.module:app to compute the keys their handlers derive from the body",
            err=True,
        )
    if report.failed:
        raise typer.Exit(1)


def _settings() -> BrokerSettings:
    settings = read_settings(BrokerSettings)
    with user_errors(settings):
        require_shared_broker(settings, "consumer-kit dlq")
    return settings


def _trail(settings: BrokerSettings) -> AuditTrail:
    """The CLI's audit trail (``source`` ``cli``, actor ``user@host``); without a database it
    writes nothing, and says so."""
    trail = AuditTrail(settings, default_actor(), "cli")
    if not trail.enabled:
        typer.echo("warning: not audited: set CONSUMER_KIT_DATABASE_URL to record this in the audit table",
                   err=True)
    return trail


def _app(path: str | None) -> App | None:
    if path is None:
        return None
    sys.path.insert(0, os.getcwd())
    with user_errors():
        return load_app(path)
    raise AssertionError("unreachable")  # user_errors exits on every error


def _with_dead_letters(settings: BrokerSettings, work: Callable[[DeadLetterQueues], Awaitable[T]]) -> T:
    async def run() -> T:
        async with open_dead_letter_queues(settings) as dead:
            return await work(dead)

    with user_errors(settings):
        return asyncio.run(run())
    raise AssertionError("unreachable")


def _json(row: Row, show_body: bool) -> dict[str, Any]:
    letter = row.letter
    entry: dict[str, Any] = {
        "queue": letter.queue, "message_id": letter.message_id, "operation_key": row.operation_key,
        "reason": letter.reason, "detail": letter.detail, "delivery_count": letter.delivery_count,
        "first_failure": _iso(row.first_failure), "last_failure": _iso(row.last_failure),
        "dead_lettered_at": _iso(letter.dead_lettered_at),
    }
    if show_body:
        entry["body"] = letter.body.decode("utf-8", "replace")
    return entry


def _iso(value: dt.datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _time(value: dt.datetime | None) -> str:
    return UNKNOWN_TIME if value is None else value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
