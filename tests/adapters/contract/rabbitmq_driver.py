"""RabbitMQ in the contract suite: the session's vhost (``rabbitmq_url``), one queue per case."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aio_pika

from consumer_kit.adapters.rabbitmq import (
    DEAD_LETTER_DETAIL_HEADER,
    DEAD_LETTER_REASON_HEADER,
    RabbitMQConsumer,
    RabbitMQPublisher,
    consumer_from_settings,
)
from consumer_kit.broker import Consumer
from consumer_kit.broker.publishing import OutgoingMessage, Publisher
from consumer_kit.settings import Settings
from tests.adapters.contract.driver import DeadLetter, Driver, as_text

_TIERS_MS = (200, 1000, 2000, 5000, 30000)  # every retry tier the cases' settings may declare


class RabbitMQDriver(Driver):
    name = "rabbitmq"
    lock_lapses = False  # an unacked delivery stays with its channel until the channel goes
    has_lock = False  # no peek-lock to outlive (RabbitMQ has no lock to renew: a consumer timeout)
    lock_seconds = 0.5  # nothing lapses: the renewal case only checks one run, one report

    def __init__(self, queue: str, url: str) -> None:
        super().__init__(queue)
        self.url = url
        self._publisher = RabbitMQPublisher(url)
        self._extra_queues: list[str] = []

    async def consumer(
        self, settings: Settings, *, short_lock: bool = False, renewal: bool = True, copy_limit: int | None = None
    ) -> Consumer:
        if copy_limit is None:
            return consumer_from_settings(settings)
        return RabbitMQConsumer(
            self.url, max_deliveries=settings.max_deliveries,
            retry_delays=[*settings.retry_delays, settings.in_progress_delay],
            settle_timeout=settings.settle_timeout, max_message_size=copy_limit,
        )

    async def send(self, body: bytes, headers: dict[str, str] | None = None, message_id: str | None = None) -> str:
        message_id = message_id or str(uuid.uuid4())
        await self._publisher.publish(
            OutgoingMessage("", self.queue, message_id, body, "CreateInvoice", headers or {})
        )
        return message_id

    async def dead_letters(self, expected: int, timeout: float = 15.0) -> list[DeadLetter]:
        found: list[DeadLetter] = []
        connection = await aio_pika.connect(self.url)
        try:
            channel = await connection.channel()
            dlq = await channel.declare_queue(self.queue + ".dlq", passive=True)
            async with dlq.iterator() as messages, asyncio.timeout(timeout):
                async for message in messages:
                    await message.ack()
                    found.append(_dead_letter(message))
                    if len(found) == expected:
                        break
        finally:
            await connection.close()
        return found

    async def depth(self) -> int:
        connection = await aio_pika.connect(self.url)
        try:
            channel = await connection.channel()
            total = 0
            for name in (self.queue, *(f"{self.queue}.retry.{ms}ms" for ms in _TIERS_MS)):
                try:
                    declared = await channel.declare_queue(name, passive=True)
                except aio_pika.exceptions.ChannelClosed:
                    channel = await connection.channel()
                    continue
                total += int(declared.declaration_result.message_count or 0)
            return total
        finally:
            await connection.close()

    async def outlive_lock(self, consumer: Consumer) -> None:
        """RabbitMQ has no lock to lapse: the delivery's channel goes away instead (the broker
        requeues its unacked deliveries, as for a lost lock)."""
        assert isinstance(consumer, RabbitMQConsumer)
        for subscription in consumer._subscriptions.values():
            if subscription.channel is not None:
                await subscription.channel.close()

    async def size_limited(self, limit: int) -> tuple[Publisher, str, Callable[[], Awaitable[int]]]:
        target = f"{self.queue}.small"
        self._extra_queues.append(target)
        connection = await aio_pika.connect(self.url)
        try:
            channel = await connection.channel()
            await channel.declare_queue(target, durable=True)
        finally:
            await connection.close()

        async def count() -> int:
            conn = await aio_pika.connect(self.url)
            try:
                declared = await (await conn.channel()).declare_queue(target, passive=True)
                return int(declared.declaration_result.message_count or 0)
            finally:
                await conn.close()

        return RabbitMQPublisher(self.url, max_message_size=limit), target, count

    async def close(self) -> None:
        await self._publisher.close()
        connection = await aio_pika.connect(self.url)
        try:
            channel = await connection.channel()
            for name in (self.queue, f"{self.queue}.dlq", *self._extra_queues,
                         *(f"{self.queue}.retry.{ms}ms" for ms in _TIERS_MS)):
                await channel.queue_delete(name)
        finally:
            await connection.close()


def _dead_letter(message: aio_pika.abc.AbstractIncomingMessage) -> DeadLetter:
    headers: dict[str, Any] = dict(message.headers or {})
    copied = DEAD_LETTER_REASON_HEADER in headers
    if copied:
        reason = as_text(headers[DEAD_LETTER_REASON_HEADER])
    else:  # moved by the broker's own dead-lettering: x-death says why
        deaths = headers.get("x-death") or [{}]
        reason = as_text(deaths[0].get("reason"))  # type: ignore[union-attr]
    return DeadLetter(
        message_id=message.message_id, body=message.body, reason=reason,
        detail=as_text(headers.get(DEAD_LETTER_DETAIL_HEADER)), copied=copied,
        size=len(message.body),
    )
