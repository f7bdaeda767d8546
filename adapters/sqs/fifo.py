"""FIFO message groups as lanes: one group's messages one at a time, in order; groups in parallel.

One ``ReceiveMessage`` on a FIFO queue may return several messages of the same group (in group
order); SQS itself hands out no further message of a group while one of it is in flight. Each
group gets a *lane*: a task that runs the group's deliveries one after the other, so no two
messages of a group are ever in flight in this worker at once, while other groups' lanes run
concurrently.

A retry *held* in this process (:mod:`consumer_kit.adapters.sqs.delivery`, "Held retries": FIFO with
the heartbeat on) runs again first: the lane waits the retry's delay, then runs the delivery's
successor, its followers still held behind it, so no receive is spent on anyone.

Any other delivery that does not end in ``ack`` or ``dead_letter`` (given back to SQS, released,
its settlement lost) must come back before anything after it: the lane gives the rest of its
deliveries back (uncounted) instead of running them, and SQS hands the group out again from that
message on.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from consumer_kit.broker import Settlement
from consumer_kit.resilience.one_shots import OneShots

if TYPE_CHECKING:
    from .delivery import SQSDelivery

logger = logging.getLogger(__name__)

_DONE = (Settlement.ACK, Settlement.DEAD_LETTER)


class GroupLanes:
    """Lanes of one FIFO subscription (module docstring).

    Args:
        run: hands one delivery to the worker and returns once it is settled.
        give_back: releases a delivery that must not run before the one ahead of it.
    """

    def __init__(
        self,
        run: Callable[[SQSDelivery], Awaitable[None]],
        give_back: Callable[[SQSDelivery], Awaitable[None]],
    ) -> None:
        self._run = run
        self._give_back = give_back
        self._lanes: dict[str, deque[SQSDelivery]] = {}
        self._tasks = OneShots()

    def submit(self, delivery: SQSDelivery) -> None:
        """Queue ``delivery`` behind the earlier deliveries of its group."""
        group = delivery.partition_key or ""
        lane = self._lanes.get(group)
        if lane is not None:
            lane.append(delivery)
            return
        self._lanes[group] = deque([delivery])
        self._tasks.start(self._drive(group), name=f"consumer-kit sqs lane {group}")

    @property
    def tasks(self) -> OneShots:
        """The running lanes (the consumer cancels them on close)."""
        return self._tasks

    async def _drive(self, group: str) -> None:
        lane = self._lanes[group]
        try:
            while lane:
                delivery = lane.popleft()
                await self._run(delivery)
                successor = delivery.successor
                if successor is not None and not delivery.lost and successor.settlement is None:
                    await asyncio.sleep(delivery.retry_delay)  # cancelled by close(): it gives back
                    lane.appendleft(successor)
                    continue
                if delivery.settlement not in _DONE or delivery.lost:
                    behind = list(lane)
                    lane.clear()
                    if behind:
                        logger.debug(
                            "group %s: message_id=%s was given back, so %s later message(s) go back too",
                            group, delivery.message_id, len(behind),
                        )
                    for later in behind:
                        await self._give_back(later)
        finally:
            if self._lanes.get(group) is lane:
                del self._lanes[group]
