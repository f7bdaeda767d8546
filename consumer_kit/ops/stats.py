"""What operators and the gauges read about pressure: outcome counts per operation type, stuck and
parked operations, outbox lag. Used by ``consumer-kit stats`` and
:mod:`consumer_kit.ops.gauges`. Read-only; statements built once per schema with
:mod:`psycopg.sql`.

Where each number comes from (the ledger holds one row per operation, not one per delivery, so
the outcomes that leave no row of their own come from the workers' per-minute ``outcome_counts``,
:mod:`consumer_kit.ledger.outcome_counts`: written every summary interval, so up to one interval
behind, and a lower bound when a worker was killed without its shutdown):

===================  =================================================================================
number               source
===================  =================================================================================
executed             ``operations`` completed within the window, first owner (``attempts = 1``)
lease_recovered      completed within the window by a worker that took an expired lease over
failed               ``failed`` rows updated within the window (permanent business failures)
resolved             rows an operator resolved within the window (``consumer-kit ledger resolve``)
processing           ``processing`` under a live lease now
expired_leases       ``processing`` past its lease now (a worker died or hangs), oldest expiry age
needs_reconciliation parked now, oldest age (since it was parked)
retries              handler faults recorded within the window (``attempts.history``, last 20 per op)
contentions          lock timeouts, deadlocks, serialization failures recorded within the window
crashes              process deaths while running an operation alone, within the window
crashed_worker       operations parked as crashed_worker within the window
duplicates           ``outcome_counts``: deliveries answered from a completed operation (``duplicate``)
payload_conflicts    ``outcome_counts``: same key, different payload, dead-lettered
in_progress          ``outcome_counts``: deliveries that met another worker's live lease, retried later
uncertain            ``outcome_counts``: COMMIT without a reply, left for the redelivery to read
key_expired          ``outcome_counts``: refused as older than their key retention, dead-lettered
contentions_in_place ``outcome_counts`` (``contended_in_place``): deliveries rolled back for a
                     deadlock, lock timeout or serialization failure and run again in place (a
                     batch counts each of its deliveries); ``contentions`` are those given back
outbox               pending (capped), oldest pending age, parked; published within the window and
                     commit-to-publish latency (``published_at - created_at``: avg, p50, p95, max)
===================  =================================================================================

Costs: the gauge queries (:meth:`StatsReader.ledger_pressure`, :meth:`StatsReader.outbox_pressure`)
read only the partial indexes of open leases, parked operations and unpublished rows, and count at
most ``cap`` outbox rows. :meth:`StatsReader.read` scans the ``operations`` and ``attempts`` rows
updated within the window (an operator's command, not a scrape).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from psycopg import AsyncConnection, sql

from consumer_kit.ledger.outcome_counts import OutcomeCountBook

OUTBOX_COUNT_CAP = 100_000
"""The outbox counts stop at this many rows (a bounded query, even in a long outage)."""

_LEDGER_PRESSURE = """
    SELECT operation_type,
           count(*) FILTER (WHERE state = 'processing'),
           extract(epoch FROM now() - min(lease_expires_at) FILTER (WHERE state = 'processing')),
           count(*) FILTER (WHERE state = 'needs_reconciliation'),
           extract(epoch FROM now() - min(updated_at) FILTER (WHERE state = 'needs_reconciliation'))
      FROM {operations}
     WHERE watch_since IS NOT NULL  -- the rows that can be stuck or parked (ledger migration 5)
       AND ((state = 'processing' AND lease_expires_at <= now()) OR state = 'needs_reconciliation')
     GROUP BY operation_type
