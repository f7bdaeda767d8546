"""``python -m consumer_kit.demo`` (installed) or ``python -m consumer_kit.demo`` (clone): the demo."""

from __future__ import annotations

import typer

from .demo import main

command = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
command.command()(main)
command()
