"""``consumer-kit asyncapi APP``: print (or write) the app's AsyncAPI 3.0 document
(:mod:`consumer_kit.ops.asyncapi`). Reads no setting: it needs neither a broker nor a database."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from consumer_kit.app import load_app
from consumer_kit.cli.console import fail
from consumer_kit.errors import ConfigurationError
from consumer_kit.ops.asyncapi import document


def asyncapi(
    app: Annotated[str, typer.Argument(help="The app as module:attribute, e.g. consumer_kit.demo.app:app")],
    out: Annotated[Path | None, typer.Option("--out", help="Write the document to FILE instead of stdout")] = None,
    version: Annotated[str, typer.Option(help="info.version of the contract (your app's version)")] = "1.0.0",
) -> None:
    """Print the app's AsyncAPI 3.0 document (JSON): the queues it consumes with each message's
    payload schema and headers (operation-id, tenant-id, ...), and its event destinations."""
    sys.path.insert(0, os.getcwd())  # like the worker: APP may live in the current directory
    try:
        application = load_app(app)
    except ConfigurationError as exc:
        fail(str(exc))
    text = json.dumps(document(application, version=version), indent=2, ensure_ascii=False) + "\n"
    if out is None:
        typer.echo(text, nl=False)
        return
    out.write_text(text, encoding="utf-8")
    typer.echo(f"wrote {out}", err=True)
