"""The tenant a deployment can trust: ``Delivery.sender`` is the broker-authenticated
producer (RabbitMQ's validated ``user_id``, SQS's ``SenderId``, the memory broker's test value), and
``Handler.tenant_senders`` allows each sender only its tenants. A producer claiming another tenant
is dead-lettered at once as ``invalid_header`` naming ``tenant-id``: never executed, no ledger row,
so the genuine tenant's message with the same key still executes (without the allow-list it would
meet the forger's fingerprint: ``payload_conflict``)."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping
from typing import Any, ClassVar

import aio_pika
import aiormq
import pytest
from pydantic import BaseModel

from consumer_kit import App, ConfigurationError, Context, Handler, Outcome, Result, RetryableError
from consumer_kit.adapters.memory import MemoryBroker, MemoryConsumer
from consumer_kit.adapters.rabbitmq import RabbitMQDelivery, RabbitMQPublisher
from consumer_kit.adapters.rabbitmq.envelope import SENDER_HEADER, sender_of, user_of_url
from consumer_kit.adapters.sqs import SQSDelivery
from consumer_kit.codec import headers as own
from tests.adapters.contract.test_relayed_age import relayed
from tests.adapters.rabbitmq.test_adapter import Inbox, cleanup, consuming, raw_channel, send, wait_for  # noqa: F401 - fixture
from tests.adapters.sqs.test_adapter import consuming as sqs_consuming
from tests.adapters.sqs.test_adapter import make_queue, sqs  # noqa: F401 - fixture
from tests.fixtures.harness import fetch_all, runtime_for, throwaway_schema
from tests.fixtures.moto_server import sqs_endpoint  # noqa: F401 - fixture

QUEUE = "tenancy.commands"


class Order(BaseModel):
    amount: int


class AllowListedHandler(Handler[Order]):
    """Tenant from ``tenant-id``, checked against the sender; fails the first call of a key once
    when ``fail_first`` (so a retry copy has to carry the sender)."""

    operation_type = "order.place"
    tenant_senders: ClassVar[Mapping[str, set[str]] | None] = {
        "acme-producer": {"acme"}, "guest": {"acme"}, "ops": {"*"},
    }
    calls: ClassVar[list[tuple[str, int]]] = []
    fail_first: ClassVar[bool] = False

    async def handle(self, message: Order, ctx: Context) -> Result:
        AllowListedHandler.calls.append((ctx.operation.tenant, message.amount))
        if AllowListedHandler.fail_first and len(AllowListedHandler.calls) == 1:
            raise RetryableError("first call fails")
        return Result("placed")


class OpenHandler(AllowListedHandler):
    tenant_senders = None  # the default: the header is believed


def body(amount: int) -> bytes:
    return json.dumps({"amount": amount}).encode()


async def run_memory(broker: MemoryBroker, runtime: Any) -> list[Any]:
    reports: list[Any] = []

    async def on_delivery(delivery: Any) -> None:
        reports.append(await runtime.process(delivery))

    consumer = MemoryConsumer(broker)
    await consumer.subscribe(QUEUE, on_delivery, prefetch=1)
    await broker.wait_idle(30)
    await consumer.close()
    return reports


def test_an_allow_list_must_map_senders_to_sets_of_tenants() -> None:
    class Bare(AllowListedHandler):
        tenant_senders: ClassVar[Any] = {"acme-producer": "acme"}  # the mistake refused

    class Empty(AllowListedHandler):
        tenant_senders: ClassVar[Any] = {"": {"acme"}}

    for handler in (Bare, Empty):
        with pytest.raises(ConfigurationError, match="tenant_senders"):
            handler()


@pytest.mark.postgres
async def test_without_an_allow_list_a_forger_takes_the_genuine_tenants_key(database_url: str) -> None:
    """The default, as the README's "Trust" states it: the header is whatever the producer wrote."""
    AllowListedHandler.calls.clear()
    app = App("tenancy")
    app.subscribe(QUEUE, OpenHandler())
    async with throwaway_schema(database_url) as schema, runtime_for(app, database_url, schema) as rt:
        broker = MemoryBroker()
        broker.send(QUEUE, body(1), headers={"operation-id": "o-1", "tenant-id": "acme"}, sender="mallory")
        broker.send(QUEUE, body(500), headers={"operation-id": "o-1", "tenant-id": "acme"}, sender="acme-producer")
        reports = await run_memory(broker, rt)
    assert [r.outcome for r in reports] == [Outcome.EXECUTED, Outcome.PAYLOAD_CONFLICT]
    assert AllowListedHandler.calls == [("acme", 1)]


