"""``consumer-kit stats``: outcome counts per operation type, stuck and parked operations, outbox lag.

    consumer-kit stats [--since 1h] [--json]

Reads CONSUMER_KIT_DATABASE_URL and CONSUMER_KIT_DB_SCHEMA only (what the numbers mean:
:mod:`consumer_kit.ops.stats`). Duplicates, payload conflicts, in-progress collisions, uncertain
outcomes and key-expiry refusals leave no ledger row of their own (one row per operation): they
come from the workers' per-minute outcome counts (ledger migration 8), written every summary
interval.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated

import typer
from rich.console import Console

from consumer_kit.cli.console import (
    Embedded,
    Field,
    cell,
    fail,
    output,
    print_records,
    read_settings,
    to_json,
)
from consumer_kit.cli.ledger import AsJson, Schema, _jsonable, _run, _settings, parse_duration
from consumer_kit.ops.stats import Stats, StatsReader, age_text, duration_text
from consumer_kit.settings import OutboxSettings

COLUMNS = (
    ("executed", "executed"), ("lease_recovered", "recovered"), ("failed", "failed"),
    ("retries", "retries"), ("contentions", "contentions"), ("contentions_in_place", "retried in place"),
    ("crashes", "crashes"),
    ("crashed_worker", "parked (crash)"), ("processing", "processing"), ("expired_leases", "stuck"),
    ("needs_reconciliation", "reconcile"), ("resolved", "resolved"),
)
"""(OperationStats field, column title) of the table, in order."""

DELIVERY_COLUMNS = (
    ("executed", "first"), ("duplicates", "dupes"), ("payload_conflicts", "clash"), ("in_progress", "busy"),
    ("lease_recovered", "recov"), ("uncertain", "uncert"), ("key_expired", "expired"),
)
"""(OperationStats field, short column title) of the deliveries table: short so that it fits 80
columns; :data:`DELIVERY_LEGEND` spells them out under it."""

DELIVERY_LEGEND = (
    "first: first executions, dupes: duplicates, clash: payload conflicts, busy: in-progress "
    "collisions, recov: recovered leases, uncert: uncertain outcomes (COMMIT without a reply), "
    "expired: key-expiry refusals; dupes to expired from the workers' per-minute counts"
)


def stats(
    since: Annotated[str, typer.Option(help="Window: 30s, 10m, 1h, 1d")] = "1h",
    max_attempts: Annotated[
        int | None,
        typer.Option(min=1, help="The relay's parking bound (default CONSUMER_KIT_RELAY_MAX_ATTEMPTS, else 20)"),
    ] = None,
    schema: Schema = None,
    as_json: AsJson = False,
    embedded: Embedded = False,
) -> None:
    """Outcome counts per operation type, stuck and parked operations with ages, outbox lag."""
    try:
        seconds = parse_duration(since)
    except ValueError as exc:
        fail(f"--since: {exc}")
    settings = _settings(schema, embedded, "consumer-kit stats")
    if max_attempts is None:  # the relay's setting, read from the relay's group
        max_attempts = read_settings(OutboxSettings, db_schema=settings.db_schema).relay_max_attempts
    reader = StatsReader(settings.db_schema, max_attempts=max_attempts)
    result = _run(settings, lambda conn: reader.read(conn, since=seconds))
    if as_json:
        typer.echo(to_json(_jsonable(dataclasses.asdict(result))))
        return
    print_stats(result, since)


def print_stats(result: Stats, since: str, console: Console | None = None) -> None:
    """The operations table and the outbox table, as ``consumer-kit stats`` prints them (one block
    per operation type on a terminal too narrow for the table)."""
    console = console or output()
    rows = [
        (row.operation_type, *(getattr(row, field) for field, _ in COLUMNS),
         f"{age_text(row.oldest_expired_age)} / {age_text(row.oldest_reconciliation_age)}")
        for row in result.operations
    ] or [("(none)", *(0 for _ in COLUMNS), "- / -")]
    print_records(
        f"operations in {result.schema}, last {since} (at {result.generated_at:%Y-%m-%d %H:%M:%S %Z})",
        (Field("operation type", 16), *(Field(title, 6, "right") for _, title in COLUMNS),
         Field("oldest stuck / reconcile", 11, "right")),
        rows, console,
    )
    deliveries = [
        (row.operation_type, *(getattr(row, field) for field, _ in DELIVERY_COLUMNS)) for row in result.operations
    ] or [("(none)", *(0 for _ in DELIVERY_COLUMNS))]
    print_records(
        f"deliveries, last {since}",
        (Field("operation type", 12), *(Field(title, 5, "right") for _, title in DELIVERY_COLUMNS)),
        deliveries, console,
    )
    console.print(cell(DELIVERY_LEGEND))
    outbox = result.outbox
    if outbox is None:
        return
    print_records(
        "outbox",
        [Field(title, 7, "right") for title in ("pending", "oldest pending", "parked", f"published ({since})",
                                                 "commit→publish avg", "p50", "p95", "max")],
        [(outbox.pending, age_text(outbox.oldest_pending_age), outbox.parked, outbox.published,
          *(duration_text(v) for v in (outbox.latency_avg, outbox.latency_p50, outbox.latency_p95, outbox.latency_max)))],
        console,
    )
