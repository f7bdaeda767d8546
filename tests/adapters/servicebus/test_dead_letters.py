"""``consumer-kit dlq list`` and ``dlq redrive`` on Service Bus (the real azure-servicebus SDK against
the local test server, real PostgreSQL).

The CLI test is tests/cli/test_dlq.py's on Service Bus: 50 dead letters, 20 of whose operations
completed meanwhile, are redriven; the other 30 execute once each and the 20 answer as duplicates.
The others cover what is Service Bus's own (:mod:`consumer_kit.adapters.servicebus.dead_letters`): peeking
locks and counts nothing, what a redriven copy carries (session id kept, dead-letter properties
dropped, the id consumer-kit saw), a message Service Bus moved itself, messages kept or arriving
during a redrive, a copy that no longer fits, and subscriptions (listed, never redriven).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from azure.servicebus import ServiceBusClient as SyncClient
from azure.servicebus import ServiceBusMessage, ServiceBusSubQueue
from typer.testing import CliRunner

from consumer_kit import Context, Outcome, RetryableError
from consumer_kit.adapters.servicebus import ServiceBusDeadLetters, dead_letters
from consumer_kit.broker import DeadLetter
from consumer_kit.cli.main import cli
from consumer_kit.codec import headers as own
from consumer_kit.demo.app import CreateInvoice, CreateInvoiceHandler
from consumer_kit.errors import ConfigurationError
from tests.adapters.contract.conftest import Contract
from tests.adapters.contract.servicebus_driver import ServiceBusDriver
from tests.adapters.servicebus.server import MessageSnapshot, ServiceBusTestServer
from tests.adapters.servicebus.server.fixtures import SDK_CALL_TIMEOUT, SBEnv
from tests.fixtures.broker_env import command
from tests.fixtures.harness import throwaway_schema

pytestmark = [pytest.mark.postgres]

REASON = "max_deliveries_exceeded:RetryableError"
DETAIL = "RetryableError at handlers.py:12 in handle on attempt 3 of 3"


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
async def case(sb_server: ServiceBusTestServer, database_url: str, unique_name: str) -> AsyncIterator[Contract]:
    driver = ServiceBusDriver(f"{unique_name}.commands", sb_server)
    await driver.open()
    try:
        async with throwaway_schema(database_url) as schema:
            yield Contract(driver, database_url, schema)
    finally:
        await driver.close()


def run_dlq(server: ServiceBusTestServer, args: list[str], **env: str) -> Any:
    return CliRunner().invoke(cli, ["dlq", *args], env={
        "CONSUMER_KIT_BROKER_URL": "servicebus://",
        "CONSUMER_KIT_SERVICEBUS_CONNECTION_STRING": server.connection_string,
        "CONSUMER_KIT_SERVICEBUS_RECEIVE_WAIT": "0.5", "COLUMNS": "250", **env,
    })


async def dlq(case: Contract, *args: str) -> str:
    """``consumer-kit dlq ARGS`` in a thread (the command runs its own event loop)."""
    assert isinstance(case.driver, ServiceBusDriver)
    result = await asyncio.to_thread(
        run_dlq, case.driver.server, list(args),
        CONSUMER_KIT_DATABASE_URL=case.database_url, CONSUMER_KIT_DB_SCHEMA=case.schema,
    )
    assert result.exit_code == 0, result.output
    return str(result.output)


def terminal(count: int) -> Any:
    return lambda seen: sum(r.outcome in (Outcome.EXECUTED, Outcome.DUPLICATE, Outcome.DEAD_LETTERED)
                            for r in seen) == count


async def test_redrive_of_50_dead_letters_executes_the_rest_once_and_answers_the_others_as_duplicates(
    case: Contract, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(dead_letters, "PEEK_PAGE", 7)  # several pages and receives (the CLI runs in-process)
    monkeypatch.setattr(dead_letters, "RECEIVE_BATCH", 8)
    driver = case.driver
    assert isinstance(driver, ServiceBusDriver)
    queue = driver.queue
    dead_letter_queue = driver.server.entity(f"{queue}/$DeadLetterQueue")
    handler = Gated()

    async def send(order: int) -> str:  # the producer names the operation (header operation-id)
        return await driver.send(command(order_id=order), {"operation-id": f"order-{order}-rev-2"})

    async with case.worker(handler, max_deliveries=1, concurrency=16):
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
        # Service Bus keeps no dead-letter time: first and last failure come from the ledger.
        assert all(row["dead_lettered_at"] is None for row in listed)
        assert all(row["first_failure"] and row["first_failure"] <= row["last_failure"] for row in listed)
        table = await dlq(case, "list", queue, "--limit", "3")
        assert REASON in table and "ledger service down" not in table

        dry = await dlq(case, "redrive", queue, "--key", "order-7-rev-2", "--dry-run")
        assert "would redrive 1, kept 49, failed 0" in dry
        assert len(json.loads(await dlq(case, "list", queue, "--json"))) == 50  # nothing moved
        assert {m.delivery_count for m in dead_letter_queue.messages} == {0}  # nor locked or counted

        moved = await dlq(case, "redrive", queue, "--reason", "max_deliveries_exceeded")
        assert "redrove 50, kept 0, failed 0" in moved
        redriven = await case.reports_until(terminal(50), timeout=60)

    outcomes = {int(r.operation_key.split("-")[1]): r.outcome for r in redriven if r.operation_key}
    assert len(outcomes) == 50
    assert {o for n, o in outcomes.items() if n <= 20} == {Outcome.DUPLICATE}
    assert {o for n, o in outcomes.items() if n > 20} == {Outcome.EXECUTED}
    assert all(r.delivery_count == 1 and not r.redelivered for r in redriven)
    assert await case.rows("SELECT count(*), count(DISTINCT order_id) FROM invoices") == [(50, 50)]
    assert json.loads(await dlq(case, "list", queue, "--json")) == []
    assert await driver.depth() == 0


async def test_a_missing_queue_and_a_subscription_redrive_are_user_errors(
    sb_server: ServiceBusTestServer, unique_name: str,
) -> None:
    missing = await asyncio.to_thread(run_dlq, sb_server, ["list", f"{unique_name}.nope"])
    assert missing.exit_code == 2, missing.output
    assert f"no Service Bus queue or subscription '{unique_name}.nope'" in missing.output
    assert "Traceback" not in missing.output

    sb_server.create_topic(unique_name)
    sb_server.create_subscription(unique_name, "ledger")
    refused = await asyncio.to_thread(run_dlq, sb_server, ["redrive", f"{unique_name}/Subscriptions/ledger", "--all"])
    assert refused.exit_code == 2, refused.output
    assert "is a topic subscription" in refused.output and "Traceback" not in refused.output


# -- Service Bus's own ---------------------------------------------------------------------------


@pytest.fixture
def dead(sb: SBEnv) -> ServiceBusDeadLetters:
    return sb.dead_letter_reader(receive_wait=0.3)


def letter_message(message_id: str, session_id: str | None = None) -> ServiceBusMessage:
    """A command as a producer sends it, with operation properties."""
    return ServiceBusMessage(
        json.dumps({"id": message_id}).encode(), message_id=message_id, session_id=session_id,
        application_properties={"operation-id": f"op-{message_id}", "message-type": "CreateInvoice"},
    )


def properties(snapshot: MessageSnapshot) -> dict[str, Any]:
    """A held message's application properties with text names and values."""
    def text(value: Any) -> Any:
        return value.decode() if isinstance(value, bytes) else value
    return {text(k): text(v) for k, v in snapshot.application_properties.items()}


