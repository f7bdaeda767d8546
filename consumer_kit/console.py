"""What the command-line programs (``consumer-kit``, ``outbox-relay``) share: logging set-up,
URL redaction, and one-line errors for the mistakes users make (wrong URL, schema not migrated,
in-process broker across processes) instead of tracebacks."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import NoReturn

import psycopg
import typer
from psycopg import errors as pg_errors
from psycopg_pool import PoolTimeout

from consumer_kit.errors import ConfigurationError
from consumer_kit.settings import Settings, redact_url

EXIT_USAGE = 2


def setup_logging(level: str) -> None:
    """``key=value`` lines on stderr at ``level``; the embedded server's own chatter stays quiet."""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s %(process)d %(message)s",
        stream=sys.stderr,
    )
    if logging.getLogger().level > logging.DEBUG:
        logging.getLogger("pgserver").setLevel(logging.WARNING)


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
            "(consumer-kit demo, tests)."
        )


def fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(EXIT_USAGE)


@contextlib.contextmanager
def user_errors(settings: Settings | None = None) -> Iterator[None]:
    """Turn the errors a user can fix into ``error: ...`` on stderr and exit code 2."""
    where = f" at {redact_url(settings.database_url)}" if settings and settings.database_url else ""
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
