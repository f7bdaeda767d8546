"""What the command-line programs (``consumer-kit``, ``outbox-relay``) share: logging set-up,
reading settings, one-line errors for the mistakes users make (a setting out of range, wrong
URL, schema not migrated, in-process broker across processes, no database named) instead of
tracebacks, and operator output that prints producer text as text.

Keys, message ids, reasons, details, bodies and headers are written by whoever could publish to a
queue. Every command prints them through :func:`plain` (control and bidi characters escaped) into
rich :class:`~rich.text.Text` cells (never read as markup), :func:`print_records` (a table, or one
block per record where the terminal is too narrow for the table) and :func:`to_json` (every
non-ASCII character escaped)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from importlib.metadata import version as distribution_version
from typing import Annotated, Any, Literal, NoReturn, TypeVar

import psycopg
import typer
from psycopg import errors as pg_errors
from psycopg_pool import PoolTimeout
from rich.console import Console
from rich.table import Table
from rich.text import Text

from consumer_kit.codec.plain_text import escape_controls
from consumer_kit.codec.redaction import redact, redact_url
from consumer_kit.errors import ConfigurationError
from consumer_kit.settings import (
    BrokerSettings,
    DatabaseSettings,
    GroupSettings,
    LoggingSettings,
    TelemetrySettings,
    all_env_names,
    unknown_variables,
)

EXIT_USAGE = 2

SettingsT = TypeVar("SettingsT", bound=GroupSettings)

OWN_LOGGERS = ("consumer_kit",)
"""The loggers ``--log-level`` applies to; every other library's follow ``--library-log-level``."""

class CommandDefault(str):
    """An option's value the user did not type: the command's default, which the option's
    variable (its settings group) overrides (:func:`setup_logging`)."""


def _mark_default(ctx: typer.Context, param: typer.CallbackParam, value: Any) -> Any:
    """Option callback: wrap a text option left at its default in :class:`CommandDefault`."""
    source = ctx.get_parameter_source(param.name) if param.name else None
    if isinstance(value, str) and source is not None and source.name in ("DEFAULT", "DEFAULT_MAP"):
        return CommandDefault(value)
    return value


LogLevel = Annotated[
    str,
    typer.Option(
        "--log-level", callback=_mark_default,
        help="Level of consumer-kit's own logs (consumer_kit.*): DEBUG (every "
        "delivery), INFO, WARNING, ERROR [env CONSUMER_KIT_LOG_LEVEL]",
    ),
]
LibraryLogLevel = Annotated[
    str,
    typer.Option(
        "--library-log-level", callback=_mark_default,
        help="Level of other libraries' logs (aio-pika, aiormq, psycopg, ...): DEBUG, INFO, WARNING, ERROR "
        "[env CONSUMER_KIT_LIBRARY_LOG_LEVEL]",
    ),
]
"""The two logging options of every command (:func:`setup_logging`)."""

