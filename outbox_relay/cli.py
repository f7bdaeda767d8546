"""The ``outbox-relay`` command.

``outbox-relay``            relay until SIGTERM/SIGINT (finishes the in-flight batch, exits 0)
``outbox-relay --once``     publish what is claimable now and exit (cron, tests)
``outbox-relay status``     pending, retrying, claimed, parked, oldest pending age, published/min
``outbox-relay requeue``    make parked rows claimable again (all, or ``--event-id`` ones)
``outbox-relay cleanup``    delete published rows older than the retention now
``outbox-relay rebind``     the schema's outbox now belongs to CONSUMER_KIT_BROKER_URL's broker

Settings come from ``CONSUMER_KIT_*`` environment variables (see
:class:`consumer_kit.outbox_relay.settings.RelaySettings`; ``status``, ``requeue`` and ``cleanup`` read only
:class:`~consumer_kit.outbox_relay.settings.OutboxSettings`); options override them. Exit codes: 0 done,
2 configuration error (a setting out of range, no database named, PostgreSQL or the broker
unreachable or refusing at start-up, unknown destination, schema not migrated).
"""

from __future__ import annotations

import asyncio
import signal
import uuid
from pathlib import Path
from typing import Annotated, Any

import psycopg
import typer

from consumer_kit.cli.console import (
    Embedded,
    HealthHost,
    LibraryLogLevel,
    LogFormat,
    LogLevel,
    MetricsHost,
    MetricsPort,
    Otel,
    plain,
    read_settings,
    read_telemetry,
    require_database,
    require_shared_broker,
    setup_logging,
    to_json,
    user_errors,
    version_callback,
)
from consumer_kit.db.embedded import database_url
from consumer_kit.db.pooler import connect_options
from consumer_kit.settings import EMBEDDED
from consumer_kit.telemetry.setup import install

from .binding import rebind as rebind_broker
from .relay import Relay
from .settings import OutboxSettings, RelaySettings
from .store import OutboxStore

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Publish consumer-kit outbox rows to the broker (at least once, ordered per key).",
)

Schema = Annotated[str | None, typer.Option(help="Schema (default CONSUMER_KIT_DB_SCHEMA)")]
MaxAttempts = Annotated[
    int | None, typer.Option(min=1, help="Failed attempts before a row counts as parked")
]


OPTIONS = {
    "db_schema": "--schema",
    "relay_batch_size": "--batch-size",
    "relay_max_in_flight": "--max-in-flight",
    "relay_poll_interval": "--poll-interval",
    "relay_claim_timeout": "--claim-timeout",
    "relay_max_attempts": "--max-attempts",
    "relay_destinations_file": "--destinations",
    "relay_health_file": "--health-file",
    "relay_health_port": "--health-port",
    "relay_health_host": "--health-host",
    "metrics_host": "--metrics-host",
    "relay_id": "--relay-id",
    "relay_retention": "--retention",
}
"""Setting -> the option that overrides it, so an error names what the user typed."""


def _outbox_settings(schema: str | None, max_attempts: int | None = None, **overrides: Any) -> OutboxSettings:
    """The settings of the maintenance commands (database and outbox rules only), or exit 2."""
    settings = read_settings(
        OutboxSettings, options=OPTIONS, db_schema=schema, relay_max_attempts=max_attempts, **overrides
    )
    with user_errors(settings):
        require_database(settings, "outbox-relay")
    return settings


