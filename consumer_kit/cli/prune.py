"""``consumer-kit prune``: delete expired result bodies, then expired identities (docs/explanation/retention.md),
then the per-minute outcome counts older than ``--outcome-counts-retention`` (default 7 days).

Safe while workers run (bounded batches that skip rows a worker holds); ``--dry-run`` only counts.
Reads CONSUMER_KIT_DATABASE_URL and CONSUMER_KIT_DB_SCHEMA only.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

import psycopg
import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from consumer_kit.cli.console import (
    Embedded,
    LibraryLogLevel,
    LogLevel,
    fail,
    read_settings,
    require_database,
    setup_logging,
    user_errors,
)
from consumer_kit.cli.ledger import Schema, parse_duration
from consumer_kit.db.embedded import database_url
from consumer_kit.db.pooler import connect_options
from consumer_kit.ledger.outcome_counts import OUTCOME_COUNTS_RETENTION, OutcomeCountBook
from consumer_kit.ledger.retention import Pruner
from consumer_kit.settings import EMBEDDED, DatabaseSettings


def prune(
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Count what would go; change nothing")] = False,
    batch: Annotated[int, typer.Option(min=1, max=100_000, help="Rows per statement")] = 1000,
    grace: Annotated[str, typer.Option(help="Identities outlive their expiry by this much (clock skew)")] = "1h",
    outcome_counts_retention: Annotated[
        str, typer.Option(help="Per-minute outcome counts (the Pressure page's) are kept this long")
    ] = f"{OUTCOME_COUNTS_RETENTION / 86_400:.0f}d",
    schema: Schema = None,
    embedded: Embedded = False,
    log_level: LogLevel = "INFO",
    library_log_level: LibraryLogLevel = "WARNING",
) -> None:
    """Delete expired result bodies, then expired operation identities, then old per-minute
    outcome counts, in bounded batches."""
    setup_logging(log_level, library_log_level)
    try:
        grace_seconds = parse_duration(grace)
    except ValueError as exc:
        fail(f"--grace: {exc}")
    try:
        counts_retention = parse_duration(outcome_counts_retention)
    except ValueError as exc:
        fail(f"--outcome-counts-retention: {exc}")
    settings = read_settings(
        DatabaseSettings, db_schema=schema, database_url=EMBEDDED if embedded else None,
        options={"db_schema": "--schema"},
    )
    pruner = Pruner(settings.db_schema, grace=grace_seconds)
    outcome_counts = OutcomeCountBook(settings.db_schema)

    async def run() -> tuple[int, int, int]:
        async with await psycopg.AsyncConnection.connect(database_url(settings), autocommit=True, **connect_options(settings)) as conn:
            counts = await pruner.count(conn)
            old_minutes = await outcome_counts.count_old(conn, older_than=counts_retention)
            if dry_run:
                return counts.bodies, counts.identities, old_minutes
            tables = await pruner.tables(conn)
            done = [0, 0]
            with Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            ) as progress:
                for step, (label, total, one_batch) in enumerate((
                    ("result bodies", counts.bodies, pruner.prune_bodies),
                    ("identities", counts.identities, pruner.prune_identities),
                )):
                    task = progress.add_task(label, total=total or None)
                    for table in tables:  # one partition at a time
                        while (deleted := await one_batch(conn, table, batch)) > 0:
                            done[step] += deleted
                            progress.advance(task, deleted)
                            if deleted < batch:
                                break
                task = progress.add_task("outcome counts", total=old_minutes or None)
                minutes_deleted = 0
                while (deleted := await outcome_counts.prune(conn, batch, older_than=counts_retention)) > 0:
                    minutes_deleted += deleted
                    progress.advance(task, deleted)
                    if deleted < batch:
                        break
            return done[0], done[1], minutes_deleted

    with user_errors(settings):
        require_database(settings, "consumer-kit prune")
        bodies, identities, minutes = asyncio.run(run())
    verb = "would delete" if dry_run else "deleted"
    typer.echo(
        f"schema {settings.db_schema}: {verb} {bodies} result bodies and {identities} identities, "
        f"and {minutes} per-minute outcome counts older than {outcome_counts_retention}"
    )
