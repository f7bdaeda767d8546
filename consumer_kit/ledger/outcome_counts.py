"""Outcome counts per operation type and minute (ledger migration 8, table ``outcome_counts``).

The ledger keeps one row per operation, so a duplicate, a payload conflict, an in-progress
collision or a key-expiry refusal leaves no row of its own. The worker counts every delivery's
outcome in memory (:class:`consumer_kit.telemetry.minute_counts.MinuteCounts`, by the minute it
was reported in) and adds those counts here in **one** statement per summary interval and once at
shutdown, never per delivery: the hot path never touches this table. Counts of a process killed
without its shutdown (SIGKILL, power loss) since its last flush are lost; the figures are a
lower bound, not a ledger.

Rows: ``(operation_type, outcome, minute, count)``, primary key on the first three; a flush adds
(``count = count + excluded.count``), so any number of workers share one row per minute.
``operation_type`` is ``""`` for a delivery that never decoded (an invalid message).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from psycopg import AsyncConnection, sql

OUTCOME_COUNTS_RETENTION = 7 * 86_400.0
"""Seconds a minute's counts are kept before ``consumer-kit prune`` deletes them (7 days)."""

MinuteKey = tuple[str, str, dt.datetime]
"""``(operation type, outcome, minute)``: the minute as an aware UTC datetime, seconds zero."""

_ADD = """
    INSERT INTO {table} AS t (operation_type, outcome, minute, count)
    SELECT * FROM unnest(%(types)s::text[], %(outcomes)s::text[], %(minutes)s::timestamptz[],
                         %(counts)s::bigint[])
    ON CONFLICT (operation_type, outcome, minute) DO UPDATE SET count = t.count + excluded.count
"""

_READ = """
    SELECT operation_type, outcome, sum(count)::bigint
      FROM {table}
     WHERE minute >= date_trunc('minute', now() - make_interval(secs => %(since)s))
     GROUP BY operation_type, outcome
"""

_COUNT_OLD = "SELECT count(*) FROM {table} WHERE minute < now() - make_interval(secs => %(older_than)s)"

_PRUNE = """
    DELETE FROM {table} WHERE ctid = ANY(ARRAY(
        SELECT ctid FROM {table} WHERE minute < now() - make_interval(secs => %(older_than)s)
         LIMIT %(batch)s FOR UPDATE SKIP LOCKED))
"""


class OutcomeCountBook:
    """The ``outcome_counts`` table of one schema.

    Args:
        schema: the ledger's schema (a plain identifier, already validated).
    """

    def __init__(self, schema: str) -> None:
        self.schema = schema
        table = sql.Identifier(schema, "outcome_counts")
        self._add = sql.SQL(_ADD).format(table=table).as_bytes(None)
        self._read = sql.SQL(_READ).format(table=table).as_bytes(None)
        self._count_old = sql.SQL(_COUNT_OLD).format(table=table).as_bytes(None)
        self._prune = sql.SQL(_PRUNE).format(table=table).as_bytes(None)

    async def add(self, conn: AsyncConnection[Any], counts: Mapping[MinuteKey, int]) -> None:
        """Add ``counts`` (``{(operation type, outcome, minute): count}``) in one statement (an
        autocommit connection commits it alone). Nothing to add: no statement."""
        if not counts:
            return
        keys = list(counts)
        await conn.execute(self._add, {
            "types": [k[0] for k in keys], "outcomes": [k[1] for k in keys],
            "minutes": [k[2] for k in keys], "counts": [counts[k] for k in keys],
        })

    async def read(self, conn: AsyncConnection[Any], *, since: float) -> dict[str, dict[str, int]]:
        """``{operation type: {outcome: count}}`` over the minutes of the last ``since`` seconds
        (whole minutes: the one ``since`` falls in counts in full)."""
        cur = await conn.execute(self._read, {"since": since})
        result: dict[str, dict[str, int]] = {}
        for operation_type, outcome, count in await cur.fetchall():
            result.setdefault(str(operation_type), {})[str(outcome)] = int(count)
        return result

    async def count_old(self, conn: AsyncConnection[Any], *, older_than: float = OUTCOME_COUNTS_RETENTION) -> int:
        """Rows of minutes more than ``older_than`` seconds ago (what a prune would delete)."""
        cur = await conn.execute(self._count_old, {"older_than": older_than})
        row = await cur.fetchone()
        return int(row[0]) if row else 0

    async def prune(
        self, conn: AsyncConnection[Any], batch: int, *, older_than: float = OUTCOME_COUNTS_RETENTION,
    ) -> int:
        """Delete up to ``batch`` rows of minutes more than ``older_than`` seconds ago; returns
        how many (fewer than ``batch``: done)."""
        cur = await conn.execute(self._prune, {"older_than": older_than, "batch": batch})
        return cur.rowcount