@pytest.mark.postgres
async def test_a_sender_claiming_another_tenant_is_refused_and_the_genuine_message_executes(
    database_url: str,
) -> None:
    AllowListedHandler.calls.clear()
    app = App("tenancy")
    app.subscribe(QUEUE, AllowListedHandler())
    headers = {"operation-id": "o-1", "tenant-id": "acme"}
    async with throwaway_schema(database_url) as schema, runtime_for(app, database_url, schema) as rt:
        broker = MemoryBroker()
        broker.send(QUEUE, body(1), headers=headers, sender="mallory")  # another producer
        broker.send(QUEUE, body(2), headers=headers)  # no authenticated sender at all
        forged = await run_memory(broker, rt)
        rows_after_forgery = await fetch_all(database_url, schema, "SELECT count(*) FROM operations")
        attempts = await fetch_all(database_url, schema, "SELECT count(*) FROM attempts")
        broker.send(QUEUE, body(500), headers=headers, sender="acme-producer")
        broker.send(QUEUE, body(7), headers={"operation-id": "o-2", "tenant-id": "globex"}, sender="ops")
        genuine = await run_memory(broker, rt)
        rows = await fetch_all(database_url, schema, "SELECT scope, key FROM operations ORDER BY scope")
    assert [r.outcome for r in forged] == [Outcome.INVALID, Outcome.INVALID]
    first, second = broker.dead_letters(QUEUE)
    assert first.reason == second.reason == "invalid_header"
    assert "tenant-id 'acme' is not allowed for sender 'mallory'" in first.detail, first.detail
    assert "tenant-id 'acme' is not allowed for no authenticated sender" in second.detail, second.detail
    assert rows_after_forgery == [(0,)] and attempts == [(0,)]  # the key is still free
    assert [r.outcome for r in genuine] == [Outcome.EXECUTED, Outcome.EXECUTED]  # "*": any tenant
    assert AllowListedHandler.calls == [("acme", 500), ("globex", 7)]
    assert rows == [("acme/order.place/v1", "o-1"), ("globex/order.place/v1", "o-2")]


@pytest.mark.postgres
async def test_a_tenant_derived_from_the_sender_needs_no_header(database_url: str) -> None:
    class SenderIsTenant(AllowListedHandler):
        tenant_senders = None

        def tenant(self, message: Order, envelope: Any) -> str:
            return {"acme-producer": "acme"}.get(envelope.sender or "", "unknown")

    AllowListedHandler.calls.clear()
    app = App("tenancy")
    app.subscribe(QUEUE, SenderIsTenant())
    async with throwaway_schema(database_url) as schema, runtime_for(app, database_url, schema) as rt:
        broker = MemoryBroker()
        broker.send(QUEUE, body(3), headers={"operation-id": "o-1", "tenant-id": "globex"}, sender="acme-producer")
        (report,) = await run_memory(broker, rt)
    assert report.outcome is Outcome.EXECUTED and AllowListedHandler.calls == [("acme", 3)]


# -- RabbitMQ: the validated user_id ----------------------------------------------------------------


