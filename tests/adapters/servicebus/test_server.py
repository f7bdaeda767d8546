"""The local Service Bus test server, exercised only through the real azure-servicebus async SDK.

Each test proves one Service Bus behaviour the consumer-kit adapter will rely on. The SDK hangs
instead of failing when a server answers wrongly, so every test runs under ``asyncio.timeout``
and the client never retries (``retry_total=0``): a protocol mistake fails fast. Waiting for a lock
to expire is what some tests are about; those waits are bounded and a few lock durations long.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
from azure.servicebus import (
    NEXT_AVAILABLE_SESSION,
    ServiceBusMessage,
    ServiceBusReceivedMessage,
    ServiceBusSubQueue,
)
from azure.servicebus.aio import AutoLockRenewer, ServiceBusClient, ServiceBusReceiver, ServiceBusSender
from azure.servicebus.exceptions import (
    MessageAlreadySettled,
    MessageLockLostError,
    MessageSizeExceededError,
    MessagingEntityNotFoundError,
    OperationTimeoutError,
    ServiceBusError,
    SessionCannotBeLockedError,
    SessionLockLostError,
)

from tests.adapters.servicebus.server import MessageState, ServiceBusTestServer
from tests.adapters.servicebus.server.fixtures import eventually

LOCK = 5.0  # seconds: Service Bus's shortest lock; tests that wait for expiry advance the broker's clock
# seconds: the lock of the tests that must act while it holds (renew it at half its time, settle
# after its first expiry) or settle under it: 3 s for each step, which a loaded machine does not
# outrun (LOCK left 0.5-0.75 s, or the whole 1.5 s for a receive and a complete)
HELD_LOCK = 6.0
RECEIVE_WAIT = 3  # seconds the SDK waits for a message before giving up


def bounded(seconds: float) -> Callable[[Callable[..., Awaitable[None]]], Callable[..., Awaitable[None]]]:
    """Run a test under ``asyncio.timeout(seconds)``: a hung SDK call fails the test instead of the run."""

    def decorate(test: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
        @functools.wraps(test)
        async def run(*args: Any, **kwargs: Any) -> None:
            async with asyncio.timeout(seconds):
                await test(*args, **kwargs)

        return run

    return decorate


async def receive_one(receiver: ServiceBusReceiver, wait: float = RECEIVE_WAIT) -> ServiceBusReceivedMessage:
    messages = await receiver.receive_messages(max_message_count=1, max_wait_time=wait)
    assert len(messages) == 1, f"expected one message, got {messages}"
    return messages[0]


@pytest.fixture
def server() -> Iterator[ServiceBusTestServer]:
    with ServiceBusTestServer() as running:
        yield running


@pytest.fixture
async def client(server: ServiceBusTestServer) -> AsyncIterator[ServiceBusClient]:
    sb_client = ServiceBusClient.from_connection_string(server.connection_string, retry_total=0)
    try:
        yield sb_client
    finally:
        async with asyncio.timeout(10):
            await sb_client.close()


def open_sender(client: ServiceBusClient, queue: str) -> ServiceBusSender:
    # keep_alive=0: the SDK's keep-alive task sleeps in whole seconds and closing a handler waits
    # for it, which would add up to a second per handler.
    return client.get_queue_sender(queue, keep_alive=0)


def open_receiver(
    client: ServiceBusClient, queue: str, *, prefetch: int = 1, **options: Any
) -> ServiceBusReceiver:
    """A peek-lock receiver; ``prefetch=0`` where a test needs exactly one message on the wire at a time.

    The SDK always runs its keep-alive task for receivers without prefetch (close then takes up to a
    second), so the tests that do not care prefetch one message. On close the SDK drains the link
    until two socket timeouts pass idle: 0.05 s instead of 0.2 s keeps that short on loopback.
    """
    return client.get_queue_receiver(
        queue, prefetch_count=prefetch, keep_alive=0, socket_timeout=0.05, **options
    )


async def send(client: ServiceBusClient, entity: str, *messages: ServiceBusMessage) -> None:
    async with open_sender(client, entity) as queue_sender:
        await queue_sender.send_messages(list(messages) if len(messages) > 1 else messages[0])


# -- 1. send, peek-lock receive, complete --------------------------------------------------------


@bounded(20)
async def test_send_receive_complete_keeps_the_message_and_broker_fields(
    server: ServiceBusTestServer, client: ServiceBusClient
) -> None:
    server.create_queue("orders", lock_duration=5)
    sent_at = datetime.datetime.now(datetime.UTC)
    await send(
        client,
        "orders",
        ServiceBusMessage(
            b'{"order": 418}',
            message_id="op-418",
            correlation_id="corr-1",
            content_type="application/json",
            subject="create-invoice",
            application_properties={"tenant": "acme", "attempt": 3},
        ),
    )
    assert server.entity("orders").active_count == 1

    async with open_receiver(client, "orders") as receiver:
        message = await receive_one(receiver)
        assert b"".join(message.body) == b'{"order": 418}'
        assert (message.message_id, message.correlation_id) == ("op-418", "corr-1")
        assert (message.content_type, message.subject) == ("application/json", "create-invoice")
        assert message.application_properties == {b"tenant": b"acme", b"attempt": 3}
        assert message.delivery_count == 0
        assert message.sequence_number == 1
        assert isinstance(message.lock_token, uuid.UUID)
        assert message.enqueued_time_utc is not None and message.locked_until_utc is not None
        assert abs((message.enqueued_time_utc - sent_at).total_seconds()) < 2
        assert 3 < (message.locked_until_utc - message.enqueued_time_utc).total_seconds() < 7
        assert server.entity("orders").locked_count == 1

        await receiver.complete_message(message)
        with pytest.raises(MessageAlreadySettled):
            await receiver.complete_message(message)

    assert server.entity("orders").active_count == 0


@bounded(20)
async def test_receive_respects_link_credit(server: ServiceBusTestServer, client: ServiceBusClient) -> None:
    queue = server.create_queue("work", lock_duration=10)
    await send(client, "work", *[ServiceBusMessage(f"m{i}") for i in range(5)])

    async with open_receiver(client, "work", prefetch=0) as receiver:
        first = await receive_one(receiver)
        # Without prefetch the SDK asks for exactly one message: only that one is locked.
        assert queue.locked_count == 1
        assert first.sequence_number == 1
        batch = await receiver.receive_messages(max_message_count=2, max_wait_time=RECEIVE_WAIT)
        assert [m.sequence_number for m in batch] == [2, 3]
        assert queue.locked_count == 3
        for message in [first, *batch]:
            await receiver.complete_message(message)

    assert [m.sequence_number for m in queue.messages] == [4, 5]


# -- 2. abandon ----------------------------------------------------------------------------------


@bounded(20)
async def test_abandon_redelivers_with_delivery_count_one(
    server: ServiceBusTestServer, client: ServiceBusClient
) -> None:
    server.create_queue("orders", lock_duration=10)
    await send(client, "orders", ServiceBusMessage("x", message_id="m1"))

    async with open_receiver(client, "orders") as receiver:
        first = await receive_one(receiver)
        await receiver.abandon_message(first)
        again = await receive_one(receiver)
        assert (again.message_id, again.sequence_number) == ("m1", first.sequence_number)
        assert (first.delivery_count, again.delivery_count) == (0, 1)
        assert again.lock_token != first.lock_token
        await receiver.complete_message(again)


# -- 3. dead-letter --------------------------------------------------------------------------------


@bounded(20)
async def test_dead_letter_keeps_reason_and_description_in_the_dead_letter_queue(
    server: ServiceBusTestServer, client: ServiceBusClient
) -> None:
    queue = server.create_queue("orders")
    await send(client, "orders", ServiceBusMessage("bad", message_id="m1", application_properties={"k": "v"}))

    async with open_receiver(client, "orders") as receiver:
        message = await receive_one(receiver)
        await receiver.dead_letter_message(
            message, reason="invalid_body", error_description="missing order id"
        )

    assert queue.active_count == 0
    [dead] = queue.dead_letters
    assert (dead.message_id, dead.dead_letter_reason) == ("m1", "invalid_body")

    async with open_receiver(client, "orders", sub_queue=ServiceBusSubQueue.DEAD_LETTER) as dlq:
        dead_message = await receive_one(dlq)
        assert dead_message.message_id == "m1"
        assert dead_message.dead_letter_reason == "invalid_body"
        assert dead_message.dead_letter_error_description == "missing order id"
        assert dead_message.application_properties[b"k"] == b"v"
        assert dead_message.sequence_number == message.sequence_number
        await dlq.complete_message(dead_message)

    assert queue.dead_letters == []


@bounded(20)
async def test_a_dead_letter_may_take_the_message_over_its_size_limit(
    server: ServiceBusTestServer, client: ServiceBusClient
) -> None:
    """The reason and description are properties of the message, bounded by Service Bus's header
    limits (*Service Bus quotas*), not by the message size limit: the server used to refuse this
    dead-letter, a rule of its own. Header limits: ``test_servicebus_header_limits.py``."""
    queue = server.create_queue("orders", max_message_size=1024)
    await send(client, "orders", ServiceBusMessage(b"x" * 800, message_id="m1"))

    async with open_receiver(client, "orders") as receiver:
        message = await receive_one(receiver)
        await receiver.dead_letter_message(message, reason="too_long", error_description="d" * 500)

    [dead] = queue.dead_letters
    assert (dead.dead_letter_reason, dead.dead_letter_error_description) == ("too_long", "d" * 500)
    assert dead.size > 1024


@bounded(20)
async def test_options_changed_in_place_apply_to_new_locks(
    server: ServiceBusTestServer, client: ServiceBusClient
) -> None:
    queue = server.create_queue("orders", lock_duration=30)
    queue.configure(lock_duration=HELD_LOCK)
    await send(client, "orders", ServiceBusMessage("x"))
    async with open_receiver(client, "orders", prefetch=0) as receiver:
        message = await receive_one(receiver)
        assert message.locked_until_utc is not None and message.enqueued_time_utc is not None
        assert (message.locked_until_utc - datetime.datetime.now(datetime.UTC)).total_seconds() < HELD_LOCK + 0.5
        await receiver.complete_message(message)


@bounded(20)
async def test_max_delivery_count_dead_letters_like_service_bus(
    server: ServiceBusTestServer, client: ServiceBusClient
) -> None:
    queue = server.create_queue("orders", max_delivery_count=2)
    await send(client, "orders", ServiceBusMessage("poison", message_id="p1"))

    async with open_receiver(client, "orders") as receiver:
        counts = []
        for _ in range(2):
            message = await receive_one(receiver)
            counts.append(message.delivery_count)
            await receiver.abandon_message(message)
        assert counts == [0, 1]
        assert await receiver.receive_messages(max_message_count=1, max_wait_time=0.3) == []

    [dead] = queue.dead_letters
    assert dead.message_id == "p1"
    assert dead.dead_letter_reason == "MaxDeliveryCountExceeded"
    assert dead.dead_letter_error_description == "Message could not be consumed after 2 delivery attempts."


# -- 4. locks: expiry, lock lost, renewal ----------------------------------------------------------


def test_lock_durations_outside_five_seconds_to_five_minutes_are_refused(server: ServiceBusTestServer) -> None:
    """Service Bus's LockDuration runs from 5 s (the portal's and the emulator's minimum) to 5 min
    (``CreateQueueOptions.LockDuration``): the server refuses the rest, at creation and update."""
    with pytest.raises(ValueError, match="outside Service Bus's 5-300 s"):
        server.create_queue("short", lock_duration=4.9)
    with pytest.raises(ValueError):
        server.create_queue("long", lock_duration=301)
    queue = server.create_queue("orders", lock_duration=5)
    with pytest.raises(ValueError):
        queue.configure(lock_duration=1)
    assert queue.options.lock_duration == 5


@bounded(20)
async def test_lock_expiry_redelivers_to_the_next_receiver(
    server: ServiceBusTestServer, client: ServiceBusClient
) -> None:
    queue = server.create_queue("orders", lock_duration=LOCK)
    await send(client, "orders", ServiceBusMessage("x", message_id="m1"))

    async with open_receiver(client, "orders", prefetch=0) as first_receiver:
        held = await receive_one(first_receiver)
        assert held.delivery_count == 0
        # The receiver keeps the message without settling it: the lock runs out (the broker's
        # clock is moved past it rather than waited for).
        server.skew_clock(LOCK)
        await eventually(lambda: queue.locked_count == 0, within=2, what="the lock to expire")
        queue.configure(lock_duration=HELD_LOCK)  # the redelivery's lock: time to complete it

        async with open_receiver(client, "orders") as second_receiver:
            redelivered = await receive_one(second_receiver)
            assert redelivered.message_id == "m1"
            assert redelivered.delivery_count == 1
            await second_receiver.complete_message(redelivered)

        with pytest.raises(MessageLockLostError):
            await first_receiver.complete_message(held)

    assert queue.active_count == 0


@bounded(20)
async def test_server_side_lock_loss_is_reported_as_message_lock_lost(
    server: ServiceBusTestServer, client: ServiceBusClient
) -> None:
    """The server, not the SDK's clock, decides: a lock the server lost is refused on settlement."""
    queue = server.create_queue("orders", lock_duration=30)
    await send(client, "orders", ServiceBusMessage("x"))

    async with open_receiver(client, "orders", prefetch=0) as receiver:
        message = await receive_one(receiver)
        queue.expire_all_locks(time.time())
        await eventually(lambda: queue.locked_count == 0, within=2, what="the server to drop the lock")
        assert message.locked_until_utc is not None
        # The SDK's clock still says the lock holds: only the server knows it is gone.
        assert message.locked_until_utc > datetime.datetime.now(datetime.UTC)
        with pytest.raises(MessageLockLostError):
            await receiver.complete_message(message)


