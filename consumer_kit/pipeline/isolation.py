"""Isolation: when a delivery may run, and crash isolation for redelivered messages
(docs/explanation/faults-and-attempts.md, the *crash* row).

A delivery first waits for its partition key's lane (:mod:`consumer_kit.pipeline.lanes`; waiting
there holds no slot), then for admission (:mod:`consumer_kit.pipeline.admission`): at most
``concurrency`` run at once, and a *redelivered* message (nobody settled its last hand-over: the
process may have died running it) runs alone. Running alone, it sets a run-alone marker in the
ledger's ``attempts`` table, renewed while it runs and cleared when it ends: a marker found
expired on the next run means the process died running it, and a crash is counted against this
operation and only this one. Once the process died ``crash_limit`` times, the message is parked as
``crashed_worker`` instead of run.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import psycopg
from psycopg_pool import AsyncConnectionPool

from consumer_kit.broker import Delivery, Settlement
from consumer_kit.codec.envelope import Envelope
from consumer_kit.errors import DeadLetterReason, GiveBack, SimulatedCrash
from consumer_kit.ledger import AttemptBook, AttemptCounts
from consumer_kit.model.decision import Decision
from consumer_kit.model.identity import OperationIdentity
from consumer_kit.model.outcomes import Outcome
from consumer_kit.pipeline.admission import Admission
from consumer_kit.pipeline.decoding import DecodedDelivery as Decoded
from consumer_kit.pipeline.faults import FaultKind, classify
from consumer_kit.pipeline.lanes import Lanes
from consumer_kit.pipeline.transaction import on_own_connection
from consumer_kit.settings import Settings
from consumer_kit.telemetry import describe_error

__all__ = ["Isolation"]

logger = logging.getLogger("consumer_kit.runtime")

T = TypeVar("T")

Run = Callable[[Delivery, Decoded, Envelope], Awaitable[Decision]]


class Isolation:
    """Lanes, admission and run-alone markers around ``run`` (the runtime's execution step).

    Args:
        pool: the worker's connection pool (the markers are written on connections of their own).
        settings: ``alone_marker_ttl`` (seconds), ``crash_limit``, ``statement_timeout``,
            ``in_progress_delay``.
        attempts: the ledger's attempt book (crash counts, markers).
        admission: the process's slots.
        run: runs one admitted delivery to a decision.
        released: the decision for an environment fault met while setting the marker (the
            delivery is given back uncounted and the worker told).
    """

    def __init__(
        self, pool: AsyncConnectionPool, settings: Settings, attempts: AttemptBook, admission: Admission, *,
        run: Run, released: Callable[[BaseException], Decision],
    ) -> None:
        self.pool = pool
        self.settings = settings
        self.attempts = attempts
        self.admission = admission
        self.lanes = Lanes()
        self._run = run
        self._released = released
        self._uncleared: set[OperationIdentity] = set()  # markers to clear once the database is back

    async def run(self, delivery: Delivery, decoded: Decoded, envelope: Envelope) -> Decision:
        """Run the delivery when its lane and admission allow (given back uncounted when the
        process is paused), alone if it was redelivered."""
        # The lane first: a delivery waiting behind an earlier one of its key holds no slot.
        async with self.lanes.lane(decoded.partition_key):
            try:
                if delivery.redelivered:
                    async with self.admission.alone():
                        return await self._run_alone(delivery, decoded, envelope)
                async with self.admission.slot():
                    return await self._run(delivery, decoded, envelope)
            except GiveBack as back:
                return Decision(Outcome.RELEASED, Settlement.RELEASED, reason=back.reason)

    async def flush_markers(self) -> None:
        """Clear the run-alone markers an unavailable database kept this process from clearing
        (a marker left behind would count as a crash on the operation's next run alone). The
        worker calls it when the database is back, before it starts deliveries again."""
        for identity in list(self._uncleared):
            try:
                await self._bookkeeping(functools.partial(self.attempts.finish_alone, identity=identity), "run-alone end")
            except Exception:  # noqa: BLE001 - still unavailable: try again at the next resume
                return
            self._uncleared.discard(identity)

    async def _run_alone(self, delivery: Delivery, decoded: Decoded, envelope: Envelope) -> Decision:
        """Run a redelivered message with nothing else running: if the process dies now, the next
        run finds this run's marker and counts a crash against this operation, and only this one."""
        identity = decoded.identity
        limit = self.settings.crash_limit
        try:
            counts = await self._start_alone(delivery, identity)
        except Exception as exc:  # noqa: BLE001 - classified below
            if classify(exc) is FaultKind.ENVIRONMENT:
                return self._released(exc)
            logger.error(
                "cannot keep the crash count (%s; is the schema migrated?): running message_id=%s "
                "alone without it", describe_error(exc), delivery.message_id,
            )
            return await self._run(delivery, decoded, envelope)
        if counts is None:
            # Another copy runs alone on a live worker (its marker stays renewed): it decides;
            # this copy comes back later and answers from the ledger.
            return Decision.in_progress(self.settings.in_progress_delay, "running_alone_elsewhere")
        if counts.crashes >= limit:
            logger.error(
                "parking scope=%s operation_key=%s message_id=%s: the process died %s times running it alone",
                identity.scope, identity.key, delivery.message_id, counts.crashes,
            )
            return Decision(
                Outcome.CRASHED_WORKER, Settlement.DEAD_LETTER,
                reason=DeadLetterReason.CRASHED_WORKER.value,
                detail=f"the worker process died {counts.crashes} times while running this operation "
                f"alone (crash_limit {limit}); attempt history in the ledger's attempts table",
            )
        # one-shot: lives as long as this run, cancelled when it ends
        renewer = asyncio.create_task(self._renew_alone(identity), name="consumer-kit run-alone marker")
        try:
            decision = await self._run(delivery, decoded, envelope)
        except SimulatedCrash:
            raise  # a simulated death leaves the marker to expire, as a real one would
        except BaseException:
            renewer.cancel()
            await self._finish_alone(identity)
            raise
        finally:
            renewer.cancel()
        await self._finish_alone(identity)
        return decision

    async def _start_alone(self, delivery: Delivery, identity: OperationIdentity) -> AttemptCounts | None:
        """Set the run-alone marker. A live marker of another run is waited out for at most one
        marker lifetime (still holding this process to itself): a dead run's marker expires in
        that time and its crash is counted; a live one is renewed, and ``None`` says so. Waiting
        here rather than through the broker keeps this delivery a suspect, so it still runs alone."""
        ttl = self.settings.alone_marker_ttl
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ttl * 1.2
        while True:
            counts = await self._bookkeeping(
                lambda conn: self.attempts.start_alone(
                    conn, identity, message_id=delivery.message_id, delivery_count=delivery.delivery_count,
                    crash_limit=self.settings.crash_limit, ttl=ttl,
                ),
                "the run-alone marker",
            )
            if counts is not None or loop.time() >= deadline:
                return counts
            await asyncio.sleep(ttl / 5)

    async def _renew_alone(self, identity: OperationIdentity) -> None:
        """Keep the run-alone marker live while the run lasts (a renewal that fails is retried at
        the next tick; the marker only expires if several in a row fail)."""
        ttl = self.settings.alone_marker_ttl
        while True:
            await asyncio.sleep(ttl / 5)
            try:
                await self._bookkeeping(lambda conn: self.attempts.renew_alone(conn, identity, ttl), "marker renewal")
            except Exception as exc:  # noqa: BLE001 - the next tick tries again
                logger.debug("run-alone marker renewal failed (%s)", type(exc).__name__)

    async def _finish_alone(self, identity: OperationIdentity) -> None:
        try:
            await self._bookkeeping(lambda conn: self.attempts.finish_alone(conn, identity), "run-alone end")
        except Exception as exc:  # noqa: BLE001 - kept and cleared by flush_markers() later
            self._uncleared.add(identity)
            logger.warning(
                "could not clear the run-alone marker of scope=%s operation_key=%s (%s); will retry",
                identity.scope, identity.key, describe_error(exc),
            )

    async def _bookkeeping(self, write: Callable[[psycopg.AsyncConnection[Any]], Awaitable[T]], what: str) -> T:
        return await on_own_connection(self.pool, self.settings.statement_timeout, write, what)
