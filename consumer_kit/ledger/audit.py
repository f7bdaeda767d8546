"""The ``audit`` table (ledger migrations 7 and 9: append-only by trigger): what operators did by hand, who, when, why.

Written by the operator's actions (:mod:`consumer_kit.operator`): a resolution, a redrive or its
dry run, a dead letter's body shown, a refusal. Append-only; the console's audit page reads it
newest first. Producer text (keys, reasons) goes in as data, never into SQL.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from psycopg import AsyncConnection, sql
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

NOTE_CHARS = 2000
"""A note is kept up to this many characters (as ``consumer-kit ledger resolve`` keeps it)."""

_RECORD = """
    INSERT INTO {audit} (actor, source, action, target, outcome, note, details)
    VALUES (%(actor)s, %(source)s, %(action)s, %(target)s, %(outcome)s, %(note)s, %(details)s)
    RETURNING id
"""

_RECENT = """
    SELECT id, at, actor, source, action, target, outcome, note, details FROM {audit}
     ORDER BY id DESC LIMIT %(limit)s
"""


@dataclass(frozen=True)
class AuditEntry:
    """One action: ``actor`` (who), ``source`` (``console`` or ``cli``), ``action`` (e.g.
    ``resolve``, ``redrive``, ``redrive_dry_run``, ``show_body``), ``target`` (what it acted on,
    e.g. ``scope key`` or ``queue reason``), ``outcome`` (e.g. ``completed``, ``refused``,
    ``redrove 3``), the operator's ``note`` and machine-readable ``details`` (a JSON object)."""

    actor: str
    source: str
    action: str
    target: str
    outcome: str
    note: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    id: int | None = None
    at: dt.datetime | None = None


class AuditLog:
    """Statements on ``<schema>.audit``, rendered once per schema."""

    def __init__(self, schema: str) -> None:
        audit = sql.Identifier(schema, "audit")
        self._record = sql.SQL(_RECORD).format(audit=audit).as_bytes(None)
        self._recent = sql.SQL(_RECENT).format(audit=audit).as_bytes(None)

    async def record(self, conn: AsyncConnection[Any], entry: AuditEntry) -> int:
        """Append ``entry`` (in the caller's transaction, if any); returns its id."""
        cur = await conn.execute(self._record, {
            "actor": entry.actor, "source": entry.source, "action": entry.action, "target": entry.target,
            "outcome": entry.outcome, "note": entry.note[:NOTE_CHARS], "details": Jsonb(entry.details),
        })
        row = await cur.fetchone()
        assert row is not None
        return int(row[0])

    async def recent(self, conn: AsyncConnection[Any], *, limit: int = 100) -> list[AuditEntry]:
        """The last ``limit`` entries, newest first."""
        async with conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(self._recent, {"limit": limit})
            return [AuditEntry(**row) for row in await cur.fetchall()]
