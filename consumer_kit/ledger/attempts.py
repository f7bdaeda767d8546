"""The ``attempts`` table: consumer-kit's own count of what went wrong for an operation.

docs/explanation/faults-and-attempts.md: only a fault of the message may cost it an attempt, so the count
that decides dead-lettering is kept here, per operation (scope, key), not taken from the broker
(whose delivery count also grows with crashes, lost connections and shutdowns):

* ``failures``: handler faults; the operation is dead-lettered when it reaches ``max_deliveries``;
* ``contentions``: lock timeouts, deadlocks, serialization failures (their own, larger bound);
* ``crashes``: times the process died while the operation ran *alone* (a redelivered message runs
  alone, so a crash then can only be its own; a crash with other deliveries in flight is
  attributed to none of them), seen as a run-alone marker left to expire; parked as
  ``crashed_worker`` at ``crash_limit``;
* ``history``: the last :data:`HISTORY_LENGTH` events (time, kind, worker, message id, delivery
  count, error description: never payload values), oldest first.

Each write is one autocommit statement, run after the delivery's own transaction is over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from psycopg import AsyncConnection, sql
from psycopg.rows import dict_row

from consumer_kit.model.identity import OperationIdentity

HISTORY_LENGTH = 20

ALONE_MARKER_TTL = 5.0
"""Seconds a run-alone marker stays live without renewal (renewed every second while the run
lasts): a process that dies leaves it to expire, and the next run then counts the crash."""

# ``history`` keeps its last HISTORY_LENGTH entries after appending ``{new}`` (a jsonb array).
_TRIMMED_HISTORY = """
    (SELECT coalesce(jsonb_agg(e ORDER BY n), '[]'::jsonb) FROM (
        SELECT e, n FROM jsonb_array_elements(a.history || {new}) WITH ORDINALITY AS t(e, n)
         ORDER BY n DESC LIMIT {length}) AS kept)
"""

_ENTRY = """jsonb_build_object('at', now(), 'kind', %(kind)s::text, 'worker', %(worker)s::text,
    'message_id', %(message_id)s::text, 'delivery_count', %(delivery_count)s::int,
    'detail', %(detail)s::text)"""

# Count one handler fault or one contention.
_COUNT = """
    INSERT INTO {table} AS a (scope, key, failures, contentions, history)
    VALUES (%(scope)s, %(key)s, %(failure)s, %(contention)s, jsonb_build_array(""" + _ENTRY + """))
    ON CONFLICT (scope, key) DO UPDATE SET
        failures = a.failures + EXCLUDED.failures,
        contentions = a.contentions + EXCLUDED.contentions,
        history = """ + _TRIMMED_HISTORY.format(new="EXCLUDED.history", length=HISTORY_LENGTH) + """,
        updated_at = now()
    RETURNING failures, contentions, crashes
"""

# Begin a run alone. The marker is renewed while the run lasts (``renew_alone``), so one found
# *expired* means the previous run alone never finished: its process died (a crash, recorded with
# that run's owner and start). A marker still live belongs to a run that is alive elsewhere: no
# row is returned and nothing changes (the caller waits). At ``crash_limit`` the operation is
# parked instead of run, and no new marker is set.
_DIED = "(a.running_until IS NOT NULL AND a.running_until <= now())"
_PARK = "a.crashes + " + _DIED + "::int >= %(crash_limit)s::int"
_START_ALONE = """
    INSERT INTO {table} AS a (scope, key, running_owner, running_since, running_until, history)
    VALUES (%(scope)s, %(key)s, %(worker)s, now(), now() + make_interval(secs => %(ttl)s),
            jsonb_build_array(""" + _ENTRY + """))
    ON CONFLICT (scope, key) DO UPDATE SET
        crashes = a.crashes + """ + _DIED + """::int,
        running_owner = CASE WHEN """ + _PARK + """ THEN NULL ELSE EXCLUDED.running_owner END,
        running_since = CASE WHEN """ + _PARK + """ THEN NULL ELSE now() END,
        running_until = CASE WHEN """ + _PARK + """ THEN NULL ELSE EXCLUDED.running_until END,
        history = """ + _TRIMMED_HISTORY.format(
    new="""CASE WHEN """ + _DIED + """ THEN jsonb_build_array(jsonb_build_object(
                'at', now(), 'kind', 'crash', 'worker', a.running_owner,
                'detail', 'died while running alone since ' || a.running_since::text)) ELSE '[]'::jsonb END
            || jsonb_build_array(jsonb_set(EXCLUDED.history -> 0, '{{kind}}', to_jsonb(
                CASE WHEN """ + _PARK + """ THEN 'parked' ELSE 'run_alone' END)))""",
    length=HISTORY_LENGTH,
) + """,
        updated_at = now()
     WHERE NOT coalesce(a.running_until > now() AND a.running_owner IS DISTINCT FROM EXCLUDED.running_owner, false)
    RETURNING failures, contentions, crashes
"""

_RENEW_ALONE = """
    UPDATE {table} SET running_until = now() + make_interval(secs => %(ttl)s)
     WHERE scope = %(scope)s AND key = %(key)s AND running_owner = %(worker)s
