"""Edges of the relay claim found by adversarial testing: the relay must not go idle while a row
is claimable, and a parked row stays parked (visible, requeueable) whatever max_attempts says."""

from __future__ import annotations

import uuid

from psycopg import sql

from consumer_kit.adapters.memory import MemoryBroker, MemoryPublisher
from consumer_kit.ops.stats import StatsReader
from consumer_kit.outbox_relay import Relay, RouteTarget
from consumer_kit.outbox_relay.store import OutboxStore
from tests.fixtures.harness import throwaway_schema
from tests.fixtures.relay_support import Event, connect, relay_settings, write_events


async def test_a_relay_woken_again_finds_a_new_row_behind_a_window_of_blocked_keys(database_url: str) -> None:
    """A relay idles only after a whole clean lap of its cursors. Before the fix a lap finished
    once stayed finished: after the next wake-up the first empty claim (one window of keys
    whose heads are parked) said "idle" again and the relay slept with a claimable row behind
    that window, one window per wake-up (blocked keys / window wake-ups of latency)."""
    async with throwaway_schema(database_url, example_tables=False) as schema:
        table = sql.Identifier(schema, "outbox")
        broker = MemoryBroker()
        settings = relay_settings(database_url, schema, "memory://edges", relay_batch_size=1,
                                  relay_max_attempts=5)
        relay = Relay(settings, publisher=MemoryPublisher(broker))
        async with await connect(database_url) as conn:
            # 250 keys whose heads are parked (window: 100 keys a claim)
            await write_events(conn, schema, [Event("d", partition_key=f"a-{i:03}") for i in range(250)])
            await conn.execute(sql.SQL(
                "UPDATE {} SET attempts = 5, available_at = 'infinity'").format(table))
            await relay.start(listen=False)
            try:
                assert await relay.relay_until_idle() == 0
                # a new key sorting after every blocked one
                fresh = await write_events(conn, schema, [Event("d", partition_key="zzz")])
                assert await relay.relay_until_idle() == 1
            finally:
                await relay.close()
        assert sorted(r.message.message_id for r in broker.published) == sorted(str(e) for e in fresh)


async def test_parked_rows_stay_parked_and_requeueable_when_max_attempts_is_raised(database_url: str) -> None:
    """A parked row is due at 'infinity'. Raising RELAY_MAX_ATTEMPTS (or running `outbox-relay
    status|requeue` without the relay's value) used to turn such rows into "pending" rows no claim
    could ever reach: counted as pending and retrying, never parked, never requeued, never
    published, and a keyed one blocked its key for good."""
    async with throwaway_schema(database_url, example_tables=False) as schema:
        table = sql.Identifier(schema, "outbox")
        async with await connect(database_url) as conn:
            ids = await write_events(conn, schema, [Event("d", partition_key="k"), Event("d")])
            await conn.execute(sql.SQL(
                "UPDATE {} SET attempts = 5, available_at = 'infinity', last_error = 'refused'").format(table))
            raised = OutboxStore(schema, relay_id="R", max_attempts=20, claim_timeout=30,
                                 backoff_base=1, backoff_max=1)
            status = await raised.status(conn)
            assert (status.pending, status.parked) == (0, 2)
            assert {r.event_id for r in await raised.parked(conn)} == set(ids)
            pressure = await StatsReader(schema, max_attempts=20).outbox_pressure(conn)
            assert (pressure.pending, pressure.parked) == (0, 2)
            assert await raised.requeue_parked(conn, [ids[0]]) == 1
            assert await raised.requeue_parked(conn) == 1
            claimed: set[uuid.UUID] = set()
            for _ in range(10):
                claimed |= {r.event_id for r in await raised.claim(conn, 10)}
                if raised.idle:
                    break
            assert claimed == set(ids)


async def test_a_row_parked_for_an_unknown_destination_does_not_keep_the_relay_from_starting(
    database_url: str,
) -> None:
    """The start-up check refuses destinations of *pending* rows the map does not know (fail
    fast on a wrong map). A row that arrived later with an unknown destination is parked at once;
    it used to count too, so the next restart of the relay refused to start at all and no event
    of the outbox was published until someone deleted the row or edited the map."""
    async with throwaway_schema(database_url, example_tables=False) as schema:
        broker = MemoryBroker()
        targets = {"orders": RouteTarget(exchange="orders.v2")}
        settings = relay_settings(database_url, schema, "memory://edges", relay_destinations=targets)
        relay = Relay(settings, publisher=MemoryPublisher(broker))
        await relay.start(listen=False)
        try:
            async with await connect(database_url) as conn:
                await write_events(conn, schema, [Event("mystery")])
            await relay.relay_until_idle()
            assert relay.counters["unknown_destination"] == 1  # parked at once
        finally:
            await relay.close()
        async with await connect(database_url) as conn:
            (healthy,) = await write_events(conn, schema, [Event("orders")])
        restarted = Relay(settings, publisher=MemoryPublisher(broker))
        await restarted.run(once=True)
        assert [r.message.message_id for r in broker.published] == [str(healthy)]
