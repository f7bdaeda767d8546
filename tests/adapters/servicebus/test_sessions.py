"""Session-enabled entities through the real azure-servicebus SDK against the local test server:
one session's messages in order whatever the concurrency, sessions in parallel, session lock
renewal, session lock loss, and a held retry that keeps the order."""

from __future__ import annotations

import asyncio
import random
import time
from collections import defaultdict
from typing import Any

import pytest
from azure.servicebus import ServiceBusMessage

from consumer_kit.adapters.servicebus import ServiceBusConsumer, ServiceBusDelivery
from consumer_kit.resilience import supervised
from tests.adapters.servicebus.server.fixtures import Received, SBEnv, eventually

# seconds: the session lock of the tests about locks, Service Bus's shortest (the test server
# refuses less). The adapter renews a lock at half its time left; its timers run on real time, so
# the tests of renewal and held retries wait real seconds, a little over one lock length.
LOCK = 5.0


async def send_sessions(sb: SBEnv, sessions: dict[str, int]) -> None:
    """``count`` messages per session id, bodies ``<session>-<n>``, interleaved across sessions."""
    messages = [
        ServiceBusMessage(f"{session}-{n}".encode(), session_id=session, message_id=f"{session}-{n}")
        for n in range(max(sessions.values()))
        for session, count in sessions.items()
        if n < count
    ]
    await sb.send(*messages)


async def test_one_sessions_messages_are_handled_in_order_while_sessions_run_in_parallel(sb: SBEnv) -> None:
    queue = sb.create_queue(requires_session=True, lock_duration=30)
    await send_sessions(sb, {"customer-a": 6, "customer-b": 6, "customer-c": 6})
    running: set[str] = set()
    most_at_once = 0
    order: dict[str, list[str]] = defaultdict(list)

    async def handle(delivery: ServiceBusDelivery) -> None:
        nonlocal most_at_once
        session = delivery.partition_key
        assert session is not None and session not in running, "two messages of one session at once"
        running.add(session)
        most_at_once = max(most_at_once, len(running))
        await asyncio.sleep(random.uniform(0, 0.03))
        order[session].append(delivery.body.decode())
        running.discard(session)
        await delivery.ack()

    received = Received(handle)
    consumer = await sb.subscribe(received, prefetch=3, session_entities=[sb.queue])
    await received.take(18)
    await eventually(lambda: queue.messages == [], within=5, what="every completion")
    assert order == {s: [f"{s}-{n}" for n in range(6)] for s in ("customer-a", "customer-b", "customer-c")}
    assert most_at_once >= 2  # different sessions did run at the same time
    assert consumer.counters["sessions"] >= 3


async def test_session_lock_renewal_keeps_a_handler_longer_than_its_lock(sb: SBEnv) -> None:
    queue = sb.create_queue(requires_session=True, lock_duration=LOCK)
    await send_sessions(sb, {"s1": 2})
    lapsed: list[float] = []

    async def slow_first(delivery: ServiceBusDelivery) -> None:
        if delivery.body == b"s1-0":
            started = time.monotonic()
            while time.monotonic() - started < 1.6 * LOCK:
                if queue.session_holder("s1") is None:
                    lapsed.append(time.monotonic() - started)
                await asyncio.sleep(0.05)
        await delivery.ack()

    received = Received(slow_first)
    consumer = await sb.subscribe(received, prefetch=1, session_entities=[sb.queue])
    first, second = await received.take(2, timeout=2 * LOCK + 10)
    await eventually(lambda: queue.messages == [], within=5, what="both completions")
    assert lapsed == []
    assert [(d.body, d.delivery_count, d.lost) for d in (first, second)] == [(b"s1-0", 1, False), (b"s1-1", 1, False)]
    assert consumer.counters["renewals"] >= 2 and consumer.counters["locks_lost"] == 0