async def test_a_redriven_copy_keeps_its_session_and_operation_and_drops_the_dead_letter_marks(
    sb: SBEnv, dead: ServiceBusDeadLetters, monkeypatch: pytest.MonkeyPatch,
) -> None:
    queue = sb.create_queue(requires_session=True)
    dlq = queue.dead_letter_queue
    assert dlq is not None
    await sb.send(letter_message("m-1", "order-7"))
    # A retry copy as the adapter sends it: a new id, the original's and the deliveries before it.
    await sb.send(ServiceBusMessage(
        b'{"id": "m-2"}', message_id=str(uuid.uuid4()), session_id="order-7",
        application_properties=own.seal({"operation-id": "op-m-2", "x-consumer-kit-message-id": "m-2",
                                         "x-consumer-kit-deliveries": 2, "x-consumer-kit-redelivered": 1},
                                        b'{"id": "m-2"}'),  # signed, as the adapter signs a copy
    ))
    await sb.receive_and_dead_letter(2, reason=REASON, description=DETAIL, session_id="order-7")

    letters = {d.message_id: d for d in await dead.peek(sb.queue)}
    assert set(letters) == {"m-1", "m-2"}
    first, copy = letters["m-1"], letters["m-2"]
    assert (first.reason, first.detail, first.delivery_count, first.operation_key) == (REASON, DETAIL, 1, "op-m-1")
    assert copy.delivery_count == 3 and copy.operation_key == "op-m-2"  # 2 before the copy + this one
    assert first.enqueued_at is not None and first.dead_lettered_at is None and first.queue == sb.queue
    assert first.body == b'{"id": "m-1"}' and first.headers["DeadLetterReason"] == REASON
    assert await dead.count(sb.queue) == 2
    assert (dlq.locked_count, {m.delivery_count for m in dlq.messages}) == (0, {0})  # a peek locks nothing

    monkeypatch.setattr(dead_letters, "COUNT_LIMIT", 1)
    assert await dead.count(sb.queue) == 1  # the count stops at its bound

    report = await dead.redrive(sb.queue, lambda d: True)
    assert (report.redriven, report.kept, report.failed) == (2, 0, 0)
    assert dlq.messages == []
    back = {properties(m)["x-consumer-kit-message-id"]: m for m in queue.messages}
    assert set(back) == {"m-1", "m-2"}
    for original, sent in back.items():
        carried = properties(sent)
        assert sent.session_id == "order-7" and sent.delivery_count == 0
        assert sent.body == json.dumps({"id": original}).encode()
        assert carried["operation-id"] == f"op-{original}" and carried["x-consumer-kit-redriven"] == REASON
        assert not {"DeadLetterReason", "DeadLetterErrorDescription", "x-consumer-kit-deliveries",
                    "x-consumer-kit-redelivered"} & set(carried)
        assert sent.message_id not in (None, original)  # duplicate detection must not drop it
    assert properties(back["m-1"])["message-type"] == "CreateInvoice"


