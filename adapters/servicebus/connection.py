"""Opening and closing Service Bus clients, and the backoff between reconnects.

A :class:`ServiceBusClient` makes receivers and senders; the SDK opens one AMQP connection per
receiver or sender (it does not share them), so a failed one is replaced by a new one from the
same client. The SDK's own retries are off (``retry_total=0``): consumer-kit decides what a failure means
(the consumer reconnects with tenacity, a settlement that fails is redelivered by the broker, the
relay retries a failed publish), and against a server that answers wrongly the SDK hangs instead
of failing, so every call into it is bounded with ``asyncio.timeout`` by the caller.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from azure.servicebus.aio import ServiceBusClient

from consumer_kit.errors import ConfigurationError
from consumer_kit.resilience.backoff import RECONNECT

from .config import Namespace
from .errors import describe

logger = logging.getLogger(__name__)

# Pause between recovery attempts: 0.1 s, 0.2 s, 0.4 s, ... at most 5 s.
BACKOFF = RECONNECT.wait()


class Connection:
    """A :class:`ServiceBusClient` for ``namespace`` and, for Microsoft Entra ID sign-in, the
    azure-identity credential it uses (closed with it).

    Raises:
        ConfigurationError: Entra ID sign-in is asked for and azure-identity is not installed.
    """

    def __init__(self, namespace: Namespace, *, name: str) -> None:
        self.namespace = namespace
        self._credential: Any = None
        if namespace.connection_string is not None:
            self.client = ServiceBusClient.from_connection_string(namespace.connection_string, retry_total=0)
        else:
            self._credential = default_credential()
            self.client = ServiceBusClient(namespace.fully_qualified_namespace, self._credential, retry_total=0)
        logger.debug("%s client for %s", name, namespace.description)

    async def close(self, timeout: float) -> None:
        """Close the client (every receiver and sender on it) and the credential within ``timeout``
        seconds, ignoring errors: they are going away either way."""
        for closing in (self.client.close, getattr(self._credential, "close", None)):
            if closing is None:
                continue
            try:
                async with asyncio.timeout(timeout):
                    await closing()
            except Exception as exc:  # noqa: BLE001 - it is going away either way
                logger.debug("closing a Service Bus client failed (%s)", describe(exc))


def default_credential() -> Any:
    """azure-identity's async ``DefaultAzureCredential`` (environment, workload identity, managed
    identity, Azure CLI, ...).

    Raises:
        ConfigurationError: azure-identity is not installed.
    """
    try:
        from azure.identity.aio import DefaultAzureCredential
    except ImportError as exc:
        raise ConfigurationError(
            "Microsoft Entra ID sign-in to Service Bus needs azure-identity (pip install azure-identity), "
            "or set CONSUMER_KIT_SERVICEBUS_CONNECTION_STRING"
        ) from exc
    return DefaultAzureCredential()


async def close_quietly(handler: Any, timeout: float, what: str) -> None:
    """Close an SDK receiver or sender within ``timeout`` seconds, ignoring errors."""
    if handler is None:
        return
    try:
        async with asyncio.timeout(timeout):
            await handler.close()
    except Exception as exc:  # noqa: BLE001 - it is going away either way
        logger.debug("closing %s failed (%s)", what, describe(exc))
