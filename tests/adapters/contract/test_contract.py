"""The broker contract, once for every broker (memory, RabbitMQ, SQS; see ``conftest.DRIVERS``).

Each case drives the real worker and runtime (``consumer_kit.worker.process.Worker``) with the broker's
own consumer, on a throwaway PostgreSQL schema, and reads the outcome from three places: the
delivery reports, the ledger and business tables, and the broker (dead-letter queue, work queue).
Where a broker has nothing to test (memory has no size limit) the case says so and skips.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from consumer_kit import Outcome, RetryableError
from consumer_kit.broker import DeadLetterQueues, Settlement
from consumer_kit.broker.publishing import OutgoingMessage
from consumer_kit.context import Context
from consumer_kit.demo.app import CreateInvoice, CreateInvoiceHandler
from consumer_kit.errors import PublishError
from consumer_kit.pipeline import crashpoints
from consumer_kit.pipeline.crashpoints import CrashPoint
from tests.adapters.contract.conftest import Contract
from tests.adapters.contract.driver import wait_until
from tests.fixtures.broker_env import command

pytestmark = [pytest.mark.postgres]

TERMINAL = {Outcome.EXECUTED, Outcome.DUPLICATE}


class FlakyHandler(CreateInvoiceHandler):
    """Fails the first attempt of every operation, then creates the invoice."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[float] = []

    async def handle(self, message: CreateInvoice, ctx: Context) -> Any:
        self.calls.append(time.monotonic())
        if len(self.calls) == 1:
            raise RetryableError("first attempt fails")
        return await super().handle(message, ctx)


class FailingHandler(CreateInvoiceHandler):
    async def handle(self, message: CreateInvoice, ctx: Context) -> Any:
        raise RetryableError("the downstream ledger is closed")


class SlowHandler(CreateInvoiceHandler):
    """Runs ``work()`` (longer than the lock) before creating the invoice."""

    def __init__(self, work: Any) -> None:
        super().__init__()
        self.work = work
        self.calls = 0

    async def handle(self, message: CreateInvoice, ctx: Context) -> Any:
        self.calls += 1
        await self.work()
        return await super().handle(message, ctx)


