"""The pull loop both pull adapters (SQS, NATS) run (:class:`consumer_kit.broker.kit.pull_consumer.PulledQueue`),
driven by a queue whose "broker" is a script of pull outcomes. No broker needed."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from consumer_kit.broker.kit.pull_consumer import PulledQueue

logger = logging.getLogger("tests.pull_consumer")


@dataclass(eq=False)
class Held:
    """What a queue holds, as far as the loop looks at it."""

    key: str
    message_id: str
    settlement: Any = None


class Beat:
    def __init__(self) -> None:
        self.held: set[str] = set()

    def hold(self, delivery: Any) -> None:
        self.held.add(delivery.key)

    def drop(self, delivery: Any) -> None:
        self.held.discard(delivery.key)


class ScriptedQueue(PulledQueue[str, Any]):
    """Each pull takes the next outcome of ``script``: a list of message keys, or an exception."""

    log = logger
    verb = "pull"
    lapse_note = "it comes back"

    def __init__(self, prefetch: int) -> None:
        super().__init__("q", lambda delivery: asyncio.sleep(0), prefetch, heartbeat=Beat())
        self.script: asyncio.Queue[list[str] | Exception] = asyncio.Queue()
        self.rooms: list[int] = []
        self.taken: asyncio.Queue[list[str]] = asyncio.Queue()

    async def _pull(self, room: int, requested_at: float) -> list[str]:
        self.rooms.append(room)
        outcome = await self.script.get()
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def _take(self, messages: Sequence[str], requested_at: float) -> None:
        for key in messages:
            delivery = Held(key, f"m-{key}")
            self.held[key] = delivery
            self._heartbeat.hold(delivery)
        self.taken.put_nowait(list(messages))

    def _describe(self, exc: Exception) -> str:
        return type(exc).__name__

    def _key(self, delivery: Any) -> Hashable:
        return delivery.key


async def test_pulls_ask_for_the_room_left_and_wait_for_a_free_slot() -> None:
    queue, resumed = ScriptedQueue(prefetch=3), asyncio.Event()
    resumed.set()
    loop = asyncio.create_task(queue.pull_until_stopped(resumed))
    try:
        queue.script.put_nowait(["a", "b"])
        assert await asyncio.wait_for(queue.taken.get(), 10) == ["a", "b"]
        queue.script.put_nowait(["c"])  # full now: the next pull waits for room
        assert await asyncio.wait_for(queue.taken.get(), 10) == ["c"]
        queue._settled(queue.held["b"])  # one slot free
        queue.script.put_nowait(["d"])
        assert await asyncio.wait_for(queue.taken.get(), 10) == ["d"]
        assert queue.rooms == [3, 1, 1]
        assert set(queue.held) == {"a", "c", "d"} and queue._heartbeat.held == {"a", "c", "d"}
    finally:
        queue.stop()
        queue.script.put_nowait([])
        await asyncio.wait_for(loop, 10)


async def test_an_outage_is_logged_once_retried_and_its_end_told(caplog: pytest.LogCaptureFixture) -> None:
    queue, resumed = ScriptedQueue(prefetch=5), asyncio.Event()
    resumed.set()
    for outcome in (ConnectionError("gone"), TimeoutError("still gone"), ["a"]):
        queue.script.put_nowait(outcome)
    with caplog.at_level(logging.INFO, logger="tests.pull_consumer"):
        loop = asyncio.create_task(queue.pull_until_stopped(resumed))
        try:
            assert await asyncio.wait_for(queue.taken.get(), 10) == ["a"]
        finally:
            queue.stop()
            queue.script.put_nowait([])
            await asyncio.wait_for(loop, 10)
    said = [r.getMessage() for r in caplog.records if r.name == "tests.pull_consumer"]
    assert said == ["pull from queue=q failed (ConnectionError); retrying", "pull from queue=q works again"]
    assert not queue.failing and len(queue.rooms) >= 3


def test_a_delivery_left_unsettled_lapses_once_and_a_settled_one_not_at_all(
    caplog: pytest.LogCaptureFixture,
) -> None:
    queue = ScriptedQueue(prefetch=2)
    lapsed, settled = Held("a", "m-a"), Held("b", "m-b", settlement="ack")
    queue.held.update({"a": lapsed, "b": settled})
    with caplog.at_level(logging.INFO, logger="tests.pull_consumer"):
        queue.leave_to_lapse(settled)
        queue.leave_to_lapse(lapsed)
    assert queue.left_to_lapse == 1 and set(queue.held) == {"b"}
    assert [r.getMessage() for r in caplog.records] == [
        "queue=q message_id=m-a handed back unsettled: it comes back"
    ]
    assert queue.unsettled() == []
