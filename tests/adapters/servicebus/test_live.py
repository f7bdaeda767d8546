"""The Service Bus adapter against a real namespace or the official emulator, when one is configured.

Runs when ``CONSUMER_KIT_SERVICEBUS_CONNECTION_STRING`` is set (skipped otherwise), on the queue
``CONSUMER_KIT_SERVICEBUS_LIVE_QUEUE`` (default ``invoices.commands``, which the emulator's
``examples/invoices/servicebus-emulator.json`` declares). Use a queue nothing else consumes:
messages of others that it meets are given back (abandoned). With the emulator from docker-compose::

    ACCEPT_EULA=Y docker compose --profile servicebus up -d servicebus
    CONSUMER_KIT_SERVICEBUS_CONNECTION_STRING="Endpoint=sb://127.0.0.1:5673;SharedAccessKeyName=RootManageSharedAccessKey;SharedAccessKey=SAS_KEY_VALUE;UseDevelopmentEmulator=true;" \\
        python -m pytest tests/adapters/servicebus/test_live.py

Every step is bounded in time.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator

import pytest

from consumer_kit.adapters.servicebus import (
    Namespace,
    ServiceBusConsumer,
    ServiceBusDelivery,
    ServiceBusPublisher,
    ServiceBusSettings,
)
from consumer_kit.broker.publishing import OutgoingMessage

CONNECTION_STRING = os.environ.get("CONSUMER_KIT_SERVICEBUS_CONNECTION_STRING")
QUEUE = os.environ.get("CONSUMER_KIT_SERVICEBUS_LIVE_QUEUE", "invoices.commands")

pytestmark = pytest.mark.skipif(
    not CONNECTION_STRING,
    reason="CONSUMER_KIT_SERVICEBUS_CONNECTION_STRING is not set: no real Service Bus namespace or "
    "emulator to run against (ACCEPT_EULA=Y docker compose --profile servicebus up -d starts the emulator)",
)


@pytest.fixture
async def live() -> AsyncIterator[tuple[ServiceBusConsumer, ServiceBusPublisher]]:
    namespace = Namespace.from_settings("servicebus://", ServiceBusSettings())
    consumer = ServiceBusConsumer(namespace, settle_timeout=30.0, receive_wait=2.0)
    publisher = ServiceBusPublisher(namespace, confirm_timeout=30.0)
    try:
        yield consumer, publisher
    finally:
        async with asyncio.timeout(60):
            await consumer.close()
            await publisher.close()


async def test_publish_receive_give_back_renew_and_complete_on_a_real_service_bus(
    live: tuple[ServiceBusConsumer, ServiceBusPublisher],
) -> None:
    consumer, publisher = live
    ours = str(uuid.uuid4())
    seen: asyncio.Queue[tuple[int, bool, bool]] = asyncio.Queue()

    async def handle(delivery: ServiceBusDelivery) -> None:
        if delivery.message_id != ours:
            await delivery.release()  # not this test's message
            return
        if delivery.delivery_count == 1:
            await delivery.retry(0)
            await seen.put((1, delivery.redelivered, True))
            return
        renewed = await delivery.renew_lock()
        await delivery.ack()
        await seen.put((delivery.delivery_count, delivery.redelivered, renewed and not delivery.lost))

    async with asyncio.timeout(120):
        await publisher.publish(OutgoingMessage(
            destination="", routing_key=QUEUE, message_id=ours, body=b'{"live": true}',
            message_type="LiveTest", headers={"operation-key": ours},
        ))
        await consumer.subscribe(QUEUE, handle, prefetch=2)
        first = await seen.get()
        second = await seen.get()
    assert first == (1, False, True)
    assert second == (2, False, True)  # our own abandon is no suspect; renewed; completed
    assert consumer.counters["given_back"] >= 1 and consumer.counters["locks_lost"] == 0