async def test_a_message_service_bus_moved_itself_is_listed_with_its_reason(
    sb: SBEnv, dead: ServiceBusDeadLetters,
) -> None:
    sb.create_queue(max_delivery_count=2)
    await sb.send(letter_message("m-1"))
    async with asyncio.timeout(SDK_CALL_TIMEOUT), sb.receiver(sb.queue) as receiver:
        for _ in range(2):  # two deliveries abandoned: Service Bus moves it
            (message,) = await receiver.receive_messages(max_wait_time=2)
            await receiver.abandon_message(message)
    (letter,) = await dead.peek(sb.queue)
    assert (letter.message_id, letter.reason, letter.delivery_count) == ("m-1", "broker:MaxDeliveryCountExceeded", 2)
    assert letter.operation_key == "op-m-1"


async def test_kept_and_late_dead_letters_stay_and_a_chosen_one_never_received_fails(
    sb: SBEnv, dead: ServiceBusDeadLetters,
) -> None:
    queue = sb.create_queue()
    dlq = queue.dead_letter_queue
    assert dlq is not None
    for name in ("a", "b", "c"):
        await sb.send(letter_message(name))
    await sb.receive_and_dead_letter(3, reason=REASON, description=DETAIL)
    await sb.send(letter_message("late"))
    # A plain synchronous client: progress runs on the event loop and cannot await.
    producer = SyncClient.from_connection_string(sb.server.connection_string, retry_total=0)

    def progress(letter: DeadLetter, moved: bool) -> None:  # "late" fails while the redrive runs
        if letter.message_id == "b":
            with producer.get_queue_receiver(sb.queue, max_wait_time=5) as receiver:
                (message,) = receiver.receive_messages(max_wait_time=5)
                receiver.dead_letter_message(message, reason=REASON, error_description=DETAIL)

    try:
        async with asyncio.timeout(SDK_CALL_TIMEOUT), sb.receiver(
            sb.queue, sub_queue=ServiceBusSubQueue.DEAD_LETTER, prefetch=0,  # nothing locked in its buffer
        ) as other:
            messages: list[Any] = []
            while len(messages) < 3:
                messages += await other.receive_messages(max_message_count=3 - len(messages), max_wait_time=2)
            locked = next(m for m in messages if m.message_id == "c")  # another receiver holds "c"
            for message in messages:
                if message is not locked:
                    await other.abandon_message(message)
            async with asyncio.timeout(20):
                report = await dead.redrive(sb.queue, lambda d: d.message_id in ("b", "c"), progress=progress)
            await other.abandon_message(locked)
    finally:
        producer.close()
    assert (report.redriven, report.kept, report.failed) == (1, 1, 1)
    assert [properties(m)["x-consumer-kit-message-id"] for m in queue.messages] == ["b"]  # the copy of "b"
    left = {m.message_id: m for m in dlq.messages}
    assert set(left) == {"a", "c", "late"} and dlq.locked_count == 0  # held ones were given back
    assert left["a"].delivery_count == 2  # abandoned by the other receiver, then held and given back
    assert left["late"].delivery_count == 1  # arrived during the redrive: held, given back, not moved
    again = await dead.redrive(sb.queue, lambda d: d.message_id == "late")
    assert (again.redriven, again.kept, again.failed) == (1, 2, 0)


