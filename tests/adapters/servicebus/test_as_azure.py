"""The Service Bus adapter on behaviours Azure has and the test server used to lack: a worker
clock skewed from the broker's, message time to live, throttling, ``Diagnostic-Id`` trace context,
a connection dropped under a running handler. Real azure-servicebus SDK, local test server."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from typing import Any

import pytest
from azure.servicebus import ServiceBusMessage

from consumer_kit.adapters.servicebus import ServiceBusDelivery
from consumer_kit.adapters.servicebus.delivery import EXPIRES_BEFORE_RETRY
from tests.adapters.servicebus.server.fixtures import Received, SBEnv, eventually

LOCK = 5.0  # seconds: Service Bus's shortest lock duration


# -- lock renewal by the worker's own clock --------------------------------------------------------


async def _handle_for_two_locks(sb: SBEnv, queue: Any, sessions: bool) -> tuple[list[float], ServiceBusDelivery, Any, Received]:
    """Subscribe a handler that works for two lock lengths on the one message waiting in
    ``queue``, noting each moment (seconds into its work) it saw the broker's lock gone; returns
    those moments, the delivery, the consumer and what it received, once the message completed."""
    lapsed: list[float] = []

    async def slow(delivery: ServiceBusDelivery) -> None:
        started = time.monotonic()
        while time.monotonic() - started < 2 * LOCK:  # the handler's own work
            if queue.locked_count == 0 or (sessions and queue.session_holder("s1") is None):
                lapsed.append(time.monotonic() - started)
            await asyncio.sleep(0.05)
        await delivery.ack()

    received = Received(slow)
    consumer = await sb.subscribe(received, prefetch=1, session_entities=[sb.queue] if sessions else [])
    delivery = await received.next()
    await eventually(lambda: queue.messages == [], within=4 * LOCK, what="the completion")
    return lapsed, delivery, consumer, received


@pytest.mark.parametrize("skew", [20.0, -20.0], ids=["worker-20s-behind", "worker-20s-ahead"])
@pytest.mark.parametrize("sessions", [False, True], ids=["queue", "session"])
async def test_renewal_keeps_the_lock_whatever_the_skew_between_worker_and_broker(
    sb: SBEnv, skew: float, sessions: bool
) -> None:
    """renewal timed from ``locked_until`` (the broker's clock) against the host's clock
    renews too late with the worker 20 s behind (locks lost, duplicates) and as often as it can
    with it 20 s ahead. Timed on the monotonic clock, a handler two lock lengths long keeps its
    lock with about one renewal per half lock."""
    queue = sb.create_queue(lock_duration=LOCK, requires_session=sessions)
    sb.server.skew_clock(skew)  # the broker's clock is ``skew`` seconds ahead of the worker's
    try:
        await sb.send(ServiceBusMessage(b"x", session_id="s1" if sessions else None))
        lapsed, delivery, consumer, _ = await _handle_for_two_locks(sb, queue, sessions)
    finally:
        sb.server.skew_clock(0.0)
    assert (lapsed, delivery.lost, consumer.counters["locks_lost"]) == ([], False, 0)
    # about 2 * LOCK / (LOCK / 2) = 4 renewals; a skew-driven loop renews every 0.1 s (~100)
    assert 2 <= consumer.counters["renewals"] <= 10


# -- time to live ------------------------------------------------------------------------------------


async def test_a_held_retry_that_would_outlive_the_ttl_is_dead_lettered_with_a_reason(sb: SBEnv) -> None:
    """On a session entity a delayed retry is held (lock renewed, then abandoned). Azure expires a
    message the moment it is abandoned past its TTL (dropped, where the entity does not dead-letter
    on expiry): the adapter dead-letters it at once with ``expires_before_retry`` instead."""
    queue = sb.create_queue(lock_duration=LOCK, requires_session=True)  # no dead-lettering on expiry
    await sb.send(ServiceBusMessage(b"x", session_id="s1", time_to_live=dt.timedelta(seconds=20)))
    received = Received(lambda d: d.retry(60))
    consumer = await sb.subscribe(received, prefetch=1, session_entities=[sb.queue])
    await received.next()
    await eventually(lambda: len(queue.dead_letters) == 1, within=10, what="the dead letter")
    (dead,) = queue.dead_letters
    assert dead.dead_letter_reason == EXPIRES_BEFORE_RETRY
    assert "60 s" in (dead.dead_letter_error_description or "")
    assert consumer.counters["expired_retries"] == 1 and consumer.counters["held_retries"] == 0


async def test_a_held_retry_within_the_ttl_is_held_and_comes_back(sb: SBEnv) -> None:
    queue = sb.create_queue(lock_duration=LOCK, requires_session=True)
    await sb.send(ServiceBusMessage(b"x", session_id="s1", time_to_live=dt.timedelta(seconds=120)))
    received = Received(lambda d: d.ack() if d.delivery_count > 1 else d.retry(1.0))
    await sb.subscribe(received, prefetch=1, session_entities=[sb.queue])
    first, again = await received.take(2)
    assert (first.delivery_count, again.delivery_count) == (1, 2)
    await eventually(lambda: queue.messages == [], within=5, what="the completion")
    assert queue.dead_letters == []


async def test_a_retry_copy_keeps_only_what_is_left_of_the_ttl(sb: SBEnv) -> None:
    """On a queue a delayed retry is a scheduled copy: a copy with the original's whole TTL would
    restart the clock at every retry (a message that never expires). It gets what is left."""
    queue = sb.create_queue(lock_duration=LOCK)
    await sb.send(ServiceBusMessage(b"x", time_to_live=dt.timedelta(seconds=60)))
    received = Received(lambda d: d.ack() if d.delivery_count > 1 else d.retry(1.0))
    await sb.subscribe(received, prefetch=1)
    first, again = await received.take(2)
    original, copy = first._message, again._message
    assert original.expires_at_utc is not None and copy.expires_at_utc is not None
    assert copy.expires_at_utc <= original.expires_at_utc + dt.timedelta(seconds=1)  # whole seconds
    assert copy.time_to_live is not None and copy.time_to_live < dt.timedelta(seconds=60)
    await eventually(lambda: queue.messages == [], within=5, what="the completion")


async def test_a_retry_copy_that_would_be_due_after_the_ttl_is_dead_lettered(sb: SBEnv) -> None:
    """The message sets no TTL: Azure applies the entity's default (15 s) without showing it on the
    message (``expires_at_utc`` None), so the guard works from the default the operator states."""
    queue = sb.create_queue(lock_duration=LOCK, default_message_time_to_live=15)
    await sb.send(ServiceBusMessage(b"x"))
    received = Received(lambda d: d.retry(30))
    consumer = await sb.subscribe(received, prefetch=1, default_ttls={sb.queue: 15})
    await received.next()
    await eventually(lambda: len(queue.dead_letters) == 1, within=10, what="the dead letter")
    assert queue.dead_letters[0].dead_letter_reason == EXPIRES_BEFORE_RETRY
    assert queue.scheduled == [] and consumer.counters["retry_copies"] == 0


async def test_a_message_without_its_own_ttl_shows_none_and_is_taken_as_never_expiring(sb: SBEnv) -> None:
    """Azure leaves ``expires_at_utc`` None unless the sender set a TTL, whatever the entity's
    default; the adapter then assumes no expiry: a delayed retry is a copy, not a dead letter."""
    queue = sb.create_queue(lock_duration=LOCK, default_message_time_to_live=15)
    await sb.send(ServiceBusMessage(b"x"))
    received = Received(lambda d: d.ack() if d.delivery_count > 1 else d.retry(1.0))
    consumer = await sb.subscribe(received, prefetch=1)
    first, _again = await received.take(2)
    assert (first._message.expires_at_utc, first._message.time_to_live) == (None, None)
    assert first.ttl_left() is None and consumer.counters["retry_copies"] == 1
    await eventually(lambda: queue.messages == [], within=5, what="the completion")
    assert queue.dead_letters == []


async def test_a_copy_of_a_message_under_the_entity_default_keeps_only_what_is_left(sb: SBEnv) -> None:
    """With the entity's default stated, a retry copy of a message without its own TTL carries the
    remaining time as its TTL: it never outlives the original's expiry (enqueued time + default)."""
    queue = sb.create_queue(lock_duration=LOCK, default_message_time_to_live=60)
    await sb.send(ServiceBusMessage(b"x"))
    received = Received(lambda d: d.ack() if d.delivery_count > 1 else d.retry(1.0))
    await sb.subscribe(received, prefetch=1, default_ttls={sb.queue: 60})
    first, again = await received.take(2)
    enqueued = first._message.enqueued_time_utc
    assert enqueued is not None and again._message.expires_at_utc is not None
    assert again._message.expires_at_utc <= enqueued + dt.timedelta(seconds=61)  # whole seconds
    assert again._message.time_to_live is not None and again._message.time_to_live < dt.timedelta(seconds=60)
    await eventually(lambda: queue.messages == [], within=5, what="the completion")


# -- trace context -------------------------------------------------------------------------------------


async def test_a_diagnostic_id_alone_carries_the_trace_context(sb: SBEnv) -> None:
    """Producers on older Azure SDKs send only ``Diagnostic-Id`` (W3C format). azure-servicebus
    reads ``traceparent``, else ``Diagnostic-Id`` (``_common/tracing.py``); so does the adapter.
    A malformed one (the old hierarchical Request-Id form) is ignored; ``traceparent`` wins."""
    from opentelemetry import trace

    from consumer_kit.telemetry.trace_context import extract

    sb.create_queue(lock_duration=LOCK)
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    other = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    await sb.send(
        ServiceBusMessage(b"a", message_id="a", application_properties={"Diagnostic-Id": parent}),
        ServiceBusMessage(b"b", message_id="b", application_properties={"Diagnostic-Id": "|abc.1."}),
        ServiceBusMessage(b"c", message_id="c", application_properties={"Diagnostic-Id": other, "traceparent": parent}),
    )
    received = Received(lambda d: d.ack())
    await sb.subscribe(received, prefetch=3)
    by_id = {d.message_id: d for d in await received.take(3)}

    def trace_id(headers: dict[str, object]) -> str | None:
        context = extract(headers)
        if context is None:
            return None
        return format(trace.get_current_span(context).get_span_context().trace_id, "032x")

    assert trace_id(by_id["a"].headers) == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert trace_id(by_id["b"].headers) is None
    assert trace_id(by_id["c"].headers) == "4bf92f3577b34da6a3ce929d0e0e4736"


# -- a connection dropped under a running handler ---------------------------------------------------


@pytest.mark.parametrize("sessions", [False, True], ids=["queue", "session"])
async def test_settling_after_the_connection_dropped_neither_loses_nor_acks_twice(
    sb: SBEnv, sessions: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """the connection drops while the handler runs and, on a queue, the message's lock
    lapses before the worker is back (the broker's clock is moved past it). A session's lock dies
    with its link. So the ack of the first delivery fails (the error is logged: see the report) and
    the message comes back: on a queue counted (a suspect), on a session entity at once (uncounted,
    a suspect by the hold mark). The second delivery is acked; the message is completed exactly
    once. With the lock still held, a queue's delivery is acked after all (the next test)."""
    queue = sb.create_queue(lock_duration=LOCK, requires_session=sessions)
    await sb.send(ServiceBusMessage(b"x", message_id="m", session_id="s1" if sessions else None))
    dropped = asyncio.Event()

    async def settle(delivery: ServiceBusDelivery) -> None:
        if len(received.deliveries) == 1:
            await dropped.wait()
        await delivery.ack()

    received = Received(settle)
    await sb.subscribe(received, prefetch=1, session_entities=[sb.queue] if sessions else [])
    first = await received.next()
    sb.server.drop_connections()
    if not sessions:
        # Nothing can renew a lock over a dropped connection: the broker's clock is moved past
        # it rather than waited for.
        sb.advance_broker_clock(LOCK)
    dropped.set()
    again = await received.next(timeout=3 * LOCK)
    await eventually(lambda: queue.messages == [], within=10, what="the redelivery's completion")
    assert first.lost and not again.lost
    assert (again.message_id, again.redelivered) == ("m", True)
    assert again.delivery_count == (1 if sessions else 2)
    assert len(received.deliveries) == 2 and queue.dead_letters == []
    failures = [r.getMessage() for r in caplog.records if "settlement ack failed" in r.getMessage()]
    assert len(failures) == 1, failures
    print("SDK raised:", failures[0])


async def test_a_queue_delivery_whose_connection_dropped_is_acked_by_lock_token_on_a_new_receiver(
    sb: SBEnv,
) -> None:
    """The connection drops while the handler runs, and the pump (its one slot taken) does not
    notice. The ack fails on the dead link; the delivery asks the pump for a new receiver and
    completes the message over ``$management`` by lock token, which Service Bus accepts from any
    receiver of an entity without sessions while the lock holds (azure-sdk-for-go 1.10.0,
    azure-sdk-for-js #8406; ``ServiceBusDelivery.off_its_link``). Completed once, never
    redelivered, no lock lost."""
    queue = sb.create_queue(lock_duration=LOCK * 6)
    await sb.send(ServiceBusMessage(b"x", message_id="m"))
    dropped = asyncio.Event()

    async def settle(delivery: ServiceBusDelivery) -> None:
        await dropped.wait()
        await delivery.ack()

    received = Received(settle)
    consumer = await sb.subscribe(received, prefetch=1)
    first = await received.next()
    sb.server.drop_connections()
    dropped.set()
    await eventually(lambda: first.settlement is not None or first.lost, within=3 * LOCK, what="the ack")
    await eventually(lambda: queue.messages == [], within=LOCK, what="the completion")
    assert not first.lost and len(received.deliveries) == 1
    assert consumer.counters["reconnects"] == 1 and consumer.counters["locks_lost"] == 0
    assert queue.dead_letters == []


# -- lock renewal for a message out of a backlog -------------------------------------------------------


@pytest.mark.parametrize("sessions", [False, True], ids=["queue", "session"])
async def test_a_message_out_of_a_backlog_keeps_its_lock_without_any_setting(sb: SBEnv, sessions: bool) -> None:
    """A message that waited 8 s before a 5 s lock was granted: timed by ``locked_until -
    enqueued_time`` (13 s) its first renewal came at 6.5 s, after the lock was gone (2 locks lost,
    0 renewals). Timed by what the grant itself tells (``locked_until`` seen just now), a 10 s
    handler keeps it."""
    queue = sb.create_queue(lock_duration=LOCK, requires_session=sessions)
    await sb.send(ServiceBusMessage(b"x", session_id="s1" if sessions else None))
    queue.age_messages(8.0)  # Azure stamps the enqueued time; the message waited 8 s since
    lapsed, delivery, consumer, received = await _handle_for_two_locks(sb, queue, sessions)
    assert (lapsed, delivery.lost, consumer.counters["locks_lost"]) == ([], False, 0)
    assert consumer.counters["renewals"] >= 2
    assert len(received.deliveries) == 1  # never redelivered
