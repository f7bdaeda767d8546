"""Statements PREPAREd once per session and EXECUTEd through the simple query protocol.

The hot path sends BEGIN together with the claim in one round trip, which needs the simple query
protocol (several statements in one query). Sent as text, the claim would be parsed and planned
on every delivery: about 190 µs of server CPU per claim on the benchmark machine, more than the
round trip it saves. So the claim is ``PREPARE``d by name once per session and the hot path sends
``BEGIN; EXECUTE name(<literals>)``: one round trip, no parse or plan (measured: claim with BEGIN
305-337 µs of client + server CPU, against 509-540 µs as text, 365-382 µs as two round trips,
414-461 µs in a libpq pipeline).

A session can lose its prepared statements: psycopg sends ``DEALLOCATE ALL`` after a ROLLBACK,
DROP or ALTER on a connection where it prepared statements of its own, and a handler may send
``DISCARD ALL``. Every ROLLBACK of consumer-kit's own (and a discarded connection) forgets the
session's statements here (a PREPARE that finds its statement still there is taken as done), and
an EXECUTE that finds its statement gone (``InvalidSqlStatementName``) rolls back, prepares it
again and retries once.

Behind a transaction-mode pooler (:mod:`consumer_kit.db.pooler`) nothing is prepared: the claim is
sent as text after the pooler's BEGIN and its ``SET LOCAL``s, still in one round trip.
"""

from __future__ import annotations

import hashlib
import re
import weakref
from typing import Any

from psycopg import AsyncClientCursor, AsyncConnection
from psycopg import errors as pg_errors
from psycopg.rows import DictRow, dict_row

from consumer_kit.db import pooler

_PLACEHOLDER = re.compile(rb"%\((\w+)\)s")

# The names prepared on each live session (a connection that is closed and replaced starts empty).
_PREPARED_ON: weakref.WeakKeyDictionary[AsyncConnection[Any], set[bytes]] = weakref.WeakKeyDictionary()


def forget(conn: AsyncConnection[Any]) -> None:
    """``conn``'s session may have lost its prepared statements (a ROLLBACK, a discarded
    connection): the next execute prepares again."""
    _PREPARED_ON.pop(conn, None)


class SessionStatement:
    """``statement`` (named ``%(name)s`` placeholders, as psycopg takes them) prepared once per
    session under a name derived from its text; :meth:`begin_and_fetchone` runs it first in a new
    transaction."""

    def __init__(self, prefix: str, statement: bytes) -> None:
        names = list(dict.fromkeys(_PLACEHOLDER.findall(statement)))
        positions = {name: b"$%d" % i for i, name in enumerate(names, 1)}
        self.name = b"%s_%s" % (prefix.encode(), hashlib.sha1(statement).hexdigest()[:12].encode())
        self._prepare = b"PREPARE " + self.name + b" AS " + _PLACEHOLDER.sub(lambda m: positions[m.group(1)], statement)
        self._text = statement
        self._begin_and_execute = (
            b"BEGIN; EXECUTE " + self.name + b"(" + b", ".join(b"%(" + n + b")s" for n in names) + b")"
        )

    async def begin_and_fetchone(self, conn: AsyncConnection[Any], params: dict[str, Any]) -> DictRow | None:
        """``BEGIN; EXECUTE`` in one round trip (parameters bound client-side as literals); the
        first row, or ``None``. The transaction stays open (rolled back only to prepare again).

        Raises:
            psycopg.Error: as the statement itself raises.
        """
        rows = await self.begin_and_fetchall(conn, params)
        return rows[0] if rows else None

    async def begin_and_fetchall(self, conn: AsyncConnection[Any], params: dict[str, Any]) -> list[DictRow]:
        """As :meth:`begin_and_fetchone`, every row (the batch path's claim)."""
        try:
            return await self._run(conn, params)
        except pg_errors.InvalidSqlStatementName:  # deallocated behind our back: prepare again
            forget(conn)
            await conn.execute(b"ROLLBACK", prepare=False)
            return await self._run(conn, params)

    async def _run(self, conn: AsyncConnection[Any], params: dict[str, Any]) -> list[DictRow]:
        begin = pooler.begin_statement(conn)
        if begin is not None:
            return await self._run_as_text(conn, begin, params)
        prepared = _PREPARED_ON.setdefault(conn, set())
        if self.name not in prepared:
            try:
                await conn.execute(self._prepare, prepare=False)
            except pg_errors.DuplicatePreparedStatement:
                pass  # forgotten here, yet still on the session (same name, same text)
            prepared.add(self.name)
        async with AsyncClientCursor(conn, row_factory=dict_row) as client:
            await client.execute(self._begin_and_execute, params)
            client.nextset()  # past BEGIN's result
            return await client.fetchall()

    async def _run_as_text(self, conn: AsyncConnection[Any], begin: bytes, params: dict[str, Any]) -> list[DictRow]:
        async with AsyncClientCursor(conn, row_factory=dict_row) as client:
            await client.execute(begin + b"; " + self._text, params)
            while client.nextset():  # past BEGIN's (and the set_config's) results
                pass
            return await client.fetchall()
