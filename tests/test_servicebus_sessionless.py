"""An event without a partition key (no session id) published to a session queue.

What Azure does with it is not documented: the *Dead-letter queues* page lists the system reason
``Session id is null`` ("Session enabled entity doesn't allow a message whose session identifier
is null"), and SDK threads show such sends refused. The test server does either
(``EntityOptions.sessionless_sends``); the adapter is right both ways: refused, it is a permanent
``PublishError`` (never retried for ever); accepted and dead-lettered, ``consumer-kit dlq`` lists
it as Service Bus's own reason. A publisher told which queues require sessions
(``CONSUMER_KIT_SERVICEBUS_SESSION_ENTITIES``) refuses it before sending, whatever Azure would do.
"""

from __future__ import annotations

import asyncio

import pytest

from consumer_kit.adapters.servicebus import ServiceBusDeadLetters
from consumer_kit.publishing import OutgoingMessage, PublishError
from tests.servicebus_server.fixtures import (  # noqa: F401 - fixtures
    SBEnv,
    sb_fixture,
    sb_server_fixture,
)


def event(sb: SBEnv, n: int, partition_key: str | None) -> OutgoingMessage:
    return OutgoingMessage(
        destination=sb.queue,
        routing_key="invoice.created",
        message_id=f"00000000-0000-4000-8000-{n:012d}",
        body=b"{}",
        message_type="InvoiceCreated",
        partition_key=partition_key,
    )


async def test_refused_by_service_bus_it_is_a_permanent_error_and_the_rest_of_the_batch_goes(
    sb: SBEnv,
) -> None:
    queue = sb.create_queue(requires_session=True, sessionless_sends="refuse")
    keyed, keyless = event(sb, 1, "customer-1"), event(sb, 2, None)
    publisher = sb.publisher()
    outcomes = await asyncio.gather(*(publisher.publish(e) for e in (keyed, keyless)), return_exceptions=True)
    assert outcomes[0] is None
    refused = outcomes[1]
    assert isinstance(refused, PublishError) and refused.permanent and keyless.message_id in str(refused)
    assert [m.message_id for m in queue.messages] == [keyed.message_id] and queue.dead_letters == []


async def test_dead_lettered_by_service_bus_it_is_listed_with_its_reason(sb: SBEnv) -> None:
    queue = sb.create_queue(requires_session=True, sessionless_sends="dead-letter")
    keyless = event(sb, 1, None)
    await sb.publisher().publish(keyless)  # accepted: the relay counts it published
    assert queue.messages == []
    dead_letters = ServiceBusDeadLetters(sb.namespace, call_timeout=10)
    try:
        [dead] = await dead_letters.peek(sb.queue)
    finally:
        await dead_letters.close()
    assert (dead.message_id, dead.reason) == (keyless.message_id, "broker:Session id is null")


@pytest.mark.parametrize("sessionless_sends", ["refuse", "dead-letter"])
async def test_a_publisher_told_the_session_queues_refuses_it_before_sending(
    sb: SBEnv, sessionless_sends: str
) -> None:
    queue = sb.create_queue(requires_session=True, sessionless_sends=sessionless_sends)
    publisher = sb.publisher(session_entities=[sb.queue.upper()])  # names are case-insensitive
    with pytest.raises(PublishError, match="no partition key") as refused:
        await publisher.publish(event(sb, 1, None))
    assert refused.value.permanent
    await publisher.publish(event(sb, 2, "customer-2"))
    assert [m.session_id for m in queue.messages] == ["customer-2"] and queue.dead_letters == []
