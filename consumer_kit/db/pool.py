"""The worker's PostgreSQL connections: the pool, the bounds on consumer-kit's own statements, the
reset that returns a connection as it went in, and the probe that says when writes work again.

Every connection is opened with TCP keepalives and ``tcp_user_timeout`` so a peer that vanished is
noticed by the kernel, and every statement of consumer-kit's own is bounded on the client side
(``statement_timeout`` seconds): a database or network that stops answering is an environment
fault, never a hang. psycopg answers a cancelled statement by asking the server to cancel it for
up to 5 s, then closes the connection, so a bounded statement returns within
``statement_timeout + 5`` seconds at worst.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, cast

import psycopg
from psycopg_pool import AsyncConnectionPool

from consumer_kit.codec.redaction import redact, redact_url
from consumer_kit.db import pooler, prepared
from consumer_kit.db.deadlines import overran, step_bound
from consumer_kit.db.pg_wait import KeptWaitConnection
from consumer_kit.errors import ConfigurationError, StatementTimeout
from consumer_kit.settings import Settings

BEGIN = b"BEGIN"
ROLLBACK = b"ROLLBACK"
COMMIT = b"COMMIT"
# A handler may change its session (SET without LOCAL, SET ROLE, a session advisory lock, LISTEN, a
# WITH HOLD cursor). Sent with the COMMIT in one round trip (the simple query protocol runs several
# statements), so the next delivery on this connection starts from the pool's own settings. RESET
# goes back to the values the connection was opened with (lock_timeout, search_path, role).
COMMIT_AND_RESET = (
    b"CLOSE ALL; RESET ALL; RESET ROLE; UNLISTEN *; SELECT pg_advisory_unlock_all(); COMMIT"
)
# A rolled-back transaction undoes SET, SET ROLE and LISTEN itself; session advisory locks stay.
ROLLBACK_AND_RESET = b"ROLLBACK; SELECT pg_advisory_unlock_all()"


class bounded:
    """Bound a block of consumer-kit's own database work to ``seconds`` (``async with``): a
    step of the delivery's one timer inside a delivery's transaction
    (:mod:`consumer_kit.db.deadlines`), else an ``asyncio.timeout``.

    Raises:
        StatementTimeout: the block overran (an environment fault); the caller discards the
            connection it was using.
    """

    __slots__ = ("_scope", "_seconds", "_what")

    def __init__(self, seconds: float, what: str) -> None:
        self._seconds, self._what = seconds, what
        self._scope = step_bound(seconds)

    async def __aenter__(self) -> None:
        await self._scope.__aenter__()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            await self._scope.__aexit__(exc_type, exc, tb)
        except TimeoutError:
            if overran(self._scope):  # ours, not a TimeoutError raised inside the block
                raise StatementTimeout(f"{self._what} did not answer within {self._seconds:g} s") from None
            raise
        if exc_type is TimeoutError and overran(self._scope):  # the block's own TimeoutError, past the bound
            raise StatementTimeout(f"{self._what} did not answer within {self._seconds:g} s") from None


async def discard(conn: psycopg.AsyncConnection[Any]) -> None:
    """Close ``conn`` so the pool replaces it (its state is unknown)."""
    prepared.forget(conn)
    try:
        await conn.close()
    except Exception:  # noqa: BLE001 - it is being thrown away
        pass


def session_settings(settings: Settings, search_path: str | None) -> dict[str, str]:
    """The settings every worker session runs with (name -> value as PostgreSQL reads it).

    ``lock_timeout`` (at least 1 ms: PostgreSQL reads 0 as "no limit") bounds how long a claim
    waits on a concurrent claimer of the same key; ``idle_in_transaction_session_timeout``
    (``Settings.effective_idle_in_transaction_timeout``) ends the session of a process frozen
    inside a transaction (SIGSTOP, a paused VM), which would otherwise hold its claim's row lock
    for as long as it stays frozen. With ``settings.outbox_notify`` off, outbox writes send no
    NOTIFY; ``search_path`` sets where the handlers' unqualified table names resolve.
    """
    local = {
        "lock_timeout": str(max(1, round(settings.lock_timeout * 1000))),
        "idle_in_transaction_session_timeout": str(
            max(1, round(settings.effective_idle_in_transaction_timeout * 1000))
        ),
    }
    if not settings.outbox_notify:
        local["consumer_kit.outbox_notify"] = "off"
    if search_path:
        local["search_path"] = search_path
    return local


def connection_options(settings: Settings, search_path: str | None) -> dict[str, Any]:
    """libpq keyword arguments of every worker connection.

    Direct: :func:`session_settings` as the ``options`` startup parameter. Behind a
    transaction-mode pooler (:mod:`consumer_kit.db.pooler`): no ``options`` (the settings go in
    every transaction instead) and no psycopg prepared statements. Keepalives and
    ``tcp_user_timeout`` make a dead peer fail the connection instead of leaving it open.
    """
    kwargs: dict[str, Any] = {
        "autocommit": True,
        "connect_timeout": max(2, round(settings.statement_timeout)),
        "keepalives": 1,
        "keepalives_idle": 10,
        "keepalives_interval": 5,
        "keepalives_count": 3,
        "tcp_user_timeout": round(settings.statement_timeout * 1000),
    }
    if pooler.in_transaction_mode(settings):
        kwargs["prepare_threshold"] = None
    else:
        kwargs["options"] = " ".join(f"-c {k}={v}" for k, v in session_settings(settings, search_path).items())
    return kwargs


async def open_pool(
    settings: Settings, database_url: str, *, size: int | None = None, search_path: str | None = None
) -> AsyncConnectionPool:
    """Open the worker's autocommit connection pool (options: :func:`connection_options`).

    ``size`` defaults to ``settings.effective_pool_size`` (concurrency + 2). ``search_path`` (e.g.
    ``"app,public"``) sets where the handlers' unqualified table names resolve. With
    ``settings.outbox_notify`` off, the sessions' outbox writes send no NOTIFY.

    Raises:
        ConfigurationError: PostgreSQL cannot be reached or refuses the URL (checked with one
            connection first, so a wrong URL fails at once instead of after the pool's timeout).
    """
    kwargs = connection_options(settings, search_path)
    await _check_reachable(database_url, kwargs)
    configure = None
    if pooler.in_transaction_mode(settings):
        begin = pooler.begin_with(session_settings(settings, search_path))

        async def configure(conn: psycopg.AsyncConnection[Any]) -> None:
            pooler.register(conn, begin)

    pool: AsyncConnectionPool = cast(AsyncConnectionPool, AsyncConnectionPool(
        database_url,
        min_size=1,
        max_size=size or settings.effective_pool_size,
        kwargs=kwargs,
        configure=configure,
        connection_class=KeptWaitConnection,  # one loop registration per connection, not per wait
        open=False,
        name="consumer-kit",
        timeout=settings.statement_timeout,
    ))  # of KeptWaitConnection, an AsyncConnection
    await pool.open(wait=True, timeout=30)
    return pool


async def probe_writable(database_url: str, *, timeout: float) -> str | None:
    """``None`` when a new session on ``database_url`` can write; else why not (one line).

    A new session is what the pool will open, so it tells the truth after a fail-over (a demoted
    node, ``default_transaction_read_only``, recovery) where an old session might not.
    """
    try:
        async with bounded(timeout, "the database probe"):
            conn = await psycopg.AsyncConnection.connect(
                database_url, autocommit=True, connect_timeout=max(2, round(timeout))
            )
            try:
                cur = await conn.execute(
                    "SELECT pg_is_in_recovery(), current_setting('transaction_read_only')"
                )
                row = await cur.fetchone()
            finally:
                await conn.close()
    except (psycopg.Error, StatementTimeout, OSError) as exc:
        return _first_line(exc)
    if row is None:
        return "no answer"
    in_recovery, read_only = row
    if in_recovery:
        return "the server is in recovery (a standby)"
    if read_only == "on":
        return "new sessions are read-only (default_transaction_read_only)"
    return None


async def _check_reachable(database_url: str, kwargs: dict[str, Any]) -> None:
    """One connection opened as the pool opens its own (``kwargs``: its startup parameters)."""
    try:
        conn = await psycopg.AsyncConnection.connect(database_url, **{**kwargs, "connect_timeout": 10})
    except (psycopg.OperationalError, psycopg.ProgrammingError) as exc:
        why = _first_line(exc)
        if "startup parameter" in why:  # PgBouncer refusing `options`
            why += " (a pooler in transaction mode: set CONSUMER_KIT_DATABASE_POOLER=transaction)"
        raise ConfigurationError(f"cannot connect to PostgreSQL at {redact_url(database_url)}: {why}") from None
    await conn.close()


def _first_line(exc: BaseException) -> str:
    """The first line of a driver error, secrets masked: libpq may quote the DSN it refused."""
    return redact((str(exc).strip().splitlines() or [type(exc).__name__])[0])[:300]
