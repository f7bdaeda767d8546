"""The relay against the real PostgreSQL with an in-process broker: claims, leases, backoff,
parking, per-key commit order, routing, cleanup, status and health."""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import json
import os
import random
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from typing import Any

import pytest
from psycopg import sql
from psycopg.types.json import Jsonb

from consumer_kit.adapters.memory import MemoryBroker, MemoryPublisher
from consumer_kit.broker.publishing import OutgoingMessage, Publisher
from consumer_kit.errors import ConfigurationError, PublishError
from consumer_kit.outbox_relay import Relay, RouteTarget, relay_pending
from consumer_kit.outbox_relay.store import OutboxStore
from tests.fixtures.harness import throwaway_schema
from tests.fixtures.relay_support import (
    ROOT,
    Event,
    connect,
    relay_settings,
    rows,
    wait_until,
    write_events,
)

MEMORY = "memory://relaytests"


def published_ids(broker: MemoryBroker) -> list[str]:
    return [r.message.message_id for r in broker.published]


class FailingFor(Publisher):
    """Fails every publish whose partition key is in ``bad``; passes the rest to ``inner``."""

    def __init__(self, inner: Publisher, bad: set[str]) -> None:
        self.inner = inner
        self.bad = bad

    async def publish(self, message: OutgoingMessage) -> None:
        if message.partition_key in self.bad:
            # a row-level failure (as for a message no queue can take), not a broker outage
            raise PublishError(f"simulated nack for message_id={message.message_id}", transient=False)
        await self.inner.publish(message)

    async def close(self) -> None:
        return None


class Recording(Publisher):
    """Records (message_id, partition_key, relay, start, end) of every publish, slowly."""

    def __init__(self, name: str, log: list[tuple[str, str | None, str, float, float]]) -> None:
        self.name = name
        self.log = log

    async def publish(self, message: OutgoingMessage) -> None:
        start = time.monotonic()
        await asyncio.sleep(random.uniform(0, 0.004))  # broker latency, widens every window
        self.log.append((message.message_id, message.partition_key, self.name, start,
                         time.monotonic()))

    async def close(self) -> None:
        return None


async def test_publishes_each_row_with_event_id_as_message_id_and_headers(database_url: str) -> None:
    async with throwaway_schema(database_url) as schema:
        traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        async with await connect(database_url) as conn:
            ids = await write_events(conn, schema, [
                Event("billing.events", "invoice.created", partition_key="c-1",
                      payload={"n": 1}, headers={"traceparent": traceparent, "x-app": "a"}),
                Event("billing.events", "invoice.created", payload={"n": 2}),
            ])
        broker = MemoryBroker()
        settings = relay_settings(database_url, schema, MEMORY)
        assert await relay_pending(settings, MemoryPublisher(broker)) == 2

        assert sorted(published_ids(broker)) == sorted(str(i) for i in ids)
        first = next(r.message for r in broker.published if r.message.message_id == str(ids[0]))
        assert first.destination == "billing.events" and first.routing_key == "invoice.created"
        assert json.loads(first.body) == {"n": 1}
        headers = dict(first.headers)
        assert headers["event-id"] == str(ids[0])
        assert headers["message-type"] == "ThingHappened"
        assert headers["operation-key"] == f"op-{ids[0].hex[:8]}"
        assert headers["operation-scope"] == "tenant/thing.do/v1"
        assert headers["correlation-id"] == "corr-1"
        assert headers["partition-key"] == "c-1"
        assert headers["x-app"] == "a"
        assert headers["traceparent"].split("-")[1] == "4bf92f3577b34da6a3ce929d0e0e4736"
        left = await rows(database_url, sql.SQL(
            "SELECT count(*) FROM {} WHERE published_at IS NULL OR claimed_until IS NOT NULL"
        ).format(sql.Identifier(schema, "outbox")).as_string(None))
        assert left == [(0,)]


