"""The relay's work on the outbox: claim, mark, back off, park, requeue, clean up and report on the outbox.

Every statement (:mod:`consumer_kit.outbox_relay.statements`) is built once with :mod:`psycopg.sql` (identifiers are never formatted by hand)
and runs as one autocommit statement, so a claim or a mark is atomic on its own.

The claim protocol (many relays on one outbox):

* a row is *claimable* when it is unpublished, not parked (``attempts < max_attempts``), due
  (``available_at <= now()``) and not under a live lease (``claimed_until`` unset or past);
* ``FOR UPDATE SKIP LOCKED`` lets concurrent claimers pass each other's rows without waiting, and
  the lease (``claimed_by``, ``claimed_until = now() + claim_timeout``) keeps the row away from
  other relays after the claiming statement commits; a dead relay's rows come back when the lease
  runs out;
* with ordering on, a row that has a partition key is claimable only when no *earlier* unpublished
  row of the same key exists (earlier = smaller ``commit_seq``, see migration 102 in
  :mod:`consumer_kit.outbox`): at most one row per key is ever claimed, by one relay, and the next
  row of that key becomes claimable only after this one is marked published.

Times come from the database clock (``now()``), so relays on hosts with skewed clocks agree.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import AsyncConnection, pq, sql

from consumer_kit.errors import ConfigurationError

from .statements import (
    CANDIDATES_ORDERED,
    CANDIDATES_ORDERED_FROM_START,
    CANDIDATES_UNORDERED,
    CLAIM,
    CLEANUP,
    MARK_FAILED,
    MARK_PUBLISHED,
    MIGRATION_APPLIED,
    PARKED,
    PARKED_ROW,
    PENDING_DESTINATIONS,
    PLAN_BY_INDEX_ORDER,
    RELEASE,
    REQUEUE,
    STATUS,
)

if TYPE_CHECKING:
    from .settings import OutboxSettings

REQUIRED_MIGRATION = 105
"""The latest outbox migration the relay relies on: 102 adds ``commit_seq`` (commit order per
partition key), 105 the ``outbox_broker`` table (:mod:`consumer_kit.outbox_relay.binding`)."""


@dataclass(frozen=True)
class ClaimedRow:
    """One outbox row claimed by this relay.

    Attributes:
        id: the row's identity (bigint).
        event_id: the stable event ID (UUID): the broker message id on every attempt.
        payload: the JSON payload as text (sent as the body, UTF-8).
        headers: the row's stored headers (str -> str).
        attempts: failed publish attempts before this one.
        previous_owner: ``claimed_by`` before this claim (another relay whose lease ran out,
            or this relay's own earlier claim), ``None`` for a fresh row.
    """

    id: int
    event_id: uuid.UUID
    destination: str
    routing_key: str
    message_type: str
    partition_key: str | None
    payload: str
    headers: dict[str, Any]
    attempts: int
    operation_scope: str | None
    operation_key: str | None
    correlation_id: str | None
    created_at: dt.datetime
    previous_owner: str | None


@dataclass(frozen=True)
class Failure:
    """A row whose publish failed: ``error`` is a short text without payload; ``park`` parks it
    at once (an unknown destination cannot succeed on retry); ``transient`` marks a failure of the
    broker or the connection rather than of the row: it is retried after at most
    ``transient_backoff_max`` seconds and never parks the row (a long outage must not park the
    whole outbox, nor leave every partition key blocked behind a long backoff)."""

    id: int
    error: str
    park: bool = False
    transient: bool = False


@dataclass(frozen=True)
class OutboxStatus:
    """What ``outbox-relay status`` prints.

    Attributes:
        pending: unpublished rows that will still be tried (includes ``retrying`` and ``claimed``).
        retrying: pending rows with at least one failed attempt.
        claimed: pending rows under a live lease (being published right now).
        parked: rows past ``max_attempts``, or parked (due at 'infinity') under a smaller
            ``max_attempts``: never deleted, never retried until requeued.
        oldest_pending_age: seconds since the oldest pending row was written (``None``: none).
        published_last_minute: rows marked published in the last 60 seconds.
        published_total: published rows still in the table (within retention).
    """

    pending: int
    retrying: int
    claimed: int
    parked: int
    oldest_pending_age: float | None
    published_last_minute: int
    published_total: int


@dataclass(frozen=True)
class ParkedRow:
    event_id: uuid.UUID
    destination: str
    partition_key: str | None
    attempts: int
    last_error: str | None
    created_at: dt.datetime


class OutboxStore:
    """The relay's statements on ``<schema>.outbox``.

    Args:
        schema: the schema holding the outbox (a plain identifier, already validated).
        relay_id: this relay's name, written to ``claimed_by``.
        max_attempts: failed attempts after which a row is parked.
        claim_timeout: lease length (seconds).
        backoff_base: first retry delay (seconds); doubles per failed attempt.
        backoff_max: longest retry delay (seconds).
        transient_backoff_max: longest retry delay after a broker or connection failure (seconds).
    """

    @classmethod
    def from_settings(cls, settings: OutboxSettings) -> OutboxStore:
        """The store for ``settings``' schema, relay id, attempts, lease and backoff."""
        return cls(
            settings.db_schema,
            relay_id=settings.relay_id,
            max_attempts=settings.relay_max_attempts,
            claim_timeout=settings.relay_claim_timeout,
            backoff_base=settings.relay_backoff_base,
            backoff_max=settings.relay_backoff_max,
            transient_backoff_max=settings.relay_transient_backoff_max,
        )

    def __init__(
        self,
        schema: str,
        *,
        relay_id: str,
        max_attempts: int,
        claim_timeout: float,
        backoff_base: float,
        backoff_max: float,
        transient_backoff_max: float = 5.0,
    ) -> None:
        self.schema = schema
        self.relay_id = relay_id
        self.max_attempts = max_attempts
        self.claim_timeout = claim_timeout
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self.transient_backoff_max = transient_backoff_max
        table = sql.Identifier(schema, "outbox")
        self._claim_ordered = CLAIM.format(table=table, candidates=CANDIDATES_ORDERED.format(table=table))
        self._claim_ordered_from_start = CLAIM.format(
            table=table, candidates=CANDIDATES_ORDERED_FROM_START.format(table=table)
        )
        self._claim_unordered = CLAIM.format(table=table, candidates=CANDIDATES_UNORDERED.format(table=table))
        self._after_key: str | None = None  # the claim's rotating cursors (see statements.KEYS, IDS)
        self._after = _FROM_START
        # Each cursor's lap: "dirty" (a claim found rows since it last started over), "clean"
        # (no rows found since it started over), "done" (a clean lap reached the end).
        self._laps = {"keys": "dirty", "ids": "dirty"}
        self.idle = False
        """Whether nothing is claimable now: the last claim was empty and both cursors have made
        a whole lap, start to end, without finding a claimable row."""
        self._mark_published = MARK_PUBLISHED.format(table=table)
        self._mark_failed = MARK_FAILED.format(table=table)
        self._release = RELEASE.format(table=table)
        self._cleanup = CLEANUP.format(table=table)
        self._status = STATUS.format(table=table, parked=PARKED_ROW)
        self._parked = PARKED.format(table=table, parked=PARKED_ROW)
        self._requeue = REQUEUE.format(table=table, parked=PARKED_ROW)
        self._pending_destinations = PENDING_DESTINATIONS.format(table=table, parked=PARKED_ROW)
        self._migration_applied = MIGRATION_APPLIED.format(table=sql.Identifier(schema, "schema_migrations"))

    async def check_schema(self, conn: AsyncConnection[Any]) -> None:
        """Check that the schema's outbox is migrated far enough for this relay.

        Raises:
            ConfigurationError: migration :data:`REQUIRED_MIGRATION` is missing (or no migration
                table at all): run ``consumer-kit migrate`` first.
        """
        try:
            cur = await conn.execute(self._migration_applied, (REQUIRED_MIGRATION,))
            found = await cur.fetchone()
        except psycopg.errors.UndefinedTable:
            found = None
        if found is None:
            raise ConfigurationError(
                f"schema {self.schema!r} has no up-to-date outbox (migration "
                f"{REQUIRED_MIGRATION} missing): run `consumer-kit migrate` first"
            )

    async def claim(
        self, conn: AsyncConnection[Any], limit: int, *, ordered: bool = True
    ) -> list[ClaimedRow]:
        """Claim up to ``limit`` claimable rows (oldest id first among the candidates) under a
        lease of ``claim_timeout`` seconds; returned in id order.

        With ``ordered``, only the head row of each partition key is a candidate. Candidates are
        the next ``max(4 * limit, 100)`` keys and due rows after this store's rotating cursors,
        so one claim costs the same whatever the backlog and every row comes round (see
        ``statements.KEYS`` and ``IDS``). An empty result with :attr:`idle` false says only that
        nothing in these windows was claimable: claim again."""
        window = max(4 * limit, 100)
        if not ordered:
            query = self._claim_unordered
        elif self._after_key is None:
            query = self._claim_ordered_from_start
        else:
            query = self._claim_ordered
        params = {
            "relay_id": self.relay_id,
            "lease": self.claim_timeout,
            "max_attempts": self.max_attempts,
            "limit": limit,
            "keys": window,
            "window": window,
            "after_key": "" if self._after_key is None else self._after_key,
            "after_at": self._after[0],
            "after_id": self._after[1],
        }
        # One round trip: the claim in a transaction of its own whose planner may not sort (see
        # PLAN_BY_INDEX_ORDER), then COMMIT.
        try:
            async with conn.pipeline():
                await conn.execute(b"BEGIN")
                for setting in PLAN_BY_INDEX_ORDER:
                    await conn.execute(setting)
                cur = await conn.execute(query, params)
                await conn.execute(b"COMMIT")
        except BaseException:
            await _end_failed_transaction(conn)
            raise
        records = await cur.fetchall()
        last_key, more_keys, last_at, last_id, more_ids = records[0][-5:]
        rows = [ClaimedRow(*record[:-5]) for record in records if record[0] is not None]
        self._lap("keys", started=self._after_key is None, found=bool(rows), ended=not more_keys)
        self._lap("ids", started=self._after == _FROM_START, found=bool(rows), ended=not more_ids)
        self.idle = not rows and self._laps["keys"] == self._laps["ids"] == "done"
        # Move each cursor past what was visited; start over once the end was reached.
        self._after_key = last_key if more_keys else None
        self._after = (last_at, last_id) if more_ids else _FROM_START
        rows.sort(key=lambda r: r.id)
        return rows

    def rescan(self) -> None:
        """Forget the laps made so far: :attr:`idle` becomes true again only after both cursors
        make a whole clean lap from now on. Call it when rows may have become claimable (the
        relay wakes up): a lap finished before that proves nothing about them, and an empty
        window in front of them (keys whose heads are parked or leased) must not say idle."""
        self._laps = {"keys": "dirty", "ids": "dirty"}
        self.idle = False

    def _lap(self, cursor: str, *, started: bool, found: bool, ended: bool) -> None:
        state = self._laps[cursor]
        if found:
            state = "dirty"
        elif started and state == "dirty":
            state = "clean"
        if ended and state == "clean":
            state = "done"
        self._laps[cursor] = state

    async def mark_published(self, conn: AsyncConnection[Any], ids: Sequence[int]) -> int:
        """Mark confirmed rows published in one statement; returns rows changed. A row another
        relay already marked (after taking over an expired lease) is left as it is."""
        if not ids:
            return 0
        cur = await conn.execute(self._mark_published, {"ids": list(ids), "relay_id": self.relay_id})
        return cur.rowcount

    async def mark_failed(self, conn: AsyncConnection[Any], failures: Sequence[Failure]) -> list[int]:
        """Record failed publishes in one statement: ``attempts + 1``, ``last_error``,
        ``available_at = now() + min(backoff_max, backoff_base * 2**attempts)`` seconds (a transient
        failure: at most ``transient_backoff_max``, and never parked), lease released. Only rows this
        relay still holds are changed. Returns the ids now parked."""
        if not failures:
            return []
        cur = await conn.execute(
            self._mark_failed,
            {
                "ids": [f.id for f in failures],
                "errors": [f.error[:1000] for f in failures],
                "park": [f.park for f in failures],
                "transient": [f.transient for f in failures],
                "transient_max_delay": self.transient_backoff_max,
                "relay_id": self.relay_id,
                "base": self.backoff_base,
                "max_delay": self.backoff_max,
                "max_attempts": self.max_attempts,
            },
        )
        return [row[0] for row in await cur.fetchall() if row[1]]

    async def release(self, conn: AsyncConnection[Any], ids: Sequence[int]) -> int:
        """Give claimed rows back untried (no attempt counted); returns rows released."""
        if not ids:
            return 0
        cur = await conn.execute(self._release, {"ids": list(ids), "relay_id": self.relay_id})
        return cur.rowcount

    async def delete_published(
        self, conn: AsyncConnection[Any], *, older_than: float, limit: int
    ) -> int:
        """Delete at most ``limit`` rows published more than ``older_than`` seconds ago; returns
        rows deleted. Unpublished and parked rows are never deleted."""
        cur = await conn.execute(self._cleanup, {"older_than": older_than, "limit": limit})
        return cur.rowcount

    async def status(self, conn: AsyncConnection[Any]) -> OutboxStatus:
        """Counts for ``outbox-relay status`` (one scan of the outbox)."""
        cur = await conn.execute(self._status, {"max_attempts": self.max_attempts})
        row = await cur.fetchone()
        assert row is not None
        return OutboxStatus(
            pending=row[0],
            retrying=row[1],
            claimed=row[2],
            parked=row[3],
            oldest_pending_age=float(row[4]) if row[4] is not None else None,
            published_last_minute=row[5],
            published_total=row[6],
        )

    async def parked(self, conn: AsyncConnection[Any], limit: int = 20) -> list[ParkedRow]:
        """The oldest ``limit`` parked rows."""
        cur = await conn.execute(self._parked, {"max_attempts": self.max_attempts, "limit": limit})
        return [ParkedRow(*row) for row in await cur.fetchall()]

    async def requeue_parked(
        self, conn: AsyncConnection[Any], event_ids: Sequence[uuid.UUID] | None = None
    ) -> int:
        """Make parked rows (all, or those in ``event_ids``) claimable again: ``attempts = 0``,
        due now; ``last_error`` is kept. Returns rows requeued."""
        cur = await conn.execute(
            self._requeue,
            {
                "max_attempts": self.max_attempts,
                "all": event_ids is None,
                "event_ids": list(event_ids or []),
            },
        )
        return cur.rowcount

    async def pending_destinations(self, conn: AsyncConnection[Any]) -> set[str]:
        """Distinct destinations of pending rows (unpublished, not parked), checked against the map
        at start-up."""
        cur = await conn.execute(self._pending_destinations, {"max_attempts": self.max_attempts})
        return {row[0] for row in await cur.fetchall()}


async def _end_failed_transaction(conn: AsyncConnection[Any]) -> None:
    """Roll back what a failed pipeline left open (its COMMIT was skipped), so the connection's
    next statement does not meet an aborted transaction. Best effort: a broken connection is the
    caller's to replace."""
    if conn.closed or conn.broken or conn.info.transaction_status == pq.TransactionStatus.IDLE:
        return
    with contextlib.suppress(psycopg.Error):
        await conn.execute(b"ROLLBACK")


_FROM_START = (dt.datetime.min.replace(tzinfo=dt.UTC), 0)
"""The id cursor's start: before every (available_at, id)."""
