"""Opening and closing AMQP connections and channels, for the consumer and the publisher alike."""

from __future__ import annotations

import asyncio
import logging

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractConnection

logger = logging.getLogger(__name__)

_closing: set[asyncio.Task[None]] = set()  # channel closes still waiting for the broker's reply


async def open_connection(url: str, *, timeout: float, name: str) -> AbstractConnection:
    """Connect to ``url`` within ``timeout`` seconds; ``name`` shows in the management UI
    (``consumer-kit consumer``, ``consumer-kit publisher``).

    Raises:
        aiormq.exceptions.AMQPConnectionError, OSError, TimeoutError: no connection.
    """
    return await aio_pika.connect(
        url, timeout=timeout, client_properties={"connection_name": name}
    )


def is_open(connection: AbstractConnection | None) -> bool:
    """True while ``connection`` is usable. aio-pika's ``is_closed`` only turns True when the
    client closes it; a connection the broker or the network closed shows in ``connected``."""
    return connection is not None and not connection.is_closed and connection.connected.is_set()


async def close_quietly(connection: AbstractConnection | None, timeout: float, whose: str) -> None:
    """Close ``connection`` within ``timeout`` seconds, ignoring errors: it is going away either way."""
    if connection is None or connection.is_closed:
        return
    try:
        async with asyncio.timeout(timeout):
            await connection.close()
    except Exception as exc:  # noqa: BLE001 - it is going away either way
        logger.debug("closing the %s connection failed (%s)", whose, type(exc).__name__)


async def close_channel_soon(channel: AbstractChannel, wait: float) -> None:
    """Start closing ``channel`` and wait at most ``wait`` seconds for the broker's reply.

    The close keeps going in the background after that: its Channel.Close frame is already queued,
    so a broker that stopped answering still sees it as soon as it reads again, and requeues the
    channel's unacked deliveries then (or when the connection drops, whichever comes first).
    """
    if channel.is_closed:
        return
    task = asyncio.create_task(_close(channel), name="consumer-kit rabbitmq channel close")
    _closing.add(task)
    task.add_done_callback(_closing.discard)
    await asyncio.wait({task}, timeout=wait)


async def _close(channel: AbstractChannel) -> None:
    try:
        await channel.close()
    except Exception as exc:  # noqa: BLE001 - a channel that fails to close is closed
        logger.debug("closing a channel failed (%s)", type(exc).__name__)