@app.callback(invoke_without_command=True)
def run(
    ctx: typer.Context,
    once: Annotated[bool, typer.Option("--once", help="Publish what is pending, then exit")] = False,
    schema: Schema = None,
    batch_size: Annotated[int | None, typer.Option(min=1, help="Rows per claim")] = None,
    max_in_flight: Annotated[int | None, typer.Option(min=1, help="Unconfirmed publishes")] = None,
    poll_interval: Annotated[float | None, typer.Option(help="Fallback poll (seconds)")] = None,
    claim_timeout: Annotated[float | None, typer.Option(help="Claim lease (seconds)")] = None,
    max_attempts: MaxAttempts = None,
    ordered: Annotated[
        bool | None, typer.Option("--ordered/--unordered", help="Per-key commit order")
    ] = None,
    destinations: Annotated[
        Path | None, typer.Option(help="Destination map file (TOML or JSON with a destinations table)")
    ] = None,
    show_version: Annotated[bool, typer.Option(
        "--version", callback=version_callback("outbox-relay"), is_eager=True, help="Print the version and exit",
    )] = False,
    health_file: Annotated[Path | None, typer.Option(help="Touched on every loop")] = None,
    health_port: Annotated[int | None, typer.Option(help="HTTP health on --health-host (0: any free port)")] = None,
    health_host: HealthHost = None,
    relay_id: Annotated[str | None, typer.Option(help="Name written to claimed_by")] = None,
    embedded: Embedded = False,
    log_level: LogLevel = "INFO",
    library_log_level: LibraryLogLevel = "WARNING",
    log_format: LogFormat = "text",
    metrics_port: MetricsPort = None,
    metrics_host: MetricsHost = None,
    otel: Otel = False,
) -> None:
    """Relay outbox rows to the broker until SIGTERM (or once, with --once).

    Probes PostgreSQL and the broker at start-up: a refused login, a wrong URL, a missing vhost or
    a broker that stays down (RabbitMQ: 30 s) stops it with the reason (exit 2). --metrics-port
    serves the relay's metrics and the outbox gauges in Prometheus format; --otel exports traces
    and metrics by OTLP (OTEL_* variables)."""
    if ctx.invoked_subcommand is not None:
        return
    setup_logging(log_level, library_log_level, log_format)
    telemetry = read_telemetry(metrics_port=metrics_port, metrics_host=metrics_host, otel=otel)
    settings = read_settings(
        RelaySettings,
        options=OPTIONS,
        database_url=EMBEDDED if embedded else None,
        db_schema=schema,
        relay_batch_size=batch_size,
        relay_max_in_flight=max_in_flight,
        relay_poll_interval=poll_interval,
        relay_claim_timeout=claim_timeout,
        relay_max_attempts=max_attempts,
        relay_ordered=ordered,
        relay_destinations_file=destinations,
        relay_health_file=health_file,
        relay_health_port=health_port,
        relay_health_host=health_host,
        relay_id=relay_id,
    )
    with user_errors(settings):
        require_shared_broker(settings, "outbox-relay")
        require_database(settings, "outbox-relay")
        installed = install(
            service_name="outbox-relay", metrics_port=telemetry.metrics_port,
            metrics_addr=telemetry.metrics_host, otel=telemetry.otel,
        )
        try:
            gauges = telemetry.metrics_port is not None or telemetry.otel
            asyncio.run(_run(settings, once=once, gauges=gauges, interval=telemetry.metrics_interval))
        finally:
            installed.shutdown()


async def _run(settings: RelaySettings, *, once: bool, gauges: bool = False, interval: float = 15.0) -> None:
    relay = Relay(settings)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, relay.request_stop)
    if gauges:
        from consumer_kit.ops.gauges import DatabaseGauges

        async with DatabaseGauges(
            database_url(settings), settings.db_schema, outbox=True, max_attempts=settings.relay_max_attempts,
            interval=interval, connect=connect_options(settings),
        ):
            await relay.run(once=once)
    else:
        await relay.run(once=once)
    if once:
        typer.echo(f"published {relay.counters['published']} rows")


