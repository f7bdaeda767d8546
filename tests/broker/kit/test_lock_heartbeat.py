"""The heartbeat both pull adapters (SQS, NATS) keep their held deliveries locked with
(:mod:`consumer_kit.broker.kit.lock_heartbeat`) and the lock clock of a pulled delivery
(:class:`consumer_kit.broker.kit.pull_consumer.PulledDelivery`), with a "broker" that is a list of call
outcomes. No broker needed."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from consumer_kit.broker import Settlement
from consumer_kit.broker.kit.lock_heartbeat import LockHeartbeat
from consumer_kit.broker.kit.pull_consumer import PulledDelivery

logger = logging.getLogger("tests.lock_heartbeat")


class Pulled(PulledDelivery):
    def __init__(self, lock_seconds: float, left: float) -> None:
        super().__init__(queue="q", message_id="m", headers={}, body=b"", delivery_count=1)
        self.lock_seconds, self.locked_until, self.lock_lost = lock_seconds, time.monotonic() + left, False
        self._on_settled = lambda delivery: None

    async def _ack(self) -> None: ...

    async def _retry(self, delay: float) -> None: ...

    async def _dead_letter(self, reason: str, detail: str) -> None: ...

    async def _release(self) -> None: ...


class Scripted(LockHeartbeat[Pulled]):
    """Each extension call takes the next outcome of ``script`` (``None``: it works)."""

    log = logger
    call = "extension"

    def __init__(self, script: list[Exception | None]) -> None:
        super().__init__("test heartbeat")
        self.script = script
        self.worked = asyncio.Event()

    async def renew(self, delivery: Pulled) -> bool:
        await self._extend([delivery])
        return True

    async def _extend(self, deliveries: list[Pulled]) -> None:
        sent_at = time.monotonic()
        outcome = self.script.pop(0) if self.script else None
        if outcome is not None:
            raise outcome
        for delivery in deliveries:
            self._extended(delivery, sent_at, delivery.lock_seconds)
        self.worked.set()

    def _describe(self, exc: Exception) -> str:
        return type(exc).__name__


def test_a_delivery_is_due_with_half_its_lock_left_while_it_holds_it_unsettled() -> None:
    beat = Scripted([])
    assert beat._due(Pulled(30, 15)) and not beat._due(Pulled(30, 20))
    settled, lost, lapsed = Pulled(30, 5), Pulled(30, 5), Pulled(30, 0.5)
    settled.settlement, lost.lock_lost = Settlement.ACK, True
    assert not any(beat._due(d) for d in (settled, lost, lapsed))
    assert lapsed.holds_lock is False  # within its margin (10 % of the lock, at most 1 s)
    assert Pulled(30, 1.5).holds_lock and not Pulled(4, 0.3).holds_lock
    assert beat._tick() == 10.0  # nothing held


async def test_a_failing_extension_is_logged_once_and_made_again_at_the_next_beat(
    caplog: pytest.LogCaptureFixture,
) -> None:
    beat = Scripted([ConnectionError("gone"), TimeoutError("still gone")])
    delivery = Pulled(30, 10)  # due at once
    short = Pulled(0.4, 0.4)  # the shortest lock held: a beat every 0.1 s
    short.settlement = Settlement.ACK
    with caplog.at_level(logging.INFO, logger="tests.lock_heartbeat"):
        beat.hold(delivery)
        beat.hold(short)
        assert beat._tick() == pytest.approx(0.1)
        try:
            await asyncio.wait_for(beat.worked.wait(), 10)
        finally:
            await beat.close()
    assert [r.getMessage() for r in caplog.records] == [
        "extension of 1 held deliveries failed (ConnectionError); retrying"
    ]
    assert beat.extensions == 1 and delivery.locked_until > time.monotonic() + 25  # a full lock again
    assert not beat._failing and set(beat.held()) == {delivery, short}
    beat.drop(delivery)
    assert beat.held() == (short,)
