"""What the command-line programs (``consumer-kit``, ``outbox-relay``) share: logging set-up,
reading settings, and one-line errors for the mistakes users make (a setting out of range, wrong
URL, schema not migrated, in-process broker across processes, no database named) instead of
tracebacks."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Annotated, NoReturn, TypeVar

import psycopg
import typer
from psycopg import errors as pg_errors
from psycopg_pool import PoolTimeout

from consumer_kit.errors import ConfigurationError
from consumer_kit.redaction import redact_url
from consumer_kit.settings import DatabaseSettings, Settings, unknown_variables

EXIT_USAGE = 2

SettingsT = TypeVar("SettingsT", bound=DatabaseSettings)

OWN_LOGGERS = ("consumer_kit", "adapters", "outbox_relay")
"""The loggers ``--log-level`` applies to; every other library's follow ``--library-log-level``."""

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

LogLevel = Annotated[
    str,
    typer.Option(
        "--log-level", envvar="CONSUMER_KIT_LOG_LEVEL",
        help="Level of consumer-kit's own logs (consumer_kit, adapters, outbox_relay): DEBUG (every "
        "delivery), INFO, WARNING, ERROR",
    ),
]
LibraryLogLevel = Annotated[
    str,
    typer.Option(
        "--library-log-level", envvar="CONSUMER_KIT_LIBRARY_LOG_LEVEL",
        help="Level of other libraries' logs (aio-pika, aiormq, psycopg, ...): DEBUG, INFO, WARNING, ERROR",
    ),
]
"""The two logging options of every command (:func:`setup_logging`)."""

LOG_FORMATS = ("text", "json")

LogFormat = Annotated[
    str,
    typer.Option(
        "--log-format", envvar="CONSUMER_KIT_LOG_FORMAT",
        help="text (one line per record) or json (one JSON object per record, with the delivery "
        "line's fields: outcome, operation_key, message_id, event_ids, correlation_id, ...)",
    ),
]
MetricsPort = Annotated[
    int | None,
    typer.Option(
        "--metrics-port", envvar="CONSUMER_KIT_METRICS_PORT", min=1, max=65535,
        help="Serve metrics in Prometheus format at http://0.0.0.0:PORT/metrics (needs the otel extra)",
    ),
]
Otel = Annotated[
    bool,
    typer.Option(
        "--otel", envvar="CONSUMER_KIT_OTEL",
        help="Export traces and metrics by OTLP, configured by the standard OTEL_* variables "
        "(OTEL_EXPORTER_OTLP_ENDPOINT, ...; needs the otel extra)",
    ),
]
"""The telemetry options of ``consumer-kit worker`` and ``outbox-relay``
(:func:`consumer_kit.telemetry.setup.install`)."""

Embedded = Annotated[
    bool,
    typer.Option(
        "--embedded",
        help="Use a throwaway embedded PostgreSQL under CONSUMER_KIT_EMBEDDED_DATA_DIR "
        "(same as CONSUMER_KIT_DATABASE_URL=embedded)",
    ),
]


def setup_logging(level: str, library_level: str = "WARNING", log_format: str = "text") -> None:
    """One line per record on stderr: consumer-kit's own loggers (:data:`OWN_LOGGERS`) at
    ``level``, every other library (aio-pika, aiormq, psycopg, pgserver, ...) at
    ``library_level``, so ``--log-level DEBUG`` shows each delivery without AMQP frame dumps.
    ``log_format`` ``json`` writes one JSON object per record
    (:class:`consumer_kit.telemetry.logs.JsonFormatter`); either format writes exceptions as
    frames-only tracebacks (an exception's text may quote the payload).

    Raises:
        typer.Exit: (code 2) a level that is not one of :data:`LEVELS`, or a format that is not
            one of :data:`LOG_FORMATS`.
    """
    from consumer_kit.telemetry.logs import JsonFormatter, SafeTextFormatter

    own, libraries = _level(level, "--log-level"), _level(library_level, "--library-log-level")
    if log_format not in LOG_FORMATS:
        fail(f"--log-format={log_format}: must be one of {', '.join(LOG_FORMATS)}")
    text = "%(asctime)s %(levelname)s %(name)s %(process)d %(message)s"
    formatter = JsonFormatter() if log_format == "json" else SafeTextFormatter(text)
    root = logging.getLogger()
    if not root.handlers:
        stderr = logging.StreamHandler(sys.stderr)
        stderr.setFormatter(formatter)
        root.addHandler(stderr)
    else:  # a host (or a test) set up logging: only plain stream handlers change format
        for handler in root.handlers:
            if type(handler) is logging.StreamHandler:
                handler.setFormatter(formatter)
    logging.getLogger().setLevel(libraries)
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(own)


