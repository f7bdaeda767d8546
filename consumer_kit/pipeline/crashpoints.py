"""Named crash points at every boundary of the delivery and relay paths.

In production nothing is armed and :func:`reached` is one dictionary truth test. The testing kit
(``consumer_kit.testing``) or the environment variable ``CONSUMER_KIT_CRASH_AT=<point>[:kill|raise]``
arms a point: ``kill`` sends SIGKILL to this process (no cleanup, no ack, no rollback message),
``raise`` raises :class:`~consumer_kit.errors.SimulatedCrash`, which the runtime treats as process
death (the delivery stays unsettled until the broker's lock expires).
"""

from __future__ import annotations

import enum
import os
import signal
from dataclasses import dataclass

from consumer_kit.errors import SimulatedCrash


class CrashPoint(enum.StrEnum):
    BEFORE_CLAIM = "before_claim"
    AFTER_CLAIM = "after_claim"  # claim done (leased path: committed), effect not yet applied
    IN_HANDLER = "in_handler"  # the handler has run, its writes are not committed
    AFTER_COMMIT_BEFORE_ACK = "after_commit_before_ack"
    # leased path: reached when evidence of a remote call is recorded (docs/how-to/external-effects.md)
    DURING_EXTERNAL_CALL = "during_external_call"  # remote side accepted, reply lost
    AFTER_PUBLISH_BEFORE_MARK = "after_publish_before_mark"  # relay: broker confirmed, row not marked
    BEFORE_ACK = "before_ack"  # any settlement about to happen (duplicates too)
    # HTTP front door (consumer_kit.http): the request's COMMIT is durable, its response not yet sent
    AFTER_COMMIT_BEFORE_RESPONSE = "after_commit_before_response"


@dataclass
class _Arming:
    action: str  # "kill" | "raise"
    remaining: int  # fires this many more times; < 0 = always


_ARMED: dict[CrashPoint, _Arming] = {}


class Armed:
    """Returned by :func:`arm`: leaving its ``with`` block disarms every point."""

    def __enter__(self) -> Armed:
        return self

    def __exit__(self, *exc: object) -> None:
        disarm_all()


def arm(point: CrashPoint | str, *, action: str = "raise", times: int = 1) -> Armed:
    """Arm ``point`` to fire ``times`` times (``-1``: every time) with ``action`` ``"raise"`` or
    ``"kill"``; usable as a context manager that disarms every point when it ends.

    Raises:
        ValueError: an unknown ``action`` or point.
    """
    if action not in ("raise", "kill"):
        raise ValueError("action must be 'raise' or 'kill'")
    _ARMED[CrashPoint(point)] = _Arming(action, times)
    return Armed()


def disarm_all() -> None:
    _ARMED.clear()


def reached(point: CrashPoint) -> None:
    """Called by the runtime and relay at ``point``; fires if armed."""
    if not _ARMED:
        return
    arming = _ARMED.get(point)
    if arming is None or arming.remaining == 0:
        return
    if arming.remaining > 0:
        arming.remaining -= 1
    if arming.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise SimulatedCrash(point.value)


def _arm_from_environment() -> None:
    spec = os.environ.get("CONSUMER_KIT_CRASH_AT")
    if not spec:
        return
    point, _, action = spec.partition(":")
    arm(point, action=action or "kill", times=1)


_arm_from_environment()
