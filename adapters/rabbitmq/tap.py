"""``consumer-kit watch`` on RabbitMQ: a temporary queue bound to an event exchange.

The relay publishes events to a topic exchange (``billing.events``); with nothing bound, RabbitMQ
drops them, so a newcomer cannot see one. The tap declares a server-named, exclusive, auto-delete
queue, binds it to the exchange with the routing-key pattern and hands over what arrives: the queue
disappears with the connection, and the exchange and other consumers are untouched (the tap gets
its own copies). Only events published after :meth:`RabbitMQTap.subscribe` returned are seen.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aio_pika
from aio_pika.abc import AbstractConnection, AbstractIncomingMessage

from consumer_kit.broker.dead_letters import header_text
from consumer_kit.codec.envelope import MESSAGE_TYPE_HEADER
from consumer_kit.model.events import WatchedEvent

from .connection import close_quietly, open_connection


class RabbitMQTap:
    """Watches one event exchange of ``url`` (see module doc); ``timeout`` bounds connecting and
    closing (seconds)."""

    def __init__(self, url: str, *, timeout: float) -> None:
        self._url = url
        self._timeout = timeout
        self._connection: AbstractConnection | None = None
        self._arrived: asyncio.Queue[WatchedEvent] = asyncio.Queue()

    async def subscribe(self, destination: str, *, pattern: str = "#") -> None:
        """Bind a temporary queue to exchange ``destination`` for keys matching ``pattern`` (AMQP
        topic syntax: ``#`` every key, ``invoice.*`` one word after ``invoice.``).

        Raises:
            LookupError: the exchange does not exist (nothing is created).
            ConnectionError: RabbitMQ cannot be reached.
        """
        try:
            self._connection = await open_connection(self._url, timeout=self._timeout, name="consumer-kit watch")
        except (aio_pika.exceptions.AMQPError, OSError, TimeoutError) as exc:
            raise ConnectionError(f"RabbitMQ cannot be reached: {type(exc).__name__}: {exc}") from exc
        channel = await self._connection.channel()
        try:
            exchange = await channel.get_exchange(destination, ensure=True)  # passive: never creates
        except aio_pika.exceptions.ChannelClosed:
            await self.close()
            raise LookupError(
                f"exchange {destination!r} does not exist: `consumer-kit declare module:app` creates the "
                "event destinations an app names (App(..., events=[...]))"
            ) from None
        queue = await channel.declare_queue("", exclusive=True, auto_delete=True)
        await queue.bind(exchange, routing_key=pattern)

        async def arrived(message: AbstractIncomingMessage) -> None:
            self._arrived.put_nowait(_watched(destination, message))

        await queue.consume(arrived, no_ack=True)

    async def events(self) -> AsyncIterator[WatchedEvent]:
        """What arrived since :meth:`subscribe`, in order, waiting for more (endless)."""
        while True:
            yield await self._arrived.get()

    async def close(self) -> None:
        """Disconnect; RabbitMQ deletes the exclusive queue with the connection. Idempotent."""
        connection, self._connection = self._connection, None
        await close_quietly(connection, self._timeout, "watch")


def _watched(destination: str, message: AbstractIncomingMessage) -> WatchedEvent:
    headers = {str(k): header_text(v) for k, v in (message.headers or {}).items()}
    return WatchedEvent(
        destination=destination,
        routing_key=message.routing_key or "",
        message_id=message.message_id,
        message_type=message.type or headers.get(MESSAGE_TYPE_HEADER) or None,
        headers=headers,
        body=message.body,
    )