class StuckHandler(CreateInvoiceHandler):
    """Never finishes on its own: the shutdown has to give the delivery back."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = asyncio.Event()

    async def handle(self, message: CreateInvoice, ctx: Context) -> Any:
        self.entered.set()
        await asyncio.Event().wait()


async def test_duplicates_are_answered_from_the_ledger(contract: Contract) -> None:
    async with contract.worker():
        for _ in range(3):
            await contract.driver.send(command())  # three message ids, one operation
        reports = await contract.reports_until(lambda seen: sum(r.outcome in TERMINAL for r in seen) == 3)
    outcomes = [r.outcome for r in reports if r.outcome in TERMINAL]
    assert outcomes.count(Outcome.EXECUTED) == 1 and outcomes.count(Outcome.DUPLICATE) == 2
    duplicate = next(r for r in reports if r.outcome is Outcome.DUPLICATE)
    assert duplicate.result is not None and duplicate.result.status == "created"
    assert await contract.rows("SELECT count(*) FROM invoices") == [(1,)]
    assert await contract.rows("SELECT invoiced_cents FROM customers") == [(1250,)]
    assert await contract.driver.depth() == 0


async def test_payload_conflict_is_dead_lettered_with_its_reason(contract: Contract) -> None:
    async with contract.worker():
        await contract.driver.send(command())
        assert (await contract.next_report()).outcome is Outcome.EXECUTED
        conflicting = await contract.driver.send(command(amount=9999))
        report = await contract.next_report()
    assert report.outcome is Outcome.PAYLOAD_CONFLICT and report.settlement is Settlement.DEAD_LETTER
    (dead,) = await contract.driver.dead_letters(1)
    assert (dead.message_id, dead.reason) == (conflicting, "payload_conflict")
    assert b"9999" in dead.body and "another fingerprint" in dead.detail
    assert await contract.rows("SELECT invoiced_cents FROM customers") == [(1250,)]
    assert await contract.driver.depth() == 0


async def test_a_crash_before_the_ack_is_redelivered_and_answered_as_a_duplicate(contract: Contract) -> None:
    driver = contract.driver
    crashpoints.arm(CrashPoint.AFTER_COMMIT_BEFORE_ACK, times=1)  # a crashed run is not reported
    try:
        # A long lock, nothing renewing it (as for a dead process): neither the crashing run nor
        # the redelivery can outlive it on a loaded machine.
        async with contract.worker(renewal=False) as worker:
            message_id = await driver.send(command())
            await wait_until(lambda: _true(worker.runtime is not None
                                           and worker.runtime.counters[Outcome.CRASHED.value] == 1))
            if driver.lock_lapses:  # the lock lapses (made explicit, not waited for): the same worker gets it back
                assert contract.consumer is not None
                await driver.lapse_locks(contract.consumer)
                redelivery = await contract.next_report()
            # else: the "dead" worker's connection has to go first
        if not driver.lock_lapses:
            async with contract.worker():
                redelivery = await contract.next_report()
    finally:
        crashpoints.disarm_all()
    assert (redelivery.outcome, redelivery.message_id) == (Outcome.DUPLICATE, message_id)
    assert redelivery.redelivered and redelivery.delivery_count == 2
    assert await contract.rows("SELECT count(*) FROM invoices") == [(1,)]
    assert await driver.depth() == 0


async def test_a_retry_waits_its_delay_and_counts_one_attempt(contract: Contract) -> None:
    handler = FlakyHandler()
    async with contract.worker(handler, retry_delays=[1.0]):
        await contract.driver.send(command())
        first, second = await contract.reports_until(lambda seen: len(seen) == 2)
    assert (first.outcome, first.settlement) == (Outcome.RETRIED, Settlement.RETRY)
    assert second.outcome is Outcome.EXECUTED
    assert (second.delivery_count, second.redelivered) == (2, False)
    assert handler.calls[1] - handler.calls[0] >= 0.9  # retry_delays=[1.0]
    assert await contract.rows("SELECT failures, crashes FROM attempts") == [(1, 0)]
    assert await contract.driver.depth() == 0


async def test_dead_letter_carries_reason_and_detail(contract: Contract) -> None:
    async with contract.worker(FailingHandler(), max_deliveries=2):
        message_id = await contract.driver.send(command())
        reports = await contract.reports_until(lambda seen: len(seen) == 2)
    assert [r.outcome for r in reports] == [Outcome.RETRIED, Outcome.DEAD_LETTERED]
    (dead,) = await contract.driver.dead_letters(1)
    assert (dead.message_id, dead.reason, dead.copied) == (message_id, "max_deliveries_exceeded:RetryableError", True)
    assert "attempt 2 of 2" in dead.detail and "c-1" not in dead.detail  # no payload values
    assert await contract.rows("SELECT count(*) FROM invoices") == [(0,)]
    assert await contract.driver.depth() == 0


async def test_invalid_input_is_dead_lettered_without_running(contract: Contract) -> None:
    async with contract.worker():
        message_id = await contract.driver.send(b"{not json")
        report = await contract.next_report()
    assert report.outcome is Outcome.INVALID
    (dead,) = await contract.driver.dead_letters(1)
    assert (dead.message_id, dead.reason, dead.body) == (message_id, "invalid_json", b"{not json")
    assert await contract.rows("SELECT count(*) FROM operations") == [(0,)]
    assert await contract.driver.depth() == 0


async def test_the_lock_is_renewed_for_a_handler_longer_than_the_lock(contract: Contract) -> None:
    driver = contract.driver
    handler = SlowHandler(lambda: asyncio.sleep(driver.lock_seconds * 2))
    async with contract.worker(handler, short_lock=True):
        await driver.send(command())
        report = await contract.next_report()
        assert (report.outcome, report.settlement_lost, report.redelivered) == (Outcome.EXECUTED, False, False)
        # A lapsed lock would have handed the message out again by now: it would run as soon as
        # the first run ended, and report.
        with pytest.raises(TimeoutError):
            await contract.next_report(timeout=driver.lock_seconds)
    assert handler.calls == 1
    assert await driver.depth() == 0


async def test_a_settlement_after_the_lock_was_lost_is_never_an_ack(contract: Contract) -> None:
    driver = contract.driver

    async def outlive() -> None:
        if handler.calls == 1:
            assert contract.consumer is not None
            await driver.outlive_lock(contract.consumer)  # the lock lapses (made to, not waited for)

    handler = SlowHandler(outlive)
    # A long lock, never renewed: only the lapse made on purpose loses one.
    async with contract.worker(handler, renewal=False):
        message_id = await driver.send(command())
        # Without renewal a redelivery waiting to run alone may outlive its own lock too: wait
        # for the one whose ack holds.
        first, *redeliveries = await contract.reports_until(
            lambda seen: len(seen) > 1 and not seen[-1].settlement_lost
        )
    assert (first.outcome, first.settlement, first.settlement_lost) == (Outcome.EXECUTED, Settlement.ACK, True)
    assert {(r.outcome, r.message_id, r.redelivered) for r in redeliveries} == {
        (Outcome.DUPLICATE, message_id, True)
    }
    assert handler.calls == 1
    assert await contract.rows("SELECT count(*) FROM invoices") == [(1,)]
    assert await driver.depth() == 0


async def test_an_oversized_event_is_refused_before_sending(contract: Contract) -> None:
    if not contract.driver.size_limit:
        pytest.skip(f"{contract.driver.name} has no size limit")
    limit = 2048
    publisher, queue, count = await contract.driver.size_limited(limit)
    try:
        with pytest.raises(PublishError) as refused:
            await publisher.publish(OutgoingMessage("", queue, "big", b"x" * (limit + 1), "E"))
        assert refused.value.permanent
        assert str(limit) in str(refused.value) and "big" in str(refused.value)
        await publisher.publish(OutgoingMessage("", queue, "small", b"{}", "E"))  # still usable
    finally:
        await publisher.close()
    await wait_until(lambda: _equals(count(), 1))


async def test_a_dead_letter_copy_never_exceeds_the_limit(contract: Contract) -> None:
    if not contract.driver.size_limit:
        pytest.skip(f"{contract.driver.name} has no size limit")
    limit = 2048
    body = b"{not json " + b"x" * (limit - 200)  # fits as sent; with a reason and detail it would not
    async with contract.worker(copy_limit=limit):
        message_id = await contract.driver.send(body)
        assert (await contract.next_report()).outcome is Outcome.INVALID
    (dead,) = await contract.driver.dead_letters(1)
    assert (dead.message_id, dead.body) == (message_id, body)
    if dead.copied:  # trimmed to fit, the reason kept
        assert dead.reason == "invalid_json" and dead.size <= limit
    else:  # refused before sending: the broker moved the original itself
        assert dead.reason == "rejected"
    assert await contract.driver.depth() == 0


async def test_shutdown_gives_deliveries_back_without_counting_them(contract: Contract) -> None:
    handler = StuckHandler()
    async with contract.worker(handler, shutdown_timeout=0.5):
        message_id = await contract.driver.send(command())
        await asyncio.wait_for(handler.entered.wait(), 20)
    assert contract.reports.empty()  # a cancelled delivery is released, not reported
    async with contract.worker():
        again = await contract.next_report()
    assert (again.outcome, again.message_id) == (Outcome.EXECUTED, message_id)
    assert (again.redelivered, again.delivery_count) == (False, 1)
    assert await contract.rows("SELECT count(*) FROM attempts") == [(0,)]
    assert await contract.driver.depth() == 0


async def test_dead_letters_are_listed_counted_and_redriven_once(contract: Contract) -> None:
    driver = contract.driver
    dead = driver.dead_letter_queues(contract.settings())
    try:
        if type(dead) is DeadLetterQueues:
            pytest.skip(f"{driver.name}: the adapter provides no DeadLetterQueues (dead_letters_from_settings) yet")
        async with contract.worker(FailingHandler(), max_deliveries=1):
            ids = [await driver.send(command(order_id=n)) for n in (1, 2, 3)]  # three poison messages
            poisoned = await contract.reports_until(lambda seen: len(seen) == 3)
        assert {r.outcome for r in poisoned} == {Outcome.DEAD_LETTERED}
        await wait_until(lambda: _equals(dead.count(driver.queue), 3))

        letters = await dead.peek(driver.queue)
        assert sorted(d.message_id or "" for d in letters) == sorted(ids)
        assert {(d.queue, d.reason) for d in letters} == {(driver.queue, "max_deliveries_exceeded:RetryableError")}
        assert all("attempt 1 of 1" in d.detail and d.delivery_count == 1 for d in letters)
        await wait_until(lambda: _equals(dead.count(driver.queue), 3))  # a peek removes nothing

        first, done, kept = ids
        async with contract.worker():  # the cause is fixed; order 2 completes from a fresh copy
            await driver.send(command(order_id=2))
            assert (await contract.next_report()).outcome is Outcome.EXECUTED
            report = await dead.redrive(driver.queue, lambda d: d.message_id != kept)
            assert (report.redriven, report.kept, report.failed) == (2, 1, 0)
            redriven = await contract.reports_until(lambda seen: len(seen) == 2)
        assert {(r.message_id, r.outcome) for r in redriven} == {
            (first, Outcome.EXECUTED), (done, Outcome.DUPLICATE),
        }
        assert all(r.delivery_count == 1 and not r.redelivered for r in redriven)  # counting starts again
        assert await contract.rows("SELECT order_id FROM invoices ORDER BY order_id") == [(1,), (2,)]
        await wait_until(lambda: _equals(dead.count(driver.queue), 1))
        assert [d.message_id for d in await dead.peek(driver.queue)] == [kept]
        assert await driver.depth() == 0
    finally:
        await dead.close()


async def _equals(value: Any, expected: Any) -> bool:
    return await value == expected


async def _true(value: bool) -> bool:
    return value


class BatchesOfTen(CreateInvoiceHandler):
    """The batch path: up to 10 deliveries per transaction; order 13 fails every time."""

    batch_size = 10
    batch_wait = 0.05

    async def handle(self, message: CreateInvoice, ctx: Context) -> Any:
        if message.order_id == 13:
            raise RetryableError("order 13 always fails")
        return await super().handle(message, ctx)


async def test_batches_keep_each_outcome(contract: Contract) -> None:
    """Deliveries taken in batches (docs/how-to/batches.md): new ones execute once, duplicates
    and conflicts are answered from the ledger, a failing one is retried then dead-lettered
    without costing the others their effect."""
    async with contract.worker(BatchesOfTen(), max_deliveries=2, concurrency=2):
        for order in range(20):  # order 13 fails on every attempt
            await contract.driver.send(command(order_id=order, amount=100))
        await contract.driver.send(command(order_id=3, amount=100))  # a duplicate
        conflicting = await contract.driver.send(command(order_id=4, amount=5))  # a conflict

        def done(seen: list[Any]) -> bool:
            final = [r for r in seen if r.outcome not in (Outcome.IN_PROGRESS, Outcome.RETRIED, Outcome.CONTENDED)]
            return len(final) >= 22

        reports = await contract.reports_until(done, timeout=60)
    final = [r.outcome.value for r in reports if r.outcome not in (Outcome.IN_PROGRESS, Outcome.RETRIED, Outcome.CONTENDED)]
    assert sorted(final) == sorted(["executed"] * 19 + ["duplicate", "payload_conflict", "dead_lettered"]), final
    assert await contract.rows("SELECT count(*) FROM invoices") == [(19,)]
    assert await contract.rows("SELECT count(*) FROM outbox") == [(19,)]
    # only the failing operation was counted
    assert await contract.rows("SELECT key, failures FROM attempts WHERE failures > 0") == [("order-13-rev-2", 2)]
    dead = await contract.driver.dead_letters(2)
    assert sorted(d.reason.split(":")[0] for d in dead) == ["max_deliveries_exceeded", "payload_conflict"]
    assert conflicting in {d.message_id for d in dead}
    assert await contract.driver.depth() == 0
