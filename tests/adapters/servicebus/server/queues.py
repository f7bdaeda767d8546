"""A queue, subscription or dead-letter queue: peek-lock delivery, settlement, deferral, sessions.

Imitates Service Bus (times in seconds since the Unix epoch, durations in seconds):

- the lowest available sequence number is handed out under a peek-lock of ``lock_duration``;
  abandon and lock expiry return the message with ``delivery_count + 1`` and dead-letter it with
  reason ``MaxDeliveryCountExceeded`` once the count reaches ``max_delivery_count``; release (the
  SDK's "not delivered after all") does not count;
- defer keeps the message aside until ``receive-by-sequence-number``; dead-letter moves it to the
  entity's ``$DeadLetterQueue`` with ``DeadLetterReason``/``DeadLetterErrorDescription``;
- a session-enabled queue locks whole sessions: one receiver per session, messages of a session in
  sequence order, the session lock (not the message lock) expires, and it carries a state blob.

Not thread-safe by itself: callers hold ``Namespace.lock`` (the inspection properties take it).
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import header_limits, wire
from .errors import (
    InvalidArgument,
    MessageLockLost,
    MessageNotFound,
    NotAllowed,
    SessionCannotBeLocked,
    SessionLockLost,
)
from .messages import MessageSnapshot, MessageState, StoredMessage
from .partitions import PeekTurn
from .sections import EncodedMessage
from .send_target import EntityOptions, SendTarget

MAX_DELIVERY_COUNT_EXCEEDED = "MaxDeliveryCountExceeded"
# Microsoft's "Service Bus dead-letter queues" page, table of system reasons.
TTL_EXPIRED = "TTLExpiredException"
TTL_EXPIRED_DESCRIPTION = "The message expired and was dead lettered."
# The same table: a message without a session id on a session entity. Not documented when Azure
# refuses the send (reported for queues: Azure/azure-service-bus#289) and when it dead-letters
# (reported for topic subscriptions: #196): ``EntityOptions.sessionless_sends`` picks for queues.
SESSION_ID_NULL = "Session id is null"
SESSION_ID_NULL_DESCRIPTION = "Session enabled entity doesn't allow a message whose session identifier is null."


class Settlement:
    """Outcomes a receiver can settle a locked message with."""

    COMPLETE = "complete"
    ABANDON = "abandon"
    DEFER = "defer"
    DEAD_LETTER = "dead-letter"
    RELEASE = "release"


@dataclass
class MessageSession:
    """A Service Bus message session: its lock holder, lock expiry and state blob."""

    session_id: str
    state: bytes | None = None
    owner: object | None = None
    locked_until: float = 0.0

    def is_locked(self, now: float) -> bool:
        return self.owner is not None and self.locked_until > now


class Queue(SendTarget):
    """A queue, a subscription or a dead-letter sub-queue: peek-lock delivery from held messages."""

    QUEUE = "queue"
    SUBSCRIPTION = "subscription"
    DEAD_LETTER_QUEUE = "dead-letter queue"

    def __init__(
        self, path: str, options: EntityOptions, lock: threading.RLock, *, kind: str = QUEUE,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if kind == self.DEAD_LETTER_QUEUE:
            # A dead-letter queue never dead-letters again and does not require sessions.
            options = EntityOptions(
                lock_duration=options.lock_duration, max_delivery_count=None,
                enable_partitioning=options.enable_partitioning,
            )
        super().__init__(path, options, lock)
        self.kind = kind
        self._clock = clock  # the broker's clock (epoch seconds; the server may skew it)
        # test hook: settlements applied but never answered (lose_settlement_replies)
        self.settlement_replies_to_lose = 0
        self.settlement_replies_lost = 0
        self._messages: dict[int, StoredMessage] = {}
        self._available: list[int] = []  # sequence numbers of active, unlocked messages, sorted
        self._locks: dict[Any, StoredMessage] = {}
        self._sessions: dict[str, MessageSession] = {}
        self._peek_turn = PeekTurn()
        self.dead_letter_queue: Queue | None = (
            None
            if kind == self.DEAD_LETTER_QUEUE
            else Queue(path + wire.DEAD_LETTER_SUFFIX, options, lock, kind=self.DEAD_LETTER_QUEUE, clock=clock)
        )

    def lose_settlement_replies(self, count: int = 1) -> None:
        """Test hook: the next ``count`` settlements by disposition on this entity are applied but
        never answered (the reply lost on its way: the SDK waits until its caller's bound)."""
        with self._lock:
            self.settlement_replies_to_lose = count

    def take_lost_reply(self) -> bool:
        """Whether the reply to a settlement just applied is to be lost (one of ``count``)."""
        with self._lock:
            if self.settlement_replies_to_lose <= 0:
                return False
            self.settlement_replies_to_lose -= 1
            self.settlement_replies_lost += 1
            return True

    @property
    def requires_session(self) -> bool:
        return self.options.requires_session

    # -- arrival --------------------------------------------------------------------------------

    def _check_acceptable(self, content: EncodedMessage) -> None:
        super()._check_acceptable(content)
        if self.requires_session and content.session_id is None and self.options.sessionless_sends == "refuse":
            raise NotAllowed(f"{self.path} requires sessions: the message needs a session_id")

    def _accept(self, stored: StoredMessage) -> None:
        if self.requires_session and stored.session_id is None and self.dead_letter_queue is not None:
            self._dead_letter(stored, SESSION_ID_NULL, SESSION_ID_NULL_DESCRIPTION)  # sessionless_sends
            return
        if self.kind == self.DEAD_LETTER_QUEUE:
            stored.time_to_live = math.inf  # dead letters stay until someone takes them
        else:
            # "Message expiration": the entity's default TTL applies to a message that sets none
            # and is the ceiling of one that does; it counts from the enqueued time (for a
            # scheduled message, the time it became active).
            default = self.options.default_message_time_to_live
            own = stored.content.time_to_live
            stored.time_to_live = min(
                stored.time_to_live, math.inf if own is None else own, math.inf if default is None else default
            )
        self._messages[stored.sequence_number] = stored
        bisect.insort(self._available, stored.sequence_number)

    def enqueue_copy(self, stored: StoredMessage) -> None:
        """Take a copy of a message that a topic (or dead-lettering) already sequenced."""
        copy = StoredMessage(
            stored.sequence_number,
            stored.content,
            enqueued_time=stored.enqueued_time,
            delivery_count=stored.delivery_count,
            time_to_live=stored.time_to_live,
        )
        self._accept(copy)

    # -- delivery -------------------------------------------------------------------------------

    def lock_next(self, owner: object, now: float, session_id: str | None = None) -> StoredMessage | None:
        """Lock the lowest available message (of ``session_id`` on a session queue) for ``owner``."""
        self._expire_messages(now)
        for index, sequence_number in enumerate(self._available):
            stored = self._messages[sequence_number]
            if self.requires_session and stored.session_id != session_id:
                continue
            del self._available[index]
            until = math.inf if self.requires_session else now + self.options.lock_duration
            self._locks[stored.lock(owner, until)] = stored
            return stored
        return None

    def take(self, stored: StoredMessage) -> None:
        """Remove a message handed out in receive-and-delete mode."""
        self._forget_lock(stored)
        self._messages.pop(stored.sequence_number, None)

    def settle(
        self,
        lock_token: Any,
        outcome: str,
        now: float,
        *,
        reason: str | None = None,
        description: str | None = None,
    ) -> None:
        """Apply a receiver's outcome to the message it holds under ``lock_token``.

        Raises MessageLockLost (SessionLockLost on a session queue) when the token is unknown,
        already settled or expired.
        """
        stored = self._held(lock_token, now)
        if outcome == Settlement.DEAD_LETTER:
            if self.dead_letter_queue is None:
                raise NotAllowed(f"cannot dead-letter a message of {self.path}")
            self._dead_letter(stored, reason, description, check_size=True)  # may refuse: still locked
            return
        self._forget_lock(stored)
        if outcome == Settlement.COMPLETE:
            del self._messages[stored.sequence_number]
        elif outcome == Settlement.ABANDON:
            self._give_back(stored, counted=True)
        elif outcome == Settlement.RELEASE:
            self._give_back(stored, counted=False)
        elif outcome == Settlement.DEFER:
            stored.state = MessageState.DEFERRED
        else:
            raise InvalidArgument(f"unknown settlement {outcome!r}")

    def renew_lock(self, lock_token: Any, now: float) -> float:
        """Extend a message lock by ``lock_duration``; returns the new expiry."""
        if self.requires_session:
            raise NotAllowed(f"messages of {self.path} are locked by their session: renew the session lock")
        stored = self._held(lock_token, now)
        stored.locked_until = now + self.options.lock_duration
        return stored.locked_until

    def _held(self, lock_token: Any, now: float) -> StoredMessage:
        stored = self._locks.get(lock_token)
        if self.requires_session:
            session = self._sessions.get(stored.session_id or "") if stored else None
            if (
                stored is None
                or session is None
                or session.owner is not stored.lock_owner
                or not session.is_locked(now)
            ):
                raise SessionLockLost(f"session lock lost in {self.path}")
            return stored
        if stored is None or stored.locked_until <= now:
            raise MessageLockLost(f"lock {lock_token} lost in {self.path}")
        return stored

    def _forget_lock(self, stored: StoredMessage) -> None:
        self._locks.pop(stored.lock_token, None)
        stored.unlock()

    def _give_back(self, stored: StoredMessage, *, counted: bool) -> None:
        """Return a message after an abandon, release or lost lock."""
        if counted:
            stored.delivery_count += 1
            limit = self.options.max_delivery_count
            if limit is not None and stored.delivery_count >= limit:
                self._dead_letter(
                    stored,
                    MAX_DELIVERY_COUNT_EXCEEDED,
                    f"Message could not be consumed after {limit} delivery attempts.",
                )
                return
        if stored.state is MessageState.ACTIVE:
            if stored.is_expired(self._clock()):
                # "Message expiration": a locked message is not expired, but "if the lock expires
                # or the message is abandoned, the expiration takes immediate effect".
                self._expire(stored)
                return
            bisect.insort(self._available, stored.sequence_number)

    def _expire_messages(self, now: float) -> None:
        """Expire every available (unlocked, active) message past its ExpiresAtUtc. Deferred
        messages are left alone: Service Bus does not expire them ("Message deferral")."""
        for sequence_number in [n for n in self._available if self._messages[n].is_expired(now)]:
            self._available.remove(sequence_number)
            self._expire(self._messages[sequence_number])

    def _expire(self, stored: StoredMessage) -> None:
        """Drop an expired message, or dead-letter it where the entity enables it."""
        if self.options.dead_lettering_on_message_expiration and self.dead_letter_queue is not None:
            self._dead_letter(stored, TTL_EXPIRED, TTL_EXPIRED_DESCRIPTION)
        else:
            self._messages.pop(stored.sequence_number, None)

    def _dead_letter(
        self, stored: StoredMessage, reason: str | None, description: str | None, *, check_size: bool = False
    ) -> None:
        """Move ``stored`` to the dead-letter queue with ``reason`` and ``description`` as properties.
        With ``check_size`` (a receiver's dead-letter request), a message that the two properties
        would take over Service Bus's header limits (``header_limits.py``: 32 KB per property, 64 KB
        in all, *Service Bus quotas*) is refused (HeaderTooLarge) and stays locked. The message's
        own size limit does not apply: the quotas tie the two properties to the header only."""
        extra = {wire.DEAD_LETTER_REASON: reason, wire.DEAD_LETTER_ERROR_DESCRIPTION: description}
        content = stored.content.with_application_properties({k: v for k, v in extra.items() if v is not None})
        if check_size:
            header_limits.check(content, "dead-lettered message")
        if check_size:
            self._forget_lock(stored)
        self._messages.pop(stored.sequence_number, None)
        if stored.sequence_number in self._available:
            self._available.remove(stored.sequence_number)
        assert self.dead_letter_queue is not None, "dead-letter queues never dead-letter"
        stored.content = content
        stored.state = MessageState.ACTIVE
        self.dead_letter_queue.enqueue_copy(stored)

    # -- deferred messages and peek ---------------------------------------------------------------

    def lock_deferred(
        self, sequence_numbers: list[int], owner: object, now: float, *, session_id: str | None, remove: bool
    ) -> list[StoredMessage]:
        """Lock (or, when ``remove``, take) deferred messages by sequence number."""
        found = []
        for sequence_number in sequence_numbers:
            stored = self._messages.get(sequence_number)
            if stored is None or stored.state is not MessageState.DEFERRED:
                raise MessageNotFound(f"no deferred message {sequence_number} in {self.path}")
            if self.requires_session and stored.session_id != session_id:
                raise MessageNotFound(f"deferred message {sequence_number} is not in session {session_id}")
            found.append(stored)
        for stored in found:
            self._forget_lock(stored)
            until = math.inf if self.requires_session else now + self.options.lock_duration
            self._locks[stored.lock(owner, until)] = stored
            if remove:
                self.take(stored)
        return found

    def peek(
        self, from_sequence_number: int, count: int, session_id: str | None = None
    ) -> list[StoredMessage]:
        """Held and scheduled messages from a sequence number on, without locking them: in sequence
        order, or, on a partitioned entity, those of one partition (:class:`.partitions.PeekTurn`)."""
        candidates = [*self._messages.values(), *self._scheduled.values()]
        chosen = [
            m
            for m in candidates
            if m.sequence_number >= from_sequence_number and (session_id is None or m.session_id == session_id)
        ]
        if self.options.enable_partitioning:
            return self._peek_turn.answer(chosen, count)
        return sorted(chosen, key=lambda m: m.sequence_number)[:count]

    # -- sessions ---------------------------------------------------------------------------------

    def accept_session(self, owner: object, session_id: str | None, now: float) -> MessageSession | None:
        """Lock ``session_id`` (or the next session with available messages when None) for ``owner``.

        Raises SessionCannotBeLocked when another receiver holds the named session; returns None
        when no session is available.
        """
        if session_id is None:
            session_id = self._next_available_session(now)
            if session_id is None:
                return None
        session = self._sessions.setdefault(session_id, MessageSession(session_id))
        if session.is_locked(now) and session.owner is not owner:
            raise SessionCannotBeLocked(f"session {session_id} of {self.path} is locked by another receiver")
        session.owner = owner
        session.locked_until = now + self.options.lock_duration
        return session

    def _next_available_session(self, now: float) -> str | None:
        for sequence_number in self._available:
            session_id = self._messages[sequence_number].session_id
            if session_id is None:
                continue
            session = self._sessions.get(session_id)
            if session is None or not session.is_locked(now):
                return session_id
        return None

    def session_for(self, session_id: str, owner: object | None, now: float) -> MessageSession:
        """The session ``owner`` holds (any holder when ``owner`` is None); raises SessionLockLost."""
        session = self._sessions.get(session_id)
        if (
            session is None
            or not session.is_locked(now)
            or (owner is not None and session.owner is not owner)
        ):
            raise SessionLockLost(f"session {session_id} of {self.path} is not locked by this receiver")
        return session

    def renew_session_lock(self, session_id: str, owner: object | None, now: float) -> float:
        session = self.session_for(session_id, owner, now)
        session.locked_until = now + self.options.lock_duration
        return session.locked_until

    def release_session(self, session_id: str, owner: object, *, counted: bool = False) -> None:
        """Drop ``owner``'s session lock; messages it still held go back to the session.

        Service Bus's *Message sessions* page ("delivery count per message in the context of
        sessions"): a session closed with messages unsettled (the receiver closed, its link or
        connection dropped) does **not** raise their delivery count; a session lock that expires
        does (``counted``)."""
        session = self._sessions.get(session_id)
        if session is None or session.owner is not owner:
            return
        counted = counted or session.locked_until <= self._clock()  # it had expired: an expiry, counted
        session.owner = None
        session.locked_until = 0.0
        for stored in [
            m for m in self._locks.values() if m.session_id == session_id and m.lock_owner is owner
        ]:
            self._forget_lock(stored)
            self._give_back(stored, counted=counted)

    # -- time -------------------------------------------------------------------------------------

    def expire(self, now: float) -> list[tuple[object, str]]:
        """Release due scheduled messages and expired locks; returns the (owner, session id) pairs that lost
        their session lock."""
        self.release_due(now)
        self._expire_messages(now)
        for stored in [m for m in self._locks.values() if m.locked_until <= now]:
            self._forget_lock(stored)
            self._give_back(stored, counted=True)
        lost = []
        for session in self._sessions.values():
            if session.owner is not None and session.locked_until <= now:
                owner = session.owner
                lost.append((owner, session.session_id))
                self.release_session(session.session_id, owner, counted=True)
        if self.dead_letter_queue is not None:
            lost.extend(self.dead_letter_queue.expire(now))
        return lost

    def expire_all_locks(self, now: float) -> None:
        """Test hook: make every message and session lock run out now, as if its duration had passed."""
        with self._lock:
            for stored in self._locks.values():
                stored.locked_until = min(stored.locked_until, now)
            for session in self._sessions.values():
                if session.owner is not None:
                    session.locked_until = min(session.locked_until, now)

    def age_messages(self, seconds: float) -> None:
        """Test hook: every held message was enqueued ``seconds`` earlier (a backlog that waited)."""
        with self._lock:
            for stored in self._messages.values():
                stored.enqueued_time -= seconds

    # -- inspection (takes the namespace lock) -----------------------------------------------------

    def _snapshots(self, state: MessageState | None = None) -> list[MessageSnapshot]:
        now = self._clock()
        with self._lock:
            chosen = [m for m in self._messages.values() if state is None or m.state is state]
            return [m.snapshot(now) for m in sorted(chosen, key=lambda m: m.sequence_number)]

    @property
    def messages(self) -> list[MessageSnapshot]:
        """Every held message (active, locked or deferred), in sequence order."""
        return self._snapshots()

    @property
    def active_count(self) -> int:
        """Active messages, locked ones included (Service Bus's ActiveMessageCount)."""
        return len(self._snapshots(MessageState.ACTIVE))

    @property
    def deferred(self) -> list[MessageSnapshot]:
        return self._snapshots(MessageState.DEFERRED)

    @property
    def locked_count(self) -> int:
        with self._lock:
            return len(self._locks)

    @property
    def dead_letters(self) -> list[MessageSnapshot]:
        """The dead-letter sub-queue's messages, in sequence order."""
        if self.dead_letter_queue is None:
            return []
        return self.dead_letter_queue.messages

    def session_state(self, session_id: str) -> bytes | None:
        with self._lock:
            session = self._sessions.get(session_id)
            return None if session is None else session.state

    def session_holder(self, session_id: str) -> object | None:
        """The receiver holding ``session_id``'s lock, or None."""
        with self._lock:
            session = self._sessions.get(session_id)
            return session.owner if session is not None and session.is_locked(self._clock()) else None