@bounded(20)
async def test_renew_message_lock_extends_the_lock(
    server: ServiceBusTestServer, client: ServiceBusClient
) -> None:
    queue = server.create_queue("orders", lock_duration=HELD_LOCK)
    await send(client, "orders", ServiceBusMessage("x"))

    async with open_receiver(client, "orders") as receiver:
        message = await receive_one(receiver)
        first_expiry = message.locked_until_utc
        assert first_expiry is not None
        await asyncio.sleep(HELD_LOCK / 2)  # half the lock gone, renew it: the new expiry moves forward
        new_expiry = await receiver.renew_message_lock(message)
        assert new_expiry > first_expiry
        assert message.locked_until_utc == new_expiry
        # Past the original expiry, the lock still holds.
        await eventually(
            lambda: datetime.datetime.now(datetime.UTC) > first_expiry + datetime.timedelta(seconds=0.3),
            within=HELD_LOCK,
            what="the original expiry to pass",
        )
        assert queue.locked_count == 1
        await receiver.complete_message(message)

    assert queue.active_count == 0


@bounded(30)
async def test_auto_lock_renewer_keeps_a_lock_for_twice_its_length(
    server: ServiceBusTestServer, client: ServiceBusClient
) -> None:
    # 4.5 s: the SDK's renewer wakes once a second and renews when 0.75 x (whole seconds left at
    # registration) remain, so a 2 s lock (1.9 s left -> renew under 0.75 s) lapses between two
    # wake-ups; 2.5 s (2.4 s left -> renew under 1.5 s) is renewed with 0.5 s to spare at worst,
    # which a loaded machine can outrun; 4.5 s (4.4 s left -> renew under 3 s) leaves at least 2 s
    # for the renewal's round trip. Service Bus does not allow locks under 5 s: 5 s it is. The
    # SDK's renewer runs on real time, so this test waits real seconds (two lock lengths).
    lock = LOCK
    queue = server.create_queue("orders", lock_duration=lock)
    await send(client, "orders", ServiceBusMessage("slow work"))

    renewer = AutoLockRenewer(max_lock_renewal_duration=30)
    try:
        async with open_receiver(client, "orders", auto_lock_renewer=renewer) as receiver:
            message = await receive_one(receiver)
            held_since = time.monotonic()
            while time.monotonic() - held_since < 2 * lock:
                assert queue.locked_count == 1, "the lock lapsed while the renewer was running"
                await asyncio.sleep(0.1)
            await receiver.complete_message(message)
            assert message.auto_renew_error is None
    finally:
        await renewer.close()

    assert queue.active_count == 0
    assert queue.dead_letters == []