async def test_failing_row_backs_off_blocks_only_its_key_then_parks_and_requeues(
    database_url: str,
) -> None:
    async with throwaway_schema(database_url) as schema:
        table = f'"{schema}".outbox'
        async with await connect(database_url) as conn:
            bad1, bad2, good1, good2, loose = await write_events(conn, schema, [
                Event("d", partition_key="bad"), Event("d", partition_key="bad"),
                Event("d", partition_key="good"), Event("d", partition_key="good"), Event("d"),
            ])
        broker = MemoryBroker()
        publisher = FailingFor(MemoryPublisher(broker), {"bad"})
        settings = relay_settings(
            database_url, schema, MEMORY, relay_max_attempts=3,
            relay_backoff_base=0.05, relay_backoff_max=0.2, relay_poll_interval=0.05,
        )
        relay = Relay(settings, publisher=publisher)
        task = asyncio.create_task(relay.run())

        async def bad_parked() -> bool:
            found = await rows(database_url, f"SELECT attempts FROM {table} WHERE event_id = %s", bad1)
            return found[0][0] >= 3

        await wait_until(bad_parked, 20, "the failing row to be parked")
        # Other keys and unkeyed rows went through once each, the good key in its order (no order
        # is promised across keys); the bad key's second row waited.
        published = published_ids(broker)
        assert sorted(published) == sorted([str(good1), str(good2), str(loose)]), published
        assert published.index(str(good1)) < published.index(str(good2)), published
        (attempts, last_error, claimed), = await rows(
            database_url, f"SELECT attempts, last_error, claimed_by FROM {table} WHERE event_id = %s",
            bad1)
        assert attempts == 3 and "simulated nack" in last_error and claimed is None
        assert await rows(database_url, f"SELECT attempts, published_at FROM {table} "
                          "WHERE event_id = %s", bad2) == [(0, None)]
        assert relay.counters["publish_failed"] == 3 and relay.counters["parked"] == 1

        store = relay.store
        async with await connect(database_url) as conn:
            status = await store.status(conn)
            assert (status.parked, status.pending) == (1, 1)
            assert [p.event_id for p in await store.parked(conn)] == [bad1]
            publisher.bad.clear()  # the broker is fixed; the operator requeues
            assert await store.requeue_parked(conn) == 1

        await broker_has(broker, {str(bad1), str(bad2)})
        order = published_ids(broker)
        assert order.index(str(bad1)) < order.index(str(bad2))
        relay.request_stop()
        await asyncio.wait_for(task, 10)


class RefusingFor(Publisher):
    """Refuses, permanently, every publish to a destination in ``refused``; passes the rest on."""

    def __init__(self, inner: Publisher, refused: set[str]) -> None:
        self.inner = inner
        self.refused = refused
        self.attempts = 0

    async def publish(self, message: OutgoingMessage) -> None:
        if message.destination in self.refused:
            self.attempts += 1
            raise PublishError(
                f"broker refused message_id={message.message_id}: PRECONDITION_FAILED - "
                "inequivalent arg 'type'", permanent=True,
            )
        await self.inner.publish(message)

    async def close(self) -> None:
        return None


