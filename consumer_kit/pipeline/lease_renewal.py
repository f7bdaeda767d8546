"""Keeping an attempt's lease: the renewer of the leased path (docs/how-to/external-effects.md).

While a handler with external effects runs, its lease in the ledger and its delivery's peek-lock
are extended every third of ``lease_seconds``; when either is lost the attempt is cancelled (it no
longer owns the operation) and ends with :class:`~consumer_kit.errors.LeaseLost`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

from consumer_kit.broker import Delivery
from consumer_kit.errors import LeaseLost
from consumer_kit.model.identity import OperationIdentity

logger = logging.getLogger("consumer_kit.leased")

_MIN_RENEW_INTERVAL = 0.2  # seconds


class HeldLease(Protocol):
    """What the renewer needs of an attempt (the leased path's run)."""

    lost: str | None  # why this worker no longer holds the lease; set by the renewer
    leased_from: float  # the loop's clock just before the statement that granted the lease
    identity: OperationIdentity
    delivery: Delivery

    @property
    def lease_seconds(self) -> float: ...

    async def renew_lease(self) -> bool: ...


@contextlib.asynccontextmanager
async def renewing(run: HeldLease) -> AsyncIterator[None]:
    """Extend the lease and the delivery's peek-lock every third of ``lease_seconds`` while the
    attempt runs; when either is lost, cancel the attempt (it no longer owns the operation)."""
    owner = asyncio.current_task()
    assert owner is not None
    # one-shot: lives as long as this attempt, cancelled and awaited when it ends
    renewer = asyncio.create_task(_renew_until_lost(run, owner), name="consumer-kit lease renewer")
    try:
        yield
    except asyncio.CancelledError:
        if run.lost is None:
            raise  # a shutdown, not a lost lease
        owner.uncancel()
        raise LeaseLost(run.lost) from None
    finally:
        renewer.cancel()
        await asyncio.gather(renewer, return_exceptions=True)

async def _renew_until_lost(run: HeldLease, owner: asyncio.Task[Any]) -> None:
    """Renew every third of the lease (seconds; the first renewal a third of it after the
    claim or take-over was sent, the next ones a third after the previous one ended). The
    attempt is stopped at ``deadline``, a tenth of the lease before the ledger's lease runs
    out, counted from when the statement that set the lease was sent (the claim or take-over
    first, then the last successful renewal), which is no later than the database's ``now()``
    for it, whatever a renewal in flight is doing: a renewal that hangs, or a renewer that
    starts late (a busy event loop), must not let the attempt outlive its lease."""
    lease = run.lease_seconds
    interval = max(lease / 3, _MIN_RENEW_INTERVAL)
    margin = lease / 10
    loop = asyncio.get_running_loop()
    deadline = run.leased_from + lease - margin
    due = run.leased_from + interval  # a renewer that starts late renews at once
    while True:
        await asyncio.sleep(max(0.0, min(due, deadline) - loop.time()))
        sent = loop.time()
        renewed: bool | None = None
        if sent < deadline:
            try:
                async with asyncio.timeout(deadline - sent):
                    renewed = await run.renew_lease()
            except Exception as exc:  # noqa: BLE001 - the database may be back before the deadline
                logger.warning("lease renewal failed (%s) scope=%s operation_key=%s",
                               type(exc).__name__, run.identity.scope, run.identity.key)
        if renewed:
            deadline = sent + lease - margin
        if renewed is False or loop.time() >= deadline:
            run.lost = "lease taken over" if renewed is False else "lease could not be renewed in time"
        elif not await run.delivery.renew_lock():
            run.lost = "the broker's peek-lock was lost"
        if run.lost is not None:
            owner.cancel()
            return
        due = loop.time() + interval