def test_a_signed_sender_mark_is_believed_whoever_published_the_copy() -> None:
    """The headers are the codec's verified ones: a sender mark there was signed by consumer-kit
    (a producer's unsigned one is dropped before), on the worker's copy or an operator's redrive."""
    assert sender_of("worker", {SENDER_HEADER: "acme-producer"}) == "acme-producer"
    assert sender_of("ops", {SENDER_HEADER: "acme-producer"}) == "acme-producer"  # a redrive
    assert sender_of("worker", {}) == "worker"
    assert sender_of(None, {}) is None
    assert sender_of("worker", {SENDER_HEADER: "x" * 256}) == "worker"  # not a user id: the copy's own
    assert sender_of("worker", {SENDER_HEADER: ""}) is None  # a copy of an anonymous message
    forged = own.read({SENDER_HEADER: "acme-producer"}, b"{}").headers  # unsigned: dropped by the codec
    assert sender_of("mallory", forged) == "mallory"


@pytest.mark.rabbitmq
async def test_rabbitmq_sender_is_the_validated_user_id_and_a_foreign_one_is_refused_by_the_broker(
    rabbitmq_url: str, unique_name: str, cleanup: list[str],  # noqa: F811 - the fixture above
) -> None:
    inbox = Inbox()
    async with consuming(rabbitmq_url, unique_name, inbox, prefetch=4):
        async with raw_channel(rabbitmq_url) as channel:  # connected as guest
            await channel.default_exchange.publish(
                aio_pika.Message(b"{}", message_id="as-guest", user_id="guest"), routing_key=unique_name)
            await channel.default_exchange.publish(
                aio_pika.Message(b"{}", message_id="anonymous", headers={SENDER_HEADER: "acme-producer"}),
                routing_key=unique_name,
            )
        # "Validated User-ID": a user_id that is not the connection's user is refused, the channel closed
        with pytest.raises(aiormq.exceptions.ChannelPreconditionFailed, match="user_id"):
            async with raw_channel(rabbitmq_url) as channel:
                await channel.default_exchange.publish(
                    aio_pika.Message(b"{}", message_id="forged", user_id="acme-producer"), routing_key=unique_name)
        as_guest = await inbox.next()
        anonymous = await inbox.next()
        assert isinstance(as_guest, RabbitMQDelivery)
        assert (as_guest.message_id, as_guest.sender) == ("as-guest", "guest")
        assert (anonymous.message_id, anonymous.sender) == ("anonymous", None)  # the header is not believed
        await as_guest.retry(0)  # a copy the worker publishes: its user_id is the worker's own
        copy = await inbox.next()
        assert (copy.message_id, copy.sender, copy.delivery_count) == ("as-guest", "guest", 2)
        await anonymous.retry(0)
        anonymous_copy = await inbox.next()
        assert anonymous_copy.sender is None and anonymous_copy.headers[SENDER_HEADER] == ""
        await copy.ack()
        await anonymous_copy.ack()
        with pytest.raises(TimeoutError):  # the forged publish never reached the queue
            await inbox.next(timeout=0.5)


