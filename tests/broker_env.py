"""A test's broker environment: throwaway schema, unique RabbitMQ queue, in-process workers.

``env`` (a fixture registered in conftest) gives each test an :class:`Env`; ``command()`` builds a
``CreateInvoice`` body.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aio_pika
import pytest

from consumer_kit import App, DeliveryReport, OutgoingMessage, Settings
from consumer_kit.adapters.rabbitmq import RabbitMQPublisher
from consumer_kit.worker import Worker
from examples.invoices.app import CreateInvoiceHandler
from tests.harness import fetch_all, throwaway_schema


def command(order_id: int = 418, amount: int = 1250, **changes: Any) -> bytes:
    body: dict[str, Any] = {
        "order_id": order_id, "revision": 2, "customer_id": "c-1", "amount_cents": amount,
        "currency": "EUR", "requested_at": dt.datetime.now(dt.UTC).isoformat(),
    }
    body.update(changes)
    return json.dumps(body).encode()


class Env:
    """One test's schema, queue, settings, sender and report stream."""

    def __init__(self, database_url: str, rabbitmq_url: str, schema: str, queue: str) -> None:
        self.database_url, self.rabbitmq_url = database_url, rabbitmq_url
        self.schema, self.queue = schema, queue
        self.settings = Settings(
            database_url=database_url, broker_url=rabbitmq_url, db_schema=schema, search_path=schema,
            retry_delays=[0.2], in_progress_delay=0.2, max_deliveries=3, concurrency=8,
            lock_timeout=2.0, shutdown_timeout=5.0,
        )
        self.reports: asyncio.Queue[DeliveryReport] = asyncio.Queue()
        self.publisher = RabbitMQPublisher(rabbitmq_url)

    async def send(
        self, body: bytes, headers: dict[str, Any] | None = None, *, message_type: str = "CreateInvoice"
    ) -> str:
        return await self.send_to(self.queue, body, headers, message_type=message_type)

    async def send_to(
        self, queue: str, body: bytes, headers: dict[str, Any] | None = None, *,
        message_type: str = "CreateInvoice",
    ) -> str:
        message_id = str(uuid.uuid4())
        await self.publisher.publish(
            OutgoingMessage(destination="", routing_key=queue, message_id=message_id, body=body,
                            message_type=message_type, headers=headers or {})
        )
        return message_id

    async def next_reports(self, count: int, timeout: float = 30.0) -> list[DeliveryReport]:
        return [await asyncio.wait_for(self.reports.get(), timeout) for _ in range(count)]

    async def reports_until(
        self, done: Callable[[list[DeliveryReport]], bool], timeout: float = 30.0
    ) -> list[DeliveryReport]:
        seen: list[DeliveryReport] = []
        async with asyncio.timeout(timeout):
            while not done(seen):
                seen.append(await self.reports.get())
        return seen

    @asynccontextmanager
    async def worker(self, app: App | None = None) -> AsyncIterator[Worker]:
        if app is None:
            app = App("test")
            app.subscribe(self.queue, CreateInvoiceHandler())
        worker = Worker(app, self.settings, on_report=self.reports.put_nowait)
        task = asyncio.create_task(worker.run())
        started = asyncio.create_task(worker.started.wait())
        await asyncio.wait({task, started}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()  # start-up failed: raise its error
        try:
            yield worker
        finally:
            worker.stop()
            await asyncio.wait_for(task, 30)

    async def dead_letters(self, expected: int, timeout: float = 10.0) -> list[aio_pika.abc.AbstractIncomingMessage]:
        connection = await aio_pika.connect(self.rabbitmq_url)
        try:
            channel = await connection.channel()
            dlq = await channel.declare_queue(self.queue + ".dlq", passive=True)
            found: list[aio_pika.abc.AbstractIncomingMessage] = []
            async with dlq.iterator() as messages:
                async with asyncio.timeout(timeout):
                    async for message in messages:
                        await message.ack()
                        found.append(message)
                        if len(found) == expected:
                            break
            return found
        finally:
            await connection.close()

    async def queue_depth(self) -> int:
        connection = await aio_pika.connect(self.rabbitmq_url)
        try:
            channel = await connection.channel()
            declared = await channel.declare_queue(self.queue, passive=True)
            return int(declared.declaration_result.message_count or 0)
        finally:
            await connection.close()

    async def rows(self, query: str, *params: Any) -> list[tuple[Any, ...]]:
        return await fetch_all(self.database_url, self.schema, query, *params)

    def worker_environment(self, **extra: str) -> dict[str, str]:
        """Environment for a ``consumer-kit worker tests.apps.invoices_on_test_queue:app``
        subprocess on this test's queue and schema, plus ``extra`` variables."""
        return {
            **os.environ,
            "CK_TEST_QUEUE": self.queue,
            "CONSUMER_KIT_DATABASE_URL": self.database_url,
            "CONSUMER_KIT_BROKER_URL": self.rabbitmq_url,
            "CONSUMER_KIT_DB_SCHEMA": self.schema,
            "CONSUMER_KIT_SEARCH_PATH": self.schema,
            "PYTHONPATH": os.getcwd(),
            **extra,
        }

    async def cleanup(self) -> None:
        await self.publisher.close()
        connection = await aio_pika.connect(self.rabbitmq_url)
        try:
            channel = await connection.channel()
            # every retry tier a test's settings could have declared (defaults and test delays)
            for suffix in ("", ".dlq", *(f".retry.{ms}ms" for ms in (200, 1000, 2000, 5000, 30000))):
                await channel.queue_delete(self.queue + suffix)
        finally:
            await connection.close()


@pytest.fixture
async def env(database_url: str, rabbitmq_url: str, unique_name: str) -> AsyncIterator[Env]:
    async with throwaway_schema(database_url) as schema:
        environment = Env(database_url, rabbitmq_url, schema, f"{unique_name}.commands")
        try:
            yield environment
        finally:
            await environment.cleanup()
