"""Attacks on the relay through a socket the broker stops reading (a blocked connection), end to end.

The relay publishes through a TCP proxy (``tests.fixtures.tcp_proxy``) that is paused mid-drain, for less and
for more than the publisher's confirm timeout and the claim lease, then resumed. Besides healthy
events, some go to an exchange whose only queue holds a few messages and nacks the rest
(``reject-publish``) and some to a queue that does not exist (returned). Whatever the pauses do:

* every row marked published is on the broker (counted by event id: none lost);
* every healthy event reaches the broker at least once;
* a nacked or returned publish never marks its row published;
* per partition key, first arrivals come in commit order (the ordered relay);
* nothing is parked but the returned rows (a row error, parked after ``max_attempts``): an outage,
  a nack or a timeout never parks a row (docs/explanation/faults-and-attempts.md).

Also: a relay SIGKILLed while the proxy holds its frames, then a new relay; a graceful stop and a
cancel while the socket is blocked (bounded, nothing marked that is not on the broker).
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import aio_pika
import pytest
from psycopg import sql

from consumer_kit.adapters.rabbitmq import RabbitMQPublisher
from consumer_kit.outbox_relay import Relay, RelaySettings, RouteTarget
from tests.fixtures.harness import throwaway_schema
from tests.fixtures.relay_support import (
    Event,
    Recorder,
    connect,
    relay_settings,
    rows,
    start_relay_process,
    stop_process,
    wait_until,
    write_events,
)
from tests.fixtures.tcp_proxy import TcpProxy
from tests.outbox_relay.test_rabbitmq import assert_key_order, via

pytestmark = [pytest.mark.rabbitmq]

MAX_ATTEMPTS = 3  # low: a timeout, nack or outage that cost attempts would park healthy rows
KEYS = 4
SMALL_QUEUE = 4  # messages the nacking queue holds before it nacks every further publish


@dataclass
class World:
    """One test's broker topology, outbox and proxy."""

    schema: str
    table: str
    ok: str  # the recorder's exchange (healthy events)
    nacking: str  # exchange whose only queue holds SMALL_QUEUE messages, then nacks
    small_queue: str
    missing_queue: str  # no such queue: publishes to it are returned
    proxy: TcpProxy
    broker_via_proxy: str
    rec: Recorder
    seq: dict[str, int] = field(default_factory=dict)  # next seq per partition key
    ids: dict[str, set[str]] = field(default_factory=lambda: {"ok": set(), "nack": set(), "missing": set()})

    def destinations(self) -> dict[str, RouteTarget]:
        return {
            "ok": RouteTarget(exchange=self.ok),
            "nack": RouteTarget(exchange=self.nacking),
            "missing": RouteTarget(exchange="", routing_key=self.missing_queue),
        }

    def wave(self, *, loose: int = 12, per_key: int = 3, nack: int = 4, missing: int = 1,
             pad: int = 0) -> list[Event]:
        """Healthy keyed events (``per_key`` more per key, seq continuing), healthy loose ones
        (``pad`` bytes of payload each), nacked and returned ones, interleaved."""
        keyed: list[Event] = []
        for _ in range(per_key):
            for k in range(KEYS):
                key = f"k{k}"
                s = self.seq.get(key, 0)
                self.seq[key] = s + 1
                keyed.append(Event("ok", "thing.keyed", partition_key=key, payload={"key": key, "seq": s}))
        others = [Event("ok", "thing.loose", payload={"pad": "x" * pad}) for _ in range(loose)]
        others += [Event("nack", "thing.nacked") for _ in range(nack)]
        others += [Event("missing", "thing.returned") for _ in range(missing)]
        events: list[Event] = []
        for i in range(max(len(keyed), len(others))):  # keyed events stay in their own order
            events += keyed[i:i + 1] + others[i:i + 1]
        for e in events:
            self.ids[e.destination].add(str(e.event_id))
        return events

    async def write(self, database_url: str, events: list[Event]) -> None:
        async with await connect(database_url) as conn:
            await write_events(conn, self.schema, events)

    def settings(self, database_url: str, **overrides: Any) -> RelaySettings:
        base: dict[str, Any] = {
            "relay_destinations": self.destinations(),
            "relay_max_attempts": MAX_ATTEMPTS,
            "relay_claim_timeout": 2.5,  # publish deadline 2.0 s
            "settle_timeout": 1.0,  # the publisher's confirm timeout
            "relay_batch_size": 20,
            "relay_max_in_flight": 5,
            "relay_poll_interval": 0.2,
        }
        base.update(overrides)
        return relay_settings(database_url, self.schema, self.broker_via_proxy, **base)

    def env(self, settings: RelaySettings) -> dict[str, str]:
        """The environment of a relay process with ``settings``' windows."""
        destinations = {k: v.model_dump() for k, v in self.destinations().items()}
        return {
            "CONSUMER_KIT_RELAY_DESTINATIONS": json.dumps(destinations),
            "CONSUMER_KIT_RELAY_MAX_ATTEMPTS": str(settings.relay_max_attempts),
            "CONSUMER_KIT_RELAY_CLAIM_TIMEOUT": str(settings.relay_claim_timeout),
            "CONSUMER_KIT_SETTLE_TIMEOUT": str(settings.settle_timeout),
            "CONSUMER_KIT_RELAY_BATCH_SIZE": str(settings.relay_batch_size),
            "CONSUMER_KIT_RELAY_MAX_IN_FLIGHT": str(settings.relay_max_in_flight),
            "CONSUMER_KIT_RELAY_POLL_INTERVAL": str(settings.relay_poll_interval),
            "CONSUMER_KIT_RELAY_BACKOFF_BASE": str(settings.relay_backoff_base),
            "CONSUMER_KIT_RELAY_BACKOFF_MAX": str(settings.relay_backoff_max),
        }

    async def count(self, database_url: str, where: str) -> int:
        return int((await rows(database_url, f"SELECT count(*) FROM {self.table} WHERE {where}"))[0][0])

    async def claimed(self, database_url: str) -> int:
        return await self.count(database_url, "published_at IS NULL AND claimed_until IS NOT NULL")