async def test_a_lost_session_lock_is_never_acked_and_the_message_comes_back(sb: SBEnv) -> None:
    queue = sb.create_queue(requires_session=True, lock_duration=30)
    await send_sessions(sb, {"s1": 1})
    lock_gone = asyncio.Event()

    async def settle(delivery: ServiceBusDelivery) -> None:
        if delivery.delivery_count == 1:
            await lock_gone.wait()
        await delivery.ack()

    received = Received(settle)
    consumer = await sb.subscribe(received, prefetch=1, session_entities=[sb.queue])
    first = await received.next()
    queue.expire_all_locks(time.time())  # Service Bus drops the session lock (and detaches the receiver)
    await eventually(lambda: queue.session_holder("s1") is None, within=3, what="the session lock to go")
    lock_gone.set()
    again = await received.next()
    assert (first.settlement, first.lost) == (first.settlement.ACK, True)  # type: ignore[union-attr]
    assert (again.body, again.delivery_count, again.redelivered) == (b"s1-0", 2, True)
    assert consumer.counters["locks_lost"] == 1
    await eventually(lambda: queue.messages == [], within=5, what="the redelivery's completion")


async def test_a_delayed_retry_in_a_session_is_held_and_keeps_the_order(sb: SBEnv) -> None:
    queue = sb.create_queue(requires_session=True, lock_duration=LOCK)
    await send_sessions(sb, {"s1": 2})
    delay = 1.1 * LOCK  # held (renewed) past the session lock's length

    async def retry_first_once(delivery: ServiceBusDelivery) -> None:
        if delivery.body == b"s1-0" and delivery.delivery_count == 1:
            await delivery.retry(delay)
        else:
            await delivery.ack()

    received = Received(retry_first_once)
    consumer = await sb.subscribe(received, prefetch=2, session_entities=[sb.queue])
    deliveries = await received.take(3, timeout=delay + 10)
    assert [(d.body, d.delivery_count, d.redelivered) for d in deliveries] == [
        (b"s1-0", 1, False), (b"s1-0", 2, False), (b"s1-1", 1, False),
    ]
    assert consumer.counters["held_retries"] == 1 and queue.scheduled == []
    await eventually(lambda: queue.messages == [], within=5, what="both completions")


async def test_an_unsettled_session_delivery_gives_the_session_up_and_comes_back_as_a_suspect(sb: SBEnv) -> None:
    """A simulated crash in a session: the slot closes its receiver and Service Bus returns the
    message to its session **uncounted** (Microsoft's *Message sessions* page, "delivery count per
    message in the context of sessions": messages not completed when the session is closed: No),
    so its count says nothing. The hold mark the slot left in the session state makes the next
    delivery a suspect anyway (``adapters/servicebus/session_holds.py``); once the session is given
    up cleanly the mark is cleared."""
    queue = sb.create_queue(requires_session=True, lock_duration=30)
    await send_sessions(sb, {"s1": 1})

    async def crash_first(delivery: ServiceBusDelivery) -> None:
        if delivery.redelivered:
            await delivery.ack()

    received = Received(crash_first)
    await sb.subscribe(received, prefetch=1, session_entities=[sb.queue])
    first, again = await received.take(2)
    assert (first.settlement, first.delivery_count, first.redelivered) == (None, 1, False)
    assert (again.delivery_count, again.redelivered) == (1, True)  # Azure: (1, False) without the mark
    await eventually(lambda: queue.messages == [], within=5, what="the suspect's completion")
    await eventually(lambda: queue.session_state("s1") is None, within=5, what="the hold mark to be cleared")


async def test_a_session_given_up_cleanly_leaves_no_suspect(sb: SBEnv) -> None:
    """Sessions taken again and again (settled, emptied, paused) never make a false suspect."""
    queue = sb.create_queue(requires_session=True, lock_duration=30)
    received = Received(lambda d: d.ack())
    consumer = await sb.subscribe(received, prefetch=1, session_entities=[sb.queue])
    for round_ in range(3):
        await sb.send(ServiceBusMessage(f"s1-{round_}".encode(), session_id="s1"))
        delivery = await received.next()
        assert (delivery.body, delivery.redelivered) == (f"s1-{round_}".encode(), False)
        await eventually(lambda: queue.session_holder("s1") is None, within=5, what="the session to be given up")
        assert queue.session_state("s1") is None
    await consumer.pause()
    await consumer.resume()
    await sb.send(ServiceBusMessage(b"s1-last", session_id="s1"))
    assert (await received.next()).redelivered is False