async def test_a_permanent_publish_error_parks_the_row_at_once_with_the_reply(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with throwaway_schema(database_url) as schema:
        table = f'"{schema}".outbox'
        async with await connect(database_url) as conn:
            bad, good = await write_events(conn, schema, [
                Event("wrong", payload={"card": "secret-4111"}), Event("right"),
            ])
        broker = MemoryBroker()
        publisher = RefusingFor(MemoryPublisher(broker), {"wrong"})
        settings = relay_settings(database_url, schema, MEMORY, relay_max_attempts=5,
                                  relay_backoff_base=0.05, relay_backoff_max=0.1)
        relay = Relay(settings, publisher=publisher)
        with caplog.at_level("INFO", logger="consumer_kit.outbox_relay"):
            await relay.run(once=True)
        assert published_ids(broker) == [str(good)]
        assert publisher.attempts == 1  # parked at once: never tried again
        (attempts, last_error), = await rows(
            database_url, f"SELECT attempts, last_error FROM {table} WHERE event_id = %s", bad)
        assert attempts == 5 and "PRECONDITION_FAILED" in last_error
        assert (relay.counters["parked_permanent"], relay.counters["parked"]) == (1, 1)
        assert f"event_id={bad}" in caplog.text and "secret-4111" not in caplog.text


async def broker_has(broker: MemoryBroker, ids: set[str], timeout: float = 10) -> None:
    async def seen() -> bool:
        return ids <= set(published_ids(broker))

    await wait_until(seen, timeout, f"{len(ids)} publishes")


async def test_backoff_doubles_up_to_the_maximum(database_url: str) -> None:
    async with throwaway_schema(database_url) as schema:
        table = f'"{schema}".outbox'
        async with await connect(database_url) as conn:
            (event_id,) = await write_events(conn, schema, [Event("d")])
            store = OutboxStore(schema, relay_id="r1", max_attempts=10, claim_timeout=30,
                                backoff_base=1.0, backoff_max=5.0)
            from consumer_kit.outbox_relay.store import Failure

            delays = []
            for _ in range(5):
                await conn.execute(f"UPDATE {table} SET available_at = now()")
                (row,) = await store.claim(conn, 10)
                assert row.event_id == event_id
                await store.mark_failed(conn, [Failure(row.id, "boom")])
                cur = await conn.execute(
                    f"SELECT extract(epoch FROM available_at - now()), attempts FROM {table}")
                delay, attempts = await cur.fetchone()
                delays.append(round(float(delay)))
            assert delays == [1, 2, 4, 5, 5] and attempts == 5


async def test_transient_failures_back_off_briefly_and_never_park(database_url: str) -> None:
    """A broker outage is not the row's fault: the backoff stops at transient_backoff_max and the
    row stays claimable however often it fails (the chaos run found rows parked, or blocking their
    key for minutes, after many connection closes)."""
    async with throwaway_schema(database_url) as schema:
        table = f'"{schema}".outbox'
        async with await connect(database_url) as conn:
            (event_id,) = await write_events(conn, schema, [Event("d", partition_key="k")])
            store = OutboxStore(schema, relay_id="r1", max_attempts=3, claim_timeout=30,
                                backoff_base=1.0, backoff_max=300.0, transient_backoff_max=2.0)
            from consumer_kit.outbox_relay.store import Failure

            delays = []
            for _ in range(6):
                await conn.execute(f"UPDATE {table} SET available_at = now()")
                (row,) = await store.claim(conn, 10)
                assert row.event_id == event_id
                assert await store.mark_failed(conn, [Failure(row.id, "connection lost", transient=True)]) == []
                cur = await conn.execute(
                    f"SELECT extract(epoch FROM available_at - now()), attempts, last_error FROM {table}")
                delay, attempts, last_error = await cur.fetchone()
                delays.append(round(float(delay)))
            assert delays == [1, 2, 2, 2, 2, 2]
            assert attempts == 2 and last_error == "connection lost"  # below max_attempts: not parked
            assert (await store.status(conn)).parked == 0


async def test_commit_order_not_id_order_per_key(database_url: str) -> None:
    """Id order differs from commit order (T2 took a larger id but committed first): the relay
    follows commit order."""
    async with throwaway_schema(database_url) as schema:
        insert = sql.SQL(
            "INSERT INTO {} (id, event_id, destination, message_type, partition_key, payload) "
            "OVERRIDING SYSTEM VALUE VALUES (%s, %s, 'd', 'T', 'K', %s)"
        ).format(sql.Identifier(schema, "outbox"))
        committed_first, committed_second = uuid.uuid4(), uuid.uuid4()
        async with await connect(database_url) as conn:
            await conn.execute(insert, (2000, committed_first, Jsonb({})))
            await conn.execute(insert, (1000, committed_second, Jsonb({})))
        broker = MemoryBroker()
        await relay_pending(relay_settings(database_url, schema, MEMORY), MemoryPublisher(broker))
        assert published_ids(broker) == [str(committed_first), str(committed_second)]


async def test_same_key_writer_waits_for_open_transaction_other_keys_flow(database_url: str) -> None:
    """The commit-order gap: while T1 (key K) is open, T2 (key K) waits in its INSERT, so the relay
    can never see T2's row before T1's; a row of another key is published meanwhile."""
    async with throwaway_schema(database_url) as schema:
        broker = MemoryBroker()
        relay = Relay(relay_settings(database_url, schema, MEMORY, relay_poll_interval=0.1),
                      publisher=MemoryPublisher(broker))
        task = asyncio.create_task(relay.run())
        t1 = await connect(database_url)
        t2 = await connect(database_url)
        try:
            await t1.execute("BEGIN")
            (k1,) = await _insert_in_open_txn(t1, schema, "K")
            t2_pid = t2.info.backend_pid
            t2_write = asyncio.create_task(write_events(t2, schema, [Event("d", partition_key="K")]))

            async def t2_waits_on_advisory_lock() -> bool:
                found = await rows(database_url, "SELECT wait_event FROM pg_stat_activity "
                                   "WHERE pid = %s", t2_pid)
                return bool(found) and found[0][0] == "advisory"

            await wait_until(t2_waits_on_advisory_lock, 10, "T2 to wait for T1's key lock")
            async with await connect(database_url) as conn:
                (other,) = await write_events(conn, schema, [Event("d", partition_key="other")])
            await broker_has(broker, {str(other)})  # other keys are not stalled by T1
            assert not t2_write.done() and str(k1) not in published_ids(broker)

            await t1.execute("COMMIT")
            (k2,) = await asyncio.wait_for(t2_write, 10)
            await broker_has(broker, {str(k1), str(k2)})
            order = published_ids(broker)
            assert order.index(str(k1)) < order.index(str(k2))
        finally:
            await t1.close()
            await t2.close()
            relay.request_stop()
            await asyncio.wait_for(task, 10)


async def _insert_in_open_txn(conn: Any, schema: str, key: str) -> list[uuid.UUID]:
    event_id = uuid.uuid4()
    await conn.execute(
        sql.SQL("INSERT INTO {} (event_id, destination, message_type, partition_key, payload) "
                "VALUES (%s, 'd', 'T', %s, '{{}}')").format(sql.Identifier(schema, "outbox")),
        (event_id, key),
    )
    return [event_id]


async def test_two_relays_never_hold_the_same_row_and_keys_stay_in_order(database_url: str) -> None:
    async with throwaway_schema(database_url) as schema:
        events = [Event("d", partition_key=f"k{i % 25}", payload={"seq": i // 25}) for i in range(500)]
        events += [Event("d") for _ in range(100)]
        async with await connect(database_url) as conn:
            for start in range(0, len(events), 50):  # 12 transactions, committed in list order
                await write_events(conn, schema, events[start:start + 50])
        log: list[tuple[str, str | None, str, float, float]] = []
        relays = [
            Relay(relay_settings(database_url, schema, MEMORY, relay_batch_size=20,
                                 relay_id=name), publisher=Recording(name, log))
            for name in ("A", "B")
        ]
        await asyncio.gather(*(r.run(once=True) for r in relays))

        ids = [entry[0] for entry in log]
        assert len(ids) == len(set(ids)) == 600  # every row exactly once: never held twice
        assert {entry[2] for entry in log} == {"A", "B"}
        by_key: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
        for message_id, key, _relay, start, end in log:
            if key is not None:
                by_key[key].append((start, end, message_id))
        seq = {str(e.event_id): e.payload["seq"] for e in events if e.partition_key}
        for key, spans in by_key.items():
            spans.sort()
            assert [seq[m] for _, _, m in spans] == list(range(20)), key
            for (_, end, _), (next_start, _, _) in itertools.pairwise(spans):
                assert end <= next_start, f"two publishes of key {key} overlapped"


async def test_destination_map_routes_and_rejects_unknown_destinations(database_url: str) -> None:
    async with throwaway_schema(database_url) as schema:
        async with await connect(database_url) as conn:
            (mapped,) = await write_events(conn, schema, [Event("orders", "order.placed")])
            (stray,) = await write_events(conn, schema, [Event("mystery")])
        targets = {"orders": RouteTarget(exchange="orders.v2", routing_key="fixed")}
        settings = relay_settings(database_url, schema, MEMORY, relay_destinations=targets)
        broker = MemoryBroker()
        with pytest.raises(ConfigurationError, match="mystery"):
            await relay_pending(settings, MemoryPublisher(broker))
        assert broker.published == []

        # The CLI says the same and exits 2 (env map, JSON), before it ever connects to the
        # broker (port 1: nothing listens there).
        result = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "consumer_kit.outbox_relay.cli", "--once", "--schema", schema],
            env={**os.environ, "CONSUMER_KIT_DATABASE_URL": database_url,
                 "CONSUMER_KIT_BROKER_URL": "amqp://guest:guest@127.0.0.1:1/", "PYTHONPATH": str(ROOT),
                 "CONSUMER_KIT_RELAY_DESTINATIONS": json.dumps({"orders": {"exchange": "x"}})},
            capture_output=True, text=True, timeout=60,
        )
        assert result.returncode == 2 and "mystery" in result.stderr

        # A row that appears after start-up with an unknown destination is parked, not guessed.
        async with await connect(database_url) as conn:
            await conn.execute(sql.SQL("DELETE FROM {} WHERE event_id = %s").format(
                sql.Identifier(schema, "outbox")), (stray,))
        relay = Relay(settings, publisher=MemoryPublisher(broker))
        await relay.start(listen=False)
        async with await connect(database_url) as conn:
            (late,) = await write_events(conn, schema, [Event("mystery")])
        await relay.relay_until_idle()
        await relay.close()
        assert [(r.message.destination, r.message.routing_key, r.message.message_id)
                for r in broker.published] == [("orders.v2", "fixed", str(mapped))]
        (attempts, error), = await rows(database_url, sql.SQL(
            "SELECT attempts, last_error FROM {} WHERE event_id = %s"
        ).format(sql.Identifier(schema, "outbox")).as_string(None), late)
        assert attempts == settings.relay_max_attempts and "unknown destination" in error  # parked at once
        assert relay.counters["unknown_destination"] == 1


async def test_cleanup_deletes_only_old_published_rows_in_bounded_batches(database_url: str) -> None:
    async with throwaway_schema(database_url) as schema:
        table = f'"{schema}".outbox'
        async with await connect(database_url) as conn:
            await write_events(conn, schema, [Event("d") for _ in range(12)])
            await conn.execute(f"UPDATE {table} SET published_at = now() - interval '2 days' "
                               "WHERE id <= 7")  # 7 old published
            await conn.execute(f"UPDATE {table} SET published_at = now() WHERE id IN (8, 9)")
            await conn.execute(f"UPDATE {table} SET created_at = now() - interval '9 days', "
                               "attempts = 99 WHERE id = 10")  # old and parked: kept
        relay = Relay(relay_settings(database_url, schema, MEMORY, relay_retention=86400,
                                     relay_cleanup_batch=3), publisher=MemoryPublisher(MemoryBroker()))
        await relay.start(listen=False)
        try:
            assert await relay.cleanup_published() == 7
        finally:
            await relay.close()
        assert await rows(database_url, f"SELECT id FROM {table} ORDER BY id") == [
            (8,), (9,), (10,), (11,), (12,)]


async def test_status_command_reports_pending_parked_age_and_rate(database_url: str) -> None:
    async with throwaway_schema(database_url) as schema:
        table = f'"{schema}".outbox'
        async with await connect(database_url) as conn:
            await write_events(conn, schema, [Event("d") for _ in range(6)])
            await conn.execute(f"UPDATE {table} SET published_at = now() WHERE id <= 2")
            await conn.execute(f"UPDATE {table} SET attempts = 5, last_error = 'nacked' "
                               "WHERE id = 3")
            await conn.execute(f"UPDATE {table} SET attempts = 1, "
                               "created_at = now() - interval '90 seconds' WHERE id = 4")
        result = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "consumer_kit.outbox_relay.cli", "status", "--json", "--schema", schema,
             "--max-attempts", "5"],
            env={**os.environ, "CONSUMER_KIT_DATABASE_URL": database_url, "PYTHONPATH": str(ROOT)},
            capture_output=True, text=True, timeout=60,
        )
        assert result.returncode == 0, result.stderr
        status = json.loads(result.stdout)
        assert (status["pending"], status["retrying"], status["parked"]) == (3, 1, 1)
        assert status["published_last_minute"] == 2
        assert 89 <= status["oldest_pending_age"] < 200
        assert status["parked_rows"][0]["last_error"] == "nacked"


