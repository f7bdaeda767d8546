"""The ``consumer-kit`` command: ``migrate``, ``worker``, ``demo``."""

from __future__ import annotations

import asyncio
import importlib
import os
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Annotated, Any

import psycopg
import typer

from consumer_kit.app import load_app
from consumer_kit.console import fail, require_shared_broker, setup_logging, user_errors
from consumer_kit.embedded import database_url
from consumer_kit.ledger import migrate as migrate_schema
from consumer_kit.settings import Settings

cli = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Idempotent message consumers: one business effect per operation.\n\n"
    "Configuration comes from CONSUMER_KIT_* environment variables: CONSUMER_KIT_DATABASE_URL "
    "(unset: an embedded PostgreSQL under .consumer-kit/pgdata) and CONSUMER_KIT_BROKER_URL "
    "(amqp://...; memory:// works only inside one process). See README.md for the rest.",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"consumer-kit {version('consumer-kit')}")
        raise typer.Exit()


@cli.callback()
def _root(
    show_version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit")
    ] = False,
) -> None:
    """Idempotent message consumers: one business effect per operation."""

LogLevel = Annotated[str, typer.Option("--log-level", envvar="CONSUMER_KIT_LOG_LEVEL", help="DEBUG, INFO, WARNING")]


def _settings(**overrides: Any) -> Settings:
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValueError as exc:  # pydantic ValidationError: show it plainly
        fail(f"invalid setting: {exc}")


@cli.command()
def migrate(
    schema: Annotated[str | None, typer.Option(help="Schema (default CONSUMER_KIT_DB_SCHEMA or consumer_kit)")] = None,
    log_level: LogLevel = "INFO",
) -> None:
    """Create or upgrade the ledger and outbox tables (idempotent; safe to run concurrently)."""
    setup_logging(log_level)
    settings = _settings(db_schema=schema)

    async def run() -> list[int]:
        async with await psycopg.AsyncConnection.connect(database_url(settings), autocommit=True) as conn:
            return await migrate_schema(conn, settings.db_schema)

    with user_errors(settings):
        applied = asyncio.run(run())
    if applied:
        typer.echo(f"schema {settings.db_schema}: applied migrations {', '.join(map(str, applied))}")
    else:
        typer.echo(f"schema {settings.db_schema}: up to date")


@cli.command()
def worker(
    app: Annotated[str, typer.Argument(help="The App to run, as package.module:attribute")],
    processes: Annotated[int, typer.Option(min=1, help="Worker processes under one supervisor")] = 1,
    concurrency: Annotated[int | None, typer.Option(min=1, help="Deliveries in flight per process")] = None,
    migrate_first: Annotated[bool, typer.Option("--migrate/--no-migrate", help="Run migrations at start")] = False,
    log_level: LogLevel = "INFO",
) -> None:
    """Consume the app's queues until SIGTERM/SIGINT, then shut down gracefully (exit 0)."""
    setup_logging(log_level)
    settings = _settings(concurrency=concurrency)
    sys.path.insert(0, os.getcwd())  # like uvicorn: APP may live in the current directory
    with user_errors(settings):
        require_shared_broker(settings, "consumer-kit worker")
        if processes > 1:
            from consumer_kit.supervisor import Supervisor, child_environment, worker_command

            env = child_environment(database_url(settings))
            extra = ["--log-level", log_level] + (["--migrate"] if migrate_first else [])
            if concurrency:
                extra += ["--concurrency", str(concurrency)]
            raise typer.Exit(Supervisor(worker_command(app, extra), processes, env=env).run())
        from consumer_kit.worker import Worker

        asyncio.run(Worker(load_app(app), settings, migrate_schema=migrate_first).run())


@cli.command()
def demo(
    log_level: LogLevel = "ERROR",
) -> None:
    """Run the invoices example with duplicates, a conflict, invalid bodies and a crash.

    Uses CONSUMER_KIT_DATABASE_URL if set, else an embedded PostgreSQL; the broker is the
    in-process memory broker. Drops and recreates the schema consumer_kit_demo on each run.
    Exit code 0 when every balance equals the sum of the unique commands."""
    setup_logging(log_level)
    run_demo = _load_demo()
    raise typer.Exit(asyncio.run(run_demo(_settings())))


def _load_demo() -> Any:
    """Import ``examples.invoices.demo`` from the current directory or the source checkout."""
    checkout = Path(__file__).resolve().parents[1]
    for root in (Path.cwd(), checkout):
        if (root / "examples" / "invoices" / "demo.py").exists():
            sys.path.insert(0, str(root))
            break
    try:
        return importlib.import_module("examples.invoices.demo").run_demo
    except ImportError as exc:
        typer.echo(f"error: the demo needs the repository's examples/ directory ({exc})", err=True)
        raise typer.Exit(2) from None


def main() -> None:
    cli()
