"""The contract suite's fixtures: one :class:`Contract` per case and broker.

``DRIVERS`` lists the brokers; a new broker joins with one driver module and one entry here.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest

from consumer_kit import App, DeliveryReport, Settings
from consumer_kit.broker import Consumer
from consumer_kit.demo.app import CreateInvoiceHandler
from consumer_kit.handler import Handler
from consumer_kit.worker.process import Worker
from tests.adapters.contract.driver import Driver
from tests.adapters.contract.memory_driver import MemoryDriver
from tests.adapters.contract.nats_driver import NATSDriver, nats_url  # noqa: F401 - fixture
from tests.adapters.contract.rabbitmq_driver import RabbitMQDriver
from tests.adapters.contract.servicebus_driver import ServiceBusDriver
from tests.adapters.contract.sqs_driver import SQSDriver
from tests.fixtures.harness import fetch_all, throwaway_schema
from tests.fixtures.moto_server import sqs_endpoint  # noqa: F401 - fixture

DRIVERS: dict[str, Callable[[pytest.FixtureRequest, str], Driver]] = {
    "memory": lambda request, queue: MemoryDriver(queue),
    "rabbitmq": lambda request, queue: RabbitMQDriver(queue, request.getfixturevalue("rabbitmq_url")),
    "sqs": lambda request, queue: SQSDriver(queue, request.getfixturevalue("sqs_endpoint")),
    "servicebus": lambda request, queue: ServiceBusDriver(queue, request.getfixturevalue("sb_server")),
    "nats": lambda request, queue: NATSDriver(queue, request.getfixturevalue("nats_url")),
}


class Contract:
    """One case on one broker: the driver, a throwaway schema, settings, workers and reports."""

    def __init__(self, driver: Driver, database_url: str, schema: str) -> None:
        self.driver = driver
        self.database_url, self.schema = database_url, schema
        self.reports: asyncio.Queue[DeliveryReport] = asyncio.Queue()
        self.consumer: Consumer | None = None

    def settings(self, **overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "database_url": self.database_url, "db_schema": self.schema, "search_path": self.schema,
            "broker_url": getattr(self.driver, "url", "memory://"), "retry_delays": [0.2],
            "in_progress_delay": 0.2, "max_deliveries": 3, "concurrency": 4, "lock_timeout": 2.0,
            "shutdown_timeout": 5.0, "settle_timeout": 5.0,
        }
        values.update(overrides)
        return Settings(**values)

    def app(self, handler: Handler[Any] | None = None) -> App:
        app = App("contract")
        app.subscribe(self.driver.queue, handler or CreateInvoiceHandler())
        return app

    @asynccontextmanager
    async def worker(
        self, handler: Handler[Any] | None = None, *, short_lock: bool = False, renewal: bool = True,
        copy_limit: int | None = None, **overrides: Any,
    ) -> AsyncIterator[Worker]:
        """A running worker for this case's queue (stopped, gracefully, on exit)."""
        settings = self.settings(**overrides)
        self.consumer = await self.driver.consumer(
            settings, short_lock=short_lock, renewal=renewal, copy_limit=copy_limit
        )
        worker = Worker(self.app(handler), settings, consumer=self.consumer, on_report=self.reports.put_nowait)
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

    async def next_report(self, timeout: float = 20.0) -> DeliveryReport:
        return await asyncio.wait_for(self.reports.get(), timeout)

    async def reports_until(
        self, done: Callable[[list[DeliveryReport]], bool], timeout: float = 20.0
    ) -> list[DeliveryReport]:
        seen: list[DeliveryReport] = []
        async with asyncio.timeout(timeout):
            while not done(seen):
                seen.append(await self.reports.get())
        return seen

    async def rows(self, query: str, *params: Any) -> list[tuple[Any, ...]]:
        return await fetch_all(self.database_url, self.schema, query, *params)


@pytest.fixture(params=list(DRIVERS))
async def contract(request: pytest.FixtureRequest, database_url: str, unique_name: str) -> AsyncIterator[Contract]:
    driver = DRIVERS[request.param](request, f"{unique_name}.commands")
    await driver.open()
    try:
        async with throwaway_schema(database_url) as schema:
            yield Contract(driver, database_url, schema)
    finally:
        await driver.close()
