"""When a lock expires, on the worker's own monotonic clock (never the host's wall clock).

Service Bus states a lock's expiry as ``locked_until``, a time on *its* clock. Compared with the
worker's wall clock, a worker 20 s behind the broker believes a 10 s lock has 30 s left (it renews
too late: the lock is lost and the message runs twice) and one 20 s ahead believes it expired 10 s
ago (it renews as often as it can). So the adapter never compares a broker time with a host time.
It keeps, per lock, its expiry on ``time.monotonic()``:

* at the grant (a receive, a session accept): ``requested + duration``, where ``requested`` is the
  monotonic time the receive or accept was *asked for* (the lock cannot have started earlier, so
  the estimate errs early) and ``duration`` the lock duration the broker granted (below);
* at each renewal: the previous local expiry plus how far the broker moved ``locked_until``
  (a difference of two broker times: no clock offset in it).

**The granted duration** is the entity's LockDuration. Service Bus does not send it with a message,
so the adapter takes the smallest of: the operator's setting for the entity (``lock_duration``, one
value or one per entity: an override), and, from every lock the entity granted so far (a message's,
a session's), ``locked_until`` minus the host's time when the grant was seen (the lock cannot have
started later; with the host's clock in step with the broker's this is the duration, shortened by
the receive's own latency) and ``locked_until - enqueued_time`` (both broker times; a message cannot
be locked before it was enqueued: exact for a message received as soon as it arrived, whatever the
host's clock says). The first bound is what keeps a message out of a backlog from being timed by its
age plus the lock (its renewal would come after the lock expired); the second is what keeps a host
clock behind the broker's from overstating a fresh message's lock. Only a message out of a backlog
*and* a host clock behind the broker's by more than half the lock make the estimate late: give the
entity's LockDuration in the setting where clocks cannot be trusted.

**The SDK's own checks.** azure-servicebus 7.15 refuses, without asking the broker, to settle a
message whose ``locked_until_utc`` is past on the host's clock (``MessageLockLostError``,
``_servicebus_receiver_async.py`` "hot fix for settling a message received ... after lock
expiration"), and any operation of a session receiver whose session ``locked_until_utc`` is past
(``SessionLockLostError`` from ``_check_live``). With the worker ahead of the broker, every lock
would look lost there. :func:`align_sdk` rewrites the SDK's copy of the expiry on the host's clock
from the monotonic estimate (plus :data:`SDK_MARGIN`: the broker stays the judge of a lost lock).

Broker times that matter later (a message's ``expires_at_utc``) are mapped the same way:
local expiry of the lock + (broker time - ``locked_until``).
"""

from __future__ import annotations

import datetime as dt
import math
import time
from collections.abc import Mapping

SDK_MARGIN = 5.0  # seconds the SDK's copy of an expiry is set beyond the estimate (the broker decides)


def host_clock_expiry(seconds_left: float) -> dt.datetime:
    """An expiry ``seconds_left`` (monotonic estimate) from now on the host's clock, plus the margin."""
    return dt.datetime.now(dt.UTC) + dt.timedelta(seconds=max(0.0, seconds_left) + SDK_MARGIN)


def align_sdk(holder: object, attribute: str, seconds_left: float) -> None:
    """Set the SDK's private expiry ``attribute`` of ``holder`` (a received message's ``_expiry``,
    a session's ``_locked_until_utc``) on the host's clock (module docstring); a no-op when an
    SDK version has no such attribute."""
    if hasattr(holder, attribute):
        setattr(holder, attribute, host_clock_expiry(seconds_left))


