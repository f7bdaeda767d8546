"""The memory broker in the contract suite: one named in-process broker per case."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable

from consumer_kit.adapters.memory import MemoryBroker, MemoryConsumer, MemoryDelivery, get_broker
from consumer_kit.broker import Consumer, Delivery, DeliveryCallback
from consumer_kit.broker.publishing import Publisher
from consumer_kit.settings import Settings
from tests.adapters.contract.driver import DeadLetter, Driver, wait_until


class TrackingConsumer(MemoryConsumer):
    """A memory consumer that keeps its deliveries, so that the driver can make their locks lapse."""

    def __init__(self, broker: MemoryBroker, *, renew_locks: bool = True) -> None:
        super().__init__(broker, renew_locks=renew_locks)
        self.deliveries: list[MemoryDelivery] = []

    async def subscribe(self, queue: str, callback: DeliveryCallback, *, prefetch: int) -> None:
        async def keeping(delivery: Delivery) -> None:
            assert isinstance(delivery, MemoryDelivery)
            self.deliveries.append(delivery)
            await callback(delivery)

        await super().subscribe(queue, keeping, prefetch=prefetch)


class MemoryDriver(Driver):
    name = "memory"
    size_limit = False  # the memory adapter has no size limit (docs/reference/adapters.md)
    lock_seconds = 1.0  # its lock and its renewal are timers of the test's own event loop: never outrun

    def __init__(self, queue: str) -> None:
        super().__init__(queue)
        self.url = f"memory://contract-{uuid.uuid4().hex[:8]}"
        self.broker: MemoryBroker = get_broker(self.url, lock_timeout=30.0)

    async def consumer(
        self, settings: Settings, *, short_lock: bool = False, renewal: bool = True, copy_limit: int | None = None
    ) -> Consumer:
        self.broker.lock_timeout = self.lock_seconds if short_lock else 30.0
        return TrackingConsumer(self.broker, renew_locks=renewal)

    async def lapse_locks(self, consumer: Consumer) -> None:
        assert isinstance(consumer, TrackingConsumer)
        for delivery in consumer.deliveries:
            if delivery.settlement is None and not delivery._lock_expired:
                delivery._redeliver()  # what the lock timer does when it runs out

    async def send(self, body: bytes, headers: dict[str, str] | None = None, message_id: str | None = None) -> str:
        return self.broker.send(self.queue, body, message_id=message_id, headers=headers)

    async def dead_letters(self, expected: int, timeout: float = 15.0) -> list[DeadLetter]:
        async def arrived() -> bool:
            return len(self.broker.dead_letters(self.queue)) >= expected

        await wait_until(arrived, timeout)
        return [
            DeadLetter(d.message.message_id, d.message.body, d.reason, d.detail, copied=True)
            for d in self.broker.dead_letters(self.queue)[:expected]
        ]

    async def depth(self) -> int:
        # ready, locked and delayed messages of this broker (one queue per case)
        return self.broker._outstanding

    async def size_limited(self, limit: int) -> tuple[Publisher, str, Callable[[], Awaitable[int]]]:
        raise NotImplementedError("the memory broker has no size limit")
