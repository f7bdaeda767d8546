"""Attacks on settling by lock token after a receive link died (Service Bus entities without
sessions; ``ServiceBusDelivery.off_its_link``, ``EntityPump._recover``, ``Route.replace``).

Through the real azure-servicebus SDK against ``tests/adapters/servicebus/server``: many deliveries in hand
when the connection drops, each settled its own way at its own time; drops and throttles in a row;
an old delivery's settlement after a reconnect (delivery ids restart on the new link) must never
settle a message of the new link; closing the consumer while a replacement receiver is wanted;
a lock that lapsed during the outage. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from azure.servicebus import ServiceBusMessage

from consumer_kit.adapters.servicebus import ServiceBusDelivery
from consumer_kit.adapters.servicebus.renewal import Renewal
from consumer_kit.adapters.servicebus.subscription import EntityPump
from tests.adapters.servicebus.server.fixtures import SBEnv, eventually

LOCK = 5.0  # seconds: Service Bus's shortest lock duration
ACTIONS = ("ack", "abandon", "later", "dead")  # ack, retry(0), retry(delay), dead_letter
DELAY = 1.0  # seconds of a delayed retry


def receive_links(sb: SBEnv, path: str) -> int:
    """Receive links the server has open on ``path`` (every receiver the adapter leaked counts)."""
    protocol = sb.server._protocol  # the test server is ours: its link table
    with sb.server.namespace.lock:
        return sum(1 for consumer in protocol._consumers if consumer.queue.path == path)


def body_of(delivery: ServiceBusDelivery) -> str:
    return delivery.body.decode()


class Gate:
    """Handlers that wait, each on its own event, until the test lets them settle."""

    def __init__(self) -> None:
        self.events: dict[str, asyncio.Event] = {}
        self.first: dict[str, ServiceBusDelivery] = {}
        self.seen: Counter[str] = Counter()

    def event(self, body: str) -> asyncio.Event:
        return self.events.setdefault(body, asyncio.Event())

    async def __call__(self, delivery: ServiceBusDelivery) -> None:
        body = body_of(delivery)
        self.seen[body] += 1
        if self.seen[body] > 1:  # a redelivery or a retry's copy: ack it at once
            await delivery.ack()
            return
        self.first[body] = delivery
        await self.event(body).wait()
        action = body.split("-")[0]
        if action == "ack":
            await delivery.ack()
        elif action == "abandon":
            await delivery.retry(0)
        elif action == "later":
            await delivery.retry(DELAY)
        elif action == "dead":
            await delivery.dead_letter("attack_reason", f"dead-lettered {body}")


@pytest.mark.parametrize("kind", ["queue", "subscription"])
async def test_sixteen_deliveries_in_hand_through_a_dropped_connection_settle_each_as_asked_once(
    sb: SBEnv, kind: str
) -> None:
    """16 deliveries in hand (every slot taken: the pump is idle and does not notice the drop).
    Half settle one after the other, half all at once; each as its body says: ack, retry(0),
    retry(delay) (a scheduled copy on a queue, a held lock on a subscription) or dead-letter.
    Each is settled as asked, once: only the abandoned and retried ones come back (once each), the
    entity ends empty, the dead-letter queue holds exactly the dead-lettered ones, no lock or
    settlement is lost, one receiver replaces the old one and none is left behind."""
    if kind == "queue":
        entity = sb.create_queue(lock_duration=LOCK * 4)
        path = send_to = sb.queue
    else:
        entity = sb.create_subscription("audit", lock_duration=LOCK * 4)
        path, send_to = entity.path, sb.topic
    bodies = [f"{ACTIONS[n % 4]}-{n}" for n in range(16)]
    await sb.send_bodies(*(b.encode() for b in bodies), entity=send_to)
    gate = Gate()
    consumer = await sb.subscribe(gate, path, prefetch=16, settle_timeout=3.0)
    await eventually(lambda: len(gate.first) == 16, within=15, what="16 deliveries in hand")
    assert receive_links(sb, path) == 1
    sb.server.drop_connections()

    one_by_one, at_once = bodies[:8], bodies[8:]
    for body in one_by_one:
        gate.event(body).set()
        await eventually(lambda b=body: gate.first[b].settlement is not None and gate.first[b].released.is_set(),
                         within=10, what=f"the settlement of {body}")
    for body in at_once:
        gate.event(body).set()

    comes_back = [b for b in bodies if b.split("-")[0] in ("abandon", "later")]
    await eventually(lambda: all(gate.seen[b] == 2 for b in comes_back), within=20, what="retries back")
    await eventually(lambda: entity.messages == [], within=15, what="an empty entity")
    assert {b: n for b, n in gate.seen.items()} == {b: 2 if b in comes_back else 1 for b in bodies}
    assert not any(d.lost for d in gate.first.values())
    letters = await sb.dead_letters(4, entity=path)
    assert sorted(str(m) for m in letters) == sorted(b for b in bodies if b.startswith("dead"))
    assert {m.dead_letter_reason for m in letters} == {"attack_reason"}
    assert consumer.counters["locks_lost"] == 0 and consumer.counters["settlements_lost"] == 0
    assert consumer.counters["reconnects"] == 1
    assert consumer.counters["dead_lettered"] == 4
    assert receive_links(sb, path) == 1  # the new one; the old one is gone with its connection


async def send_fresh(sb: SBEnv, *bodies: bytes, entity: str | None = None) -> None:
    """Send through a new sender (the fixture's own went down with a dropped connection)."""
    async with asyncio.timeout(10), sb.client.get_queue_sender(entity or sb.queue, keep_alive=0) as sender:
        await sender.send_messages([ServiceBusMessage(body) for body in bodies])


class Holder:
    """Handlers that hold each delivery (renewed) until the test settles it."""

    def __init__(self) -> None:
        self.by_body: dict[str, list[ServiceBusDelivery]] = {}

    async def __call__(self, delivery: ServiceBusDelivery) -> None:
        self.by_body.setdefault(body_of(delivery), []).append(delivery)
        await delivery.released.wait()  # a handler that returned unsettled would leave it to lapse

    def one(self, body: str) -> ServiceBusDelivery:
        [delivery] = self.by_body[body]
        return delivery

    async def have(self, *bodies: str, within: float = 10) -> None:
        await eventually(lambda: all(b in self.by_body for b in bodies), within=within, what=f"{bodies} in hand")


async def test_an_old_delivery_settled_after_a_reconnect_never_settles_a_message_of_the_new_link(sb: SBEnv) -> None:
    """Delivery ids restart on the new link: old-0 and old-1 had ids 0 and 1 on the dropped link,
    the three new messages get 0, 1, 2 on the new one. Acking old-0 and abandoning old-1 after the
    reconnect (by lock token) must leave every new message locked and untouched; settled afterwards
    (over the new link), each goes exactly once."""
    queue = sb.create_queue(lock_duration=LOCK * 4)
    await sb.send_bodies(b"old-0", b"old-1")
    holder = Holder()
    consumer = await sb.subscribe(holder, prefetch=8, settle_timeout=3.0)  # free slots: the pump sees drops
    await holder.have("old-0", "old-1")
    sb.server.drop_connections()
    await eventually(lambda: consumer.counters["reconnects"] == 1, within=10, what="the new receiver")
    await send_fresh(sb, b"new-0", b"new-1", b"new-2")
    await holder.have("new-0", "new-1", "new-2")
    assert queue.locked_count == 5

    old_0, old_1 = holder.one("old-0"), holder.one("old-1")
    await old_0.ack()
    await old_1.retry(0)
    assert old_0.settlement is not None and not old_0.lost and not old_1.lost
    await eventually(lambda: len(holder.by_body["old-1"]) == 2, within=10, what="old-1 back after its abandon")
    again = holder.by_body["old-1"][1]
    assert (again.delivery_count, again.redelivered) == (2, False)
    # Every new message still there, locked, delivered once: none was settled in old-0's place.
    remaining = sorted(m.body for m in queue.messages)
    assert remaining == [b"new-0", b"new-1", b"new-2", b"old-1"]
    assert queue.locked_count == 4
    assert all(len(holder.by_body[f"new-{n}"]) == 1 for n in range(3))

    for delivery in [*(holder.one(f"new-{n}") for n in range(3)), again]:
        await delivery.ack()
        assert not delivery.lost
    await eventually(lambda: queue.messages == [], within=10, what="an empty queue")
    assert consumer.counters["locks_lost"] == 0 and consumer.counters["settlements_lost"] == 0
    assert receive_links(sb, sb.queue) == 1


async def test_a_receive_throttled_twice_in_a_row_strands_nothing_and_the_pump_goes_on(sb: SBEnv) -> None:
    queue = sb.create_queue(lock_duration=LOCK)
    await sb.send_bodies(b"first")
    holder = Holder()
    consumer = await sb.subscribe(holder, prefetch=4, settle_timeout=2.0)
    await holder.have("first")
    sb.server.throttle(sb.queue, "receive", 2)
    await eventually(lambda: consumer.counters["reconnects"] == 2, within=15, what="two new receivers")
    assert sb.server.throttled(sb.queue, "receive") == 2 and consumer.counters["throttled"] == 2
    await sb.send_bodies(b"second")
    await holder.have("second")
    first = holder.one("first")
    renewals = consumer.counters["renewals"]  # the next ones go through the third receiver, by lock token
    await eventually(lambda: consumer.counters["renewals"] > renewals, within=LOCK * 2, what="a renewal")
    await first.ack()
    await holder.one("second").ack()
    await eventually(lambda: queue.messages == [], within=10, what="an empty queue")
    assert not first.lost and not holder.one("second").lost
    assert [len(v) for v in holder.by_body.values()] == [1, 1]
    assert consumer.counters["locks_lost"] == 0 and consumer.counters["settlements_lost"] == 0
    assert receive_links(sb, sb.queue) == 1 and consumer.ready


async def test_a_replacement_receiver_whose_connection_drops_as_it_opens_is_replaced_again(
    sb: SBEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection drops, and the new receiver's drops too the moment it is open (before the
    pump or any settlement used it). The deliveries in hand, moved onto it, settle on a third;
    new messages are received; nothing is redelivered, no lock or settlement lost."""
    queue = sb.create_queue(lock_duration=LOCK * 4)
    await sb.send_bodies(b"a", b"b", b"c")
    holder = Holder()
    consumer = await sb.subscribe(holder, prefetch=3, settle_timeout=3.0)  # all slots taken: the pump is idle
    await holder.have("a", "b", "c")
    real_open = EntityPump.open
    opened = 0

    async def open_then_drop(self: EntityPump) -> None:
        nonlocal opened
        await real_open(self)
        opened += 1
        if opened == 1:
            sb.server.drop_connections()

    monkeypatch.setattr(EntityPump, "open", open_then_drop)
    sb.server.drop_connections()
    await holder.one("a").ack()  # fails on the dead link; the replacement dies as it opens
    await holder.one("b").dead_letter("attack_reason", "b")
    await holder.one("c").retry(0)
    await eventually(lambda: "c" in holder.by_body and len(holder.by_body["c"]) == 2, within=15, what="c back")
    await holder.by_body["c"][1].ack()
    await send_fresh(sb, b"d")
    await holder.have("d")
    await holder.one("d").ack()
    await eventually(lambda: queue.messages == [], within=10, what="an empty queue")
    assert [d.lost for d in (holder.one("a"), holder.one("b"), *holder.by_body["c"], holder.one("d"))] == [False] * 5
    assert [m.body for m in queue.dead_letters] == [b"b"]
    assert consumer.counters["locks_lost"] == 0 and consumer.counters["settlements_lost"] == 0
    assert opened >= 2 and consumer.counters["reconnects"] >= 2
    assert receive_links(sb, sb.queue) == 1


async def test_a_lock_that_lapsed_during_the_outage_is_reported_lost_and_its_redelivery_completes_once(
    sb: SBEnv,
) -> None:
    queue = sb.create_queue(lock_duration=LOCK)
    await sb.send_bodies(b"x")
    holder = Holder()
    consumer = await sb.subscribe(holder, prefetch=1, settle_timeout=2.0, renew_locks=False)
    await holder.have("x")
    first = holder.one("x")
    sb.server.drop_connections()
    sb.advance_broker_clock(LOCK + 1)  # the lock lapses while the connection is down
    await eventually(lambda: queue.locked_count == 0, within=5, what="the lock to lapse")
    await first.ack()
    assert first.lost
    assert consumer.counters["locks_lost"] == 1
    await eventually(lambda: len(holder.by_body["x"]) == 2, within=15, what="the redelivery")
    again = holder.by_body["x"][1]
    assert (again.delivery_count, again.redelivered) == (2, True)
    await again.ack()
    assert not again.lost
    await eventually(lambda: queue.messages == [], within=10, what="an empty queue")
    assert len(holder.by_body["x"]) == 2 and queue.dead_letters == []
    assert consumer.counters["locks_lost"] == 1


async def test_closing_the_consumer_while_a_replacement_receiver_cannot_be_opened_ends_in_time(sb: SBEnv) -> None:
    """The connection drops and the entity cannot be reached (its receivers and $management
    refused) while a delivery's ack asks for a replacement. Closing the consumer then ends within
    its bounds, and once the entity is back no receiver attaches: nothing was left retrying."""
    queue = sb.create_queue(lock_duration=LOCK * 4)
    await sb.send_bodies(b"x")
    holder = Holder()
    consumer = await sb.subscribe(holder, prefetch=1, settle_timeout=2.0)
    await holder.have("x")
    namespace = sb.server.namespace
    with namespace.lock:
        hidden = namespace._queues.pop(sb.queue.casefold())  # the server is ours
    try:
        sb.server.drop_connections()
        acking = asyncio.create_task(holder.one("x").ack())
        await eventually(lambda: consumer.counters["reconnects"] == 0 and not consumer.ready,
                         within=5, what="the pump to see the receiver dead")
        loop = asyncio.get_running_loop()
        started = loop.time()
        async with asyncio.timeout(15):
            await consumer.close()
        assert loop.time() - started < 10
        async with asyncio.timeout(10):
            await acking
    finally:
        with namespace.lock:
            namespace._queues[sb.queue.casefold()] = hidden
    # Nothing still trying: no receiver attaches now that the entity is back.
    await asyncio.sleep(1.0)  # an absence: the longest backoff step of a retry left behind is 5 s, of the first ones < 1 s
    assert receive_links(sb, sb.queue) == 0
    assert consumer.counters["reconnects"] == 0
    pending = [t for t in asyncio.all_tasks() if "consumer-kit" in t.get_name()]
    assert pending == []
    assert queue.messages != []  # never completed: it comes back once its lock lapses


@pytest.mark.parametrize("link", ["its own link", "by lock token after a drop"])
async def test_a_renewal_that_meets_the_lock_its_own_ack_just_released_is_no_lost_lock(sb: SBEnv, link: str) -> None:
    """The lock keeper renews while the handler's ack is on its way: Service Bus completes the
    message, then answers the renewal "lock lost". That is the ack's doing, not a lost lock:
    nothing counted lost, no warning that the broker redelivers it (it does not)."""
    queue = sb.create_queue(lock_duration=LOCK * 4)
    await sb.send_bodies(b"x")
    holder = Holder()
    consumer = await sb.subscribe(holder, prefetch=2, settle_timeout=3.0)  # a free slot: the pump receives
    await holder.have("x")
    delivery = holder.one("x")
    if link != "its own link":
        sb.server.drop_connections()  # the renewal below moves it to a new receiver
    assert await delivery.renew() is Renewal.RENEWED  # (the receiver's $management link now open)
    # The renewal meets the completed message while the ack's answer is still on its way when the
    # pump's receive holds the connection (not every run: then the ack has returned already).
    acking = asyncio.create_task(delivery.ack())
    await eventually(lambda: queue.messages == [], within=5, what="the completion applied")
    await delivery.renew()
    await acking
    await eventually(lambda: queue.messages == [], within=10, what="the completion")
    assert not delivery.lost and delivery.settlement is not None
    assert consumer.counters["locks_lost"] == 0 and consumer.counters["settlements_lost"] == 0
    assert len(holder.by_body["x"]) == 1


async def test_a_delayed_retry_after_a_drop_is_not_lost_to_the_copy_sender_that_died_with_it(sb: SBEnv) -> None:
    """On a queue a delayed retry is a scheduled copy sent through the pump's copy sender, opened
    on first use and dropped with every other connection. The first copy after the drop meets
    that dead sender."""
    queue = sb.create_queue(lock_duration=LOCK * 4)
    await sb.send_bodies(b"before", b"after")
    holder = Holder()
    consumer = await sb.subscribe(holder, prefetch=2, settle_timeout=3.0)
    await holder.have("before", "after")
    await holder.one("before").retry(DELAY)  # opens the copy sender
    assert consumer.counters["retry_copies"] == 1
    sb.server.drop_connections()
    await holder.one("after").retry(DELAY)
    await eventually(lambda: all(len(holder.by_body.get(b, [])) == 2 for b in ("before", "after")),
                     within=15, what="both copies")
    for delivery in (holder.by_body["before"][1], holder.by_body["after"][1]):
        assert (delivery.delivery_count, delivery.redelivered) == (2, False)
        await delivery.ack()
    await eventually(lambda: queue.messages == [], within=10, what="an empty queue")
    assert not holder.by_body["after"][0].lost
    assert consumer.counters["settlements_lost"] == 0 and consumer.counters["locks_lost"] == 0
    assert consumer.counters["retry_copies"] == 2
