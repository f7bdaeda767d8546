"""A worker process for the chaos app on RabbitMQ, configured entirely by the environment.

Used by the SIGKILL crash tests and by the chaos run when ``consumer-kit worker`` (the CLI) is not
available. ``CONSUMER_KIT_CRASH_AT=<point>:kill`` arms a crash point at import of consumer_kit.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from consumer_kit.adapters.rabbitmq import RabbitMQConsumer
from consumer_kit.settings import Settings
from consumer_kit.worker.process import Worker
from tests.system.chaos.app import app


async def main() -> None:
    settings = Settings()
    consumer = RabbitMQConsumer(
        settings.broker_url,
        max_deliveries=settings.max_deliveries,
        retry_delays=settings.retry_delays,
        handler_timeout=settings.handler_timeout,
        settle_timeout=settings.settle_timeout,
    )
    await Worker(app, settings, consumer=consumer, migrate_schema=True).run()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(main())