async def test_health_file_and_endpoint_follow_the_loop(database_url: str, tmp_path: Any) -> None:
    async with throwaway_schema(database_url) as schema:
        health_file = tmp_path / "alive"
        relay = Relay(relay_settings(database_url, schema, MEMORY, relay_poll_interval=0.1,
                                     relay_health_file=health_file, relay_health_port=0),
                      publisher=MemoryPublisher(MemoryBroker()))
        task = asyncio.create_task(relay.run())
        try:
            async def touched() -> bool:
                return health_file.exists()

            await wait_until(touched, 10, "the health file")
            first = health_file.stat().st_mtime_ns

            async def touched_again() -> bool:
                return health_file.stat().st_mtime_ns > first

            await wait_until(touched_again, 10, "the health file to be touched again")
            polls_before = relay.counters["wakeups_poll"]
            reader, writer = await asyncio.open_connection("127.0.0.1", relay.health.port)
            writer.write(b"GET / HTTP/1.0\r\n\r\n")
            answer = (await asyncio.wait_for(reader.read(), 5)).decode()
            writer.close()
            polls_after = relay.counters["wakeups_poll"]
            assert answer.startswith("HTTP/1.1 200")
            body = json.loads(answer.split("\r\n\r\n", 1)[1])
            assert body["status"] == "ok" and body["ready"] is True
            # the relay's live counters, as they were while it answered (it keeps polling meanwhile)
            assert polls_before >= 1
            assert polls_before <= body["detail"]["counters"]["wakeups_poll"] <= polls_after
        finally:
            relay.request_stop()
            await asyncio.wait_for(task, 10)


