"""The Service Bus adapter through the real azure-servicebus SDK against the local test server.

Settlement, ``redelivered``, lock renewal and loss, pause, reconnect and topic subscriptions; the
sessions and the publisher have test modules of their own (``test_servicebus_sessions.py``,
``test_servicebus_publisher.py``), the worker on PostgreSQL ``test_servicebus_end_to_end.py``.
Every wait is bounded; waits for broker-side state poll the server, never sleep blindly.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Awaitable, Callable

import pytest
from azure.servicebus import ServiceBusMessage, ServiceBusMessageBatch

from consumer_kit.adapters.servicebus import (
    DELIVERIES_PROPERTY,
    ORIGINAL_MESSAGE_ID_PROPERTY,
    Entity,
    GiveBacks,
    Namespace,
    ServiceBusConsumer,
    ServiceBusDelivery,
    ServiceBusPublisher,
    ServiceBusSettings,
)
from consumer_kit.adapters.servicebus.connection import Connection
from consumer_kit.adapters.servicebus.renewal import MAX_WAIT, MIN_WAIT, seconds_until_renewal
from consumer_kit.broker.registry import adapter_for
from consumer_kit.errors import ConfigurationError
from consumer_kit.telemetry.metrics import BROKER, QUEUE
from tests.adapters.servicebus.server.fixtures import Received, SBEnv, eventually
from tests.fixtures.tcp_proxy import TcpProxy
from tests.fixtures.telemetry_kit import Telemetry

# seconds: the lock of the tests about locks, Service Bus's shortest (the test server refuses
# less). The adapter renews a lock at half its time left, so each renewal round trip has 2.5 s.
# Tests of the adapter's renewal wait real time (its timers are the host's); tests that only need
# a lock to lapse advance the broker's clock instead (sb.advance_broker_clock).
LOCK = 5.0
CONNECTION_STRING = "Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKeyName=sender;SharedAccessKey=s3cr3t=="


def settings(**values: object) -> ServiceBusSettings:
    return ServiceBusSettings(**values)  # type: ignore[arg-type]


# -- settings, names, bookkeeping (no server) -----------------------------------------------------


def test_a_connection_string_namespace_never_shows_its_key() -> None:
    namespace = Namespace.from_settings("servicebus://", settings(connection_string=CONNECTION_STRING))
    assert namespace.fully_qualified_namespace == "ns.servicebus.windows.net"
    assert namespace.description == "sb://ns.servicebus.windows.net (shared access key sender)"
    assert "s3cr3t" not in repr(namespace) and "s3cr3t" not in namespace.description
    assert "s3cr3t" not in repr(settings(connection_string=CONNECTION_STRING))
    # sb:// works as well, and a URL naming the same namespace is fine
    same = Namespace.from_settings("sb://NS.servicebus.windows.net", settings(connection_string=CONNECTION_STRING))
    assert same.connection_string == CONNECTION_STRING


def test_a_namespace_alone_signs_in_with_entra_id() -> None:
    namespace = Namespace.from_settings("servicebus://ns.servicebus.windows.net", settings())
    assert namespace.connection_string is None
    assert namespace.description == "sb://ns.servicebus.windows.net (Microsoft Entra ID)"
    try:
        import azure.identity  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigurationError, match="azure-identity"):
            Connection(namespace, name="test")


@pytest.mark.parametrize(
    ("url", "connection_string", "complaint"),
    [
        ("servicebus://", None, "needs a namespace"),
        ("servicebus://key:s3cr3t@ns.servicebus.windows.net", None, "must not carry credentials"),
        ("servicebus://other.servicebus.windows.net", CONNECTION_STRING, "names namespace"),
        ("servicebus://", "SharedAccessKeyName=k;SharedAccessKey=v", "no Endpoint"),
        ("amqp://ns", CONNECTION_STRING, "not a Service Bus URL"),
    ],
)
def test_broker_settings_that_name_no_single_namespace_are_refused(
    url: str, connection_string: str | None, complaint: str
) -> None:
    with pytest.raises(ConfigurationError, match=complaint) as refused:
        Namespace.from_settings(url, settings(connection_string=connection_string))
    assert "s3cr3t" not in str(refused.value)


def test_the_broker_url_schemes_find_this_adapter() -> None:
    import consumer_kit.adapters.servicebus

    assert adapter_for("servicebus://") is consumer_kit.adapters.servicebus
    assert adapter_for("sb://ns.servicebus.windows.net") is consumer_kit.adapters.servicebus


async def test_declare_says_consumer_kit_does_not_create_service_bus_entities() -> None:
    namespace = Namespace.from_connection_string(CONNECTION_STRING)
    with pytest.raises(ConfigurationError, match=r"create queue 'invoices\.commands'"):
        await ServiceBusConsumer(namespace).declare("invoices.commands")
    with pytest.raises(ConfigurationError, match=r"'billing\.events'.*az servicebus"):
        await ServiceBusPublisher(namespace).declare("billing.events")


def test_entity_names() -> None:
    queue = Entity.parse("invoices.commands", session_entities=frozenset({"orders"}))
    assert (queue.is_queue, queue.requires_session, queue.dead_letter_path) == (
        True, False, "invoices.commands/$DeadLetterQueue",
    )
    subscription = Entity.parse("billing.events/subscriptions/ledger")
    assert (subscription.topic, subscription.subscription, subscription.is_queue) == ("billing.events", "ledger", False)
    assert Entity.parse("Orders", session_entities=frozenset({"orders"})).requires_session
    for bad in ("", "a/b", "t/Rules/x", " q"):
        with pytest.raises(ValueError, match="not a Service Bus entity name"):
            Entity.parse(bad)


def test_only_an_exact_match_with_our_own_abandon_clears_a_redelivery() -> None:
    book = GiveBacks(capacity=2)
    assert book.is_suspect("q", 1, 0) is False  # a first delivery
    assert book.is_suspect("q", 1, 1) is True  # redelivered, nothing remembered: a crash, maybe
    book.record("q", 1, 1, suspect=False)  # we abandoned it at broker count 1
    assert book.is_suspect("Q", 1, 2) is False  # exactly the next count: ours (names are case-insensitive)
    assert book.is_suspect("q", 1, 3) is True  # forgotten once matched
    book.record("q", 2, 0, suspect=False)
    assert book.is_suspect("q", 2, 2) is True  # a lock lapsed after our abandon: someone died holding it
    book.record("q", 3, 4, suspect=True)
    assert book.is_suspect("q", 3, 5) is True  # a suspect stays a suspect
    for sequence_number in (4, 5, 6):
        book.record("q", sequence_number, 0, suspect=False)
    assert len(book) == 2
    assert book.is_suspect("q", 4, 1) is True  # the oldest was dropped: a false suspect, never a miss
    assert book.is_suspect("q", 6, 1) is False


def test_renewal_is_due_at_half_the_time_left() -> None:
    assert seconds_until_renewal(30) == 15
    assert seconds_until_renewal(0.05) == MIN_WAIT
    assert seconds_until_renewal(-5) == MIN_WAIT
    assert seconds_until_renewal(3600) == MAX_WAIT
    assert seconds_until_renewal(None) == MIN_WAIT


# -- settlement ---------------------------------------------------------------------------------


def retry_once(delay: float) -> Callable[[ServiceBusDelivery], Awaitable[None]]:
    """A settle policy: ``retry(delay)`` on the first delivery, ack afterwards."""

    async def settle(delivery: ServiceBusDelivery) -> None:
        if delivery.delivery_count == 1:
            await delivery.retry(delay)
        else:
            await delivery.ack()

    return settle


async def test_ack_completes_and_the_delivery_carries_the_broker_fields(sb: SBEnv) -> None:
    sb.create_queue(lock_duration=30)
    sent_at = dt.datetime.now(dt.UTC)
    await sb.send(ServiceBusMessage(
        b'{"order": 1}', message_id="m-1", correlation_id="corr-1",
        application_properties={"tenant-id": "acme", "attempt": 3},
    ))
    received = Received(lambda d: d.ack())
    consumer = await sb.subscribe(received, prefetch=2)
    delivery = await received.next()
    await eventually(lambda: sb.entity().messages == [], within=5, what="the message to be completed")
    assert (delivery.message_id, delivery.body, delivery.delivery_count) == ("m-1", b'{"order": 1}', 1)
    assert (delivery.redelivered, delivery.lost, delivery.correlation_id) == (False, False, "corr-1")
    assert delivery.headers == {"tenant-id": "acme", "attempt": 3}
    assert delivery.partition_key is None
    assert delivery.enqueued_at is not None and abs((delivery.enqueued_at - sent_at).total_seconds()) < 2
    assert consumer.ready
    assert consumer.counters["received"] == 1 and consumer.counters["suspects"] == 0


async def test_retry_now_is_our_own_give_back_and_release_an_uncounted_copy(sb: SBEnv) -> None:
    sb.create_queue(lock_duration=30)
    await sb.send_bodies(b"x")

    async def settle(delivery: ServiceBusDelivery) -> None:
        if len(received.deliveries) == 1:
            await delivery.retry(0)  # abandoned: Service Bus counts it, this process knows it
        elif len(received.deliveries) == 2:
            await delivery.release()  # a copy that does not count this delivery
        else:
            await delivery.ack()

    received = Received(settle)
    consumer = await sb.subscribe(received, prefetch=1)
    deliveries = await received.take(3)
    assert [(d.delivery_count, d.redelivered) for d in deliveries] == [(1, False), (2, False), (2, False)]
    assert len({d.message_id for d in deliveries}) == 1  # the copy reports the original id
    assert consumer.counters["given_back"] == 1 and consumer.counters["release_copies"] == 1
    assert consumer.counters["suspects"] == 0
    await eventually(lambda: sb.entity().messages == [], within=5, what="the completion")


async def test_a_give_back_whose_reply_is_lost_stays_our_own_give_back(sb: SBEnv) -> None:
    """retry(0) is applied by Service Bus but its reply never comes: the settle timeout ends the
    call with its outcome unknown. The give-back stays remembered, so the redelivery (counted
    once, as Service Bus did apply it) is not taken for a crash. Forgetting it on any failure made
    the next delivery a suspect (the race fixed on SQS too)."""
    sb.create_queue(lock_duration=30)
    await sb.send_bodies(b"x")
    sb.entity().lose_settlement_replies(1)

    async def settle(delivery: ServiceBusDelivery) -> None:
        if len(received.deliveries) == 1:
            await delivery.retry(0)  # applied by the server; its reply lost
        else:
            await delivery.ack()

    received = Received(settle)
    consumer = await sb.subscribe(received, prefetch=1, settle_timeout=1.0)
    first, again = await received.take(2)
    assert sb.entity().settlement_replies_lost == 1  # the abandon was applied, unanswered
    assert first.lost  # the settlement did not answer within settle_timeout
    assert (again.delivery_count, again.redelivered) == (2, False)
    assert consumer.counters["suspects"] == 0
    await eventually(lambda: sb.entity().messages == [], within=5, what="the completion")


async def test_an_unsettled_delivery_lapses_and_comes_back_as_a_suspect(sb: SBEnv) -> None:
    """A simulated crash (the worker hands the delivery back unsettled): renewal stops, the lock
    lapses, and the redelivery is a suspect, as after a real crash: never missed."""
    sb.create_queue(lock_duration=LOCK)
    await sb.send_bodies(b"x")

    async def settle(delivery: ServiceBusDelivery) -> None:
        if delivery.delivery_count > 1:
            await delivery.ack()

    received = Received(settle)
    consumer = await sb.subscribe(received, prefetch=1)
    first = await received.next()
    await eventually(lambda: first.released.is_set(), within=5, what="the unsettled hand-back")
    sb.advance_broker_clock(LOCK)  # the lock's time passes on the broker: it lapses, unrenewed
    again = await received.next()
    assert (first.settlement, first.redelivered) == (None, False)
    assert (again.delivery_count, again.redelivered) == (2, True)
    assert consumer.counters["suspects"] == 1 and consumer.counters["renewals"] == 0


async def test_a_release_on_a_queue_is_uncounted_in_any_process_and_a_suspect_stays_one(sb: SBEnv) -> None:
    """A graceful restart: what one consumer released, another receives uncounted and not a
    suspect, unless it was a suspect already (its lock had lapsed once)."""
    sb.create_queue(lock_duration=LOCK)
    [healthy, crashed] = await sb.send_bodies(b"healthy", b"crashed")
    go = asyncio.Event()

    async def release_later(delivery: ServiceBusDelivery) -> None:
        if delivery.body == b"crashed" and not delivery.redelivered:
            return  # handed back unsettled, as by a crash: its lock lapses
        await go.wait()
        await delivery.release()

    releasing = Received(release_later)
    first = await sb.subscribe(releasing, prefetch=2)
    await releasing.take(3)  # healthy; crashed; crashed again, as a suspect
    await first.pause()  # the first consumer takes nothing more: the second one gets the releases
    go.set()
    await eventually(lambda: first.counters["release_copies"] == 2, within=5, what="the releases")
    await first.close()
    acking = Received(lambda d: d.ack())
    await sb.subscribe(acking, prefetch=2)
    after = {d.message_id: (d.delivery_count, d.redelivered) for d in await acking.take(2)}
    assert after == {healthy: (1, False), crashed: (2, True)}


async def test_an_abandon_seen_by_another_consumer_is_a_false_suspect(sb: SBEnv) -> None:
    """What is remembered is this process's own abandons (here a release on a subscription, which
    cannot take a copy): another process takes the redelivery for a possible crash. It costs
    running alone once; a real crash is never missed."""
    path = sb.create_subscription("audit", lock_duration=30).path
    await sb.send_bodies(b"x", entity=sb.topic)
    go = asyncio.Event()

    async def release_later(delivery: ServiceBusDelivery) -> None:
        await go.wait()
        await delivery.release()

    releasing = Received(release_later)
    first = await sb.subscribe(releasing, path, prefetch=1)
    await releasing.next()
    await first.pause()
    go.set()
    await eventually(lambda: first.counters["given_back"] == 1, within=5, what="the release")
    await first.close()
    acking = Received(lambda d: d.ack())
    await sb.subscribe(acking, path, prefetch=1)
    delivery = await acking.next()
    assert (delivery.delivery_count, delivery.redelivered) == (2, True)


async def test_a_delayed_retry_on_a_queue_is_a_scheduled_copy(sb: SBEnv) -> None:
    queue = sb.create_queue(lock_duration=30)
    await sb.send(ServiceBusMessage(b"x", message_id="orig", application_properties={"k": "v"}))
    delay = 0.8

    received = Received(retry_once(delay))
    consumer = await sb.subscribe(received, prefetch=1)
    first = await received.next()
    again = await received.next()
    # The copy as received (not polled while scheduled: on a loaded machine sending it can take
    # longer than its delay, and it is active at once)
    copy = again._message
    assert copy.scheduled_enqueue_time_utc is not None
    assert copy.message_id != "orig"  # duplicate detection must not drop the copy
    assert copy.application_properties[DELIVERIES_PROPERTY.encode()] == 1
    assert copy.application_properties[ORIGINAL_MESSAGE_ID_PROPERTY.encode()] == b"orig"
    original = first._message
    assert original.enqueued_time_utc is not None
    # scheduled ``delay`` after the retry, which came after the original was enqueued (broker times)
    assert (copy.scheduled_enqueue_time_utc - original.enqueued_time_utc).total_seconds() >= delay
    assert (first.message_id, again.message_id) == ("orig", "orig")
    assert (again.delivery_count, again.redelivered, again.headers["k"]) == (2, False, "v")
    assert consumer.counters["retry_copies"] == 1
    await eventually(lambda: queue.messages == [], within=5, what="the copy's completion")


async def test_a_retry_copy_too_large_for_the_queue_is_abandoned_at_once(sb: SBEnv) -> None:
    limit = 1024
    queue = sb.create_queue(lock_duration=30, max_message_size=limit)
    body = b"x" * largest_body_that_fits(limit)  # the original fits; the copy's extra properties do not
    await sb.send(ServiceBusMessage(body, message_id="big"))

    received = Received(retry_once(30))
    consumer = await sb.subscribe(received, prefetch=1)
    first, again = await received.take(2, timeout=10)  # not 30 s later: the delay is given up, not the message
    assert (again.message_id, again.delivery_count, again.redelivered) == ("big", 2, False)
    assert first.lost is False and queue.scheduled == []
    assert consumer.counters["copy_refused"] == 1


def largest_body_that_fits(limit: int) -> int:
    """Bytes of the largest body whose message (with a message id) fits ``limit`` bytes."""
    size = limit
    while size > 0:
        batch = ServiceBusMessageBatch(max_size_in_bytes=limit)
        try:
            batch.add_message(ServiceBusMessage(b"x" * size, message_id="big"))
        except ValueError:
            size -= 8
            continue
        return size
    raise AssertionError("nothing fits")


async def test_dead_letter_reason_and_description_are_read_from_the_dead_letter_queue(sb: SBEnv) -> None:
    sb.create_queue(lock_duration=30)
    [message_id] = await sb.send_bodies(b"bad")
    reason = "invalid_json" + "!" * 2000
    received = Received(lambda d: d.dead_letter(reason, "line 1: expecting value"))
    consumer = await sb.subscribe(received, prefetch=1)
    await received.next()
    [dead] = await sb.dead_letters(1)
    assert dead.message_id == message_id
    assert dead.dead_letter_reason == reason[:1024]
    assert dead.dead_letter_error_description == "line 1: expecting value"
    await eventually(lambda: consumer.counters["dead_lettered"] == 1, within=5, what="the settlement's end")
    assert sb.entity().messages == []


async def test_a_dead_letter_on_a_queue_keeps_its_reason_within_the_size_limit(sb: SBEnv) -> None:
    """On a queue the description is also cut to the room the message size limit leaves. Service
    Bus documents only header limits for the dead-letter properties (*Service Bus quotas*; the test
    server enforces those, ``test_servicebus_header_limits.py``): this is a precaution, so the
    server takes the dead-letter either way; the cut is the adapter's."""
    limit = 2048
    body = b"x" * (largest_body_that_fits(limit) - 80)
    entity = sb.create_queue(max_message_size=limit)
    await sb.send(ServiceBusMessage(body, message_id="big"))
    received = Received(lambda d: d.dead_letter("invalid_json", "why: " + "w" * 1000))
    consumer = await sb.subscribe(received, prefetch=1)
    delivery = await received.next()
    await eventually(lambda: len(entity.dead_letters) == 1, within=5, what="the dead letter")
    [dead] = entity.dead_letters
    assert dead.dead_letter_reason == "invalid_json" and dead.size <= limit
    assert (dead.dead_letter_error_description or "").startswith("why: ")
    await eventually(lambda: consumer.counters["dead_lettered"] == 1, within=5, what="the settlement's end")
    assert delivery.lost is False


