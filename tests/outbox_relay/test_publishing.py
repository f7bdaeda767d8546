"""The relay's publish bounds: nothing is sent once the claim's time is up (a message sent then
could reach the broker and still count as failed: published again later, a duplicate and an attempt
spent), and no publish outlives a cancelled caller (``outbox_relay/publishing.py``,
``Publisher.publish_batch``'s default)."""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid

import pytest

from consumer_kit.broker.publishing import OutgoingMessage, Publisher
from consumer_kit.errors import PublishTimeout
from consumer_kit.outbox_relay.counters import RelayCounters
from consumer_kit.outbox_relay.publishing import RowPublisher
from consumer_kit.outbox_relay.routing import Routing
from consumer_kit.outbox_relay.store import ClaimedRow


class Gate(Publisher):
    """A publisher whose every publish waits for ``release``; records what started, ended, was
    cancelled (a stand-in for a broker that stopped answering)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started: list[str] = []
        self.finished: list[str] = []
        self.cancelled: list[str] = []
        self.two_started = asyncio.Event()

    async def connect(self) -> None:
        pass

    async def publish(self, message: OutgoingMessage) -> None:
        self.started.append(message.message_id)
        if len(self.started) == 2:
            self.two_started.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.append(message.message_id)
            raise
        self.finished.append(message.message_id)

    async def close(self) -> None:
        pass


def outgoing(n: int) -> OutgoingMessage:
    return OutgoingMessage(destination="d", routing_key="k", message_id=f"m-{n}", body=b"{}", message_type="T")


def claimed(n: int) -> ClaimedRow:
    return ClaimedRow(
        id=n, event_id=uuid.UUID(int=n), destination="d", routing_key="k", message_type="T", partition_key=None,
        payload="{}", headers={}, attempts=0, operation_scope=None, operation_key=None, correlation_id=None,
        created_at=dt.datetime.now(dt.UTC), previous_owner=None,
    )


async def test_chunks_left_when_the_deadline_has_passed_are_never_sent() -> None:
    gate = Gate()  # never released: the first chunk waits out the whole deadline
    counters = RelayCounters()
    publishing = RowPublisher(gate, Routing(), counters, relay_id="r", messaging_system="test", max_in_flight=2)
    confirmed, failures = await publishing.publish_all([claimed(n) for n in range(1, 7)], deadline=0.2)
    assert confirmed == []
    assert gate.started == [str(uuid.UUID(int=1)), str(uuid.UUID(int=2))]  # only the first chunk
    assert sorted(f.id for f in failures) == [1, 2, 3, 4, 5, 6] and all(f.transient for f in failures)
    assert [f.error for f in failures if f.id > 2] == ["not sent before the claim lease ran low"] * 4
    assert counters["deadline_exceeded"] == 6


async def test_the_default_batch_sends_nothing_with_no_time_left() -> None:
    gate = Gate()
    outcomes = await gate.publish_batch([outgoing(1), outgoing(2)], within=0.0)
    assert [type(o) for o in outcomes] == [PublishTimeout, PublishTimeout] and gate.started == []


async def test_no_publish_of_the_default_batch_outlives_its_cancelled_caller() -> None:
    gate = Gate()
    batch = asyncio.create_task(gate.publish_batch([outgoing(1), outgoing(2)], within=30.0))
    await gate.two_started.wait()
    batch.cancel()
    with pytest.raises(asyncio.CancelledError):
        await batch
    assert sorted(gate.cancelled) == ["m-1", "m-2"] and gate.finished == []
