"""OutboxWriter: code outside a handler (an API endpoint) writes events in its own transaction."""

from __future__ import annotations

import psycopg
import pytest
from psycopg import sql

from consumer_kit import OutboxWriter
from tests.fixtures.harness import throwaway_schema


async def test_events_commit_and_roll_back_with_the_callers_transaction(database_url: str) -> None:
    async with throwaway_schema(database_url, example_tables=False) as schema:
        writer = OutboxWriter(schema)
        outbox = sql.Identifier(schema, "outbox")
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            async with conn.transaction():
                kept = await writer.add(
                    conn, destination="billing.events", routing_key="invoice.created",
                    message_type="InvoiceCreated", payload={"invoice_id": 7}, partition_key="c-1",
                )
            with pytest.raises(RuntimeError):
                async with conn.transaction():
                    await writer.add(conn, destination="billing.events", routing_key="x",
                                     message_type="Lost", payload={})
                    raise RuntimeError("the endpoint failed after writing")
            cur = await conn.execute(
                sql.SQL("SELECT event_id, message_type, payload, partition_key, commit_seq IS NOT NULL"
                        " FROM {}").format(outbox)
            )
            assert await cur.fetchall() == [(kept, "InvoiceCreated", {"invoice_id": 7}, "c-1", True)]
            with pytest.raises(ValueError, match="destination"):
                await writer.add(conn, destination="", routing_key="", message_type="E", payload={})


async def test_writer_refuses_headers_over_the_documented_limit(database_url: str) -> None:
    """Headers the relay could not fit in one broker frame are refused where they are written
    (MAX_EVENT_HEADERS_BYTES of compact JSON), naming the limit and the size; nothing is written."""
    from consumer_kit.outbox import MAX_EVENT_HEADERS_BYTES

    async with throwaway_schema(database_url, example_tables=False) as schema:
        writer = OutboxWriter(schema)
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            # {"h":"x...x"} is 8 bytes of JSON around the value
            at_limit = {"h": "x" * (MAX_EVENT_HEADERS_BYTES - 8)}
            kept = await writer.add(conn, destination="d", routing_key="", message_type="E",
                                    payload={}, headers=at_limit)
            over = {"h": "é" * ((MAX_EVENT_HEADERS_BYTES - 8) // 2 + 1)}  # 2 bytes each in UTF-8
            with pytest.raises(ValueError) as refused:
                await writer.add(conn, destination="d", routing_key="", message_type="E",
                                 payload={}, headers=over)
            assert f"limit is {MAX_EVENT_HEADERS_BYTES} bytes" in str(refused.value)
            assert f"headers are {MAX_EVENT_HEADERS_BYTES + 2} bytes" in str(refused.value)
            cur = await conn.execute(sql.SQL("SELECT event_id FROM {}").format(
                sql.Identifier(schema, "outbox")))
            assert await cur.fetchall() == [(kept,)]


async def test_outbox_notify_can_be_switched_off_per_session(database_url: str) -> None:
    """Sessions opened with ``-c consumer_kit.outbox_notify=off`` (CONSUMER_KIT_OUTBOX_NOTIFY=false)
    write outbox rows without NOTIFY. Notifications arrive in commit order, so if the first one
    comes from the session that left the setting on, the silent session sent none."""
    from consumer_kit.outbox import notify_channel

    async with throwaway_schema(database_url, example_tables=False) as schema:
        writer = OutboxWriter(schema)
        async with (
            await psycopg.AsyncConnection.connect(database_url, autocommit=True) as listener,
            await psycopg.AsyncConnection.connect(
                database_url, autocommit=True, options="-c consumer_kit.outbox_notify=off"
            ) as silent,
            await psycopg.AsyncConnection.connect(database_url, autocommit=True) as loud,
        ):
            await listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(notify_channel(schema))))
            for conn in (silent, loud):
                async with conn.transaction():
                    await writer.add(conn, destination="d", routing_key="", message_type="E", payload={})
            first = [n async for n in listener.notifies(timeout=10, stop_after=1)]
            assert [n.pid for n in first] == [loud.info.backend_pid]