# -- locks --------------------------------------------------------------------------------------


async def test_renewal_keeps_a_handler_longer_than_its_lock_owning_its_delivery(sb: SBEnv) -> None:
    queue = sb.create_queue(lock_duration=LOCK)
    await sb.send_bodies(b"slow")
    lapsed: list[float] = []

    async def slow(delivery: ServiceBusDelivery) -> None:
        started = time.monotonic()
        while time.monotonic() - started < 1.6 * LOCK:  # real time: the adapter's renewal timers
            if queue.locked_count != 1:
                lapsed.append(time.monotonic() - started)
            await asyncio.sleep(0.05)
        await delivery.ack()

    received = Received(slow)
    consumer = await sb.subscribe(received, prefetch=1)
    delivery = await received.next()
    await eventually(lambda: queue.messages == [], within=2 * LOCK + 5, what="the completion")
    assert lapsed == []
    assert (delivery.settlement, delivery.lost) == (delivery.settlement.ACK, False)  # type: ignore[union-attr]
    # renewed at half the time left (about 2.5, 5 and 7.5 s in): at least twice on a loaded machine
    assert consumer.counters["renewals"] >= 2 and consumer.counters["locks_lost"] == 0
    assert len(received.deliveries) == 1  # never redelivered


async def test_deliveries_waiting_for_a_slot_keep_their_locks(sb: SBEnv) -> None:
    """Prefetched deliveries waiting behind a slow one (as behind a message running alone) are
    renewed too: none lapses, none comes back."""
    sb.create_queue(lock_duration=LOCK)
    await sb.send_bodies(b"a", b"b", b"c")
    one_at_a_time = asyncio.Lock()

    async def serial(delivery: ServiceBusDelivery) -> None:
        async with one_at_a_time:
            # the work itself (real time: the adapter's renewal timers): the third waits 1.1 lock
            # lengths for its slot and is done after 1.65
            await asyncio.sleep(0.55 * LOCK)
            await delivery.ack()

    received = Received(serial)
    await sb.subscribe(received, prefetch=3)
    await eventually(lambda: sb.entity().messages == [], within=2 * LOCK + 5, what="all three completions")
    assert sorted(d.body for d in received.deliveries) == [b"a", b"b", b"c"]
    assert all(d.delivery_count == 1 and not d.lost for d in received.deliveries)


