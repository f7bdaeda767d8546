"""The pool's connection class (consumer_kit.db.pg_wait): the socket stays registered with the loop
between waits, on the real PostgreSQL; an idle socket turning readable never spins the loop, an
interrupted statement is cancelled as psycopg cancels it, and a closed socket is dropped."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from consumer_kit.db.pg_wait import KeptWaitConnection


async def _until(predicate, what: str) -> None:
    async with asyncio.timeout(10):  # synchronisation with the server, not a speed goal
        while not predicate():
            await asyncio.sleep(0.01)
    assert predicate(), what


async def test_statements_answer_and_the_socket_stays_registered_between_them(database_url: str) -> None:
    async with await KeptWaitConnection.connect(database_url, autocommit=True) as conn:
        for n in range(20):
            cur = await conn.execute("SELECT %s::int * 2", (n,))
            assert await cur.fetchone() == (n * 2,)
        assert conn._kept_fd == conn.pgconn.socket and conn._kept_loop is asyncio.get_running_loop()
        async with conn.transaction():
            await conn.execute("CREATE TEMP TABLE t (v int) ON COMMIT DROP")
            await conn.execute("INSERT INTO t SELECT generate_series(1, 5000)")
            cur = await conn.execute("SELECT sum(v) FROM t")
            assert await cur.fetchone() == (5000 * 5001 // 2,)
    assert conn._kept_loop is None  # close() dropped the registration


async def test_a_notification_while_idle_drops_the_registration_and_is_read_by_the_next_statement(
    database_url: str,
) -> None:
    async with (
        await KeptWaitConnection.connect(database_url, autocommit=True) as conn,
        await psycopg.AsyncConnection.connect(database_url, autocommit=True) as other,
    ):
        await conn.execute("LISTEN ck_pg_wait_test")
        assert conn._kept_loop is not None
        await other.execute("NOTIFY ck_pg_wait_test, 'hello'")
        await _until(lambda: conn._kept_loop is None, "the readable idle socket was dropped, not spun on")
        cur = await conn.execute("SELECT 1")
        assert await cur.fetchone() == (1,)
        received = []
        conn.add_notify_handler(received.append)
        await conn.execute("SELECT 1")  # psycopg hands over what it read
        assert [n.payload for n in received] in ([], ["hello"])  # delivered before or now: never lost
        await conn.execute("UNLISTEN *")


async def test_a_cancelled_statement_is_cancelled_on_the_server_and_the_connection_stays_usable(
    database_url: str,
) -> None:
    async with await KeptWaitConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute("SELECT 1")
        task = asyncio.create_task(conn.execute("SELECT pg_sleep(60)"))
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as other:
            pid = conn.info.backend_pid
            await _until_active(other, pid)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not conn.broken
        cur = await conn.execute("SELECT 2")
        assert await cur.fetchone() == (2,)


async def _until_active(other: psycopg.AsyncConnection, pid: int) -> None:
    async with asyncio.timeout(10):
        while True:
            cur = await other.execute("SELECT state FROM pg_stat_activity WHERE pid = %s", (pid,))
            row = await cur.fetchone()
            if row and row[0] == "active":
                return
            await asyncio.sleep(0.01)


async def test_a_server_closing_an_idle_connection_breaks_it_without_spinning(database_url: str) -> None:
    async with (
        await KeptWaitConnection.connect(database_url, autocommit=True) as conn,
        await psycopg.AsyncConnection.connect(database_url, autocommit=True) as other,
    ):
        await conn.execute("SELECT 1")
        await other.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))
        await _until(lambda: conn._kept_loop is None, "the closed idle socket was dropped, not spun on")
        with pytest.raises(psycopg.OperationalError):
            await conn.execute("SELECT 1")
        assert conn.broken


async def test_a_statement_larger_than_the_send_buffer_goes_through_psycopgs_write_wait(database_url: str) -> None:
    big = "x" * (16 * 1024 * 1024)  # far past a socket's send buffer: libpq must wait to write
    async with await KeptWaitConnection.connect(database_url, autocommit=True) as conn:
        cur = await conn.execute("SELECT length(%s::text)", (big,))
        assert await cur.fetchone() == (len(big),)
        cur = await conn.execute("SELECT 4")  # and the read waits after it keep working
        assert await cur.fetchone() == (4,)