@asynccontextmanager
async def world(database_url: str, rabbitmq_url: str, unique_name: str) -> AsyncIterator[World]:
    parsed = urlparse(rabbitmq_url)
    proxy = TcpProxy(parsed.hostname or "127.0.0.1", parsed.port or 5672)
    await proxy.start()
    try:
        async with throwaway_schema(database_url) as schema, Recorder(rabbitmq_url, unique_name) as rec:
            connection = await aio_pika.connect(rabbitmq_url)
            try:
                channel = await connection.channel()
                nacking = await channel.declare_exchange(
                    f"{unique_name}.nacking", aio_pika.ExchangeType.TOPIC, durable=True
                )
                small = await channel.declare_queue(
                    f"{unique_name}.small", arguments={"x-max-length": SMALL_QUEUE, "x-overflow": "reject-publish"}
                )
                await small.bind(nacking, "#")
            finally:
                await connection.close()
            yield World(
                schema=schema, table=sql.Identifier(schema, "outbox").as_string(None), ok=unique_name,
                nacking=f"{unique_name}.nacking", small_queue=f"{unique_name}.small",
                missing_queue=f"{unique_name}.missing", proxy=proxy,
                broker_via_proxy=via(rabbitmq_url, proxy.port), rec=rec,
            )
    finally:
        await proxy.close()


def fast_backoff(relay: Relay) -> Relay:
    """Shorter retry delays after a transient failure (0.5 s, not 5 s): the test's waits stay short."""
    relay.store.transient_backoff_max = 0.5
    return relay


async def settled(database_url: str, w: World, timeout: float) -> None:
    """Wait until every healthy row is marked published and every returned row parked."""
    async def done() -> bool:
        ok = await w.count(database_url, "destination = 'ok' AND published_at IS NULL")
        missing = await w.count(
            database_url, "destination = 'missing' AND published_at IS NULL AND "
            f"(attempts >= {MAX_ATTEMPTS} OR available_at = 'infinity')")
        return ok == 0 and missing == len(w.ids["missing"])

    await wait_until(done, timeout, "healthy rows published and returned rows parked")


async def small_queue_ids(rabbitmq_url: str, queue: str) -> list[str]:
    """The message ids in the nacking queue (read without removing them: the queue stays full)."""
    connection = await aio_pika.connect(rabbitmq_url)
    try:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue, passive=True)
        got: list[str] = []
        while (m := await declared.get(no_ack=False, fail=False)) is not None:
            got.append(m.message_id or "")
        return got  # unacked: requeued when the channel closes
    finally:
        await connection.close()


