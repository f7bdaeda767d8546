"""What the contract suite needs from each broker, beyond the adapter itself.

One small driver per broker (``memory_driver``, ``rabbitmq_driver``, ``sqs_driver``) builds the
broker URL and consumer a case asks for, sends commands, reads the dead-letter queue and measures
the work queue. Adding a broker to the suite is one driver module and one entry in
``tests/adapters/contract/conftest.py``'s ``DRIVERS``.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from consumer_kit.broker import Consumer, DeadLetterQueues
from consumer_kit.broker.publishing import Publisher
from consumer_kit.settings import Settings


@dataclass(frozen=True)
class DeadLetter:
    """One message read from a dead-letter queue.

    Attributes:
        message_id: the message id consumer-kit saw.
        body: the body as sent.
        reason: consumer-kit's reason, or the broker's own where the broker moved the message.
        detail: consumer-kit's detail ("" where none).
        copied: consumer-kit sent this copy (``False``: the broker moved the original).
        size: bytes the broker counts for it against its limit (0 where it has none).
    """

    message_id: str | None
    body: bytes
    reason: str
    detail: str
    copied: bool
    size: int = 0


class Driver(abc.ABC):
    """One broker in the contract suite, around one work queue (``self.queue``).

    Attributes:
        name: the pytest id.
        lock_lapses: an unsettled delivery comes back by itself once its lock lapses (memory,
            SQS); ``False``: only when the consumer's connection goes (RabbitMQ).
        has_lock: the broker has a peek-lock that a long handler can outlive.
        size_limit: the broker limits message size (``False``: memory).
        lock_seconds: the short lock (seconds) of ``short_lock`` consumers: the lock the renewal
            case renews. Where renewal is a round trip to the broker it must be long enough that
            a loaded machine never outruns the renewal, due at about half of it. The cases that
            need a lock to lapse make that explicit (:meth:`lapse_locks`) instead of waiting for
            a short one: the redelivery would have to finish before its own short lock lapsed.
    """

    name: str
    lock_lapses: bool = True
    has_lock: bool = True
    size_limit: bool = True
    lock_seconds: float = 3.0

    def __init__(self, queue: str) -> None:
        self.queue = queue

    async def open(self) -> None:  # noqa: B027 - optional: create the queues the case needs
        """Create the work queue and its dead-letter queue where the broker needs it."""

    @abc.abstractmethod
    async def consumer(
        self, settings: Settings, *, short_lock: bool = False, renewal: bool = True, copy_limit: int | None = None
    ) -> Consumer:
        """The adapter's consumer for ``settings``; ``short_lock``: a peek-lock of
        ``lock_seconds``; ``renewal=False``: nothing extends it; ``copy_limit``: bytes a copy
        (retry, dead letter) may have."""

    @abc.abstractmethod
    async def send(self, body: bytes, headers: dict[str, str] | None = None, message_id: str | None = None) -> str:
        """Put a command on the work queue; returns its message id."""

    @abc.abstractmethod
    async def dead_letters(self, expected: int, timeout: float = 15.0) -> list[DeadLetter]:
        """The first ``expected`` messages of the dead-letter queue (waits for them, bounded)."""

    @abc.abstractmethod
    async def depth(self) -> int:
        """Messages on the work queue not yet settled (ready, delayed or held)."""

    def dead_letter_queues(self, settings: Settings) -> DeadLetterQueues:
        """The adapter's :class:`DeadLetterQueues` for ``settings`` (``consumer-kit dlq``); the
        base class itself where the adapter provides none (every method: "not supported")."""
        from consumer_kit.broker.registry import open_dead_letters

        return open_dead_letters(settings)

    async def lapse_locks(self, consumer: Consumer) -> None:
        """Make the lock of every delivery ``consumer`` holds unsettled lapse now, on the broker's
        side and the adapter's, as its time running out would (the message comes back as a
        redelivery). Drivers whose broker has no lock to lapse (``lock_lapses = False``) need not
        provide it."""
        raise NotImplementedError(f"{self.name}: no lock to lapse")

    async def outlive_lock(self, consumer: Consumer) -> None:
        """Called by a handler: return once the delivery's lock is gone (by default: made to lapse
        with :meth:`lapse_locks`)."""
        await self.lapse_locks(consumer)

    @abc.abstractmethod
    async def size_limited(self, limit: int) -> tuple[Publisher, str, Callable[[], Awaitable[int]]]:
        """A publisher whose destination refuses messages over ``limit`` bytes: ``(publisher,
        queue name to publish to with destination "", count of messages on that queue)``."""

    async def close(self) -> None:  # noqa: B027 - optional
        """Delete what :meth:`open` created."""

    def __repr__(self) -> str:
        return self.name


async def wait_until(predicate: Callable[[], Awaitable[bool]], timeout: float = 15.0) -> None:
    """Poll ``predicate`` until true (a bounded wait on a condition).

    Raises:
        TimeoutError: still false after ``timeout`` seconds.
    """
    async with asyncio.timeout(timeout):
        while not await predicate():
            await asyncio.sleep(0.05)


def as_text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return "" if value is None else str(value)
