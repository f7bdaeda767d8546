"""In-process broker with peek-lock semantics, for the demo and fast tests.

It behaves like the real brokers where the runtime can tell: a delivery is hidden under a lock
for ``lock_timeout`` seconds and redelivered (delivery count + 1, ``redelivered``) if not settled
by then; ``retry`` re-queues after a delay; ``dead_letter`` moves the message to the queue's DLQ
with its reason; ``release`` re-queues at once, uncounted, and keeps ``redelivered`` only for a
delivery that was itself a redelivery (a suspect stays a suspect); ``renew_lock`` extends the lock;
a settlement that fails (settling after the lock expired raises :class:`LockLost`, like
Service Bus) abandons the delivery, which re-queues it as a redelivery. Brokers are named
(``memory://name``) and shared within one process so a worker and a relay can meet.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from consumer_kit.broker import Consumer, Delivery, DeliveryCallback, build_delivery, hand_over
from consumer_kit.broker.publishing import OutgoingMessage, Publisher, headers_to_send
from consumer_kit.codec import headers as own_headers
from consumer_kit.errors import DeadLetterReason, LockLost
from consumer_kit.resilience.one_shots import OneShots
from consumer_kit.resilience.supervised import Supervised, all_running
from consumer_kit.settings import BrokerSettings, Settings

logger = logging.getLogger("consumer_kit.adapters.memory")

_BROKERS: dict[str, MemoryBroker] = {}


@dataclass
class StoredMessage:
    body: bytes
    message_id: str
    headers: dict[str, Any]
    deliveries: int = 0  # how many times handed out so far (releases excepted)
    sender: str | None = None  # the authenticated producer a test says sent it (Delivery.sender)
    suspect: bool = False  # the last hand-over ended without a settlement (lock expired, abandoned)
    # when the broker first took it: kept in the broker's own memory, so a retry (the same stored
    # message, re-queued) keeps the operation's age (key expiry)
    enqueued_at: dt.datetime = field(default_factory=lambda: dt.datetime.now(dt.UTC))


@dataclass(frozen=True)
class DeadLetter:
    """A dead-lettered message with the reason it was given."""

    message: StoredMessage
    reason: str
    detail: str


@dataclass(frozen=True)
class PublishedRecord:
    """One confirmed publish, with the broker-side time it was accepted (seconds, monotonic)."""

    message: OutgoingMessage
    accepted_at: float


@dataclass
class _Queue:
    name: str
    ready: deque[StoredMessage] = field(default_factory=deque)
    dead: list[DeadLetter] = field(default_factory=list)
    available: asyncio.Event = field(default_factory=asyncio.Event)


class MemoryBroker:
    """A named in-process broker.

    Args:
        lock_timeout: seconds a delivery stays locked before it is redelivered.
    """

    def __init__(self, name: str = "default", *, lock_timeout: float = 30.0) -> None:
        self.name = name
        self.lock_timeout = lock_timeout
        self._queues: dict[str, _Queue] = {}
        self._bindings: dict[str, list[tuple[str, str]]] = {}  # destination -> [(pattern, queue)]
        self.published: list[PublishedRecord] = []
        self._outstanding = 0  # ready + locked + delayed messages
        self._idle = asyncio.Condition()
        self._notifying = OneShots()

    # -- producer side ----------------------------------------------------------------------

    def queue(self, name: str) -> _Queue:
        if name not in self._queues:
            self._queues[name] = _Queue(name)
        return self._queues[name]

    def send(
        self,
        queue: str,
        body: bytes,
        *,
        message_id: str | None = None,
        headers: Mapping[str, Any] | None = None,
        sender: str | None = None,
    ) -> str:
        """Put a message on ``queue``; returns its message id (a new UUID when not given).
        ``sender`` stands for the broker-authenticated producer (``Delivery.sender``)."""
        message = StoredMessage(body, message_id or str(uuid.uuid4()), dict(headers or {}), sender=sender)
        self._outstanding += 1
        self._enqueue(queue, message)
        return message.message_id

    def bind(self, destination: str, queue: str, routing_key: str = "#") -> None:
        """Route publishes to ``destination`` whose routing key matches (``#`` = all, else exact)."""
        self._bindings.setdefault(destination, []).append((routing_key, queue))

    def dead_letters(self, queue: str) -> list[DeadLetter]:
        return list(self.queue(queue).dead)

    def ready_count(self, queue: str) -> int:
        return len(self.queue(queue).ready)

    async def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until no message is ready, locked or waiting for a delayed retry.

        Raises:
            TimeoutError: still busy after ``timeout`` seconds.
        """
        async with asyncio.timeout(timeout):
            async with self._idle:
                await self._idle.wait_for(lambda: self._outstanding == 0)

    # -- internals used by deliveries ---------------------------------------------------------

    def _enqueue(self, queue: str, message: StoredMessage) -> None:
        q = self.queue(queue)
        q.ready.append(message)
        q.available.set()

    def _enqueue_later(self, queue: str, message: StoredMessage, delay: float) -> None:
        if delay <= 0:
            self._enqueue(queue, message)
        else:
            asyncio.get_running_loop().call_later(delay, self._enqueue, queue, message)

    def _finished(self) -> None:
        self._outstanding -= 1
        self._notifying.start(self._notify_idle())

    async def _notify_idle(self) -> None:
        async with self._idle:
            self._idle.notify_all()

    def _route(self, message: OutgoingMessage) -> None:
        self.published.append(PublishedRecord(message, time.monotonic()))
        if not message.destination:  # default exchange: the routing key names a queue
            targets = [message.routing_key]
        else:
            targets = [
                queue for pattern, queue in self._bindings.get(message.destination, [])
                if pattern in ("#", message.routing_key)
            ]
        for queue in targets:
            self.send(queue, message.body, message_id=message.message_id, headers=headers_to_send(message))


class MemoryDelivery(Delivery):
    """A delivery from :class:`MemoryBroker`, locked until settled or until the lock expires."""

    def __init__(
        self,
        broker: MemoryBroker,
        queue: str,
        message: StoredMessage,
        *,
        held: Callable[[], bool] | None = None,
    ) -> None:
        message.deliveries += 1
        reading = own_headers.read(message.headers, message.body)
        super().__init__(
            queue=queue,
            message_id=reading.message_id or message.message_id,
            headers=reading.headers,
            body=message.body,
            sender=message.sender,
            delivery_count=reading.deliveries_before + message.deliveries,
            redelivered=message.suspect or reading.suspect,
            enqueued_at=message.enqueued_at,
        )
        self._broker = broker
        self._message = message
        self._held = held or (lambda: False)
        self._lock_expired = False
        self._lock_timer = self._arm_lock()

    def _arm_lock(self) -> asyncio.TimerHandle:
        return asyncio.get_running_loop().call_later(self._broker.lock_timeout, self._expire_lock)

    def _expire_lock(self) -> None:
        if self.settlement is not None:
            return
        if self._held():  # the consumer still works on it: renewed, as the SDKs' lock renewers do
            self._lock_timer = self._arm_lock()
            return
        logger.info("lock expired queue=%s message_id=%s: redelivering", self.queue, self.message_id)
        self._redeliver()

    def _redeliver(self) -> None:
        """Give the message back as a redelivery (the hand-over ended without a settlement)."""
        self._lock_expired = True
        self._lock_timer.cancel()
        self._message.suspect = True
        self._broker._enqueue(self.queue, self._message)

    def _unlock(self) -> None:
        if self._lock_expired:
            raise LockLost(f"lock on message {self.message_id} expired before settlement")
        self._lock_timer.cancel()

    async def _renew_lock(self) -> bool:
        if self._lock_expired:
            return False
        self._lock_timer.cancel()
        self._lock_timer = self._arm_lock()
        return True

    async def _abandon(self) -> None:
        if not self._lock_expired:  # an expired lock already gave it back
            self._redeliver()

    async def _ack(self) -> None:
        self._unlock()
        self._broker._finished()

    async def _retry(self, delay: float) -> None:
        self._unlock()
        self._message.suspect = False
        self._broker._enqueue_later(self.queue, self._message, delay)

    async def _dead_letter(self, reason: str, detail: str) -> None:
        self._unlock()
        self._broker.queue(self.queue).dead.append(DeadLetter(self._message, reason, detail))
        self._broker._finished()

    async def _release(self) -> None:
        self._unlock()
        self._message.deliveries -= 1  # uncounted; a suspect stays a suspect
        self._broker._enqueue(self.queue, self._message)


class MemoryConsumer(Consumer):
    """Consumes from a :class:`MemoryBroker` with at most ``prefetch`` deliveries in flight;
    :meth:`pause` stops handing out deliveries until :meth:`resume`.

    Args:
        broker: the broker.
        renew_locks: renew the lock of every delivery whose callback is still running (as the
            SQS and Service Bus adapters do), so only a delivery whose callback ended without
            settling it (a crash point fired) is redelivered when its lock expires. ``False``
            lets locks lapse under a long handler (to test lost locks).
    """

    def __init__(self, broker: MemoryBroker, *, renew_locks: bool = True) -> None:
        self.broker = broker
        self.renew_locks = renew_locks
        self._pumps: list[Supervised] = []
        self._inflight: set[asyncio.Task[None]] = set()
        self._running = asyncio.Event()
        self._running.set()

    @property
    def ready(self) -> bool:
        """No pump is down (readiness)."""
        return all_running(self._pumps)

    async def subscribe(self, queue: str, callback: DeliveryCallback, *, prefetch: int) -> None:
        slots = asyncio.Semaphore(prefetch)  # outlives a restart of the pump: slots in use stay used
        self._pumps.append(
            Supervised(f"memory-pump:{queue}", lambda: self._pump(queue, callback, slots)).start()
        )

    async def _pump(self, queue: str, callback: DeliveryCallback, slots: asyncio.Semaphore) -> None:
        q = self.broker.queue(queue)
        while True:
            await slots.acquire()
            running: list[asyncio.Task[None]] = []
            try:
                message = await self._next(q)
            except BaseException:
                slots.release()
                raise
            delivery = build_delivery(
                functools.partial(MemoryDelivery, self.broker, queue, message, held=self._held(running)),
                unbuildable=functools.partial(self._dead_letter_raw, queue, message),
                what=f"queue={queue} message_id={message.message_id}",
            )
            if delivery is None:
                slots.release()
                continue
            task: asyncio.Task[None] = asyncio.ensure_future(hand_over(delivery, callback, wanted=True))
            running.append(task)
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)
            task.add_done_callback(lambda _t: slots.release())

    def _held(self, running: list[asyncio.Task[None]]) -> Callable[[], bool]:
        """Whether a delivery's callback (the task in ``running``) still works on it."""
        return lambda: self.renew_locks and bool(running) and not running[0].done()

    async def _next(self, q: _Queue) -> StoredMessage:
        """The next ready message of ``q``, waiting while paused or empty."""
        while True:
            await self._running.wait()
            if q.ready:  # no await between this check and the pop: a pause cannot slip in
                return q.ready.popleft()
            q.available.clear()
            await q.available.wait()

    def _dead_letter_raw(self, queue: str, message: StoredMessage, detail: str) -> None:
        self.broker.queue(queue).dead.append(DeadLetter(message, DeadLetterReason.INVALID_HEADER.value, detail))
        self.broker._finished()

    async def declare(self, queue: str) -> list[str]:
        """Create ``queue`` (and its dead-letter list) on the in-process broker."""
        self.broker.queue(queue)
        return [queue]

    async def pause(self) -> None:
        self._running.clear()

    async def resume(self) -> None:
        self._running.set()

    async def stop_consuming(self) -> None:
        await asyncio.gather(*(pump.stop() for pump in self._pumps))
        self._pumps.clear()

    async def close(self) -> None:
        await self.stop_consuming()


class MemoryPublisher(Publisher):
    """Publishes into a :class:`MemoryBroker`; every publish is confirmed at once."""

    def __init__(self, broker: MemoryBroker) -> None:
        self.broker = broker

    async def connect(self) -> None:
        """Nothing to open: the broker lives in this process."""

    async def declare(self, destination: str) -> None:
        """Nothing to create: a destination exists once something binds to it."""

    async def publish(self, message: OutgoingMessage) -> None:
        self.broker._route(message)

    async def close(self) -> None:
        return None


def get_broker(url: str = "memory://", *, lock_timeout: float | None = None) -> MemoryBroker:
    """The process-wide broker named by ``memory://<name>`` (``default`` when no name)."""
    name = urlparse(url).netloc or "default"
    broker = _BROKERS.get(name)
    if broker is None:
        broker = _BROKERS[name] = MemoryBroker(name, lock_timeout=lock_timeout or 30.0)
    elif lock_timeout is not None:
        broker.lock_timeout = lock_timeout
    return broker


def consumer_from_settings(settings: Settings) -> MemoryConsumer:
    """Entry point ``consumer_kit.broker.registry: memory``."""
    return MemoryConsumer(get_broker(settings.broker_url))


def publisher_from_settings(settings: BrokerSettings) -> MemoryPublisher:
    """Entry point ``consumer_kit.broker.registry: memory``."""
    return MemoryPublisher(get_broker(settings.broker_url))