async def test_claims_skip_rows_leased_by_a_live_relay_and_take_over_expired_ones(
    database_url: str,
) -> None:
    async with throwaway_schema(database_url) as schema:
        async with await connect(database_url) as conn:
            await write_events(conn, schema, [Event("d") for _ in range(4)])
            # A's lease is long: B's claims below must not outrun it (with 0.5 s a loaded machine
            # could); its running out is made explicit instead of waited for.
            a = OutboxStore(schema, relay_id="A", max_attempts=5, claim_timeout=30,
                            backoff_base=1, backoff_max=1)
            b = OutboxStore(schema, relay_id="B", max_attempts=5, claim_timeout=30,
                            backoff_base=1, backoff_max=1)
            got_a = await a.claim(conn, 2)
            got_b = await b.claim(conn, 10)
            assert {r.id for r in got_a}.isdisjoint({r.id for r in got_b})
            assert len(got_a) == 2 and len(got_b) == 2
            assert await b.claim(conn, 10) == []

            await conn.execute(sql.SQL(
                "UPDATE {} SET claimed_until = now() - interval '1 second' WHERE claimed_by = 'A'"
            ).format(sql.Identifier(schema, "outbox")))  # A's lease runs out (A died)
            taken = await b.claim(conn, 10)
            assert {r.id for r in taken} == {r.id for r in got_a}
            assert {r.previous_owner for r in taken} == {"A"}