# -- 5. defer and the management fallback --------------------------------------------------------


@bounded(20)
async def test_defer_then_receive_deferred_and_settle_through_management(
    server: ServiceBusTestServer, client: ServiceBusClient
) -> None:
    queue = server.create_queue("orders")
    await send(client, "orders", ServiceBusMessage("later", message_id="d1"), ServiceBusMessage("other"))

    async with open_receiver(client, "orders") as receiver:
        message = await receive_one(receiver)
        await receiver.defer_message(message)
        assert [m.state for m in queue.deferred] == [MessageState.DEFERRED]

        # Deferred messages are not handed out again by an ordinary receive.
        other = await receive_one(receiver)
        assert other.sequence_number != message.sequence_number
        await receiver.complete_message(other)

        [deferred] = await receiver.receive_deferred_messages([message.sequence_number])
        assert deferred.message_id == "d1"
        assert isinstance(deferred.lock_token, uuid.UUID)
        # Deferred messages settle over $management (com.microsoft:update-disposition).
        await receiver.dead_letter_message(deferred, reason="given_up", error_description="deferred too long")

    assert queue.messages == []
    [dead] = queue.dead_letters
    assert (dead.dead_letter_reason, dead.dead_letter_error_description) == ("given_up", "deferred too long")


# -- 6. scheduled messages --------------------------------------------------------------------------


