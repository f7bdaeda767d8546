"""Embedded PostgreSQL (the ``pgserver`` package): ``CONSUMER_KIT_DATABASE_URL=embedded``, and
in-process runs (the demo, tests on ``memory://``) that set no URL.

pgserver (the ``embedded`` extra: ``pip install 'consumer-kit[embedded]'``, not a base dependency)
ships PostgreSQL 16 binaries in its wheel, initialises a data directory and starts a server on a
Unix socket (URL ``postgresql://postgres:@/postgres?host=<dir>``).

As root (a fresh container) PostgreSQL refuses to run, and pgserver 0.1.4 would then run
``useradd pgserver`` and open every parent directory of the data directory and of its binaries to
all users. So as root pgserver's server class is never used: :mod:`consumer_kit.db.embedded_root`
runs the same binaries as the existing unprivileged account ``nobody`` in a private directory of
its own, and changes nothing else (docs/how-to/install.md, "As root").
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

_servers: dict[Path, str] = {}
"""Data directory -> URL of the server this process started or joined."""

INSTALL_HINT = install_hint("embedded")
OWN_SERVER_HINT = "CONSUMER_KIT_DATABASE_URL=postgresql://USER:PASSWORD@HOST:5432/DATABASE"


def _as_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def embedded_database_url(data_dir: Path, *, throwaway: bool = False) -> str:
    """Start (or reuse) the embedded server for ``data_dir`` and return its URL.

    ``throwaway``: the server's data is deleted when the last process using it exits (the testing
    kit's); otherwise it stays for the next run. As root the server lives in a private directory
    that stands for ``data_dir`` (:mod:`consumer_kit.db.embedded_root`), not in ``data_dir``.

    Raises:
        ConfigurationError: pgserver is not installed (the message names the extra), or the
            server cannot start (as root also: no account ``nobody``, a private directory that
            is not root's own); each message says how to use a server of your own instead.
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
        if _as_root():
            _servers[data_dir] = _start_as_root(data_dir, throwaway)
        else:
            _servers[data_dir] = _start_with_pgserver(pgserver, data_dir, throwaway)
    return _servers[data_dir]


def _start_with_pgserver(pgserver: Any, data_dir: Path, throwaway: bool) -> str:
    data_dir.mkdir(parents=True, exist_ok=True)
    try:
        with warnings.catch_warnings():  # platformdirs warns about XDG_RUNTIME_DIR
            warnings.simplefilter("ignore")
            server = pgserver.get_server(str(data_dir), cleanup_mode="delete" if throwaway else "stop")
    except Exception as exc:
        raise ConfigurationError(
            f"embedded PostgreSQL did not start in {data_dir} ({type(exc).__name__}: {exc}); "
            "set CONSUMER_KIT_DATABASE_URL to use your own server"
        ) from exc
    logger.warning("using embedded PostgreSQL in %s (set CONSUMER_KIT_DATABASE_URL for your own)", data_dir)
    return str(server.get_uri())


def _start_as_root(data_dir: Path, throwaway: bool) -> str:
    from consumer_kit.db import embedded_root  # POSIX only (pwd, fcntl): imported where root exists

    try:
        server = embedded_root.start(data_dir, throwaway=throwaway)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{exc} (or use a server of your own: {OWN_SERVER_HINT})") from exc
    logger.warning("using embedded PostgreSQL in %s, run as %s: the process runs as root "
                   "(set CONSUMER_KIT_DATABASE_URL for your own)", server.private_dir, embedded_root.SERVER_ACCOUNT)
    return server.url


def database_url(settings: DatabaseSettings) -> str:
    """``settings.database_url``, or the embedded server's URL when it is ``embedded`` or unset.

    Raises:
        ConfigurationError: the embedded server cannot be used (see :func:`embedded_database_url`).
    """
    if settings.embedded:
        return embedded_database_url(settings.embedded_data_dir)
    assert settings.database_url is not None
    return settings.database_url
