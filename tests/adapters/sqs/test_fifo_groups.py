"""A FIFO message group behind failing heads, on moto in server mode and real PostgreSQL.

Group G holds m1..m10; the first ``failing`` always raise a retryable error, the rest are healthy;
``max_deliveries`` 5. SQS counts every receive towards the redrive policy's ``maxReceiveCount``:
when each failed attempt of a head gave the rest of the group back, the followers' receive counts
climbed with every attempt, and SQS moved healthy messages to the DLQ with no consumer-kit reason
and never ran them. Expected: the failing heads dead-lettered by consumer-kit after their 5
attempts, each healthy message run once, every dead letter carrying consumer-kit's reason, and no
message received more than once, with the issue's policy (10), the smallest one the start-up check
accepts without a warning (``max_deliveries + crash_limit`` = 8) and the default (50).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest

from consumer_kit import App, Context, DeliveryReport, Outcome, Result, RetryableError, Settings
from consumer_kit.adapters.sqs import SQSClient, SQSConfig, SQSConsumer, headers_of
from consumer_kit.adapters.sqs.envelope import DEAD_LETTER_REASON_ATTRIBUTE
from consumer_kit.adapters.sqs.topology import recommended_max_receive_count
from consumer_kit.demo.app import CreateInvoice, CreateInvoiceHandler
from consumer_kit.worker.process import Worker
from tests.fixtures.broker_env import command
from tests.fixtures.harness import throwaway_schema
from tests.fixtures.moto_server import sqs_endpoint, sqs_url  # noqa: F401 - fixture

pytestmark = [pytest.mark.postgres]

MAX_DELIVERIES, CRASH_LIMIT, MESSAGES = 5, 3, 10


class FailingHeads(CreateInvoiceHandler):
    """Orders ``1..failing`` always fail with a retryable error; every run is counted."""

    def __init__(self, failing: int) -> None:
        super().__init__()
        self.failing = failing
        self.runs: Counter[int] = Counter()

    async def handle(self, message: CreateInvoice, ctx: Context) -> Result:
        self.runs[message.order_id] += 1
        if message.order_id <= self.failing:
            raise RetryableError("downstream refuses this one")
        return await super().handle(message, ctx)


@pytest.fixture
async def sqs(sqs_endpoint: str) -> AsyncIterator[SQSClient]:  # noqa: F811 - the fixture above
    client = SQSClient(SQSConfig.from_url(sqs_url(sqs_endpoint)), threads=4, pollers=0)
    yield client
    await client.close()


async def fifo_queue(sqs: SQSClient, max_receive_count: int) -> tuple[str, str, str]:
    """A FIFO queue whose redrive policy moves a message to its own DLQ after
    ``max_receive_count`` receives; returns (name, queue URL, DLQ URL)."""
    name = f"t{uuid.uuid4().hex[:10]}.fifo"
    dlq = await sqs.call("create_queue", QueueName=name.replace(".fifo", "-dlq.fifo"),
                         Attributes={"FifoQueue": "true"})
    dlq_url = str(dlq["QueueUrl"])
    arn = (await sqs.call("get_queue_attributes", QueueUrl=dlq_url, AttributeNames=["QueueArn"]))["Attributes"]["QueueArn"]
    policy = {"deadLetterTargetArn": arn, "maxReceiveCount": max_receive_count}
    reply = await sqs.call("create_queue", QueueName=name,
                           Attributes={"FifoQueue": "true", "RedrivePolicy": json.dumps(policy)})
    return name, str(reply["QueueUrl"]), dlq_url


async def drain(sqs: SQSClient, url: str) -> list[dict[str, Any]]:
    """Every message of ``url`` (deleted), waiting up to 2 s for stragglers."""
    found: list[dict[str, Any]] = []
    while True:
        reply = await sqs.call("receive_message", QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=2,
                               MessageAttributeNames=["All"], MessageSystemAttributeNames=["All"])
        messages = reply.get("Messages", [])
        if not messages:
            return found
        for raw in messages:
            await sqs.call("delete_message", QueueUrl=url, ReceiptHandle=raw["ReceiptHandle"])
        found.extend(messages)


@pytest.mark.parametrize(("failing", "max_receive_count"), [
    (2, 10),  # the case
    (3, 10),  # the worse case: SQS itself moved m3 and the healthy m4..m8
    (3, MAX_DELIVERIES + CRASH_LIMIT),  # the smallest policy the start-up check accepts
    (3, recommended_max_receive_count(MAX_DELIVERIES, CRASH_LIMIT)),  # the default of created queues
])
async def test_failing_heads_of_a_fifo_group_never_cost_their_followers_a_receive(
    sqs: SQSClient, sqs_endpoint: str, database_url: str, failing: int, max_receive_count: int,  # noqa: F811
) -> None:
    name, url, dlq_url = await fifo_queue(sqs, max_receive_count)
    for order in range(1, MESSAGES + 1):
        await sqs.call("send_message", QueueUrl=url, MessageBody=command(order_id=order).decode(),
                       MessageGroupId="G", MessageDeduplicationId=f"m{order}")
    handler = FailingHeads(failing)
    app = App("fifo-heads")
    app.subscribe(name, handler)
    reports: asyncio.Queue[DeliveryReport] = asyncio.Queue()
    async with throwaway_schema(database_url) as schema:
        broker_url = sqs_url(sqs_endpoint)
        settings = Settings(
            database_url=database_url, db_schema=schema, search_path=schema, broker_url=broker_url,
            retry_delays=[0.1], max_deliveries=MAX_DELIVERIES, crash_limit=CRASH_LIMIT, concurrency=4,
            prefetch=10, settle_timeout=10.0, shutdown_timeout=5.0,
        )
        consumer = SQSConsumer(SQSConfig.from_url(broker_url), max_deliveries=MAX_DELIVERIES,
                               crash_limit=CRASH_LIMIT, settle_timeout=10.0, concurrency=4)
        worker = Worker(app, settings, consumer=consumer, on_report=reports.put_nowait)
        task = asyncio.create_task(worker.run())
        terminal: dict[str, DeliveryReport] = {}
        try:
            async with asyncio.timeout(90):
                while len(terminal) < MESSAGES:
                    report = await reports.get()
                    if report.outcome in (Outcome.EXECUTED, Outcome.DEAD_LETTERED):
                        assert report.message_id not in terminal, "an operation ended twice"
                        terminal[str(report.message_id)] = report
        finally:
            worker.stop()
            await asyncio.wait_for(task, 30)
        receives = consumer.receives
    expected_runs = {order: MAX_DELIVERIES if order <= failing else 1 for order in range(1, MESSAGES + 1)}
    assert dict(handler.runs) == expected_runs
    assert sorted(r.outcome.value for r in terminal.values()) == sorted(
        [Outcome.DEAD_LETTERED.value] * failing + [Outcome.EXECUTED.value] * (MESSAGES - failing)
    )
    assert receives == MESSAGES  # each message received once: no follower spent a receive
    dead = await drain(sqs, dlq_url)
    assert len(dead) == failing
    reasons = [headers_of(raw.get("MessageAttributes")).get(DEAD_LETTER_REASON_ATTRIBUTE) for raw in dead]
    assert all(reason and str(reason).startswith("max_deliveries_exceeded") for reason in reasons), reasons
    assert sorted(json.loads(raw["Body"])["order_id"] for raw in dead) == list(range(1, failing + 1))
    assert await drain(sqs, url) == []
    for queue_url in (url, dlq_url):
        await sqs.call("delete_queue", QueueUrl=queue_url)
