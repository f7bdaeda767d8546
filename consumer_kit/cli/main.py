"""The ``consumer-kit`` command: ``migrate``, ``worker``, ``declare``, ``ledger``, ``stats``, ``dlq``,
``prune``, ``console``, ``watch`` (the demo is the invoices example, installed as ``consumer_kit.demo``:
``python -m consumer_kit.demo``).

Exit codes: 0 done (a worker stopped by SIGTERM/SIGINT too), 2 a mistake the user can fix (a
setting out of range, no database named, wrong URL, schema not migrated), printed as
``error: ...`` lines on stderr.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Coroutine
from typing import Annotated, Any

import psycopg
import typer

from consumer_kit.app import App, load_app
from consumer_kit.cli.asyncapi import asyncapi as asyncapi_command
from consumer_kit.cli.console import (
    Embedded,
    HealthHost,
    LibraryLogLevel,
    LogFormat,
    LogLevel,
    MetricsHost,
    MetricsPort,
    Otel,
    read_settings,
    read_telemetry,
    require_database,
    require_shared_broker,
    setup_logging,
    user_errors,
    version_callback,
)
from consumer_kit.cli.dlq import dlq_cli
from consumer_kit.cli.ledger import ledger_cli
from consumer_kit.cli.prune import prune
from consumer_kit.cli.serve_console import console as console_command
from consumer_kit.cli.stats import stats as stats_command
from consumer_kit.cli.watch import watch as watch_command
from consumer_kit.db.embedded import database_url
from consumer_kit.db.pooler import connect_options
from consumer_kit.ledger import migrate as migrate_schema
from consumer_kit.settings import EMBEDDED, DatabaseSettings, Settings, TelemetrySettings
from consumer_kit.telemetry.setup import install

cli = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Idempotent message consumers: one business effect per operation.\n\n"
    "Configuration comes from CONSUMER_KIT_* environment variables: CONSUMER_KIT_DATABASE_URL "
    "(postgresql://...; 'embedded' for a throwaway embedded PostgreSQL under .consumer-kit/pgdata) "
    "and CONSUMER_KIT_BROKER_URL (amqp://...; memory:// works only inside one process). Every "
    "setting: docs/reference/settings.md on consumer-kit's documentation site, or "
    "`python -m consumer_kit.settings.reference`.",
)


@cli.callback()
def _root(
    show_version: Annotated[
        bool, typer.Option("--version", callback=version_callback("consumer-kit"), is_eager=True, help="Print the version and exit")
    ] = False,
) -> None:
    """Idempotent message consumers: one business effect per operation."""


AppPath = Annotated[str, typer.Argument(help="The App, as package.module:attribute")]


@cli.command()
def migrate(
    schema: Annotated[str | None, typer.Option(help="Schema (default CONSUMER_KIT_DB_SCHEMA or consumer_kit)")] = None,
    partitions: Annotated[int | None, typer.Option(
        help="Create the ledger hash-partitioned on (scope, key) into N partitions (new ledgers only)",
    )] = None,
    embedded: Embedded = False,
    log_level: LogLevel = "INFO",
    library_log_level: LibraryLogLevel = "WARNING",
) -> None:
    """Create or upgrade the ledger and outbox tables (idempotent; safe to run concurrently).

    Reads only CONSUMER_KIT_DATABASE_URL, CONSUMER_KIT_DB_SCHEMA and CONSUMER_KIT_EMBEDDED_DATA_DIR."""
    setup_logging(log_level, library_log_level)
    settings = read_settings(
        DatabaseSettings, db_schema=schema, database_url=EMBEDDED if embedded else None,
        options={"db_schema": "--schema"},
    )

    async def run() -> list[int]:
        async with await psycopg.AsyncConnection.connect(database_url(settings), autocommit=True, **connect_options(settings)) as conn:
            return await migrate_schema(conn, settings.db_schema, partitions=partitions)

    with user_errors(settings):
        require_database(settings, "consumer-kit migrate")
        applied = asyncio.run(run())
    if applied:
        typer.echo(f"schema {settings.db_schema}: applied migrations {', '.join(map(str, applied))}")
    else:
        typer.echo(f"schema {settings.db_schema}: up to date")


@cli.command()
def worker(
    app: AppPath,
    processes: Annotated[int, typer.Option(min=1, help="Worker processes under one supervisor")] = 1,
    concurrency: Annotated[int | None, typer.Option(min=1, help="Deliveries in flight per process")] = None,
    migrate_first: Annotated[bool, typer.Option("--migrate/--no-migrate", help="Run migrations at start")] = False,
    embedded: Embedded = False,
    log_level: LogLevel = "INFO",
    library_log_level: LibraryLogLevel = "WARNING",
    log_format: LogFormat = "text",
    metrics_port: MetricsPort = None,
    metrics_host: MetricsHost = None,
    health_host: HealthHost = None,
    otel: Otel = False,
) -> None:
    """Consume the app's queues until SIGTERM/SIGINT, then shut down gracefully (exit 0).

    Needs CONSUMER_KIT_BROKER_URL and CONSUMER_KIT_DATABASE_URL (or --embedded). With
    --metrics-port and --processes N, the processes serve ports PORT to PORT+N-1. The health
    endpoint (CONSUMER_KIT_HEALTH_PORT) listens on --health-host."""
    console = setup_logging(log_level, library_log_level, log_format)  # logging as applied
    telemetry = read_telemetry(metrics_port=metrics_port, metrics_host=metrics_host, otel=otel)
    settings = read_settings(
        Settings, concurrency=concurrency, database_url=EMBEDDED if embedded else None, health_host=health_host,
        options={"concurrency": "--concurrency", "health_host": "--health-host"},
    )
    migrate_first = migrate_first or settings.embedded  # nobody runs `migrate` on a throwaway database
    sys.path.insert(0, os.getcwd())  # like uvicorn: APP may live in the current directory
    with user_errors(settings):
        require_shared_broker(settings, "consumer-kit worker")
        require_database(settings, "consumer-kit worker")
        if processes > 1:
            from consumer_kit.worker.supervisor import Supervisor, child_environment, worker_command

            env = child_environment(database_url(settings))
            extra = ["--log-level", console.log_level, "--library-log-level", console.library_log_level]
            extra += ["--log-format", console.log_format]
            extra += ["--migrate"] if migrate_first else []
            if concurrency:
                extra += ["--concurrency", str(concurrency)]
            if telemetry.metrics_port is not None:
                extra += ["--metrics-port", str(telemetry.metrics_port), "--metrics-host", telemetry.metrics_host]
                env[PORT_RANGE_VARIABLE] = str(processes)
            extra += ["--health-host", settings.health_host]
            extra += ["--otel"] if telemetry.otel else []
            raise typer.Exit(Supervisor(worker_command(app, extra), processes, env=env).run())
        from consumer_kit.worker.process import Worker

        application = load_app(app)
        installed = install(
            service_name="consumer-kit-worker", metrics_port=telemetry.metrics_port,
            metrics_addr=telemetry.metrics_host, otel=telemetry.otel, port_range=telemetry.metrics_port_range,
        )
        try:
            worker = Worker(application, settings, migrate_schema=migrate_first)
            gauges = telemetry.metrics_port is not None or telemetry.otel
            asyncio.run(_with_gauges(worker.run(), settings, gauges, telemetry.metrics_interval))
        finally:
            installed.shutdown()


PORT_RANGE_VARIABLE = TelemetrySettings.env_name_of("metrics_port_range")
"""Set by a supervisor for its children: how many ports from --metrics-port they may take."""


async def _with_gauges(run: Coroutine[Any, Any, None], settings: Settings, gauges: bool, interval: float) -> None:
    """Run the worker, refreshing the ledger gauges every ``interval`` seconds meanwhile when
    metrics are exported."""
    if not gauges:
        await run
        return
    from consumer_kit.ops.gauges import DatabaseGauges

    async with DatabaseGauges(
        database_url(settings), settings.db_schema, ledger=True, interval=interval, connect=connect_options(settings)
    ):
        await run


@cli.command()
def declare(
    app: AppPath,
    log_level: LogLevel = "WARNING",
    library_log_level: LibraryLogLevel = "WARNING",
) -> None:
    """Create the app's queues and the event destinations it names, as a worker would, so
    producers can send (and consumers bind) before any worker has run.

    RabbitMQ: per queue Q, Q itself, Q.dlq and one Q.retry.<ms>ms per retry delay (exactly what
    the worker declares, from the same settings), and a durable topic exchange per event
    destination (App(..., events=[...])). Idempotent. Needs CONSUMER_KIT_BROKER_URL; no database."""
    setup_logging(log_level, library_log_level)
    settings = read_settings(Settings)
    sys.path.insert(0, os.getcwd())
    with user_errors(settings):
        require_shared_broker(settings, "consumer-kit declare")
        application = load_app(app)
        queues, events = asyncio.run(_declare(application, settings))
    for names in queues:
        typer.echo(f"queue {names[0]}" + (f" (with {', '.join(names[1:])})" if names[1:] else ""))
    for destination in events:
        typer.echo(f"event destination {destination}")
    if not application.events:
        typer.echo(f"(app {application.name!r} names no event destinations: App(..., events=[...]))")


async def _declare(app: App, settings: Settings) -> tuple[list[list[str]], list[str]]:
    """Declare ``app``'s queues through the consumer and its event destinations through the
    publisher of ``settings.broker_url``; returns (names per queue, destinations)."""
    from consumer_kit.broker.registry import open_consumer, open_publisher

    consumer = open_consumer(settings)
    try:
        queues = [await consumer.declare(queue) for queue in app.queues]
    finally:
        await consumer.close()
    publisher = open_publisher(settings)
    try:
        for destination in app.events:
            await publisher.declare(destination)
    finally:
        await publisher.close()
    return queues, list(app.events)


cli.add_typer(ledger_cli, name="ledger")
cli.command("stats")(stats_command)
cli.command("watch")(watch_command)
cli.add_typer(dlq_cli, name="dlq")
cli.command("prune")(prune)
cli.command("asyncapi")(asyncapi_command)
cli.command("console")(console_command)


def main() -> None:
    cli()