async def test_a_foreign_session_state_is_kept_and_the_first_delivery_runs_alone(sb: SBEnv) -> None:
    """An application's own session state is never overwritten; the session's first delivery is then
    a suspect (a false one at worst: a crash is never missed)."""
    queue = sb.create_queue(requires_session=True, lock_duration=30)
    await send_sessions(sb, {"s1": 2})
    async with asyncio.timeout(10), sb.client.get_queue_receiver(
        sb.queue, session_id="s1", prefetch_count=1, keep_alive=0, socket_timeout=0.05
    ) as receiver:
        await receiver.session.set_state(b"app-state")
    received = Received(lambda d: d.ack())
    await sb.subscribe(received, prefetch=1, session_entities=[sb.queue])
    first, second = await received.take(2)
    assert [(d.body, d.redelivered) for d in (first, second)] == [(b"s1-0", True), (b"s1-1", False)]
    await eventually(lambda: queue.messages == [], within=5, what="both completions")
    assert queue.session_state("s1") == b"app-state"


# -- stopping while a session slot waits (a shutdown that hung on a session slot) ----------

SETTLE = 1.0  # seconds: the consumers' settle_timeout below
# seconds: what close() may take by its own bounds (a receive given settle_timeout after the stop,
# the handlers settle_timeout, a slot's give-up (hold, mark) 2 x settle_timeout, the receivers'
# close settle_timeout), with room for a loaded machine; far below the 30 s receive_wait below,
# which a slot that missed the stop would wait out
SHUTDOWN_BOUND = 10 * SETTLE
LONG_WAIT = 30.0  # seconds: receive_wait, longer than any bound of the test


async def _slot_waiting(sb: SBEnv, state: str, *, receive_wait: float) -> tuple[ServiceBusConsumer, Any]:
    """A consumer with one session slot, left in ``state``; returns it and its slot's pumps."""
    sb.create_queue(requires_session=True, lock_duration=30)
    handling = asyncio.Event()
    handed = 0

    async def handle(delivery: ServiceBusDelivery) -> None:
        nonlocal handed
        handed += 1
        if state == "handling":
            handling.set()
            await asyncio.Event().wait()  # never settles: the stop must not wait for it
        elif state == "crash loop":
            return None  # handed back unsettled: a simulated crash, again and again
        else:
            await delivery.ack()

    if state in ("receiving", "handling", "crash loop"):
        await sb.send(ServiceBusMessage(b"x", session_id="s-1"))
    received = Received(handle)
    consumer = await sb.subscribe(
        received, prefetch=1, settle_timeout=SETTLE, receive_wait=receive_wait, session_entities=[sb.queue]
    )
    pumps = consumer._pumps[sb.queue]
    slot = pumps._slots[0]
    if state == "accepting":  # no session has messages: the accept waits for one
        await eventually(lambda: slot._receiving.locked(), within=10, what="an accept in progress")
    elif state == "receiving":  # the session's only message acked: the next receive waits
        await received.next()
        await eventually(lambda: slot._receiving.locked() and slot._current is not None
                         and slot._current.released.is_set(), within=10, what="a receive in progress")
    elif state == "handling":
        await asyncio.wait_for(handling.wait(), 10)
    elif state == "crash loop":
        await received.take(3)
    elif state == "paused":
        await consumer.pause()
    return consumer, pumps


@pytest.mark.parametrize("state", ["accepting", "receiving", "handling", "paused", "crash loop"])
async def test_closing_stops_a_session_slot_in_each_waiting_state(sb: SBEnv, state: str) -> None:
    consumer, _ = await _slot_waiting(sb, state, receive_wait=LONG_WAIT)
    async with asyncio.timeout(SHUTDOWN_BOUND):  # close() returns once every slot task has ended
        await consumer.close()
    assert not supervised.find(f"session slot {sb.queue}")
    assert consumer.counters["sessions"] >= (0 if state in ("accepting", "paused") else 1)


@pytest.mark.parametrize("state", ["accepting", "receiving", "handling", "paused", "crash loop"])
async def test_a_session_slot_told_to_stop_ends_even_if_its_cancellation_is_lost(sb: SBEnv, state: str) -> None:
    """The stop signal alone, no cancellation (as when the SDK's wait_for swallows it on Python
    3.11): the slot ends by itself at its next wait. Its bounded waits (accept, receive: 0.2 s
    here) end as usual; its unbounded ones (paused, a delivery in hand) end on the signal."""
    consumer, pumps = await _slot_waiting(sb, state, receive_wait=0.2)
    await consumer.stop_consuming()
    slot, task = pumps._slots[0], pumps._tasks[0]
    slot.stopping.set()
    await task.wait_finished(SHUTDOWN_BOUND)
    assert task.finished and task.deaths == 0
