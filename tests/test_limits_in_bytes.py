"""Key, tenant and operation-type limits are UTF-8 bytes the ledger's indexes can always hold: the
largest of each, in incompressible 4-byte characters, runs once through a worker on the real
PostgreSQL (attempt book row included) and its duplicate replays; one byte more is dead-lettered at
once with the reason (no handler call, no retry), never a `54000 index row size` handler fault."""

from __future__ import annotations

import json
import random
from typing import Any, ClassVar

import psycopg
import pytest
from psycopg import sql
from pydantic import BaseModel

from consumer_kit import App, ConfigurationError, Context, Handler, Outcome, Result, RetryableError
from consumer_kit.adapters.memory import MemoryBroker, MemoryConsumer
from consumer_kit.errors import MalformedKey
from consumer_kit.http.keys import KeyFormat
from consumer_kit.http.scope import request_identity, scope_tenant
from consumer_kit.identity import (
    MAX_KEY_BYTES,
    MAX_OPERATION_TYPE_BYTES,
    MAX_TENANT_BYTES,
    MAX_VERSION,
    check_scope_parts,
)
from consumer_kit.outbox import MAX_PARTITION_KEY_BYTES, pending_event
from tests.fixtures.harness import fetch_all, runtime_for, throwaway_schema

QUEUE = "limits.commands"


def four_byte_text(count: int, seed: int) -> str:
    """``count`` different CJK Extension B ideographs (4 bytes of UTF-8 each, NFC-stable): text
    that pglz cannot compress, so an index row holds it at full size."""
    rng = random.Random(seed)
    return "".join(chr(rng.randrange(0x20000, 0x2A6DF)) for _ in range(count))