@bounded(20)
async def test_scheduled_message_becomes_receivable_at_its_time_and_can_be_cancelled(
    server: ServiceBusTestServer, client: ServiceBusClient
) -> None:
    queue = server.create_queue("orders")
    async with open_sender(client, "orders") as sender, open_receiver(client, "orders") as receiver:
        due = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=1)
        [kept] = await sender.schedule_messages(ServiceBusMessage("retry", message_id="r1"), due)
        [cancelled] = await sender.schedule_messages(ServiceBusMessage("never", message_id="r2"), due)
        assert kept != cancelled
        await sender.cancel_scheduled_messages(cancelled)
        assert [m.sequence_number for m in queue.scheduled] == [kept]

        assert await receiver.receive_messages(max_message_count=1, max_wait_time=0.3) == []
        message = await receive_one(receiver, wait=5)
        assert datetime.datetime.now(datetime.UTC) >= due
        # Microsoft's *Message sequencing and timestamps*: the scheduled number "is only valid while
        # the message is in this state"; on activation it gets "a new SequenceNumber".
        assert message.message_id == "r1" and message.sequence_number > kept
        assert message.scheduled_enqueue_time_utc is not None
        assert abs((message.scheduled_enqueue_time_utc - due).total_seconds()) < 0.01
        await receiver.complete_message(message)
        assert await receiver.receive_messages(max_message_count=1, max_wait_time=0.3) == []

    assert queue.scheduled == [] and queue.messages == []


