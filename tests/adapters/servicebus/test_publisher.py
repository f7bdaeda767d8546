"""The relay's Service Bus publisher through the real azure-servicebus SDK against the local test
server: concurrent publishes leave as one ServiceBusMessageBatch, fields, size checks, PublishError
kinds, and a refused batch isolated message by message."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from consumer_kit.broker.publishing import OutgoingMessage
from consumer_kit.errors import PublishError
from tests.adapters.servicebus.server.fixtures import SBEnv, outgoing_event


def event(n: int, destination: str, **fields: Any) -> OutgoingMessage:
    """Event ``n`` with an operation key, a correlation id and a trace context."""
    return outgoing_event(
        n, destination, headers={"operation-key": f"order-{n}", "correlation-id": f"corr-{n}",
                                 "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
        **fields,
    )


async def test_concurrent_publishes_leave_as_one_batch_with_the_event_fields(sb: SBEnv) -> None:
    """A plain entity takes a batch of several partition keys (session ids) at once; a partitioned
    one refuses it, after which the publisher keeps to one key a batch
    (test_servicebus_partitions.py)."""
    ledger = sb.create_subscription("ledger")
    publisher = sb.publisher()
    events = [event(n, sb.topic, partition_key=f"customer-{n % 3}") for n in range(12)]
    await asyncio.gather(*(publisher.publish(e) for e in events))
    assert [batcher.batches_sent for batcher in publisher._batchers.values()] == [1]
    assert not any(batcher.keys_apart for batcher in publisher._batchers.values())
    stored = ledger.messages
    assert [m.message_id for m in stored] == [e.message_id for e in events]
    assert [m.session_id for m in stored] == [e.partition_key for e in events]
    first = stored[0].application_properties
    assert first["message-type"] == "InvoiceCreated"
    assert (first["operation-key"], first["traceparent"]) == ("order-0", events[0].headers["traceparent"])
    [received] = await sb.peek(ledger.path, 1)
    assert (received.subject, received.correlation_id, received.content_type) == (
        "invoice.created", "corr-0", "application/json",
    )


async def test_an_empty_destination_publishes_to_the_queue_named_by_the_routing_key(sb: SBEnv) -> None:
    queue = sb.create_queue()
    await sb.publisher().publish(event(1, "", routing_key=sb.queue))
    assert [m.message_id for m in queue.messages] == [event(1, "").message_id]


async def test_an_oversized_event_is_refused_permanently_naming_the_limit_and_the_rest_go(sb: SBEnv) -> None:
    limit = 4096
    queue = sb.create_queue(max_message_size=limit)
    publisher = sb.publisher()
    events = [event(1, sb.queue), event(2, sb.queue, body=b"x" * 6000), event(3, sb.queue)]
    outcomes = await asyncio.gather(*(publisher.publish(e) for e in events), return_exceptions=True)
    assert outcomes[0] is None and outcomes[2] is None
    refused = outcomes[1]
    assert isinstance(refused, PublishError) and refused.permanent
    assert f"{limit}-byte" in str(refused) and "6000 bytes" in str(refused)
    assert events[1].message_id in str(refused) and "xxxx" not in str(refused)  # ids, never payloads
    assert [m.message_id for m in queue.messages] == [events[0].message_id, events[2].message_id]


async def test_a_missing_entity_is_a_row_error(sb: SBEnv) -> None:
    with pytest.raises(PublishError) as refused:
        await sb.publisher().publish(event(1, "no-such-topic"))
    assert (refused.value.transient, refused.value.permanent) == (False, False)
    assert "no-such-topic" in str(refused.value)


async def test_a_refused_batch_is_sent_message_by_message_so_only_the_culprit_is_permanent(sb: SBEnv) -> None:
    """A session queue refuses an event without a session id: the culprit is permanent, the other
    goes through. (The two have different keys, so they no longer share a batch; a refused batch
    retried message by message: test_servicebus_partitions.py, partitioned with duplicate
    detection.)"""
    queue = sb.create_queue(requires_session=True)
    publisher = sb.publisher()
    good, bad = event(1, sb.queue, partition_key="customer-1"), event(2, sb.queue)
    outcomes = await asyncio.gather(publisher.publish(good), publisher.publish(bad), return_exceptions=True)
    assert outcomes[0] is None
    assert isinstance(outcomes[1], PublishError) and outcomes[1].permanent
    assert [m.message_id for m in queue.messages] == [good.message_id]


async def test_publishing_again_with_the_same_event_id_is_dropped_by_duplicate_detection(sb: SBEnv) -> None:
    queue = sb.create_queue(duplicate_detection_window=60)
    publisher = sb.publisher()
    await publisher.publish(event(1, sb.queue))
    await publisher.publish(event(1, sb.queue))  # the relay again after a crash between confirm and mark
    assert [m.message_id for m in queue.messages] == [event(1, sb.queue).message_id]
