"""A producer cannot steer consumer-kit's bookkeeping, on every broker: forged marks are
ignored and counted, the time that decides key expiry survives every copy consumer-kit makes, a
future operation time is refused, and redrive goes only to the queue the operator named."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
import uuid
from typing import Any

import psycopg
import pytest

from consumer_kit import Context, Outcome, RetryableError
from consumer_kit.broker import DeadLetter, DeadLetterQueues
from consumer_kit.codec import headers as own
from consumer_kit.demo.app import CreateInvoice, CreateInvoiceHandler
from consumer_kit.ledger.retention import Pruner
from tests.adapters.contract.conftest import Contract
from tests.adapters.contract.sqs_driver import SQSDriver
from tests.fixtures.broker_env import command

FORGED = {
    own.REDELIVERED: "1", own.DELIVERIES: "7", own.MESSAGE_ID: "forged-id",
    own.ORIGINAL_QUEUE: "somewhere-else", own.DEAD_LETTER_REASON: "handler_failed",
    own.DEAD_LETTER_DETAIL: "looks like ours", own.FIRST_ENQUEUED: "2000-01-01T00:00:00+00:00",
}


class Counted(CreateInvoiceHandler):
    """Fails every attempt while ``open`` is false; counts the runs that got through."""

    key_retention = dt.timedelta(seconds=3)

    def __init__(self) -> None:
        super().__init__()
        self.open = False
        self.runs = 0

    async def handle(self, message: CreateInvoice, ctx: Context) -> Any:
        if not self.open:
            raise RetryableError("downstream down")
        self.runs += 1
        return await super().handle(message, ctx)


async def test_forged_marks_are_ignored_and_counted(contract: Contract) -> None:
    """Every mark a producer can write, at once: the message runs once, not alone, as a first
    delivery under the broker's own id; each mark is counted as unverified."""
    before = {name: own.UNVERIFIED[name] for name in FORGED}
    handler = CreateInvoiceHandler()
    async with contract.worker(handler):
        sent_id = await _send_as_a_producer(contract, command(order_id=1), dict(FORGED))
        report = await contract.next_report()
    assert report.outcome is Outcome.EXECUTED
    assert (report.redelivered, report.delivery_count, report.message_id) == (False, 1, sent_id)
    assert all(own.UNVERIFIED[name] > before[name] for name in FORGED)


async def test_a_forged_delivery_count_does_not_dead_letter_a_first_fault(contract: Contract) -> None:
    """``x-consumer-kit-deliveries: 7`` with max_deliveries 3 was believed; now the first fault is
    retried and the second run executes."""
    flaky = _FailFirst()
    async with contract.worker(flaky, max_deliveries=3):
        await contract.driver.send(command(order_id=2), {own.DELIVERIES: "7"})
        seen = await contract.reports_until(lambda s: any(r.outcome is Outcome.EXECUTED for r in s))
    assert [r.outcome for r in seen] == [Outcome.RETRIED, Outcome.EXECUTED]
    assert flaky.calls == 2


class _FailFirst(CreateInvoiceHandler):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    async def handle(self, message: CreateInvoice, ctx: Context) -> Any:
        self.calls += 1
        if self.calls == 1:
            raise RetryableError("first attempt fails")
        return await super().handle(message, ctx)


async def test_an_operation_time_a_day_ahead_is_refused_naming_the_header(contract: Contract) -> None:
    ahead = (dt.datetime.now(dt.UTC) + dt.timedelta(days=1)).isoformat()
    handler = Counted()
    handler.open = True
    async with contract.worker(handler):
        await contract.driver.send(command(order_id=3), {own.OPERATION_CREATED_AT: ahead})
        report = await contract.next_report()
        # within the stated clock-skew allowance (60 s) it is accepted
        near = (dt.datetime.now(dt.UTC) + dt.timedelta(seconds=30)).isoformat()
        await contract.driver.send(command(order_id=4), {own.OPERATION_CREATED_AT: near})
        accepted = await contract.next_report()
    assert (report.outcome, report.reason) == (Outcome.INVALID, "invalid_header")
    (letter,) = await contract.driver.dead_letters(1)
    assert own.OPERATION_CREATED_AT in letter.detail
    assert accepted.outcome is Outcome.EXECUTED and handler.runs == 1


@pytest.mark.parametrize("attempts", [1, 2], ids=["dead-lettered at once", "after a retry copy"])
async def test_a_redrive_after_prune_is_key_expired_never_executed(contract: Contract, attempts: int) -> None:
    """Dead-lettered after its attempts (with 2: a retry copy, then a dead-letter copy, each with a
    new enqueue time on the broker), then ``prune``, then a redrive (one more copy): refused as
    ``key_expired`` because the first enqueue time travels, signed, on every copy."""
    if contract.driver.name == "memory":
        pytest.skip("the memory broker keeps no dead-letter queue to redrive")
    handler = Counted()  # key retention 3 s
    queue = contract.driver.queue
    async with contract.worker(handler, max_deliveries=attempts) as worker:
        sent = time.monotonic()
        await contract.driver.send(command(order_id=5), {"operation-id": f"op-{uuid.uuid4()}"})
        seen = await contract.reports_until(lambda s: any(r.outcome is Outcome.DEAD_LETTERED for r in s))
        assert [r.outcome for r in seen][-1] is Outcome.DEAD_LETTERED and handler.runs == 0
        dead = contract.driver.dead_letter_queues(worker.settings)
        (letter,) = await _peeked(dead, queue)
        # the retention, made to have passed: 3 s after the first enqueue (a precondition of
        # the case, not a synchronisation: nothing runs meanwhile)
        await _until_monotonic(sent + Counted.key_retention.total_seconds() + 0.5)
        async with await psycopg.AsyncConnection.connect(contract.database_url, autocommit=True) as conn:
            pruner = Pruner(contract.schema, grace=0)
            for table in await pruner.tables(conn):
                await pruner.prune_identities(conn, table, 100)
        handler.open = True
        try:
            report = await dead.redrive(queue, lambda d: True)
        finally:
            await dead.close()
        assert report.redriven == 1
        expired = await contract.next_report()
    assert (expired.outcome, expired.reason) == (Outcome.KEY_EXPIRED, "key_expired")
    assert handler.runs == 0
    assert await contract.rows("SELECT count(*) FROM invoices") == [(0,)]
    assert letter.reason.startswith("max_deliveries_exceeded")


async def _send_as_a_producer(contract: Contract, body: bytes, headers: dict[str, str]) -> str:
    """Send as a producer with publish rights would: on SQS with the SDK itself (consumer-kit's
    own publisher writes no marks it did not make); elsewhere consumer-kit's publisher passes the
    headers on unsigned, as any producer's client would."""
    driver = contract.driver
    if isinstance(driver, SQSDriver):
        reply = await driver.client.call(
            "send_message", QueueUrl=driver.queue_url, MessageBody=body.decode(),
            MessageAttributes={k: {"DataType": "String", "StringValue": v} for k, v in headers.items()},
        )
        return str(reply["MessageId"])
    return await driver.send(body, headers)


async def _until_monotonic(deadline: float) -> None:
    await asyncio.sleep(max(0.0, deadline - time.monotonic()))


async def _peeked(dead: DeadLetterQueues, queue: str) -> list[DeadLetter]:
    """The dead letters of ``queue`` once there are any (polling the broker, bounded), left there."""
    async with asyncio.timeout(15):
        while not (letters := await dead.peek(queue)):
            await asyncio.sleep(0.1)
    return letters