async def test_a_lock_lost_while_running_is_never_acked_and_comes_back(sb: SBEnv, otel: Telemetry) -> None:
    queue = sb.create_queue(lock_duration=30)
    await sb.send_bodies(b"x")
    lock_gone = asyncio.Event()

    async def settle(delivery: ServiceBusDelivery) -> None:
        if delivery.delivery_count == 1:
            await lock_gone.wait()  # the handler is slow; meanwhile Service Bus drops its lock
        await delivery.ack()

    received = Received(settle)
    consumer = await sb.subscribe(received, prefetch=1)
    first = await received.next()
    lost_metric = {QUEUE: first.queue, BROKER: "servicebus"}
    before = otel.value("consumer_kit.locks_lost", attrs=lost_metric)
    queue.expire_all_locks(time.time())
    await eventually(lambda: queue.locked_count == 0, within=3, what="the server to drop the lock")
    lock_gone.set()
    again = await received.next()
    # The late ack was refused (MessageLockLostError): never counted as done.
    assert (first.settlement, first.lost) == (first.settlement.ACK, True)  # type: ignore[union-attr]
    assert (again.delivery_count, again.redelivered) == (2, True)
    assert consumer.counters["locks_lost"] == 1
    assert otel.value("consumer_kit.locks_lost", attrs=lost_metric) == before + 1  # the OpenTelemetry metric too
    await eventually(lambda: queue.messages == [], within=5, what="the redelivery's completion")