# -- 7. sessions -------------------------------------------------------------------------------------


@bounded(25)
async def test_session_messages_arrive_in_order_to_one_receiver_at_a_time(
    server: ServiceBusTestServer, client: ServiceBusClient
) -> None:
    queue = server.create_queue("orders", requires_session=True, lock_duration=10)
    await send(
        client,
        "orders",
        *[ServiceBusMessage(f"a{i}", session_id="customer-a") for i in range(3)],
        ServiceBusMessage("b0", session_id="customer-b"),
    )

    async with open_receiver(client, "orders", session_id="customer-a") as receiver:
        assert receiver.session.session_id == "customer-a"
        messages = await receiver.receive_messages(max_message_count=3, max_wait_time=RECEIVE_WAIT)
        assert [str(m) for m in messages] == ["a0", "a1", "a2"]
        assert all(m.session_id == "customer-a" for m in messages)

        with pytest.raises(SessionCannotBeLockedError):
            async with open_receiver(client, "orders", session_id="customer-a"):
                pass

        for message in messages:
            await receiver.complete_message(message)

    async with open_receiver(
        client, "orders", session_id=NEXT_AVAILABLE_SESSION, max_wait_time=2
    ) as receiver:
        assert receiver.session.session_id == "customer-b"
        message = await receive_one(receiver)
        assert str(message) == "b0"
        await receiver.complete_message(message)

    assert queue.messages == []


@bounded(10)
async def test_next_available_session_times_out_when_no_session_has_messages(
    server: ServiceBusTestServer, client: ServiceBusClient
) -> None:
    server.create_queue("orders", requires_session=True)
    started = time.monotonic()
    # The server holds the attach for the link's com.microsoft:timeout (from max_wait_time), then
    # refuses it with com.microsoft:timeout, as Service Bus does.
    with pytest.raises(OperationTimeoutError):
        async with open_receiver(client, "orders", session_id=NEXT_AVAILABLE_SESSION, max_wait_time=0.5):
            pass
    assert time.monotonic() - started < 5


@bounded(20)
async def test_session_state_and_lock_renewal(server: ServiceBusTestServer, client: ServiceBusClient) -> None:
    queue = server.create_queue("orders", requires_session=True, lock_duration=HELD_LOCK)
    await send(client, "orders", ServiceBusMessage("x", session_id="s1"))

    async with open_receiver(client, "orders", session_id="s1") as receiver:
        session = receiver.session
        assert await session.get_state() is None
        await session.set_state(b"step-2")
        assert await session.get_state() == b"step-2"
        assert queue.session_state("s1") == b"step-2"

        first_expiry = session.locked_until_utc
        assert first_expiry is not None
        message = await receive_one(receiver)
        await asyncio.sleep(HELD_LOCK / 2)  # half the session lock gone, renew it
        new_expiry = await session.renew_lock()
        assert new_expiry > first_expiry
        await eventually(
            lambda: datetime.datetime.now(datetime.UTC) > first_expiry + datetime.timedelta(seconds=0.3),
            within=HELD_LOCK,
            what="the original session expiry to pass",
        )
        await receiver.complete_message(message)

    assert queue.messages == []


@bounded(20)
async def test_session_lock_expiry_raises_session_lock_lost(
    server: ServiceBusTestServer, client: ServiceBusClient
) -> None:
    queue = server.create_queue("orders", requires_session=True, lock_duration=LOCK)
    await send(client, "orders", ServiceBusMessage("x", session_id="s1"))

    async with open_receiver(client, "orders", session_id="s1") as receiver:
        message = await receive_one(receiver)
        server.skew_clock(LOCK)  # the broker's clock past the session lock, rather than waiting
        await eventually(
            lambda: queue.session_holder("s1") is None, within=2, what="the session lock to expire"
        )
        with pytest.raises(SessionLockLostError):
            await receiver.complete_message(message)

    # The message went back to its session, counted as a delivery.
    await eventually(
        lambda: [(m.locked, m.delivery_count) for m in queue.messages] == [(False, 1)],
        within=2,
        what="the message to return to its session",
    )


