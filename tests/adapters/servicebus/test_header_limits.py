"""Service Bus's header limits, through the real azure-servicebus SDK against the test server.

Microsoft's *Service Bus quotas*, "Message property size for a queue, topic, or subscription
entity": each property at most 32 KB; all properties, user and system, at most 64 KB (the whole
header). The test server enforces both on sends and on dead-letter requests (whose reason and
description become properties), with ``MessageSizeExceededError`` (the AMQP condition Azure uses
there is not documented). The adapter keeps within them: the publisher refuses an event whose
headers break them before sending; a dead-letter's description is cut to the header's room.
"""

from __future__ import annotations

import asyncio

import pytest
from azure.servicebus import ServiceBusMessage
from azure.servicebus.exceptions import MessageSizeExceededError

from consumer_kit.adapters.servicebus.envelope import DEAD_LETTER_DESCRIPTION_MAX_CHARS
from consumer_kit.errors import PublishError
from tests.adapters.servicebus.server.fixtures import (
    SDK_CALL_TIMEOUT,
    Received,
    SBEnv,
    eventually,
    outgoing_event,
)

KB = 1024


async def test_a_send_over_a_header_limit_is_refused_and_one_within_them_is_taken(sb: SBEnv) -> None:
    queue = sb.create_queue(lock_duration=30)
    with pytest.raises(MessageSizeExceededError):  # one property over 32 KB
        await sb.send(ServiceBusMessage(b"x", application_properties={"big": "v" * (33 * KB)}))
    with pytest.raises(MessageSizeExceededError):  # three under 32 KB each, over 64 KB together
        await sb.send(
            ServiceBusMessage(b"x", application_properties={f"p{n}": "v" * (22 * KB) for n in range(3)})
        )
    await sb.send(ServiceBusMessage(b"x", message_id="ok", application_properties={"big": "v" * (31 * KB)}))
    assert [m.message_id for m in queue.messages] == ["ok"]


async def test_a_dead_letter_is_limited_by_the_header_not_by_the_message_size(sb: SBEnv) -> None:
    """A message near its size limit takes a long description (the quotas tie the dead-letter
    properties to the header, not to the message's size); a message whose own properties nearly
    fill the header does not, and stays locked."""
    queue = sb.create_queue(lock_duration=30, max_message_size=64 * KB)
    await sb.send(ServiceBusMessage(b"x" * (63 * KB), message_id="big-body"))
    full = {"a": "v" * (30 * KB), "b": "v" * (30 * KB)}
    await sb.send(ServiceBusMessage(b"x", message_id="full-header", application_properties=full))
    async with asyncio.timeout(SDK_CALL_TIMEOUT), sb.receiver(sb.queue, prefetch=2) as receiver:
        big_body, full_header = await receiver.receive_messages(max_message_count=2, max_wait_time=5)
        await receiver.dead_letter_message(big_body, reason="invalid", error_description="d" * 4000)
        with pytest.raises(MessageSizeExceededError):
            await receiver.dead_letter_message(full_header, reason="invalid", error_description="d" * 8000)
        assert [m.message_id for m in queue.messages if m.locked] == ["full-header"]
        await receiver.complete_message(full_header)
    [dead] = queue.dead_letters
    assert (dead.message_id, dead.dead_letter_error_description) == ("big-body", "d" * 4000)
    assert dead.size > 64 * KB  # over the message size limit, which does not apply here


@pytest.mark.parametrize("on_subscription", [False, True], ids=["queue", "subscription"])
async def test_the_adapter_cuts_a_dead_letter_description_to_the_room_the_header_leaves(
    sb: SBEnv, on_subscription: bool
) -> None:
    """A message whose own properties leave about 3 KB of header: the reason is kept whole, the
    description (4096 characters) is cut to fit, and Service Bus takes the dead-letter at once."""
    properties = {"a": "v" * (30 * KB), "b": "v" * (30 * KB)}
    if on_subscription:
        entity = sb.create_subscription("audit", lock_duration=30)
        path, send_to = entity.path, sb.topic
    else:
        entity = sb.create_queue(lock_duration=30)
        path, send_to = sb.queue, sb.queue
    await sb.send(ServiceBusMessage(b"{}", message_id="m", application_properties=properties), entity=send_to)
    reason, detail = "invalid_json", "why: " + "w" * DEAD_LETTER_DESCRIPTION_MAX_CHARS
    received = Received(lambda d: d.dead_letter(reason, detail))
    consumer = await sb.subscribe(received, path, prefetch=1)
    delivery = await received.next()
    await eventually(lambda: len(entity.dead_letters) == 1, within=5, what="the dead letter")
    [dead] = entity.dead_letters
    description = dead.dead_letter_error_description or ""
    assert dead.dead_letter_reason == reason
    assert description.startswith("why: ") and 1000 < len(description) < DEAD_LETTER_DESCRIPTION_MAX_CHARS
    await eventually(lambda: consumer.counters["dead_lettered"] == 1, within=5, what="the settlement's end")
    assert delivery.lost is False


async def test_the_publisher_refuses_an_event_whose_headers_break_a_limit_naming_it(sb: SBEnv) -> None:
    queue = sb.create_queue()
    publisher = sb.publisher()
    too_long = outgoing_event(1, sb.queue, headers={"note": "n" * (33 * KB)})
    too_many = outgoing_event(2, sb.queue, headers={f"h{n}": "n" * (20 * KB) for n in range(4)})
    fine = outgoing_event(3, sb.queue, headers={"note": "n" * (20 * KB)})
    outcomes = await asyncio.gather(
        *(publisher.publish(e) for e in (too_long, too_many, fine)), return_exceptions=True
    )
    long_error, many_error, ok = outcomes
    assert ok is None
    assert isinstance(long_error, PublishError) and long_error.permanent
    assert "'note'" in str(long_error) and "32768-byte" in str(long_error) and "nnnn" not in str(long_error)
    assert isinstance(many_error, PublishError) and many_error.permanent
    assert "65536-byte header limit" in str(many_error) and too_many.message_id in str(many_error)
    assert [m.message_id for m in queue.messages] == [fine.message_id]