LogFormat = Annotated[
    str,
    typer.Option(
        "--log-format", callback=_mark_default,
        help="text (one line per record) or json (one JSON object per record, with the delivery "
        "line's fields: outcome, operation_key, message_id, event_ids, correlation_id, ...) "
        "[env CONSUMER_KIT_LOG_FORMAT]",
    ),
]
MetricsPort = Annotated[
    int | None,
    typer.Option(
        "--metrics-port", min=1, max=65535,
        help="Serve metrics in Prometheus format at http://HOST:PORT/metrics, HOST from --metrics-host "
        "(needs the otel extra) [env CONSUMER_KIT_METRICS_PORT]",
    ),
]
MetricsHost = Annotated[
    str | None,
    typer.Option(
        "--metrics-host",
        help="Address the metrics endpoint listens on (default CONSUMER_KIT_METRICS_HOST or 0.0.0.0: "
        "a scraper runs elsewhere; 127.0.0.1 keeps it on this host)",
    ),
]
HealthHost = Annotated[
    str | None,
    typer.Option(
        "--health-host",
        help="Address the health endpoint listens on (default 127.0.0.1: this host only; 0.0.0.0 or :: "
        "for Kubernetes probes)",
    ),
]
Otel = Annotated[
    bool,
    typer.Option(
        "--otel",
        help="Export traces and metrics by OTLP, configured by the standard OTEL_* variables "
        "(OTEL_EXPORTER_OTLP_ENDPOINT, ...; needs the otel extra) [env CONSUMER_KIT_OTEL]",
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


def setup_logging(level: str, library_level: str = "WARNING", log_format: str = "text") -> LoggingSettings:
    """One line per record on stderr: consumer-kit's own loggers (:data:`OWN_LOGGERS`) at
    ``level``, every other library (aio-pika, aiormq, psycopg, pgserver, ...) at
    ``library_level``, so ``--log-level DEBUG`` shows each delivery without AMQP frame dumps.
    ``log_format`` ``json`` writes one JSON object per record
    (:class:`consumer_kit.telemetry.logs.JsonFormatter`); either format writes exceptions as
    frames-only tracebacks (an exception's text may quote the payload).

    Each argument is the command's option: typed, it wins; left at the command's default, the
    ``logging`` group's variable (``CONSUMER_KIT_LOG_LEVEL``, ...) wins over that default.
    Returns the ``logging`` group as read, its logging fields as applied.

    Raises:
        typer.Exit: (code 2) a level that is not one of :data:`LEVELS`, or a format that is not
            one of :data:`LOG_FORMATS` (one line naming the option or the variable).
    """
    from consumer_kit.telemetry.logs import JsonFormatter, SafeTextFormatter

    console = _read_options(LoggingSettings, log_level=level, library_log_level=library_level, log_format=log_format)
    own = _effective(console, "log_level", level)
    libraries = _effective(console, "library_log_level", library_level)
    chosen_format = _effective(console, "log_format", log_format)
    text = "%(asctime)s %(levelname)s %(name)s %(process)d %(message)s"
    formatter = JsonFormatter() if chosen_format == "json" else SafeTextFormatter(text)
    root = logging.getLogger()
    if not root.handlers:
        stderr = logging.StreamHandler(sys.stderr)
        stderr.setFormatter(formatter)
        root.addHandler(stderr)
    else:  # a host (or a test) set up logging: only plain stream handlers change format
        for handler in root.handlers:
            if type(handler) is logging.StreamHandler:
                handler.setFormatter(formatter)
    logging.getLogger().setLevel(int(getattr(logging, libraries.upper())))
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(int(getattr(logging, own.upper())))
    return console.model_copy(update={"log_level": own, "library_log_level": libraries, "log_format": chosen_format})


CONSOLE_OPTIONS = {
    "log_level": "--log-level", "library_log_level": "--library-log-level", "log_format": "--log-format",
    "metrics_port": "--metrics-port", "metrics_host": "--metrics-host", "otel": "--otel",
}
"""``logging`` and ``telemetry`` field -> the option every command spells it as."""


def read_telemetry(**options: object) -> TelemetrySettings:
    """The ``telemetry`` group (the worker's and the relay's metrics and traces): the environment,
    with each of ``options`` (field -> the command's value) that the user typed winning over it;
    a value left at the command's default does not (:func:`_typed`). Exits 2 with one line per
    refused setting."""
    return _read_options(TelemetrySettings, **options)


def _read_options(cls: type[SettingsT], **options: object) -> SettingsT:
    typed = {name: _typed(name, value) for name, value in options.items()}
    try:  # misspelt variables are reported once, by the command's own read_settings
        return cls.from_environment(options=CONSOLE_OPTIONS, **typed)
    except ConfigurationError as exc:
        fail(str(exc))


def _typed(parameter: str, value: object) -> object | None:
    """``value`` if the user gave option ``parameter``, else ``None``: a :class:`CommandDefault`
    (the command's default, which a variable may override), ``None`` or ``False`` (an option not
    given, e.g. ``--otel``)."""
    return None if value is None or value is False or isinstance(value, CommandDefault) else value


def _effective(console: LoggingSettings, field: str, default: str) -> str:
    """The option or variable behind ``field`` when set, else the command's own ``default``."""
    return str(getattr(console, field)) if field in console.model_fields_set else str(default)


def version_callback(program: str) -> Callable[[bool], None]:
    """The callback of a ``--version`` option: prints ``<program> <version>`` (the installed
    distribution's, as :data:`consumer_kit.__version__`) and exits."""
    def show(value: bool) -> None:
        if value:
            typer.echo(f"{program} {distribution_version('consumer-kit')}")
            raise typer.Exit()

    return show


def read_settings(
    cls: type[SettingsT], *, options: dict[str, str] | None = None, **overrides: object
) -> SettingsT:
    """``cls`` from the environment and the command's options (``None``: not given), or exit 2
    with one ``error:`` line per refused setting (variable, unit, range, example). Warns about
    ``CONSUMER_KIT_*`` variables that look like a misspelt setting."""
    known = LoggingSettings.env_names() | TelemetrySettings.env_names() | cls.env_names()  # and the groups of every command
    for unknown in unknown_variables(known, everywhere=all_env_names()):
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


def require_shared_broker(settings: BrokerSettings, program: str) -> None:
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
    """Print ``error: <line>`` on stderr for each line of ``message`` (each :func:`plain`: it may
    quote a key or a queue) and exit with code 2."""
    for line in message.splitlines() or [""]:
        typer.echo(f"error: {plain(line)}", err=True)
    raise typer.Exit(EXIT_USAGE)


# -- operator output: producer text printed as text ----------------------------------------------

def plain(value: object) -> str:
    """``value`` as one line of text a terminal shows as it is: control characters (C0, DEL, C1:
    ESC, CSI, ...), bidi controls (U+202A-U+202E, U+2066-U+2069, U+200E/F, U+061C) and line
    separators written as ``\\x1b`` / ``\\u202e`` escapes, and a backslash doubled, so that the
    text reads one way only (``None`` is ``""``)."""
    return escape_controls("" if value is None else str(value))


def cell(value: object) -> Text:
    """``value`` as a rich cell: :func:`plain`, never read as markup (``[link=...]``, ``[/]``)."""
    return Text(plain(value))


def output(*, stderr: bool = False) -> Console:
    """A console that interprets nothing in the strings it is given (no markup, emoji codes or
    highlighting); its width follows the terminal (or ``COLUMNS``)."""
    return Console(stderr=stderr, markup=False, emoji=False, highlight=False)


def to_json(value: Any, *, indent: int | None = 2) -> str:
    """``value`` as JSON (``indent`` ``None``: on one line) with every non-ASCII character escaped (``\\u001b``, ``\\u202e``):
    JSON escapes control characters itself, and ASCII-only output cannot reorder a terminal line.
    Dates and other values are written with ``str``."""
    return json.dumps(value, indent=indent, ensure_ascii=True, default=str)


@dataclasses.dataclass(frozen=True)
class Field:
    """A column of :func:`print_records`: its title, the width below which its cells stop being
    readable (characters), and its alignment."""

    title: str
    min_width: int = 10
    justify: Literal["left", "right"] = "left"


def print_records(
    title: str, fields: Sequence[Field], rows: Sequence[Sequence[object]], console: Console | None = None,
) -> None:
    """``rows`` (one value per field, each printed :func:`plain`) as one table when the terminal
    gives every column its ``min_width``; else one block of ``field  value`` lines per record, so
    that a narrow terminal (80 columns) folds long values in a wide column instead of squeezing
    every column to a few characters. Long values fold, never cut with an ellipsis."""
    console = console or output()
    # a column is never narrower than its title's longest word (rich does not break those)
    widths = [max(f.min_width, *(len(word) for word in f.title.split())) for f in fields]
    if console.width >= sum(widths) + 3 * len(fields) + 1:  # cell padding and borders
        table = Table(title=cell(title))
        for f, width in zip(fields, widths, strict=True):
            table.add_column(cell(f.title), justify=f.justify, overflow="fold", min_width=width)
        for row in rows:
            table.add_row(*(cell(value) for value in row))
        console.print(table)
        return
    console.print(cell(title))
    for number, row in enumerate(rows, 1):
        print_fields(f"{number}/{len(rows)}", [(f.title, value) for f, value in zip(fields, row, strict=True)], console)


def print_fields(title: str, pairs: Sequence[tuple[str, object]], console: Console | None = None) -> None:
    """One record as a two-column table of ``name  value`` lines (values :func:`plain`, folded)."""
    console = console or output()
    table = Table(title=cell(title), show_header=False)
    table.add_column("field", no_wrap=True)
    table.add_column("value", overflow="fold")
    for name, value in pairs:
        table.add_row(cell(name), cell(value))
    console.print(table)


@contextlib.contextmanager
def user_errors(settings: DatabaseSettings | None = None) -> Iterator[None]:
    """Turn the errors a user can fix into ``error: ...`` on stderr and exit code 2, secrets
    masked (:func:`~consumer_kit.codec.redaction.redact`): a driver's message may quote the URL it refused."""
    url = settings.database_url if settings is not None and not settings.embedded else None
    where = f" at {redact_url(url)}" if url else ""
    try:
        yield
    except ConfigurationError as exc:
        fail(str(exc))  # our own messages: URLs in them are redacted where they are written
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
    """The first line of ``exc``'s text, secrets masked (libpq quotes the DSN it cannot parse)."""
    text = str(exc).strip() or type(exc).__name__
    return redact(text.splitlines()[0])
