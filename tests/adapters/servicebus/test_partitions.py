"""Partitioned entities and scheduled messages as Azure documents them, through the real
azure-servicebus SDK against the local test server, and the adapter holding on that behaviour:
``consumer-kit dlq`` counts and lists every partition, the publisher never mixes keys in a batch,
delayed retry copies are renumbered when they become active and never dropped as duplicates.

Sources (also in tests/adapters/servicebus/server/README.md): Microsoft's *Message sequencing and
timestamps* ("for partitioned entities, the topmost 16 bits reflect the partition identifier";
a scheduled message "is appended to the queue as if had been enqueued at the current instant,
which includes assigning a new SequenceNumber"), *Partitioned queues and topics* (use of partition
keys; a peek "returns the oldest message in one of the partitions whose message broker responded
first"), *Duplicate detection* ("Scheduled messages are included in duplicate detection"), and
Azure/azure-service-bus#103, azure-sdk-for-python#21955 for the batch rule.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging

import pytest
from azure.servicebus import ServiceBusMessage, ServiceBusReceiveMode
from azure.servicebus.exceptions import ServiceBusError

from consumer_kit.adapters.servicebus import ServiceBusDelivery, dead_letters
from consumer_kit.broker.publishing import OutgoingMessage
from tests.adapters.servicebus.server.fixtures import (
    SDK_CALL_TIMEOUT,
    Received,
    SBEnv,
    eventually,
    outgoing_event,
)

SHIFT = 48  # the partition id sits in a sequence number's topmost 16 bits


def partition(sequence_number: int) -> int:
    return sequence_number >> SHIFT


# -- the server: numbers, keys, the batch rule, peeks ---------------------------------------------


async def test_sequence_numbers_carry_the_partition_that_the_key_picks(sb: SBEnv) -> None:
    queue = sb.create_queue(enable_partitioning=True)
    await sb.send(*(ServiceBusMessage(b"a", partition_key="a") for _ in range(3)))
    await sb.send(*(ServiceBusMessage(b"s", session_id="s1") for _ in range(2)))
    for _ in range(4):  # keyless: one send each, spread over partitions in turn
        await sb.send(ServiceBusMessage(b"-"))
    numbers = {m.body: [] for m in queue.messages}
    for m in queue.messages:
        numbers[m.body].append(m.sequence_number)
    # One key, one partition, numbered from 1 within it (the low 48 bits)
    assert len({partition(n) for n in numbers[b"a"]}) == 1
    assert [n & ((1 << SHIFT) - 1) for n in sorted(numbers[b"a"])] == [1, 2, 3]
    assert len({partition(n) for n in numbers[b"s"]}) == 1
    assert len({partition(n) for n in numbers[b"-"]}) == 4
    assert all(0 <= partition(n) < 16 for ns in numbers.values() for n in ns)
    # The SDK reads the same 64-bit numbers
    peeked = await sb.peek(sb.queue, 1)
    assert peeked[0].sequence_number in {n for ns in numbers.values() for n in ns}


async def test_a_batch_mixing_keys_is_refused_whole_and_one_key_is_taken(sb: SBEnv) -> None:
    queue = sb.create_queue(enable_partitioning=True)
    with pytest.raises(ServiceBusError):
        await sb.send(ServiceBusMessage(b"1", session_id="a"), ServiceBusMessage(b"2", session_id="b"))
    with pytest.raises(ServiceBusError):
        await sb.send(ServiceBusMessage(b"1", partition_key="a"), ServiceBusMessage(b"2"))
    assert queue.messages == []
    await sb.send(ServiceBusMessage(b"1", session_id="a"), ServiceBusMessage(b"2", session_id="a"))
    await sb.send(
        ServiceBusMessage(b"3"), ServiceBusMessage(b"4")
    )  # keyless: Service Bus picks one partition
    assert sorted(m.body for m in queue.messages) == [b"1", b"2", b"3", b"4"]


async def test_with_duplicate_detection_a_batch_of_distinct_message_ids_is_refused(sb: SBEnv) -> None:
    queue = sb.create_queue(enable_partitioning=True, duplicate_detection_window=60)
    with pytest.raises(ServiceBusError, match="distinct SessionId, PartitionKey, or MessageId"):
        await sb.send(ServiceBusMessage(b"1", message_id="m1"), ServiceBusMessage(b"2", message_id="m2"))
    await sb.send(ServiceBusMessage(b"1", message_id="m1"))
    await sb.send(ServiceBusMessage(b"1", message_id="m1"))  # a repeat: dropped (MessageId+PartitionKey)
    assert [m.message_id for m in queue.messages] == ["m1"]


async def test_a_peek_answers_with_one_partition_so_jumping_past_the_highest_skips(sb: SBEnv) -> None:
    """What the adapter must not do: browse by "highest sequence number seen plus one"."""
    queue = sb.create_queue(enable_partitioning=True)
    for key in "abcdef":
        await sb.send(ServiceBusMessage(key.encode(), partition_key=key))
    start, seen = 1, []
    async with asyncio.timeout(SDK_CALL_TIMEOUT), sb.receiver(sb.queue) as receiver:
        while page := await receiver.peek_messages(max_message_count=10, sequence_number=start):
            assert len({partition(m.sequence_number or 0) for m in page}) == 1
            seen.extend(page)
            start = max(m.sequence_number or 0 for m in seen) + 1
    assert 0 < len(seen) < len(queue.messages)


# -- the adapter's dlq browse -------------------------------------------------------------------------


@pytest.mark.parametrize("page", [100, 2], ids=["one-page-a-partition", "pages-within-partitions"])
async def test_dlq_counts_and_lists_every_partition(
    sb: SBEnv, page: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dead_letters, "PEEK_PAGE", page)
    queue = sb.create_queue(enable_partitioning=True)
    keys = [f"customer-{k}" for k in range(5)]
    for key in keys:  # one batch per key (one sender: no concurrent opens)
        await sb.send(
            *(
                ServiceBusMessage(f"{key}/{i}".encode(), message_id=f"{key}/{i}", partition_key=key)
                for i in range(2)
            )
        )
    await sb.receive_and_dead_letter(10, reason="test", description="partitioned")
    assert len({partition(m.sequence_number) for m in queue.dead_letters}) > 2
    letters = sb.dead_letter_reader(receive_wait=0.3)
    assert await letters.count(sb.queue) == 10
    listed = await letters.peek(sb.queue, limit=100)
    assert sorted(letter.message_id for letter in listed) == sorted(m.message_id for m in queue.dead_letters)
    assert len(await letters.peek(sb.queue, limit=3)) == 3


# -- the adapter's publisher --------------------------------------------------------------------------


async def test_the_publisher_keeps_to_one_key_a_batch_once_a_partitioned_queue_refused_a_mix(
    sb: SBEnv, caplog: pytest.LogCaptureFixture
) -> None:
    """The first batch mixing keys is refused (Azure/azure-service-bus#103) and its events sent
    each alone; from then on the publisher keeps to one key a batch for that entity."""
    queue = sb.create_queue(enable_partitioning=True)
    publisher = sb.publisher()

    def events(start: int) -> list[OutgoingMessage]:
        keyed = [outgoing_event(n, sb.queue, partition_key=f"customer-{n % 3}") for n in range(start, start + 9)]
        return keyed + [outgoing_event(n, sb.queue) for n in range(start + 9, start + 13)]

    first, second = events(0), events(100)
    with caplog.at_level(logging.WARNING):
        await asyncio.gather(*(publisher.publish(e) for e in first))
        [batcher] = publisher._batchers.values()
        assert len([r for r in caplog.records if "was refused" in r.getMessage()]) == 1
        assert batcher.keys_apart and batcher.batches_sent == 13  # the refused batch's 13, each alone
        await asyncio.gather(*(publisher.publish(e) for e in second))
    assert len([r for r in caplog.records if "was refused" in r.getMessage()]) == 1  # no new refusal
    assert batcher.batches_sent == 13 + 4  # one per key, one for the keyless events
    assert sorted(m.message_id for m in queue.messages) == sorted(e.message_id for e in first + second)


async def test_with_duplicate_detection_a_refused_batch_is_sent_event_by_event(
    sb: SBEnv, caplog: pytest.LogCaptureFixture
) -> None:
    queue = sb.create_queue(enable_partitioning=True, duplicate_detection_window=60)
    publisher = sb.publisher()
    events = [outgoing_event(n, sb.queue) for n in range(3)]
    with caplog.at_level(logging.WARNING):
        await asyncio.gather(*(publisher.publish(e) for e in events))
    assert len([r for r in caplog.records if "was refused" in r.getMessage()]) == 1
    assert sorted(m.message_id for m in queue.messages) == sorted(e.message_id for e in events)


# -- scheduled messages -------------------------------------------------------------------------------


async def test_a_scheduled_message_gets_a_new_number_when_it_becomes_active(sb: SBEnv) -> None:
    queue = sb.create_queue()
    async with (
        asyncio.timeout(SDK_CALL_TIMEOUT),
        sb.client.get_queue_sender(sb.queue, keep_alive=0) as sender,
    ):
        due = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1)  # the sender is open: only two calls left
        [scheduled] = await sender.schedule_messages(ServiceBusMessage(b"s", message_id="s"), due)
        await sender.send_messages(ServiceBusMessage(b"n", message_id="n"))
        assert [m.sequence_number for m in queue.scheduled] == [scheduled]  # not active yet
    await eventually(lambda: queue.scheduled == [], within=5, what="the scheduled message's activation")
    numbers = {m.message_id: m.sequence_number for m in queue.messages}
    assert numbers["s"] != scheduled and numbers["s"] > numbers["n"]  # it does not jump the queue
    async with (
        asyncio.timeout(SDK_CALL_TIMEOUT),
        sb.receiver(sb.queue, receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE) as receiver,
    ):
        received = await receiver.receive_messages(max_message_count=2, max_wait_time=2)
    assert [(m.message_id, m.sequence_number) for m in received] == [("n", numbers["n"]), ("s", numbers["s"])]


async def test_duplicate_detection_applies_to_scheduled_messages(sb: SBEnv) -> None:
    queue = sb.create_queue(duplicate_detection_window=60)
    later = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=60)
    async with (
        asyncio.timeout(SDK_CALL_TIMEOUT),
        sb.client.get_queue_sender(sb.queue, keep_alive=0) as sender,
    ):
        await sender.send_messages(ServiceBusMessage(b"1", message_id="sent-first"))
        await sender.schedule_messages(ServiceBusMessage(b"2", message_id="sent-first"), later)
        assert queue.scheduled == []  # the scheduled duplicate was dropped
        await sender.schedule_messages(ServiceBusMessage(b"3", message_id="scheduled-first"), later)
        await sender.send_messages(ServiceBusMessage(b"4", message_id="scheduled-first"))
    assert [m.body for m in queue.messages] == [b"1"]  # the plain duplicate was dropped
    assert [m.body for m in queue.scheduled] == [b"3"]


async def test_a_delayed_retry_copy_is_never_dropped_as_a_duplicate_and_gets_a_new_number(sb: SBEnv) -> None:
    queue = sb.create_queue(lock_duration=30, duplicate_detection_window=60)
    await sb.send(ServiceBusMessage(b"x", message_id="orig"))

    async def retry_then_ack(delivery: ServiceBusDelivery) -> None:
        if (delivery.message_id, delivery.delivery_count) == ("orig", 1):
            await delivery.retry(2.0)  # long enough to be sent before it is due, on a loaded machine
        else:
            await delivery.ack()

    received = Received(retry_then_ack)
    consumer = await sb.subscribe(received, prefetch=1)
    first = await received.next()
    await eventually(lambda: consumer.counters["retry_copies"] == 1, within=5, what="the scheduled copy")
    scheduled = [m.sequence_number for m in queue.scheduled]
    await sb.send(ServiceBusMessage(b"y", message_id="after-the-retry"))
    later = await received.next()
    again = await received.next()
    assert (first.message_id, later.message_id, again.message_id) == ("orig", "after-the-retry", "orig")
    assert again.sequence_number > later.sequence_number > first.sequence_number
    assert len(scheduled) == 1 and again.sequence_number not in scheduled
    assert consumer.counters["retry_copies"] == 1
    await eventually(lambda: queue.messages == [], within=5, what="the completions")


# -- the browse cursor alone: answers in sequence order cost two extra peeks per partition -----------


def test_the_browse_cursor_sees_everything_from_peeks_in_sequence_order() -> None:
    """Where a broker answers in sequence order (a plain entity, or a partitioned one that does),
    the cursor reads each message once, with a few extra peeks at each partition boundary (answers
    from the next partition only, until its second turn)."""
    from consumer_kit.adapters.servicebus.browse import BrowseCursor

    numbers = sorted([*range(1, 6), *((3 << SHIFT) + n for n in range(1, 4)), (9 << SHIFT) + 1])
    cursor, seen, calls = BrowseCursor(), [], 0
    while True:
        calls += 1
        page = [n for n in numbers if n >= cursor.start][:2]
        new, more = cursor.take(page)
        if not more:
            break
        seen.extend(page[i] for i in new)
    assert seen == numbers
    assert calls == 11  # browsing by "highest seen plus one" takes 6 here (and skips on partitioned entities)
