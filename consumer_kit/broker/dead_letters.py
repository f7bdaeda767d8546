"""Dead-letter queues (``consumer-kit dlq``): what a dead letter shows, the broker contract for
listing and redriving them, and the one redrive loop every adapter fills with its broker calls.

:mod:`consumer_kit.broker` re-exports the types, so adapters keep importing the broker contract
from there. This module imports nothing of consumer_kit but :mod:`consumer_kit.errors` and the
headers codec (:mod:`consumer_kit.codec.headers`).
"""

from __future__ import annotations

import abc
import datetime as dt
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

from consumer_kit.codec import headers as own
from consumer_kit.errors import ConfigurationError, CopyRefused, RemoveFailed

logger = logging.getLogger("consumer_kit.dead_letters")

M = TypeVar("M")

REASON_ON_COPY_CHARS = 200
"""A redriven copy records the dead letter's reason (``x-consumer-kit-redriven``) cut to this many
characters."""


@dataclass(frozen=True)
class DeadLetter:
    """One message in a dead-letter queue, as ``consumer-kit dlq list`` shows it.

    Attributes:
        queue: the work queue it was dead-lettered from (and is redriven to).
        message_id: the message id consumer-kit saw (an event id for relayed events).
        reason: consumer-kit's machine-readable reason (``payload_conflict``,
            ``max_deliveries:RetryableError``, ...) or ``broker:<the broker's own>`` where the
            broker moved it (RabbitMQ ``x-death``, SQS redrive, Service Bus's ``MaxDeliveryCountExceeded``).
        detail: the human-readable detail ("" where none); never payload content.
        delivery_count: deliveries before it was dead-lettered (0 where unknown).
        dead_lettered_at: when it reached the dead-letter queue (aware UTC), where the broker says.
        enqueued_at: when the broker first accepted the message (aware UTC), where it says.
        operation_key: header ``operation-id`` (``consumer-kit dlq --app`` computes keys that
            handlers derive from the body).
        headers: the application headers, dead-letter ones included.
        body: the raw body (bytes); shown only with ``--show-body``.
        sender: the broker's authenticated sender of this message in the dead-letter queue
            (RabbitMQ validated ``user_id``, SQS ``SenderId``; ``None``: none). A redriven copy
            carries the original's sender (:func:`sender_of_letter`), never the operator's.
    """

    queue: str
    message_id: str | None
    reason: str
    detail: str
    delivery_count: int
    dead_lettered_at: dt.datetime | None
    enqueued_at: dt.datetime | None
    operation_key: str | None
    headers: Mapping[str, Any]
    body: bytes
    sender: str | None = None