@app.command()
def status(
    schema: Schema = None,
    max_attempts: MaxAttempts = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
    log_level: LogLevel = "WARNING",
    library_log_level: LibraryLogLevel = "WARNING",
) -> None:
    """Print pending, retrying, claimed, parked, oldest pending age and published per minute."""
    setup_logging(log_level, library_log_level)
    settings = _outbox_settings(schema, max_attempts)

    async def read() -> tuple[Any, Any]:
        store = _store(settings)
        async with await _connect(settings) as conn:
            return await store.status(conn), await store.parked(conn)

    with user_errors(settings):
        counts, parked = asyncio.run(read())
    if as_json:
        typer.echo(to_json({
            **counts.__dict__,
            "parked_rows": [
                {"event_id": str(p.event_id), "destination": p.destination,
                 "partition_key": p.partition_key, "attempts": p.attempts,
                 "last_error": p.last_error}
                for p in parked
            ],
        }, indent=None))
        return
    age = "-" if counts.oldest_pending_age is None else f"{counts.oldest_pending_age:.1f} s"
    typer.echo(f"schema                  {settings.db_schema}")
    typer.echo(f"pending                 {counts.pending}")
    typer.echo(f"  retrying (backoff)    {counts.retrying}")
    typer.echo(f"  claimed now           {counts.claimed}")
    typer.echo(f"parked                  {counts.parked}")
    typer.echo(f"oldest pending age      {age}")
    typer.echo(f"published last minute   {counts.published_last_minute}")
    typer.echo(f"published (retained)    {counts.published_total}")
    for p in parked:
        typer.echo(plain(  # destination, key and error text come from producers and brokers
            f"  parked event_id={p.event_id} destination={p.destination} "
            f"key={p.partition_key} attempts={p.attempts} last_error={p.last_error}"
        ))


@app.command()
def requeue(
    event_id: Annotated[
        list[uuid.UUID] | None, typer.Option("--event-id", help="Only these (repeatable)")
    ] = None,
    schema: Schema = None,
    max_attempts: MaxAttempts = None,
    log_level: LogLevel = "WARNING",
    library_log_level: LibraryLogLevel = "WARNING",
) -> None:
    """Make parked rows claimable again (attempts reset to 0; last_error kept)."""
    setup_logging(log_level, library_log_level)
    settings = _outbox_settings(schema, max_attempts)

    async def go() -> int:
        async with await _connect(settings) as conn:
            return await _store(settings).requeue_parked(conn, event_id or None)

    with user_errors(settings):
        requeued = asyncio.run(go())
    typer.echo(f"requeued {requeued} parked rows")


@app.command()
def cleanup(
    schema: Schema = None,
    retention: Annotated[float | None, typer.Option(help="Keep published rows (seconds)")] = None,
    log_level: LogLevel = "WARNING",
    library_log_level: LibraryLogLevel = "WARNING",
) -> None:
    """Delete published rows older than the retention, in bounded batches."""
    setup_logging(log_level, library_log_level)
    settings = _outbox_settings(schema, relay_retention=retention)

    async def go() -> int:
        store, total = _store(settings), 0
        async with await _connect(settings) as conn:
            while True:
                n = await store.delete_published(
                    conn, older_than=settings.relay_retention, limit=settings.relay_cleanup_batch
                )
                total += n
                if n < settings.relay_cleanup_batch:
                    return total

    with user_errors(settings):
        deleted = asyncio.run(go())
    typer.echo(f"deleted {deleted} published rows")


@app.command()
def rebind(
    schema: Schema = None,
    log_level: LogLevel = "WARNING",
    library_log_level: LibraryLogLevel = "WARNING",
) -> None:
    """Record CONSUMER_KIT_BROKER_URL's broker as the one this schema's outbox belongs to, so the
    relay publishes the pending events there (after moving to another broker on purpose)."""
    setup_logging(log_level, library_log_level)
    settings = read_settings(RelaySettings, db_schema=schema, options={"db_schema": "--schema"})
    with user_errors(settings):
        require_database(settings, "outbox-relay rebind")
        require_shared_broker(settings, "outbox-relay rebind")

    async def go() -> str | None:
        async with await _connect(settings) as conn:
            await _store(settings).check_schema(conn)
            return await rebind_broker(conn, settings.db_schema, settings.broker_url, relay_id=settings.relay_id)

    with user_errors(settings):
        broker = asyncio.run(go())
    typer.echo(plain(f"outbox of schema {settings.db_schema} now belongs to broker {broker}"))


def _store(settings: OutboxSettings) -> OutboxStore:
    return OutboxStore.from_settings(settings)


async def _connect(settings: OutboxSettings) -> psycopg.AsyncConnection[Any]:
    return await psycopg.AsyncConnection.connect(database_url(settings), autocommit=True, **connect_options(settings))


def main() -> None:
    """Console script ``outbox-relay``."""
    app()


if __name__ == "__main__":
    main()
