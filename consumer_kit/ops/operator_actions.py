"""What an operator does by hand, in one place for ``consumer-kit ledger resolve``, ``consumer-kit
dlq`` and the console (``consumer-kit console``): the commands and the pages call these functions,
so they cannot diverge.

- :func:`resolve_parked`: settle a parked operation (done / not done / failed) with a required
  note, refused for a live lease, audited (ledger migration 7).
- :func:`dead_letter_rows`, :func:`group_dead_letters`: a queue's dead letters with their operation
  keys and failure times, grouped by reason.
- :class:`Selection`, :func:`redrive_dead_letters`: which dead letters go back, and the redrive.
- :func:`open_dead_letter_queues`: the broker's dead-letter side with the deployment's mark key.
"""

from __future__ import annotations

import datetime as dt
import getpass
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg

from consumer_kit.app import App
from consumer_kit.broker import DeadLetter, DeadLetterQueues, RedriveReport
from consumer_kit.codec import marks
from consumer_kit.codec.envelope import Envelope
from consumer_kit.db.embedded import database_url
from consumer_kit.db.pooler import connect_options
from consumer_kit.errors import ConfigurationError, InvalidMessage, Refused
from consumer_kit.ledger.audit import NOTE_CHARS, AuditEntry, AuditLog
from consumer_kit.ledger.inspect import DECISIONS, NOT_DONE_DECISION, LedgerInspector
from consumer_kit.ledger.mark_keys import install_mark_keys
from consumer_kit.ops.stats import failure_times
from consumer_kit.pipeline.decoding import decode
from consumer_kit.settings import BrokerSettings


def default_actor() -> str:
    """``user@host`` of this process (who resolved, when nobody says otherwise)."""
    return f"{getpass.getuser()}@{socket.gethostname()}"


# -- parked operations ---------------------------------------------------------------------------


async def resolve_parked(
    conn: psycopg.AsyncConnection[Any], schema: str, scope: str, key: str, *, decision: str, note: str,
    by: str, source: str, status: str | None = None, app: App | None = None,
) -> str:
    """Settle the parked operation ``scope key`` as ``decision`` (one of
    :data:`~consumer_kit.ledger.inspect.DECISIONS`), recording ``by`` and ``note`` on the row and in
    the audit table (``source``: ``cli`` or ``console``), in one transaction. With ``app``, ``not_done``
    is refused for an operation type whose handler has no external effects (its next run would
    only park it again). Returns the new state.

    Raises:
        Refused: no note, an unknown decision, a live lease (its worker is running it), or a row
            that is not parked (terminal already, missing). The refusal is audited too.
    """
    note = note.strip()[:NOTE_CHARS]
    if decision not in DECISIONS:
        raise Refused(f"say what happened: one of {', '.join(DECISIONS)}")
    if not note:
        raise Refused("a note is required: say what you checked (it is kept with the row)")
    inspector, audit = LedgerInspector(schema), AuditLog(schema)
    target = f"{scope} {key}"
    refusal = _not_done_refusal(app, scope) if decision == NOT_DONE_DECISION else None
    async with conn.transaction():
        state = None if refusal else await inspector.resolve(
            conn, scope, key, decision=decision, note=note, by=by, status=status,
        )
        if state is None and refusal is None:
            refusal = _resolve_refusal(target, await inspector.state(conn, scope, key))
        await audit.record(conn, AuditEntry(
            actor=by, source=source, action="resolve", target=target, outcome=state or "refused",
            note=note, details={"decision": decision, **({"refused": refusal} if refusal else {})},
        ))
    if refusal is not None:
        raise Refused(refusal)
    assert state is not None
    return state


def _resolve_refusal(target: str, found: tuple[str, bool] | None) -> str:
    if found is not None and found == ("processing", True):
        return (f"{target} is processing under a live lease: a worker is running it now, and a live lease "
                "is never overruled; wait for the lease to run out (see `consumer-kit ledger show`)")
    return (f"{target} is not parked (needs_reconciliation) nor stuck under an expired lease: "
            "see `consumer-kit ledger show`")


