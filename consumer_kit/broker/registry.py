"""Find the adapter for a broker URL through the ``consumer_kit.brokers`` entry points.

The core never imports an adapter: ``amqp://`` maps to the module registered under ``amqp``
(``consumer_kit.adapters.rabbitmq``), ``memory://`` to ``consumer_kit.adapters.memory``. What an adapter module provides is
:class:`BrokerAdapter` (two factories), and, for ``consumer-kit dlq``, :class:`DeadLetterAdapter`
(a third). The consumer factory takes the worker's :class:`~consumer_kit.settings.WorkerSettings`;
the publisher and dead-letter factories take only the ``broker`` group
(:class:`~consumer_kit.settings.BrokerSettings`: the relay's settings are one, not worker settings).
A module that lacks a required factory is refused when it is loaded; one whose SDK is missing
names its pip extra itself (:class:`~consumer_kit.errors.MissingExtra`).
"""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator
from importlib.metadata import entry_points
from types import ModuleType
from typing import Protocol, cast
from urllib.parse import urlparse

from consumer_kit.broker import Consumer, DeadLetterQueues
from consumer_kit.broker.publishing import Publisher
from consumer_kit.errors import ConfigurationError, MissingExtra
from consumer_kit.model.events import WatchedEvent
from consumer_kit.settings import BrokerSettings, Settings

GROUP = "consumer_kit.brokers"

REQUIRED = ("consumer_from_settings", "publisher_from_settings")
"""The factories every adapter module has (:class:`BrokerAdapter`)."""


class BrokerAdapter(Protocol):
    """What an adapter module registered under ``consumer_kit.brokers`` provides: module-level
    factories that build its consumer from the worker's settings and its publisher from the
    ``broker`` group (the relay passes its ``RelaySettings``, a :class:`BrokerSettings`). Each factory may raise
    :class:`ConfigurationError` for a URL or setting it cannot use."""

    def consumer_from_settings(self, settings: Settings, /) -> Consumer: ...

    def publisher_from_settings(self, settings: BrokerSettings, /) -> Publisher: ...


class DeadLetterAdapter(BrokerAdapter, Protocol):
    """An adapter that also lists and redrives dead letters (``consumer-kit dlq``)."""

    def dead_letters_from_settings(self, settings: BrokerSettings, /) -> DeadLetterQueues: ...


class EventTap(Protocol):
    """A temporary subscription to an event destination (``consumer-kit watch``): it sees what is
    published there once :meth:`subscribe` has returned, and leaves nothing behind at :meth:`close`."""

    async def subscribe(self, destination: str, *, pattern: str) -> None:
        """Bind to ``destination`` for routing keys matching ``pattern`` (the broker's syntax).

        Raises:
            LookupError: ``destination`` does not exist (``consumer-kit declare`` creates it).
            ConnectionError: the broker cannot be reached.
        """

    def events(self) -> AsyncIterator[WatchedEvent]:
        """The messages published since :meth:`subscribe`, as they arrive (endless)."""
        ...

    async def close(self) -> None:
        """Remove the subscription and disconnect. Idempotent."""


class TapAdapter(BrokerAdapter, Protocol):
    """An adapter that can watch an event destination (``consumer-kit watch``)."""

    def tap_from_settings(self, settings: Settings, /) -> EventTap: ...


def adapter_for(url: str) -> ModuleType:
    """The adapter module for ``url``'s scheme, checked to provide :class:`BrokerAdapter`.

    Raises:
        ConfigurationError: unknown scheme, the adapter's SDK is not installed (names the extra),
            or the module registered for the scheme lacks a factory (names it).
    """
    scheme = urlparse(url).scheme
    found = [ep for ep in entry_points(group=GROUP) if ep.name == scheme]
    if not found:
        known = sorted({ep.name for ep in entry_points(group=GROUP)})
        raise ConfigurationError(f"no broker adapter for scheme {scheme!r} (known: {', '.join(known)})")
    try:
        module = importlib.import_module(found[0].value)
    except MissingExtra as exc:  # the adapter names its extra (consumer_kit.errors)
        raise ConfigurationError(f"the {scheme!r} adapter needs an extra: {exc.hint} ({exc.missing})") from exc
    except ImportError as exc:
        raise ConfigurationError(f"the {scheme!r} adapter {found[0].value} cannot be imported ({exc})") from exc
    check_adapter(module, scheme)
    return module


def check_adapter(module: ModuleType, scheme: str) -> BrokerAdapter:
    """``module`` as a :class:`BrokerAdapter`, once it is seen to have each factory in
    :data:`REQUIRED` (callable).

    Raises:
        ConfigurationError: a factory is missing or not callable (names the module and the factory).
    """
    missing = [name for name in REQUIRED if not callable(getattr(module, name, None))]
    if missing:
        raise ConfigurationError(
            f"the broker adapter {module.__name__!r} (entry point {GROUP}: {scheme}) provides no "
            f"{' and no '.join(f'{name}(settings)' for name in missing)}"
        )
    return cast(BrokerAdapter, module)


def open_consumer(settings: Settings) -> Consumer:
    """The adapter's ``consumer_from_settings(settings)`` (raises as :func:`adapter_for` and the factory)."""
    return _adapter(settings).consumer_from_settings(settings)


def open_publisher(settings: BrokerSettings) -> Publisher:
    """The adapter's ``publisher_from_settings(settings)`` (raises as :func:`adapter_for` and the factory)."""
    return _adapter(settings).publisher_from_settings(settings)


def open_dead_letters(settings: BrokerSettings) -> DeadLetterQueues:
    """The adapter's ``dead_letters_from_settings(settings)``, or :class:`DeadLetterQueues` (every
    method raises "not supported") for an adapter without one."""
    adapter = _adapter(settings)
    if not callable(getattr(adapter, "dead_letters_from_settings", None)):
        return DeadLetterQueues()
    return cast(DeadLetterAdapter, adapter).dead_letters_from_settings(settings)


def open_tap(settings: Settings) -> EventTap:
    """The adapter's ``tap_from_settings(settings)``.

    Raises:
        ConfigurationError: the adapter cannot watch a destination (says what to use instead).
    """
    adapter = _adapter(settings)
    if not callable(getattr(adapter, "tap_from_settings", None)):
        scheme = urlparse(settings.broker_url).scheme
        raise ConfigurationError(
            f"consumer-kit watch supports RabbitMQ (amqp://) only, not {scheme}://: on SQS an event "
            "destination is a queue (read it with `aws sqs receive-message`), on Service Bus a topic "
            "(add a subscription and read it with Service Bus Explorer)"
        )
    return cast(TapAdapter, adapter).tap_from_settings(settings)


def _adapter(settings: BrokerSettings) -> BrokerAdapter:
    return cast(BrokerAdapter, adapter_for(settings.broker_url))  # adapter_for checked it