"""

# Parked: max_attempts failed attempts, or due at 'infinity' (parked under a smaller
# max_attempts), as in consumer_kit.outbox_relay.store.
_OUTBOX_PRESSURE = """
    SELECT (SELECT count(*) FROM (SELECT 1 FROM {outbox}
                                   WHERE published_at IS NULL AND attempts < %(max_attempts)s
                                     AND available_at <> 'infinity'
                                   LIMIT %(cap)s) AS pending),
           (SELECT extract(epoch FROM now() - created_at) FROM {outbox}
             WHERE published_at IS NULL AND attempts < %(max_attempts)s
               AND available_at <> 'infinity' ORDER BY id LIMIT 1),
           (SELECT count(*) FROM (SELECT 1 FROM {outbox}
                                   WHERE published_at IS NULL
                                     AND (attempts >= %(max_attempts)s OR available_at = 'infinity')
                                   LIMIT %(cap)s) AS parked)
"""

_OPERATIONS = """
    SELECT operation_type,
           count(*) FILTER (WHERE state = 'completed' AND resolved_at IS NULL AND attempts <= 1
                            AND completed_at >= {since}) AS executed,
           count(*) FILTER (WHERE state = 'completed' AND resolved_at IS NULL AND attempts > 1
                            AND completed_at >= {since}) AS lease_recovered,
           count(*) FILTER (WHERE state = 'failed' AND resolved_at IS NULL AND updated_at >= {since}) AS failed,
           count(*) FILTER (WHERE resolved_at >= {since}) AS resolved,
           count(*) FILTER (WHERE state = 'processing' AND lease_expires_at > now()) AS processing,
           count(*) FILTER (WHERE state = 'processing' AND lease_expires_at <= now()) AS expired_leases,
           extract(epoch FROM now() - min(lease_expires_at)
                   FILTER (WHERE state = 'processing' AND lease_expires_at <= now())) AS oldest_expired_age,
           count(*) FILTER (WHERE state = 'needs_reconciliation') AS needs_reconciliation,
           extract(epoch FROM now() - min(updated_at)
                   FILTER (WHERE state = 'needs_reconciliation')) AS oldest_reconciliation_age
      FROM {operations}
     WHERE updated_at >= {since} OR state IN ('processing', 'needs_reconciliation')
     GROUP BY operation_type
"""

# The operation type is the middle of the scope "<tenant>/<operation_type>/v<version>".
_ATTEMPTS = """
    SELECT coalesce(substring(a.scope FROM '([^/]*)/v[0-9]+$'), a.scope) AS operation_type,
           e ->> 'kind' AS kind, count(*)
      FROM {attempts} AS a CROSS JOIN LATERAL jsonb_array_elements(a.history) AS e
     WHERE a.updated_at >= {since} AND (e ->> 'at')::timestamptz >= {since}
     GROUP BY 1, 2
"""

_OUTBOX_LAG = """
    SELECT count(*),
           extract(epoch FROM avg(published_at - created_at)),
           extract(epoch FROM percentile_cont(0.5) WITHIN GROUP (ORDER BY published_at - created_at)),
           extract(epoch FROM percentile_cont(0.95) WITHIN GROUP (ORDER BY published_at - created_at)),
           extract(epoch FROM max(published_at - created_at))
      FROM {outbox}
     WHERE published_at >= {since}
"""

# outcome_counts outcomes -> OperationStats fields (the ones the ledger has no row for)
_COUNTED = {
    "duplicate": "duplicates", "payload_conflict": "payload_conflicts", "in_progress": "in_progress",
    "uncertain": "uncertain", "key_expired": "key_expired", "contended_in_place": "contentions_in_place",
}

# attempts.history kinds -> OperationStats fields
_KINDS = {"failure": "retries", "contention": "contentions", "crash": "crashes", "parked": "crashed_worker"}


@dataclass(frozen=True)
class LedgerPressure:
    """Operations of one type that need a look now (ages in seconds, ``None`` when none)."""

    operation_type: str
    expired_leases: int
    oldest_expired_age: float | None
    needs_reconciliation: int
    oldest_reconciliation_age: float | None


@dataclass(frozen=True)
class OutboxPressure:
    """The outbox now: ``pending`` and ``parked`` rows (each at most ``cap``), the oldest pending
    row's age in seconds (``None`` when none)."""

    pending: int
    oldest_pending_age: float | None
    parked: int
    cap: int = OUTBOX_COUNT_CAP


