"""``consumer-kit asyncapi APP``: print (or write) the app's AsyncAPI 3.0 document
(:mod:`consumer_kit.ops.asyncapi`). It needs neither a broker nor a database: the broker URL
(``--broker-url``, else ``CONSUMER_KIT_BROKER_URL``) only names the document's server."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from consumer_kit.app import load_app
from consumer_kit.cli.console import fail, read_settings
from consumer_kit.errors import ConfigurationError
from consumer_kit.ops.asyncapi import document
from consumer_kit.settings import BrokerSettings


def asyncapi(
    app: Annotated[str, typer.Argument(help="The app as module:attribute, e.g. consumer_kit.demo.app:app")],
    out: Annotated[Path | None, typer.Option("--out", help="Write the document to FILE instead of stdout")] = None,
    version: Annotated[str, typer.Option(help="info.version of the contract (your app's version)")] = "1.0.0",
    broker_url: Annotated[str | None, typer.Option(
        "--broker-url", help="The broker the workers use (default: CONSUMER_KIT_BROKER_URL): the document's "
        "server (host, port, virtual host; never credentials)",
    )] = None,
) -> None:
    """Print the app's AsyncAPI 3.0 document (JSON), the producer contract: the broker's server,
    the queues it consumes with each message's payload schema, headers and the fields a resend may
    change (fingerprint_exclude), and its event destinations with each declared event's payload
    and routing key."""
    sys.path.insert(0, os.getcwd())  # like the worker: APP may live in the current directory
    try:
        application = load_app(app)
        broker = read_settings(BrokerSettings, broker_url=broker_url).broker_url
        contract = document(application, version=version, broker_url=broker)
    except ConfigurationError as exc:
        fail(str(exc))
    text = json.dumps(contract, indent=2, ensure_ascii=False) + "\n"
    if out is None:
        typer.echo(text, nl=False)
        return
    out.write_text(text, encoding="utf-8")
    typer.echo(f"wrote {out}", err=True)