def _not_done_refusal(app: App | None, scope: str) -> str | None:
    handler = handler_for_scope(app, scope)
    if handler is None or handler.external_effects:
        return None
    return (f"{type(handler).__name__} has no external effects: nothing can run it again safely "
            "(its next delivery would park it again); mark it done or failed")


def handler_for_scope(app: App | None, scope: str) -> Any:
    """The app's handler whose operation type is the middle of ``scope``
    (``tenant/operation_type/vN``), or ``None``."""
    if app is None:
        return None
    parts = scope.split("/")
    operation_type = parts[-2] if len(parts) >= 3 else scope
    for handlers in app.routes.values():
        for handler in handlers.values():
            if handler.operation_type == operation_type:
                return handler
    return None


# -- dead letters --------------------------------------------------------------------------------


@dataclass
class Row:
    """A dead letter as listed: the broker's facts plus the operation key and failure times."""

    letter: DeadLetter
    operation_key: str | None
    first_failure: dt.datetime | None
    last_failure: dt.datetime | None


@dataclass
class Group:
    """The dead letters of one queue with one reason: how many, the oldest one's first failure,
    their message ids and operation keys (in listing order)."""

    queue: str
    reason: str
    rows: list[Row] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.rows)

    @property
    def oldest(self) -> dt.datetime | None:
        times = [t for row in self.rows for t in [row.first_failure or row.letter.dead_lettered_at] if t]
        return min(times) if times else None

    @property
    def details(self) -> list[str]:
        """The distinct details of the group, in order (consumer-kit's signed marks only)."""
        return list(dict.fromkeys(row.letter.detail for row in self.rows if row.letter.detail))


def operation_key(app: App | None, letter: DeadLetter) -> str | None:
    """Header ``operation-id``, else (with ``app``) the key the queue's handler computes from the
    body; ``None`` when neither says."""
    if letter.operation_key or app is None:
        return letter.operation_key
    envelope = Envelope(letter.queue, letter.message_id, letter.headers, letter.delivery_count)
    try:
        return decode(app, letter.queue, letter.body, envelope).identity.key
    except InvalidMessage:
        return None


async def dead_letter_rows(settings: BrokerSettings, app: App | None, letters: list[DeadLetter]) -> list[Row]:
    """``letters`` with their operation keys and first and last failure.

    The ledger's attempt history decides both where ``settings`` names a database (``embedded``
    included) and it recorded a failure of the operation: a broker's own time is the first
    dead-lettering it saw (RabbitMQ's ``x-death`` names the first retry's expiry), not the last
    fault. Otherwise the broker's dead-letter time (first failure: else its enqueue time); ``None``
    where nothing knows (docs/operations/dead-letters.md)."""
    keys = [operation_key(app, letter) for letter in letters]
    times: dict[str, tuple[dt.datetime, dt.datetime]] = {}
    url = ledger_url(settings)
    if url is not None and any(keys):
        async with await psycopg.AsyncConnection.connect(url, autocommit=True, **connect_options(settings)) as conn:
            times = await failure_times(conn, settings.db_schema, sorted({k for k in keys if k}))
    rows = []
    for letter, key in zip(letters, keys, strict=True):
        first, last = times.get(key or "", (None, None))
        broker_time = letter.dead_lettered_at
        rows.append(Row(letter, key, first or broker_time or letter.enqueued_at, last or broker_time))
    return rows


def ledger_url(settings: BrokerSettings) -> str | None:
    """The ledger's URL for an operator command: ``None`` where no database is named (the
    operator tools never start an embedded server nobody asked for); ``embedded`` is the
    embedded server the worker used."""
    if settings.database_url is None:
        return None
    return database_url(settings)


def group_dead_letters(rows: list[Row]) -> list[Group]:
    """``rows`` grouped by (queue, reason), largest group first."""
    groups: dict[tuple[str, str], Group] = {}
    for row in rows:
        queue, reason = row.letter.queue, row.letter.reason
        groups.setdefault((queue, reason), Group(queue, reason)).rows.append(row)
    return sorted(groups.values(), key=lambda g: (-g.count, g.reason))