async def check_invariants(database_url: str, rabbitmq_url: str, w: World, *, all_healthy: bool = True) -> None:
    """The attack's assertions (module docstring), read once the relays are stopped."""
    marked = {
        (str(r[0]), r[1]) for r in await rows(
            database_url, f"SELECT event_id, destination FROM {w.table} WHERE published_at IS NOT NULL")
    }
    marked_ok = {e for e, d in marked if d == "ok"}
    await w.rec.wait_for(marked_ok, 10)  # every healthy row marked published is on the broker
    if all_healthy:
        await w.rec.wait_for(w.ids["ok"], 10)  # every healthy event at least once
    on_broker = w.rec.ids()
    assert on_broker <= w.ids["ok"], "a foreign message on the recorder's exchange"
    assert all(r.headers["event-id"] == r.message_id for r in w.rec.received)

    in_small = await small_queue_ids(rabbitmq_url, w.small_queue)
    assert len(in_small) <= SMALL_QUEUE and set(in_small) <= w.ids["nack"]
    marked_nack = {e for e, d in marked if d == "nack"}
    # A row whose publish the broker nacked is never marked: marked ones are in the queue.
    assert marked_nack <= set(in_small), sorted(marked_nack - set(in_small))
    assert not {e for e, d in marked if d == "missing"}, "a returned publish marked its row published"

    parked = {
        str(r[0]) for r in await rows(
            database_url, f"SELECT event_id FROM {w.table} WHERE published_at IS NULL "
            f"AND (attempts >= {MAX_ATTEMPTS} OR available_at = 'infinity')")
    }
    assert parked <= w.ids["missing"], "a row parked by an outage, a nack or a timeout"
    assert_key_order(w.rec.received)


async def every_row_tried(database_url: str, w: World) -> None:
    """Wait until every row written so far was published or tried at least once."""
    async def tried() -> bool:
        return await w.count(database_url, "published_at IS NULL AND attempts = 0") == 0

    await wait_until(tried, 20, "every row to be published or tried once")


@asynccontextmanager
async def blocked_while_claimed(database_url: str, w: World, events: list[Event]) -> AsyncIterator[None]:
    """Pause the proxy, write ``events`` and wait until the relay holds some of them (it is
    publishing into the blocked socket); the socket stays blocked until the block ends."""
    w.proxy.pause()
    try:
        await w.write(database_url, events)

        async def in_flight() -> bool:
            return await w.claimed(database_url) > 0

        await wait_until(in_flight, 10, "the relay to claim rows while the socket is blocked")
        yield
    finally:
        w.proxy.resume()


async def pause_while_claimed(database_url: str, w: World, hold: float, events: list[Event]) -> None:
    """:func:`blocked_while_claimed`, the socket kept blocked ``hold`` seconds."""
    async with blocked_while_claimed(database_url, w, events):
        await asyncio.sleep(hold)  # the fault's duration, not a synchronisation


# -- 1. pauses mid-drain ---------------------------------------------------------------------------


@pytest.mark.parametrize("hold", [0.4, 1.5, 3.5], ids=["under-confirm-timeout", "over-confirm-timeout", "over-lease"])
async def test_pauses_mid_drain_lose_nothing_and_mark_only_what_the_broker_has(
    database_url: str, rabbitmq_url: str, unique_name: str, hold: float
) -> None:
    """Three waves, each written while the socket is blocked, held ``hold`` seconds (shorter than the
    confirm timeout, longer than it, longer than the lease), then resumed."""
    async with world(database_url, rabbitmq_url, unique_name) as w:
        relay = fast_backoff(Relay(w.settings(database_url)))
        task = asyncio.create_task(relay.run())
        try:
            first = w.wave()
            await w.write(database_url, first)
            await w.rec.wait_for([e.event_id for e in first if e.destination == "ok"], 20)
            for _ in range(3):
                await pause_while_claimed(database_url, w, hold, w.wave())
            await settled(database_url, w, 25)

            async def one_connection() -> bool:  # the connections given up on are closed, not leaked
                return w.proxy.connections == 1

            await wait_until(one_connection, 10, "one publisher connection through the proxy")
        finally:
            relay.request_stop()
            await asyncio.wait_for(task, 15)
        assert relay.counters["publish_failed"] > 0  # the pauses did hit publishes in flight
        await check_invariants(database_url, rabbitmq_url, w)


