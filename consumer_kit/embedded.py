"""Embedded PostgreSQL (the ``pgserver`` package): ``CONSUMER_KIT_DATABASE_URL=embedded``, and
in-process runs (the demo, tests on ``memory://``) that set no URL.

pgserver ships PostgreSQL 16 binaries in its wheel, initialises a data directory and starts a
server on a Unix socket (URL ``postgresql://postgres:@/postgres?host=<dir>``). Run as root, it
creates a system user ``pgserver``, hands the data directory to it and adds read/execute
permission on every parent directory of that directory.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

from consumer_kit.errors import ConfigurationError
from consumer_kit.settings import DatabaseSettings

logger = logging.getLogger("consumer_kit.embedded")

_servers: dict[Path, Any] = {}


def embedded_database_url(data_dir: Path) -> str:
    """Start (or reuse) the embedded server under ``data_dir`` and return its URL.

    Raises:
        ConfigurationError: pgserver cannot start (message says why and how to use a real server).
    """
    data_dir = data_dir.resolve()
    if data_dir not in _servers:
        try:
            with warnings.catch_warnings():  # platformdirs warns about XDG_RUNTIME_DIR under root
                warnings.simplefilter("ignore")
                import pgserver
        except ImportError as exc:  # pragma: no cover - pgserver is a core dependency
            raise ConfigurationError("pgserver is not installed; set CONSUMER_KIT_DATABASE_URL") from exc
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
        ConfigurationError: the embedded server cannot start.
    """
    if settings.embedded:
        return embedded_database_url(settings.embedded_data_dir)
    assert settings.database_url is not None
    return settings.database_url