@dataclass
class OperationStats:
    """Outcome counts of one operation type (module docstring: where each comes from)."""

    operation_type: str
    executed: int = 0
    lease_recovered: int = 0
    failed: int = 0
    resolved: int = 0
    processing: int = 0
    expired_leases: int = 0
    oldest_expired_age: float | None = None
    needs_reconciliation: int = 0
    oldest_reconciliation_age: float | None = None
    retries: int = 0
    contentions: int = 0
    crashes: int = 0
    crashed_worker: int = 0
    duplicates: int = 0
    payload_conflicts: int = 0
    in_progress: int = 0
    uncertain: int = 0
    key_expired: int = 0
    contentions_in_place: int = 0


@dataclass(frozen=True)
class OutboxLag:
    """The outbox: rows ``published`` within the window and their commit-to-publish latency in
    seconds (``None`` when none was published), and the :class:`OutboxPressure` now."""

    published: int
    latency_avg: float | None
    latency_p50: float | None
    latency_p95: float | None
    latency_max: float | None
    pending: int
    oldest_pending_age: float | None
    parked: int


@dataclass(frozen=True)
class Stats:
    """``consumer-kit stats``: the window (``since`` seconds back from ``generated_at``), one
    :class:`OperationStats` per operation type (sorted by name) and the outbox."""

    schema: str
    since: float
    generated_at: dt.datetime
    operations: list[OperationStats] = field(default_factory=list)
    outbox: OutboxLag | None = None


class StatsReader:
    """Read-only statements on one schema's ledger and outbox.

    Args:
        schema: the schema (a plain identifier, already validated).
        max_attempts: the relay's ``relay_max_attempts`` (a row with this many failed attempts is
            parked).
        cap: the outbox counts stop at this many rows.
    """

    def __init__(self, schema: str, *, max_attempts: int = 20, cap: int = OUTBOX_COUNT_CAP) -> None:
        self.schema = schema
        self.max_attempts = max_attempts
        self.cap = cap
        since = sql.SQL("now() - make_interval(secs => %(since)s)")
        tables = {
            "operations": sql.Identifier(schema, "operations"),
            "attempts": sql.Identifier(schema, "attempts"),
            "outbox": sql.Identifier(schema, "outbox"),
            "since": since,
        }
        self._ledger_pressure = sql.SQL(_LEDGER_PRESSURE).format(**tables).as_bytes(None)
        self._outbox_pressure = sql.SQL(_OUTBOX_PRESSURE).format(**tables).as_bytes(None)
        self._operations = sql.SQL(_OPERATIONS).format(**tables).as_bytes(None)
        self._attempts = sql.SQL(_ATTEMPTS).format(**tables).as_bytes(None)
        self._outbox_lag = sql.SQL(_OUTBOX_LAG).format(**tables).as_bytes(None)
        self._outcome_counts = OutcomeCountBook(schema)

    async def ledger_pressure(self, conn: AsyncConnection[Any]) -> list[LedgerPressure]:
        """Expired leases and parked operations per operation type (only types that have some)."""
        cur = await conn.execute(self._ledger_pressure)
        return [
            LedgerPressure(str(r[0]), int(r[1]), _seconds(r[2]), int(r[3]), _seconds(r[4]))
            for r in await cur.fetchall()
        ]

    async def outbox_pressure(self, conn: AsyncConnection[Any]) -> OutboxPressure:
        """Pending and parked outbox rows (each counted up to ``cap``), oldest pending age."""
        cur = await conn.execute(self._outbox_pressure, {"max_attempts": self.max_attempts, "cap": self.cap})
        row = await cur.fetchone()
        assert row is not None
        return OutboxPressure(int(row[0]), _seconds(row[1]), int(row[2]), self.cap)

    async def read(self, conn: AsyncConnection[Any], *, since: float) -> Stats:
        """Everything ``consumer-kit stats`` prints, for the last ``since`` seconds."""
        now_cur = await conn.execute("SELECT now()")
        now_row = await now_cur.fetchone()
        assert now_row is not None
        params = {"since": since}
        by_type: dict[str, OperationStats] = {}
        cur = await conn.execute(self._operations, params)
        for row in await cur.fetchall():
            by_type[row[0]] = OperationStats(
                str(row[0]), executed=row[1], lease_recovered=row[2], failed=row[3], resolved=row[4],
                processing=row[5], expired_leases=row[6], oldest_expired_age=_seconds(row[7]),
                needs_reconciliation=row[8], oldest_reconciliation_age=_seconds(row[9]),
            )
        cur = await conn.execute(self._attempts, params)
        for operation_type, kind, count in await cur.fetchall():
            name = _KINDS.get(kind)
            if name is not None:
                entry = by_type.setdefault(operation_type, OperationStats(operation_type))
                setattr(entry, name, getattr(entry, name) + int(count))
        for operation_type, outcomes in (await self._outcome_counts.read(conn, since=since)).items():
            for outcome, count in outcomes.items():
                name = _COUNTED.get(outcome)
                if name is not None and operation_type and count:
                    entry = by_type.setdefault(operation_type, OperationStats(operation_type))
                    setattr(entry, name, getattr(entry, name) + count)
        cur = await conn.execute(self._outbox_lag, params)
        lag = await cur.fetchone()
        assert lag is not None
        pressure = await self.outbox_pressure(conn)
        outbox = OutboxLag(
            published=int(lag[0]), latency_avg=_seconds(lag[1]), latency_p50=_seconds(lag[2]),
            latency_p95=_seconds(lag[3]), latency_max=_seconds(lag[4]), pending=pressure.pending,
            oldest_pending_age=pressure.oldest_pending_age, parked=pressure.parked,
        )
        return Stats(
            schema=self.schema, since=since, generated_at=now_row[0],
            operations=[by_type[k] for k in sorted(by_type)], outbox=outbox,
        )


