"""External effects: what a handler that calls something outside PostgreSQL works with.

A handler with ``external_effects = True`` takes the *leased path*
(docs/how-to/external-effects.md): the claim commits first as ``processing`` under a lease (owner, expiry, attempt); the
handler calls the remote side with a **downstream idempotency key** (``ctx.downstream_key``),
records **evidence** before and after the call (``ctx.record_evidence``), then writes its local
state in the completion transaction (``await ctx.begin()``), which commits with the ledger's
completion and its outbox events. A worker that finds the lease expired (the owner died, or gave
up after a fault) takes it over and asks the handler to **reconcile** from the evidence before
anything else: :class:`Reconciled` ``done`` (finish without calling), ``not_done`` (call again
with the same downstream keys) or ``unknown`` (park as ``needs_reconciliation``; nothing is
called blindly).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from consumer_kit.model.evidence import EvidenceRecord

if TYPE_CHECKING:
    from psycopg import AsyncConnection

    from consumer_kit.model.results import Result


class Evidence(Sequence[EvidenceRecord]):
    """The evidence recorded for one operation, oldest first, across every attempt.

    Example: ``evidence.facts("send")`` merges every record of the call named ``"send"`` (later
    facts win), so after ``record_evidence("send", intent="welcome")`` and
    ``record_evidence("send", provider_message_id="m-1")`` it is
    ``{"intent": "welcome", "provider_message_id": "m-1"}``.
    """

    def __init__(self, records: Sequence[EvidenceRecord]) -> None:
        self._records = list(records)

    def __getitem__(self, index: Any) -> Any:
        return self._records[index]

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[EvidenceRecord]:
        return iter(self._records)

    def of(self, name: str) -> list[EvidenceRecord]:
        """The records of call ``name``, oldest first."""
        return [r for r in self._records if r.name == name]

    def facts(self, name: str) -> dict[str, Any]:
        """Every fact recorded for call ``name``, merged in order (later records win); ``{}``
        when none."""
        merged: dict[str, Any] = {}
        for record in self.of(name):
            merged.update(record.facts)
        return merged

    def started(self, name: str | None = None) -> bool:
        """Whether a call (named ``name``, or any) recorded anything: it may have reached the
        remote side."""
        return bool(self.of(name) if name is not None else self._records)


class Reconciliation(enum.StrEnum):
    """What a reconcile pass found out about an uncertain effect (:class:`Reconciled` carries it)."""

    DONE = "done"
    NOT_DONE = "not_done"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Reconciled:
    """What ``Handler.reconcile`` decided; build it with :meth:`done`, :meth:`not_done` or
    :meth:`unknown`."""

    verdict: Reconciliation
    result: Result | None = None
    reason: str = ""

    @classmethod
    def done(cls, result: Result | None = None) -> Reconciled:
        """The effect happened: complete with ``result`` (default ``Result("reconciled")``)
        without calling again. Write the local state the handler would have written after the
        call through ``await ctx.begin()`` first."""
        return cls(Reconciliation.DONE, result)

    @classmethod
    def not_done(cls) -> Reconciled:
        """The effect did not happen: run ``handle`` again (same downstream keys)."""
        return cls(Reconciliation.NOT_DONE)

    @classmethod
    def unknown(cls, reason: str) -> Reconciled:
        """Cannot tell: park the operation as ``needs_reconciliation`` and dead-letter the
        message with ``reason`` (no payload values); an operator resolves it."""
        return cls(Reconciliation.UNKNOWN, reason=reason)


class LeaseHooks(Protocol):
    """What the runtime gives a handler's context on the leased path."""

    async def begin(self) -> AsyncConnection[Any]:
        """Open (once) the completion transaction and return its connection."""

    async def record_evidence(self, name: str, facts: dict[str, Any]) -> None:
        """Record ``facts`` about call ``name``, fenced by the lease.

        Raises:
            LeaseLost: this worker no longer holds the operation's lease.
        """