LARGEST_KEY = four_byte_text(MAX_KEY_BYTES // 4, 1)
LARGEST_TENANT = four_byte_text(MAX_TENANT_BYTES // 4, 2)
LARGEST_TYPE = four_byte_text(MAX_OPERATION_TYPE_BYTES // 4, 3)


class Command(BaseModel):
    n: int


class LargestScopeHandler(Handler[Command]):
    """Keyed by header ``operation-id``, tenant from ``tenant-id``; the longest operation type and
    version there are; the first call of each key fails once, so the attempt book gets its row."""

    operation_type = LARGEST_TYPE
    version = MAX_VERSION
    calls: ClassVar[list[str]] = []

    async def handle(self, message: Command, ctx: Context) -> Result:
        LargestScopeHandler.calls.append(ctx.operation.key)
        if LargestScopeHandler.calls.count(ctx.operation.key) == 1:
            raise RetryableError("first call of this key")
        await ctx.publish(message, destination="limits.events", routing_key="done", partition_key=str(message.n))
        return Result("done")


async def run_all(broker: MemoryBroker, runtime: Any) -> list[Any]:
    reports: list[Any] = []

    async def on_delivery(delivery: Any) -> None:
        reports.append(await runtime.process(delivery))

    consumer = MemoryConsumer(broker)
    await consumer.subscribe(QUEUE, on_delivery, prefetch=1)
    await broker.wait_idle(30)
    await consumer.close()
    return reports


@pytest.mark.postgres
async def test_the_largest_key_and_tenant_of_4_byte_characters_execute_once_and_replay(database_url: str) -> None:
    LargestScopeHandler.calls.clear()
    app = App("limits")
    app.subscribe(QUEUE, LargestScopeHandler())
    body = json.dumps({"n": 1}).encode()
    headers = {"operation-id": LARGEST_KEY, "tenant-id": LARGEST_TENANT}
    async with throwaway_schema(database_url) as schema, runtime_for(
        app, database_url, schema, retry_delays=[0.0]
    ) as rt:
        broker = MemoryBroker()
        broker.send(QUEUE, body, headers=headers)
        first = await run_all(broker, rt)
        broker.send(QUEUE, body, headers=headers)
        (again,) = await run_all(broker, rt)
        [(scope, key, state)] = await fetch_all(database_url, schema, "SELECT scope, key, state FROM operations")
        attempts = await fetch_all(database_url, schema, "SELECT failures FROM attempts WHERE key = %s", LARGEST_KEY)
        outbox = await fetch_all(database_url, schema, "SELECT operation_key FROM outbox")
    assert [r.outcome for r in first] == [Outcome.RETRIED, Outcome.EXECUTED]
    assert again.outcome is Outcome.DUPLICATE
    assert LargestScopeHandler.calls == [LARGEST_KEY, LARGEST_KEY]
    assert (key, state) == (LARGEST_KEY, "completed")
    assert scope == f"{LARGEST_TENANT}/{LARGEST_TYPE}/v{MAX_VERSION}"
    assert len(key.encode()) == MAX_KEY_BYTES and len(LARGEST_TENANT.encode()) == MAX_TENANT_BYTES
    assert attempts == [(1,)] and outbox == [(LARGEST_KEY,)]
    assert broker.dead_letters(QUEUE) == []


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("headers", "reason", "named"),
    [
        ({"operation-id": LARGEST_KEY + "k"}, "invalid_operation_key", "operation key (header 'operation-id') is 513 bytes"),
        ({"operation-id": "kkk" + LARGEST_KEY[:-1] + "é"}, "invalid_operation_key", "is 513 bytes"),  # 2-byte last
        ({"operation-id": "k-1", "tenant-id": LARGEST_TENANT + "t"}, "invalid_header", "tenant (header 'tenant-id') is 201 bytes"),
        ({"operation-id": "k-1", "tenant-id": (LARGEST_TENANT + "t").encode()}, "invalid_header", "'tenant-id'"),
        # the input: 512 characters of key and 200 of tenant, 4 bytes each (2,848 bytes)
        ({"operation-id": four_byte_text(512, 4), "tenant-id": four_byte_text(200, 5)}, "invalid_operation_key",
         "is 2048 bytes"),
        ({"operation-id": "k-1", "tenant-id": four_byte_text(200, 5)}, "invalid_header", "is 800 bytes"),
        ({"operation-id": "k" * 10_000_000}, "invalid_operation_key", "(max 512)"),  # refused before NFC
    ],
)
async def test_one_byte_more_is_dead_lettered_at_once_without_a_handler_call(
    database_url: str, headers: dict[str, Any], reason: str, named: str
) -> None:
    LargestScopeHandler.calls.clear()
    app = App("limits")
    app.subscribe(QUEUE, LargestScopeHandler())
    async with throwaway_schema(database_url) as schema, runtime_for(
        app, database_url, schema, retry_delays=[0.0]
    ) as rt:
        broker = MemoryBroker()
        broker.send(QUEUE, json.dumps({"n": 1}).encode(), headers=headers)
        reports = await run_all(broker, rt)
        rows = await fetch_all(database_url, schema, "SELECT count(*) FROM operations")
    assert [r.outcome for r in reports] == [Outcome.INVALID]  # dead-lettered at once: no retry
    (dead,) = broker.dead_letters(QUEUE)
    assert dead.reason == reason and named in dead.detail, dead.detail
    assert LargestScopeHandler.calls == [] and rows == [(0,)]


@pytest.mark.postgres
async def test_every_index_on_scope_and_key_holds_the_largest_scope_and_key(database_url: str) -> None:
    """Direct inserts of the largest incompressible scope and key into each table that indexes them
    (and twice the key, the margin the limits leave, into the primary key)."""
    scope = f"{LARGEST_TENANT}/{LARGEST_TYPE}/v{MAX_VERSION}"
    async with throwaway_schema(database_url, example_tables=False) as schema:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            await conn.execute(sql.SQL("SET search_path = {}").format(sql.Identifier(schema)))
            for key in (LARGEST_KEY, LARGEST_KEY + four_byte_text(MAX_KEY_BYTES // 4, 6)):
                await conn.execute(
                    "INSERT INTO operations (scope, key, tenant, operation_type, fingerprint, projection_version,"
                    " state) VALUES (%s, %s, %s, %s, 'f', 1, 'completed')", (scope, key, LARGEST_TENANT, LARGEST_TYPE),
                )
            await conn.execute("INSERT INTO attempts (scope, key) VALUES (%s, %s)", (scope, LARGEST_KEY))
            await conn.execute(
                "INSERT INTO evidence (scope, key, name, attempt, worker, facts) VALUES (%s, %s, 'call', 1, 'w', '{}')",
                (scope, LARGEST_KEY),
            )
            with pytest.raises(psycopg.errors.ProgramLimitExceeded):  # what the limits keep away
                await conn.execute("INSERT INTO attempts (scope, key) VALUES (%s, %s)",
                                   (scope, four_byte_text(600, 7)))


def test_operation_types_versions_and_client_ids_are_checked_in_bytes() -> None:
    check_scope_parts(LARGEST_TYPE, MAX_VERSION, owner="H")
    with pytest.raises(ConfigurationError, match="513 bytes of UTF-8"):
        check_scope_parts(LARGEST_TYPE + "x", 1, owner="H")
    for version in (-1, MAX_VERSION + 1, True, "1"):
        with pytest.raises(ConfigurationError, match="version"):
            check_scope_parts("t", version, owner="H")  # type: ignore[arg-type]

    class TooLong(LargestScopeHandler):
        operation_type = LARGEST_TYPE + "x"

    with pytest.raises(ConfigurationError, match="TooLong: operation type of 513 bytes"):
        TooLong()
    assert scope_tenant(LARGEST_TENANT) == LARGEST_TENANT
    with pytest.raises(ConfigurationError, match="201 bytes"):
        scope_tenant(LARGEST_TENANT + "t")
    with pytest.raises(ConfigurationError, match="202 bytes"):  # "/" is escaped to 3 bytes first
        scope_tenant(LARGEST_TENANT[:-1] + "//")
    with pytest.raises(ConfigurationError, match="operation type of"):
        request_identity(client="c", method="POST", template="/" + "x" * 600, api_version=1, key="k",
                         fingerprint="f", projection_version=1)
    key_format = KeyFormat(pattern=r".{1,600}")
    assert key_format.check("k" * MAX_KEY_BYTES)
    with pytest.raises(MalformedKey):
        key_format.check("k" * (MAX_KEY_BYTES + 1))


def test_an_event_partition_key_is_bounded_in_bytes_where_the_handler_writes_it() -> None:
    """The outbox indexes (partition_key, commit_seq): a key a handler took from a producer's field
    is refused in ``ctx.publish`` with the limit, not at COMMIT as an index-row error."""
    fits = pending_event(destination="d", routing_key="", message_type="E", payload={},
                         partition_key=four_byte_text(MAX_PARTITION_KEY_BYTES // 4, 8), headers={})
    assert fits.partition_key is not None
    with pytest.raises(ValueError, match="partition key of 1025 bytes"):
        pending_event(destination="d", routing_key="", message_type="E", payload={},
                      partition_key=four_byte_text(MAX_PARTITION_KEY_BYTES // 4, 8) + "p", headers={})


@pytest.mark.postgres
async def test_the_outbox_index_holds_the_largest_partition_key(database_url: str) -> None:
    async with throwaway_schema(database_url, example_tables=False) as schema:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            await conn.execute(sql.SQL("SET search_path = {}").format(sql.Identifier(schema)))
            await conn.execute(
                "INSERT INTO outbox (event_id, destination, message_type, partition_key, payload)"
                " VALUES (gen_random_uuid(), 'd', 'E', %s, '{}')",
                (four_byte_text(MAX_PARTITION_KEY_BYTES // 4, 9),),
            )