@dataclass(frozen=True)
class Selection:
    """Which dead letters a redrive moves: those with ``reason`` (``max_deliveries_exceeded`` also
    matches ``max_deliveries_exceeded:...``), those whose operation key is in ``keys``, the one
    with ``message_id``, or ``everything``. Conditions combine (all must hold).

    Raises:
        Refused: nothing said (at least one of them is needed).
    """

    reason: str | None = None
    keys: frozenset[str] = frozenset()
    message_id: str | None = None
    everything: bool = False

    def __post_init__(self) -> None:
        if not (self.reason or self.keys or self.message_id or self.everything):
            raise Refused("say which dead letters to redrive: --reason R, --key K or --all")

    def describe(self) -> str:
        said = [f"reason {self.reason}"] if self.reason else []
        said += [f"key {key}" for key in sorted(self.keys)]
        said += [f"message {self.message_id}"] if self.message_id else []
        return ", ".join(said) or "all"


@dataclass(frozen=True)
class RedriveOutcome:
    """What :func:`redrive_dead_letters` did, and how many dead letters the key selection could not
    match (no header ``operation-id`` and no app to compute the key)."""

    report: RedriveReport
    keyless: int


async def redrive_dead_letters(
    dead: DeadLetterQueues, queue: str, selection: Selection, *, app: App | None = None,
    dry_run: bool = False, progress: Callable[[DeadLetter, bool], None] | None = None,
) -> RedriveOutcome:
    """Move the dead letters of ``queue`` that ``selection`` picks back to ``queue`` through the
    broker's :meth:`~consumer_kit.broker.DeadLetterQueues.redrive` (its contract: same body, id and
    operation key, so a redrive of a done operation is a duplicate); with ``dry_run``, only count.

    Raises:
        ConfigurationError: not a dry run, and the process has no deployment mark key (neither the
            database URL nor ``CONSUMER_KIT_MARK_KEY``): its copies would be signed with a key no
            worker knows and lose the original sender (docs/explanation/trust.md); else as
            ``DeadLetterQueues.redrive``.
        ConnectionError: as ``DeadLetterQueues.redrive``.
    """
    if not dry_run and marks.installed().source == "process":
        raise ConfigurationError(
            "a redrive needs the deployment's mark key, so that each copy keeps its original sender: "
            "set CONSUMER_KIT_DATABASE_URL (the key migrate stored) or CONSUMER_KIT_MARK_KEY"
        )
    keyless = 0

    def select(letter: DeadLetter) -> bool:
        nonlocal keyless
        reason = selection.reason
        if reason is not None and letter.reason != reason and letter.reason.split(":", 1)[0] != reason:
            return False
        if selection.message_id is not None and letter.message_id != selection.message_id:
            return False
        if not selection.keys:
            return True
        found = operation_key(app, letter)
        if found is None and app is None:
            keyless += 1
        return found in selection.keys

    report = await dead.redrive(queue, select, dry_run=dry_run, progress=progress)
    return RedriveOutcome(report, keyless)


@asynccontextmanager
async def open_dead_letter_queues(settings: BrokerSettings) -> AsyncIterator[DeadLetterQueues]:
    """The broker's dead-letter side (:func:`consumer_kit.broker.registry.open_dead_letters`), after
    installing the deployment's mark key (from the ledger schema, or ``CONSUMER_KIT_MARK_KEY``) so
    only consumer-kit's signed reasons, queues and counts are believed; closed afterwards."""
    from consumer_kit.broker.registry import open_dead_letters

    url = ledger_url(settings)
    if url is not None:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True, **connect_options(settings)) as conn:
            await install_mark_keys(conn, settings)
    elif settings.mark_key is not None:
        marks.install(settings.mark_key.get_secret_value().encode(), source="settings")
    dead = open_dead_letters(settings)
    try:
        yield dead
    finally:
        await dead.close()
