"""``consumer-kit console APP``: serve the operator's console (:mod:`consumer_kit.console_web`).

    consumer-kit console myapp.main:app [--host 127.0.0.1] [--port 8765] [--read-only]
                         [--user-header X-Forwarded-User] [--operator NAME]

Needs ``CONSUMER_KIT_DATABASE_URL`` (the ledger, the audit table) and ``CONSUMER_KIT_BROKER_URL``
(the dead letters of the app's queues). The token comes from ``CONSUMER_KIT_CONSOLE_TOKEN`` (the
settings tree's ``console`` group), or is made at random and printed once, in the URL to open. Needs the ``console`` extra.
"""

from __future__ import annotations

import os
import secrets
import sys
from typing import Annotated

import typer

from consumer_kit.cli.console import (
    fail,
    read_settings,
    require_database,
    require_shared_broker,
    user_errors,
)
from consumer_kit.errors import install_hint
from consumer_kit.ops.operator_actions import default_actor
from consumer_kit.settings import OperatorConsoleSettings, OutboxSettings, Settings
from consumer_kit.settings.listen_address import check_host
from consumer_kit.settings.operator_console import MIN_TOKEN_CHARS

TOKEN_VARIABLE = OperatorConsoleSettings.env_name_of("console_token")
__all__ = ["MIN_TOKEN_CHARS", "TOKEN_VARIABLE", "console"]


def console(
    app: Annotated[str, typer.Argument(help="The App, as package.module:attribute")],
    host: Annotated[str, typer.Option(help="Address to listen on (127.0.0.1: this host only)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to listen on")] = 8765,
    read_only: Annotated[bool, typer.Option("--read-only", help="Show everything, change nothing")] = False,
    user_header: Annotated[str | None, typer.Option(
        help="Trust this header as the authenticated user (set by a reverse proxy that strips it from "
        "clients); then no token is asked for")] = None,
    operator: Annotated[str | None, typer.Option(help="Who the token holder is in the audit (default user@host)")] = None,
    max_attempts: Annotated[
        int | None,
        typer.Option(min=1, help="The relay's parking bound (default CONSUMER_KIT_RELAY_MAX_ATTEMPTS, else 20)"),
    ] = None,
) -> None:
    """Serve the operator's console: parked operations to decide, dead letters to redrive,
    pressure. Every action is audited (table ``audit``)."""
    try:
        import uvicorn

        from consumer_kit.console_web import ConsoleConfig, create_app
        from consumer_kit.console_web.security import LOCAL_NAMES
    except ImportError as exc:
        fail(f"the console needs its extra: {install_hint('console')} ({exc})")
    try:
        bind = check_host(host)
    except ValueError as exc:
        fail(f"--host={host}: {exc}")
    group = read_settings(OperatorConsoleSettings)
    given = group.console_token
    token = given.get_secret_value() if given is not None else ""
    proxy_secret = group.console_proxy_secret.get_secret_value() if group.console_proxy_secret else None
    if user_header is not None and proxy_secret is None and not group.console_trusted_proxies:
        fail("--user-header is trusted only from the proxy: set CONSUMER_KIT_CONSOLE_PROXY_SECRET (the "
             "proxy sends it in X-Console-Proxy-Secret) and/or CONSUMER_KIT_CONSOLE_TRUSTED_PROXIES")
    served = group.console_served_names or sorted({*LOCAL_NAMES, bind})
    printed = not token and user_header is None
    token = token or secrets.token_urlsafe(24)
    settings = read_settings(Settings)
    if max_attempts is None:  # the relay's setting, read from the relay's group
        max_attempts = read_settings(OutboxSettings, db_schema=settings.db_schema).relay_max_attempts
    sys.path.insert(0, os.getcwd())
    with user_errors(settings):
        require_database(settings, "consumer-kit console")
        require_shared_broker(settings, "consumer-kit console")
        from consumer_kit.app import load_app

        application = load_app(app)
    config = ConsoleConfig(
        settings=settings, app=application, token=token, user_header=user_header, read_only=read_only,
        proxy_secret=proxy_secret, trusted_proxies=group.console_trusted_proxies, served_names=served,
        relay_max_attempts=max_attempts, actor=operator or default_actor(),
    )
    shown = f"[{bind}]" if ":" in bind else bind
    if printed:
        typer.echo(f"console: open http://{shown}:{port}/?token={token}", err=True)
    else:
        typer.echo(f"console: http://{shown}:{port}/", err=True)
    if bind not in ("127.0.0.1", "::1", "localhost"):
        typer.echo(f"warning: listening on {bind}, not this host only: put it behind TLS", err=True)
    uvicorn.run(create_app(config), host=bind, port=port, log_level="warning", access_log=False)
