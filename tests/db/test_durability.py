"""The start log's durability line (consumer_kit.db.durability) on the real PostgreSQL."""

from __future__ import annotations

import psycopg

from consumer_kit.db.durability import describe_durability


async def test_the_start_says_what_an_acked_commit_survives(database_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        line = await describe_durability(conn)
        assert "no streaming standby" in line and "not the loss of the server" in line  # the test server has none
        await conn.execute("SET synchronous_commit = off")
        assert "can lose acked work" in await describe_durability(conn)