def _level(name: str, option: str) -> int:
    if name.upper() not in LEVELS:
        fail(f"{option}={name}: must be one of {', '.join(LEVELS)} (e.g. INFO)")
    return int(getattr(logging, name.upper()))


def read_settings(
    cls: type[SettingsT], *, options: dict[str, str] | None = None, **overrides: object
) -> SettingsT:
    """``cls`` from the environment and the command's options (``None``: not given), or exit 2
    with one ``error:`` line per refused setting (variable, unit, range, example). Warns about
    ``CONSUMER_KIT_*`` variables that look like a misspelt setting."""
    for unknown in unknown_variables(set(cls.model_fields)):
        logging.getLogger("consumer_kit.settings").warning("ignoring %s", unknown)
    try:
        return cls.from_environment(options=options, **overrides)
    except ConfigurationError as exc:
        fail(str(exc))


def require_database(settings: DatabaseSettings, program: str) -> None:
    """Refuse to start without ``CONSUMER_KIT_DATABASE_URL``: a forgotten URL must not make a
    worker consume real messages into a throwaway embedded database (or a relay publish from
    one, or ``migrate`` migrate one). The embedded database is used when asked for by name.

    Raises:
        ConfigurationError: ``database_url`` is unset.
    """
    if settings.database_url is None:
        raise ConfigurationError(
            f"{program} needs a database: set CONSUMER_KIT_DATABASE_URL (e.g. "
            "postgresql://postgres:postgres@127.0.0.1:5432/postgres), or "
            "CONSUMER_KIT_DATABASE_URL=embedded for a throwaway embedded PostgreSQL under "
            f"{settings.embedded_data_dir}"
        )


def require_shared_broker(settings: Settings, program: str) -> None:
    """Refuse ``memory://`` in a standalone process: nothing outside this process can reach it, so a
    worker would wait forever and a relay would mark events published that went nowhere.

    Raises:
        ConfigurationError: the broker URL is ``memory://``.
    """
    if settings.broker_url.startswith("memory:"):
        raise ConfigurationError(
            f"{program} needs a real broker: set CONSUMER_KIT_BROKER_URL (e.g. "
            "amqp://guest:guest@127.0.0.1:5672/). memory:// only works inside one process "
            "(the demo, tests)."
        )


def fail(message: str) -> NoReturn:
    """Print ``error: <line>`` on stderr for each line of ``message`` and exit with code 2."""
    for line in message.splitlines() or [""]:
        typer.echo(f"error: {line}", err=True)
    raise typer.Exit(EXIT_USAGE)


@contextlib.contextmanager
def user_errors(settings: DatabaseSettings | None = None) -> Iterator[None]:
    """Turn the errors a user can fix into ``error: ...`` on stderr and exit code 2."""
    url = settings.database_url if settings is not None and not settings.embedded else None
    where = f" at {redact_url(url)}" if url else ""
    try:
        yield
    except ConfigurationError as exc:
        fail(str(exc))
    except pg_errors.UndefinedTable as exc:
        fail(f"{_first_line(exc)}: run `consumer-kit migrate` first (and check CONSUMER_KIT_DB_SCHEMA)")
    except pg_errors.InvalidSchemaName as exc:
        fail(f"{_first_line(exc)}: run `consumer-kit migrate` first")
    except psycopg.OperationalError as exc:
        fail(f"cannot use PostgreSQL{where}: {_first_line(exc)}")
    except psycopg.ProgrammingError as exc:
        fail(f"bad database URL or query{where}: {_first_line(exc)}")
    except PoolTimeout as exc:
        fail(f"PostgreSQL{where} did not answer: {_first_line(exc)}")
    except ConnectionError as exc:
        fail(_first_line(exc))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
