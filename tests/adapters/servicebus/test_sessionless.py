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

from consumer_kit.errors import PublishError
from tests.adapters.servicebus.server.fixtures import SBEnv, outgoing_event


async def test_refused_by_service_bus_it_is_a_permanent_error_and_the_rest_of_the_batch_goes(
    sb: SBEnv,
) -> None:
    queue = sb.create_queue(requires_session=True, sessionless_sends="refuse")
    keyed, keyless = outgoing_event(1, sb.queue, partition_key="customer-1"), outgoing_event(2, sb.queue)
    publisher = sb.publisher()
    outcomes = await asyncio.gather(*(publisher.publish(e) for e in (keyed, keyless)), return_exceptions=True)
    assert outcomes[0] is None
    refused = outcomes[1]
    assert isinstance(refused, PublishError) and refused.permanent and keyless.message_id in str(refused)
    assert [m.message_id for m in queue.messages] == [keyed.message_id] and queue.dead_letters == []


async def test_dead_lettered_by_service_bus_it_is_listed_with_its_reason(sb: SBEnv) -> None:
    queue = sb.create_queue(requires_session=True, sessionless_sends="dead-letter")
    keyless = outgoing_event(1, sb.queue)
    await sb.publisher().publish(keyless)  # accepted: the relay counts it published
    assert queue.messages == []
    [dead] = await sb.dead_letter_reader(call_timeout=10).peek(sb.queue)
    assert (dead.message_id, dead.reason) == (keyless.message_id, "broker:Session id is null")


@pytest.mark.parametrize("sessionless_sends", ["refuse", "dead-letter"])
async def test_a_publisher_told_the_session_queues_refuses_it_before_sending(
    sb: SBEnv, sessionless_sends: str
) -> None:
    queue = sb.create_queue(requires_session=True, sessionless_sends=sessionless_sends)
    publisher = sb.publisher(session_entities=[sb.queue.upper()])  # names are case-insensitive
    with pytest.raises(PublishError, match="no partition key") as refused:
        await publisher.publish(outgoing_event(1, sb.queue))
    assert refused.value.permanent
    await publisher.publish(outgoing_event(2, sb.queue, partition_key="customer-2"))
    assert [m.session_id for m in queue.messages] == ["customer-2"] and queue.dead_letters == []
