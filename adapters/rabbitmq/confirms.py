"""Many publishes with confirms as one write: the relay's batch, one confirm wait instead of one
task, lock, timeout and socket write per message.

aiormq's ``Channel.basic_publish`` sends one message and then waits for its confirm, so publishing
N messages concurrently takes N tasks, N turns of the channel lock and of the connection's writer,
and N socket writes (over half of the relay's CPU per event in a drain profile). :func:`send`
does what ``basic_publish`` does for each message (next delivery tag, a confirmation future
registered under that tag and the message id, mandatory ``Basic.Publish`` + content header +
body frames), under one hold of the channel lock, and hands the frames of all of them to the
writer as one payload (encoded by :mod:`~consumer_kit.adapters.rabbitmq.frames`). The broker's replies then resolve the futures exactly as they resolve
``basic_publish``'s own (aiormq's reader does it: ``Basic.Ack`` -> the frame; ``Basic.Return``
-> the returned ``DeliveredMessage``; ``Basic.Nack`` -> ``DeliveryError``; channel or connection
closed -> the close reason), so the caller awaits all of them once.

This relies on aiormq's channel attributes ``lock``, ``delivery_tag``, ``confirmations``,
``message_id_delivery_tag``, ``write_queue``, ``number`` and ``max_content_size`` (the same in
aiormq 7.1 and 7.2, the versions ``pyproject.toml`` allows); the RabbitMQ relay tests exercise it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from functools import partial
from typing import Any

import aiormq
import pamqp.frame
from aiormq.abc import ChannelFrame
from pamqp.body import ContentBody
from pamqp.commands import Basic
from pamqp.header import ContentHeader

from . import frames

Publish = tuple[str, str, Basic.Properties, bytes]
"""One message: (exchange, routing key, properties with a ``message_id``, body)."""


async def send(channel: aiormq.Channel, messages: Sequence[Publish]) -> list[asyncio.Future[Any]]:
    """Publish ``messages`` (mandatory) on ``channel`` (publisher confirms on) in one write; returns
    one confirmation future per message, in order, resolved as for ``basic_publish`` (module doc).

    Raises:
        ValueError: a routing key over 255 bytes (nothing is sent).
        aiormq.exceptions.ChannelInvalidStateError: the channel is closed (nothing is sent).
        TimeoutError, asyncio.CancelledError: while waiting for room in the connection's write
            queue; nothing is sent and the delivery tags are given back.
    """
    for _, routing_key, _, _ in messages:
        if len(routing_key) > 255:
            raise ValueError("Routing key too long (max 255 bytes)")
    futures: list[asyncio.Future[Any]] = []
    payload: list[bytes] = []
    async with channel.lock:  # delivery tags in wire order, as basic_publish keeps them
        if channel.is_closed:
            raise aiormq.exceptions.ChannelInvalidStateError("the publishing channel is closed")
        registered: list[tuple[int, str]] = []
        written = channel.create_future()
        sent = False
        try:
            for exchange, routing_key, properties, body in messages:
                channel.delivery_tag += 1
                tag = channel.delivery_tag
                confirmation = channel.create_future()
                channel.confirmations[tag] = confirmation
                message_id = properties.message_id or ""  # the relay always sets it (the event id)
                channel.message_id_delivery_tag[message_id] = tag  # how a Basic.Return finds its future
                registered.append((tag, message_id))
                futures.append(confirmation)
                payload.append(_encoded(channel, exchange, routing_key, properties, body))
            # The connection's write queue is bounded (aiormq: FRAME_BUFFER_SIZE frames), so put()
            # can wait, e.g. while a blocked connection stops draining it.
            await channel.write_queue.put(
                ChannelFrame(payload=b"".join(payload), should_close=False, drain_future=written)
            )
            sent = True
        finally:
            if not sent:  # failed, timed out or cancelled before the broker saw any of them
                _unregister(channel, registered, futures)
                written.cancel()
        for (tag, message_id), confirmation in zip(registered, futures, strict=True):
            confirmation.add_done_callback(partial(_forget, channel, message_id, tag))
    await written
    return futures


def _encoded(
    channel: aiormq.Channel, exchange: str, routing_key: str, properties: Basic.Properties, body: bytes
) -> bytes:
    encoded = frames.encode(channel.number, exchange, routing_key, properties, body, channel.max_content_size)
    if encoded is None:  # outside the direct encoder's shape: pamqp's generic one
        publish = Basic.Publish(exchange=exchange, routing_key=routing_key, mandatory=True)
        header = ContentHeader(properties=properties, body_size=len(body))
        parts: list[Any] = [publish, header, *_body_frames(body, channel.max_content_size)]
        encoded = b"".join(pamqp.frame.marshal(f, channel.number) for f in parts)
    return encoded


def _unregister(
    channel: aiormq.Channel, registered: list[tuple[int, str]], futures: list[asyncio.Future[Any]]
) -> None:
    """Give back the delivery tags of publishes never written (under the channel lock), as
    ``basic_publish`` does: the broker numbers only what it receives, so a tag kept would match
    every later confirm to the message before it, a nack to a message that was confirmed."""
    channel.delivery_tag -= len(registered)
    for tag, message_id in registered:
        channel.confirmations.pop(tag, None)
        if channel.message_id_delivery_tag.get(message_id) == tag:
            del channel.message_id_delivery_tag[message_id]
    for future in futures:
        future.cancel()


def _body_frames(body: bytes, max_content_size: int) -> list[ContentBody]:
    return [ContentBody(body[i : i + max_content_size]) for i in range(0, len(body), max_content_size)]


def _forget(channel: aiormq.Channel, message_id: str, tag: int, future: asyncio.Future[Any]) -> None:
    if channel.message_id_delivery_tag.get(message_id) == tag:
        del channel.message_id_delivery_tag[message_id]
    if not future.cancelled():
        future.exception()  # retrieved: an abandoned one (caller cancelled) logs nothing