# -- pause, reconnect, subscriptions ---------------------------------------------------------------


async def test_pause_stops_receiving_and_resume_goes_on(sb: SBEnv) -> None:
    queue = sb.create_queue(lock_duration=30)
    received = Received(lambda d: d.ack())
    consumer = await sb.subscribe(received, prefetch=2, receive_wait=0.2)
    await consumer.pause()
    await sb.send_bodies(b"while paused")
    with pytest.raises(TimeoutError):  # nothing is received while paused (bounded absence check)
        await received.next(timeout=1.0)
    assert (queue.active_count, queue.locked_count) == (1, 0)
    await consumer.resume()
    delivery = await received.next()
    assert (delivery.body, delivery.delivery_count) == (b"while paused", 1)


async def test_what_arrives_while_paused_is_not_locked_and_runs_once_after_resume(sb: SBEnv) -> None:
    """Credit the receiver's link had left when the worker paused locks nothing: messages sent
    meanwhile wait unlocked, past a lock's length, and each runs once after resume (no lock lost,
    no extra delivery count)."""
    queue = sb.create_queue(lock_duration=LOCK)
    received = Received(lambda d: d.ack())
    consumer = await sb.subscribe(received, prefetch=4, receive_wait=0.2)
    await sb.send_bodies(b"before")  # a receive with credit for 4 took 1: 3 are left on the link
    assert (await received.next()).body == b"before"
    await eventually(lambda: queue.messages == [], within=5, what="the first completion")
    await consumer.pause()
    await sb.send_bodies(b"a", b"b", b"c")
    await eventually(lambda: queue.active_count == 3, within=5, what="the three sends")
    assert queue.locked_count == 0  # none is locked on the paused link's credit
    queue.expire_all_locks(time.time())  # as if a lock's length passed while paused
    await consumer.resume()
    await eventually(lambda: queue.messages == [], within=10, what="the three completions")
    later = received.deliveries[1:]
    assert sorted(d.body for d in later) == [b"a", b"b", b"c"]
    assert all(d.delivery_count == 1 and not d.lost for d in later)
    assert consumer.counters["locks_lost"] == 0