def _seconds(value: Any) -> float | None:
    return None if value is None else max(0.0, float(value))


_FAILURE_TIMES = """
    SELECT a.key, min((e ->> 'at')::timestamptz), max((e ->> 'at')::timestamptz)
      FROM {attempts} AS a CROSS JOIN LATERAL jsonb_array_elements(a.history) AS e
     WHERE a.key = ANY(%(keys)s) AND e ->> 'kind' IN ('failure', 'contention', 'crash', 'parked')
     GROUP BY a.key
"""


async def failure_times(
    conn: AsyncConnection[Any], schema: str, keys: list[str]
) -> dict[str, tuple[dt.datetime, dt.datetime]]:
    """``{operation key: (first, last)}`` failure times the ledger's attempt history records for
    ``keys`` (any scope; the history keeps each operation's last 20 entries). Keys that never
    failed (a payload conflict, an invalid message) are absent."""
    if not keys:
        return {}
    query = sql.SQL(_FAILURE_TIMES).format(attempts=sql.Identifier(schema, "attempts"))
    cur = await conn.execute(query, {"keys": keys})
    return {str(key): (first, last) for key, first, last in await cur.fetchall()}


UNKNOWN_TIME = "unknown"
"""What the operator tools print for a time nothing recorded (never ``-``, never ``- ago``)."""


def ago_text(when: dt.datetime | None, now: dt.datetime | None = None) -> str:
    """How long ago ``when`` was (``"3m05s ago"``, :func:`age_text`'s units), or
    :data:`UNKNOWN_TIME`; ``now`` defaults to the current UTC time."""
    if when is None:
        return UNKNOWN_TIME
    return age_text(((now or dt.datetime.now(dt.UTC)) - when).total_seconds()) + " ago"


def age_text(seconds: float | None) -> str:
    """An age in seconds as ``consumer-kit stats`` and the console print it: ``"45s"``,
    ``"3m05s"``, ``"2h10m"``, ``"1d03h"``; ``"-"`` for none."""
    if seconds is None:
        return "-"
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def duration_text(seconds: float | None) -> str:
    """A latency in seconds: ``"12 ms"`` under 10 s, else ``"12.3 s"``; ``"-"`` for none."""
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"
