"""An application: which handler serves which queue. Workers load one by ``module:attribute``."""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from psycopg import AsyncConnection
from pydantic import BaseModel

from consumer_kit.errors import ConfigurationError
from consumer_kit.handler import Handler


@dataclass(frozen=True)
class EventType:
    """An event the app's handlers publish, as :meth:`App.event` declares it: the typed part of
    the producer contract (``consumer-kit asyncapi``, docs/how-to/producer-contract.md).

    Attributes:
        model: the pydantic model the handlers pass to ``ctx.publish(...)``.
        destination: the outbox destination (RabbitMQ: the topic exchange of that name).
        routing_key: the routing key the handlers give it (``""``: none).
        message_type: header ``message-type`` of the published message (the model's class name
            unless ``ctx.publish(..., message_type=...)`` says otherwise).
    """

    model: type[BaseModel]
    destination: str
    routing_key: str
    message_type: str


@dataclass
class App:
    """Routes queues to handlers.

    One handler per queue is the common case. Several handlers may share a queue; the header
    ``message-type`` then selects one (its ``message_type``, by default the model's class name).

    ``events`` names the outbox destinations the handlers publish to (``ctx.publish(...,
    destination=...)``); ``consumer-kit declare`` creates them (RabbitMQ: durable topic
    exchanges) next to the queues, so consumers can bind before the first event.

    ``event_types`` declares what is published there (:meth:`event`): each event's model, routing
    key and message type, which the AsyncAPI document gives consumers of the events as typed
    payloads.

    Example::

        app = App("invoices", events=["billing.events"])
        app.subscribe("invoices.commands", CreateInvoiceHandler())
        app.event(InvoiceCreated, destination="billing.events", routing_key="invoice.created")
    """

    name: str = "app"
    routes: dict[str, dict[str, Handler[Any]]] = field(default_factory=dict)
    startup: list[Callable[[AsyncConnection[Any]], Awaitable[None]]] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    event_types: list[EventType] = field(default_factory=list)

    def __post_init__(self) -> None:
        events, self.events = self.events, []
        self.publishes(*events)

    def on_startup(
        self, hook: Callable[[AsyncConnection[Any]], Awaitable[None]]
    ) -> Callable[[AsyncConnection[Any]], Awaitable[None]]:
        """Register ``hook(connection)``, run by each worker at start (e.g. idempotent DDL of the
        app's own tables). Usable as a decorator."""
        self.startup.append(hook)
        return hook

    def subscribe(self, queue: str, handler: Handler[Any]) -> None:
        """Route ``queue``'s messages to ``handler``.

        Raises:
            ConfigurationError: the queue already has a handler for the same message type.
        """
        if not queue:
            raise ConfigurationError("queue name must not be empty")
        handlers = self.routes.setdefault(queue, {})
        message_type = type(handler).message_type or type(handler).__name__
        if message_type in handlers:
            raise ConfigurationError(f"queue {queue!r} already has a handler for {message_type!r}")
        handlers[message_type] = handler

    def publishes(self, *destinations: str) -> None:
        """Name outbox destinations the app's handlers publish events to (see :attr:`events`).

        Raises:
            ConfigurationError: an empty destination name.
        """
        for destination in destinations:
            if not destination:
                raise ConfigurationError("event destination name must not be empty")
            if destination not in self.events:
                self.events.append(destination)

    def event(
        self, model: type[BaseModel], *, destination: str, routing_key: str = "", message_type: str | None = None,
    ) -> EventType:
        """Declare that handlers publish ``model`` to ``destination`` with ``routing_key`` (as
        their ``ctx.publish(...)`` calls do); ``destination`` joins :attr:`events`. Returns the
        declaration.

        Raises:
            ConfigurationError: ``model`` is not a pydantic model, an empty destination, or the
                destination already has an event of that message type with another model or key.
        """
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise ConfigurationError(f"an event model must be a pydantic BaseModel subclass, not {model!r}")
        declared = EventType(model, destination, routing_key, message_type or model.__name__)
        for known in self.event_types:
            if (known.destination, known.message_type) == (destination, declared.message_type):
                if known != declared:
                    raise ConfigurationError(
                        f"destination {destination!r} already has event {declared.message_type!r} "
                        f"({known.model.__name__}, routing key {known.routing_key!r})")
                return known
        self.publishes(destination)
        self.event_types.append(declared)
        return declared

    @property
    def queues(self) -> list[str]:
        """The subscribed queues, in subscription order."""
        return list(self.routes)


def load_app(path: str) -> App:
    """Import ``"package.module:attribute"`` and return the :class:`App` there.

    Raises:
        ConfigurationError: bad path, import failure or not an ``App``.
    """
    module_name, _, attribute = path.partition(":")
    if _is_file_path(module_name):
        raise ConfigurationError(
            f"app path {path!r} names a file: use the module name, e.g. "
            f"'{_module_of_file(module_name)}:{attribute or 'app'}'"
        )
    if not module_name or not attribute:
        raise ConfigurationError(
            f"app path {path!r} must look like 'package.module:app', e.g. '{module_name or 'app'}:app'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"cannot import {module_name!r}: {exc}") from exc
    if not hasattr(module, attribute):
        raise ConfigurationError(f"module {module_name!r} has no attribute {attribute!r}")
    app = getattr(module, attribute)
    if not isinstance(app, App):
        raise ConfigurationError(f"{path!r} is not a consumer_kit.App (got {type(app).__name__})")
    return app


def _is_file_path(name: str) -> bool:
    return name.endswith(".py") or "/" in name or "\\" in name


def _module_of_file(name: str) -> str:
    """``pkg/app.py`` (or ``./pkg/app``, or an absolute path under the current directory) ->
    ``pkg.app``: the module name a worker started in the current directory imports."""
    path = Path(name.replace("\\", "/"))
    if path.suffix == ".py":
        path = path.with_suffix("")
    if path.is_absolute():
        try:
            path = path.resolve().relative_to(Path.cwd().resolve())
        except ValueError:
            return path.name  # outside the current directory: run from the file's directory
    return ".".join(path.parts)