@pytest.mark.rabbitmq
@pytest.mark.postgres
async def test_rabbitmq_relay_publishes_carry_the_relays_user_so_an_allow_list_can_admit_it(
    rabbitmq_url: str, database_url: str, unique_name: str, cleanup: list[str],  # noqa: F811 - the fixture above
) -> None:
    """The relay's publisher sends its connection's own user as ``user_id`` (RabbitMQ validates
    it): a relayed event is the relay user's, which the handler's ``tenant_senders`` allows
    (``guest``: ``acme``); the same command published without a user is refused."""
    AllowListedHandler.calls.clear()
    app = App("tenancy")
    app.subscribe(unique_name, AllowListedHandler())
    publisher = RabbitMQPublisher(rabbitmq_url)
    try:
        async with throwaway_schema(database_url) as schema, runtime_for(app, database_url, schema) as rt:
            reports: list[Any] = []
            senders: list[str | None] = []

            async def judge(delivery: Any) -> None:
                senders.append(delivery.sender)
                await _record(reports, rt, delivery)

            async with consuming(rabbitmq_url, unique_name, Inbox(judge)):
                await publisher.publish(relayed(unique_name, body(7), {"operation-id": "o-relayed", "tenant-id": "acme"},
                                                created_at=dt.datetime.now(dt.UTC), message_type="Order"))
                await wait_for(lambda: _count_at_least(reports, 1), "the relayed event")
                async with raw_channel(rabbitmq_url) as channel:
                    await channel.default_exchange.publish(aio_pika.Message(
                        body(8), message_id="m-anonymous", headers={"operation-id": "o-anon", "tenant-id": "acme"},
                    ), routing_key=unique_name)
                await wait_for(lambda: _count_at_least(reports, 2), "the anonymous one")
    finally:
        await publisher.close()
    assert senders == [user_of_url(rabbitmq_url), None]
    assert [r.outcome for r in reports] == [Outcome.EXECUTED, Outcome.INVALID]
    assert AllowListedHandler.calls == [("acme", 7)]


@pytest.mark.rabbitmq
@pytest.mark.postgres
async def test_rabbitmq_worker_refuses_a_message_without_the_allowed_user_and_retries_keep_the_sender(
    rabbitmq_url: str, database_url: str, unique_name: str, cleanup: list[str],  # noqa: F811
) -> None:
    AllowListedHandler.calls.clear()
    AllowListedHandler.fail_first = True
    app = App("tenancy")
    app.subscribe(unique_name, AllowListedHandler())
    headers = {"operation-id": "o-1", "tenant-id": "acme"}
    try:
        async with throwaway_schema(database_url) as schema, runtime_for(
            app, database_url, schema, retry_delays=[0.0]
        ) as rt:
            reports: list[Any] = []
            inbox = Inbox(lambda delivery: _record(reports, rt, delivery))
            async with consuming(rabbitmq_url, unique_name, inbox):
                async with raw_channel(rabbitmq_url) as channel:
                    await channel.default_exchange.publish(
                        aio_pika.Message(body(1), message_id="m-1", headers=headers), routing_key=unique_name)
                    await channel.default_exchange.publish(
                        aio_pika.Message(body(500), message_id="m-2", headers=headers, user_id="guest"),
                        routing_key=unique_name,
                    )
                # refused, retried (handler fault), executed from the retry copy
                await wait_for(lambda: _count_at_least(reports, 3), "three reports")
            rows = await fetch_all(database_url, schema, "SELECT key, state FROM operations")
    finally:
        AllowListedHandler.fail_first = False
    assert [r.outcome for r in reports] == [Outcome.INVALID, Outcome.RETRIED, Outcome.EXECUTED]
    assert AllowListedHandler.calls == [("acme", 500), ("acme", 500)]
    assert rows == [("o-1", "completed")]


async def _count_at_least(reports: list[Any], count: int) -> bool:
    return len(reports) >= count


async def _record(reports: list[Any], runtime: Any, delivery: Any) -> None:
    reports.append(await runtime.process(delivery))


# -- SQS: SenderId -------------------------------------------------------------------------------


async def test_sqs_sender_is_the_sender_id_sqs_returns(
    sqs_endpoint: str, sqs: Any, unique_name: str,  # noqa: F811 - the fixtures above
) -> None:
    url = await make_queue(sqs, unique_name)
    await sqs.call("send_message", QueueUrl=url, MessageBody="{}", MessageAttributes={
        SENDER_HEADER: {"DataType": "String", "StringValue": "acme-producer"},  # not believed: no such mark
    })
    inbox = Inbox()
    async with sqs_consuming(sqs_endpoint, unique_name, inbox):
        delivery = await inbox.next()
        assert isinstance(delivery, SQSDelivery)
        # moto answers SenderId with its fixed DEFAULT_SENDER_ID (a real SQS: the IAM user/role id)
        assert delivery.sender is not None and delivery.sender.isalnum(), delivery.sender
        first_sender = delivery.sender
        await delivery.retry(0)  # a copy the worker sends: SQS attributes it to the worker
        again = await inbox.next()
        assert again.sender == first_sender
        await again.ack()


