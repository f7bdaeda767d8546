"""The SQS adapter against a local SQS endpoint (moto in server mode, ``tests/adapters/contract/moto_server``).

The contract suite (``tests/adapters/contract``) covers what every broker must do; this module covers what
is SQS's own: FIFO group order and lanes, redelivered detection on both sides, broker duplicates,
stale receipt handles, per-entry batch failures, the 12-hour cap, attribute packing and the
relay's FIFO publishing. moto never duplicates a message nor refuses an old receipt handle:
those replies are injected into the adapter's client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import psycopg
import pytest

from consumer_kit import OutboxWriter, Settings
from consumer_kit.adapters.sqs import (
    SQSClient,
    SQSConfig,
    SQSConsumer,
    SQSDelivery,
    SQSPublisher,
    attributes_for,
    headers_of,
    sqs_queue_name,
)
from consumer_kit.adapters.sqs.config import MAX_VISIBILITY_SECONDS
from consumer_kit.adapters.sqs.envelope import MAX_ATTRIBUTES, PACKED_ATTRIBUTE
from consumer_kit.adapters.sqs.errors import describe, entry_publish_error
from consumer_kit.adapters.sqs.limits import size_of
from consumer_kit.adapters.sqs.redelivery import MAX_ENTRIES
from consumer_kit.adapters.sqs.topology import QueueInfo
from consumer_kit.broker import Delivery, Settlement, ack_all
from consumer_kit.broker.kit.give_backs import GiveBacks
from consumer_kit.broker.publishing import OutgoingMessage
from consumer_kit.errors import ConfigurationError
from consumer_kit.outbox_relay.relay import relay_pending
from tests.adapters.rabbitmq.test_adapter import Inbox  # collects deliveries; next() waits, bounded
from tests.fixtures.harness import throwaway_schema
from tests.fixtures.moto_server import sqs_endpoint, sqs_url  # noqa: F401 - fixture
from tests.fixtures.tcp_proxy import TcpProxy

WAIT = 15.0  # seconds: upper bound for anything that should happen "soon"


# -- helpers -----------------------------------------------------------------------------------


@pytest.fixture
async def sqs(sqs_endpoint: str) -> AsyncIterator[SQSClient]:  # noqa: F811 - the fixture above
    client = SQSClient(SQSConfig.from_url(sqs_url(sqs_endpoint)), threads=4, pollers=0)
    yield client
    await client.close()


async def make_queue(client: SQSClient, name: str, **attributes: str) -> str:
    """A queue and its ``-dlq`` (FIFO for a ``.fifo`` name); returns the queue URL."""
    fifo = {"FifoQueue": "true"} if name.endswith(".fifo") else {}
    dlq_name = name.replace(".fifo", "") + "-dlq" + (".fifo" if fifo else "")
    await client.call("create_queue", QueueName=dlq_name, Attributes=fifo)
    reply = await client.call("create_queue", QueueName=name, Attributes={**fifo, **attributes})
    return str(reply["QueueUrl"])


async def depth(client: SQSClient, url: str) -> int:
    reply = await client.call(
        "get_queue_attributes", QueueUrl=url,
        AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible",
                        "ApproximateNumberOfMessagesDelayed"],
    )
    return sum(int(v) for v in reply["Attributes"].values())


@asynccontextmanager
async def consuming(endpoint: str, queue: str, inbox: Inbox, *, prefetch: int = 10,
                    **options: object) -> AsyncIterator[SQSConsumer]:
    consumer = SQSConsumer(SQSConfig.from_url(sqs_url(endpoint, **options)), settle_timeout=5.0)
    await consumer.subscribe(queue, inbox, prefetch=prefetch)
    try:
        yield consumer
    finally:
        await consumer.close()


async def send(client: SQSClient, url: str, body: str = "{}", **params: Any) -> str:
    reply = await client.call("send_message", QueueUrl=url, MessageBody=body, **params)
    return str(reply["MessageId"])


def intercept(client: SQSClient, operation: str, change: Callable[[dict[str, Any], dict[str, Any]], Awaitable[dict[str, Any]]]) -> None:
    """Route ``client``'s calls of ``operation`` (``receive_message`` covers ``poll``) through
    ``change(params, reply_of_the_real_call)``."""
    original_call, original_poll = client.call, client.poll

    async def call(op: str, **params: Any) -> dict[str, Any]:
        reply = await original_call(op, **params)
        return await change(params, reply) if op == operation else reply

    async def poll(**params: Any) -> dict[str, Any]:
        reply = await original_poll(**params)
        return await change(params, reply) if operation == "receive_message" else reply

    client.call = call  # type: ignore[method-assign]
    client.poll = poll  # type: ignore[method-assign]


# -- pure parts ----------------------------------------------------------------------------------


def test_sqs_urls_carry_options_and_never_credentials() -> None:
    config = SQSConfig.from_url("sqs://localhost:9324/000000000000?region=elasticmq&tls=false&wait=2&visibility=30")
    assert (config.endpoint_url, config.region, config.account_id) == ("http://localhost:9324", "elasticmq", "000000000000")
    assert (config.wait_seconds, config.visibility_timeout, config.heartbeat) == (2, 30, True)
    assert SQSConfig.from_url("sqs://?region=eu-west-1").endpoint_url is None
    with pytest.raises(ConfigurationError) as refused:
        SQSConfig.from_url("sqs://AKIAEXAMPLE:s3cret@localhost:9324")
    assert "s3cret" not in str(refused.value) and "AKIAEXAMPLE" not in str(refused.value)
    for bad in ("sqs://h?wait=21", "sqs://h?visibility=0", "sqs://h?visibility=43201", "sqs://h?colour=red"):
        with pytest.raises(ConfigurationError):
            SQSConfig.from_url(bad)


def test_queue_names_become_sqs_names() -> None:
    assert sqs_queue_name("invoices.commands") == "invoices-commands"
    assert sqs_queue_name("orders.fifo") == "orders.fifo"
    assert sqs_queue_name("billing.events.v2.fifo") == "billing-events-v2.fifo"
    with pytest.raises(ConfigurationError):
        sqs_queue_name("x" * 81)


def test_more_headers_than_sqs_attributes_travel_packed_and_come_back() -> None:
    headers = {f"h{i}": f"v{i}" for i in range(12)}
    headers.update({"operation-id": "op-1", "tenant-id": "t", "bad name!": "x", "empty": ""})
    attributes = attributes_for(headers)
    assert len(attributes) == MAX_ATTRIBUTES and PACKED_ATTRIBUTE in attributes
    assert {"operation-id", "tenant-id"} <= set(attributes)  # the operation's headers stay separate
    assert headers_of(attributes) == headers
    assert attributes_for({"a": "1"}) == {"a": {"DataType": "String", "StringValue": "1"}}
    assert size_of("{}", {"ab": {"DataType": "String", "StringValue": "xyz"}}) == 2 + 2 + 6 + 3


def test_give_backs_tell_our_own_from_a_crash() -> None:
    book: GiveBacks[tuple[str, str]] = GiveBacks(MAX_ENTRIES, keep_for=MAX_VISIBILITY_SECONDS)
    judge = book.judge
    assert judge(("q", "m"), 1) == (1, False)
    assert judge(("q", "m"), 2) == (2, True)  # unexplained
    book.remember(("q", "m"), 2, uncounted=False, suspect=False)  # a retry
    assert judge(("q", "m"), 3) == (3, False)
    book.remember(("q", "m"), 3, uncounted=True, suspect=False)  # a release
    assert judge(("q", "m"), 4) == (3, False)
    book.remember(("q", "m"), 4, uncounted=True, suspect=True)  # a suspect released
    assert judge(("q", "m"), 5) == (3, True)
    earlier = book.remember(("q", "m"), 5, uncounted=False, suspect=False)
    # someone else received it in between (and died): the count is not the one expected
    assert judge(("q", "m"), 7)[1] is True
    assert judge(("q", "copy"), 1, earlier=4, copied_suspect=True) == (5, True)
    book.remember(("q", "m"), 7, uncounted=True, suspect=False)
    book.forget(("q", "m"), earlier)  # SQS refused that give-back: back to what was known before
    assert judge(("q", "m"), 8) == (6, True)  # two uncounted releases, and no give-back to explain 8


def test_per_entry_publish_failures_map_to_publish_error_kinds() -> None:
    sender = entry_publish_error({"Code": "InvalidParameterValue", "SenderFault": True, "Message": "m"}, "e", "q")
    assert sender.permanent
    ours = entry_publish_error({"Code": "InternalError", "SenderFault": False}, "e", "q")
    assert ours.transient and not ours.permanent
    throttled = entry_publish_error({"Code": "RequestThrottled", "SenderFault": True}, "e", "q")
    assert throttled.transient
    missing = entry_publish_error({"Code": "AWS.SimpleQueueService.NonExistentQueue", "SenderFault": True}, "e", "q")
    assert not missing.transient and not missing.permanent


def test_missing_credentials_say_where_they_come_from() -> None:
    from botocore.exceptions import NoCredentialsError

    text = describe(NoCredentialsError())
    assert "AWS_ACCESS_KEY_ID" in text and "a local server such as moto or ElasticMQ accepts any" in text


# -- against moto ----------------------------------------------------------------------------------


async def test_fifo_groups_keep_their_order_and_run_in_parallel(sqs: SQSClient, sqs_endpoint: str) -> None:  # noqa: F811
    name = f"t{uuid.uuid4().hex[:10]}.fifo"
    url = await make_queue(sqs, name)
    running: dict[str, int] = {"A": 0, "B": 0}
    overlap_within_group = False
    overlap_across_groups = False
    handled: list[tuple[str, int, int]] = []  # (group, seq, delivery_count)
    retried_once: set[int] = set()
    # Each group's first message waits (bounded) until the other group's is running: the overlap
    # across groups is then a fact of parallel lanes, not of a 50 ms sleep on a loaded machine.
    first_running = {"A": asyncio.Event(), "B": asyncio.Event()}

    async def work(delivery: Delivery) -> None:
        nonlocal overlap_within_group, overlap_across_groups
        group, seq = delivery.partition_key or "", int(json.loads(delivery.body)["seq"])
        running[group] += 1
        overlap_within_group |= running[group] > 1
        if seq == 0:
            first_running[group].set()
            other = first_running["B" if group == "A" else "A"]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(other.wait(), WAIT)
        overlap_across_groups |= all(running.values())
        running[group] -= 1
        if group == "A" and seq == 1 and seq not in retried_once:
            retried_once.add(seq)
            await delivery.retry(0)  # A2.. must wait for A1 to come back first
            return
        handled.append((group, seq, delivery.delivery_count))
        await delivery.ack()

    for seq in range(4):
        for group in ("A", "B"):
            await send(sqs, url, json.dumps({"seq": seq}), MessageGroupId=group,
                       MessageDeduplicationId=f"{group}-{seq}")
    async with consuming(sqs_endpoint, name, Inbox(work)):
        async with asyncio.timeout(WAIT * 2):
            while len(handled) < 8:
                await asyncio.sleep(0.05)
    for group in ("A", "B"):
        assert [seq for g, seq, _ in handled if g == group] == [0, 1, 2, 3]
    assert not overlap_within_group and overlap_across_groups
    assert ("A", 1, 2) in handled  # the retried message, counted, came back before A2
    assert await depth(sqs, url) == 0


async def test_fifo_give_backs_are_no_redelivery_but_a_lapsed_lock_is(sqs: SQSClient, sqs_endpoint: str) -> None:  # noqa: F811
    name = f"t{uuid.uuid4().hex[:10]}.fifo"
    url = await make_queue(sqs, name)
    await send(sqs, url, MessageGroupId="g", MessageDeduplicationId="one")
    inbox = Inbox()
    # a visibility long enough that our give-backs never race its lapse on a loaded machine
    async with consuming(sqs_endpoint, name, inbox, visibility=30, heartbeat="off"):
        first = await inbox.next()
        assert (first.delivery_count, first.redelivered) == (1, False)
        await first.retry(0)  # our own give-back: counted, not a redelivery
        second = await inbox.next()
        assert (second.delivery_count, second.redelivered) == (2, False)
        # nobody settles it: its visibility lapses, as after a crash (made explicit on both
        # clocks, the adapter's and SQS's, instead of waited for)
        second.locked_until = time.monotonic()
        await sqs.call("change_message_visibility", QueueUrl=url,
                       ReceiptHandle=second.receipt_handles[-1], VisibilityTimeout=0)
        third = await inbox.next()
        assert (third.delivery_count, third.redelivered) == (3, True)
        await third.release()  # a suspect released stays a suspect, uncounted
        fourth = await inbox.next()
        assert (fourth.delivery_count, fourth.redelivered) == (3, True)
        await fourth.ack()
        assert not fourth.lost and not second.lost
    assert await depth(sqs, url) == 0


async def test_a_give_back_whose_redelivery_arrives_before_its_reply_is_still_our_own(
    sqs: SQSClient, sqs_endpoint: str,  # noqa: F811
) -> None:
    # What a loaded machine did to the test above: SQS applied retry(0)'s visibility change, the
    # poller received the message again, and only then did the change's reply come back. Here the
    # reply is held until the next delivery has been handed over, every time.
    name = f"t{uuid.uuid4().hex[:10]}.fifo"
    url = await make_queue(sqs, name)
    await send(sqs, url, MessageGroupId="g", MessageDeduplicationId="one")
    handed_over: list[Delivery] = []
    again = asyncio.Event()

    async def note(delivery: Delivery) -> None:
        handed_over.append(delivery)
        if len(handed_over) == 2:
            again.set()

    inbox = Inbox(note)
    async with consuming(sqs_endpoint, name, inbox, visibility=30, heartbeat="off") as consumer:
        async def reply_after_the_redelivery(params: dict[str, Any], reply: dict[str, Any]) -> dict[str, Any]:
            await asyncio.wait_for(again.wait(), WAIT)
            return reply

        first = await inbox.next()
        intercept(consumer.client, "change_message_visibility", reply_after_the_redelivery)
        await first.retry(0)
        second = await inbox.next()
        assert (second.delivery_count, second.redelivered) == (2, False)
        assert not first.lost
        await second.ack()
    assert await depth(sqs, url) == 0


async def test_a_give_back_whose_reply_outlives_the_settle_timeout_is_still_our_own(
    sqs: SQSClient, sqs_endpoint: str,  # noqa: F811
) -> None:
    # The race left behind the flaky FIFO give-back test: on a loaded machine the reply of
    # retry(0)'s ChangeMessageVisibility came after the settle timeout. SQS had applied the change,
    # but the adapter forgot the give-back on the timeout, so the next receive (count 2) was judged
    # a redelivery: (2, True). An unknown outcome is no refusal: the give-back stays remembered.
    name = f"t{uuid.uuid4().hex[:10]}.fifo"
    url = await make_queue(sqs, name)
    await send(sqs, url, MessageGroupId="g", MessageDeduplicationId="one")
    retried = asyncio.Event()
    inbox = Inbox()
    consumer = SQSConsumer(SQSConfig.from_url(sqs_url(sqs_endpoint, visibility=30, heartbeat="off")),
                           settle_timeout=1.0)
    await consumer.subscribe(name, inbox, prefetch=10)
    try:
        first = await inbox.next()

        async def reply_after_the_timeout(params: dict[str, Any], reply: dict[str, Any]) -> dict[str, Any]:
            await asyncio.sleep(WAIT)  # cancelled by the settle timeout: the reply never arrives
            return reply

        async def receive_after_the_retry(params: dict[str, Any], reply: dict[str, Any]) -> dict[str, Any]:
            if reply.get("Messages"):
                await asyncio.wait_for(retried.wait(), WAIT)  # judged only once retry() is over
            return reply

        intercept(consumer.client, "change_message_visibility", reply_after_the_timeout)
        intercept(consumer.client, "receive_message", receive_after_the_retry)
        await first.retry(0)
        retried.set()
        assert first.lost  # the settlement's outcome is unknown to the worker
        second = await inbox.next()
        assert (second.delivery_count, second.redelivered) == (2, False)
        await second.ack()
    finally:
        await consumer.close()
    assert await depth(sqs, url) == 0


async def test_the_same_message_twice_in_one_receive_runs_once(sqs: SQSClient, sqs_endpoint: str) -> None:  # noqa: F811
    name = f"t{uuid.uuid4().hex[:10]}"
    url = await make_queue(sqs, name)
    inbox = Inbox()
    async with consuming(sqs_endpoint, name, inbox) as consumer:
        async def twice(params: dict[str, Any], reply: dict[str, Any]) -> dict[str, Any]:
            messages = reply.get("Messages", [])
            if messages:  # as SQS may do on a standard queue: the same message, another handle
                again = dict(messages[0], ReceiptHandle=messages[0]["ReceiptHandle"] + "-again")
                reply = {**reply, "Messages": [*messages, again]}
            return reply

        intercept(consumer.client, "receive_message", twice)
        message_id = await send(sqs, url)
        delivery = await inbox.next()
        assert delivery.message_id == message_id
        await delivery.ack()
        assert not delivery.lost
        with pytest.raises(TimeoutError):
            await inbox.next(timeout=1.5)  # never handed out a second time
        assert consumer.duplicates_absorbed == 1
    assert await depth(sqs, url) == 0


async def test_a_batch_of_acks_is_one_delete_message_batch(sqs: SQSClient, sqs_endpoint: str) -> None:  # noqa: F811
    name = f"t{uuid.uuid4().hex[:10]}"
    url = await make_queue(sqs, name)
    inbox = Inbox()
    async with consuming(sqs_endpoint, name, inbox) as consumer:
        for _ in range(10):
            await send(sqs, url)
        held = [await inbox.next() for _ in range(10)]
        await ack_all(held)
        assert all(d.settlement is Settlement.ACK and not d.lost for d in held)
        assert consumer.client.calls["delete_message_batch"] == 1  # SQS's limit: 10 entries a call
        assert consumer.settler.deletes == 10
    assert await depth(sqs, url) == 0


async def test_a_stale_receipt_handle_on_delete_is_counted_and_logged_once(
    sqs: SQSClient, sqs_endpoint: str, caplog: pytest.LogCaptureFixture,  # noqa: F811
) -> None:
    name = f"t{uuid.uuid4().hex[:10]}"
    url = await make_queue(sqs, name)
    inbox = Inbox()
    async with consuming(sqs_endpoint, name, inbox) as consumer:
        async def stale(params: dict[str, Any], reply: dict[str, Any]) -> dict[str, Any]:
            # moto refuses an unknown handle with ReceiptHandleIsInvalid, as SQS does a stale one
            return {**reply, "Messages": [dict(m, ReceiptHandle="stale-handle") for m in reply.get("Messages", [])]}

        intercept(consumer.client, "receive_message", stale)
        await send(sqs, url)
        delivery = await inbox.next()
        with caplog.at_level(logging.WARNING, logger="consumer_kit.adapters.sqs"):
            await delivery.ack()
        assert delivery.lost
        assert consumer.settler.stale_receipts == 1
        assert consumer.client.calls["delete_message_batch"] == 1  # refused once, never looped
        assert sum("receipt handle no longer valid" in r.getMessage() for r in caplog.records) == 1


async def test_a_delete_entry_sqs_failed_on_its_side_is_retried(sqs: SQSClient, sqs_endpoint: str) -> None:  # noqa: F811
    name = f"t{uuid.uuid4().hex[:10]}"
    url = await make_queue(sqs, name)
    inbox = Inbox()
    async with consuming(sqs_endpoint, name, inbox) as consumer:
        for _ in range(3):
            await send(sqs, url)
        deliveries = [await inbox.next() for _ in range(3)]
        failed_once: list[str] = []
        real_call = consumer.client.call

        async def flaky(operation: str, **params: Any) -> dict[str, Any]:
            if operation == "delete_message_batch" and not failed_once:
                first, *rest = params["Entries"]
                failed_once.append(first["ReceiptHandle"])
                reply = await real_call(operation, **{**params, "Entries": rest}) if rest else {"Successful": []}
                failure = {"Id": first["Id"], "SenderFault": False, "Code": "InternalError", "Message": "try again"}
                return {**reply, "Failed": [*reply.get("Failed", []), failure]}
            return await real_call(operation, **params)

        consumer.client.call = flaky  # type: ignore[method-assign]
        await asyncio.gather(*(d.ack() for d in deliveries))
        assert not any(d.lost for d in deliveries)
        assert consumer.settler.delete_retries == 1 and consumer.settler.deletes == 3
    assert await depth(sqs, url) == 0


HANDED_BACK_VISIBILITY = 30  # seconds: the lapse is made explicit on SQS's clock below. A short
# visibility waited out was load-dependent: the redelivery got the same short lock, counted from
# the poll's send (up to the 1 s long-poll wait earlier), so its ack could come too late on a
# loaded machine (a sibling of the flaky FIFO give-back test)


async def lapse_on_sqs(sqs: SQSClient, url: str, delivery: Delivery) -> None:
    """What the end of the visibility timeout does, now: SQS may hand the message out again."""
    assert isinstance(delivery, SQSDelivery)
    await sqs.call("change_message_visibility", QueueUrl=url,
                   ReceiptHandle=delivery.receipt_handles[-1], VisibilityTimeout=0)


def hand_back_first(handed_back: list[Delivery]) -> Inbox:
    """An inbox whose callback returns without settling the first delivery, as the runtime does
    after a crash point (``SimulatedCrash``: process death), and acks every later one."""

    async def crash_once(delivery: Delivery) -> None:
        if not handed_back:
            handed_back.append(delivery)
            return
        await delivery.ack()

    return Inbox(crash_once)


async def test_a_delivery_handed_back_unsettled_lapses_and_comes_back_while_the_worker_lives(
    sqs: SQSClient, sqs_endpoint: str,  # noqa: F811
) -> None:
    """As after a crash: the heartbeat no longer extends it, so its visibility lapses and SQS
    hands it out again, counted and marked redelivered, to the same live consumer (memory and
    Service Bus stop renewing the same way). Nothing was given back for it, so the receive count
    is judged a redelivery."""
    name = f"t{uuid.uuid4().hex[:10]}"
    url = await make_queue(sqs, name)
    handed_back: list[Delivery] = []
    inbox = hand_back_first(handed_back)
    async with consuming(sqs_endpoint, name, inbox, visibility=HANDED_BACK_VISIBILITY) as consumer:
        await send(sqs, url)
        first = await inbox.next()
        subscription = consumer.subscription(name)
        async with asyncio.timeout(WAIT):
            while subscription.left_to_lapse < 1:
                await asyncio.sleep(0.02)
        assert first not in consumer.heartbeat.held()  # no longer extended: it will lapse
        await lapse_on_sqs(sqs, url, first)
        again = await inbox.next()
        assert (again.message_id, again.delivery_count, again.redelivered) == (first.message_id, 2, True)
        assert first.settlement is None and not first.lost
        assert first not in consumer.heartbeat.held() and first not in subscription.held.values()
        assert subscription.left_to_lapse == 1
    assert await depth(sqs, url) == 0


async def test_a_delivery_handed_back_unsettled_is_not_given_back_at_close(
    sqs: SQSClient, sqs_endpoint: str,  # noqa: F811
) -> None:
    """Closing the consumer gives back (uncounted, not suspect) only what never ran: a delivery
    handed back unsettled is left to lapse, so the next worker still sees the crash (counted,
    redelivered) instead of a fresh message."""
    name = f"t{uuid.uuid4().hex[:10]}"
    url = await make_queue(sqs, name)
    handed_back: list[Delivery] = []
    first_inbox = hand_back_first(handed_back)
    async with consuming(sqs_endpoint, name, first_inbox, visibility=HANDED_BACK_VISIBILITY):
        message_id = await send(sqs, url)
        await first_inbox.next()
    await lapse_on_sqs(sqs, url, handed_back[0])  # closing gave nothing back: it lapses as it is
    inbox = Inbox(lambda delivery: delivery.ack())
    async with consuming(sqs_endpoint, name, inbox, visibility=HANDED_BACK_VISIBILITY):
        again = await inbox.next()
    # the very message (a release would have sent a copy: another SQS message id, counted afresh)
    assert (again.message_id, again.delivery_count, again.redelivered) == (message_id, 2, True)
    assert await depth(sqs, url) == 0


async def test_renewal_asks_at_most_what_is_left_of_12_hours(sqs: SQSClient) -> None:
    url = await make_queue(sqs, f"t{uuid.uuid4().hex[:10]}")
    await send(sqs, url)
    reply = await sqs.call("receive_message", QueueUrl=url, MessageSystemAttributeNames=["All"])
    info = QueueInfo("q", url, "", False, 262_144, 30, None)
    consumer = SQSConsumer(SQSConfig.from_url("sqs://127.0.0.1:1?tls=false"), client=sqs)
    asked: list[int] = []

    async def record(params: dict[str, Any], reply: dict[str, Any]) -> dict[str, Any]:
        asked.append(params["VisibilityTimeout"])
        return reply

    intercept(sqs, "change_message_visibility", record)

    def delivery(held_for: float) -> SQSDelivery:
        return SQSDelivery(
            reply["Messages"][0], queue="q", info=info, dead_letters=info, settler=consumer.settler,
            requested_at=time.monotonic() - held_for, visibility=30, settle_timeout=5.0,
            renew=consumer.heartbeat.renew, on_settled=lambda d: None,
        )

    nearly = delivery(43_200 - 10)
    nearly.locked_until = time.monotonic() + 5  # still locked
    assert await nearly.renew_lock()
    assert len(asked) == 1 and 8 <= asked[0] <= 9  # 12 hours less what has passed, less 1 s
    spent = delivery(43_200)
    spent.locked_until = time.monotonic() + 5
    assert not await spent.renew_lock()
    assert len(asked) == 1  # nothing asked past the maximum


async def test_publishes_that_arrive_together_share_one_queue_lookup_and_one_batch(
    sqs: SQSClient, sqs_endpoint: str,  # noqa: F811
) -> None:
    # Each publish used to look its queue up on its own: the lookups' replies came back at
    # different moments, so on a loaded machine the publishes missed each other's batch.
    name = f"t{uuid.uuid4().hex[:10]}"
    await make_queue(sqs, name)
    publisher = SQSPublisher(SQSConfig.from_url(sqs_url(sqs_endpoint)))
    lookups: list[str] = []

    async def count(params: dict[str, Any], reply: dict[str, Any]) -> dict[str, Any]:
        lookups.append(params["QueueName"])
        return reply

    intercept(publisher.client, "get_queue_url", count)
    try:
        await asyncio.gather(*(
            publisher.publish(OutgoingMessage("", name, str(uuid.uuid4()), b"{}", "Ping")) for _ in range(5)
        ))
        assert lookups == [name]
        assert publisher.batches == 1
    finally:
        await publisher.close()


async def test_the_relay_publishes_to_fifo_with_event_ids_as_deduplication_ids(
    sqs: SQSClient, sqs_endpoint: str, database_url: str,  # noqa: F811
) -> None:
    name = f"t{uuid.uuid4().hex[:10]}.fifo"
    url = await make_queue(sqs, name)
    headers = {f"x-app-{i}": str(i) for i in range(12)}  # more than SQS's 10 attributes
    async with throwaway_schema(database_url, example_tables=False) as schema:
        writer = OutboxWriter(schema)
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            async with conn.transaction():
                event_ids = [
                    str(await writer.add(conn, destination=name, routing_key="invoice.created",
                                         message_type="InvoiceCreated", payload={"n": n},
                                         partition_key=f"customer-{n % 2}", headers=headers))
                    for n in range(4)
                ]
        settings = Settings(database_url=database_url, db_schema=schema, broker_url=sqs_url(sqs_endpoint))
        publisher = SQSPublisher(SQSConfig.from_url(settings.broker_url))
        try:
            assert await relay_pending(settings, publisher) == 4
            assert publisher.batches <= 2  # one SendMessageBatch per partition key in order
            for event_id in event_ids[:2]:  # a relay that publishes again within 5 minutes
                await publisher.publish(OutgoingMessage(name, "invoice.created", event_id, b"{}", "InvoiceCreated",
                                                        partition_key="customer-0"))
        finally:
            await publisher.close()
    received: list[dict[str, Any]] = []
    async with asyncio.timeout(WAIT):
        while len(received) < 4:
            reply = await sqs.call(
                "receive_message", QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=1,
                MessageAttributeNames=["All"],
                MessageSystemAttributeNames=["MessageDeduplicationId", "MessageGroupId"],
            )
            for raw in reply.get("Messages", []):
                received.append(raw)
                await sqs.call("delete_message", QueueUrl=url, ReceiptHandle=raw["ReceiptHandle"])
    assert sorted(r["Attributes"]["MessageDeduplicationId"] for r in received) == sorted(event_ids)
    by_event = {r["Attributes"]["MessageDeduplicationId"]: r for r in received}
    for n, event_id in enumerate(event_ids):
        assert by_event[event_id]["Attributes"]["MessageGroupId"] == f"customer-{n % 2}"
        carried = headers_of(by_event[event_id]["MessageAttributes"])
        assert carried["x-consumer-kit-message-id"] == carried["event-id"] == event_id
        assert carried["message-type"] == "InvoiceCreated" and carried["x-app-11"] == "11"
    assert await depth(sqs, url) == 0  # the two re-sends were deduplicated by SQS


ATTEMPT_ID = re.compile(rb'"ReceiveRequestAttemptId"\s*:\s*"([^"]+)"')


async def test_a_fifo_receive_whose_reply_is_lost_is_retried_with_the_same_attempt_id(
    sqs: SQSClient, sqs_endpoint: str,  # noqa: F811
) -> None:
    # AWS: a ReceiveMessage retried with the same ReceiveRequestAttemptId returns the messages the
    # lost reply held (moto ignores the id: what is checked here is what the adapter sends).
    name = f"t{uuid.uuid4().hex[:10]}.fifo"
    url = await make_queue(sqs, name)
    await send(sqs, url, MessageGroupId="g", MessageDeduplicationId="one")
    host, port = sqs_endpoint.split("://", 1)[1].split(":")
    proxy = TcpProxy(host, int(port))
    proxied = f"http://127.0.0.1:{await proxy.start()}"
    # botocore tries 3 times (standard mode); the 4th loss makes the poll fail, and the loop's
    # own retry must carry the id too
    proxy.lose_replies(b"AmazonSQS.ReceiveMessage", 4)
    inbox = Inbox(lambda delivery: delivery.ack())
    try:
        async with consuming(proxied, name, inbox, visibility=2) as consumer:
            await inbox.next(timeout=WAIT)  # the lost receive's message, once its visibility lapsed
            async with asyncio.timeout(WAIT):
                while consumer.receives < 1 or len(proxy.requests) < 6:
                    await asyncio.sleep(0.05)
    finally:
        await proxy.close()
    ids = [ATTEMPT_ID.search(bytes(request)) for request in proxy.requests]
    assert all(ids), "every FIFO receive carries ReceiveRequestAttemptId"
    values = [match.group(1) for match in ids if match]
    assert all(1 <= len(v) <= 128 for v in values)
    assert len(set(values[:5])) == 1  # 3 botocore tries + 1 of them lost again + the loop's retry
    assert len(set(values[4:])) == len(values[4:])  # after a receive answered: a new id each time
    assert await depth(sqs, url) == 0


async def test_a_standard_queue_receive_carries_no_attempt_id(sqs: SQSClient, sqs_endpoint: str) -> None:  # noqa: F811
    name = f"t{uuid.uuid4().hex[:10]}"
    await make_queue(sqs, name)
    host, port = sqs_endpoint.split("://", 1)[1].split(":")
    proxy = TcpProxy(host, int(port))
    proxied = f"http://127.0.0.1:{await proxy.start()}"
    proxy.lose_replies(b"AmazonSQS.ReceiveMessage", 0)  # only recorded
    try:
        async with consuming(proxied, name, Inbox()):
            async with asyncio.timeout(WAIT):
                while len(proxy.requests) < 1:
                    await asyncio.sleep(0.05)
    finally:
        await proxy.close()
    assert b"ReceiveMessage" in bytes(proxy.requests[0]) and not ATTEMPT_ID.search(bytes(proxy.requests[0]))
