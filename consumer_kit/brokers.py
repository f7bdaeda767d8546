"""Find the adapter for a broker URL through the ``consumer_kit.brokers`` entry points.

The core never imports an adapter: ``amqp://`` maps to the module registered under ``amqp``
(``adapters.rabbitmq``), ``memory://`` to ``adapters.memory``. An adapter module provides
``consumer_from_settings(settings)`` and ``publisher_from_settings(settings)``, and may provide
``dead_letters_from_settings(settings)`` (``consumer-kit dlq``).
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from types import ModuleType
from typing import cast
from urllib.parse import urlparse

from consumer_kit.broker import Consumer, DeadLetterQueues, Publisher
from consumer_kit.errors import ConfigurationError
from consumer_kit.settings import Settings

GROUP = "consumer_kit.brokers"


def adapter_for(url: str) -> ModuleType:
    """The adapter module for ``url``'s scheme.

    Raises:
        ConfigurationError: unknown scheme, or the adapter's SDK is not installed (names the extra).
    """
    scheme = urlparse(url).scheme
    found = [ep for ep in entry_points(group=GROUP) if ep.name == scheme]
    if not found:
        known = sorted({ep.name for ep in entry_points(group=GROUP)})
        raise ConfigurationError(f"no broker adapter for scheme {scheme!r} (known: {', '.join(known)})")
    try:
        return importlib.import_module(found[0].value)
    except ImportError as exc:
        raise ConfigurationError(
            f"the {scheme!r} adapter needs an extra: pip install 'consumer-kit[{_extra(scheme)}]' ({exc})"
        ) from exc


def open_consumer(settings: Settings) -> Consumer:
    return cast(Consumer, adapter_for(settings.broker_url).consumer_from_settings(settings))


def open_publisher(settings: Settings) -> Publisher:
    return cast(Publisher, adapter_for(settings.broker_url).publisher_from_settings(settings))


def open_dead_letters(settings: Settings) -> DeadLetterQueues:
    """The adapter's ``dead_letters_from_settings(settings)``, or :class:`DeadLetterQueues` (every
    method raises "not supported") for an adapter without one."""
    adapter = adapter_for(settings.broker_url)
    factory = getattr(adapter, "dead_letters_from_settings", None)
    return DeadLetterQueues() if factory is None else cast(DeadLetterQueues, factory(settings))


def _extra(scheme: str) -> str:
    return {"amqp": "rabbitmq", "amqps": "rabbitmq", "sqs": "sqs", "sb": "servicebus", "servicebus": "servicebus"}.get(scheme, "all")
