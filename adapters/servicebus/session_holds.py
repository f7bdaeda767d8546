"""A hold mark in a session's state: how a session receiver learns that the last holder died.

Service Bus does **not** raise the delivery count of session messages left unsettled when the
session is closed, its link or its connection dropped (Microsoft's *Message sessions* page, table
"delivery count per message in the context of sessions": "Session is accepted, the messages within
the session aren't completed (even if they're locked), and the session is closed: No"). A worker
that dies holding a session message, or hands it back unsettled, therefore gives it back looking
fresh: its delivery count cannot tell a crash, and a poison message that kills every worker would
never trip the crash limit nor reach ``MaxDeliveryCount``.

So the adapter keeps its own broker-side mark, in the session state (which lives on the broker,
survives the process, and is readable only by the session's lock holder):

=======================================  =================================================
step                                     session state
=======================================  =================================================
a slot accepts a session                 read; then set to :data:`HOLD_MARK`
the slot gives the session up cleanly    set to ``None`` (no message left unsettled)
(empty for now, pause, shutdown)
the worker handed a delivery back        left as it is: :data:`HOLD_MARK`
unsettled, or the process died, or the
session lock was lost
=======================================  =================================================

A slot that finds :data:`HOLD_MARK` on accepting a session makes the session's first delivery a
*suspect* (``redelivered``): it runs alone under the ledger's run-alone marker, which counts the
crash and parks the message as ``crashed_worker`` at ``crash_limit``
(:mod:`consumer_kit.pipeline.isolation`), whatever Service Bus counted. A holder that died between
two messages makes the next first delivery a false suspect: it costs running alone once.

A session state that is not consumer-kit's (an application's own) is never overwritten: the
session's first delivery is then always a suspect (false suspects only, no crash missed).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from azure.servicebus.aio import ServiceBusReceiver

from .errors import describe

logger = logging.getLogger(__name__)

HOLD_MARK = b"consumer-kit:held:v1"
"""The session state while a consumer-kit slot holds the session (bytes)."""


@dataclass(frozen=True)
class Hold:
    """What :func:`take_hold` found and did.

    Attributes:
        suspect: the session's first delivery must be a suspect (the mark was found, the state is
            foreign, or it could not be read).
        marked: the mark is set (and is to be cleared on a clean give-up).
    """

    suspect: bool
    marked: bool


async def take_hold(receiver: ServiceBusReceiver, management: asyncio.Lock, timeout: float) -> Hold:
    """Read the session's state and set :data:`HOLD_MARK` (table in the module docstring). Each
    request is bounded by ``timeout`` seconds; never raises (except cancellation)."""
    session = receiver.session
    try:
        async with asyncio.timeout(timeout), management:
            state = await session.get_state()
    except Exception as exc:  # noqa: BLE001 - unknown: a false suspect at worst
        logger.info("reading the state of session %s failed (%s): its first delivery is a suspect",
                    session.session_id, describe(exc))
        return Hold(suspect=True, marked=False)
    if state is not None and bytes(state) != HOLD_MARK:
        logger.warning(
            "session %s has a state consumer-kit did not set: left untouched, its first delivery runs alone",
            session.session_id,
        )
        return Hold(suspect=True, marked=False)
    try:
        async with asyncio.timeout(timeout), management:
            await session.set_state(HOLD_MARK)
    except Exception as exc:  # noqa: BLE001 - no mark: a crash now would go unseen by the next holder
        logger.warning("marking session %s as held failed (%s)", session.session_id, describe(exc))
        return Hold(suspect=state is not None, marked=False)
    return Hold(suspect=state is not None, marked=True)


async def clear_hold(receiver: ServiceBusReceiver, management: asyncio.Lock, timeout: float) -> None:
    """Clear the mark: the session is given up with nothing unsettled. Bounded by ``timeout``
    seconds; a failure only makes the next holder's first delivery a false suspect."""
    session = receiver.session
    try:
        async with asyncio.timeout(timeout), management:
            await session.set_state(None)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        logger.info("clearing the hold mark of session %s failed (%s)", session.session_id, describe(exc))
