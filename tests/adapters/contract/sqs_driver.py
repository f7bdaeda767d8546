"""SQS (moto in server mode) in the contract suite: one standard queue and its DLQ per case."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from consumer_kit.adapters.sqs import (
    DEAD_LETTER_DETAIL_ATTRIBUTE,
    DEAD_LETTER_REASON_ATTRIBUTE,
    SQSClient,
    SQSConfig,
    SQSConsumer,
    SQSDelivery,
    SQSPublisher,
    headers_of,
    recommended_max_receive_count,
    sqs_queue_name,
)
from consumer_kit.adapters.sqs.limits import size_of
from consumer_kit.adapters.sqs.subscription import SYSTEM_ATTRIBUTES
from consumer_kit.broker import Consumer, Delivery, DeliveryCallback
from consumer_kit.broker.publishing import OutgoingMessage, Publisher
from consumer_kit.settings import Settings
from tests.adapters.contract.driver import DeadLetter, Driver, as_text
from tests.fixtures.moto_server import sqs_url


class TrackingConsumer(SQSConsumer):
    """An SQS consumer that keeps the deliveries it hands out, so that the driver can make their
    locks lapse: one handed back unsettled (a crash point) is no longer held by the adapter."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.deliveries: list[SQSDelivery] = []

    async def subscribe(self, queue: str, callback: DeliveryCallback, *, prefetch: int) -> None:
        async def keeping(delivery: Delivery) -> None:
            assert isinstance(delivery, SQSDelivery)
            self.deliveries.append(delivery)
            await callback(delivery)

        await super().subscribe(queue, keeping, prefetch=prefetch)


class SQSDriver(Driver):
    name = "sqs"
    # visibility=5 (whole seconds on SQS): the heartbeat (ticks of a quarter of it) extends a lock
    # with half of it left and must be answered before the last tenth: 2 s for one round trip
    lock_seconds = 5.0

    def __init__(self, queue: str, endpoint: str) -> None:
        super().__init__(queue)
        self.endpoint = endpoint
        self.url = sqs_url(endpoint)
        self.client = SQSClient(SQSConfig.from_url(self.url), threads=4, pollers=0)
        self.publisher = SQSPublisher(SQSConfig.from_url(self.url), client=self.client)
        self.queue_url = ""
        self.dlq_url = ""
        self._created: list[str] = []

    async def open(self) -> None:
        self.dlq_url = await self.create(sqs_queue_name(self.queue) + "-dlq")
        dlq_arn = await self.arn(self.dlq_url)
        policy = {"deadLetterTargetArn": dlq_arn, "maxReceiveCount": recommended_max_receive_count(3, 3)}
        self.queue_url = await self.create(sqs_queue_name(self.queue), RedrivePolicy=json.dumps(policy))

    async def create(self, name: str, **attributes: str) -> str:
        reply = await self.client.call("create_queue", QueueName=name, Attributes=attributes)
        url = str(reply["QueueUrl"])
        self._created.append(url)
        return url

    async def arn(self, queue_url: str) -> str:
        reply = await self.client.call("get_queue_attributes", QueueUrl=queue_url, AttributeNames=["QueueArn"])
        return str(reply["Attributes"]["QueueArn"])

    async def consumer(
        self, settings: Settings, *, short_lock: bool = False, renewal: bool = True, copy_limit: int | None = None
    ) -> Consumer:
        options: dict[str, object] = {}
        if short_lock:
            options["visibility"] = int(self.lock_seconds)
        if not renewal:
            options["heartbeat"] = "off"
        if copy_limit is not None:
            for url in (self.queue_url, self.dlq_url):
                await self.client.call(
                    "set_queue_attributes", QueueUrl=url, Attributes={"MaximumMessageSize": str(copy_limit)}
                )
        # consumer_from_settings's arguments, on a consumer that keeps its deliveries
        return TrackingConsumer(
            SQSConfig.from_url(sqs_url(self.endpoint, **options)),
            max_deliveries=settings.max_deliveries, crash_limit=settings.crash_limit,
            settle_timeout=settings.settle_timeout, concurrency=settings.concurrency,
            handler_timeout=settings.handler_timeout,
        )

    async def lapse_locks(self, consumer: Consumer) -> None:
        """The visibility of each unsettled delivery whose lock still holds (running, or handed
        back unsettled) lapses on both clocks, the adapter's (``locked_until``) and SQS's
        (``ChangeMessageVisibility`` 0): SQS hands the message out again at once."""
        assert isinstance(consumer, TrackingConsumer)
        for delivery in consumer.deliveries:
            if delivery.settlement is None and delivery.holds_lock:
                delivery.locked_until = time.monotonic()
                await self.client.call(
                    "change_message_visibility", QueueUrl=delivery.queue_url,
                    ReceiptHandle=delivery.receipt_handles[-1], VisibilityTimeout=0,
                )

    async def send(self, body: bytes, headers: dict[str, str] | None = None, message_id: str | None = None) -> str:
        message_id = message_id or str(uuid.uuid4())
        await self.publisher.publish(
            OutgoingMessage("", self.queue, message_id, body, "CreateInvoice", headers or {})
        )
        return message_id

    async def dead_letters(self, expected: int, timeout: float = 15.0) -> list[DeadLetter]:
        found: list[DeadLetter] = []
        deadline = time.monotonic() + timeout
        while len(found) < expected:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(found)} of {expected} dead letters after {timeout} s")
            reply = await self.client.call(
                "receive_message", QueueUrl=self.dlq_url, MaxNumberOfMessages=10, WaitTimeSeconds=1,
                MessageAttributeNames=["All"], MessageSystemAttributeNames=SYSTEM_ATTRIBUTES,
            )
            for raw in reply.get("Messages", []):
                await self.client.call("delete_message", QueueUrl=self.dlq_url, ReceiptHandle=raw["ReceiptHandle"])
                headers = headers_of(raw.get("MessageAttributes"))
                found.append(DeadLetter(
                    message_id=as_text(headers.get("x-consumer-kit-message-id")) or raw["MessageId"],
                    body=raw["Body"].encode("utf-8"),
                    reason=as_text(headers.get(DEAD_LETTER_REASON_ATTRIBUTE)) or "redrive",
                    detail=as_text(headers.get(DEAD_LETTER_DETAIL_ATTRIBUTE)),
                    copied=DEAD_LETTER_REASON_ATTRIBUTE in headers,
                    size=size_of(raw["Body"], raw.get("MessageAttributes", {})),
                ))
        return found[:expected]

    async def depth(self) -> int:
        return await self.depth_of(self.queue_url)

    async def depth_of(self, queue_url: str) -> int:
        reply = await self.client.call(
            "get_queue_attributes", QueueUrl=queue_url,
            AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible",
                            "ApproximateNumberOfMessagesDelayed"],
        )
        return sum(int(v) for v in reply["Attributes"].values())

    async def size_limited(self, limit: int) -> tuple[Publisher, str, Callable[[], Awaitable[int]]]:
        name = sqs_queue_name(self.queue) + "-small"
        url = await self.create(name, MaximumMessageSize=str(limit))
        return SQSPublisher(SQSConfig.from_url(self.url)), name, lambda: self.depth_of(url)

    async def close(self) -> None:
        for url in self._created:
            await self.client.call("delete_queue", QueueUrl=url)
        await self.publisher.close()
        await self.client.close()