"""

_FINISH_ALONE = """
    UPDATE {table} SET running_owner = NULL, running_since = NULL, running_until = NULL, updated_at = now()
     WHERE scope = %(scope)s AND key = %(key)s AND running_owner = %(worker)s
"""

_FETCH = """
    SELECT failures, contentions, crashes, running_owner, running_since, running_until, history, updated_at
      FROM {table} WHERE scope = %s AND key = %s
"""


@dataclass(frozen=True)
class AttemptCounts:
    """An operation's counts after a write: handler ``failures``, ``contentions``, ``crashes``."""

    failures: int
    contentions: int
    crashes: int


@dataclass(frozen=True)
class AttemptRecord:
    """The whole ``attempts`` row of an operation (for operators and tests)."""

    failures: int
    contentions: int
    crashes: int
    running_owner: str | None
    running_since: Any
    running_until: Any
    history: list[dict[str, Any]]
    updated_at: Any


class AttemptBook:
    """Statements on ``<schema>.attempts``, rendered once per schema.

    Args:
        schema: the ledger's schema (a plain identifier, already validated).
        worker: this process's worker id, recorded with every entry.
    """

    def __init__(self, schema: str, worker: str) -> None:
        table = sql.Identifier(schema, "attempts")
        self.worker = worker
        self._count = sql.SQL(_COUNT).format(table=table).as_bytes(None)
        self._start_alone = sql.SQL(_START_ALONE).format(table=table).as_bytes(None)
        self._finish_alone = sql.SQL(_FINISH_ALONE).format(table=table).as_bytes(None)
        self._renew_alone = sql.SQL(_RENEW_ALONE).format(table=table).as_bytes(None)
        self._fetch = sql.SQL(_FETCH).format(table=table).as_bytes(None)

    async def count_failure(
        self, conn: AsyncConnection[Any], identity: OperationIdentity, *, message_id: str | None,
        delivery_count: int, detail: str,
    ) -> AttemptCounts:
        """Record one handler fault; returns the counts including it."""
        return await self._write(self._count, conn, identity, "failure", message_id, delivery_count,
                                 detail, failure=1, contention=0)

    async def count_contention(
        self, conn: AsyncConnection[Any], identity: OperationIdentity, *, message_id: str | None,
        delivery_count: int, detail: str,
    ) -> AttemptCounts:
        """Record one contention (lock timeout, deadlock, serialization failure)."""
        return await self._write(self._count, conn, identity, "contention", message_id,
                                 delivery_count, detail, failure=0, contention=1)

    async def start_alone(
        self, conn: AsyncConnection[Any], identity: OperationIdentity, *, message_id: str | None,
        delivery_count: int, crash_limit: int, ttl: float = ALONE_MARKER_TTL,
    ) -> AttemptCounts | None:
        """Mark a run alone of a redelivered message as begun, live for ``ttl`` seconds unless
        renewed. ``None`` when another run alone of this operation is live (wait and retry).
        At ``crash_limit`` (``crashes >= crash_limit`` in the result) no marker is set: park it."""
        cur = await conn.execute(
            self._start_alone,
            {"scope": identity.scope, "key": identity.key, "kind": "run_alone", "worker": self.worker,
             "message_id": message_id, "delivery_count": delivery_count,
             "detail": "redelivered: running alone", "crash_limit": crash_limit, "ttl": ttl},
        )
        row = await cur.fetchone()
        return None if row is None else AttemptCounts(*row)

    async def renew_alone(
        self, conn: AsyncConnection[Any], identity: OperationIdentity, ttl: float = ALONE_MARKER_TTL
    ) -> bool:
        """Keep this worker's run-alone marker live for ``ttl`` more seconds."""
        cur = await conn.execute(
            self._renew_alone, {"scope": identity.scope, "key": identity.key, "worker": self.worker, "ttl": ttl}
        )
        return cur.rowcount == 1

    async def finish_alone(self, conn: AsyncConnection[Any], identity: OperationIdentity) -> None:
        """Clear this worker's run-alone marker: the run ended without the process dying."""
        await conn.execute(
            self._finish_alone, {"scope": identity.scope, "key": identity.key, "worker": self.worker}
        )

    async def fetch(self, conn: AsyncConnection[Any], scope: str, key: str) -> AttemptRecord | None:
        """The operation's row, or ``None`` when nothing ever went wrong for it."""
        async with conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(self._fetch, (scope, key))
            row = await cur.fetchone()
        return None if row is None else AttemptRecord(**row)

    async def _write(
        self, statement: bytes, conn: AsyncConnection[Any], identity: OperationIdentity, kind: str,
        message_id: str | None, delivery_count: int, detail: str, **extra: Any,
    ) -> AttemptCounts:
        cur = await conn.execute(
            statement,
            {
                "scope": identity.scope, "key": identity.key, "kind": kind, "worker": self.worker,
                "message_id": message_id, "delivery_count": delivery_count, "detail": detail[:300],
                **extra,
            },
        )
        row = await cur.fetchone()
        assert row is not None  # an upsert always returns its row
        return AttemptCounts(*row)
