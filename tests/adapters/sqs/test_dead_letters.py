"""``consumer-kit dlq list`` and ``dlq redrive`` on SQS (moto in server mode, real PostgreSQL).

The CLI test is tests/cli/test_dlq.py's on SQS: 50 dead letters, 20 of whose operations completed
meanwhile, are redriven; the other 30 execute once each and the 20 answer as duplicates. The
others cover what is SQS's own (:mod:`consumer_kit.adapters.sqs.dead_letters`): a dead-letter queue shared by
two work queues, a message SQS moved itself, what a redriven copy carries, FIFO message groups,
and dead letters that arrive while a redrive runs.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import boto3
import pytest
from typer.testing import CliRunner

from consumer_kit import Context, Outcome, RetryableError
from consumer_kit.adapters.sqs import SQSClient, SQSConfig, SQSDeadLetters, headers_of
from consumer_kit.adapters.sqs.dead_letters import BROKER_REASON, REDRIVEN_ATTRIBUTE
from consumer_kit.cli.main import cli
from consumer_kit.codec import headers as own
from consumer_kit.demo.app import CreateInvoice, CreateInvoiceHandler
from tests.adapters.contract.conftest import Contract
from tests.adapters.contract.sqs_driver import SQSDriver
from tests.fixtures.broker_env import command
from tests.fixtures.harness import throwaway_schema
from tests.fixtures.moto_server import REGION, sqs_endpoint, sqs_url  # noqa: F401 - fixture

pytestmark = [pytest.mark.postgres]

REASON = "max_deliveries_exceeded:RetryableError"


class Gated(CreateInvoiceHandler):
    """Fails every attempt while ``open`` is false (the downstream is down)."""

    def __init__(self) -> None:
        super().__init__()
        self.open = False

    async def handle(self, message: CreateInvoice, ctx: Context) -> Any:
        if not self.open:
            raise RetryableError("ledger service down")
        return await super().handle(message, ctx)


@pytest.fixture
async def case(sqs_endpoint: str, database_url: str, unique_name: str) -> AsyncIterator[Contract]:  # noqa: F811
    driver = SQSDriver(f"{unique_name}.commands", sqs_endpoint)
    await driver.open()
    try:
        async with throwaway_schema(database_url) as schema:
            yield Contract(driver, database_url, schema)
    finally:
        await driver.close()


async def dlq(case: Contract, *args: str) -> str:
    """``consumer-kit dlq ARGS`` in a thread (the command runs its own event loop)."""
    assert isinstance(case.driver, SQSDriver)
    result = await asyncio.to_thread(CliRunner().invoke, cli, ["dlq", *args], env={
        "CONSUMER_KIT_BROKER_URL": case.driver.url, "CONSUMER_KIT_DATABASE_URL": case.database_url,
        "CONSUMER_KIT_DB_SCHEMA": case.schema, "COLUMNS": "250",
    })
    assert result.exit_code == 0, result.output
    return result.output


def terminal(count: int) -> Any:
    return lambda seen: sum(r.outcome in (Outcome.EXECUTED, Outcome.DUPLICATE, Outcome.DEAD_LETTERED)
                            for r in seen) == count


async def test_redrive_of_50_dead_letters_executes_the_rest_once_and_answers_the_others_as_duplicates(
    case: Contract,
) -> None:
    driver = case.driver
    queue = driver.queue
    handler = Gated()

    async def send(order: int) -> str:  # the producer names the operation (header operation-id)
        return await driver.send(command(order_id=order), {"operation-id": f"order-{order}-rev-2"})

    async with case.worker(handler, max_deliveries=1):
        await asyncio.gather(*(send(order) for order in range(1, 51)))
        dead = await case.reports_until(terminal(50), timeout=60)
        assert {r.outcome for r in dead} == {Outcome.DEAD_LETTERED}

        handler.open = True
        await asyncio.gather(*(send(order) for order in range(1, 21)))  # 20 operations complete
        done = await case.reports_until(terminal(20), timeout=60)
        assert {r.outcome for r in done} == {Outcome.EXECUTED}

        listed = json.loads(await dlq(case, "list", queue, "--json"))
        assert len(listed) == 50
        assert {row["reason"] for row in listed} == {REASON}
        assert {row["operation_key"] for row in listed} == {f"order-{n}-rev-2" for n in range(1, 51)}
        assert all(row["delivery_count"] == 1 and "body" not in row for row in listed)
        assert all(row["dead_lettered_at"] and row["first_failure"] <= row["last_failure"] for row in listed)
        table = await dlq(case, "list", queue, "--limit", "3")
        assert REASON in table and "ledger service down" not in table

        dry = await dlq(case, "redrive", queue, "--key", "order-7-rev-2", "--dry-run")
        assert "would redrive 1, kept 49, failed 0" in dry
        assert len(json.loads(await dlq(case, "list", queue, "--json"))) == 50  # nothing moved

        moved = await dlq(case, "redrive", queue, "--reason", "max_deliveries_exceeded")
        assert "redrove 50, kept 0, failed 0" in moved
        redriven = await case.reports_until(terminal(50), timeout=60)

    outcomes = {int(r.operation_key.split("-")[1]): r.outcome for r in redriven if r.operation_key}
    assert len(outcomes) == 50
    assert {o for n, o in outcomes.items() if n <= 20} == {Outcome.DUPLICATE}
    assert {o for n, o in outcomes.items() if n > 20} == {Outcome.EXECUTED}
    assert await case.rows("SELECT count(*), count(DISTINCT order_id) FROM invoices") == [(50, 50)]
    assert json.loads(await dlq(case, "list", queue, "--json")) == []
    assert await driver.depth() == 0


async def test_a_queue_that_does_not_exist_is_a_user_error(sqs_endpoint: str, unique_name: str) -> None:  # noqa: F811
    result = await asyncio.to_thread(CliRunner().invoke, cli, ["dlq", "list", f"{unique_name}.nope"], env={
        "CONSUMER_KIT_BROKER_URL": sqs_url(sqs_endpoint),
    })
    assert result.exit_code == 2, result.output
    assert f"no SQS queue '{unique_name}.nope'" in result.output and "Traceback" not in result.output


# -- SQS's own -----------------------------------------------------------------------------------


@pytest.fixture
async def sqs(sqs_endpoint: str) -> AsyncIterator[SQSClient]:  # noqa: F811
    client = SQSClient(SQSConfig.from_url(sqs_url(sqs_endpoint)), threads=4, pollers=0)
    yield client
    await client.close()


async def make(client: SQSClient, name: str, dlq_arn: str | None = None, max_receive_count: int = 5) -> tuple[str, str]:
    """A queue (FIFO for a ``.fifo`` name), with a redrive policy to ``dlq_arn`` if given: (URL, ARN)."""
    attributes = {"FifoQueue": "true"} if name.endswith(".fifo") else {}
    if dlq_arn:
        attributes["RedrivePolicy"] = json.dumps({"deadLetterTargetArn": dlq_arn, "maxReceiveCount": max_receive_count})
    url = str((await client.call("create_queue", QueueName=name, Attributes=attributes))["QueueUrl"])
    reply = await client.call("get_queue_attributes", QueueUrl=url, AttributeNames=["QueueArn"])
    return url, str(reply["Attributes"]["QueueArn"])


def dead_letter_copy(origin: str, message_id: str, **extra: Any) -> dict[str, Any]:
    """``send_message`` parameters of a dead-letter copy as :class:`~consumer_kit.adapters.sqs.SQSDelivery` sends it."""
    attributes = {
        "x-dead-letter-reason": REASON, "x-dead-letter-detail": "RetryableError on attempt 3 of 3",
        "x-original-queue": origin, "x-consumer-kit-deliveries": "3", "x-consumer-kit-message-id": message_id,
        "operation-id": f"op-{message_id}", "message-type": "CreateInvoice",
    }
    body = json.dumps({"id": message_id})
    own.seal(attributes, body.encode())  # the copy's marks, signed as the adapter signs them
    return {"MessageBody": body, **extra,
            "MessageAttributes": {k: {"DataType": "String", "StringValue": v} for k, v in attributes.items()}}


async def received(client: SQSClient, url: str, expected: int) -> list[dict[str, Any]]:
    """The first ``expected`` messages of ``url`` (deleted), waiting at most 15 s."""
    found: list[dict[str, Any]] = []
    async with asyncio.timeout(15):
        while len(found) < expected:
            reply = await client.call(
                "receive_message", QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=1,
                MessageAttributeNames=["All"], MessageSystemAttributeNames=["All"],
            )
            for raw in reply.get("Messages", []):
                await client.call("delete_message", QueueUrl=url, ReceiptHandle=raw["ReceiptHandle"])
                found.append(raw)
    return found


async def test_a_shared_dead_letter_queue_lists_and_redrives_only_the_queue_asked_for(
    sqs: SQSClient, sqs_endpoint: str, unique_name: str,  # noqa: F811
) -> None:
    dlq_url, dlq_arn = await make(sqs, f"{unique_name}-shared-dlq")
    a_url, _ = await make(sqs, f"{unique_name}-a", dlq_arn, max_receive_count=1)
    b_url, _ = await make(sqs, f"{unique_name}-b", dlq_arn)
    dead = SQSDeadLetters(SQSConfig.from_url(sqs_url(sqs_endpoint)))
    try:
        await sqs.call("send_message", QueueUrl=dlq_url, **dead_letter_copy(f"{unique_name}.a", "m-a"))
        await sqs.call("send_message", QueueUrl=dlq_url, **dead_letter_copy(f"{unique_name}.b", "m-b"))
        moved = str((await sqs.call("send_message", QueueUrl=a_url, MessageBody="{}"))["MessageId"])
        await sqs.call("receive_message", QueueUrl=a_url, VisibilityTimeout=0)  # received once (maxReceiveCount 1)
        assert (await sqs.call("receive_message", QueueUrl=a_url)).get("Messages") is None  # SQS moved it
        assert await dead.count(f"{unique_name}.a") == 3  # the whole queue's count

        letters = {d.message_id: d for d in await dead.peek(f"{unique_name}.a")}
        assert set(letters) == {"m-a", moved}
        copy, by_sqs = letters["m-a"], letters[moved]
        assert (copy.reason, copy.delivery_count, copy.operation_key) == (REASON, 3, "op-m-a")
        assert copy.dead_lettered_at is not None and copy.queue == f"{unique_name}.a"
        assert (by_sqs.reason, by_sqs.delivery_count, by_sqs.dead_lettered_at) == (BROKER_REASON, 1, None)
        of_b = {d.message_id for d in await dead.peek(f"{unique_name}.b")}
        assert "m-b" in of_b and "m-a" not in of_b  # (moto sets no DeadLetterQueueSourceArn: SQS's move shows too)

        report = await dead.redrive(f"{unique_name}.a", lambda d: True)
        assert (report.redriven, report.kept, report.failed) == (2, 0, 0)
        back = {headers_of(raw["MessageAttributes"]).get("x-consumer-kit-message-id"): raw
                for raw in await received(sqs, a_url, 2)}
        assert set(back) == {"m-a", moved}
        headers = headers_of(back["m-a"]["MessageAttributes"])
        assert headers["operation-id"] == "op-m-a" and headers[REDRIVEN_ATTRIBUTE] == REASON
        assert not {"x-dead-letter-reason", "x-dead-letter-detail", "x-original-queue",
                    "x-consumer-kit-deliveries"} & set(headers)
        assert back["m-a"]["Body"] == json.dumps({"id": "m-a"})
        assert back["m-a"]["Attributes"]["ApproximateReceiveCount"] == "1"  # counting starts again
        assert [d.message_id for d in await dead.peek(f"{unique_name}.b")] == ["m-b"]  # b's is untouched
    finally:
        await dead.close()
        for url in (a_url, b_url, dlq_url):
            await sqs.call("delete_queue", QueueUrl=url)


async def test_a_fifo_redrive_keeps_the_message_group(sqs: SQSClient, sqs_endpoint: str, unique_name: str) -> None:  # noqa: F811
    dlq_url, dlq_arn = await make(sqs, f"{unique_name}-dlq.fifo")
    url, _ = await make(sqs, f"{unique_name}.fifo", dlq_arn)
    dead = SQSDeadLetters(SQSConfig.from_url(sqs_url(sqs_endpoint)))
    try:
        for n, group in enumerate(("order-7", "order-8")):
            await sqs.call("send_message", QueueUrl=dlq_url, **dead_letter_copy(
                f"{unique_name}.fifo", f"m-{n}", MessageGroupId=group, MessageDeduplicationId=f"d-{n}"))
        assert {d.message_id for d in await dead.peek(f"{unique_name}.fifo")} == {"m-0", "m-1"}
        report = await dead.redrive(f"{unique_name}.fifo", lambda d: True)
        assert (report.redriven, report.kept, report.failed) == (2, 0, 0)
        groups = {headers_of(raw["MessageAttributes"])["x-consumer-kit-message-id"]: raw["Attributes"]["MessageGroupId"]
                  for raw in await received(sqs, url, 2)}
        assert groups == {"m-0": "order-7", "m-1": "order-8"}
        assert await dead.count(f"{unique_name}.fifo") == 0
    finally:
        await dead.close()
        for queue_url in (url, dlq_url):
            await sqs.call("delete_queue", QueueUrl=queue_url)


async def test_dead_letters_arriving_during_a_redrive_are_left_for_the_next(
    sqs: SQSClient, sqs_endpoint: str, unique_name: str,  # noqa: F811
) -> None:
    dlq_url, dlq_arn = await make(sqs, f"{unique_name}-dlq")
    url, _ = await make(sqs, unique_name, dlq_arn)
    dead = SQSDeadLetters(SQSConfig.from_url(sqs_url(sqs_endpoint)))
    # A plain synchronous client: ``select`` runs on the event loop and cannot await.
    producer = boto3.session.Session().client("sqs", region_name=REGION, endpoint_url=sqs_endpoint)

    def select(letter: Any) -> bool:  # each redriven message fails again at once
        producer.send_message(QueueUrl=dlq_url, **dead_letter_copy(unique_name, f"again-{letter.message_id}"))
        return True

    try:
        for n in range(3):
            await sqs.call("send_message", QueueUrl=dlq_url, **dead_letter_copy(unique_name, f"m-{n}"))
        async with asyncio.timeout(30):  # without the rule, each pass would find a new one for ever
            report = await dead.redrive(unique_name, select)
        assert (report.redriven, report.kept, report.failed) == (3, 0, 0)  # looked at each once
        assert {d.message_id for d in await dead.peek(unique_name)} == {f"again-m-{n}" for n in range(3)}
        assert len(await received(sqs, url, 3)) == 3
    finally:
        producer.close()
        await dead.close()
        for queue_url in (url, dlq_url):
            await sqs.call("delete_queue", QueueUrl=queue_url)