async def test_a_delivery_in_hand_at_pause_settles_on_the_new_link_and_nothing_more_is_locked(sb: SBEnv) -> None:
    queue = sb.create_queue(lock_duration=30)
    finish = asyncio.Event()

    async def slow(delivery: ServiceBusDelivery) -> None:
        if delivery.body == b"running":
            await finish.wait()
        await delivery.ack()

    received = Received(slow)
    consumer = await sb.subscribe(received, prefetch=4, receive_wait=0.2)
    await sb.send_bodies(b"running")
    assert (await received.next()).body == b"running"
    await consumer.pause()  # the running one moves to a receiver that asked for nothing
    await sb.send_bodies(b"a", b"b")
    await eventually(lambda: queue.active_count == 3, within=5, what="the two sends")
    assert queue.locked_count == 1  # only the running delivery
    finish.set()
    await eventually(lambda: queue.active_count == 2, within=5, what="the running one's ack by lock token")
    await consumer.resume()
    await eventually(lambda: queue.messages == [], within=10, what="the two completions")
    assert sorted(d.body for d in received.deliveries) == [b"a", b"b", b"running"]
    assert all(d.delivery_count == 1 and not d.lost for d in received.deliveries)
    assert consumer.counters["locks_lost"] == 0


async def test_the_consumer_reconnects_after_its_connection_drops(sb: SBEnv) -> None:
    sb.create_queue(lock_duration=30)
    proxy = TcpProxy("127.0.0.1", sb.server.port)
    port = await proxy.start()
    sb.namespace = Namespace.from_connection_string(sb.server.connection_string.replace(f":{sb.server.port};", f":{port};"))
    received = Received(lambda d: d.ack())
    consumer = sb.consumer()
    try:
        await consumer.subscribe(sb.queue, received, prefetch=1)
        await sb.send_bodies(b"before")
        assert (await received.next()).body == b"before"
        accepted = proxy.accepted
        await proxy.drop()
        await sb.send_bodies(b"after")
        assert (await received.next(timeout=20)).body == b"after"
        assert proxy.accepted > accepted  # a new connection
        assert consumer.counters["reconnects"] >= 1
        await eventually(lambda: consumer.ready, within=5, what="readiness")
    finally:
        await consumer.close()
        await proxy.close()