@bounded(20)
async def test_server_side_session_lock_loss_detaches_the_receiver(
    server: ServiceBusTestServer, client: ServiceBusClient
) -> None:
    """As Service Bus does, the server detaches the receiver whose session lock it dropped."""
    queue = server.create_queue("orders", requires_session=True, lock_duration=30)
    await send(client, "orders", ServiceBusMessage("x", session_id="s1"))

    async with open_receiver(client, "orders", session_id="s1") as receiver:
        message = await receive_one(receiver)
        queue.expire_all_locks(time.time())
        # The next tick releases the session (the message goes back, counted) and detaches the link.
        await eventually(
            lambda: [m.delivery_count for m in queue.messages] == [1],
            within=2,
            what="the server to drop the session",
        )
        assert receiver.session.locked_until_utc is not None
        # The SDK's clock still says the session lock holds: only the server knows it is gone.
        assert receiver.session.locked_until_utc > datetime.datetime.now(datetime.UTC)
        with pytest.raises(SessionLockLostError):
            await receiver.complete_message(message)


@bounded(20)
async def test_a_session_closed_with_messages_unsettled_returns_them_uncounted(
    server: ServiceBusTestServer, client: ServiceBusClient
) -> None:
    """Microsoft's *Message sessions* page, "delivery count per message in the context of sessions":
    messages not completed when the session is closed: not counted (a session lock that expires:
    counted, ``test_session_lock_expiry_raises_session_lock_lost``). The same for a dropped link."""
    queue = server.create_queue("orders", requires_session=True, lock_duration=30)
    await send(client, "orders", ServiceBusMessage("x", session_id="s1"))
    for _ in range(3):
        async with open_receiver(client, "orders", session_id="s1") as receiver:
            message = await receive_one(receiver)
            assert message.delivery_count == 0
        await eventually(lambda: queue.session_holder("s1") is None, within=5, what="the session to be released")
    assert [(m.locked, m.delivery_count) for m in queue.messages] == [(False, 0)]


# -- 7b. time to live -------------------------------------------------------------------------------


@bounded(20)
async def test_an_expired_message_is_never_delivered_and_is_dropped_or_dead_lettered(
    server: ServiceBusTestServer, client: ServiceBusClient
) -> None:
    """Microsoft's *Message expiration (Time to Live)*: past ExpiresAtUtc (enqueued time + TTL,
    the entity's default being both the default and the ceiling) a message is not retrievable;
    with dead-lettering on expiration it moves to the dead-letter queue with ``TTLExpiredException``."""
    dropping = server.create_queue("dropping", default_message_time_to_live=1.0)
    keeping = server.create_queue("keeping", dead_lettering_on_message_expiration=True)
    await send(client, "dropping", ServiceBusMessage("a", time_to_live=datetime.timedelta(seconds=30)))
    await send(client, "keeping", ServiceBusMessage("b", time_to_live=datetime.timedelta(seconds=1)),
               ServiceBusMessage("c"))
    await eventually(lambda: dropping.messages == [] and len(keeping.messages) == 1, within=5, what="expiry")
    assert [(m.body, m.dead_letter_reason) for m in keeping.dead_letters] == [(b"b", "TTLExpiredException")]
    async with open_receiver(client, "keeping") as receiver:
        message = await receive_one(receiver)
        assert b"".join(message.body) == b"c" and message.time_to_live is None
        await receiver.complete_message(message)


@bounded(20)
async def test_a_locked_message_expires_the_moment_it_is_abandoned(
    server: ServiceBusTestServer, client: ServiceBusClient
) -> None:
    """*Message expiration*: expiry does not affect a locked message; "if the lock expires or the
    message is abandoned, the expiration takes immediate effect"."""
    # The broker's clock is moved past the expiry rather than waited for: a real wait of a short
    # TTL raced the receive on a loaded machine (the message expired before it was locked).
    queue = server.create_queue("orders", dead_lettering_on_message_expiration=True, lock_duration=300)
    await send(client, "orders", ServiceBusMessage("x", time_to_live=datetime.timedelta(seconds=60)))
    try:
        async with open_receiver(client, "orders") as receiver:
            message = await receive_one(receiver)
            assert message.time_to_live == datetime.timedelta(seconds=60)
            server.skew_clock(120.0)  # past the expiry (60 s), within the lock (300 s)
            assert queue.locked_count == 1 and queue.dead_letters == []  # still ours while locked
            await receiver.abandon_message(message)
    finally:
        server.skew_clock(0.0)
    await eventually(lambda: len(queue.dead_letters) == 1, within=2, what="the expiry to apply")
    assert queue.messages == [] and queue.dead_letters[0].dead_letter_reason == "TTLExpiredException"