async def test_a_blocked_socket_is_reset_when_short_waits_add_up_to_the_confirm_timeout(
    database_url: str, rabbitmq_url: str, unique_name: str
) -> None:
    """The confirm timeout equals the publish deadline, so no chunk alone waits as long as the
    confirm timeout: each times out with ``PublishTimeout`` (the claim's time ran out first). The
    publisher adds the unanswered waits up across passes and resets the connection once it has
    been silent for the confirm timeout (a second connection through the proxy); counted chunk by
    chunk it never would, and every pass would pile large events onto the blocked socket. After
    the resume, acks and nacks must still match their own messages. (A chunk that cannot even enter
    aiormq's full write queue gives its delivery tags back: tests/adapters/rabbitmq/test_publisher.py.)"""
    async with world(database_url, rabbitmq_url, unique_name) as w:
        settings = w.settings(database_url, relay_claim_timeout=1.0, settle_timeout=0.8,
                              relay_batch_size=8, relay_max_in_flight=4)
        relay = fast_backoff(Relay(settings))
        relay.store.transient_backoff_max = 0.05
        task = asyncio.create_task(relay.run())
        try:
            await w.write(database_url, w.wave())
            await every_row_tried(database_url, w)  # every destination declared on this connection
            connections = w.proxy.accepted
            w.proxy.pause()
            try:
                await w.write(database_url, w.wave(loose=40, pad=700_000, nack=6, missing=1))

                async def reset() -> bool:
                    return w.proxy.accepted > connections

                waited = await wait_until(reset, 25, "the silent connection to be reset")
                assert waited >= settings.settle_timeout
                assert relay.counters["publish_failed"] >= 1
            finally:
                w.proxy.resume()
            await w.write(database_url, w.wave())
            await settled(database_url, w, 25)
        finally:
            relay.request_stop()
            await asyncio.wait_for(task, 15)
        await check_invariants(database_url, rabbitmq_url, w)


async def test_a_relay_stuck_behind_a_blocked_socket_hands_its_rows_to_another_in_key_order(
    database_url: str, rabbitmq_url: str, unique_name: str
) -> None:
    """Relay A publishes through the proxy, relay B straight to the broker. While A's socket is
    blocked (longer than the lease) A keeps claiming rows and writing them into it; B publishes
    whatever A gives up or loses the lease of. When the socket flows again, A's held copies reach
    the broker late (republished copies): still every marked row is on the broker, nothing nacked
    or returned is marked, and per key the first arrivals stay in commit order."""
    async with world(database_url, rabbitmq_url, unique_name) as w:
        # A polls rarely (NOTIFY still wakes it for new rows), B often: a row A gives up is B's next
        a = fast_backoff(Relay(w.settings(database_url, relay_id="A", relay_poll_interval=5.0)))
        # B's settings name the proxy too (the outbox is bound to one broker URL); its publisher
        # goes straight to the broker
        b_settings = w.settings(database_url, relay_id="B", relay_batch_size=2)  # A claims most of a wave
        direct = RabbitMQPublisher(rabbitmq_url, confirm_timeout=b_settings.settle_timeout)
        b = fast_backoff(Relay(b_settings, publisher=direct))
        tasks = [asyncio.create_task(a.run()), asyncio.create_task(b.run())]
        try:
            await w.write(database_url, w.wave())
            await every_row_tried(database_url, w)
            held_by_a: set[str] = set()
            w.proxy.pause()
            try:
                for _ in range(3):
                    await w.write(database_url, w.wave(per_key=4))

                    async def a_holds_rows() -> bool:
                        found = await rows(database_url, f"SELECT event_id FROM {w.table} WHERE "
                                           "published_at IS NULL AND claimed_by = 'A' AND destination = 'ok'")
                        held_by_a.update(str(r[0]) for r in found)
                        return bool(found)

                    await wait_until(a_holds_rows, 10, "relay A to claim rows while its socket is blocked")

                async def b_published_rows_a_held() -> bool:
                    found = await rows(database_url, f"SELECT event_id FROM {w.table} "
                                       "WHERE published_at IS NOT NULL AND claimed_by = 'B'")
                    return bool(held_by_a & {str(r[0]) for r in found})

                await wait_until(b_published_rows_a_held, 15, "relay B to publish rows A held")
                await asyncio.sleep(1.0)  # more of the fault: A keeps writing into the blocked socket
            finally:
                w.proxy.resume()
            await settled(database_url, w, 25)
        finally:
            a.request_stop()
            b.request_stop()
            try:
                await asyncio.wait_for(asyncio.gather(*tasks), 15)
            finally:
                await direct.close()
        assert a.counters["publish_failed"] > 0
        await check_invariants(database_url, rabbitmq_url, w)