async def test_subscribing_to_a_missing_entity_fails_fast(sb: SBEnv) -> None:
    consumer = sb.consumer()
    started = time.monotonic()
    with pytest.raises(ConnectionError, match="missing-queue"):
        await consumer.subscribe("missing-queue", Received(), prefetch=1)
    assert time.monotonic() - started < 5


async def test_a_delayed_retry_on_a_subscription_is_held_then_abandoned(sb: SBEnv) -> None:
    """A subscription cannot take a copy: the lock is held (renewed) for the delay, then abandoned."""
    subscription = sb.create_subscription("audit", lock_duration=LOCK)
    await sb.send_bodies(b"x", entity=sb.topic)
    delay = 1.3 * LOCK  # real time (the adapter holds the retry on its own timer), past one lock

    received = Received(retry_once(delay))
    consumer = await sb.subscribe(received, subscription.path, prefetch=1)
    await received.next()
    held_at = time.monotonic()
    await asyncio.sleep(LOCK + 0.3)  # past the first lock's expiry: the time itself is under test
    assert subscription.locked_count == 1  # still ours, past its first expiry
    again = await received.next()
    assert time.monotonic() - held_at >= delay - 0.2
    assert (again.delivery_count, again.redelivered) == (2, False)
    assert consumer.counters["held_retries"] == 1 and sb.server.entity(sb.topic).scheduled == []


@pytest.mark.parametrize("state", ["paused", "slots full"])
async def test_a_queue_pump_told_to_stop_ends_even_if_its_cancellation_is_lost(sb: SBEnv, state: str) -> None:
    """The session slots' sibling: the stop signal alone, no cancellation (as when the
    SDK's wait_for swallows it on Python 3.11), ends the pump at its unbounded waits: paused, or
    every slot holding a delivery that is never settled."""
    sb.create_queue(lock_duration=30)
    await sb.send_bodies(b"x")
    in_hand = asyncio.Event()

    async def handle(delivery: ServiceBusDelivery) -> None:
        in_hand.set()
        await asyncio.Event().wait()  # never settles

    consumer = await sb.subscribe(Received(handle), prefetch=1, settle_timeout=1.0)
    await asyncio.wait_for(in_hand.wait(), 10)
    if state == "paused":
        await consumer.pause()
    pump = consumer._pumps[sb.queue]
    task = pump._task
    assert task is not None
    pump._stopping.set()
    await task.wait_finished(10.0)
    assert task.finished and task.deaths == 0