@bounded(20)
async def test_a_skewed_broker_clock_shows_in_every_time_it_hands_out(
    server: ServiceBusTestServer, client: ServiceBusClient
) -> None:
    server.create_queue("orders", lock_duration=10)
    server.skew_clock(-20.0)  # the broker 20 s behind the host
    try:
        await send(client, "orders", ServiceBusMessage("x"))
        async with open_receiver(client, "orders") as receiver:
            message = await receive_one(receiver)
            assert message.locked_until_utc is not None and message.enqueued_time_utc is not None
            now = datetime.datetime.now(datetime.UTC)
            assert -25 < (message.locked_until_utc - now).total_seconds() < -5
            # both broker times: their difference is the lock duration plus the wait, never less
            assert (message.locked_until_utc - message.enqueued_time_utc).total_seconds() >= 10 - 0.001
            # The SDK itself refuses to settle a message whose locked_until is past on the host's
            # clock, without asking the broker (the adapter corrects its copy: lock_clock.py)
            with pytest.raises(MessageLockLostError):
                await receiver.complete_message(message)
    finally:
        server.skew_clock(0.0)


# -- 8. batches, duplicate detection, size --------------------------------------------------------------


@bounded(20)
async def test_batch_send_stores_each_message_with_its_own_fields(
    server: ServiceBusTestServer, client: ServiceBusClient
) -> None:
    queue = server.create_queue("orders")
    async with open_sender(client, "orders") as sender:
        batch = await sender.create_message_batch()
        for i in range(3):
            batch.add_message(
                ServiceBusMessage(f"m{i}", message_id=f"id-{i}", application_properties={"i": i})
            )
        await sender.send_messages(batch)

    assert [m.message_id for m in queue.messages] == ["id-0", "id-1", "id-2"]
    async with open_receiver(client, "orders") as receiver:
        messages = await receiver.receive_messages(max_message_count=3, max_wait_time=RECEIVE_WAIT)
        assert [(str(m), m.application_properties[b"i"]) for m in messages] == [
            ("m0", 0),
            ("m1", 1),
            ("m2", 2),
        ]
        assert [m.sequence_number for m in messages] == [1, 2, 3]
        for message in messages:
            await receiver.complete_message(message)


@bounded(20)
async def test_a_batch_with_one_refused_message_stores_none_of_it(
    server: ServiceBusTestServer, client: ServiceBusClient
) -> None:
    """Service Bus takes a batch whole or not at all: one message without a session id refuses it."""
    queue = server.create_queue("orders", requires_session=True)
    async with open_sender(client, "orders") as sender:
        batch = await sender.create_message_batch()
        batch.add_message(ServiceBusMessage("fine", session_id="s1"))
        batch.add_message(ServiceBusMessage("no session"))
        with pytest.raises(ServiceBusError, match="requires sessions"):
            await sender.send_messages(batch)
        await sender.send_messages(ServiceBusMessage("alone", session_id="s1"))
    assert [m.body for m in queue.messages] == [b"alone"]


@bounded(20)
async def test_duplicate_detection_drops_a_repeated_message_id(
    server: ServiceBusTestServer, client: ServiceBusClient
) -> None:
    deduplicated = server.create_queue("events", duplicate_detection_window=60)
    plain = server.create_queue("plain")
    for entity in ("events", "plain"):
        async with open_sender(client, entity) as queue_sender:
            await queue_sender.send_messages(ServiceBusMessage("first", message_id="event-1"))
            # Accepted like any send, then dropped where duplicate detection is on.
            await queue_sender.send_messages(ServiceBusMessage("again", message_id="event-1"))
            await queue_sender.send_messages(ServiceBusMessage("other", message_id="event-2"))

    assert [(m.message_id, m.body) for m in deduplicated.messages] == [
        ("event-1", b"first"),
        ("event-2", b"other"),
    ]
    assert len(plain.messages) == 3


@bounded(20)
async def test_a_message_over_the_size_limit_is_refused(
    server: ServiceBusTestServer, client: ServiceBusClient
) -> None:
    queue = server.create_queue("orders", max_message_size=1024)
    async with open_sender(client, "orders") as sender:
        with pytest.raises(MessageSizeExceededError):
            await sender.send_messages(ServiceBusMessage(b"x" * 2048))
        await sender.send_messages(ServiceBusMessage(b"x" * 100))
    assert len(queue.messages) == 1