@pytest.mark.postgres
async def test_sqs_worker_allows_a_sender_id_its_tenants_only_and_a_retry_copy_keeps_running(
    sqs_endpoint: str, sqs: Any, database_url: str, unique_name: str,  # noqa: F811 - the fixtures above
) -> None:
    """moto gives every message the same SenderId (its DEFAULT_SENDER_ID): the test allows that
    sender tenant ``acme`` only; the retry copy the worker sends comes back with the same SenderId."""
    from moto.sqs.models import DEFAULT_SENDER_ID

    class MotoSenders(AllowListedHandler):
        tenant_senders: ClassVar[Any] = {DEFAULT_SENDER_ID: {"acme"}}

    AllowListedHandler.calls.clear()
    AllowListedHandler.fail_first = True
    app = App("tenancy")
    app.subscribe(unique_name, MotoSenders())
    url = await make_queue(sqs, unique_name)
    for amount, tenant in ((1, "globex"), (500, "acme")):
        await sqs.call("send_message", QueueUrl=url, MessageBody=body(amount).decode(), MessageAttributes={
            "operation-id": {"DataType": "String", "StringValue": f"o-{tenant}"},
            "tenant-id": {"DataType": "String", "StringValue": tenant},
        })
    try:
        async with throwaway_schema(database_url) as schema, runtime_for(
            app, database_url, schema, retry_delays=[0.0]
        ) as rt:
            reports: list[Any] = []
            inbox = Inbox(lambda delivery: _record(reports, rt, delivery))
            async with sqs_consuming(sqs_endpoint, unique_name, inbox, prefetch=1):
                await wait_for(lambda: _count_at_least(reports, 3), "three reports", timeout=30)
            rows = await fetch_all(database_url, schema, "SELECT scope, key, state FROM operations")
    finally:
        AllowListedHandler.fail_first = False
    outcomes = sorted(r.outcome.value for r in reports)
    assert outcomes == ["executed", "invalid", "retried"]
    (refused,) = [r for r in reports if r.outcome is Outcome.INVALID]
    assert refused.reason == "invalid_header" and refused.operation_key is None  # refused at decoding
    assert AllowListedHandler.calls == [("acme", 500), ("acme", 500)]
    assert rows == [("acme/order.place/v1", "o-acme", "completed")]


async def test_sqs_copies_of_a_message_from_sender_a_are_still_judged_as_as(
    sqs_endpoint: str, sqs: Any, unique_name: str,  # noqa: F811 - the fixtures above
) -> None:
    """SQS attributes a copy to whoever sends it: the worker. The original's sender travels as the
    signed mark ``x-consumer-kit-sender``, so a retry copy and a release copy of A's message stay
    A's. (moto gives every message one SenderId, the worker's copies included: A here is the
    sender a signed mark names, as on a copy consumer-kit made of A's message.)"""
    url = await make_queue(sqs, unique_name)
    marked = own.seal({"x-consumer-kit-sender": "acme-producer"}, b"{}")
    await sqs.call("send_message", QueueUrl=url, MessageBody="{}", MessageAttributes={
        name: {"DataType": "String", "StringValue": value} for name, value in marked.items()
    })
    inbox = Inbox()
    async with sqs_consuming(sqs_endpoint, unique_name, inbox):
        delivery = await inbox.next()
        assert delivery.sender == "acme-producer"
        await delivery.retry(0)
        retried = await inbox.next()
        assert (retried.sender, retried.delivery_count) == ("acme-producer", 2)
        await retried.release()
        released = await inbox.next()
        assert released.sender == "acme-producer"
        await released.ack()
