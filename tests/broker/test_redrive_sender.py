"""A redrive keeps the original authenticated sender, whoever runs it (docs/explanation/trust.md):
a letter the worker dead-lettered carries the signed ``x-consumer-kit-sender`` of the message it
copies, and one a producer published straight into ``<queue>.dlq`` earns no more than its own
broker sender. So ``tenant_senders`` refuses the redriven copy of a refused message even when the
operator's broker user may act for every tenant; a redrive without the deployment's mark key is
refused (its copies would lose the sender)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar
from urllib.parse import urlsplit, urlunsplit

import aio_pika
import pytest

from consumer_kit import App, ConfigurationError, Outcome
from consumer_kit.adapters.rabbitmq import RabbitMQDeadLetters
from consumer_kit.adapters.sqs import SQSConfig, SQSDeadLetters
from consumer_kit.codec import headers as own
from consumer_kit.codec import marks
from consumer_kit.ops.operator_actions import Selection, redrive_dead_letters
from tests.adapters.rabbitmq.test_adapter import Inbox, cleanup, consuming, raw_channel, wait_for  # noqa: F401 - fixture
from tests.adapters.sqs.test_adapter import make_queue, sqs  # noqa: F401 - fixture
from tests.conftest import rabbitmqctl, vhost_of
from tests.fixtures.harness import runtime_for, throwaway_schema
from tests.fixtures.moto_server import sqs_endpoint, sqs_url  # noqa: F401 - fixture
from tests.test_tenancy import AllowListedHandler, body


@pytest.fixture
def operator_url(rabbitmq_url: str) -> Iterator[tuple[str, str]]:
    """A broker user of its own for the operator (``rabbitmqctl add_user``), allowed everything on
    the test's vhost: ``(its URL, its name)``; deleted at the end."""
    name = "ck-ops-" + uuid.uuid4().hex[:8]
    rabbitmqctl("add_user", name, "secret")
    rabbitmqctl("set_permissions", "-p", vhost_of(rabbitmq_url), name, ".*", ".*", ".*")
    parts = urlsplit(rabbitmq_url)
    try:
        yield urlunsplit(parts._replace(netloc=f"{name}:secret@{parts.hostname}:{parts.port or 5672}")), name
    finally:
        rabbitmqctl("delete_user", name, check=False)


@pytest.mark.rabbitmq
@pytest.mark.postgres
async def test_rabbitmq_a_redriven_copy_is_judged_as_the_original_sender_not_the_operator(
    rabbitmq_url: str, database_url: str, unique_name: str, cleanup: list[str],  # noqa: F811
    operator_url: tuple[str, str],
) -> None:
    ops_url, ops_user = operator_url

    class Guarded(AllowListedHandler):
        # guest (the producer and the worker here) may act for acme; the operator for everyone
        tenant_senders: ClassVar[Mapping[str, set[str]] | None] = {"guest": {"acme"}, ops_user: {"*"}}

    AllowListedHandler.calls.clear()
    app = App("tenancy")
    app.subscribe(unique_name, Guarded())
    globex = {"tenant-id": "globex"}
    async with throwaway_schema(database_url) as schema, runtime_for(app, database_url, schema) as rt:
        reports: list[Any] = []

        async def record(delivery: Any) -> None:
            reports.append(await rt.process(delivery))

        async with consuming(rabbitmq_url, unique_name, Inbox(record)):
            async with raw_channel(rabbitmq_url) as channel:  # the producer, as guest
                await channel.default_exchange.publish(aio_pika.Message(
                    body(1), message_id="m-1", user_id="guest", headers={**globex, "operation-id": "o-1"},
                ), routing_key=unique_name)
                await wait_for(lambda: _at_least(reports, 1), "the refusal")
                # a letter the producer writes straight into the dead-letter queue, with a forged
                # sender mark and reason: it never passed a worker
                await channel.default_exchange.publish(aio_pika.Message(body(2), message_id="m-2", headers={
                    **globex, "operation-id": "o-2", own.SENDER: ops_user, own.DEAD_LETTER_REASON: "invalid_header",
                }), routing_key=f"{unique_name}.dlq")
            dead = RabbitMQDeadLetters(ops_url)
            try:
                report = await dead.redrive(unique_name, lambda letter: True)
            finally:
                await dead.close()
            assert report.redriven == 2
            await wait_for(lambda: _at_least(reports, 3), "both redriven copies")
    assert [r.outcome for r in reports] == [Outcome.INVALID] * 3
    assert AllowListedHandler.calls == []


async def _at_least(reports: list[Any], count: int) -> bool:
    return len(reports) >= count


async def test_sqs_a_redriven_copy_carries_the_letters_sender(
    sqs_endpoint: str, sqs: Any, unique_name: str,  # noqa: F811 - the fixtures above
) -> None:
    """SQS: a redriven copy is sent by the operator; it carries, signed, the sender of the message
    the worker dead-lettered (its mark), and for a letter without one the letter's own SenderId."""
    url = await make_queue(sqs, unique_name)
    dlq_url = (await sqs.call("get_queue_url", QueueName=unique_name + "-dlq"))["QueueUrl"]
    marked = own.seal({own.SENDER: "acme-producer", own.ORIGINAL_QUEUE: unique_name}, b"{}")
    await sqs.call("send_message", QueueUrl=dlq_url, MessageBody="{}", MessageAttributes={
        name: {"DataType": "String", "StringValue": value} for name, value in marked.items()
    })
    await sqs.call("send_message", QueueUrl=dlq_url, MessageBody="[]", MessageAttributes={
        own.SENDER: {"DataType": "String", "StringValue": "forged"},  # unsigned: dropped
    })
    dead = SQSDeadLetters(SQSConfig.from_url(sqs_url(sqs_endpoint)))
    try:
        report = await dead.redrive(unique_name, lambda letter: True)
    finally:
        await dead.close()
    assert report.redriven == 2
    got = await sqs.call("receive_message", QueueUrl=url, MaxNumberOfMessages=10, MessageAttributeNames=["All"],
                         MessageSystemAttributeNames=["SenderId"], WaitTimeSeconds=1)
    senders = {}
    for message in got["Messages"]:
        attributes = {k: v["StringValue"] for k, v in message.get("MessageAttributes", {}).items()}
        verified = own.read(attributes, message["Body"].encode()).headers
        senders[message["Body"]] = verified.get(own.SENDER)
    assert senders == {"{}": "acme-producer", "[]": message["Attributes"]["SenderId"]}


async def test_a_redrive_without_the_deployments_mark_key_is_refused() -> None:
    saved = marks.installed()
    marks.install(b"k" * 32, source="process")
    try:
        with pytest.raises(ConfigurationError, match="mark key"):
            await redrive_dead_letters(_NoLetters(), "q", Selection(everything=True))
        outcome = await redrive_dead_letters(_NoLetters(), "q", Selection(everything=True), dry_run=True)
        assert outcome.report.redriven == 0
    finally:
        marks.install(saved.current, saved.previous, source=saved.source)


class _NoLetters:
    async def redrive(self, queue: str, select: Any, **kwargs: Any) -> Any:
        from consumer_kit.broker import RedriveReport

        return RedriveReport()