def header_text(value: Any) -> str:
    """A header value as a dead-letter listing shows it: bytes decoded as UTF-8 (bad bytes
    replaced), ``None`` as ``""``, anything else ``str()``."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return "" if value is None else str(value)


def header_count(value: Any) -> int:
    """A count carried in a header or a broker attribute (a string, bytes or an int); 0 when it
    is missing, negative or not a whole number."""
    try:
        return max(0, int(header_text(value)))
    except ValueError:
        return 0


@dataclass
class RedriveReport:
    """What a redrive did: messages ``redriven`` (or, in a dry run, that would be), ``kept``
    (not selected, left in the dead-letter queue) and ``failed`` (the copy was refused; left)."""

    redriven: int = 0
    kept: int = 0
    failed: int = 0


RedriveProgress = Callable[[DeadLetter, bool], None]
"""Called after each message a redrive looked at, with ``True`` when it was (or would be) moved."""


class DeadLetterQueues:
    """The dead-letter side of a broker: list a work queue's dead letters and move them back.

    An adapter provides it as ``dead_letters_from_settings(settings)`` in its module (found through
    the ``consumer_kit.brokers`` entry points, :func:`consumer_kit.broker.registry.open_dead_letters`);
    a broker without one gets this base class, whose every method raises
    :class:`~consumer_kit.errors.ConfigurationError` ("not supported").

    **Redrive contract.** A redriven message goes back to its work queue with the same body, message
    id and operation headers (so the same operation key: a redrive of an operation already done is
    answered as a duplicate, a resolved one replays its resolution), without the dead-letter
    headers, and with its delivery count starting again; it is sent (and confirmed) before it is
    removed from the dead-letter queue, so a crash in between redrives it twice, which the ledger
    answers as a duplicate. Messages not selected stay where they are. The ledger's attempt count
    is kept: a redriven message whose handler fails again is dead-lettered at its next failure.
    Adapters implement the loop of one redrive with :class:`Redrive`.
    """

    async def count(self, queue: str) -> int:
        """Messages in ``queue``'s dead-letter queue now (the broker's count; may lag).

        Raises:
            ConfigurationError: not supported by this broker, or the queue has no dead-letter queue.
            ConnectionError: the broker cannot be reached.
        """
        raise self._unsupported(queue)

    async def peek(self, queue: str, *, limit: int = 100) -> list[DeadLetter]:
        """Up to ``limit`` dead letters of the work queue ``queue``, oldest first, without removing
        any (each stays where it was; a broker without a peek counts one more receive).

        Raises:
            ConfigurationError: not supported by this broker, or the queue has no dead-letter queue.
            ConnectionError: the broker cannot be reached.
        """
        raise self._unsupported(queue)

    async def redrive(
        self, queue: str, select: Callable[[DeadLetter], bool], *, dry_run: bool = False,
        progress: RedriveProgress | None = None,
    ) -> RedriveReport:
        """Move the dead letters of ``queue`` that ``select`` accepts back to ``queue`` (contract in
        the class docstring); with ``dry_run``, only count them. Looks at each message that is in
        the dead-letter queue when it starts, once. An adapter implements :meth:`_redrive`.

        Raises:
            ConfigurationError: not supported by this broker, or the queue has no dead-letter queue.
            ConnectionError: the broker cannot be reached.
        """
        return await self._redrive(queue, RedriveAsked(select, dry_run, progress))

    async def _redrive(self, queue: str, asked: RedriveAsked) -> RedriveReport:
        """:meth:`redrive` on this broker (usually a loop feeding a :class:`Redrive`)."""
        raise self._unsupported(queue)

    async def close(self) -> None:
        """Close connections."""

    def _unsupported(self, queue: str) -> ConfigurationError:
        return ConfigurationError(
            f"listing and redriving dead letters is not supported by this broker ({type(self).__name__}); "
            f"read the dead-letter queue of {queue!r} with the broker's own tools"
        )


@dataclass(frozen=True)
class RedriveAsked:
    """What :meth:`DeadLetterQueues.redrive` was asked: which dead letters to move (``select``),
    whether only to count them (``dry_run``), whom to tell (``progress``)."""

    select: Callable[[DeadLetter], bool]
    dry_run: bool = False
    progress: RedriveProgress | None = None


class Redrive(abc.ABC, Generic[M]):
    """One redrive pass over one dead-letter queue, as every adapter runs it: select, send the copy,
    only then remove the original, count into :attr:`report`, tell ``progress``.

    An adapter subclasses it with its broker calls (:meth:`send_copy`, :meth:`remove`) and feeds
    each message it takes from the dead-letter queue (of type ``M``, the broker's message) to
    :meth:`look_at`, or, where choosing and moving are separate steps (Service Bus chooses by
    peeking, then receives), to :meth:`choose` and later :meth:`move`.

    Args:
        asked: ``select``, ``dry_run`` (only count what would be moved; nothing is sent or
            removed) and ``progress`` (called once for each dead letter looked at, with ``True``
            when it was, or in a dry run would be, moved).
        target: the work queue copies go to, for log lines.
        source: the dead-letter queue, for log lines.
    """

    def __init__(self, asked: RedriveAsked, *, target: str, source: str) -> None:
        self.report = RedriveReport()
        self._select = asked.select
        self._dry_run = asked.dry_run
        self._progress = asked.progress
        self._target = target
        self._source = source

    @abc.abstractmethod
    async def send_copy(self, message: M, letter: DeadLetter) -> None:
        """Send the copy of ``message`` to the work queue and wait for the broker to accept it.

        Raises:
            CopyRefused: the broker refused it, or it does not fit.
            ConnectionError, ConfigurationError: the redrive cannot go on (it stops there).
        """

    @abc.abstractmethod
    async def remove(self, message: M, letter: DeadLetter) -> None:
        """Remove ``message`` from the dead-letter queue (its copy was accepted).

        Raises:
            RemoveFailed: it could not be removed (it stays there too).
            ConnectionError: the redrive cannot go on (it stops there).
        """

    async def look_at(self, message: M, letter: DeadLetter) -> bool:
        """:meth:`choose`, then :meth:`move` when chosen. ``True`` when the message left the
        dead-letter queue (or, after a refused removal, was sent anyway); ``False`` when it stays
        there (not selected, a dry run, the copy refused)."""
        return self.choose(letter) and await self.move(message, letter)

    def choose(self, letter: DeadLetter) -> bool:
        """Apply ``select``. A dead letter not selected is counted ``kept``; in a dry run a selected
        one is counted ``redriven``; both are told to ``progress`` here. ``True`` when it is to be
        moved (selected, not a dry run): the caller then calls :meth:`move` for it."""
        selected = self._select(letter)
        if selected and not self._dry_run:
            return True
        if selected:
            self.report.redriven += 1
        else:
            self.report.kept += 1
        self._told(letter, selected)
        return False

    async def move(self, message: M, letter: DeadLetter) -> bool:
        """Send the copy, then remove the original (at least once: a crash in between leaves it in
        both places). ``False`` when the copy was refused (counted ``failed``, left in the
        dead-letter queue); ``True`` when it was sent (counted ``redriven``, even if the removal
        failed: it then stays in the dead-letter queue as well). Tells ``progress``."""
        try:
            await self.send_copy(message, _sender_kept(_first_enqueue_kept(letter)))
        except CopyRefused as refused:
            self.report.failed += 1
            logger.warning("redrive of message_id=%s to %s refused (%s): left in the dead-letter queue",
                           letter.message_id, self._target, refused)
            self._told(letter, False)
            return False
        self.report.redriven += 1
        try:  # only now: a crash before this line leaves the message in both places (a duplicate)
            await self.remove(message, letter)
        except RemoveFailed as failed:
            logger.warning(
                "redriven message_id=%s to %s but could not remove it from %s (%s): it stays there "
                "too; redriving it again is answered as a duplicate",
                letter.message_id, self._target, self._source, failed,
            )
        self._told(letter, True)
        return True

    def _told(self, letter: DeadLetter, moved: bool) -> None:
        if self._progress is not None:
            self._progress(letter, moved)


def _first_enqueue_kept(letter: DeadLetter) -> DeadLetter:
    """``letter`` with ``x-consumer-kit-first-enqueued`` set to the earliest of its (signed) mark
    and the broker's first enqueue time of the letter, so the redriven copy, a new message with a
    new enqueue time, keeps the operation's age (key expiry). The adapter's copy signs it."""
    carried = own.read_time(own.lookup(letter.headers, own.FIRST_ENQUEUED))
    known = [when for when in (carried, letter.enqueued_at) if when is not None]
    if not known:
        return letter
    first = min(known).astimezone(dt.UTC).isoformat()
    return replace(letter, headers={**letter.headers, own.FIRST_ENQUEUED: first})


def sender_of_letter(letter: DeadLetter) -> str:
    """The authenticated sender of the operation ``letter`` carries (``""``: none): the signed
    ``x-consumer-kit-sender`` of the worker's dead-letter copy (the codec has dropped an unsigned
    one), else the broker's sender of the letter itself (a message the broker moved, or one a
    producer published straight into the dead-letter queue: it earns no more than its own sender)."""
    carried = own.read_text(own.lookup(letter.headers, own.SENDER), 255)
    if carried is not None:
        return carried
    return letter.sender or ""


def _sender_kept(letter: DeadLetter) -> DeadLetter:
    """``letter`` with ``x-consumer-kit-sender`` set to :func:`sender_of_letter`, so the redriven
    copy, sent by whoever runs the redrive, is judged as the original sender's
    (docs/explanation/trust.md). The adapter's copy signs it."""
    kept = {k: v for k, v in letter.headers.items() if not (isinstance(k, str) and k.lower() == own.SENDER)}
    return replace(letter, headers={**kept, own.SENDER: sender_of_letter(letter)})
