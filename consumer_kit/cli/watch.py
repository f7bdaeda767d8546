"""``consumer-kit watch DESTINATION``: print what is published to an event destination.

    consumer-kit watch billing.events [--routing-key 'invoice.*'] [--count N] [--timeout S] [--show-body] [--json]

The relay publishes events to destinations nothing may be bound to yet (RabbitMQ drops a message
no queue is bound for), so a newcomer cannot see the event the walk-through promises. ``watch``
subscribes a temporary queue to the destination (RabbitMQ: server-named, exclusive, auto-delete:
gone when the command ends) and prints one record per event: ids, routing key, message type, and
the body with ``--show-body`` (it may hold personal data, as ``dlq list --show-body`` says).
Events published before it started are not shown. Needs CONSUMER_KIT_BROKER_URL; no database.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Annotated

import typer

from consumer_kit.broker.registry import EventTap, open_tap
from consumer_kit.cli.console import (
    LibraryLogLevel,
    LogLevel,
    fail,
    plain,
    read_settings,
    require_shared_broker,
    setup_logging,
    to_json,
    user_errors,
)
from consumer_kit.model.events import WatchedEvent
from consumer_kit.settings import Settings

EXIT_TIMED_OUT = 1


def watch(
    destination: Annotated[str, typer.Argument(help="The event destination, e.g. billing.events")],
    routing_key: Annotated[str, typer.Option(help="Routing-key pattern (RabbitMQ topic syntax)")] = "#",
    count: Annotated[int | None, typer.Option(min=1, help="Stop after this many events")] = None,
    timeout: Annotated[
        float | None, typer.Option(min=0.1, help="Stop after this many seconds (exit 1 if --count was not reached)")
    ] = None,
    show_body: Annotated[bool, typer.Option("--show-body", help="Also print each body (may hold personal data)")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per event and line")] = False,
    log_level: LogLevel = "WARNING",
    library_log_level: LibraryLogLevel = "WARNING",
) -> None:
    """Print the events published to DESTINATION from now on (a temporary queue bound to it, removed
    when the command ends), e.g. the InvoiceCreated the relay publishes to billing.events."""
    setup_logging(log_level, library_log_level)
    settings = read_settings(Settings)
    with user_errors(settings):
        require_shared_broker(settings, "consumer-kit watch")
        tap = open_tap(settings)
        try:
            seen = asyncio.run(_watch(tap, destination, routing_key, count, timeout, show_body, as_json))
        except KeyboardInterrupt:  # Ctrl-C is how one stops watching: the queue went with the connection
            raise typer.Exit(0) from None
        except LookupError as exc:
            fail(str(exc.args[0]) if exc.args else str(exc))
    if count is not None and seen < count:
        raise typer.Exit(EXIT_TIMED_OUT)


async def _watch(
    tap: EventTap, destination: str, pattern: str, count: int | None, timeout: float | None,
    show_body: bool, as_json: bool,
) -> int:
    """Print events until ``count`` were seen or ``timeout`` seconds passed; returns how many."""
    seen = 0

    async def consume() -> None:
        nonlocal seen
        async for event in tap.events():
            _print(event, show_body, as_json)
            seen += 1
            if count is not None and seen >= count:
                return

    try:
        await tap.subscribe(destination, pattern=pattern)
        # on stderr, after the binding exists: from this line on nothing published is missed
        typer.echo(
            f"watching {plain(destination)} (routing key {plain(pattern)}) through a temporary queue; "
            "events published from now on; Ctrl-C to stop", err=True,
        )
        sys.stderr.flush()
        try:
            await asyncio.wait_for(consume(), timeout)
        except TimeoutError:
            pass
    finally:
        await tap.close()
    return seen


def _print(event: WatchedEvent, show_body: bool, as_json: bool) -> None:
    body = event.body.decode("utf-8", "replace")
    if as_json:
        record = {"destination": event.destination, "routing_key": event.routing_key,
                  "message_id": event.message_id, "message_type": event.message_type, "headers": event.headers}
        if show_body:
            record["body"] = body
        typer.echo(to_json(record, indent=None))
        return
    line = (f"event destination={event.destination} routing_key={event.routing_key} "
            f"message_id={event.message_id or '-'} type={event.message_type or '-'} bytes={len(event.body)}")
    typer.echo(plain(line))
    if show_body:
        typer.echo("  " + plain(body))
