"""Embedded PostgreSQL (the ``pgserver`` package): ``CONSUMER_KIT_DATABASE_URL=embedded``, and
in-process runs (the demo, tests on ``memory://``) that set no URL.

pgserver (the ``embedded`` extra: ``pip install 'consumer-kit[embedded]'``, not a base dependency)
ships PostgreSQL 16 binaries in its wheel, initialises a data directory and starts a server on a
Unix socket (URL ``postgresql://postgres:@/postgres?host=<dir>``).

As root this module refuses to start it. PostgreSQL itself will not run as root, so pgserver 0.1.4
(``PostgresServer.__init__`` / ``ensure_pgdata_inited`` / ``ensure_postgres_running``) then runs
``useradd pgserver``, adds group/other read+execute to every parent directory of the data
directory up to ``/`` and of its own binaries, recursively to its ``bin`` and ``lib`` folders, and
makes a runtime socket directory mode 0777: changes far outside the data directory. The way out is
one line: a PostgreSQL server of your own in ``CONSUMER_KIT_DATABASE_URL``, or a non-root user.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any

from consumer_kit.errors import ConfigurationError, install_hint
from consumer_kit.settings import DatabaseSettings

logger = logging.getLogger("consumer_kit.embedded")

_servers: dict[Path, Any] = {}

INSTALL_HINT = install_hint("embedded")
OWN_SERVER_HINT = "CONSUMER_KIT_DATABASE_URL=postgresql://USER:PASSWORD@HOST:5432/DATABASE"


def _refuse_root(data_dir: Path) -> None:
    """Raise before pgserver touches anything when the process runs as root (see module doc)."""
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        raise ConfigurationError(
            f"the embedded PostgreSQL does not run as root: PostgreSQL refuses root, and pgserver would "
            f"then create a system user and open every parent directory of {data_dir} to all users. "
            f"Use a server of your own ({OWN_SERVER_HINT}) or run as a non-root user"
        )


def embedded_database_url(data_dir: Path) -> str:
    """Start (or reuse) the embedded server under ``data_dir`` and return its URL.

    Raises:
        ConfigurationError: pgserver is not installed (the message names the extra), the process
            runs as root (nothing is created or changed), or pgserver cannot start; each message
            says how to use a server of your own instead.
    """
    data_dir = data_dir.resolve()
    if data_dir not in _servers:
        try:
            with warnings.catch_warnings():  # platformdirs warns about XDG_RUNTIME_DIR under root
                warnings.simplefilter("ignore")
                import pgserver
        except ImportError as exc:
            raise ConfigurationError(
                f"the embedded PostgreSQL needs the pgserver package: {INSTALL_HINT} "
                f"(or use a server of your own: {OWN_SERVER_HINT})"
            ) from exc
        _refuse_root(data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        try:
            with warnings.catch_warnings():  # platformdirs warns about XDG_RUNTIME_DIR under root
                warnings.simplefilter("ignore")
                server = pgserver.get_server(str(data_dir), cleanup_mode="stop")  # type: ignore[attr-defined]
        except Exception as exc:
            raise ConfigurationError(
                f"embedded PostgreSQL did not start in {data_dir} ({type(exc).__name__}: {exc}); "
                "set CONSUMER_KIT_DATABASE_URL to use your own server"
            ) from exc
        _servers[data_dir] = server
        logger.warning("using embedded PostgreSQL in %s (set CONSUMER_KIT_DATABASE_URL for your own)", data_dir)
    return str(_servers[data_dir].get_uri())


def database_url(settings: DatabaseSettings) -> str:
    """``settings.database_url``, or the embedded server's URL when it is ``embedded`` or unset.

    Raises:
        ConfigurationError: the embedded server cannot be used (see :func:`embedded_database_url`).
    """
    if settings.embedded:
        return embedded_database_url(settings.embedded_data_dir)
    assert settings.database_url is not None
    return settings.database_url