# -- 9. topics -----------------------------------------------------------------------------------------


@bounded(20)
async def test_topic_send_fans_out_to_every_subscription(
    server: ServiceBusTestServer, client: ServiceBusClient
) -> None:
    server.create_topic("invoices")
    billing = server.create_subscription("invoices", "billing")
    audit = server.create_subscription("invoices", "audit")

    async with client.get_topic_sender("invoices", keep_alive=0) as sender:
        await sender.send_messages(ServiceBusMessage("invoice-1", message_id="i1"))

    assert [m.message_id for m in billing.messages] == ["i1"]
    assert [m.message_id for m in audit.messages] == ["i1"]

    async with client.get_subscription_receiver(
        "invoices", "billing", prefetch_count=1, keep_alive=0, socket_timeout=0.05
    ) as receiver:
        message = await receive_one(receiver)
        assert str(message) == "invoice-1"
        await receiver.complete_message(message)

    assert billing.messages == []
    assert [m.message_id for m in audit.messages] == ["i1"]  # each subscription has its own copy


# -- 10. peek and unknown entities ------------------------------------------------------------------------


@bounded(20)
async def test_peek_shows_messages_without_locking_them(
    server: ServiceBusTestServer, client: ServiceBusClient
) -> None:
    queue = server.create_queue("orders")
    await send(client, "orders", *[ServiceBusMessage(f"m{i}") for i in range(3)])

    async with open_receiver(client, "orders") as receiver:
        peeked = await receiver.peek_messages(max_message_count=2)
        assert [(str(m), m.sequence_number) for m in peeked] == [("m0", 1), ("m1", 2)]
        rest = await receiver.peek_messages(max_message_count=5)
        assert [m.sequence_number for m in rest] == [3]
        assert await receiver.peek_messages(max_message_count=5) == []
    assert queue.locked_count == 0 and len(queue.messages) == 3


@bounded(10)
async def test_unknown_entities_fail_fast(server: ServiceBusTestServer, client: ServiceBusClient) -> None:
    for open_handler in (open_sender, open_receiver):
        started = time.monotonic()
        with pytest.raises(MessagingEntityNotFoundError):
            async with open_handler(client, "missing"):
                pass
        # Refused at attach: only the SDK's connection set-up (about half a second) is spent.
        assert time.monotonic() - started < 3


# -- 11. the server itself ----------------------------------------------------------------------------------


def test_stop_closes_the_reactor_thread() -> None:
    before = {t.name for t in threading.enumerate()}
    server = ServiceBusTestServer().start()
    assert server.port > 0
    assert any(t.name == "servicebus-test-server" for t in threading.enumerate())
    server.stop()
    assert {t.name for t in threading.enumerate()} <= before


@bounded(20)
async def test_a_topic_default_ttl_bounds_its_subscriptions_and_is_not_shown_on_the_message(
    server: ServiceBusTestServer, client: ServiceBusClient
) -> None:
    """*Message expiration*: the entity's default TTL is the default and the ceiling; a topic's
    applies to what its subscriptions keep. Azure shows no TTL the sender did not set."""
    server.create_topic("ledger", default_message_time_to_live=30.0)
    audit = server.create_subscription("ledger", "audit")
    async with client.get_topic_sender("ledger", keep_alive=0) as sender:
        await sender.send_messages(ServiceBusMessage("no-ttl"))
    [held] = audit.messages
    assert held.expires_at - time.time() <= 30.0  # the topic's default applied
    async with client.get_subscription_receiver(
        "ledger", "audit", prefetch_count=1, keep_alive=0, socket_timeout=0.05
    ) as receiver:
        message = await receive_one(receiver)
        assert (message.time_to_live, message.expires_at_utc) == (None, None)
        await receiver.abandon_message(message)
    try:
        server.skew_clock(31.0)
        await eventually(lambda: audit.messages == [], within=5, what="the expiry")
    finally:
        server.skew_clock(0.0)


@bounded(20)
async def test_an_entity_created_without_a_lock_duration_locks_for_sixty_seconds(
    server: ServiceBusTestServer, client: ServiceBusClient
) -> None:
    """``CreateQueueOptions.LockDuration``: 1 minute by default, as on Azure."""
    server.create_queue("plain")
    await send(client, "plain", ServiceBusMessage("x"))
    async with open_receiver(client, "plain") as receiver:
        message = await receive_one(receiver)
        assert message.locked_until_utc is not None and message.enqueued_time_utc is not None
        granted = (message.locked_until_utc - message.enqueued_time_utc).total_seconds()
        assert 59.0 <= granted <= 61.0
        await receiver.complete_message(message)