class LockDurations:
    """The lock duration per entity, as far as the adapter can know it (module docstring).

    Args:
        configured: seconds, the entities' LockDuration as the operator states it: one value for
            every entity, or ``{entity path: seconds}`` (case-insensitive), or ``None``.

    Raises:
        ValueError: a configured duration is not > 0 seconds.
    """

    def __init__(self, configured: float | Mapping[str, float] | None = None) -> None:
        values = configured.values() if isinstance(configured, Mapping) else [configured]
        if any(value is not None and value <= 0 for value in values):
            raise ValueError("lock_duration must be > 0 seconds")
        self._default = math.inf
        self._per_entity: dict[str, float] = {}
        if isinstance(configured, Mapping):
            self._per_entity = {name.casefold(): float(value) for name, value in configured.items()}
        elif configured is not None:
            self._default = float(configured)
        self._learned: dict[str, float] = {}

    def observe(self, entity: str, locked_until: dt.datetime | None, enqueued: dt.datetime | None = None) -> None:
        """Learn from one lock ``entity`` granted just now: its broker-stamped expiry and, for a
        message, its enqueued time (``None`` for a session lock)."""
        if locked_until is None:
            return
        bounds = [(locked_until - dt.datetime.now(dt.UTC)).total_seconds()]
        if enqueued is not None:
            bounds.append((locked_until - enqueued).total_seconds())
        for bound in bounds:
            if bound > 0:  # (not positive: a host clock ahead of the broker's, no bound at all)
                key = entity.casefold()
                self._learned[key] = min(self._learned.get(key, math.inf), bound)

    def of(self, entity: str) -> float | None:
        """Seconds, the best upper bound known for ``entity``; ``None`` when nothing is known yet."""
        key = entity.casefold()
        value = min(self._per_entity.get(key, self._default), self._learned.get(key, math.inf))
        return None if math.isinf(value) else value


class LockExpiry:
    """One lock's expiry on the monotonic clock, kept in step with the broker's ``locked_until``.

    Args:
        requested: ``time.monotonic()`` when the receive (or session accept) was asked for.
        duration: seconds granted (:class:`LockDurations`), ``None`` when unknown.
        broker_until: the broker's ``locked_until`` for the grant, ``None`` when not given.
    """

    def __init__(self, requested: float, duration: float | None, broker_until: dt.datetime | None) -> None:
        self._broker_until = broker_until
        self._duration = duration
        if duration is None and broker_until is not None:
            # Nothing known of the duration (a session accepted before any message of the entity
            # was seen): the broker's own view, until the first message tightens it (refine()).
            duration = max(0.0, (broker_until - dt.datetime.now(dt.UTC)).total_seconds())
        self._requested = requested
        self._local_until = requested + (duration or 0.0)

    def seconds_left(self, now: float | None = None) -> float:
        """Seconds until the lock expires, on the monotonic clock (negative once past)."""
        return self._local_until - (time.monotonic() if now is None else now)

    def refine(self, duration: float) -> None:
        """A bound on the granted duration became known: it replaces the broker's view (which a
        skewed clock distorts) and otherwise only ever shortens the estimate."""
        if self._duration is None:
            self._local_until = self._requested + duration
        else:
            self._local_until = min(self._local_until, self._requested + duration)
        self._duration = duration if self._duration is None else min(self._duration, duration)

    def renewed(self, broker_until: dt.datetime | None, *, sent: float, answered: float) -> None:
        """The broker renewed the lock to ``broker_until``: asked for at monotonic ``sent``,
        answered at ``answered``. The expiry moves as far as the broker moved it, and never past
        ``answered + duration`` (the renewal was granted before it was answered)."""
        if broker_until is None:
            return
        if self._broker_until is not None:
            self._local_until += max(0.0, (broker_until - self._broker_until).total_seconds())
        if self._duration is not None:
            # granted between ``sent`` and ``answered``: its expiry lies in that span plus the duration
            self._local_until = min(max(self._local_until, sent + self._duration), answered + self._duration)
        self._broker_until = broker_until
        self._requested = sent

    def broker_time_in(self, seconds: float) -> dt.datetime | None:
        """The broker's time ``seconds`` from now (for a scheduled enqueue time), ``None`` when unknown."""
        if self._broker_until is None:
            return None
        return self._broker_until + dt.timedelta(seconds=seconds - self.seconds_left())

    def local_time_of(self, broker_time: dt.datetime) -> float | None:
        """``broker_time`` (a broker timestamp, e.g. ``expires_at_utc``) on the monotonic clock."""
        if self._broker_until is None:
            return None
        return self._local_until + (broker_time - self._broker_until).total_seconds()
