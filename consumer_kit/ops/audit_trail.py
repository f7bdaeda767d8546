"""The operator's audit trail around an action on the broker (docs/how-to/console.md, "Audit"):
a row saying what is about to be done is written **before** the effect, so a failure part-way
still leaves the attempt recorded, then a row with the outcome. Used by the console and by
``consumer-kit dlq`` alike; the rows are append-only (ledger migration 9).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import psycopg

from consumer_kit.db.pooler import connect_options
from consumer_kit.ledger.audit import AuditEntry, AuditLog
from consumer_kit.ops.operator_actions import ledger_url
from consumer_kit.settings import BrokerSettings


class AuditTrail:
    """Appends :class:`~consumer_kit.ledger.audit.AuditEntry` rows for ``actor`` from ``source``
    (``console`` or ``cli``), each on its own committed connection to the ledger. With no
    database named (``enabled`` false) nothing is written: the CLI says so before it acts.

    Raises (from every method): ``psycopg.Error`` when the ledger cannot be written; the caller
    then does not act (nothing is done unaudited).
    """

    def __init__(self, settings: BrokerSettings, actor: str, source: str) -> None:
        self.settings, self.actor, self.source = settings, actor, source
        self._log = AuditLog(settings.db_schema)
        self._url = ledger_url(settings)
        self.enabled = self._url is not None

    async def record(self, action: str, target: str, outcome: str, note: str = "", **details: Any) -> None:
        """Append one row, committed before this returns."""
        if self._url is None:
            return
        async with await psycopg.AsyncConnection.connect(self._url, autocommit=True, **connect_options(self.settings)) as conn:
            await self._log.record(conn, AuditEntry(actor=self.actor, source=self.source, action=action,
                                                    target=target, outcome=outcome, note=note, details=details))

    @asynccontextmanager
    async def around(self, action: str, target: str, **details: Any) -> AsyncIterator[dict[str, Any]]:
        """Record ``<action>`` ``started`` first, then run the block; the block sets ``"outcome"``
        (and any details) in the dict it gets, recorded as a second ``<action>`` row. An exception
        in the block is recorded as outcome ``failed: <type>`` and raised again."""
        await self.record(action, target, "started", **details)
        result: dict[str, Any] = {}
        try:
            yield result
        except BaseException as exc:
            await self.record(action, target, f"failed: {type(exc).__name__}", **details)
            raise
        outcome = str(result.pop("outcome", "done"))
        await self.record(action, target, outcome, **{**details, **result})