# -- 2. SIGKILL while blocked, then a new relay ------------------------------------------------------


async def test_a_relay_sigkilled_while_its_socket_is_blocked_loses_nothing(
    database_url: str, rabbitmq_url: str, unique_name: str
) -> None:
    """Relay A (a process) has chunks in the blocked socket when it is SIGKILLed; the proxy then
    lets the dead connection's held bytes through (or the reset), and relay B takes over after
    the lease."""
    async with world(database_url, rabbitmq_url, unique_name) as w:
        settings = w.settings(database_url, relay_id="B")
        a = await start_relay_process(
            database_url, w.schema, w.broker_via_proxy, "--relay-id", "A", env=w.env(settings),
        )
        try:
            first = w.wave()
            await w.write(database_url, first)
            await w.rec.wait_for([e.event_id for e in first if e.destination == "ok"], 30)
            async with blocked_while_claimed(database_url, w, w.wave(loose=20)):
                a.send_signal(signal.SIGKILL)
                assert await a.wait() == -signal.SIGKILL
                held = await w.claimed(database_url)
        finally:
            await stop_process(a)
        assert held > 0  # A died holding rows (published into the blocked socket, or about to be)

        b = fast_backoff(Relay(settings))
        task = asyncio.create_task(b.run())
        try:
            await pause_while_claimed(database_url, w, 1.5, w.wave())  # and one more pause for B
            await settled(database_url, w, 25)
        finally:
            b.request_stop()
            await asyncio.wait_for(task, 15)
        assert b.counters["taken_over"] > 0
        await check_invariants(database_url, rabbitmq_url, w)


# -- 3. stopping while blocked ---------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["request_stop", "cancel", "sigterm"])
async def test_stopping_a_relay_while_its_socket_is_blocked_is_bounded_and_marks_nothing_unsent(
    database_url: str, rabbitmq_url: str, unique_name: str, how: str
) -> None:
    """A graceful stop finishes the pass in flight within the publish deadline, then closes the
    publisher (at most one confirm timeout on a blocked socket); a cancel ends at once but for
    that close; SIGTERM to a relay process exits 0 within the same bound. Nothing is marked
    published that the broker does not have, and a relay started afterwards publishes the rest."""
    async with world(database_url, rabbitmq_url, unique_name) as w:
        settings = w.settings(database_url, relay_id="S")
        first = w.wave()
        relay: Relay | None = None
        proc = None
        if how == "sigterm":
            proc = await start_relay_process(
                database_url, w.schema, w.broker_via_proxy, "--relay-id", "S", env=w.env(settings),
            )
        else:
            relay = Relay(settings)
            task = asyncio.create_task(relay.run())
        try:
            await w.write(database_url, first)
            await w.rec.wait_for([e.event_id for e in first if e.destination == "ok"], 30)
            async with blocked_while_claimed(database_url, w, w.wave(loose=20)):
                started = time.monotonic()
                if proc is not None:
                    proc.send_signal(signal.SIGTERM)
                    code = await asyncio.wait_for(proc.wait(), 30)
                    assert code == 0
                else:
                    assert relay is not None
                    if how == "cancel":
                        task.cancel()
                    else:
                        relay.request_stop()
                    await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 30)
                took = time.monotonic() - started
        finally:
            if proc is not None:
                await stop_process(proc)
        # pass in flight (publish deadline, plus a reset's close) + the publisher's close
        bound = {"cancel": settings.settle_timeout, "request_stop": settings.publish_deadline + 2 * settings.settle_timeout,
                 "sigterm": settings.publish_deadline + 2 * settings.settle_timeout + 2.0}[how]
        assert took <= bound + 1.0, (how, took, bound)
        if how != "cancel":  # the pass was finished: its rows were marked one way or the other
            assert await w.claimed(database_url) == 0
        await check_invariants(database_url, rabbitmq_url, w, all_healthy=False)

        after = fast_backoff(Relay(w.settings(database_url, relay_id="T")))
        task = asyncio.create_task(after.run())
        try:
            await settled(database_url, w, 25)
        finally:
            after.request_stop()
            await asyncio.wait_for(task, 15)
        await check_invariants(database_url, rabbitmq_url, w)
