"""An application: which handler serves which queue. Workers load one by ``module:attribute``."""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from psycopg import AsyncConnection

from consumer_kit.errors import ConfigurationError
from consumer_kit.handler import Handler


@dataclass
class App:
    """Routes queues to handlers.

    One handler per queue is the common case. Several handlers may share a queue; the header
    ``message-type`` then selects one (its ``message_type``, by default the model's class name).

    Example::

        app = App("invoices")
        app.subscribe("invoices.commands", CreateInvoiceHandler())
    """

    name: str = "app"
    routes: dict[str, dict[str, Handler[Any]]] = field(default_factory=dict)
    startup: list[Callable[[AsyncConnection[Any]], Awaitable[None]]] = field(default_factory=list)

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

    @property
    def queues(self) -> list[str]:
        return list(self.routes)


def load_app(path: str) -> App:
    """Import ``"package.module:attribute"`` and return the :class:`App` there.

    Raises:
        ConfigurationError: bad path, import failure or not an ``App``.
    """
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ConfigurationError(f"app path {path!r} must look like 'package.module:app'")
    if module_name.endswith(".py"):
        raise ConfigurationError(
            f"app path {path!r} names a file: use the module name, e.g. {module_name[:-3]!r}:{attribute}"
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