async def test_claims_reach_every_row_past_a_window_of_blocked_ones(database_url: str) -> None:
    """A claim looks at a bounded window after rotating cursors (its cost must not grow with the
    backlog), so rows blocked in front (backed off, leased) must not hide the rows behind them:
    every key, the key '' included, and every unkeyed row comes round within a few claims."""
    async with throwaway_schema(database_url) as schema:
        async with await connect(database_url) as conn:
            table = sql.Identifier(schema, "outbox")
            # 300 blocked rows first (backed off an hour), 300 keyed and unkeyed rows behind them
            await write_events(conn, schema, [Event("d", partition_key=f"blocked-{i:03}")
                                              for i in range(150)]
                               + [Event("d") for _ in range(150)])
            await conn.execute(sql.SQL(
                "UPDATE {} SET available_at = now() + interval '1 hour'").format(table))
            behind = [Event("d", partition_key=f"k-{i:03}") for i in range(149)]
            behind += [Event("d", partition_key="")] + [Event("d") for _ in range(150)]
            await write_events(conn, schema, behind)
            for ordered in (True, False):
                store = OutboxStore(schema, relay_id=f"R{ordered}", max_attempts=5,
                                    claim_timeout=30, backoff_base=1, backoff_max=1)
                claimed: set[uuid.UUID] = set()
                # 300 claimable rows, 10 a claim, each claim sees a window of 100 keys and rows;
                # claim as the relay does: until a claim is empty and its windows reached the end
                for claims in itertools.count(1):
                    got = await store.claim(conn, 10, ordered=ordered)
                    claimed |= {r.event_id for r in got}
                    if store.idle:
                        break
                    assert claims < 100, "the claims never reached the end"
                missing = [e.partition_key for e in behind if e.event_id not in claimed]
                assert not missing, (ordered, missing[:10])
                assert len(claimed) == len(behind)
                await conn.execute(sql.SQL(
                    "UPDATE {} SET claimed_by = NULL, claimed_until = NULL").format(table))


def test_relay_settings_read_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from consumer_kit.outbox_relay.settings import RelaySettings

    monkeypatch.setenv("CONSUMER_KIT_RELAY_BATCH_SIZE", "17")
    monkeypatch.setenv("CONSUMER_KIT_DB_SCHEMA", "shop")
    monkeypatch.setenv("CONSUMER_KIT_RELAY_DESTINATIONS", '{"a": {"exchange": "b"}}')
    settings = RelaySettings()
    assert settings.relay_batch_size == 17 and settings.db_schema == "shop"
    assert settings.relay_destinations == {"a": RouteTarget(exchange="b")}
    assert dt.timedelta(seconds=settings.publish_deadline) < dt.timedelta(
        seconds=settings.relay_claim_timeout)