async def test_a_copy_that_no_longer_fits_is_left_in_the_dead_letter_queue(
    sb: SBEnv, dead: ServiceBusDeadLetters,
) -> None:
    queue = sb.create_queue()
    await sb.send(ServiceBusMessage(b"x" * 4000, message_id="big", application_properties={"operation-id": "op-big"}))
    await sb.receive_and_dead_letter(1, reason=REASON, description=DETAIL)
    queue.configure(max_message_size=2000)  # the queue's limit shrank meanwhile
    report = await dead.redrive(sb.queue, lambda d: True)
    assert (report.redriven, report.kept, report.failed) == (0, 0, 1)
    assert queue.messages == []
    assert [m.message_id for m in queue.dead_letters] == ["big"]
    assert queue.dead_letter_queue is not None and queue.dead_letter_queue.locked_count == 0


async def test_subscriptions_are_listed_and_counted_but_never_redriven(
    sb: SBEnv, dead: ServiceBusDeadLetters, unique_name: str,
) -> None:
    sb.server.create_topic(unique_name)
    first = sb.server.create_subscription(unique_name, "ledger")
    second = sb.server.create_subscription(unique_name, "audit")
    await sb.send(letter_message("m-1"), entity=unique_name)
    path = f"{unique_name}/Subscriptions/ledger"
    await sb.receive_and_dead_letter(1, path, reason=REASON, description=DETAIL)

    (letter,) = await dead.peek(path)
    assert (letter.message_id, letter.reason, letter.queue) == ("m-1", REASON, path)
    assert await dead.count(path) == 1 and await dead.peek(f"{unique_name}/Subscriptions/audit") == []
    for dry_run in (True, False):
        with pytest.raises(ConfigurationError, match="is a topic subscription"):
            await dead.redrive(path, lambda d: True, dry_run=dry_run)
    assert [m.message_id for m in first.dead_letters] == ["m-1"] and first.messages == []
    assert [m.message_id for m in second.messages] == ["m-1"]  # the other subscription's own copy only
